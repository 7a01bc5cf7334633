"""The lean runtime: decompressed MLA prefill, preallocated tiers, per-step eviction in place, no host sync
in a decode step, and retrieval scans in bounded memory."""

import contextlib
import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzoo import TieredCache, registry
from kvzoo.framework.adapters.mla import decompress_break_even
from kvzoo.framework.attention import detach
from kvzoo.framework.buffers import RowStore
from kvzoo.framework.policy import Observation, RowsView
from kvzoo.framework.retrieval import scan
from kvzoo.framework.retriever import ArchiveView, RowGeometry
from kvzoo.kernels.index_scan import exact_scores
from kvzoo.models import tiny_deepseek_v2, tiny_kimi_linear, tiny_llama
from kvzoo.policies.streaming_llm import StreamingLLM
from kvzoo.retrievers.quest import PageIndex, QuestRetriever
from kvzoo.retrievers.sketch import SketchIndex
from kvzoo.retrievers.vestige import VestigeRetriever

BUILDERS = {"deepseek_v2": tiny_deepseek_v2, "kimi_linear": tiny_kimi_linear}


@pytest.fixture(scope="module", params=list(BUILDERS))
def mla(request):
    return BUILDERS[request.param]()[0]


def _ids(n, seed=0, vocab=512):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- MLA: prefill decompressed, decode absorbed ------------------------------------------------------


def _logits(model, ids, chunk, cache):
    with torch.no_grad():
        parts = [model(input_ids=ids[:, i : i + chunk], cache=cache, use_cache=True).logits
                 for i in range(0, ids.shape[1], chunk)]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("chunk", [96, 400])
def test_decompressed_equals_absorbed_equals_transformers(mla, chunk):
    """Every position's logits, one-shot (400) and chunked (96): per-head SDPA == absorbed == transformers (1e-4)."""
    ids = _ids(400, seed=11)
    detach(mla)
    with torch.no_grad():
        ref = mla(input_ids=ids).logits  # transformers' own MLA, DynamicCache
    decompressed = _logits(mla, ids, chunk, TieredCache(mla, "full", decompress_min_queries=2))
    absorbed = _logits(mla, ids, chunk, TieredCache(mla, "full", decompress_min_queries=10**9))
    assert (decompressed - ref).abs().max().item() < 1e-4
    assert (absorbed - ref).abs().max().item() < 1e-4
    assert (decompressed - absorbed).abs().max().item() < 1e-4


def test_decompressed_path_with_eviction_and_padding_matches_absorbed(mla):
    """After eviction (slots scattered) and with left padding, both forms still agree (the slot mask path)."""
    ids = torch.cat([torch.zeros(1, 30, dtype=torch.long), _ids(270, seed=12)], dim=1).repeat(2, 1)
    ids[1] = _ids(300, seed=13)
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    outs = []
    for threshold in (2, 10**9):
        cache = TieredCache(mla, StreamingLLM(budget=64, schedule="block", block_size=10_000), decompress_min_queries=threshold)
        with torch.no_grad():
            mla(input_ids=ids[:, :200], attention_mask=mask[:, :200], cache=cache, use_cache=True)
            cache.compress()
            outs.append(mla(input_ids=ids[:, 200:], attention_mask=mask, cache=cache, use_cache=True).logits)
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4


def test_decompress_threshold_is_the_flop_break_even_and_validated(mla):
    cache = TieredCache(mla, "full")
    assert cache.adapter.geometry.decompress_min_queries == decompress_break_even(512, 64, 128, 128) == 171
    with pytest.raises(ValueError, match="decompress_min_queries must be None"):
        TieredCache(mla, "full", decompress_min_queries=1)


# --- the store ---------------------------------------------------------------------------------------


