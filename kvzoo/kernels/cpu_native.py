"""Small C kernels for CPU tensors, built on first use with the machine's C compiler and called through ctypes.

Why: a decode step's int8 index scan is ``hq`` (a group's query heads, 3 on SmolLM2) query rows against ``m``
int8 rows. In PyTorch that is an fp32 upcast of the codes and a matrix product whose short side is ``hq``, which
BLAS runs at a small fraction of its speed: 5-7x the time the int8 bytes take to read (``benchmarks/
decode_step.py --profile``). The C loop here converts each row's codes in registers and multiplies them with every
query row at once, so the scan reads the int8 bytes once and writes ``hq`` floats per row.

The source is below; it is compiled once per machine and source version into the user's cache directory
(``$KVZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvzoo`` or ``~/.cache/kvzoo``) with ``$CC`` (default ``cc``),
``-O3 -march=native``. Where no compiler works, :func:`library` returns None once and says why in a
RuntimeWarning, and callers take the PyTorch reference (:mod:`kvzoo.kernels.index_scan` holds the kernel to it
in ``tests/test_index_scan_native.py``). ``KVZOO_KERNELS=torch`` takes the reference everywhere.

Imports with torch alone (ctypes is the standard library's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define LANES 8
#define MAX_HQ 64
#define MAX_D 1024
#define MAX_J 64

/* fp16 bits -> float (normal, subnormal, inf and nan) */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            int shift = 0;
            while (!(mantissa & 0x400u)) { mantissa <<= 1; shift++; }
            mantissa &= 0x3FFu;
            bits = sign | ((uint32_t)(113 - shift) << 23) | (mantissa << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* The estimates of `rows` (1 or 2) consecutive int8 rows for every query row of their group:
   dots[r * hq + h] = (dot(q[h], row r) * scale[r]) * scaling. q [hq, D] fp32 contiguous; each dot accumulates in
   LANES partial sums (d mod LANES), then adds them in a fixed order, the same for every row however they are
   paired. Two rows at a time keep two independent chains of multiply-adds in flight. */
static inline float lane_sum(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline void row_estimates(const float *restrict q, const int8_t *restrict row, int64_t rows, int64_t hq,
                                 int64_t D, const float *scale, float scaling, float *restrict dots) {
#ifdef __AVX2__
    const int8_t *row1 = row + (rows > 1 ? D : 0);
    for (int64_t h0 = 0; h0 < hq; h0 += 4) {  /* up to 4 query rows per pass: accumulators in registers */
        int64_t n = hq - h0 < 4 ? hq - h0 : 4;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const float *q0 = q + h0 * D;
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
            __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d0))));
            __m256 e = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row1 + d0))));
            __m256 x = _mm256_loadu_ps(q0 + d0);
            a0 = _mm256_fmadd_ps(x, c, a0);
            b0 = _mm256_fmadd_ps(x, e, b0);
            if (n > 1) {
                x = _mm256_loadu_ps(q0 + D + d0);
                a1 = _mm256_fmadd_ps(x, c, a1);
                b1 = _mm256_fmadd_ps(x, e, b1);
            }
            if (n > 2) {
                x = _mm256_loadu_ps(q0 + 2 * D + d0);
                a2 = _mm256_fmadd_ps(x, c, a2);
                b2 = _mm256_fmadd_ps(x, e, b2);
            }
            if (n > 3) {
                x = _mm256_loadu_ps(q0 + 3 * D + d0);
                a3 = _mm256_fmadd_ps(x, c, a3);
                b3 = _mm256_fmadd_ps(x, e, b3);
            }
        }
        __m256 acc[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < n; k++) {
                float a[LANES];
                _mm256_storeu_ps(a, acc[4 * r + k]);
                dots[r * hq + h0 + k] = (lane_sum(a) * scale[r]) * scaling;
            }
    }
#else
    for (int64_t r = 0; r < rows; r++) {
        float c[MAX_D];
        for (int64_t d = 0; d < D; d++) c[d] = (float)row[r * D + d];
        for (int64_t h = 0; h < hq; h++) {
            const float *restrict qh = q + h * D;
            float a[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t d0 = 0; d0 < D; d0 += LANES)
                for (int l = 0; l < LANES; l++) a[l] += qh[d0 + l] * c[d0 + l];
            dots[r * hq + h] = (lane_sum(a) * scale[r]) * scaling;
        }
    }
#endif
}

/* Rows live in sequence b: length[b] clamped to [0, m] (every row without a length). */
static inline int64_t live_rows(const int64_t *length, int64_t b, int64_t m) {
    int64_t live = length ? length[b] : m;
    return live > m ? m : (live < 0 ? 0 : live);
}

/* estimate[b, g, h, i] = (dot(q[b, g, h], codes[b, g, i]) * scale[b, g, i]) * scaling for i < length[b], -inf for
   length[b] <= i < m. q [B, G, hq, D] fp32 contiguous; codes [B, G, m, D] int8 with contiguous rows (element
   strides codes_sb, codes_sg for b and g: a view of the first m rows of a larger buffer); side [B, G, m, side_w]
   fp16 bits the same way (strides side_sb, side_sg), the scale its column 0; out [B, G, hq, m] fp32 contiguous. */
int kvzoo_int8_estimate(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                        float *out, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m,
                        int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w,
                        float scaling) {
    if (hq > MAX_HQ || D > MAX_D || D % LANES != 0) return 1;
    float dots[2 * MAX_HQ];
    for (int64_t b = 0; b < B; b++) {
        int64_t live = live_rows(length, b, m);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + (b * G + g) * hq * D;
            const int8_t *cg = codes + b * codes_sb + g * codes_sg;
            const uint16_t *sg = side + b * side_sb + g * side_sg;
            float *og = out + (b * G + g) * hq * m;
            for (int64_t i = 0; i < live; i += 2) {
                int64_t rows = live - i < 2 ? 1 : 2;
                float scale[2] = {half_to_float(sg[i * side_w]), rows > 1 ? half_to_float(sg[(i + 1) * side_w]) : 0};
                row_estimates(qg, cg + i * D, rows, hq, D, scale, scaling, dots);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t h = 0; h < hq; h++) og[h * m + i + r] = dots[r * hq + h];
            }
            for (int64_t h = 0; h < hq; h++)
                for (int64_t i = live; i < m; i++) og[h * m + i] = -INFINITY;
        }
    }
    return 0;
}

/* VestigeKV's top-j rule on int8 key entries for one decode step, every query row of a group at once, staged as the
   runtime stages it. Per query row h of group (b, g): the top j rows by estimate (kvzoo_int8_estimate's numbers; an
   earlier row first among equal values), each kept when its certified bound
       estimate + (scaling * ||q_h||) * (err + slack * norm)
   is above threshold[b, g, h] (s* - j_margin). The K = hq * j candidates -- a kept row's index, `archived` for the
   others -- are sorted ascending; idx[b, g, k] is min(candidate, archived - 1) and picked[b, g, k] is 1 on the first
   copy of each kept row: what kvzoo.framework.retrieval's unique_candidates makes of the same choice. */
int kvzoo_int8_choose(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                      const float *threshold, int64_t *idx, uint8_t *picked, int64_t B, int64_t G, int64_t hq,
                      int64_t D, int64_t m, int64_t j, int64_t archived, int64_t codes_sb, int64_t codes_sg,
                      int64_t side_sb, int64_t side_sg, int64_t side_w, float scaling, float slack) {
    if (hq > MAX_HQ || D > MAX_D || D % LANES != 0 || j < 1 || j > MAX_J || j > m || archived < 1) return 1;
    float dots[2 * MAX_HQ];
    float top[MAX_HQ * MAX_J];
    int64_t at[MAX_HQ * MAX_J];
    int64_t K = hq * j;
    for (int64_t b = 0; b < B; b++) {
        int64_t live = live_rows(length, b, m);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + (b * G + g) * hq * D;
            const int8_t *cg = codes + b * codes_sb + g * codes_sg;
            const uint16_t *sg = side + b * side_sb + g * side_sg;
            int64_t filled = 0;
            for (int64_t i = 0; i < live; i += 2) {
                int64_t rows = live - i < 2 ? 1 : 2;
                float scale[2] = {half_to_float(sg[i * side_w]), rows > 1 ? half_to_float(sg[(i + 1) * side_w]) : 0};
                row_estimates(qg, cg + i * D, rows, hq, D, scale, scaling, dots);
                for (int64_t r = 0; r < rows; r++) {
                    int64_t n = filled;
                    for (int64_t h = 0; h < hq; h++) {
                        float v = dots[r * hq + h];
                        float *vh = top + h * j;
                        int64_t *ih = at + h * j;
                        if (n == j && !(v > vh[j - 1])) continue;  /* not above the j-th (NaN never enters) */
                        int64_t pos = n == j ? j - 1 : n;
                        while (pos > 0 && v > vh[pos - 1]) {  /* insertion: strictly greater moves up */
                            vh[pos] = vh[pos - 1];
                            ih[pos] = ih[pos - 1];
                            pos--;
                        }
                        vh[pos] = v;
                        ih[pos] = i + r;
                    }
                    if (filled < j) filled++;
                }
            }
            int64_t candidates[MAX_HQ * MAX_J];
            for (int64_t h = 0; h < hq; h++) {
                const float *qh = qg + h * D;
                float sq = 0.0f;
                for (int64_t d = 0; d < D; d++) sq += qh[d] * qh[d];
                float reach = scaling * sqrtf(sq);
                float limit = threshold[(b * G + g) * hq + h];
                for (int64_t p = 0; p < j; p++) {
                    int64_t c = archived;
                    if (p < filled) {
                        int64_t row = at[h * j + p];
                        float err = half_to_float(sg[row * side_w + 1]), norm = half_to_float(sg[row * side_w + 2]);
                        float bound = top[h * j + p] + reach * (err + slack * norm);
                        if (bound > limit) c = row;
                    }
                    candidates[h * j + p] = c;
                }
            }
            for (int64_t k = 1; k < K; k++) {  /* insertion sort: K is small (heads x j) */
                int64_t v = candidates[k], pos = k;
                while (pos > 0 && candidates[pos - 1] > v) { candidates[pos] = candidates[pos - 1]; pos--; }
                candidates[pos] = v;
            }
            int64_t *ig = idx + (b * G + g) * K;
            uint8_t *pg = picked + (b * G + g) * K;
            for (int64_t k = 0; k < K; k++) {
                int64_t v = candidates[k];
                pg[k] = v < archived && (k == 0 || v != candidates[k - 1]);
                ig[k] = v < archived ? v : archived - 1;
            }
        }
    }
    return 0;
}
"""

