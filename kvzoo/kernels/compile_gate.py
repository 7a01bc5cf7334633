"""Compile a Triton kernel for sm_90 without a GPU and read what it costs (the compile gate).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` builds the H100/H200 binary on
any machine; its metadata gives the shared memory a program needs (limit 232,448 B per block on
sm_90) and ``cuobjdump --dump-resource-usage`` of the cubin gives registers per thread and the local
memory (register spills) and stack. Each kernel module lists the configurations it ships
(``shipped_configs()``, the ones its launcher picks on a GPU); ``tests/test_compile_gate.py`` compiles
every one and holds it to the limits. Imports Triton: never imported by the runtime.
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


@dataclass(frozen=True)
class KernelConfig:
    """One compiled specialisation: the kernel, its argument types and constexprs, warps and stages."""

    name: str
    fn: Any  # a triton.JITFunction
    signature: dict[str, str]  # argument -> "*fp16", "*fp32", "i32", "fp32", "constexpr", ...
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class Usage:
    name: str
    shared_bytes: int
    registers: int
    local_bytes: int  # per-thread local memory: register spills
    stack_bytes: int

    @property
    def ok(self) -> bool:
        return self.shared_bytes <= SM90_SHARED_LIMIT and self.local_bytes == 0

    def __str__(self) -> str:
        return (f"{self.name}: {self.registers} registers/thread, {self.shared_bytes:,} B shared "
                f"(limit {SM90_SHARED_LIMIT:,}), local (spills) {self.local_bytes} B, stack {self.stack_bytes} B")


def _cuobjdump() -> str:
    import triton.backends.nvidia as nvidia

    bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    found = bundled if os.path.exists(bundled) else shutil.which("cuobjdump")
    if not found:
        raise RuntimeError("cuobjdump not found (Triton's NVIDIA backend bundles it in triton/backends/nvidia/bin)")
    return found


def compile_sm90(config: KernelConfig) -> Usage:
    """Compile ``config`` for sm_90 and return its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=config.fn, signature=config.signature, constexprs=config.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
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
    return Usage(config.name, int(compiled.metadata.shared), registers, local, stack)
