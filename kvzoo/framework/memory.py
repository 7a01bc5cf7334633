"""Give the memory a compression frees back to the operating system (glibc's ``malloc_trim``).

A context-ending forward frees one layer's whole prefill right after that layer's attention (the rows it does not
keep). On Linux with glibc, CPU tensors of a few MiB come from the C heap, which keeps freed memory for reuse instead
of returning it; the next layer's activations land elsewhere, and the process's resident memory grows by most of a
layer's prefill per layer although the cache holds only the kept rows (measured with a per-layer trace of the
process's RSS: SmolLM2-135M, 8k tokens, SnapKV 8x, ~11 MiB a layer, 1.77 GiB at the peak against 1.43 GiB with a trim
after each layer).
:func:`release_freed` asks glibc to hand the free pages back (``malloc_trim(0)``: every arena, the free pages inside
the heap too) after a layer dropped at least :data:`TRIM_AFTER` bytes of rows (8 MiB: SmolLM2-135M's layer at 8k
tokens drops ~11 MiB at 8x; below it, the pages given back are faulted in again by the next layer for little gain:
trimming after every layer of a 2k prefill cost ~7 % of its CPU time at 2 threads and saved no memory); it changes
no tensor and no allocator setting, and is a no-op where there is no glibc (macOS, musl) or when
``KVZOO_MALLOC_TRIM=0``.

Imports nothing of kvzoo and nothing heavy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable

VARIABLE = "KVZOO_MALLOC_TRIM"  # "0": never trim (the allocator's own behaviour)
TRIM_AFTER = 8 << 20  # trim after a layer freed at least this many bytes of rows (below it, trimming costs more)


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
    """Return the C heap's free pages to the operating system after ``freed`` bytes of rows were dropped (None:
    unknown, trim), if they are at least :data:`TRIM_AFTER`; whether it trimmed (see the module's text)."""
    if not can_release() or (freed is not None and freed < TRIM_AFTER):
        return False
    _malloc_trim()(0)
    return True
