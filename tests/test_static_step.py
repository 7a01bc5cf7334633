"""A decode step a CUDA graph can replay: with ``TieredCache(..., capacity=N)`` consecutive steps between events
launch the same ops with the same arguments on the same storage, and never wait for the device.

What a CPU can prove of the condition for graph capture: every aten op a step dispatches is recorded
(``kvzoo.bench.step_trace``) -- its name, its non-tensor arguments and the shapes and dtypes of its tensors -- and
the traces of the steady steps (no event: no selection over the tier, no storage growth) must be identical, every
tensor the cache owns must keep its storage, and no op may synchronise. Also: the same greedy tokens and the
same kept rows with and without ``capacity``.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.bench.step_trace import StandInGraph, StepTrace, first_difference
from kvzoo.framework.adapters import model_type_of
from kvzoo.framework.attention import detach
from kvzoo.framework.names import adapter_class
from kvzoo.models import TINY_FAMILIES, tiny_deepseek_v2, tiny_llama
from tests.greedy import assert_same_greedy

PROMPT, STEPS = 120, 24

# Test sizes, by hyperparameter: budgets the tiny models' prompt exceeds, a small observation window, blocks that
# close within the prompt, every layer compressed. A policy takes those of its fields it has.
SIZES = {"budget": 32, "window": 8, "block_size": 64, "dense_layers": 0}


def _paged():
    """The paged sketch index (issue 25), pages of 8 rows."""
    return registry.build_retriever("vestige", index="paged", page_rows=8)


def _sized(name: str, **params) -> tuple[str, dict]:
    cls = registry.policy_class(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    sized = {k: v for k, v in SIZES.items() if k in fields and (k != "budget" or cls.requires_budget)
             and (k != "block_size" or cls.schedule == "block")}
    return name, {**sized, **params}


def _policies() -> dict[str, tuple[str, dict]]:
    """Every registered policy at test sizes; the eviction-only form of each that holds a retriever by default; and
    the runtime's other paths: the sketch indexed at every step under one in, one out, and the paged index."""
    out = {name: _sized(name) for name in registry.available()}
    for name in registry.available():
        if isinstance(registry.policy_class(name).retriever, str):
            out[f"{name}-evict"] = _sized(name, retriever=None)
    out["streaming_llm-sketch"] = _sized("streaming_llm", retriever="vestige")  # one in, one out, indexed every step
    out["vestige-sketch"] = _sized("vestige", retriever=registry.build_retriever("vestige", index="sketch"))
    out["vestige-paged"] = _sized("vestige", retriever=_paged())  # pages scanned first; a row a step joins the open page
    out["streaming_llm-paged"] = _sized("streaming_llm", retriever=_paged())
    # issue 47: the int8 index's page summary scanned first, the dead pages' entries skipped, the bytes counted
    out["vestige-pruned"] = _sized("vestige", retriever=registry.build_retriever("vestige", index="int8", prune=True,
                                                                                 page_rows=4))
    return out


POLICIES = _policies()


def _policy(name: str):
    base, params = POLICIES[name]
    return registry.get(base, **params)


def _pages(policy) -> bool:
    """The policy's retriever moves pages of ``page_size`` rows (an event every page)."""
    return policy.retriever is not None and "page_size" in policy.retriever_fields


def _runs_on(name: str, policy, family: str) -> bool:
    """The policy's layouts cover the family's rows (a paged index is for GQA rows only)."""
    layout = adapter_class(model_type_of(_model(family))).layout
    return layout in policy.layouts and (layout == "gqa" or not name.endswith(("-paged", "-pruned")))


@functools.cache
def _model(family: str):
    build = TINY_FAMILIES[family]
    model = build()[0]
    detach(model)
    return model


def _ids(model, n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, n), generator=g)


def _owned(cache: TieredCache) -> dict[str, int]:
    """Storage pointer of every tensor the cache's tiered layers own: rows, views, index, lengths, counters."""
    out = {}
    for layer in cache.tiered_layers:
        store = layer.store
        for where, rows in (("rows", store.rows), ("tier", store.tier), ("archived", store.archive.positions)):
            for name, buf in rows.buffers.items():
                out[f"{layer.layer_idx}.{where}.{name}"] = buf.data_ptr()
            if rows.length is not None:
                out[f"{layer.layer_idx}.{where}.length"] = rows.length.data_ptr()
        out[f"{layer.layer_idx}.seen"] = layer.counts.seen_dev.data_ptr()
        out[f"{layer.layer_idx}.fetched"] = layer.counts.fetched_rows.data_ptr()
        out[f"{layer.layer_idx}.index_bytes"] = layer.counts.index_bytes_counted.data_ptr()
        index = layer.store.archive.index
        for owner, attr in ((index, "rows"), (getattr(index, "summary", None), "pages")):
            index_rows = getattr(owner, attr, None)
            if index_rows is not None and hasattr(index_rows, "buffers"):
                for name, buf in index_rows.buffers.items():
                    out[f"{layer.layer_idx}.index.{attr}.{name}"] = buf.data_ptr()
        summary = getattr(index, "summary", None)
        for attr in ("count", "open_min", "open_max"):
            value = getattr(summary, attr, None)
            if isinstance(value, torch.Tensor):
                out[f"{layer.layer_idx}.index.{attr}"] = value.data_ptr()
    return out


