"""Small C kernels for CPU tensors, built on first use with the machine's C compiler and called through ctypes.

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

The source is below; it is compiled once per machine and source version into the user's cache directory
(``$KVZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvzoo`` or ``~/.cache/kvzoo``) with ``$CC`` (default ``cc``),
``-O3 -march=native``. Threads: where torch runs on GNU OpenMP (its wheel ships ``libgomp``) the kernels are built
with ``-fopenmp`` and linked against that very library, found in the process's memory map, so one OpenMP runtime
(and one thread pool) serves torch and these kernels; a call takes ``torch.get_num_threads()`` threads when its
rows are large enough to pay for waking them (:data:`PARALLEL_BYTES`). Elsewhere, or if that build fails, they run
on one thread. Where no compiler works, :func:`library` returns None once and says why in a RuntimeWarning, and callers take the
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
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvzoo.kernels.decode_attention import Rows

SOURCE = r"""

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* AVX-512 (F, BW, VL: masked 16-bit loads) where the compiler targets it; AVX2 for the int8 scan; else portable C */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_AVX512 1
#endif
#if defined(KV_AVX512) && defined(__AVX512BF16__)
#define KV_BF16DOT 1
#endif

#define LANES 8
#define MAX_HQ 64
#define MAX_D 1024
#define MAX_J 64

/* ------------------------------------------------------------------------------------------------------------
   shared: work items over threads, number formats
   ------------------------------------------------------------------------------------------------------------ */

int kvzoo_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

typedef void (*item_fn)(void *ctx, int64_t item);

/* fn(ctx, 0 .. items - 1), on up to `threads` threads of the process's OpenMP runtime (the one torch uses: its
   pool is reused, nothing is oversubscribed), each taking the next item as it finishes one. */
static void run_items(item_fn fn, void *ctx, int64_t items, int64_t threads) {
#ifdef _OPENMP
    if (threads > 1 && items > 1) {
        int64_t next = 0;
        int team = (int)(threads < items ? threads : items);
#pragma omp parallel num_threads(team)
        {
            for (;;) {
                int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
                if (item >= items) break;
                fn(ctx, item);
            }
        }
        return;
    }
#endif
    (void)threads;
    for (int64_t item = 0; item < items; item++) fn(ctx, item);
}

enum { F32 = 0, BF16 = 1, F16 = 2 };

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

/* float -> fp16 bits, rounded to nearest even (as torch's .to(float16)) */
static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7FFFFFFFu;
    if (absx > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);        /* nan */
    if (absx >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);       /* rounds to inf (65520 and up) */
    if (absx < 0x38800000u) {                                          /* below 2^-14: subnormal or zero */
        float a;
        memcpy(&a, &absx, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f)); /* units of 2^-24, nearest even */
    }
    uint32_t h = (((absx >> 23) - 112) << 10) | ((absx & 0x7FFFFFu) >> 13), rest = absx & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;         /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
#endif
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* float -> bf16 bits, rounded to nearest even (as torch's .to(bfloat16)) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline float element(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == BF16 ? bf16_to_float(h) : half_to_float(h);
}

static inline float round_to(float x, int dtype) {
    if (dtype == BF16) return bf16_to_float(float_to_bf16(x));
    if (dtype == F16) return half_to_float(float_to_half(x));
    return x;
}

/* ------------------------------------------------------------------------------------------------------------
   the int8 index scan
   ------------------------------------------------------------------------------------------------------------ */

