"""Ops a decode step launches, per attention layer, for every kvzoo policy against transformers' own caches.

    python benchmarks/step_ops.py                 # Markdown table (tiny Llama, tiny DeepSeek-V2, tiny Kimi Linear)
    python benchmarks/step_ops.py --json out.json

One steady decode step after a 300-token prompt (compressed), every aten op recorded under a TorchDispatchMode
(``kvzoo.bench.step_trace``): *launches* count the ops that launch work (views, slices, ``t``, ``expand``,
``_unsafe_view`` and other metadata ops apart), *syncs* the ops that make the host wait. kvzoo's caches are
built with ``capacity`` (preallocated, fixed shapes: the capturable step) and without. "beyond StaticCache" is
(kvzoo's launches - transformers' ``StaticCache``'s) / the layers kvzoo handles: the cache transformers
captures in CUDA graphs. On a GPU every launch costs ~5-10 us of host time unless the step is graph-captured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvzoo import TieredCache, registry  # noqa: E402
from kvzoo.bench.step_trace import count_decode_step  # noqa: E402
from kvzoo.framework.attention import detach  # noqa: E402
from kvzoo.models import tiny_deepseek_v2, tiny_kimi_linear, tiny_llama  # noqa: E402

PROMPT = 300
# every registered policy at a budget the prompt exceeds; quest compresses every layer (dense_layers=0: the tiny
# models have 2-4 layers), vestige and quest with their retrievers, vestige without too
POLICIES = {
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {"budget": 64}),
    "snapkv": ("snapkv", {"budget": 64}),
    "chunkkv": ("chunkkv", {"budget": 64}),
    "h2o": ("h2o", {"budget": 64}),
    "quest": ("quest", {"budget": 64, "dense_layers": 0}),
    "vestige (evict only)": ("vestige", {"budget": 16, "retriever": None}),
    "vestige (+ sketch)": ("vestige", {"budget": 16}),
}
MODELS = {"tiny Llama": tiny_llama, "tiny DeepSeek-V2": tiny_deepseek_v2, "tiny Kimi Linear": tiny_kimi_linear}


def transformers_cache(model, kind: str):
    from transformers import DynamicCache, StaticCache

    if kind == "DynamicCache":
        return lambda: DynamicCache(config=model.config)
    return lambda: StaticCache(config=model.config, max_cache_len=PROMPT + 16)


def measure(models: dict | None = None, policies: dict | None = None,
            capacities: tuple[bool, ...] = (True, False)) -> list[dict]:
    rows = []
    for model_name, build in (models or MODELS).items():
        model = build()[0]
        prompt = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
        detach(model)
        layers = len(TieredCache(model, "full").tiered_layers)
        detach(model)
        own = {}
        for kind in ("DynamicCache", "StaticCache"):
            try:
                own[kind] = count_decode_step(model, transformers_cache(model, kind), prompt, layers=layers)
                rows.append({"model": model_name, "cache": f"transformers {kind}", "launches": own[kind].launches,
                             "syncs": own[kind].syncs, "layers": layers})
            except Exception as err:  # a cache transformers does not offer for this model: said in the table
                rows.append({"model": model_name, "cache": f"transformers {kind}", "error": f"{type(err).__name__}: "
                             f"{str(err)[:80]}", "layers": layers})
        for label, (name, params) in (policies or POLICIES).items():
            for capacity in [PROMPT + 16 if fixed else None for fixed in capacities]:
                policy = registry.get(name, **params)
                if ("gqa" if "llama" in model_name.lower() else "mla") not in policy.layouts:
                    continue
                count = count_decode_step(model, lambda m=model, p=policy, c=capacity: TieredCache(m, p, capacity=c),
                                          prompt, layers=layers)
                detach(model)
                row = {"model": model_name, "cache": f"kvzoo {label}", "capacity": capacity is not None,
                       "launches": count.launches, "syncs": count.syncs, "layers": layers}
                for kind, base in own.items():
                    row[f"beyond {kind}"] = (count.launches - base.launches) / layers
                rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | cache | capacity | launches / step | per layer beyond StaticCache | beyond DynamicCache | "
             "host syncs |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['cache']} | | n/a ({r['error']}) | | | |")
            continue
        cap = {True: "yes", False: "no"}.get(r.get("capacity"), "")
        static, dynamic = (f"{r[k]:+.1f}" if k in r else "" for k in ("beyond StaticCache", "beyond DynamicCache"))
        lines.append(f"| {r['model']} | {r['cache']} | {cap} | {r['launches']} | {static} | {dynamic} | "
                     f"{r['syncs']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = measure()
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
