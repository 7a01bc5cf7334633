"""The Triton kernels on a GPU, one cell at a time: bytes per second against the measured copy bandwidth.

``make gpu-check`` (``benchmarks/gpu_check.py``) plans and runs these cells with the runtime's; this module says what
one kernel cell does. Decode attention in the forms the runtime launches, for DeepSeek-V2-Lite's absorbed MLA
geometry (16 heads over one latent group of 512 + 64 dims, bf16 rows) and a GQA model (32 query heads over 8 KV
heads of 128 dims):

* ``dense``: all ``N`` rows, no flags (what ``full`` reads each step);
* ``pool``: the ``N`` rows of a preallocated tier with valid flags and a device length (1/16 of the rows
  invalid): the runtime's tier;
* ``gathered f``: ``f`` rows of an archive of ``N`` named by indices (MLA);
* ``step 1/32 + f``: the runtime's retrieving step -- the ``N / 32`` rows kept in the tier (flags; deferred, its
  best score for the retriever) then the ``f`` staged rows (valid and per-head flags), merged into the first
  part by the merge kernel (MLA, ``f`` = 16 and 1,024);

and the index scans (VestigeKV's certified sketch scan reduced over the heads, Quest's page scan). A cell first
checks the op against the fp32 reference on the same inputs (relative error, :data:`CHECK` per dtype: a failing
check fails the row), then times it twice: with the host's launch overhead (``triton.testing.do_bench``) and
without it (``do_bench_cudagraph``). Inputs are cycled -- enough copies that the bytes one round reads exceed twice
the 50 MB L2 -- so every call reads from HBM; a copy holds what one call reads (a gathered case's pool is shared by
its copies: each copy draws new indices into it), and the copies together stay under 8 GiB and half the free
memory (:func:`copies_for`); a case that cannot fit one copy is skipped before allocating, saying why. ``split``
times the split kernels alone (the merge's share is the difference). A sweep cell tries (``BLOCK_N``, warps,
stages, splits) points on one case within its time slice and reports the best checked point.

    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --toy --only kernels   # the cells at toy size on CPU
"""

from __future__ import annotations

import itertools
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MLA = {"heads": 16, "groups": 1, "latent": 512, "branch": 64}  # DeepSeek-V2-Lite's absorbed MLA rows
GQA = {"heads": 32, "groups": 8, "dim": 128}  # 32 query heads over 8 KV heads of 128 dims
TOY_MLA = {"heads": 16, "groups": 1, "latent": 32, "branch": 16}
TOY_GQA = {"heads": 8, "groups": 2, "dim": 32}
SKETCH_WIDTH = 131  # rank 64 + eta + branch 64 + two norms: vestige's index entry
PAGE = 16
KEEP = 32
L2_BYTES = 50 * 2**20
COPIES_MAX_BYTES = 8 * 2**30
SCALING = 0.1352  # softmax scale (V2-Lite's with YaRN ~ 0.135)
# a kernel's output against the fp32 reference on the same inputs: relative error allowed per input dtype
CHECK = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


class Skip(Exception):
    """A cell that is not run, and why (too big for the free memory): a row saying so, not a failure
    (``gpu_check.run_cell`` reads ``skip``)."""

    skip = True


@dataclass
class Case:
    """One op on one set of inputs. ``make(copy)`` builds copy ``copy`` of the inputs (a gathered case's pool is
    built once and shared), ``run(inputs, **tune)`` runs the op, ``check(inputs)`` is the fp32 reference of
    ``run``'s output, ``split(inputs)`` the split kernels alone. ``bytes``: what one call must read (and write);
    ``copy_bytes``: what one copy allocates; ``shared_bytes``: what all copies share; ``reference_bytes``: the
    reference's working memory."""

    op: str
    model: str
    batch: int
    rows: int
    case: str
    bytes: int
    copy_bytes: int
    make: Callable[[int], Any]
    run: Callable[..., torch.Tensor]
    check: Callable[[Any], torch.Tensor]
    split: Callable[[Any], Any] | None = None
    shared_bytes: int = 0
    reference_bytes: int = 0
    results: dict[str, Any] = field(default_factory=dict)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")  # NaN never passes
    finite = torch.isfinite(b)
    scale = b[finite].abs().max().clamp(min=1e-30)
    return float(((a - b)[finite].abs().max() / scale).item())


