"""The native CPU kernels (kvzoo/kernels/cpu_native.py) at SmolLM2's decode shapes, against what they replace.

    PYTHONPATH=. OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/native_kernels.py \\
        [--contexts 2048,8192,32768] [--threads 1,2] [--rounds 7] [--base REV] [--json out.json]

SmolLM2-135M's attention: B = 1, 3 KV groups x 3 query heads, D = Dv = 64, fp32 rows. Per context ``n``:

* decode attention over the whole pool of ``n`` rows by SDPA (``decode_attention.sdpa.attend_sdpa``, one plain source: torch's
  fused kernel with ``enable_gqa``) and by the native op (pool form);
* the gathered form, ``n/8`` and ``n/32`` of the rows (sorted random index lists into the pool), by the native op and
  by the PyTorch path the runtime takes for a gathered source (``attend_sdpa``: gather, two matmuls, one softmax);
* a Quest-like gathered source: each of a group's 3 heads reads its own 64 pages of 16 rows (``head_valid`` marks each
  head's segment of the index list);
* the int8 index scan over ``n`` archived rows (VestigeKV: 64 int8 codes + 3 fp16 per row, j = 16): the PyTorch
  reference, the C loop at ``--base`` (the commit before the AVX-512 one, built from its source under the old
  flags) and now, for the estimate and for the whole top-j rule (``int8_choose``);
* the fused choices of ``kvzoo/kernels/choose.py``, each its PyTorch reference (the ops a decode step ran before)
  against the C op: VestigeKV's top-j rule over the sketch (``sketch_choose``) on ``n`` rows at SmolLM2's shape
  (rank 16, fp32 entries of 18 values) and at DeepSeek-V2-Lite's (one group of 16 heads, rank 64, a 512 + 64 latent:
  131 values), Quest's page choice (``quest_choose``, each head's own pages) over the ``n / 16`` pages of 129 values
  at 8x (``pages = n / 128``), and Quest's one-row page add (``quest_page_add``, a few hundred bytes: its time is the
  call's).

Each row gives the bytes the op reads (rows, index lists, flags), the time per call and those bytes per second: at
1 thread the thread's CPU time (``time.thread_time``: load from other processes does not enter), at 2 threads wall
time. Calls cycle over copies of the data (enough to exceed the last-level cache for the arms that read whole pools,
as a model's 30 layers do), and each timed pass starts after a read that evicts the caches, so every call reads its
rows from memory, as a decode step's would. The machine's read bandwidth (a sum over a 256 MiB tensor, the better
of a measure before and one after the arms) is given beside. Within a round every arm runs at every thread count, one
after another, so that load from other processes falls on all of them alike. Importable: :func:`measure` returns the rows, :func:`markdown` the table.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvzoo.kernels import cpu_native
from kvzoo.kernels.choose import quest_choose_reference, quest_page_add_reference, sketch_choose_reference
from kvzoo.kernels.decode_attention import Rows, _validate
from kvzoo.kernels.decode_attention.sdpa import attend_sdpa
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    int8_choose_reference,
    int8_key_entries,
    int8_key_estimate_reference,
    page_entries,
    sketch_entries,
)

ROOT = Path(__file__).resolve().parent.parent
B, G, HPG, D = 1, 3, 3, 64
H = G * HPG
SCALE = D ** -0.5
J = 16
BASE = "1f70bb7"  # the commit before this work: the int8 C loop with AVX2, two rows per pass
CACHE_BYTES = 96 << 20  # the data one timed round cycles over (the last-level cache here is 32 MiB)


def read_bandwidth(threads: int, mib: int = 256) -> float:
    """Bytes per second of a sum over a large fp32 tensor (best of 5) at ``threads`` threads."""
    torch.set_num_threads(threads)
    x = torch.ones(mib << 18)
    x.sum()
    best = min(_wall(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def base_library(rev: str) -> ctypes.CDLL | None:
    """The int8 C loop as it was at ``rev`` (its SOURCE string, its flags), or None where git or the file is missing."""
    try:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kvzoo/kernels/cpu_native.py"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    source = next((node.value.value for node in ast.parse(text).body if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", None) == "SOURCE"), None)
    if source is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="kvzoo-base-"))
    (folder / "base.c").write_text(source)
    subprocess.run(["cc", "-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99", str(folder / "base.c"), "-o",
                    str(folder / "base.so"), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(folder / "base.so"))
    lib.kvzoo_int8_estimate.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 10 + [ctypes.c_float]
    lib.kvzoo_int8_choose.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 12 + [ctypes.c_float] * 2
    return lib


def _copies(nbytes: int, cache_bytes: int, most: int = 64) -> int:
    return max(2, min(most, math.ceil(cache_bytes / max(1, nbytes))))


def attention_cases(n: int, cache_bytes: int = CACHE_BYTES, seed: int = 0) -> list[dict]:
    """The attention arms at context ``n``: each a name, the bytes it reads and one call per copy of the data."""
    g = torch.Generator().manual_seed(seed)
    pool_bytes = B * G * n * 2 * D * 4
    copies = _copies(pool_bytes, cache_bytes)
    query = torch.randn(B, H, D, generator=g)
    pools = [(torch.randn(B, G, n, D, generator=g), torch.randn(B, G, n, D, generator=g)) for _ in range(copies)]
    row = 2 * D * 4
    arms = []

    def sdpa(source: Rows):
        checked = _validate(query, [source], SCALE, None)
        return lambda: attend_sdpa(query, checked, SCALE)

    def native(source: Rows, **kwargs):
        return lambda: cpu_native.decode_attend(query, source, SCALE, **kwargs)

    plain = [Rows(k, v) for k, v in pools]
    arms.append({"op": "attention", "form": "pool", "impl": "sdpa", "bytes": pool_bytes,
                 "calls": [sdpa(s) for s in plain]})
    arms.append({"op": "attention", "form": "pool", "impl": "native", "bytes": pool_bytes,
                 "calls": [native(s) for s in plain]})
    for part in (8, 32):
        K = n // part
        gathered = []
        for k, v in pools:
            idx = torch.stack([torch.randperm(n, generator=g)[:K].sort().values for _ in range(B * G)]).view(B, G, K)
            gathered.append(Rows(k, v, indices=idx))
        nbytes = B * G * K * (row + 8)
        arms.append({"op": "attention", "form": f"gathered 1/{part}", "impl": "sdpa (gather)", "bytes": nbytes,
                     "calls": [sdpa(s) for s in gathered]})
        arms.append({"op": "attention", "form": f"gathered 1/{part}", "impl": "native", "bytes": nbytes,
                     "calls": [native(s) for s in gathered]})
    pages, page_rows = 64, 16
    if n >= pages * page_rows:
        quest = []
        K = HPG * pages * page_rows
        head_valid = torch.zeros(B, H, K, dtype=torch.bool)
        for h in range(H):
            head_valid[:, h, (h % HPG) * pages * page_rows:(h % HPG + 1) * pages * page_rows] = True
        for k, v in pools:
            chosen = torch.stack([torch.randperm(n // page_rows, generator=g)[:pages].sort().values
                                  for _ in range(B * G * HPG)])  # [B*G*HPG, pages]
            rows = (chosen[..., None] * page_rows + torch.arange(page_rows)).view(B, G, K)
            quest.append(Rows(k, v, indices=rows, head_valid=head_valid))
        nbytes = B * G * K * (row + 8) + B * H * K
        arms.append({"op": "attention", "form": "Quest-like (3 x 64 x 16)", "impl": "sdpa (gather)", "bytes": nbytes,
                     "calls": [sdpa(s) for s in quest]})
        arms.append({"op": "attention", "form": "Quest-like (3 x 64 x 16)", "impl": "native", "bytes": nbytes,
                     "calls": [native(s) for s in quest]})
    return arms


def scan_cases(n: int, base: ctypes.CDLL | None, cache_bytes: int = CACHE_BYTES, seed: int = 1) -> list[dict]:
    """The int8 scan arms over ``n`` archived rows (estimate and the whole top-j rule)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = B * G * n * (D + 6)
    copies = _copies(nbytes, cache_bytes)
    q = torch.randn(B, G, HPG, D, generator=g)
    entries = [int8_key_entries(torch.randn(B, G, n, D, generator=g)) for _ in range(copies)]
    threshold = torch.full((B, G, HPG), 2.0)
    out = torch.empty(B, G, HPG, n)
    idx, picked = torch.empty(B, G, HPG * J, dtype=torch.long), torch.empty(B, G, HPG * J, dtype=torch.bool)

    def base_estimate(codes, side):
        return lambda: base.kvzoo_int8_estimate(q.data_ptr(), codes.data_ptr(), side.data_ptr(), None,
                                                out.data_ptr(), B, G, HPG, D, n, codes.stride(0), codes.stride(1),
                                                side.stride(0), side.stride(1), 3, SCALE)

    def base_choose(codes, side):
        return lambda: base.kvzoo_int8_choose(q.data_ptr(), codes.data_ptr(), side.data_ptr(), None,
                                              threshold.data_ptr(), idx.data_ptr(), picked.data_ptr(), B, G, HPG, D,
                                              n, J, n, codes.stride(0), codes.stride(1), side.stride(0),
                                              side.stride(1), 3, SCALE, SKETCH_SLACK)

    arms = [{"op": "int8 estimate", "form": "", "impl": "PyTorch reference", "bytes": nbytes,
             "calls": [lambda c=c, s=s: int8_key_estimate_reference(q, c, s, SCALE) for c, s in entries]}]
    if base is not None:
        arms.append({"op": "int8 estimate", "form": "", "impl": f"C at {BASE}", "bytes": nbytes,
                     "calls": [base_estimate(c, s) for c, s in entries]})
    arms.append({"op": "int8 estimate", "form": "", "impl": "native now", "bytes": nbytes,
                 "calls": [lambda c=c, s=s: cpu_native.int8_estimate(q, c, s, SCALE, None) for c, s in entries]})
    arms.append({"op": "int8 top-j rule", "form": f"j={J}", "impl": "PyTorch reference", "bytes": nbytes,
                 "calls": [lambda c=c, s=s: int8_choose_reference(q, c, s, threshold, J, n, SCALE)
                           for c, s in entries]})
    if base is not None:
        arms.append({"op": "int8 top-j rule", "form": f"j={J}", "impl": f"C at {BASE}", "bytes": nbytes,
                     "calls": [base_choose(c, s) for c, s in entries]})
    arms.append({"op": "int8 top-j rule", "form": f"j={J}", "impl": "native now", "bytes": nbytes,
                 "calls": [lambda c=c, s=s: cpu_native.int8_choose(q, c, s, threshold, J, n, SCALE, SKETCH_SLACK,
                                                                    None) for c, s in entries]})
    return arms


