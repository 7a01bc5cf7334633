"""ChunkKV's compression step with and without layer-wise index reuse, on SmolLM2-135M (real weights).

    .venv/bin/python benchmarks/chunkkv_reuse.py [--context-tokens 2000] [--ratio 4] [--reps 12] [--json out.json]

One dense prefill of RULER's single needle (essay haystack, depth 0.5) into a ``full`` cache that keeps the
last 32 queries (``record_window``); each trial forks it as ChunkKV (``TieredCache.fork_as``) and times
``cache.compress()`` -- the context-end event, i.e. the window attention, scoring and chunk selection of every
layer and the move of the evicted rows -- and nothing else. Arms, interleaved (each repetition runs every arm
once, in an order rotated from one repetition to the next, so drifting machine load falls on all arms alike):

* ``reuse=1`` -- every layer scores (no reuse);
* ``reuse=2`` -- the paper's ``N_reuse = 2``: layers 1, 3, ... reuse their predecessor's indices;
* ``reuse=2, window attention computed`` -- what kvzoo shipped before issue 23: the reusing layers also
  computed their window attention (to check that the window fits), then did not use it. Reproduced by asking
  for the attention in ``select`` before the real selector runs.

Torch runs one thread (``torch.set_num_threads(1)``). Prints median and mean ± standard deviation per arm,
the change against ``reuse=1``, whether every arm kept the same rows on every layer as ``reuse=2`` (the two
``reuse=2`` arms must), and the machine's load average before and after (timing depends on it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvzoo import TieredCache, pipeline  # noqa: E402
from kvzoo.bench.runner import encode_prompt  # noqa: E402
from kvzoo.bench.tasks import TaskSpec, make_task  # noqa: E402
from kvzoo.models import load_smollm2  # noqa: E402
from kvzoo.policies.chunkkv import ChunkKV  # noqa: E402


class ChunkKVAsShipped(ChunkKV):
    """ChunkKV as it was before issue 23: every layer's window attention computed, reusing layers included."""

    def select(self, rows, keep):
        rows.observed_window()
        return super().select(rows, keep)


ARMS = {
    "reuse=1": lambda ratio: ChunkKV(ratio=ratio, reuse=1),
    "reuse=2": lambda ratio: ChunkKV(ratio=ratio, reuse=2),
    "reuse=2, window attention computed (before issue 23)": lambda ratio: ChunkKVAsShipped(ratio=ratio, reuse=2),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    model, tokenizer = load_smollm2()
    task = make_task(TaskSpec("niah_single", args.context_tokens, 0.5, 0, "essay"), tokenizer, continuation_tokens=0)
    prefix = encode_prompt(tokenizer, task).prefix
    base = TieredCache(model, "full", context_length=prefix.shape[1], record_window=32)
    started = time.perf_counter()
    pipeline.prefill(model, base, prefix)
    prefill_s = time.perf_counter() - started

    names = list(ARMS)
    times: dict[str, list[float]] = {name: [] for name in names}
    kept: dict[str, list[torch.Tensor]] = {}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            cache = base.fork_as(ARMS[name](args.ratio))
            started = time.perf_counter()
            cache.compress()
            times[name].append(time.perf_counter() - started)
            slots = [layer.slots.clone() for layer in cache.layers]
            if name not in kept:
                kept[name] = slots
            elif not all(torch.equal(a, b) for a, b in zip(kept[name], slots, strict=True)):
                raise RuntimeError(f"{name}: two trials kept different rows")
            cache.close()
    load_after = os.getloadavg()

    same = {name: all(torch.equal(a, b) for a, b in zip(kept[name], kept["reuse=2"], strict=True)) for name in names}
    base_ms = 1e3 * statistics.median(times["reuse=1"])
    results = []
    print(f"SmolLM2-135M fp32, {prefix.shape[1]} context tokens, ratio {args.ratio:g}, {args.reps} interleaved "
          f"repetitions, 1 torch thread; one prefill ({prefill_s:.1f} s) forked per trial")
    print(f"load average (1/5/15 min) before: {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}; "
          f"after: {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} on {os.cpu_count()} cores")
    print("| arm | compression step, median ms | mean ± sd ms | vs reuse=1 (median) | same kept rows as reuse=2 |")
    print("|---|---:|---:|---:|---|")
    for name in names:
        ms = [1e3 * t for t in times[name]]
        median = statistics.median(ms)
        change = 100 * (median - base_ms) / base_ms
        print(f"| {name} | {median:.1f} | {statistics.mean(ms):.1f} ± {statistics.stdev(ms):.1f} | "
              f"{change:+.1f} % | {'yes' if same[name] else 'no'} |")
        results.append({"arm": name, "median_ms": median, "ms": ms, "change_vs_reuse1_pct": change,
                        "same_rows_as_reuse2": same[name]})
    if not same["reuse=2, window attention computed (before issue 23)"]:
        raise RuntimeError("the two reuse=2 arms kept different rows")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "context_tokens": int(prefix.shape[1]), "ratio": args.ratio, "reps": args.reps, "prefill_s": prefill_s,
            "load_before": load_before, "load_after": load_after, "arms": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