def _randn(g: torch.Generator, *shape, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def op_of(case: str) -> str:
    return {"sketch": "index_scan_reduce", "pages": "index_scan"}.get(case, "decode_attention")


def build_case(model: str, case: str, batch: int, rows: int, *, device: str, dtype: torch.dtype, toy: bool,
               scaling: float = SCALING) -> Case:
    """The :class:`Case` of one kernel cell; nothing is allocated until ``make`` is called."""
    from kvzoo.kernels import decode_attention as da

    mla, gqa = (TOY_MLA, TOY_GQA) if toy else (MLA, GQA)
    elt = torch.empty((), dtype=dtype).element_size()
    seed = zlib.crc32(f"{model} {case} {batch} {rows}".encode())  # the same inputs in every process

    def generator(copy: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed + 7919 * copy)

    def one(inputs, **tune):
        query, sources = inputs
        return da.triton.launch(query, da._validate(query, sources, scaling, None), scaling, tune.pop("splits", None),
                          tune=tune or None)[0]

    def one_split(inputs):
        query, sources = inputs
        return da.triton.launch(query, da._validate(query, sources, scaling, None), scaling, None, merge=False)

    def one_reference(inputs):
        query, sources = inputs
        return da.decode_attention_reference(query.float(), sources, scaling)[0]

    if model == "mla16" and op_of(case) == "decode_attention":
        width = mla["latent"] + mla["branch"]
        H = mla["heads"]
        row_bytes = width * elt
        q_bytes = batch * H * width * 2 + batch * H * (mla["latent"] * 2 + 4)
        reference_bytes = 3 * batch * H * rows * 4 + 256 * 2**20

        def rows_of(g, B, n):
            return _randn(g, B, 1, n, width, device=device, dtype=dtype)

        def query_of(g, B):
            return _randn(g, B, H, width, device=device, dtype=dtype)

        def valid_of(g, B, n):
            return torch.rand(B, 1, n, generator=g, device=device) >= 1 / 16

        if case == "dense":
            def make(copy):
                g = generator(copy)
                return query_of(g, batch), [da.Rows(rows_of(g, batch, rows), value_width=mla["latent"])]

            size = batch * rows * row_bytes + q_bytes
            return Case("decode_attention", model, batch, rows, case, size, size, make, one, one_reference,
                        one_split, reference_bytes=reference_bytes)
        if case == "pool":
            def make(copy):
                g = generator(copy)
                length = torch.full((batch,), rows, dtype=torch.int32, device=device)
                return query_of(g, batch), [da.Rows(rows_of(g, batch, rows), value_width=mla["latent"],
                                                    valid=valid_of(g, batch, rows), length=length)]

            size = batch * rows * (row_bytes + 4) + q_bytes
            return Case("decode_attention", model, batch, rows, case, size, size, make, one, one_reference,
                        one_split, reference_bytes=reference_bytes)
        if case.startswith("gathered "):
            f = int(case.split()[1])
            pool: list[torch.Tensor] = []  # the archive, built once: every copy gathers from it

            def make(copy):
                g = generator(copy)
                if not pool:
                    pool.append(rows_of(generator(10**6), batch, rows))
                idx = torch.randint(0, rows, (batch, 1, f), generator=g, device=device)
                length = torch.full((batch,), f, dtype=torch.int32, device=device)
                return query_of(g, batch), [da.Rows(pool[0], value_width=mla["latent"], indices=idx,
                                                    valid=valid_of(g, batch, f), length=length)]

            size = batch * f * (row_bytes + 12) + q_bytes
            return Case("decode_attention", model, batch, rows, case, size, batch * f * 16 + q_bytes, make, one,
                        one_reference, one_split, shared_bytes=batch * rows * row_bytes,
                        reference_bytes=3 * batch * H * f * 4 + 256 * 2**20)
        if case.startswith(f"step 1/{KEEP} + "):
            f = int(case.rsplit(" ", 1)[1])
            kept = max(1, rows // KEEP)

            def make(copy):
                g = generator(copy)
                tier = da.Rows(rows_of(g, batch, kept), value_width=mla["latent"], valid=valid_of(g, batch, kept))
                head_valid = torch.rand(batch, H, f, generator=g, device=device) < 0.5
                fetched = da.Rows(rows_of(g, batch, f), value_width=mla["latent"], valid=valid_of(g, batch, f),
                                  head_valid=head_valid)
                return query_of(g, batch), [tier, fetched]

            def step(inputs, **tune):
                query, (tier, fetched) = inputs
                splits = tune.pop("splits", None)
                out_t, lse_t, _ = da.triton.launch(query, da._validate(query, [tier], scaling, None), scaling, splits,
                                             best=True, out_dtype=torch.float32, tune=tune or None)
                return da.triton.launch(query, da._validate(query, [fetched], scaling, None), scaling, splits,
                                  prior=(out_t, lse_t), tune=tune or None)[0]

            per_seq = kept * (row_bytes + 4) + f * (row_bytes + 4 + 4 * H // 32 + 4)
            size = batch * per_seq + 2 * q_bytes
            return Case("decode_attention", model, batch, rows, case, size, size + batch * H * f, make, step,
                        one_reference, reference_bytes=3 * batch * H * (kept + f) * 4 + 256 * 2**20)
    if model == "gqa32/8" and case in ("dense", "pool"):
        G, H, D = gqa["groups"], gqa["heads"], gqa["dim"]
        row_bytes = 2 * D * elt
        flags = case == "pool"

        def make(copy):
            g = generator(copy)
            query = _randn(g, batch, H, D, device=device, dtype=dtype)
            keys = _randn(g, batch, G, rows, D, device=device, dtype=dtype)
            values = _randn(g, batch, G, rows, D, device=device, dtype=dtype)
            if not flags:
                return query, [da.Rows(keys, values)]
            length = torch.full((batch,), rows, dtype=torch.int32, device=device)
            valid = torch.rand(batch, G, rows, generator=g, device=device) >= 1 / 16
            return query, [da.Rows(keys, values, valid=valid, length=length)]

        size = batch * G * rows * (row_bytes + (4 if flags else 0)) + batch * H * D * 4
        return Case("decode_attention", model, batch, rows, case, size, size, make, one, one_reference, one_split,
                    reference_bytes=3 * batch * H * rows * 4 + 256 * 2**20)
    if model == "mla16" and case in ("sketch", "pages"):
        from kvzoo.kernels import index_scan as scan

        if case == "sketch":
            width, n, entry_dtype = (mla["latent"] // 8 + 3 + mla["branch"]) if toy else SKETCH_WIDTH, rows, \
                torch.float32
        else:
            width, n = 2 * (mla["latent"] + mla["branch"]) + 1, max(1, rows // PAGE)
            entry_dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter gets bf16 wrong
        H = mla["heads"]

        def make(copy):
            g = generator(copy)
            return (torch.randn(batch, 1, H, width, generator=g, device=device),
                    torch.randn(batch, 1, n, width, generator=g, device=device).to(entry_dtype),
                    torch.randn(batch, 1, H, generator=g, device=device))

        size = batch * n * width * torch.empty((), dtype=entry_dtype).element_size() + batch * H * width * 4
        reference_bytes = 2 * batch * n * width * 4 + 2 * batch * H * n * 4 + 256 * 2**20
        if case == "sketch":
            return Case("index_scan_reduce", model, batch, rows, case, size, size, make,
                        lambda x, **_: scan.index_scan_reduce_triton(x[0], x[1], scaling, x[2]),
                        lambda x: scan.index_scan_reduce_reference(x[0], x[1].float(), scaling, x[2]),
                        reference_bytes=reference_bytes)
        return Case("index_scan", model, batch, rows, case, size, size, make,
                    lambda x, **_: scan.index_scan_triton(x[0], x[1], scaling),
                    lambda x: scan.index_scan_reference(x[0], x[1].float(), scaling),
                    reference_bytes=reference_bytes)
    raise ValueError(f"no kernel case {model!r} {case!r}: models mla16 (dense, pool, gathered F, step 1/{KEEP} + F, "
                     "sketch, pages) and gqa32/8 (dense, pool)")


def free_bytes(device: str) -> int:
    """Memory free for a cell: the GPU's free memory (``cudaMemGetInfo``), the host's available RAM on CPU
    (``MemAvailable``: free pages and the page cache the kernel would give back)."""
    if device == "cuda":
        torch.cuda.empty_cache()  # blocks the caching allocator holds count as used
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 8 * 2**30


def margin_bytes(device: str) -> int:
    """Memory a cell leaves free beyond its estimate: the CUDA context, the allocator's fragmentation (GPU); the
    process itself (CPU, toy sizes)."""
    return 2**30 if device == "cuda" else 2**28


def copies_for(case: Case, device: str, free: int) -> int:
    """Copies of the inputs to cycle so that one round reads more than twice the L2, within :data:`COPIES_MAX_BYTES`
    and half of ``free`` (1 on CPU). :class:`Skip` when not even one copy, the shared pool and the reference's
    working memory fit in ``free`` (less :func:`margin_bytes`)."""
    need = case.shared_bytes + case.copy_bytes + case.reference_bytes
    if need > free - margin_bytes(device):
        raise Skip(f"needs {need / 2**30:.1f} GiB (shared {case.shared_bytes / 2**30:.1f}, one copy "
                   f"{case.copy_bytes / 2**30:.2f}, reference {case.reference_bytes / 2**30:.2f}), "
                   f"{free / 2**30:.1f} GiB free")
    if device != "cuda":
        return 1
    room = min(COPIES_MAX_BYTES, free // 2) - case.shared_bytes - case.reference_bytes
    by_memory = max(1, room // max(1, case.copy_bytes))
    return int(max(1, min(256, math.ceil(2 * L2_BYTES / max(1, case.bytes)), by_memory)))


def timer(device: str):
    """``time(fn, graph)`` -> median ms per call: ``do_bench`` (host overhead included) or ``do_bench_cudagraph`` on
    CUDA (None on CPU), one wall time elsewhere (the interpreter: a smoke run, not a measurement)."""
    def time_it(fn: Callable[[], Any], graph: bool) -> float | None:
        if device == "cuda":
            from triton.testing import do_bench, do_bench_cudagraph

            if graph:
                return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))
            return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))
        if graph:
            return None
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    return time_it


class KernelBench:
    """What the kernel cells of one worker process share: the device, the dtype, the copy bandwidth (measured once)."""

    def __init__(self, device: str, toy: bool) -> None:
        self.device, self.toy = device, toy
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float16
        self.time_it = timer(device)
        self._bandwidth: float | None = None

    @property
    def bandwidth(self) -> float:
        if self._bandwidth is None:
            from kvzoo.bench.metrics import copy_bandwidth

            self._bandwidth = copy_bandwidth(self.device, gib=1.0 if self.device == "cuda" else 0.05)
        return self._bandwidth

    def case(self, p: dict[str, Any]) -> Case:
        return build_case(p["model"], p["case"], p["batch"], p["rows"], device=self.device, dtype=self.dtype,
                          toy=self.toy)

    def measure(self, p: dict[str, Any]) -> dict[str, Any]:
        """One kernel cell: the check against fp32, then eager and graph timings. ``status`` ``failed`` when the
        check fails."""
        case = self.case(p)
        tol = CHECK[self.dtype] if case.op == "decode_attention" else 1e-5
        row: dict[str, Any] = {"op": case.op, "model": case.model, "batch": case.batch, "rows": case.rows,
                               "case": case.case, "bytes": case.bytes, "dtype": str(self.dtype).removeprefix("torch.")}
        copies = copies_for(case, self.device, free_bytes(self.device))
        inputs = [case.make(i) for i in range(copies)]
        row["copies"] = len(inputs)
        row["rel_error"] = rel_error(case.run(inputs[0]), case.check(inputs[0]))
        row["tolerance"] = tol
        row["check"] = "ok" if row["rel_error"] <= tol else f"FAILED (> {tol:g})"
        counter = itertools.count()

        def cycled(fn):
            return lambda: fn(inputs[next(counter) % len(inputs)])

        for key, graph in (("eager_ms", False), ("graph_ms", True)):
            row[key] = self.time_it(cycled(case.run), graph)
        if case.split is not None:
            row["split_graph_ms"] = self.time_it(cycled(case.split), True)
            if row["split_graph_ms"] is None:
                row["split_eager_ms"] = self.time_it(cycled(case.split), False)
        best = row["graph_ms"] if row["graph_ms"] is not None else row["eager_ms"]
        bandwidth = self.bandwidth
        row.update(gb_per_s=case.bytes / best / 1e6, of_copy=case.bytes / (best / 1e3) / bandwidth,
                   bandwidth_bytes_per_s=bandwidth)
        row["status"] = "ok" if row["check"] == "ok" else "failed"
        if row["status"] == "failed":
            row["error"] = f"output off the fp32 reference: relative error {row['rel_error']:.2e} > {tol:g}"
        inputs.clear()  # free the copies before the next cell
        return row

    def sweep(self, p: dict[str, Any], deadline: float) -> dict[str, Any]:
        """(BLOCK_N, warps, stages, splits) points on one case until ``deadline`` (``time.time()``): every point
        checked against fp32; the best checked one reported beside what ships."""
        from kvzoo.kernels import decode_attention as da

        if self.toy:
            grid = [{"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}]
            factors: tuple[float, ...] = (2.0,)
        else:
            grid = [{"BLOCK_N": n, "num_warps": w, "num_stages": s} for n in (32, 64) for w in (4, 8) for s in (3, 4)]
            factors = (1.0, 0.5, 2.0)
        case = self.case(p)
        inputs = case.make(0)
        reference = case.check(inputs)
        query, sources = inputs
        src = da._validate(query, sources[:1], SCALING, None)[0]
        base_cfg, base_splits = da.triton._split_launch(query, src, None)
        points, left_out = [], 0
        for factor, tune in itertools.product(factors, grid):
            if time.time() > deadline:
                left_out += 1
                continue
            point = {**tune, "splits": max(1, round(base_splits * factor))}
            try:
                err = rel_error(case.run(inputs, **dict(point)), reference)
                ms = self.time_it(lambda pt=point: case.run(inputs, **dict(pt)), self.device == "cuda")
                points.append({**point, "ms": ms, "rel_error": err, "ok": err <= CHECK[query.dtype]})
            except Exception as err:  # a configuration that does not compile or fit is a point, not the end
                points.append({**point, "error": f"{type(err).__name__}: {err}"[:200]})
        timed = [pt for pt in points if pt.get("ok")]
        best = min(timed, key=lambda pt: pt["ms"]) if timed else None
        shipped = {"BLOCK_N": base_cfg.BLOCK_N, "num_warps": base_cfg.num_warps, "num_stages": base_cfg.num_stages,
                   "splits": base_splits}
        row = {"model": case.model, "batch": case.batch, "rows": case.rows, "case": case.case, "shipped": shipped,
               "best": best, "points": points, "points_left_out": left_out,
               "status": "ok" if best is not None else "failed"}
        if best is None:
            row["error"] = "no point passed its check"
        return row
