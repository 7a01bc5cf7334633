"""ΔCE and the needle-intact rate on kvzoo's reference twins (NoPE arm vs RoPE arm), teacher-forced one decode step
per token, on the twins' own data distribution.

    python benchmarks/refmodels/delta_ce.py                         # all shipped seeds, 16 sequences each
    python benchmarks/refmodels/delta_ce.py --count 4 --seeds 0     # quick look

Data (``kvzoo.refmodel.data.heldout_recall_continuation``): the recall task's held-out stream in the training
layout -- a 464-token context of noise with 16 key-value pairs, then 16 questions with their answers
``[QUERY k v] * 16`` (48 tokens, 512 in all, the length the twins were trained at). The context is prefilled and
compressed (``ratio`` of its 464 rows), then the 48 tokens are teacher-forced (``kvzoo.pipeline.delta_ce``):

* ``ΔCE`` -- decode mode (the VestigeKV paper's measure): each token its own decode step, so a retriever's
  per-step rule is what the CE sees; the CE is the mean NLL over the 16 answer tokens (what the twins were
  trained to predict; the markers and the keys asked are chance by design); the policy's minus ``full``'s,
  averaged over the sequences;
* ``intact`` -- the share of answer tokens whose NLL (decode mode) exceeds ``full``'s by less than 1 nat (the
  needle-intact test, one needle per question);
* ``ΔCE (one forward)`` -- the 48 tokens in one multi-token forward: a retriever reads the whole archive there
  under its default ``multi_token="dense"`` rule, so its figure is ≈ 0 by construction.

Settings forced by the 464-token context and the 2-layer model, as in ``tables.py``: snapkv/chunkkv
``window = min(32, budget)`` (the budget is 58 rows at 8x, 14 at 32x); quest ``dense_layers = 0``. Mean over the
seeds' means, ± half the range over seeds. Torch runs one thread per worker process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvzoo import pipeline, registry  # noqa: E402
from kvzoo.models import load_model  # noqa: E402
from kvzoo.refmodel import CHECKPOINT_DIR  # noqa: E402
from kvzoo.refmodel import data as D  # noqa: E402

RATIOS = (8, 32)
POLICIES = ("streaming_llm", "snapkv", "h2o", "chunkkv", "quest", "quest(rule=kernel)", "quest(gqa=group)",
            "vestige", "vestige(retriever=None)")
DATA_SEED = 2027  # a held-out stream no training run and no other table draws
INTACT_NATS = 1.0


def make_policy(name: str, ratio: int, context_len: int) -> Any:
    base, params = registry.parse_spec(name)
    budget = context_len // ratio
    if base in ("snapkv", "chunkkv"):
        params["window"] = min(32, budget)
    if base == "quest":
        params["dense_layers"] = 0
    return registry.get(base, ratio=ratio, **params)


def shipped_seeds(arm: str) -> list[int]:
    return sorted(int(p.name.rsplit("-s", 1)[1]) for p in CHECKPOINT_DIR.glob(f"ref-{arm}-s*") if (p / "config.json").is_file())


def one_model(arm: str, seed: int, count: int) -> dict[str, Any]:
    """Every (policy, ratio) cell for one trained twin (one worker process's job)."""
    torch.set_num_threads(1)
    model = load_model(f"ref-{arm}-s{seed}")[0]
    examples = D.heldout_recall_continuation(count=count, seed=DATA_SEED)
    cells: dict[str, dict[str, float]] = {}
    full_ce = []
    started = time.perf_counter()
    refs = {mode: [pipeline.continuation_nll(model, e.context, e.continuation, "full", mode=mode, scored=e.scored)
                   for e in examples] for mode in pipeline.TEACHER_FORCING}
    full_ce = [r.ce for r in refs["decode"]]
    for name in POLICIES:
        for ratio in RATIOS:
            decode, forward, intact = [], [], []
            for i, e in enumerate(examples):
                policy = make_policy(name, ratio, len(e.context))
                d = pipeline.delta_ce(model, e.context, e.continuation, policy, reference=refs["decode"][i],
                                      mode="decode", scored=e.scored)
                decode.append(d.delta)
                intact += [x < INTACT_NATS for x in d.token_deltas]
                policy = make_policy(name, ratio, len(e.context))
                forward.append(pipeline.delta_ce(model, e.context, e.continuation, policy,
                                                 reference=refs["one_forward"][i], mode="one_forward",
                                                 scored=e.scored).delta)
            cells[f"{name}|{ratio}"] = {"delta_ce": statistics.mean(decode), "intact": sum(intact) / len(intact),
                                        "delta_ce_one_forward": statistics.mean(forward)}
    return {"arm": arm, "seed": seed, "count": count, "full_ce": statistics.mean(full_ce), "cells": cells,
            "seconds": time.perf_counter() - started}


def fmt(values: list[float], spec: str) -> str:
    if len(values) == 1:
        return f"{values[0]:{spec}}"
    return f"{statistics.mean(values):{spec}} ± {(max(values) - min(values)) / 2:.4f}"


def table(results: list[dict[str, Any]]) -> str:
    arms = ("nope", "rope")
    by_arm = {arm: [r for r in results if r["arm"] == arm] for arm in arms}
    lines = ["| policy | ratio | NoPE ΔCE | NoPE intact | NoPE ΔCE (one forward) | RoPE ΔCE | RoPE intact | "
             "RoPE ΔCE (one forward) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    full = [fmt([r["full_ce"] for r in by_arm[arm]], ".4f") for arm in arms]
    lines.append(f"| full (CE, nats/answer token) | — | {full[0]} | 1.00 | — | {full[1]} | 1.00 | — |")
    for name in POLICIES:
        for ratio in RATIOS:
            cells = []
            for arm in arms:
                got = [r["cells"][f"{name}|{ratio}"] for r in by_arm[arm]]
                cells += [fmt([g["delta_ce"] for g in got], "+.4f"), fmt([g["intact"] for g in got], ".3f"),
                          fmt([g["delta_ce_one_forward"] for g in got], "+.4f")]
            lines.append(f"| {name} | {ratio}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=16, help="held-out sequences per twin (16 answers each)")
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="training seeds (default: all shipped)")
    p.add_argument("--workers", type=int, default=2, help="processes (one thread each)")
    p.add_argument("--json", help="also write every cell here")
    args = p.parse_args(argv)
    jobs = [(arm, s) for arm in ("nope", "rope") for s in (args.seeds if args.seeds is not None else shipped_seeds(arm))]
    load = os.getloadavg()
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        results = list(pool.map(one_model, *zip(*jobs), [args.count] * len(jobs)))
    seeds = sorted({s for _, s in jobs})
    print(f"Twins ref-{{nope,rope}}-s{{{','.join(map(str, seeds))}}}, {args.count} held-out sequences each (16 answers "
          f"per sequence), {time.perf_counter() - started:.0f} s, load average at start {load[0]:.1f}")
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
