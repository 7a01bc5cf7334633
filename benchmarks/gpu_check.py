"""``make gpu-check``: the GPU measurements of one lent machine in one script (<= 8 minutes on an H200).

    python benchmarks/gpu_check.py --out results/gpu_check          # on the GPU machine
    python benchmarks/gpu_check.py --toy --out /tmp/gpu_check       # anywhere: the same script at toy size (CI)

It runs, each in its own process with a time limit (a crash or a hang in one leaves the other's rows):

1. ``benchmarks/gpu_kernels.py``: the Triton kernels against the copy bandwidth (decode attention dense, pool and
   gathered, the index scans);
2. ``benchmarks/gpu_runtime.py --contexts 32768,131072 --policies full,streaming_llm,vestige,vestige+sketch,quest
   --steps 16 --kernels torch,triton --modes eager,graph``: decode ms/step per policy, eager against
   ``cuda_graph=True``, the PyTorch path against the kernels, beside transformers' own DeepseekV2.

Each script records a failing configuration -- out of memory, a Triton ``CompilationError`` or ``OutOfResources``
-- as a row and goes on, and writes its rows after every configuration. This script then joins both Markdown
reports into ``OUT.md`` and writes ``OUT.json`` (exit codes, wall times, whether a part hit its time limit). The
toy size runs the interpreter for the kernels and ``--modes eager,capacity`` on CPU (no CUDA graphs there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parts(out: Path, toy: bool) -> list[tuple[str, list[str], dict[str, str], int]]:
    """(name, argv, extra environment, time limit in seconds) per part."""
    if toy:
        return [
            ("gpu_kernels", [str(HERE / "gpu_kernels.py"), "--toy", "--device", "cpu", "--out", str(out / "gpu_kernels")],
             {"TRITON_INTERPRET": "1"}, 600),
            ("gpu_runtime", [str(HERE / "gpu_runtime.py"), "--toy", "--device", "cpu", "--contexts", "512",
                             "--batches", "1,2", "--steps", "2", "--policies", "transformers,full,streaming_llm,vestige,"
                             "vestige+sketch,quest", "--modes", "eager,capacity", "--out", str(out / "gpu_runtime")],
             {}, 600),
        ]
    return [
        ("gpu_kernels", [str(HERE / "gpu_kernels.py"), "--out", str(out / "gpu_kernels")], {}, 200),
        ("gpu_runtime", [str(HERE / "gpu_runtime.py"), "--contexts", "32768,131072", "--batches", "1,4",
                         "--policies", "transformers,full,streaming_llm,vestige,vestige+sketch,quest", "--steps", "16",
                         "--kernels", "torch,triton", "--modes", "eager,graph", "--out", str(out / "gpu_runtime")],
         {}, 270),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check"), help="folder for the reports")
    parser.add_argument("--toy", action="store_true", help="toy sizes on CPU (what CI runs)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary, sections = [], [f"# make gpu-check ({'toy size, CPU' if args.toy else 'GPU'})", ""]
    env_base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    for name, cmd, extra, limit in parts(args.out, args.toy):
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, *cmd], env={**env_base, **extra}, timeout=limit,
                                  capture_output=True, text=True)
            rc, timed_out, tail = done.returncode, False, (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:  # what it wrote so far stays in its report
            rc, timed_out, tail = None, True, str(exc)[-2000:]
        seconds = time.perf_counter() - started
        summary.append({"part": name, "returncode": rc, "timed_out": timed_out, "seconds": round(seconds, 1),
                        "limit_seconds": limit})
        report = args.out / f"{name}.md"
        sections.append(f"## {name} ({seconds:.0f} s{', hit its time limit' if timed_out else ''}, rc {rc})")
        sections.append(report.read_text() if report.exists() else f"no report written; last output:\n```\n{tail}\n```")
        print(f"{name}: rc {rc}, {seconds:.0f} s{' (time limit)' if timed_out else ''}", file=sys.stderr)
    (args.out / "gpu_check.md").write_text("\n".join(sections) + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(sections))
    return 0 if all(p["returncode"] == 0 for p in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
