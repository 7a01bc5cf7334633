"""Smoke runs of the benchmark scripts at their toy sizes (the figures themselves are the scripts' job)."""

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_runtime_toy_run_writes_markdown_and_json(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gpu_runtime", None)
    import gpu_runtime

    out = tmp_path / "runtime"
    assert gpu_runtime.main(["--toy", "--device", "cpu", "--contexts", "1024", "--batches", "1,2", "--steps", "2",
                             "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["policy"], r["batch"]): r for r in result["rows"] if "error" not in r}
    assert set(rows) == {(p, b) for p in gpu_runtime.POLICIES for b in (1, 2)}
    assert result["bandwidth_bytes_per_s"] > 0
    for (_policy, batch), row in rows.items():
        assert row["decode_ms"] > 0 and row["kv_bytes_per_step"] > 0
        assert (row["prefill_s"] is not None) == (batch == 1)
    # a 32x policy reads fewer KV bytes per step than full; batch 2 reads about twice batch 1 (the
    # context grew by batch 1's decode steps in between)
    assert rows[("streaming_llm", 1)]["kv_bytes_per_step"] * 8 < rows[("full", 1)]["kv_bytes_per_step"]
    assert 1.95 < rows[("full", 2)]["kv_bytes_per_step"] / rows[("full", 1)]["kv_bytes_per_step"] < 2.05
    assert "| vestige+sketch | torch | eager | 1024 | 2 |" in out.with_suffix(".md").read_text()


def test_gpu_check_toy_run_joins_both_parts(tmp_path, monkeypatch):
    """make gpu-check at its toy size on CPU: both parts run (the kernels in the interpreter), both reports join."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gpu_check", None)
    import gpu_check

    out = tmp_path / "check"
    assert gpu_check.main(["--toy", "--out", str(out)]) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [p["part"] for p in summary] == ["gpu_kernels", "gpu_runtime"]
    assert all(p["returncode"] == 0 and not p["timed_out"] for p in summary)
    report = (out / "gpu_check.md").read_text()
    assert "## gpu_kernels" in report and "## gpu_runtime" in report and "| full | torch | capacity | 512 | 2 |" in report


def test_step_ops_counts_every_policy_against_transformers(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("step_ops", None)
    import step_ops

    from kvzoo.models import tiny_llama

    rows = step_ops.measure({"tiny Llama": tiny_llama}, {k: step_ops.POLICIES[k] for k in ("full", "streaming_llm")})
    caches = [r["cache"] for r in rows]
    assert caches[:2] == ["transformers DynamicCache", "transformers StaticCache"]
    assert {"kvzoo full", "kvzoo streaming_llm"} <= set(caches)
    assert all(r["syncs"] == 0 for r in rows)
    assert "| tiny Llama | kvzoo full | yes |" in step_ops.markdown(rows)


def test_soak_toy_run_reports_every_policy_and_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("soak", None)
    import soak

    out = tmp_path / "soak.json"
    assert soak.main(["--steps", "40", "--context", "30", "--window", "10", "--models", "tiny-llama", "--check",
                      "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == set(soak.POLICIES) and all(r["step"] == 40 and r["ms_per_step"] > 0 for r in rows.values())
    assert rows["streaming_llm"]["attended_rows"] <= 256 and rows["streaming_llm"]["archived_rows"] == 0  # 70 < budget
    assert "| tiny-llama | vestige+sketch | 40 |" in capsys.readouterr().out
    # the growth criterion: a streaming_llm slower at 10,000 steps than 1.3x its 1,000-step figure fails the soak
    fake = [{"model": "m", "policy": "streaming_llm", "step": 1_000, "ms_per_step": 1.0},
            {"model": "m", "policy": "streaming_llm", "step": 10_000, "ms_per_step": 1.4}]
    assert soak.check(fake, 100.0, 100.0) == ["m: streaming_llm ms/step at 10,000 steps is 1.40x its ms/step at 1,000 "
                                              "(limit 1.3x)"]
    assert soak.check(fake[:1], 100.0, 200.0)[0].startswith("RSS grew 100 MiB")
