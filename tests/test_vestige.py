"""VestigeKV: the branch-σ selector and the certified sketch retriever."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework.policy import RowsView
from kvzoo.framework.retrieval import ArchiveView, RowGeometry, build_retriever
from kvzoo.kernels.index_scan import exact_scores, index_scan, sketch_entries, sketch_query
from kvzoo.models import tiny_kimi_linear
from kvzoo.policies.vestige import branch_sigma
from kvzoo.retrievers.sketch import SketchIndex
from kvzoo.retrievers.vestige import VestigeRetriever


def dft_sigma(x: torch.Tensor, kappa: int) -> torch.Tensor:
    """σ with an explicit DFT matrix (float64): zero bins k and n-k for k < kappa, invert, row norms."""
    n = x.shape[0]
    k = torch.arange(n, dtype=torch.float64)
    F = torch.exp(-2j * math.pi * k[:, None] * k[None, :] / n)  # [n, n]
    X = F @ x.to(torch.complex128)
    low = (k < kappa) | ((n - k) < kappa) & (k > 0)  # a real signal's low bins and their mirrors
    X[low] = 0
    back = (F.conj() @ X / n).real
    return back.norm(dim=-1)


@pytest.mark.parametrize("n", [31, 64, 101])
@pytest.mark.parametrize("kappa", [0, 1, 3, 9])
def test_sigma_equals_explicit_dft(n, kappa):
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n + kappa), dtype=torch.float64)
    got = branch_sigma(x.float(), kappa)
    assert torch.allclose(got.double(), dft_sigma(x, kappa), atol=1e-4, rtol=1e-4)


def test_kappa_edges():
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(branch_sigma(x, 0), x.norm(dim=-1), atol=1e-5)  # kappa = 0: raw branch norm
    assert branch_sigma(x, 50 // 2 + 1).abs().max() < 1e-5  # kappa = all bins: σ == 0
    assert branch_sigma(x, 1000).abs().max() < 1e-5


def _mla_rows(n=200, seed=0, content=None):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, n, 576, generator=g)
    if content is not None:
        keys[..., :512] = content
    return RowsView(
        keys=keys, values=None, slots=torch.arange(n).view(1, 1, n), valid=torch.ones(1, 1, n, dtype=torch.bool),
        layer_idx=0, num_layers=1, layout="mla", branch_dim=64,
    )


def test_selector_reads_only_the_branch():
    policy = registry.get("vestige", ratio=4, retriever=None)
    clean = _mla_rows()
    poisoned = _mla_rows(content=float("nan"))  # the 512-dim content is never read
    keep = policy.target_rows("context_end", budget=policy.resolve_budget(200), resident=200, block_rows=200)
    assert keep == 50
    a, b = policy.select(clean, keep), policy.select(poisoned, keep)
    assert torch.equal(a, b)
    assert clean.info["selector_rows_read"] == 200 and clean.info["selector_bytes_read"] == 200 * 64 * 4


def test_selector_keeps_sinks_recent_and_top_sigma():
    rows = _mla_rows(n=100, seed=1)
    rows.keys[..., 512:] *= 0.01  # quiet branch everywhere ...
    loud = torch.tensor([20, 41, 63])
    rows.keys[0, 0, loud, 512:] = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 10
    policy = registry.get("vestige", budget=4 + 3 + 6, recent=6, retriever=None, kappa=0)
    kept = policy.select(rows, 13)[0, 0].tolist()
    assert kept == [0, 1, 2, 3, 20, 41, 63, *range(94, 100)]
    # kappa = all bins: σ == 0 everywhere, the ties go to the earliest rows
    flat = registry.get("vestige", budget=13, recent=6, retriever=None, kappa=10_000)
    assert flat.select(rows, 13)[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, *range(94, 100)]
    # the recent window is capped at half the block's keep, so σ always chooses at least half
    capped = registry.get("vestige", budget=13, recent=100, retriever=None, kappa=0)
    assert capped.select(rows, 13)[0, 0].tolist()[-6:] == list(range(94, 100))


def test_blocks_are_final_and_each_keeps_its_share():
    """Two closed blocks of 64 at ratio 8: 8 rows each, the first block's choice untouched by the second."""
    model, _ = tiny_kimi_linear()
    ids = torch.randint(3, 512, (1, 128), generator=torch.Generator().manual_seed(3))
    cache = TieredCache(model, registry.get("vestige", ratio=8, block_size=64, recent=2, retriever=None))
    with torch.no_grad():
        model(input_ids=ids[:, :64], cache=cache, use_cache=True)
        first = [layer.slots.clone() for layer in cache.tiered_layers]
        model(input_ids=ids[:, 64:], cache=cache, use_cache=True)
    for layer, before in zip(cache.tiered_layers, first):
        assert before.shape[-1] == 8 and layer.store.n == 16
        assert torch.equal(layer.slots[..., :8], before) and (layer.slots[..., 8:] >= 64).all()


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40), dc=st.integers(2, 48), dr=st.integers(0, 16), rank_frac=st.floats(0.0, 1.0),
    heads=st.sampled_from([1, 2, 4]), scale=st.floats(0.01, 3.0), seed=st.integers(0, 2**16),
)
def test_sketch_bound_is_sound(m, dc, dr, rank_frac, heads, scale, seed):
    """ŝ >= true score for every row, any orthonormal basis of any rank (bound includes its float slack)."""
    g = torch.Generator().manual_seed(seed)
    rank = max(1, round(rank_frac * dc))
    basis = torch.linalg.qr(torch.randn(dc, dc, generator=g, dtype=torch.float64))[0][:, :rank].float()[None]
    c = torch.randn(1, 1, m, dc, generator=g) * torch.rand(1, generator=g) * 10
    r = torch.randn(1, 1, m, dr, generator=g) if dr else None
    q = torch.randn(1, heads, 3, dc + dr, generator=g) * 5
    entries = sketch_entries(c, r, basis)  # [z, eta, r, ||c||, ||r||]: what the index stores
    bound = index_scan(sketch_query(q[..., :dc], q[..., dc:] if dr else None, basis), entries, scale).view(1, heads, 3, m)
    keys = torch.cat([c, r], dim=-1) if dr else c
    assert (bound >= exact_scores(q, keys, scale)).all()