def _store(n, B=2, G=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    store = RowStore()
    store.define(B, G, {"keys": ((D,), torch.float32), "slots": ((), torch.long)}, torch.device("cpu"))
    for start in range(0, n, 7):
        q = min(7, n - start)
        store.append({"keys": torch.randn(B, G, q, D, generator=g), "slots": torch.arange(start, start + q).expand(B, G, q)})
    return store


def test_store_grows_geometrically_and_keeps_rows_in_order():
    store = _store(100)
    keys = store.get("keys").clone()
    assert store.n == 100 and store.capacity >= 100
    assert torch.equal(store.get("slots")[0, 0], torch.arange(100))
    grown = []
    for step in range(300):  # one row per step: the capacity changes O(log) times, not every step
        cap = store.capacity
        store.append({"keys": torch.zeros(2, 3, 1, 4), "slots": 100 + step})
        grown.append(store.capacity != cap)
    assert sum(grown) <= 6 and torch.equal(store.get("keys")[:, :, :100], keys)


def test_store_keep_shrinks_and_a_vacated_row_settles_by_moving_one_row():
    store = _store(500)
    keys = store.get("keys").clone()
    keep = torch.arange(0, 500, 10).expand(2, 3, 50).contiguous()
    store.keep(keep)
    assert store.n == 50 and store.capacity < 200  # memory given back
    assert torch.equal(store.get("keys"), keys[:, :, ::10])
    victim = torch.tensor([[0, 5, 49], [7, 7, 3]])
    store.vacate(victim)
    store.settle()
    assert store.n == 49 and not store.ordered
    store.ensure_order()
    for b in range(2):
        for g in range(3):
            expected = [s for i, s in enumerate(range(0, 500, 10)) if i != victim[b, g]]
            assert store.get("slots")[b, g].tolist() == expected
            assert torch.equal(store.get("keys")[b, g], keys[b, g, expected])


# --- one in, one out: the per-step victim equals select()'s choice -----------------------------------


def _random_rows(n, pad, seed, with_stats):
    g = torch.Generator().manual_seed(seed)
    B, G = 2, 2
    slots = torch.arange(n).expand(B, G, n).clone()
    valid = torch.ones(B, G, n, dtype=torch.bool)
    valid[1, :, :pad] = False  # left padding on the second sequence
    stats = {"attention": torch.randint(0, 4, (B, G, n), generator=g).float()} if with_stats else {}  # with ties
    ordered = RowsView(keys=torch.zeros(B, G, n, 1), values=None, slots=slots, valid=valid, layer_idx=0,
                       num_layers=1, row_stats=stats)
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(B * G)]).view(B, G, n)
    shuffled = RowsView(keys=torch.zeros(B, G, n, 1), values=None, slots=slots.gather(2, perm),
                        valid=valid.gather(2, perm), layer_idx=0, num_layers=1,
                        row_stats={k: v.gather(2, perm) for k, v in stats.items()})
    return ordered, shuffled, perm


def _one_in_one_out() -> list[str]:
    """Every registered policy that evicts at every decode step (schedule ``step``) by a rule on the rows and their
    accumulated attention (what :func:`_random_rows` gives; a window-observing rule needs queries)."""
    return [name for name, cls in ((name, registry.policy_class(name)) for name in registry.available())
            if cls.schedule == "step" and cls.requires_budget and set(cls.observes) <= {Observation.ACCUMULATE}]


@pytest.mark.parametrize("policy", _one_in_one_out())
@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 40), pad=st.integers(0, 45), sinks=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_step_victim_is_the_row_select_leaves_out(policy, n, pad, sinks, seed):
    """On any row order (the tier after hole-filling evictions) the victim is select(n - 1)'s left-out row."""
    pad = min(pad, n)
    cls = registry.policy_class(policy)
    ordered, shuffled, perm = _random_rows(n, pad, seed, with_stats=Observation.ACCUMULATE in cls.observes)
    has_sinks = "sinks" in {f.name for f in dataclasses.fields(cls)}
    chosen = registry.get(policy, budget=n + 10, **({"sinks": sinks} if has_sinks else {}))
    kept = chosen.select(ordered, n - 1)  # [B, G, n - 1] positions in the ordered view
    victim = chosen.step_victim(shuffled)  # [B, G] positions in the shuffled view
    left_out = torch.ones(2, 2, n, dtype=torch.bool).scatter_(2, kept, False).float().argmax(-1)
    assert torch.equal(perm.gather(2, victim[..., None])[..., 0], left_out)
    if pad == 0:  # no padding: the runtime says so (all_valid) and the rule takes its shorter form, to the same row
        shuffled.all_valid = True
        assert torch.equal(chosen.step_victim(shuffled), victim)