def _steady(cache: TieredCache) -> tuple[int, ...]:
    """What changes at an event: selections over the tier and storage growths, per layer."""
    return tuple(x for layer in cache.tiered_layers
                 for x in (layer.counts.selections, layer.store.rows.growths, layer.store.tier.growths,
                           layer.store.archive.positions.growths))


def _decode_traces(model, policy, *, steps: int = STEPS):
    """Prefill, compress, then ``steps`` recorded decode steps: [(trace, steady key before, after, owned)]."""
    ids = _ids(model, PROMPT)
    cache = TieredCache(model, policy, capacity=PROMPT + steps + 4)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        cache.compress()
        token = logits.argmax(-1, keepdim=True)
        for t in range(steps + 1):
            position = torch.tensor([[PROMPT + t]])
            before = _steady(cache)
            with StepTrace() as trace:
                logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1]
            out.append((trace, before, _steady(cache), _owned(cache)))
            token = logits.argmax(-1, keepdim=True)
    return out[1:]  # the first decode step sizes what the event left (the archive, the counters): not steady yet


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
@pytest.mark.parametrize("name", list(POLICIES))
def test_steady_decode_steps_repeat_op_for_op(name, family, kernels, monkeypatch):
    """``auto``: what a CPU step runs (the C ops where they apply); ``torch``: the PyTorch references every op
    falls back to -- what a GPU step composes with its Triton kernels (VestigeKV's choice has no kernel there)."""
    monkeypatch.setenv("KVZOO_KERNELS", kernels)
    model = _model(family)
    policy = _policy(name)
    if not _runs_on(name, policy, family):
        pytest.skip(f"{name} does not run on {family}")
    runs: list[list] = [[]]  # steady steps, in runs between events (after an event a graph is captured again)
    for trace, before, after, owned in _decode_traces(model, policy):
        if before == after:
            runs[-1].append((trace, owned))
        elif runs[-1]:
            runs.append([])
    runs = [run for run in runs if run]
    longest = max((len(run) for run in runs), default=0)
    # a paging retriever (quest's) moves the current page to the archive every page_size steps (an event); the
    # others have none here
    assert longest >= (12 if _pages(policy) else STEPS), f"the longest run of steady steps is {longest}"
    for run in runs:
        reference, ref_owned = run[0]
        assert reference.syncs == [], f"host syncs in a decode step: {reference.syncs}"
        assert reference.host_tensors == [], f"tensors built from host data in a decode step (a host-to-device " \
                                             f"copy each on a GPU): shapes {reference.host_tensors}"
        for i, (trace, owned) in enumerate(run[1:], 1):
            assert first_difference(reference, trace) is None, f"steady step {i}: {first_difference(reference, trace)}"
            moved = sorted(k for k in owned if owned[k] != ref_owned.get(k))
            assert not moved, f"steady step {i}: storage moved for {moved}"
            assert trace.syncs == [] and trace.host_tensors == []


@pytest.mark.parametrize("name", ["quest", "vestige", "vestige-sketch", "vestige-paged", "vestige-pruned",
                                  "streaming_llm-sketch", "streaming_llm-paged"])
def test_a_padded_batchs_decode_steps_do_not_synchronise(name):
    """Issue 44 item 2: in a left-padded batch (padding of 5 rows, not a multiple of a page) the retrievers read
    their row flags and page shifts on the device: no host sync, no tensor built from host data, in a decode step."""
    model = _model("llama")
    ids = _ids(model, PROMPT, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = TieredCache(model, _policy(name), capacity=PROMPT + 12)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache,
                       use_cache=True).logits[:, -1]
        cache.compress()
        steady = 0
        for t in range(8):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            position = position[:, -1:] + 1
            before = _steady(cache)
            with StepTrace() as trace:
                logits = model(input_ids=logits.argmax(-1, keepdim=True), attention_mask=mask, position_ids=position,
                               cache=cache, use_cache=True).logits[:, -1]
            if t and before == _steady(cache):  # the first step sizes what the event left; events may sync
                steady += 1
                assert trace.syncs == [] and trace.host_tensors == [], (t, trace.syncs, trace.host_tensors)
    assert steady >= 4


