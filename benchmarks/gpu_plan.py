"""What ``make gpu-check`` runs, in what order, and what each cell is expected to cost on one H200.

Plans (``gpu_check.py --plan``):

* ``headline`` (the first run's, the default): the native CPU build (a row of its own, before anything is timed),
  the headline kernels (MLA 16 heads, 32k / 128k rows, batch 1 / 8), then the headline table -- one decode step of
  ``full``, transformers' own DeepseekV2, VestigeKV 32x (with its sketch retriever) and Quest 32x at 32k and 128k,
  batch 1 and 8, eager and CUDA graph, PyTorch and Triton. It fits the budget at 1.5x its estimates
  (``tests/test_gpu_check.py`` holds that).
* ``more`` (a second run's): the retrieving-step kernels, batch 4, GQA, the index scans, streaming_llm and VestigeKV
  without its retriever, the sweep of kernel configurations.
* ``all``: both, in that order (what the toy run in CI makes).

**Expected seconds are counts times rates.** The counts are measured on the toy run and committed in
``gpu_costs.json`` (``python benchmarks/gpu_check.py --toy --plan all --out OUT`` then ``python
benchmarks/gpu_plan.py --costs-from OUT/rows.jsonl`` rewrites it): per arm (policy, kernels), the ops one decode step
launches per layer, the ops its setup launches per layer (transplant, compress, batch repeat), the KV bytes a step
reads relative to ``full``'s, and which Triton ops it calls. The rates are the H200's (:data:`RATES`): those measured
there in an earlier round say where; the three never measured (a Triton compile, a prefill's arithmetic rate, a
cell's fixed overhead) say they are assumptions. The summary prints each cell's seconds beside its plan, and the
worker rescales the estimates of a part by what its finished cells took. A decode cell:

    setup launches x layers x host s/launch + the bytes it copies / copy bandwidth
    + warm-up and timed steps, each  eager: max(launches x host s/launch, bytes / bandwidth + launches x device s)
                                     graph: bytes / bandwidth + launches x device s/launch (the replay; its first
                                            two steps are eager: the warm-up on the capture's stream, the capture)
    + the Triton compiles of the first cell of an arm that calls an op + a cell's fixed overhead
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COSTS_FILE = HERE / "gpu_costs.json"
PLANS = ("headline", "more", "all")

CONTEXTS = (32768, 131072)
BATCHES = (1, 8)
HEADLINE_POLICIES = ("full", "vestige+sketch", "quest")
OTHER_POLICIES = ("streaming_llm", "vestige")
DECODE_ARMS = (("torch", "eager"), ("triton", "eager"), ("triton", "graph"), ("torch", "graph"))
OTHER_ARMS = (("torch", "eager"), ("triton", "eager"), ("triton", "graph"))

# The full-size run (gpu_runtime.settings, gpu_kernels): the model's layers, its attention heads, one MLA row's bytes.
LAYERS, HEADS, HIDDEN, INTERMEDIATE = 8, 16, 2048, 1024
ROW_BYTES = 576 * 2  # one absorbed MLA row in bf16
HF_ROW_BYTES = HEADS * (192 + 128) * 2  # transformers' DeepseekV2 caches per-head keys (192) and values (128)
WARMUP, STEPS, CHUNK = 4, 16, 4096

RATES = {
    # measured on the H200 with kvzoo's first release (a torch.profiler look at `full`, 32k, 8 layers, batch 1):
    # ~550 kernel launches per step, ~16 ms of CPU dispatch, ~6 ms of GPU time
    "host_s_per_launch": 16e-3 / 550,
    "device_s_per_launch": 6e-3 / 550,
    "copy_bytes_per_s": 4.25e12,  # measured copy bandwidth there (4,251 GB/s)
    "worker_start_s": 20.0,  # imports, the CUDA context, the copy bandwidth's measurement
    # assumptions (never measured here): the first run's rows replace them
    "triton_compile_s": 4.0,  # one Triton kernel's first compile ("a few seconds")
    "prefill_flops_per_s": 1e14,  # bf16, plain-PyTorch chunked attention: ~10 % of the H200's dense peak
    "cell_overhead_s": 0.5,  # Python, the allocator, logits to the host, a cell's bookkeeping
    "kernel_timing_s": 0.25,  # one kernel cell's do_bench calls (eager, graph, split alone)
    "native_build_s": 45.0,  # the CPU ops' first build (measured 30-49 s on 2 cores; 16 there, cached after)
}
TOY = {"worker_start_s": 8.0, "kernel": 1.5, "prefill": 1.0, "decode": 1.0, "interpreted": 8.0, "build": 60.0}


def load_costs(path: Path = COSTS_FILE) -> dict[str, Any]:
    """The committed counts (see the module docstring); a KeyError names an arm that has none."""
    return json.loads(path.read_text())


def arm_costs(costs: dict[str, Any], policy: str, kernels: str) -> dict[str, Any]:
    key = "transformers" if policy == "transformers" else f"{policy} {kernels}"
    try:
        return costs["arms"][key]
    except KeyError:
        raise KeyError(f"{COSTS_FILE.name} has no counts for the arm {key!r} (arms: {sorted(costs['arms'])}): run "
                       "the toy plan 'all' and --costs-from its rows") from None


# --- the estimates ---------------------------------------------------------------------------------------------
def step_s(launches: float, kv_bytes: float, graph: bool, rates: dict[str, float] = RATES) -> float:
    device = kv_bytes / rates["copy_bytes_per_s"] + launches * rates["device_s_per_launch"]
    return device if graph else max(launches * rates["host_s_per_launch"], device)


def full_kv_bytes(context: int, batch: int) -> float:
    """What ``full``'s decode step reads at full size: every layer's rows."""
    return LAYERS * context * batch * ROW_BYTES


def decode_s(arm: dict[str, Any], policy: str, mode: str, context: int, batch: int, compiles: int,
             rates: dict[str, float] = RATES) -> float:
    """One decode cell at full size (module docstring)."""
    kv = arm["kv_ratio"] * full_kv_bytes(context, batch)
    launches = arm["step_launches_per_layer"] * LAYERS
    row_bytes = HF_ROW_BYTES if policy == "transformers" else ROW_BYTES
    copied = LAYERS * context * row_bytes * (1 + batch)  # the prefilled rows copied in, repeated to the batch
    setup = arm["setup_launches_per_layer"] * LAYERS * rates["host_s_per_launch"] + copied / rates["copy_bytes_per_s"]
    eager = step_s(launches, kv, graph=False, rates=rates)
    if mode == "graph":
        steps = 2 * eager + (WARMUP + STEPS - 2) * step_s(launches, kv, graph=True, rates=rates)
    else:
        steps = (WARMUP + STEPS) * eager
    return setup + steps + compiles * rates["triton_compile_s"] + rates["cell_overhead_s"]


def prefill_s(kind: str, context: int, rates: dict[str, float] = RATES) -> float:
    """One prefill at full size in chunks of :data:`CHUNK`: causal attention's and the layers' matmuls over the
    assumed arithmetic rate. kvzoo's absorbed form scores 576-dim rows and reads 512-dim values per head;
    transformers' decompressed form 192 and 128."""
    dims = (192 + 128) if kind == "transformers" else (576 + 512)
    attention = LAYERS * HEADS * dims * context * context  # 2 flops per multiply-add, half the pairs (causal)
    per_layer = HIDDEN * HEADS * 192 + HIDDEN * 576 + 512 * HEADS * 256 + HEADS * 128 * HIDDEN + 3 * HIDDEN * INTERMEDIATE
    linear = 2 * LAYERS * per_layer * context
    chunks = math.ceil(context / CHUNK)
    return (attention + linear) / rates["prefill_flops_per_s"] + chunks * rates["cell_overhead_s"] / 4 \
        + rates["cell_overhead_s"]


