"""Render a pytest-benchmark JSON (``--benchmark-json``) as the leaderboard's markdown tables.

    .venv/bin/python benchmarks/render_json.py bench.json

The quality rows come from ``extra_info["leaderboard_rows"]`` of ``test_prefill_compress``; the
timings replace the trial's own with pytest-benchmark's means: ``prefill_s`` from
``test_prefill_compress`` (prefill + compression), ``decode_ms_per_step`` from ``test_decode_steps``.
The tables are :func:`kvzoo.bench.report.render`'s, the same as ``kvzoo leaderboard`` prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvzoo.bench.report import render


def rows_from_benchmark_json(data: dict[str, Any]) -> list[dict[str, Any]]:
    decode_ms: dict[tuple[str, Any], float] = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if bench["name"].startswith("test_decode_steps"):
            decode_ms[(info["policy"], info["ratio"])] = 1e3 * bench["stats"]["mean"] / info["decode_steps"]
    rows: list[dict[str, Any]] = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if not bench["name"].startswith("test_prefill_compress"):
            continue
        for row in info.get("leaderboard_rows", []):
            row = dict(row, prefill_s=bench["stats"]["mean"], compress_s=0.0)
            if (info["policy"], info["ratio"]) in decode_ms:
                row["decode_ms_per_step"] = decode_ms[(info["policy"], info["ratio"])]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="the file written by pytest --benchmark-json")
    args = parser.parse_args(argv)
    if not args.json.is_file():
        parser.error(f"no such file: {args.json}")
    data = json.loads(args.json.read_text(encoding="utf-8"))
    rows = rows_from_benchmark_json(data)
    if not rows:
        parser.error(f"{args.json} has no test_prefill_compress results with leaderboard_rows in extra_info")
    machine = data.get("machine_info", {})
    title = f"pytest-benchmark leaderboard ({machine.get('cpu', {}).get('brand_raw', 'unknown CPU')})"
    print(render(rows, title=title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
