/* VestigeKV's top-j rule over the certified sketch (kvzoo_sketch_choose) */

#include "kernels.h"
#include "common.h"
#include "top.h"
#include "entries.h"

/* --- VestigeKV's top-j rule over the certified sketch ------------------------------------------------------- */

typedef struct {
    const float *qrank,
        *qbound; /* [B * G][hq][Wp]: the ranking query rows (the estimate's, or the bound's), the bound's */
    const char *entries;
    const int64_t *length;
    const float *floor;
    float *top;
    int64_t *at, *filled, *cand, *idx, *counts;
    uint8_t *picked;
    int64_t B, G, hq, W, Wp, m, j, archived, e_sb, e_sg, e_sm, es, chunks, chunk_rows;
    int dtype;
    float scaling;
    const uint8_t *valid; /* [B, G, m] row flags (strides v_sb, v_sg, v_sm), or NULL: every row is one */
    int64_t v_sb, v_sg, v_sm;
} SketchScan;

static void sketch_item(void *ctx, int64_t item) {
    const SketchScan *c = (const SketchScan *)ctx;
    int64_t bg = item / c->chunks, chunk = item % c->chunks, b = bg / c->G, g = bg % c->G, hq = c->hq, j = c->j;
    int64_t live = live_rows(c->length, b, c->m), r0 = chunk * c->chunk_rows;
    int64_t r1 = r0 + c->chunk_rows < live ? r0 + c->chunk_rows : live, step = c->e_sm * c->es;
    const char *eg = c->entries + (b * c->e_sb + g * c->e_sg) * c->es;
    const float *q = c->qrank + bg * hq * c->Wp;
    float *top = c->top + item * hq * j;
    int64_t *at = c->at + item * hq * j, *filled = c->filled + item * hq;
    float sc[MAX_HQ * TILE];
    const char *rows[16];
    const uint8_t *ok = c->valid ? c->valid + b * c->v_sb + g * c->v_sg : NULL;
    for (int64_t h = 0; h < hq; h++) filled[h] = 0;
    for (int64_t s = r0; s < r1;) {
        int64_t e = r1; /* a run of rows [s, e): with row flags, consecutive valid rows (padding is never read) */
        if (ok) {
            if (!ok[s * c->v_sm]) {
                s++;
                continue;
            }
            e = s + 1;
            while (e < r1 && ok[e * c->v_sm]) e++;
        }
        for (int64_t i = s; i < e; i += 16) {
            int64_t count = e - i < 16 ? e - i : 16;
            for (int64_t k = 0; k < count; k++) rows[k] = eg + (i + k) * step;
            if (i + 80 <= e)
                for (int64_t k = 64; k < 80; k++) prefetch_row(eg + (i + k) * step, c->W * c->es);
            index_scores(q, c->Wp, rows, count, c->W, c->dtype, hq, c->scaling, sc);
            for (int64_t h = 0; h < hq; h++) {
                float *v = sc + h * TILE;
                for (int64_t k = 0; k < count; k++) v[k] = ranked(v[k]);
                top_block(top + h * j, at + h * j, filled + h, j, v, count, i);
            }
        }
        s = e;
    }
}

