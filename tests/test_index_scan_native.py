"""The CPU kernel of the int8 index scan (kvzoo/kernels/cpu_native.py) against its PyTorch reference."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from kvzoo.kernels import cpu_native
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    int8_bound_from,
    int8_key_bounds,
    int8_key_entries,
    int8_key_estimate,
    int8_key_estimate_reference,
)

needs_compiler = pytest.mark.skipif(cpu_native.toolchain_missing() is not None,
                                    reason=f"{cpu_native.toolchain_missing()}: the CPU kernels are not built here "
                                           "(kvzoo takes the PyTorch references)")



def _index(B: int, G: int, rows: int, D: int, spare: int = 0, seed: int = 0):
    """int8 entries of random keys (a few large outliers), as views of buffers with ``spare`` rows more."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, G, rows + spare, D, generator=g) * 2
    keys[..., 0, :] *= 40  # an outlier row: its scale is large
    codes, side = int8_key_entries(keys)
    return keys[:, :, :rows], codes[:, :, :rows], side[:, :, :rows]


@needs_compiler
def test_library_builds_here():
    assert cpu_native.library() is not None


@needs_compiler
@pytest.mark.parametrize(("B", "G", "hq", "D", "rows", "spare"), [
    (1, 3, 3, 64, 500, 0), (2, 3, 9, 64, 257, 13), (2, 1, 5, 128, 31, 0), (1, 2, 1, 8, 1, 4), (3, 2, 6, 16, 0, 5),
])
def test_kernel_matches_reference(B, G, hq, D, rows, spare):
    _, codes, side = _index(B, G, rows, D, spare)
    q = torch.randn(B, G, hq, D, generator=torch.Generator().manual_seed(1))
    assert cpu_native.int8_estimate_supported(q, codes, side)
    kernel = cpu_native.int8_estimate(q, codes, side, 0.125, None)
    reference = int8_key_estimate_reference(q, codes, side, 0.125)
    assert kernel.shape == reference.shape == (B, G, hq, rows)
    # the sums run in another order: equal to fp32 rounding of the terms' magnitude
    scale = (q.abs()[..., None, :] * codes.abs().float()[:, :, None]).sum(-1) * side[..., 0].float()[:, :, None] * 0.125
    assert ((kernel - reference).abs() <= 1e-6 * scale + 1e-30).all()


@needs_compiler
def test_kernel_length_masks_past_each_sequence():
    _, codes, side = _index(3, 2, 40, 16, spare=8)
    q = torch.randn(3, 2, 3, 16)
    length = torch.tensor([40, 7, 0])
    out = int8_key_estimate(q, codes, side, 0.5, length=length)
    ref = int8_key_estimate_reference(q, codes, side, 0.5, length=length)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.isinf(out[1, :, :, 7:]).all() and torch.isfinite(out[1, :, :, :7]).all()
    assert torch.isinf(out[2]).all()
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-5, atol=1e-4)


@needs_compiler
def test_bound_from_kernel_estimate_is_certified():
    """The bound built on the kernel's estimate is never below the exact score (computed in float64)."""
    keys, codes, side = _index(2, 3, 700, 64, seed=3)
    q = torch.randn(2, 3, 9, 64, generator=torch.Generator().manual_seed(4)) * 3
    bound, estimate = int8_key_bounds(q, codes, side, 0.125)
    exact = (q.double() @ keys.double().transpose(-1, -2)) * 0.125
    assert (bound.double() >= exact).all()
    # and the estimate is the score of the int8 reconstruction, within the bound's slack
    k_hat = codes.double() * side[..., :1].double()
    slack = 0.125 * q.double().norm(dim=-1, keepdim=True) * SKETCH_SLACK * side[..., 2].double()[:, :, None]
    assert ((estimate.double() - (q.double() @ k_hat.transpose(-1, -2)) * 0.125).abs() <= slack).all()
    picked = torch.tensor([[5, 0, 699]]).expand(2, 3, 9, 3)  # a few rows per query row, as the top-j rule gathers
    gathered = side[:, :, None].expand(2, 3, 9, 700, 3).gather(3, picked[..., None].expand(2, 3, 9, 3, 3))
    assert torch.equal(int8_bound_from(estimate.gather(-1, picked), q, gathered, 0.125), bound.gather(-1, picked))


def test_torch_mode_takes_the_reference(monkeypatch):
    _, codes, side = _index(1, 3, 100, 64)
    q = torch.randn(1, 3, 3, 64)
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    assert torch.equal(int8_key_estimate(q, codes, side, 0.3), int8_key_estimate_reference(q, codes, side, 0.3))


