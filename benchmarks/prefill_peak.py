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
tier and, where a retriever reads one, the archive), the prefill's peak RSS -- ``peak_rss_mib``, everything resident
(weights, libraries, the prefill), and ``peak_rss_over_model_mib``, that less the RSS right before the prefill (the
model loaded and its weights touched by a 32-token forward, nothing prefilled; ``kvzoo.allocator.mark_model`` resets
the process's peak there, so the load's own peak is not counted) -- and the prefill's CPU time (a first call of this
length: first-touch costs included, alike in every cell).

glibc's mmap threshold is fixed at 4 MiB in every cell (``kvzoo.allocator.prefer_mmap_threshold``, as the ``kvzoo``
command does: freed blocks of 4 MiB and more go back to the system instead of staying in the heap) unless the
environment sets ``MALLOC_MMAP_THRESHOLD_``, or ``KVZOO_MMAP_THRESHOLD=0`` (glibc's dynamic threshold); the script
prints which, and each row records it (``mmap_threshold``: bytes, null for glibc's dynamic one).

``--mla-vs-transformers``: tiny DeepSeek-V2's prefill (the real row geometry, random weights), kvzoo's default
(compressed latent rows, each layer compressing inside the forward; ``full``, ``snapkv`` and ``vestige`` at ratio 8)
beside transformers' own (its decompressed K/V in a ``DynamicCache``), interleaved ``--rounds``, a fresh process per
arm and round, 1-thread CPU time (issue 32's goal: kvzoo <= 1.1x); ``--json`` then rewrites the file with one summary
row per arm (the medians)::

    .venv/bin/python benchmarks/prefill_peak.py --mla-vs-transformers [--tokens 8192] [--rounds 3] [--json f.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from kvzoo.allocator import mark_model, mmap_threshold, peak_over_model, prefer_mmap_threshold

MALLOC_NOTE = prefer_mmap_threshold()  # this process and the cells it starts (module text)

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
            rss0, t = mark_model(), time.process_time()
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            cpu = time.process_time() - t
            kept = stored = peak_rows = tokens * layers
            step = tokens
        else:
            cache = TieredCache(model, registry.get(policy) if policy == "full" else registry.get(policy, ratio=ratio),
                                context_length=tokens)
            step = {"default": prefill_chunk(cache, tokens), "after": tokens, "chunks": chunk}[mode]
            rss0, t = mark_model(), time.process_time()
            if mode == "after":
                prefill(model, cache, ids, step)
                cache.compress()
            else:
                prefill(model, cache, ids, step, ends_context=True)
            cpu = time.process_time() - t
            stats = cache.stats()
            peak_rows = stats.peak_cache_rows
            kept = sum(layer.store.n for layer in cache.tiered_layers)
            stored = kept + sum(layer.store.archive.n for layer in cache.tiered_layers)
    return dict(policy=policy, mode=mode, tokens=tokens, ratio=None if policy in ("full", "transformers") else ratio,
                chunk=step, layers=layers, peak_cache_rows=peak_rows, peak_layers=peak_rows / tokens,
                kept_rows=kept, stored_rows=stored, **peak_over_model(rss0), prefill_cpu_s=cpu,
                threads=torch.get_num_threads(), mmap_threshold=mmap_threshold())


def mla_cell(model_name: str, arm: str, tokens: int) -> dict:
    """One prefill of ``tokens`` random ids, timed after a warm-up prefill of the same size: transformers' own
    (``arm == "transformers"``: a ``DynamicCache`` of decompressed K/V, as its DeepSeek-V2 attention keeps) or
    kvzoo's default prefill of policy ``arm`` at ratio 8 (``pipeline.prefill(..., ends_context=True)``)."""
    import torch
    from transformers import DynamicCache

    from kvzoo import TieredCache, registry
    from kvzoo.models import load_model
    from kvzoo.pipeline import cache_kwargs, prefill

    torch.manual_seed(0)
    model, _ = load_model(model_name)
    ids = torch.randint(3, 512, (1, tokens))

    def once() -> float:
        t = time.process_time()
        if arm == "transformers":
            cache = DynamicCache()
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        else:
            policy = registry.get(arm) if arm == "full" else registry.get(arm, ratio=8)
            cache = TieredCache(model, policy, context_length=tokens)
            prefill(model, cache, ids, ends_context=True)
        return time.process_time() - t

    with torch.no_grad():
        once()
        rss0 = _rss_mib()
        cpu = once()
    return dict(model=model_name, arm=arm, tokens=tokens, cpu_s=cpu, rss_mib=_rss_mib(), rss_warm_mib=rss0,
                peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def mla_side_by_side(model_name: str, tokens: int, rounds: int, arms: list[str]) -> list[dict]:
    """Fresh process per arm and round, the arms' order rotated each round; per round each arm's prefill CPU time
    over transformers' (1 thread: ``OMP_NUM_THREADS=1`` unless set). One summary row per arm: the medians."""
    import statistics

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    rows = []
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            out = subprocess.run([sys.executable, __file__, "--mla-cell",
                                  json.dumps(dict(model_name=model_name, arm=arm, tokens=tokens))],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(f"{arm} failed:\n{out.stderr[-3000:]}")
            rows.append({**json.loads(out.stdout.strip().splitlines()[-1]), "round": r})
    print(f"| {model_name}, {tokens} tokens, prefill | " + " | ".join(
        f"round {r + 1}" for r in range(rounds)) + " | median |")
    print("|---|" + "---|" * (rounds + 1))
    summary = []
    for arm in arms:
        ratios = [next(x for x in rows if x["round"] == r and x["arm"] == arm)["cpu_s"]
                  / next(x for x in rows if x["round"] == r and x["arm"] == "transformers")["cpu_s"]
                  for r in range(rounds)]
        mine = [x for x in rows if x["arm"] == arm]
        summary.append(dict(model=model_name, tokens=tokens, arm=arm, rounds=rounds, threads=env["OMP_NUM_THREADS"],
                            cpu_s=statistics.median(x["cpu_s"] for x in mine), ratio=statistics.median(ratios),
                            ratios=ratios, peak_mib=statistics.median(x["peak_mib"] for x in mine)))
        print(f"| {arm} / transformers (CPU s {summary[-1]['cpu_s']:.2f}) | "
              + " | ".join(f"{v:.2f}x" for v in ratios) + f" | **{summary[-1]['ratio']:.2f}x** |", flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="append one JSON line per cell here (--mla-vs-transformers: the summary rows)")
    parser.add_argument("--mla-vs-transformers", action="store_true",
                        help="only tiny DeepSeek-V2's prefill beside transformers' own, --rounds rounds (docstring)")
    parser.add_argument("--rounds", type=int, default=3, help="with --mla-vs-transformers")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--mla-cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(**json.loads(args.cell))))
        return
    if args.mla_cell:
        print(json.dumps(mla_cell(**json.loads(args.mla_cell))))
        return
    if args.mla_vs_transformers:
        rows = mla_side_by_side("tiny-deepseek-v2", args.tokens, args.rounds, ["transformers", "full", "snapkv", "vestige"])
        if args.json:
            with open(args.json, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        return
    policies, modes = args.policies.split(","), args.modes.split(",")
    bad = [p for p in policies if p not in POLICIES] + [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown {bad}; policies: {', '.join(POLICIES)}; modes: {', '.join(MODES)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    cells = [("transformers", "default")] + [(p, m) for p in policies for m in modes if p != "full" or m != "chunks"]
    print(f"# {MALLOC_NOTE}")
    print("| policy | mode | chunk | peak rows (x one layer's prompt) | stored at the end | peak RSS MiB "
          "| over the loaded model MiB | prefill CPU s |\n|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for policy, mode in cells:
        cell = dict(policy=policy, mode=mode, tokens=args.tokens, ratio=args.ratio, chunk=args.chunk)
        out = subprocess.run([sys.executable, __file__, "--cell", json.dumps(cell)], capture_output=True, text=True,
                             env=env)
        if out.returncode:
            print(f"| {policy} | {mode} | failed: {out.stderr.strip().splitlines()[-1][:200]} |", flush=True)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {policy} | {mode} | {row['chunk']} | {row['peak_cache_rows']} ({row['peak_layers']:.1f}) | "
              f"{row['stored_rows']} | {row['peak_rss_mib']:.0f} | {row['peak_rss_over_model_mib']:.0f} | "
              f"{row['prefill_cpu_s']:.1f} |",
              flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
