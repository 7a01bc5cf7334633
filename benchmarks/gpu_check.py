"""``make gpu-check``: the GPU figures of one lent machine in one budgeted run that cannot lose its rows.

    python3 benchmarks/gpu_check.py --wheels .gpu-wheels --out $OUT     # on the GPU machine (benchmarks/README.md)
    python benchmarks/gpu_check.py --toy --out /tmp/gpu_check          # anywhere: the same run at toy size (CI)

1. **Software first.** With ``--wheels DIR`` the carried wheels (``make gpu-bundle``) are unpacked into a scratch
   folder put first on ``PYTHONPATH``; then the preflight (``gpu_bundle.py preflight``) refuses a transformers or
   huggingface-hub kvzoo does not support, naming the versions and the fix, and runs a tiny DeepseekV2 with
   ``cache=`` (transformers 5.17 drops it silently). Nothing is timed on a refused interpreter.
2. **A plan, printed before anything runs** (``benchmarks/gpu_plan.py``; ``--plan headline``, the default, is the
   first run's table and fits the budget at 1.5x its estimates; ``--plan more`` is the rest, for a second run):
   every cell, most important first -- the native CPU build (so that no timed cell pays it), the headline kernels,
   then the runtime's decode step -- each with its expected seconds (counts measured on the toy run times the
   H200's rates), and the total at 1x and 1.5x against the budget (``--budget``, 540 s: 9 minutes of one H200's
   wall, start-up and compiles included).
3. **Cells run in one worker process**, in plan order; each cell's row is appended to ``rows.jsonl`` and flushed
   the moment it is measured. Before a cell the worker compares its expected seconds (scaled by how the finished
   cells of its part compared with their plan) with the time left before the deadline: a cell that would not end
   in time is skipped with a row saying so, and the worker goes on to smaller ones. A cell's inputs are sized
   against the free GPU memory before anything is allocated (a row saying so if they cannot fit).
4. **This process watches the worker**: a cell running past four times its plan (a hang) or past the deadline is
   killed, gets a row saying so, and a fresh worker continues with the cells left; so does a crash (a lost CUDA
   context after an illegal address, a segfault). Every planned cell ends with exactly one row (``ok``, ``failed``,
   ``skipped``, ``timeout``, ``crashed``); the Markdown summary is re-rendered from the rows after each one, at the
   end, on SIGTERM and on an exception -- it lists the cells not run and why.

Files in ``--out`` (four, for the device tool's 8-file limit): ``gpu_check.md`` (the summary), ``rows.jsonl`` (one
row per cell, and the worker's start/stop events), ``plan.json`` (the plan, the preflight, the run's status),
``worker.log`` (the worker's output). The toy size (CPU) runs the kernels in Triton's interpreter and the runtime
on a toy model, its ``graph`` cells on a stand-in for a CUDA graph that refuses a captured step which syncs or
builds a tensor from host data (``kvzoo.bench.step_trace``); the tests add fake cells (``--fake-cells``) to exercise
the deadline and ``--pretend`` to exercise a refused preflight.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_plan import PLANS, RATES, TOY, fake_cells, load_costs, plan, select, total_s

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUDGET_S = 540.0  # 9 minutes of wall on one H200: the device tool's 15 minutes less start-up, transfers and slack
TOY_BUDGET_S = 600.0
RESERVE_S = 10.0  # before the deadline: the summary, the worker's exit
MAX_WORKERS = 4  # a worker started again after a crash or a hang, at most this many in all
FILES = ("gpu_check.md", "rows.jsonl", "plan.json", "worker.log")
WORKER_START_S, TOY_WORKER_START_S = RATES["worker_start_s"], TOY["worker_start_s"]

# --- rows ----------------------------------------------------------------------------------------------------
def append_row(path: Path, row: dict[str, Any]) -> None:
    """One JSON line, flushed and closed at once: a worker killed after this keeps the row."""
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return rows


def cell_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["cell"]: r for r in rows if r.get("cell")}


# --- the worker ----------------------------------------------------------------------------------------------
class Worker:
    """Runs cells in one process; the kernel and runtime benches are built at their first cell."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.toy = state["toy"]
        self._device: str | None = None
        self._kernels = None
        self._runtime = None
        self._bandwidth: float | None = None

    @property
    def device(self) -> str:
        if self._device is None:
            import torch

            if not self.toy and not torch.cuda.is_available():
                raise RuntimeError("no CUDA device is visible to torch: the full-size run needs a GPU (use --toy off "
                                   "one)")
            self._device = "cuda" if not self.toy else "cpu"
        return self._device

    def bandwidth(self) -> float:
        if self._bandwidth is None:
            from kvzoo.bench.metrics import copy_bandwidth

            self._bandwidth = copy_bandwidth(self.device, gib=1.0 if self.device == "cuda" else 0.05)
        return self._bandwidth

    def kernels(self):
        if self._kernels is None:
            import gpu_kernels

            self._kernels = gpu_kernels.KernelBench(self.device, self.toy)
            self._kernels._bandwidth = self.bandwidth()
        return self._kernels

    def runtime(self):
        if self._runtime is None:
            import gpu_runtime

            self._runtime = gpu_runtime.RuntimeBench(self.device, self.toy, bandwidth=self.bandwidth)
        return self._runtime

    def extra_expected(self, cell: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> float:
        """Seconds a decode cell costs beyond its plan in this process: a prefill or a reference it must rebuild
        (a restarted worker lost them)."""
        if cell["part"] != "decode":
            return 0.0
        extra = 0.0
        for what in self.runtime().missing(cell["params"]):
            if what.startswith("prefill "):
                extra += by_id.get(what, {}).get("expected_s", 0.0)
            else:
                extra += 0.5 * cell["expected_s"]
        return extra

    def run(self, cell: dict[str, Any], deadline: float) -> dict[str, Any]:
        part, p = cell["part"], cell["params"]
        if part == "fake":
            if os.environ.get("KVZOO_GPU_CHECK_TEST_CRASH", "\0") in cell["id"]:  # the crash test's fake crash
                os._exit(86)
            time.sleep(p["sleep"])
            return {"status": "ok", "slept_s": p["sleep"]}
        if part == "build":
            return build_native()
        if part == "kernel":
            return self.kernels().measure(p)
        if part == "sweep":
            return self.kernels().sweep(p, min(deadline, time.time() + cell["expected_s"]))
        if part == "prefill":
            return self.runtime().prefill_cell(p)
        if part == "decode":
            return self.runtime().decode_cell(p)
        raise ValueError(f"unknown part {part!r}")

    def cuda_lost(self) -> str | None:
        """Why the CUDA context can no longer be used (an illegal address poisons it for the process), or None."""
        if self._device != "cuda":
            return None
        import torch

        try:
            torch.cuda.synchronize()
            torch.ones(1, device="cuda").add_(1).item()
        except Exception as err:
            return f"{type(err).__name__}: {str(err)[:200]}"
        return None

    def environment(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {"device": self.device, "torch": torch.__version__, "pid": os.getpid()}
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception as err:  # a row then says so; the kernel cells fail on their own
            info["triton"] = f"not importable: {type(err).__name__}"
        if self.device == "cuda":
            info["gpu"] = torch.cuda.get_device_name()
            info["free_gib"] = round(torch.cuda.mem_get_info()[0] / 2**30, 1)
        return info


def build_native() -> dict[str, Any]:
    """The native CPU ops built (or found built) before any timed cell, so that no cell pays for the build: its
    seconds, and why it could not be built where it could not (a row ``ok`` either way: the CUDA cells never call the
    CPU ops)."""
    started = time.perf_counter()
    try:
        from kvzoo.kernels import cpu_native

        native = cpu_native.library()
        built = native is not None
        why = None if built else "no native library (no compiler or ninja): the CPU ops fall back to PyTorch"
    except Exception as err:  # a failing build is the row's news, not the run's end
        built, why = False, f"{type(err).__name__}: {str(err)[:300]}"
    row: dict[str, Any] = {"status": "ok", "built": built, "build_s": round(time.perf_counter() - started, 2)}
    if why:
        row["note"] = why
    return row


def calibration(rows: dict[str, dict[str, Any]], part: str) -> float:
    """How the finished cells of ``part`` compared with their plan (actual / expected, within 0.25 .. 4; 1 until two
    have finished)."""
    done = [r for r in rows.values() if r.get("part") == part and r.get("status") in ("ok", "failed")
            and r.get("seconds") and r.get("expected_s")]
    if len(done) < 2:
        return 1.0
    return min(4.0, max(0.25, sum(r["seconds"] for r in done) / sum(r["expected_s"] for r in done)))


def run_cell(worker: Worker, cell: dict[str, Any], deadline: float) -> dict[str, Any]:
    """One cell as its row: what it measured, ``skipped`` with the reason it gave, or ``failed`` with its exception
    (a kernel's exception included: the benchmark's guard never lets it fall back to PyTorch)."""
    base = {"cell": cell["id"], "part": cell["part"], "group": cell["group"], "expected_s": cell["expected_s"]}
    started = time.perf_counter()
    try:
        row = worker.run(cell, deadline)
    except Exception as err:
        if getattr(err, "skip", False):
            row = {"status": "skipped", "reason": str(err)}
        else:
            row = {"status": "failed", "error": f"{type(err).__name__}: {str(err)[:500]}",
                   "traceback": traceback.format_exc()[-2000:]}
            traceback.print_exc()
    return {**base, **row, "seconds": round(time.perf_counter() - started, 3)}


def worker_main(out: Path, progress: Path) -> int:
    state = json.loads((out / "plan.json").read_text())
    rows_path = out / "rows.jsonl"
    deadline = state["deadline"]
    reserve = state["reserve_s"]
    done = cell_rows(read_rows(rows_path))
    by_id = {c["id"]: c for c in state["cells"]}
    worker = Worker(state)
    needs_torch = any(c["part"] != "fake" for c in state["cells"] if c["id"] not in done)
    if needs_torch:
        append_row(rows_path, {"event": "worker started", "time": time.time(), **worker.environment()})
    else:
        append_row(rows_path, {"event": "worker started", "time": time.time(), "pid": os.getpid()})
    for cell in state["cells"]:
        if cell["id"] in done:
            continue
        base = {"cell": cell["id"], "part": cell["part"], "group": cell["group"], "expected_s": cell["expected_s"]}
        left = deadline - reserve - time.time()
        if cell["part"] == "decode":  # a prefill it needs was skipped or failed: so is the cell
            kind = "transformers" if cell["params"]["policy"] == "transformers" else "kvzoo"
            prefill = done.get(f"prefill {kind} {cell['params']['context']}")
            if prefill is not None and prefill["status"] != "ok":
                row = {**base, "status": "skipped", "reason": f"its prefill was {prefill['status']}"}
                append_row(rows_path, row)
                done[cell["id"]] = row
                continue
        expected = (cell["expected_s"] + worker.extra_expected(cell, by_id)) * calibration(done, cell["part"])
        if expected > left:
            reason = ("the deadline had passed" if left <= 0 else
                      f"the deadline: expected {expected:.0f} s, {max(0.0, left):.0f} s left")
            row = {**base, "status": "skipped", "reason": reason}
            append_row(rows_path, row)
            done[cell["id"]] = row
            continue
        progress.write_text(json.dumps({"cell": cell["id"], "started": time.time()}))
        row = run_cell(worker, cell, deadline - reserve)
        append_row(rows_path, row)
        done[cell["id"]] = row
        progress.write_text("{}")
        print(f"[{row['seconds']:7.1f} s / plan {cell['expected_s']:5.1f} s] {row['status']:>7} {cell['id']}",
              flush=True)
        if row["status"] == "failed":
            lost = worker.cuda_lost()
            if lost:
                append_row(rows_path, {"event": "CUDA context lost", "after": cell["id"], "error": lost})
                return 3  # the watcher starts a fresh worker for the cells left
    append_row(rows_path, {"event": "worker finished", "time": time.time()})
    return 0


# --- the watcher -----------------------------------------------------------------------------------------------
class Interrupted(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise Interrupted(f"signal {signum}")


def cell_limit(cell: dict[str, Any], toy: bool) -> float:
    """Seconds a cell may run before the watcher calls it a hang."""
    factor = 8 if cell["part"] == "prefill" else 4  # every decode cell of its context needs the prefill: be patient
    return max(300.0 if toy else 60.0, factor * cell["expected_s"])


def worker_env(args: argparse.Namespace, site: str | None) -> dict[str, str]:
    paths = [p for p in (site, str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    if args.toy:
        env["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter (set before triton is imported)
    return env


def run_preflight(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "preflight.json"
        cmd = [sys.executable, str(HERE / "gpu_bundle.py"), "preflight", "--json", str(result)]
        cmd += ["--no-probe"] if args.no_probe else []
        for item in args.pretend:
            cmd += ["--pretend", item]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if result.exists():
            return json.loads(result.read_text())
        return {"ok": False, "problems": [f"the preflight did not run: rc {done.returncode}: "
                                          f"{(done.stdout + done.stderr)[-1500:]}"], "versions": {}}


def watch(args: argparse.Namespace, state: dict[str, Any], env: dict[str, str], out: Path, progress: Path) -> None:
    """Start workers until every cell has a row, the deadline passes or too many workers were needed. ``progress``:
    where a worker writes the cell it is running."""
    rows_path = out / "rows.jsonl"
    by_id = {c["id"]: c for c in state["cells"]}
    seen = 0
    while True:
        rows = cell_rows(read_rows(rows_path))
        left = [c for c in state["cells"] if c["id"] not in rows]
        if not left:
            state["status"] = "complete"
            return
        start_cost = TOY_WORKER_START_S if args.toy else WORKER_START_S
        if state["workers"] and state["deadline"] - time.time() < start_cost:
            state["status"] = "stopped at the deadline"  # no time to start another worker
            return
        if len(state["workers"]) >= MAX_WORKERS:
            state["status"] = f"stopped: {MAX_WORKERS} workers started"
            return
        if state["workers"] and state["workers"][-1].get("cells") == 0:
            state["status"] = f"stopped: the worker wrote no row ({state['workers'][-1]['ended']}); see worker.log"
            return
        progress.write_text("{}")
        with open(out / "worker.log", "a") as log:
            log.write(f"\n=== worker {len(state['workers']) + 1} at {time.time() - state['started']:.1f} s ===\n")
            log.flush()
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
                                     "--progress", str(progress)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        record = {"pid": proc.pid, "started_s": round(time.time() - state["started"], 1)}
        state["workers"].append(record)
        state["current"] = proc
        ended = None
        while ended is None:
            time.sleep(0.2)
            seen = report_progress(rows_path, seen, state, out)
            rc = proc.poll()
            current = _read_json(progress)
            now = time.time()
            if rc is not None:
                ended = ("exit", rc)
            elif now >= state["deadline"]:
                ended = ("deadline", None)
            elif current.get("cell") and now - current["started"] > cell_limit(by_id[current["cell"]], args.toy):
                ended = ("hang", None)
        if ended[0] != "exit":
            _kill(proc)
        state["current"] = None
        record["ended"] = ended[0] if ended[0] != "exit" else f"exit {ended[1]}"
        before = len(rows)
        if ended[0] == "deadline":
            in_flight_row(state, out, progress, "timeout",
                          lambda seconds, limit: f"still running at the deadline after {seconds} s: killed")
        elif ended[0] == "hang":
            in_flight_row(state, out, progress, "timeout",
                          lambda seconds, limit: f"ran {seconds} s, past its limit of {limit:.0f} s: killed")
        else:
            in_flight_row(state, out, progress, "crashed",
                          lambda seconds, limit, rc=ended[1]: f"the worker died running it (rc {rc}): {_log_tail(out)}")
        record["cells"] = len(cell_rows(read_rows(rows_path))) - before  # rows this worker's run added
        seen = report_progress(rows_path, seen, state, out)
        if ended[0] == "deadline":
            state["status"] = "stopped at the deadline"
            return


def in_flight_row(state: dict[str, Any], out: Path, progress: Path, status: str,
                  error: Callable[[float, float], str]) -> None:
    """A row for the cell the (now dead) worker was running, if it wrote none; ``error(seconds it ran, its hang
    limit)`` says what happened."""
    current = _read_json(progress)
    cell = {c["id"]: c for c in state["cells"]}.get(current.get("cell", ""))
    if cell is None or cell["id"] in cell_rows(read_rows(out / "rows.jsonl")):
        return
    seconds = round(time.time() - current["started"], 1)
    append_row(out / "rows.jsonl", {
        "cell": cell["id"], "part": cell["part"], "group": cell["group"], "expected_s": cell["expected_s"],
        "seconds": seconds, "status": status,
        "error": error(seconds, cell_limit(cell, state["toy"]))})


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(out: Path, chars: int = 600) -> str:
    try:
        return (out / "worker.log").read_text()[-chars:].strip()
    except OSError:
        return ""


def report_progress(rows_path: Path, seen: int, state: dict[str, Any], out: Path) -> int:
    """Print the rows that arrived since ``seen``, and re-render the summary when any did."""
    rows = read_rows(rows_path)
    for r in rows[seen:]:
        if r.get("cell"):
            what = r.get("error") or r.get("reason") or ""
            print(f"  {r['status']:>8} {r.get('seconds', 0) or 0:7.1f} s (plan {r['expected_s']:5.1f}) {r['cell']}"
                  f"{': ' + what[:160] if what else ''}", flush=True)
    if len(rows) != seen:
        render(state, out)
    return len(rows)


def finish_rows(state: dict[str, Any], out: Path) -> None:
    """A row for every planned cell that has none (the run stopped before it), saying why."""
    rows_path = out / "rows.jsonl"
    rows = cell_rows(read_rows(rows_path))
    reason = {"complete": "not reached", "stopped at the deadline": "the deadline passed before it started"}.get(
        state["status"], f"not started: gpu-check {state['status']}")
    for cell in state["cells"]:
        if cell["id"] not in rows:
            append_row(rows_path, {"cell": cell["id"], "part": cell["part"], "group": cell["group"],
                                   "expected_s": cell["expected_s"], "status": "skipped", "reason": reason})


# --- the summary -----------------------------------------------------------------------------------------------
def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def render(state: dict[str, Any], out: Path) -> str:
    """``gpu_check.md`` from ``plan.json``'s state and ``rows.jsonl``: what ran, what failed, what did not run."""
    all_rows = read_rows(out / "rows.jsonl")
    rows = cell_rows(all_rows)
    cells = state["cells"]
    counts: dict[str, int] = {}
    for c in cells:
        status = rows.get(c["id"], {}).get("status", "not run yet")
        counts[status] = counts.get(status, 0) + 1
    events = [r for r in all_rows if r.get("event")]
    env = next((r for r in events if r.get("event") == "worker started" and r.get("device")), {})
    wall = time.time() - state["started"]
    pre = state.get("preflight") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (pre.get("versions") or {}).items())
    bandwidth = next((r.get("bandwidth_bytes_per_s") for r in rows.values() if r.get("bandwidth_bytes_per_s")), None)
    title = "toy size, CPU" if state["toy"] else env.get("gpu", env.get("device", "GPU"))
    lines = [f"# make gpu-check: {title}", "",
             f"**Status: {state['status']}.** Budget {state['budget_s']:.0f} s, wall so far {wall:.0f} s; "
             f"{len(cells)} cells planned (expected {sum(c['expected_s'] for c in cells):.0f} s): "
             + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
             + f"; workers started: {len(state['workers'])}.",
             f"Versions: {versions or 'unknown'}."
             + (f" Worker: {env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}"
                f"{', ' + str(env.get('free_gib')) + ' GiB free' if env.get('free_gib') else ''}." if env else "")
             + (f" Copy bandwidth {bandwidth / 1e9:,.0f} GB/s." if bandwidth else "")]
    if state["toy"]:
        lines.append("Toy size on CPU: the kernels in Triton's interpreter, a toy model -- a smoke run of the script, "
                     "no figure of a GPU.")
    if pre and not pre.get("ok", True):
        lines += ["", "## Refused by the preflight: nothing was timed", ""]
        lines += [f"- {p}" for p in pre.get("problems", [])]
        lines += ["", f"Fix: {pre.get('fix')}"]
    elif pre and not pre.get("probed"):
        lines.append("The preflight checked versions only: the DeepseekV2 `cache=` probe was skipped (--no-probe).")
    not_run = [(c, rows.get(c["id"])) for c in cells if rows.get(c["id"], {}).get("status") in (None, "skipped")]
    bad = [(c, rows[c["id"]]) for c in cells if rows.get(c["id"], {}).get("status") in ("failed", "timeout", "crashed")]
    if bad:
        lines += ["", f"## Failed ({len(bad)})", "", "| cell | status | error |", "|---|---|---|"]
        lines += [f"| {c['id']} | {r['status']} | {_cell_text(r.get('error', ''))} |" for c, r in bad]
    if not_run and (pre.get("ok", True)):
        lines += ["", f"## Not run ({len(not_run)})", "", "| cell | plan s | why |", "|---|---|---|"]
        lines += [f"| {c['id']} | {c['expected_s']:.0f} | {_cell_text((r or {}).get('reason', 'not reached yet'))} |"
                  for c, r in not_run]
    lines += _kernel_table(cells, rows) + _runtime_table(cells, rows) + _prefill_table(cells, rows)
    lines += _sweep_table(cells, rows) + _fake_table(cells, rows)
    if state["status"] not in ("complete", "running", "starting") or bad:
        tail = _log_tail(out, 3000)
        if tail:
            lines += ["", "## The end of worker.log", "", "```", tail, "```"]
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.md").write_text(text)
    return text


def _cell_text(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:300]


def _done(cells, rows, part):
    """The cells of ``part`` whose row holds measurements (a failed check included: it is in the table and in the
    failed list)."""
    field = {"kernel": "eager_ms", "decode": "decode_ms"}[part]
    return [(c, rows[c["id"]]) for c in cells if c["part"] == part and field in rows.get(c["id"], {})]


def _kernel_table(cells, rows) -> list[str]:
    done = _done(cells, rows, "kernel")
    if not done:
        return []
    out = ["", "## Kernels", "",
           "'graph': the calls replayed from a CUDA graph (no host overhead); GB/s and 'of copy' from it where taken. "
           "Each op is checked against the fp32 reference on the same inputs first.", "",
           "| op | model | batch | rows | case | eager ms | graph ms | split alone ms | GB/s | of copy | copies | "
           "rel. error | check | s / plan |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, r in done:
        split = r.get("split_graph_ms") or r.get("split_eager_ms")
        of_copy = None if r.get("of_copy") is None else 100 * r["of_copy"]
        out.append(f"| {r['op']} | {r['model']} | {r['batch']} | {r['rows']:,} | {r['case']} | "
                   f"{_f(r.get('eager_ms'), '.4f')} | {_f(r.get('graph_ms'), '.4f')} | {_f(split, '.4f')} | "
                   f"{_f(r.get('gb_per_s'), ',.0f')} | {_f(of_copy, '.1f')}% | {r.get('copies', '—')} | "
                   f"{_f(r.get('rel_error'), '.1e')} | {r.get('check', '—')} | "
                   f"{r['seconds']:.1f} / {c['expected_s']:.0f} |")
    return out


def _runtime_table(cells, rows) -> list[str]:
    done = _done(cells, rows, "decode")
    if not done:
        return []
    out = ["", "## Runtime decode", "",
           "ms/step: median over the timed steps, synchronised around each (host overhead included). bound ms: the "
           "KV bytes a step reads at the measured copy bandwidth; of copy: bound / ms (the share of the bandwidth the "
           "step reaches). check: a torch/eager row's every attention call against float64 on its own inputs; the "
           "others' warm-up logits against the torch/eager row of the same policy, context and batch (relative "
           "error, worst step; greedy tokens). bookkeeping: host ms per replay spent advancing the cache's "
           "counters.", "",
           "| policy | kernels | mode | context | batch | ms/step | bound ms | of copy | KV MiB/step | peak MiB | check | "
           "kernel calls | bookkeeping ms | s / plan |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, r in done:
        check = r.get("check") or {}
        if "rel" in check:
            text = (f"{'ok' if check.get('ok') else 'FAILED'} {max(check['rel'], default=0):.1e}"
                    + (f", {check['ties']} ties" if check.get("ties") else ""))
        else:
            text = check.get("reference", "—")
        mode = r["mode"]
        if r.get("replays") is not None:
            mode += f" ({r['replays']}/{r['steps']} replayed)"
        calls = sum((r.get("kernel_calls") or {}).values())
        out.append(f"| {r['policy']} | {r['kernels']} | {mode} | {r['context']} | {r['batch']} | "
                   f"{_f(r.get('decode_ms'), '.2f')} | {_f(r.get('bandwidth_bound_ms'), '.3f')} | {_of_copy(r)} | "
                   f"{_f(None if r.get('kv_bytes_per_step') is None else r['kv_bytes_per_step'] / 2**20, ',.1f')} | "
                   f"{_f(r.get('decode_peak_mib'), ',.0f')} | {text} | {calls} | "
                   f"{_f(r.get('bookkeeping_ms'), '.2f')} | "
                   f"{r['seconds']:.1f} / {c['expected_s']:.0f} |")
    return out


def _of_copy(row: dict[str, Any]) -> str:
    """The share of the measured copy bandwidth a step's KV bytes reach: its bound over its time."""
    if not row.get("decode_ms") or row.get("bandwidth_bound_ms") is None:
        return "—"
    return f"{100 * row['bandwidth_bound_ms'] / row['decode_ms']:.1f}%"


def _prefill_table(cells, rows) -> list[str]:
    done = [(c, rows[c["id"]]) for c in cells if c["part"] == "prefill" and rows.get(c["id"], {}).get("status") == "ok"]
    if not done:
        return []
    out = ["", "## Prefill (batch 1, once per context)", "", "| cache | context | s | peak MiB | s / plan |",
           "|---|---|---|---|---|"]
    out += [f"| {r['kind']} | {r['context']} | {r['prefill_s']:.2f} | {_f(r.get('prefill_peak_mib'), ',.0f')} | "
            f"{r['seconds']:.1f} / {c['expected_s']:.0f} |" for c, r in done]
    return out


def _sweep_table(cells, rows) -> list[str]:
    done = [(c, rows[c["id"]]) for c in cells if c["part"] == "sweep" and "points" in rows.get(c["id"], {})]
    if not done:
        return []
    out = ["", "## Sweep", "",
           "| case | shipped (BLOCK_N, warps, stages, splits) | best | best ms | points (left out) |",
           "|---|---|---|---|---|"]
    for _c, r in done:
        s, b = r["shipped"], r["best"]
        best = "—" if b is None else f"{b['BLOCK_N']}, {b['num_warps']}, {b['num_stages']}, {b['splits']}"
        out.append(f"| {r['model']} B{r['batch']} {r['rows']:,} {r['case']} | {s['BLOCK_N']}, {s['num_warps']}, "
                   f"{s['num_stages']}, {s['splits']} | {best} | {_f(None if b is None else b['ms'], '.4f')} | "
                   f"{len(r['points'])} ({r.get('points_left_out', 0)}) |")
    return out


def _fake_table(cells, rows) -> list[str]:
    done = [(c, rows[c["id"]]) for c in cells if c["part"] == "fake" and rows.get(c["id"], {}).get("status") == "ok"]
    if not done:
        return []
    return ["", "## Fake cells (a test of the deadline)", ""] + [f"- {c['id']}: {r['seconds']:.1f} s" for c, r in done]


# --- main ------------------------------------------------------------------------------------------------------
def print_plan(state: dict[str, Any]) -> None:
    """Each cell with its expected seconds and the running total; the total at 1x and 1.5x the estimates against
    the budget (the headline plan must fit at 1.5x)."""
    total, group = total_s([], state["toy"]), None
    budget = state["budget_s"] - state["reserve_s"]
    print(f"plan {state.get('plan', 'headline')}: {len(state['cells'])} cells, budget {state['budget_s']:.0f} s "
          f"(a worker's start-up ~{total:.0f} s)")
    for c in state["cells"]:
        if c["group"] != group:
            group = c["group"]
            print(f"  -- {group}")
        total += c["expected_s"]
        over = "  (past the budget: expected to be skipped)" if total > budget else ""
        print(f"  {c['expected_s']:6.1f} s  (total {total:6.1f} s)  {c['id']}{over}")
    at = total_s(state["cells"], state["toy"], 1.5)
    print(f"plan total {total:.0f} s expected, {at:.0f} s at 1.5x the estimates, against a budget of "
          f"{state['budget_s']:.0f} s ({'fits' if at <= state['budget_s'] else 'does not fit'} at 1.5x)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check"), help="folder for the four files")
    parser.add_argument("--toy", action="store_true", help="toy sizes on CPU (what CI runs)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds of wall for the whole run (default {BUDGET_S:.0f}; toy {TOY_BUDGET_S:.0f})")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="a folder of carried wheels (make gpu-bundle) to unpack first, no network")
    parser.add_argument("--site", default="/tmp/kvzoo-site", help="where --wheels are unpacked")
    parser.add_argument("--plan", choices=PLANS, default="headline",
                        help="headline: the first run's table (default); more: the rest, for a second run; all: both")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only the cells whose id contains TEXT (repeatable)")
    parser.add_argument("--fake-cells", default="", metavar="SLEEP[:EXPECTED],...",
                        help="cells that sleep, run first (tests of the deadline)")
    parser.add_argument("--pretend", action="append", default=[], metavar="NAME=VERSION",
                        help="the preflight reads VERSION for NAME (tests of a refusal)")
    parser.add_argument("--no-probe", action="store_true", help="the preflight checks versions only")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (nothing is written or run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if args.worker:
        sys.path.insert(0, str(HERE))
        return worker_main(out, args.progress)

    started = time.time()
    budget = args.budget if args.budget is not None else (TOY_BUDGET_S if args.toy else BUDGET_S)
    cells = fake_cells(args.fake_cells) + select(plan(args.toy, args.plan, None if args.toy else load_costs()),
                                                 args.only)
    if args.dry_run:
        print_plan({"toy": args.toy, "plan": args.plan, "budget_s": budget, "reserve_s": min(RESERVE_S, budget / 10),
                    "cells": cells})
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a fresh run: the worker reads rows.jsonl to know what is done
        (out / name).unlink(missing_ok=True)
    state: dict[str, Any] = {"toy": args.toy, "plan": args.plan, "budget_s": budget, "reserve_s": min(RESERVE_S, budget / 10),
                             "started": started, "deadline": started + budget, "cells": cells, "workers": [],
                             "status": "starting", "preflight": None, "current": None}

    def save() -> None:
        keep = {k: v for k, v in state.items() if k != "current"}
        (out / "plan.json").write_text(json.dumps(keep, indent=1, default=str) + "\n")

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    progress = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "progress.json"  # the cell a worker is running
    code = 1
    try:
        site = None
        if args.wheels is not None and sys.version_info[:2] != (3, 12):
            print(f"--wheels {args.wheels}: the carried wheels are CPython 3.12's (the GPU machine's) and this is "
                  f"{sys.version.split()[0]}: not unpacked; the preflight checks what this interpreter has", flush=True)
        elif args.wheels is not None:
            from gpu_bundle import install

            install(args.wheels, args.site)
            site = args.site
        env = worker_env(args, site)
        state["preflight"] = run_preflight(args, env)
        if not state["preflight"]["ok"]:
            versions = state["preflight"].get("versions", {})
            state["status"] = (f"refused by the preflight (transformers {versions.get('transformers')}, "
                               f"huggingface-hub {versions.get('huggingface-hub')})")
            save()
            print(render(state, out))
            return 2
        save()
        print_plan(state)
        state["status"] = "running"
        watch(args, state, env, out, progress)
        code = 0
    except Interrupted as why:
        state["status"] = f"interrupted ({why})"
        code = 130
    except Exception as err:
        state["status"] = f"stopped by an error in gpu_check ({type(err).__name__}: {err})"
        traceback.print_exc()
        code = 1
    finally:
        proc = state.get("current")
        if proc is not None and proc.poll() is None:
            _kill(proc)
        if state["status"] in ("starting", "running"):
            state["status"] = "stopped"
        in_flight_row(state, out, progress, "timeout",
                      lambda seconds, limit: f"still running after {seconds} s when gpu-check was {state['status']}: "
                                             "killed")
        shutil.rmtree(progress.parent, ignore_errors=True)
        if state["preflight"] is None or state["preflight"].get("ok"):
            finish_rows(state, out)
        save()
        text = render(state, out)
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(text)
    rows = cell_rows(read_rows(out / "rows.jsonl"))
    bad = [r["cell"] for r in rows.values() if r["status"] in ("failed", "timeout", "crashed")]
    skipped = [r["cell"] for r in rows.values() if r["status"] == "skipped"]
    print(f"gpu-check: {state['status']}; {len(rows) - len(bad) - len(skipped)} ok, {len(bad)} failed"
          f"{' (' + '; '.join(bad[:6]) + ('; ...' if len(bad) > 6 else '') + ')' if bad else ''}, {len(skipped)} "
          f"skipped; {time.time() - started:.0f} s of a {budget:.0f} s budget; files in {out}")
    if code == 0 and bad:
        code = 1
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
