"""Both directions of the interop, in kvpress's environment.

* kvzoo policies as presses (``to_press``): kvpress's own pipeline runs every kvzoo selector on SmolLM2 with the
  question after compression, and each layer then holds what kvzoo's runtime holds at the same ratio (Quest: the
  budget, where the runtime attends to the current page and fetches the rest every step); a port given
  kvpress's parameters keeps kvpress's rows through ``to_press`` too; kvpress's wrappers take a ``to_press`` press.
* kvpress presses as kvzoo policies (``kvpress:<Press>``): inside kvzoo's runtime a press keeps the rows it keeps
  inside kvpress's hook, layer by layer and head by head.
"""

from __future__ import annotations

import kvpress
import pytest
import torch
from transformers import DynamicCache, pipeline

from kvzoo import registry
from kvzoo.integrations.kvpress import KvpressPolicy, to_press
from kvzoo.integrations.kvpress_presses import KvzooPress, KvzooScorerPress

from .test_fidelity import PAIRS, _same_rows

RATIO = 4  # kvzoo: keep 1/4; kvpress: compression_ratio 0.75

# every kvzoo selector as a prefill press: the per-step evictors at the context's end, the retrieving policies without
# their retriever (to_press refuses both otherwise: test_to_press_refuses_what_a_prefill_press_cannot_do)
SELECTORS = {
    "full": (lambda: registry.get("full"), {}),
    "streaming_llm": (lambda: registry.get("streaming_llm", ratio=RATIO), {"prefill_only": True}),
    "snapkv": (lambda: registry.get("snapkv", ratio=RATIO), {}),
    "h2o": (lambda: registry.get("h2o", ratio=RATIO), {"prefill_only": True}),
    "chunkkv": (lambda: registry.get("chunkkv", ratio=RATIO), {}),
    # Quest's selector without its retriever keeps the current page; its dense first layers would give layers of
    # different lengths, which kvpress's pipeline cannot attend over (to_press refuses them)
    "quest": (lambda: registry.get("quest", ratio=RATIO, retriever=None, dense_layers=0), {"prefill_only": True}),
    "vestige": (lambda: registry.get("vestige", ratio=RATIO, retriever=None), {}),
}

QUESTION = "Who is the story about?"


@pytest.fixture(scope="module")
def pipe(smol):
    model, tokenizer = smol
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def context(smol) -> str:
    """About 600 tokens of public-domain text."""
    from kvzoo.haystacks import book_text_sentences

    _, tokenizer = smol
    ids = tokenizer(" ".join(book_text_sentences()), add_special_tokens=False).input_ids[:600]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("name", list(SELECTORS))
def test_kvpress_pipeline_runs_every_kvzoo_selector(name, pipe, context, smol, kv):
    model, _ = smol
    make, options = SELECTORS[name]
    press = to_press(make(), **options)
    assert isinstance(press, KvzooScorerPress) == (name != "full") and isinstance(press, KvzooPress)
    cache = DynamicCache()
    answer = pipe(context, question=QUESTION, press=press, cache=cache, max_new_tokens=5)["answer"]
    assert isinstance(answer, str) and answer
    # the pipeline drops the question and the answer from the cache: what is left is the compressed context
    context_ids = pipe.preprocess(context, questions=[QUESTION], answer_prefix="",
                                  max_context_length=10**9)["context_ids"]
    n = context_ids.shape[1]
    kept_by_press = [layer.keys.shape[2] for layer in cache.layers]
    kept_by_kvzoo = [slots.shape[2] for slots in kv.zoo_rows(model, context_ids, make())]
    assert len(kept_by_press) == 30
    if name == "quest":  # kvzoo's runtime (rule="eval") attends to the sinks (none here) and fetches pages every
        assert kept_by_kvzoo == [0] * 30  # step from the index; the press keeps the budget (test_press_fixes.py)
        assert kept_by_press == [n // RATIO] * 30
    else:
        assert kept_by_press == kept_by_kvzoo == [n if name == "full" else n // RATIO] * 30


@pytest.mark.parametrize("port", ["streaming_llm", "snapkv"])
def test_to_press_of_a_port_keeps_kvpress_rows(port, tiny, tiny_ids, kv):
    """A port given kvpress's parameters keeps kvpress's rows in kvpress's hook too, not only in kvzoo's runtime."""
    policy, press = PAIRS[port]
    ours = kv.press_rows(tiny, tiny_ids, to_press(policy(RATIO), prefill_only=True))
    assert _same_rows(ours, kv.press_rows(tiny, tiny_ids, press(RATIO))) == []
    assert _same_rows(ours, kv.zoo_rows(tiny, tiny_ids, policy(RATIO))) == []


def test_kvpress_chunkkv_wraps_to_press_as_it_wraps_snapkv(tiny, tiny_ids, kv):
    """``ChunkKVPress(press=to_press(snapkv))`` keeps the rows of ``ChunkKVPress(press=SnapKVPress)``: the forced
    window rows score above every other row, as SnapKVPress pads its window."""
    snapkv, _ = PAIRS["snapkv"]
    ours = kvpress.ChunkKVPress(press=to_press(snapkv(RATIO)), chunk_length=20)
    theirs = kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=0.75, window_size=64, kernel_size=5),
                                  chunk_length=20)
    assert _same_rows(kv.press_rows(tiny, tiny_ids, ours), kv.press_rows(tiny, tiny_ids, theirs)) == []