def choose_cases(n: int, cache_bytes: int = CACHE_BYTES, seed: int = 2) -> list[dict]:
    """The fused choices' arms at context ``n``: each op's PyTorch reference against the C op."""
    g = torch.Generator().manual_seed(seed)
    arms = []
    for label, groups, hq, dc, dr, rank in (("SmolLM2", G, HPG, D, 0, 16), ("DeepSeek-V2-Lite", 1, 16, 512, 64, 64)):
        W = rank + 1 + (dr + 2 if dr else 1)
        nbytes = B * groups * n * W * 4
        data = []
        for _ in range(_copies(nbytes, cache_bytes, most=16)):
            basis = torch.linalg.qr(torch.randn(B, groups, dc, rank, generator=g)).Q.contiguous()
            keys = torch.randn(B, groups, n, dc + dr, generator=g)
            data.append((basis, sketch_entries(keys[..., :dc], keys[..., dc:] if dr else None, basis)))
        q = torch.randn(B, groups, hq, dc + dr, generator=g)
        floor = torch.full((B, groups, hq), 2.0)
        form = f"{label}: {groups} x {hq} heads, W={W}, j={J}"
        arms.append({"op": "sketch top-j rule", "form": form, "impl": "PyTorch reference", "bytes": nbytes,
                     "calls": [lambda v=v, e=e, q=q, f=floor: sketch_choose_reference(q, v, e, f, J, n, SCALE)
                               for v, e in data]})
        arms.append({"op": "sketch top-j rule", "form": form, "impl": "native", "bytes": nbytes,
                     "calls": [lambda v=v, e=e, q=q, f=floor: cpu_native.sketch_choose(q, v, e, None, f, J, n, SCALE,
                                                                                      SKETCH_SLACK, False)
                               for v, e in data]})
    size, P = 16, n // 16
    pages = max(1, n // 8 // size)  # Quest at 8x: a budget of n / 8 rows, that many pages per head
    W = 2 * D + 1
    nbytes = B * G * P * (W * 4 + 1)
    data = []
    for _ in range(_copies(nbytes, cache_bytes, most=16)):
        keys = torch.randn(B, G, P, size, D, generator=g)
        data.append(page_entries(keys.amin(3), keys.amax(3)))
    q = torch.randn(B, G, HPG, D, generator=g)
    empty = torch.zeros(B, G, P, dtype=torch.bool)
    live = torch.tensor([n])
    positions = torch.arange(n).expand(B, G, n)
    form = f"{G} x {HPG} heads, {P} pages of {size}, {pages} a head"
    arms.append({"op": "Quest page choice", "form": form, "impl": "PyTorch reference", "bytes": nbytes,
                 "calls": [lambda e=e: quest_choose_reference(q, e, empty, live, positions, pages, size, n, SCALE)
                           for e in data]})
    arms.append({"op": "Quest page choice", "form": form, "impl": "native", "bytes": nbytes,
                 "calls": [lambda e=e: cpu_native.quest_choose(q, e, empty, live, positions, pages, size, n, True,
                                                               SCALE, SKETCH_SLACK) for e in data]})
    storage = torch.randn(B, G, n, D, generator=g)
    valid = torch.ones(B, G, n, dtype=torch.bool)

    def page_add(add):
        summary = (torch.full((B, G, D), float("inf")), torch.full((B, G, D), float("-inf")),
                   torch.zeros(B, G, P, W), torch.ones(B, G, P, dtype=torch.bool))
        count, length = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        position = torch.zeros(B, G, dtype=torch.long)

        def call():
            if int(count) >= n - 1:
                count.zero_()
            add(storage, valid, position, *summary, count, length, size)
        return call

    nbytes = B * G * D * (4 * 2 + 4 * 2 + W * 4)  # the row read, the running min/max read and written, the entry
    arms.append({"op": "Quest page add", "form": "one row", "impl": "PyTorch reference", "bytes": nbytes,
                 "calls": [page_add(quest_page_add_reference)]})
    arms.append({"op": "Quest page add", "form": "one row", "impl": "native", "bytes": nbytes,
                 "calls": [page_add(cpu_native.quest_page_add)]})
    return arms


def _time_arms(arms: list[dict], threads: list[int], rounds: int, cache_bytes: int) -> dict[tuple[int, int], float]:
    """Seconds per call of each arm at each thread count (median over rounds; within a round every arm at every
    thread count, one after another, so that load from other processes falls on all of them alike). Before each
    timed pass a read of ``cache_bytes`` evicts what the last one left in the caches: a gathered arm reads a small
    part of each copy, which would otherwise stay in the last-level cache from one pass to the next."""
    evict = torch.ones(cache_bytes // 4)
    for arm in arms:  # warm-up: the library, the allocator, the first touch of every copy
        for call in arm["calls"]:
            call()
    spent: dict[tuple[int, int], list[float]] = {(i, t): [] for i in range(len(arms)) for t in threads}
    for _ in range(rounds):
        for i, arm in enumerate(arms):
            for t in threads:
                torch.set_num_threads(t)
                evict.sum()
                clock = time.thread_time if t == 1 else time.perf_counter
                start = clock()
                for call in arm["calls"]:
                    call()
                spent[i, t].append((clock() - start) / len(arm["calls"]))
    return {key: statistics.median(s) for key, s in spent.items()}


def measure(contexts: list[int], threads: list[int], rounds: int = 7, base_rev: str | None = BASE,
            cache_bytes: int = CACHE_BYTES, bandwidth_mib: int = 256) -> dict:
    """Every arm at every context and thread count, and the read bandwidth at each thread count. ``base_rev`` None:
    no 'before' rows for the int8 scan; ``cache_bytes``: the data a round cycles over (small: a smoke run)."""
    saved = torch.get_num_threads()
    base = base_library(base_rev) if base_rev else None
    rows = []
    try:
        bandwidth = {t: read_bandwidth(t, bandwidth_mib) for t in threads}
        with torch.no_grad():
            for n in contexts:
                arms = attention_cases(n, cache_bytes) + scan_cases(n, base, cache_bytes) + choose_cases(n, cache_bytes)
                seconds = _time_arms(arms, threads, rounds, cache_bytes)
                for i, arm in enumerate(arms):
                    row = {"context": n, "op": arm["op"], "form": arm["form"], "impl": arm["impl"],
                           "bytes": arm["bytes"]}
                    for t in threads:
                        row[f"ms_{t}"] = 1e3 * seconds[i, t]
                        row[f"gbps_{t}"] = arm["bytes"] / seconds[i, t] / 1e9
                    rows.append(row)
                    arm["calls"] = None
        bandwidth = {t: max(bw, read_bandwidth(t, bandwidth_mib)) for t, bw in bandwidth.items()}  # before, after
    finally:
        torch.set_num_threads(saved)
    return {"rows": rows, "threads": threads, "bandwidth_gbps": {t: bw / 1e9 for t, bw in bandwidth.items()},
            "bandwidth_mib": bandwidth_mib, "load": os.getloadavg(),
            "openmp": cpu_native.library().openmp if cpu_native.library() is not None else None}


def markdown(result: dict) -> str:
    threads = result["threads"]
    clocks = ", ".join(f"{t} thread{'s' if t > 1 else ''}: {'thread CPU time' if t == 1 else 'wall time'}"
                       for t in threads)
    load = ", ".join(f"{x:.1f}" for x in result["load"])
    lines = [f"Read bandwidth (sum over {result['bandwidth_mib']} MiB): " + ", ".join(
        f"{result['bandwidth_gbps'][t]:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t in threads)
        + f". Timing: {clocks}. Load average after the run: {load}. OpenMP runtime: "
        + f"{result['openmp'] or 'none (one thread)'}.", ""]
    head = "| context | op | form | impl | MiB read |" + "".join(f" ms ({t}T) | GB/s ({t}T) |" for t in threads)
    lines += [head, "|" + "---|" * (5 + 2 * len(threads))]
    for r in result["rows"]:
        cells = "".join(f" {r[f'ms_{t}']:.3f} | {r[f'gbps_{t}']:.1f} |" for t in threads)
        lines.append(f"| {r['context']} | {r['op']} | {r['form']} | {r['impl']} | {r['bytes'] / 2**20:.2f} |{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--base", default=BASE, help="the git revision whose int8 C loop is the 'before' row")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if cpu_native.library() is None:
        print(f"the native kernels are not built here: {cpu_native.toolchain_missing() or 'see the warning above'}", file=sys.stderr)
        return 1
    result = measure([int(c) for c in args.contexts.split(",")], [int(t) for t in args.threads.split(",")],
                     args.rounds, args.base)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