def test_per_step_eviction_moves_rows_in_place_and_keeps_the_partition(tiny_llama_model):
    """streaming_llm step by step: the tier's position list never reallocates between steps (one index moves per
    step), the rows stay where they were written (the storage grows geometrically: a few reallocations over 40
    steps), and every row is in one place."""
    model = tiny_llama_model
    cache = TieredCache(model, StreamingLLM(budget=48, archive=True))
    ids = _ids(200, seed=3, vocab=256)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        layer = cache.layers[0]
        positions = layer.store.tier.buffers["pos"].data_ptr()
        moves, rows = 0, layer.store.rows.buffers["keys"].data_ptr()
        for step in range(40):
            model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
            assert layer.store.tier.buffers["pos"].data_ptr() == positions and layer.store.n == 48
            moves += layer.store.rows.buffers["keys"].data_ptr() != rows
            rows = layer.store.rows.buffers["keys"].data_ptr()
        assert moves <= 2
    slots = torch.cat([layer.slots, layer.store.archive.tensors()["slots"]], dim=2)
    assert torch.equal(slots.sort(dim=2).values[0, 0], torch.arange(240))
    assert layer.slots[0, 0, :4].tolist() == [0, 1, 2, 3] and layer.slots[0, 0, -1].item() == 239


@pytest.fixture(scope="module")
def tiny_llama_model():
    return tiny_llama()[0]


# --- no host synchronisation in a decode step ----------------------------------------------------------


@contextlib.contextmanager
def count_host_syncs():
    """Count every way Python code can read a tensor's value on the host (the CPU stand-in for
    ``torch.cuda.set_sync_debug_mode``): ``item``, ``tolist``, ``bool``, ``int``, ``float``, ``index``."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    counter = {"syncs": 0, "where": []}

    def counting(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            counter["syncs"] += 1
            counter["where"].append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in names:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


POLICIES_WITHOUT_SYNC = {
    "full": lambda: registry.get("full"),
    "streaming_llm": lambda: registry.get("streaming_llm", ratio=4),
    "vestige": lambda: registry.get("vestige", ratio=4, retriever=None, block_size=64),
    "vestige+sketch": lambda: registry.get("vestige", ratio=4, block_size=64),  # top-j: fixed staging
    "vestige+pruned": lambda: registry.get(  # the page scan, the pruned int8 scan, the bytes counted on the device
        "vestige", ratio=4, block_size=64, retriever=registry.build_retriever("vestige", index="int8", prune=True)),
    "h2o": lambda: registry.get("h2o", ratio=4),
}


@pytest.mark.parametrize("name", list(POLICIES_WITHOUT_SYNC))
@pytest.mark.parametrize("builder", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_decode_step_has_no_host_sync(name, builder, with_mask, tiny_llama_model):
    if name == "vestige+pruned" and builder != "llama":
        pytest.skip("the int8 index is for GQA rows")
    model = tiny_llama_model if builder == "llama" else tiny_deepseek_v2()[0]
    vocab = model.config.vocab_size
    ids = _ids(160, seed=4, vocab=vocab)
    cache = TieredCache(model, POLICIES_WITHOUT_SYNC[name](), context_length=160)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        cache.compress()
        for step in range(3):  # past the first step's one-off work
            model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
        mask = torch.ones(1, 164, dtype=torch.long) if with_mask else None
        with count_host_syncs() as counter:
            model(input_ids=ids[:, 5:6], cache=cache, use_cache=True, attention_mask=mask)
    assert counter["syncs"] == 0, counter["where"]
    if name != "full":
        assert cache.stats().totals["events"] > 0 or cache.stats().totals["archived_rows"] > 0


# --- retrieval scans in bounded memory -------------------------------------------------------------------


def _rss_kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _peak_extra_mib(fn):
    """Peak resident memory ``fn()`` adds (MiB): VmHWM reset through /proc/self/clear_refs, then read."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _rss_kib("VmRSS")
    result = fn()
    return (_rss_kib("VmHWM") - before) / 1024, result


