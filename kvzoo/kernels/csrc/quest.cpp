/* Quest's pages: the fused page choice (kvzoo_quest_choose) and the one-row page add (kvzoo_quest_page_add) */

#include "kernels.h"
#include "common.h"
#include "top.h"
#include "entries.h"

/* --- Quest's pages ------------------------------------------------------------------------------------------- */

/* torch.minimum / torch.maximum: NaN if either is */
static inline float nan_min(float a, float b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }
static inline float nan_max(float a, float b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }

static inline void store_as(char *p, int64_t i, int dtype, float x) {
    if (dtype == F32)
        ((float *)p)[i] = x;
    else
        ((uint16_t *)p)[i] = dtype == BF16 ? float_to_bf16(x) : float_to_half(x);
}

typedef struct {
    const float *qrows; /* [B * G][hq][Wp]: [max(q, 0), min(q, 0), slack ||q||_1] */
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
    const int64_t *shift; /* [B, G] (strides s_sb, s_sg) or NULL: virtual rows before each archive (pages from each
                             sequence's first real row: page p holds rows p * size - shift on) */
    int64_t s_sb, s_sg;
} QuestScan;

static inline int64_t shift_of(const QuestScan *c, int64_t b, int64_t g) {
    return c->shift ? c->shift[b * c->s_sb + g * c->s_sg] : 0;
}

/* The current page's entry [max, min, max |k|] in the entries' dtype with the step's own key in it (the key alone when
   it opens the page, *live % size == 0; a padding row, or a position outside [0, N), joins nothing): written into
   `entry`; returns whether the page is empty (every bound of both infinite). The summary is left as it is. */