def _generate(model, policy, ids, mask, capacity):
    cache = TieredCache(model, policy, capacity=capacity)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         cache=cache, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    kept = [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]
    return out, kept


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
@pytest.mark.parametrize("name", list(POLICIES))
def test_capacity_changes_no_token_and_no_kept_row(name, family):
    """A left-padded batch of two: the same greedy tokens (up to a near tie) and the same rows kept per layer."""
    model = _model(family)
    policy = _policy(name)
    if not _runs_on(name, policy, family):
        pytest.skip(f"{name} does not run on {family}")
    ids = _ids(model, PROMPT, seed=1, batch=2)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0  # the second sequence is 9 tokens shorter, padded on the left
    with torch.no_grad():
        grown, grown_kept = _generate(model, policy, ids, mask, None)
        fixed, fixed_kept = _generate(model, policy, ids, mask, PROMPT + 16)
    for row in range(2):
        assert_same_greedy(grown.sequences[row], fixed.sequences[row],
                           torch.stack([s[row] for s in grown.logits]), torch.stack([s[row] for s in fixed.logits]))
    if torch.equal(grown.sequences, fixed.sequences):  # the same tokens: the same rows
        for layer, (a, b) in enumerate(zip(grown_kept, fixed_kept)):
            assert torch.equal(a, b), f"layer {layer} keeps other rows with capacity"


def test_capacity_is_checked():
    model = _model("llama")
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="capacity must be None"):
            TieredCache(model, "full", capacity=bad)


def test_cuda_graph_off_a_gpu_names_cuda_graph_and_cuda():
    with pytest.raises(ValueError, match="cuda_graph=True.*CUDA"):
        TieredCache(_model("llama"), "full", capacity=64, cuda_graph=True)


@pytest.mark.parametrize("name", ["full", "streaming_llm", "h2o", "quest", "vestige", "vestige-pruned"])
def test_a_graphed_decode_replays_what_an_eager_one_computes_and_counts(name):
    """DecodeGraph's logic on CPU (the stand-in for the CUDA graph): which steps replay, the static inputs, and
    the host's counters advanced at each replay -- the same tokens and the same cache.stats() as eager steps."""
    from kvzoo.framework.graphs import install

    model = _model("llama")
    ids = _ids(model, PROMPT, seed=3)
    runs = {}
    for graphed in (False, True):
        cache = TieredCache(model, _policy(name), capacity=PROMPT + 40)
        graph = None
        if graphed:
            cache.graph = graph = install(model, cache, lambda c=cache: StandInGraph(c))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, cache=cache,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        runs[graphed] = (out, cache.stats().totals, graph)
    detach(model)
    (eager, eager_totals, _), (replayed, replayed_totals, graph) = runs[False], runs[True]
    assert graph.replays >= (12 if _pages(_policy(name)) else 20) and graph.captures >= 1
    assert_same_greedy(eager.sequences[0], replayed.sequences[0], torch.stack([s[0] for s in eager.logits]),
                       torch.stack([s[0] for s in replayed.logits]))
    if torch.equal(eager.sequences, replayed.sequences):
        assert replayed_totals == eager_totals


@pytest.mark.parametrize("name", ["full", "streaming_llm", "vestige-sketch", "vestige-pruned"])
def test_a_graph_captured_right_after_compression_reports_each_replayed_steps_reads(name):
    """The figures of the latest step (``stats().layers[i].last_step``) after replays equal an eager run's, when the
    steps captured follow a compression (before them the latest forward was the prompt's: off the steady line)."""
    from kvzoo.framework.graphs import install

    model = _model("llama")
    ids = _ids(model, PROMPT, seed=5)
    seen = {}
    for graphed in (False, True):
        cache = TieredCache(model, _policy(name), capacity=PROMPT + 20)
        graph = install(model, cache, lambda c=cache: StandInGraph(c)) if graphed else None
        cache.graph = graph
        with torch.no_grad():
            token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            cache.compress()
            for t in range(10):
                position = torch.tensor([[PROMPT + t]])
                token = model(input_ids=token, position_ids=position, cache=cache,
                              use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        seen[graphed] = [layer.last_step for layer in cache.stats().layers]
        if graph is not None:
            assert graph.replays >= 6
            detach(model)
    assert seen[True] == seen[False]


# launches per layer-step beyond transformers' StaticCache (benchmarks/decode_step.py --ops prints the exact figures): a policy
# that only evicts at its events costs nothing more than StaticCache; a per-step one in, one out, a few ops; a retriever
# (an index scan, a second attention part) a bounded number
LAUNCH_BOUNDS = {"full": 0, "snapkv": 0, "chunkkv": 0, "vestige (evict only)": 0, "streaming_llm": 4, "h2o": 10,
                 "quest": 15, "vestige (+ sketch)": 15}


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
def test_a_decode_step_launches_at_most_its_bound_of_ops_beyond_transformers_static_cache(family):
    """The regression bound on the op count, per policy (``LAUNCH_BOUNDS``), with ``capacity`` (the capturable step),
    and no host synchronisation."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import decode_step

    build = {"llama": tiny_llama, "deepseek_v2": tiny_deepseek_v2}[family]
    rows = decode_step.count_ops({family: build}, decode_step.OPS_POLICIES, capacities=(True,))
    over = {r["cache"]: round(r["beyond StaticCache"], 1) for r in rows if r["cache"].startswith("kvzoo ")
            and r["beyond StaticCache"] > LAUNCH_BOUNDS[r["cache"][len("kvzoo "):]]}
    assert over == {}, f"launches per layer-step beyond StaticCache over their bound {LAUNCH_BOUNDS}: {over}"
    assert all(r["syncs"] == 0 for r in rows if "syncs" in r)
