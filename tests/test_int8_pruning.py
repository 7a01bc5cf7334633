"""Issue 47 (part D): VestigeKV's int8 index pruned by a page summary (``VestigeRetriever(prune=True)``).

A decode step scans the page summaries first (key min/max of ``page_rows`` archived rows, int8), and skips the int8
entries of a page whose bound is ``<= s* - j_margin`` for every head of its group. What must hold: no skipped row
scores above ``s* - j_margin`` (the certificate, on random and adversarial keys); the C op skips exactly the dead
pages' rows and agrees with its reference; the pruned choice equals the unpruned one whenever no skipped row would
rank in a head's top ``j``; bad inputs are refused before any read; the bytes a step read are counted on the device.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzoo import TieredCache, registry
from kvzoo.framework.retriever import RowGeometry
from kvzoo.kernels import cpu_native
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    int8_bound_from,
    int8_choose,
    int8_choose_reference,
    int8_key_entries,
    int8_key_estimate_reference,
    int8_page_bounds,
    int8_page_live,
    int8_page_live_reference,
    page_rows_live,
)
from kvzoo.models import tiny_llama
from kvzoo.retrievers.int8 import Int8KeyIndex
from kvzoo.retrievers.vestige import VestigeRetriever
from tests.greedy import assert_same_greedy

needs_compiler = pytest.mark.skipif(cpu_native.toolchain_missing() is not None,
                                    reason=f"{cpu_native.toolchain_missing()}: the CPU kernels are not built here "
                                           "(kvzoo takes the PyTorch references)")
SCALING = 0.125


def _pruned_index(keys: torch.Tensor, valid: torch.Tensor, page_rows: int, chunks: list[int],
                  capacity: int | None = None) -> Int8KeyIndex:
    """An int8 index with its page summary, fed ``keys [B, G, m, D]`` in ``chunks`` (pages opened and re-encoded as
    rows join them, as archive events do)."""
    state = VestigeRetriever(index="int8", prune=True, page_rows=page_rows).new_state(
        RowGeometry("gqa", 0, capacity=capacity))
    start = 0
    for k in chunks:
        state.index({"keys": keys[:, :, start : start + k], "valid": valid[:, :, start : start + k]}, None, None)
        start += k
    return state


def _live(state: Int8KeyIndex, query: torch.Tensor, floor: torch.Tensor, flags=int8_page_live) -> torch.Tensor:
    pages = state.pages
    B = query.shape[0]
    return flags(query, pages.reading("codes"), pages.reading("scale"), pages.reading("empty"), floor, SCALING,
                 length=pages.length.expand(B) if pages.fixed else None)


def _violations(keys, valid, query, floor, page_live, page_rows) -> tuple[int, int]:
    """(rows of dead pages scoring above the floor for some head of their group, rows of dead pages)."""
    m = keys.shape[2]
    exact = SCALING * torch.einsum("bghd,bgmd->bghm", query.double(), keys.double())  # the exact score, in fp64
    skipped = valid & ~page_rows_live(page_live, page_rows, m)
    above = (exact > floor.double()[..., None]).any(2)
    return int((skipped & above).sum()), int(skipped.sum())


# --- the certificate ---------------------------------------------------------------------------------------------


KEY_KINDS = ("gauss", "constant pages", "outlier row", "huge", "tiny", "one hot", "mixed scale")


def _keys(kind: str, B: int, G: int, m: int, D: int, page_rows: int, g: torch.Generator) -> torch.Tensor:
    """Adversarial archived keys: pages whose rows are all alike (the bound is tight, the floor lands on it), one
    outlier row per page, magnitudes at fp16/int8 extremes, one-hot keys, rows of very different scales."""
    x = torch.randn(B, G, m, D, generator=g)
    if kind == "constant pages":
        pages = -(-m // page_rows)
        x = torch.randn(B, G, pages, 1, D, generator=g).expand(B, G, pages, page_rows, D).reshape(B, G, -1, D)[:, :, :m]
        x = x + 1e-6 * torch.randn(B, G, m, D, generator=g)
    elif kind == "outlier row":
        x[:, :, ::page_rows] *= 50
    elif kind == "huge":
        x = x * 3e3
    elif kind == "tiny":
        x = x * 1e-4
    elif kind == "one hot":
        x = torch.nn.functional.one_hot(torch.randint(0, D, (B, G, m), generator=g), D).float() \
            * torch.randn(B, G, m, 1, generator=g).sign() * 4
    elif kind == "mixed scale":
        x = x * torch.exp(3 * torch.randn(B, G, m, 1, generator=g))
    return x.contiguous()


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(KEY_KINDS), page_rows=st.sampled_from([1, 3, 4, 16]), m=st.integers(1, 90),
       hq=st.sampled_from([1, 3]), D=st.sampled_from([8, 16, 64]), chunks=st.integers(1, 4),
       floor_at=st.sampled_from(["a row", "a row, nudged down", "quantile", "the best"]), seed=st.integers(0, 2**16),
       reference=st.booleans(), capacity=st.booleans())
def test_no_skipped_row_scores_above_the_floor(kind, page_rows, m, hq, D, chunks, floor_at, seed, reference, capacity):
    """Every row of a page the summary calls dead scores ``<= s* - j_margin`` for every head of its group, the open
    last page and padding rows included (a fixed index's spare page slots too); floors placed on a row's own score
    (the tight case) and queries aligned with a key; the C loop's flags and the reference's."""
    g = torch.Generator().manual_seed(seed)
    B, G = 2, 2
    keys = _keys(kind, B, G, m, D, page_rows, g)
    valid = torch.rand(B, G, m, generator=g) > 0.1
    cuts = sorted(torch.randint(0, m + 1, (chunks - 1,), generator=g).tolist())
    state = _pruned_index(keys, valid, page_rows, [b - a for a, b in zip([0, *cuts], [*cuts, m])],
                          capacity=m + 40 if capacity else None)
    query = torch.randn(B, G, hq, D, generator=g) * 2
    query[:, :, 0] = keys[:, :, int(torch.randint(0, m, (1,), generator=g))] * 0.7  # aligned with an archived key
    exact = SCALING * torch.einsum("bghd,bgmd->bghm", query, keys).masked_fill(~valid[:, :, None], float("-inf"))
    if floor_at == "the best":
        floor = exact.amax(-1)
    elif floor_at == "quantile":
        floor = exact.nan_to_num(neginf=0.0).quantile(0.8, dim=-1)
    else:
        pick = torch.randint(0, m, (B, G, hq, 1), generator=g)
        floor = exact.gather(-1, pick)[..., 0].nan_to_num(neginf=0.0)
        if floor_at.endswith("down"):
            floor = torch.nextafter(floor, torch.full_like(floor, float("-inf")))
    live = _live(state, query, floor, int8_page_live_reference if reference else int8_page_live)
    assert live.shape == (B, G, -(-(m + (40 if capacity else 0)) // page_rows))
    assert not live[:, :, -(-m // page_rows):].any()  # spare slots hold no row
    violations, _ = _violations(keys, valid, query, floor, live, page_rows)
    assert violations == 0


def test_clustered_pages_are_skipped_and_never_wrongly():
    """Keys in pages of near-identical rows (tight bounds): most pages are dead for a query aligned with one of them,
    and no skipped row scores above the floor -- the certificate is not vacuous here."""
    g = torch.Generator().manual_seed(3)
    B, G, hq, D, size, pages = 1, 3, 3, 64, 16, 40
    centres = torch.randn(B, G, pages, 1, D, generator=g) * 3
    keys = (centres + 0.05 * torch.randn(B, G, pages, size, D, generator=g)).reshape(B, G, pages * size, D)
    valid = torch.ones(B, G, pages * size, dtype=torch.bool)
    state = _pruned_index(keys, valid, size, [300, 1, 250, pages * size - 551])
    query = keys[:, :, 5:6].expand(B, G, hq, D) + 0.1 * torch.randn(B, G, hq, D, generator=g)
    best = (SCALING * torch.einsum("bghd,bgmd->bghm", query, keys)).amax(-1)
    floor = best - 8.0
    live = _live(state, query, floor)
    violations, skipped = _violations(keys, valid, query, floor, live, size)
    assert violations == 0
    assert skipped > 0.5 * keys.shape[1] * keys.shape[2]  # most rows are skipped
    assert live[:, :, 0].all()  # the page of the key the query is aligned with


# --- the ops: native against reference, and the rule over the live pages ------------------------------------------


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("B", "G", "hq", "D", "pages", "size", "spare"), [
    (1, 3, 3, 64, 300, 16, 0), (2, 3, 9, 64, 45, 16, 7), (2, 1, 5, 128, 20, 3, 0), (1, 2, 1, 8, 4, 4, 2),
])
def test_page_flags_of_the_c_loop_match_the_reference(B, G, hq, D, pages, size, spare, threads, threads_at_any_size):
    """The same flags wherever a bound is not within rounding of its threshold; empty pages, pages past the length
    and pages of an infinite key as the reference has them."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(4)
    m = pages * size
    keys = torch.randn(B, G, m, D, generator=g) * torch.exp(torch.randn(B, G, m, 1, generator=g))
    valid = torch.rand(B, G, m, generator=g) > 0.05
    valid[:, :, :size] = False  # the first page: padding only (empty)
    state = _pruned_index(keys, valid, size, [m], capacity=m + spare * size)
    summary = state.pages
    codes, scale, empty = summary.reading("codes"), summary.reading("scale").clone(), summary.reading("empty")
    scale[:, :, 1] = float("inf")  # a page of an infinite key: live whatever the threshold
    q = torch.randn(B, G, hq, D, generator=g)
    bounds = int8_page_bounds(q, codes, scale, SCALING)
    threshold = bounds[..., 2:pages].quantile(0.8, dim=-1) + 0.01 * torch.randn(B, G, hq, generator=g)
    length = torch.tensor([pages] + [max(1, pages // 2)] * (B - 1))
    got = int8_page_live(q, codes, scale, empty, threshold, SCALING, length=length)
    want = int8_page_live_reference(q, codes, scale, empty, threshold, SCALING, length=length)
    near = (((bounds - threshold[..., None]).abs() <= 1e-4 * (1 + bounds.abs())) & bounds.isfinite()).any(2)
    assert got.dtype == torch.bool and got.shape == want.shape == (B, G, pages + spare)
    assert torch.equal(got[~near], want[~near]) and (~near).float().mean() > 0.9
    assert not got[:, :, 0].any() and not got[..., pages:].any()  # empty; spare slots
    assert got[:, :, 1][(length > 1).view(B, 1).expand(B, G)].all()  # an infinite key's page, below the length
    assert 0 < int(got.sum()) < int((~empty).sum())  # some live, some dead


def _int8(B, G, m, D, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, G, m, D, generator=g) * 2
    keys[:, :, ::7] *= 5
    codes, side = int8_key_entries(keys)
    return keys, codes, side, g


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("B", "G", "hq", "D", "m", "spare", "page_rows", "j"), [
    (1, 3, 3, 64, 700, 0, 16, 16), (2, 3, 9, 64, 301, 19, 16, 16), (2, 1, 5, 128, 40, 0, 3, 8),
    (1, 2, 3, 16, 33, 7, 1, 4), (2, 2, 2, 8, 5, 3, 64, 2),
])
def test_pruned_choose_matches_its_reference_and_reads_only_live_pages(B, G, hq, D, m, spare, page_rows, j, threads,
                                                                      threads_at_any_size):
    torch.set_num_threads(threads)
    _, codes, side, g = _int8(B, G, m + spare, D, seed=11)
    q = torch.randn(B, G, hq, D, generator=g)
    length = torch.tensor([m] + [max(1, m // 2)] * (B - 1))
    estimate = int8_key_estimate_reference(q, codes, side, SCALING, length=length)
    threshold = estimate.masked_fill(torch.isinf(estimate), float("nan")).nanquantile(0.9, dim=-1) - 1
    pages = -(-(m + spare) // page_rows) + 2  # a buffer may hold more page slots than the rows need
    for page_live in (torch.rand(B, G, pages, generator=g) < 0.6, torch.ones(B, G, pages, dtype=torch.bool),
                      torch.zeros(B, G, pages, dtype=torch.bool)):
        counter, ref_counter = torch.tensor(3), torch.tensor(3)
        scanned, ref_scanned = torch.tensor(100), torch.tensor(100)
        got = int8_choose(q, codes, side, threshold, j, m + spare + 2, SCALING, length=length, counter=counter,
                          page_live=page_live, page_rows=page_rows, scanned=scanned)
        want = int8_choose_reference(q, codes, side, threshold, j, m + spare + 2, SCALING, length=length,
                                     counter=ref_counter, page_live=page_live, page_rows=page_rows,
                                     scanned=ref_scanned)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert int(counter) == int(ref_counter) == 3 + int(got[2])
        idx, picked, _ = got
        read = page_rows_live(page_live, page_rows, m + spare) & (torch.arange(m + spare) < length.view(B, 1, 1))
        assert int(scanned) == int(ref_scanned) == 100 + int(read.sum()) * (D + 6)
        read = torch.nn.functional.pad(read, (0, 2))  # the staging's sentinel rows (never picked)
        assert read.gather(2, idx)[picked].all()  # every row kept lies in a live page, below its length


@settings(max_examples=40, deadline=None)
@given(m=st.integers(8, 120), page_rows=st.sampled_from([1, 4, 16]), j=st.integers(1, 8), hq=st.sampled_from([1, 3]),
       native=st.booleans(), seed=st.integers(0, 2**16))
def test_pruned_choice_equals_the_unpruned_one_when_no_skipped_row_ranks(m, page_rows, j, hq, native, seed):
    """Dead pages (any, here) that hold no row of any head's top ``j``: the pruned choice is the unpruned one, row for
    row; and whatever the dead pages, a row the unpruned rule keeps whose exact score is above the floor is kept."""
    if native and cpu_native.toolchain_missing() is not None:
        return
    choose = int8_choose if native else int8_choose_reference
    B, G, D = 2, 2, 16
    keys, codes, side, g = _int8(B, G, m, D, seed)
    q = torch.randn(B, G, hq, D, generator=g)
    estimate = int8_key_estimate_reference(q, codes, side, SCALING)
    floor = estimate.quantile(0.5, dim=-1) + torch.randn(B, G, hq, generator=g)
    j = min(j, m)
    idx, picked, count = choose(q, codes, side, floor, j, m, SCALING)
    pages = -(-m // page_rows)
    ranked = torch.zeros(B, G, m, dtype=torch.bool).scatter_(2, estimate.topk(j, -1).indices.flatten(2), True)
    ranked_pages = torch.nn.functional.pad(ranked, (0, pages * page_rows - m)).view(B, G, pages, page_rows).any(-1)
    page_live = ranked_pages | (torch.rand(B, G, pages, generator=g) < 0.3)  # the rest dead
    pruned = choose(q, codes, side, floor, j, m, SCALING, page_live=page_live, page_rows=page_rows)
    assert torch.equal(pruned[0], idx) and torch.equal(pruned[1], picked) and int(pruned[2]) == int(count)
    # any dead pages: every kept row that scores above the floor stays kept (the skipped ones score below it)
    live = int8_page_live(q, *_summary_of(keys, page_rows), floor, SCALING)
    pruned = choose(q, codes, side, floor, j, m, SCALING, page_live=live, page_rows=page_rows)
    exact = SCALING * torch.einsum("bghd,bgmd->bghm", q, keys)
    above = (exact > floor[..., None]).any(2)  # [B, G, m]
    kept = _kept(idx, picked, m) & above
    assert (kept <= _kept(*pruned[:2], m)).all()


def _summary_of(keys, page_rows):
    state = _pruned_index(keys, torch.ones(keys.shape[:3], dtype=torch.bool), page_rows, [keys.shape[2]])
    return state.pages.get("codes"), state.pages.get("scale"), state.pages.get("empty")


def _kept(idx, picked, m):
    B, G = idx.shape[:2]
    return torch.zeros(B, G, m + 1, dtype=torch.bool).scatter_(2, torch.where(picked, idx, m), True)[..., :m]


def test_a_kept_rows_bound_is_the_rule_s():
    """The reference's pruned rows are never kept: their estimate is -inf, so is their bound (even an inf norm)."""
    _, codes, side, g = _int8(1, 1, 4, 8, seed=2)
    side[..., 2] = float("inf")
    q = torch.randn(1, 1, 1, 8, generator=g)
    bound = int8_bound_from(torch.full((1, 1, 1, 4), float("-inf")), q, side[:, :, None], SCALING)
    assert not (bound > -1e30).any()
    out = int8_choose_reference(q, codes, side, torch.full((1, 1, 1), -1e30), 2, 4, SCALING,
                                page_live=torch.tensor([[[False, True]]]), page_rows=2)
    assert set(out[0][out[1]].tolist()) <= {2, 3}


# --- bad inputs --------------------------------------------------------------------------------------------------


def _bad_inputs():
    _, codes, side, g = _int8(1, 2, 40, 16, seed=1)
    q = torch.randn(1, 2, 3, 16, generator=g)
    thr = torch.zeros(1, 2, 3)
    live = torch.ones(1, 2, 10, dtype=torch.bool)
    return q, codes, side, thr, live, [
        ({"page_rows": 4}, "page_rows=4 without page_live"),
        ({"page_live": live, "page_rows": 0}, "page_rows must be"),
        ({"page_live": live.to(torch.uint8), "page_rows": 4}, "page_live must be"),
        ({"page_live": live[:, :, :9], "page_rows": 4}, r"page_live must be .*p >= ceil\(m / page_rows\) = 10"),
        ({"page_live": live[:, :1], "page_rows": 4}, "page_live must be"),
        ({"page_live": live, "page_rows": 4, "scanned": torch.zeros(2, dtype=torch.long)}, "scanned must be"),
        ({"page_live": live, "page_rows": 4, "scanned": torch.zeros((), dtype=torch.int32)}, "scanned must be"),
    ]


def test_the_reference_refuses_bad_pruning_inputs():
    q, codes, side, thr, _, bad = _bad_inputs()
    for change, message in bad:
        if "scanned" in change:
            continue  # the reference adds to any tensor; the op's check below
        with pytest.raises(ValueError, match=message):
            int8_choose_reference(q, codes, side, thr, 4, 40, SCALING, **change)


@needs_compiler
def test_the_op_refuses_bad_pruning_inputs_before_reading():
    ops = cpu_native.library()
    q, codes, side, thr, _, bad = _bad_inputs()
    for change, message in bad:
        args = {"page_live": None, "page_rows": 0, "scanned": None, **change}
        with pytest.raises(ValueError, match=r"kvzoo::int8_choose: .*" + message):
            ops.int8_choose(q, codes, side, None, thr, 4, 40, SCALING, SKETCH_SLACK, None, args["page_live"],
                            args["page_rows"], args["scanned"])


def _page_inputs():
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(1, 2, 40, 16, generator=g)
    state = _pruned_index(keys, torch.ones(1, 2, 40, dtype=torch.bool), 4, [40])
    pages = state.pages
    return (torch.randn(1, 2, 3, 16, generator=g), pages.get("codes"), pages.get("scale"), pages.get("empty"),
            torch.tensor([7]), torch.zeros(1, 2, 3))


@needs_compiler
def test_the_page_flags_op_refuses_bad_inputs_before_reading():
    ops = cpu_native.library()
    args = _page_inputs()
    q, codes, scale, empty, length, thr = args
    bad = [
        ({1: codes[..., :16]}, r"codes must have shape \[1, 2, 10, 32\]"),
        ({2: scale.double()}, "scale must be Float"),
        ({3: empty.to(torch.uint8)}, "empty must be Bool"),
        ({3: empty[:, :, :9]}, r"empty must have shape \[1, 2, 10\]"),
        ({5: thr[..., :2]}, r"threshold must have shape \[1, 2, 3\]"),
        ({5: thr.long()}, "threshold must be a float tensor"),
        ({4: torch.tensor([1, 2])}, r"length must have shape \[1\]"),
        ({0: q[..., :12], 1: codes[..., :24]}, "a multiple of 8"),
        ({1: codes.transpose(2, 3).contiguous().transpose(2, 3)}, "codes need each group's pages contiguous"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=r"kvzoo::int8_page_live: .*" + message):
            ops.int8_page_live(*(change.get(i, a) for i, a in enumerate(args)), SCALING, 0.0025)


@needs_compiler
def test_the_extended_ops_pass_opcheck():
    """Their schemas (``scanned`` declared mutated), Meta impls and AOT dispatch."""
    ops = cpu_native.library()
    q, codes, side, thr, live, _ = _bad_inputs()
    args = (q, codes, side, torch.tensor([33]), thr, 4, 40, SCALING, SKETCH_SLACK, torch.tensor(0), live, 4,
            torch.tensor(0))
    result = torch.library.opcheck(ops.int8_choose, args)
    assert set(result.values()) == {"SUCCESS"}, result
    q, codes, scale, empty, length, thr = _page_inputs()
    result = torch.library.opcheck(ops.int8_page_live, (q, codes, scale, empty, length, thr, SCALING, 0.0025))
    assert set(result.values()) == {"SUCCESS"}, result


def test_prune_options_are_checked():
    with pytest.raises(ValueError, match="prune=True has no effect with certified=True"):
        VestigeRetriever(prune=True, certified=True)
    with pytest.raises(ValueError, match="prune=True has no effect"):
        VestigeRetriever(prune=True, rank_by="bound")
    with pytest.raises(ValueError, match="prune=True has no effect with index='sketch'"):
        VestigeRetriever(prune=True, index="sketch")
    with pytest.raises(ValueError, match="page_rows=8 has no effect with index='int8'"):
        VestigeRetriever(index="int8", page_rows=8)
    with pytest.raises(ValueError, match=r"prune=True has no effect with index='sketch' \(index='auto' on MLA rows\)"):
        VestigeRetriever(prune=True).new_state(RowGeometry("mla", 512, 64))
    with pytest.raises(ValueError, match="prune must be True or False|certified, refit and prune"):
        VestigeRetriever(prune=1)
    assert isinstance(VestigeRetriever(prune=True, page_rows=8).new_state(RowGeometry("gqa", 0)), Int8KeyIndex)


# --- a decode step ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [None, 260])
def test_a_pruned_decode_step_skips_pages_certifiably_and_counts_what_it_read(capacity):
    """Tiny Llama, VestigeKV 4x with the floor at s* (``j_margin=0``: pages do die): the audit finds no skipped row
    above the floor and every page bound above its rows; the same tokens as the unpruned index; the bytes the steps
    read (counted on the device) are what ``stats()`` reports, less than the page summaries plus every entry."""
    model = tiny_llama()[0]
    ids = torch.randint(3, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    runs = {}
    for prune in (False, True):
        retriever = registry.build_retriever("vestige", index="int8", prune=prune, j_margin=0.0,
                                             **({"page_rows": 4} if prune else {}))
        cache = TieredCache(model, registry.get("vestige", budget=32, retriever=retriever), capacity=capacity,
                            audit=True)
        steps, logits = [], []
        with torch.no_grad():
            token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            cache.compress()
            for _ in range(10):
                out = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
                logits.append(out[0])
                token = out.argmax(-1, keepdim=True)
                steps.append(sum(layer.last_step["index_bytes_scanned"] for layer in cache.stats().layers))
        runs[prune] = (torch.stack(logits), cache.stats().totals, steps, cache)
    (plain_logits, _, plain_steps, _), (logits, pruned, steps, cache) = runs[False], runs[True]
    assert_same_greedy(plain_logits.argmax(-1), logits.argmax(-1), plain_logits, logits)
    assert pruned["pruning_violations"] == 0 and pruned["page_bound_violations"] == 0
    assert pruned["pruning_audited"] > 10_000 and pruned["pages_skipped"] > 0
    assert pruned["pages_skipped"] <= pruned["pages_prunable"]
    layers = cache.tiered_layers
    counted = sum(int(layer.counts.index_bytes_counted) for layer in layers)
    host = sum(layer.counts.index_bytes_scanned for layer in layers)  # scans by scan_cost: none in decode steps
    assert counted > 0 and pruned["index_bytes_scanned"] == counted + host
    # a step reads its page summaries (every slot of a fixed index) and the live pages' entries
    index = layers[0].store.archive.index
    B, G = 1, index.groups
    whole = B * G * (index.summary.entries() * index.page_bytes + index.rows.n * index.entry_bytes)
    assert all(0 < s for s in steps) and steps[-1] < len(layers) * whole  # some entries were not read
    assert plain_steps[-1] == len(layers) * B * G * index.rows.n * index.entry_bytes  # unpruned: every entry
