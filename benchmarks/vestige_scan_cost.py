"""One layer's decode-step choose of the vestige retriever on SmolLM2's geometry, before and after issue 25 (CPU).

    PYTHONPATH=. .venv/bin/python benchmarks/vestige_scan_cost.py [--rows 7000]

3 KV heads x 3 query heads each, 64-dim keys, ``--rows`` archived rows per KV head (7,000: an 8k context at 8x),
random keys; ms per ``SketchIndex.choose`` (scan + rank + filter) for the rule before (sketch, ranked by the bound),
the sketch ranked by its estimate, and the default now (int8 keys, estimate, margin).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvzoo.framework.retrieval import ArchiveView, RowGeometry
from kvzoo.retrievers.vestige import VestigeRetriever


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=7000)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.manual_seed(0)
    G, H, D, m = 3, 9, 64, args.rows
    keys = torch.randn(1, G, m, D) * 3
    valid = torch.ones(1, G, m, dtype=torch.bool)
    view = ArchiveView(keys, torch.arange(m).expand(1, G, m), valid, None)
    empty = ArchiveView(keys[:, :, :0], torch.zeros(1, G, 0, dtype=torch.long), valid[:, :, :0], None)
    q, best = torch.randn(1, H, 1, D), torch.full((1, H, 1), 5.0)
    arms = (("before: sketch, top-16 by bound, beats s*", {"index": "sketch", "rank_by": "bound", "j_margin": 0.0}),
            ("sketch, top-16 by estimate, margin 8", {"index": "sketch"}),
            ("now: int8 keys, top-16 by estimate, margin 8", {}))
    with torch.no_grad():
        for label, options in arms:
            state = VestigeRetriever(**options).new_state(RowGeometry("gqa", 0, 0))
            state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), empty)
            for _ in range(3):
                state.choose(q, best, 0.125, view)
            start = time.perf_counter()
            for _ in range(args.repeats):
                state.choose(q, best, 0.125, view)
            ms = 1e3 * (time.perf_counter() - start) / args.repeats
            print(f"{label}: {ms:.2f} ms per layer-step, {m} rows x {G} KV heads, {state.entry_bytes} B per entry")


if __name__ == "__main__":
    main()
