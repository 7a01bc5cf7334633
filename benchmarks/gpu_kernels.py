"""The Triton kernels on a GPU: bytes per second against the measured copy bandwidth (< 5 minutes on an H200).

    python benchmarks/gpu_kernels.py                  # CUDA: 4k / 32k / 128k rows, batch 1 and 8
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --toy   # any machine: toy sizes in the interpreter

For each context of ``N`` rows (DeepSeek-V2-Lite's absorbed MLA geometry: 16 heads over one latent
group of 512 + 64 dims, bf16 rows) it measures, with ``triton.testing.do_bench``:

* ``decode_attention`` over all ``N`` rows (what ``full`` reads each step);
* ``decode_attention`` over the ``N / 32`` kept rows plus ``f`` fetched rows as a second source
  (``f`` = 16 and 1,024: what a 32x VestigeKV / Quest step reads);
* the certified sketch scan (``index_scan_reduce``) over ``N`` index entries of width 131 (fp32) and
  Quest's page scan (``index_scan``) over ``N / 16`` page entries of width 1,153 (bf16).

Each line gives the time, the bytes the op must read (rows, entries, queries; outputs written), those
bytes per second and their fraction of the copy bandwidth (``2 x bytes / time`` of a 1 GiB device
copy, measured first). Before timing, each op's bf16 output is checked against the fp32 reference
on the same inputs (the relative error is printed; a check that fails is reported and the run goes
on). Markdown and JSON go to ``--out`` (default ``results/gpu_kernels.{md,json}``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kvzoo.bench.metrics import copy_bandwidth

HEADS, LATENT, BRANCH = 16, 512, 64  # DeepSeek-V2-Lite / Kimi Linear absorbed MLA rows
SKETCH_WIDTH = 131  # rank 64 + eta + branch 64 + two norms: vestige's index entry
PAGE = 16
KEEP = 32
FETCHED = (16, 1024)
# a kernel's output against the fp32 reference on the same inputs: relative error allowed per input dtype
CHECK = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def timed(fn, device: str) -> float:
    """Milliseconds per call: ``triton.testing.do_bench`` on CUDA, a median of wall times elsewhere."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[1]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    finite = torch.isfinite(b)
    scale = b[finite].abs().max().clamp(min=1e-30)
    return float(((a - b)[finite].abs().max() / scale).item())