static inline float lane_sum(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#ifdef KV_AVX512
/* 4 vectors -> one: block k (128 bits) holds 4 partial sums of v[k] */
static inline __m512 sum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
    __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

/* 4 vectors of sum4 -> lane 4k + s holds the total of block k of t[s] */
static inline __m512 sum4x4(__m512 t0, __m512 t1, __m512 t2, __m512 t3) {
    __m512 a = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
    __m512 b = _mm512_add_ps(_mm512_shuffle_ps(t2, t3, 0x44), _mm512_shuffle_ps(t2, t3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

static inline __m512 codes16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 codes8(const int8_t *p) {  /* 8 codes, the upper lanes 0 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The dots of 16 consecutive int8 rows (rows >= count read row 0 again; their lanes are not used) with nh (1-4)
   query rows: lane r of sums[h] is dot(q[h], row r). Each dot accumulates 16 partial sums (d mod 16) in its own
   register; four rows at a time (rows s, s + 4, s + 8, s + 12) and then all sixteen are reduced together
   (sum4, sum4x4): a fixed order, the same for every row, and ~1 shuffle-add per dot instead of ~8. */
static inline __attribute__((always_inline)) void int8_dots16(const float *q, int64_t D, const int8_t *codes,
                                                              int64_t count, const int nh, __m512 *sums) {
    __m512 part[4][4];
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {  /* unrolled: the partial sums stay in registers */
        const int8_t *r0 = codes + (s < count ? s : 0) * D, *r1 = codes + (s + 4 < count ? s + 4 : 0) * D;
        const int8_t *r2 = codes + (s + 8 < count ? s + 8 : 0) * D, *r3 = codes + (s + 12 < count ? s + 12 : 0) * D;
        __m512 a[4][4];
        for (int h = 0; h < nh; h++)
            for (int k = 0; k < 4; k++) a[h][k] = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m512 c0 = codes16(r0 + d), c1 = codes16(r1 + d), c2 = codes16(r2 + d), c3 = codes16(r3 + d);
            for (int h = 0; h < nh; h++) {
                __m512 x = _mm512_loadu_ps(q + h * D + d);
                __asm__("" : "+v"(x));  /* one load in a register for the 4 rows (not one per multiply-add) */
                a[h][0] = _mm512_fmadd_ps(x, c0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(x, c1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(x, c2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(x, c3, a[h][3]);
            }
        }
        if (d < D) {  /* D % 16 == 8 */
            __m512 c0 = codes8(r0 + d), c1 = codes8(r1 + d), c2 = codes8(r2 + d), c3 = codes8(r3 + d);
            for (int h = 0; h < nh; h++) {
                __m512 x = _mm512_maskz_loadu_ps(0x00FF, q + h * D + d);
                a[h][0] = _mm512_fmadd_ps(x, c0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(x, c1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(x, c2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(x, c3, a[h][3]);
            }
        }
        for (int h = 0; h < nh; h++) part[h][s] = sum4(a[h][0], a[h][1], a[h][2], a[h][3]);
    }
    for (int h = 0; h < nh; h++) sums[h] = sum4x4(part[h][0], part[h][1], part[h][2], part[h][3]);
}
#endif

#ifdef __AVX2__
/* The estimates of `rows` (1 or 2) consecutive int8 rows for every query row (AVX2 without AVX-512): dots[r * hq +
   h]; each dot in LANES partial sums (d mod LANES), added in a fixed order (lane_sum). */
static inline void row_estimates(const float *restrict q, const int8_t *restrict row, int64_t rows, int64_t hq,
                                 int64_t D, const float *scale, float scaling, float *restrict dots) {
    const int8_t *row1 = row + (rows > 1 ? D : 0);
    for (int64_t h0 = 0; h0 < hq; h0 += 4) {
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
}
#endif

/* est[h * 16 + r] = (dot(q[h], row r) * scale[r]) * scaling for the `count` (<= 16) consecutive rows at `codes`,
   every query row h < hq; the scale is column 0 of each row's side entry (fp16). */
static void int8_block(const float *q, int64_t hq, int64_t D, const int8_t *codes, const uint16_t *side,
                       int64_t side_w, float scaling, int64_t count, float *est) {
    float scale[16];
#ifdef KV_AVX512
    __m512 sc;
    if (side_w == 3) {  /* column 0 of 16 entries [scale, err, norm]: 48 halves, every third, in one permute */
        int64_t n = 3 * count;
        __m512i lo = _mm512_maskz_loadu_epi16(n >= 32 ? ~0u : (1u << n) - 1u, side);
        __m512i hi = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(n > 32 ? (__mmask16)((1u << (n - 32)) - 1u) : 0,
                                                                     side + 32));
        const __m512i every3 = _mm512_setr_epi32(0x00030000, 0x00090006, 0x000F000C, 0x00150012, 0x001B0018,
                                                 0x0021001E, 0x00270024, 0x002D002A, 0, 0, 0, 0, 0, 0, 0, 0);
        sc = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(lo, every3, hi)));
    } else {
        for (int64_t r = 0; r < 16; r++) scale[r] = r < count ? half_to_float(side[r * side_w]) : 0.0f;
        sc = _mm512_loadu_ps(scale);
    }
    __m512 scl = _mm512_set1_ps(scaling), sums[4];
    for (int64_t h0 = 0; h0 < hq; h0 += 4) {
        int64_t nh = hq - h0 < 4 ? hq - h0 : 4;
        const float *qh = q + h0 * D;
        switch (nh) {
            case 1: int8_dots16(qh, D, codes, count, 1, sums); break;
            case 2: int8_dots16(qh, D, codes, count, 2, sums); break;
            case 3: int8_dots16(qh, D, codes, count, 3, sums); break;
            default: int8_dots16(qh, D, codes, count, 4, sums); break;
        }
        for (int64_t h = 0; h < nh; h++)
            _mm512_storeu_ps(est + (h0 + h) * 16, _mm512_mul_ps(_mm512_mul_ps(sums[h], sc), scl));
    }
#elif defined(__AVX2__)
    for (int64_t r = 0; r < count; r++) scale[r] = half_to_float(side[r * side_w]);
    float dots[2 * MAX_HQ];
    for (int64_t r = 0; r < count; r += 2) {
        int64_t rows = count - r < 2 ? 1 : 2;
        row_estimates(q, codes + r * D, rows, hq, D, scale + r, scaling, dots);
        for (int64_t k = 0; k < rows; k++)
            for (int64_t h = 0; h < hq; h++) est[h * 16 + r + k] = dots[k * hq + h];
    }
#else
    for (int64_t r = 0; r < count; r++) scale[r] = half_to_float(side[r * side_w]);
    for (int64_t r = 0; r < count; r++) {
        const int8_t *row = codes + r * D;
        for (int64_t h = 0; h < hq; h++) {
            const float *qh = q + h * D;
            float a[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t d0 = 0; d0 < D; d0 += LANES)
                for (int l = 0; l < LANES; l++) a[l] += qh[d0 + l] * (float)row[d0 + l];
            est[h * 16 + r] = (lane_sum(a) * scale[r]) * scaling;
        }
    }
#endif
}

/* the lines of a block of rows four blocks ahead (the hardware prefetcher alone leaves the scan waiting on memory) */
static inline void prefetch_rows(const int8_t *codes, int64_t code_bytes, const uint16_t *side, int64_t side_halves) {
#if defined(__GNUC__)
    for (int64_t o = 0; o < code_bytes; o += 64) __builtin_prefetch(codes + o, 0, 3);
    for (int64_t o = 0; o < side_halves; o += 32) __builtin_prefetch(side + o, 0, 3);
#endif
}

/* Rows live in sequence b: length[b] clamped to [0, m] (every row without a length). */
static inline int64_t live_rows(const int64_t *length, int64_t b, int64_t m) {
    int64_t live = length ? length[b] : m;
    return live > m ? m : (live < 0 ? 0 : live);
}

typedef struct {
    const float *q;
    const int8_t *codes;
    const uint16_t *side;
    const int64_t *length;
    float *out;                                 /* estimate: [B, G, hq, m] */
    const float *threshold;                     /* choose */
    int64_t *idx;
    uint8_t *picked;
    float *top;                                 /* choose, per item: [hq][j] values, rows, and the count */
    int64_t *at, *filled, *counts;             /* counts: picked rows per group */
    int64_t B, G, hq, D, m, j, archived, codes_sb, codes_sg, side_sb, side_sg, side_w, chunks, chunk_rows;
    float scaling, slack;
} Int8Scan;

/* the rows [r0, r1) an item (b, g, chunk) scans */
static inline void item_rows(const Int8Scan *c, int64_t item, int64_t *b, int64_t *g, int64_t *r0, int64_t *r1) {
    int64_t bg = item / c->chunks, chunk = item % c->chunks;
    *b = bg / c->G;
    *g = bg % c->G;
    int64_t live = live_rows(c->length, *b, c->m);
    *r0 = chunk * c->chunk_rows;
    *r1 = *r0 + c->chunk_rows < live ? *r0 + c->chunk_rows : live;
}

static void estimate_item(void *ctx, int64_t item) {
    const Int8Scan *c = ctx;
    int64_t b, g, r0, r1, hq = c->hq, D = c->D, m = c->m;
    item_rows(c, item, &b, &g, &r0, &r1);
    const float *qg = c->q + (b * c->G + g) * hq * D;
    const int8_t *cg = c->codes + b * c->codes_sb + g * c->codes_sg;
    const uint16_t *sg = c->side + b * c->side_sb + g * c->side_sg;
    float *og = c->out + (b * c->G + g) * hq * m;
    float est[MAX_HQ * 16];
    for (int64_t i = r0; i < r1; i += 16) {
        int64_t count = r1 - i < 16 ? r1 - i : 16;
        if (i + 80 <= r1) prefetch_rows(cg + (i + 64) * D, 16 * D, sg + (i + 64) * c->side_w, 16 * c->side_w);
        int8_block(qg, hq, D, cg + i * D, sg + i * c->side_w, c->side_w, c->scaling, count, est);
        for (int64_t h = 0; h < hq; h++) memcpy(og + h * m + i, est + h * 16, count * sizeof(float));
    }
    if (item % c->chunks == c->chunks - 1) {  /* the group's last chunk: -inf past its live rows */
        int64_t live = live_rows(c->length, b, m);
        for (int64_t h = 0; h < hq; h++)
            for (int64_t i = live; i < m; i++) og[h * m + i] = -INFINITY;
    }
}

/* estimate[b, g, h, i] = (dot(q[b, g, h], codes[b, g, i]) * scale[b, g, i]) * scaling for i < length[b], -inf for
   length[b] <= i < m. q [B, G, hq, D] fp32 contiguous; codes [B, G, m, D] int8 with contiguous rows (element
   strides codes_sb, codes_sg for b and g: a view of the first m rows of a larger buffer); side [B, G, m, side_w]
   fp16 bits the same way (strides side_sb, side_sg), the scale its column 0; out [B, G, hq, m] fp32 contiguous.
   `threads`: at most this many threads, over (b, g, a run of rows). */
int kvzoo_int8_estimate(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                        float *out, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m,
                        int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w,
                        float scaling, int64_t threads);

/* runs of rows per group: one on one thread, else a few items per thread of at least 256 rows each (the caller
   asks for threads only where the index is large enough to pay for waking them) */
static int64_t scan_chunks(int64_t B, int64_t G, int64_t m, int64_t threads) {
    if (threads <= 1) return 1;
    int64_t chunks = (4 * threads + B * G - 1) / (B * G), most = (m + 255) / 256;
    if (chunks > most) chunks = most;
    return chunks < 1 ? 1 : chunks;
}

static inline int64_t chunk_rows_of(int64_t m, int64_t chunks) {
    int64_t rows = (m + chunks - 1) / chunks;
    return (rows + 15) / 16 * 16;
}

int kvzoo_int8_estimate(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                        float *out, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m,
                        int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w,
                        float scaling, int64_t threads) {
    if (hq > MAX_HQ || D > MAX_D || D % LANES != 0) return 1;
    Int8Scan c = {q, codes, side, length, out, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                  B, G, hq, D, m, 0, 0, codes_sb, codes_sg, side_sb, side_sg, side_w, 1, m, scaling, 0.0f};
    c.chunks = scan_chunks(B, G, m, threads);
    c.chunk_rows = chunk_rows_of(m, c.chunks);
    run_items(estimate_item, &c, B * G * c.chunks, threads);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
   top lists (every fused choice): each query row's best K rows of a run of rows, merged over runs in row order,
   and a group's candidates staged as the runtime stages a choice
   ------------------------------------------------------------------------------------------------------------ */

/* insert (v, row) into a query row's top list (vh, ih, *n of j): an earlier row stays first among equal values */
static inline void top_insert(float *vh, int64_t *ih, int64_t *n, int64_t j, float v, int64_t row) {
    int64_t pos = *n == j ? j - 1 : *n;
    while (pos > 0 && v > vh[pos - 1]) {  /* strictly greater moves up */
        vh[pos] = vh[pos - 1];
        ih[pos] = ih[pos - 1];
        pos--;
    }
    vh[pos] = v;
    ih[pos] = row;
    if (*n < j) (*n)++;
}

/* the values vals[0 .. count) of rows i .. i + count - 1 (count <= 16; vals holds 16 readable floats) into a query
   row's top list (vh, ih, *n of j) */
static inline void top_block(float *vh, int64_t *ih, int64_t *n, int64_t j, const float *vals, int64_t count,
                             int64_t i) {
    int64_t r = 0;
    for (; r < count && *n < j; r++) top_insert(vh, ih, n, j, vals[r], i + r);
    if (r == count) return;
#ifdef KV_AVX512
    /* which rows beat the j-th best: one compare for the block, the insertion only for those */
    uint32_t beat = _mm512_cmp_ps_mask(_mm512_loadu_ps(vals), _mm512_set1_ps(vh[j - 1]), _CMP_GT_OQ);
    beat &= ((1u << count) - 1u) & ~((1u << r) - 1u);
    while (beat) {
        int rr = __builtin_ctz(beat);
        beat &= beat - 1;
        if (vals[rr] > vh[j - 1]) top_insert(vh, ih, n, j, vals[rr], i + rr);  /* the j-th may rise */
    }
#else
    for (; r < count; r++)
        if (vals[r] > vh[j - 1]) top_insert(vh, ih, n, j, vals[r], i + r);  /* NaN never enters */
#endif
}

/* query row h's top lists (top, at, filled: [item][hq][j], [item][hq][j], [item][hq]) of a group's runs -- items
   bg * chunks + chunk, in row order -- merged into its best j (an earlier run first among equal values): vals and
   rows (tmp_v, tmp_r: room for j more). Returns how many. */
static int64_t merge_tops(const float *top, const int64_t *at, const int64_t *filled, int64_t bg, int64_t chunks,
                          int64_t hq, int64_t h, int64_t j, float *vals, int64_t *rows, float *tmp_v, int64_t *tmp_r) {
    int64_t n = 0;
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        int64_t item = bg * chunks + chunk, nb = filled[item * hq + h], ia = 0, ib = 0, out = 0;
        const float *vb = top + (item * hq + h) * j;
        const int64_t *rb = at + (item * hq + h) * j;
        while (out < j && (ia < n || ib < nb)) {
            int from_b = ia >= n || (ib < nb && vb[ib] > vals[ia]);
            tmp_v[out] = from_b ? vb[ib] : vals[ia];
            tmp_r[out++] = from_b ? rb[ib++] : rows[ia++];
        }
        n = out;
        memcpy(vals, tmp_v, n * sizeof(float));
        memcpy(rows, tmp_r, n * sizeof(int64_t));
    }
    return n;
}

/* a[0 .. K) ascending: nothing when it already is, insertion sort for a few, else a bottom-up merge sort (tmp: room
   for K) */
static void sort_rows(int64_t *a, int64_t K, int64_t *tmp) {
    int64_t k = 1;
    while (k < K && a[k - 1] <= a[k]) k++;
    if (k >= K) return;
    const int64_t run = 32;
    for (int64_t r0 = 0; r0 < K; r0 += run) {
        int64_t r1 = r0 + run < K ? r0 + run : K;
        for (int64_t i = r0 + 1; i < r1; i++) {
            int64_t v = a[i], pos = i;
            while (pos > r0 && a[pos - 1] > v) { a[pos] = a[pos - 1]; pos--; }
            a[pos] = v;
        }
    }
    int64_t *from = a, *to = tmp;
    for (int64_t width = run; width < K; width *= 2) {
        for (int64_t lo = 0; lo < K; lo += 2 * width) {
            int64_t mid = lo + width < K ? lo + width : K, hi = lo + 2 * width < K ? lo + 2 * width : K;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) to[o++] = from[j] < from[i] ? from[j++] : from[i++];
            while (i < mid) to[o++] = from[i++];
            while (j < hi) to[o++] = from[j++];
        }
        int64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != a) memcpy(a, from, K * sizeof(int64_t));
}

/* K candidates (a kept row's index, `archived` for the others) staged as kvzoo.framework.retrieval's
   unique_candidates stages a choice: sorted ascending, idx = min(candidate, archived - 1), picked on the first copy
   of each kept row. Returns how many rows are picked. */
static int64_t stage_union(int64_t *cand, int64_t K, int64_t archived, int64_t *idx, uint8_t *picked) {
    int64_t local[MAX_HQ * MAX_J], *tmp = K <= MAX_HQ * MAX_J ? local : malloc(K * sizeof(int64_t));
    if (!tmp) {  /* no memory for the merge: insertion sort in place */
        for (int64_t k = 1; k < K; k++) {
            int64_t v = cand[k], pos = k;
            while (pos > 0 && cand[pos - 1] > v) { cand[pos] = cand[pos - 1]; pos--; }
            cand[pos] = v;
        }
    } else {
        sort_rows(cand, K, tmp);
        if (tmp != local) free(tmp);
    }
    int64_t count = 0;
    for (int64_t k = 0; k < K; k++) {
        int64_t v = cand[k];
        uint8_t first = v < archived && (k == 0 || v != cand[k - 1]);
        picked[k] = first;
        count += first;
        idx[k] = v < archived ? v : archived - 1;
    }
    return count;
}

/* the total of the groups' counts: written to *count_out, added to *counter (the layer's fetched rows) if given */
static void add_counts(const int64_t *counts, int64_t groups, int64_t *count_out, int64_t *counter) {
    int64_t total = 0;
    for (int64_t bg = 0; bg < groups; bg++) total += counts[bg];
    *count_out = total;
    if (counter) *counter += total;
}

static void choose_item(void *ctx, int64_t item) {
    const Int8Scan *c = ctx;
    int64_t b, g, r0, r1, hq = c->hq, D = c->D, j = c->j;
    item_rows(c, item, &b, &g, &r0, &r1);
    const float *qg = c->q + (b * c->G + g) * hq * D;
    const int8_t *cg = c->codes + b * c->codes_sb + g * c->codes_sg;
    const uint16_t *sg = c->side + b * c->side_sb + g * c->side_sg;
    float *top = c->top + item * hq * j;
    int64_t *at = c->at + item * hq * j, *filled = c->filled + item * hq;
    float est[MAX_HQ * 16];
    for (int64_t h = 0; h < hq; h++) filled[h] = 0;
    for (int64_t i = r0; i < r1; i += 16) {
        int64_t count = r1 - i < 16 ? r1 - i : 16;
        if (i + 80 <= r1) prefetch_rows(cg + (i + 64) * D, 16 * D, sg + (i + 64) * c->side_w, 16 * c->side_w);
        int8_block(qg, hq, D, cg + i * D, sg + i * c->side_w, c->side_w, c->scaling, count, est);
        for (int64_t h = 0; h < hq; h++) top_block(top + h * j, at + h * j, filled + h, j, est + h * 16, count, i);
    }
}

/* a group's chunks merged in row order (a tie goes to the earlier chunk: the earlier row), then the certified
   bound of each of the top j rows against the threshold, and the group's union staged */
static void choose_group(void *ctx, int64_t bg) {
    const Int8Scan *c = ctx;
    int64_t hq = c->hq, D = c->D, j = c->j, K = hq * j, b = bg / c->G, g = bg % c->G, archived = c->archived;
    const float *qg = c->q + bg * hq * D;
    const uint16_t *sg = c->side + b * c->side_sb + g * c->side_sg;
    int64_t candidates[MAX_HQ * MAX_J];
    for (int64_t h = 0; h < hq; h++) {
        float vals[MAX_J], tmp_v[MAX_J];
        int64_t rows[MAX_J], tmp_r[MAX_J];
        int64_t n = merge_tops(c->top, c->at, c->filled, bg, c->chunks, hq, h, j, vals, rows, tmp_v, tmp_r);
        const float *qh = qg + h * D;
        float sq = 0.0f;
        for (int64_t d = 0; d < D; d++) sq += qh[d] * qh[d];
        float reach = c->scaling * sqrtf(sq), limit = c->threshold[bg * hq + h];
        for (int64_t p = 0; p < j; p++) {
            int64_t cand = archived;
            if (p < n) {
                int64_t row = rows[p];
                float err = half_to_float(sg[row * c->side_w + 1]), norm = half_to_float(sg[row * c->side_w + 2]);
                if (vals[p] + reach * (err + c->slack * norm) > limit) cand = row;
            }
            candidates[h * j + p] = cand;
        }
    }
    c->counts[bg] = stage_union(candidates, K, archived, c->idx + bg * K, c->picked + bg * K);
}

/* VestigeKV's top-j rule on int8 key entries for one decode step, every query row of a group at once, staged as the
   runtime stages it. Per query row h of group (b, g): the top j rows by estimate (kvzoo_int8_estimate's numbers; an
   earlier row first among equal values), each kept when its certified bound
       estimate + (scaling * ||q_h||) * (err + slack * norm)
   is above threshold[b, g, h] (s* - j_margin). The K = hq * j candidates -- a kept row's index, `archived` for the
   others -- are staged (stage_union): idx[b, g, k] and picked[b, g, k], what kvzoo.framework.retrieval's
   unique_candidates makes of the same choice. *count_out: the rows picked over every group, also added to *counter
   when it is given (the layer's count of fetched rows). With several threads each scans runs of rows keeping its own
   top lists, merged per group in row order (the same choice). */
int kvzoo_int8_choose(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                      const float *threshold, int64_t *idx, uint8_t *picked, int64_t *count_out, int64_t *counter,
                      int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m, int64_t j, int64_t archived,
                      int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w,
                      float scaling, float slack, int64_t threads) {
    if (hq > MAX_HQ || D > MAX_D || D % LANES != 0 || j < 1 || j > MAX_J || j > m || archived < 1) return 1;
    Int8Scan c = {q, codes, side, length, NULL, threshold, idx, picked, NULL, NULL, NULL, NULL,
                  B, G, hq, D, m, j, archived, codes_sb, codes_sg, side_sb, side_sg, side_w, 1, m, scaling, slack};
    c.chunks = scan_chunks(B, G, m, threads);
    c.chunk_rows = chunk_rows_of(m, c.chunks);
    int64_t items = B * G * c.chunks;
    char *scratch = malloc(items * hq * (j * (sizeof(float) + sizeof(int64_t)) + sizeof(int64_t))
                           + B * G * sizeof(int64_t));
    if (!scratch) return 2;
    c.at = (int64_t *)scratch;
    c.filled = c.at + items * hq * j;
    c.counts = c.filled + items * hq;
    c.top = (float *)(c.counts + B * G);
    run_items(choose_item, &c, items, threads);
    run_items(choose_group, &c, B * G, B * G * hq * j >= 4096 ? threads : 1);
    add_counts(c.counts, B * G, count_out, counter);
    free(scratch);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
   decode attention over one source of rows, read where they lie (kvzoo.kernels.decode_attention's specification)
   ------------------------------------------------------------------------------------------------------------ */

#define TILE 32      /* positions per tile: their scores, one softmax update, then their values */
#define MAX_HPG 64   /* query heads per KV group (a bit each in a position's head mask) */

/* the parameters of kvzoo_decode_attend, in this order: an int64 array (pointers as integers, 0 for an absent
   tensor; strides in elements) */
enum {
    A_Q, A_Q_SB, A_Q_SH, A_Q_DTYPE,
    A_K, A_K_SB, A_K_SG, A_K_SN,
    A_V, A_V_SB, A_V_SG, A_V_SN,
    A_DTYPE,
    A_IDX, A_IDX_SB, A_IDX_SG, A_IDX_SK, A_IDX_32,
    A_LEN, A_LEN_S, A_LEN_32,
    A_VALID, A_VALID_SB, A_VALID_SG, A_VALID_SK,
    A_POOL, A_POOL_SB, A_POOL_SG, A_POOL_SN,
    A_HEAD, A_HEAD_SB, A_HEAD_SH, A_HEAD_SK,
    A_PRIOR_OUT, A_PRIOR_LSE,
    A_OUT, A_LSE, A_BEST, A_MASS,
    A_B, A_H, A_G, A_N, A_P, A_D, A_DV, A_THREADS,
    A_COUNT
};

typedef struct {
    const char *q, *k, *v;  /* v: the keys in the absorbed form (a row's value is its first Dv dims) */
    const void *idx, *len;
    const uint8_t *valid, *pool, *head;
    const float *prior_out, *prior_lse;
    float *out, *lse, *best, *mass;
    int64_t q_sb, q_sh, k_sb, k_sg, k_sn, v_sb, v_sg, v_sn, i_sb, i_sg, i_sk, len_s;
    int64_t va_sb, va_sg, va_sk, pv_sb, pv_sg, pv_sn, hv_sb, hv_sh, hv_sk;
    int64_t B, H, G, N, P, D, Dv, hpg, Dp, splits, item_floats, separate;
    int q_dtype, dtype, idx32, len32;
    float scaling;
    float *scratch;  /* per item: acc [hpg][Dv], max [hpg], sum [hpg], query [hpg][Dp], scores [hpg][TILE], bf16 query */
} Decode;

/* positions sequence b reads: [0, length[b]) within [0, P) */
static inline int64_t decode_positions(const Decode *c, int64_t b) {
    int64_t n = c->P;
    if (c->len) {
        int64_t l = c->len32 ? ((const int32_t *)c->len)[b * c->len_s] : ((const int64_t *)c->len)[b * c->len_s];
        if (l < n) n = l;
    }
    return n < 0 ? 0 : n;
}

#ifdef KV_AVX512
static inline __m512 vload(const char *row, int64_t d, const int dtype) {
    if (dtype == F32) return _mm512_loadu_ps((const float *)row + d);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static inline __m512 vload_mask(const char *row, int64_t d, const int dtype, __mmask16 mk) {
    if (dtype == F32) return _mm512_maskz_loadu_ps(mk, (const float *)row + d);
    __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)row + d);
    if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static inline __mmask16 tail16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* exp(x) in fp32 (Cephes' expf: 2^n exp(r), |r| <= ln2 / 2, within ~2 ulp); 0 below -104 (-inf included) */
static inline __m512 exp512(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* The scores of up to 16 rows (rows[r], r < n; the others read rows[0] again, their lanes unused) with nh (1-4)
   query rows (fp32, zero-padded to Dp): out[h * TILE + r] = scaling * dot. As the int8 scan: four rows at a time
   (rows s, s + 4, s + 8, s + 12), each dot in 16 lanes, all sixteen reduced together (sum4, sum4x4). */
static inline __attribute__((always_inline)) void dots16(const float *q, int64_t Dp, const char *const *rows,
                                                         int64_t n, int64_t D, const int dtype, const int nh,
                                                         float scaling, float *out) {
    __m512 part[4][4];
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const char *r0 = rows[s < n ? s : 0], *r1 = rows[s + 4 < n ? s + 4 : 0];
        const char *r2 = rows[s + 8 < n ? s + 8 : 0], *r3 = rows[s + 12 < n ? s + 12 : 0];
        __m512 a[4][4];
        for (int h = 0; h < nh; h++)
            for (int k = 0; k < 4; k++) a[h][k] = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m512 c0 = vload(r0, d, dtype), c1 = vload(r1, d, dtype), c2 = vload(r2, d, dtype), c3 = vload(r3, d, dtype);
            __asm__("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3));  /* each row chunk loaded once, for every head */
            for (int h = 0; h < nh; h++) {
                __m512 x = _mm512_loadu_ps(q + h * Dp + d);
                __asm__("" : "+v"(x));  /* one load in a register for the 4 rows */
                a[h][0] = _mm512_fmadd_ps(x, c0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(x, c1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(x, c2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(x, c3, a[h][3]);
            }
        }
        if (d < D) {
            __mmask16 mk = tail16(D - d);
            __m512 c0 = vload_mask(r0, d, dtype, mk), c1 = vload_mask(r1, d, dtype, mk);
            __m512 c2 = vload_mask(r2, d, dtype, mk), c3 = vload_mask(r3, d, dtype, mk);
            for (int h = 0; h < nh; h++) {
                __m512 x = _mm512_loadu_ps(q + h * Dp + d);
                a[h][0] = _mm512_fmadd_ps(x, c0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(x, c1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(x, c2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(x, c3, a[h][3]);
            }
        }
        for (int h = 0; h < nh; h++) part[h][s] = sum4(a[h][0], a[h][1], a[h][2], a[h][3]);
    }
    for (int h = 0; h < nh; h++)
        _mm512_storeu_ps(out + h * TILE, _mm512_mul_ps(sum4x4(part[h][0], part[h][1], part[h][2], part[h][3]),
                                                       _mm512_set1_ps(scaling)));
}

#ifdef KV_BF16DOT
/* dots16 for bf16 rows: the products of bf16 pairs (exact in fp32) added into fp32 lanes by vdpbf16ps */
static inline __attribute__((always_inline)) void dots16_bf16(const uint16_t *q, int64_t Dp, const char *const *rows,
                                                              int64_t n, int64_t D, const int nh, float scaling,
                                                              float *out) {
    __m512 part[4][4];
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const uint16_t *r0 = (const uint16_t *)rows[s < n ? s : 0], *r1 = (const uint16_t *)rows[s + 4 < n ? s + 4 : 0];
        const uint16_t *r2 = (const uint16_t *)rows[s + 8 < n ? s + 8 : 0];
        const uint16_t *r3 = (const uint16_t *)rows[s + 12 < n ? s + 12 : 0];
        __m512 a[4][4];
        for (int h = 0; h < nh; h++)
            for (int k = 0; k < 4; k++) a[h][k] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32) {
            __mmask32 mk = D - d >= 32 ? ~0u : (1u << (D - d)) - 1u;
            __m512bh c0 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r0 + d), c1 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r1 + d);
            __m512bh c2 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r2 + d), c3 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r3 + d);
            __asm__("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3));
            for (int h = 0; h < nh; h++) {
                __m512i xi = _mm512_loadu_si512((const void *)(q + h * Dp + d));
                __asm__("" : "+v"(xi));
                __m512bh x = (__m512bh)xi;
                a[h][0] = _mm512_dpbf16_ps(a[h][0], x, c0);
                a[h][1] = _mm512_dpbf16_ps(a[h][1], x, c1);
                a[h][2] = _mm512_dpbf16_ps(a[h][2], x, c2);
                a[h][3] = _mm512_dpbf16_ps(a[h][3], x, c3);
            }
        }
        for (int h = 0; h < nh; h++) part[h][s] = sum4(a[h][0], a[h][1], a[h][2], a[h][3]);
    }
    for (int h = 0; h < nh; h++)
        _mm512_storeu_ps(out + h * TILE, _mm512_mul_ps(sum4x4(part[h][0], part[h][1], part[h][2], part[h][3]),
                                                       _mm512_set1_ps(scaling)));
}
#endif

/* scores [hpg][TILE] of a tile's n rows for every head of the group: each row read once per block of 4 heads */
static inline __attribute__((always_inline)) void tile_scores(const float *qf, const uint16_t *qb, int64_t Dp,
                                                              const char *const *rows, int64_t n, int64_t D,
                                                              int64_t hpg, const int dtype, float scaling, float *sc) {
    for (int64_t h0 = 0; h0 < hpg; h0 += 4) {
        int64_t nh = hpg - h0 < 4 ? hpg - h0 : 4;
        for (int64_t k0 = 0; k0 < n; k0 += 16) {
            int64_t m = n - k0;
            float *out = sc + h0 * TILE + k0;
#ifdef KV_BF16DOT
            if (dtype == BF16) {
                const uint16_t *qh = qb + h0 * Dp;
                switch (nh) {
                    case 1: dots16_bf16(qh, Dp, rows + k0, m, D, 1, scaling, out); break;
                    case 2: dots16_bf16(qh, Dp, rows + k0, m, D, 2, scaling, out); break;
                    case 3: dots16_bf16(qh, Dp, rows + k0, m, D, 3, scaling, out); break;
                    default: dots16_bf16(qh, Dp, rows + k0, m, D, 4, scaling, out); break;
                }
                continue;
            }
#endif
            const float *qh = qf + h0 * Dp;
            switch (nh) {
                case 1: dots16(qh, Dp, rows + k0, m, D, dtype, 1, scaling, out); break;
                case 2: dots16(qh, Dp, rows + k0, m, D, dtype, 2, scaling, out); break;
                case 3: dots16(qh, Dp, rows + k0, m, D, dtype, 3, scaling, out); break;
                default: dots16(qh, Dp, rows + k0, m, D, dtype, 4, scaling, out); break;
            }
        }
    }
    (void)qb;
}

/* acc[h][:] += sum_k p[h][k] * value_k for nh (1-4) heads: 4 x 16 columns of nh heads in registers per pass */
static inline __attribute__((always_inline)) void tile_values(float *acc, int64_t Dv, const float *p,
                                                              const char *const *vrow, int64_t n, const int dtype,
                                                              const int nh) {
    int64_t c0 = 0;
    for (; c0 + 64 <= Dv; c0 += 64) {
        __m512 a[4][4];
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < 4; j++) a[h][j] = _mm512_loadu_ps(acc + h * Dv + c0 + 16 * j);
        for (int64_t k = 0; k < n; k++) {
            __m512 x0 = vload(vrow[k], c0, dtype), x1 = vload(vrow[k], c0 + 16, dtype);
            __m512 x2 = vload(vrow[k], c0 + 32, dtype), x3 = vload(vrow[k], c0 + 48, dtype);
            for (int h = 0; h < nh; h++) {
                __m512 w = _mm512_set1_ps(p[h * TILE + k]);
                a[h][0] = _mm512_fmadd_ps(w, x0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(w, x1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(w, x2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(w, x3, a[h][3]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + h * Dv + c0 + 16 * j, a[h][j]);
    }
    for (; c0 < Dv; c0 += 16) {
        __mmask16 mk = tail16(Dv - c0);
        __m512 a[4];
        for (int h = 0; h < nh; h++) a[h] = _mm512_maskz_loadu_ps(mk, acc + h * Dv + c0);
        for (int64_t k = 0; k < n; k++) {
            __m512 x = vload_mask(vrow[k], c0, dtype, mk);
            for (int h = 0; h < nh; h++) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * TILE + k]), x, a[h]);
        }
        for (int h = 0; h < nh; h++) _mm512_mask_storeu_ps(acc + h * Dv + c0, mk, a[h]);
    }
}

static inline float max_of(const float *s, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < n; k += 16) {
        __mmask16 mk = tail16(n - k);
        m = _mm512_mask_max_ps(m, mk, m, _mm512_maskz_loadu_ps(mk, s + k));
    }
    return _mm512_reduce_max_ps(m);
}

/* s[k] = exp(s[k] - shift) for k < n; returns their sum */
static inline float exp_shifted(float *s, int64_t n, float shift) {
    __m512 total = _mm512_setzero_ps(), sh = _mm512_set1_ps(shift);
    for (int64_t k = 0; k < n; k += 16) {
        __mmask16 mk = tail16(n - k);
        __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + k), sh)));
        _mm512_mask_storeu_ps(s + k, mk, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}

static inline void scale_by(float *a, int64_t n, float w) {
    __m512 ww = _mm512_set1_ps(w);
    for (int64_t k = 0; k < n; k += 16) {
        __mmask16 mk = tail16(n - k);
        _mm512_mask_storeu_ps(a + k, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a + k), ww));
    }
}

static inline void add_scaled(float *a, const float *x, int64_t n, float w) {
    __m512 ww = _mm512_set1_ps(w);
    for (int64_t k = 0; k < n; k += 16) {
        __mmask16 mk = tail16(n - k);
        _mm512_mask_storeu_ps(a + k, mk, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + k), ww,
                                                         _mm512_maskz_loadu_ps(mk, a + k)));
    }
}
#else  /* portable C (the compiler vectorises the lane loops where it can) */
static inline __attribute__((always_inline)) void row_dots(const float *q, int64_t Dp, const char *row, int64_t D,
                                                           const int dtype, const int nh, float *out) {
    float x[2 * MAX_D + 64];  /* index entries too: up to MAX_W */
    for (int64_t d = 0; d < D; d++) x[d] = element(row, d, dtype);
    for (int64_t d = D; d < Dp; d++) x[d] = 0.0f;
    for (int h = 0; h < nh; h++) {
        const float *qh = q + h * Dp;
        float a[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t d0 = 0; d0 < Dp; d0 += LANES)
            for (int l = 0; l < LANES; l++) a[l] += qh[d0 + l] * x[d0 + l];
        out[h * TILE] = lane_sum(a);
    }
}

static inline __attribute__((always_inline)) void tile_scores(const float *qf, const uint16_t *qb, int64_t Dp,
                                                              const char *const *rows, int64_t n, int64_t D,
                                                              int64_t hpg, const int dtype, float scaling, float *sc) {
    for (int64_t h0 = 0; h0 < hpg; h0 += 4) {
        int64_t nh = hpg - h0 < 4 ? hpg - h0 : 4;
        for (int64_t k = 0; k < n; k++) {
            row_dots(qf + h0 * Dp, Dp, rows[k], D, dtype, (int)nh, sc + h0 * TILE + k);
            for (int64_t h = 0; h < nh; h++) sc[(h0 + h) * TILE + k] *= scaling;
        }
    }
    (void)qb;
}

static inline __attribute__((always_inline)) void tile_values(float *acc, int64_t Dv, const float *p,
                                                              const char *const *vrow, int64_t n, const int dtype,
                                                              const int nh) {
    float x[MAX_D];
    for (int64_t k = 0; k < n; k++) {
        for (int64_t d = 0; d < Dv; d++) x[d] = element(vrow[k], d, dtype);
        for (int h = 0; h < nh; h++) {
            float w = p[h * TILE + k], *ah = acc + h * Dv;
            for (int64_t d = 0; d < Dv; d++) ah[d] += w * x[d];
        }
    }
}

static inline float max_of(const float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t k = 0; k < n; k++) m = s[k] > m ? s[k] : m;
    return m;
}

static inline float exp_shifted(float *s, int64_t n, float shift) {
    float total = 0.0f;
    for (int64_t k = 0; k < n; k++) {
        s[k] = expf(s[k] - shift);
        total += s[k];
    }
    return total;
}

static inline void scale_by(float *a, int64_t n, float w) {
    for (int64_t k = 0; k < n; k++) a[k] *= w;
}

static inline void add_scaled(float *a, const float *x, int64_t n, float w) {
    for (int64_t k = 0; k < n; k++) a[k] += w * x[k];
}
#endif

static inline void prefetch_row(const char *row, int64_t bytes) {
#if defined(__GNUC__)
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
#endif
}

/* One work item: sequence b, group g, its split-th run of positions. Per tile: the readable positions (in the pool,
   within length, valid, pool_valid at their row, some head's head_valid), the scores of every head of the group
   from one read of each row, one online-softmax update per head, then the values. Leaves the item's running max,
   sum and unnormalised output in its scratch; with `mass`, the masked scores in mass (-inf: unreadable). */
static inline __attribute__((always_inline)) void decode_range(const Decode *c, int64_t item, const int dtype) {
    int64_t bg = item / c->splits, split = item % c->splits, b = bg / c->G, g = bg % c->G;
    int64_t hpg = c->hpg, D = c->D, Dv = c->Dv, Dp = c->Dp, P = c->P, es = dtype == F32 ? 4 : 2;
    int64_t qes = c->q_dtype == F32 ? 4 : 2;
    float *acc = c->scratch + item * c->item_floats, *mx = acc + hpg * Dv, *sum = mx + hpg, *qf = sum + hpg;
    float *sc = qf + hpg * Dp;
    uint16_t *qb = (uint16_t *)(sc + hpg * TILE);
    memset(acc, 0, hpg * Dv * sizeof(float));
    for (int64_t h = 0; h < hpg; h++) {
        mx[h] = -INFINITY;
        sum[h] = 0.0f;
        const char *qh = c->q + (b * c->q_sb + (g * hpg + h) * c->q_sh) * qes;
        for (int64_t d = 0; d < Dp; d++) {  /* the query rounded to the rows' dtype, as the reference does */
            float x = d < D ? round_to(element(qh, d, c->q_dtype), dtype) : 0.0f;
            qf[h * Dp + d] = x;
            qb[h * Dp + d] = float_to_bf16(x);
        }
    }
    int64_t limit = decode_positions(c, b), per = (limit + c->splits - 1) / c->splits;
    int64_t p0 = split * per, p1 = p0 + per < limit ? p0 + per : limit;
    float *mass = c->mass ? c->mass + (b * c->H + g * hpg) * P : NULL;
    if (mass)
        for (int64_t h = 0; h < hpg; h++)
            for (int64_t p = p0; p < p1; p++) mass[h * P + p] = -INFINITY;
    const char *kbase = c->k + (b * c->k_sb + g * c->k_sg) * es, *vbase = c->v + (b * c->v_sb + g * c->v_sg) * es;
    const uint64_t every = hpg == 64 ? ~0ull : (1ull << hpg) - 1ull;
    const char *krow[TILE], *vrow[TILE];
    int64_t pos[TILE];
    uint64_t heads[TILE];
    /* this group's slices of the index list and the flags, and their strides (locals: the stores below never alias) */
    const int64_t *idx64 = c->idx && !c->idx32 ? (const int64_t *)c->idx + b * c->i_sb + g * c->i_sg : NULL;
    const int32_t *idx32 = c->idx && c->idx32 ? (const int32_t *)c->idx + b * c->i_sb + g * c->i_sg : NULL;
    const uint8_t *valid = c->valid ? c->valid + b * c->va_sb + g * c->va_sg : NULL;
    const uint8_t *pool = c->pool ? c->pool + b * c->pv_sb + g * c->pv_sg : NULL;
    const uint8_t *head = c->head ? c->head + b * c->hv_sb + g * hpg * c->hv_sh : NULL;
    const int64_t i_sk = c->i_sk, va_sk = c->va_sk, pv_sn = c->pv_sn, hv_sh = c->hv_sh, hv_sk = c->hv_sk, N = c->N;
    const int64_t k_step = c->k_sn * es, v_step = c->v_sn * es;
    const int plain = !c->idx && !valid && !pool && !head;
    for (int64_t t0 = p0; t0 < p1; t0 += TILE) {
        int64_t t1 = t0 + TILE < p1 ? t0 + TILE : p1, n = 0;
        int partial = 0;  /* some position readable by some heads only */
        if (plain) {  /* every position of the pool: its row */
            for (int64_t i = t0; i < t1; i++, n++) {
                krow[n] = kbase + i * k_step;
                vrow[n] = vbase + i * v_step;
                pos[n] = i;
                heads[n] = every;
            }
        } else {
            for (int64_t i = t0; i < t1; i++) {
                int64_t row = idx64 ? idx64[i * i_sk] : idx32 ? idx32[i * i_sk] : i;
                if (row < 0 || row >= N) continue;
                if (valid && !valid[i * va_sk]) continue;
                if (pool && !pool[row * pv_sn]) continue;
                uint64_t hm = every;
                if (head) {
                    const uint8_t *hv = head + i * hv_sk;
                    hm = 0;
                    for (int64_t h = 0; h < hpg; h++) hm |= (uint64_t)(hv[h * hv_sh] != 0) << h;
                    if (!hm) continue;
                    partial |= hm != every;
                }
                krow[n] = kbase + row * k_step;
                vrow[n] = vbase + row * v_step;
                pos[n] = i;
                heads[n++] = hm;
            }
        }
        {  /* the rows two tiles ahead, while this one computes (from memory, the hardware prefetcher alone leaves the
              pool form waiting on its rows: a third less time with this) */
            int64_t u0 = t0 + 2 * TILE, u1 = u0 + TILE < p1 ? u0 + TILE : p1;
            for (int64_t i = u0; i < u1; i++) {
                int64_t row = idx64 ? idx64[i * i_sk] : idx32 ? idx32[i * i_sk] : i;
                if (row < 0 || row >= N) continue;
                prefetch_row(kbase + row * k_step, D * es);
                if (c->separate) prefetch_row(vbase + row * v_step, Dv * es);
            }
        }
        if (n == 0) continue;
        tile_scores(qf, qb, Dp, krow, n, D, hpg, dtype, c->scaling, sc);  /* [hpg][n], each row read once */
        for (int64_t h = 0; h < hpg; h++) {
            float *s = sc + h * TILE;
            if (partial)
                for (int64_t k = 0; k < n; k++) s[k] = (heads[k] >> h) & 1u ? s[k] : -INFINITY;
            if (mass)
                for (int64_t k = 0; k < n; k++) mass[h * P + pos[k]] = s[k];
            float top = max_of(s, n);
            if (top == -INFINITY) {  /* nothing this head may read in the tile */
                memset(s, 0, n * sizeof(float));
                continue;
            }
            float m = top > mx[h] ? top : mx[h];
            if (m != mx[h]) {
                float alpha = expf(mx[h] - m);  /* 0 while nothing was read */
                sum[h] *= alpha;
                scale_by(acc + h * Dv, Dv, alpha);
                mx[h] = m;
            }
            sum[h] += exp_shifted(s, n, m);
        }
        for (int64_t h0 = 0; h0 < hpg; h0 += 4) {
            int64_t nh = hpg - h0 < 4 ? hpg - h0 : 4;
            switch (nh) {
                case 1: tile_values(acc + h0 * Dv, Dv, sc + h0 * TILE, vrow, n, dtype, 1); break;
                case 2: tile_values(acc + h0 * Dv, Dv, sc + h0 * TILE, vrow, n, dtype, 2); break;
                case 3: tile_values(acc + h0 * Dv, Dv, sc + h0 * TILE, vrow, n, dtype, 3); break;
                default: tile_values(acc + h0 * Dv, Dv, sc + h0 * TILE, vrow, n, dtype, 4); break;
            }
        }
    }
}

static void decode_item_f32(void *ctx, int64_t item) { decode_range(ctx, item, F32); }
static void decode_item_bf16(void *ctx, int64_t item) { decode_range(ctx, item, BF16); }
static void decode_item_f16(void *ctx, int64_t item) { decode_range(ctx, item, F16); }

/* A group's splits and the prior merged into one softmax per head (log-sum-exp weights; a part with none readable
   weighs 0), normalised; the best score; each position's probability in the whole softmax. */
static void decode_finish(void *ctx, int64_t bg) {
    const Decode *c = ctx;
    int64_t b = bg / c->G, g = bg % c->G, hpg = c->hpg, Dv = c->Dv, P = c->P;
    for (int64_t hh = 0; hh < hpg; hh++) {
        int64_t bh = b * c->H + g * hpg + hh;
        float top = -INFINITY;
        for (int64_t s = 0; s < c->splits; s++) {
            float m = (c->scratch + (bg * c->splits + s) * c->item_floats + hpg * Dv)[hh];
            top = m > top ? m : top;
        }
        if (c->best) c->best[bh] = top;
        float prior = c->prior_lse ? c->prior_lse[bh] : -INFINITY;
        float shift = prior > top ? prior : top, total = 0.0f;
        float *o = c->out + bh * Dv;
        memset(o, 0, Dv * sizeof(float));
        if (shift == -INFINITY) {
            c->lse[bh] = -INFINITY;
            continue;
        }
        for (int64_t s = 0; s < c->splits; s++) {
            const float *acc = c->scratch + (bg * c->splits + s) * c->item_floats, *mx = acc + hpg * Dv;
            if (mx[hh] == -INFINITY) continue;
            float w = expf(mx[hh] - shift);
            total += w * mx[hpg + hh];
            add_scaled(o, acc + hh * Dv, Dv, w);
        }
        if (prior != -INFINITY) {
            float w = expf(prior - shift);
            total += w;
            add_scaled(o, c->prior_out + bh * Dv, Dv, w);
        }
        scale_by(o, Dv, 1.0f / total);
        c->lse[bh] = shift + logf(total);
    }
    if (c->mass) {
        int64_t limit = decode_positions(c, b);
        for (int64_t hh = 0; hh < hpg; hh++) {
            int64_t bh = b * c->H + g * hpg + hh;
            float *m = c->mass + bh * P, lse = c->lse[bh];
            int64_t read = lse == -INFINITY ? 0 : limit;  /* no readable row: every probability 0 */
            exp_shifted(m, read, lse);
            memset(m + read, 0, (P - read) * sizeof(float));
        }
    }
}

/* Decode attention of one query per sequence over one source of rows, in one softmax with a prior part (see
   kvzoo.kernels.cpu_native.decode_attend). a: the A_* parameters; returns 0, or 1 for a shape it does not take. */
int kvzoo_decode_attend(const int64_t *a, int64_t count, float scaling) {
    if (count != A_COUNT) return 3;
    Decode c;
    memset(&c, 0, sizeof c);
    c.q = (const char *)a[A_Q]; c.q_sb = a[A_Q_SB]; c.q_sh = a[A_Q_SH]; c.q_dtype = (int)a[A_Q_DTYPE];
    c.k = (const char *)a[A_K]; c.k_sb = a[A_K_SB]; c.k_sg = a[A_K_SG]; c.k_sn = a[A_K_SN];
    c.separate = a[A_V] != 0;
    c.v = c.separate ? (const char *)a[A_V] : c.k;
    c.v_sb = c.separate ? a[A_V_SB] : c.k_sb; c.v_sg = c.separate ? a[A_V_SG] : c.k_sg;
    c.v_sn = c.separate ? a[A_V_SN] : c.k_sn;
    c.dtype = (int)a[A_DTYPE];
    c.idx = (const void *)a[A_IDX]; c.i_sb = a[A_IDX_SB]; c.i_sg = a[A_IDX_SG]; c.i_sk = a[A_IDX_SK];
    c.idx32 = (int)a[A_IDX_32];
    c.len = (const void *)a[A_LEN]; c.len_s = a[A_LEN_S]; c.len32 = (int)a[A_LEN_32];
    c.valid = (const uint8_t *)a[A_VALID]; c.va_sb = a[A_VALID_SB]; c.va_sg = a[A_VALID_SG]; c.va_sk = a[A_VALID_SK];
    c.pool = (const uint8_t *)a[A_POOL]; c.pv_sb = a[A_POOL_SB]; c.pv_sg = a[A_POOL_SG]; c.pv_sn = a[A_POOL_SN];
    c.head = (const uint8_t *)a[A_HEAD]; c.hv_sb = a[A_HEAD_SB]; c.hv_sh = a[A_HEAD_SH]; c.hv_sk = a[A_HEAD_SK];
    c.prior_out = (const float *)a[A_PRIOR_OUT]; c.prior_lse = (const float *)a[A_PRIOR_LSE];
    c.out = (float *)a[A_OUT]; c.lse = (float *)a[A_LSE]; c.best = (float *)a[A_BEST]; c.mass = (float *)a[A_MASS];
    c.B = a[A_B]; c.H = a[A_H]; c.G = a[A_G]; c.N = a[A_N]; c.P = a[A_P]; c.D = a[A_D]; c.Dv = a[A_DV];
    c.scaling = scaling;
    int64_t threads = a[A_THREADS];
    if (c.G < 1 || c.H % c.G || c.H / c.G > MAX_HPG || c.D < 1 || c.D > MAX_D || c.Dv < 1 || c.Dv > MAX_D
        || (!c.separate && c.Dv > c.D) || c.dtype < F32 || c.dtype > F16 || c.q_dtype < F32 || c.q_dtype > F16)
        return 1;
    c.hpg = c.H / c.G;
    c.Dp = (c.D + 31) / 32 * 32;
    c.splits = 1;
    if (threads > 1) {  /* a few items per thread, each of two tiles or more (the caller asks for threads only where
                           the rows are many enough to pay for waking them) */
        int64_t most = (c.P + 2 * TILE - 1) / (2 * TILE);
        c.splits = (4 * threads + c.B * c.G - 1) / (c.B * c.G);
        if (c.splits > most) c.splits = most;
        if (c.splits < 1) c.splits = 1;
    }
    int64_t hpg = c.hpg, items = c.B * c.G * c.splits;
    c.item_floats = (hpg * c.Dv + 2 * hpg + hpg * c.Dp + hpg * TILE + (hpg * c.Dp + 1) / 2 + 15) / 16 * 16;
    if (items > 0) {
        c.scratch = aligned_alloc(64, items * c.item_floats * sizeof(float));
        if (!c.scratch) return 2;
        run_items(c.dtype == F32 ? decode_item_f32 : c.dtype == BF16 ? decode_item_bf16 : decode_item_f16, &c,
                  items, threads);
        run_items(decode_finish, &c, c.B * c.G, c.mass && c.B * c.H * c.P >= (64 << 10) ? threads : 1);
        free(c.scratch);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
   fused decode-step choices over float index entries -- VestigeKV's sketch, Quest's pages -- and Quest's one-row
   page add (kvzoo.kernels.choose holds their PyTorch references: the specification)
   ------------------------------------------------------------------------------------------------------------ */

#define MAX_W (2 * MAX_D + 1)  /* the widest index entry: a Quest page [max, min, max |k|] of MLA's 576-dim rows */

/* sc[h * TILE + k] = scaling * dot(q[h], rows[k]) for n (1 - 16) rows of width W in `dtype` and hq fp32 query rows
   (row stride Wp, zero-padded to Wp, a multiple of 32). The query is not rounded: an index scan's products are fp32's,
   the entries upcast (kvzoo.kernels.index_scan's reference), whatever their dtype. */
static void index_scores(const float *q, int64_t Wp, const char *const *rows, int64_t n, int64_t W, int dtype,
                         int64_t hq, float scaling, float *sc) {
    for (int64_t h0 = 0; h0 < hq; h0 += 4) {
        int nh = hq - h0 < 4 ? (int)(hq - h0) : 4;
        const float *qh = q + h0 * Wp;
        float *out = sc + h0 * TILE;
#ifdef KV_AVX512
#define KV_SCORES(DT) switch (nh) { \
            case 1: dots16(qh, Wp, rows, n, W, DT, 1, scaling, out); break; \
            case 2: dots16(qh, Wp, rows, n, W, DT, 2, scaling, out); break; \
            case 3: dots16(qh, Wp, rows, n, W, DT, 3, scaling, out); break; \
            default: dots16(qh, Wp, rows, n, W, DT, 4, scaling, out); break; }
        if (dtype == F32) { KV_SCORES(F32) } else if (dtype == BF16) { KV_SCORES(BF16) } else { KV_SCORES(F16) }
#undef KV_SCORES
#else
        for (int64_t k = 0; k < n; k++) {
            row_dots(qh, Wp, rows[k], W, dtype, nh, out + k);
            for (int h = 0; h < nh; h++) out[h * TILE + k] *= scaling;
        }
#endif
    }
}

/* dot(x, y) over n fp32 values, in LANES partial sums (d mod LANES) added in a fixed order: the compiler vectorises
   it (a plain running sum it may not reorder) */
static inline float lanes_dot(const float *x, const float *y, int64_t n) {
    float a[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) a[l] += x[d + l] * y[d + l];
    for (int l = 0; d < n; d++, l++) a[l] += x[d] * y[d];
    return lane_sum(a);
}

/* dot(q, row) over W columns, the row in `dtype` */
static float entry_dot(const float *q, const char *row, int64_t W, int dtype) {
    if (dtype == F32) return lanes_dot(q, (const float *)row, W);
    float x[MAX_W];
    for (int64_t d = 0; d < W; d++) x[d] = element(row, d, dtype);
    return lanes_dot(q, x, W);
}

static inline float ranked(float v) { return v != v ? INFINITY : v; }  /* NaN first, as torch.topk ranks it */

/* --- VestigeKV's top-j rule over the certified sketch ------------------------------------------------------- */

typedef struct {
    const float *qrank, *qbound;  /* [B * G][hq][Wp]: the ranking query rows (the estimate's, or the bound's), the bound's */
    const char *entries;
    const int64_t *length;
    const float *floor;
    float *top;
    int64_t *at, *filled, *cand, *idx, *counts;
    uint8_t *picked;
    int64_t B, G, hq, W, Wp, m, j, archived, e_sb, e_sg, e_sm, es, chunks, chunk_rows;
    int dtype;
    float scaling;
} SketchScan;

static void sketch_item(void *ctx, int64_t item) {
    const SketchScan *c = ctx;
    int64_t bg = item / c->chunks, chunk = item % c->chunks, b = bg / c->G, g = bg % c->G, hq = c->hq, j = c->j;
    int64_t live = live_rows(c->length, b, c->m), r0 = chunk * c->chunk_rows;
    int64_t r1 = r0 + c->chunk_rows < live ? r0 + c->chunk_rows : live, step = c->e_sm * c->es;
    const char *eg = c->entries + (b * c->e_sb + g * c->e_sg) * c->es;
    const float *q = c->qrank + bg * hq * c->Wp;
    float *top = c->top + item * hq * j;
    int64_t *at = c->at + item * hq * j, *filled = c->filled + item * hq;
    float sc[MAX_HQ * TILE];
    const char *rows[16];
    for (int64_t h = 0; h < hq; h++) filled[h] = 0;
    for (int64_t i = r0; i < r1; i += 16) {
        int64_t count = r1 - i < 16 ? r1 - i : 16;
        for (int64_t k = 0; k < count; k++) rows[k] = eg + (i + k) * step;
        if (i + 80 <= r1)
            for (int64_t k = 64; k < 80; k++) prefetch_row(eg + (i + k) * step, c->W * c->es);
        index_scores(q, c->Wp, rows, count, c->W, c->dtype, hq, c->scaling, sc);
        for (int64_t h = 0; h < hq; h++) {
            float *v = sc + h * TILE;
            for (int64_t k = 0; k < count; k++) v[k] = ranked(v[k]);
            top_block(top + h * j, at + h * j, filled + h, j, v, count, i);
        }
    }
}

static void sketch_group(void *ctx, int64_t bg) {
    const SketchScan *c = ctx;
    int64_t hq = c->hq, j = c->j, K = hq * j, b = bg / c->G, g = bg % c->G;
    const char *eg = c->entries + (b * c->e_sb + g * c->e_sg) * c->es;
    int64_t *cand = c->cand + bg * K;
    for (int64_t h = 0; h < hq; h++) {
        float vals[MAX_J], tmp_v[MAX_J];
        int64_t rows[MAX_J], tmp_r[MAX_J];
        int64_t n = merge_tops(c->top, c->at, c->filled, bg, c->chunks, hq, h, j, vals, rows, tmp_v, tmp_r);
        const float *qb = c->qbound + (bg * hq + h) * c->Wp;
        float limit = c->floor[bg * hq + h];
        for (int64_t p = 0; p < j; p++) {
            int64_t keep = c->archived;
            if (p < n) {  /* the chosen row's bound, every column of its entry */
                float bound = entry_dot(qb, eg + rows[p] * c->e_sm * c->es, c->W, c->dtype) * c->scaling;
                if (bound > limit) keep = rows[p];
            }
            cand[h * j + p] = keep;
        }
    }
    c->counts[bg] = stage_union(cand, K, c->archived, c->idx + bg * K, c->picked + bg * K);
}

/* A group's query rows of the sketch (kvzoo.kernels.index_scan.sketch_query): for each of its hq query rows q (D =
   dc + dr, the content part q_c first) the bound's row [V^T q_c, ||(I - V V^T) q_c||, q_r, slack ||q_c||, slack
   ||q_r||] (GQA, dr = 0: [V^T q_c, ||(I - V V^T) q_c||, slack ||q_c||]) and the ranking row: the estimate's (eta's
   and the slack columns 0) or, rank_by_bound, the bound's. V [dc, r] contiguous; rows of stride Wp (zero-padded).
   Both products run in a fixed order (V^T q_c over the latent dimensions, V (V^T q_c) over the basis columns, every
   head at once: with AVX-512 a register of 16 heads and 4 latent dimensions in flight). Scratch: qz [hq][r], qzT [r][hq], resid, nc [hq]. */
static void sketch_query_rows(const float *restrict q, const float *restrict V, int64_t hq, int64_t D, int64_t dc,
                              int64_t r, float slack, int rank_by_bound, int64_t Wp, float *restrict rank,
                              float *restrict bound, float *restrict qz, float *restrict qzT, float *restrict resid,
                              float *restrict nc) {
    int64_t dr = D - dc;
    /* qz[h][k] = sum over d (in order) of q_c[h][d] V[d][k] */
    for (int64_t h = 0; h < hq; h++) {
        const float *qc = q + h * D;
        float *z = qz + h * r;
#ifdef KV_AVX512
        int64_t k0 = 0;
        for (; k0 + 64 <= r; k0 += 64) {  /* 64 columns in registers over the whole sum */
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < dc; d++) {
                __m512 x = _mm512_set1_ps(qc[d]);
                const float *v = V + d * r + k0;
                a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v), a0);
                a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 16), a1);
                a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 32), a2);
                a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 48), a3);
            }
            _mm512_storeu_ps(z + k0, a0);
            _mm512_storeu_ps(z + k0 + 16, a1);
            _mm512_storeu_ps(z + k0 + 32, a2);
            _mm512_storeu_ps(z + k0 + 48, a3);
        }
        for (; k0 < r; k0 += 16) {
            __mmask16 mk = tail16(r - k0);
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < dc; d++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(qc[d]), _mm512_maskz_loadu_ps(mk, V + d * r + k0), a);
            _mm512_mask_storeu_ps(z + k0, mk, a);
        }
