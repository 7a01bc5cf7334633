"""Per (context length, policy, ratio) from leaderboard results: score, ΔCE (decode), KV bytes per decode step
and per generated token, and the share of the context fetched per KV head per layer-step (issue 25).

    PYTHONPATH=. .venv/bin/python benchmarks/retrieval_table.py results.jsonl [more.jsonl ...] [--layers 30 --kv-heads 3]

``fetched / context`` = ``fetched_rows_per_step`` (summed over layers and KV heads) / (layers x KV heads) / the
prompt's tokens (SmolLM2-135M: 30 layers, 3 KV heads). "index share": the index bytes a decode step scans over the
step's KV bytes -- the measured ``index_bytes_per_step`` where the row has it, else (vestige rows written before it)
archived rows x ``--entry-bytes``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from statistics import mean


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--entry-bytes", type=int, default=70, help="vestige index entry (int8 keys, 64-dim: 70; sketch: 72)")
    p.add_argument("--row-bytes", type=int, default=512, help="an archived row's K+V bytes (fp32, 64-dim: 512)")
    args = p.parse_args()
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for path in args.files:
        for line in open(path):
            row = json.loads(line)
            if row.get("error") or row.get("score") is None:
                continue
            cells[(row["context_tokens"], row["policy"], row.get("ratio"))].append(row)
    print("| context | policy | ratio | trials | score | ΔCE (decode) | KV bytes/step | KV bytes/token | "
          "fetched / context per KV head per step | index share of a step | decode ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (n, policy, ratio), rows in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] != "full", kv[0][1],
                                                                          kv[0][2] or 0)):
        def m(key, rows=rows):
            values = [r[key] for r in rows if r.get(key) is not None]
            return mean(values) if values else None
        fetched = m("fetched_rows_per_step")
        share = None if fetched is None else fetched / (args.layers * args.kv_heads) / m("prompt_tokens")
        ce = m("delta_ce")
        index = None
        if m("index_bytes_per_step"):  # measured (rows since issue 25's paged index)
            index = m("index_bytes_per_step") / m("kv_bytes_per_step")
        elif policy == "vestige" and m("archived_bytes"):  # older rows: one entry per archived row (int8/sketch)
            index = m("archived_bytes") / args.row_bytes * args.entry_bytes / m("kv_bytes_per_step")
        print(f"| {n} | {policy} | {'-' if ratio is None else f'{ratio:g}x'} | {len(rows)} | {m('score'):.2f} | "
              f"{'-' if ce is None else f'{ce:+.3f}'} | {m('kv_bytes_per_step') / 2**20:.2f} MiB | "
              f"{m('kv_bytes_per_token') / 2**20:.2f} MiB | {'-' if not share else f'{share:.2%}'} | "
              f"{'-' if index is None else f'{index:.0%}'} | "
              f"{m('decode_ms_per_step') or 0:.0f} |")


if __name__ == "__main__":
    main()
