"""Needle answer of the eviction baselines on SmolLM2-135M (issue 3's benchmark).

    .venv/bin/python benchmarks/needle_baselines.py [--context-tokens 2000] [--depth 0.35]

A 2k-token context from kvzoo.demo's generator with one needle; for each policy and ratio the
question is asked after compression and, as the other column, before it. Prints a markdown table:
answer correct (contains the needle value) and prefill+compression time relative to ``full``.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvzoo import pipeline, registry
from kvzoo.demo import NEEDLE_VALUE, QUESTION, build_needle_context
from kvzoo.models import load_smollm2

POLICIES = ("full", "streaming_llm", "snapkv", "h2o", "chunkkv")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--depth", type=float, default=0.35)
    parser.add_argument("--ratios", type=float, nargs="+", default=[4, 8])
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_smollm2(torch.float32)
    ctx = build_needle_context(tok, context_tokens=args.context_tokens, depth=args.depth)
    rows = []
    full_time = {}
    for name in POLICIES:
        for ratio in [None] if name == "full" else args.ratios:
            cells = []
            for position in ("after", "before"):
                policy = registry.get(name) if ratio is None else registry.get(name, ratio=ratio)
                t = time.perf_counter()
                r = pipeline.generate(model, tok, ctx.text, QUESTION, policy, max_new_tokens=16, question_position=position)
                elapsed = time.perf_counter() - t
                pc = r.timings["prefill_s"] + r.timings["compress_s"]
                if name == "full":
                    full_time[position] = pc
                ok = NEEDLE_VALUE in r.answer
                cells.append((ok, pc / full_time[position], r.answer, elapsed))
            label = name if ratio is None else f"{name} {ratio:g}x"
            rows.append((label, cells))
            print(label, [(c[0], round(c[1], 2), c[2][:60]) for c in cells], flush=True)
    print(f"\nSmolLM2-135M fp32, {ctx.context_tokens}-token context, needle at {ctx.depth:.0%} depth\n")
    print("| policy | q after: correct | q before: correct | prefill+compress vs full (after) |")
    print("|---|---|---|---|")
    for label, (after, before) in rows:
        print(f"| {label} | {'yes' if after[0] else 'no'} | {'yes' if before[0] else 'no'} | {after[1]:.2f}x |")


if __name__ == "__main__":
    main()
