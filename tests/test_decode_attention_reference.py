"""The decode-attention op (kvzoo/kernels/decode_attention/) on CPU: its reference against a float64 softmax,
and every other implementation against the reference, on one list of cases.

The reference is the specification; ``sdpa`` (torch's fused SDPA where it applies, two matmuls elsewhere) must
equal it (fp32: 1e-5 relative; half rows: to their rounding) on every case, with and without the best score and
the per-position probabilities, in one part and in parts merged. The Triton kernels are held to the same cases in
tests/interpreter/test_decode_attention.py. Also the input checks and the launch heuristics that need no Triton.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvzoo.kernels import decode_attention as da
from kvzoo.kernels import shapes
from kvzoo.kernels.decode_attention import Rows, attend, decode_attention, decode_attention_reference

SCALE = 0.3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _gqa(seed: int, B=2, G=2, hpg=3, N=40, D=16, dtype=torch.float32):
    g = _gen(seed)
    return (torch.randn(B, G * hpg, D, generator=g).to(dtype), torch.randn(B, G, N, D, generator=g).to(dtype),
            torch.randn(B, G, N, D, generator=g).to(dtype))


def _mla(seed: int, B=2, H=4, N=40, dv=32, dr=16, dtype=torch.float32):
    g = _gen(seed)
    query = torch.randn(B, H, dv + dr, generator=g).to(dtype)
    return query, torch.randn(B, 1, N, dv + dr, generator=g).to(dtype)


def _plain(query, keys, values, allowed):
    """Softmax over the rows ``allowed [B, H, n]`` marks, in float64 (nothing readable: 0 and -inf)."""
    B, H, D = query.shape
    G = keys.shape[1]
    k = keys.double().repeat_interleave(H // G, dim=1)
    v = values.double().repeat_interleave(H // G, dim=1)
    scores = torch.einsum("bhd,bhnd->bhn", query.double(), k) * SCALE
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhn,bhnd->bhd", probs, v), lse


def cases() -> dict[str, tuple[torch.Tensor, list[Rows]]]:
    """The case list every implementation is held to: ``name -> (query, sources)``."""
    out = {}
    query, keys, values = _gqa(0)
    valid = torch.rand(2, 2, 40, generator=_gen(1)) < 0.7
    _, fk, fv = _gqa(2, N=25)
    fvalid = torch.rand(2, 2, 25, generator=_gen(3)) < 0.8
    out["gqa"] = (query, [Rows(keys, values)])
    out["gqa-valid"] = (query, [Rows(keys, values, valid=valid)])
    out["gqa-two-sources"] = (query, [Rows(keys, values, valid=valid), Rows(fk, fv, valid=fvalid)])
    head_valid = torch.rand(2, 6, 25, generator=_gen(4)) < 0.6
    out["gqa-head-valid"] = (query, [Rows(keys, values), Rows(fk, fv, valid=fvalid, head_valid=head_valid)])
    mq, rows = _mla(4)
    mvalid = torch.rand(2, 1, 40, generator=_gen(5)) < 0.8
    _, fetched = _mla(6, N=12)
    out["mla"] = (mq, [Rows(rows, value_width=32)])
    out["mla-two-sources"] = (mq, [Rows(rows, value_width=32, valid=mvalid), Rows(fetched, value_width=32)])
    q2, k2, v2 = _gqa(8, N=30)
    indices = torch.randint(-2, 32, (2, 2, 25), generator=_gen(9))
    out["gathered-length"] = (q2, [Rows(k2, v2, valid=fvalid, length=torch.tensor([25, 9], dtype=torch.int32),
                                        indices=indices, head_valid=head_valid)])
    q3, k3, v3 = _gqa(12)
    k3[0], v3[0] = float("nan"), float("nan")
    nothing = torch.ones(2, 2, 40, dtype=torch.bool)
    nothing[0] = False  # sequence 0: every row invalid (and NaN)
    out["nothing-readable-nan"] = (q3, [Rows(k3, v3, valid=nothing)])  # NaN in unreadable rows: reference, kernel
    out["nothing-readable"] = (q3, [Rows(k3.nan_to_num(0.0), v3.nan_to_num(0.0), valid=nothing)])
    return out


# sdpa reads unreadable rows' values (times a zero probability): it needs them finite, as the runtime's always are
FINITE_ONLY = {"nothing-readable-nan"}


CASES = cases()


def test_the_reference_is_a_softmax_over_the_readable_rows():
    query, keys, values = _gqa(0)
    valid = torch.rand(2, 2, 40, generator=_gen(1)) < 0.7
    _, fk, fv = _gqa(2, N=25)
    out, lse = decode_attention_reference(query, [Rows(keys, values, valid=valid), Rows(fk, fv)], SCALE)
    allowed = torch.cat([valid, torch.ones(2, 2, 25, dtype=torch.bool)], dim=2).repeat_interleave(3, 1)
    r_out, r_lse = _plain(query, torch.cat([keys, fk], 2), torch.cat([values, fv], 2), allowed)
    assert _rel(out, r_out) <= 1e-6 and _rel(lse, r_lse) <= 1e-6


@pytest.mark.parametrize("impl", ["sdpa"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_implementation_equals_the_reference(name, impl):
    if impl == "sdpa" and name in FINITE_ONLY:
        pytest.skip("sdpa needs finite values in unreadable rows (the runtime's are): the reference and the kernel do not")
    query, sources = CASES[name]
    ref = attend(query, sources, SCALE, lse=True, best=True, mass=True, impl="reference")
    for kwargs in ({}, {"lse": True}, {"lse": True, "best": True}, {"lse": True, "mass": True}):
        got = attend(query, sources, SCALE, impl=impl, **kwargs)
        assert _rel(got.out.float(), ref.out) <= 1e-5, kwargs
        if kwargs.get("lse"):
            assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref.lse))
            finite = torch.isfinite(ref.lse)
            assert _rel(got.lse[finite], ref.lse[finite]) <= 1e-5
        if kwargs.get("best"):
            finite = torch.isfinite(ref.best)
            assert torch.equal(finite, torch.isfinite(got.best)) and _rel(got.best[finite], ref.best[finite]) <= 1e-5
        if kwargs.get("mass"):
            for a, b in zip(got.mass, ref.mass):
                assert (a - b).abs().max() <= 1e-5


TWO_SOURCES = sorted(name for name, (_, sources) in CASES.items() if len(sources) == 2)


def _native_available() -> bool:
    from kvzoo.kernels import cpu_native

    return cpu_native.available()


@pytest.mark.parametrize("impl", ["reference", "sdpa", "native"])
@pytest.mark.parametrize("name", TWO_SOURCES)
def test_a_step_in_two_parts_equals_the_reference_of_the_whole_step(name, impl):
    """The runtime's retrieving step on every implementation: the tier deferred for its best score (s*), then the
    fetched rows with that part as the prior; the same softmax as the reference over both sources at once, the best
    score the tier's, the mass of every position of both sources (the tier's first)."""
    if impl == "native" and not _native_available():
        pytest.skip("the native library is not built here")
    query, sources = CASES[name]
    whole = attend(query, sources, SCALE, lse=True, mass=True, impl="reference")
    tier_best = attend(query, sources[:1], SCALE, best=True, impl="reference").best
    first = attend(query, sources[:1], SCALE, best=True, defer=True, mass=True, impl=impl)
    both = attend(query, sources[1:], SCALE, lse=True, mass=True, prior=first, impl=impl)
    assert _rel(both.out.float(), whole.out) <= 1e-5 and _rel(both.lse, whole.lse) <= 1e-5
    finite = torch.isfinite(tier_best)
    assert torch.equal(finite, torch.isfinite(both.best)) and _rel(both.best[finite], tier_best[finite]) <= 1e-5
    assert len(both.mass) == 2
    for got, want in zip(both.mass, whole.mass):
        assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
@pytest.mark.parametrize("name", TWO_SOURCES)
def test_a_prior_with_no_scores_joins_the_softmax_as_one_log_sum_exp_term(name, impl):
    """A kernel's or the native op's part has only ``out``, ``lse`` (and ``mass`` within itself): the PyTorch forms
    join it to their softmax as one term; the result is the reference of the whole step, its mass the step's."""
    query, sources = CASES[name]
    whole = attend(query, sources, SCALE, lse=True, mass=True, impl="reference")
    alone = attend(query, sources[:1], SCALE, lse=True, best=True, mass=True, impl="reference")
    kernel_like = da.Attended(alone.out, alone.lse, alone.best, alone.mass)  # no sources, no scores
    both = attend(query, sources[1:], SCALE, lse=True, mass=True, prior=kernel_like, impl=impl)
    assert _rel(both.out, whole.out) <= 1e-5 and _rel(both.lse, whole.lse) <= 1e-5
    assert both.best is alone.best and len(both.mass) == 2
    for got, want in zip(both.mass, whole.mass):
        assert (got - want).abs().max() <= 1e-5