MAX_HQ = 64  # query rows per group the kernel takes (a group's heads x queries)
MAX_D = 1024  # the longest key it takes
MAX_J = 64  # rows per query row the top-j rule takes
LANES = 8  # the head dim must be a multiple of this


def cache_dir() -> Path:
    root = os.environ.get("KVZOO_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvzoo"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the processor's model and flags (a cache shared by machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99")


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kvzoo_cpu.c"
        src.write_text(SOURCE)
        out = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(src), "-o", str(out), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(out, target)  # atomic: a concurrent builder never sees half a library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on the first call), or None -- with one RuntimeWarning saying why -- where they
    cannot be built or loaded here."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, compiler, platform.machine(), _cpu_signature()]).encode())
    target = cache_dir() / "native" / f"kvzoo_cpu_{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC)")
            _build(target, compiler)
        lib = ctypes.CDLL(str(target))
        fn = lib.kvzoo_int8_estimate
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 10 + [ctypes.c_float]
        choose = lib.kvzoo_int8_choose
        choose.restype = ctypes.c_int
        choose.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 12 + [ctypes.c_float] * 2
        return lib
    except Exception as err:  # a missing or failing compiler, an unwritable cache: the reference runs instead
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvzoo: the CPU kernels could not be built ({type(err).__name__}: {detail}); the int8 index "
                      "scan runs its PyTorch reference (slower; set CC to a C compiler, or KVZOO_KERNELS=torch to "
                      "silence this)", RuntimeWarning, stacklevel=2)
        return None


