"""Probes: the one-off measurements behind findings recorded in docs/results.md, docs/fidelity.md and CHANGELOG.md,
kept runnable as one tool -- ``.venv/bin/python benchmarks/probe.py NAME [options]``, ``NAME --help`` for what it
measures and its options:

* ``vestige-answer``: why VestigeKV misses a task ``full`` answers -- lost at eviction, or not fetched back?
* ``vestige-dce``: why VestigeKV's ΔCE at 64x/128x on a 4k needle is above 0.2 nats/token.
* ``vestige-recovery``: VestigeKV's recovery table on the reference twins, the tier against eviction alone.
* ``vestige-runtime``: VestigeKV / Quest costs on the tiny MLA models: selector time, rows fetched, bytes, step time.
* ``quest-page``: how often ``quest(rule="eval")``'s pages differ from the reference evaluation rule's.
* ``chunkkv-reuse``: ChunkKV's compression step with and without layer-wise index reuse.
* ``vestige-prune``: VestigeKV's int8 index pruned by page summaries on SmolLM2: pages skipped, bytes, the audit.
* ``vestige-prune-needle``: the 2k needle grid with VestigeKV's int8 index pruned: the same answers?
* ``prune-bounds``: which certified bound could prune VestigeKV's int8 scan on SmolLM2, and how far.

Heavy imports (torch, kvzoo) happen inside each probe, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks.refmodels and kvzoo from the checkout
    sys.path.insert(0, str(ROOT))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _append_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to the JSON-lines file ``path``, one line each."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def vestige_with(ratio: float, retriever: dict | None):
    """``vestige`` at ``ratio`` with its retriever built from these parameters (None: eviction alone)."""
    from kvzoo import registry

    if retriever is None:
        return registry.get("vestige", ratio=ratio, retriever=None)
    return registry.get("vestige", ratio=ratio, retriever=registry.retriever_class("vestige")(**retriever))


# ---------------------------------------------------------------------------------------------------- vestige-answer

ANSWER_ARMS = {  # arm -> the vestige policy's retriever parameters (None: eviction alone); "full": the full cache
    "full": "full",
    "eviction alone": None,
    "tier, j=16 (default)": {},
    "tier, j=64": {"j": 64},
    "tier, j=256": {"j": 256},
    "tier, j=16 ranked by the bound": {"rank_by": "bound"},
    "tier, j=256 ranked by the bound": {"j": 256, "rank_by": "bound"},
    "tier, certified tau=8": {"certified": True, "tau": 8.0},
}


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i: i + len(needle)] == needle:
            return i
    raise ValueError(f"answer tokens {needle} not found in the prompt")


def residency(model, prefix, ratio: float, spans: list[list[int]]) -> list[list[float]]:
    """Per answer value and digit: the share of (layer, KV head) pairs whose tier holds the digit's row after
    compression (VestigeKV's selection, which every arm of the ratio shares: the tier is the same, only fetching
    differs)."""
    import torch

    from kvzoo import pipeline, registry
    from kvzoo.framework.cache import TieredCache

    with torch.no_grad():
        cache = TieredCache(model, registry.get("vestige", ratio=ratio), context_length=prefix.shape[1])
        pipeline.prefill(model, cache, prefix, ends_context=True)
        pipeline.compress(cache)
        held = []
        for layer in cache.layers:
            store = layer.store
            if store.gathered:
                held.append(store.tier.get("pos")[0])  # [G, n]: the tier's positions per KV head
            else:
                held.append(torch.arange(store.n)[None].expand(store.batch_groups[1], -1))
        cache.close()
    out = []
    for span in spans:
        shares = []
        for pos in span:
            hits = [bool((pos_g == pos).any()) for per_layer in held for pos_g in per_layer]
            shares.append(sum(hits) / len(hits))
        out.append(shares)
    return out


def vestige_answer(args: argparse.Namespace) -> int:
    """Why VestigeKV misses a task `full` answers (issue 36: `niah_multivalue` at 4k, each value's last digit replaced
    by a period): is the answer lost at eviction, or not fetched back?

        .venv/bin/python benchmarks/probe.py vestige-answer --task niah_multivalue --context-tokens 4000 --depth 0.5 \\
            --seed 0 --ratios 8 32 --out docs/results/vestige_answer_probe.jsonl

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
    import torch

    from kvzoo import registry
    from kvzoo.bench import metrics
    from kvzoo.bench.results import append_row
    from kvzoo.bench.tasks import TaskSpec, make_task
    from kvzoo.bench.trial import encode_prompt, run_trial
    from kvzoo.models import load_smollm2

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
    commit = git_commit()
    full_nll = None
    for ratio in args.ratios:
        held = residency(model, ids.prefix, ratio, spans)
        print(f"{ratio:g}x: digit rows held (share of layer x KV head), per value in context order:")
        for value, shares in zip(values, held, strict=True):
            print(f"  {value}: " + " ".join(f"{s:.2f}" for s in shares))
        for arm in args.arms:
            if arm == "full" and full_nll is not None:
                continue
            t0 = time.perf_counter()
            policy = registry.get("full") if arm == "full" else vestige_with(ratio, ANSWER_ARMS[arm])
            row = run_trial(model, tokenizer, task, policy, one_forward=False)
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
            print(f"  {arm}: {out['prediction']!r} score {out['score']:.2f}, answer NLL {nll:.2f}, fetched/step "
                  f"{out['fetched_rows_per_step']} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.out:
                append_row(args.out, out)
    return 0


def _vestige_answer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="niah_multivalue")
    p.add_argument("--context-tokens", type=int, default=4000)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratios", type=float, nargs="+", default=[8, 32])
    p.add_argument("--arms", nargs="+", default=list(ANSWER_ARMS), choices=list(ANSWER_ARMS))
    p.add_argument("--out", help="write one JSON line per (ratio, arm) here")


# ------------------------------------------------------------------------------------------------------- vestige-dce

