"""Soak: 10,000 decode steps per policy on tiny Llama and tiny DeepSeek-V2 (``make soak``).

    python benchmarks/soak.py                     # 10,000 steps, both models, every soak policy
    python benchmarks/soak.py --steps 1000 --models tiny-llama --policies streaming_llm

Each run prefills a ``--context`` (256) token prompt into a fresh ``TieredCache``, ends the context
(the pipeline's compression point) and decodes greedily, one token per forward, for ``--steps``
steps. At checkpoints 100, 1,000 and 10,000 (those within ``--steps``) it prints the rows one decode
step attends (the last layer, per sequence and KV group, fetched rows included), the archive's rows,
the process RSS and ms/step: the median of the ``--window`` (100) steps that end at the checkpoint
(50 for checkpoint 100). Policies: ``streaming_llm`` and ``h2o`` (budget 256, no retriever: their
per-step time must not grow with the archive), ``vestige`` with block 512 (ratio 8, no retriever; a
block closes every 512 decoded rows), and the retrievers ``vestige+sketch`` (vestige's sketch index,
block 512) and ``quest`` (budget 256, every layer paged), whose scans grow with the archive by design.

``--check`` (on in ``make soak``) exits 1 when ``streaming_llm``'s ms/step at the last checkpoint is
above 1.3x its ms/step at 1,000 steps on either model (the reliability issue's criterion) or a
cache does not free its memory when dropped (RSS after all runs more than 50 MiB above the RSS after
the first; the models are built once, before the first run). On a machine whose load changes during
the run the checkpoints' figures drift apart, so the growth check uses a side-by-side measurement: a
fork of the cache taken at 1,000 steps and the cache at the end decode alternately for ``--window``
steps each, and their medians are compared. ``--json`` writes every measured row.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

POLICIES = {
    "streaming_llm": ("streaming_llm", {"budget": 256}),
    "h2o": ("h2o", {"budget": 256}),
    "vestige": ("vestige", {"ratio": 8, "block_size": 512, "retriever": None}),
    "vestige+sketch": ("vestige", {"ratio": 8, "block_size": 512}),
    "quest": ("quest", {"budget": 256, "dense_layers": 0}),
}
MODELS = ("tiny-llama", "tiny-deepseek-v2")
CHECKPOINTS = (100, 1_000, 10_000)
GROWTH_LIMIT = 1.3  # streaming_llm: ms/step at the last checkpoint over ms/step at 1,000 steps
LEAK_LIMIT_MIB = 50.0


def rss_mib() -> float:
    """Resident set size of this process in MiB (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def release_freed_heap() -> None:
    """Ask glibc to hand freed heap pages back to the OS (``malloc_trim(0)``), so that RSS measures what is
    still allocated rather than what the allocator keeps for reuse; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def live_caches() -> int:
    """kvzoo caches and row stores still alive (found without the collector: ``gc.get_objects`` only lists)."""
    from kvzoo.framework.buffers import RowStore
    from kvzoo.framework.cache import TieredCache

    return sum(issubclass(type(obj), (TieredCache, RowStore)) for obj in gc.get_objects())  # type(): no proxy lookups


@functools.cache
def build_model(name: str):
    """One model per name for the whole soak (built before the first run): RSS then tracks caches only."""
    from kvzoo.models import tiny_deepseek_v2, tiny_llama

    model = {"tiny-llama": tiny_llama, "tiny-deepseek-v2": tiny_deepseek_v2}[name]()[0]
    return model.eval()


def attended_rows(layer) -> float:
    """Rows the latest decode step of ``layer`` attended, per sequence and KV group: the resident rows plus
    the rows a retriever fetched back (``LayerStats.last_step`` counts them over the batch and groups)."""
    step = layer.last_step
    attended = step.get("attended_bytes_read", 0)
    if not attended:
        return float(layer.resident_rows)
    return layer.resident_rows * (attended + step.get("fetched_bytes", 0)) / attended  # same bytes per row


@torch.inference_mode()
def soak(model_name: str, policy_name: str, *, steps: int, context: int, window: int, seed: int = 0) -> list[dict]:
    from kvzoo import TieredCache, registry

    model = build_model(model_name)
    name, params = POLICIES[policy_name]
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(seed))
    checkpoints = [c for c in CHECKPOINTS if c <= steps] or [steps]
    rows: list[dict] = []
    early = None  # a fork of the cache at the 1,000-step checkpoint, for the interleaved comparison
    with TieredCache(model, registry.get(name, **params)) as cache:
        out = model(input_ids=ids, cache=cache, use_cache=True)
        cache.compress()
        token = out.logits[:, -1:].argmax(-1)
        times: list[float] = []
        for step in range(1, steps + 1):
            start = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            if step == 1_000 and steps > 1_000:
                early, early_token = cache.fork(), token
            if step in checkpoints:
                span = min(window if step > 100 else window // 2, step)
                stats = cache.stats()
                layer = stats.layers[-1]  # the last layer (quest keeps its first layers dense by default)
                rows.append({
                    "model": model_name,
                    "policy": policy_name,
                    "step": step,
                    "ms_per_step": 1e3 * statistics.median(times[-span:]),
                    "attended_rows": attended_rows(layer),
                    "archived_rows": int(layer.archived_rows),
                    "events": int(layer.events),
                    "rss_mib": rss_mib(),
                })
        if early is not None:
            # the same two checkpoints measured side by side: alternate single steps between the cache at
            # 1,000 steps and the cache at the end, so that a change in the machine's load hits both alike
            late_times, early_times = [], []
            for _ in range(window):
                for which, times_of in ((cache, late_times), (early, early_times)):
                    tok = token if which is cache else early_token
                    start = time.perf_counter()
                    out = model(input_ids=tok, cache=which, use_cache=True)
                    times_of.append(time.perf_counter() - start)
                    if which is cache:
                        token = out.logits[:, -1:].argmax(-1)
                    else:
                        early_token = out.logits[:, -1:].argmax(-1)
            rows[-1]["interleaved_ms"] = {"1000": 1e3 * statistics.median(early_times),
                                          str(steps): 1e3 * statistics.median(late_times)}
            early.close()
    return rows


def format_table(rows: list[dict]) -> str:
    head = "| model | policy | step | ms/step | attended rows (last layer) | archive rows (last layer) | events | RSS MiB |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['model']} | {r['policy']} | {r['step']:,} | {r['ms_per_step']:.2f} | {r['attended_rows']:,.0f} "
                     f"| {r['archived_rows']:,} | {r['events']:,} | {r['rss_mib']:.0f} |")
    return "\n".join(lines)


def check(rows: list[dict], rss_after_first: float, rss_end: float) -> list[str]:
    """What the soak must show: streaming_llm's per-step time flat in the archive, memory freed on drop."""
    problems = []
    for model in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == model and r["policy"] == "streaming_llm"]
        stream = {r["step"]: r["ms_per_step"] for r in mine}
        side_by_side = next((r["interleaved_ms"] for r in mine if "interleaved_ms" in r), None)
        if side_by_side is not None:  # measured alternately: the comparison the criterion means
            last = max(stream)
            growth = side_by_side[str(last)] / side_by_side["1000"]
            if growth > GROWTH_LIMIT:
                problems.append(f"{model}: streaming_llm ms/step at {last:,} steps is {growth:.2f}x its ms/step "
                                f"at 1,000, measured alternately (limit {GROWTH_LIMIT}x)")
        elif 1_000 in stream and max(stream) > 1_000:
            growth = stream[max(stream)] / stream[1_000]
            if growth > GROWTH_LIMIT:
                problems.append(f"{model}: streaming_llm ms/step at {max(stream):,} steps is {growth:.2f}x its ms/step "
                                f"at 1,000 (limit {GROWTH_LIMIT}x)")
    if rss_end - rss_after_first > LEAK_LIMIT_MIB:
        problems.append(f"RSS grew {rss_end - rss_after_first:.0f} MiB across dropped caches (limit {LEAK_LIMIT_MIB} MiB)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the decode")
    parser.add_argument("--window", type=int, default=100, help="steps whose median is a checkpoint's ms/step")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a soak criterion fails")
    parser.add_argument("--json", type=Path, help="write the measured rows here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.context < 1 or args.window < 2:
        parser.error("--steps and --context must be >= 1 and --window >= 2")
    torch.set_num_threads(args.threads)
    gc.disable()  # a leak must show: nothing waits for the cycle collector
    rows: list[dict] = []
    rss_after_first = None
    for model in args.models:
        build_model(model)
    try:
        for model in args.models:
            for policy in args.policies:
                found = soak(model, policy, steps=args.steps, context=args.context, window=args.window)
                rows.extend(found)
                for r in found:
                    print(f"{r['model']:>16} {r['policy']:>14} step {r['step']:>6,}: {r['ms_per_step']:7.2f} ms/step, "
                          f"attended {r['attended_rows']:>5,.0f} rows, archive {r['archived_rows']:>6,} rows, "
                          f"RSS {r['rss_mib']:.0f} MiB", flush=True)
                if rss_after_first is None:
                    release_freed_heap()
                    rss_after_first = rss_mib()
    finally:
        gc.enable()
    release_freed_heap()
    rss_end = rss_mib()
    alive = live_caches()
    print()
    print(format_table(rows))
    for r in rows:
        if "interleaved_ms" in r:
            (a_step, a), (b_step, b) = sorted(r["interleaved_ms"].items(), key=lambda kv: int(kv[0]))
            print(f"{r['model']} {r['policy']}: measured alternately, {a:.2f} ms/step at {int(a_step):,} steps, "
                  f"{b:.2f} at {int(b_step):,} ({b / a:.2f}x)")
    runs = len(args.models) * len(args.policies)
    print(f"\nRSS after the first run's cache was dropped: {rss_after_first:.0f} MiB; after all {runs} runs: "
          f"{rss_end:.0f} MiB (both after malloc_trim); kvzoo caches/row stores still alive: {alive}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "rss_after_first_mib": rss_after_first, "rss_end_mib": rss_end,
                                         "steps": args.steps, "context": args.context}, indent=1))
    problems = check(rows, rss_after_first, rss_end)
    if alive:
        problems.append(f"{alive} kvzoo caches/row stores are still alive after every run dropped its cache")
    for problem in problems:
        print(f"soak: FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("soak: streaming_llm per-step time flat within "
              f"{GROWTH_LIMIT}x from 1,000 steps on; dropped caches freed" if args.steps > 1_000 else
              "soak: fewer than 1,001 steps: the growth criterion needs --steps > 1000 (not checked)")
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
