"""The Triton kernels on a GPU: bytes per second against the measured copy bandwidth (< 200 s on an H200).

    python benchmarks/gpu_kernels.py                  # CUDA: 32k / 128k rows, batch 1, 4 and 8, the sweep
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --toy   # any machine: toy sizes in the interpreter

Decode attention in the forms the runtime launches, for DeepSeek-V2-Lite's absorbed MLA geometry (16 heads over
one latent group of 512 + 64 dims, bf16 rows) and a GQA model (32 query heads over 8 KV heads of 128 dims):

* ``dense``: all ``N`` rows, no flags (what ``full`` reads each step);
* ``pool``: the ``N`` rows of a preallocated tier with valid flags and a device length (1/16 of the rows
  invalid): the runtime's tier;
* ``gathered f``: ``f`` rows of an archive of ``N`` named by indices (MLA);
* ``step 1/32 + f``: the runtime's retrieving step -- the ``N / 32`` rows kept in the tier (flags; deferred, its
  best score for the retriever) then the ``f`` staged rows (valid and per-head flags), merged into the first
  part by the merge kernel (MLA, ``f`` = 16 and 1,024);

and the index scans (VestigeKV's certified sketch scan reduced over the heads, Quest's page scan). Each case is
timed twice: with the host's launch overhead (``triton.testing.do_bench``: the Python launcher, the flag packing,
one kernel after the other) and without it (``do_bench_cudagraph``: the same calls replayed from a CUDA graph).
Inputs are cycled -- as many copies as make the working set exceed twice the 50 MB L2 -- so every call reads
from HBM. ``split`` times the split kernels alone (the merge's share is the difference). Each line gives the
bytes the op must read (rows, flags, indices, queries; outputs written), those bytes per second and their
fraction of the copy bandwidth (``2 x bytes / time`` of a 1 GiB device copy, measured first). Before timing,
each op is checked against the fp32 reference on the same inputs (a failing check is reported, the run goes
on). Then a sweep of (``BLOCK_N``, warps, stages, splits) over a few cases prints the best configuration of
each. Markdown and JSON go to ``--out`` (default ``results/gpu_kernels.{md,json}``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvzoo.bench.metrics import copy_bandwidth

MLA = {"heads": 16, "groups": 1, "latent": 512, "branch": 64}  # DeepSeek-V2-Lite's absorbed MLA rows
GQA = {"heads": 32, "groups": 8, "dim": 128}  # 32 query heads over 8 KV heads of 128 dims
TOY_MLA = {"heads": 16, "groups": 1, "latent": 32, "branch": 16}
TOY_GQA = {"heads": 8, "groups": 2, "dim": 32}
SKETCH_WIDTH = 131  # rank 64 + eta + branch 64 + two norms: vestige's index entry
PAGE = 16
KEEP = 32
FETCHED = (16, 1024)
L2_BYTES = 50 * 2**20
# a kernel's output against the fp32 reference on the same inputs: relative error allowed per input dtype
CHECK = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@dataclass
class Case:
    """One op on one set of inputs: ``make(copy)`` builds copy ``copy`` of the inputs, ``run(inputs, **tune)`` runs
    the op (``split=True``: the split kernels alone), ``check(inputs)`` the fp32 reference of ``run``'s output."""

    op: str
    model: str
    batch: int
    rows: int
    case: str
    bytes: int
    make: Callable[[int], Any]
    run: Callable[..., torch.Tensor]
    check: Callable[[Any], torch.Tensor]
    split: Callable[[Any], Any] | None = None
    results: dict[str, Any] = field(default_factory=dict)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    finite = torch.isfinite(b)
    scale = b[finite].abs().max().clamp(min=1e-30)
    return float(((a - b)[finite].abs().max() / scale).item())


