/* row math over one tile of rows read where they lie (AVX-512 or portable): decode attention's, and the float
   index scans' */

#ifndef KVZOO_ROWS_H
#define KVZOO_ROWS_H

#include "common.h"

#define TILE 32 /* positions per tile: their scores, one softmax update, then their values */

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
static inline __attribute__((always_inline)) void dots16(const float *q, int64_t Dp, const char *const *rows, int64_t n,
                                                         int64_t D, const int dtype, const int nh, float scaling,
                                                         float *out) {
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
            __m512 c0 = vload(r0, d, dtype), c1 = vload(r1, d, dtype), c2 = vload(r2, d, dtype),
                   c3 = vload(r3, d, dtype);
            __asm__("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3)); /* each row chunk loaded once, for every head */
            for (int h = 0; h < nh; h++) {
                __m512 x = _mm512_loadu_ps(q + h * Dp + d);
                __asm__("" : "+v"(x)); /* one load in a register for the 4 rows */
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
            __m512bh c0 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r0 + d),
                     c1 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r1 + d);
            __m512bh c2 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r2 + d),
                     c3 = (__m512bh)_mm512_maskz_loadu_epi16(mk, r3 + d);
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
static inline __attribute__((always_inline)) void
tile_values(float *acc, int64_t Dv, const float *p, const char *const *vrow, int64_t n, const int dtype, const int nh) {
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
        _mm512_mask_storeu_ps(a + k, mk,
                              _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + k), ww, _mm512_maskz_loadu_ps(mk, a + k)));
    }
}
#else /* portable C (the compiler vectorises the lane loops where it can) */
static inline __attribute__((always_inline)) void row_dots(const float *q, int64_t Dp, const char *row, int64_t D,
                                                           const int dtype, const int nh, float *out) {
    float x[2 * MAX_D + 64]; /* index entries too: up to MAX_W */
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

static inline __attribute__((always_inline)) void
tile_values(float *acc, int64_t Dv, const float *p, const char *const *vrow, int64_t n, const int dtype, const int nh) {
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

#endif /* KVZOO_ROWS_H */