def _rows_contiguous(t: torch.Tensor) -> bool:
    """``t [B, G, m, w]`` has contiguous rows, one after another (a view of a buffer's first ``m`` rows is fine)."""
    return t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(2) == t.shape[3])


def int8_estimate_supported(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor) -> bool:
    """Whether :func:`int8_estimate` takes these tensors (CPU, the dtypes and a geometry the loop handles)."""
    hq, D = query.shape[2], query.shape[3]
    return (query.device.type == "cpu" and codes.device.type == "cpu" and side.device.type == "cpu"
            and query.dtype == torch.float32 and codes.dtype == torch.int8 and side.dtype == torch.float16
            and hq <= MAX_HQ and D <= MAX_D and D % LANES == 0 and not query.requires_grad
            and _rows_contiguous(codes) and _rows_contiguous(side))


def int8_estimate(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, scaling: float,
                  length: torch.Tensor | None) -> torch.Tensor:
    """The C loop's ``estimate [B, G, hq, m]`` (see ``SOURCE``) for ``codes [B, G, m, D]`` and ``side [B, G, m, w]``;
    the caller checked :func:`int8_estimate_supported` and that :func:`library` is not None. Registered as the
    torch op ``kvzoo::int8_estimate``, so that traces count it and ``torch.compile`` takes it whole."""
    lengths = None if length is None else length.to(torch.int64)
    return torch.ops.kvzoo.int8_estimate(query, codes, side, lengths, float(scaling))


