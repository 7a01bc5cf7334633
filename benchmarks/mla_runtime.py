"""MLA runtime figures on the tiny random models (issue 4's benchmark), CPU.

    .venv/bin/python benchmarks/mla_runtime.py [--tokens 8192] [--chunk 512]
    .venv/bin/python benchmarks/mla_runtime.py --prefill-vs-transformers [--tokens 8192] [--rounds 3]

For tiny DeepSeek-V2 (Lite geometry) and tiny Kimi Linear: prefill time and peak process memory
(ru_maxrss of a fresh subprocess per configuration, minus the same process's RSS right before
the prefill) with one-shot vs streaming (chunked) prefill under streaming_llm at ratio 8; and the
mean decode-step time with full vs ratio 8 and 32 (20 steps after the prefill).

``--prefill-vs-transformers``: tiny DeepSeek-V2's prefill, kvzoo's default (compressed latent rows, each layer
compressing inside the forward) beside transformers' own (its decompressed K/V in a ``DynamicCache``), interleaved
rounds, a fresh process per arm and round, 1-thread CPU time (issue 32's goal: kvzoo <= 1.1x).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(model_name: str, policy: str, ratio: float | None, tokens: int, chunk: int | None) -> dict:
    import torch

    from kvzoo import TieredCache, registry
    from kvzoo.models import load_model

    torch.manual_seed(0)
    model, _ = load_model(model_name)
    ids = torch.randint(3, 512, (1, tokens))
    policy_obj = registry.get(policy) if ratio is None else registry.get(policy, ratio=ratio)
    cache = TieredCache(model, policy_obj, context_length=tokens)
    rss0 = _rss_mib()
    step = chunk or tokens
    with torch.no_grad():
        t = time.perf_counter()
        for i in range(0, tokens, step):
            out = model(input_ids=ids[:, i : i + step], cache=cache, use_cache=True, logits_to_keep=1)
        cache.compress()
        prefill = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=token, cache=cache, use_cache=True)  # warm-up step
        t = time.perf_counter()
        for _ in range(20):
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        decode = (time.perf_counter() - t) / 20
    s = cache.stats().totals
    return dict(model=model_name, policy=policy, ratio=ratio, chunk=chunk, prefill_s=prefill, peak_mib=peak,
                decode_ms=decode * 1e3, resident_rows=s["resident_rows"], peak_rows=s["peak_resident_rows"])


def prefill_one(model_name: str, arm: str, tokens: int) -> dict:
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


def prefill_side_by_side(model_name: str, tokens: int, rounds: int, arms: list[str]) -> list[dict]:
    """Fresh process per arm and round, the arms' order rotated each round; per round each arm's prefill CPU time
    over transformers' (1 thread: ``OMP_NUM_THREADS=1`` unless set). One summary row per arm: the medians."""
    import os
    import statistics

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    rows = []
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            out = subprocess.run([sys.executable, __file__, "--prefill-one",
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--prefill-vs-transformers", action="store_true",
                        help="only the prefill beside transformers' own (tiny DeepSeek-V2, --rounds rounds)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="with --prefill-vs-transformers: write its summary rows here (JSON lines)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(**json.loads(args.one))))
        return
    if args.prefill_one:
        print(json.dumps(prefill_one(**json.loads(args.prefill_one))))
        return
    if args.prefill_vs_transformers:
        rows = prefill_side_by_side("tiny-deepseek-v2", args.tokens, args.rounds,
                                    ["transformers", "full", "snapkv", "vestige"])
        if args.json:
            with open(args.json, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        return
    configs = []
    for model in ("tiny-deepseek-v2", "tiny-kimi-linear"):
        configs += [
            dict(model_name=model, policy="streaming_llm", ratio=8, tokens=args.tokens, chunk=None),
            dict(model_name=model, policy="streaming_llm", ratio=8, tokens=args.tokens, chunk=args.chunk),
            dict(model_name=model, policy="full", ratio=None, tokens=args.tokens, chunk=args.chunk),
            dict(model_name=model, policy="streaming_llm", ratio=32, tokens=args.tokens, chunk=args.chunk),
        ]
    print("| model | policy | prefill | prefill s | peak MiB over start | peak rows/layer | decode ms/step |")
    print("|---|---|---|---|---|---|---|")
    for cfg in configs:
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        name = r["policy"] + (f" {r['ratio']:g}x" if r["ratio"] else "")
        how = f"chunks of {r['chunk']}" if r["chunk"] else "one shot"
        print(f"| {r['model']} | {name} | {how} | {r['prefill_s']:.2f} | {r['peak_mib']:.0f} | "
              f"{r['peak_rows']} | {r['decode_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
