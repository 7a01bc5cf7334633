"""Small C kernels for CPU tensors, built on first use by torch's extension builder and called through ctypes.

Why: a decode step on CPU should cost what its bytes cost, and two of its ops do not in PyTorch.

* The **int8 index scan** (VestigeKV) is ``hq`` query rows (a group's heads, 3 on SmolLM2) against ``m`` int8 rows:
  in PyTorch an fp32 upcast of the codes and a matrix product whose short side is ``hq``, which BLAS runs at a small
  fraction of its speed. The C loop converts each row's codes in registers and multiplies them with every query row
  at once (AVX-512: 16 rows per pass, their sixteen 16-lane dot products reduced together), so the scan reads the
  int8 bytes once: :func:`int8_estimate`, and VestigeKV's whole top-j rule in one call, :func:`int8_choose`.
* **Decode attention over gathered rows**: a layer's rows stay in one pool ``[B, G, capacity, D]`` and a step
  attends over index lists into it. In PyTorch a gathered source costs an ``index_select`` copy and several small
  ops, and SDPA with ``enable_gqa`` reads a row once per query head; :func:`decode_attend` reads each readable row
  once per KV group, where it lies, for all the group's heads (one pass, online softmax), and merges a prior part
  (the runtime's tier) into the same softmax (``kvzoo.kernels.decode_attention``'s specification, one source).

The sources are ``kvzoo/kernels/csrc/`` (one file per op family, C-style C++ with C names, warning-free under
``-Wall -Wextra``), built by :func:`torch.utils.cpp_extension.load` -- ninja, its dependency tracking and its lock
between processes -- once per machine and source version into the user's cache directory (``$KVZOO_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvzoo`` or ``~/.cache/kvzoo``) with ``$CXX`` (default ``c++``), ``-O3 -march=native``. Threads:
where torch runs on GNU OpenMP (its wheel ships ``libgomp``) the kernels are built with ``-fopenmp`` and linked
against that very library, found in the process's memory map, so one OpenMP runtime (and one thread pool) serves
torch and these kernels; a call takes ``torch.get_num_threads()`` threads when its rows are large enough to pay for
waking them (:data:`PARALLEL_BYTES`). Elsewhere, or if that build fails, they run on one thread. Where no compiler
(or no ninja) works, :func:`library` returns None once and says why in a RuntimeWarning, and callers take the
PyTorch references (``tests/test_index_scan_native.py`` and ``tests/test_native_decode_attention.py`` hold the
kernels to them). ``KVZOO_KERNELS=torch`` takes the references everywhere.

Each kernel is a torch op (``torch.ops.kvzoo.*``, a plain :class:`torch.library.Library` registration with CPU and
Meta implementations: ``custom_op`` costs ~80 us of Python per call), so traces count it and ``torch.compile``
takes it whole.

Imports with torch alone (ctypes is the standard library's).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvzoo.kernels.decode_attention.rows import Rows

MAX_HQ = 64  # query rows per group the int8 scan takes (a group's heads x queries)
MAX_D = 1024  # the longest key (and value) the kernels take
MAX_J = 64  # rows per query row the top-j rule takes
LANES = 8  # the int8 scan's head dim must be a multiple of this
MAX_HPG = 64  # query heads per KV group decode attention takes
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # decode attention's rows (and query)
INDEX_DTYPES = (torch.int32, torch.int64)
_BOOL = (torch.bool,)
# Bytes of rows below which a call runs on one thread. Waking torch's OpenMP threads costs ~1 us while they spin
# (libgomp's default) but ~60 us once they sleep (OMP_WAIT_POLICY=PASSIVE, which kvzoo's CLI and benchmarks set:
# an idle core of this 2-core VM is halted, and waking it is an interrupt to the host); at ~20 GB/s a second thread
# pays only past ~3 MiB then (measured on an idle machine, SmolLM2 pool read from memory: 2k tokens (3 MiB) 1.08x,
# 8k 1.38x, 32k 1.35x; with another process on the second core, never). Read once: libgomp reads the variable when
# torch loads it.
# (Each call takes torch.get_num_threads() threads when it reads at least this many bytes, else 1: written in place
# at each call, not as a helper, since the ops run per layer per decode step.)
PARALLEL_BYTES = (3 << 20) if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive" else (256 << 10)


def unobserved() -> bool:
    """Nothing watches the dispatcher: no torch.compile, no dispatch mode (FakeTensor, a trace recorder), no
    torch-function mode, no JIT tracer. Then the registered CPU function may be called as a function. (Under
    ``torch.compile`` the first test is a constant True to dynamo, so the others, which it cannot trace, are never
    reached there: the compiled step takes the registered op, no graph break.)"""
    if torch.compiler.is_compiling():
        return False
    return not (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
                or torch._C._get_tracing_state())


def cache_dir() -> Path:
    root = os.environ.get("KVZOO_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvzoo"


# /proc/cpuinfo's lines that name the processor and its instruction sets: x86 ("model name", "flags") and ARM
# ("CPU implementer"/"part"/"variant"/"revision", "Features"); the first of each is the machine's
_CPUINFO_KEYS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",
                 "CPU revision")


def _cpu_signature() -> str:
    """What ``-march=native`` / ``-mcpu=native`` depends on: the processor's model and instruction sets, so that a
    cache folder shared by machines never hands one a library built for another (an illegal instruction). Linux reads
    ``/proc/cpuinfo``, macOS ``sysctl``; where neither names the processor, the machine's own name stands in (the
    library is then built per machine)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in _CPUINFO_KEYS and key not in found:
                    found[key] = line.strip()
    except OSError:
        pass
    if not found and sys.platform == "darwin":
        try:
            found["sysctl"] = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string", "hw.cputype", "hw.cpusubtype", "hw.cpufamily"],
                capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "\n".join(found.values()) if any(found.values()) else f"host {platform.node()} {platform.processor()}"


def _arch_flag(march: str) -> str:
    """``-march=native`` on x86; on ARM ``-mcpu=native`` (GCC's and clang's spelling there: clang before 15 rejects
    ``-march=native`` on ARM)."""
    if march == "native" and platform.machine().lower() in ("aarch64", "arm64"):
        return "-mcpu=native"
    return f"-march={march}"