def kernel_s(compiles: int, rates: dict[str, float] = RATES) -> float:
    return rates["kernel_timing_s"] + compiles * rates["triton_compile_s"] + rates["cell_overhead_s"]


# --- the plan ----------------------------------------------------------------------------------------------------
class _Planner:
    """Appends cells in order, each with its expected seconds; remembers what was compiled and prefilled."""

    def __init__(self, toy: bool, costs: dict[str, Any] | None) -> None:
        self.toy, self.costs = toy, costs
        self.cells: list[dict[str, Any]] = []
        self.compiled: set = set()
        self.prefilled: set = set()

    def add(self, cell_id: str, part: str, group: str, params: dict[str, Any], expected: float) -> None:
        self.cells.append({"id": cell_id, "part": part, "group": group, "params": params,
                           "expected_s": round(expected, 2)})

    def build(self, group: str) -> None:
        self.add("build native CPU ops", "build", group, {}, TOY["build"] if self.toy else RATES["native_build_s"])

    def kernel(self, group: str, model: str, case: str, batch: int, rows: int) -> None:
        kind = (model, case.split()[0], batch == 1)  # a new specialisation compiles (split and merge kernels)
        compiles = 0 if kind in self.compiled else 2
        self.compiled.add(kind)
        self.add(f"kernel {model} {case} B{batch} {rows}", "kernel", group,
                 {"model": model, "case": case, "batch": batch, "rows": rows},
                 TOY["kernel"] if self.toy else kernel_s(compiles))

    def decode(self, group: str, policy: str, kernels: str, mode: str, context: int, batch: int) -> None:
        kind = "transformers" if policy == "transformers" else "kvzoo"
        if (kind, context) not in self.prefilled:  # the prefill every decode cell of this context starts from
            self.prefilled.add((kind, context))
            self.add(f"prefill {kind} {context}", "prefill", group, {"kind": kind, "context": context},
                     TOY["prefill"] if self.toy else prefill_s(kind, context))
        label = "—" if policy == "transformers" else kernels
        compiles = 0
        if kernels == "triton" and policy != "transformers":
            new = {(policy, op, batch == 1) for op in self._arm(policy, kernels).get("triton_ops", [])} - self.compiled
            self.compiled |= new
            compiles = 2 * len(new)  # an op's split and merge kernels
        if self.toy:
            expected = TOY["decode"] + (TOY["interpreted"] if kernels == "triton" else 0.0)
        else:
            expected = decode_s(self._arm(policy, kernels), policy, mode, context, batch, compiles)
        self.add(f"runtime {policy} {label} {mode} B{batch} {context}", "decode", group,
                 {"policy": policy, "kernels": kernels, "mode": mode, "context": context, "batch": batch}, expected)

    def sweep(self, group: str, model: str, case: str, batch: int, rows: int, seconds: float) -> None:
        self.add(f"sweep {model} {case} B{batch} {rows}", "sweep", group,
                 {"model": model, "case": case, "batch": batch, "rows": rows}, seconds)

    def _arm(self, policy: str, kernels: str) -> dict[str, Any]:
        if self.costs is None:
            return {}
        return arm_costs(self.costs, policy, kernels)


