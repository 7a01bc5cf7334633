"""The runtime on DeepSeek-V2-Lite's attention geometry: transformers' own model vs kvzoo's policies.

    python benchmarks/gpu_runtime.py                      # CUDA if present: 32k and 128k, batch 1 and 4
    python benchmarks/gpu_runtime.py --toy                # any machine: a toy size in seconds (CI smoke test)
    python benchmarks/gpu_runtime.py --profile streaming_llm   # also profile one decode step of a policy

The model: DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, latent 512 + 64, nope 128, v 128, no
q-LoRA, Lite's YaRN), ``--layers`` layers (8) with a small dense MLP (intermediate 1024) so that
attention dominates, vocabulary 32,768, random weights, bf16 on CUDA (fp32 on CPU). Per context
length: the prompt is prefilled at batch 1 in chunks of ``--chunk`` (4,096) tokens, the cache is
compressed (the pipeline's compression point), then copied to each batch size
(``Cache.batch_repeat_interleave``) and decoded for ``--steps`` (48) steps after 4 warm-up steps.

Reported per (policy, context, batch): decode ms/step (median, ``torch.cuda.synchronize`` around
each step), prefill seconds and peak memory above the weights (batch 1), peak memory during the
decode, the KV-path bytes one decode step reads (``cache.stats()``: attended rows + index entries
+ fetched rows; for transformers the latent cache it decompresses), and the time those bytes take
at the measured copy bandwidth (``2 x bytes / time`` of a 1 GiB device copy). ``--weights`` adds
the weight bytes a step reads to that bound. Markdown and JSON go to ``--out`` (default
``results/gpu_runtime.{md,json}``). A configuration that fails (out of memory) is recorded with
its error and the run goes on.

``--kernels torch,triton`` (the default on CUDA) runs every kvzoo policy on both decode paths
(``KVZOO_KERNELS``: the PyTorch path, and the Triton kernels of ``kvzoo/kernels/``: gathered split-K
decode attention over the tier and the fetched rows, fused index scans); the ``kernels`` column says
which. ``--modes eager,graph`` (the default on CUDA) runs every kvzoo policy eagerly and with
``TieredCache(..., capacity=N, cuda_graph=True)`` (decode steps captured in a CUDA graph and replayed); the
``mode`` column says which, and for a graph row how many steps replayed. Rows are written after every
configuration, so a run cut short keeps what it measured. A configuration that fails -- out of memory, a
Triton ``CompilationError`` or ``OutOfResources`` -- becomes a row with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvzoo.bench.metrics import copy_bandwidth

POLICIES = {
    "transformers": None,  # transformers' own DeepseekV2 attention with a DynamicCache
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {}),
    "vestige": ("vestige", {"retriever": None}),
    "vestige+sketch": ("vestige", {}),
    "quest": ("quest", {}),
    "snapkv": ("snapkv", {}),
}


@dataclass
class Settings:
    device: str
    dtype: torch.dtype
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    contexts: list[int]
    batches: list[int]
    steps: int
    warmup: int
    chunk: int
    ratio: float
    policies: list[str]
    weights_in_bound: bool = False
    kernels: list[str] = field(default_factory=lambda: ["torch"])
    modes: list[str] = field(default_factory=lambda: ["eager"])
    notes: list[str] = field(default_factory=list)


def build_model(s: Settings) -> torch.nn.Module:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from kvzoo.models import DEEPSEEK_V2_LITE_ROPE, MLA_ROW_GEOMETRY

    config = DeepseekV2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.heads, q_lora_rank=None,
        first_k_dense_replace=s.layers,  # every layer's MLP dense and small: attention dominates
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, max_position_embeddings=163840,
        rope_parameters=dict(DEEPSEEK_V2_LITE_ROPE), tie_word_embeddings=False, **MLA_ROW_GEOMETRY,
    )
    torch.manual_seed(0)
    with torch.device(s.device):
        model = DeepseekV2ForCausalLM(config)
    return model.to(s.dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def memory_mark(device: str) -> int:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def memory_peak(device: str, base: int) -> float | None:
    if device == "cuda":
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return None  # CPU: no allocator peak to read without a subprocess per row


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads (all but the embedding table, of which it reads a row)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def make_cache(model: torch.nn.Module, name: str, s: Settings, context: int, mode: str = "eager") -> Any:
    from transformers import DynamicCache

    from kvzoo import TieredCache, registry
    from kvzoo.framework.attention import detach

    if POLICIES[name] is None:
        detach(model)
        return DynamicCache(config=model.config)
    policy_name, extra = POLICIES[name]
    params = dict(extra) if policy_name == "full" else {"ratio": s.ratio, **extra}
    policy = registry.get(policy_name, **params)
    if mode == "eager":
        return TieredCache(model, policy, context_length=context)
    capacity = context + s.warmup + s.steps + 8  # the prompt and every decode step, preallocated
    return TieredCache(model, policy, context_length=context, capacity=capacity, cuda_graph=mode == "graph")


def forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits


def kv_bytes_per_step(name: str, cache: Any, s: Settings) -> int:
    if POLICIES[name] is None:  # transformers keeps the latent c and k_pe and reads them every step
        layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
        return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                   for layer in layers)
    return int(sum(layer.last_step.get("kv_bytes_read", 0) for layer in cache.stats().layers))


def run_config(model: torch.nn.Module, name: str, context: int, s: Settings, bandwidth: float,
               mode: str = "eager") -> list[dict[str, Any]]:
    """Prefill one context at batch 1, then decode at every batch size; one row per batch size."""
    g = torch.Generator(device="cpu").manual_seed(context)
    ids = torch.randint(3, s.vocab, (1, context), generator=g).to(s.device)
    base = memory_mark(s.device)
    cache = make_cache(model, name, s, context, mode)
    rows = []
    with torch.no_grad():
        sync(s.device)
        t = time.perf_counter()
        for start in range(0, context, s.chunk):
            logits = forward(model, ids[:, start : start + s.chunk], cache)
        if hasattr(cache, "compress"):
            cache.compress()
        sync(s.device)
        prefill_s = time.perf_counter() - t
        prefill_peak = memory_peak(s.device, base)
        token = logits[:, -1].argmax(-1, keepdim=True)
        current = 1
        for batch in s.batches:
            if batch % current:
                raise ValueError(f"batch sizes must each divide the next, got {s.batches}")
            if batch != current:
                cache.batch_repeat_interleave(batch // current)
                token = token.repeat_interleave(batch // current, dim=0)
                current = batch
            decode_base = memory_mark(s.device)
            times = []
            for step in range(s.warmup + s.steps):
                sync(s.device)
                t = time.perf_counter()
                logits = forward(model, token, cache)
                sync(s.device)
                if step >= s.warmup:
                    times.append(time.perf_counter() - t)
                token = logits[:, -1].argmax(-1, keepdim=True)
            kv = kv_bytes_per_step(name, cache, s)
            bound_bytes = kv + (weight_bytes(model) if s.weights_in_bound else 0)
            graph = getattr(cache, "graph", None)
            rows.append({
                "policy": name, "kernels": "—" if name == "transformers" else os.environ.get("KVZOO_KERNELS", "auto"),
                "mode": mode if graph is None else f"graph ({graph.replays} replays, {graph.captures} captures)",
                "context": context, "batch": batch,
                "decode_ms": 1e3 * statistics.median(times),
                "prefill_s": prefill_s if batch == 1 else None,
                "prefill_peak_mib": prefill_peak if batch == 1 else None,
                "decode_peak_mib": memory_peak(s.device, decode_base),
                "kv_bytes_per_step": kv,
                "bandwidth_bound_ms": 1e3 * bound_bytes / bandwidth,
            })
    del cache
    if s.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def profile_step(model: torch.nn.Module, name: str, context: int, s: Settings) -> str:
    """One decode step under torch.profiler: kernels launched, host syncs, CPU and device time."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, s.vocab, (1, context)).to(s.device)
    cache = make_cache(model, name, s, context)
    with torch.no_grad():
        for start in range(0, context, s.chunk):
            logits = forward(model, ids[:, start : start + s.chunk], cache)
        if hasattr(cache, "compress"):
            cache.compress()
        token = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            forward(model, token, cache)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
        sync(s.device)
        with profile(activities=activities) as prof:
            forward(model, token, cache)
            sync(s.device)
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = sum(e.count for e in events if e.key in ("aten::item", "aten::_local_scalar_dense", "cudaMemcpyAsync",
                                                      "cudaStreamSynchronize", "cudaDeviceSynchronize"))
    lines = [f"profile of one decode step: {name}, context {context}, batch 1, {s.layers} layers",
             f"  aten ops: {aten} ({aten / s.layers:.0f} per layer); host syncs (item / memcpy / synchronize): {syncs}"]
    if s.device == "cuda":
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        device_us = sum(e.self_device_time_total for e in events)
        cpu_us = sum(e.self_cpu_time_total for e in events)
        lines.append(f"  CUDA kernels: {kernels}; device time {device_us / 1e3:.2f} ms; CPU time {cpu_us / 1e3:.2f} ms")
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    del cache
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], s: Settings, bandwidth: float) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    out = [f"Device {s.device}, {str(s.dtype).removeprefix('torch.')}, {s.layers} layers of DeepSeek-V2-Lite attention "
           f"(hidden {s.hidden}, {s.heads} heads, 512 + 64 latent), ratio {s.ratio:g}x, prefill in chunks of {s.chunk}, "
           f"median of {s.steps} decode steps. Copy bandwidth {bandwidth / 1e9:,.0f} GB/s.", "",
           "| policy | kernels | mode | context | batch | decode ms/step | bandwidth-bound ms | KV MiB/step | prefill s | prefill peak MiB | decode peak MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['policy']} | {r.get('kernels', '—')} | {r.get('mode', '—')} | {r['context']} | "
                       f"{r.get('batch', '—')} | {r['error']} | | | | | |")
            continue
        out.append(
            f"| {r['policy']} | {r['kernels']} | {r['mode']} | {r['context']} | {r['batch']} | {r['decode_ms']:.2f} | {r['bandwidth_bound_ms']:.3f} | "
            f"{r['kv_bytes_per_step'] / 2**20:,.1f} | {fmt(r['prefill_s'], '.2f')} | {fmt(r['prefill_peak_mib'], ',.0f')} | "
            f"{fmt(r['decode_peak_mib'], ',.0f')} |"
        )
    return "\n".join(out + [""] + [f"- {n}" for n in s.notes])


