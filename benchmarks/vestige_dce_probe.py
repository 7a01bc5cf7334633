"""Why VestigeKV's ΔCE at 64x/128x on a 4k needle context is above 0.2 nats/token (issue 36): eviction alone, the
retrieval tier as shipped (top ``j`` = 16 rows per head and step) and with more rows fetched (``j`` = 64, 256).

    PYTHONPATH=. .venv/bin/python benchmarks/vestige_dce_probe.py --context-tokens 4000 --ratios 64 128 \
        --depths 0.1 0.3 0.5 0.7 0.9 --json rows.jsonl --summary docs/results/vestige_dce_probe_4k.jsonl

SmolLM2-135M (real weights), the leaderboard's ``niah_single`` trial (essay haystack, seed 0, the same prompt as
``kvzoo leaderboard --continuation-tokens 32``): the context is prefilled and compressed, then its 32-token held-out
continuation is teacher-forced one decode step per token (``pipeline.delta_ce``, ``mode="decode"``, the paper's
measure), against ``full`` on the same tokens. Per (depth, ratio, arm): ΔCE and the rows the retriever fetched per
decode step, as a share of the context per KV head. If the tier with more rows fetched closes the gap, the miss is
the fetch budget (how many rows a step may bring back), not the ranking; if eviction alone is no worse, the tier is
not what decides it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvzoo import pipeline, registry
from kvzoo.bench.tasks import TaskSpec, make_task
from kvzoo.bench.trial import encode_prompt
from kvzoo.models import load_smollm2

ARMS = {  # arm -> the vestige policy's retriever (None: eviction alone)
    "eviction alone": None,
    "tier, j=16 (default)": {},
    "tier, j=64": {"j": 64},
    "tier, j=256": {"j": 256},
}


def _policy(ratio: float, retriever: dict | None):
    if retriever is None:
        return registry.get("vestige", ratio=ratio, retriever=None)
    return registry.get("vestige", ratio=ratio, retriever=registry.retriever_class("vestige")(**retriever))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=4000)
    parser.add_argument("--ratios", type=float, nargs="+", default=[64, 128])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--json", help="append one JSON line per (depth, ratio, arm)")
    parser.add_argument("--summary", help="write one JSON line per (ratio, arm) here: mean ΔCE, per depth, fetched")
    parser.add_argument("--from-json", help="summarize the rows of an earlier --json file instead of running")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        _summarize(rows, args.summary)
        return
    model, tokenizer = load_smollm2(torch.float32)
    rows = []
    for depth in args.depths:
        task = make_task(TaskSpec("niah_single", args.context_tokens, depth, args.seed), tokenizer,
                         continuation_tokens=32)
        ids = encode_prompt(tokenizer, task)
        context, continuation = ids.prefix, ids.continuation
        t0 = time.perf_counter()
        reference = pipeline.continuation_nll(model, context, continuation, "full")
        print(f"depth {depth}: full CE {reference.ce:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        for ratio in args.ratios:
            for arm in args.arms:
                t0 = time.perf_counter()
                result = pipeline.delta_ce(model, context, continuation, _policy(ratio, ARMS[arm]),
                                           reference=reference)
                stats = result.result.stats
                steps = continuation.shape[1]
                fetched = sum(layer.fetched_rows for layer in stats.layers)
                heads = model.config.num_hidden_layers * model.config.num_key_value_heads  # rows: per KV head
                row = {"context_tokens": context.shape[1], "depth": depth, "seed": args.seed, "ratio": ratio,
                       "arm": arm, "delta_ce": result.delta, "full_ce": reference.ce,
                       "fetched_rows_per_step": fetched / steps,
                       "fetched_share": fetched / steps / heads / context.shape[1]}
                rows.append(row)
                print(f"  {ratio:g}x {arm}: ΔCE {result.delta:+.3f}, fetched/step {fetched / steps:.0f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    _summarize(rows, args.summary)


def _summarize(rows: list[dict], path: str | None) -> None:
    """One line per (ratio, arm): the mean ΔCE over the depths, each depth's, the mean fetched share; printed as a
    table and, with ``path``, written as JSON lines (the results page's rows)."""
    out = []
    for ratio in dict.fromkeys(r["ratio"] for r in rows):
        for arm in dict.fromkeys(r["arm"] for r in rows):
            mine = [r for r in rows if r["ratio"] == ratio and r["arm"] == arm]
            if mine:
                out.append({"context_tokens": mine[0]["context_tokens"], "seed": mine[0]["seed"], "ratio": ratio,
                            "arm": arm, "depths": [r["depth"] for r in mine],
                            "mean_delta_ce": statistics.mean(r["delta_ce"] for r in mine),
                            "delta_ce_per_depth": " ".join(f"{r['delta_ce']:+.2f}" for r in mine),
                            "fetched_share": statistics.mean(r["fetched_share"] for r in mine),
                            "fetched_rows_per_step": statistics.mean(r["fetched_rows_per_step"] for r in mine)})
    print("\n| ratio | arm | mean ΔCE | per depth | fetched share |\n|---|---|---|---|---|")
    for row in out:
        print(f"| {row['ratio']:g}x | {row['arm']} | {row['mean_delta_ce']:+.3f} | {row['delta_ce_per_depth']} | "
              f"{row['fetched_share'] * 100:.2f} % |")
    if path:
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in out)

if __name__ == "__main__":
    main()