def plan(toy: bool, which: str = "headline", costs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every cell of ``which`` plan, most important first: ``{"id", "part", "group", "params", "expected_s"}``."""
    if which not in PLANS:
        raise ValueError(f"--plan must be one of {PLANS}, got {which!r}")
    p = _Planner(toy, costs if costs is not None or toy else load_costs())
    if which in ("headline", "all"):
        (_toy_headline if toy else _headline)(p)
    if which in ("more", "all"):
        if which == "more":
            p.build("0 the native CPU build (before anything is timed)")
        (_toy_more if toy else _more)(p)
    return p.cells


def _headline(p: _Planner) -> None:
    p.build("0 the native CPU build (before anything is timed)")
    group = "1 headline kernels: MLA 16 heads, 32k / 128k rows, batch 1 / 8"
    for case in ("pool", "dense"):
        for rows in CONTEXTS:
            for batch in BATCHES:
                p.kernel(group, "mla16", case, batch, rows)
    for n, context in enumerate(CONTEXTS):
        for batch in BATCHES:
            group = (f"{2 + 2 * n + (batch > 1)} headline runtime: {context // 1024}k, batch {batch}, full / "
                     "transformers / vestige 32x / quest 32x")
            for policy in HEADLINE_POLICIES:
                for kernels, mode in DECODE_ARMS:
                    p.decode(group, policy, kernels, mode, context, batch)
            p.decode(group, "transformers", "torch", "eager", context, batch)


def _more(p: _Planner) -> None:
    group = "6 retrieving-step kernels: MLA, 32k / 128k, batch 1 / 8"
    for case in ("step 1/32 + 1024", "gathered 1024", "step 1/32 + 16", "gathered 16"):
        for rows in CONTEXTS:
            for batch in BATCHES:
                p.kernel(group, "mla16", case, batch, rows)
    group = "7 kernels: batch 4, GQA, index scans"
    for case in ("pool", "dense", "step 1/32 + 1024", "gathered 1024"):
        for rows in CONTEXTS:
            p.kernel(group, "mla16", case, 4, rows)
    for case in ("pool", "dense"):
        for rows in CONTEXTS:
            for batch in BATCHES:
                p.kernel(group, "gqa32/8", case, batch, rows)
    for case in ("sketch", "pages"):
        for rows in CONTEXTS:
            for batch in BATCHES:
                p.kernel(group, "mla16", case, batch, rows)
    for n, context in enumerate(CONTEXTS):
        group = f"{8 + n} runtime at {context // 1024}k: streaming_llm 32x, vestige 32x without its retriever"
        for batch in BATCHES:
            for policy in OTHER_POLICIES:
                for kernels, mode in OTHER_ARMS:
                    p.decode(group, policy, kernels, mode, context, batch)
    group = "10 sweep of (BLOCK_N, warps, stages, splits)"
    for model, case, batch in (("mla16", "pool", 1), ("mla16", "pool", 8), ("mla16", "step 1/32 + 1024", 1),
                               ("gqa32/8", "pool", 8)):
        p.sweep(group, model, case, batch, CONTEXTS[0], 25.0)


TOY_ROWS, TOY_BATCHES, TOY_CONTEXT, TOY_FETCHED = 64, (1, 2), 512, 16
TOY_ARMS = (("torch", "eager"), ("torch", "graph"))  # graph: a stand-in that checks the capture (gpu_runtime)


def _toy_headline(p: _Planner) -> None:
    p.build("0 the native CPU build (toy)")
    group = "1 headline kernels (toy)"
    for case in ("pool", "dense"):
        for batch in TOY_BATCHES:
            p.kernel(group, "mla16", case, batch, TOY_ROWS)
    group = "2 headline runtime (toy)"
    for batch in TOY_BATCHES:
        for policy in HEADLINE_POLICIES:
            for kernels, mode in TOY_ARMS:
                p.decode(group, policy, kernels, mode, TOY_CONTEXT, batch)
        p.decode(group, "transformers", "torch", "eager", TOY_CONTEXT, batch)
    for policy in HEADLINE_POLICIES:  # the kernels in the interpreter, checked against torch
        p.decode(group, policy, "triton", "eager", TOY_CONTEXT, 1)
    p.decode(group, "vestige+sketch", "triton", "graph", TOY_CONTEXT, 1)


def _toy_more(p: _Planner) -> None:
    group = "3 other kernels (toy)"
    for case in (f"step 1/32 + {TOY_FETCHED}", f"gathered {TOY_FETCHED}"):
        p.kernel(group, "mla16", case, 1, TOY_ROWS)
    for case in ("dense", "pool"):
        p.kernel(group, "gqa32/8", case, 1, TOY_ROWS)
    for case in ("sketch", "pages"):
        p.kernel(group, "mla16", case, 1, TOY_ROWS)
    group = "4 other policies (toy)"
    for policy in OTHER_POLICIES:
        for kernels, mode in (("torch", "eager"), ("triton", "eager"), ("torch", "graph")):
            p.decode(group, policy, kernels, mode, TOY_CONTEXT, 1)
    p.sweep("5 sweep (toy)", "mla16", "pool", 1, TOY_ROWS, 10.0)


def fake_cells(spec: str) -> list[dict[str, Any]]:
    """``SLEEP[:EXPECTED],...`` -> cells that sleep (the deadline's tests): each expects EXPECTED s (default SLEEP)."""
    out = []
    for i, item in enumerate(filter(None, spec.split(","))):
        sleep, _, expected = item.partition(":")
        out.append({"id": f"fake {i} sleeps {float(sleep):g} s", "part": "fake", "group": "0 fake cells (a test)",
                    "params": {"sleep": float(sleep)}, "expected_s": float(expected or sleep)})
    return out


def select(cells: list[dict[str, Any]], only: list[str]) -> list[dict[str, Any]]:
    """The cells whose id contains one of ``only`` (all when empty); a decode cell keeps its prefill."""
    if not only:
        return cells
    kept = [c for c in cells if any(o in c["id"] for o in only)]
    needed = {f"prefill {'transformers' if c['params']['policy'] == 'transformers' else 'kvzoo'} "
              f"{c['params']['context']}" for c in kept if c["part"] == "decode"}
    return [c for c in cells if c in kept or c["id"] in needed]


def total_s(cells: list[dict[str, Any]], toy: bool, factor: float = 1.0) -> float:
    """The plan's expected seconds with a worker's start-up, its estimates scaled by ``factor``."""
    start = TOY["worker_start_s"] if toy else RATES["worker_start_s"]
    return factor * (start + sum(c["expected_s"] for c in cells))


# --- the counts, from a toy run's rows ------------------------------------------------------------------------
def costs_from_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm (policy, kernels), from the toy run's decode rows (``gpu_runtime`` records the counts): the median over
    the arm's rows of its step's and its setup's launches per layer (a Triton arm: its PyTorch arm's, below), its KV
    bytes against ``full``'s (same batch), and the Triton ops it called."""
    decode = [r for r in rows if r.get("part") == "decode" and r.get("status") == "ok" and r.get("step_launches")]
    full = {r["batch"]: r["kv_bytes_per_step"] for r in decode if r["policy"] == "full"
            and (r["kernels"], r["mode"]) == ("torch", "eager")}
    arms: dict[str, dict[str, list]] = {}
    for r in decode:
        key = "transformers" if r["policy"] == "transformers" else f"{r['policy']} {r['kernels']}"
        arm = arms.setdefault(key, {"step": [], "setup": [], "kv": [], "ops": set()})
        arm["step"].append(r["step_launches"] / r["layers"])
        arm["setup"].append(r["setup_launches"] / r["layers"])
        if r["batch"] in full and r.get("kv_bytes_per_step"):
            arm["kv"].append(r["kv_bytes_per_step"] / full[r["batch"]])
        arm["ops"] |= set(r.get("kernel_calls") or {})
    missing = {f"{p} {k}" for p in HEADLINE_POLICIES + OTHER_POLICIES for k in ("torch", "triton")} \
        | {"transformers"}
    missing -= set(arms)
    if missing:
        raise ValueError(f"the rows hold no counts for {sorted(missing)}: run the toy plan 'all'")
    out = {}
    for key, a in sorted(arms.items()):
        # a Triton arm launches what its PyTorch arm does at most (a kernel stands for several ops); on CPU its rows
        # run the kernels in Triton's interpreter, whose own tensor ops the trace would count: the PyTorch arm's counts
        counted = arms[key.replace(" triton", " torch")] if key.endswith(" triton") else a
        out[key] = {"step_launches_per_layer": round(_median(counted["step"]), 1),
                    "setup_launches_per_layer": round(_median(counted["setup"]), 1),
                    "kv_ratio": round(_median(a["kv"]), 4) if a["kv"] else 1.0, "triton_ops": sorted(a["ops"])}
    return {"arms": out}


def _median(values: list[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gpu-check's plan: print it, or rewrite gpu_costs.json")
    parser.add_argument("--costs-from", type=Path, metavar="ROWS", help="a toy run's rows.jsonl: rewrite the counts")
    parser.add_argument("--commit", default="", help="the commit the rows were measured at (recorded)")
    args = parser.parse_args(argv)
    if args.costs_from is None:
        parser.error("--costs-from ROWS is required (to print the plan: gpu_check.py --dry-run)")
    rows = [json.loads(line) for line in args.costs_from.read_text().splitlines() if line.strip()]
    costs = {"measured_by": "python benchmarks/gpu_check.py --toy --plan all --out OUT && python "
                            "benchmarks/gpu_plan.py --costs-from OUT/rows.jsonl",
             "commit": args.commit, "toy_layers": 2, **costs_from_rows(rows)}
    COSTS_FILE.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"wrote {COSTS_FILE} ({len(costs['arms'])} arms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