static int own_page_entry(const QuestScan *c, int64_t b, int64_t g, char *entry) {
    int64_t D = (c->W - 1) / 2, bg = b * c->G + g, pos = c->own_pos[b * c->o_sb + g * c->o_sg];
    int ok = pos >= 0 && pos < c->N && c->own_valid[b * c->v_sb + g * c->v_sg + pos * c->v_sn];
    int opens = (c->live + shift_of(c, b, g)) % c->size == 0, lo_inf = 1, hi_inf = 1;
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
    const QuestScan *c = (const QuestScan *)ctx;
    int64_t b = bg / c->G, g = bg % c->G, hq = c->hq, n = c->n, P = c->P, Pc = c->Pc, size = c->size;
    int64_t live = c->live, lists = c->per_head ? hq : 1, s = shift_of(c, b, g);
    char *mine = c->scratch + bg * c->item_bytes; /* pages [lists][n], sort room [n], filled [lists], candidates
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
    int64_t own_page = c->own_keys ? (live + s) / size : -1;
    int own_empty = c->own_keys ? own_page_entry(c, b, g, own_entry) : 1;
    for (int64_t l = 0; l < lists; l++) filled[l] = 0;
    memset(chosen, 0, Pc);
    for (int64_t i = 0; i < Pc; i += 16) { /* every page's bound (each head's, or the group's) into the top lists */
        int64_t count = Pc - i < 16 ? Pc - i : 16, nz = 0;
        for (int64_t k = 0; k < count; k++) {
            int64_t page = i + k;
            if (page == own_page) {
                if (!own_empty) {
                    rows[nz] = own_entry;
                    slot[nz++] = k;
                }
            } else if (page < P && !emg[page * c->em_sp]) { /* an empty page is never read: its bound is -inf */
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
                } else { /* the max over the heads, a NaN bound left out (index_scan_reduce's margin) */
                    float best = -INFINITY;
                    for (int64_t h = 0; h < hq; h++) {
                        float v = sc[h * TILE + z];
                        best = v > best ? v : best;
                    }
                    vals[slot[z]] = best;
                }
            }
        }
        for (int64_t l = 0; l < lists; l++)
            top_block(vh + l * n, pages + l * n, filled + l, n, vals + l * 16, count, i);
    }
    for (int64_t l = 0; l < lists; l++) { /* each list's pages in ascending order */
        for (int64_t k = 0; k < n; k++) /* a page of bound -inf (empty) is no page: Pc, last, its rows never valid */
            if (vh[l * n + k] == -INFINITY) pages[l * n + k] = Pc;
        sort_rows(pages + l * n, n, room);
    }
    int64_t K = lists * n * size;
    int64_t *rows_out = c->rows_out + bg * K, *pos_out = c->positions ? c->pos_out + bg * K : NULL;
    uint8_t *valid_out = c->valid_out + bg * K;
    if (c->per_head) { /* each head's pages in its own segment; the group's union counted once */
        for (int64_t h = 0; h < hq; h++)
            for (int64_t k = 0; k < n; k++) {
                int64_t page = pages[h * n + k];
                if (page < Pc) chosen[page] = 1;
                for (int64_t o = 0; o < size; o++) {
                    int64_t at = (h * n + k) * size + o, row = page * size + o - s;
                    int64_t clamped = row < 0 ? 0 : (row < live ? row : live - 1);
                    rows_out[at] = clamped;
                    valid_out[at] = page < Pc && row >= 0 && row < live;
                    if (pos_out) pos_out[at] = archive_position(c, b, g, clamped);
                }
            }
        int64_t count = 0;
        for (int64_t page = 0; page < Pc; page++)
            if (chosen[page]) { /* its rows [page * size - s, + size) inside [0, live) */
                int64_t first = page * size - s, last = first + size;
                first = first < 0 ? 0 : first;
                last = last < live ? last : live;
                count += last > first ? last - first : 0;
            }
        c->counts[bg] = count;
    } else { /* one page set for the group: its rows staged as unique_candidates stages them (already in order) */
        for (int64_t k = 0; k < n; k++)
            for (int64_t o = 0; o < size; o++) {
                int64_t row = pages[k] * size + o - s;
                cand[k * size + o] = pages[k] < Pc && row >= 0 && row < live ? row : c->archived;
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
   page), and the top n pages (an earlier page first among equal bounds; NaN first), in ascending page order, a top
   page of bound -inf (empty: nothing to read) taken as page Pc (past every slot, so last; its rows never valid):
   * per_head: of each query head; rows_out [B, G, hq * n * size] = head after head, page after page, its rows
     page * size + o clamped below live, valid_out = (page < Pc and row < live), counted once per group (the union
     of its heads' rows);
   * else: of the group by the max over its heads (a NaN bound left out); rows_out/valid_out [B, G, n * size] the
     pages' rows staged (stage_union: sorted, the rows >= live not picked).
   pos_out: the storage positions of rows_out (positions given); *count_out: the rows counted over every group, also
   added to *counter when given.
   own_keys (or NULL; Quest's rule "eval"): the step's own row, not yet indexed -- the storage keys [B, G, N, D] in
   `dtype` (strides k_*; rows contiguous), valid [B, G, N] (strides v_*), its position [B, G] (strides o_*), the
   summary's open page's running min/max open_min, open_max [B, G, D] fp32 contiguous: page *live / size is scored
   by its min/max joined with that key (own_page_entry), read from P + 1 page slots (the last one a page the key
   opens past P, else empty); n <= P + 1.
   shift (or NULL): [B, G] virtual rows before each archive (strides s_sb, s_sg; 0 <= shift < size): page p of group
   (b, g) holds rows p * size - shift on (the negative ones none), the own row's page is (*live + shift) / size. */
KV_EXPORT int kvzoo_quest_choose(const float *q, const char *entries, int64_t dtype, int64_t e_sb, int64_t e_sg,
                                 int64_t e_sp, const uint8_t *empty, int64_t em_sb, int64_t em_sg, int64_t em_sp,
                                 const int64_t *live, const int64_t *positions, int64_t p_sb, int64_t p_sg,
                                 int64_t p_sm, int64_t M, int64_t *rows_out, int64_t *pos_out, uint8_t *valid_out,
                                 int64_t *count_out, int64_t *counter, int64_t B, int64_t G, int64_t hq, int64_t D,
                                 int64_t P, int64_t n, int64_t size, int64_t archived, int64_t per_head, float scaling,
                                 float slack, int64_t threads, const char *own_keys, int64_t k_sb, int64_t k_sg,
                                 int64_t k_sn, int64_t N, const uint8_t *own_valid, int64_t v_sb, int64_t v_sg,
                                 int64_t v_sn, const int64_t *own_pos, int64_t o_sb, int64_t o_sg,
                                 const float *open_min, const float *open_max, const int64_t *shift, int64_t s_sb,
                                 int64_t s_sg) {
    int64_t W = 2 * D + 1, Pc = P + (own_keys ? 1 : 0);
    if (hq < 1 || hq > MAX_HQ || D < 1 || W > MAX_W || n < 1 || n > Pc || size < 1 || archived < 1 || dtype < F32 ||
        dtype > F16 || (own_keys && (!own_valid || !own_pos || !open_min || !open_max)))
        return 1;
    QuestScan c;
    memset(&c, 0, sizeof c);
    c.own_keys = own_keys;
    c.own_valid = own_valid;
    c.own_pos = own_pos;
    c.open_min = open_min;
    c.open_max = open_max;
    c.shift = shift;
    c.s_sb = s_sb;
    c.s_sg = s_sg;
    c.N = N;
    c.k_sb = k_sb;
    c.k_sg = k_sg;
    c.k_sn = k_sn;
    c.v_sb = v_sb;
    c.v_sg = v_sg;
    c.v_sn = v_sn;
    c.o_sb = o_sb;
    c.o_sg = o_sg;
    c.Pc = Pc;
    c.B = B;
    c.G = G;
    c.hq = hq;
    c.W = W;
    c.Wp = (W + 31) / 32 * 32;
    c.P = P;
    c.n = n;
    c.size = size;
    c.live = *live;
    c.archived = archived;
    c.M = M;
    c.es = dtype == F32 ? 4 : 2;
    c.dtype = (int)dtype;
    c.e_sb = e_sb;
    c.e_sg = e_sg;
    c.e_sp = e_sp;
    c.em_sb = em_sb;
    c.em_sg = em_sg;
    c.em_sp = em_sp;
    c.p_sb = p_sb;
    c.p_sg = p_sg;
    c.p_sm = p_sm;
    c.per_head = (int)per_head;
    c.scaling = scaling;
    c.entries = entries;
    c.empty = empty;
    c.positions = positions;
    c.rows_out = rows_out;
    c.pos_out = pos_out;
    c.valid_out = valid_out;
    int64_t lists = per_head ? hq : 1, rows_q = B * G * hq * c.Wp;
    c.item_bytes = ((lists * n + n + lists + (per_head ? 0 : n * size)) * sizeof(int64_t) +
                    (lists * n + W) * sizeof(float) + Pc + 63) /
                   64 * 64;
    char *scratch = (char *)calloc(1, rows_q * sizeof(float) + B * G * (c.item_bytes + sizeof(int64_t)));
    if (!scratch) return 2;
    float *qrows = (float *)scratch;
    c.counts = (int64_t *)(qrows + rows_q);
    c.scratch = (char *)(c.counts + B * G);
    for (int64_t row = 0; row < B * G * hq; row++) { /* kvzoo.kernels.index_scan.page_query */
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
KV_EXPORT int kvzoo_quest_page_add(const char *keys, int64_t dtype, int64_t k_sb, int64_t k_sg, int64_t k_sn,
                                   const uint8_t *valid, int64_t v_sb, int64_t v_sg, int64_t v_sn,
                                   const int64_t *position, int64_t p_sb, int64_t p_sg, float *open_min,
                                   float *open_max, char *entries, int64_t e_sb, int64_t e_sg, int64_t e_sp,
                                   uint8_t *empty, int64_t em_sb, int64_t em_sg, int64_t em_sp, int64_t *count,
                                   int64_t *length, int64_t B, int64_t G, int64_t N, int64_t D, int64_t P,
                                   int64_t size) {
    if (size < 1 || *count < 0 || *count / size >= P || dtype < F32 || dtype > F16) return 1; /* before a division */
    int64_t done = *count, page = done / size, es = dtype == F32 ? 4 : 2;
    int opens = done % size == 0;
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