def _sketch_state(keys, valid):
    state = SketchIndex(VestigeRetriever(j=16), RowGeometry("mla", 512, 64))
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys[:, :, :2048], valid=valid[:, :, :2048]), None)
    return state


def _page_state(keys, valid):
    state = PageIndex(QuestRetriever())
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), None)
    return state


SCAN_BOUND_MIB = 200  # one score tile (64 MiB) and its companions, plus O(rows) masks


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="needs /proc")
@pytest.mark.parametrize("make_state", [_sketch_state, _page_state], ids=["sketch", "pages"])
def test_scan_of_a_long_question_stays_in_bounded_memory(make_state):
    """16k archived MLA rows, a 1,024-token question, 16 heads: the scan never holds queries x rows x dims.

    The old scans materialised [B, H, q, m] (sketch: ~1 GiB per intermediate) or [B, G, H, q, p, D]
    (pages: ~9 GiB) here."""
    g = torch.Generator().manual_seed(0)
    m, q_len, H = 16384, 1024, 16
    keys = torch.randn(1, 1, m, 576, generator=g)
    valid = torch.ones(1, 1, m, dtype=torch.bool)
    state = make_state(keys, valid)
    view = ArchiveView(keys, torch.arange(m).view(1, 1, m), valid, budget=512)
    query = torch.randn(1, H, q_len, 576, generator=g)
    best = torch.zeros(1, H, q_len)
    peak, mask = _peak_extra_mib(lambda: scan(state, query, lambda start, stop: best[:, :, start:stop], 1.0, view))
    assert mask.shape == (1, 1, m) and mask.any()
    assert peak < SCAN_BOUND_MIB, f"scan peaked at {peak:.0f} MiB over its inputs"


@pytest.mark.parametrize("make_state", [_sketch_state, _page_state], ids=["sketch", "pages"])
def test_multi_token_choice_contains_every_querys_own_choice(make_state):
    """The union a multi-token forward fetches contains what each query, alone, would fetch."""
    g = torch.Generator().manual_seed(1)
    m, q_len, H = 700, 37, 4
    keys = torch.randn(1, 1, m, 576, generator=g)
    valid = torch.ones(1, 1, m, dtype=torch.bool)
    state = make_state(keys, valid)
    view = ArchiveView(keys, torch.arange(m).view(1, 1, m), valid, budget=64)
    query = torch.randn(1, H, q_len, 576, generator=g)
    best = exact_scores(query, keys[:, :, :50], 1.0).amax(-1)  # some s* per head and query
    union = scan(state, query, lambda start, stop: best[:, :, start:stop], 1.0, view, tile=5)
    for t in range(q_len):
        alone = state.choose(query[:, :, t : t + 1], best[:, :, t : t + 1], 1.0, view).as_mask(m)
        assert alone.any() and not (alone & ~union).any()


def test_retriever_policy_with_a_long_question_runs_and_counts(tiny_llama_model):
    """A question of several hundred tokens after compression through both retrievers (the tiled union path)."""
    ctx, question = _ids(600, seed=5, vocab=256), _ids(300, seed=6, vocab=256)
    for retriever in ("vestige", "quest"):
        cache = TieredCache(tiny_llama_model, registry.get("streaming_llm", ratio=8, retriever=retriever),
                            context_length=600)
        with torch.no_grad():
            tiny_llama_model(input_ids=ctx, cache=cache, use_cache=True)
            cache.compress()
            tiny_llama_model(input_ids=question, cache=cache, use_cache=True)
        step = cache.stats().layers[0].last_step
        assert step["queries"] == 300 and step["rows_fetched"] > 0
        assert step["kv_bytes_read"] == step["attended_bytes_read"] + step["index_bytes_scanned"] + step["fetched_bytes"]

