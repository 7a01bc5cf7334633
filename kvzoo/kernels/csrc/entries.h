/* float index entries' scores, shared by VestigeKV's sketch (sketch_choose.cpp) and Quest's pages (quest.cpp) */

#ifndef KVZOO_ENTRIES_H
#define KVZOO_ENTRIES_H

#include "rows.h"

/* ------------------------------------------------------------------------------------------------------------
   fused decode-step choices over float index entries -- VestigeKV's sketch, Quest's pages -- and Quest's one-row
   page add (kvzoo.kernels.choose holds their PyTorch references: the specification)
   ------------------------------------------------------------------------------------------------------------ */

#define MAX_W (2 * MAX_D + 1) /* the widest index entry: a Quest page [max, min, max |k|] of MLA's 576-dim rows */

/* sc[h * TILE + k] = scaling * dot(q[h], rows[k]) for n (1 - 16) rows of width W in `dtype` and hq fp32 query rows
   (row stride Wp, zero-padded to Wp, a multiple of 32). The query is not rounded: an index scan's products are fp32's,
   the entries upcast (kvzoo.kernels.index_scan's reference), whatever their dtype. */
static inline void index_scores(const float *q, int64_t Wp, const char *const *rows, int64_t n, int64_t W, int dtype,
                                int64_t hq, float scaling, float *sc) {
    for (int64_t h0 = 0; h0 < hq; h0 += 4) {
        int nh = hq - h0 < 4 ? (int)(hq - h0) : 4;
        const float *qh = q + h0 * Wp;
        float *out = sc + h0 * TILE;
#ifdef KV_AVX512
#define KV_SCORES(DT)                                                                                                  \
    switch (nh) {                                                                                                      \
        case 1: dots16(qh, Wp, rows, n, W, DT, 1, scaling, out); break;                                                \
        case 2: dots16(qh, Wp, rows, n, W, DT, 2, scaling, out); break;                                                \
        case 3: dots16(qh, Wp, rows, n, W, DT, 3, scaling, out); break;                                                \
        default: dots16(qh, Wp, rows, n, W, DT, 4, scaling, out); break;                                               \
    }
        if (dtype == F32) {
            KV_SCORES(F32)
        } else if (dtype == BF16) {
            KV_SCORES(BF16)
        } else {
            KV_SCORES(F16)
        }
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
static inline float entry_dot(const float *q, const char *row, int64_t W, int dtype) {
    if (dtype == F32) return lanes_dot(q, (const float *)row, W);
    float x[MAX_W];
    for (int64_t d = 0; d < W; d++) x[d] = element(row, d, dtype);
    return lanes_dot(q, x, W);
}

static inline float ranked(float v) { return v != v ? INFINITY : v; } /* NaN first, as torch.topk ranks it */

#endif /* KVZOO_ENTRIES_H */
