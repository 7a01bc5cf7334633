"""How often ``quest(rule="eval")``'s pages differ from the reference evaluation rule's, per head-step (issue 36).

    PYTHONPATH=. .venv/bin/python benchmarks/quest_current_page.py [--ratios 4 8] [--context 400] [--steps 64]

A tiny random Llama (``kvzoo.models.tiny_llama``: 3 layers, 4 query heads over 2 KV heads), ``dense_layers=0`` so
every layer's decode steps choose pages; greedy decoding after a random context. Every decode step's choice is
observed (``Retrieval.fetch_step`` wrapped, nothing changed): the query, the layer's whole key sequence (the step's
own key last: with ``rule="eval"`` every row is archived where it was appended, so storage order is slot order) and
the archived rows each query head reads. Beside it, the reference's rule restated on the same inputs
(mit-han-lab/Quest ``evaluation/quest_attention.py``: the new key joins the key states before any page is scored;
pages of 16 from the first token, bound ``sum_i max(q_i min_i, q_i max_i)``, the top
``min(max(3, B // 16), pages)`` pages over all of them, the current page included), in fp64.

Reported per ratio: head-steps; the fraction where the archived rows a head reads differ from the reference's
(the step's own row left out on both sides: kvzoo always attends it), how many of those at steps that open a
page, and the widest relative gap, among them, between the last bound the reference takes and the first it leaves
(a near-tie: kvzoo's fp32 bounds and their slack may order such pages otherwise); and, at steps that do not open a page, the
head-steps where each reads the current page (its rows before the step's own).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvzoo import pipeline, registry
from kvzoo.framework.retrieval import Retrieval
from kvzoo.models import tiny_llama

PAGE = 16


def reference_rows(query: torch.Tensor, keys: torch.Tensor, budget: int) -> tuple[list[set[int]], list[float]]:
    """Rows each query head reads by the reference's eval rule: ``query [H, D]``, ``keys [G, L, D]`` (own key last);
    and per head the relative gap between the last bound it takes and the first it leaves (inf: it takes all)."""
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


def observe(ratio: int, context: int, steps: int, seed: int) -> dict:
    model, _ = tiny_llama(seed=0)
    ids = torch.randint(1, 256, (context,), generator=torch.Generator().manual_seed(seed))
    records = []
    original = Retrieval.fetch_step

    def fetch_step(self, layer, query, best, scaling):
        L = layer.seen
        keys = layer.rows.buffers["keys"][0, :, :L].clone()  # [G, L, D]: slot order, the own row last
        index, captured = layer.index, {}
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
        ref, gaps = reference_rows(query, keys, budget)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for ratio in args.ratios:
        print(json.dumps(observe(ratio, args.context, args.steps, args.seed)))


if __name__ == "__main__":
    main()
