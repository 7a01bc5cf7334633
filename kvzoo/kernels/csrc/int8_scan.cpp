/* VestigeKV's int8 index scan: estimates (kvzoo_int8_estimate) and the fused top-j rule (kvzoo_int8_choose) */

#include "kernels.h"
#include "common.h"
#include "top.h"

/* ------------------------------------------------------------------------------------------------------------
   the int8 index scan
   ------------------------------------------------------------------------------------------------------------ */

#ifdef KV_AVX512
static inline __m512 codes16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 codes8(const int8_t *p) { /* 8 codes, the upper lanes 0 */
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
    for (int s = 0; s < 4; s++) { /* unrolled: the partial sums stay in registers */
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
                __asm__("" : "+v"(x)); /* one load in a register for the 4 rows (not one per multiply-add) */
                a[h][0] = _mm512_fmadd_ps(x, c0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(x, c1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(x, c2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(x, c3, a[h][3]);
            }
        }
        if (d < D) { /* D % 16 == 8 */
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
static inline void row_estimates(const float *KV_RESTRICT q, const int8_t *KV_RESTRICT row, int64_t rows, int64_t hq,
                                 int64_t D, const float *scale, float scaling, float *KV_RESTRICT dots) {
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
static void int8_block(const float *q, int64_t hq, int64_t D, const int8_t *codes, const uint16_t *side, int64_t side_w,
                       float scaling, int64_t count, float *est) {
    float scale[16];
#ifdef KV_AVX512
    __m512 sc;
    if (side_w == 3) { /* column 0 of 16 entries [scale, err, norm]: 48 halves, every third, in one permute */
        int64_t n = 3 * count;
        __m512i lo = _mm512_maskz_loadu_epi16(n >= 32 ? ~0u : (1u << n) - 1u, side);
        __m512i hi = _mm512_castsi256_si512(
            _mm256_maskz_loadu_epi16(n > 32 ? (__mmask16)((1u << (n - 32)) - 1u) : 0, side + 32));
        const __m512i every3 = _mm512_setr_epi32(0x00030000, 0x00090006, 0x000F000C, 0x00150012, 0x001B0018, 0x0021001E,
                                                 0x00270024, 0x002D002A, 0, 0, 0, 0, 0, 0, 0, 0);
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

typedef struct {
    const float *q;
    const int8_t *codes;
    const uint16_t *side;
    const int64_t *length;
    float *out;             /* estimate: [B, G, hq, m] */
    const float *threshold; /* choose */
    int64_t *idx;
    uint8_t *picked;
    float *top;                    /* choose, per item: [hq][j] values, rows, and the count */
    int64_t *at, *filled, *counts; /* counts: picked rows per group */
    int64_t B, G, hq, D, m, j, archived, codes_sb, codes_sg, side_sb, side_sg, side_w, chunks, chunk_rows;
    float scaling, slack;
    const uint8_t *page_live; /* choose, pruned: [B, G, p] flags (strides pl_sb, pl_sg, pl_sp), rows page_rows a page */
    int64_t pl_sb, pl_sg, pl_sp, page_rows;
    int64_t *rows_read; /* choose: rows each item scanned */
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
    const Int8Scan *c = (const Int8Scan *)ctx;
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
    if (item % c->chunks == c->chunks - 1) { /* the group's last chunk: -inf past its live rows */
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
KV_EXPORT int kvzoo_int8_estimate(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                                  float *out, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m, int64_t codes_sb,
                                  int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w, float scaling,
                                  int64_t threads) {
    if (hq > MAX_HQ || D > MAX_D || D % LANES != 0) return 1;
    Int8Scan c = {q, codes, side, length, out,      NULL,     NULL,    NULL,    NULL,   NULL, NULL, NULL,    B,   G, hq,
                  D, m,     0,    0,      codes_sb, codes_sg, side_sb, side_sg, side_w, 1,    m,    scaling, 0.0f,
                  NULL, 0,  0,    0,      0,        NULL};
    c.chunks = scan_chunks(B, G, m, threads);
    c.chunk_rows = chunk_rows_of(m, c.chunks);
    run_items(estimate_item, &c, B * G * c.chunks, threads);
    return 0;
}

static void choose_item(void *ctx, int64_t item) {
    const Int8Scan *c = (const Int8Scan *)ctx;
    int64_t b, g, r0, r1, hq = c->hq, D = c->D, j = c->j;
    item_rows(c, item, &b, &g, &r0, &r1);
    const float *qg = c->q + (b * c->G + g) * hq * D;
    const int8_t *cg = c->codes + b * c->codes_sb + g * c->codes_sg;
    const uint16_t *sg = c->side + b * c->side_sb + g * c->side_sg;
    float *top = c->top + item * hq * j;
    int64_t *at = c->at + item * hq * j, *filled = c->filled + item * hq;
    const uint8_t *live = c->page_live ? c->page_live + b * c->pl_sb + g * c->pl_sg : NULL;
    int64_t P = c->page_rows, read = 0;
    float est[MAX_HQ * 16];
    for (int64_t h = 0; h < hq; h++) filled[h] = 0;
    for (int64_t s = r0; s < r1;) {
        int64_t e = r1; /* a run of rows [s, e): with a page mask, the rows of consecutive live pages */
        if (live) {
            int64_t page = s / P;
            if (!live[page * c->pl_sp]) { /* a dead page: its codes are never read */
                s = (page + 1) * P;
                continue;
            }
            e = (page + 1) * P;
            while (e < r1 && live[(e / P) * c->pl_sp]) e += P;
            if (e > r1) e = r1;
        }
        for (int64_t i = s; i < e; i += 16) {
            int64_t count = e - i < 16 ? e - i : 16;
            if (i + 80 <= e) prefetch_rows(cg + (i + 64) * D, 16 * D, sg + (i + 64) * c->side_w, 16 * c->side_w);
            int8_block(qg, hq, D, cg + i * D, sg + i * c->side_w, c->side_w, c->scaling, count, est);
            for (int64_t h = 0; h < hq; h++) top_block(top + h * j, at + h * j, filled + h, j, est + h * 16, count, i);
        }
        read += e - s;
        s = e;
    }
    c->rows_read[item] = read;
}

/* a group's chunks merged in row order (a tie goes to the earlier chunk: the earlier row), then the certified
   bound of each of the top j rows against the threshold, and the group's union staged */
static void choose_group(void *ctx, int64_t bg) {
    const Int8Scan *c = (const Int8Scan *)ctx;
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
   top lists, merged per group in row order (the same choice).
   page_live (or NULL): pruning. Row i of group (b, g) is in page i / page_rows, and the rows of a page whose flag
   page_live[b * pl_sb + g * pl_sg + page * pl_sp] is 0 are skipped -- never read, never ranked -- so the choice is the
   rule's over the rows of the live pages. *scanned (or NULL) += the bytes of the entries read, (D + 2 side_w) a row. */
KV_EXPORT int kvzoo_int8_choose_pages(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                                      const float *threshold, int64_t *idx, uint8_t *picked, int64_t *count_out,
                                      int64_t *counter, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m,
                                      int64_t j, int64_t archived, int64_t codes_sb, int64_t codes_sg, int64_t side_sb,
                                      int64_t side_sg, int64_t side_w, float scaling, float slack, int64_t threads,
                                      const uint8_t *page_live, int64_t pl_sb, int64_t pl_sg, int64_t pl_sp,
                                      int64_t page_rows, int64_t *scanned) {
    if (hq > MAX_HQ || D > MAX_D || D % LANES != 0 || j < 1 || j > MAX_J || j > m || archived < 1) return 1;
    if (page_live && page_rows < 1) return 1;
    Int8Scan c = {q,        codes,   side,    length, NULL, threshold, idx,     picked, NULL,     NULL,
                  NULL,     NULL,    B,       G,      hq,   D,         m,       j,      archived, codes_sb,
                  codes_sg, side_sb, side_sg, side_w, 1,    m,         scaling, slack,  page_live, pl_sb,
                  pl_sg,    pl_sp,   page_rows, NULL};
    c.chunks = scan_chunks(B, G, m, threads);
    c.chunk_rows = chunk_rows_of(m, c.chunks);
    int64_t items = B * G * c.chunks;
    char *scratch = (char *)malloc(items * hq * (j * (sizeof(float) + sizeof(int64_t)) + sizeof(int64_t)) +
                                   (B * G + items) * sizeof(int64_t));
    if (!scratch) return 2;
    c.at = (int64_t *)scratch;
    c.filled = c.at + items * hq * j;
    c.counts = c.filled + items * hq;
    c.rows_read = c.counts + B * G;
    c.top = (float *)(c.rows_read + items);
    run_items(choose_item, &c, items, threads);
    run_items(choose_group, &c, B * G, B * G * hq * j >= 4096 ? threads : 1);
    add_counts(c.counts, B * G, count_out, counter);
    if (scanned) {
        int64_t rows = 0;
        for (int64_t item = 0; item < items; item++) rows += c.rows_read[item];
        *scanned += rows * (D + 2 * side_w);
    }
    free(scratch);
    return 0;
}

/* kvzoo_int8_choose_pages without pruning (every live row scanned) */
KV_EXPORT int kvzoo_int8_choose(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                                const float *threshold, int64_t *idx, uint8_t *picked, int64_t *count_out,
                                int64_t *counter, int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m, int64_t j,
                                int64_t archived, int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg,
                                int64_t side_w, float scaling, float slack, int64_t threads) {
    return kvzoo_int8_choose_pages(q, codes, side, length, threshold, idx, picked, count_out, counter, B, G, hq, D, m,
                                   j, archived, codes_sb, codes_sg, side_sb, side_sg, side_w, scaling, slack, threads,
                                   NULL, 0, 0, 0, 0, NULL);
}

/* ------------------------------------------------------------------------------------------------------------
   pruning's page flags: the int8 page summaries' certified bound against the floor (kvzoo.kernels.index_scan's
   int8_page_live_reference is the specification)
   ------------------------------------------------------------------------------------------------------------ */

typedef struct {
    const float *q;
    const int8_t *codes;
    const float *scale;
    const uint8_t *empty;
    const int64_t *length;
    const float *threshold;
    uint8_t *live; /* [B, G, P] */
    int64_t G, hq, D, P, codes_sb, codes_sg, scale_sb, scale_sg, scale_sp, empty_sb, empty_sg, empty_sp;
    float scaling, slack;
} PageScan;

static void page_live_group(void *ctx, int64_t bg) {
    const PageScan *c = (const PageScan *)ctx;
    static const uint16_t ones[16] = {0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00,
                                      0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00, 0x3C00}; /* fp16 1.0 */
    int64_t b = bg / c->G, g = bg % c->G, hq = c->hq, D = c->D, W = 2 * D, P = c->P;
    const float *qg = c->q + bg * hq * D, *thr = c->threshold + bg * hq;
    const int8_t *cg = c->codes + b * c->codes_sb + g * c->codes_sg;
    const float *sg = c->scale + b * c->scale_sb + g * c->scale_sg;
    const uint8_t *eg = c->empty + b * c->empty_sb + g * c->empty_sg;
    uint8_t *out = c->live + bg * P;
    float *rows = (float *)malloc(hq * W * sizeof(float)); /* [max(q, 0), min(q, 0)]: the dot with [hi, lo] codes */
    float slack[MAX_HQ], dots[MAX_HQ * 16];
    if (!rows) { /* no room: every page live (nothing skipped is always certified) */
        for (int64_t p = 0; p < P; p++) out[p] = 1;
        return;
    }
    for (int64_t h = 0; h < hq; h++) {
        float l1 = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            float x = qg[h * D + d];
            rows[h * W + d] = x > 0.0f ? x : 0.0f;
            rows[h * W + D + d] = x < 0.0f ? x : 0.0f;
            l1 += fabsf(x);
        }
        slack[h] = c->slack * l1;
    }
    int64_t pages = live_rows(c->length, b, P);
    for (int64_t i = 0; i < pages; i += 16) {
        int64_t count = pages - i < 16 ? pages - i : 16;
        int8_block(rows, hq, W, cg + i * W, ones, 1, 1.0f, count, dots); /* the raw dots: scale 1, scaling 1 */
        for (int64_t r = 0; r < count; r++) {
            int64_t p = i + r;
            float s = sg[p * c->scale_sp];
            uint8_t alive = 0;
            if (!eg[p * c->empty_sp]) {
                if (!isfinite(s)) alive = 1; /* an infinite key: the bound is +inf */
                for (int64_t h = 0; h < hq && !alive; h++) {
                    float bound = ((dots[h * 16 + r] + slack[h]) * s) * c->scaling;
                    alive = !(bound <= thr[h]); /* a NaN bound or threshold: live */
                }
            }
            out[p] = alive;
        }
    }
    for (int64_t p = pages; p < P; p++) out[p] = 0;
    free(rows);
}

/* live[b, g, p] (0/1): page p of group (b, g) holds rows (not empty[.], p < length[b]) and its bound
       ((dot([max(q_h, 0), min(q_h, 0)], codes[p]) + slack * ||q_h||_1) * scale[p]) * scaling
   is not <= threshold[b, g, h] for some query row h -- Quest's bound on the int8 page summary (codes [B, G, P, 2 D]:
   each page's [hi, lo] codes, rows contiguous; scale [B, G, P] fp32, +inf: every row bounded by +inf); slack covers
   the dot's fp32 rounding in any summation order. q [B, G, hq, D] and threshold [B, G, hq] fp32 contiguous. */
KV_EXPORT int kvzoo_int8_page_live(const float *q, const int8_t *codes, const float *scale, const uint8_t *empty,
                                   const int64_t *length, const float *threshold, uint8_t *live, int64_t B, int64_t G,
                                   int64_t hq, int64_t D, int64_t P, int64_t codes_sb, int64_t codes_sg,
                                   int64_t scale_sb, int64_t scale_sg, int64_t scale_sp, int64_t empty_sb,
                                   int64_t empty_sg, int64_t empty_sp, float scaling, float slack, int64_t threads) {
    if (hq > MAX_HQ || 2 * D > MAX_D || D % LANES != 0) return 1;
    PageScan c = {q,       codes,    scale,    empty,    length,   threshold, live,     G,       hq,
                  D,       P,        codes_sb, codes_sg, scale_sb, scale_sg,  scale_sp, empty_sb, empty_sg,
                  empty_sp, scaling, slack};
    run_items(page_live_group, &c, B * G, threads);
    return 0;
}
