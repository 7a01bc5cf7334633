"""The default vestige retriever's top-j rule on the reference twins: ranked by the bound (before issue 25) or by
its estimate (now), question after compression (issue 25's "NoPE twin no worse than today").

    PYTHONPATH=. .venv/bin/python benchmarks/vestige_nope_check.py [--count 100]

Both arms (NoPE, RoPE), the first shipped seed, T = 512, 16 pairs, held-out examples (the tables' stream); the
retriever scans with the 2-token question too (``multi_token="union"``: under the dense rule the answer's only
forward would read the whole archive). MLA rows: the sketch index (unchanged), only the ranking differs.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "refmodels"))

from tables import RATIOS, TABLE_SEED, shipped_seeds  # noqa: E402

from kvzoo import pipeline, registry  # noqa: E402
from kvzoo.framework.retrieval import build_retriever  # noqa: E402
from kvzoo.models import load_model  # noqa: E402
from kvzoo.refmodel import data as D  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--arms", nargs="+", default=["nope", "rope"])
    args = p.parse_args()
    torch.set_num_threads(1)
    T, n_pairs = D.CURRICULUM[-1]
    examples = D.heldout_recall(T, n_pairs, args.count, seed=TABLE_SEED)
    print("| arm | ratio | top-16 by bound (before) | top-16 by estimate (now) | rows fetched/forward bound / estimate |")
    print("|---|---|---|---|---|")
    for arm in args.arms:
        model = load_model(f"ref-{arm}-s{shipped_seeds(arm)[0]}")[0]
        for ratio in RATIOS:
            cells, fetched = [], []
            for rank_by in ("bound", "estimate"):
                hits = rows = 0
                for e in examples:
                    retriever = build_retriever("vestige", multi_token="union", rank_by=rank_by)
                    policy = registry.get("vestige", ratio=ratio, retriever=retriever)
                    out = pipeline.generate(model, None, e.context, e.question, policy, max_new_tokens=1)
                    hits += out.token_ids[0] == e.answer
                    rows += out.stats.totals.get("rows_fetched", 0)
                cells.append(hits / len(examples))
                fetched.append(rows / len(examples))
            print(f"| {arm} | {ratio}x | {cells[0]:.3f} | {cells[1]:.3f} | {fetched[0]:.0f} / {fetched[1]:.0f} |",
                  flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
