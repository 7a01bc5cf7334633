"""The demo grid with the local executor and with Ray, and what a bigger grid would take on N workers.

    python benchmarks/ray_leaderboard.py [--preset demo] [--workers 2] [--out-dir results/ray-bench] [LEADERBOARD OPTIONS]

Runs ``kvzoo leaderboard --preset PRESET [LEADERBOARD OPTIONS]`` (e.g. ``--depths 0.5 --ratios 4``, to
fit a busy machine) twice in fresh processes -- ``--executor local``, then
``--executor ray --workers N`` (a local Ray instance of its own) -- and reports for each the wall time
and the peak resident memory (``VmHWM``) of every process it started: the driver, Ray's daemons and
its workers (sampled from /proc every 0.2 s; a process's high-water mark is kept by the kernel,
so a short peak between samples still counts). It checks that both runs wrote the same trials with
the same scores and KV bytes.

Then it projects the wall time of ``--project`` (default the ``leaderboard`` preset, ``make
leaderboard``) on 1..64 workers: each planned trial is given the mean ``trial_seconds`` its policy took
on one Ray worker here (one CPU, one torch thread), the schedule is simulated with the runner's own
:class:`~kvzoo.bench.executors.TrialQueue` (a group's reference first), and the fixed cost the Ray run
paid here (starting Ray and the workers, loading the model) is added. It is a projection from this
machine's per-trial times, for workers as fast as one of its cores.

``--json PATH`` writes every figure. Nothing is asserted: the machine may be shared (see ``load``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status(pid: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except OSError:
        pass
    return fields


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _label(pid: int, root: int, cmd: str, comm: str) -> str:
    if pid == root:
        return "driver"
    if comm.startswith("ray::"):  # a Ray worker names itself after what it runs
        return comm
    for name in ("gcs_server", "raylet", "dashboard", "runtime_env", "log_monitor", "monitor.py"):
        if name in cmd:
            return f"ray daemon: {name}"
    return f"other: {comm}"


class TreeSampler(threading.Thread):
    """Peak RSS (VmHWM) of every process descended from ``root`` while it runs."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peaks: dict[int, dict[str, Any]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            parent: dict[int, int] = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    ppid = _status(int(entry)).get("PPid")
                    if ppid and ppid.isdigit():
                        parent[int(entry)] = int(ppid)
            for pid in parent:
                p, depth = pid, 0
                while p in parent and p != self.root and depth < 16:
                    p, depth = parent[p], depth + 1
                if p != self.root:
                    continue
                status = _status(pid)
                hwm = status.get("VmHWM", "0 kB").split()[0]
                if not hwm.isdigit():
                    continue
                info = self.peaks.setdefault(pid, {"pid": pid, "peak_rss_bytes": 0})
                info["peak_rss_bytes"] = max(info["peak_rss_bytes"], int(hwm) * 1024)
                info["label"] = _label(pid, self.root, _cmdline(pid), status.get("Name", "?"))
            self.done.wait(self.interval)


def run_leaderboard(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvzoo.cli", "leaderboard", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    sampler.done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-4000:]}")
    processes = sorted(sampler.peaks.values(), key=lambda p: (p["label"] != "driver", p["label"], p["pid"]))
    return {"command": "kvzoo " + " ".join(["leaderboard", *args]), "wall_s": wall, "processes": processes,
            "stdout_tail": out[-3000:]}