DCE_ARMS = {  # arm -> the vestige policy's retriever (None: eviction alone)
    "eviction alone": None,
    "tier, j=16 (default)": {},
    "tier, j=64": {"j": 64},
    "tier, j=256": {"j": 256},
}


def vestige_dce(args: argparse.Namespace) -> int:
    """Why VestigeKV's ΔCE at 64x/128x on a 4k needle context is above 0.2 nats/token (issue 36): eviction alone, the
    retrieval tier as shipped (top ``j`` = 16 rows per head and step) and with more rows fetched (``j`` = 64, 256).

        .venv/bin/python benchmarks/probe.py vestige-dce --context-tokens 4000 --ratios 64 128 \\
            --depths 0.1 0.3 0.5 0.7 0.9 --json rows.jsonl --summary docs/results/vestige_dce_probe_4k.jsonl

    SmolLM2-135M (real weights), the leaderboard's ``niah_single`` trial (essay haystack, seed 0, the same prompt as
    ``kvzoo leaderboard --continuation-tokens 32``): the context is prefilled and compressed, then its 32-token held-out
    continuation is teacher-forced one decode step per token (``pipeline.delta_ce``, ``mode="decode"``, the paper's
    measure), against ``full`` on the same tokens. Per (depth, ratio, arm): ΔCE and the rows the retriever fetched per
    decode step, as a share of the context per KV head. If the tier with more rows fetched closes the gap, the miss is
    the fetch budget (how many rows a step may bring back), not the ranking; if eviction alone is no worse, the tier is
    not what decides it.
    """
    if args.from_json:
        with open(args.from_json) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        dce_summary(rows, args.summary)
        return 0
    import torch

    from kvzoo import pipeline
    from kvzoo.bench.tasks import TaskSpec, make_task
    from kvzoo.bench.trial import encode_prompt
    from kvzoo.models import load_smollm2

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
                result = pipeline.delta_ce(model, context, continuation, vestige_with(ratio, DCE_ARMS[arm]),
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
                    _append_rows(args.json, [row])
    dce_summary(rows, args.summary)
    return 0


def dce_summary(rows: list[dict], path: str | None) -> None:
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


def _vestige_dce_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=4000)
    p.add_argument("--ratios", type=float, nargs="+", default=[64, 128])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=list(DCE_ARMS), choices=list(DCE_ARMS))
    p.add_argument("--json", help="append one JSON line per (depth, ratio, arm)")
    p.add_argument("--summary", help="write one JSON line per (ratio, arm) here: mean ΔCE, per depth, fetched")
    p.add_argument("--from-json", help="summarize the rows of an earlier --json file instead of running")


# -------------------------------------------------------------------------------------------------- vestige-recovery

RECOVERY_ARMS = ("nope", "rope")
RECOVERY_RATIOS = (8, 16, 32, 64, 128)
RECOVERY_TIERS = ("eviction alone", "tier (top-j, as shipped)", "tier (certified, tau 8)")
FULL = "full"
RECOVERY_OUT = ROOT / "docs" / "results" / "vestige_recovery_twins.jsonl"


def recovery_policy(tier: str, ratio: int | None) -> Any:
    from kvzoo import registry
    from kvzoo.framework.retrieval import build_retriever

    if tier == FULL:
        return registry.get("full")
    if tier == "eviction alone":
        return registry.get("vestige", ratio=ratio, retriever=None)
    if tier == "tier (top-j, as shipped)":
        return registry.get("vestige", ratio=ratio, retriever=build_retriever("vestige", multi_token="union"))
    if tier == "tier (certified, tau 8)":
        return registry.get("vestige", ratio=ratio, retriever=build_retriever("vestige", certified=True, tau=8.0,
                                                                              multi_token="union"))
    raise ValueError(f"unknown tier {tier!r}")


def recovery_cell(model: Any, examples: list, tier: str, ratio: int | None) -> dict[str, Any]:
    """Accuracy and retrieval figures of one (model, tier, ratio) cell over ``examples``."""
    from kvzoo import pipeline

    audit = tier == "tier (certified, tau 8)"
    hits = 0
    tot = {"fetched_rows": 0, "retrieval_steps": 0, "bound_violations": 0, "audited_scores": 0}
    archived: list[float] = []
    dropped: list[float] = []
    resident: list[float] = []
    for e in examples:
        policy = recovery_policy(tier, ratio)
        out = pipeline.generate(model, None, e.context, e.question, policy, max_new_tokens=1, audit=audit)
        hits += out.token_ids[0] == e.answer
        t = out.stats.totals
        for k in tot:
            tot[k] += int(t.get(k, 0))
        layers = out.stats.layers
        archived.append(statistics.mean(s.archived_rows for s in layers))
        dropped.append(statistics.mean(s.dropped_rows for s in layers))
        resident.append(statistics.mean(s.resident_rows for s in layers))
    per_step = tot["fetched_rows"] / tot["retrieval_steps"] if tot["retrieval_steps"] else 0.0
    archived_rows = statistics.mean(archived)
    return {
        "examples": len(examples),
        "accuracy": hits / len(examples),
        "fetched_rows_per_step": per_step,
        "archived_rows": archived_rows,
        "fetched_share": per_step / archived_rows if archived_rows else None,
        "fetched_rows": tot["fetched_rows"],
        "retrieval_steps": tot["retrieval_steps"],
        "dropped_rows": statistics.mean(dropped),
        "resident_rows": statistics.mean(resident),
        "bound_violations": tot["bound_violations"] if audit else None,
        "audited_scores": tot["audited_scores"] if audit else None,
    }