#else
        for (int64_t k = 0; k < r; k++) z[k] = 0.0f;
        for (int64_t d = 0; d < dc; d++)
            for (int64_t k = 0; k < r; k++) z[k] += qc[d] * V[d * r + k];
#endif
        for (int64_t k = 0; k < r; k++) qzT[k * hq + h] = z[k];
        resid[h] = nc[h] = 0.0f;
    }
    /* p[h] = (V V^T q_c[h])[d] = sum over k (in order) of V[d][k] qz[h][k], every head at once; then the residual's
       and q_c's squared norms, summed over d in order */
    for (int64_t d0 = 0; d0 < dc; d0 += 4) {
        int64_t nd = dc - d0 < 4 ? dc - d0 : 4;
        float pp[4 * MAX_HQ];
#ifdef KV_AVX512
        for (int64_t h0 = 0; h0 < hq; h0 += 16) {  /* 16 heads a register, 4 latent dimensions in flight */
            __mmask16 mk = tail16(hq - h0);
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *v0 = V + d0 * r, *v1 = V + (d0 + (nd > 1)) * r, *v2 = V + (d0 + 2 * (nd > 2)) * r;
            const float *v3 = V + (d0 + 3 * (nd > 3)) * r;
            for (int64_t k = 0; k < r; k++) {
                __m512 z = _mm512_maskz_loadu_ps(mk, qzT + k * hq + h0);
                a0 = _mm512_fmadd_ps(z, _mm512_set1_ps(v0[k]), a0);
                a1 = _mm512_fmadd_ps(z, _mm512_set1_ps(v1[k]), a1);
                a2 = _mm512_fmadd_ps(z, _mm512_set1_ps(v2[k]), a2);
                a3 = _mm512_fmadd_ps(z, _mm512_set1_ps(v3[k]), a3);
            }
            _mm512_mask_storeu_ps(pp + h0, mk, a0);
            _mm512_mask_storeu_ps(pp + MAX_HQ + h0, mk, a1);
            _mm512_mask_storeu_ps(pp + 2 * MAX_HQ + h0, mk, a2);
            _mm512_mask_storeu_ps(pp + 3 * MAX_HQ + h0, mk, a3);
        }
#else
        for (int64_t i = 0; i < nd; i++)
            for (int64_t h = 0; h < hq; h++) {
                float a = 0.0f;
                for (int64_t k = 0; k < r; k++) a += qzT[k * hq + h] * V[(d0 + i) * r + k];
                pp[i * MAX_HQ + h] = a;
            }
#endif
        for (int64_t i = 0; i < nd; i++)
            for (int64_t h = 0; h < hq; h++) {
                float x = q[h * D + d0 + i], e = x - pp[i * MAX_HQ + h];
                resid[h] += e * e;
                nc[h] += x * x;
            }
    }
    for (int64_t h = 0; h < hq; h++) {
        const float *qr = q + h * D + dc, *z = qz + h * r;
        float *rk = rank + h * Wp, *bd = bound + h * Wp, nr = 0.0f;
        for (int64_t d = 0; d < dr; d++) nr += qr[d] * qr[d];
        for (int64_t k = 0; k < r; k++) bd[k] = rk[k] = z[k];
        bd[r] = sqrtf(resid[h]);
        for (int64_t d = 0; d < dr; d++) bd[r + 1 + d] = rk[r + 1 + d] = qr[d];
        bd[r + 1 + dr] = slack * sqrtf(nc[h]);
        if (dr) bd[r + 2 + dr] = slack * sqrtf(nr);
        if (rank_by_bound) memcpy(rk, bd, Wp * sizeof(float));
    }
}

