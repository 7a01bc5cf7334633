"""The leaderboard on Ray: the same rows as the local executor, no trial lost or duplicated when a
worker is killed, a driver interrupted (in process, and by a real Ctrl-C to a `kvzoo leaderboard` process)
and rerun resumes, a trial that keeps losing workers is an error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from kvzoo.bench import runner
from kvzoo.bench.executors import TrialGroup, Work
from kvzoo.bench.ray_executor import RayExecutor

ROOT = Path(__file__).resolve().parents[2]

# The grid: the tiny Llama, 3 policies (besides the full-cache reference), 2 ratios, 2 tasks --
# as a Grid, and as the command line that runs the same grid.
POLICIES = ("full", "streaming_llm", "snapkv", "h2o")
GRID = runner.needle_grid(models=("tiny-llama",), tasks=("niah_single", "niah_multikey"), context_tokens=(512,),
                          depths=(0.5,), policies=POLICIES, ratios=(2, 4), positions=("after",), max_new_tokens=4,
                          continuation_tokens=16)
CLI = ["leaderboard", "--preset", "tiny", "--model", "tiny-llama", "--tasks", "niah_single", "niah_multikey",
       "--context-tokens", "512", "--depths", "0.5", "--policies", *POLICIES, "--ratios", "2", "4",
       "--positions", "after", "--max-new-tokens", "4", "--continuation-tokens", "16", "--no-plots", "--no-progress"]
TRIALS = 2 * (1 + 3 * 2)
# where and how a row ran, and how long things took: the only fields that may differ between executors
RUN_FIELDS = {"worker", "trial_seconds", "model_load_s", "attempts", "attempt_errors", "finished_at", "peak_rss_bytes", "wall_s",
              "prefill_s", "compress_s", "score_s", "continuation_s", "question_s", "decode_s", "decode_ms_per_step",
              "prefill_shared"}  # which trial of a worker made the shared prefill depends on the schedule


def lines_of(path: Path) -> list[dict[str, Any]]:
    """Every line of a results file as JSON: fails on a partial line."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def same_row(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for name in set(a) - RUN_FIELDS:
        if isinstance(a[name], float):  # two processes with other thread counts: fp32 sums round differently;
            # the Δ figures (differences of NLLs of ~2-6 nats, per decode step since issue 23) carry that as ~1e-6 abs
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-5), name
        else:
            assert a[name] == b[name], name


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The grid on the local executor, through the same command line."""
    from kvzoo.cli import main

    out = tmp_path_factory.mktemp("local") / "local.jsonl"
    assert main([*CLI, "--out", str(out)]) == 0
    rows = lines_of(out)
    assert [r["key"] for r in rows] == [t.key for t in runner.plan(GRID)]  # the command line's grid is GRID
    assert len(rows) == TRIALS and all(r["status"] == "ok" and r["attempts"] == 1 for r in rows)
    return {r["key"]: r for r in rows}


def test_two_ray_workers_write_exactly_the_rows_the_local_executor_writes(local_rows, tmp_path):
    """`kvzoo leaderboard --executor ray --workers 2` with no address: it starts a local Ray instance of its own
    (a fresh process), and its rows are the local executor's, field by field, bar where and how long they ran."""
    out = tmp_path / "ray.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvzoo.cli", *CLI, "--executor", "ray", "--workers", "2",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on RayExecutor(address=None, workers=2" in done.stderr
    stored = lines_of(out)
    assert len(stored) == TRIALS and {r["key"] for r in stored} == set(local_rows)
    for row in stored:
        same_row(row, local_rows[row["key"]])
        assert row["attempts"] == 1 and row["attempt_errors"] == [] and row["trial_seconds"] > 0
    assert all(r["delta_nll"] is not None for r in stored)  # every trial was measured against its reference
    workers = {r["worker"] for r in stored}
    assert len(workers) == 2 and done.stdout.count("| " + stored[0]["worker"].split(":")[0]) >= 2
    for worker in workers:  # the summary says who ran what
        assert f"| {worker} | {sum(r['worker'] == worker for r in stored)} | 0 |" in done.stdout


def test_a_killed_worker_loses_no_trial_duplicates_none_and_the_trial_shows_one_retry(ray_cluster, local_rows,
                                                                                      tmp_path):
    path = tmp_path / "killed.jsonl"
    killed: list[str] = []

    def kill_after_two_rows(row: dict[str, Any]) -> None:
        if len(killed) == 0 and row["attempts"] == 1 and sum(1 for _ in path.open()) == 2:
            killed.append(row["worker"])
            os.kill(int(row["worker"].rsplit(":", 1)[1]), signal.SIGKILL)  # SIGKILL: no chance to clean up

    runner.run_grid(GRID, path, progress=False, on_row=kill_after_two_rows, executor=RayExecutor(workers=2))
    stored = lines_of(path)
    assert killed and len(stored) == TRIALS
    assert sorted(r["key"] for r in stored) == sorted(local_rows)  # every trial exactly once
    assert all(r["status"] == "ok" for r in stored)
    retried = [r for r in stored if r["attempts"] > 1]
    assert len(retried) == 1 and retried[0]["attempts"] == 2
    (cause,) = retried[0]["attempt_errors"]
    assert "ActorDiedError" in cause and retried[0]["worker"] != killed[0]
    assert all(r["worker"] != killed[0] for r in stored[2:])
    for row in stored:
        same_row(row, local_rows[row["key"]])


def test_an_interrupted_driver_leaves_whole_lines_and_a_rerun_runs_only_the_rest(ray_cluster, local_rows, tmp_path):
    path = tmp_path / "interrupted.jsonl"
    seen: list[str] = []

    def interrupt_after_three(row: dict[str, Any]) -> None:
        seen.append(row["key"])
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run_grid(GRID, path, progress=False, on_row=interrupt_after_three, executor=RayExecutor(workers=2))
    first = lines_of(path)
    assert [r["key"] for r in first] == seen and len(first) == 3
    rerun: list[str] = []
    rows = runner.run_grid(GRID, path, progress=False, on_row=lambda row: rerun.append(row["key"]),
                           executor=RayExecutor(workers=2))
    assert sorted(rerun) == sorted(set(local_rows) - set(seen))  # only what was missing ran
    stored = lines_of(path)
    assert len(stored) == TRIALS and sorted(r["key"] for r in stored) == sorted(local_rows)
    assert [r["finished_at"] for r in stored[:3]] == [r["finished_at"] for r in first]  # the first rows untouched
    for row in rows:
        same_row(row, local_rows[row["key"]])  # ΔNLL against a reference read back from the file, too


def _processes_with_env(entry: str) -> list[str]:
    """``pid cmdline`` of every live process whose environment holds ``entry`` (``NAME=value``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours
            continue
        if entry.encode() in environ and int(pid) != os.getpid():
            found.append(f"{pid} {cmdline.strip()}")
    return found


def test_ctrl_c_on_a_ray_driver_leaves_whole_lines_no_ray_processes_and_a_rerun_resumes(local_rows, tmp_path):
    """A real Ctrl-C: SIGINT to the driver's process group while it waits on its workers (not an exception
    raised from a callback). The driver exits, its local Ray instance goes with it, the file holds whole
    lines only, and the same command run again runs only the trials that are missing."""
    out = tmp_path / "ctrl-c.jsonl"
    ray_tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_TMPDIR": ray_tmp}  # marks every process this driver starts, to find any left behind
    command = [sys.executable, "-m", "kvzoo.cli", *CLI, "--executor", "ray", "--workers", "2", "--out", str(out)]
    # SIGINT back to its default in the driver: a process started with it ignored (a job started with `&` by a
    # script) passes that on, and Python then never turns Ctrl-C into KeyboardInterrupt
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while driver.poll() is None and time.monotonic() < deadline and (
                not out.exists() or out.read_text().count("\n") < 3):
            time.sleep(0.1)
        assert driver.poll() is None, "the grid finished before it could be interrupted"
        os.killpg(driver.pid, signal.SIGINT)  # what Ctrl-C at a terminal sends: the foreground process group
        _, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    # one line, exit 130 (as a shell reports SIGINT), no traceback (issue 44)
    assert driver.returncode == 130 and "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("kvzoo leaderboard: interrupted; ")]
    assert len(said) == 1 and f"trials are kept in {out} (whole rows only): the same command resumes where it " \
        "stopped" in said[0], err[-3000:]
    first = lines_of(out)  # fails on a partial line
    assert 3 <= len(first) < TRIALS and len({r["key"] for r in first}) == len(first)
    deadline = time.monotonic() + 30  # ray.shutdown() stops the daemons; give their exits a moment
    while _processes_with_env(f"RAY_TMPDIR={ray_tmp}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with_env(f"RAY_TMPDIR={ray_tmp}") == []  # no Ray daemon or worker outlived the driver

    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    shutil.rmtree(ray_tmp, ignore_errors=True)  # both instances' session logs
    assert done.returncode == 0, done.stderr[-3000:]
    stored = lines_of(out)
    assert [r["finished_at"] for r in stored[:len(first)]] == [r["finished_at"] for r in first]  # untouched
    assert sorted(r["key"] for r in stored[len(first):]) == sorted(set(local_rows) - {r["key"] for r in first})
    assert len(stored) == TRIALS
    for row in stored:
        same_row(row, local_rows[row["key"]])


class _Trial:
    def __init__(self, key: str) -> None:
        self.key, self.model, self.label = key, "m", key


def test_a_trial_that_keeps_losing_its_worker_is_recorded_as_an_error_with_the_cause(ray_cluster):
    class DiesOnPoison:  # defined here: Ray ships it to the workers by value
        def run(self, trial, reference):
            if trial.key == "poison":
                os._exit(1)
            return {"key": trial.key, "status": "ok", "reference": reference}

    trials = [_Trial(k) for k in ("ref", "poison", "fine")]
    group = TrialGroup("g", "m", trials, first_is_reference=True)
    emitted: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    work = Work(groups=[group], make_runner=DiesOnPoison, reference=lambda trial: f"reference for {trial.key}",
                failed_row=lambda trial, cause: {"key": trial.key, "status": "error", "error": cause})
    RayExecutor(workers=2, max_attempts=2).run(work, lambda trial, row, info: emitted.append((trial.key, row, info)))
    by_key = {key: (row, info) for key, row, info in emitted}
    assert len(emitted) == 3 and emitted[0][0] == "ref"  # the reference ran first, everything once
    row, info = by_key["poison"]
    assert row["status"] == "error" and "lost its worker 2 times" in row["error"] and "ActorDiedError" in row["error"]
    assert info["attempts"] == 2 and len(info["attempt_errors"]) == 2 and info["worker"] is None
    assert by_key["fine"][0] == {"key": "fine", "status": "ok", "reference": "reference for fine"}
    assert by_key["fine"][1]["attempts"] == 1
