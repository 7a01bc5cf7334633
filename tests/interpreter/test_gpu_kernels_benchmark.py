"""benchmarks/gpu_kernels.py at toy size in the interpreter: every op runs, its check against fp32 passes."""

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_kernels_toy(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_kernels", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "gk"
    assert bench.main(["--toy", "--rows", "64", "--batches", "1", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    ops = {(r["op"], r["model"], r["case"]) for r in result["rows"]}
    assert ops == {("decode_attention", "mla16", "dense"), ("decode_attention", "mla16", "pool"),
                   ("decode_attention", "mla16", "gathered 16"), ("decode_attention", "mla16", "step 1/32 + 16"),
                   ("decode_attention", "gqa32/8", "dense"), ("decode_attention", "gqa32/8", "pool"),
                   ("index_scan_reduce", "mla16", "sketch"), ("index_scan", "mla16", "pages")}
    assert all(r["check"] == "ok" and r["eager_ms"] > 0 and r["graph_ms"] is None for r in result["rows"])
    assert all(r["split_eager_ms"] > 0 for r in result["rows"] if r["case"] in ("dense", "pool"))
    (swept,) = result["sweep"]  # the toy sweep: one case, two configurations, each checked against fp32
    assert swept["best"] is not None and all(p["ok"] for p in swept["points"]) and len(swept["points"]) == 2
    text = out.with_suffix(".md").read_text()
    assert "| decode_attention | mla16 | 1 | 64 | step 1/32 + 16 |" in text and "| sweep case |" in text


def test_gpu_runtime_kernel_path_toy(tmp_path, monkeypatch):
    """benchmarks/gpu_runtime.py --kernels torch,triton: both decode paths run and read the same KV bytes."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_runtime

    out = tmp_path / "runtime"
    assert gpu_runtime.main(["--toy", "--device", "cpu", "--contexts", "256", "--batches", "1", "--steps", "1",
                             "--chunk", "256", "--policies", "full,vestige+sketch", "--kernels", "torch,triton",
                             "--out", str(out)]) == 0
    rows = {(r["policy"], r["kernels"]): r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {(p, k) for p in ("full", "vestige+sketch") for k in ("torch", "triton")}
    assert all("error" not in r for r in rows.values())
    for policy in ("full", "vestige+sketch"):
        assert rows[(policy, "triton")]["kv_bytes_per_step"] == rows[(policy, "torch")]["kv_bytes_per_step"]
    # the table has a mode column (eager, graph, capacity) since the runtime benchmark compares CUDA graphs
    assert "| vestige+sketch | triton | eager | 256 | 1 |" in out.with_suffix(".md").read_text()