def test_kvpress_wrappers_take_a_to_press_press(tiny, tiny_ids, kv):
    n = tiny_ids.shape[1]
    ratios = [0.5, 0.75, 0.25][: tiny.config.num_hidden_layers]
    assert len(ratios) == tiny.config.num_hidden_layers
    per_layer = kvpress.PerLayerCompressionPress(press=to_press(registry.get("snapkv", ratio=RATIO)),
                                                 compression_ratios=ratios)
    cache = kv.cache(tiny, tiny_ids, per_layer)
    assert [layer.keys.shape[2] for layer in cache.layers] == [int(n * (1 - c)) for c in ratios]
    rerotated = kvpress.KeyRerotationPress(press=to_press(registry.get("snapkv", ratio=RATIO)))
    cache = kv.cache(tiny, tiny_ids, rerotated)
    assert [layer.keys.shape[2] for layer in cache.layers] == [n // RATIO] * len(cache.layers)


def test_to_press_refuses_what_a_prefill_press_cannot_do():
    with pytest.raises(ValueError, match="retriever 'quest'"):
        to_press(registry.get("quest", ratio=RATIO))
    with pytest.raises(ValueError, match="schedule 'step'.*prefill_only=True"):
        to_press(registry.get("h2o", ratio=RATIO))
    with pytest.raises(ValueError, match="dense_layers=2.*dense_layers=0"):
        to_press(registry.get("quest", ratio=RATIO, retriever=None), prefill_only=True)
    with pytest.raises(ValueError, match="sized by budget"):
        to_press(registry.get("snapkv", budget=64))


# kvpress's presses as kvzoo policies: kvpress's parameter names, the rows kvpress keeps
PRESSES = {
    "KnormPress": {},
    "SnapKVPress": {"window_size": 64, "kernel_size": 5},
    "TOVAPress": {},
    "KeyDiffPress": {},
    "StreamingLLMPress": {"n_sink": 4},
}


def _differ_beyond_ties(zoo: list[torch.Tensor], press: list[torch.Tensor], scores: list[torch.Tensor] | None) -> list[str]:
    """:func:`_same_rows`, except that a row kept by one side only is forgiven when ``scores`` (``[B, G, n]`` per layer)
    give it exactly the score of a row kept by the other side only: an exact tie at the top-k boundary, which kvzoo
    breaks to the earlier row and ``torch.topk`` leaves open."""
    out = []
    for layer, (a, b) in enumerate(zip(zoo, press)):
        assert a.shape == b.shape, f"layer {layer}: kvzoo keeps {tuple(a.shape)}, kvpress {tuple(b.shape)}"
        for g in range(a.shape[1]):
            ours, theirs = set(a[0, g].tolist()), set(b[0, g].tolist())
            if ours == theirs:
                continue
            tied = scores is not None and sorted(scores[layer][0, g, sorted(ours - theirs)].tolist()) == \
                sorted(scores[layer][0, g, sorted(theirs - ours)].tolist())
            if not tied:
                out.append(f"layer {layer} head {g}: {len(ours - theirs)} rows differ")
    return out


@pytest.mark.parametrize("press_name", list(PRESSES))
@pytest.mark.parametrize("model_name", ["tiny", "smol"])
def test_kvpress_press_keeps_its_rows_inside_kvzoo(press_name, model_name, request, kv, book_ids):
    """Row for row, on a tiny random Llama (400 ids) and SmolLM2 (600 tokens of text). On SmolLM2 KnormPress meets
    exact ties: layer 0's pre-RoPE key depends on the token alone and RoPE keeps norms, so a repeated token scores the
    same; those ties (and only those) may go either way."""
    if model_name == "tiny":
        model, ids = request.getfixturevalue("tiny"), request.getfixturevalue("tiny_ids")
    else:
        model, tokenizer = request.getfixturevalue("smol")
        ids = book_ids(tokenizer, 600)
    params = PRESSES[press_name]
    policy = registry.get(f"kvpress:{press_name}", compression_ratio=0.75, **params)
    assert isinstance(policy, KvpressPolicy) and policy.name == f"kvpress:{press_name}"
    zoo = kv.zoo_rows(model, ids, policy)
    inputs: dict[int, torch.Tensor] = {}
    ref = kv.press_rows(model, ids, getattr(kvpress, press_name)(compression_ratio=0.75, **params), inputs)
    assert zoo[0].shape[2] == int(ids.shape[1] * 0.25)
    scores = None
    if press_name == "KnormPress":  # the press's own score, of the keys it compressed
        scores = [-inputs[layer].norm(dim=-1) for layer in range(len(inputs))]
    assert _differ_beyond_ties(zoo, ref, scores) == []


def test_kvpress_names_given_kvzoo_ratio_keep_kvzoo_count(tiny, tiny_ids, kv):
    zoo = kv.zoo_rows(tiny, tiny_ids, registry.get("kvpress:KnormPress", ratio=RATIO))
    ref = kv.press_rows(tiny, tiny_ids, kvpress.KnormPress(compression_ratio=0.75))
    assert _same_rows(zoo, ref) == []


def test_kvpress_names_refuse_what_kvzoo_cannot_run():
    with pytest.raises(KeyError, match="ObservedAttentionPress.*full attention matrix"):
        registry.get("kvpress:ObservedAttentionPress", compression_ratio=0.5)
    with pytest.raises(KeyError, match="not a ScorerPress"):
        registry.get("kvpress:ChunkKVPress", compression_ratio=0.5)
    with pytest.raises(KeyError, match="valid kvpress: names:.*KnormPress"):
        registry.get("kvpress:NoSuchPress", compression_ratio=0.5)
    with pytest.raises(ValueError, match="exactly one of compression_ratio"):
        registry.get("kvpress:KnormPress", compression_ratio=0.5, ratio=2)
    with pytest.raises(ValueError, match="not budget"):
        registry.get("kvpress:KnormPress", budget=64)
    assert torch.isclose(torch.tensor(0.75), torch.tensor(registry.get("kvpress:KnormPress", ratio=4)
                                                          .press_params()["compression_ratio"]))