def parse(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", action="store_true", help="a toy size that runs anywhere in seconds (CI smoke test)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths (default 32768,131072)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes, each dividing the next (default 1,4)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="decode steps measured (default 48)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 4096)")
    p.add_argument("--ratio", type=float, default=32.0)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--weights", action="store_true", help="add the weight bytes a step reads to the bandwidth bound")
    p.add_argument("--profile", default=None, help="also profile one decode step of this policy")
    p.add_argument("--kernels", default=None, help="comma-separated KVZOO_KERNELS modes for kvzoo's policies "
                   "(torch, triton; default torch,triton on CUDA, torch elsewhere)")
    p.add_argument("--modes", default=None, help="comma-separated decode modes for kvzoo's policies: eager, capacity "
                   "(preallocated, not captured), graph (CUDA graphs; CUDA only). Default eager,graph on CUDA, eager "
                   "elsewhere")
    p.add_argument("--out", default="results/gpu_runtime", help="output stem: STEM.md and STEM.json")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    toy = args.toy or device == "cpu"
    policies = args.policies.split(",")
    unknown = [n for n in policies if n not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown}; valid: {', '.join(POLICIES)}")
    s = Settings(
        device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        layers=args.layers or (2 if toy else 8), hidden=256 if toy else 2048, heads=4 if toy else 16,
        intermediate=256 if toy else 1024, vocab=512 if toy else 32768,
        contexts=[int(c) for c in (args.contexts or ("1024,2048" if toy else "32768,131072")).split(",")],
        batches=[int(b) for b in (args.batches or ("1,2" if toy else "1,4")).split(",")],
        steps=args.steps or (6 if toy else 48), warmup=2 if toy else 4, chunk=args.chunk or (256 if toy else 4096),
        ratio=args.ratio, policies=policies, weights_in_bound=args.weights,
        kernels=(args.kernels or ("torch,triton" if device == "cuda" else "torch")).split(","),
    )
    bad = [k for k in s.kernels if k not in ("torch", "triton", "auto")]
    if bad:
        p.error(f"unknown --kernels {bad}; valid: torch, triton, auto")
    s.modes = (args.modes or ("eager,graph" if device == "cuda" else "eager")).split(",")
    bad = [m for m in s.modes if m not in ("eager", "capacity", "graph")]
    if bad or ("graph" in s.modes and device != "cuda"):
        p.error(f"--modes {s.modes}: valid are eager, capacity and graph (graph needs CUDA)")
    if toy:
        s.notes.append("toy size (hidden 256, 4 heads, the real 512 + 64 row): a smoke run, not a measurement of a GPU")
    return s, args


