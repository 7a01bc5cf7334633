"""``make gpu-check`` on CPU: the toy run, the deadline, the preflight, the sizes, the checks its rows make.

The run itself (``benchmarks/gpu_check.py``) is a watcher that starts a worker process; the deadline tests use
cells that only sleep, so their worker imports no torch and the timings they rely on are seconds, not
milliseconds.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_kernels  # noqa: E402
import gpu_runtime  # noqa: E402


@pytest.fixture(autouse=True)
def _collect(monkeypatch):
    """The caches these tests build hold cycles (a graphed cache and its DecodeGraph): collect them, so that a
    later test counting live caches (benchmarks/soak.py's) counts its own. ``ACTIVE_LAYER`` (the fallback for a
    transformers that hands no kwargs) is cleared too. The bench writes ``KVZOO_KERNELS`` into ``os.environ`` (it
    is a process of its own on the GPU machine): put back after each test, else a later test in this worker runs
    with the kernels switched off."""
    monkeypatch.setenv("KVZOO_KERNELS", "auto")
    yield
    from kvzoo.framework.layer import ACTIVE_LAYER

    ACTIVE_LAYER.set(None)
    gc.collect()


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _rows(out: Path) -> dict[str, dict]:
    return gpu_check.cell_rows(gpu_check.read_rows(out / "rows.jsonl"))


# --- the plan --------------------------------------------------------------------------------------------------
def test_the_headline_plan_is_the_headline_table_and_fits_its_budget_at_one_and_a_half_times_its_estimates():
    cells = gpu_check.plan(toy=False)
    ids = [c["id"] for c in cells]
    assert len(ids) == len(set(ids))
    assert ids[0] == "build native CPU ops"  # before anything is timed
    assert ids[1:9] == [f"kernel mla16 {case} B{b} {n}" for case in ("pool", "dense") for n in (32768, 131072)
                        for b in (1, 8)]
    assert ids[9] == "prefill kvzoo 32768"
    decode = {(c["params"]["policy"], c["params"]["kernels"], c["params"]["mode"], c["params"]["context"],
               c["params"]["batch"]) for c in cells if c["part"] == "decode"}
    want = {(p, k, m, n, b) for p in ("full", "vestige+sketch", "quest") for k in ("torch", "triton")
            for m in ("eager", "graph") for n in (32768, 131072) for b in (1, 8)}
    want |= {("transformers", "torch", "eager", n, b) for n in (32768, 131072) for b in (1, 8)}
    assert decode == want
    seen = set()
    for c in cells:  # a decode cell's prefill, and its reference (torch, eager), come before it
        seen.add(c["id"])
        if c["part"] == "decode":
            p = c["params"]
            kind = "transformers" if p["policy"] == "transformers" else "kvzoo"
            assert f"prefill {kind} {p['context']}" in seen
            if p["policy"] != "transformers":
                assert f"runtime {p['policy']} torch eager B{p['batch']} {p['context']}" in seen
    assert gpu_check.total_s(cells, toy=False, factor=1.5) <= gpu_check.BUDGET_S
    more = gpu_check.plan(toy=False, which="more")
    repeated = set(ids) & {c["id"] for c in more}  # a second run builds and prefills again, and repeats nothing else
    assert repeated == {"build native CPU ops", "prefill kvzoo 32768", "prefill kvzoo 131072"}
    assert {c["params"]["policy"] for c in more if c["part"] == "decode"} == {"streaming_llm", "vestige"}
    assert any(c["part"] == "sweep" for c in more)
    with pytest.raises(ValueError, match="--plan must be one of"):
        gpu_check.plan(toy=False, which="headlines")


def test_the_estimates_are_the_toy_runs_counts_times_the_rates():
    """A decode cell's estimate moves with the counts the toy run measured (gpu_costs.json), not a hand number."""
    import gpu_plan

    costs = gpu_plan.load_costs()
    cells = {c["id"]: c for c in gpu_plan.plan(toy=False, costs=costs)}
    doubled = {"arms": {k: {**a, "step_launches_per_layer": 2 * a["step_launches_per_layer"]}
                        for k, a in costs["arms"].items()}}
    slower = {c["id"]: c for c in gpu_plan.plan(toy=False, costs=doubled)}
    key = "runtime quest torch eager B1 32768"
    steps = gpu_plan.WARMUP + gpu_plan.STEPS
    launches = costs["arms"]["quest torch"]["step_launches_per_layer"] * gpu_plan.LAYERS
    assert slower[key]["expected_s"] - cells[key]["expected_s"] == pytest.approx(
        steps * launches * gpu_plan.RATES["host_s_per_launch"], rel=0.05)
    with pytest.raises(KeyError, match="no counts for the arm 'quest triton'"):
        gpu_plan.plan(toy=False, costs={"arms": {k: a for k, a in costs["arms"].items() if k != "quest triton"}})


