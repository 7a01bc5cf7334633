"""Issue 25: the sketch retriever's top-j rule ranks by the bound's estimate; fp16 sketch entries and int8 key
entries stay certified (bound >= exact score)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzoo.framework.retrieval import ArchiveView, RowGeometry
from kvzoo.kernels.index_scan import exact_scores
from kvzoo.retrievers.vestige import VestigeRetriever


def _archive(keys):
    B, G, m = keys.shape[:3]
    return ArchiveView(keys, torch.arange(m).expand(B, G, m), torch.ones(B, G, m, dtype=torch.bool), None)


def _index(keys, layout, dc, **options):
    dr = keys.shape[-1] - dc if layout == "mla" else 0
    state = VestigeRetriever(**options).new_state(RowGeometry(layout, dc if layout == "mla" else 0, dr))
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), _archive(keys[:, :, :0]))
    return state


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["gqa", "mla"]), m=st.integers(1, 50), dc=st.integers(2, 40), dr=st.integers(1, 12),
       rank=st.integers(1, 40), groups=st.sampled_from([1, 2]), hpg=st.sampled_from([1, 3]),
       magnitude=st.floats(1e-6, 300.0), dtype=st.sampled_from(["float32", "float16", "int8"]),
       seed=st.integers(0, 2**16))
def test_bound_upper_bounds_exact_score(layout, m, dc, dr, rank, groups, hpg, magnitude, dtype, seed):
    """The certificate: every row's bound >= its exact score -- sketch entries in fp32 or fp16, int8 key entries
    (GQA) -- keys tiny to large; the estimate never above the bound."""
    if dtype == "int8" and layout == "mla":
        layout = "gqa"
    g = torch.Generator().manual_seed(seed)
    width = dc + (dr if layout == "mla" else 0)
    keys = torch.randn(1, groups, m, width, generator=g) * magnitude
    keys[..., 0] += magnitude  # a shared direction, as RoPE-free key dims carry
    options = {"index": "int8"} if dtype == "int8" else {"index": "sketch", "entry_dtype": dtype, "rank": min(rank, dc)}
    state = _index(keys, layout, dc, **options)
    query = torch.randn(1, groups * hpg, 2, width, generator=g) * 3
    bound = state.bounds(query, 0.125)
    if dtype != "int8":
        assert state.rows.get("entries").dtype == (torch.float16 if dtype == "float16" else torch.float32)
    assert (bound >= exact_scores(query, keys, 0.125)).all()
    _, estimate = state.bounds_and_estimates(query, 0.125)
    assert (estimate <= bound + 1e-3 * bound.abs().clamp(min=1)).all()


def test_fp16_entries_halve_the_index_bytes():
    keys = torch.randn(1, 1, 20, 64)
    half = _index(keys, "gqa", 64, index="sketch", entry_dtype="float16")
    assert half.entry_bytes * 2 == _index(keys, "gqa", 64, index="sketch").entry_bytes == (16 + 2) * 4
    assert _index(keys, "gqa", 64).entry_bytes == 64 + 3 * 2  # the GQA default: int8 codes + fp16 scale, err, norm


def test_estimate_is_the_in_span_score():
    """The estimate is scale * (<V^T q, z> (+ <q_r, r> on MLA)): at full rank it is the exact score."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 30, 24, generator=g)
    query = torch.randn(1, 2, 1, 24, generator=g)
    for layout, dc in (("gqa", 24), ("mla", 16)):
        state = _index(keys, layout, dc, rank=dc, index="sketch")
        _, estimate = state.bounds_and_estimates(query, 0.5)
        torch.testing.assert_close(estimate, exact_scores(query, keys, 0.5), atol=1e-4, rtol=1e-4)


def test_estimate_rule_picks_what_the_bound_rule_misses():
    """A toy where the Cauchy-Schwarz term dominates: rows with a large out-of-span part have the highest bounds,
    the row the query really aligns with (in span) has the highest estimate and the highest exact score. The bound
    rule fetches the wrong rows, the estimate rule the right one; both only rows whose bound beats s*."""
    dc, m = 8, 15
    keys = torch.zeros(1, 1, m, dc)
    keys[0, 0, 0, 0] = 5.0  # row 0: the query's row, in span
    keys[0, 0, 1:8, 0] = 3.0  # rows 1-7 in span too: the basis (rank 1) is e0
    for u in range(8, m):  # rows 8-14: one large out-of-span coordinate each
        keys[0, 0, u, u - 7] = 7.0
    query = torch.zeros(1, 1, 1, dc)
    query[0, 0, 0, 0] = 1.0
    query[0, 0, 0, 1:] = 0.3
    exact = exact_scores(query, keys, 1.0)[0, 0, 0]
    assert int(exact.argmax()) == 0
    s_star = torch.full((1, 1, 1), -100.0)
    picks = {}
    for rank_by in ("bound", "estimate"):
        state = _index(keys, "gqa", dc, rank=1, j=1, rank_by=rank_by, index="sketch", j_margin=0.0)
        picks[rank_by] = state.choose(query, s_star, 1.0, _archive(keys)).as_mask(m)[0, 0].nonzero().flatten().tolist()
    assert picks["estimate"] == [0] and picks["bound"] != [0]