def test_the_reference_runs_two_parts_without_sdpa(monkeypatch):
    """The specification speaks the parts protocol itself (no detour through the SDPA form)."""
    monkeypatch.setattr(da.sdpa, "attend_sdpa", lambda *a, **k: pytest.fail("the reference took the SDPA form"))
    query, sources = CASES["gqa-two-sources"]
    first = attend(query, sources[:1], SCALE, best=True, defer=True, impl="reference")
    both = attend(query, sources[1:], SCALE, lse=True, prior=first, impl="reference")
    whole = attend(query, sources, SCALE, lse=True, impl="reference")
    assert torch.equal(both.out, whole.out) and torch.equal(both.lse, whole.lse)


@pytest.mark.parametrize("name", ["gqa-head-valid", "mla-two-sources", "gathered-length", "nothing-readable-nan"])
def test_float64_math_agrees_with_fp32_math_and_returns_float64(name):
    """``math=torch.float64`` (what gpu-check holds an fp32 row to): the same softmax as the fp32 specification to
    fp32's rounding, in float64 -- in one part, and in two parts (a deferred part, then a prior of fp32 out/lse)."""
    query, sources = CASES[name]
    checked = da.rows._validate(query, sources, SCALE, None)
    fp32 = da.reference.attend_reference(query, checked, SCALE, best=True, mass=True)
    fp64 = da.reference.attend_reference(query, checked, SCALE, best=True, mass=True, math=torch.float64)
    assert fp64.out.dtype == fp64.lse.dtype == fp64.best.dtype == torch.float64 and fp32.out.dtype == torch.float32
    assert _rel(fp32.out, fp64.out) <= 1e-6 and torch.equal(torch.isneginf(fp32.lse), torch.isneginf(fp64.lse))
    finite = torch.isfinite(fp64.lse)
    assert _rel(fp32.lse[finite], fp64.lse[finite]) <= 1e-6
    for a, b in zip(fp32.mass, fp64.mass):
        assert b.dtype == torch.float64 and (a - b).abs().max() <= 1e-6
    if len(checked) == 2:
        first = da.reference.attend_reference(query, checked[:1], SCALE, defer=True, math=torch.float64)
        both = da.reference.attend_reference(query, checked[1:], SCALE, prior=first, math=torch.float64)
        alone = da.reference.attend_reference(query, checked[:1], SCALE)  # fp32 (out, lse), joined as one term
        merged = da.reference.attend_reference(query, checked[1:], SCALE, math=torch.float64,
                                               prior=da.Attended(alone.out, alone.lse))
        for got in (both, merged):
            assert got.out.dtype == torch.float64 and _rel(got.out, fp32.out) <= 1e-6


