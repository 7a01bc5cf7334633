"""VestigeKV's recovery table on kvzoo's reference twins: what the retrieval tier recovers over eviction alone.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/vestige_recovery.py            # all shipped seeds, 80 examples
    PYTHONPATH=. python benchmarks/vestige_recovery.py --seeds 0 --ratios 8 128 --count 10 --out /tmp/r.jsonl

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

Columns (one JSON line per row in ``--out``): ``budget`` = rows the policy keeps per layer out of the 510 context
rows (``510 // ratio``; the 2 question rows come on top); ``archived_rows`` = archived rows per layer after the
question forward (mean over layers and examples; 0 for eviction alone, whose evicted rows are dropped --
``dropped_rows`` counts them); ``fetched_rows_per_step`` = archived rows admitted per retrieval step, i.e. per
question forward per layer (``totals["fetched_rows"] / totals["retrieval_steps"]`` over the cell's examples; 0 when
nothing is archived); ``fetched_share`` = fetched per step / archived rows (null without an archive). The markdown
summary printed at the end is the mean over seeds per arm x tier x ratio.

Default ``--count`` 80: one example takes ~0.05 s on one CPU thread whatever the tier (the certified one included),
and the full grid is 2 arms x 3 seeds x (5 ratios x 3 tiers + full) = 96 cells, so 80 examples per cell is
~7 min on one thread (100 would be ~9).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.refmodels import tables  # noqa: E402
from kvzoo import pipeline, registry  # noqa: E402
from kvzoo.framework.retrieval import build_retriever  # noqa: E402
from kvzoo.models import load_model  # noqa: E402
from kvzoo.refmodel import data as D  # noqa: E402

ARMS = ("nope", "rope")
RATIOS = (8, 16, 32, 64, 128)
TIERS = ("eviction alone", "tier (top-j, as shipped)", "tier (certified, tau 8)")
FULL = "full"
DEFAULT_COUNT = 80
DEFAULT_OUT = ROOT / "docs" / "results" / "vestige_recovery_twins.jsonl"


def make_policy(tier: str, ratio: int | None) -> Any:
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


def measure_cell(model: Any, examples: list[D.Example], tier: str, ratio: int | None) -> dict[str, Any]:
    """Accuracy and retrieval figures of one (model, tier, ratio) cell over ``examples``."""
    audit = tier == "tier (certified, tau 8)"
    hits = 0
    tot = {"fetched_rows": 0, "retrieval_steps": 0, "bound_violations": 0, "audited_scores": 0}
    archived: list[float] = []
    dropped: list[float] = []
    resident: list[float] = []
    for e in examples:
        policy = make_policy(tier, ratio)
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
    row = {
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
    return row


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary(rows: list[dict[str, Any]]) -> str:
    """Markdown: mean over seeds per arm x tier x ratio."""
    lines = ["| arm | tier | ratio | budget | seeds | accuracy | rows fetched / step | archived rows | fetched share |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys: list[tuple[str, str, int | None]] = []
    for r in rows:
        key = (r["arm"], r["tier"], r["ratio"])
        if key not in keys:
            keys.append(key)
    order = {t: i for i, t in enumerate((FULL, *TIERS))}
    keys.sort(key=lambda k: (ARMS.index(k[0]), order[k[1]], k[2] or 0))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="training seeds (default: all shipped)")
    p.add_argument("--ratios", type=int, nargs="+", default=list(RATIOS))
    p.add_argument("--count", type=int, default=DEFAULT_COUNT, help="held-out examples per cell")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSONL, one line per (model, ratio, tier)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = {arm: args.seeds if args.seeds is not None else tables.shipped_seeds(arm) for arm in ARMS}
    if not all(seeds.values()):
        print(f"no shipped checkpoint for some arm in {tables.CHECKPOINT_DIR}: train them first")
        return 1
    T, n_pairs = D.CURRICULUM[-1]
    examples = D.heldout_recall(T, n_pairs, args.count, seed=tables.TABLE_SEED)
    context_len = len(examples[0].context)
    commit, date = git_commit(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with out_path.open("w") as fh:
        for arm in ARMS:
            for seed in seeds[arm]:
                name = f"ref-{arm}-s{seed}"
                model = load_model(name)[0]
                cells = [(FULL, None)] + [(tier, ratio) for ratio in args.ratios for tier in TIERS]
                for tier, ratio in cells:
                    row = {"model": name, "arm": arm, "seed": seed, "ratio": ratio,
                           "budget": context_len if ratio is None else context_len // ratio, "tier": tier}
                    row.update(measure_cell(model, examples, tier, ratio))
                    row.update({"T": T, "pairs": n_pairs, "commit": commit, "date": date})
                    rows.append(row)
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                print(f"{name}: done ({time.perf_counter() - t0:.0f}s)", flush=True)
    elapsed = time.perf_counter() - t0
    print(f"\n## VestigeKV recovery on the reference twins: T = {T}, {n_pairs} pairs, {args.count} held-out examples "
          f"per cell, seeds {seeds}, mean over seeds\n")
    print(summary(rows))
    print(f"\n{len(rows)} rows written to {out_path} ({elapsed:.0f}s, one CPU thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
