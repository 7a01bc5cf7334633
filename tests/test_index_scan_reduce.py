"""The index scans' PyTorch references (kvzoo/kernels/index_scan.py), on CPU without Triton: the scan is the
one kvzoo always computed, bit for bit; the reduced scan selects exactly what the per-head rules select."""

from __future__ import annotations

import pytest
import torch

from kvzoo.framework.retrieval import ArchiveView, RowGeometry
from kvzoo.kernels import index_scan as ix
from kvzoo.kernels.index_scan import (
    index_scan,
    index_scan_reduce,
    index_scan_reduce_reference,
    index_scan_reference,
)
from kvzoo.retrievers.quest import PageIndex, QuestRetriever
from kvzoo.retrievers.sketch import SketchIndex
from kvzoo.retrievers.vestige import VestigeRetriever


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("KVZOO_KERNELS", raising=False)


def _rows(B, G, hq, m, W, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, G, hq, W, generator=g), (torch.randn(B, G, m, W, generator=g) * 2).to(dtype)


def _scan_before_length(query_rows, entries, scaling):
    """index_scan as it was before the kernels (the code of the first release)."""
    B, G, hq, W = query_rows.shape
    m = entries.shape[2]
    q = query_rows.float()
    if entries.dtype == torch.float32:
        out = torch.matmul(q, entries.transpose(-1, -2))
    else:
        out = q.new_empty(B, G, hq, m)
        for start, stop in ix._row_blocks(m, B * G * W):
            out[..., start:stop] = torch.matmul(q, entries[:, :, start:stop].float().transpose(-1, -2))
    return out.mul_(scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", [1 << 22, 3000], ids=["one-block", "many-blocks"])
def test_the_scan_on_cpu_is_bit_for_bit_the_first_release(monkeypatch, dtype, block):
    monkeypatch.setattr(ix, "ROW_BLOCK_ELEMENTS", block)

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran on CPU in auto mode")

    monkeypatch.setattr(ix, "index_scan_triton", refuse)
    q, entries = _rows(2, 3, 5, 201, 49, dtype, seed=1)
    assert torch.equal(index_scan(q, entries, 0.3), _scan_before_length(q, entries, 0.3))


def test_length_gives_minus_inf_past_each_sequence():
    q, entries = _rows(3, 2, 4, 30, 17)
    out = index_scan(q, entries, 1.0, length=torch.tensor([0, 12, 99]))
    full = index_scan(q, entries, 1.0)
    assert torch.isneginf(out[0]).all() and torch.isneginf(out[1, ..., 12:]).all()
    assert torch.equal(out[1, ..., :12], full[1, ..., :12]) and torch.equal(out[2], full[2])


@pytest.mark.parametrize("block", [1 << 22, 500], ids=["one-block", "many-blocks"])
def test_reduce_is_bound_minus_threshold_maxed_over_query_rows(monkeypatch, block):
    monkeypatch.setattr(ix, "ROW_BLOCK_ELEMENTS", block)
    q, entries = _rows(2, 2, 6, 150, 33, seed=2)
    threshold = torch.randn(2, 2, 6, generator=torch.Generator().manual_seed(3)) * 4
    bounds = index_scan(q, entries, 0.7)
    margin = index_scan_reduce(q, entries, 0.7, threshold)
    assert torch.equal(margin, (bounds - threshold[..., None]).amax(2))
    assert torch.equal(index_scan_reduce(q, entries, 0.7, None), bounds.amax(2))
    assert 0 < int((margin >= 0).sum()) < margin.numel()  # the thresholds cut through the bounds


def test_reduce_selects_exactly_the_per_head_rule_with_ties_infinities_and_nan():
    B, G, hq, m, W = 2, 2, 4, 40, 9
    g = torch.Generator().manual_seed(4)
    q = torch.rand(B, G, hq, W, generator=g) + 0.1
    q[..., -1] = 0.0
    entries = torch.randn(B, G, m, W, generator=g)
    entries[:, :, 3, :-1] = float("-inf")  # bound -inf
    entries[:, :, 4, :-1] = float("inf")  # bound +inf
    entries[:, :, 5, -1] = float("inf")  # bound NaN
    bounds = index_scan(q, entries, 0.5)
    threshold = bounds[..., 7].clone()  # ties on row 7
    threshold[0, 0, 2] = float("-inf")
    threshold[0, 1] = float("inf")
    threshold[1, 1, 0] = float("nan")
    margin = index_scan_reduce(q, entries, 0.5, threshold)
    per_head = (bounds >= threshold[..., None]).any(2)
    assert torch.equal(margin >= 0, per_head)
    assert per_head[0, 0, 3] and margin[0, 0, 3] == 0  # -inf >= -inf: chosen, margin 0 (not NaN)
    assert per_head[0, 1].tolist() == [i == 4 for i in range(m)] and margin[0, 1, 4] == 0  # inf >= inf only
    assert torch.isneginf(margin[..., 5]).all() and not torch.isnan(margin).any()
    # past length: never selected, even by a -inf threshold
    cut = index_scan_reduce(q, entries, 0.5, threshold, length=torch.tensor([3, 40]))
    assert torch.isneginf(cut[0, :, 3:]).all() and torch.equal(cut[0, :, :3], margin[0, :, :3])
    assert torch.equal(cut[1], margin[1])


def test_reduce_with_no_query_rows_selects_nothing():
    q, entries = _rows(1, 2, 0, 7, 5)
    assert torch.isneginf(index_scan_reduce(q, entries, 1.0, None)).all()


def _archive(keys, budget=None):
    B, G, m = keys.shape[:3]
    return ArchiveView(keys, torch.arange(m).expand(B, G, m), torch.ones(B, G, m, dtype=torch.bool), budget)


@pytest.mark.parametrize("tau", [0.0, 1.0, 8.0])
def test_vestige_certified_rule_through_the_reduction_is_the_policys(tau):
    """SketchIndex.choose's certified mask == index_scan_reduce(s* - tau) >= 0 (the integration of the report)."""
    g = torch.Generator().manual_seed(5)
    B, G, H, q_len, m, dc, dr = 2, 1, 4, 2, 90, 24, 8
    cfg = VestigeRetriever(rank=20, certified=True, tau=tau)
    state = SketchIndex(cfg, RowGeometry("mla", dc, dr))
    keys = torch.randn(B, G, m, dc + dr, generator=g)
    valid = torch.ones(B, G, m, dtype=torch.bool)
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), _archive(keys[:, :, :0]))
    query = torch.randn(B, H, q_len, dc + dr, generator=g)
    best = ix.exact_scores(query, keys, 0.2).amax(-1) - 0.3  # s* per head and query [B, H, q]
    mask = state.choose(query, best, 0.2, _archive(keys)).as_mask(m)
    rows = ix.sketch_query(query[..., :dc], query[..., dc:], state.basis)
    threshold = (best - tau).reshape(B, G, (H // G) * q_len)
    margin = index_scan_reduce(rows, state.rows.get("entries"), 0.2, threshold)
    assert torch.equal(margin >= 0, mask) and mask.any()
    assert tau > 1 or not mask.all()  # small margins leave rows out: the comparison is not vacuous


def test_quest_group_rule_through_the_reduction_is_the_policys():
    """PageIndex's gqa="group" page scores (empty pages masked) == index_scan_reduce(None), for decode."""
    g = torch.Generator().manual_seed(6)
    B, G, H, D, m = 2, 2, 6, 16, 150
    state = PageIndex(QuestRetriever(page_size=16, gqa="group"))
    keys = torch.randn(B, G, m, D, generator=g)
    valid = torch.ones(B, G, m, dtype=torch.bool)
    valid[0, 1, 32:48] = False  # a page of padding only: empty in (0, 1)
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), _archive(keys[:, :, :0]))
    assert state.pages.get("empty")[0, 1, 2]
    query = torch.randn(B, H, 1, D, generator=g)
    scores = state.bounds(query, 0.9).view(B, G, H // G, 1, -1).amax(dim=2)[:, :, 0]  # [B, G, p]
    margin = index_scan_reduce(ix.page_query(query, G), state.pages.get("entries"), 0.9, None)
    assert torch.equal(margin, scores) and torch.isneginf(margin[0, 1, 2])
    assert torch.equal(margin.topk(4, dim=-1).indices, scores.topk(4, dim=-1).indices)


def test_dispatch_takes_the_reference_when_told(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(ix, "index_scan_triton", refuse)
    monkeypatch.setattr(ix, "index_scan_reduce_triton", refuse)
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    q, entries = _rows(1, 1, 2, 5, 3)
    assert torch.equal(index_scan(q, entries, 1.0), index_scan_reference(q, entries, 1.0))
    assert torch.equal(index_scan_reduce(q, entries, 1.0, None), index_scan_reduce_reference(q, entries, 1.0, None))


@pytest.mark.parametrize("call, message", [
    (lambda q, e: index_scan(q[0], e, 1.0), r"query_rows must be \[B, G, hq, W\] and entries \[B, G, m, W\]"),
    (lambda q, e: index_scan(q, e[..., :-1], 1.0), r"entries must be \[B, G, m, W\] = \[2, 3, m, 5\]"),
    (lambda q, e: index_scan(q, e.int(), 1.0), r"must be floating point .*got torch.float32 and torch.int32"),
    (lambda q, e: index_scan(q, e, 1.0, length=torch.tensor([1.0, 2.0])), r"length must be None or an int32/int64"),
    (lambda q, e: index_scan(q, e, 1.0, length=torch.tensor([1, 2, 3])), r"tensor \[B\] = \[2\] .*got torch.int64 \(3,\)"),
    (lambda q, e: index_scan_reduce(q, e, 1.0, torch.zeros(2, 3)), r"threshold must be None or a float tensor \[B, G, hq\] = \[2, 3, 4\]"),
    (lambda q, e: index_scan_reduce(q, e, 1.0, 0.0), r"threshold must be None or a float tensor .*got float"),
])
def test_bad_inputs_name_what_is_valid(call, message):
    q, entries = _rows(2, 3, 4, 6, 5)
    with pytest.raises((ValueError, TypeError), match=message):
        call(q, entries)
