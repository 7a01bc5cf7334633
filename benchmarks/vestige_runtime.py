"""VestigeKV / Quest figures on the tiny MLA models (issue 5's benchmark), CPU, torch path.

    .venv/bin/python benchmarks/vestige_runtime.py [--tokens 8192]

Per model (tiny DeepSeek-V2, tiny Kimi Linear; random weights: mechanics and costs, not quality):
* selector time: vestige reading the 64-dim branch vs the same selector on the whole 576-dim row
  (branch="row"), eviction only, one block of all the context at the same budget (the
  context_end event); with the sketch retriever that event also fits the basis and builds the index;
* per decode step (20 steps after the prefill, question-free): rows fetched, KV-path bytes read
  (attended rows + index entries + fetched rows) vs full, and step time vs full, at 8x and 32x.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvzoo import TieredCache, registry
from kvzoo.models import load_model


def run(model, policy, ids, steps=20):
    cache = TieredCache(model, policy, context_length=ids.shape[1])
    with torch.no_grad():
        for i in range(0, ids.shape[1], 1024):
            out = model(input_ids=ids[:, i : i + 1024], cache=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        cache.compress()
        compress_s = time.perf_counter() - t
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=token, cache=cache, use_cache=True)
        before = cache.stats().totals
        t = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        step_ms = (time.perf_counter() - t) / steps * 1e3
    after = cache.stats().totals
    per_step = {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in ("rows_fetched", "kv_bytes_read")}
    if not after.get("kv_bytes_read"):  # no retriever: a step reads the attended tier
        per_step["kv_bytes_read"] = after["resident_bytes"]
    return compress_s, step_ms, per_step, after


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    n = args.tokens
    print(f"context {n} tokens prefilled in chunks of 1024, one block closed at the end of the context, 20 decode "
          "steps; figures per step, summed over the MLA layers\n")
    print("| model | policy | selector s | rows fetched/step | KV bytes/step | vs full | step ms | vs full |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("tiny-deepseek-v2", "tiny-kimi-linear"):
        model, _ = load_model(name)
        ids = torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(0))
        _, full_ms, full_step, _ = run(model, registry.get("full"), ids)
        print(f"| {name} | full | - | 0 | {full_step['kv_bytes_read'] / 1e6:.2f} MB | 1.00 | {full_ms:.1f} | 1.00 |")
        block = 2 * n  # one block, closed by compress() at the end of the context (so it is timed there)
        rows = []
        for ratio in (8, 32):
            rows += [
                (f"vestige {ratio}x, eviction only, σ on branch", registry.get(
                    "vestige", ratio=ratio, block_size=block, retriever=None)),
                (f"vestige {ratio}x, eviction only, σ on whole row", registry.get(
                    "vestige", ratio=ratio, block_size=block, retriever=None, branch="row")),
                (f"vestige {ratio}x + sketch (top-16)", registry.get("vestige", ratio=ratio, block_size=block)),
                (f"quest {ratio}x (dense_layers=0)", registry.get("quest", ratio=ratio, dense_layers=0)),
            ]
        for label, policy in rows:
            sel_s, ms, step, totals = run(model, policy, ids)
            print(f"| {name} | {label} | {sel_s:.3f} | {step['rows_fetched']:.0f} | {step['kv_bytes_read'] / 1e6:.2f} MB | "
                  f"{step['kv_bytes_read'] / full_step['kv_bytes_read']:.2f} | {ms:.1f} | {ms / full_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
