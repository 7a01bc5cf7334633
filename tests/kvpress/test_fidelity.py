"""Fidelity badges: kvzoo's ports keep exactly the rows of kvpress's presses, layer by layer and head by head.

kvzoo's runtime (``TieredCache``, the context compressed at its end; decode steps through kvzoo's attention) against
kvpress 0.5.5's presses in kvpress's hook, on SmolLM2-135M (real weights, 2,000 tokens of text) and a tiny random
Llama (GQA, 3 layers, 400 random ids). Ratio r is kvpress's ``compression_ratio = 1 - 1/r``.

=============  =========================================  ==========================================================
kvzoo port     kvpress twin                               checked here (exact rows unless said)
=============  =========================================  ==========================================================
full           none needed (no press: every row stays)    ``tests/kvpress/test_interop.py`` (kept length)
streaming_llm  ``StreamingLLMPress(n_sink=4)``            prompt's end: ratios 2, 4, 8 (tiny), 4 (SmolLM2).
               ``DecodingPress(StreamingLLMPress(4),      decode: 37 steps after the prompt at ratio 4 (tiny), every
               compression_interval, target_size)``       step (``schedule="step"``, interval 1) and per block of 8
                                                          (``"block"``, interval 8) -- exact only with kvpress's kept
                                                          rows put back in position order; as released, kvpress keeps
                                                          them in topk order and then drops other rows (finding below)
snapkv         ``SnapKVPress(window_size, kernel_size)``  kvpress's settings (window 64, kernel 5, avgpool, mean):
                                                          ratios 2, 4 (tiny), 4, 8 (SmolLM2). kvzoo's paper defaults
                                                          (window 32, kernel 7) with ``pooling="avgpool"``: ratios 2,
                                                          4, 8 (tiny), 4 (SmolLM2). Max pooling (the paper's): no twin,
                                                          SnapKVPress pools by average only (the SnapKV reference's
                                                          rule restated: ``tests/test_fidelity.py``)
chunkkv        ``ChunkKVPress(SnapKVPress(...),           kvpress's settings (chunk 20, window 64, kernel 5):
               chunk_length)``                            ratios 2, 4 (tiny), 4, 8 (SmolLM2; at 8 kvpress keeps 12
                                                          whole chunks, 240 rows, so kvzoo gets ``budget=240``).
                                                          kvzoo's paper defaults (chunk 10, window 32, kernel 1) with
                                                          ``reuse=1, tiling="kvpress", aggregate="mean"``: ratios 2,
                                                          4, 8 (tiny), 4 (SmolLM2). ``reuse=2`` (the paper's): no
                                                          twin; its scoring layers keep kvpress's rows of that layer
                                                          and its reusing layers the layer before's (tiny, 2, 4, 8).
                                                          ``tiling="paper"`` (window kept apart, sum): no twin
h2o            none                                       kvpress 0.5.5 has no H2O press; ``ObservedAttentionPress``
                                                          ("related to H2O") scores one forward's attention with no
                                                          accumulation across steps and no recent window. Checked
                                                          against the H2O reference's rule restated
                                                          (``tests/test_fidelity.py``)
quest          none                                       kvpress has no page retrieval (its presses evict)
vestige        none                                       kvzoo's own policy; no reference code anywhere
=============  =========================================  ==========================================================

Not comparable, so not tested: SnapKV and ChunkKV at ratio 8 on the tiny Llama with kvpress's 64-query window (the
budget, 50 rows, is below the window: kvzoo refuses it, kvpress keeps 50 window rows).

Finding (kvpress, not kvzoo): kvpress 0.5.5's ``ScorerPress.compress`` stores the kept rows in ``topk`` order
(NVIDIA/kvpress#173), and ``StreamingLLMPress`` prunes by cache index, so ``DecodingPress(StreamingLLMPress)`` does
not keep the sinks and the latest rows: on the tiny Llama after 37 steps at ratio 4, 27 of 100 rows per layer and
head differ from StreamingLLM's (interval 1; sink 1 lost, rows from 304 on kept where StreamingLLM keeps 341 on),
21 of 105 at interval 8 (sinks 0 and 3 lost). ``test_kvpress_decoding_press_as_released_drops_other_rows_than_
streaming_llm`` pins it; with the order restored the rows are StreamingLLM's exactly.
"""

from __future__ import annotations

import kvpress
import pytest
import torch

from kvzoo import registry