def test_half_rows_score_in_fp32_on_every_pytorch_path():
    """One score precision for s*: bf16 rows, the query rounded to bf16, products kept in fp32 -- the SDPA form's best
    score equals the reference's (a bf16-rounded score would be off by up to 2**-9 of its size)."""
    query, keys, values = _gqa(21, N=300, D=64, dtype=torch.bfloat16)
    src = [Rows(keys, values, valid=torch.rand(2, 2, 300, generator=_gen(22)) < 0.9)]
    ref = attend(query, src, SCALE, best=True, impl="reference").best
    got = attend(query, src, SCALE, best=True, defer=True, impl="sdpa").best
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_rows_agree_with_the_reference_to_their_rounding(dtype):
    """sdpa rounds the probabilities to the rows' dtype for the second product (as the kernel does); the reference
    keeps them in fp32: they agree to that rounding (a few units of the dtype's epsilon), not exactly."""
    query, keys, values = _gqa(7, dtype=dtype)
    for sources in ([Rows(keys, values)], [Rows(keys, values), Rows(keys[:, :, :9], values[:, :, :9])]):
        out, lse = decode_attention_reference(query, sources, SCALE)
        got = attend(query, sources, SCALE, lse=True, impl="sdpa")
        eps = torch.finfo(dtype).eps
        assert out.dtype == dtype and _rel(got.out, out) <= 8 * eps and _rel(got.lse, lse) <= 8 * eps


