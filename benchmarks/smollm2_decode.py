"""SmolLM2-135M decode ms/step at one context length, policies measured interleaved (CPU, real weights).

    .venv/bin/python benchmarks/smollm2_decode.py [CONTEXT=2000] [POLICIES=full,vestige,quest] [STEPS=40]

Each policy prefills the same random context (chunks of 1,024), compresses at ratio 8 (``full``: none),
decodes 2 warm-up steps, then every policy decodes one step in turn, ``STEPS`` times, so that load on a
shared machine hits all of them alike. Prints the median ms/step and the ratio to the first policy.
"""

import statistics
import sys
import time

import torch

from kvzoo import TieredCache, registry
from kvzoo.models import load_smollm2


def main(argv: list[str]) -> None:
    context = int(argv[0]) if argv else 2000
    names = argv[1].split(",") if len(argv) > 1 else ["full", "vestige", "quest"]
    steps = int(argv[2]) if len(argv) > 2 else 40
    model, _ = load_smollm2()
    ids = torch.randint(100, 40000, (1, context), generator=torch.Generator().manual_seed(0))
    caches, tokens, times = {}, {}, {}
    with torch.no_grad():
        for name in names:
            policy = registry.get(name) if name == "full" else registry.get(name, ratio=8)
            cache = TieredCache(model, policy, context_length=context)
            for start in range(0, context, 1024):
                out = model(input_ids=ids[:, start : start + 1024], cache=cache, use_cache=True, logits_to_keep=1)
            cache.compress()
            tokens[name] = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(2):
                model(input_ids=tokens[name], cache=cache, use_cache=True)
            caches[name], times[name] = cache, []
        for _ in range(steps):
            for name in names:
                t = time.perf_counter()
                model(input_ids=tokens[name], cache=caches[name], use_cache=True)
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times[names[0]])
    for name in names:
        median = statistics.median(times[name])
        print(f"{name}: decode median {1e3 * median:.1f} ms/step ({median / base:.2f}x {names[0]}) at {context} tokens")


if __name__ == "__main__":
    main(sys.argv[1:])
