"""glibc's mmap threshold for kvzoo's commands and benchmarks, and the resident memory the benchmarks report.

glibc's ``malloc`` serves a block above its *mmap threshold* with a mapping of its own, which ``free`` hands straight
back to the operating system, and a smaller one from its heap, which keeps freed memory for reuse. The threshold
starts at 128 KiB and is dynamic: each free of a mapped block raises it to that block's size (up to 32 MiB), so once a
prefill's first layers have freed their activations, blocks of several MiB come from the heap, and what a layer frees
stays resident while the next layer maps more. A prefill's peak RSS then counts memory nothing holds (measured in
docs/results.md, "glibc's mmap threshold, with and without": at 4 MiB both transformers' and SnapKV's prefill peak
lower; the price is a fresh mapping, its pages faulted in, for each such block: SnapKV's prefill there took about a
tenth more CPU time).
:func:`prefer_mmap_threshold` fixes the threshold at :data:`THRESHOLD` (4 MiB) for the running process --
``mallopt(M_MMAP_THRESHOLD, 4 MiB)``, which also turns the dynamic threshold off: that is the point -- and exports
``MALLOC_MMAP_THRESHOLD_`` so that the processes it starts (benchmark cells, Ray workers) have the same from their
start. It leaves glibc alone when the environment sets ``MALLOC_MMAP_THRESHOLD_`` (glibc read it at start) or
``KVZOO_MMAP_THRESHOLD=0`` (glibc's own dynamic threshold), and does nothing without glibc (musl, macOS); its note
says which. It changes no tensor: only where the allocator takes blocks of 4 MiB and more from.

:func:`mark_model` and :func:`peak_over_model` read ``/proc/self/status`` for the benchmarks' "peak RSS over the
loaded model": the prefill's peak RSS (``VmHWM``, reset to the RSS of the moment by :func:`mark_model`) less the RSS
right after the model was loaded and warmed, before the prefill (``VmRSS`` then).

Imports nothing of kvzoo and nothing heavy (no torch): the CLI calls it before anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

VARIABLE = "MALLOC_MMAP_THRESHOLD_"  # glibc's own, read once at process start
OFF = "KVZOO_MMAP_THRESHOLD"  # "0": leave glibc's dynamic threshold
THRESHOLD = 4 << 20  # bytes: a block this size or larger is mapped, and unmapped when freed
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>

_note: str | None = None  # what the first call did: the setting is applied once per process


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc (``gnu_get_libc_version`` tells them apart:
    musl has a ``mallopt`` that does nothing)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    fn = libc.mallopt
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def prefer_mmap_threshold() -> str:
    """Fix glibc's mmap threshold at 4 MiB unless the environment chose (see the module's text); a one-line note of
    what is in effect. Only the first call acts; later ones return its note."""
    global _note
    if _note is None:
        _note = _apply()
    return _note


def _apply() -> str:
    if VARIABLE in os.environ:
        return f"{VARIABLE}={os.environ[VARIABLE]} (from the environment: glibc read it at start)"
    if os.environ.get(OFF) == "0":
        return f"glibc's dynamic mmap threshold ({OFF}=0)"
    mallopt = _mallopt()
    if mallopt is None:
        return "mmap threshold not set (the C library is not glibc: its allocator's own)"
    if mallopt(M_MMAP_THRESHOLD, THRESHOLD) != 1:
        return f"mmap threshold not set (glibc's mallopt refused {THRESHOLD}: its dynamic threshold)"
    os.environ[VARIABLE] = str(THRESHOLD)  # the processes this one starts get it from their start
    return (f"{VARIABLE}={THRESHOLD} (set by kvzoo: freed blocks of 4 MiB and more go back to the system; "
            f"export {VARIABLE}, or {OFF}=0 for glibc's dynamic threshold, to override)")


def mmap_threshold() -> int | None:
    """The fixed mmap threshold in effect, in bytes, as far as the environment says (kvzoo's export included; call
    after :func:`prefer_mmap_threshold`); None: glibc's dynamic one, or no glibc."""
    value = os.environ.get(VARIABLE)
    return int(value) if value and value.isdigit() else None


# --- resident memory, as the benchmarks report it -----------------------------------------------

STATUS = "/proc/self/status"


def _status_mib(status: str, key: str) -> float:
    """A ``kB`` line of ``/proc/self/status``'s text (``VmRSS``, ``VmHWM``) in MiB; NaN when absent."""
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _read_status() -> str:
    try:
        with open(STATUS) as fh:
            return fh.read()
    except OSError:
        return ""


_peak_reset = False  # whether mark_model could reset the peak


def mark_model() -> float:
    """Call right after the model is loaded and warmed, before the prefill: resets the process's peak RSS to its RSS
    now (Linux: ``5`` written to ``/proc/self/clear_refs``; the load's own peak, above it, is forgotten -- and with it
    ``ru_maxrss``, which reads the same counter) and returns that RSS, in MiB."""
    global _peak_reset
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        _peak_reset = True
    except OSError:  # VmHWM stays the process's whole peak: peak_over_model says so
        _peak_reset = False
    return _status_mib(_read_status(), "VmRSS")


def peak_rss_mib() -> float:
    """The process's peak RSS so far (``VmHWM``: since :func:`mark_model` where it could reset it), in MiB."""
    return _status_mib(_read_status(), "VmHWM")


def peak_over_model(model_rss_mib: float, status: str | None = None) -> dict[str, float | bool]:
    """The fields a prefill's row records, from the RSS :func:`mark_model` returned and ``/proc/self/status``
    (``status``: its text; read now when None): ``peak_rss_mib``, the peak RSS since the mark, everything resident
    (weights, libraries, the prefill); ``model_rss_mib``, the RSS at the mark; ``peak_rss_over_model_mib``, the
    first less the second; ``peak_since_mark``, whether the peak counts from the mark (False where it could not be
    reset: then it is the process's whole peak, the load's included)."""
    status = _read_status() if status is None else status
    peak = _status_mib(status, "VmHWM")
    return {"peak_rss_mib": peak, "model_rss_mib": model_rss_mib, "peak_rss_over_model_mib": peak - model_rss_mib,
            "peak_since_mark": _peak_reset}
