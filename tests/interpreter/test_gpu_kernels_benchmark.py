"""``make gpu-check``'s rows with the kernels in the interpreter: a kernel that raises inside a runtime row fails
that row, naming the exception -- the benchmark never times the PyTorch fallback under a Triton label."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_runtime  # noqa: E402


def test_a_triton_row_whose_kernel_raises_is_a_failed_row_naming_it(monkeypatch):
    from kvzoo.kernels import decode_attention, dispatch

    def broken(*args, **kwargs):
        raise RuntimeError("boom: no kernel today")

    bench = gpu_runtime.RuntimeBench("cpu", toy=True)
    worker = gpu_check.Worker({"toy": True})
    worker._device, worker._runtime = "cpu", bench
    cells = {c["id"]: c for c in gpu_check.plan(toy=True)}
    try:
        assert gpu_check.run_cell(worker, cells["prefill kvzoo 512"], 1e18)["status"] == "ok"
        monkeypatch.setattr(decode_attention.triton, "attend_triton", broken)  # (auto on CUDA: tests/test_gpu_check.py)
        row = gpu_check.run_cell(worker, cells["runtime full triton eager B1 512"], 1e18)
        assert row["status"] == "failed", row
        assert "KernelFailed" in row["error"] and "RuntimeError: boom: no kernel today" in row["error"]
        assert "decode_attention" not in dispatch._failed
    finally:
        bench.close()