def _archive(keys, budget=None):
    """The archive as a retriever sees it: all of ``keys`` archived, every row valid."""
    B, G, m = keys.shape[:3]
    return ArchiveView(keys, torch.arange(m).expand(B, G, m), torch.ones(B, G, m, dtype=torch.bool), budget)


def _index_for(c, r, rank, certified=False, tau=8.0, j=16, j_margin=8.0):
    cfg = VestigeRetriever(rank=rank, certified=certified, tau=tau, j=j, j_margin=j_margin)
    state = SketchIndex(cfg, RowGeometry("mla", c.shape[-1], r.shape[-1]))
    keys = torch.cat([c, r], -1)
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), _archive(keys[:, :, :0]))
    return state, keys


@pytest.mark.parametrize("tau", [0.5, 2.0, 5.0])
def test_certified_mode_excluded_mass_lemma3(tau):
    """Excluded softmax mass <= (T - |F|) e^-tau relative to the attended tier, checked numerically."""
    g = torch.Generator().manual_seed(int(tau * 10))
    T, dc, dr = 300, 64, 16
    c, r = torch.randn(1, 1, T, dc, generator=g), torch.randn(1, 1, T, dr, generator=g)
    state, keys = _index_for(c, r, rank=56, certified=True, tau=tau)
    query = torch.randn(1, 2, 1, dc + dr, generator=g)
    # the attended tier holds rows the query likes (as it does after a good selection)
    attended = torch.randn(1, 1, 20, dc + dr, generator=g)
    attended[0, 0, :4] += 0.4 * query[0, 0, 0]
    scale = 0.3
    s_att = exact_scores(query, attended, scale)  # [1, 2, 1, 20]
    choice = state.choose(query, s_att.amax(-1), scale, _archive(keys)).as_mask(T)
    s_arch = exact_scores(query, keys, scale)[0, :, 0]  # [2, T]
    fetched = choice[0, 0]
    excluded = torch.logsumexp(s_arch[:, ~fetched], dim=-1) - torch.logsumexp(s_att[0, :, 0], dim=-1)
    limit = math.log(T - int(fetched.sum())) - tau
    assert 0 < fetched.sum() < T  # a real test: some rows in, some out
    assert (excluded <= limit + 1e-6).all()


