"""SnapKV three ways on SmolLM2-135M, 2k-token needle context, question after compression (issue 14's benchmark).

* ``kvpress``       -- kvpress's pipeline with its ``SnapKVPress(compression_ratio=0.75)``;
* ``kvzoo``         -- kvzoo's runtime (``kvzoo.pipeline.generate``'s steps) with ``snapkv`` at ratio 4 (paper
  defaults);
* ``kvpress+kvzoo`` -- kvpress's pipeline with ``to_press(registry.get("snapkv", ratio=4))``.

Each arm runs in a subprocess of its own (one warm-up call, then ``--repeats`` timed calls), so its peak memory is
its own: the peak resident set size sampled every 2 ms during the timed calls, minus the RSS before them (the
model's weights excluded). Kept rows: the context rows each layer holds after compression (the same for every layer
and KV head here). Runs only in kvpress's environment: ``.venv-kvpress/bin/python benchmarks/kvpress_side_by_side.py``
(``make test-kvpress`` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ARMS = ("kvpress", "kvzoo", "kvpress+kvzoo")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS seen while the block runs, sampled from a thread."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def run_arm(arm: str, context_tokens: int, repeats: int, max_new_tokens: int) -> dict:
    import torch
    from transformers import DynamicCache, pipeline

    from kvzoo import registry
    from kvzoo.bench.tasks import make_task
    from kvzoo.framework.cache import TieredCache
    from kvzoo.framework.pipeline import build_prompt, compress, eos_ids, greedy_decode, prefill
    from kvzoo.integrations.kvpress import to_press
    from kvzoo.models import load_smollm2

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(torch.float32)
    task = make_task("niah_single", tokenizer, context_tokens=context_tokens, depth=0.5)
    question = task.question

    if arm == "kvzoo":
        def call() -> tuple[str, list[int], int]:  # kvzoo.pipeline.generate's steps, the kept rows read after compress
            prefix, rest = build_prompt(tokenizer, task.context, question)
            cache = TieredCache(model, registry.get("snapkv", ratio=4), context_length=prefix.shape[1])
            prefill(model, cache, prefix)
            compress(cache)
            kept = [layer.slots.shape[2] for layer in cache.tiered_layers]
            logits = prefill(model, cache, rest)
            new_tokens = greedy_decode(model, cache, logits, max_new_tokens, eos_ids(model, tokenizer))
            return tokenizer.decode(new_tokens, skip_special_tokens=True), kept, prefix.shape[1]
    else:
        import kvpress

        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
        n = pipe.preprocess(task.context, questions=[question], answer_prefix="",
                            max_context_length=10**9)["context_ids"].shape[1]

        def call() -> tuple[str, list[int], int]:
            press = (kvpress.SnapKVPress(compression_ratio=0.75) if arm == "kvpress"
                     else to_press(registry.get("snapkv", ratio=4)))
            cache = DynamicCache()
            answer = pipe(task.context, question=question, press=press, cache=cache,
                          max_new_tokens=max_new_tokens)["answer"]
            return answer, [layer.keys.shape[2] for layer in cache.layers], n

    with torch.no_grad():
        call()  # warm-up
        times = []
        with PeakRSS() as mem:
            for _ in range(repeats):
                t0 = time.perf_counter()
                answer, kept, n = call()
                times.append(time.perf_counter() - t0)
    return {
        "arm": arm, "context_tokens": n, "kept_rows_per_layer": sorted(set(kept)), "layers": len(kept),
        "wall_s_median": sorted(times)[len(times) // 2], "wall_s": times,
        "peak_rss_over_start_mib": (mem.peak - mem.start) / 2**20, "answer": answer.strip(),
        "needle_found": all(a in answer for a in task.answers), "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # a subprocess runs one arm
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.context_tokens, args.repeats, args.max_new_tokens)))
        return
    rows = []
    for arm in args.arms.split(","):
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
        out = subprocess.run([sys.executable, __file__, "--arm", arm, "--context-tokens", str(args.context_tokens),
                              "--repeats", str(args.repeats), "--max-new-tokens", str(args.max_new_tokens)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| arm | context tokens | kept rows per layer | wall s (median of runs) | peak RSS over start, MiB | "
          "needle found | answer |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['context_tokens']} | {r['kept_rows_per_layer']} | {r['wall_s_median']:.2f} | "
              f"{r['peak_rss_over_start_mib']:.0f} | {r['needle_found']} | {r['answer'][:40]!r} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