/* VestigeKV's top-j rule over its certified sketch for one decode step (kvzoo.kernels.choose.sketch_choose_reference
   is the specification). q [B, G, hq, D] fp32 contiguous (D = dc + dr: the content part first, dr = 0 on GQA); basis
   [B, G, dc, r] fp32 (element strides basis_sb, basis_sg; each [dc, r] contiguous); entries [B, G, m, W] in `dtype`
   (F32 or F16; element strides e_sb, e_sg, e_sm; each row contiguous), W = r + 1 + dr + 2 (MLA) or r + 2 (GQA):
   [z, eta, r, ||c||, ||r||]; length [B] or NULL (rows >= length[b] are not rows); floor [B, G, hq] fp32 (s* -
   j_margin). Per query row: its query row Q = [V^T q_c, ||(I - V V^T) q_c||, q_r, slack ||q_c||, slack ||q_r||],
   the estimate scaling * (Q . E without eta's and the slack columns) of every row (rank_by_bound: the bound scaling *
   Q . E), its top j (an earlier row first among equal values, NaN first), each kept when its bound scaling * Q . E
   is above the floor; the group's candidates staged (stage_union) into idx, picked [B, G, hq * j]; *count_out the
   rows picked, also added to *counter when given. */
int kvzoo_sketch_choose(const float *q, const float *basis, int64_t basis_sb, int64_t basis_sg, const char *entries,
                        int64_t dtype, int64_t e_sb, int64_t e_sg, int64_t e_sm, const int64_t *length,
                        const float *floor, int64_t *idx, uint8_t *picked, int64_t *count_out, int64_t *counter,
                        int64_t B, int64_t G, int64_t hq, int64_t D, int64_t dc, int64_t r, int64_t m, int64_t W,
                        int64_t j, int64_t archived, int64_t rank_by_bound, float scaling, float slack,
                        int64_t threads) {
    int64_t dr = D - dc;
    if (hq < 1 || hq > MAX_HQ || D > MAX_D || dc < 1 || dr < 0 || r < 1 || r > dc || j < 1 || j > MAX_J || j > m
        || archived < 1 || W != r + 1 + (dr ? dr + 2 : 1) || (dtype != F32 && dtype != F16))
        return 1;
    SketchScan c;
    memset(&c, 0, sizeof c);
    c.B = B; c.G = G; c.hq = hq; c.W = W; c.Wp = (W + 31) / 32 * 32; c.m = m; c.j = j; c.archived = archived;
    c.e_sb = e_sb; c.e_sg = e_sg; c.e_sm = e_sm; c.es = dtype == F32 ? 4 : 2; c.dtype = (int)dtype;
    c.entries = entries; c.length = length; c.floor = floor; c.idx = idx; c.picked = picked; c.scaling = scaling;
    c.chunks = scan_chunks(B, G, m, threads);
    c.chunk_rows = chunk_rows_of(m, c.chunks);
    int64_t items = B * G * c.chunks, rows_q = B * G * hq * c.Wp;
    char *scratch = calloc(1, 2 * rows_q * sizeof(float) + items * hq * j * (sizeof(float) + sizeof(int64_t))
                              + items * hq * sizeof(int64_t) + B * G * (hq * j + 1) * sizeof(int64_t));
    if (!scratch) return 2;
    float *qrank = (float *)scratch, *qbound = qrank + rows_q;
    c.top = qbound + rows_q;
    c.at = (int64_t *)(c.top + items * hq * j);
    c.filled = c.at + items * hq * j;
    c.cand = c.filled + items * hq;
    c.counts = c.cand + B * G * hq * j;
    float *qz = malloc((2 * r * hq + 2 * hq) * sizeof(float));  /* [hq][r], [r][hq], then per head 2 sums */
    if (!qz) { free(scratch); return 2; }
    float *qzT = qz + r * hq, *resid = qzT + r * hq, *nc = resid + hq;
    for (int64_t bg = 0; bg < B * G; bg++)  /* the query rows (kvzoo.kernels.index_scan.sketch_query) */
        sketch_query_rows(q + bg * hq * D, basis + (bg / G) * basis_sb + (bg % G) * basis_sg, hq, D, dc, r, slack,
                          (int)rank_by_bound, c.Wp, qrank + bg * hq * c.Wp, qbound + bg * hq * c.Wp, qz, qzT, resid,
                          nc);
    free(qz);
    c.qrank = qrank;
    c.qbound = qbound;
    run_items(sketch_item, &c, items, threads);
    run_items(sketch_group, &c, B * G, B * G * hq * j >= 4096 ? threads : 1);
    add_counts(c.counts, B * G, count_out, counter);
    free(scratch);
    return 0;
}

