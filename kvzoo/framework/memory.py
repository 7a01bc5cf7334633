"""Give the memory a compression frees back to the operating system (glibc's ``malloc_trim``).

A context-ending forward frees one layer's whole prefill right after that layer's attention (the rows it does not
keep). On Linux with glibc, CPU tensors of a few MiB come from the C heap, which keeps freed memory for reuse instead
of returning it; the next layer's activations land elsewhere, and the process's resident memory grows by most of a
layer's prefill per layer although the cache holds only the kept rows (measured with a per-layer trace of the
process's RSS: SmolLM2-135M, 8k tokens, SnapKV 8x, ~11 MiB a layer, 1.77 GiB at the peak against 1.43 GiB with a trim
after each layer).
:func:`release_freed` asks glibc to hand the free pages back (``malloc_trim(0)``: every arena, the free pages inside
the heap too) after each layer of a context-ending forward whose rows -- those it dropped, or those the forward
brought it, whichever is more -- reach :data:`TRIM_AFTER` (2 MiB: SmolLM2-135M's layer at ~1,400 tokens). The rows
brought count because the layer's activations scale with them: with glibc's mmap threshold at 4 MiB
(``kvzoo.allocator``) the blocks of a 2k-token layer (keys, values, rotary halves, the window's scores: 0.7-2.2 MiB
each) come from the heap, and the few hundred KiB of rows each layer keeps land among their freed chunks, so the heap
grows by ~2 MiB a layer that nothing holds. Measured (SmolLM2-135M, SnapKV 8x, 2,000 tokens, the prefill's peak
RSS over the loaded model): 70-118 MiB without a trim, moving from run to run with where the chunks fall (one thread
too), 43-49 MiB with one after each layer, for 30 trims of 1.5-2.5 ms (~1 % of the prefill's CPU time); at 1,000
tokens 35-47 against 24-32 MiB but ~5 % more CPU time, at 512 tokens ~9 %: below the threshold, the pages given
back are faulted in again by the next layer for too little gain. It changes no tensor and no allocator setting,
and is a no-op where there is no glibc (macOS, musl) or when ``KVZOO_MALLOC_TRIM=0``.

Imports nothing of kvzoo and nothing heavy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable

VARIABLE = "KVZOO_MALLOC_TRIM"  # "0": never trim (the allocator's own behaviour)
TRIM_AFTER = 2 << 20  # trim after a layer dropped or was brought this many bytes of rows (below it, trimming costs more)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def can_release() -> bool:
    """Whether :func:`release_freed` does anything here (glibc present, not turned off by ``KVZOO_MALLOC_TRIM=0``)."""
    return os.environ.get(VARIABLE, "1") != "0" and _malloc_trim() is not None


def release_freed(freed: int | None = None) -> bool:
    """Return the C heap's free pages to the operating system after a layer's forward that moved ``freed`` bytes of
    rows (dropped or brought; None: unknown, trim), if they are at least :data:`TRIM_AFTER`; whether it trimmed (see
    the module's text)."""
    if not can_release() or (freed is not None and freed < TRIM_AFTER):
        return False
    _malloc_trim()(0)
    return True