def _int8_estimate_cpu(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, length: torch.Tensor | None,
                       scaling: float) -> torch.Tensor:
    lib = library()
    B, G, hq, D = query.shape
    m = codes.shape[2]
    q = query.contiguous()
    lengths = None if length is None else length.contiguous()
    out = torch.empty(B, G, hq, m, dtype=torch.float32)
    status = lib.kvzoo_int8_estimate(
        q.data_ptr(), codes.data_ptr(), side.data_ptr(), None if lengths is None else lengths.data_ptr(),
        out.data_ptr(), B, G, hq, D, m, codes.stride(0), codes.stride(1), side.stride(0), side.stride(1),
        side.shape[-1], scaling)
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


def int8_choose(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, threshold: torch.Tensor, j: int,
                archived: int, scaling: float, slack: float,
                length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over int8 entries for a decode step, staged: ``(idx, picked) [B, G, hq * j]`` (see
    ``kvzoo_int8_choose`` in ``SOURCE``; ``threshold [B, G, hq]`` is ``s* - j_margin``). One call for what the
    PyTorch path does in ~30 ops (scan, top-j, the chosen rows' bounds, the group's union). The caller checked
    :func:`int8_estimate_supported`, ``1 <= j <= min(MAX_J, m)`` and that :func:`library` is not None."""
    lengths = None if length is None else length.to(torch.int64)
    return torch.ops.kvzoo.int8_choose(query, codes, side, lengths, threshold.float(), j, archived, float(scaling),
                                       float(slack))


def _int8_choose_cpu(query, codes, side, length, threshold, j, archived, scaling, slack):
    lib = library()
    B, G, hq, D = query.shape
    q = query.contiguous()
    thr = threshold.contiguous()
    lengths = None if length is None else length.contiguous()
    idx = torch.empty(B, G, hq * j, dtype=torch.int64)
    picked = torch.empty(B, G, hq * j, dtype=torch.bool)
    status = lib.kvzoo_int8_choose(
        q.data_ptr(), codes.data_ptr(), side.data_ptr(), None if lengths is None else lengths.data_ptr(),
        thr.data_ptr(), idx.data_ptr(), picked.data_ptr(), B, G, hq, D, codes.shape[2], j, archived,
        codes.stride(0), codes.stride(1), side.stride(0), side.stride(1), side.shape[-1], scaling, slack)
    if status != 0:
        raise RuntimeError(f"kvzoo_int8_choose refused hq={hq}, D={D}, j={j}, m={codes.shape[2]}, "
                           f"archived={archived} (hq <= {MAX_HQ}, D % {LANES} == 0, 1 <= j <= min({MAX_J}, m))")
    return idx, picked


def _int8_choose_meta(query, codes, side, length, threshold, j, archived, scaling, slack):
    B, G, hq, _ = query.shape
    return (query.new_empty(B, G, hq * j, dtype=torch.int64), query.new_empty(B, G, hq * j, dtype=torch.bool))


_LIBRARY.define("int8_choose(Tensor query, Tensor codes, Tensor side, Tensor? length, Tensor threshold, int j, "
                "int archived, float scaling, float slack) -> (Tensor, Tensor)")
_LIBRARY.impl("int8_choose", _int8_choose_cpu, "CPU")
_LIBRARY.impl("int8_choose", _int8_choose_meta, "Meta")
