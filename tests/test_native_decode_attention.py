"""The native gathered decode-attention op (kvzoo/kernels/cpu_native.py, ``torch.ops.kvzoo.decode_attend``) against
the specification, ``attend_reference`` in kvzoo/kernels/decode_attention/reference.py, on one list of cases covering every option.

Each case is a query and one source; the op runs it alone and as the second part of a step (a first source's
result as its ``prior``), and is compared with the reference over that source alone and over both sources joined:
output, log-sum-exp, best score, per-position probabilities. Tolerances scale with the magnitudes (the sums run in
another order: fp32 rounding), never bit equality. The portable C (no AVX-512, no OpenMP) is held to the same cases.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvzoo.kernels import cpu_native
from kvzoo.kernels.decode_attention import Rows, _validate
from kvzoo.kernels.decode_attention.reference import attend_reference

needs_compiler = pytest.mark.skipif(cpu_native.toolchain_missing() is not None,
                                    reason=f"{cpu_native.toolchain_missing()}: the CPU kernels are not built here "
                                           "(kvzoo takes the PyTorch references)")

pytestmark = needs_compiler

SCALE = 0.125


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _flags(*shape, p: float, seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=_gen(seed)) < p


@dataclasses.dataclass
class Case:
    query: torch.Tensor
    source: Rows
    pool_valid: torch.Tensor | None = None


def _as_reference(case: Case) -> Rows:
    """The source the reference reads: ``pool_valid`` folded into ``valid`` (through the indices in gathered form)."""
    src, pv = case.source, case.pool_valid
    if pv is None:
        return src
    if src.indices is None:
        flags = pv
    else:
        flags = pv.gather(2, src.indices.long().clamp(0, max(pv.shape[2] - 1, 0))) if pv.shape[2] else \
            torch.zeros(src.indices.shape, dtype=torch.bool)
    return dataclasses.replace(src, valid=flags if src.valid is None else src.valid & flags)


def _pool(B, G, N, D, Dv, seed, dtype=torch.float32, capacity=None):
    """keys and values ``[B, G, N, *]`` as the first N rows of a preallocated pool of ``capacity`` rows, NaN beyond."""
    capacity = capacity or N
    keys = torch.full((B, G, capacity, D), float("nan"))
    values = torch.full((B, G, capacity, Dv), float("nan"))
    keys[:, :, :N] = _rand(B, G, N, D, seed=seed)
    values[:, :, :N] = _rand(B, G, N, Dv, seed=seed + 1)
    return keys.to(dtype), values.to(dtype)


def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    B, G, hpg, D = 2, 3, 3, 64
    H = G * hpg
    q = _rand(B, H, D, seed=1)
    keys, values = _pool(B, G, 70, D, D, seed=2)
    out["pool"] = Case(q, Rows(keys, values))
    # a preallocated pool passed whole: NaN past each sequence's length, in invalid rows, in padding rows
    pk, pv = _pool(B, G, 90, D, D, seed=3, capacity=128)
    valid = _flags(B, G, 128, p=0.7, seed=4)
    pk[~valid[..., None].expand_as(pk)] = float("nan")
    pv[~valid[..., None].expand_as(pv)] = float("nan")
    length = torch.tensor([90, 41])
    out["pool-length-valid-nan"] = Case(q, Rows(pk, pv, valid=valid, length=length))
    padding = _flags(B, G, 128, p=0.8, seed=5)
    pk2, pv2 = pk.clone(), pv.clone()
    pk2[~padding[..., None].expand_as(pk2)] = float("nan")
    out["pool-pool-valid"] = Case(q, Rows(pk2, pv2, length=length), pool_valid=padding & valid)
    # gathered: duplicates, -1 padding, indices past the pool (never read), NaN in rows the indices skip
    K = 60
    idx = torch.randint(-1, 80 + 3, (B, G, K), generator=_gen(6))
    idx[:, :, :5] = idx[:, :, 5:10]  # duplicates: read twice, like a gather
    gk, gv = _pool(B, G, 80, D, D, seed=7)
    skipped = torch.ones(B, G, 80 + 4, dtype=torch.bool).scatter_(2, idx + 1, False)[:, :, 1:81]
    gk[skipped], gv[skipped] = float("nan"), float("nan")
    out["gathered"] = Case(q, Rows(gk, gv, indices=idx))
    out["gathered-length-valid"] = Case(q, Rows(gk, gv, indices=idx, length=torch.tensor([K, 23]),
                                                valid=_flags(B, G, K, p=0.8, seed=8)))
    pool_flags = _flags(B, G, 80, p=0.75, seed=9)
    nk, nv = gk.clone(), gv.clone()
    nk[~pool_flags[..., None].expand_as(nk)] = float("nan")
    nv[~pool_flags[..., None].expand_as(nv)] = float("nan")
    out["gathered-pool-valid-nan"] = Case(q, Rows(nk, nv, indices=idx, length=torch.tensor([50, K]),
                                                  valid=_flags(B, G, K, p=0.9, seed=10)), pool_valid=pool_flags)
    out["gathered-int32"] = Case(q, Rows(gk, gv, indices=idx.int(), length=torch.tensor([K, 31], dtype=torch.int32)))
    # Quest-like: 3 heads' pages, each head reading its own segment (head_valid); a row no head reads holds NaN
    pages, rows_per_page = 4, 16
    seg = pages * rows_per_page
    qk, qv = _pool(B, G, 200, D, D, seed=11)
    idx_q = torch.stack([torch.randperm(200, generator=_gen(12 + i))[:hpg * seg] for i in range(B * G)]).view(B, G, -1)
    head_valid = torch.zeros(B, H, hpg * seg, dtype=torch.bool)
    for h in range(H):
        head_valid[:, h, (h % hpg) * seg:(h % hpg + 1) * seg] = True
    head_valid &= _flags(B, H, hpg * seg, p=0.9, seed=13)
    nobody = ~head_valid.view(B, G, hpg, -1).any(2)  # [B, G, K]: rows no head of the group reads
    for b in range(B):
        for g in range(G):
            qk[b, g, idx_q[b, g][nobody[b, g]]] = float("nan")
            qv[b, g, idx_q[b, g][nobody[b, g]]] = float("nan")
    out["quest-head-valid"] = Case(q, Rows(qk, qv, indices=idx_q, head_valid=head_valid))
    # odd shapes: one head per group, five heads per group (not a multiple of 4), D and Dv off every vector width
    q1 = _rand(2, 3, 5, seed=14)
    k1, v1 = _pool(2, 3, 33, 5, 7, seed=15)
    out["hpg1-d5-dv7"] = Case(q1, Rows(k1, v1, length=torch.tensor([33, 2])))
    q5 = _rand(1, 10, 40, seed=16)
    k5, v5 = _pool(1, 2, 45, 40, 24, seed=17)
    out["hpg5-d40-dv24"] = Case(q5, Rows(k5, v5, head_valid=_flags(1, 10, 45, p=0.6, seed=18)))
    # strides: the pool stored [B, N, G, D] (a transposed view) and the flags and indices as non-contiguous views
    tk = _rand(B, 50, G, D, seed=19).transpose(1, 2)
    tv = _rand(B, 50, G, D, seed=20).transpose(1, 2)
    tidx = torch.randint(0, 50, (B, 30, G), generator=_gen(21)).transpose(1, 2)
    out["strided"] = Case(q, Rows(tk, tv, indices=tidx, valid=_flags(B, 30, G, p=0.8, seed=22).transpose(1, 2)))
    # half rows (the query rounded to their dtype first), and a bf16 query over fp32 rows
    for dtype in (torch.bfloat16, torch.float16):
        hk, hv = _pool(B, G, 70, D, D, seed=23, dtype=dtype, capacity=96)
        name = str(dtype).split(".")[-1]
        out[f"{name}-pool"] = Case(q, Rows(hk, hv, length=torch.tensor([70, 66])))
        out[f"{name}-gathered"] = Case(q.to(dtype), Rows(gk.to(dtype), gv.to(dtype), indices=idx,
                                                         valid=_flags(B, G, K, p=0.8, seed=24)))
    out["bf16-query-fp32-rows"] = Case(q.bfloat16(), Rows(keys, values))
    # MLA absorbed: one latent group, value = the first Dv dims of the row (576 = 512 + 64, 16 and 32 heads)
    for heads, dtype in ((16, torch.bfloat16), (32, torch.float32), (16, torch.float16)):
        mq = _rand(1, heads, 576, seed=25)
        rows = torch.full((1, 1, 48, 576), float("nan"))
        rows[:, :, :40] = _rand(1, 1, 40, 576, seed=26)
        name = str(dtype).split(".")[-1]
        out[f"mla-h{heads}-{name}"] = Case(mq, Rows(rows.to(dtype), value_width=512, length=torch.tensor([40])))
    # more than 64 heads a group (the op takes a block of 64 a work item): 70 = 64 + 6 heads with their own flags,
    # and DeepSeek-V3's absorbed MLA, 128 heads over one latent group
    q70 = _rand(2, 140, 24, seed=28)
    k70, v70 = _pool(2, 2, 40, 24, 16, seed=29)
    idx70 = torch.randint(-1, 42, (2, 2, 30), generator=_gen(30))
    out["hpg70-head-valid"] = Case(q70, Rows(k70, v70, indices=idx70, length=torch.tensor([30, 17]),
                                             head_valid=_flags(2, 140, 30, p=0.6, seed=31)))
    out["mla-h128-float32"] = Case(_rand(1, 128, 576, seed=32), Rows(rows, value_width=512,
                                                                     length=torch.tensor([40])))
    mi = torch.tensor([[[3, -1, 39, 47, 3, 0, 12, 60]]])  # 47: in the pool, but NaN; 60: outside
    out["mla-gathered"] = Case(_rand(1, 16, 576, seed=27), Rows(rows.bfloat16(), value_width=512, indices=mi),
                               pool_valid=torch.arange(48).view(1, 1, 48) < 40)
    # nothing readable: an empty pool, no indices, every row invalid (and NaN), a zero length
    out["empty-pool"] = Case(q, Rows(keys[:, :, :0], values[:, :, :0]))
    out["empty-indices"] = Case(q, Rows(keys, values, indices=torch.zeros(B, G, 0, dtype=torch.long)))
    nan_k, nan_v = keys.clone(), values.clone()
    nan_k[0], nan_v[0] = float("nan"), float("nan")
    none = torch.ones(B, G, 70, dtype=torch.bool)
    none[0] = False
    out["sequence-0-nothing-nan"] = Case(q, Rows(nan_k, nan_v, valid=none))
    out["zero-length"] = Case(q, Rows(keys, values, length=torch.tensor([0, 70])))
    return out


CASES = cases()


def _reference_part(query, sources):
    checked = _validate(query, sources, SCALE, None)
    if sum(s.positions for s in checked):
        return attend_reference(query, checked, SCALE, best=True, mass=True)
    # no positions at all: the reference's best (an amax over an empty dim) raises; it is -inf by definition
    part = attend_reference(query, checked, SCALE, mass=True)
    part.best = torch.full(query.shape[:2], float("-inf"))
    return part


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """Equal up to ``rel`` of the largest magnitude involved; the same -inf pattern; no NaN anywhere."""
    assert got.shape == want.shape and got.dtype == torch.float32, what
    assert not torch.isnan(got).any(), f"{what}: NaN"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf differs"
    finite = torch.isfinite(want)
    if finite.any():
        err = (got[finite] - want[finite]).abs().max().item()
        assert err <= rel * (1.0 + want[finite].abs().max().item()), f"{what}: off by {err}"


def _rel(case: Case) -> float:
    """fp32 rounding of sums over D terms in another order (bf16/fp16 rows are exact in fp32 products)."""
    return 2e-5 if case.query.shape[-1] > 256 else 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_one_source_equals_the_reference(name):
    case = CASES[name]
    want = _reference_part(case.query, [_as_reference(case)])
    out, lse, best, mass = cpu_native.decode_attend(case.query, case.source, SCALE, pool_valid=case.pool_valid,
                                                    best=True, mass=True)
    rel = _rel(case)
    _assert_close(out, want.out, rel, "out")
    _assert_close(lse, want.lse, rel, "lse")
    _assert_close(best, want.best, rel, "best")
    _assert_close(mass, want.mass[0], rel, "mass")
    plain = cpu_native.decode_attend(case.query, case.source, SCALE, pool_valid=case.pool_valid)
    assert plain[2] is None and plain[3] is None
    assert torch.equal(plain[0], out) and torch.equal(plain[1], lse)  # asking for more changes nothing


@pytest.mark.parametrize("name", list(CASES))
def test_second_part_with_a_prior_is_the_one_softmax_over_both(name):
    """The runtime's protocol: the tier first (its best score), then this source with the tier's part as prior;
    the result is the reference over both sources joined, and the mass each position gets in that softmax."""
    case = CASES[name]
    B, H, _ = case.query.shape
    G = case.source.keys.shape[1]
    Dv = case.source.values.shape[-1] if case.source.values is not None else case.source.value_width
    tier_keys = _rand(B, G, 20, case.query.shape[-1], seed=30)
    tier_values = _rand(B, G, 20, Dv, seed=31) if case.source.values is not None else None
    tier = Rows(tier_keys.to(case.source.keys.dtype),
                None if tier_values is None else tier_values.to(case.source.keys.dtype),
                value_width=None if tier_values is not None else Dv,
                length=torch.tensor([20] + [0] * (B - 1)))  # sequence 1: an empty tier (lse -inf)
    first = cpu_native.decode_attend(case.query, tier, SCALE, best=True)
    out, lse, best, mass = cpu_native.decode_attend(case.query, case.source, SCALE, pool_valid=case.pool_valid,
                                                    prior=first[:2], best=True, mass=True)
    whole = _reference_part(case.query, [tier, _as_reference(case)])
    alone = _reference_part(case.query, [_as_reference(case)])
    rel = _rel(case)
    _assert_close(first[2], _reference_part(case.query, [tier]).best, rel, "the tier's best")
    _assert_close(out, whole.out, rel, "out")
    _assert_close(lse, whole.lse, rel, "lse")
    _assert_close(best, alone.best, rel, "best (this source's)")
    _assert_close(mass, whole.mass[1], rel, "mass in the whole softmax")


def test_a_prior_with_nothing_readable_weighs_nothing_even_if_its_output_is_nan():
    case = CASES["gathered-length-valid"]
    B, H, _ = case.query.shape
    prior = (torch.full((B, H, 64), float("nan")), torch.full((B, H), float("-inf")))
    got = cpu_native.decode_attend(case.query, case.source, SCALE, prior=prior, mass=True)
    alone = cpu_native.decode_attend(case.query, case.source, SCALE, mass=True)
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1]) and torch.equal(got[3], alone[3])
    # and a source with nothing readable after a prior: the prior's part, unchanged
    empty = CASES["empty-indices"]
    first = cpu_native.decode_attend(case.query, case.source, SCALE)
    again = cpu_native.decode_attend(empty.query, empty.source, SCALE, prior=first[:2], best=True)
    torch.testing.assert_close(again[0], first[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(again[1], first[1]) and torch.isneginf(again[2]).all()


def test_nothing_readable_is_zero_and_minus_infinity():
    for name in ("empty-pool", "empty-indices", "zero-length", "sequence-0-nothing-nan"):
        case = CASES[name]
        out, lse, best, mass = cpu_native.decode_attend(case.query, case.source, SCALE, best=True, mass=True)
        b = 0  # every case has nothing readable in sequence 0
        assert (out[b] == 0).all() and torch.isneginf(lse[b]).all() and torch.isneginf(best[b]).all(), name
        assert (mass[b] == 0).all(), name


@pytest.mark.parametrize("name", ["pool", "gathered-pool-valid-nan", "quest-head-valid", "bfloat16-pool",
                                  "mla-h16-bfloat16", "hpg70-head-valid"])
def test_two_threads_split_the_positions_to_the_same_result(name, threads_at_any_size):
    """Split over threads (forced at this size: ``threads_at_any_size``; positions repeated for several splits of two
    tiles or more per group): the splits merge exactly (to fp32 rounding); 1 and 2 threads agree with each other and
    with the reference."""
    case = CASES[name]
    src = case.source
    positions = src.keys.shape[2] if src.indices is None else src.indices.shape[2]
    reps = -(-512 // positions)  # >= 512 positions: 8 tiles per group
    if src.indices is not None:
        big = dataclasses.replace(src, indices=src.indices.repeat(1, 1, reps),
                                  valid=None if src.valid is None else src.valid.repeat(1, 1, reps),
                                  head_valid=None if src.head_valid is None else src.head_valid.repeat(1, 1, reps),
                                  length=None)
        pool_valid = case.pool_valid
    else:  # the rows every sequence reads (a pool's padding holds NaN), repeated
        n = src.keys.shape[2] if src.length is None else int(src.length.min())
        big = dataclasses.replace(src, keys=src.keys[:, :, :n].repeat(1, 1, reps, 1),
                                  values=None if src.values is None else src.values[:, :, :n].repeat(1, 1, reps, 1),
                                  valid=None if src.valid is None else src.valid[..., :n].repeat(1, 1, reps),
                                  head_valid=None if src.head_valid is None else
                                  src.head_valid[..., :n].repeat(1, 1, reps), length=None)
        pool_valid = None if case.pool_valid is None else case.pool_valid[..., :n].repeat(1, 1, reps)
    big_case = Case(case.query, big, pool_valid)
    want = _reference_part(case.query, [_as_reference(big_case)])
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(cpu_native.decode_attend(case.query, big, SCALE, pool_valid=pool_valid, best=True,
                                                    mass=True))
    finally:
        torch.set_num_threads(threads)
    for got in results:
        _assert_close(got[0], want.out, 2e-5, "out")
        _assert_close(got[1], want.lse, 2e-5, "lse")
        _assert_close(got[2], want.best, 2e-5, "best")
        _assert_close(got[3], want.mass[0], 2e-5, "mass")


def test_one_openmp_runtime_in_the_process(threads_at_any_size):
    """The kernels use torch's own OpenMP runtime (or none): never a second libgomp beside torch's."""
    lib = cpu_native.library()
    assert lib is not None
    case = CASES["pool"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_native.decode_attend(case.query, case.source, SCALE)
    finally:
        torch.set_num_threads(threads)
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if os.path.basename(line.split()[-1]).startswith("libgomp")}
    assert len(runtimes) <= 1, runtimes
    if lib.openmp is not None:
        assert runtimes == {lib.openmp}


def test_an_openmp_build_that_fails_falls_back_to_one_thread(monkeypatch, recwarn):
    """Where the build against torch's OpenMP runtime fails, the kernels are built without OpenMP: no warning, the
    same results on one thread."""
    monkeypatch.setattr(cpu_native, "openmp_runtime", lambda: "/nonexistent/libgomp.so.1")
    cpu_native.library.cache_clear()
    try:
        lib = cpu_native.library()
        assert lib is not None and lib.openmp is None
        assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
        case = CASES["gathered-length-valid"]
        want = _reference_part(case.query, [_as_reference(case)])
        out, lse, _, _ = cpu_native.decode_attend(case.query, case.source, SCALE)
        _assert_close(out, want.out, 1e-5, "out")
        _assert_close(lse, want.lse, 1e-5, "lse")
    finally:
        cpu_native.library.cache_clear()


@pytest.mark.parametrize("name", ["pool-length-valid-nan", "gathered-pool-valid-nan", "quest-head-valid",
                                  "hpg1-d5-dv7", "hpg5-d40-dv24", "bfloat16-gathered", "float16-pool",
                                  "mla-gathered", "sequence-0-nothing-nan"])
def test_the_portable_c_equals_the_reference(name, monkeypatch):
    """The same source built for plain x86-64 (no AVX-512, no OpenMP: the scalar fallback) on a few cases."""
    portable = cpu_native.compile_library("x86-64", None)
    monkeypatch.setattr(cpu_native, "_LOADED", [portable])
    case = CASES[name]
    want = _reference_part(case.query, [_as_reference(case)])
    out, lse, best, mass = cpu_native.decode_attend(case.query, case.source, SCALE, pool_valid=case.pool_valid,
                                                    best=True, mass=True)
    _assert_close(out, want.out, _rel(case), "out")
    _assert_close(lse, want.lse, _rel(case), "lse")
    _assert_close(best, want.best, _rel(case), "best")
    _assert_close(mass, want.mass[0], _rel(case), "mass")


def test_pool_valid_may_come_with_the_source():
    """A ``Rows`` with its ``pool_valid`` field set (the runtime's) gives the op its pool flags; not twice."""
    case = CASES["gathered-pool-valid-nan"]
    src = dataclasses.replace(case.source, pool_valid=case.pool_valid)
    want = cpu_native.decode_attend(case.query, case.source, SCALE, pool_valid=case.pool_valid)
    got = cpu_native.decode_attend(case.query, src, SCALE)
    assert cpu_native.decode_attend_supported(case.query, src)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="pool_valid given twice"):
        cpu_native.decode_attend(case.query, src, SCALE, pool_valid=case.pool_valid)


