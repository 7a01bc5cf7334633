"""``python -m kvzoo.demo`` (``make demo``): every registered policy at 4x and 8x on a needle, on SmolLM2-135M.

Runs ``kvzoo leaderboard --preset demo`` afresh (``--resume`` continues an interrupted demo; other options go to it)
and records the wall time and machine in ``results/demo.run.json`` for ``benchmarks/render_results.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path("results") / "demo.jsonl"


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def main(argv: list[str] | None = None) -> int:
    from kvzoo.cli import main as kvzoo_main

    started, load_start = time.perf_counter(), _load_average()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(
        "kvzoo demo: every registered policy at 4x and 8x on SmolLM2-135M-Instruct (fp32, CPU) -- a needle in 2k "
        "tokens of essay text at depths 25 and 75 %, the question asked after compression",
        flush=True,
    )
    args = list(argv if argv is not None else sys.argv[1:])
    given = list(args)
    if "--resume" in args:
        args.remove("--resume")
    elif "--fresh" not in args:
        args.append("--fresh")
    code = kvzoo_main(["leaderboard", "--preset", "demo", *args])
    wall = time.perf_counter() - started
    print(f"demo wall time: {wall:.0f} s")
    out = Path(args[args.index("--out") + 1]) if "--out" in args else RESULTS
    if out.parent.is_dir():
        record = {
            "command": " ".join(["python -m kvzoo.demo", *given]),
            "wall_s": wall, "started_at": started_at, "exit_code": code,
            "load_average_start": load_start, "load_average_end": _load_average(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        }
        out.with_name(out.stem + ".run.json").write_text(json.dumps(record, indent=1) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