def attention_case(batch: int, rows: int, fetched: int | None, dtype: torch.dtype, device: str, heads: int,
                   latent: int, branch: int):
    from kvzoo.kernels.decode_attention import Rows

    g = torch.Generator(device="cpu").manual_seed(rows + batch)
    width = latent + branch
    kept = rows if fetched is None else max(1, rows // KEEP)
    query = torch.randn(batch, heads, width, generator=g).to(device, dtype)
    pool = torch.randn(batch, 1, kept, width, generator=g).to(device, dtype)
    sources = [Rows(keys=pool, value_width=latent)]
    read = pool.numel() * pool.element_size()
    if fetched is not None:
        staged = torch.randn(batch, 1, fetched, width, generator=g).to(device, dtype)
        sources.append(Rows(keys=staged, value_width=latent))
        read += staged.numel() * staged.element_size()
    read += query.numel() * query.element_size() + batch * heads * (latent * query.element_size() + 4)
    return query, sources, read


def scan_case(kind: str, batch: int, rows: int, device: str, heads: int, latent: int, branch: int):
    g = torch.Generator(device="cpu").manual_seed(rows + batch + 7)
    if kind == "sketch":
        width, entries_n, dtype = SKETCH_WIDTH if latent == LATENT else latent // 8 + 3 + branch, rows, torch.float32
    else:
        width, entries_n, dtype = 2 * (latent + branch) + 1, max(1, rows // PAGE), torch.bfloat16
    if device != "cuda":
        dtype = torch.float32 if kind == "sketch" else torch.float16  # the interpreter gets bf16 wrong
    query_rows = torch.randn(batch, 1, heads, width, generator=g).to(device)
    entries = torch.randn(batch, 1, entries_n, width, generator=g).to(device, dtype)
    threshold = torch.randn(batch, 1, heads, generator=g).to(device)
    read = entries.numel() * entries.element_size() + query_rows.numel() * 4
    return query_rows, entries, threshold, read


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvzoo.kernels import decode_attention as da
    from kvzoo.kernels import index_scan as scan

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    heads, latent, branch = (HEADS, LATENT, BRANCH) if not args.toy else (16, 32, 16)
    bandwidth = copy_bandwidth(device, gib=1.0 if device == "cuda" else 0.05)
    print(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s ({device})", flush=True)
    rows_out: list[dict[str, Any]] = []

    def record(op: str, batch: int, rows: int, extra: str, fn, reference, read: int) -> None:
        row: dict[str, Any] = {"op": op, "batch": batch, "rows": rows, "case": extra}
        try:
            row["rel_error"] = rel_error(fn(), reference())
            row["check"] = "ok" if row["rel_error"] <= CHECK[dtype] else f"FAILED (> {CHECK[dtype]:g})"
            ms = timed(fn, device)
            row.update(ms=ms, bytes=read, gb_per_s=read / ms / 1e6, of_copy=read / (ms / 1e3) / bandwidth)
        except Exception as err:  # one failing configuration must not stop the benchmark
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        rows_out.append(row)
        if "error" in row:
            print(f"{op:>18} B{batch} {rows:>7,} rows {extra:>12}: FAILED {row['error']}", flush=True)
        else:
            print(f"{op:>18} B{batch} {rows:>7,} rows {extra:>12}: {row['ms']:8.3f} ms  {row['gb_per_s']:8.0f} GB/s  "
                  f"{100 * row['of_copy']:5.1f}% of copy  rel.err {row['rel_error']:.1e} {row['check']}", flush=True)

    for rows in args.rows:
        for batch in args.batches:
            for fetched in (None, *args.fetched):
                query, sources, read = attention_case(batch, rows, fetched, dtype, device, heads, latent, branch)
                reference_sources = [da.Rows(keys=s.keys.float(), value_width=s.value_width) for s in sources]
                label = "all rows" if fetched is None else f"1/{KEEP} + {fetched}"
                record("decode_attention", batch, rows, label,
                       lambda q=query, src=sources: da.decode_attention_triton(q, src, args.scaling)[0],
                       lambda q=query, src=reference_sources: da.decode_attention_reference(q.float(), src, args.scaling)[0],
                       read)
            for kind in ("sketch", "pages"):
                query_rows, entries, threshold, read = scan_case(kind, batch, rows, device, heads, latent, branch)
                if kind == "sketch":
                    record("index_scan_reduce", batch, rows, "sketch",
                           lambda q=query_rows, e=entries, t=threshold: scan.index_scan_reduce_triton(q, e, args.scaling, t),
                           lambda q=query_rows, e=entries, t=threshold: scan.index_scan_reduce_reference(
                               q, e.float(), args.scaling, t), read)
                else:
                    record("index_scan", batch, rows, "pages",
                           lambda q=query_rows, e=entries: scan.index_scan_triton(q, e, args.scaling),
                           lambda q=query_rows, e=entries: scan.index_scan_reference(q, e.float(), args.scaling), read)
    return {"device": device, "bandwidth_bytes_per_s": bandwidth, "rows": rows_out, "dtype": str(dtype),
            "check_tolerance": CHECK[dtype],
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device == "cuda" else None}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"copy bandwidth {result['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s on {result['gpu'] or result['device']}",
             "", "| op | batch | rows | case | ms | GB/s | of copy | rel. error vs fp32 |", "|---|---|---|---|---|---|---|---|"]
    lines.insert(1, f"inputs {result['dtype']}; a check fails above {result['check_tolerance']:g} relative error")
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['batch']} | {r['rows']:,} | {r['case']} | failed: {r['error']} ||||")
        else:
            lines.append(f"| {r['op']} | {r['batch']} | {r['rows']:,} | {r['case']} | {r['ms']:.3f} | {r['gb_per_s']:,.0f} "
                         f"| {100 * r['of_copy']:.1f}% | {r['rel_error']:.1e} {r['check']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--toy", action="store_true", help="toy sizes (the interpreter on CPU)")
    parser.add_argument("--rows", type=int, nargs="+", help="context rows (default 4096 32768 131072; toy 256)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8; toy 1 2)")
    parser.add_argument("--fetched", type=int, nargs="+", help=f"fetched rows besides the kept 1/{KEEP} (default {FETCHED})")
    parser.add_argument("--scaling", type=float, default=0.1352, help="softmax scale (V2-Lite's with YaRN ~ 0.135)")
    parser.add_argument("--out", type=Path, default=Path("results/gpu_kernels"))
    args = parser.parse_args(argv)
    args.rows = args.rows or ([256] if args.toy else [4096, 32768, 131072])
    args.batches = args.batches or ([1, 2] if args.toy else [1, 8])
    args.fetched = args.fetched or ([16] if args.toy else list(FETCHED))
    if args.device != "cuda" and not args.toy:
        parser.error("without CUDA only --toy runs (in Triton's interpreter: set TRITON_INTERPRET=1)")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 1 if any("error" in r or r["check"] != "ok" for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
