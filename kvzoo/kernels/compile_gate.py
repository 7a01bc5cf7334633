"""Compile a Triton kernel for sm_90 without a GPU and read what the compiler made (the compile gate).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` builds the H100/H200 binary on any machine.
:func:`compile_sm90` reads its shared memory, registers and spills (``cuobjdump``), the matrix instruction (PTX), the
row buffers in flight (:func:`row_buffers`, from the TTGIR), the warps per score and the programs one SM holds.
``kvzoo/kernels/shapes.py`` lists the configurations that ship, ``tests/test_compile_gate.py`` holds each to its
``expect``. Imports Triton when it compiles; never imported by the runtime.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

SM90_SHARED_LIMIT = 232_448  # bytes of shared memory one block may use on H100 / H200
SM90_SHARED_PER_SM = 233_472  # bytes per SM (a block reserves 1 KiB of it)
SM90_REGISTERS = 65_536  # 32-bit registers per SM
SM90_THREADS = 2_048  # threads per SM
SM90_BLOCKS = 32  # blocks per SM


@dataclass(frozen=True)
class KernelConfig:
    """One compiled specialisation: the kernel, its argument types and constexprs, warps, stages, and what the
    gate holds the compiled code to (``expect``: see :func:`problems`; ``row_tiles`` ``(rows, cols, dtype)`` and
    ``score_tile`` ``(heads, rows)`` name the operands)."""

    name: str
    fn: Any  # a triton.JITFunction
    signature: dict[str, str]  # argument -> "*fp16", "*fp32", "i32", "fp32", "constexpr", ...
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    expect: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    name: str
    shared_bytes: int
    registers: int
    local_bytes: int  # per-thread local memory: register spills
    stack_bytes: int
    num_warps: int = 4
    mma: str = "fma"  # "mma.sync.m16n8k16", "wgmma", or "fma" (no tensor-core instruction)
    row_buffers: int | None = None  # row tiles in flight (None: the kernel names no row tiles)
    score_copies: int | None = None  # warps computing each score (None: no score tile named)
    ctas_per_sm: int = 0

    def __str__(self) -> str:
        return (f"{self.name}: {self.registers} registers/thread, {self.shared_bytes:,} B shared "
                f"(limit {SM90_SHARED_LIMIT:,}), local (spills) {self.local_bytes} B, stack {self.stack_bytes} B, "
                f"{self.mma}, {self.row_buffers} row buffers, {self.ctas_per_sm} programs/SM")


def _cuobjdump() -> str:
    import triton.backends.nvidia as nvidia

    bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    found = bundled if os.path.exists(bundled) else shutil.which("cuobjdump")
    if not found:
        raise RuntimeError("cuobjdump not found (Triton's NVIDIA backend bundles it in triton/backends/nvidia/bin)")
    return found


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Programs one sm_90 SM holds at once (registers per warp rounded up to 256, 1 KiB of shared memory reserved
    per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS // (per_warp * num_warps)
    by_shared = SM90_SHARED_PER_SM // (shared_bytes + 1024)
    return max(0, min(by_registers, by_shared, SM90_THREADS // (32 * num_warps), SM90_BLOCKS))


_DTYPE = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "f16": "f16", "f32": "f32"}


def mma_kind(ptx: str) -> str:
    """The matrix instruction in the PTX: ``wgmma``, ``mma.sync.<shape>`` or ``fma``."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    found = re.search(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    return f"mma.sync.{found.group(1)}" if found else "fma"


def row_buffers(ttgir: str, tiles: list[tuple[int, int, str]]) -> int:
    """The fewest buffers in flight over the row-tile operands ``(rows, cols, dtype)``: Triton's pipeliner copies a
    pipelined load into one slice of ``ttg.local_alloc : () -> !ttg.memdesc<S x rows x cols x dtype>``, ``S`` tiles
    in flight at the wait for the current one; an operand with no such allocation is loaded synchronously (1)."""
    allocs = re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x(\d+)x(\d+)x(\w+),", ttgir)
    pool = sorted(((int(r), int(c), d), int(s)) for s, r, c, d in allocs)
    counts = []
    for rows, cols, dtype in tiles:  # each operand its own allocation (two operands of one shape: two of them)
        key = (rows, cols, _DTYPE.get(dtype, dtype))
        found = [i for i, (shape, _) in enumerate(pool) if shape == key]
        counts.append(pool.pop(max(found, key=lambda i: pool[i][1]))[1] if found else 1)
    return min(counts)