def recovery_summary(rows: list[dict[str, Any]]) -> str:
    """Markdown: mean over seeds per arm x tier x ratio."""
    lines = ["| arm | tier | ratio | budget | seeds | accuracy | rows fetched / step | archived rows | fetched share |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys: list[tuple[str, str, int | None]] = []
    for r in rows:
        key = (r["arm"], r["tier"], r["ratio"])
        if key not in keys:
            keys.append(key)
    order = {t: i for i, t in enumerate((FULL, *RECOVERY_TIERS))}
    keys.sort(key=lambda k: (RECOVERY_ARMS.index(k[0]), order[k[1]], k[2] or 0))
    for arm, tier, ratio in keys:
        cell = [r for r in rows if (r["arm"], r["tier"], r["ratio"]) == (arm, tier, ratio)]
        shares = [r["fetched_share"] for r in cell if r["fetched_share"] is not None]
        lines.append(
            f"| {arm} | {tier} | {'-' if ratio is None else f'{ratio}x'} | {cell[0]['budget']} | {len(cell)} | "
            f"{statistics.mean(r['accuracy'] for r in cell):.3f} | "
            f"{statistics.mean(r['fetched_rows_per_step'] for r in cell):.1f} | "
            f"{statistics.mean(r['archived_rows'] for r in cell):.0f} | "
            f"{f'{statistics.mean(shares):.3f}' if shares else '-'} |")
    return "\n".join(lines)


def vestige_recovery(args: argparse.Namespace) -> int:
    """VestigeKV's recovery table on kvzoo's reference twins: what the retrieval tier recovers over eviction alone.

        OMP_NUM_THREADS=1 python benchmarks/probe.py vestige-recovery            # all shipped seeds, 80 examples
        python benchmarks/probe.py vestige-recovery --seeds 0 --ratios 8 128 --count 10 --out /tmp/r.jsonl

    Models: the trained twins of ``benchmarks/refmodels`` (README there), ``ref-nope-s<seed>`` (Kimi-like: MLA
    branch never rotated) and ``ref-rope-s<seed>`` (DeepSeek-like control), every shipped seed by default.
    Examples: held-out 16-pair recall at T = 512 (``D.heldout_recall(*D.CURRICULUM[-1], count,
    seed=tables.TABLE_SEED)``, the stream of ``benchmarks/refmodels/tables.py``); the context (510 tokens) is
    prefilled and compressed, then the 2-token question ``[QUERY, k]`` runs and its one greedy token is the answer
    (``pipeline.generate(..., max_new_tokens=1)``, exactly as ``tables.accuracy``).

    Per (arm, seed, ratio) three tiers of VestigeKV, plus one ``full`` row per (arm, seed):

    * ``eviction alone``: ``vestige(ratio, retriever=None)``; the evicted rows are dropped;
    * ``tier (top-j, as shipped)``: the shipped vestige retriever, its defaults except ``multi_token="union"``;
    * ``tier (certified, tau 8)``: ``build_retriever("vestige", certified=True, tau=8.0, multi_token="union")``,
      tables.py's ``vestige+certified``; run with ``audit=True`` (cheap here: every archived row is scored
      exactly once more), so its rows also carry ``bound_violations`` and ``audited_scores``.

    Why ``multi_token="union"``: the question is a 2-token forward, and under the default ``multi_token="dense"`` rule
    a retriever reads the whole archive on a multi-token forward, so every tier would equal ``full`` by construction.
    ``union`` lets each question token make its own choice, the same rule as a decode step.

    Columns (one JSON line per row in ``--out``, the file rewritten): ``budget`` = rows the policy keeps per layer out of
    the 510 context rows (``510 // ratio``; the 2 question rows come on top); ``archived_rows`` = archived rows per layer
    after the question forward (mean over layers and examples; 0 for eviction alone, whose evicted rows are dropped --
    ``dropped_rows`` counts them); ``fetched_rows_per_step`` = archived rows admitted per retrieval step, i.e. per
    question forward per layer (``totals["fetched_rows"] / totals["retrieval_steps"]`` over the cell's examples; 0 when
    nothing is archived); ``fetched_share`` = fetched per step / archived rows (null without an archive). The markdown
    summary printed at the end is the mean over seeds per arm x tier x ratio.

    Default ``--count`` 80: one example takes ~0.05 s on one CPU thread whatever the tier (the certified one included),
    and the full grid is 2 arms x 3 seeds x (5 ratios x 3 tiers + full) = 96 cells, so 80 examples per cell is
    ~7 min on one thread (100 would be ~9).
    """
    import torch

    from benchmarks.refmodels import tables
    from kvzoo.models import load_model
    from kvzoo.refmodel import data as D

    torch.set_num_threads(1)
    seeds = {arm: args.seeds if args.seeds is not None else tables.shipped_seeds(arm) for arm in RECOVERY_ARMS}
    if not all(seeds.values()):
        print(f"no shipped checkpoint for some arm in {tables.CHECKPOINT_DIR}: train them first")
        return 1
    T, n_pairs = D.CURRICULUM[-1]
    examples = D.heldout_recall(T, n_pairs, args.count, seed=tables.TABLE_SEED)
    context_len = len(examples[0].context)
    commit, date = git_commit(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with out_path.open("w") as fh:
        for arm in RECOVERY_ARMS:
            for seed in seeds[arm]:
                name = f"ref-{arm}-s{seed}"
                model = load_model(name)[0]
                cells = [(FULL, None)] + [(tier, ratio) for ratio in args.ratios for tier in RECOVERY_TIERS]
                for tier, ratio in cells:
                    row = {"model": name, "arm": arm, "seed": seed, "ratio": ratio,
                           "budget": context_len if ratio is None else context_len // ratio, "tier": tier}
                    row.update(recovery_cell(model, examples, tier, ratio))
                    row.update({"T": T, "pairs": n_pairs, "commit": commit, "date": date})
                    rows.append(row)
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                print(f"{name}: done ({time.perf_counter() - t0:.0f}s)", flush=True)
    elapsed = time.perf_counter() - t0
    print(f"\n## VestigeKV recovery on the reference twins: T = {T}, {n_pairs} pairs, {args.count} held-out examples "
          f"per cell, seeds {seeds}, mean over seeds\n")
    print(recovery_summary(rows))
    print(f"\n{len(rows)} rows written to {out_path} ({elapsed:.0f}s, one CPU thread)")
    return 0


def _vestige_recovery_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="training seeds (default: all shipped)")
    p.add_argument("--ratios", type=int, nargs="+", default=list(RECOVERY_RATIOS))
    p.add_argument("--count", type=int, default=80, help="held-out examples per cell")
    p.add_argument("--out", default=str(RECOVERY_OUT), help="JSONL, one line per (model, ratio, tier)")


# --------------------------------------------------------------------------------------------------- vestige-runtime

def _runtime_run(model, policy, ids, steps=20):
    import torch

    from kvzoo import TieredCache

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


def vestige_runtime(args: argparse.Namespace) -> int:
    """VestigeKV / Quest figures on the tiny MLA models (issue 5's benchmark), CPU, torch path.

        .venv/bin/python benchmarks/probe.py vestige-runtime [--tokens 8192]

    Per model (tiny DeepSeek-V2, tiny Kimi Linear; random weights: mechanics and costs, not quality):
    * selector time: vestige reading the 64-dim branch vs the same selector on the whole 576-dim row
      (branch="row"), eviction only, one block of all the context at the same budget (the
      context_end event); with the sketch retriever that event also fits the basis and builds the index;
    * per decode step (20 steps after the prefill, question-free): rows fetched, KV-path bytes read
      (attended rows + index entries + fetched rows) vs full, and step time vs full, at 8x and 32x.
    """
    import torch

    from kvzoo import registry
    from kvzoo.models import load_model

    n = args.tokens
    print(f"context {n} tokens prefilled in chunks of 1024, one block closed at the end of the context, 20 decode "
          "steps; figures per step, summed over the MLA layers\n")
    print("| model | policy | selector s | rows fetched/step | KV bytes/step | vs full | step ms | vs full |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("tiny-deepseek-v2", "tiny-kimi-linear"):
        model, _ = load_model(name)
        ids = torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(0))
        _, full_ms, full_step, _ = _runtime_run(model, registry.get("full"), ids)
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
            sel_s, ms, step, _ = _runtime_run(model, policy, ids)
            print(f"| {name} | {label} | {sel_s:.3f} | {step['rows_fetched']:.0f} | {step['kv_bytes_read'] / 1e6:.2f} MB | "
                  f"{step['kv_bytes_read'] / full_step['kv_bytes_read']:.2f} | {ms:.1f} | {ms / full_ms:.2f} |", flush=True)
    return 0


def _vestige_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8192)


# -------------------------------------------------------------------------------------------------------- quest-page

PAGE = 16


def quest_reference_rows(query, keys, budget: int) -> tuple[list[set[int]], list[float]]:
    """Rows each query head reads by the reference's eval rule: ``query [H, D]``, ``keys [G, L, D]`` (own key last);
    and per head the relative gap between the last bound it takes and the first it leaves (inf: it takes all)."""
    import torch

    H, G, L = query.shape[0], keys.shape[0], keys.shape[1]
    pages = -(-L // PAGE)
    n = min(max(3, budget // PAGE), pages)
    out, gaps = [], []
    for h in range(H):
        k = keys[h // (H // G)].double()
        q = query[h].double()
        bound = torch.stack([torch.maximum(q * k[p * PAGE:(p + 1) * PAGE].amin(0),
                                           q * k[p * PAGE:(p + 1) * PAGE].amax(0)).sum() for p in range(pages)])
        out.append({r for p in bound.topk(n).indices.tolist() for r in range(p * PAGE, min(L, (p + 1) * PAGE))})
        ranked = bound.sort(descending=True).values
        gaps.append(float((ranked[n - 1] - ranked[n]) / ranked[n - 1].abs()) if n < pages else float("inf"))
    return out, gaps


def quest_page_observe(ratio: int, context: int, steps: int, seed: int) -> dict:
    """One ratio's figures (``quest-page``'s paragraph); ``tests/test_quest.py`` holds them at toy size."""
    import torch

    from kvzoo import pipeline, registry
    from kvzoo.framework.retrieval import Retrieval
    from kvzoo.models import tiny_llama

    model, _ = tiny_llama(seed=0)
    ids = torch.randint(1, 256, (context,), generator=torch.Generator().manual_seed(seed))
    records = []
    original = Retrieval.fetch_step

    def fetch_step(self, layer, query, best, scaling):
        L = layer.counts.seen
        keys = layer.store.rows.buffers["keys"][0, :, :L].clone()  # [G, L, D]: slot order, the own row last
        index, captured = layer.store.archive.index, {}
        choose = index.choose

        def watched(q, b, s, view):
            captured["view"] = view
            captured["choice"] = choice = choose(q, b, s, view)
            return choice

        index.choose = watched
        try:
            rows = original(self, layer, query, best, scaling)
        finally:
            del index.choose
        choice = captured["choice"]
        H, G = query.shape[1], keys.shape[0]
        hpg = H // G
        seg_rows = choice.rows.view(G, hpg, -1)
        seg_ok = choice.ok.view(G, hpg, -1)
        got = [set(seg_rows[h // hpg, h % hpg][seg_ok[h // hpg, h % hpg]].tolist()) for h in range(H)]
        records.append((query[0, :, 0].clone(), keys, captured["view"].budget, got))
        return rows

    Retrieval.fetch_step = fetch_step
    try:
        policy = registry.get("quest", ratio=ratio, dense_layers=0)
        pipeline.generate(model, None, ids[:-8], ids[-8:], policy, max_new_tokens=steps)
    finally:
        Retrieval.fetch_step = original
    differ = differ_opening = head_steps = kvzoo_current = ref_current = 0
    differ_gaps = []
    for query, keys, budget, got in records:
        L = keys.shape[1]
        ref, gaps = quest_reference_rows(query, keys, budget)
        start = (L - 1) // PAGE * PAGE  # the current page's first row
        for h in range(query.shape[0]):
            head_steps += 1
            mine, theirs = got[h] - {L - 1}, ref[h] - {L - 1}
            differ += mine != theirs
            differ_opening += mine != theirs and start == L - 1
            if mine != theirs:
                differ_gaps.append(gaps[h])
            if start < L - 1:  # a step that does not open a page: the current page has rows before the own one
                kvzoo_current += start in mine
                ref_current += start in theirs
    return {"ratio": ratio, "head_steps": head_steps, "differ": differ, "differ_fraction": differ / head_steps,
            "differ_at_page_opening_steps": differ_opening,
            "max_reference_gap_where_differ": max(differ_gaps, default=None),
            "kvzoo_reads_current_page": kvzoo_current, "reference_reads_current_page": ref_current}


def quest_page(args: argparse.Namespace) -> int:
    """How often ``quest(rule="eval")``'s pages differ from the reference evaluation rule's, per head-step (issue 36).

        .venv/bin/python benchmarks/probe.py quest-page [--ratios 4 8] [--context 400] [--steps 64] [--seed 0]

    A tiny random Llama (``kvzoo.models.tiny_llama``: 3 layers, 4 query heads over 2 KV heads), ``dense_layers=0`` so
    every layer's decode steps choose pages; greedy decoding after a random context. Every decode step's choice is
    observed (``Retrieval.fetch_step`` wrapped, nothing changed): the query, the layer's whole key sequence (the step's
    own key last: with ``rule="eval"`` every row is archived where it was appended, so storage order is slot order) and
    the archived rows each query head reads. Beside it, the reference's rule restated on the same inputs
    (mit-han-lab/Quest ``evaluation/quest_attention.py``: the new key joins the key states before any page is scored;
    pages of 16 from the first token, bound ``sum_i max(q_i min_i, q_i max_i)``, the top
    ``min(max(3, B // 16), pages)`` pages over all of them, the current page included), in fp64.

    Reported per ratio (one JSON line): head-steps; the fraction where the archived rows a head reads differ from the
    reference's (the step's own row left out on both sides: kvzoo always attends it), how many of those at steps that open
    a page, and the widest relative gap, among them, between the last bound the reference takes and the first it leaves
    (a near-tie: kvzoo's fp32 bounds and their slack may order such pages otherwise); and, at steps that do not open a
    page, the head-steps where each reads the current page (its rows before the step's own).
    """
    for ratio in args.ratios:
        print(json.dumps(quest_page_observe(ratio, args.context, args.steps, args.seed)))
    return 0


def _quest_page_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ratios", type=int, nargs="+", default=[4, 8])
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


# ----------------------------------------------------------------------------------------------------- chunkkv-reuse

def chunkkv_reuse(args: argparse.Namespace) -> int:
    """ChunkKV's compression step with and without layer-wise index reuse, on SmolLM2-135M (real weights).

        .venv/bin/python benchmarks/probe.py chunkkv-reuse [--context-tokens 2000] [--ratio 4] [--reps 12] [--json f]

    One dense prefill of RULER's single needle (essay haystack, depth 0.5) into a ``full`` cache that keeps the
    last 32 queries (``record_window``); each trial forks it as ChunkKV (``TieredCache.fork_as``) and times
    ``cache.compress()`` -- the context-end event, i.e. the window attention, scoring and chunk selection of every
    layer and the move of the evicted rows -- and nothing else. Arms, interleaved (each repetition runs every arm
    once, in an order rotated from one repetition to the next, so drifting machine load falls on all arms alike):

    * ``reuse=1`` -- every layer scores (no reuse);
    * ``reuse=2`` -- the paper's ``N_reuse = 2``: layers 1, 3, ... reuse their predecessor's indices;
    * ``reuse=2, window attention computed`` -- what kvzoo shipped before issue 23: the reusing layers also
      computed their window attention (to check that the window fits), then did not use it. Reproduced by asking
      for the attention in ``select`` before the real selector runs.

    Torch runs one thread (``torch.set_num_threads(1)``). Prints median and mean ± standard deviation per arm,
    the change against ``reuse=1``, whether every arm kept the same rows on every layer as ``reuse=2`` (the two
    ``reuse=2`` arms must), and the machine's load average before and after (timing depends on it).
    """
    import torch

    from kvzoo import TieredCache, pipeline
    from kvzoo.bench.runner import encode_prompt
    from kvzoo.bench.tasks import TaskSpec, make_task
    from kvzoo.models import load_smollm2
    from kvzoo.policies.chunkkv import ChunkKV

    class ChunkKVAsShipped(ChunkKV):
        """ChunkKV as it was before issue 23: every layer's window attention computed, reusing layers included."""

        def select(self, rows, keep):
            rows.observed_window()
            return super().select(rows, keep)

    arms = {
        "reuse=1": lambda ratio: ChunkKV(ratio=ratio, reuse=1),
        "reuse=2": lambda ratio: ChunkKV(ratio=ratio, reuse=2),
        "reuse=2, window attention computed (before issue 23)": lambda ratio: ChunkKVAsShipped(ratio=ratio, reuse=2),
    }
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    model, tokenizer = load_smollm2()
    task = make_task(TaskSpec("niah_single", args.context_tokens, 0.5, 0, "essay"), tokenizer, continuation_tokens=0)
    prefix = encode_prompt(tokenizer, task).prefix
    base = TieredCache(model, "full", context_length=prefix.shape[1], record_window=32)
    started = time.perf_counter()
    pipeline.prefill(model, base, prefix)
    prefill_s = time.perf_counter() - started

    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    kept: dict[str, list] = {}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            cache = base.fork_as(arms[name](args.ratio))
            started = time.perf_counter()
            cache.compress()
            times[name].append(time.perf_counter() - started)
            slots = [layer.slots.clone() for layer in cache.layers]
            if name not in kept:
                kept[name] = slots
            elif not all(torch.equal(a, b) for a, b in zip(kept[name], slots, strict=True)):
                raise RuntimeError(f"{name}: two trials kept different rows")
            cache.close()
    load_after = os.getloadavg()

    same = {name: all(torch.equal(a, b) for a, b in zip(kept[name], kept["reuse=2"], strict=True)) for name in names}
    base_ms = 1e3 * statistics.median(times["reuse=1"])
    results = []
    print(f"SmolLM2-135M fp32, {prefix.shape[1]} context tokens, ratio {args.ratio:g}, {args.reps} interleaved "
          f"repetitions, 1 torch thread; one prefill ({prefill_s:.1f} s) forked per trial")
    print(f"load average (1/5/15 min) before: {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}; "
          f"after: {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} on {os.cpu_count()} cores")
    print("| arm | compression step, median ms | mean ± sd ms | vs reuse=1 (median) | same kept rows as reuse=2 |")
    print("|---|---:|---:|---:|---|")
    for name in names:
        ms = [1e3 * t for t in times[name]]
        median = statistics.median(ms)
        change = 100 * (median - base_ms) / base_ms
        print(f"| {name} | {median:.1f} | {statistics.mean(ms):.1f} ± {statistics.stdev(ms):.1f} | "
              f"{change:+.1f} % | {'yes' if same[name] else 'no'} |")
        results.append({"arm": name, "median_ms": median, "ms": ms, "change_vs_reuse1_pct": change,
                        "same_rows_as_reuse2": same[name]})
    if not same["reuse=2, window attention computed (before issue 23)"]:
        raise RuntimeError("the two reuse=2 arms kept different rows")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "context_tokens": int(prefix.shape[1]), "ratio": args.ratio, "reps": args.reps, "prefill_s": prefill_s,
            "load_before": load_before, "load_after": load_after, "arms": results}, indent=2))
    return 0


def _chunkkv_reuse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--ratio", type=float, default=4.0)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--json", help="also write the figures here")


# -------------------------------------------------------------------------------------------------------- vestige-prune


def _smollm2_essay(context: int, seed: int):
    """SmolLM2-135M (torch seeded 0) and ``context`` tokens of essay text from ``seed``, ``[1, context]``."""
    import torch

    from kvzoo.haystacks import haystack_sentences
    from kvzoo.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    sentences = haystack_sentences("essay", seed)
    ids: list[int] = []
    while len(ids) < context:
        ids += tokenizer(next(sentences) + " ", add_special_tokens=False)["input_ids"]
    return model, torch.tensor([ids[:context]])


def vestige_prune(args: argparse.Namespace) -> int:
    """Issue 47: VestigeKV's int8 index pruned by its page summary (``prune=True``) on SmolLM2's real rows, audited.

        .venv/bin/python benchmarks/probe.py vestige-prune [--context 8192] [--ratios 8 32 128] [--json FILE]

    One dense prefill of ``--context`` tokens of essay text (the last 64 run under each arm's policy, as
    benchmarks/decode_step.py does), then per ratio two arms from the same rows: VestigeKV with the int8 index as it
    is, and with ``prune=True`` under the audit (every archived row scored exactly each step). ``--steps`` greedy
    decode steps each. Per ratio: the index MiB a step read (the last step, all layers) without and with pruning,
    the rows fetched, and the audit's figures over the steps: ``pruning_violations`` (a skipped row scoring above
    s* - j_margin, for some head: must be 0) of ``pruning_audited`` (row, head) pairs, ``page_bound_violations`` (a
    page bound below its page's best exact score: must be 0), the pages holding a row, those skipped, and those a
    perfect page bound could skip (``pages_prunable``: every row <= s* - j_margin for every head).
    """
    import dataclasses

    import torch

    from kvzoo import TieredCache, registry
    from kvzoo.bench.results import versions
    from kvzoo.retrievers.vestige import VestigeRetriever

    model, prompt = _smollm2_essay(args.context, args.seed)
    tail = 64
    head = args.context - tail
    commit = git_commit()  # the code this process runs (HEAD may move while it does)
    figures = ("pruning_violations", "pruning_audited", "page_bound_violations", "page_bounds_audited", "pages",
               "pages_skipped", "pages_prunable", "rows_skipped", "rows_above_floor", "rows_audited")
    rows = []
    with torch.no_grad():
        t0 = time.perf_counter()
        shared = TieredCache(model, "full", context_length=args.context, record_window=tail)
        for start in range(0, head, 1024):
            model(input_ids=prompt[:, start : min(head, start + 1024)], cache=shared, use_cache=True,
                  logits_to_keep=1)
        print(f"# shared prefill of {head} tokens: {time.perf_counter() - t0:.0f} s", flush=True)
        for ratio in args.ratios:
            out: dict[str, Any] = {"probe": "vestige-prune", "model": "smollm2-135m", "context": args.context,
                                   "ratio": ratio, "page_rows": args.page_rows, "steps": args.steps,
                                   "seed": args.seed, "commit": commit, "versions": versions()}
            for prune in (False, True):
                retriever = VestigeRetriever(index="int8", prune=prune, **({"page_rows": args.page_rows} if prune else {}))
                shared.runtime.audit = prune  # the arm's retrieval audits (transplant takes the source's setting)
                cache = shared.transplant(registry.get("vestige", ratio=ratio, retriever=retriever),
                                          context_length=args.context)
                token = model(input_ids=prompt[:, head:], cache=cache, use_cache=True,
                              logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
                cache.compress()
                before = cache.stats().totals
                for _ in range(args.steps):
                    token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                stats = cache.stats()
                totals = stats.totals
                arm = "pruned" if prune else "int8"
                out[f"{arm}_index_mib_per_step"] = sum(layer.last_step.get("index_bytes_scanned", 0)
                                                       for layer in stats.layers) / 2**20
                out[f"{arm}_fetched_rows_per_step"] = (totals["fetched_rows"] - before["fetched_rows"]) / args.steps
                if prune:
                    out.update({k: totals.get(k, 0) - before.get(k, 0) for k in figures})
                    out["retriever"] = dataclasses.asdict(retriever)
                cache.close()
                del cache
            out["pages_skipped_fraction"] = out["pages_skipped"] / max(1, out["pages"])
            out["pages_prunable_fraction"] = out["pages_prunable"] / max(1, out["pages"])
            out["index_bytes_ratio"] = out["pruned_index_mib_per_step"] / out["int8_index_mib_per_step"]
            if out.get("rows_audited"):
                out["rows_above_floor_fraction"] = out["rows_above_floor"] / out["rows_audited"]
            rows.append(out)
            print(json.dumps(out), flush=True)
        shared.close()
    print("\n| context | ratio | pages skipped | a perfect page bound could skip | violations / audited (row, head) "
          "| page bound violations | index MiB/step: int8 | pruned | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['ratio']:g}x | {r['pages_skipped_fraction']:.3f} | "
              f"{r['pages_prunable_fraction']:.3f} | {r['pruning_violations']} / {r['pruning_audited']} | "
              f"{r['page_bound_violations']} / {r['page_bounds_audited']} | {r['int8_index_mib_per_step']:.1f} | "
              f"{r['pruned_index_mib_per_step']:.1f} | {r['index_bytes_ratio']:.2f} |")
    if args.json:
        _append_rows(args.json, rows)
    return 0


# -------------------------------------------------------------------------------------------------------- prune-bounds


def _pca_tree_order(keys, page_rows: int):
    """A permutation of ``keys [N, D]`` putting similar keys in the same page: split at the median of the principal
    direction, recursively, down to ``page_rows`` (the best case a reordered archive could give a page summary)."""
    import torch

    groups = [torch.arange(keys.shape[0])]
    while groups[0].numel() > page_rows:
        split = []
        for g in groups:
            x = keys[g] - keys[g].mean(0)
            order = (x @ torch.linalg.svd(x, full_matrices=False).Vh[0]).argsort()
            half = g.numel() // 2
            split += [g[order[:half]], g[order[half:]]]
        groups = split
    return torch.cat(groups)


def prune_bounds(args: argparse.Namespace) -> int:
    """Issue 47: which certified bound could prune VestigeKV's int8 scan on SmolLM2, and how far.

        .venv/bin/python benchmarks/probe.py prune-bounds [--context 8192] [--steps 2] [--json FILE]

    One dense prefill of ``--context`` tokens of essay text in transformers (``DynamicCache``), then ``--steps`` greedy
    decode steps, each layer's query heads captured after RoPE. Every prompt row stands for an archived row (at 32x
    all but 1/32 are). Per (layer, KV group, step), for each bound family, the share of what it leaves live (pages or
    rows a scan must still read) against two thresholds: ``top-j`` (each head's exact ``j``-th best score: a pruned
    scan that must fetch what the unpruned top-j rule fetches cannot skip a row above it), and ``floor`` (``s* - 8``,
    ``s*`` the best row: the rule's floor, which the shipped pruning uses). A page or row is live when its bound
    reaches the threshold for some query head of its group. The families (each >= every row's exact score): Quest's
    page box (per-dim min/max over ``--page-rows`` rows) in archive order and in the best reordering found (a PCA
    tree); a page ball (centre and radius); per row, the centred rank-``r`` projection plus ``||q_perp|| ||k_perp||``;
    per row, the centred norm. ``implied index bytes``: the family's own bytes plus the int8 entries (``D + 6`` a row)
    of the live rows, over the int8 index's bytes -- the goal is 0.4. ``perfect page``: pages none of whose rows
    reaches the threshold (what an exact page bound would leave live).
    """
    import math

    import torch
    from transformers import DynamicCache

    from kvzoo.bench.results import versions

    model, prompt = _smollm2_essay(args.context, args.seed)
    captured: dict[int, list] = {}

    def capture(module, positional, kwargs):  # the decode step's query rows after RoPE
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        hidden = kwargs.get("hidden_states", positional[0] if positional else None)
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(*hidden.shape[:2], -1, module.head_dim).transpose(1, 2)
        captured.setdefault(module.layer_idx, []).append(apply_rotary_pos_emb(q, q, cos, sin)[0][0, :, -1].float())

    cache = DynamicCache()
    with torch.no_grad():
        for start in range(0, args.context, 1024):
            out = model(input_ids=prompt[:, start : start + 1024], past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        hooks = [layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in model.model.layers]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(args.steps):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for h in hooks:
            h.remove()
    P, j = args.page_rows, args.j
    live: dict[tuple[str, str], list[float]] = {}
    own_bytes: dict[str, float] = {}
    D = 0
    for layer, queries in captured.items():
        keys_all = cache.layers[layer].keys[0, :, : args.context].float()  # [G, N, D]
        G, N, D = keys_all.shape
        hq = queries[0].shape[0] // G
        sc = 1 / math.sqrt(D)
        n = N // P * P
        for g in range(G):
            keys = keys_all[g]
            mu = keys.mean(0)
            basis = torch.linalg.svd(keys - mu, full_matrices=False).Vh
            tree = keys[_pca_tree_order(keys[:n], P)]
            for q_all in queries:
                q = q_all[g * hq : (g + 1) * hq]  # [hq, D]
                scores = (q @ keys.T) * sc  # [hq, N]
                bounds = {}
                for name, k in (("page box, archive order", keys[:n]), ("page box, PCA-tree order", tree)):
                    pages = k.view(-1, P, D)
                    lo, hi = pages.amin(1), pages.amax(1)
                    bounds[name] = (q.clamp(min=0) @ hi.T + q.clamp(max=0) @ lo.T) * sc
                pages = keys[:n].view(-1, P, D)
                centre = pages.mean(1)
                radius = (pages - centre[:, None]).norm(dim=-1).amax(1)
                bounds["page ball, archive order"] = (q @ centre.T + q.norm(dim=-1, keepdim=True) * radius) * sc
                bounds["perfect page, archive order"] = scores[:, :n].view(hq, -1, P).amax(-1)
                for r in (8, 16, 24):
                    u = basis[:r]
                    coords = (keys - mu) @ u.T
                    rest = (keys - mu - coords @ u).norm(dim=-1)
                    qu = q @ u.T
                    q_rest = (q - qu @ u).norm(dim=-1, keepdim=True)
                    bounds[f"row rank-{r} projection + residual"] = ((q @ mu)[:, None] + qu @ coords.T
                                                                      + q_rest * rest) * sc
                bounds["row centred norm"] = ((q @ mu)[:, None]
                                              + q.norm(dim=-1, keepdim=True) * (keys - mu).norm(dim=-1)) * sc
                for threshold_name, threshold in (("top-j", scores.topk(j, dim=-1).values[:, -1]),
                                                  ("floor", scores.amax(-1) - 8)):
                    for name, bound in bounds.items():  # live: the bound reaches some head's threshold
                        share = (bound >= threshold[:, None]).any(0).float().mean().item()
                        live.setdefault((name, threshold_name), []).append(share)
    entry = D + 6  # an int8 entry: codes and three fp16 side columns
    for r in (8, 16, 24):
        own_bytes[f"row rank-{r} projection + residual"] = r + 4  # int8 coordinates, fp16 scale and residual norm
    own_bytes.update({"page box, archive order": (2 * D + 5) / P, "page box, PCA-tree order": (2 * D + 5 + 4 * P) / P,
                      "page ball, archive order": (D + 6) / P, "perfect page, archive order": 0.0,
                      "row centred norm": 2})
    rows = []
    for (name, threshold_name), shares in live.items():
        share = statistics.fmean(shares)
        rows.append({"probe": "prune-bounds", "model": "smollm2-135m", "context": args.context, "steps": args.steps,
                     "j": j, "page_rows": P, "bound": name, "threshold": threshold_name, "cases": len(shares),
                     "live_share": share, "max_live_share": max(shares), "own_bytes_per_row": own_bytes[name],
                     "implied_index_bytes": (own_bytes[name] + share * entry) / entry, "commit": git_commit(),
                     "versions": versions()})
    print("| bound | threshold | live (mean) | live (max) | implied index bytes vs int8 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bound']} | {r['threshold']} | {r['live_share']:.3f} | {r['max_live_share']:.3f} | "
              f"{r['implied_index_bytes']:.2f} |")
    if args.json:
        _append_rows(args.json, rows)
    return 0


def _prune_bounds_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2, help="decode steps whose queries are scored")
    p.add_argument("--page-rows", type=int, default=16)
    p.add_argument("-j", type=int, default=16, help="the top-j rule's j")
    p.add_argument("--seed", type=int, default=0, help="the essay text's seed")
    p.add_argument("--json", help="append one JSON line per (bound, threshold) here")


class _PrunedPlugin:
    """A plugin registering ``vestige_pruned``: VestigeKV's retriever with the int8 index pruned (``prune=True``)."""

    @staticmethod
    def kvzoo_retrievers():
        from dataclasses import dataclass
        from typing import ClassVar

        from kvzoo.retrievers.vestige import VestigeRetriever

        @dataclass
        class PrunedVestigeRetriever(VestigeRetriever):
            index: str = "int8"
            prune: bool = True
            name: ClassVar[str] = "vestige_pruned"

        return [PrunedVestigeRetriever]


def vestige_prune_needle(args: argparse.Namespace) -> int:
    """Issue 47: the 2k needle grid of docs/results/needle_2k.jsonl with VestigeKV's int8 index pruned.

        .venv/bin/python benchmarks/probe.py vestige-prune-needle --out FILE

    ``kvzoo leaderboard --model smollm2-135m --policies full 'vestige(retriever=vestige_pruned)' --ratios 8 16 32
    --context-tokens 2000 --depths 0.1 0.3 0.5 0.7 0.9 --continuation-tokens 32``, where ``vestige_pruned`` (registered
    here as a plugin) is ``VestigeRetriever(index="int8", prune=True)``: the same answers as the unpruned grid?
    """
    from kvzoo import cli, registry
    from kvzoo.hookspecs import hookimpl

    plugin = _PrunedPlugin()
    hookimpl(plugin.kvzoo_retrievers)  # marks the function
    registry.register_plugin(plugin, name="vestige_pruned")
    return cli.main(["leaderboard", "--model", "smollm2-135m", "--policies", "full", "vestige(retriever=vestige_pruned)",
                     "--ratios", "8", "16", "32", "--context-tokens", "2000", "--depths", "0.1", "0.3", "0.5", "0.7",
                     "0.9", "--continuation-tokens", "32", "--out", args.out, "--no-plots"])


def _vestige_prune_needle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the leaderboard's results JSONL")


def _vestige_prune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--ratios", type=float, nargs="+", default=[8, 32, 128])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--page-rows", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the essay text's seed")
    p.add_argument("--json", help="append one JSON line per ratio here")


PROBES = {  # name -> (one line, its options, what it runs)
    "vestige-answer": ("why VestigeKV misses a task full answers: lost at eviction, or not fetched back?",
                       _vestige_answer_args, vestige_answer),
    "vestige-dce": ("why VestigeKV's ΔCE at 64x/128x on a 4k needle is above 0.2 nats/token",
                    _vestige_dce_args, vestige_dce),
    "vestige-recovery": ("VestigeKV's recovery table on the reference twins: the tier against eviction alone",
                         _vestige_recovery_args, vestige_recovery),
    "vestige-runtime": ("VestigeKV / Quest costs on the tiny MLA models: selector time, rows fetched, bytes, step",
                        _vestige_runtime_args, vestige_runtime),
    "quest-page": ("how often quest(rule=eval)'s pages differ from the reference evaluation rule's",
                   _quest_page_args, quest_page),
    "chunkkv-reuse": ("ChunkKV's compression step with and without layer-wise index reuse",
                      _chunkkv_reuse_args, chunkkv_reuse),
    "vestige-prune": ("VestigeKV's int8 index pruned by page summaries on SmolLM2: pages skipped, bytes, audit",
                      _vestige_prune_args, vestige_prune),
    "vestige-prune-needle": ("the 2k needle grid with VestigeKV's int8 index pruned: the same answers?",
                             _vestige_prune_needle_args, vestige_prune_needle),
    "prune-bounds": ("which certified bound could prune VestigeKV's int8 scan on SmolLM2, and how far",
                     _prune_bounds_args, prune_bounds),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True, metavar="{" + ",".join(PROBES) + "}")
    for name, (line, add_arguments, run) in PROBES.items():
        p = sub.add_parser(name, help=line, description=inspect.cleandoc(run.__doc__ or line),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
