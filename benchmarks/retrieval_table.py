"""Per (context length, policy, ratio) from leaderboard results: score, ΔCE (decode), KV bytes per decode step
and per generated token, and the share of the context fetched per KV head per layer-step (issue 25).

    PYTHONPATH=. .venv/bin/python benchmarks/retrieval_table.py results.jsonl [more.jsonl ...] [--layers 30 --kv-heads 3]

``fetched / context`` = ``fetched_rows_per_step`` (summed over layers and KV heads) / (layers x KV heads) / the
prompt's tokens (SmolLM2-135M: 30 layers, 3 KV heads).
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
    args = p.parse_args()
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for path in args.files:
        for line in open(path):
            row = json.loads(line)
            if row.get("error") or row.get("score") is None:
                continue
            cells[(row["context_tokens"], row["policy"], row.get("ratio"))].append(row)
    print("| context | policy | ratio | trials | score | ΔCE (decode) | KV bytes/step | KV bytes/token | "
          "fetched / context per KV head per step | decode ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (n, policy, ratio), rows in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] != "full", kv[0][1],
                                                                          kv[0][2] or 0)):
        def m(key, rows=rows):
            values = [r[key] for r in rows if r.get(key) is not None]
            return mean(values) if values else None
        fetched = m("fetched_rows_per_step")
        share = None if fetched is None else fetched / (args.layers * args.kv_heads) / m("prompt_tokens")
        ce = m("delta_ce")
        print(f"| {n} | {policy} | {'-' if ratio is None else f'{ratio:g}x'} | {len(rows)} | {m('score'):.2f} | "
              f"{'-' if ce is None else f'{ce:+.3f}'} | {m('kv_bytes_per_step') / 2**20:.2f} MiB | "
              f"{m('kv_bytes_per_token') / 2**20:.2f} MiB | {'-' if not share else f'{share:.2%}'} | "
              f"{m('decode_ms_per_step') or 0:.0f} |")


if __name__ == "__main__":
    main()