def test_length_indices_and_head_valid_against_a_plain_softmax():
    query, keys, values = _gqa(8, N=30)
    B, H, G, K = 2, 6, 2, 25
    indices = torch.randint(-2, 32, (B, G, K), generator=_gen(9))  # duplicates and out-of-pool entries
    valid = torch.rand(B, G, K, generator=_gen(10)) < 0.8
    head_valid = torch.rand(B, H, K, generator=_gen(11)) < 0.7
    length = torch.tensor([K, 9], dtype=torch.int32)
    src = Rows(keys, values, valid=valid, length=length, indices=indices, head_valid=head_valid)
    out, lse = decode_attention_reference(query, [src], SCALE)
    inside = (indices >= 0) & (indices < 30)
    safe = indices.clamp(0, 29)
    gk = torch.gather(keys, 2, safe[..., None].expand(B, G, K, 16))
    gv = torch.gather(values, 2, safe[..., None].expand(B, G, K, 16))
    allowed = (valid & inside & (torch.arange(K)[None, None] < length[:, None, None])).repeat_interleave(3, 1)
    r_out, r_lse = _plain(query, gk, gv, allowed & head_valid)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    assert _rel(out, r_out) <= 1e-6
    finite = torch.isfinite(r_lse)
    assert _rel(lse[finite], r_lse[finite]) <= 1e-6


def test_nothing_readable_gives_zero_and_minus_infinity_even_over_nan_rows():
    query, keys, values = _gqa(12)
    keys[0], values[0] = float("nan"), float("nan")
    valid = torch.ones(2, 2, 40, dtype=torch.bool)
    valid[0] = False  # sequence 0: every row invalid (and NaN)
    valid[1, :, 7] = False
    keys[1, :, 7], values[1, :, 7] = float("nan"), float("inf")
    out, lse = decode_attention_reference(query, [Rows(keys, values, valid=valid)], SCALE)
    assert out[0].abs().max() == 0 and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    allowed = valid[1:].repeat_interleave(3, 1)
    r_out, r_lse = _plain(query[1:], keys[1:].nan_to_num(0.0, 0.0, 0.0), values[1:].nan_to_num(0.0, 0.0, 0.0),
                          allowed)
    assert _rel(out[1:], r_out) <= 1e-6 and _rel(lse[1:], r_lse) <= 1e-6


def test_row_blocks_and_splits_do_not_change_the_result(monkeypatch):
    query, keys, values = _gqa(13, N=50)
    src = [Rows(keys, values, length=torch.tensor([50, 31]))]
    whole = decode_attention_reference(query, src, SCALE)
    monkeypatch.setattr(da.reference, "REFERENCE_ROW_BLOCK_ELEMENTS", 7 * 2 * 16)  # blocks of 3 rows per batch x group
    blocked = decode_attention_reference(query, src, SCALE, splits=5)
    assert _rel(blocked[0], whole[0]) <= 1e-6 and _rel(blocked[1], whole[1]) <= 1e-6


def test_decode_attention_on_cpu_takes_sdpa_never_the_kernel(monkeypatch):
    monkeypatch.delenv("KVZOO_KERNELS", raising=False)
    query, keys, values = _gqa(14)
    monkeypatch.setattr(da.triton, "launch", lambda *a, **k: pytest.fail("the kernel ran on CPU in auto mode"))
    out, lse = decode_attention(query, [Rows(keys, values)], SCALE)
    got = attend(query, [Rows(keys, values)], SCALE, lse=True, impl="sdpa")
    assert torch.equal(out, got.out.to(out.dtype)) and torch.equal(lse, got.lse)
    with pytest.raises(ValueError, match=r"impl must be one of \('reference', 'sdpa', 'triton', 'native'\)"):
        attend(query, [Rows(keys, values)], SCALE, impl="cuda")