def test_dry_run_prints_the_plan_against_the_budget_and_runs_nothing(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "none")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"plan headline: {len(gpu_check.plan(toy=False))} cells, budget 540 s")
    assert "kernel mla16 pool B1 32768" in printed and "at 1.5x the estimates" in printed
    assert "(fits at 1.5x)" in printed
    assert not (tmp_path / "none").exists()
    assert gpu_check.main(["--dry-run", "--plan", "more", "--out", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.startswith("plan more: ")


def test_a_prefill_too_big_for_the_free_memory_is_skipped_and_so_are_its_cells(monkeypatch):
    bench = gpu_runtime.RuntimeBench("cpu", toy=True)
    monkeypatch.setattr(gpu_runtime, "_free_bytes", lambda device: 2**20)
    try:
        with pytest.raises(gpu_runtime.Skip, match="the prefill of 512 tokens needs about"):
            bench.prefill_cell({"kind": "kvzoo", "context": 512})
        with pytest.raises(gpu_runtime.Skip, match="failed earlier"):
            bench.base("kvzoo", 512)
        assert bench.model is None  # nothing built
    finally:
        bench.close()


def test_only_keeps_a_decode_cells_prefill():
    cells = gpu_check.select(gpu_check.plan(toy=True), ["runtime quest torch graph B2"])
    assert [c["id"] for c in cells] == ["prefill kvzoo 512", "runtime quest torch graph B2 512"]


# --- the deadline ---------------------------------------------------------------------------------------------
def test_a_cell_running_past_the_deadline_is_killed_and_the_rows_before_it_are_kept(tmp_path):
    out = tmp_path / "check"
    code = gpu_check.main(["--toy", "--only", "fake", "--fake-cells", "0,600:0.5,0", "--budget", "10",
                           "--no-probe", "--out", str(out)])
    assert code == 1
    rows = _rows(out)
    assert rows["fake 0 sleeps 0 s"]["status"] == "ok"
    slow = rows["fake 1 sleeps 600 s"]
    assert slow["status"] == "timeout" and "deadline" in slow["error"] and slow["seconds"] < 30
    assert rows["fake 2 sleeps 0 s"]["status"] == "skipped" and "deadline" in rows["fake 2 sleeps 0 s"]["reason"]
    state = json.loads((out / "plan.json").read_text())
    assert state["status"] == "stopped at the deadline"
    report = (out / "gpu_check.md").read_text()
    assert "Status: stopped at the deadline" in report
    assert "## Not run (1)" in report and "| fake 2 sleeps 0 s |" in report
    assert "| fake 1 sleeps 600 s | timeout |" in report
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.FILES)


def test_a_cell_that_would_not_end_in_time_is_skipped_and_a_smaller_one_after_it_runs(tmp_path):
    out = tmp_path / "check"
    assert gpu_check.main(["--toy", "--only", "fake", "--fake-cells", "0,0:1000,0", "--budget", "60", "--no-probe",
                           "--out", str(out)]) == 0
    rows = _rows(out)
    assert rows["fake 1 sleeps 0 s"]["status"] == "skipped"
    assert rows["fake 1 sleeps 0 s"]["reason"].startswith("the deadline: expected 1000 s")
    assert rows["fake 0 sleeps 0 s"]["status"] == rows["fake 2 sleeps 0 s"]["status"] == "ok"
    assert "Status: complete" in (out / "gpu_check.md").read_text()


def test_sigterm_kills_the_worker_and_the_summary_says_what_ran(tmp_path):
    """The device tool ends a command past its limit with a signal: the rows so far stay, the cell in flight and the
    rest get rows saying so, and the summary is written."""
    import os
    import signal
    import threading
    import time

    out = tmp_path / "check"

    def terminate_once_the_first_row_is_in():
        give_up = time.time() + 60
        while time.time() < give_up and "fake 0" not in _text(out / "rows.jsonl"):
            time.sleep(0.1)
        time.sleep(0.5)  # the slow cell is running by now
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_the_first_row_is_in, daemon=True).start()
    code = gpu_check.main(["--toy", "--only", "fake", "--fake-cells", "0,600:0.5,0", "--budget", "120",
                           "--no-probe", "--out", str(out)])
    assert code == 130
    rows = _rows(out)
    assert rows["fake 0 sleeps 0 s"]["status"] == "ok"
    assert rows["fake 1 sleeps 600 s"]["status"] == "timeout"
    assert "when gpu-check was interrupted (signal 15)" in rows["fake 1 sleeps 600 s"]["error"]
    assert rows["fake 2 sleeps 0 s"]["reason"] == "not started: gpu-check interrupted (signal 15)"
    assert "Status: interrupted (signal 15)" in (out / "gpu_check.md").read_text()
    assert signal.getsignal(signal.SIGTERM) is not gpu_check._on_signal  # the handler put back


