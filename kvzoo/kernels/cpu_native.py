"""Small C++ kernels for CPU tensors, as torch ops (``torch.ops.kvzoo.*``), built on first use.

Why: a decode step on CPU should cost what its bytes cost. The int8 index scan (VestigeKV) is a few query rows
against many int8 rows, a product BLAS runs at a fraction of its speed: the C loop reads the int8 bytes once
(:func:`int8_estimate`, :func:`int8_choose`). Decode attention over gathered rows (:func:`decode_attend`) reads each
readable row once per KV group, where it lies, with no ``index_select`` copy.

The sources are ``kvzoo/kernels/csrc/`` (``ops.cpp`` registers each op with ``TORCH_LIBRARY`` and checks its inputs),
built by :func:`torch.utils.cpp_extension.load` once per machine, checkout and source version into :func:`cache_dir`
(``$CXX``, ``-O3 -march=native``, OpenMP on torch's own ``libgomp`` where torch has one). Where no compiler or ninja
works, :func:`library` warns once and callers take the PyTorch references (``KVZOO_KERNELS=torch`` takes them
everywhere); the ``*_supported`` predicates say which inputs take an op.
"""

from __future__ import annotations

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
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # decode attention's rows (and query), Quest's entries
INDEX_DTYPES = (torch.int32, torch.int64)
_BOOL = (torch.bool,)


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
    """What ``-march=native`` depends on: the processor's model and instruction sets (``/proc/cpuinfo``, macOS
    ``sysctl``; else the machine's name), so that a shared cache never hands one machine a library built for another."""
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
# the kernels, one file per op family (their shared inline helpers in csrc/*.h, their entry points in kernels.h), and
# ops.cpp, the torch ops over them (the one file that includes torch's headers); compiled as C++17
SOURCES = ("ops.cpp", "int8_scan.cpp", "decode_attend.cpp", "sketch_choose.cpp", "quest.cpp")
COMPILE_FLAGS = ("-O3", "-Wall", "-Wextra")
NAMESPACE = "kvzoo"  # torch.ops.kvzoo: the ops of the build library() loads
OPS = ("int8_estimate", "int8_choose", "int8_page_live", "sketch_choose", "quest_choose", "quest_page_add", "decode_attend",
       "parallel_bytes")


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


class Native:
    """A loaded build of the kernels: each op of :data:`OPS` as an attribute (its ``torch.ops`` overload), its
    namespace, and ``openmp``: the OpenMP runtime its threads come from (None: one thread)."""

    def __init__(self, namespace: str, runtime: str | None):
        ops = getattr(torch.ops, namespace)
        self.namespace = namespace
        for name in OPS:
            setattr(self, name, getattr(ops, name).default)
        self.openmp = runtime if ops.openmp() else None


# The key of the build whose library registered torch.ops.kvzoo in this process (empty until one has): a namespace is
# registered once, so a second build loaded beside it (a test's portable build, a rebuild under other settings) takes
# a namespace of its own
_HOLDER: list[str] = []