def test_estimate_rule_keeps_only_rows_whose_bound_beats_s_star():
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 1, 40, 16, generator=g)
    query = torch.randn(1, 1, 1, 16, generator=g)
    for margin in (0.0, 1.5):
        state = _index(keys, "gqa", 16, rank=4, j=8, index="sketch", j_margin=margin)
        bound = state.bounds(query, 1.0)[0, 0, 0]
        s_star = bound.sort(descending=True).values[2:4].mean().view(1, 1, 1)  # 2 rows' bounds beat it
        chosen = state.choose(query, s_star, 1.0, _archive(keys)).as_mask(40)[0, 0]
        passing = int((bound > s_star.flatten() - margin).sum())
        assert 0 < int(chosen.sum()) <= min(8, passing) and (bound[chosen] > s_star.flatten() - margin).all()


def test_adaptive_count_a_peaked_head_fetches_fewer(monkeypatch):
    """int8 keys (tight bound), j = 8, margin 2: a head with one dominant archived row fetches only the rows within 2
    logits of s*; a flat head fetches all 8 (each head asked alone); the PyTorch path and a CPU decode step's fused
    kernel stage the group's union of the same rows."""
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(1, 1, 50, 16, generator=g) * 0.1
    query = torch.zeros(1, 2, 1, 16)
    query[0, 0, 0, 0] = 30.0  # head 0 peaked on row 7
    query[0, 1, 0] = torch.randn(16, generator=g) * 0.01  # head 1 flat (no exact ties: their order is the op's own)
    keys[0, 0, 7, 0] = 1.0
    state = _index(keys, "gqa", 16, j=8, j_margin=2.0)
    s_star = exact_scores(query, keys, 1.0).amax(-1)  # the tier's best = the archive's best
    fused = state.choose(query, s_star, 1.0, _archive(keys))
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    choice = state.choose(query, s_star, 1.0, _archive(keys))
    alone = [state.choose(query[:, h : h + 1], s_star[:, h : h + 1], 1.0, _archive(keys)) for h in range(2)]
    assert int(alone[0].ok.sum()) == 1 and int(alone[1].ok.sum()) == 8
    assert torch.equal(choice.as_mask(50), alone[0].as_mask(50) | alone[1].as_mask(50))
    assert torch.equal(fused.as_mask(50), choice.as_mask(50))


def test_options_are_checked():
    with pytest.raises(ValueError, match="rank_by"):
        VestigeRetriever(rank_by="exact")
    with pytest.raises(ValueError, match="entry_dtype"):
        VestigeRetriever(entry_dtype="int8")
    with pytest.raises(ValueError, match="j_margin"):
        VestigeRetriever(j_margin=-1.0)
    with pytest.raises(ValueError, match="overflow fp16"):
        _index(torch.full((1, 1, 4, 8), 1e6), "gqa", 8, index="sketch", entry_dtype="float16")
    with pytest.raises(ValueError, match="index"):
        VestigeRetriever(index="pq")
    with pytest.raises(ValueError, match="GQA rows"):
        _index(torch.randn(1, 1, 4, 24), "mla", 16, index="int8")


def test_int8_estimate_ranks_like_exact_and_certified_mode_is_sound():
    """int8 keys: the estimate's top rows are the exact top rows on well-separated scores; the certified rule
    (bound >= s* - tau) fetches every row whose exact score is >= s* - tau."""
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(1, 2, 64, 32, generator=g)
    query = torch.randn(1, 4, 1, 32, generator=g)
    state = _index(keys, "gqa", 32, j=4)
    exact = exact_scores(query, keys, 0.3)
    _, estimate = state.bounds_and_estimates(query, 0.3)
    assert (estimate - exact).abs().max() < 0.05 * exact.abs().max()
    s_star = exact.amax(-1) - 1.0  # [1, 4, 1]
    cert = _index(keys, "gqa", 32, certified=True, tau=0.5)
    mask = cert.choose(query, s_star, 0.3, _archive(keys)).as_mask(64)  # [1, 2, 64]
    need = (exact >= (s_star - 0.5)[..., None]).view(1, 2, 2, 64).any(2)
    assert (mask | ~need).all() and need.any()