def test_a_worker_that_dies_mid_cell_gets_a_crashed_row_and_a_fresh_worker_goes_on(tmp_path, monkeypatch):
    """The watcher's side of a crash: the cell in flight gets a row naming the exit code, the rest run."""
    out = tmp_path / "check"
    monkeypatch.setenv("KVZOO_GPU_CHECK_TEST_CRASH", "fake 1")
    assert gpu_check.main(["--toy", "--only", "fake", "--fake-cells", "0,0,0", "--budget", "60", "--no-probe",
                           "--out", str(out)]) == 1
    rows = _rows(out)
    assert rows["fake 1 sleeps 0 s"]["status"] == "crashed" and "rc 86" in rows["fake 1 sleeps 0 s"]["error"]
    assert rows["fake 0 sleeps 0 s"]["status"] == rows["fake 2 sleeps 0 s"]["status"] == "ok"
    assert len(json.loads((out / "plan.json").read_text())["workers"]) == 2


# --- the preflight --------------------------------------------------------------------------------------------
def test_gpu_check_times_nothing_when_the_preflight_refuses(tmp_path):
    out = tmp_path / "check"
    assert gpu_check.main(["--toy", "--pretend", "transformers=5.17.0", "--no-probe", "--out", str(out)]) == 2
    assert _rows(out) == {}
    report = (out / "gpu_check.md").read_text()
    assert "refused by the preflight (transformers 5.17.0, huggingface-hub " in report
    assert "## Refused by the preflight: nothing was timed" in report and "make gpu-bundle" in report


# --- sizes ------------------------------------------------------------------------------------------------------
def test_a_gathered_case_shares_its_pool_so_its_copies_fit_in_memory():
    """A gathered 128k case at batch 8 once cycled 256 copies of the whole pool (276 GiB): the copies now hold what
    one call reads, the pool is shared."""
    case = gpu_kernels.build_case("mla16", "gathered 16", 8, 131072, device="cuda", dtype=torch.bfloat16, toy=False)
    copies = gpu_kernels.copies_for(case, "cuda", free=139 * 2**30)
    assert copies * case.copy_bytes + case.shared_bytes <= gpu_kernels.COPIES_MAX_BYTES + case.shared_bytes
    assert case.shared_bytes == 8 * 131072 * 576 * 2  # one pool, 1.2 GB
    assert copies * case.bytes >= 2 * gpu_kernels.L2_BYTES > (copies - 1) * case.bytes  # a round reads past the L2
    dense = gpu_kernels.build_case("mla16", "dense", 8, 131072, device="cuda", dtype=torch.bfloat16, toy=False)
    assert gpu_kernels.copies_for(dense, "cuda", free=139 * 2**30) == 1  # one copy reads 1.2 GB: past the L2
    with pytest.raises(gpu_kernels.Skip, match="needs .* GiB free"):
        gpu_kernels.copies_for(dense, "cuda", free=2 * 2**30)