RATIO = 4  # kvzoo: keep 1/4; kvpress: compression_ratio 0.75


def _cr(ratio: int) -> float:
    """kvpress's ``compression_ratio`` for kvzoo's ``ratio``: 1 - 1/ratio (0.5, 0.75, 0.875: exact in binary)."""
    return 1 - 1 / ratio


# kvzoo's port with kvpress's parameters, and kvpress's press, at a ratio (and, for ChunkKV, kvzoo's budget when
# kvpress's whole chunks are not the ratio's budget: kvpress keeps int(chunks * (1 - compression_ratio)) chunks)
PAIRS = {
    "streaming_llm": (
        lambda r, budget=None: registry.get("streaming_llm", ratio=r, sinks=4),
        lambda r: kvpress.StreamingLLMPress(compression_ratio=_cr(r), n_sink=4),
    ),
    "snapkv": (
        lambda r, budget=None: registry.get("snapkv", ratio=r, window=64, kernel_size=5, pooling="avgpool",
                                            aggregate="mean"),
        lambda r: kvpress.SnapKVPress(compression_ratio=_cr(r), window_size=64, kernel_size=5),
    ),
    "chunkkv": (
        lambda r, budget=None: registry.get("chunkkv", **({"budget": budget} if budget else {"ratio": r}), window=64,
                                            kernel_size=5, pooling="avgpool", aggregate="mean", chunk_size=20, reuse=1,
                                            tiling="kvpress"),
        lambda r: kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=_cr(r), window_size=64,
                                                                 kernel_size=5), chunk_length=20),
    ),
}


def _same_rows(zoo: list[torch.Tensor], press: list[torch.Tensor]) -> list[str]:
    """Where the two disagree: 'layer l head g: n rows differ', empty when every layer and head matches."""
    out = []
    for layer, (a, b) in enumerate(zip(zoo, press)):
        assert a.shape == b.shape, f"layer {layer}: kvzoo keeps {tuple(a.shape)}, kvpress {tuple(b.shape)}"
        for g in range(a.shape[1]):
            differ = len(set(a[0, g].tolist()) ^ set(b[0, g].tolist())) // 2
            if differ:
                out.append(f"layer {layer} head {g}: {differ} rows differ")
    return out


# (port, ratio, kvzoo's budget when kvpress's whole chunks are not the ratio's): SmolLM2 at 4, and at 8 for the two
# ports whose rows depend on the text (StreamingLLM's rows are the same on any model: the tiny Llama checks its ratios)
SMOL_CASES = [("streaming_llm", 4, None), ("snapkv", 4, None), ("chunkkv", 4, None), ("snapkv", 8, None),
              ("chunkkv", 8, 240)]  # 100 chunks of 20 at 0.875: kvpress keeps int(12.5) = 12 chunks, 240 rows, not 250
# the tiny Llama's 400 rows at 2 and 4; at 8 the budget (50 rows) is below kvpress's 64-query window, which SnapKV
# and ChunkKV keep whole: kvzoo refuses such a budget (ValueError), kvpress keeps 50 window rows -- not comparable
TINY_CASES = [(port, r) for r in (2, 4) for port in PAIRS] + [("streaming_llm", 8)]


