/* kvzoo's CPU kernels: what every op family shares -- instruction-set switches, limits, work items over threads,
   number formats */

#ifndef KVZOO_COMMON_H
#define KVZOO_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__cplusplus) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
/* GCC 12's AVX-512 headers, compiled as C++, warn of their own _mm512_undefined_* values once inlined (GCC bug
   105593, fixed in GCC 13) */
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/* AVX-512 (F, BW, VL: masked 16-bit loads) where the compiler targets it; AVX2 for the int8 scan; else portable C */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_AVX512 1
#endif
#if defined(KV_AVX512) && defined(__AVX512BF16__)
#define KV_BF16DOT 1
#endif

#ifdef __cplusplus
#define KV_RESTRICT __restrict__
#else
#define KV_RESTRICT restrict
#endif

#define LANES  8
#define MAX_HQ 64
#define MAX_D  1024
#define MAX_J  64

/* the entry points ops.cpp calls (kernels.h): C names */
#ifdef __cplusplus
#define KV_EXPORT extern "C" __attribute__((visibility("default")))
#else
#define KV_EXPORT __attribute__((visibility("default")))
#endif

/* ------------------------------------------------------------------------------------------------------------
   shared: work items over threads, number formats
   ------------------------------------------------------------------------------------------------------------ */

typedef void (*item_fn)(void *ctx, int64_t item);

/* fn(ctx, 0 .. items - 1), on up to `threads` threads of the process's OpenMP runtime (the one torch uses: its
   pool is reused, nothing is oversubscribed), each taking the next item as it finishes one. */
static inline void run_items(item_fn fn, void *ctx, int64_t items, int64_t threads) {
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
        } else { /* subnormal: normalise */
            int shift = 0;
            while (!(mantissa & 0x400u)) {
                mantissa <<= 1;
                shift++;
            }
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
    if (absx > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  /* nan */
    if (absx >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to inf (65520 and up) */
    if (absx < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
        float a;
        memcpy(&a, &absx, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f)); /* units of 2^-24, nearest even */
    }
    uint32_t h = (((absx >> 23) - 112) << 10) | ((absx & 0x7FFFFFu) >> 13), rest = absx & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is right */
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
#endif

/* a scan's rows: the live ones of sequence b, in runs over threads */

static inline float lane_sum(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Rows live in sequence b: length[b] clamped to [0, m] (every row without a length). */
static inline int64_t live_rows(const int64_t *length, int64_t b, int64_t m) {
    int64_t live = length ? length[b] : m;
    return live > m ? m : (live < 0 ? 0 : live);
}

/* runs of rows per group: one on one thread, else a few items per thread of at least 256 rows each (the caller
   asks for threads only where the index is large enough to pay for waking them) */
static inline int64_t scan_chunks(int64_t B, int64_t G, int64_t m, int64_t threads) {
    if (threads <= 1) return 1;
    int64_t chunks = (4 * threads + B * G - 1) / (B * G), most = (m + 255) / 256;
    if (chunks > most) chunks = most;
    return chunks < 1 ? 1 : chunks;
}

static inline int64_t chunk_rows_of(int64_t m, int64_t chunks) {
    int64_t rows = (m + chunks - 1) / chunks;
    return (rows + 15) / 16 * 16;
}

#endif /* KVZOO_COMMON_H */