def test_default_mode_fetches_top_j_that_beat_s_star():
    g = torch.Generator().manual_seed(5)
    c, r = torch.randn(1, 1, 100, 64, generator=g), torch.randn(1, 1, 100, 16, generator=g)
    state, _ = _index_for(c, r, rank=64, j=5, j_margin=0.0)  # full rank: the bound is the exact score
    query = torch.randn(1, 1, 1, 80, generator=g)
    exact = exact_scores(query, torch.cat([c, r], -1), 1.0)[0, 0, 0]
    ranked = exact.sort(descending=True).values
    s_star = (ranked[2] + ranked[3]) / 2  # exactly 3 rows beat it
    choice = state.choose(query, s_star.view(1, 1, 1), 1.0, _archive(torch.cat([c, r], -1))).as_mask(100)
    assert set(choice[0, 0].nonzero().flatten().tolist()) == set(exact.topk(3).indices.tolist())
    # the default margin (8 logits below s*) keeps the top 5 whose bound is within 8 of s*
    state, _ = _index_for(c, r, rank=64, j=5)
    choice = state.choose(query, s_star.view(1, 1, 1), 1.0, _archive(torch.cat([c, r], -1))).as_mask(100)
    want = [u for u in exact.topk(5).indices.tolist() if exact[u] > s_star - 8.0]
    assert set(choice[0, 0].nonzero().flatten().tolist()) == set(want)


@pytest.fixture(scope="module")
def kimi():
    return tiny_kimi_linear()[0]


def _context(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_certified_with_huge_tau_equals_full(kimi):
    ctx, q = _context(600, 6), _context(8, 7)
    with torch.no_grad():
        full = pipeline.score(kimi, None, ctx, q, _context(12, 8), "full")
        everything = build_retriever("vestige", certified=True, tau=1e9)
        got = pipeline.score(kimi, None, ctx, q, _context(12, 8), registry.get("vestige", ratio=8, retriever=everything))
    assert got.stats.totals["archived_rows"] > 0 and got.stats.totals["rows_fetched"] > 0
    assert max(abs(a - b) for a, b in zip(full.token_nll, got.token_nll)) < 1e-4


@pytest.mark.parametrize("ratio", [8, 32])
def test_vestige_on_kimi_streaming_prefill_decode_audit(kimi, ratio):
    """Streaming prefill (chunks of 256, blocks of 512) + 100 decode steps with audit: zero violations."""
    ctx, q = _context(2048, 9), _context(8, 10)
    policy = registry.get("vestige", ratio=ratio, block_size=512)
    r = pipeline.generate(kimi, None, ctx, q, policy, max_new_tokens=100, chunk_size=256, audit=True)
    t = r.stats.totals
    assert len(r.token_ids) == 100
    assert t["bound_violations"] == 0 and t["audited_scores"] > 100 * 2048
    assert t["rows_fetched"] > 0 and t["selector_bytes_read"] == t["selector_rows_read"] * 64 * 4
    for s in r.stats.layers:
        assert s.resident_rows <= 2048 // ratio + 8 + 100 and s.peak_resident_rows <= 2048 // ratio + 512 + 256
        assert s.last_step["kv_bytes_read"] == (
            s.last_step["attended_bytes_read"] + s.last_step["index_bytes_scanned"] + s.last_step["fetched_bytes"]
        )