/* --- Quest's pages ------------------------------------------------------------------------------------------- */

/* torch.minimum / torch.maximum: NaN if either is */
static inline float nan_min(float a, float b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }
static inline float nan_max(float a, float b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }

static inline void store_as(char *p, int64_t i, int dtype, float x) {
    if (dtype == F32) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = dtype == BF16 ? float_to_bf16(x) : float_to_half(x);
}

typedef struct {
    const float *qrows;  /* [B * G][hq][Wp]: [max(q, 0), min(q, 0), slack ||q||_1] */
    const char *entries;
    const uint8_t *empty;
    const int64_t *positions;
    int64_t *rows_out, *pos_out, *counts;
    uint8_t *valid_out;
    char *scratch;
    int64_t B, G, hq, W, Wp, P, Pc, n, size, live, archived, M, es, item_bytes;
    int64_t e_sb, e_sg, e_sp, em_sb, em_sg, em_sp, p_sb, p_sg, p_sm;
    int dtype, per_head;
    float scaling;
    /* the step's own row (own_keys NULL: none): the storage keys [B, G, N, D] in `dtype`, valid [B, G, N], its
       position [B, G], the open page's running min/max [B, G, D] fp32 contiguous */
    const char *own_keys;
    const uint8_t *own_valid;
    const int64_t *own_pos;
    const float *open_min, *open_max;
    int64_t N, k_sb, k_sg, k_sn, v_sb, v_sg, v_sn, o_sb, o_sg;
} QuestScan;

