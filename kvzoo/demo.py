"""``python -m kvzoo.demo`` (``make demo``): the small leaderboard on SmolLM2-135M-Instruct.

Every registered policy (found in the registry at run time, plugins included) at ratios 4 and 8 on
RULER's single needle hidden in 2,000 tokens of essay-like text at depths 25 %, 50 % and 75 %; the
question is shown only after the cache has been compressed. Prints the leaderboard (string-match
score, KV bytes read per decode step), the detail table (needle intact rate, ΔNLL, ΔCE, memory,
time) and writes the needle heatmap and score-vs-ratio curves under ``results/``.

Results go to ``results/demo.jsonl``, written afresh on every run (a policy's code may have changed
since the last one); ``python -m kvzoo.demo --resume`` continues an interrupted demo instead. Other
options go to ``kvzoo leaderboard`` (e.g. ``--policies full vestige``). ``make leaderboard`` runs the
larger grid. About 5 minutes on 2 idle CPU cores (8 when the machine is shared); h2o's prefill is
the slowest.
"""

from __future__ import annotations

import sys
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from kvzoo.cli import main as kvzoo_main

    started = time.perf_counter()
    print(
        "kvzoo demo: the leaderboard's small grid on SmolLM2-135M-Instruct (fp32, CPU) -- every registered "
        "policy at 4x and 8x, RULER single needle in 2k tokens of essay text at depths 25/50/75 %, "
        "question after compression",
        flush=True,
    )
    args = list(argv if argv is not None else sys.argv[1:])
    if "--resume" in args:
        args.remove("--resume")
    elif "--fresh" not in args:
        args.append("--fresh")
    code = kvzoo_main(["leaderboard", "--preset", "demo", *args])
    print(f"demo wall time: {time.perf_counter() - started:.0f} s")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