def main(argv: list[str] | None = None) -> int:
    s, args = parse(argv)
    model = build_model(s)
    bandwidth = copy_bandwidth(s.device, gib=0.125 if s.device == "cpu" else 1.0)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    previous = os.environ.get("KVZOO_KERNELS")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(s).items()}

    def write() -> str:  # after every configuration: a run cut short keeps what it measured
        report = markdown(rows, s, bandwidth)
        out.with_suffix(".md").write_text(report + "\n")
        out.with_suffix(".json").write_text(json.dumps({"settings": settings, "bandwidth_bytes_per_s": bandwidth,
                                                        "rows": rows}, indent=1) + "\n")
        return report

    for context in s.contexts:
        for name in s.policies:
            for kernels in s.kernels if name != "transformers" else s.kernels[:1]:
                for mode in s.modes if name != "transformers" else ["eager"]:
                    os.environ["KVZOO_KERNELS"] = kernels
                    try:
                        rows.extend(run_config(model, name, context, s, bandwidth, mode))
                    except Exception as exc:  # OOM, and Triton's CompilationError / OutOfResources (not RuntimeErrors)
                        traceback.print_exc(file=sys.stderr)
                        rows.append({"policy": name, "kernels": kernels, "mode": mode, "context": context,
                                     "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                        if s.device == "cuda":
                            torch.cuda.empty_cache()
                    write()
                    print(f"[{time.perf_counter() - started:6.1f} s] {name} ({kernels}, {mode}) at {context}",
                          file=sys.stderr)
    if previous is None:
        os.environ.pop("KVZOO_KERNELS", None)
    else:
        os.environ["KVZOO_KERNELS"] = previous
    s.notes.append(f"wall time {time.perf_counter() - started:.0f} s")
    report = write()
    if args.profile:
        report += "\n\n```\n" + profile_step(model, args.profile, s.contexts[0], s) + "\n```\n"
        out.with_suffix(".md").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