@pytest.mark.parametrize(("port", "ratio", "budget"), SMOL_CASES)
def test_port_keeps_kvpress_rows_on_smollm2(port, ratio, budget, smol, smol_ids, kv):
    model, _ = smol
    policy, press = PAIRS[port]
    zoo, ref = kv.zoo_rows(model, smol_ids, policy(ratio, budget)), kv.press_rows(model, smol_ids, press(ratio))
    assert len(zoo) == 30 and zoo[0].shape == (1, 3, budget or 2000 // ratio)  # every layer and KV head
    assert _same_rows(zoo, ref) == []


@pytest.mark.parametrize(("port", "ratio"), TINY_CASES)
def test_port_keeps_kvpress_rows_on_a_tiny_llama(port, ratio, tiny, tiny_ids, kv):
    policy, press = PAIRS[port]
    zoo, ref = kv.zoo_rows(tiny, tiny_ids, policy(ratio)), kv.press_rows(tiny, tiny_ids, press(ratio))
    assert zoo[0].shape == (1, 2, 400 // ratio)
    assert _same_rows(zoo, ref) == []


@pytest.mark.parametrize("port", ["snapkv", "chunkkv"])
def test_paper_defaults_differ_from_kvpress_as_the_docstrings_say(port, tiny, tiny_ids, kv):
    """kvzoo's defaults (the papers') keep other rows than kvpress's defaults; each differing parameter is named in
    the port's docstring together with kvpress's value."""
    _, press = PAIRS[port]
    zoo, ref = kv.zoo_rows(tiny, tiny_ids, registry.get(port, ratio=RATIO)), kv.press_rows(tiny, tiny_ids, press(RATIO))
    assert _same_rows(zoo, ref) != []
    doc = type(registry.get(port, ratio=RATIO)).__doc__
    said = {"snapkv": ("kernel_size=5", "avgpool", "64-query window", "kvpress"),
            "chunkkv": ("chunk_length=20", "index reuse", "kvpress", "kernel_size")}[port]
    assert all(phrase in doc for phrase in said), said


# kvzoo's paper defaults, with only the fields kvpress's press cannot take changed, against that press configured to
# the same settings. SnapKV: window 32 and kernel 7 are kvzoo's defaults; kvpress's SnapKVPress pools by average only
# (F.avg_pool1d in its score), so the paper's max pooling has no twin there. ChunkKV: chunk 10, window 32 and no
# pooling (kernel 1) are kvzoo's defaults; kvpress's ChunkKVPress has no index reuse (reuse=1 here; the reuse test
# below checks reuse=2 layer by layer), tiles every row, the window included (tiling="kvpress"), and averages a KV
# group's query heads (aggregate="mean"; kvzoo's default "sum" ranks rows alike but scales the window's +1 margin).
PAPER = {
    "snapkv": (
        {"pooling": "avgpool"},
        lambda r: kvpress.SnapKVPress(compression_ratio=_cr(r), window_size=32, kernel_size=7),
    ),
    "chunkkv": (
        {"reuse": 1, "tiling": "kvpress", "aggregate": "mean"},
        lambda r: kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=_cr(r), window_size=32,
                                                                 kernel_size=1), chunk_length=10),
    ),
}


def _paper_policy(port: str, ratio: int, **changed):
    """kvzoo's port at its defaults but for ``changed`` (checked: every other field is the default)."""
    policy = registry.get(port, ratio=ratio, **changed)
    default = registry.get(port, ratio=ratio).config()
    assert {k for k, v in policy.config().items() if default.get(k) != v} == {k for k, v in changed.items()
                                                                              if default[k] != v}
    return policy