def trial_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean ``trial_seconds`` per policy."""
    by_policy: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get("trial_seconds") is not None:
            by_policy[row["policy"]].append(row["trial_seconds"])
    return {policy: statistics.fmean(times) for policy, times in by_policy.items()}


def simulate(groups: list[Any], seconds: dict[str, float], workers: int) -> float:
    """The makespan of ``groups`` on ``workers`` slots under the runner's TrialQueue."""
    from kvzoo.bench.executors import TrialQueue

    queue = TrialQueue(groups)
    clock, running, idle = 0.0, [], [(None, None)] * workers  # running: (finish, n, slot state, group, trial)
    counter = 0
    while len(queue) or running:
        still_idle = []
        for state in idle:
            item = queue.take(*state)
            if item is None:
                still_idle.append(state)
                continue
            group, trial = item
            counter += 1
            heapq.heappush(running, (clock + seconds[trial.policy], counter, (group.key, group.model), group, trial))
        idle = still_idle
        clock, _, state, group, trial = heapq.heappop(running)
        queue.finished(group, trial)
        idle.append(state)
    return clock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", help="the grid run both ways (default demo)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (default 2)")
    parser.add_argument("--project", default="leaderboard", help="the preset whose wall time is projected")
    parser.add_argument("--out-dir", default="results/ray-bench", help="where the two JSONL files go")
    parser.add_argument("--json", help="write every figure here")
    args, grid_options = parser.parse_known_args(argv)

    from kvzoo.bench import runner
    from kvzoo.cli import _grid_from_args, build_parser

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = ["--preset", args.preset, *grid_options, "--fresh", "--no-plots", "--no-progress"]
    grid_here = _grid_from_args(build_parser().parse_args(["leaderboard", *common]))
    load_before = os.getloadavg()
    runs = {
        "local": run_leaderboard([*common, "--out", str(out_dir / "local.jsonl")]),
        f"ray x{args.workers}": run_leaderboard([*common, "--out", str(out_dir / "ray.jsonl"), "--executor", "ray",
                                                 "--workers", str(args.workers)]),
    }
    local_rows = runner.read_results(out_dir / "local.jsonl")
    ray_rows = runner.read_results(out_dir / "ray.jsonl")
    local_by_key = {r["key"]: r for r in local_rows}
    same = {r["key"] for r in ray_rows} == set(local_by_key) and all(
        r["score"] == local_by_key[r["key"]]["score"] and r["kv_bytes_per_token"] == local_by_key[r["key"]]["kv_bytes_per_token"]
        and r["resident_bytes"] == local_by_key[r["key"]]["resident_bytes"] for r in ray_rows)

    per_policy = trial_times(ray_rows)  # one worker: one CPU, one torch thread
    makespan_here = simulate(runner.group_trials(runner.plan(grid_here)), per_policy, args.workers)
    overhead = max(0.0, runs[f"ray x{args.workers}"]["wall_s"] - makespan_here)
    projected_plan = runner.plan(runner.PRESETS[args.project]())
    groups = runner.group_trials(projected_plan)
    missing = {t.policy for t in projected_plan} - set(per_policy)
    if missing:
        raise SystemExit(f"no per-trial time for {sorted(missing)}: the {args.preset} grid did not run them")
    sequential = sum(per_policy[t.policy] for t in projected_plan)
    makespans = {n: simulate(groups, per_policy, n) for n in (1, 2, 4, 8, 16, 32, 64)}
    projection = {n: seconds + overhead for n, seconds in makespans.items()}

    report = {
        "preset": args.preset, "workers": args.workers, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "cpu_count": os.cpu_count(), "runs": runs,
        "same_trials_scores_and_bytes": same, "trials": len(local_rows),
        "local_trial_seconds_mean": statistics.fmean(r["trial_seconds"] for r in local_rows),
        "ray_trial_seconds_mean": statistics.fmean(r["trial_seconds"] for r in ray_rows),
        "ray_trial_seconds_by_policy": per_policy, "ray_trials_by_worker": {
            w: sum(r["worker"] == w for r in ray_rows) for w in sorted({r["worker"] for r in ray_rows})},
        "ray_fixed_overhead_s": overhead,
        "grid_options": grid_options, "context_tokens": sorted({t.task.context_tokens for t in runner.plan(grid_here)}),
        "projected": {"preset": args.project, "trials": len(projected_plan), "sequential_one_worker_s": sequential,
                      "wall_s_by_workers": projection,
                      "speedup_by_workers": {n: makespans[1] / m for n, m in makespans.items()}},
    }
    for name, run in runs.items():
        print(f"{name}: {run['wall_s']:.0f} s wall ({run['command']})")
        for proc in run["processes"]:
            if proc["peak_rss_bytes"] > 20 * 2**20:
                print(f"    {proc['label']:<40} pid {proc['pid']:>7}  peak RSS {proc['peak_rss_bytes'] / 2**20:7.0f} MiB")
    print(f"same trials, scores and KV bytes: {same} ({len(local_rows)} trials)")
    print(f"mean trial: local {report['local_trial_seconds_mean']:.1f} s, ray worker {report['ray_trial_seconds_mean']:.1f} s; "
          f"trials per worker {report['ray_trials_by_worker']}")
    print(f"ray fixed cost here (start Ray and the workers, load the model): {overhead:.0f} s")
    print(f"projected `{args.project}` ({len(projected_plan)} trials, {sequential / 60:.0f} min on one worker):")
    for n, seconds in projection.items():
        print(f"    {n:>3} workers: {seconds / 60:6.1f} min  (schedule speed-up {makespans[1] / makespans[n]:.1f}x)")
    print(f"per-trial times measured at {report['context_tokens']} context tokens "
          f"({' '.join(grid_options) or 'the preset as is'}); per policy: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in per_policy.items()))
    print(f"load average before {load_before[0]:.1f}, after {report['load_average_after'][0]:.1f} on {os.cpu_count()} CPUs")
    busiest = max(load_before[0], report["load_average_after"][0], report["load_average_after"][1])
    if busiest > (os.cpu_count() or 1):  # other jobs shared the cores: the times above are theirs too
        print(f"WARNING: the machine was busy (load average up to {busiest:.1f} on {os.cpu_count()} CPUs): the wall and "
              "trial times are inflated and the local/ray comparison is not like for like; trust the same-rows check, "
              "the memory figures and the schedule speed-ups, not the minutes")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
