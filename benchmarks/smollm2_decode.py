"""SmolLM2-135M decode ms/step at one context length, arms measured interleaved (CPU, real weights).

    .venv/bin/python benchmarks/smollm2_decode.py --context 8192 --arms transformers,full
    .venv/bin/python benchmarks/smollm2_decode.py --context 32768 --arms full,vestige@32 --steps 20

An arm is ``transformers`` (the model's own SDPA attention with a ``DynamicCache``, on a copy of the model that
kvzoo never attached to) or a kvzoo policy, optionally ``@RATIO`` (default ratio 8; ``full``: none) and
``+capacity`` (``TieredCache(..., capacity=N)``: preallocated, fixed shapes); ``/key=value`` pieces after the
ratio configure the policy's retriever (``vestige@32/rank_by=bound/entry_dtype=float32``: the rule before
issue 25). Each arm prefills the same random
context (chunks of 1,024, ``logits_to_keep=1``), is compressed (kvzoo arms), decodes 2 warm-up steps, then every
arm decodes one step in turn, ``--steps`` times, so that load on a shared machine hits all of them alike. Prints
the median ms/step per arm and its ratio to the first arm. Contexts past SmolLM2's 8,192 positions still run
(RoPE extrapolates); only the step's cost is measured, not its output.
"""

from __future__ import annotations

import argparse
import ast
import copy
import statistics
import time

import torch

from kvzoo import TieredCache, registry
from kvzoo.framework.attention import detach
from kvzoo.models import load_smollm2


def make_cache(arm: str, model, plain_model, context: int, steps: int):
    """(model, cache) for an arm (see the module docstring)."""
    if arm == "transformers":
        from transformers import DynamicCache

        return plain_model, DynamicCache(config=plain_model.config)
    spec, _, option = arm.partition("+")
    spec, *retriever_options = spec.split("/")
    name, _, ratio = spec.partition("@")
    params = {} if name == "full" else {"ratio": float(ratio or 8)}
    if retriever_options:  # vestige@32/rank_by=bound: the policy's retriever with these options
        from kvzoo.framework.retrieval import build_retriever

        options = {k: ast.literal_eval(v) if v[:1].isdigit() or v in ("True", "False") else v
                   for k, v in (o.split("=", 1) for o in retriever_options)}
        params["retriever"] = build_retriever(registry.get(name, **params).retriever, **options)
    policy = registry.get(name, **params)
    capacity = context + steps + 8 if option == "capacity" else None
    return model, TieredCache(model, policy, context_length=context, capacity=capacity)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--arms", default="full,vestige,quest", help="comma-separated arms (module docstring)")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    model, _ = load_smollm2()
    plain_model = None
    if "transformers" in arms:
        plain_model = copy.deepcopy(model)
        detach(plain_model)
    ids = torch.randint(100, 40000, (1, args.context), generator=torch.Generator().manual_seed(0))
    runs, times = {}, {}
    with torch.no_grad():
        for arm in arms:
            m, cache = make_cache(arm, model, plain_model, args.context, args.steps)
            for start in range(0, args.context, 1024):
                out = m(input_ids=ids[:, start : start + 1024], cache=cache, use_cache=True, logits_to_keep=1)
            if hasattr(cache, "compress"):
                cache.compress()
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(2):
                m(input_ids=token, cache=cache, use_cache=True)
            runs[arm], times[arm] = (m, cache, token), []
        for _ in range(args.steps):
            for arm in arms:
                m, cache, token = runs[arm]
                t = time.perf_counter()
                m(input_ids=token, cache=cache, use_cache=True)
                times[arm].append(time.perf_counter() - t)
    base = statistics.median(times[arms[0]])
    for arm in arms:
        median = statistics.median(times[arm])
        print(f"{arm}: decode median {1e3 * median:.1f} ms/step ({median / base:.2f}x {arms[0]}) at {args.context} "
              f"tokens, {args.steps} interleaved steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