def test_a_runtime_cell_too_big_for_the_free_memory_is_skipped_before_allocating(monkeypatch):
    bench = gpu_runtime.RuntimeBench("cpu", toy=True)
    monkeypatch.setattr(gpu_runtime, "_free_bytes", lambda device: 2**20)
    try:
        with pytest.raises(gpu_runtime.Skip, match="needs about"):
            bench.decode_cell({"policy": "full", "kernels": "torch", "mode": "eager", "context": 512, "batch": 1})
        assert bench.model is None  # nothing built
    finally:
        bench.close()


# --- what a row checks -------------------------------------------------------------------------------------------
def test_a_kernel_cell_off_its_fp32_reference_is_a_failed_row(monkeypatch):
    bench = gpu_kernels.KernelBench("cpu", toy=True)
    bench._bandwidth = 1e10
    real = bench.case

    def wrong(p):
        case = real(p)
        case.run = lambda inputs, **_: case.check(inputs) * 1.01  # 1 % off: over fp16's 2e-3
        case.split = None
        return case

    monkeypatch.setattr(bench, "case", wrong)
    row = bench.measure({"model": "mla16", "case": "dense", "batch": 1, "rows": 64})
    assert row["status"] == "failed" and row["check"].startswith("FAILED")
    assert "relative error 1.0" in row["error"] and row["eager_ms"] > 0


def test_compare_passes_equal_logits_a_tie_and_fails_a_clear_token_change_and_nan():
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(2, 1000, generator=g) for _ in range(3)]
    assert gpu_runtime.compare(ref, [r.clone() for r in ref], 3e-2)["ok"]
    off = gpu_runtime.compare(ref, [r + 0.1 * r.norm() for r in ref], 3e-2)
    assert not off["ok"] and "relative error" in off["why"]
    ref[1][0, :2] = torch.tensor([5.0, 5.0 - 1e-4])  # a near tie in the reference ...
    tie = [r + 1e-3 * torch.randn(r.shape, generator=g) for r in ref]  # ... rounding noise everywhere ...
    tie[1][0, 1] = tie[1][0, 0] + 1e-4  # ... and the tie flipped
    result = gpu_runtime.compare(ref, tie, 3e-2)
    assert result["ok"] and result["ties"] == 1
    flipped = [r.clone() for r in ref]
    low = ref[2][1].argmin()
    flipped[2][1, low] = ref[2][1].max() + 5.0  # one logit gone wrong: no tie
    result = gpu_runtime.compare(ref, flipped, 10.0)  # a loose tolerance: the token alone fails it
    assert not result["ok"] and "greedy token differs: step 2 seq 1" in result["why"]
    nan = [r.clone() for r in ref]
    nan[0][0, 0] = float("nan")
    assert "non-finite" in gpu_runtime.compare(ref, nan, 3e-2)["why"]


def test_the_kernel_guard_fails_instead_of_falling_back_and_counts_calls(monkeypatch):
    from kvzoo.kernels import dispatch, index_scan

    monkeypatch.setenv("KVZOO_KERNELS", "auto")
    guard = gpu_runtime.KernelGuard()
    guard.install()
    try:
        assert index_scan.run is dispatch.run  # both names patched
        before = guard.snapshot()
        assert dispatch.run("decode_attention", lambda x: x + 1, lambda x: -1, 1) == 2

        def broken(x):
            raise RuntimeError("boom")

        with pytest.raises(gpu_runtime.KernelFailed, match="'index_scan' raised RuntimeError: boom"):
            index_scan.run("index_scan", broken, lambda x: -1, 1)
        calls, problems = guard.since(before)
        assert calls == {"decode_attention": 1} and problems == ["index_scan: RuntimeError: boom"]
        assert "index_scan" not in dispatch._failed  # no switch to PyTorch
    finally:
        guard.uninstall()
    assert index_scan.run is dispatch.run and dispatch.run.__module__ == "kvzoo.kernels.dispatch"