/* The current page's entry [max, min, max |k|] in the entries' dtype with the step's own key in it (the key alone when
   it opens the page, *live % size == 0; a padding row, or a position outside [0, N), joins nothing): written into
   `entry`; returns whether the page is empty (every bound of both infinite). The summary is left as it is. */
static int own_page_entry(const QuestScan *c, int64_t b, int64_t g, char *entry) {
    int64_t D = (c->W - 1) / 2, bg = b * c->G + g, pos = c->own_pos[b * c->o_sb + g * c->o_sg];
    int ok = pos >= 0 && pos < c->N && c->own_valid[b * c->v_sb + g * c->v_sg + pos * c->v_sn];
    int opens = c->live % c->size == 0, lo_inf = 1, hi_inf = 1;
    const char *key = c->own_keys + (b * c->k_sb + g * c->k_sg + (ok ? pos : 0) * c->k_sn) * c->es;
    const float *lo0 = c->open_min + bg * D, *hi0 = c->open_max + bg * D;
    float magnitude = -INFINITY;
    for (int64_t d = 0; d < D; d++) {
        float x = ok ? element(key, d, c->dtype) : 0.0f;
        float mn = ok ? x : INFINITY, mx = ok ? x : -INFINITY;
        float lo = opens ? mn : nan_min(lo0[d], mn), hi = opens ? mx : nan_max(hi0[d], mx);
        store_as(entry, d, c->dtype, hi);
        store_as(entry, D + d, c->dtype, lo);
        magnitude = nan_max(magnitude, nan_max(fabsf(lo), fabsf(hi)));
        lo_inf &= isinf(lo) != 0;
        hi_inf &= isinf(hi) != 0;
    }
    store_as(entry, 2 * D, c->dtype, lo_inf ? 0.0f : magnitude);
    return lo_inf && hi_inf;
}

/* the storage position of archive entry `row` (the archive list), -1 for none */
static inline int64_t archive_position(const QuestScan *c, int64_t b, int64_t g, int64_t row) {
    return row >= 0 && row < c->M ? c->positions[b * c->p_sb + g * c->p_sg + row * c->p_sm] : -1;
}

static void quest_item(void *ctx, int64_t bg) {
    const QuestScan *c = ctx;
    int64_t b = bg / c->G, g = bg % c->G, hq = c->hq, n = c->n, P = c->P, Pc = c->Pc, size = c->size;
    int64_t live = c->live, lists = c->per_head ? hq : 1;
    char *mine = c->scratch + bg * c->item_bytes;  /* pages [lists][n], sort room [n], filled [lists], candidates
                                                      [n * size], top values [lists][n], the own page's entry [W],
                                                      chosen [Pc] */
    int64_t *pages = (int64_t *)mine, *room = pages + lists * n, *filled = room + n, *cand = filled + lists;
    float *vh = (float *)(cand + (c->per_head ? 0 : n * size));
    char *own_entry = (char *)(vh + lists * n);
    uint8_t *chosen = (uint8_t *)(own_entry + c->W * sizeof(float));
    const char *eg = c->entries + (b * c->e_sb + g * c->e_sg) * c->es;
    const uint8_t *emg = c->empty + b * c->em_sb + g * c->em_sg;
    const float *q = c->qrows + bg * hq * c->Wp;
    float sc[MAX_HQ * TILE], vals[MAX_HQ * 16];
    const char *rows[16];
    int64_t slot[16];
    /* the current page (live / size) scored with the step's own key; one slot past P for a page it opens there */
    int64_t own_page = c->own_keys ? live / size : -1;
    int own_empty = c->own_keys ? own_page_entry(c, b, g, own_entry) : 1;
    for (int64_t l = 0; l < lists; l++) filled[l] = 0;
    memset(chosen, 0, Pc);
    for (int64_t i = 0; i < Pc; i += 16) {  /* every page's bound (each head's, or the group's) into the top lists */
        int64_t count = Pc - i < 16 ? Pc - i : 16, nz = 0;
        for (int64_t k = 0; k < count; k++) {
            int64_t page = i + k;
            if (page == own_page) {
                if (!own_empty) {
                    rows[nz] = own_entry;
                    slot[nz++] = k;
                }
            } else if (page < P && !emg[page * c->em_sp]) {  /* an empty page is never read: its bound is -inf */
                rows[nz] = eg + page * c->e_sp * c->es;
                slot[nz++] = k;
            }
        }
        for (int64_t l = 0; l < lists; l++)
            for (int64_t k = 0; k < 16; k++) vals[l * 16 + k] = -INFINITY;
        if (nz) {
            index_scores(q, c->Wp, rows, nz, c->W, c->dtype, hq, c->scaling, sc);
            for (int64_t z = 0; z < nz; z++) {
                if (c->per_head) {
                    for (int64_t h = 0; h < hq; h++) vals[h * 16 + slot[z]] = ranked(sc[h * TILE + z]);
                } else {  /* the max over the heads, a NaN bound left out (index_scan_reduce's margin) */
                    float best = -INFINITY;
                    for (int64_t h = 0; h < hq; h++) {
                        float v = sc[h * TILE + z];
                        best = v > best ? v : best;
                    }
                    vals[slot[z]] = best;
                }
            }
        }
        for (int64_t l = 0; l < lists; l++) top_block(vh + l * n, pages + l * n, filled + l, n, vals + l * 16, count, i);
    }
    for (int64_t l = 0; l < lists; l++) sort_rows(pages + l * n, n, room);  /* each list's pages in ascending order */
    int64_t K = lists * n * size;
    int64_t *rows_out = c->rows_out + bg * K, *pos_out = c->positions ? c->pos_out + bg * K : NULL;
    uint8_t *valid_out = c->valid_out + bg * K;
    if (c->per_head) {  /* each head's pages in its own segment; the group's union counted once */
        for (int64_t h = 0; h < hq; h++)
            for (int64_t k = 0; k < n; k++) {
                int64_t page = pages[h * n + k];
                chosen[page] = 1;
                for (int64_t o = 0; o < size; o++) {
                    int64_t at = (h * n + k) * size + o, row = page * size + o;
                    int64_t clamped = row < live ? row : live - 1;
                    rows_out[at] = clamped;
                    valid_out[at] = row < live;
                    if (pos_out) pos_out[at] = archive_position(c, b, g, clamped);
                }
            }
        int64_t count = 0;
        for (int64_t page = 0; page < Pc; page++)
            if (chosen[page]) {
                int64_t in = live - page * size;
                count += in < 0 ? 0 : (in > size ? size : in);
            }
        c->counts[bg] = count;
    } else {  /* one page set for the group: its rows staged as unique_candidates stages them (already in order) */
        for (int64_t k = 0; k < n; k++)
            for (int64_t o = 0; o < size; o++) {
                int64_t row = pages[k] * size + o;
                cand[k * size + o] = row < live ? row : c->archived;
            }
        c->counts[bg] = stage_union(cand, K, c->archived, rows_out, valid_out);
        if (pos_out)
            for (int64_t k = 0; k < K; k++) pos_out[k] = archive_position(c, b, g, rows_out[k]);
    }
}

/* Quest's choice for one decode step (kvzoo.kernels.choose.quest_choose_reference is the specification). q [B, G, hq,
   D] fp32 contiguous (a group's query heads); entries [B, G, P, W = 2 D + 1] in `dtype` ([max, min, max |k|] per
   page; element strides e_sb, e_sg, e_sp; rows contiguous); empty [B, G, P] (strides em_*): a page never read;
   *live: the rows indexed; positions [B, G, M] (strides p_*) or NULL: the archive list (each archived row's storage
   position). Each page's bound scaling * Q . E with Q = [max(q, 0), min(q, 0), slack ||q||_1] (-inf for an empty
   page), and the top n pages (an earlier page first among equal bounds; NaN first), in ascending page order:
   * per_head: of each query head; rows_out [B, G, hq * n * size] = head after head, page after page, its rows
     page * size + o clamped below live, valid_out = (row < live), counted once per group (the union of its heads'
     rows);
   * else: of the group by the max over its heads (a NaN bound left out); rows_out/valid_out [B, G, n * size] the
     pages' rows staged (stage_union: sorted, the rows >= live not picked).
   pos_out: the storage positions of rows_out (positions given); *count_out: the rows counted over every group, also
   added to *counter when given.
   own_keys (or NULL; Quest's rule "eval"): the step's own row, not yet indexed -- the storage keys [B, G, N, D] in
   `dtype` (strides k_*; rows contiguous), valid [B, G, N] (strides v_*), its position [B, G] (strides o_*), the
   summary's open page's running min/max open_min, open_max [B, G, D] fp32 contiguous: page *live / size is scored
   by its min/max joined with that key (own_page_entry), read from P + 1 page slots (the last one a page the key
   opens past P, else empty); n <= P + 1. */
