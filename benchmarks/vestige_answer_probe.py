"""Why VestigeKV misses a task `full` answers (issue 36: `niah_multivalue` at 4k, each value's last digit replaced
by a period): is the answer lost at eviction, or not fetched back?

    PYTHONPATH=. .venv/bin/python benchmarks/vestige_answer_probe.py --task niah_multivalue --context-tokens 4000 \
        --depth 0.5 --seed 0 --ratios 8 32 --out docs/results/vestige_answer_probe.jsonl

SmolLM2-135M (real weights), the leaderboard's trial (``kvzoo.bench.trial.run_trial``, question after compression,
the same prompt and greedy answer as ``kvzoo leaderboard``), one row per (ratio, arm):

- the arms: ``full``; VestigeKV with eviction alone (no retriever); with its retrieval tier as shipped (top ``j`` = 16
  rows per head and step, ranked by the bound's estimate); with ``j`` = 64 and 256 (more rows fetched back per step);
  the same ranked by the bound itself (``rank_by="bound"``); certified (every row whose bound is within ``tau`` = 8
  of the tier's best score: no ranking);
- per arm: the greedy answer, its score, the reference answer's teacher-forced NLL (decode steps) less ``full``'s,
  and the rows fetched back per decode step;
- per ratio: where the answer's digits are after compression -- for each answer value (in the context's order) and
  each digit of it, the share of (layer, KV head) pairs whose attended tier still holds that digit's row.

If the tier with more rows fetched answers, the miss is the fetch budget; if only the certified tier answers, it is
the top-j ranking; if none does, the rows a step fetches are not what decides it.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

from kvzoo import pipeline, registry
from kvzoo.bench import metrics
from kvzoo.bench.results import append_row
from kvzoo.bench.tasks import TaskSpec, make_task
from kvzoo.bench.trial import encode_prompt, run_trial
from kvzoo.framework.cache import TieredCache
from kvzoo.models import load_smollm2

ARMS = {  # arm -> the vestige policy's retriever parameters (None: eviction alone); "full": the full cache
    "full": "full",
    "eviction alone": None,
    "tier, j=16 (default)": {},
    "tier, j=64": {"j": 64},
    "tier, j=256": {"j": 256},
    "tier, j=16 ranked by the bound": {"rank_by": "bound"},
    "tier, j=256 ranked by the bound": {"j": 256, "rank_by": "bound"},
    "tier, certified tau=8": {"certified": True, "tau": 8.0},
}


def _policy(arm: str, ratio: float):
    spec = ARMS[arm]
    if spec == "full":
        return registry.get("full")
    if spec is None:
        return registry.get("vestige", ratio=ratio, retriever=None)
    return registry.get("vestige", ratio=ratio, retriever=registry.retriever_class("vestige")(**spec))


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i: i + len(needle)] == needle:
            return i
    raise ValueError(f"answer tokens {needle} not found in the prompt")


@torch.no_grad()
def residency(model, prefix: torch.Tensor, ratio: float, spans: list[list[int]]) -> list[list[float]]:
    """Per answer value and digit: the share of (layer, KV head) pairs whose tier holds the digit's row after
    compression (VestigeKV's selection, which every arm of the ratio shares: the tier is the same, only fetching
    differs)."""
    cache = TieredCache(model, registry.get("vestige", ratio=ratio), context_length=prefix.shape[1])
    pipeline.prefill(model, cache, prefix, ends_context=True)
    pipeline.compress(cache)
    held = []
    for layer in cache.layers:
        if layer.gathered:
            held.append(layer.tier.get("pos")[0])  # [G, n]: the tier's positions per KV head
        else:
            held.append(torch.arange(layer.n)[None].expand(layer.batch_groups[1], -1))
    cache.close()
    out = []
    for span in spans:
        shares = []
        for pos in span:
            hits = [bool((pos_g == pos).any()) for per_layer in held for pos_g in per_layer]
            shares.append(sum(hits) / len(hits))
        out.append(shares)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="niah_multivalue")
    parser.add_argument("--context-tokens", type=int, default=4000)
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratios", type=float, nargs="+", default=[8, 32])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", help="write one JSON line per (ratio, arm) here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_smollm2(torch.float32)
    spec = TaskSpec(args.task, args.context_tokens, args.depth, args.seed)
    task = make_task(spec, tokenizer)
    ids = encode_prompt(tokenizer, task)
    prompt = ids.prefix[0].tolist()
    values = sorted(task.answers, key=lambda v: _find(prompt, tokenizer(v, add_special_tokens=False).input_ids))
    spans = []
    for value in values:
        tokens = tokenizer(value, add_special_tokens=False).input_ids
        start = _find(prompt, tokens)
        spans.append(list(range(start, start + len(tokens))))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows, full_nll = [], None
    for ratio in args.ratios:
        held = residency(model, ids.prefix, ratio, spans)
        print(f"{ratio:g}x: digit rows held (share of layer x KV head), per value in context order:")
        for value, shares in zip(values, held, strict=True):
            print(f"  {value}: " + " ".join(f"{s:.2f}" for s in shares))
        for arm in args.arms:
            if arm == "full" and full_nll is not None:
                continue
            t0 = time.perf_counter()
            row = run_trial(model, tokenizer, task, _policy(arm, ratio), one_forward=False)
            nll = sum(row["answer_nll"]) if isinstance(row["answer_nll"], list) else row["answer_nll"]
            if arm == "full":
                full_nll = nll
            out = {"task": args.task, "context_tokens": args.context_tokens, "depth": args.depth, "seed": args.seed,
                   "ratio": None if arm == "full" else ratio, "arm": arm, "prediction": row["prediction"],
                   "answers": values, "score": metrics.string_match(task.metric, row["prediction"], task.answers),
                   "answer_nll": nll, "delta_nll": None if full_nll is None else nll - full_nll,
                   "fetched_rows_per_step": row.get("fetched_rows_per_step"),
                   "digits_held": None if arm == "full" else held, "commit": commit,
                   "date": time.strftime("%Y-%m-%d")}
            rows.append(out)
            print(f"  {arm}: {out['prediction']!r} score {out['score']:.2f}, answer NLL {nll:.2f}, fetched/step "
                  f"{out['fetched_rows_per_step']} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.out:
                append_row(args.out, out)


if __name__ == "__main__":
    main()
