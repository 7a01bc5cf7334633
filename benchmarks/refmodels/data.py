"""Dump the reference models' held-out sets (generated offline, fixed seeds) as JSON lines.

    python benchmarks/refmodels/data.py --task recall --length 512 --pairs 16 --count 200 > recall.jsonl
    python benchmarks/refmodels/data.py --task shared --length 512 --pairs 16
    python benchmarks/refmodels/data.py --task needle_text --length 512 --pairs 4

The generators live in :mod:`kvzoo.refmodel.data` (vocabulary, curriculum, training batches).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvzoo.refmodel import data as D  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=D.TASKS, default="recall")
    p.add_argument("--length", type=int, default=512, help="context + question tokens")
    p.add_argument("--pairs", type=int, default=16, help="key-value pairs (needles for needle_text)")
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--seed", type=int, default=12345)
    args = p.parse_args(argv)
    for example in D.heldout(args.task, args.length, args.pairs, args.count, seed=args.seed):
        print(json.dumps(example.as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
