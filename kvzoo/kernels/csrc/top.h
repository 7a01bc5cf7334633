/* top lists, shared by every fused choice (int8_scan.cpp, sketch_choose.cpp, quest.cpp) */

#ifndef KVZOO_TOP_H
#define KVZOO_TOP_H

#include "common.h"

/* ------------------------------------------------------------------------------------------------------------
   top lists (every fused choice): each query row's best K rows of a run of rows, merged over runs in row order,
   and a group's candidates staged as the runtime stages a choice
   ------------------------------------------------------------------------------------------------------------ */

/* insert (v, row) into a query row's top list (vh, ih, *n of j): an earlier row stays first among equal values */
static inline void top_insert(float *vh, int64_t *ih, int64_t *n, int64_t j, float v, int64_t row) {
    int64_t pos = *n == j ? j - 1 : *n;
    while (pos > 0 && v > vh[pos - 1]) { /* strictly greater moves up */
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
        if (vals[rr] > vh[j - 1]) top_insert(vh, ih, n, j, vals[rr], i + rr); /* the j-th may rise */
    }
#else
    for (; r < count; r++)
        if (vals[r] > vh[j - 1]) top_insert(vh, ih, n, j, vals[r], i + r); /* NaN never enters */
#endif
}

/* query row h's top lists (top, at, filled: [item][hq][j], [item][hq][j], [item][hq]) of a group's runs -- items
   bg * chunks + chunk, in row order -- merged into its best j (an earlier run first among equal values): vals and
   rows (tmp_v, tmp_r: room for j more). Returns how many. */
static inline int64_t merge_tops(const float *top, const int64_t *at, const int64_t *filled, int64_t bg, int64_t chunks,
                                 int64_t hq, int64_t h, int64_t j, float *vals, int64_t *rows, float *tmp_v,
                                 int64_t *tmp_r) {
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
static inline void sort_rows(int64_t *a, int64_t K, int64_t *tmp) {
    int64_t k = 1;
    while (k < K && a[k - 1] <= a[k]) k++;
    if (k >= K) return;
    const int64_t run = 32;
    for (int64_t r0 = 0; r0 < K; r0 += run) {
        int64_t r1 = r0 + run < K ? r0 + run : K;
        for (int64_t i = r0 + 1; i < r1; i++) {
            int64_t v = a[i], pos = i;
            while (pos > r0 && a[pos - 1] > v) {
                a[pos] = a[pos - 1];
                pos--;
            }
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
static inline int64_t stage_union(int64_t *cand, int64_t K, int64_t archived, int64_t *idx, uint8_t *picked) {
    int64_t local[MAX_HQ * MAX_J], *tmp = K <= MAX_HQ * MAX_J ? local : (int64_t *)malloc(K * sizeof(int64_t));
    if (!tmp) { /* no memory for the merge: insertion sort in place */
        for (int64_t k = 1; k < K; k++) {
            int64_t v = cand[k], pos = k;
            while (pos > 0 && cand[pos - 1] > v) {
                cand[pos] = cand[pos - 1];
                pos--;
            }
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
static inline void add_counts(const int64_t *counts, int64_t groups, int64_t *count_out, int64_t *counter) {
    int64_t total = 0;
    for (int64_t bg = 0; bg < groups; bg++) total += counts[bg];
    *count_out = total;
    if (counter) *counter += total;
}

#endif /* KVZOO_TOP_H */