def _bad_inputs():
    query, keys, values = _gqa(15)
    ok = dict(keys=keys, values=values)
    b = torch.ones(2, 2, 40, dtype=torch.bool)
    return [
        ("query 2-D", query[0], [Rows(**ok)], {}, r"query must be a \[B, H, D\] tensor"),
        ("query int", query.long(), [Rows(**ok)], {}, "query must be float16, bfloat16 or float32"),
        ("no sources", query, [], {}, "sources must be a non-empty list of Rows"),
        ("a tuple of tensors", query, [(keys, values)], {}, "sources must be a non-empty list of Rows"),
        ("keys 3-D", query, [Rows(keys[0], values)], {},
         r"sources\[0\].keys must be a \[B, G, N, D\] tensor"),
        ("keys width", query, [Rows(keys[..., :8], values)], {}, r"must be \[B=2, G, N, D=16\]"),
        ("groups", query, [Rows(torch.randn(2, 4, 40, 16), torch.randn(2, 4, 40, 16))], {},
         "H=6 heads must be a multiple of it"),
        ("keys strided", query, [Rows(torch.randn(2, 2, 40, 32)[..., ::2], values)], {},
         "contiguous last dimension"),
        ("keys int", query, [Rows(keys.long(), values)], {}, r"sources\[0\].keys must be float16"),
        ("values shape", query, [Rows(keys, values[:, :, :30])], {},
         r"values must be \[B=2, G=2, N=40, Dv\]"),
        ("values dtype", query, [Rows(keys, values.half())], {}, "values must have the keys' dtype"),
        ("no value width", query, [Rows(keys)], {}, r"value_width must be an int in \[1, D=16\]"),
        ("value width too wide", query, [Rows(keys, value_width=17)], {},
         r"value_width must be an int in \[1, D=16\]"),
        ("value width disagrees", query, [Rows(keys, values, value_width=8)], {},
         "disagrees with values' Dv=16"),
        ("value widths differ", query, [Rows(**ok), Rows(keys, value_width=8)], {},
         "all sources must share Dv"),
        ("valid dtype", query, [Rows(**ok, valid=b.int())], {}, r"sources\[0\].valid must be a bool tensor"),
        ("valid shape", query, [Rows(**ok, valid=b[:, :, :5])], {}, r"valid must have shape \[2, 2, 40\]"),
        ("head_valid shape", query, [Rows(**ok, head_valid=b)], {},
         r"head_valid must have shape \[2, 6, 40\]"),
        ("indices dtype", query, [Rows(**ok, indices=torch.zeros(2, 2, 5))], {},
         "indices must be an int32 or int64"),
        ("indices shape", query, [Rows(**ok, indices=torch.zeros(2, 5, dtype=torch.long))], {},
         r"indices must have shape \[B=2, G=2, K\]"),
        ("valid vs indices", query, [Rows(**ok, indices=torch.zeros(2, 2, 5, dtype=torch.long), valid=b)], {},
         r"valid must have shape \[2, 2, 5\]"),
        ("length shape", query, [Rows(**ok, length=torch.tensor([3]))], {},
         r"length must be an int32 or int64 tensor of shape \[B=2\]"),
        ("length float", query, [Rows(**ok, length=torch.tensor([3.0, 4.0]))], {},
         "length must be an int32 or int64"),
        ("length int", query, [Rows(**ok, length=3)], {}, "length must be an int32 or int64"),
        ("keys on another device", query, [Rows(keys.to("meta"), values.to("meta"))], {},
         r"sources\[0\].keys is on meta, the query on cpu: put them on one device"),
        ("length on another device", query, [Rows(**ok, length=torch.tensor([3, 4], device="meta"))], {},
         r"length \(a tensor on the query's device\) is on meta"),
        ("splits 0", query, [Rows(**ok)], {"splits": 0}, r"splits must be None or an int in \[1, 65535\]"),
        ("scaling nan", query, [Rows(**ok)], {"scaling": float("nan")}, "scaling must be a finite number"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_are_value_errors_naming_what_is_valid(case):
    _, query, sources, kwargs, message = case
    scaling = kwargs.pop("scaling", SCALE)
    for fn in (decode_attention, decode_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(query, sources, scaling, **kwargs)


def test_default_splits_fill_one_wave_of_the_chip_within_the_tiles():
    """``batch x groups x splits`` fills the ``sms x ctas_per_sm`` programs the chip holds at once, never more (a
    second, partial wave would double the time of the longest program), at most one split per tile. Replaces the
    old heuristic's floor of rows per split (228 rows for MLA: 5 programs on 132 SMs for the 1/32-kept step at
    batch 1): the one-pass merge reads the partials back from L2."""
    assert da.default_splits(1, 10_000, 64, sms=132, ctas_per_sm=2) == 157  # every tile its own split (157 < 264)
    assert da.default_splits(1, 100_000, 64, sms=132, ctas_per_sm=2) == 264  # two programs per SM
    assert da.default_splits(16, 100_000, 64, sms=132, ctas_per_sm=2) == 16  # 16 x 16 = 256 <= 264 (17: 272 > 264)
    assert da.default_splits(8, 100_000, 64, sms=132, ctas_per_sm=3) == 49  # 392 <= 396
    assert da.default_splits(300, 100_000, 64, sms=132) == 1
    assert da.default_splits(4, 0, 64) == 1  # an empty source still has one (empty) split
    # MLA, 16 heads over 576-dim bf16 rows, 1/32 of 32k kept at batch 1: one split per tile of 32 rows
    cfg = da.split_config(16, 576, 512, False, 2)
    assert da.default_splits(1, 1024, cfg.BLOCK_N, sms=132, ctas_per_sm=cfg.ctas_per_sm) == 32
    assert da.default_splits(1, 32_768, cfg.BLOCK_N, sms=132, ctas_per_sm=cfg.ctas_per_sm) == 264


def test_the_grid_table_fills_the_chip_unless_the_tiles_run_out():
    for row in shapes.grid_table(132):
        assert row["programs"] <= max(row["slots"], row["batch"] * row["groups"])
        more = row["batch"] * row["groups"] * (row["splits"] + 1)
        assert row["splits"] == row["tiles"] or more > row["slots"], row  # one more split would not fit


@pytest.mark.parametrize("hpg,width,value_width,separate", [(16, 576, 512, False), (32, 576, 512, False),
                                                              (3, 64, 64, True), (8, 128, 128, True),
                                                              (5, 48, 32, False), (40, 100, 30, True)])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_split_config_blocks_cover_the_shape_with_dots_of_at_least_16(hpg, width, value_width, separate,
                                                                       itemsize):
    cfg = da.split_config(hpg, width, value_width, separate, itemsize)
    blocks = (cfg.BLOCK_H, cfg.BLOCK_N, cfg.BLOCK_D1, cfg.BLOCK_D2, cfg.BLOCK_DV)
    assert all(b >= 16 and b & (b - 1) == 0 for b in blocks)
    assert cfg.BLOCK_H >= hpg and cfg.BLOCK_D1 >= cfg.D1 and cfg.BLOCK_D2 >= cfg.D2
    assert cfg.BLOCK_DV >= value_width
    assert cfg.D1 + cfg.D2 == width and (separate or cfg.D1 == value_width)
    assert cfg.num_warps in (4, 8) and cfg.num_stages == 3 and cfg.row_buffers == 2
    assert 1 <= cfg.ctas_per_sm <= 4 and cfg.score_copies == max(1, 8 * cfg.num_warps // cfg.BLOCK_N)


@pytest.mark.parametrize("hpg", [3, 32, 40])
def test_flag_words_hold_valid_and_head_valid_bit_per_head(hpg):
    B, G, P = 2, 2, 9
    valid = torch.rand(B, G, P, generator=_gen(16)) < 0.7
    head_valid = torch.rand(B, G * hpg, P, generator=_gen(17)) < 0.5
    words = -(-hpg // 32)
    for v, hv in ((valid, None), (valid, head_valid), (None, head_valid)):
        packed = da.triton._flag_words(v, hv, hpg)
        assert packed.dtype == torch.int32 and packed.shape == (B, G, words, P) and packed.stride(-1) == 1
        bits = (packed.long()[:, :, :, None, :] >> torch.arange(32)[:, None]) & 1  # [B, G, words, 32, P]
        heads = bits.reshape(B, G, words * 32, P)[:, :, :hpg].bool()
        want = torch.ones(B, G, hpg, P, dtype=torch.bool)
        if v is not None:
            want &= v[:, :, None]
        if hv is not None:
            want &= hv.view(B, G, hpg, P)
        assert torch.equal(heads, want)


def test_a_failing_kernel_after_a_kernel_part_falls_back_to_a_merge(monkeypatch):
    """auto mode: the second part's kernel fails; its fallback (the SDPA form) joins the first part (a kernel part:
    no scores to join) to its softmax by log-sum-exp."""
    from kvzoo.kernels import dispatch

    monkeypatch.delenv("KVZOO_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_failed", set())
    query, sources = CASES["gqa-two-sources"]
    first = attend(query, sources[:1], SCALE, lse=True, impl="sdpa")  # like a kernel part: out and lse, no scores
    assert first.scores is None

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(da.triton, "launch", broken)
    with pytest.warns(RuntimeWarning, match="decode_attention"):
        got = attend(query, sources[1:], SCALE, lse=True, prior=first, impl="triton")
    want = attend(query, sources, SCALE, lse=True, impl="reference")
    assert _rel(got.out, want.out) <= 1e-5 and _rel(got.lse, want.lse) <= 1e-5
