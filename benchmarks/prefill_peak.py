"""The peak a prefill holds, per policy and prefill mode (SmolLM2-135M fp32, CPU): issue 32's docs table.

    .venv/bin/python benchmarks/prefill_peak.py [--tokens 8192] [--ratio 8] [--json docs/results/prefill_peak.jsonl]

Modes (``default`` and ``after`` end with the same cache, tests/test_context_end.py holds that; ``chunks`` does only
for a policy whose prefill is token by token -- StreamingLLM's ``prefill="stream"`` -- and otherwise is a different,
cheaper prefill: a chunk attends only the rows kept so far):

* ``default``  -- ``kvzoo.pipeline.prefill(..., ends_context=True)``'s own choice (``prefill_chunk``): the whole
  context in one forward that compresses each layer right after its attention, or, for a policy that closes blocks
  shorter than the context (``vestige`` past its ``block_size``), a block at a time;
* ``after``    -- one forward holding every layer's whole prefill, compressed after it (``cache.compress()``):
  kvzoo's prefill before this round;
* ``chunks``   -- chunks of ``--chunk`` tokens, the last one compressing inside its forward.

``transformers`` is the yardstick: its own ``DynamicCache``, nothing compressed.

Per cell, in a fresh process (1 thread): the most K/V rows every layer's attended tier held at once
(``CacheStats.peak_cache_rows``, per sequence and KV group, counted by the cache), the rows stored at the end (the
tier and, where a retriever reads one, the archive), the process's peak RSS over its RSS right before the prefill
(``ru_maxrss``: the model loaded and its weights touched by a 32-token forward, nothing prefilled), and the
prefill's CPU time (a first call of this length: first-touch costs included, alike in every cell).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

POLICIES = ("full", "snapkv", "chunkkv", "h2o", "streaming_llm", "quest", "vestige")
MODES = ("default", "after", "chunks")


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_cell(policy: str, mode: str, tokens: int, ratio: float, chunk: int) -> dict:
    import torch
    from transformers import DynamicCache

    from kvzoo import TieredCache, registry
    from kvzoo.models import load_smollm2
    from kvzoo.pipeline import cache_kwargs, prefill, prefill_chunk

    torch.manual_seed(0)
    model, _ = load_smollm2(torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        # the weights are read from a memory map: a short forward touches them all, so that the RSS below is the
        # prefill's (32 tokens in a cache of their own: far under the peak measured)
        model(input_ids=ids[:, :32], use_cache=False, logits_to_keep=1)
        if policy == "transformers":
            cache = DynamicCache()
            rss0, t = _rss_mib(), time.process_time()
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            cpu = time.process_time() - t
            kept = stored = peak_rows = tokens * layers
            step = tokens
        else:
            cache = TieredCache(model, registry.get(policy) if policy == "full" else registry.get(policy, ratio=ratio),
                                context_length=tokens)
            step = {"default": prefill_chunk(cache, tokens), "after": tokens, "chunks": chunk}[mode]
            rss0, t = _rss_mib(), time.process_time()
            if mode == "after":
                prefill(model, cache, ids, step)
                cache.compress()
            else:
                prefill(model, cache, ids, step, ends_context=True)
            cpu = time.process_time() - t
            stats = cache.stats()
            peak_rows = stats.peak_cache_rows
            kept = sum(layer.n for layer in cache.tiered_layers)
            stored = kept + sum(layer.archived_rows for layer in cache.tiered_layers)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(policy=policy, mode=mode, tokens=tokens, ratio=None if policy in ("full", "transformers") else ratio,
                chunk=step, layers=layers, peak_cache_rows=peak_rows, peak_layers=peak_rows / tokens,
                kept_rows=kept, stored_rows=stored, peak_rss_over_start_mib=peak - rss0, prefill_cpu_s=cpu,
                threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="append one JSON line per cell here")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(**json.loads(args.cell))))
        return
    policies, modes = args.policies.split(","), args.modes.split(",")
    bad = [p for p in policies if p not in POLICIES] + [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown {bad}; policies: {', '.join(POLICIES)}; modes: {', '.join(MODES)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    cells = [("transformers", "default")] + [(p, m) for p in policies for m in modes if p != "full" or m != "chunks"]
    print("| policy | mode | chunk | peak rows (x one layer's prompt) | stored at the end | peak RSS over start MiB "
          "| prefill CPU s |\n|---|---|---:|---:|---:|---:|---:|", flush=True)
    for policy, mode in cells:
        cell = dict(policy=policy, mode=mode, tokens=args.tokens, ratio=args.ratio, chunk=args.chunk)
        out = subprocess.run([sys.executable, __file__, "--cell", json.dumps(cell)], capture_output=True, text=True,
                             env=env)
        if out.returncode:
            print(f"| {policy} | {mode} | failed: {out.stderr.strip().splitlines()[-1][:200]} |", flush=True)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {policy} | {mode} | {row['chunk']} | {row['peak_cache_rows']} ({row['peak_layers']:.1f}) | "
              f"{row['stored_rows']} | {row['peak_rss_over_start_mib']:.0f} | {row['prefill_cpu_s']:.1f} |",
              flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
