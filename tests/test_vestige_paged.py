"""Issue 25: the paged index (``index="paged"``) -- a coarse int8 page summary scanned first, then the int8 entries of
the top pages' rows -- keeps the certificate (every page bound covers its rows' exact scores), is the same however
the rows arrive, and cuts the bytes a decode step scans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzoo.framework.retrieval import ArchiveView, RowGeometry
from kvzoo.kernels.index_scan import exact_scores, int8_page_bounds, int8_page_entries
from kvzoo.retrievers.int8 import Int8KeyIndex
from kvzoo.retrievers.paged import PagedKeyIndex
from kvzoo.retrievers.vestige import VestigeRetriever


def _paged(capacity=None, **options) -> PagedKeyIndex:
    state = VestigeRetriever(index="paged", **options).new_state(RowGeometry("gqa", 0, capacity=capacity))
    assert isinstance(state, PagedKeyIndex)
    return state


def _feed(state, keys, valid, chunks):
    start = 0
    for k in chunks:
        state.index({"keys": keys[:, :, start : start + k], "valid": valid[:, :, start : start + k]}, None, None)
        start += k


def _page_best(exact, valid, size):
    """Each page's best exact score over its valid rows ``[B, H, q, pages]`` (-inf for a page of padding only)."""
    B, H, q, m = exact.shape
    G = valid.shape[1]
    ok = valid[:, :, None, None].expand(B, G, H // G, q, m).reshape(B, H, q, m)
    pages = -(-m // size)
    padded = exact.new_full((B, H, q, pages * size), float("-inf"))
    padded[..., :m] = exact.masked_fill(~ok, float("-inf"))
    return padded.view(B, H, q, pages, size).amax(-1)


@settings(max_examples=60, deadline=None)
@given(pages=st.integers(1, 6), size=st.sampled_from([1, 4, 16]), D=st.sampled_from([3, 16, 64]),
       magnitude=st.floats(1e-6, 300.0), offset=st.floats(-5.0, 5.0), seed=st.integers(0, 2**16))
def test_page_codes_cover_every_key_and_bound_it(pages, size, D, magnitude, offset, seed):
    """``scale * codes`` brackets every key of its page exactly; the page bound >= every key's exact score."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(1, 2, pages, size, D, generator=g) + offset) * magnitude
    lo, hi = keys.amin(3), keys.amax(3)
    codes, scale = int8_page_entries(lo, hi)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert (codes[..., :D].float() * scale[..., None] >= hi).all()
    assert (codes[..., D:].float() * scale[..., None] <= lo).all()
    query = torch.randn(1, 2, 3, D, generator=g) * 3
    bound = int8_page_bounds(query, codes, scale, 0.125)  # [1, 2, 3, pages]
    exact = (0.125 * torch.einsum("bghd,bgpkd->bghpk", query, keys)).amax(-1)
    assert (bound >= exact).all()


def test_empty_and_infinite_pages():
    lo = torch.tensor([[[[float("inf")] * 4, [1.0, 2, 3, 4], [0.0, 0, 0, float("-inf")]]]])
    hi = torch.tensor([[[[float("-inf")] * 4, [2.0, 2, 3, 5], [0.0, 0, 0, 1.0]]]])
    codes, scale = int8_page_entries(lo, hi)
    bound = int8_page_bounds(torch.randn(1, 1, 2, 4), codes, scale, 1.0, length=torch.tensor([3]))
    assert torch.isinf(scale[0, 0, 2]) and (bound[..., 2] == float("inf")).all()  # an infinite key: +inf
    assert torch.isfinite(bound[..., :2]).all()
    assert (int8_page_bounds(torch.randn(1, 1, 1, 4), codes, scale, 1.0, length=torch.tensor([1]))[..., 1:]
            == float("-inf")).all()  # past the length: never a page


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=6), size=st.sampled_from([4, 16]),
       fixed=st.booleans(), pad=st.booleans(), seed=st.integers(0, 2**16))
def test_summaries_do_not_depend_on_how_rows_arrive(chunks, size, fixed, pad, seed):
    """Rows indexed in any chunks (single rows on a fixed index take the device path) give the summaries of all the
    rows indexed at once, and every page bound covers its rows; padding rows never widen a page."""
    g = torch.Generator().manual_seed(seed)
    m = sum(chunks)
    keys = torch.randn(2, 2, m, 8, generator=g) * 4
    valid = torch.ones(2, 2, m, dtype=torch.bool)
    if pad:
        valid[1, :, : m // 2] = False
        keys[1, :, : m // 2] = 1e4  # padding: huge keys that must not widen any page
    capacity = m + 5 if fixed else None
    whole, parts = _paged(capacity, page_rows=size), _paged(capacity, page_rows=size)
    _feed(whole, keys, valid, [m])
    _feed(parts, keys, valid, chunks)
    pages = -(-m // size)
    for name in ("codes", "scale", "empty"):
        assert torch.equal(whole.pages.reading(name)[:, :, :pages], parts.pages.reading(name)[:, :, :pages]), name
    assert int(parts.pages.length) == pages and parts.summary.rows == m
    query = torch.randn(2, 4, 2, 8, generator=g)
    bound = parts.bounds(query, 0.5)[..., :pages]
    best = _page_best(exact_scores(query, keys, 0.5), valid, size)
    assert (bound >= best).all()
    if pad:  # a page of padding only is never scanned as a page
        assert (bound[1][torch.isinf(best[1])] == float("-inf")).all()
        assert (bound[1] < 1e3).all()


def test_choose_finds_a_planted_row_and_reads_fewer_bytes():
    """The row a query aligns with comes back through its page; a step scans pages + a few pages' rows."""
    g = torch.Generator().manual_seed(0)
    m, D = 640, 64
    keys = torch.randn(1, 3, m, D, generator=g)
    planted = 421
    query = torch.randn(1, 9, 1, D, generator=g)
    keys[0, 1, planted] = query[0, 4, 0] * 2  # head 4 is in group 1
    valid = torch.ones(1, 3, m, dtype=torch.bool)
    state = _paged()
    _feed(state, keys, valid, [100, 540])
    best = exact_scores(query, keys, 0.125).amax(-1) - 1.0
    choice = state.choose(query, best, 0.125, ArchiveView(rows=m))
    chosen = choice.rows[0, 1][choice.ok[0, 1]]
    assert planted in chosen.tolist()
    assert choice.rows.shape == (1, 3, 3 * 16)  # j per head, each row of the group's union flagged once
    flat = VestigeRetriever(index="int8").new_state(RowGeometry("gqa", 0))
    _feed(flat, keys, valid, [640])
    assert state.scan_cost(3)[1] == 40 * (2 * D + 5) + 3 * 4 * 16 * (D + 6)  # 40 pages, then 4 pages per head
    assert state.scan_cost(3)[1] < flat.scan_cost(3)[1] / 2 == m * (D + 6) / 2


def test_options_and_layouts():
    with pytest.raises(ValueError, match="page_rows"):
        VestigeRetriever(index="paged", page_rows=0)
    with pytest.raises(ValueError, match="fine_pages"):
        VestigeRetriever(index="paged", fine_pages=0)
    with pytest.raises(ValueError, match="GQA rows"):
        VestigeRetriever(index="paged").new_state(RowGeometry("mla", 512, 64))
    assert type(VestigeRetriever(index="int8").new_state(RowGeometry("gqa", 0))) is Int8KeyIndex


def test_beam_reordering_follows_the_pages():
    keys = torch.randn(2, 1, 20, 8)
    valid = torch.ones(2, 1, 20, dtype=torch.bool)
    state = _paged(page_rows=8)
    _feed(state, keys, valid, [13])
    state.select_batch(torch.tensor([1, 1]))
    _feed(state, keys[[1, 1]][:, :, 13:], valid[:, :, 13:], [7])  # the open page grows on the kept beam's summary
    alone = _paged(page_rows=8)
    _feed(alone, keys[[1, 1]], valid, [20])
    assert torch.equal(state.pages.get("codes"), alone.pages.get("codes"))
    state.repeat_batch(2)
    assert state.pages.get("codes").shape[0] == 4 and state.summary.open_min.shape[0] == 4


def test_certified_mode_reads_every_row_as_the_int8_index_does():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 90, 16, generator=g)
    valid = torch.ones(1, 2, 90, dtype=torch.bool)
    paged, flat = _paged(certified=True), VestigeRetriever(index="int8", certified=True).new_state(RowGeometry("gqa", 0))
    _feed(paged, keys, valid, [50, 40])
    _feed(flat, keys, valid, [90])
    query = torch.randn(1, 4, 1, 16, generator=g)
    best = exact_scores(query, keys, 0.25).amax(-1) - 2.0
    mask = paged.choose(query, best, 0.25, ArchiveView(rows=90)).ok
    assert mask.shape == (1, 2, 90) and torch.equal(mask, flat.choose(query, best, 0.25, ArchiveView(rows=90)).ok)
    assert paged.scan_cost(2)[1] == flat.scan_cost(2)[1] == 90 * 22