int kvzoo_quest_choose(const float *q, const char *entries, int64_t dtype, int64_t e_sb, int64_t e_sg, int64_t e_sp,
                       const uint8_t *empty, int64_t em_sb, int64_t em_sg, int64_t em_sp, const int64_t *live,
                       const int64_t *positions, int64_t p_sb, int64_t p_sg, int64_t p_sm, int64_t M,
                       int64_t *rows_out, int64_t *pos_out, uint8_t *valid_out, int64_t *count_out,
                       int64_t *counter, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t P, int64_t n,
                       int64_t size, int64_t archived, int64_t per_head, float scaling, float slack,
                       int64_t threads, const char *own_keys, int64_t k_sb, int64_t k_sg, int64_t k_sn, int64_t N,
                       const uint8_t *own_valid, int64_t v_sb, int64_t v_sg, int64_t v_sn, const int64_t *own_pos,
                       int64_t o_sb, int64_t o_sg, const float *open_min, const float *open_max) {
    int64_t W = 2 * D + 1, Pc = P + (own_keys ? 1 : 0);
    if (hq < 1 || hq > MAX_HQ || D < 1 || W > MAX_W || n < 1 || n > Pc || size < 1 || archived < 1
        || dtype < F32 || dtype > F16 || (own_keys && (!own_valid || !own_pos || !open_min || !open_max)))
        return 1;
    QuestScan c;
    memset(&c, 0, sizeof c);
    c.own_keys = own_keys; c.own_valid = own_valid; c.own_pos = own_pos; c.open_min = open_min;
    c.open_max = open_max; c.N = N; c.k_sb = k_sb; c.k_sg = k_sg; c.k_sn = k_sn; c.v_sb = v_sb; c.v_sg = v_sg;
    c.v_sn = v_sn; c.o_sb = o_sb; c.o_sg = o_sg; c.Pc = Pc;
    c.B = B; c.G = G; c.hq = hq; c.W = W; c.Wp = (W + 31) / 32 * 32; c.P = P; c.n = n; c.size = size;
    c.live = *live; c.archived = archived; c.M = M; c.es = dtype == F32 ? 4 : 2; c.dtype = (int)dtype;
    c.e_sb = e_sb; c.e_sg = e_sg; c.e_sp = e_sp; c.em_sb = em_sb; c.em_sg = em_sg; c.em_sp = em_sp;
    c.p_sb = p_sb; c.p_sg = p_sg; c.p_sm = p_sm; c.per_head = (int)per_head; c.scaling = scaling;
    c.entries = entries; c.empty = empty; c.positions = positions;
    c.rows_out = rows_out; c.pos_out = pos_out; c.valid_out = valid_out;
    int64_t lists = per_head ? hq : 1, rows_q = B * G * hq * c.Wp;
    c.item_bytes = ((lists * n + n + lists + (per_head ? 0 : n * size)) * sizeof(int64_t)
                    + (lists * n + W) * sizeof(float) + Pc + 63) / 64 * 64;
    char *scratch = calloc(1, rows_q * sizeof(float) + B * G * (c.item_bytes + sizeof(int64_t)));
    if (!scratch) return 2;
    float *qrows = (float *)scratch;
    c.counts = (int64_t *)(qrows + rows_q);
    c.scratch = (char *)(c.counts + B * G);
    for (int64_t row = 0; row < B * G * hq; row++) {  /* kvzoo.kernels.index_scan.page_query */
        const float *x = q + row * D;
        float *out = qrows + row * c.Wp, l1 = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            out[d] = x[d] > 0.0f ? x[d] : 0.0f;
            out[D + d] = x[d] < 0.0f ? x[d] : 0.0f;
            l1 += fabsf(x[d]);
        }
        out[2 * D] = slack * l1;
    }
    c.qrows = qrows;
    run_items(quest_item, &c, B * G, threads);
    add_counts(c.counts, B * G, count_out, counter);
    free(scratch);
    return 0;
}

/* One archived row joins Quest's fixed page summary (kvzoo.kernels.choose.quest_page_add_reference is the
   specification), read where it lies: keys [B, G, N, D] in `dtype` (element strides k_*; rows contiguous), valid
   [B, G, N] (strides v_*), position [B, G] (strides p_*: the row's storage position; one outside [0, N) counts as
   padding). The open page's running min/max open_min, open_max [B, G, D] fp32 (contiguous) take the row (a padding
   row: +inf / -inf; the page opens when *count % size == 0), the page's entry [max, min, max |k|] (the magnitude 0
   for an empty page) is written in `dtype` into entries [B, G, P, 2 D + 1] at page *count / size (strides e_*), its
   flag into empty [B, G, P] (strides em_*: every bound of both infinite), then *count += 1 and *length (the pages in
   use) = ceil(*count / size). Returns 1 when that page is past P (the summary is full). */
int kvzoo_quest_page_add(const char *keys, int64_t dtype, int64_t k_sb, int64_t k_sg, int64_t k_sn,
                         const uint8_t *valid, int64_t v_sb, int64_t v_sg, int64_t v_sn, const int64_t *position,
                         int64_t p_sb, int64_t p_sg, float *open_min, float *open_max, char *entries, int64_t e_sb,
                         int64_t e_sg, int64_t e_sp, uint8_t *empty, int64_t em_sb, int64_t em_sg, int64_t em_sp,
                         int64_t *count, int64_t *length, int64_t B, int64_t G, int64_t N, int64_t D, int64_t P,
                         int64_t size) {
    int64_t done = *count, page = done / size, es = dtype == F32 ? 4 : 2;
    int opens = done % size == 0;
    if (done < 0 || page >= P || size < 1 || dtype < F32 || dtype > F16) return 1;
    for (int64_t bg = 0; bg < B * G; bg++) {
        int64_t b = bg / G, g = bg % G, pos = position[b * p_sb + g * p_sg];
        int ok = pos >= 0 && pos < N && valid[b * v_sb + g * v_sg + pos * v_sn];
        const char *key = keys + (b * k_sb + g * k_sg + (ok ? pos : 0) * k_sn) * es;
        char *entry = entries + (b * e_sb + g * e_sg + page * e_sp) * es;
        float *lo = open_min + bg * D, *hi = open_max + bg * D, magnitude = -INFINITY;
        int lo_inf = 1, hi_inf = 1;
        for (int64_t d = 0; d < D; d++) {
            float x = ok ? element(key, d, (int)dtype) : 0.0f;
            float mn = ok ? x : INFINITY, mx = ok ? x : -INFINITY;
            lo[d] = opens ? mn : nan_min(lo[d], mn);
            hi[d] = opens ? mx : nan_max(hi[d], mx);
            store_as(entry, d, (int)dtype, hi[d]);
            store_as(entry, D + d, (int)dtype, lo[d]);
            magnitude = nan_max(magnitude, nan_max(fabsf(lo[d]), fabsf(hi[d])));
            lo_inf &= isinf(lo[d]) != 0;
            hi_inf &= isinf(hi[d]) != 0;
        }
        store_as(entry, 2 * D, (int)dtype, lo_inf ? 0.0f : magnitude);
        empty[b * em_sb + g * em_sg + page * em_sp] = lo_inf && hi_inf;
    }
    *count = done + 1;
    *length = (done + size) / size;
    return 0;
}

"""

MAX_HQ = 64  # query rows per group the int8 scan takes (a group's heads x queries)
MAX_D = 1024  # the longest key (and value) the kernels take
MAX_J = 64  # rows per query row the top-j rule takes
LANES = 8  # the int8 scan's head dim must be a multiple of this
MAX_HPG = 64  # query heads per KV group decode attention takes
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # decode attention's rows (and query)
INDEX_DTYPES = (torch.int32, torch.int64)
# Bytes of rows below which a call runs on one thread. Waking torch's OpenMP threads costs ~1 us while they spin
# (libgomp's default) but ~60 us once they sleep (OMP_WAIT_POLICY=PASSIVE, which kvzoo's CLI and benchmarks set:
# an idle core of this 2-core VM is halted, and waking it is an interrupt to the host); at ~20 GB/s a second thread
# pays only past ~3 MiB then (measured on an idle machine, SmolLM2 pool read from memory: 2k tokens (3 MiB) 1.08x,
# 8k 1.38x, 32k 1.35x; with another process on the second core, never). Read once: libgomp reads the variable when
# torch loads it.
PARALLEL_BYTES = (3 << 20) if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive" else (256 << 10)


def _unobserved() -> bool:
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


COMPILE_FLAGS = ("-O3", "-fPIC", "-std=gnu11")


def _build(target: Path, compiler: str, march: str, runtime: str | None) -> None:
    if runtime is not None and not os.path.isfile(runtime):
        raise FileNotFoundError(f"no OpenMP runtime at {runtime}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kvzoo_cpu.c"
        src.write_text(SOURCE)
        out = Path(tmp) / target.name
        flags = [*COMPILE_FLAGS, _arch_flag(march)]
        if runtime is None:
            commands = [[compiler, *flags, "-shared", str(src), "-o", str(out), "-lm"]]
        else:  # compile with -fopenmp, link against the runtime already loaded (not the compiler's own -lgomp)
            obj = Path(tmp) / "kvzoo_cpu.o"
            commands = [[compiler, *flags, "-fopenmp", "-c", str(src), "-o", str(obj)],
                        [compiler, "-shared", str(obj), runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}",
                         "-o", str(out), "-lm"]]
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=180)
        os.replace(out, target)  # atomic: a concurrent builder never sees half a library


def compile_library(march: str = "native", runtime: str | None = None) -> ctypes.CDLL:
    """Build (once per source, flags, compiler and processor) and load the kernels for ``-march=march``, with OpenMP
    linked against ``runtime`` (None: without OpenMP). :func:`library` is the one the ops use; tests build the
    portable C (``march='x86-64'``) with this."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([SOURCE, *COMPILE_FLAGS, march, runtime or "", compiler, platform.machine(),
                                    _cpu_signature()]).encode())
    target = cache_dir() / "native" / f"kvzoo_cpu_{key.hexdigest()[:16]}.so"
    if not target.exists():
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC)")
        _build(target, compiler, march, runtime)
    lib = ctypes.CDLL(str(target))
    fn = lib.kvzoo_int8_estimate
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 10 + [ctypes.c_float, ctypes.c_int64]
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {  # the C functions' parameters in order (SOURCE): pointers, integers, floats
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
# traced path of a compiled step as a plain global (library() and available() touch no file once it is set).
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
            except (subprocess.CalledProcessError, OSError):  # e.g. a runtime the linker refuses: one thread then
                pass
        return compile_library("native", None)
    except Exception as err:  # a missing or failing compiler, an unwritable cache: the reference runs instead
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvzoo: the CPU kernels could not be built ({type(err).__name__}: {detail}); the int8 index "
                      "scan and decode attention run their PyTorch references (slower; set CC to a C compiler, or "
                      "KVZOO_KERNELS=torch to silence this)", RuntimeWarning, stacklevel=2)
        return None


def _threads(nbytes: int) -> int:
    """Threads for a call reading ``nbytes``: ``torch.get_num_threads()`` past :data:`PARALLEL_BYTES`, else 1."""
    return torch.get_num_threads() if nbytes >= PARALLEL_BYTES else 1


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
    torch op ``kvzoo::int8_estimate`` (called as a function when nothing observes the dispatcher: :func:`_unobserved`)."""
    lengths = None if length is None else length.to(torch.int64)
    if _unobserved() and query.is_cpu and codes.is_cpu and side.is_cpu and (lengths is None or lengths.is_cpu):
        return _int8_estimate_cpu(query, codes, side, lengths, float(scaling))  # the op's CPU function, undispatched
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
        side.shape[-1], scaling, _threads(B * G * m * (D + 2 * side.shape[-1])))
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


def counter_ok(counter: torch.Tensor | None) -> bool:
    """A fetched-rows counter the C ops add to in place: None, or an int64 CPU tensor of one element."""
    return counter is None or (counter.device.type == "cpu" and counter.dtype == torch.int64 and counter.numel() == 1
                               and counter.is_contiguous())


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int8_choose(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, threshold: torch.Tensor, j: int,
                archived: int, scaling: float, slack: float, length: torch.Tensor | None,
                counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over int8 entries for a decode step, staged and counted: ``(idx, picked) [B, G, hq * j]``
    and ``count`` (int64, 0-dim: the rows picked over every group, also added in place to ``counter``, the layer's
    fetched rows, when given) -- see ``kvzoo_int8_choose`` in ``SOURCE``; ``threshold [B, G, hq]`` is
    ``s* - j_margin``. One call for what the PyTorch path does in ~30 ops (scan, top-j, the chosen rows' bounds, the
    group's union, the count). The caller checked :func:`int8_estimate_supported`, ``1 <= j <= min(MAX_J, m)``, the
    counter (:func:`counter_ok`) and that :func:`library` is not None."""
    lengths = None if length is None else length.to(torch.int64)
    args = (query, codes, side, lengths, threshold.float(), j, archived, float(scaling), float(slack), counter)
    if _unobserved() and query.is_cpu and codes.is_cpu and side.is_cpu and args[4].is_cpu and (
            lengths is None or lengths.is_cpu):
        return _int8_choose_cpu(*args)  # the op's CPU function, undispatched
    return torch.ops.kvzoo.int8_choose(*args)


