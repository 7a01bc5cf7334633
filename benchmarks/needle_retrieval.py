"""Needle answers with a recall tier on SmolLM2-135M (issue 5's benchmark).

    .venv/bin/python benchmarks/needle_retrieval.py [--ratio 8]

2k-token needle context (kvzoo.bench.tasks' generator, needle at 35 % depth), question after
compression. Rows: vestige (σ on the key: SmolLM2 is a RoPE/GQA model, where the paper predicts
the branch selector fails), vestige + certified sketch, snapkv, snapkv + vestige sketch, quest.
"""

from __future__ import annotations

import argparse

import torch

from kvzoo import pipeline, registry
from kvzoo.bench.tasks import NEEDLE_VALUE, QUESTION, build_needle_context
from kvzoo.framework.retrieval import build_retriever
from kvzoo.models import load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ratio", type=float, default=8)
    args = parser.parse_args()
    model, tok = load_smollm2(torch.float32)
    ctx = build_needle_context(tok)
    r = args.ratio
    certified = build_retriever("vestige", certified=True, tau=8.0)
    runs = [
        ("full", registry.get("full")),
        ("vestige (branch=key), eviction only", registry.get("vestige", ratio=r, retriever=None)),
        ("vestige (branch=key) + sketch top-16", registry.get("vestige", ratio=r)),
        ("vestige (branch=key) + certified sketch (tau 8)", registry.get("vestige", ratio=r, retriever=certified)),
        ("snapkv", registry.get("snapkv", ratio=r)),
        ("snapkv + vestige sketch top-16", registry.get("snapkv", ratio=r, retriever="vestige")),
        ("quest", registry.get("quest", ratio=r)),
    ]
    print(f"SmolLM2-135M fp32, {ctx.context_tokens}-token context, needle at {ctx.depth:.0%}, ratio {r:g}, "
          "question after compression\n")
    print("| policy | correct | answer | rows fetched/step/layer | KV bytes/step vs full | bound violations |")
    print("|---|---|---|---|---|---|")
    full_bytes = None
    for label, policy in runs:
        res = pipeline.generate(model, tok, ctx.text, QUESTION, policy, max_new_tokens=16, audit=policy.retriever is not None)
        t = res.stats.totals
        layers = len(res.stats.layers)
        steps = max(1, t.get("retrieval_steps", 0) / layers)
        step_bytes = sum(s.last_step.get("kv_bytes_read", s.resident_bytes) for s in res.stats.layers)
        full_bytes = full_bytes or step_bytes
        viol = t.get("bound_violations", "n/a")
        print(f"| {label} | {'yes' if NEEDLE_VALUE in res.answer else 'no'} | {res.answer[:48]!r} | "
              f"{t.get('rows_fetched', 0) / steps / layers:.0f} | {step_bytes / full_bytes:.2f} | {viol} |", flush=True)


if __name__ == "__main__":
    main()
