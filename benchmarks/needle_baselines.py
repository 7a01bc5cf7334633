"""Needle answer of every registered policy on SmolLM2-135M, question after and before compression.

    .venv/bin/python benchmarks/needle_baselines.py [--context-tokens 2000] [--depth 0.35]

A thin wrapper of the leaderboard runner (``kvzoo leaderboard``): RULER's single needle in essay
text at one depth, ratios 4 and 8, both question positions; prints the markdown tables. Results
go to ``results/needle_baselines.jsonl`` (rerun to resume).
"""

from __future__ import annotations

import argparse

from kvzoo.cli import main as kvzoo_main


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context-tokens", default="2000")
    parser.add_argument("--depth", default="0.35")
    parser.add_argument("--ratios", nargs="+", default=["4", "8"])
    args = parser.parse_args()
    return kvzoo_main([
        "leaderboard", "--preset", "demo", "--context-tokens", args.context_tokens, "--depths", args.depth,
        "--ratios", *args.ratios, "--positions", "after", "before", "--out", "results/needle_baselines.jsonl",
        "--no-plots",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
