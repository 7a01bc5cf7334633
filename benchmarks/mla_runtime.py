"""MLA runtime figures on the tiny random models (issue 4's benchmark), CPU.

    .venv/bin/python benchmarks/mla_runtime.py [--tokens 8192] [--chunk 512]

For tiny DeepSeek-V2 (Lite geometry) and tiny Kimi Linear: prefill time and peak process memory
(ru_maxrss of a fresh subprocess per configuration, minus the same process's RSS right before
the prefill) with one-shot vs streaming (chunked) prefill under streaming_llm at ratio 8; and the
mean decode-step time with full vs ratio 8 and 32 (20 steps after the prefill).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(**json.loads(args.one))))
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
