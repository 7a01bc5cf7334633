"""``python -m kvzoo.demo`` (``make demo``): every registered policy at 4x and 8x on a needle, on SmolLM2-135M.

Runs ``kvzoo leaderboard --preset demo``, resuming by default: the trials an interrupted demo finished are kept when
its rows ran with the versions installed now (kvzoo, torch, transformers, kvpress, Python); rows of other versions, or
``--fresh`` (``make demo FRESH=1``), start it over. Other options go to the leaderboard. The earlier run's record and
plots are removed before it starts (an interrupted run leaves only its whole rows), and the wall time and machine go
to ``results/demo.run.json`` when it ends, for ``benchmarks/render_results.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path("results") / "demo.jsonl"
PLOTS = ("needle-heatmap.png", "score-vs-ratio.png", "frontier.png")  # kvzoo.bench.plots.write_plots's names
# the versions a resumed demo must share with the rows it keeps (kvzoo.bench.results.versions' keys)
SAME_VERSIONS = ("kvzoo", "kvpress", "torch", "transformers", "python")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def _option(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--out X`` or ``--out=X``; the last one given), if any."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def other_versions(out: Path) -> str | None:
    """What differs between the versions the rows of ``out`` ran with and those installed now (None: the same, or no
    rows): a demo resumed over them would mix two sets of figures in one table."""
    from kvzoo.bench.results import read_results_file, versions

    if not out.is_file():
        return None
    try:
        rows = read_results_file(out).rows
    except (OSError, ValueError):  # not a results file: the leaderboard refuses it, saying why
        return None
    now = versions()
    differ: dict[str, set[str]] = {}
    for row in rows:
        ran = row.get("versions") or {}
        for name in SAME_VERSIONS:
            if name in ran and ran[name] != now.get(name):
                differ.setdefault(name, set()).add(str(ran[name]))
    return "; ".join(f"{name} {', '.join(sorted(old))} (now {now.get(name)})" for name, old in differ.items()) or None


def _clear_earlier_run(out: Path, plot_dir: Path) -> None:
    """Remove the earlier run's record and plots: beside a resumed or interrupted run's rows they would describe
    another run (an interrupted demo used to leave a record saying exit 0 and the old plots)."""
    for stale in (out.with_name(out.stem + ".run.json"), *(plot_dir / f"{out.stem}-{name}" for name in PLOTS)):
        if stale.is_file():
            stale.unlink()


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(argv if argv is not None else sys.argv[1:]))
    except KeyboardInterrupt:  # before or after the leaderboard (which says its own line): no traceback
        print("kvzoo demo: interrupted", file=sys.stderr)
        return 130


def _main(args: list[str]) -> int:
    from kvzoo.cli import main as kvzoo_main

    started, load_start = time.perf_counter(), _load_average()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(
        "kvzoo demo: every registered policy at 4x and 8x on SmolLM2-135M-Instruct (fp32, CPU) -- a needle in 2k "
        "tokens of essay text at depths 25 and 75 %, the question asked after compression",
        flush=True,
    )
    given = list(args)
    if "--resume" in args:  # the default now; still accepted
        args.remove("--resume")
    out = Path(_option(args, "--out") or RESULTS)
    plot_dir = Path(_option(args, "--plot-dir") or out.parent)
    if "--fresh" not in args:
        changed = other_versions(out)
        if changed:
            print(f"kvzoo demo: the rows in {out} ran with {changed}: starting over", file=sys.stderr)
            args.append("--fresh")
        elif out.is_file():
            print(f"kvzoo demo: resuming from {out} (same grid, same versions; `make demo FRESH=1` or "
                  "`python -m kvzoo.demo --fresh` starts over)", file=sys.stderr)
    _clear_earlier_run(out, plot_dir)
    code = kvzoo_main(["leaderboard", "--preset", "demo", *args])
    wall = time.perf_counter() - started
    if code == 130:  # interrupted: the leaderboard said what is kept and how to resume; no record of a partial run
        return code
    print(f"demo wall time: {wall:.0f} s")
    if out.parent.is_dir():
        record: dict[str, Any] = {
            "command": " ".join(["python -m kvzoo.demo", *given]),
            "wall_s": wall, "started_at": started_at, "exit_code": code,
            "load_average_start": load_start, "load_average_end": _load_average(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        }
        out.with_name(out.stem + ".run.json").write_text(json.dumps(record, indent=1) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