def test_a_graph_row_on_a_stand_in_graph_replays_checks_and_lets_its_cache_go():
    """The graph row's plumbing on CPU (a stand-in replays the captured step): transplant, install, the teacher-
    forced warm-up compared with the eager reference, the timed steps all replayed, the cache released."""
    from tests.test_static_step import StandInGraph

    bench = gpu_runtime.RuntimeBench("cpu", toy=True, graph_runner=StandInGraph)
    try:
        row = bench.decode_cell({"policy": "full", "kernels": "torch", "mode": "graph", "context": 512, "batch": 2})
        assert row["status"] == "ok", row.get("error")
        assert row["replays"] == row["steps"] == bench.s.steps and row["captures"] == 1
        assert row["check"]["ok"] and row["check"]["steps"] == bench.s.warmup and row["bookkeeping_ms"] > 0
        assert len(bench.model._kvzoo_graphs) == 0
    finally:
        bench.close()


# --- the toy run (what CI runs) -----------------------------------------------------------------------------------
def test_gpu_check_toy_run_gives_every_planned_cell_a_row(tmp_path):
    """make gpu-check at its toy size on CPU, both plans: the build first, the kernels in the interpreter, the
    runtime on a toy model with its graph cells on a stand-in that refuses a step a CUDA graph could not capture,
    every row checked (the torch/eager rows against float64 attention); the summary lists each part; the counts the
    rows record are the ones gpu_costs.json holds (the plan's estimates)."""
    import gpu_plan

    out = tmp_path / "check"
    assert gpu_check.main(["--toy", "--plan", "all", "--no-probe", "--out", str(out)]) == 0
    rows = _rows(out)
    planned = [c["id"] for c in gpu_check.plan(toy=True, which="all")]
    assert set(rows) == set(planned) and all(r["status"] == "ok" for r in rows.values())
    assert planned[0] == "build native CPU ops" and "build_s" in rows[planned[0]]
    for cell, row in rows.items():
        if row["part"] != "decode":
            continue
        if (row["kernels"], row["mode"]) == ("torch", "eager") and row["policy"] != "transformers":
            assert row["check"]["ok"] and row["check"]["calls"] > 0, cell  # float64 on its own inputs
        else:
            assert row["check"]["ok"] and row["check"]["steps"] == 2, cell
        if row["mode"] == "graph":
            assert row["replays"] == row["steps"] and row["captures"] >= 1, cell
    graphs = {(r["policy"], r["kernels"]) for r in rows.values() if r.get("mode") == "graph"}
    assert {("vestige+sketch", "torch"), ("vestige+sketch", "triton"), ("quest", "torch")} <= graphs
    triton = [r for r in rows.values() if r.get("kernels") == "triton"]
    assert triton and all(sum(r["kernel_calls"].values()) > 0 for r in triton)
    assert rows["runtime vestige+sketch triton eager B1 512"]["kernel_calls"].get("index_scan", 0) > 0
    full = rows["runtime full torch eager B1 512"]
    assert rows["runtime streaming_llm torch eager B1 512"]["kv_bytes_per_step"] * 8 < full["kv_bytes_per_step"]
    assert 1.95 < rows["runtime full torch eager B2 512"]["kv_bytes_per_step"] / full["kv_bytes_per_step"] < 2.05
    report = (out / "gpu_check.md").read_text()
    assert "Status: complete" in report and "## Kernels" in report and "## Runtime decode" in report
    assert "| full | torch | graph (2/2 replayed) | 512 | 2 |" in report and "| mla16 B1 64 pool |" in report
    measured = gpu_plan.costs_from_rows(gpu_check.read_rows(out / "rows.jsonl"))["arms"]
    committed = gpu_plan.load_costs()["arms"]
    assert set(measured) == set(committed)
    for arm, counts in measured.items():  # a change that moves the counts re-measures them (gpu_plan.py's docstring)
        for key in ("step_launches_per_layer", "setup_launches_per_layer"):
            assert counts[key] == pytest.approx(committed[arm][key], rel=0.25), (arm, key)
        assert counts["triton_ops"] == committed[arm]["triton_ops"], arm