def test_the_op_is_seen_by_a_dispatch_mode_and_gives_the_same_result():
    """The wrapper calls ``torch.ops.kvzoo.decode_attend`` through the dispatcher, so a dispatch mode -- a trace
    recorder, FakeTensor -- sees it, and it computes what it computes unobserved."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    case = CASES["gathered-length-valid"]
    direct = cpu_native.decode_attend(case.query, case.source, SCALE, best=True)
    with Record():
        recorded = cpu_native.decode_attend(case.query, case.source, SCALE, best=True)
    assert "kvzoo.decode_attend.default" in seen
    assert all(torch.equal(a, b) for a, b in zip(direct[:3], recorded[:3]))


def test_supported_says_which_inputs_the_op_takes():
    case = CASES["gathered"]
    assert cpu_native.decode_attend_supported(case.query, case.source)
    src = case.source
    assert not cpu_native.decode_attend_supported(case.query, dataclasses.replace(src, keys=src.keys.double(),
                                                                                  values=src.values.double()))
    assert not cpu_native.decode_attend_supported(case.query, dataclasses.replace(src, indices=src.indices.float()))
    assert not cpu_native.decode_attend_supported(case.query.to("meta"), src)
    many = torch.randn(1, 65, 8)  # 65 heads over one group: two blocks of heads (issue 44)
    assert cpu_native.decode_attend_supported(many, Rows(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)))
    assert not cpu_native.decode_attend_supported(case.query, dataclasses.replace(
        src, keys=torch.randn(2, 3, 70, 128)[..., ::2]))  # last dim not contiguous


def test_torch_mode_is_not_supported(monkeypatch):
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    case = CASES["gathered"]
    assert not cpu_native.decode_attend_supported(case.query, case.source)


def test_bad_shapes_are_value_errors_not_crashes():
    case = CASES["gathered"]
    q, src = case.query, case.source
    bad = [
        (dataclasses.replace(src, valid=torch.ones(2, 3, 5, dtype=torch.bool)), {}, r"valid must have shape \[2, 3, 60\]"),
        (dataclasses.replace(src, indices=src.indices[0]), {}, r"indices must be \[B=2, G=3, K\]"),
        (dataclasses.replace(src, values=src.values[:, :, :5]), {}, r"values must be \[B=2, G=3, N=80, Dv\]"),
        (dataclasses.replace(src, length=torch.tensor([1])), {}, r"length must have shape \[2\]"),
        (src, {"pool_valid": torch.ones(2, 3, 60, dtype=torch.bool)}, r"pool_valid must have shape \[2, 3, 80\]"),
        (src, {"prior": (torch.zeros(2, 9, 64), torch.zeros(2, 8))}, r"prior_lse must have shape \[2, 9\]"),
        (dataclasses.replace(src, valid=torch.ones(2, 3, 60)), {}, "valid must be a bool tensor"),
        (Rows(src.keys, None, value_width=65), {}, r"value_width must be in \[1, D=64\]"),
    ]
    for source, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            cpu_native.decode_attend(q, source, SCALE, **kwargs)


def test_meta_tensors_give_the_shapes():
    case = CASES["gathered"]
    src = case.source
    meta = dataclasses.replace(src, keys=src.keys.to("meta"), values=src.values.to("meta"),
                               indices=src.indices.to("meta"))
    out, lse, best, mass = cpu_native.library().decode_attend(case.query.to("meta"), meta.keys, meta.values, 64,
                                                         meta.indices, None, None, None, None, SCALE, None, None,
                                                         True, True)
    assert out.shape == (2, 9, 64) and lse.shape == best.shape == (2, 9) and mass.shape == (2, 9, 60)
    assert out.dtype == torch.float32 and out.device.type == "meta"


def test_the_benchmark_runs_at_a_toy_size(monkeypatch):
    """benchmarks/native_kernels.py (importable): every arm runs, and the table has a row per arm."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    sys.modules.pop("native_kernels", None)
    import native_kernels

    result = native_kernels.measure([1024], [1], rounds=1, base_rev=None, cache_bytes=1 << 20, bandwidth_mib=8)
    impls = {(r["op"], r["form"], r["impl"]) for r in result["rows"]}
    assert ("attention", "pool", "native") in impls and ("attention", "gathered 1/32", "sdpa (gather)") in impls
    assert ("attention", "Quest-like (3 x 64 x 16)", "native") in impls and ("int8 top-j rule", "j=16", "native now") in impls
    assert all(r["ms_1"] > 0 and r["gbps_1"] > 0 for r in result["rows"])
    assert native_kernels.markdown(result).count("\n| 1024 |") == len(result["rows"])
