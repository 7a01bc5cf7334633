"""The fused index scans (kvzoo/kernels/index_scan.py) against their PyTorch references, in Triton's interpreter.

Toy sizes, seeded: m not a multiple of the row tile, W not a multiple of BLOCK_W (16), hq = 1, 3, 16 and a
count above one program's 64 query rows, length masks, thresholds with infinities, and real index rows of
both retrievers (the kernel's bounds still bound the exact scores).
"""

from __future__ import annotations

import pytest
import torch

from kvzoo.kernels import index_scan as ix
from kvzoo.kernels.index_scan import (
    exact_scores,
    index_scan,
    index_scan_reduce,
    index_scan_reduce_reference,
    index_scan_reference,
    launch_config,
    page_entries,
    page_query,
    sketch_entries,
    sketch_query,
)
from tests.interpreter import TOLERANCE

DTYPES = [torch.float32, torch.float16]


def _rows(B, G, hq, m, W, dtype, seed, capacity=None):
    """Query rows ``[B, G, hq, W]`` fp32 and entries ``[B, G, m, W]`` in ``dtype`` (a view of a larger buffer
    when ``capacity`` > m, whose tail holds NaN and inf: rows past ``length`` must never be read)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, G, hq, W, generator=g)
    buffer = torch.randn(B, G, capacity or m, W, generator=g).to(dtype)
    if capacity:
        buffer[:, :, m:] = float("nan")
        buffer[:, :, m::2, 0] = float("inf")
    return q, buffer[:, :, :m] if capacity else buffer


def _relative(kernel: torch.Tensor, reference: torch.Tensor) -> float:
    """max |a - b| / max |ref| over the finite entries, after checking the infinite ones agree exactly."""
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(kernel)), "the kernel and the reference disagree on which are infinite"
    assert torch.equal(kernel[~finite], reference[~finite])
    if not finite.any():
        return 0.0
    return ((kernel - reference)[finite].abs().max() / reference[finite].abs().max()).item()


def test_toy_shapes_exercise_partial_tiles():
    """The cases below really cut a row tile and a W chunk short (and hq = 80 needs two query chunks)."""
    for hq, W, m in ((1, 33, 70), (3, 49, 130), (16, 97, 69), (80, 33, 40)):
        config = launch_config(hq, W)
        assert m % config["BLOCK_M"] and W % config["BLOCK_W"]
        assert min(config["BLOCK_Q"], config["BLOCK_M"], config["BLOCK_W"]) >= 16
    assert launch_config(80, 33)["BLOCK_Q"] < 80


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq, W, m", [(1, 33, 70), (3, 49, 130), (16, 97, 69), (80, 33, 40)])
def test_scan_matches_the_reference(dtype, hq, W, m):
    q, entries = _rows(2, 2, hq, m, W, dtype, seed=hq + W + m)
    out = index_scan(q, entries, 0.37)
    assert out.shape == (2, 2, hq, m) and out.dtype == torch.float32
    assert _relative(out, index_scan_reference(q, entries, 0.37)) <= TOLERANCE[str(dtype).split(".")[1]]


def test_the_kernel_is_the_path_taken(monkeypatch):
    """KVZOO_KERNELS=triton on CPU tensors runs the kernel (the reference is never called)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(ix, "index_scan_reference", refuse)
    monkeypatch.setattr(ix, "index_scan_reduce_reference", refuse)
    q, entries = _rows(1, 1, 3, 20, 33, torch.float32, seed=0)
    assert index_scan(q, entries, 1.0).shape == (1, 1, 3, 20)
    assert index_scan_reduce(q, entries, 1.0, None).shape == (1, 1, 20)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_length_masks_rows_of_a_preallocated_buffer(dtype):
    """Entries a view of a larger buffer whose tail is NaN/inf; per-sequence lengths 0, partial, and past m."""
    B, G, hq, m, W = 3, 2, 3, 70, 49
    q, entries = _rows(B, G, hq, 60, W, dtype, seed=5, capacity=m)
    whole = entries.as_strided((B, G, m, W), entries.stride())  # the buffer passed whole
    length = torch.tensor([0, 37, 60])
    out = index_scan(q, whole, 0.5, length=length)
    ref = index_scan_reference(q, whole, 0.5, length=length)
    assert torch.isneginf(out[0]).all() and torch.isneginf(out[1, ..., 37:]).all()
    assert torch.isfinite(out[1, ..., :37]).all() and torch.isfinite(out[2, ..., :60]).all()
    assert _relative(out, ref) <= TOLERANCE[str(dtype).split(".")[1]]
    # lengths past m: nothing is masked; int32 lengths: the same result
    beyond = index_scan(q, entries, 0.5, length=torch.tensor([100, 61, 60], dtype=torch.int32))
    assert _relative(beyond, index_scan_reference(q, entries, 0.5)) <= TOLERANCE[str(dtype).split(".")[1]]
    margin = index_scan_reduce(q, whole, 0.5, None, length=length)
    assert _relative(margin, index_scan_reduce_reference(q, whole, 0.5, None, length=length)) \
        <= TOLERANCE[str(dtype).split(".")[1]]
    assert torch.isneginf(margin[0]).all() and torch.isneginf(margin[1, :, 37:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq, W, m", [(1, 33, 70), (3, 49, 130), (16, 97, 69), (80, 33, 40)])
def test_reduce_is_the_max_over_query_rows_of_bound_minus_threshold(dtype, hq, W, m):
    q, entries = _rows(2, 2, hq, m, W, dtype, seed=hq * W + m)
    g = torch.Generator().manual_seed(m)
    threshold = torch.randn(2, 2, hq, generator=g) * 3
    margin = index_scan_reduce(q, entries, 0.37, threshold)
    assert margin.shape == (2, 2, m) and margin.dtype == torch.float32
    tol = TOLERANCE[str(dtype).split(".")[1]]
    assert _relative(margin, index_scan_reduce_reference(q, entries, 0.37, threshold)) <= tol
    assert _relative(margin, (index_scan_reference(q, entries, 0.37) - threshold[..., None]).amax(2)) <= tol
    assert _relative(index_scan_reduce(q, entries, 0.37, None), index_scan_reference(q, entries, 0.37).amax(2)) <= tol


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN bounds, on purpose
def test_certified_selection_equals_the_per_head_rule_with_ties_and_infinities():
    """margin >= 0 iff bound >= threshold for some query row, with the kernel's own bounds: thresholds set
    exactly to bounds (ties), -inf and +inf thresholds, and rows whose bounds are -inf, +inf or NaN."""
    B, G, hq, m, W = 2, 2, 5, 70, 33
    g = torch.Generator().manual_seed(11)
    q = torch.rand(B, G, hq, W, generator=g) + 0.1  # positive rows: an infinite entry gives an infinite bound
    q[:, :, :, -1] = 0.0  # ... and a zero column: an entry with inf there gives a NaN bound
    entries = torch.randn(B, G, m, W, generator=g)
    entries[:, :, 3, :-1] = float("-inf")  # bound -inf
    entries[:, :, 4, :-1] = float("inf")  # bound +inf
    entries[:, :, 5, -1] = float("inf")  # bound NaN (0 * inf)
    bounds = index_scan(q, entries, 0.5)
    assert torch.isneginf(bounds[:, :, :, 3]).all() and torch.isposinf(bounds[:, :, :, 4]).all()
    assert torch.isnan(bounds[:, :, :, 5]).all()
    threshold = bounds[:, :, :, 10].clone()  # a tie for row 10 on every query row
    threshold[0, 0, 1] = float("-inf")  # every row but the NaN one is chosen in (0, 0)
    threshold[0, 1, :] = float("inf")  # only the +inf row ties in (0, 1)
    threshold[1, 0, 2] = bounds[1, 0, 2, 40]  # one more tie
    margin = index_scan_reduce(q, entries, 0.5, threshold)
    per_head = (bounds >= threshold[..., None]).any(dim=2)
    assert torch.equal(margin >= 0, per_head)
    assert per_head[0, 0, 10] and per_head[1, :, 10].all() and per_head[1, 0, 40] and per_head[0, 0].sum() == m - 1
    assert per_head[0, 1].sum() == 1 and per_head[0, 1, 4] and not per_head[..., 5].any()
    assert (margin[1, :, 10] == 0).all() and margin[0, 1, 4] == 0 and torch.isneginf(margin[..., 5]).all()
    assert torch.equal(margin, index_scan_reduce_reference(q, entries, 0.5, threshold)) or \
        _relative(margin, index_scan_reduce_reference(q, entries, 0.5, threshold)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("branch", [True, False], ids=["mla", "gqa"])
def test_sketch_bounds_from_the_kernel_bound_the_exact_scores(dtype, branch):
    """VestigeKV's index rows through the kernel: every bound >= the exact score of its row, and the reduced
    margin with s* - tau per head selects every row whose exact score is within tau of s*."""
    B, G, hpg, q_len, m, dc, dr, rank = 1, 2, 3, 2, 75, 40, 16, 24
    g = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(G, dc, dc, generator=g, dtype=torch.float64))[0][..., :rank].float()[None]
    # keys mostly inside span(basis), as a fitted basis makes them: the bounds are tight enough to leave rows out
    inside = torch.randn(B, G, m, rank, generator=g) * 3 @ basis.transpose(-1, -2)
    c = (inside + 0.05 * torch.randn(B, G, m, dc, generator=g)).to(dtype)
    r = (torch.randn(B, G, m, dr, generator=g) * 2).to(dtype) if branch else None
    query = torch.randn(B, G * hpg, q_len, dc + (dr if branch else 0), generator=g) * 2
    entries = sketch_entries(c, r, basis).to(dtype)  # the stored index (fp32 in kvzoo; fp16 tests the upcast)
    rows = sketch_query(query[..., :dc], query[..., dc:] if branch else None, basis)
    assert rows.shape[-1] % 16 and rows.shape[-1] == entries.shape[-1]
    bound = index_scan(rows, entries, 0.3).view(B, G * hpg, q_len, m)
    keys = torch.cat([c, r], -1) if branch else c
    exact = exact_scores(query, keys, 0.3)
    slack = 0 if dtype == torch.float32 else 1e-3 * exact.abs().max()  # fp16 rounds the sketch itself
    assert (bound >= exact - slack).all()
    tau = 1.0
    s_star = exact.amax(-1)  # [B, H, q]
    threshold = (s_star - tau).reshape(B, G, hpg * q_len)
    chosen = index_scan_reduce(rows, entries, 0.3, threshold) >= 0
    needed = (exact >= s_star[..., None] - tau + slack).view(B, G, hpg * q_len, m).any(2)
    assert needed.any() and not chosen.all() and (chosen | ~needed).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN bounds, on purpose
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_page_bounds_from_the_kernel_bound_every_key_of_the_page(dtype):
    """Quest's page rows through the kernel (an empty page included): each bound >= the best exact score of
    its page's keys; the reduced margin with no threshold is the group's max bound, -inf on the empty page."""
    B, G, hpg, D, size, pages = 1, 2, 4, 24, 16, 5
    g = torch.Generator().manual_seed(4)
    keys = (torch.randn(B, G, pages * size, D, generator=g) * 2).to(dtype)
    paged = keys.float().view(B, G, pages, size, D)
    page_min, page_max = paged.amin(3).to(dtype), paged.amax(3).to(dtype)
    page_min[:, 1, 2], page_max[:, 1, 2] = float("inf"), float("-inf")  # page 2 of group 1 holds only padding
    entries = page_entries(page_min, page_max)
    entries[:, 1, 2, -1] = 0  # PageIndex's magnitude of an empty page
    query = torch.randn(B, G * hpg, 1, D, generator=g)
    rows = page_query(query, G)
    assert rows.shape[-1] == 2 * D + 1 and rows.shape[-1] % 16
    bound = index_scan(rows, entries, 0.7)  # [B, G, hpg, pages]
    best = exact_scores(query, keys, 0.7).view(B, G, hpg, pages, size).amax(-1)
    empty = torch.zeros(B, G, pages, dtype=torch.bool)
    empty[:, 1, 2] = True
    assert (bound[~empty[:, :, None].expand_as(bound)] >= best[~empty[:, :, None].expand_as(best)]).all()
    margin = index_scan_reduce(rows, entries, 0.7, None)
    masked = bound.masked_fill(empty[:, :, None], float("-inf")).amax(2)  # Quest's gqa="group" scores
    assert torch.isneginf(margin[:, 1, 2]).all()
    assert _relative(margin, masked) <= TOLERANCE[str(dtype).split(".")[1]]
    assert torch.equal(margin.topk(3, dim=-1).indices, masked.topk(3, dim=-1).indices)


def test_empty_shapes():
    q, entries = _rows(1, 2, 3, 0, 33, torch.float32, seed=0)
    assert index_scan(q, entries, 1.0).shape == (1, 2, 3, 0)
    assert index_scan_reduce(q, entries, 1.0, None).shape == (1, 2, 0)
    q, entries = _rows(1, 2, 0, 9, 33, torch.float32, seed=0)
    assert index_scan(q, entries, 1.0).shape == (1, 2, 0, 9)
    assert torch.isneginf(index_scan_reduce(q, entries, 1.0, None)).all()


def test_shipped_configs_are_the_launchers_picks():
    """Every configuration the compile gate builds names each kernel argument once and carries the blocks,
    warps and stages launch_config gives its shape (the one rule the launcher also uses)."""
    import inspect

    from kvzoo.kernels import shapes

    configs = shapes.index_scan_configs()
    arguments = list(inspect.signature(ix._index_scan_kernel).parameters)
    assert len(configs) == 2 * len(shapes.INDEX_SCAN_SHAPES) and len({c.name for c in configs}) == len(configs)
    for config, (label, hq, W, dtype, op, has_threshold) in zip(configs[::2], shapes.INDEX_SCAN_SHAPES):
        assert label in config.name and list(config.signature) == arguments
        picked = launch_config(hq, W)
        assert (config.num_warps, config.num_stages) == (picked.pop("num_warps"), picked.pop("num_stages"))
        assert {k: config.constexprs[k] for k in picked} == picked
        assert (config.signature["thr_ptr"] == "*fp32") == has_threshold == config.constexprs["HAS_THRESHOLD"]
        assert config.constexprs["REDUCE"] == (op == "reduce") and config.signature["e_ptr"].endswith(
            {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype])
