"""A leaderboard trial of vestige with any retriever options, against a results file's ``full`` row (issue 25).

    PYTHONPATH=. .venv/bin/python benchmarks/vestige_rule_control.py --results new_2k.jsonl --ratio 8 32 \
        --depth 0.1 0.5 --retriever '{"index": "sketch", "rank_by": "bound", "j_margin": 0.0}' [--out rows.jsonl]

Runs ``kvzoo.bench.runner.run_trial`` (the leaderboard's code path: niah_single on the noise haystack, question after
compression, ΔCE teacher-forced one decode step per token) for ``vestige`` with the retriever built from the JSON
options -- the leaderboard's specs cannot configure a retriever -- and prints the row's score, ΔCE, KV bytes per step
and per token, and the rows fetched per KV head per layer-step. The reference figures come from the ``full`` row of
the same task in ``--results`` (same continuation length).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvzoo import registry
from kvzoo.bench.runner import Reference, run_trial
from kvzoo.bench.tasks import TaskSpec, make_task
from kvzoo.framework.retrieval import build_retriever
from kvzoo.models import load_smollm2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", required=True)
    p.add_argument("--ratio", type=float, nargs="+", default=[8])
    p.add_argument("--depth", type=float, nargs="+", default=[0.1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--retriever", default='{"index": "sketch", "rank_by": "bound", "j_margin": 0.0}')
    p.add_argument("--out", default=None, help="append each trial's results row to this JSONL (for retrieval_table.py)")
    args = p.parse_args()
    model, tok = load_smollm2(torch.float32)
    for depth in args.depth:
        full = next(r for r in map(json.loads, open(args.results))
                    if r["policy"] == "full" and r["depth"] == depth and r["seed"] == args.seed
                    and r["context_tokens"] == args.context_tokens)
        task = make_task(TaskSpec("niah_single", args.context_tokens, depth, args.seed, "noise"), tok,
                         continuation_tokens=full["continuation_tokens"])
        for ratio in args.ratio:
            retriever = build_retriever("vestige", **json.loads(args.retriever))
            policy = registry.get("vestige", ratio=ratio, retriever=retriever)
            with torch.inference_mode():
                row = run_trial(model, tok, task, policy, reference=Reference.of(full))
            per_head = row["fetched_rows_per_step"] / (model.config.num_hidden_layers * model.config.num_key_value_heads)
            index = row.get("index_bytes_per_step")
            print(f"vestige {ratio:g}x depth {depth} {retriever.config()}: score {row['score']:.2f} "
                  f"({row['prediction'][:24]!r}), ΔCE {row['delta_ce']:+.3f}, KV bytes/step "
                  f"{row['kv_bytes_per_step'] / 2**20:.2f} MiB, per token {row['kv_bytes_per_token'] / 2**20:.2f} MiB, "
                  f"fetched {per_head:.1f} rows per KV head per layer-step ({per_head / row['prompt_tokens']:.2%} of "
                  f"the context), index share {0 if index is None else index / row['kv_bytes_per_step']:.0%}",
                  flush=True)
            if args.out:
                # the table's cell (run_trial's row has no grid keys): the rule, not the default's
                row.update(policy=f"vestige[{args.retriever}]", ratio=ratio, context_tokens=args.context_tokens)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