def test_unsupported_inputs_take_the_reference():
    _, codes, side = _index(1, 2, 50, 12)  # D = 12: not a multiple of the kernel's 8 lanes
    q = torch.randn(1, 2, 3, 12)
    assert not cpu_native.int8_estimate_supported(q, codes, side)
    assert torch.equal(int8_key_estimate(q, codes, side, 0.3), int8_key_estimate_reference(q, codes, side, 0.3))
    _, codes8, side8 = _index(1, 2, 50, 16)
    column_major = codes8.transpose(-1, -2).contiguous().transpose(-1, -2)  # rows not contiguous
    assert not cpu_native.int8_estimate_supported(torch.randn(1, 2, 3, 16), column_major, side8)


def test_no_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("KVZOO_CACHE_DIR", str(tmp_path / "cache"))
    cpu_native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, codes, side = _index(1, 3, 60, 64)
            q = torch.randn(1, 3, 3, 64)
            out = int8_key_estimate(q, codes, side, 0.2)
            int8_key_estimate(q, codes, side, 0.2)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "no C++ compiler" in messages[0] and "PyTorch reference" in messages[0]
        assert torch.equal(out, int8_key_estimate_reference(q, codes, side, 0.2))
    finally:
        cpu_native.library.cache_clear()


@needs_compiler
@pytest.mark.parametrize(("B", "G", "hq", "D", "rows", "spare", "j"), [
    (1, 3, 3, 64, 900, 0, 16), (2, 3, 9, 64, 300, 20, 16), (2, 1, 5, 128, 40, 0, 8), (1, 2, 3, 16, 10, 6, 16),
    (2, 2, 2, 8, 1, 3, 1),
])
def test_fused_choose_matches_reference(B, G, hq, D, rows, spare, j):
    from kvzoo.kernels.index_scan import fused_choose_applies, int8_choose, int8_choose_reference

    _, codes, side = _index(B, G, rows + spare, D, seed=5)
    q = torch.randn(B, G, hq, D, generator=torch.Generator().manual_seed(6))
    length = torch.tensor([rows] + [max(1, rows // 2)] * (B - 1))
    j = min(j, codes.shape[2])
    exact = int8_key_estimate_reference(q, codes, side, 0.125, length=length)
    # thresholds in the estimates' range: some heads keep most of their top rows, some few
    threshold = exact.masked_fill(torch.isinf(exact), float("nan")).nanquantile(0.97, dim=-1) - torch.rand(B, G, hq)
    archived = codes.shape[2] + 3  # the archive may hold more rows than the index scans (a fixed capacity)
    assert fused_choose_applies(q, codes, side, j)
    counter = torch.tensor(5)  # a layer's fetched rows: the op adds its count in place
    idx, picked, count = int8_choose(q, codes, side, threshold, j, archived, 0.125, length=length, counter=counter)
    ref_idx, ref_picked, ref_count = int8_choose_reference(q, codes, side, threshold, j, archived, 0.125,
                                                           length=length)
    assert idx.shape == picked.shape == (B, G, hq * j)
    assert int(count) == int(ref_count) == int(picked.sum()) and int(counter) == 5 + int(count)
    assert torch.equal(picked, ref_picked) and torch.equal(idx[picked], ref_idx[ref_picked])
    assert torch.equal(idx, ref_idx)
    assert picked.any()  # the test chooses something
    live = length.view(B, 1, 1).expand_as(idx)
    assert (idx[picked] < live[picked]).all()  # never a row past a sequence's live rows


def test_fused_choose_falls_back_in_torch_mode(monkeypatch):
    from kvzoo.kernels.index_scan import fused_choose_applies, int8_choose, int8_choose_reference

    _, codes, side = _index(1, 3, 64, 64)
    q = torch.randn(1, 3, 3, 64)
    threshold = torch.zeros(1, 3, 3)
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    assert not fused_choose_applies(q, codes, side, 16)
    got = int8_choose(q, codes, side, threshold, 16, 64, 0.125)
    want = int8_choose_reference(q, codes, side, threshold, 16, 64, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_over_threads_matches_reference(threads, threads_at_any_size):
    """An index scanned in runs of rows over threads (forced at this size: ``threads_at_any_size``): the estimates are
    those of the reference (to rounding) and the top-j choice (each run's top lists merged in row order) is the
    reference's."""
    from kvzoo.kernels.index_scan import int8_choose, int8_choose_reference

    B, G, hq, D, rows = 1, 3, 3, 64, 3000  # 3 runs of 1008 rows per group at 2 threads
    _, codes, side = _index(B, G, rows, D, seed=7)
    q = torch.randn(B, G, hq, D, generator=torch.Generator().manual_seed(8))
    length = torch.tensor([4321])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        kernel = cpu_native.int8_estimate(q, codes, side, 0.125, length)
        exact = int8_key_estimate_reference(q, codes, side, 0.125, length=length)
        threshold = exact.masked_fill(torch.isinf(exact), float("nan")).nanquantile(0.999, dim=-1)
        idx, picked, _ = int8_choose(q, codes, side, threshold, 16, rows, 0.125, length=length)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(torch.isinf(kernel), torch.isinf(exact))
    finite = torch.isfinite(exact)
    scale = (q.abs()[..., None, :] * codes.abs().float()[:, :, None]).sum(-1) * side[..., 0].float()[:, :, None] * 0.125
    assert ((kernel - exact).abs()[finite] <= 1e-6 * scale[finite] + 1e-30).all()
    ref_idx, ref_picked, _ = int8_choose_reference(q, codes, side, threshold, 16, rows, 0.125, length=length)
    assert torch.equal(idx, ref_idx) and torch.equal(picked, ref_picked) and picked.any()


@needs_compiler
@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_portable_and_avx2_builds_match_reference(march, monkeypatch):
    """The same source built without AVX-512 (AVX2 with FMA, and plain x86-64's portable C) on CPUs that run them."""
    import subprocess

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if march == "haswell" and not all(f" {f}" in flags for f in ("avx2", "fma", "f16c", "bmi2")):
        pytest.skip("this CPU cannot run AVX2 code")
    try:
        lib = cpu_native.compile_library(march, None)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"the compiler does not build -march={march}: {err.stderr[:200]}")
    monkeypatch.setattr(cpu_native, "_LOADED", [lib])
    from kvzoo.kernels.index_scan import int8_choose, int8_choose_reference

    for B, G, hq, D, rows in ((2, 3, 9, 64, 257), (1, 2, 5, 24, 40)):
        _, codes, side = _index(B, G, rows, D, seed=9)
        q = torch.randn(B, G, hq, D, generator=torch.Generator().manual_seed(10))
        kernel = cpu_native.int8_estimate(q, codes, side, 0.125, None)
        reference = int8_key_estimate_reference(q, codes, side, 0.125)
        scale = (q.abs()[..., None, :] * codes.abs().float()[:, :, None]).sum(-1) * side[..., 0].float()[:, :, None]
        assert ((kernel - reference).abs() <= 1e-6 * scale * 0.125 + 1e-30).all()
        threshold = reference.quantile(0.9, dim=-1)
        got = int8_choose(q, codes, side, threshold, 8, rows, 0.125)
        want = int8_choose_reference(q, codes, side, threshold, 8, rows, 0.125)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_bounds_past_length_are_minus_infinity_whatever_the_side_columns_hold(kernels, monkeypatch):
    """A preallocated index's rows past ``length`` hold anything: an fp16 key norm that overflowed (inf) there made
    ``-inf + inf = NaN`` bounds, which a top-j rule may pick. Past length the bound is -inf, whatever is stored."""
    monkeypatch.setenv("KVZOO_KERNELS", kernels)
    _, codes, side = _index(2, 2, 48, 16, spare=0)
    side = side.clone()
    side[:, :, 30:, 1:] = float("inf")  # past the length below: err and norm overflowed
    length = torch.tensor([30, 12])
    bound, estimate = int8_key_bounds(torch.randn(2, 2, 3, 16), codes, side, 0.5, length=length)
    assert not torch.isnan(bound).any()
    assert torch.isneginf(bound[0, :, :, 30:]).all() and torch.isneginf(bound[1, :, :, 12:]).all()
    assert torch.isfinite(bound[1, :, :, :12]).all()


def test_the_native_librarys_cache_key_names_the_processor_on_x86_arm_and_elsewhere(monkeypatch, tmp_path):
    """A library built with -march=native in a shared cache must never be loaded by another processor: the key
    holds the model and instruction sets (x86: model name, flags; ARM: implementer, part, Features), or the
    machine's name where nothing names the processor; ARM builds take -mcpu=native."""
    import builtins
    import io

    arm = ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve2\nCPU implementer\t: 0x41\n"
           "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n\nprocessor\t: 1\n")
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            if cpuinfo is None:
                raise FileNotFoundError(path)
            return io.StringIO(cpuinfo)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    cpuinfo = arm
    signature = cpu_native._cpu_signature()
    assert "CPU part\t: 0xd40" in signature and "sve2" in signature and "implementer" in signature
    cpuinfo = None
    monkeypatch.setattr(cpu_native.sys, "platform", "linux")
    assert cpu_native._cpu_signature().startswith("host ")
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "aarch64")
    assert cpu_native._arch_flag("native") == "-mcpu=native" and cpu_native._arch_flag("armv8-a") == "-march=armv8-a"
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "x86_64")
    assert cpu_native._arch_flag("native") == "-march=native"


def test_this_machines_cache_key_holds_its_model_name():
    if not os.path.exists("/proc/cpuinfo") or "model name" not in open("/proc/cpuinfo").read():
        pytest.skip("no x86 /proc/cpuinfo here")
    assert "model name" in cpu_native._cpu_signature() and "flags" in cpu_native._cpu_signature()