def openmp_runtime() -> str | None:
    """The GNU OpenMP runtime (``libgomp``) loaded in this process -- torch's, when torch runs on OpenMP -- or None
    when there is none, or more than one (then the kernels are built without OpenMP)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {parts[5].strip() for parts in (line.split(maxsplit=5) for line in f)
                     if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libgomp")}
    except OSError:  # not Linux
        return None
    paths = {p for p in paths if os.path.isfile(p)}
    return paths.pop() if len(paths) == 1 else None


CSRC = Path(__file__).resolve().parent / "csrc"
# one file per op family (their shared inline helpers in csrc/*.h); compiled as C++17, each exported name C's
SOURCES = ("library.cpp", "int8_scan.cpp", "decode_attend.cpp", "sketch_choose.cpp", "quest.cpp")
COMPILE_FLAGS = ("-O3", "-Wall", "-Wextra")


def compiler() -> str:
    """The C++ compiler torch's extension builder runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def _runs(command: str) -> bool:
    """``command --version`` exits 0 (``CXX=false``, a broken wrapper: it does not)."""
    try:
        return subprocess.run([command, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_RUNS: dict[str, bool] = {}


def toolchain_missing() -> str | None:
    """Why the kernels cannot be built here (no working C++ compiler, no ninja), or None: both run (ninja also where
    the ``ninja`` package put it beside this interpreter). Each command is tried once per process."""
    cxx = compiler()
    ninja = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    for command, missing in ((cxx, f"no C++ compiler {cxx!r} that runs (set CXX)"),
                             (ninja, "no ninja on PATH (pip install ninja)")):
        if command is None or shutil.which(command) is None:
            return missing
        if command not in _RUNS:
            _RUNS[command] = _runs(command)
        if not _RUNS[command]:
            return missing
    return None


def compile_library(march: str = "native", runtime: str | None = None) -> ctypes.CDLL:
    """Build (once per source, flags, compiler and processor: ninja rebuilds what changed) and load the kernels for
    ``-march=march``, with OpenMP linked against ``runtime`` (None: without OpenMP), by
    :func:`torch.utils.cpp_extension.load` into :func:`cache_dir`. :func:`library` is the one the ops use; tests
    build the portable C (``march='x86-64'``) with this."""
    from torch.utils import cpp_extension

    missing = toolchain_missing()
    if missing is not None:
        raise RuntimeError(missing)
    if runtime is not None and not os.path.isfile(runtime):
        raise FileNotFoundError(f"no OpenMP runtime at {runtime}")
    # one build folder per target and checkout: a -march=native build never serves another CPU, and two checkouts
    # (git worktrees, an installed copy beside a clone) never rebuild each other's library in one folder
    key = hashlib.sha256("\0".join([march, runtime or "", compiler(), platform.machine(), _cpu_signature(),
                                    str(CSRC)]).encode()).hexdigest()[:16]
    name = f"kvzoo_cpu_{key}"
    folder = cache_dir() / "native" / name
    folder.mkdir(parents=True, exist_ok=True)
    cflags = [*COMPILE_FLAGS, _arch_flag(march), *(["-fopenmp"] if runtime else [])]
    # link against the runtime already loaded (not the compiler's own -lgomp): one OpenMP runtime in the process
    ldflags = [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"] if runtime else []
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([path, os.path.dirname(sys.executable)])  # a pip-installed ninja
    try:
        built = cpp_extension.load(name, [str(CSRC / source) for source in SOURCES], extra_cflags=cflags,
                                   extra_ldflags=ldflags, build_directory=str(folder), is_python_module=False,
                                   verbose=False)
    finally:
        os.environ["PATH"] = path
    lib = ctypes.CDLL(str(built))
    fn = lib.kvzoo_int8_estimate
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 10 + [ctypes.c_float, ctypes.c_int64]
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {  # the C functions' parameters in order (csrc/*.cpp): pointers, integers, floats
        "kvzoo_int8_choose": [pointer] * 9 + [integer] * 12 + [real] * 2 + [integer],
        "kvzoo_sketch_choose": [pointer] * 2 + [integer] * 2 + [pointer] + [integer] * 4 + [pointer] * 6
                               + [integer] * 11 + [real] * 2 + [integer],
        "kvzoo_quest_choose": [pointer] * 2 + [integer] * 4 + [pointer] + [integer] * 3 + [pointer] * 2
                              + [integer] * 4 + [pointer] * 5 + [integer] * 9 + [real] * 2 + [integer]
                              + [pointer] + [integer] * 4 + [pointer] + [integer] * 3 + [pointer] + [integer] * 2
                              + [pointer] * 2,
        "kvzoo_quest_page_add": [pointer] + [integer] * 4 + [pointer] + [integer] * 3 + [pointer] + [integer] * 2
                                + [pointer] * 3 + [integer] * 3 + [pointer] + [integer] * 3 + [pointer] * 2
                                + [integer] * 6,
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    attend = lib.kvzoo_decode_attend
    attend.restype = ctypes.c_int
    attend.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    lib.kvzoo_openmp.restype = ctypes.c_int
    lib.kvzoo_openmp.argtypes = []
    lib.openmp = runtime if lib.kvzoo_openmp() else None  # the runtime its threads come from (None: one thread)
    return lib


# What the first call of library() found: [the library] or [None] (unavailable here); empty until then. Read by the
# traced path of a compiled step as a plain global (library() and available() touch no file once it is set), and by
# the ops' CPU functions (a test that runs another build sets it: monkeypatch.setattr(cpu_native, "_LOADED", [lib])).
_LOADED: list[ctypes.CDLL | None] = []


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on the first call), or None -- with one RuntimeWarning saying why -- where they
    cannot be built or loaded here. Built with OpenMP on torch's own runtime where there is one (else, or if that
    build fails, without). After the first call, a lookup."""
    if not _LOADED:
        _LOADED.append(_load())
    return _LOADED[0]


library.cache_clear = _LOADED.clear  # type: ignore[attr-defined]  # forget it (tests rebuild under other settings)


def available() -> bool:
    """Whether the kernels are built and loaded here (:func:`library` is not None): a constant once the first eager
    call has loaded them. Inside ``torch.compile`` before any eager call it is False (the traced step then takes the
    PyTorch references; nothing is built or read from the filesystem while tracing)."""
    if not _LOADED:
        return not torch.compiler.is_compiling() and library() is not None
    return _LOADED[0] is not None


def _load() -> ctypes.CDLL | None:
    try:
        runtime = openmp_runtime()
        if runtime is not None:
            try:
                return compile_library("native", runtime)
            except (RuntimeError, subprocess.CalledProcessError, OSError):  # a runtime the linker refuses: one thread
                pass
        return compile_library("native", None)
    except Exception as err:  # a missing or failing compiler, an unwritable cache: the reference runs instead
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvzoo: the CPU kernels could not be built ({type(err).__name__}: {detail}); the int8 index "
                      "scan and decode attention run their PyTorch references (slower; set CXX to a C++ compiler and "
                      "install ninja, or KVZOO_KERNELS=torch to silence this)", RuntimeWarning, stacklevel=2)
        return None


def _on_cpu(tensors: tuple) -> bool:
    """Every tensor of ``tensors`` (None skipped) is a CPU tensor. A loop, not ``all()`` over a generator: these
    checks run per layer per decode step, where each generator step is a Python frame switch."""
    for t in tensors:
        if t is not None and (not isinstance(t, torch.Tensor) or t.device.type != "cpu"):
            return False
    return True


def _of_dtype(tensors: tuple, dtypes: tuple) -> bool:
    """Every tensor of ``tensors`` (None skipped) has a dtype of ``dtypes``."""
    for t in tensors:
        if t is not None and t.dtype not in dtypes:
            return False
    return True


def int8_estimate_supported(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor) -> bool:
    """Whether :func:`int8_estimate` takes these tensors (CPU, the dtypes and a geometry the loop handles)."""
    hq, D = query.shape[2], query.shape[3]
    return (query.device.type == "cpu" and codes.device.type == "cpu" and side.device.type == "cpu"
            and query.dtype == torch.float32 and codes.dtype == torch.int8 and side.dtype == torch.float16
            and hq <= MAX_HQ and D <= MAX_D and D % LANES == 0 and not query.requires_grad
            and codes.stride(-1) == 1 and (codes.shape[2] <= 1 or codes.stride(2) == codes.shape[3])
            and side.stride(-1) == 1 and (side.shape[2] <= 1 or side.stride(2) == side.shape[3]))  # rows contiguous


def int8_estimate(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, scaling: float,
                  length: torch.Tensor | None) -> torch.Tensor:
    """The C loop's ``estimate [B, G, hq, m]`` (``csrc/int8_scan.cpp``) for ``codes [B, G, m, D]`` and
    ``side [B, G, m, w]``; the caller checked :func:`int8_estimate_supported` and that :func:`library` is not None.
    Registered as the torch op ``kvzoo::int8_estimate`` (called as a function when nothing observes the dispatcher:
    :func:`unobserved`)."""
    lengths = None if length is None else length.to(torch.int64)
    if unobserved() and query.is_cpu and codes.is_cpu and side.is_cpu and (lengths is None or lengths.is_cpu):
        return _int8_estimate_cpu(query, codes, side, lengths, float(scaling))  # the op's CPU function, undispatched
    return torch.ops.kvzoo.int8_estimate(query, codes, side, lengths, float(scaling))


def _int8_estimate_cpu(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, length: torch.Tensor | None,
                       scaling: float) -> torch.Tensor:
    lib = _LOADED[0] if _LOADED else library()  # loaded (one lookup, no call) by the check that chose the op
    B, G, hq, D = query.shape
    m = codes.shape[2]
    q = query.contiguous()
    lengths = None if length is None else length.contiguous()
    out = torch.empty(B, G, hq, m, dtype=torch.float32)
    threads = torch.get_num_threads() if B * G * m * (D + 2 * side.shape[-1]) >= PARALLEL_BYTES else 1  # PARALLEL_BYTES
    status = lib.kvzoo_int8_estimate(
        q.data_ptr(), codes.data_ptr(), side.data_ptr(), None if lengths is None else lengths.data_ptr(),
        out.data_ptr(), B, G, hq, D, m, codes.stride(0), codes.stride(1), side.stride(0), side.stride(1),
        side.shape[-1], scaling, threads)
    if status != 0:
        raise RuntimeError(f"kvzoo_int8_estimate refused hq={hq}, D={D} (hq <= {MAX_HQ}, D <= {MAX_D}, "
                           f"D % {LANES} == 0)")
    return out


def _int8_estimate_meta(query, codes, side, length, scaling):
    B, G, hq, _ = query.shape
    return query.new_empty(B, G, hq, codes.shape[2], dtype=torch.float32)


# a plain operator registration (torch.library.custom_op adds ~80 us of Python per call; this path ~10 us)
_LIBRARY = torch.library.Library("kvzoo", "DEF")
_LIBRARY.define("int8_estimate(Tensor query, Tensor codes, Tensor side, Tensor? length, float scaling) -> Tensor")
_LIBRARY.impl("int8_estimate", _int8_estimate_cpu, "CPU")
_LIBRARY.impl("int8_estimate", _int8_estimate_meta, "Meta")


def _pointers(*tensors: torch.Tensor | None) -> list[int | None]:
    """Each tensor's data pointer (None for None), for the C calls: one call for all of a call's optional tensors."""
    return [None if t is None else t.data_ptr() for t in tensors]  # a list comprehension: one frame, not one per item


def counter_ok(counter: torch.Tensor | None) -> bool:
    """A fetched-rows counter the C ops add to in place: None, or an int64 CPU tensor of one element."""
    return counter is None or (counter.device.type == "cpu" and counter.dtype == torch.int64 and counter.numel() == 1
                               and counter.is_contiguous())


def int8_choose(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, threshold: torch.Tensor, j: int,
                archived: int, scaling: float, slack: float, length: torch.Tensor | None,
                counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over int8 entries for a decode step, staged and counted: ``(idx, picked) [B, G, hq * j]``
    and ``count`` (int64, 0-dim: the rows picked over every group, also added in place to ``counter``, the layer's
    fetched rows, when given) -- see ``kvzoo_int8_choose`` in ``csrc/int8_scan.cpp``; ``threshold [B, G, hq]`` is
    ``s* - j_margin``. One call for what the PyTorch path does in ~30 ops (scan, top-j, the chosen rows' bounds, the
    group's union, the count). The caller checked :func:`int8_estimate_supported`, ``1 <= j <= min(MAX_J, m)``, the
    counter (:func:`counter_ok`) and that :func:`library` is not None."""
    lengths = None if length is None else length.to(torch.int64)
    args = (query, codes, side, lengths, threshold.float(), j, archived, float(scaling), float(slack), counter)
    if unobserved() and query.is_cpu and codes.is_cpu and side.is_cpu and args[4].is_cpu and (
            lengths is None or lengths.is_cpu):
        return _int8_choose_cpu(*args)  # the op's CPU function, undispatched
    return torch.ops.kvzoo.int8_choose(*args)


def _int8_choose_cpu(query, codes, side, length, threshold, j, archived, scaling, slack, counter=None):
    lib = _LOADED[0] if _LOADED else library()  # loaded (one lookup, no call) by the check that chose the op
    B, G, hq, D = query.shape
    q = query.contiguous()
    thr = threshold.contiguous()
    lengths = None if length is None else length.contiguous()
    idx = torch.empty(B, G, hq * j, dtype=torch.int64)
    picked = torch.empty(B, G, hq * j, dtype=torch.bool)
    count = torch.empty((), dtype=torch.int64)
    m = codes.shape[2]
    threads = torch.get_num_threads() if B * G * m * (D + 2 * side.shape[-1]) >= PARALLEL_BYTES else 1
    length_at, counter_at = _pointers(lengths, counter)
    status = lib.kvzoo_int8_choose(
        q.data_ptr(), codes.data_ptr(), side.data_ptr(), length_at, thr.data_ptr(), idx.data_ptr(), picked.data_ptr(),
        count.data_ptr(), counter_at, B, G, hq, D, m, j, archived, codes.stride(0), codes.stride(1), side.stride(0),
        side.stride(1), side.shape[-1], scaling, slack, threads)
    if status != 0:
        raise RuntimeError(f"kvzoo_int8_choose refused hq={hq}, D={D}, j={j}, m={codes.shape[2]}, "
                           f"archived={archived} (hq <= {MAX_HQ}, D % {LANES} == 0, 1 <= j <= min({MAX_J}, m))")
    return idx, picked, count


def _staged_meta(query, K):
    B, G = query.shape[:2]
    return (query.new_empty(B, G, K, dtype=torch.int64), query.new_empty(B, G, K, dtype=torch.bool),
            query.new_empty((), dtype=torch.int64))


def _int8_choose_meta(query, codes, side, length, threshold, j, archived, scaling, slack, counter=None):
    return _staged_meta(query, query.shape[2] * j)


_LIBRARY.define("int8_choose(Tensor query, Tensor codes, Tensor side, Tensor? length, Tensor threshold, int j, "
                "int archived, float scaling, float slack, Tensor(a!)? counter=None) -> (Tensor, Tensor, Tensor)")
_LIBRARY.impl("int8_choose", _int8_choose_cpu, "CPU")
_LIBRARY.impl("int8_choose", _int8_choose_meta, "Meta")


# ----------------------------------------------------------------------------------------------------------------
# fused decode-step choices over float index entries (kvzoo.kernels.choose: the references and the dispatch)
# ----------------------------------------------------------------------------------------------------------------

MAX_W = 2 * MAX_D + 1  # the widest index entry the float scans take (a Quest page of MLA's 576-dim rows)
SCAN_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C code's F32, BF16, F16


def sketch_choose_supported(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, floor: torch.Tensor,
                            j: int, counter: torch.Tensor | None = None) -> bool:
    """Whether :func:`sketch_choose` takes these tensors: CPU, fp32 query, basis and floor, entries fp32 or fp16 with
    contiguous rows, the basis' ``[dc, r]`` contiguous, ``hq <= MAX_HQ``, ``D <= MAX_D``, ``1 <= j <= min(MAX_J, m)``,
    no autograd, and the library built here (widths are checked by the op: a wrong one is an error, not a fallback)."""
    if query.dim() != 4 or basis.dim() != 4 or entries.dim() != 4:
        return False
    return (_on_cpu((query, basis, entries, floor)) and query.dtype == torch.float32
            and basis.dtype == torch.float32 and floor.dtype == torch.float32
            and entries.dtype in (torch.float32, torch.float16) and 1 <= query.shape[2] <= MAX_HQ
            and query.shape[3] <= MAX_D and 1 <= j <= min(MAX_J, entries.shape[2]) and entries.stride(-1) == 1
            and basis.stride(-1) == 1 and basis.stride(-2) == basis.shape[-1] and counter_ok(counter)
            and not (query.requires_grad or entries.requires_grad)
            and (_LOADED[0] is not None if _LOADED else available()))


def sketch_choose(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, length: torch.Tensor | None,
                  floor: torch.Tensor, j: int, archived: int, scaling: float, slack: float, rank_by_bound: bool,
                  counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over its sketch for a decode step, in one call: ``(idx, picked) [B, G, hq * j]`` staged
    and ``count`` (added to ``counter`` in place when given); ``kvzoo_sketch_choose`` in
    ``csrc/sketch_choose.cpp``, whose specification is :func:`kvzoo.kernels.choose.sketch_choose_reference`. The
    caller checked :func:`sketch_choose_supported`. The torch op ``kvzoo::sketch_choose``."""
    lengths = None if length is None else length.to(torch.int64)
    args = (query, basis, entries, lengths, floor, j, archived, float(scaling), float(slack), bool(rank_by_bound),
            counter)
    if unobserved() and query.is_cpu and entries.is_cpu and floor.is_cpu and (lengths is None or lengths.is_cpu):
        return _sketch_choose_cpu(*args)
    return torch.ops.kvzoo.sketch_choose(*args)


def _sketch_choose_cpu(query, basis, entries, length, floor, j, archived, scaling, slack, rank_by_bound,
                       counter=None):
    B, G, hq, D = query.shape
    dc, r = basis.shape[2], basis.shape[3]
    m, W = entries.shape[2], entries.shape[3]
    if basis.shape[:2] != (B, G) and not (basis.shape[0] == 1 and basis.shape[1] == G):
        raise ValueError(f"kvzoo::sketch_choose: basis must be [B={B} (or 1), G={G}, dc, r], got {list(basis.shape)}")
    q = query.contiguous()
    thr = floor.contiguous()
    lengths = None if length is None else length.contiguous()
    idx = torch.empty(B, G, hq * j, dtype=torch.int64)
    picked = torch.empty(B, G, hq * j, dtype=torch.bool)
    count = torch.empty((), dtype=torch.int64)
    threads = torch.get_num_threads() if B * G * m * W * entries.element_size() >= PARALLEL_BYTES else 1
    length_at, counter_at = _pointers(lengths, counter)
    status = (_LOADED[0] if _LOADED else library()).kvzoo_sketch_choose(
        q.data_ptr(), basis.data_ptr(), 0 if basis.shape[0] == 1 else basis.stride(0), basis.stride(1),
        entries.data_ptr(), SCAN_DTYPES[entries.dtype], entries.stride(0), entries.stride(1), entries.stride(2),
        length_at, thr.data_ptr(), idx.data_ptr(), picked.data_ptr(), count.data_ptr(), counter_at,
        B, G, hq, D, dc, r, m, W, j, archived, int(rank_by_bound), scaling, slack, threads)
    if status != 0:
        raise RuntimeError(f"kvzoo_sketch_choose refused hq={hq}, D={D}, dc={dc}, r={r}, W={W}, j={j}, m={m}, "
                           f"archived={archived} (hq <= {MAX_HQ}, D <= {MAX_D}, r <= dc <= D, W = r + 1 + dr + 2 with "
                           f"dr = D - dc (r + 2 when dr = 0), 1 <= j <= min({MAX_J}, m), entries fp32 or fp16)")
    return idx, picked, count


def _sketch_choose_meta(query, basis, entries, length, floor, j, archived, scaling, slack, rank_by_bound,
                        counter=None):
    return _staged_meta(query, query.shape[2] * j)


_LIBRARY.define("sketch_choose(Tensor query, Tensor basis, Tensor entries, Tensor? length, Tensor floor, int j, "
                "int archived, float scaling, float slack, bool rank_by_bound, Tensor(a!)? counter=None) "
                "-> (Tensor, Tensor, Tensor)")
_LIBRARY.impl("sketch_choose", _sketch_choose_cpu, "CPU")
_LIBRARY.impl("sketch_choose", _sketch_choose_meta, "Meta")


def quest_choose_supported(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                           positions: torch.Tensor | None, counter: torch.Tensor | None = None,
                           own: tuple[torch.Tensor, ...] | None = None) -> bool:
    """Whether :func:`quest_choose` takes these tensors: CPU, an fp32 query of at most ``MAX_HQ`` rows per group,
    entries fp32, bf16 or fp16 with contiguous rows at most :data:`MAX_W` wide, bool flags, int64 ``live`` (one
    element) and positions, no autograd, and the library built here; ``own`` (or None): keys in the entries' dtype
    with contiguous rows, bool valid, int64 position, contiguous fp32 running min/max."""
    if query.dim() != 4 or entries.dim() != 4:
        return False
    if own is not None:
        keys, valid, position, open_min, open_max = own
        if not (_on_cpu(own) and keys.dtype == entries.dtype and keys.stride(-1) == 1
                and valid.dtype == torch.bool and position.dtype == torch.int64
                and open_min.dtype == torch.float32 and open_max.dtype == torch.float32
                and open_min.is_contiguous() and open_max.is_contiguous()
                and not keys.requires_grad):
            return False
    tensors = (query, entries, empty, live) + (() if positions is None else (positions,))
    return (_on_cpu(tensors) and query.dtype == torch.float32
            and entries.dtype in SCAN_DTYPES and entries.shape[3] <= MAX_W and entries.stride(-1) == 1
            and 1 <= query.shape[2] <= MAX_HQ and empty.dtype == torch.bool and live.dtype == torch.int64
            and live.numel() == 1 and (positions is None or positions.dtype == torch.int64)
            and (counter is None or (counter.device.type == "cpu" and counter.dtype == torch.int64
                                     and counter.numel() == 1 and counter.is_contiguous()))  # counter_ok
            and not (query.requires_grad or entries.requires_grad)
            and (_LOADED[0] is not None if _LOADED else available()))


def quest_choose(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                 positions: torch.Tensor | None, pages: int, size: int, archived: int, per_head: bool, scaling: float,
                 slack: float, counter: torch.Tensor | None = None, own: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Quest's choice for a decode step in one call: ``(rows, positions, valid) [B, G, K]`` and ``count`` (added to
    ``counter`` in place when given); ``positions`` None when the archive list is not given; ``own``: the step's own
    row and the open page's min/max (:func:`kvzoo.kernels.choose.quest_choose`). ``kvzoo_quest_choose`` in
    ``csrc/quest.cpp``, whose specification is :func:`kvzoo.kernels.choose.quest_choose_reference`. The caller checked
    :func:`quest_choose_supported`. The torch op ``kvzoo::quest_choose``."""
    args = (query, entries, empty, live, positions, pages, size, archived, bool(per_head), float(scaling),
            float(slack), counter, *(own if own is not None else (None,) * 5))
    if unobserved() and query.is_cpu and entries.is_cpu and empty.is_cpu and live.is_cpu:
        rows, at, valid, count = _quest_choose_cpu(*args)
    else:
        rows, at, valid, count = torch.ops.kvzoo.quest_choose(*args)
    return rows, at if positions is not None else None, valid, count


def _quest_rows(query, pages, size, per_head):
    return query.shape[2] * pages * size if per_head else pages * size


def _quest_choose_cpu(query, entries, empty, live, positions, pages, size, archived, per_head, scaling, slack,
                      counter=None, own_keys=None, own_valid=None, own_position=None, open_min=None, open_max=None):
    B, G, hq, D = query.shape
    P, W = entries.shape[2], entries.shape[3]
    if (entries.shape[0], entries.shape[1], W) != (B, G, 2 * D + 1) or tuple(empty.shape) != (B, G, P):
        raise ValueError(f"kvzoo::quest_choose: entries must be [B={B}, G={G}, P, 2 D + 1 = {2 * D + 1}] and empty "
                         f"[B, G, P] for query {list(query.shape)}, got {list(entries.shape)} and {list(empty.shape)}")
    absent = (own_keys is None) + (own_valid is None) + (own_position is None) + (open_min is None) + (open_max is None)
    if absent not in (0, 5):
        raise ValueError("kvzoo::quest_choose: own_keys, own_valid, own_position, open_min and open_max go together")
    N = own_keys.shape[2] if own_keys is not None else 0
    if own_keys is not None:
        shapes = ((own_keys, (B, G, N, D)), (own_valid, (B, G, N)), (own_position, (B, G)), (open_min, (B, G, D)),
                  (open_max, (B, G, D)))
        if not (own_keys.shape == shapes[0][1] and own_valid.shape == shapes[1][1]
                and own_position.shape == shapes[2][1] and open_min.shape == shapes[3][1]
                and open_max.shape == shapes[4][1]):
            raise ValueError(f"kvzoo::quest_choose: own_keys, own_valid, own_position, open_min and open_max must be "
                             f"[B, G, N, D], [B, G, N], [B, G], [B, G, D] (twice) for query {list(query.shape)}; got "
                             f"{[list(t.shape) for t, _ in shapes]}")
    if positions is not None and tuple(positions.shape[:2]) != (B, G):
        raise ValueError(f"kvzoo::quest_choose: positions must be [B={B}, G={G}, M], got {list(positions.shape)}")
    q = query.contiguous()
    K = hq * pages * size if per_head else pages * size
    rows = torch.empty(B, G, K, dtype=torch.int64)
    at = torch.empty(B, G, K, dtype=torch.int64) if positions is not None else torch.empty(0, dtype=torch.int64)
    valid = torch.empty(B, G, K, dtype=torch.bool)
    count = torch.empty((), dtype=torch.int64)
    pos_strides = (0, 0, 0, 0) if positions is None else (*positions.stride(), positions.shape[2])
    threads = torch.get_num_threads() if B * G * P * W * entries.element_size() >= PARALLEL_BYTES else 1
    positions_at, counter_at, keys_at, valid_at, position_at, min_at, max_at = _pointers(
        positions, counter, own_keys, own_valid, own_position, open_min, open_max)
    own = own_keys is not None
    status = (_LOADED[0] if _LOADED else library()).kvzoo_quest_choose(
        q.data_ptr(), entries.data_ptr(), SCAN_DTYPES[entries.dtype], *entries.stride()[:3], empty.data_ptr(),
        *empty.stride(), live.data_ptr(), positions_at, *pos_strides, rows.data_ptr(),
        at.data_ptr() if positions is not None else None, valid.data_ptr(), count.data_ptr(), counter_at,
        B, G, hq, D, P, pages, size, archived, int(per_head), scaling, slack, threads,
        keys_at, *(own_keys.stride()[:3] if own else (0, 0, 0)), N, valid_at,
        *(own_valid.stride() if own else (0, 0, 0)), position_at, *(own_position.stride() if own else (0, 0)),
        min_at, max_at)
    if status != 0:
        raise RuntimeError(f"kvzoo_quest_choose refused hq={hq}, D={D}, pages={pages} of P={P}, size={size}, "
                           f"archived={archived} (hq <= {MAX_HQ}, 2 D + 1 <= {MAX_W}, 1 <= pages <= P (P + 1 with "
                           "the own row), size >= 1, archived >= 1)")
    return rows, at, valid, count


def _quest_choose_meta(query, entries, empty, live, positions, pages, size, archived, per_head, scaling, slack,
                       counter=None, own_keys=None, own_valid=None, own_position=None, open_min=None, open_max=None):
    B, G = query.shape[:2]
    K = _quest_rows(query, pages, size, per_head)
    return (query.new_empty(B, G, K, dtype=torch.int64),
            query.new_empty((B, G, K) if positions is not None else (0,), dtype=torch.int64),
            query.new_empty(B, G, K, dtype=torch.bool), query.new_empty((), dtype=torch.int64))


_LIBRARY.define("quest_choose(Tensor query, Tensor entries, Tensor empty, Tensor live, Tensor? positions, int pages, "
                "int size, int archived, bool per_head, float scaling, float slack, Tensor(a!)? counter=None, "
                "Tensor? own_keys=None, Tensor? own_valid=None, Tensor? own_position=None, Tensor? open_min=None, "
                "Tensor? open_max=None) -> (Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.impl("quest_choose", _quest_choose_cpu, "CPU")
_LIBRARY.impl("quest_choose", _quest_choose_meta, "Meta")


def quest_page_add_supported(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor,
                             open_min: torch.Tensor, open_max: torch.Tensor, entries: torch.Tensor,
                             empty: torch.Tensor, count: torch.Tensor, length: torch.Tensor) -> bool:
    """Whether :func:`quest_page_add` takes these tensors: CPU, keys fp32, bf16 or fp16 with contiguous rows and the
    entries in their dtype, bool flags, int64 position, count and length (one element each), contiguous fp32 running
    min/max, and the library built here."""
    tensors = (keys, valid, position, open_min, open_max, entries, empty, count, length)
    return (_on_cpu(tensors) and keys.dtype in SCAN_DTYPES and entries.dtype == keys.dtype
            and keys.stride(-1) == 1 and entries.stride(-1) == 1 and valid.dtype == torch.bool
            and empty.dtype == torch.bool and position.dtype == torch.int64
            and count.dtype == torch.int64 and length.dtype == torch.int64 and count.numel() == 1
            and length.numel() == 1 and open_min.dtype == torch.float32 and open_max.dtype == torch.float32
            and open_min.is_contiguous() and open_max.is_contiguous()
            and not keys.requires_grad and (_LOADED[0] is not None if _LOADED else available()))


def quest_page_add(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, open_min: torch.Tensor,
                   open_max: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, count: torch.Tensor,
                   length: torch.Tensor, size: int) -> None:
    """One archived row joins Quest's fixed page summary, read where it lies, all in place (``kvzoo_quest_page_add`` in
    ``csrc/quest.cpp``; the specification is :func:`kvzoo.kernels.choose.quest_page_add_reference`). The caller checked
    :func:`quest_page_add_supported`. The torch op ``kvzoo::quest_page_add``."""
    args = (keys, valid, position, open_min, open_max, entries, empty, count, length, size)
    if unobserved() and keys.is_cpu and entries.is_cpu:
        _quest_page_add_cpu(*args)
    else:
        torch.ops.kvzoo.quest_page_add(*args)


def _quest_page_add_cpu(keys, valid, position, open_min, open_max, entries, empty, count, length, size):
    B, G, N, D = keys.shape
    P = entries.shape[2]
    shapes = ((valid, (B, G, N)), (position, (B, G)), (open_min, (B, G, D)), (open_max, (B, G, D)),
              (entries, (B, G, P, 2 * D + 1)), (empty, (B, G, P)))
    for t, shape in shapes:
        if tuple(t.shape) != shape:
            raise ValueError(f"kvzoo::quest_page_add: for keys {list(keys.shape)} valid, position, open_min, open_max, "
                             f"entries and empty must be [B, G, N], [B, G], [B, G, D] (twice), [B, G, P, 2 D + 1] and "
                             f"[B, G, P]; got {[list(t.shape) for t, _ in shapes]}")
    status = (_LOADED[0] if _LOADED else library()).kvzoo_quest_page_add(
        keys.data_ptr(), SCAN_DTYPES[keys.dtype], *keys.stride()[:3], valid.data_ptr(), *valid.stride(),
        position.data_ptr(), *position.stride(), open_min.data_ptr(), open_max.data_ptr(), entries.data_ptr(),
        *entries.stride()[:3], empty.data_ptr(), *empty.stride(), count.data_ptr(), length.data_ptr(), B, G, N, D, P,
        size)
    if status != 0:
        raise RuntimeError(f"kvzoo_quest_page_add: the summary is full ({P} pages of {size} rows) or size < 1")


def _quest_page_add_meta(keys, valid, position, open_min, open_max, entries, empty, count, length, size):
    return None


_LIBRARY.define("quest_page_add(Tensor keys, Tensor valid, Tensor position, Tensor(a!) open_min, "
                "Tensor(b!) open_max, Tensor(c!) entries, Tensor(d!) empty, Tensor(e!) count, Tensor(f!) length, "
                "int size) -> ()")
_LIBRARY.impl("quest_page_add", _quest_page_add_cpu, "CPU")
_LIBRARY.impl("quest_page_add", _quest_page_add_meta, "Meta")


# ----------------------------------------------------------------------------------------------------------------
# decode attention over one source of rows, read where they lie
# ----------------------------------------------------------------------------------------------------------------


def _pool_flags(source: Rows, pool_valid: torch.Tensor | None) -> torch.Tensor | None:
    """The pool's row flags: the keyword, or the source's own ``pool_valid`` where its ``Rows`` has that field."""
    own = getattr(source, "pool_valid", None)
    if own is None:
        return pool_valid
    if pool_valid is not None:
        raise ValueError("pool_valid given twice (as source.pool_valid and as the keyword): pass it once")
    return own


def decode_attend_supported(query: torch.Tensor, source: Rows, *, pool_valid: torch.Tensor | None = None,
                            prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether :func:`decode_attend` takes these inputs: CPU tensors, rows (and query) in fp32, bf16 or fp16 with a
    contiguous last dimension, values in the keys' dtype, int32/int64 indices and length, bool flags, at most
    :data:`MAX_HPG` query heads per group, ``D`` and ``Dv`` at most :data:`MAX_D`, no autograd, ``KVZOO_KERNELS`` not
    ``torch``, and the library built here. (Shapes are checked by the op itself: a wrong one is a ValueError, not a
    fallback.)"""
    from kvzoo.kernels import dispatch

    if dispatch.mode() == "torch":
        return False
    keys, values = source.keys, source.values
    pool_valid = _pool_flags(source, pool_valid)
    tensors = [query, keys, values, source.indices, source.length, source.valid, pool_valid, source.head_valid]
    if prior is not None:
        tensors += list(prior)
    if not _on_cpu(tensors):
        return False
    if query.dim() != 3 or keys.dim() != 4 or query.dtype not in ROW_DTYPES or keys.dtype not in ROW_DTYPES:
        return False
    H, D, G = query.shape[1], keys.shape[3], keys.shape[1]
    width = source.value_width if values is None else values.shape[-1]
    return (G >= 1 and H % G == 0 and D >= 1 and isinstance(width, int) and width >= 1
            and (keys.stride(-1) == 1 or D == 1)
            and (values is None or (values.dtype == keys.dtype and (values.stride(-1) == 1 or width == 1)))
            and _of_dtype((source.indices, source.length), INDEX_DTYPES)
            and _of_dtype((source.valid, pool_valid, source.head_valid), _BOOL)
            and decode_attend_takes(query, source, G, width))  # sizes, autograd, the library


def decode_attend_takes(query: torch.Tensor, source: Rows, groups: int, width: int) -> bool:
    """:func:`decode_attend_supported` for a source ``kvzoo.kernels.decode_attention`` has checked (shapes, dtypes,
    devices, strides, ``KVZOO_KERNELS``): the sizes the op takes, no autograd, the library built here."""
    H, D = query.shape[1], query.shape[2]
    values = source.values
    return (H // groups <= MAX_HPG and D <= MAX_D and width <= MAX_D and query.dtype in ROW_DTYPES
            and source.keys.dtype in ROW_DTYPES and not (query.requires_grad or source.keys.requires_grad
                                                         or (values is not None and values.requires_grad))
            and (_LOADED[0] is not None if _LOADED else available()))


def decode_attend(query: torch.Tensor, source: Rows, scaling: float, *, pool_valid: torch.Tensor | None = None,
                  prior: tuple[torch.Tensor, torch.Tensor] | None = None, best: bool = False,
                  mass: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Decode attention of ``query [B, H, D]`` over one source of rows (:class:`~kvzoo.kernels.decode_attention.Rows`,
    whose docstring and module give the semantics), read where they lie, merged with ``prior`` into one softmax:
    ``(out [B, H, Dv] fp32, lse [B, H] fp32, best [B, H] fp32 or None, mass [B, H, P] fp32 or None)``.

    * ``source``: ``keys [B, G, N, D]`` (a pool may be passed whole: any strides, last dim contiguous) and
      ``values [B, G, N, Dv]``, or ``values=None`` with ``value_width=Dv`` (MLA: the value is ``keys[..., :Dv]``);
      ``indices [B, G, K]`` (gathered form: position ``i`` is pool row ``indices[b, g, i]``, one outside ``[0, N)``
      unreadable; None: positions are pool rows ``0..N-1``), ``length [B]`` (readable positions ``[0, length)``),
      ``valid [B, G, P]`` per position, ``head_valid [B, H, P]`` per query head (``P``: ``K``, or ``N``).
    * ``pool_valid [B, G, N]`` bool: a flag per *pool row*, read through ``indices`` (as
      ``valid = pool_valid.gather(2, indices)`` would, with no gather): a pool's padding flags, as they are. Taken
      from ``source.pool_valid`` where the ``Rows`` has that field (then not also as the keyword).
    * ``prior = (out [B, H, Dv], lse [B, H])``: an earlier part over other rows (the runtime's tier); ``out`` and
      ``lse`` are then the one softmax over both (a part with ``lse = -inf`` weighs nothing).
    * ``best``: the best scaled score over this source's readable positions (VestigeKV's s*; ``-inf`` if none).
    * ``mass``: each position's probability in the whole softmax (prior included); 0 where unreadable.

    Numerics as the specification: the query rounded to the rows' dtype, products accumulated in fp32 (bf16 rows:
    ``vdpbf16ps`` where the CPU has it), fp32 online softmax. A ``(b, h)`` with nothing readable gets ``out = 0`` and
    ``lse = -inf``. A row no head may read is never loaded (it may hold NaN). The caller checked
    :func:`decode_attend_supported`. The torch op ``kvzoo::decode_attend``; called directly (the same function, not
    the dispatcher's ~8 us for 14 arguments) when nothing observes the dispatcher (:func:`unobserved`)."""
    values = source.values
    width = values.shape[-1] if values is not None else source.value_width
    if width is None:
        raise ValueError("source.values is None (MLA absorbed form): set source.value_width to the value width Dv")
    pool_valid = _pool_flags(source, pool_valid)
    prior_out, prior_lse = (None, None) if prior is None else prior
    keys, indices, length, valid, head_valid = source.keys, source.indices, source.length, source.valid, source.head_valid
    args = (query, keys, values, width, indices, length, valid, pool_valid, head_valid, float(scaling), prior_out,
            prior_lse, best, mass)
    if unobserved() and _on_cpu((query, keys, values, indices, length, valid, pool_valid, head_valid, prior_out,
                                  prior_lse)):
        return _decode_attend_run(*args)
    out, lse, top, masses = torch.ops.kvzoo.decode_attend(*args)
    return out, lse, top if best else None, masses if mass else None


def _bad(message: str) -> ValueError:
    return ValueError(f"kvzoo::decode_attend: {message}")


def _positions(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, prior_out,
               prior_lse) -> tuple[int, int, int, int, int, int, int]:
    """``(B, H, D, G, N, P, Dv)`` once the shapes agree (else a ValueError naming the shape expected): the kernel
    trusts them."""
    qs, ks = query.shape, keys.shape
    if len(qs) != 3 or len(ks) != 4:
        raise _bad(f"query must be [B, H, D] and keys [B, G, N, D], got {list(qs)} and {list(ks)}")
    B, H, D = qs
    _, G, N, _ = ks
    if ks[0] != B or ks[3] != D:
        raise _bad(f"keys {list(ks)} must be [B={B}, G, N, D={D}] for query {list(qs)}")
    if G < 1 or H % G:
        raise _bad(f"H={H} query heads must be a multiple of G={G} KV groups")
    if values is not None:
        vs = values.shape
        if len(vs) != 4 or vs[0] != B or vs[1] != G or vs[2] != N:
            raise _bad(f"values must be [B={B}, G={G}, N={N}, Dv], got {list(vs)}")
        Dv = vs[3]
    else:
        Dv = value_width
        if not 1 <= Dv <= D:
            raise _bad(f"value_width must be in [1, D={D}] when values is None, got {Dv}")
    P = N
    if indices is not None:
        ids = indices.shape
        if len(ids) != 3 or ids[0] != B or ids[1] != G:
            raise _bad(f"indices must be [B={B}, G={G}, K], got {list(ids)}")
        P = ids[2]
    for name, t, shape in (("length", length, (B,)), ("valid", valid, (B, G, P)), ("pool_valid", pool_valid, (B, G, N)),
                           ("head_valid", head_valid, (B, H, P)), ("prior_out", prior_out, (B, H, Dv)),
                           ("prior_lse", prior_lse, (B, H))):
        if t is not None and t.shape != shape:
            raise _bad(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if (prior_out is None) != (prior_lse is None):
        raise _bad("prior_out and prior_lse come together (the prior part's output and log-sum-exp)")
    return B, H, D, G, N, P, Dv


_ABSENT = (0, 0, 0, 0)


def _decode_attend_cpu(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, scaling,
                       prior_out, prior_lse, best, mass):
    """The op's CPU function: :func:`_decode_attend_run`, with empty tensors for the outputs not asked for."""
    out, lse, top, masses = _decode_attend_run(query, keys, values, value_width, indices, length, valid, pool_valid,
                                               head_valid, scaling, prior_out, prior_lse, best, mass)
    return out, lse, torch.empty(0) if top is None else top, torch.empty(0) if masses is None else masses


def _decode_attend_run(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, scaling,
                       prior_out, prior_lse, best, mass):
    """The op's inputs checked (a ValueError naming what is wrong), then :func:`_decode_attend_call`."""
    dims = _positions(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, prior_out,
                      prior_lse)
    if keys.dtype not in ROW_DTYPES or query.dtype not in ROW_DTYPES or (values is not None
                                                                         and values.dtype != keys.dtype):
        raise _bad(f"query, keys and values must be float32, bfloat16 or float16 (values in the keys' dtype), got "
                   f"{query.dtype}, {keys.dtype}, {None if values is None else values.dtype}")
    if keys.stride(3) != 1 and dims[2] > 1:
        raise _bad("keys need a contiguous last dimension (stride 1): pass the pool itself, not a transposed view")
    if values is not None and values.stride(3) != 1 and dims[6] > 1:
        raise _bad("values need a contiguous last dimension (stride 1)")
    for name, t in (("indices", indices), ("length", length)):
        if t is not None and t.dtype not in INDEX_DTYPES:
            raise _bad(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("valid", valid), ("pool_valid", pool_valid), ("head_valid", head_valid)):
        if t is not None and t.dtype != torch.bool:
            raise _bad(f"{name} must be a bool tensor, got {t.dtype}")
    return decode_attend_unchecked(query, keys, values, indices, length, valid, pool_valid, head_valid, scaling,
                               prior_out, prior_lse, best, mass, dims)


def decode_attend_unchecked(query, keys, values, indices, length, valid, pool_valid, head_valid, scaling, prior_out,
                        prior_lse, best, mass, dims):
    """:func:`decode_attend` on inputs already checked -- by :func:`_decode_attend_run`, or by
    ``kvzoo.kernels.decode_attention.attend`` (``dims``: the ``(B, H, D, G, N, P, Dv)`` its check found): the A_*
    parameters packed, the outputs made, one C call. Validated once per call, not twice; the caller runs it only
    where nothing observes the dispatcher (:func:`unobserved`), else the op."""
    B, H, D, G, N, P, Dv = dims
    dtype = ROW_DTYPES[keys.dtype]
    qst = query.stride()
    if qst[2] != 1:
        query = query.contiguous()
        qst = query.stride()
    kst = keys.stride()
    params = [query.data_ptr(), qst[0], qst[1], ROW_DTYPES[query.dtype], keys.data_ptr(), kst[0], kst[1], kst[2]]
    if values is not None:
        vst = values.stride()
        params += (values.data_ptr(), vst[0], vst[1], vst[2], dtype)
    else:
        params += (0, 0, 0, 0, dtype)
    if indices is not None:
        params += (indices.data_ptr(), *indices.stride(), indices.dtype == torch.int32)
    else:
        params += (0, 0, 0, 0, 0)
    if length is not None:
        params += (length.data_ptr(), length.stride(0), length.dtype == torch.int32)
    else:
        params += (0, 0, 0)
    for flag in (valid, pool_valid, head_valid):
        params += _ABSENT if flag is None else (flag.data_ptr(), *flag.stride())
    if prior_out is not None:
        prior_out = prior_out.float().contiguous()
        prior_lse = prior_lse.float().contiguous()
        params += (prior_out.data_ptr(), prior_lse.data_ptr())
    else:
        params += (0, 0)
    out = torch.empty(B, H, Dv)
    lse = torch.empty(B, H)
    top = torch.empty(B, H) if best else None
    masses = torch.empty(B, H, P) if mass else None
    nbytes = B * G * P * (D + (Dv if values is not None else 0)) * keys.element_size()
    threads = torch.get_num_threads() if nbytes >= PARALLEL_BYTES else 1  # PARALLEL_BYTES
    params += (out.data_ptr(), lse.data_ptr(), top.data_ptr() if best else 0, masses.data_ptr() if mass else 0,
               B, H, G, N, P, D, Dv, threads)
    packed = array.array("q", params)  # the A_* parameters of csrc/decode_attend.cpp, in their order
    status = (_LOADED[0] if _LOADED else library()).kvzoo_decode_attend(packed.buffer_info()[0], len(packed), scaling)
    if status != 0:
        raise RuntimeError(f"kvzoo_decode_attend refused H={H}, G={G}, D={D}, Dv={Dv} (status {status}; at most "
                           f"{MAX_HPG} heads per group, D and Dv at most {MAX_D})")
    return out, lse, top, masses


def _decode_attend_meta(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, scaling,
                        prior_out, prior_lse, best, mass):
    B, H, _, _, _, P, Dv = _positions(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid,
                                      prior_out, prior_lse)
    f32 = torch.float32
    return (query.new_empty(B, H, Dv, dtype=f32), query.new_empty(B, H, dtype=f32),
            query.new_empty((B, H) if best else (0,), dtype=f32), query.new_empty((B, H, P) if mass else (0,), dtype=f32))


_LIBRARY.define("decode_attend(Tensor query, Tensor keys, Tensor? values, int value_width, Tensor? indices, "
                "Tensor? length, Tensor? valid, Tensor? pool_valid, Tensor? head_valid, float scaling, "
                "Tensor? prior_out, Tensor? prior_lse, bool best, bool mass) "
                "-> (Tensor out, Tensor lse, Tensor best, Tensor mass)")
_LIBRARY.impl("decode_attend", _decode_attend_cpu, "CPU")
_LIBRARY.impl("decode_attend", _decode_attend_meta, "Meta")