def _randn(g: torch.Generator, *shape, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def attention_cases(args: argparse.Namespace, dtype: torch.dtype) -> list[Case]:
    from kvzoo.kernels import decode_attention as da

    device, scaling = args.device, args.scaling
    mla, gqa = (TOY_MLA, TOY_GQA) if args.toy else (MLA, GQA)
    out: list[Case] = []

    def generator(seed: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed)

    def mla_rows(g, B, n):
        return _randn(g, B, 1, n, mla["latent"] + mla["branch"], device=device, dtype=dtype)

    def mla_query(g, B):
        return _randn(g, B, mla["heads"], mla["latent"] + mla["branch"], device=device, dtype=dtype)

    def valid_flags(g, B, G, n):
        return torch.rand(B, G, n, generator=g, device=device) >= 1 / 16

    def one(inputs, **tune):
        query, sources = inputs
        return da._triton(query, da._validate(query, sources, scaling, None), scaling, tune.pop("splits", None),
                          tune=tune or None)[0]

    def one_split(inputs):
        query, sources = inputs
        return da._triton(query, da._validate(query, sources, scaling, None), scaling, None, merge=False)

    def one_reference(inputs):
        query, sources = inputs
        return da.decode_attention_reference(query.float(), sources, scaling)[0]

    for rows, batch in itertools.product(args.rows, args.batches):
        width = mla["latent"] + mla["branch"]
        row_bytes = width * torch.empty((), dtype=dtype).element_size()
        q_bytes = batch * mla["heads"] * width * 2 + batch * mla["heads"] * (mla["latent"] * 2 + 4)

        def dense(copy, B=batch, n=rows):
            g = generator(1000 * copy + n + B)
            return mla_query(g, B), [da.Rows(mla_rows(g, B, n), value_width=mla["latent"])]

        def pool(copy, B=batch, n=rows):
            g = generator(1000 * copy + n + B + 1)
            length = torch.full((B,), n, dtype=torch.int32, device=device)
            return mla_query(g, B), [da.Rows(mla_rows(g, B, n), value_width=mla["latent"],
                                             valid=valid_flags(g, B, 1, n), length=length)]

        out.append(Case("decode_attention", "mla16", batch, rows, "dense", batch * rows * row_bytes + q_bytes,
                        dense, one, one_reference, one_split))
        out.append(Case("decode_attention", "mla16", batch, rows, "pool", batch * rows * (row_bytes + 4) + q_bytes,
                        pool, one, one_reference, one_split))
        for f in args.fetched:
            def gathered(copy, B=batch, n=rows, f=f):
                g = generator(1000 * copy + n + B + f + 2)
                idx = torch.randint(0, n, (B, 1, f), generator=g, device=device)
                length = torch.full((B,), f, dtype=torch.int32, device=device)
                return mla_query(g, B), [da.Rows(mla_rows(g, B, n), value_width=mla["latent"], indices=idx,
                                                 valid=valid_flags(g, B, 1, f), length=length)]

            out.append(Case("decode_attention", "mla16", batch, rows, f"gathered {f}",
                            batch * f * (row_bytes + 12) + q_bytes, gathered, one, one_reference, one_split))

            def step_inputs(copy, B=batch, n=rows, f=f):
                g = generator(1000 * copy + n + B + f + 3)
                kept = max(1, n // KEEP)
                tier = da.Rows(mla_rows(g, B, kept), value_width=mla["latent"], valid=valid_flags(g, B, 1, kept))
                head_valid = torch.rand(B, mla["heads"], f, generator=g, device=device) < 0.5
                fetched = da.Rows(mla_rows(g, B, f), value_width=mla["latent"], valid=valid_flags(g, B, 1, f),
                                  head_valid=head_valid)
                return mla_query(g, B), [tier, fetched]

            def step(inputs, **tune):
                query, (tier, fetched) = inputs
                splits = tune.pop("splits", None)
                first_c = da._validate(query, [tier], scaling, None)
                out_t, lse_t, _ = da._triton(query, first_c, scaling, splits, best=True, out_dtype=torch.float32,
                                             tune=tune or None)
                return da._triton(query, da._validate(query, [fetched], scaling, None), scaling, splits,
                                  prior=(out_t, lse_t), tune=tune or None)[0]

            kept_bytes = max(1, rows // KEEP) * (row_bytes + 4) + f * (row_bytes + 4 + 4 * mla["heads"] // 32 + 4)
            out.append(Case("decode_attention", "mla16", batch, rows, f"step 1/{KEEP} + {f}",
                            batch * kept_bytes + 2 * q_bytes, step_inputs, step, one_reference))

        # GQA: 32 query heads over 8 KV heads of 128 dims, keys and values apart
        G, H, D = gqa["groups"], gqa["heads"], gqa["dim"]
        row_bytes = 2 * D * torch.empty((), dtype=dtype).element_size()
        q_bytes = batch * H * D * 4

        def gqa_inputs(copy, B=batch, n=rows, flags=False, G=G, H=H, D=D):
            g = generator(1000 * copy + n + B + 5)
            query = _randn(g, B, H, D, device=device, dtype=dtype)
            keys = _randn(g, B, G, n, D, device=device, dtype=dtype)
            values = _randn(g, B, G, n, D, device=device, dtype=dtype)
            if not flags:
                return query, [da.Rows(keys, values)]
            length = torch.full((B,), n, dtype=torch.int32, device=device)
            return query, [da.Rows(keys, values, valid=valid_flags(g, B, G, n), length=length)]

        out.append(Case("decode_attention", "gqa32/8", batch, rows, "dense", batch * G * rows * row_bytes + q_bytes,
                        gqa_inputs, one, one_reference, one_split))
        out.append(Case("decode_attention", "gqa32/8", batch, rows, "pool",
                        batch * G * rows * (row_bytes + 4) + q_bytes,
                        lambda copy, B=batch, n=rows: gqa_inputs(copy, B, n, True), one, one_reference, one_split))
    return out


def scan_cases(args: argparse.Namespace) -> list[Case]:
    from kvzoo.kernels import index_scan as scan

    device, scaling = args.device, args.scaling
    mla = TOY_MLA if args.toy else MLA
    out = []
    for rows, batch in itertools.product(args.rows, args.batches):
        for kind in ("sketch", "pages"):
            if kind == "sketch":
                width, n, dtype = SKETCH_WIDTH if not args.toy else mla["latent"] // 8 + 3 + mla["branch"], rows, \
                    torch.float32
            else:
                width, n = 2 * (mla["latent"] + mla["branch"]) + 1, max(1, rows // PAGE)
                dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter gets bf16 wrong

            def make(copy, B=batch, n=n, width=width, dtype=dtype):
                g = torch.Generator(device=device).manual_seed(1000 * copy + n + B + 7)
                return (torch.randn(B, 1, mla["heads"], width, generator=g, device=device),
                        torch.randn(B, 1, n, width, generator=g, device=device).to(dtype),
                        torch.randn(B, 1, mla["heads"], generator=g, device=device))

            size = batch * n * width * torch.empty((), dtype=dtype).element_size() + batch * mla["heads"] * width * 4
            if kind == "sketch":
                out.append(Case("index_scan_reduce", "mla16", batch, rows, "sketch", size, make,
                                lambda x, **_: scan.index_scan_reduce_triton(x[0], x[1], scaling, x[2]),
                                lambda x: scan.index_scan_reduce_reference(x[0], x[1].float(), scaling, x[2])))
            else:
                out.append(Case("index_scan", "mla16", batch, rows, "pages", size, make,
                                lambda x, **_: scan.index_scan_triton(x[0], x[1], scaling),
                                lambda x: scan.index_scan_reference(x[0], x[1].float(), scaling)))
    return out


def timer(device: str):
    """``time(fn, graph)`` -> ms per call: ``do_bench`` (host overhead included) or ``do_bench_cudagraph`` on CUDA
    (None on CPU), one wall time elsewhere (the interpreter: a smoke run, not a measurement)."""
    def time_it(fn: Callable[[], Any], graph: bool) -> float | None:
        if device == "cuda":
            from triton.testing import do_bench, do_bench_cudagraph

            if graph:
                return float(do_bench_cudagraph(fn, rep=20))
            return float(do_bench(fn, warmup=5, rep=25))
        if graph:
            return None
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    return time_it


def copies_for(case: Case, device: str) -> int:
    """Copies of the inputs to cycle so that the working set exceeds twice the L2 (1 on CPU)."""
    if device != "cuda":
        return 1
    return max(1, min(256, math.ceil(2 * L2_BYTES / max(1, case.bytes)), (8 * 2**30) // max(1, case.bytes)))


def measure(case: Case, args: argparse.Namespace, bandwidth: float, tol: float, time_it) -> None:
    row = case.results
    inputs = [case.make(i) for i in range(copies_for(case, args.device))]
    row["copies"] = len(inputs)
    row["rel_error"] = rel_error(case.run(inputs[0]), case.check(inputs[0]))
    row["check"] = "ok" if row["rel_error"] <= tol else f"FAILED (> {tol:g})"
    counter = itertools.count()

    def cycled(fn):
        return lambda: fn(inputs[next(counter) % len(inputs)])

    for key, graph in (("eager_ms", False), ("graph_ms", True)):
        row[key] = time_it(cycled(case.run), graph)
    if case.split is not None:
        row["split_graph_ms"] = time_it(cycled(case.split), True)
        if row["split_graph_ms"] is None:
            row["split_eager_ms"] = time_it(cycled(case.split), False)
    best = row["graph_ms"] if row["graph_ms"] is not None else row["eager_ms"]
    row.update(bytes=case.bytes, gb_per_s=case.bytes / best / 1e6, of_copy=case.bytes / (best / 1e3) / bandwidth)
    inputs.clear()  # free the copies before the next case


def sweep(cases: list[Case], args: argparse.Namespace, time_it) -> list[dict[str, Any]]:
    """(BLOCK_N, warps, stages, splits) over a few cases: every point checked, the best printed per case."""
    from kvzoo.kernels import decode_attention as da

    if args.toy:
        grid = [{"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}]
        factors = (2.0,)
    else:
        grid = [{"BLOCK_N": n, "num_warps": w, "num_stages": s} for n in (32, 64) for w in (4, 8) for s in (3, 4)]
        factors = (0.5, 1.0, 2.0)
    wanted = {("mla16", 1, "pool"), ("mla16", 8, "pool"), ("mla16", 1, f"step 1/{KEEP} + {max(args.fetched)}"),
              ("gqa32/8", 8, "pool")}
    picked = [c for c in cases if c.op == "decode_attention" and (c.model, c.batch, c.case) in wanted
              and c.rows == args.rows[0]][: 1 if args.toy else None]
    out = []
    for case in picked:
        inputs = case.make(0)
        reference = case.check(inputs)
        query, sources = inputs
        src = da._validate(query, sources[:1], args.scaling, None)[0]
        base_cfg, base_splits = da._split_launch(query, src, None)
        points = []
        for tune, factor in itertools.product(grid, factors):
            splits = max(1, round(base_splits * factor))
            point = {**tune, "splits": splits}
            try:
                err = rel_error(case.run(inputs, **dict(point)), reference)
                ms = time_it(lambda p=point, c=case, x=inputs: c.run(x, **dict(p)), args.device == "cuda")
                points.append({**point, "ms": ms, "rel_error": err, "ok": err <= CHECK[query.dtype]})
            except Exception as err:  # a configuration that does not compile or fit is a row, not the end
                points.append({**point, "error": f"{type(err).__name__}: {err}"[:200]})
        timed = [p for p in points if p.get("ok")]
        best = min(timed, key=lambda p: p["ms"]) if timed else None
        shipped = {"BLOCK_N": base_cfg.BLOCK_N, "num_warps": base_cfg.num_warps, "num_stages": base_cfg.num_stages,
                   "splits": base_splits}
        out.append({"model": case.model, "batch": case.batch, "rows": case.rows, "case": case.case,
                    "shipped": shipped, "best": best, "points": points})
        print(f"sweep {case.model} B{case.batch} {case.rows:,} {case.case}: shipped {shipped}; best {best}", flush=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    bandwidth = copy_bandwidth(device, gib=1.0 if device == "cuda" else 0.05)
    print(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s ({device})", flush=True)
    time_it = timer(device)
    cases = attention_cases(args, dtype) + scan_cases(args)
    rows_out = []
    for case in cases:
        row = case.results
        row.update(op=case.op, model=case.model, batch=case.batch, rows=case.rows, case=case.case)
        try:
            measure(case, args, bandwidth, CHECK[dtype] if case.op == "decode_attention" else 1e-5, time_it)
        except Exception as err:  # one failing configuration must not stop the benchmark
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        rows_out.append(row)
        print(line(row), flush=True)
    swept = sweep(cases, args, time_it) if not args.no_sweep else []
    return {"device": device, "bandwidth_bytes_per_s": bandwidth, "rows": rows_out, "sweep": swept,
            "dtype": str(dtype), "check_tolerance": CHECK[dtype], "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.4f}"


def line(r: dict[str, Any]) -> str:
    head = f"{r['op']:>17} {r['model']:>7} B{r['batch']} {r['rows']:>7,} {r['case']:>16}"
    if "error" in r:
        return f"{head}: FAILED {r['error']}"
    split = r.get("split_graph_ms") or r.get("split_eager_ms")
    return (f"{head}: eager {_ms(r['eager_ms'])} ms, graph {_ms(r['graph_ms'])} ms, split alone {_ms(split)} ms, "
            f"{r['gb_per_s']:8.0f} GB/s {100 * r['of_copy']:5.1f}% of copy, x{r['copies']} inputs, "
            f"rel.err {r['rel_error']:.1e} {r['check']}")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"copy bandwidth {result['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s on {result['gpu'] or result['device']}",
             f"inputs {result['dtype']}; a check fails above {result['check_tolerance']:g} relative error; "
             "'graph': the calls replayed from a CUDA graph (no host overhead), 'of copy' from it where taken",
             "", "| op | model | batch | rows | case | eager ms | graph ms | split alone ms | GB/s | of copy | "
             "rel. error vs fp32 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        head = f"| {r['op']} | {r['model']} | {r['batch']} | {r['rows']:,} | {r['case']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} ||||||")
            continue
        split = r.get("split_graph_ms") or r.get("split_eager_ms")
        lines.append(f"{head} {_ms(r['eager_ms'])} | {_ms(r['graph_ms'])} | {_ms(split)} | {r['gb_per_s']:,.0f} | "
                     f"{100 * r['of_copy']:.1f}% | {r['rel_error']:.1e} {r['check']} |")
    if result["sweep"]:
        lines += ["", "| sweep case | shipped (BLOCK_N, warps, stages, splits) | best | best ms | points |",
                  "|---|---|---|---|---|"]
        for s in result["sweep"]:
            shipped = s["shipped"]
            b = s["best"]
            best = "—" if b is None else f"{b['BLOCK_N']}, {b['num_warps']}, {b['num_stages']}, {b['splits']}"
            lines.append(f"| {s['model']} B{s['batch']} {s['rows']:,} {s['case']} | {shipped['BLOCK_N']}, "
                         f"{shipped['num_warps']}, {shipped['num_stages']}, {shipped['splits']} | {best} | "
                         f"{_ms(None if b is None else b['ms'])} | {len(s['points'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--toy", action="store_true", help="toy sizes (the interpreter on CPU)")
    parser.add_argument("--rows", type=int, nargs="+", help="context rows (default 32768 131072; toy 256)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 4 8; toy 1 2)")
    parser.add_argument("--fetched", type=int, nargs="+", help=f"fetched rows besides the kept 1/{KEEP} (default {FETCHED})")
    parser.add_argument("--no-sweep", action="store_true", help="skip the (BLOCK_N, warps, stages, splits) sweep")
    parser.add_argument("--scaling", type=float, default=0.1352, help="softmax scale (V2-Lite's with YaRN ~ 0.135)")
    parser.add_argument("--out", type=Path, default=Path("results/gpu_kernels"))
    args = parser.parse_args(argv)
    args.rows = args.rows or ([256] if args.toy else [32768, 131072])
    args.batches = args.batches or ([1, 2] if args.toy else [1, 4, 8])
    args.fetched = args.fetched or ([16] if args.toy else list(FETCHED))
    if args.device != "cuda" and not args.toy:
        parser.error("without CUDA only --toy runs (in Triton's interpreter: set TRITON_INTERPRET=1)")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    failed = any("error" in r or r["check"] != "ok" for r in result["rows"])
    failed |= any(s["best"] is None for s in result["sweep"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