@pytest.mark.parametrize("ratio", [2, 4, 8])
@pytest.mark.parametrize("port", list(PAPER))
def test_paper_defaults_keep_kvpress_rows_at_the_same_settings_on_a_tiny_llama(port, ratio, tiny, tiny_ids, kv):
    changed, press = PAPER[port]
    zoo = kv.zoo_rows(tiny, tiny_ids, _paper_policy(port, ratio, **changed))
    ref = kv.press_rows(tiny, tiny_ids, press(ratio))
    assert zoo[0].shape == (1, 2, 400 // ratio)  # ChunkKV: 40 chunks of 10, int(40 / ratio) whole chunks kept
    assert _same_rows(zoo, ref) == []


@pytest.mark.parametrize("port", list(PAPER))
def test_paper_defaults_keep_kvpress_rows_at_the_same_settings_on_smollm2(port, smol, smol_ids, kv):
    model, _ = smol
    changed, press = PAPER[port]
    zoo = kv.zoo_rows(model, smol_ids, _paper_policy(port, RATIO, **changed))
    ref = kv.press_rows(model, smol_ids, press(RATIO))
    assert len(zoo) == 30 and zoo[0].shape == (1, 3, 500)
    assert _same_rows(zoo, ref) == []


@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_chunkkv_index_reuse_keeps_the_scoring_layers_kvpress_rows(ratio, tiny, tiny_ids, kv):
    """The paper's layer-wise index reuse (``reuse=2``) has no kvpress twin: ChunkKVPress selects in every layer.
    What can be checked against it: kvzoo's scoring layers (0, 2, ...) keep kvpress's rows of that layer, and each
    reusing layer keeps its group's first layer's rows (kvpress's rows of the layer before it). The prefill's hidden
    states do not depend on the compression (both compress after the whole forward's attention), so kvpress's
    layer l is the rows a scoring layer l would keep."""
    changed, press = PAPER["chunkkv"]
    zoo = kv.zoo_rows(tiny, tiny_ids, _paper_policy("chunkkv", ratio, **{**changed, "reuse": 2}))
    ref = kv.press_rows(tiny, tiny_ids, press(ratio))
    assert len(zoo) >= 2
    assert _same_rows(zoo, [ref[layer - layer % 2] for layer in range(len(ref))]) == []
    assert _same_rows(zoo[1::2], ref[1::2]) != []  # the reusing layers keep other rows than their own selection


# Decode-time eviction. kvpress's DecodingPress compresses the cache during decoding with a ScorerPress, every
# ``compression_interval`` steps, back to ``target_size`` rows: with StreamingLLMPress (n_sink=4) it is meant to keep
# the sinks and the latest rows, StreamingLLM's rolling cache -- kvzoo's schedule="step" at an interval of 1 (one in,
# one out) and schedule="block" at an interval of block_size. StreamingLLMPress ranks rows by cache index, and
# kvpress 0.5.5 stores the kept rows in topk order (NVIDIA/kvpress#173): the twin holds only with the kept rows put
# back in position order (``position_order=True``); as released it drops other rows (the second test).
# H2O has no twin: kvpress 0.5.5 has no H2O press; its ObservedAttentionPress ("related to H2O") scores a forward's
# own attention, mean per query, with no accumulation across steps and no recent window, so under DecodingPress it
# would rank rows by the last step's attention alone.
DECODE_STEPS = 37  # not a multiple of the block: the cache ends 37 % 8 = 5 rows above the budget under "block"
SCHEDULES = [("step", 1), ("block", 8)]  # kvzoo's schedule, and DecodingPress's compression_interval


def _streaming_decode(schedule: str, interval: int, model, ids, kv, position_order: bool):
    steps = torch.randint(0, 256, (1, DECODE_STEPS), generator=torch.Generator().manual_seed(1))
    budget = ids.shape[1] // RATIO
    zoo = kv.zoo_decode_rows(model, ids, steps, registry.get("streaming_llm", ratio=RATIO, sinks=4, schedule=schedule,
                                                             block_size=interval))
    ref = kv.press_decode_rows(
        model, ids, steps, kvpress.StreamingLLMPress(compression_ratio=_cr(RATIO), n_sink=4),
        kvpress.DecodingPress(base_press=kvpress.StreamingLLMPress(n_sink=4), compression_interval=interval,
                              target_size=budget), position_order=position_order)
    assert ref.dropped == [DECODE_STEPS // interval] * len(ref.rows)  # kvpress evicted at every step / every block
    held = budget + DECODE_STEPS % interval
    last = ids.shape[1] + DECODE_STEPS
    rule = [0, 1, 2, 3, *range(last - held + 4, last)]  # the sinks and the latest rows
    assert all(layer.shape == (1, 2, held) and (layer == torch.tensor(rule)).all() for layer in zoo)
    return zoo, ref


@pytest.mark.parametrize(("schedule", "interval"), SCHEDULES)
def test_streaming_llm_decode_keeps_kvpress_decoding_press_rows(schedule, interval, tiny, tiny_ids, kv):
    """kvzoo's rolling cache after 37 decode steps against DecodingPress(StreamingLLMPress), the cache kept in
    position order (kvpress's press code unchanged; only the order its cache stores the kept rows in)."""
    zoo, ref = _streaming_decode(schedule, interval, tiny, tiny_ids, kv, position_order=True)
    assert _same_rows(zoo, ref.rows) == []


@pytest.mark.parametrize(("schedule", "interval"), SCHEDULES)
def test_kvpress_decoding_press_as_released_drops_other_rows_than_streaming_llm(schedule, interval, tiny, tiny_ids,
                                                                                 kv):
    """kvpress 0.5.5 as released: its cache holds the kept rows in topk order, so StreamingLLMPress, which prunes the
    rows right after the sinks by cache index, prunes rows that are not the oldest (sinks included) -- a kvpress
    finding (NVIDIA/kvpress#173), not kvzoo's. Where this torch's topk returns tied rows in position order, kvpress's
    cache stays in order and the rows are StreamingLLM's."""
    zoo, ref = _streaming_decode(schedule, interval, tiny, tiny_ids, kv, position_order=False)
    if not ref.scrambled:
        assert _same_rows(zoo, ref.rows) == []
        pytest.skip("this torch's topk kept tied rows in position order: kvpress's cache stayed in order")
    assert _same_rows(zoo, ref.rows) != []
    assert any(not set(range(4)) <= set(layer[0, g].tolist()) for layer in ref.rows for g in range(2))  # a sink lost