static void sketch_group(void *ctx, int64_t bg) {
    const SketchScan *c = (const SketchScan *)ctx;
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
            if (p < n) { /* the chosen row's bound, every column of its entry */
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
static void sketch_query_rows(const float *KV_RESTRICT q, const float *KV_RESTRICT V, int64_t hq, int64_t D, int64_t dc,
                              int64_t r, float slack, int rank_by_bound, int64_t Wp, float *KV_RESTRICT rank,
                              float *KV_RESTRICT bound, float *KV_RESTRICT qz, float *KV_RESTRICT qzT,
                              float *KV_RESTRICT resid, float *KV_RESTRICT nc) {
    int64_t dr = D - dc;
    /* qz[h][k] = sum over d (in order) of q_c[h][d] V[d][k] */
    for (int64_t h = 0; h < hq; h++) {
        const float *qc = q + h * D;
        float *z = qz + h * r;
#ifdef KV_AVX512
        int64_t k0 = 0;
        for (; k0 + 64 <= r; k0 += 64) { /* 64 columns in registers over the whole sum */
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
        for (int64_t h0 = 0; h0 < hq; h0 += 16) { /* 16 heads a register, 4 latent dimensions in flight */
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
   rows picked, also added to *counter when given. valid (or NULL): row i of group (b, g) is left out -- never
   read, never ranked -- where valid[b * v_sb + g * v_sg + i * v_sm] is 0 (a padding row). */
KV_EXPORT int kvzoo_sketch_choose(const float *q, const float *basis, int64_t basis_sb, int64_t basis_sg,
                                  const char *entries, int64_t dtype, int64_t e_sb, int64_t e_sg, int64_t e_sm,
                                  const int64_t *length, const float *floor, int64_t *idx, uint8_t *picked,
                                  int64_t *count_out, int64_t *counter, int64_t B, int64_t G, int64_t hq, int64_t D,
                                  int64_t dc, int64_t r, int64_t m, int64_t W, int64_t j, int64_t archived,
                                  int64_t rank_by_bound, float scaling, float slack, int64_t threads,
                                  const uint8_t *valid, int64_t v_sb, int64_t v_sg, int64_t v_sm) {
    int64_t dr = D - dc;
    if (hq < 1 || hq > MAX_HQ || D > MAX_D || dc < 1 || dr < 0 || r < 1 || r > dc || j < 1 || j > MAX_J || j > m ||
        archived < 1 || W != r + 1 + (dr ? dr + 2 : 1) || (dtype != F32 && dtype != F16))
        return 1;
    SketchScan c;
    memset(&c, 0, sizeof c);
    c.B = B;
    c.G = G;
    c.hq = hq;
    c.W = W;
    c.Wp = (W + 31) / 32 * 32;
    c.m = m;
    c.j = j;
    c.archived = archived;
    c.e_sb = e_sb;
    c.e_sg = e_sg;
    c.e_sm = e_sm;
    c.es = dtype == F32 ? 4 : 2;
    c.dtype = (int)dtype;
    c.entries = entries;
    c.length = length;
    c.floor = floor;
    c.idx = idx;
    c.picked = picked;
    c.scaling = scaling;
    c.valid = valid;
    c.v_sb = v_sb;
    c.v_sg = v_sg;
    c.v_sm = v_sm;
    c.chunks = scan_chunks(B, G, m, threads);
    c.chunk_rows = chunk_rows_of(m, c.chunks);
    int64_t items = B * G * c.chunks, rows_q = B * G * hq * c.Wp;
    char *scratch = (char *)calloc(1, 2 * rows_q * sizeof(float) + items * hq * j * (sizeof(float) + sizeof(int64_t)) +
                                          items * hq * sizeof(int64_t) + B * G * (hq * j + 1) * sizeof(int64_t));
    if (!scratch) return 2;
    float *qrank = (float *)scratch, *qbound = qrank + rows_q;
    c.top = qbound + rows_q;
    c.at = (int64_t *)(c.top + items * hq * j);
    c.filled = c.at + items * hq * j;
    c.cand = c.filled + items * hq;
    c.counts = c.cand + B * G * hq * j;
    float *qz = (float *)malloc((2 * r * hq + 2 * hq) * sizeof(float)); /* [hq][r], [r][hq], then per head 2 sums */
    if (!qz) {
        free(scratch);
        return 2;
    }
    float *qzT = qz + r * hq, *resid = qzT + r * hq, *nc = resid + hq;
    for (int64_t bg = 0; bg < B * G; bg++) /* the query rows (kvzoo.kernels.index_scan.sketch_query) */
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