def score_copies(ttgir: str, heads: int, rows: int) -> int | None:
    """How many warps compute each score of the ``heads x rows`` score product (1: each its own; None: the
    product has no MMA layout)."""
    layouts = dict(re.findall(r"^#(\w+) = #ttg\.nvidia_mma<\{([^}]*)\}>", ttgir, flags=re.M))
    for shape_h, shape_n, layout in re.findall(r"tt\.dot .*-> tensor<(\d+)x(\d+)xf32, #(\w+)>", ttgir):
        if (int(shape_h), int(shape_n)) == (heads, rows) and layout in layouts:
            attrs = layouts[layout]
            warps = [int(x) for x in re.search(r"warpsPerCTA = \[(\d+), (\d+)\]", attrs).groups()]
            instr = [int(x) for x in re.search(r"instrShape = \[(\d+), (\d+)", attrs).groups()]
            return max(1, warps[0] * instr[0] // heads) * max(1, warps[1] * instr[1] // rows)
    return None


_CACHE: dict[tuple, Usage] = {}


def compile_sm90(config: KernelConfig) -> Usage:
    """Compile ``config`` for sm_90 and return what the compiled code holds (cached per process)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    key = (config.name, config.fn, tuple(sorted(config.signature.items())), tuple(sorted(config.constexprs.items())),
           config.num_warps, config.num_stages)
    if key in _CACHE:
        return _CACHE[key]
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    source = ASTSource(fn=config.fn, signature=config.signature, constexprs=config.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        report = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True,
                                check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", report)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource line for {config.name}:\n{report}")
    registers, stack, _static_shared, local = (int(x) for x in found.groups())
    ttgir = compiled.asm["ttgir"]
    shared = int(compiled.metadata.shared)
    tiles = config.expect.get("row_tiles")
    score = config.expect.get("score_tile")
    usage = Usage(config.name, shared, registers, local, stack, config.num_warps, mma_kind(compiled.asm["ptx"]),
                  row_buffers(ttgir, tiles) if tiles else None,
                  score_copies(ttgir, *score) if score else None,
                  ctas_per_sm(registers, config.num_warps, shared))
    _CACHE[key] = usage
    return usage


def problems(config: KernelConfig, usage: Usage) -> list[str]:
    """What the compiled code of ``config`` breaks: the sm_90 limits, then each of ``config.expect``."""
    out = []
    if usage.shared_bytes > SM90_SHARED_LIMIT:
        out.append(f"{usage.shared_bytes:,} B of shared memory > {SM90_SHARED_LIMIT:,}")
    if usage.local_bytes or usage.stack_bytes:
        out.append(f"register spills: local {usage.local_bytes} B, stack {usage.stack_bytes} B")
    want = config.expect
    if "mma" in want and usage.mma != want["mma"]:
        out.append(f"the products became {usage.mma}, not {want['mma']} (the tensor-core path is lost)")
    if "row_buffers" in want and (usage.row_buffers or 0) < want["row_buffers"]:
        out.append(f"{usage.row_buffers} row tile(s) in flight, expected >= {want['row_buffers']} (pipelining lost)")
    if "ctas_per_sm" in want and usage.ctas_per_sm < want["ctas_per_sm"]:
        out.append(f"{usage.ctas_per_sm} program(s) per SM, the launch heuristic assumes {want['ctas_per_sm']}")
    if "max_registers" in want and usage.registers > want["max_registers"]:
        out.append(f"{usage.registers} registers per thread > the budget {want['max_registers']}")
    if "score_copies" in want and usage.score_copies != want["score_copies"]:
        out.append(f"each score computed by {usage.score_copies} warp(s), expected {want['score_copies']}")
    return out


def structure_table(rows: list[tuple[KernelConfig, Usage]]) -> str:
    """The compiled structure of each configuration as a Markdown table."""
    lines = ["| configuration | warps | stages | registers | shared B | spills B | MMA | row buffers | warps per score "
             "| programs/SM | problems |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for config, usage in rows:
        found = problems(config, usage)
        lines.append(f"| {config.name} | {usage.num_warps} | {config.num_stages} | {usage.registers} | "
                     f"{usage.shared_bytes:,} | {usage.local_bytes + usage.stack_bytes} | {usage.mma} | "
                     f"{usage.row_buffers if usage.row_buffers is not None else '—'} | "
                     f"{usage.score_copies if usage.score_copies is not None else '—'} | {usage.ctas_per_sm} | "
                     f"{'; '.join(found) or 'ok'} |")
    return "\n".join(lines)


def grid_markdown(rows: list[dict[str, Any]]) -> str:
    """:func:`kvzoo.kernels.shapes.grid_table` as a Markdown table."""
    lines = ["| shape | batch x groups | positions | tiles | splits | programs | programs the chip holds | merge tile |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['batch']} x {r['groups']} | {r['positions']:,} | {r['tiles']:,} | "
                     f"{r['splits']} | {r['programs']} | {r['slots']} | {r['merge_block_s']} |")
    return "\n".join(lines)