def _int8_choose_cpu(query, codes, side, length, threshold, j, archived, scaling, slack, counter=None):
    lib = library()
    B, G, hq, D = query.shape
    q = query.contiguous()
    thr = threshold.contiguous()
    lengths = None if length is None else length.contiguous()
    idx = torch.empty(B, G, hq * j, dtype=torch.int64)
    picked = torch.empty(B, G, hq * j, dtype=torch.bool)
    count = torch.empty((), dtype=torch.int64)
    status = lib.kvzoo_int8_choose(
        q.data_ptr(), codes.data_ptr(), side.data_ptr(), _pointer(lengths), thr.data_ptr(), idx.data_ptr(),
        picked.data_ptr(), count.data_ptr(), _pointer(counter), B, G, hq, D, codes.shape[2], j, archived,
        codes.stride(0), codes.stride(1), side.stride(0), side.stride(1), side.shape[-1], scaling, slack,
        _threads(B * G * codes.shape[2] * (D + 2 * side.shape[-1])))
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
    return (all(t.device.type == "cpu" for t in (query, basis, entries, floor)) and query.dtype == torch.float32
            and basis.dtype == torch.float32 and floor.dtype == torch.float32
            and entries.dtype in (torch.float32, torch.float16) and 1 <= query.shape[2] <= MAX_HQ
            and query.shape[3] <= MAX_D and 1 <= j <= min(MAX_J, entries.shape[2]) and entries.stride(-1) == 1
            and basis.stride(-1) == 1 and basis.stride(-2) == basis.shape[-1] and counter_ok(counter)
            and not (query.requires_grad or entries.requires_grad) and available())


def sketch_choose(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, length: torch.Tensor | None,
                  floor: torch.Tensor, j: int, archived: int, scaling: float, slack: float, rank_by_bound: bool,
                  counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over its sketch for a decode step, in one call: ``(idx, picked) [B, G, hq * j]`` staged
    and ``count`` (added to ``counter`` in place when given); ``kvzoo_sketch_choose`` in ``SOURCE``, whose
    specification is :func:`kvzoo.kernels.choose.sketch_choose_reference`. The caller checked
    :func:`sketch_choose_supported`. The torch op ``kvzoo::sketch_choose``."""
    lengths = None if length is None else length.to(torch.int64)
    args = (query, basis, entries, lengths, floor, j, archived, float(scaling), float(slack), bool(rank_by_bound),
            counter)
    if _unobserved() and query.is_cpu and entries.is_cpu and floor.is_cpu and (lengths is None or lengths.is_cpu):
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
    status = library().kvzoo_sketch_choose(
        q.data_ptr(), basis.data_ptr(), 0 if basis.shape[0] == 1 else basis.stride(0), basis.stride(1),
        entries.data_ptr(), SCAN_DTYPES[entries.dtype], entries.stride(0), entries.stride(1), entries.stride(2),
        _pointer(lengths), thr.data_ptr(), idx.data_ptr(), picked.data_ptr(), count.data_ptr(), _pointer(counter),
        B, G, hq, D, dc, r, m, W, j, archived, int(rank_by_bound), scaling, slack,
        _threads(B * G * m * W * entries.element_size()))
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
        if not (all(t.device.type == "cpu" for t in own) and keys.dtype == entries.dtype and keys.stride(-1) == 1
                and valid.dtype == torch.bool and position.dtype == torch.int64
                and all(t.dtype == torch.float32 and t.is_contiguous() for t in (open_min, open_max))
                and not keys.requires_grad):
            return False
    tensors = (query, entries, empty, live) + (() if positions is None else (positions,))
    return (all(t.device.type == "cpu" for t in tensors) and query.dtype == torch.float32
            and entries.dtype in SCAN_DTYPES and entries.shape[3] <= MAX_W and entries.stride(-1) == 1
            and 1 <= query.shape[2] <= MAX_HQ and empty.dtype == torch.bool and live.dtype == torch.int64
            and live.numel() == 1 and (positions is None or positions.dtype == torch.int64) and counter_ok(counter)
            and not (query.requires_grad or entries.requires_grad) and available())


def quest_choose(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                 positions: torch.Tensor | None, pages: int, size: int, archived: int, per_head: bool, scaling: float,
                 slack: float, counter: torch.Tensor | None = None, own: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Quest's choice for a decode step in one call: ``(rows, positions, valid) [B, G, K]`` and ``count`` (added to
    ``counter`` in place when given); ``positions`` None when the archive list is not given; ``own``: the step's own
    row and the open page's min/max (:func:`kvzoo.kernels.choose.quest_choose`). ``kvzoo_quest_choose`` in
    ``SOURCE``, whose specification is :func:`kvzoo.kernels.choose.quest_choose_reference`. The caller checked
    :func:`quest_choose_supported`. The torch op ``kvzoo::quest_choose``."""
    args = (query, entries, empty, live, positions, pages, size, archived, bool(per_head), float(scaling),
            float(slack), counter, *(own if own is not None else (None,) * 5))
    if _unobserved() and query.is_cpu and entries.is_cpu and empty.is_cpu and live.is_cpu:
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
    own = (own_keys, own_valid, own_position, open_min, open_max)
    if any(t is None for t in own) and any(t is not None for t in own):
        raise ValueError("kvzoo::quest_choose: own_keys, own_valid, own_position, open_min and open_max go together")
    N = own_keys.shape[2] if own_keys is not None else 0
    if own_keys is not None:
        shapes = ((own_keys, (B, G, N, D)), (own_valid, (B, G, N)), (own_position, (B, G)), (open_min, (B, G, D)),
                  (open_max, (B, G, D)))
        if any(tuple(t.shape) != shape for t, shape in shapes):
            raise ValueError(f"kvzoo::quest_choose: own_keys, own_valid, own_position, open_min and open_max must be "
                             f"[B, G, N, D], [B, G, N], [B, G], [B, G, D] (twice) for query {list(query.shape)}; got "
                             f"{[list(t.shape) for t, _ in shapes]}")
    if positions is not None and tuple(positions.shape[:2]) != (B, G):
        raise ValueError(f"kvzoo::quest_choose: positions must be [B={B}, G={G}, M], got {list(positions.shape)}")
    q = query.contiguous()
    K = _quest_rows(query, pages, size, per_head)
    rows = torch.empty(B, G, K, dtype=torch.int64)
    at = torch.empty(B, G, K, dtype=torch.int64) if positions is not None else torch.empty(0, dtype=torch.int64)
    valid = torch.empty(B, G, K, dtype=torch.bool)
    count = torch.empty((), dtype=torch.int64)
    pos_strides = (0, 0, 0, 0) if positions is None else (*positions.stride(), positions.shape[2])
    status = library().kvzoo_quest_choose(
        q.data_ptr(), entries.data_ptr(), SCAN_DTYPES[entries.dtype], *entries.stride()[:3], empty.data_ptr(),
        *empty.stride(), live.data_ptr(), _pointer(positions), *pos_strides, rows.data_ptr(),
        at.data_ptr() if positions is not None else None, valid.data_ptr(), count.data_ptr(), _pointer(counter),
        B, G, hq, D, P, pages, size, archived, int(per_head), scaling, slack,
        _threads(B * G * P * W * entries.element_size()), _pointer(own_keys),
        *(own_keys.stride()[:3] if own_keys is not None else (0, 0, 0)), N, _pointer(own_valid),
        *(own_valid.stride() if own_valid is not None else (0, 0, 0)), _pointer(own_position),
        *(own_position.stride() if own_position is not None else (0, 0)), _pointer(open_min), _pointer(open_max))
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
    return (all(t.device.type == "cpu" for t in tensors) and keys.dtype in SCAN_DTYPES and entries.dtype == keys.dtype
            and keys.stride(-1) == 1 and entries.stride(-1) == 1 and valid.dtype == torch.bool
            and empty.dtype == torch.bool and position.dtype == torch.int64
            and all(t.dtype == torch.int64 and t.numel() == 1 for t in (count, length))
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (open_min, open_max))
            and not keys.requires_grad and available())


def quest_page_add(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, open_min: torch.Tensor,
                   open_max: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, count: torch.Tensor,
                   length: torch.Tensor, size: int) -> None:
    """One archived row joins Quest's fixed page summary, read where it lies, all in place (``kvzoo_quest_page_add`` in
    ``SOURCE``; the specification is :func:`kvzoo.kernels.choose.quest_page_add_reference`). The caller checked
    :func:`quest_page_add_supported`. The torch op ``kvzoo::quest_page_add``."""
    args = (keys, valid, position, open_min, open_max, entries, empty, count, length, size)
    if _unobserved() and keys.is_cpu and entries.is_cpu:
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
    status = library().kvzoo_quest_page_add(
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
    if any(t is not None and (not isinstance(t, torch.Tensor) or t.device.type != "cpu") for t in tensors):
        return False
    if query.dim() != 3 or keys.dim() != 4 or query.dtype not in ROW_DTYPES or keys.dtype not in ROW_DTYPES:
        return False
    H, D, G = query.shape[1], keys.shape[3], keys.shape[1]
    width = source.value_width if values is None else values.shape[-1]
    return (G >= 1 and H % G == 0 and H // G <= MAX_HPG and 1 <= D <= MAX_D and isinstance(width, int)
            and 1 <= width <= MAX_D and (keys.stride(-1) == 1 or D == 1)
            and (values is None or (values.dtype == keys.dtype and (values.stride(-1) == 1 or width == 1)))
            and all(t is None or t.dtype in INDEX_DTYPES for t in (source.indices, source.length))
            and all(t is None or t.dtype == torch.bool for t in (source.valid, pool_valid, source.head_valid))
            and not (query.requires_grad or keys.requires_grad or (values is not None and values.requires_grad))
            and available())


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
    the dispatcher's ~8 us for 14 arguments) when nothing observes the dispatcher (:func:`_unobserved`)."""
    values = source.values
    width = values.shape[-1] if values is not None else source.value_width
    if width is None:
        raise ValueError("source.values is None (MLA absorbed form): set source.value_width to the value width Dv")
    pool_valid = _pool_flags(source, pool_valid)
    prior_out, prior_lse = (None, None) if prior is None else prior
    keys, indices, length, valid, head_valid = source.keys, source.indices, source.length, source.valid, source.head_valid
    args = (query, keys, values, width, indices, length, valid, pool_valid, head_valid, float(scaling), prior_out,
            prior_lse, best, mass)
    if _unobserved() and all(t is None or t.is_cpu for t in (query, keys, values, indices, length, valid, pool_valid,
                                                             head_valid, prior_out, prior_lse)):
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


def _flag(t: torch.Tensor | None, what: str) -> tuple[int, ...]:
    """A bool flag tensor's pointer and 3 strides (zeros: absent)."""
    if t is None:
        return _ABSENT
    if t.dtype != torch.bool:
        raise _bad(f"{what} must be a bool tensor, got {t.dtype}")
    return (t.data_ptr(), *t.stride())


def _decode_attend_cpu(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, scaling,
                       prior_out, prior_lse, best, mass):
    """The op's CPU function: :func:`_decode_attend_run`, with empty tensors for the outputs not asked for."""
    out, lse, top, masses = _decode_attend_run(query, keys, values, value_width, indices, length, valid, pool_valid,
                                               head_valid, scaling, prior_out, prior_lse, best, mass)
    return out, lse, torch.empty(0) if top is None else top, torch.empty(0) if masses is None else masses


def _decode_attend_run(query, keys, values, value_width, indices, length, valid, pool_valid, head_valid, scaling,
                       prior_out, prior_lse, best, mass):
    B, H, D, G, N, P, Dv = _positions(query, keys, values, value_width, indices, length, valid, pool_valid,
                                      head_valid, prior_out, prior_lse)
    dtype = ROW_DTYPES.get(keys.dtype)
    q_dtype = ROW_DTYPES.get(query.dtype)
    if dtype is None or q_dtype is None or (values is not None and values.dtype != keys.dtype):
        raise _bad(f"query, keys and values must be float32, bfloat16 or float16 (values in the keys' dtype), got "
                   f"{query.dtype}, {keys.dtype}, {None if values is None else values.dtype}")
    qst = query.stride()
    if qst[2] != 1:
        query = query.contiguous()
        qst = query.stride()
    kst = keys.stride()
    params = [query.data_ptr(), qst[0], qst[1], q_dtype, keys.data_ptr(), kst[0], kst[1], kst[2]]
    if kst[3] != 1 and D > 1:
        raise _bad("keys need a contiguous last dimension (stride 1): pass the pool itself, not a transposed view")
    if values is not None:
        vst = values.stride()
        if vst[3] != 1 and Dv > 1:
            raise _bad("values need a contiguous last dimension (stride 1)")
        params += (values.data_ptr(), vst[0], vst[1], vst[2], dtype)
    else:
        params += (0, 0, 0, 0, dtype)
    if indices is not None:
        if indices.dtype not in INDEX_DTYPES:
            raise _bad(f"indices must be int32 or int64, got {indices.dtype}")
        params += (indices.data_ptr(), *indices.stride(), indices.dtype == torch.int32)
    else:
        params += (0, 0, 0, 0, 0)
    if length is not None:
        if length.dtype not in INDEX_DTYPES:
            raise _bad(f"length must be int32 or int64, got {length.dtype}")
        params += (length.data_ptr(), length.stride(0), length.dtype == torch.int32)
    else:
        params += (0, 0, 0)
    params += _flag(valid, "valid")
    params += _flag(pool_valid, "pool_valid")
    params += _flag(head_valid, "head_valid")
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
    params += (out.data_ptr(), lse.data_ptr(), top.data_ptr() if best else 0, masses.data_ptr() if mass else 0,
               B, H, G, N, P, D, Dv, _threads(B * G * P * (D + (Dv if values is not None else 0))
                                              * keys.element_size()))
    packed = array.array("q", params)  # the A_* parameters of SOURCE, in their order
    status = library().kvzoo_decode_attend(packed.buffer_info()[0], len(packed), scaling)
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