def compile_library(march: str = "native", runtime: str | None = None) -> Native:
    """Build (ninja rebuilds what changed) and load the kernels for ``-march=march``, with OpenMP linked against
    ``runtime`` (None: without), into :func:`cache_dir`; registered in ``torch.ops.kvzoo``, or in a namespace named
    after the build where another build holds that one in this process (tests build the portable C this way)."""
    from torch.utils import cpp_extension

    missing = toolchain_missing()
    if missing is not None:
        raise RuntimeError(missing)
    if runtime is not None and not os.path.isfile(runtime):
        raise FileNotFoundError(f"no OpenMP runtime at {runtime}")
    # one build folder per target and checkout: a -march=native build never serves another CPU, and two checkouts
    # (git worktrees, an installed copy beside a clone) never rebuild each other's library in one folder
    target = "\0".join([march, runtime or "", compiler(), platform.machine(), _cpu_signature(), str(CSRC)])
    key = hashlib.sha256(target.encode()).hexdigest()[:16]
    namespace = NAMESPACE
    if _HOLDER and _HOLDER[0] != key:
        namespace = f"{NAMESPACE}_{key}"
        key = hashlib.sha256(f"{target}\0{namespace}".encode()).hexdigest()[:16]
    name = f"kvzoo_ops_{key}"
    folder = cache_dir() / "native" / name
    folder.mkdir(parents=True, exist_ok=True)
    cflags = [*COMPILE_FLAGS, _arch_flag(march), f"-DKVZOO_NS={namespace}", *(["-fopenmp"] if runtime else [])]
    # link against the runtime already loaded (not the compiler's own -lgomp): one OpenMP runtime in the process
    ldflags = [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"] if runtime else []
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([path, os.path.dirname(sys.executable)])  # a pip-installed ninja
    try:
        # is_python_module=False: the library is loaded with torch.ops.load_library, its TORCH_LIBRARY registers
        cpp_extension.load(name, [str(CSRC / source) for source in SOURCES], extra_cflags=cflags,
                           extra_ldflags=ldflags, build_directory=str(folder), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    if not _HOLDER and namespace == NAMESPACE:
        _HOLDER.append(key)
    return Native(namespace, runtime)


# What the first call of library() found: [the build] or [None] (unavailable here); empty until then. Read by the
# traced path of a compiled step as a plain global (library() and available() touch no file once it is set), and by
# the wrappers (a test that runs another build sets it: monkeypatch.setattr(cpu_native, "_LOADED", [lib])).
_LOADED: list[Native | None] = []


def library() -> Native | None:
    """The compiled kernels (built on the first call, with OpenMP on torch's own runtime where there is one), or
    None -- with one RuntimeWarning saying why -- where they cannot be built or loaded here. Then a lookup."""
    if not _LOADED:
        _LOADED.append(_load())
    return _LOADED[0]


library.cache_clear = _LOADED.clear  # type: ignore[attr-defined]  # forget it (tests rebuild under other settings)


def available() -> bool:
    """Whether the kernels are built and loaded here. Inside ``torch.compile`` before any eager call it is False
    (the traced step takes the PyTorch references; nothing is built while tracing)."""
    if not _LOADED:
        return not torch.compiler.is_compiling() and library() is not None
    return _LOADED[0] is not None


def _load() -> Native | None:
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


def int8_estimate_supported(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, j: int | None = None,
                            counter: torch.Tensor | None = None, page_live: torch.Tensor | None = None,
                            scanned: torch.Tensor | None = None) -> bool:
    """Whether :func:`int8_estimate` takes these tensors (CPU, the dtypes and a geometry the loop handles, the
    library built here); with ``j``, whether :func:`int8_choose` does (``1 <= j <= min(MAX_J, m)``, the counter
    and ``scanned`` :func:`counter_ok`, ``page_live`` a CPU tensor: checked in place, one call per decode step; a wrong
    shape or dtype of ``page_live`` is the op's error, not a fallback)."""
    hq, D = query.shape[2], query.shape[3]
    if page_live is not None and page_live.device.type != "cpu" or not counter_ok(scanned):
        return False
    return (query.device.type == "cpu" and codes.device.type == "cpu" and side.device.type == "cpu"
            and query.dtype == torch.float32 and codes.dtype == torch.int8 and side.dtype == torch.float16
            and hq <= MAX_HQ and D <= MAX_D and D % LANES == 0 and not query.requires_grad
            and codes.stride(-1) == 1 and (codes.shape[2] <= 1 or codes.stride(2) == codes.shape[3])
            and side.stride(-1) == 1 and (side.shape[2] <= 1 or side.stride(2) == side.shape[3])  # rows contiguous
            and (j is None or (1 <= j <= min(MAX_J, codes.shape[2])
                           and (counter is None or (counter.device.type == "cpu" and counter.dtype == torch.int64
                                                    and counter.numel() == 1 and counter.is_contiguous()))))
            and (_LOADED[0] is not None if _LOADED else available()))


def int8_estimate(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, scaling: float,
                  length: torch.Tensor | None) -> torch.Tensor:
    """The C loop's ``estimate [B, G, hq, m]`` (``csrc/int8_scan.cpp``) for ``codes [B, G, m, D]`` and
    ``side [B, G, m, w]``: the torch op ``kvzoo::int8_estimate``. The caller checked :func:`int8_estimate_supported`."""
    return (_LOADED[0] if _LOADED else library()).int8_estimate(query, codes, side, length, float(scaling))


def counter_ok(counter: torch.Tensor | None) -> bool:
    """A fetched-rows counter the C ops add to in place: None, or an int64 CPU tensor of one element."""
    return counter is None or (counter.device.type == "cpu" and counter.dtype == torch.int64 and counter.numel() == 1
                               and counter.is_contiguous())


def int8_choose(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, threshold: torch.Tensor, j: int,
                archived: int, scaling: float, slack: float, length: torch.Tensor | None,
                counter: torch.Tensor | None = None, page_live: torch.Tensor | None = None, page_rows: int = 0,
                scanned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over int8 entries for a decode step, staged and counted (the torch op
    ``kvzoo::int8_choose``, ``csrc/int8_scan.cpp``; its specification
    :func:`kvzoo.kernels.index_scan.int8_choose_reference`): one call for ~30 PyTorch ops. ``page_live [B, G, p]``
    (bool) with ``page_rows``: the rows of a page whose flag is False are not read; ``scanned`` (int64, one element)
    += the bytes of the entries read. The caller checked :func:`int8_estimate_supported` with ``j``, ``counter``,
    ``page_live`` and ``scanned``."""
    return (_LOADED[0] if _LOADED else library()).int8_choose(query, codes, side, length, threshold, j, archived,
                                                              float(scaling), float(slack), counter, page_live,
                                                              page_rows, scanned)


def int8_page_live_supported(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, empty: torch.Tensor,
                             threshold: torch.Tensor) -> bool:
    """Whether :func:`int8_page_live` takes these tensors (CPU, the dtypes, a geometry the loop handles, pages
    contiguous, no autograd, the library built here; a wrong shape is the op's error, not a fallback)."""
    if query.dim() != 4 or codes.dim() != 4:
        return False
    hq, D = query.shape[2], query.shape[3]
    return (_on_cpu((query, codes, scale, empty, threshold)) and query.dtype == torch.float32
            and codes.dtype == torch.int8 and scale.dtype == torch.float32 and empty.dtype == torch.bool
            and threshold.is_floating_point() and hq <= MAX_HQ and 2 * D <= MAX_D and D % LANES == 0
            and not query.requires_grad and codes.stride(-1) == 1
            and (codes.shape[2] <= 1 or codes.stride(2) == codes.shape[3])
            and (_LOADED[0] is not None if _LOADED else available()))


def int8_page_live(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, empty: torch.Tensor,
                   threshold: torch.Tensor, scaling: float, slack: float, length: torch.Tensor | None) -> torch.Tensor:
    """Pruning's page flags ``[B, G, P]`` (the torch op ``kvzoo::int8_page_live``, ``csrc/int8_scan.cpp``; its
    specification :func:`kvzoo.kernels.index_scan.int8_page_live_reference`): one call for ~30 PyTorch ops. The
    caller checked :func:`int8_page_live_supported`."""
    return (_LOADED[0] if _LOADED else library()).int8_page_live(query, codes, scale, empty, length, threshold,
                                                                 float(scaling), float(slack))


# ----------------------------------------------------------------------------------------------------------------
# fused decode-step choices over float index entries (kvzoo.kernels.choose: the references and the dispatch)
# ----------------------------------------------------------------------------------------------------------------

MAX_W = 2 * MAX_D + 1  # the widest index entry the float scans take (a Quest page of MLA's 576-dim rows)


def sketch_choose_supported(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, floor: torch.Tensor,
                            j: int, counter: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> bool:
    """Whether :func:`sketch_choose` takes these tensors (CPU, the dtypes and strides the op takes, ``1 <= j <=
    min(MAX_J, m)``, no autograd, the library built here; a wrong width is the op's error, not a fallback; ``valid``
    None or on the CPU)."""
    if query.dim() != 4 or basis.dim() != 4 or entries.dim() != 4:
        return False
    return (_on_cpu((query, basis, entries, floor)) and query.dtype == torch.float32
            and basis.dtype == torch.float32 and floor.dtype == torch.float32
            and entries.dtype in (torch.float32, torch.float16) and 1 <= query.shape[2] <= MAX_HQ
            and query.shape[3] <= MAX_D and 1 <= j <= min(MAX_J, entries.shape[2]) and entries.stride(-1) == 1
            and counter_ok(counter) and (valid is None or valid.device.type == "cpu")
            and not (query.requires_grad or entries.requires_grad)
            and (_LOADED[0] is not None if _LOADED else available()))


def sketch_choose(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, length: torch.Tensor | None,
                  floor: torch.Tensor, j: int, archived: int, scaling: float, slack: float, rank_by_bound: bool,
                  counter: torch.Tensor | None = None,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's sketch top-j rule in one call, the torch op ``kvzoo::sketch_choose`` (``csrc/sketch_choose.cpp``;
    specification :func:`kvzoo.kernels.choose.sketch_choose_reference`). The caller checked
    :func:`sketch_choose_supported`."""
    return (_LOADED[0] if _LOADED else library()).sketch_choose(query, basis, entries, length, floor, j, archived,
                                                                float(scaling), float(slack), bool(rank_by_bound),
                                                                counter, valid)


def quest_choose_supported(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                           positions: torch.Tensor | None, counter: torch.Tensor | None = None,
                           own: tuple[torch.Tensor, ...] | None = None, shift: torch.Tensor | None = None) -> bool:
    """Whether :func:`quest_choose` takes these tensors (CPU, the dtypes, strides and sizes the op takes, no autograd,
    the library built here; ``own`` as :func:`kvzoo.kernels.choose.quest_choose` passes it; ``shift`` int64 on the
    CPU)."""
    if query.dim() != 4 or entries.dim() != 4:
        return False
    if shift is not None and not (shift.device.type == "cpu" and shift.dtype == torch.int64):
        return False
    if own is not None:
        keys, valid, position, open_min, open_max = own
        if not (_on_cpu(own) and keys.dtype == entries.dtype and keys.stride(-1) == 1
                and valid.dtype == torch.bool and position.dtype == torch.int64
                and open_min.dtype == torch.float32 and open_max.dtype == torch.float32
                and not keys.requires_grad):
            return False
    tensors = (query, entries, empty, live) + (() if positions is None else (positions,))
    return (_on_cpu(tensors) and query.dtype == torch.float32
            and entries.dtype in FLOAT_DTYPES and entries.shape[3] <= MAX_W and entries.stride(-1) == 1
            and 1 <= query.shape[2] <= MAX_HQ and empty.dtype == torch.bool and live.dtype == torch.int64
            and live.numel() == 1 and (positions is None or positions.dtype == torch.int64)
            and (counter is None or (counter.device.type == "cpu" and counter.dtype == torch.int64
                                     and counter.numel() == 1 and counter.is_contiguous()))  # counter_ok
            and not (query.requires_grad or entries.requires_grad)
            and (_LOADED[0] is not None if _LOADED else available()))


def quest_choose(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                 positions: torch.Tensor | None, pages: int, size: int, archived: int, per_head: bool, scaling: float,
                 slack: float, counter: torch.Tensor | None = None, own: tuple[torch.Tensor, ...] | None = None,
                 shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Quest's choice in one call, the torch op ``kvzoo::quest_choose`` (``csrc/quest.cpp``; specification
    :func:`kvzoo.kernels.choose.quest_choose_reference`): ``positions`` out is None when the archive list is not
    given. The caller checked :func:`quest_choose_supported`."""
    own_keys, own_valid, own_position, open_min, open_max = (None,) * 5 if own is None else own
    rows, at, valid, count = (_LOADED[0] if _LOADED else library()).quest_choose(
        query, entries, empty, live, positions, pages, size, archived, bool(per_head), float(scaling), float(slack),
        counter, own_keys, own_valid, own_position, open_min, open_max, shift)
    return rows, at if positions is not None else None, valid, count


def quest_page_add_supported(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor,
                             open_min: torch.Tensor, open_max: torch.Tensor, entries: torch.Tensor,
                             empty: torch.Tensor, count: torch.Tensor, length: torch.Tensor) -> bool:
    """Whether :func:`quest_page_add` takes these tensors (CPU, the dtypes and strides the op takes, no autograd,
    the library built here)."""
    tensors = (keys, valid, position, open_min, open_max, entries, empty, count, length)
    return (_on_cpu(tensors) and keys.dtype in FLOAT_DTYPES and entries.dtype == keys.dtype
            and keys.stride(-1) == 1 and entries.stride(-1) == 1 and valid.dtype == torch.bool
            and empty.dtype == torch.bool and position.dtype == torch.int64
            and count.dtype == torch.int64 and length.dtype == torch.int64 and count.numel() == 1
            and length.numel() == 1 and open_min.dtype == torch.float32 and open_max.dtype == torch.float32
            and open_min.is_contiguous() and open_max.is_contiguous()
            and not keys.requires_grad and (_LOADED[0] is not None if _LOADED else available()))


def quest_page_add(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, open_min: torch.Tensor,
                   open_max: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, count: torch.Tensor,
                   length: torch.Tensor, size: int) -> None:
    """One archived row joins Quest's page summary in place, the torch op ``kvzoo::quest_page_add`` (specification
    :func:`kvzoo.kernels.choose.quest_page_add_reference`). The caller checked :func:`quest_page_add_supported`."""
    (_LOADED[0] if _LOADED else library()).quest_page_add(keys, valid, position, open_min, open_max, entries, empty,
                                                          count, length, size)


# ----------------------------------------------------------------------------------------------------------------
# decode attention over one source of rows, read where they lie
# ----------------------------------------------------------------------------------------------------------------


def decode_attend_supported(query: torch.Tensor, source: Rows, *, pool_valid: torch.Tensor | None = None,
                            prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether :func:`decode_attend` takes these inputs: CPU tensors in the dtypes and strides the op takes, the
    sizes :func:`decode_attend_takes` checks, ``KVZOO_KERNELS`` not ``torch`` (a wrong shape is the op's ValueError,
    not a fallback)."""
    from kvzoo.kernels import dispatch

    if dispatch.mode() == "torch":
        return False
    keys, values = source.keys, source.values
    own = getattr(source, "pool_valid", None)  # the op takes one of the two (decode_attend says so)
    tensors = [query, keys, values, source.indices, source.length, source.valid, pool_valid, own, source.head_valid]
    if prior is not None:
        tensors += list(prior)
    if not _on_cpu(tensors):
        return False
    if query.dim() != 3 or keys.dim() != 4 or query.dtype not in FLOAT_DTYPES or keys.dtype not in FLOAT_DTYPES:
        return False
    H, D, G = query.shape[1], keys.shape[3], keys.shape[1]
    width = source.value_width if values is None else values.shape[-1]
    return (G >= 1 and H % G == 0 and D >= 1 and isinstance(width, int) and width >= 1
            and (keys.stride(-1) == 1 or D == 1)
            and (values is None or (values.dtype == keys.dtype and (values.stride(-1) == 1 or width == 1)))
            and _of_dtype((source.indices, source.length), INDEX_DTYPES)
            and _of_dtype((source.valid, pool_valid, own, source.head_valid), _BOOL)
            and decode_attend_takes(query, source, G, width))  # sizes, autograd, the library


def decode_attend_takes(query: torch.Tensor, source: Rows, groups: int, width: int) -> bool:
    """:func:`decode_attend_supported` for a source ``kvzoo.kernels.decode_attention`` has checked (shapes, dtypes,
    devices, strides, ``KVZOO_KERNELS``): the sizes the op takes, no autograd, the library built here."""
    D = query.shape[2]
    values = source.values
    return (D <= MAX_D and width <= MAX_D and query.dtype in FLOAT_DTYPES
            and source.keys.dtype in FLOAT_DTYPES and not (query.requires_grad or source.keys.requires_grad
                                                         or (values is not None and values.requires_grad))
            and (_LOADED[0] is not None if _LOADED else available()))


def decode_attend(query: torch.Tensor, source: Rows, scaling: float, *, pool_valid: torch.Tensor | None = None,
                  prior: tuple[torch.Tensor, torch.Tensor] | None = None, best: bool = False,
                  mass: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Decode attention of ``query [B, H, D]`` over one source (:class:`~kvzoo.kernels.decode_attention.Rows`, whose
    package gives the semantics), read where it lies and merged with ``prior = (out, lse)``: ``(out, lse, best or None,
    mass or None)`` fp32. ``pool_valid [B, G, N]`` (or ``source.pool_valid``): a flag per pool row, read through
    ``indices``. The caller checked :func:`decode_attend_supported`; the op checks the shapes (a ValueError)."""
    values = source.values
    width = values.shape[-1] if values is not None else source.value_width
    if width is None:
        raise ValueError("source.values is None (MLA absorbed form): set source.value_width to the value width Dv")
    own = getattr(source, "pool_valid", None)  # the pool's row flags: the keyword, or the source's own field
    if own is not None:
        if pool_valid is not None:
            raise ValueError("pool_valid given twice (as source.pool_valid and as the keyword): pass it once")
        pool_valid = own
    prior_out, prior_lse = (None, None) if prior is None else prior
    out, lse, top, masses = (_LOADED[0] if _LOADED else library()).decode_attend(
        query, source.keys, values, width, source.indices, source.length, source.valid, pool_valid, source.head_valid,
        float(scaling), prior_out, prior_lse, best, mass)
    return out, lse, top if best else None, masses if mass else None
