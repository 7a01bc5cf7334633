/* decode attention over one source of rows read where they lie (kvzoo_decode_attend) */

#include "kernels.h"
#include "common.h"
#include "rows.h"

/* ------------------------------------------------------------------------------------------------------------
   decode attention over one source of rows, read where they lie (kvzoo.kernels.decode_attention's specification)
   ------------------------------------------------------------------------------------------------------------ */

#define HEAD_BLOCK 64 /* query heads a work item takes (a bit each in a position's head mask); a group of more
                         heads is read once per block of 64 */

typedef struct {
    const char *q, *k, *v; /* v: the keys in the absorbed form (a row's value is its first Dv dims) */
    const void *idx, *len;
    const uint8_t *valid, *pool, *head;
    const float *prior_out, *prior_lse;
    float *out, *lse, *best, *mass;
    int64_t q_sb, q_sh, k_sb, k_sg, k_sn, v_sb, v_sg, v_sn, i_sb, i_sg, i_sk, len_s;
    int64_t va_sb, va_sg, va_sk, pv_sb, pv_sg, pv_sn, hv_sb, hv_sh, hv_sk;
    int64_t B, H, G, N, P, D, Dv, hpg, blocks, Dp, splits, item_floats, separate;
    int q_dtype, dtype, idx32, len32;
    float scaling;
    float *scratch; /* per item (nh heads of a block): acc [nh][Dv], max [nh], sum [nh], query [nh][Dp], scores
                       [nh][TILE], bf16 query */
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

/* A unit of work, one block of at most HEAD_BLOCK query heads of a group (blocks a group, in head order): its
   sequence and group bg = b * G + g, its first head (an index into H) and its head count */
static inline void decode_unit(const Decode *c, int64_t unit, int64_t *bg, int64_t *first, int64_t *nh) {
    int64_t h0 = unit % c->blocks * HEAD_BLOCK;
    *bg = unit / c->blocks;
    *first = *bg % c->G * c->hpg + h0;
    *nh = c->hpg - h0 < HEAD_BLOCK ? c->hpg - h0 : HEAD_BLOCK;
}

/* One work item: sequence b, group g, a block of its heads (decode_unit), its split-th run of positions. Per tile:
   the readable positions (in the pool, within length, valid, pool_valid at their row, some head's head_valid), the
   scores of every head of the block from one read of each row, one online-softmax update per head, then the values.
   Leaves the item's running max, sum and unnormalised output in its scratch; with `mass`, the masked scores in mass
   (-inf: unreadable). */
static inline __attribute__((always_inline)) void decode_range(const Decode *c, int64_t item, const int dtype) {
    int64_t bg, first, hpg, split = item % c->splits; /* hpg: the block's heads */
    decode_unit(c, item / c->splits, &bg, &first, &hpg);
    int64_t b = bg / c->G, g = bg % c->G, D = c->D, Dv = c->Dv, Dp = c->Dp, P = c->P, es = dtype == F32 ? 4 : 2;
    int64_t qes = c->q_dtype == F32 ? 4 : 2;
    float *acc = c->scratch + item * c->item_floats, *mx = acc + hpg * Dv, *sum = mx + hpg, *qf = sum + hpg;
    float *sc = qf + hpg * Dp;
    uint16_t *qb = (uint16_t *)(sc + hpg * TILE);
    memset(acc, 0, hpg * Dv * sizeof(float));
    for (int64_t h = 0; h < hpg; h++) {
        mx[h] = -INFINITY;
        sum[h] = 0.0f;
        const char *qh = c->q + (b * c->q_sb + (first + h) * c->q_sh) * qes;
        for (int64_t d = 0; d < Dp; d++) { /* the query rounded to the rows' dtype, as the reference does */
            float x = d < D ? round_to(element(qh, d, c->q_dtype), dtype) : 0.0f;
            qf[h * Dp + d] = x;
            qb[h * Dp + d] = float_to_bf16(x);
        }
    }
    int64_t limit = decode_positions(c, b), per = (limit + c->splits - 1) / c->splits;
    int64_t p0 = split * per, p1 = p0 + per < limit ? p0 + per : limit;
    float *mass = c->mass ? c->mass + (b * c->H + first) * P : NULL;
    if (mass)
        for (int64_t h = 0; h < hpg; h++)
            for (int64_t p = p0; p < p1; p++) mass[h * P + p] = -INFINITY;
    const char *kbase = c->k + (b * c->k_sb + g * c->k_sg) * es, *vbase = c->v + (b * c->v_sb + g * c->v_sg) * es;
    const uint64_t every = hpg == HEAD_BLOCK ? ~0ull : (1ull << hpg) - 1ull;
    const char *krow[TILE], *vrow[TILE];
    int64_t pos[TILE];
    uint64_t heads[TILE];
    /* this group's slices of the index list and the flags, and their strides (locals: the stores below never alias) */
    const int64_t *idx64 = c->idx && !c->idx32 ? (const int64_t *)c->idx + b * c->i_sb + g * c->i_sg : NULL;
    const int32_t *idx32 = c->idx && c->idx32 ? (const int32_t *)c->idx + b * c->i_sb + g * c->i_sg : NULL;
    const uint8_t *valid = c->valid ? c->valid + b * c->va_sb + g * c->va_sg : NULL;
    const uint8_t *pool = c->pool ? c->pool + b * c->pv_sb + g * c->pv_sg : NULL;
    const uint8_t *head = c->head ? c->head + b * c->hv_sb + first * c->hv_sh : NULL;
    const int64_t i_sk = c->i_sk, va_sk = c->va_sk, pv_sn = c->pv_sn, hv_sh = c->hv_sh, hv_sk = c->hv_sk, N = c->N;
    const int64_t k_step = c->k_sn * es, v_step = c->v_sn * es;
    const int plain = !c->idx && !valid && !pool && !head;
    for (int64_t t0 = p0; t0 < p1; t0 += TILE) {
        int64_t t1 = t0 + TILE < p1 ? t0 + TILE : p1, n = 0;
        int partial = 0; /* some position readable by some heads only */
        if (plain) {     /* every position of the pool: its row */
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
        { /* the rows two tiles ahead, while this one computes (from memory, the hardware prefetcher alone leaves the
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
        tile_scores(qf, qb, Dp, krow, n, D, hpg, dtype, c->scaling, sc); /* [hpg][n], each row read once */
        for (int64_t h = 0; h < hpg; h++) {
            float *s = sc + h * TILE;
            if (partial)
                for (int64_t k = 0; k < n; k++) s[k] = (heads[k] >> h) & 1u ? s[k] : -INFINITY;
            if (mass)
                for (int64_t k = 0; k < n; k++) mass[h * P + pos[k]] = s[k];
            float top = max_of(s, n);
            if (top == -INFINITY) { /* nothing this head may read in the tile */
                memset(s, 0, n * sizeof(float));
                continue;
            }
            float m = top > mx[h] ? top : mx[h];
            if (m != mx[h]) {
                float alpha = expf(mx[h] - m); /* 0 while nothing was read */
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

static void decode_item_f32(void *ctx, int64_t item) { decode_range((const Decode *)ctx, item, F32); }
static void decode_item_bf16(void *ctx, int64_t item) { decode_range((const Decode *)ctx, item, BF16); }
static void decode_item_f16(void *ctx, int64_t item) { decode_range((const Decode *)ctx, item, F16); }

/* A group's splits and the prior merged into one softmax per head (log-sum-exp weights; a part with none readable
   weighs 0), normalised; the best score; each position's probability in the whole softmax. */
static void decode_finish(void *ctx, int64_t unit) {
    const Decode *c = (const Decode *)ctx;
    int64_t bg, first, hpg; /* hpg: the block's heads */
    decode_unit(c, unit, &bg, &first, &hpg);
    int64_t b = bg / c->G, Dv = c->Dv, P = c->P;
    for (int64_t hh = 0; hh < hpg; hh++) {
        int64_t bh = b * c->H + first + hh;
        float top = -INFINITY;
        for (int64_t s = 0; s < c->splits; s++) {
            float m = (c->scratch + (unit * c->splits + s) * c->item_floats + hpg * Dv)[hh];
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
            const float *acc = c->scratch + (unit * c->splits + s) * c->item_floats, *mx = acc + hpg * Dv;
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
            int64_t bh = b * c->H + first + hh;
            float *m = c->mass + bh * P, lse = c->lse[bh];
            int64_t read = lse == -INFINITY ? 0 : limit; /* no readable row: every probability 0 */
            exp_shifted(m, read, lse);
            memset(m + read, 0, (P - read) * sizeof(float));
        }
    }
}

/* Decode attention of one query per sequence over one source of rows, in one softmax with a prior part (see
   kvzoo.kernels.cpu_native.decode_attend). a: the A_* parameters; returns 0, or 1 for a shape it does not take. */
KV_EXPORT int kvzoo_decode_attend(const int64_t *a, int64_t count, float scaling) {
    if (count != A_COUNT) return 3;
    Decode c;
    memset(&c, 0, sizeof c);
    c.q = (const char *)a[A_Q];
    c.q_sb = a[A_Q_SB];
    c.q_sh = a[A_Q_SH];
    c.q_dtype = (int)a[A_Q_DTYPE];
    c.k = (const char *)a[A_K];
    c.k_sb = a[A_K_SB];
    c.k_sg = a[A_K_SG];
    c.k_sn = a[A_K_SN];
    c.separate = a[A_V] != 0;
    c.v = c.separate ? (const char *)a[A_V] : c.k;
    c.v_sb = c.separate ? a[A_V_SB] : c.k_sb;
    c.v_sg = c.separate ? a[A_V_SG] : c.k_sg;
    c.v_sn = c.separate ? a[A_V_SN] : c.k_sn;
    c.dtype = (int)a[A_DTYPE];
    c.idx = (const void *)a[A_IDX];
    c.i_sb = a[A_IDX_SB];
    c.i_sg = a[A_IDX_SG];
    c.i_sk = a[A_IDX_SK];
    c.idx32 = (int)a[A_IDX_32];
    c.len = (const void *)a[A_LEN];
    c.len_s = a[A_LEN_S];
    c.len32 = (int)a[A_LEN_32];
    c.valid = (const uint8_t *)a[A_VALID];
    c.va_sb = a[A_VALID_SB];
    c.va_sg = a[A_VALID_SG];
    c.va_sk = a[A_VALID_SK];
    c.pool = (const uint8_t *)a[A_POOL];
    c.pv_sb = a[A_POOL_SB];
    c.pv_sg = a[A_POOL_SG];
    c.pv_sn = a[A_POOL_SN];
    c.head = (const uint8_t *)a[A_HEAD];
    c.hv_sb = a[A_HEAD_SB];
    c.hv_sh = a[A_HEAD_SH];
    c.hv_sk = a[A_HEAD_SK];
    c.prior_out = (const float *)a[A_PRIOR_OUT];
    c.prior_lse = (const float *)a[A_PRIOR_LSE];
    c.out = (float *)a[A_OUT];
    c.lse = (float *)a[A_LSE];
    c.best = (float *)a[A_BEST];
    c.mass = (float *)a[A_MASS];
    c.B = a[A_B];
    c.H = a[A_H];
    c.G = a[A_G];
    c.N = a[A_N];
    c.P = a[A_P];
    c.D = a[A_D];
    c.Dv = a[A_DV];
    c.scaling = scaling;
    int64_t threads = a[A_THREADS];
    if (c.G < 1 || c.H % c.G || c.D < 1 || c.D > MAX_D || c.Dv < 1 || c.Dv > MAX_D ||
        (!c.separate && c.Dv > c.D) || c.dtype < F32 || c.dtype > F16 || c.q_dtype < F32 || c.q_dtype > F16)
        return 1;
    c.hpg = c.H / c.G;
    c.blocks = (c.hpg + HEAD_BLOCK - 1) / HEAD_BLOCK;
    c.Dp = (c.D + 31) / 32 * 32;
    c.splits = 1;
    if (threads > 1) { /* a few items per thread, each of two tiles or more (the caller asks for threads only where
                           the rows are many enough to pay for waking them) */
        int64_t most = (c.P + 2 * TILE - 1) / (2 * TILE);
        c.splits = (4 * threads + c.B * c.G * c.blocks - 1) / (c.B * c.G * c.blocks);
        if (c.splits > most) c.splits = most;
        if (c.splits < 1) c.splits = 1;
    }
    int64_t hpg = c.hpg < HEAD_BLOCK ? c.hpg : HEAD_BLOCK, units = c.B * c.G * c.blocks, items = units * c.splits;
    c.item_floats = (hpg * c.Dv + 2 * hpg + hpg * c.Dp + hpg * TILE + (hpg * c.Dp + 1) / 2 + 15) / 16 * 16;
    if (items > 0) {
        c.scratch = (float *)aligned_alloc(64, items * c.item_floats * sizeof(float));
        if (!c.scratch) return 2;
        run_items(c.dtype == F32    ? decode_item_f32
                  : c.dtype == BF16 ? decode_item_bf16
                                    : decode_item_f16,
                  &c, items, threads);
        run_items(decode_finish, &c, units, c.mass && c.B * c.H * c.P >= (64 << 10) ? threads : 1);
        free(c.scratch);
    }
    return 0;
}
