/* kvzoo's CPU kernels as torch ops (torch.ops.kvzoo.*): each op's schema; its inputs checked once, here (device,
   dtype, strides, shapes, sizes: a ValueError saying what was wrong and what is valid); then one call of the C kernel
   (kernels.h) with the tensors' data pointers. The Meta functions run the same checks and give torch.compile and
   FakeTensor the outputs' shapes. Only this file includes torch's headers (the kernels compile in a moment).
   KVZOO_NS: the namespace (kvzoo; another for a second build loaded beside it, as the tests' portable builds). */

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cctype>
#include <cstdlib>
#include <string>
#include <tuple>

#include "kernels.h"

#ifndef KVZOO_NS
#define KVZOO_NS kvzoo
#endif
#define KV_LIBRARY(ns, m) TORCH_LIBRARY(ns, m) /* expands KVZOO_NS before TORCH_LIBRARY pastes it */
#define KV_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

using at::Tensor;
using Maybe = std::optional<Tensor>;

namespace {

constexpr int64_t MAX_HQ = 64, MAX_D = 1024, MAX_J = 64, LANES = 8, MAX_HPG = 64, MAX_W = 2 * MAX_D + 1;

/* Bytes of rows below which a call runs on one thread. Waking torch's OpenMP threads costs ~1 us while they spin
   (libgomp's default) but ~60 us once they sleep (OMP_WAIT_POLICY=PASSIVE, which kvzoo's CLI and benchmarks set: an
   idle core of a 2-core VM is halted, and waking it is an interrupt to the host); at ~20 GB/s a second thread pays
   only past ~3 MiB then (measured on an idle machine, SmolLM2 pool read from memory: 2k tokens (3 MiB) 1.08x, 8k
   1.38x, 32k 1.35x; with another process on the second core, never). Read when the library loads, as libgomp reads
   the variable when torch loads it; the op parallel_bytes sets it (tests force threads at small sizes). */
int64_t initial_parallel_bytes() {
    const char *policy = std::getenv("OMP_WAIT_POLICY");
    std::string p;
    for (const char *c = policy ? policy : ""; *c; c++)
        if (!std::isspace((unsigned char)*c)) p += (char)std::tolower((unsigned char)*c);
    return p == "passive" ? (int64_t)3 << 20 : (int64_t)256 << 10;
}

int64_t parallel_bytes = initial_parallel_bytes();

int64_t threads_for(int64_t bytes) { return bytes >= parallel_bytes ? at::get_num_threads() : 1; }

int dtype_code(const Tensor &t) { /* the C code's F32, BF16, F16; -1 for another dtype */
    switch (t.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: return -1;
    }
}

#define KV_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "kvzoo::", op, ": ", __VA_ARGS__)

void on_cpu(const char *op, std::initializer_list<const Tensor *> tensors) {
    for (const Tensor *t : tensors)
        if (t && t->defined())
            KV_CHECK(t->device().is_cpu(), "every tensor must be on the CPU, got one on ", t->device());
}

void on_cpu(const char *op, std::initializer_list<const Maybe *> tensors) {
    for (const Maybe *t : tensors)
        if (t->has_value()) on_cpu(op, {&**t});
}

void shape_is(const char *op, const char *name, const Tensor &t, at::IntArrayRef want) {
    KV_CHECK(t.sizes().equals(want), name, " must have shape ", want, ", got ", t.sizes());
}

void dtype_is(const char *op, const char *name, const Tensor &t, at::ScalarType want) {
    KV_CHECK(t.scalar_type() == want, name, " must be ", want, ", got ", t.scalar_type());
}

void rows_contiguous(const char *op, const char *name, const Tensor &t) { /* the last dim's stride 1 (or one column) */
    KV_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name, " needs a contiguous last dimension (stride 1), got strides ",
             t.strides());
}

/* a counter the ops add to in place (the fetched rows, the bytes scanned): an int64 tensor of one element, contiguous */
int64_t *counter_of(const char *op, const Maybe &counter, bool meta, const char *name = "counter") {
    if (!counter) return nullptr;
    if (!meta) on_cpu(op, {&*counter});
    KV_CHECK(counter->scalar_type() == at::kLong && counter->numel() == 1 && counter->is_contiguous(), name,
             " must be a contiguous int64 tensor of one element, got ", counter->scalar_type(), " of shape ",
             counter->sizes());
    return meta ? nullptr : counter->data_ptr<int64_t>();
}

/* length [B] as contiguous int64 (None stays None) */
Maybe lengths_of(const char *op, const Maybe &length, int64_t B) {
    if (!length) return std::nullopt;
    KV_CHECK(length->scalar_type() == at::kLong || length->scalar_type() == at::kInt,
             "length must be int32 or int64, got ", length->scalar_type());
    shape_is(op, "length", *length, {B});
    return length->to(at::kLong).contiguous();
}

template <typename T>
T *ptr(const Maybe &t) { return t ? (T *)t->data_ptr() : nullptr; }

void ran(const char *op, int status) { /* the checks above come first: a refusal here is a kernel's own limit */
    TORCH_CHECK(status == 0, "kvzoo::", op, ": the kernel refused its inputs (status ", status, ")");
}

Tensor make(at::IntArrayRef shape, at::ScalarType dtype, const Tensor &like) {
    return at::empty(shape, at::TensorOptions().dtype(dtype).device(like.device()));
}

/* ------------------------------------------------------------------------------------------------------------
   VestigeKV's int8 index: the scan (int8_estimate) and the whole top-j rule (int8_choose), csrc/int8_scan.cpp
   ------------------------------------------------------------------------------------------------------------ */

struct Int8 { /* the checked inputs of an int8 op */
    int64_t B, G, hq, D, m, w;
    Tensor q;
    Maybe length;
};

Int8 int8_check(const char *op, const Tensor &query, const Tensor &codes, const Tensor &side, const Maybe &length,
                bool meta) {
    if (!meta) on_cpu(op, {&query, &codes, &side, length ? &*length : nullptr});
    KV_CHECK(query.dim() == 4 && codes.dim() == 4 && side.dim() == 4, "query must be [B, G, hq, D], codes [B, G, m, D] "
             "and side [B, G, m, w], got ", query.sizes(), ", ", codes.sizes(), " and ", side.sizes());
    int64_t B = query.size(0), G = query.size(1), hq = query.size(2), D = query.size(3), m = codes.size(2),
            w = side.size(3);
    shape_is(op, "codes", codes, {B, G, m, D});
    KV_CHECK(side.size(0) == B && side.size(1) == G && side.size(2) == m && w >= 1, "side must be [B=", B, ", G=", G,
             ", m=", m, ", w >= 1], got ", side.sizes());
    dtype_is(op, "query", query, at::kFloat);
    dtype_is(op, "codes", codes, at::kChar);
    dtype_is(op, "side", side, at::kHalf);
    KV_CHECK(hq <= MAX_HQ && D <= MAX_D && D % LANES == 0, "query rows per group hq <= ", MAX_HQ, " and D <= ", MAX_D,
             " a multiple of ", LANES, ", got hq=", hq, ", D=", D);
    KV_CHECK(codes.stride(3) == 1 && (m <= 1 || codes.stride(2) == D) && side.stride(3) == 1 &&
                 (m <= 1 || side.stride(2) == w),
             "codes and side need each group's rows contiguous, got strides ", codes.strides(), " and ",
             side.strides());
    return {B, G, hq, D, m, w, query.contiguous(), lengths_of(op, length, B)};
}

template <bool meta>
Tensor int8_estimate(const Tensor &query, const Tensor &codes, const Tensor &side, const Maybe &length,
                     double scaling) {
    Int8 c = int8_check("int8_estimate", query, codes, side, length, meta);
    Tensor out = make({c.B, c.G, c.hq, c.m}, at::kFloat, query);
    if (meta) return out;
    ran("int8_estimate",
        kvzoo_int8_estimate(c.q.data_ptr<float>(), codes.data_ptr<int8_t>(), (const uint16_t *)side.data_ptr(),
                            ptr<int64_t>(c.length), out.data_ptr<float>(), c.B, c.G, c.hq, c.D, c.m, codes.stride(0),
                            codes.stride(1), side.stride(0), side.stride(1), c.w, (float)scaling,
                            threads_for(c.B * c.G * c.m * (c.D + 2 * c.w))));
    return out;
}

using Staged = std::tuple<Tensor, Tensor, Tensor>; /* (idx, picked) [B, G, K] and the count */

Staged staged(int64_t B, int64_t G, int64_t K, const Tensor &like) {
    return {make({B, G, K}, at::kLong, like), make({B, G, K}, at::kBool, like), make({}, at::kLong, like)};
}

/* the top-j sizes both VestigeKV rules take, and threshold/floor [B, G, hq] as contiguous fp32 */
Tensor top_j_check(const char *op, const char *floor_name, const Tensor &floor, int64_t B, int64_t G, int64_t hq,
                   int64_t m, int64_t j, int64_t archived, bool meta) {
    if (!meta) on_cpu(op, {&floor});
    KV_CHECK(1 <= j && j <= MAX_J && j <= m && archived >= 1, "1 <= j <= min(", MAX_J, ", m=", m,
             ") and archived >= 1, got j=", j, ", archived=", archived);
    KV_CHECK(at::isFloatingType(floor.scalar_type()), floor_name, " must be a float tensor, got ", floor.scalar_type());
    shape_is(op, floor_name, floor, {B, G, hq});
    return floor.to(at::kFloat).contiguous();
}

/* pruning's page flags: bool [B, G, p], a page for every row (p >= ceil(m / page_rows)); page_rows only with them */
void page_live_check(const char *op, const Maybe &page_live, int64_t page_rows, int64_t B, int64_t G, int64_t m,
                     bool meta) {
    if (!page_live) {
        KV_CHECK(page_rows == 0, "page_rows=", page_rows, " without page_live: pass both (pruning) or neither");
        return;
    }
    if (!meta) on_cpu(op, {&*page_live});
    KV_CHECK(page_rows >= 1, "page_rows must be >= 1 (archived rows a page flag covers), got ", page_rows);
    dtype_is(op, "page_live", *page_live, at::kBool);
    KV_CHECK(page_live->dim() == 3 && page_live->size(0) == B && page_live->size(1) == G &&
                 page_live->size(2) >= (m + page_rows - 1) / page_rows,
             "page_live must be [B=", B, ", G=", G, ", p >= ceil(m / page_rows) = ", (m + page_rows - 1) / page_rows,
             "] (a flag for every page of m=", m, " rows), got ", page_live->sizes());
}

template <bool meta>
Staged int8_choose(const Tensor &query, const Tensor &codes, const Tensor &side, const Maybe &length,
                   const Tensor &threshold, int64_t j, int64_t archived, double scaling, double slack,
                   const Maybe &counter, const Maybe &page_live, int64_t page_rows, const Maybe &scanned) {
    const char *op = "int8_choose";
    Int8 c = int8_check(op, query, codes, side, length, meta);
    Tensor thr = top_j_check(op, "threshold", threshold, c.B, c.G, c.hq, c.m, j, archived, meta);
    int64_t *count_to = counter_of(op, counter, meta);
    page_live_check(op, page_live, page_rows, c.B, c.G, c.m, meta);
    int64_t *scanned_to = counter_of(op, scanned, meta, "scanned");
    Staged out = staged(c.B, c.G, c.hq * j, query);
    if (meta) return out;
    auto &[idx, picked, count] = out;
    const uint8_t *live = page_live ? (const uint8_t *)page_live->data_ptr() : nullptr;
    int64_t pl_sb = page_live ? page_live->stride(0) : 0, pl_sg = page_live ? page_live->stride(1) : 0,
            pl_sp = page_live ? page_live->stride(2) : 0;
    ran(op, kvzoo_int8_choose_pages(c.q.data_ptr<float>(), codes.data_ptr<int8_t>(), (const uint16_t *)side.data_ptr(),
                                    ptr<int64_t>(c.length), thr.data_ptr<float>(), idx.data_ptr<int64_t>(),
                                    (uint8_t *)picked.data_ptr(), count.data_ptr<int64_t>(), count_to, c.B, c.G, c.hq,
                                    c.D, c.m, j, archived, codes.stride(0), codes.stride(1), side.stride(0),
                                    side.stride(1), c.w, (float)scaling, (float)slack,
                                    threads_for(c.B * c.G * c.m * (c.D + 2 * c.w)), live, pl_sb, pl_sg, pl_sp,
                                    page_rows, scanned_to));
    return out;
}

/* pruning's page flags over the int8 page summaries (csrc/int8_scan.cpp): bool [B, G, P] */
template <bool meta>
Tensor int8_page_live(const Tensor &query, const Tensor &codes, const Tensor &scale, const Tensor &empty_pages,
                      const Maybe &length, const Tensor &threshold, double scaling, double slack) {
    const char *op = "int8_page_live";
    if (!meta) on_cpu(op, {&query, &codes, &scale, &empty_pages, &threshold, length ? &*length : nullptr});
    KV_CHECK(query.dim() == 4 && codes.dim() == 4, "query must be [B, G, hq, D] and codes [B, G, P, 2 D], got ",
             query.sizes(), " and ", codes.sizes());
    int64_t B = query.size(0), G = query.size(1), hq = query.size(2), D = query.size(3), P = codes.size(2);
    shape_is(op, "codes", codes, {B, G, P, 2 * D});
    shape_is(op, "scale", scale, {B, G, P});
    shape_is(op, "empty", empty_pages, {B, G, P});
    shape_is(op, "threshold", threshold, {B, G, hq});
    dtype_is(op, "query", query, at::kFloat);
    dtype_is(op, "codes", codes, at::kChar);
    dtype_is(op, "scale", scale, at::kFloat);
    dtype_is(op, "empty", empty_pages, at::kBool);
    KV_CHECK(at::isFloatingType(threshold.scalar_type()), "threshold must be a float tensor, got ",
             threshold.scalar_type());
    KV_CHECK(hq <= MAX_HQ && 2 * D <= MAX_D && D % LANES == 0, "query rows per group hq <= ", MAX_HQ,
             " and 2 D <= ", MAX_D, " with D a multiple of ", LANES, ", got hq=", hq, ", D=", D);
    KV_CHECK(codes.stride(3) == 1 && (P <= 1 || codes.stride(2) == 2 * D), "codes need each group's pages "
             "contiguous, got strides ", codes.strides());
    Maybe lengths = lengths_of(op, length, B);
    Tensor out = make({B, G, P}, at::kBool, query);
    if (meta) return out;
    Tensor q = query.contiguous(), thr = threshold.to(at::kFloat).contiguous();
    ran(op, kvzoo_int8_page_live(q.data_ptr<float>(), codes.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                 (const uint8_t *)empty_pages.data_ptr(), ptr<int64_t>(lengths), thr.data_ptr<float>(),
                                 (uint8_t *)out.data_ptr(), B, G, hq, D, P, codes.stride(0), codes.stride(1),
                                 scale.stride(0), scale.stride(1), scale.stride(2), empty_pages.stride(0),
                                 empty_pages.stride(1), empty_pages.stride(2), (float)scaling, (float)slack,
                                 threads_for(B * G * P * 2 * D)));
    return out;
}

/* ------------------------------------------------------------------------------------------------------------
   VestigeKV's top-j rule over its sketch, csrc/sketch_choose.cpp
   ------------------------------------------------------------------------------------------------------------ */

/* The rule the float ops (sketch_choose, quest_choose, quest_page_add, decode_attend) hold every input to, once per
   call, before any read: each tensor on the CPU (the Meta kernel, which a call mixing meta and CPU tensors also
   reaches: each on meta), its dtype and its shape checked against the others'; the rows read in place (index
   entries, keys, values) need a contiguous last dimension, any other strides -- the GPU kernels' stride contract --
   and the small tensors (queries, floors, bases, lengths, flags) are taken with any strides (copied where the loop
   wants them dense); tensors written in place need what the kernel writes through. Value ranges a loop indexes by
   (Quest's live count, positions, page count) are checked on the CPU kernel, where reading them costs nothing. */
const Tensor *opt(const Maybe &t) { return t ? &*t : nullptr; }

void on_device(const char *op, bool meta, std::initializer_list<const Tensor *> tensors) {
    for (const Tensor *t : tensors)
        if (t && t->defined())
            KV_CHECK(meta ? t->is_meta() : t->device().is_cpu(), "every tensor must be on the CPU, got one on ",
                     t->device(), meta ? " and one on meta" : "");
}

/* position [B, G] int64 (any strides): every value a row of [0, N) */
void in_rows(const char *op, const char *name, const Tensor &position, int64_t N) {
    const int64_t *p = position.data_ptr<int64_t>();
    for (int64_t b = 0; b < position.size(0); b++)
        for (int64_t g = 0; g < position.size(1); g++) {
            int64_t at = p[b * position.stride(0) + g * position.stride(1)];
            KV_CHECK(0 <= at && at < N, name, " must be in [0, N=", N, ") (a row of the storage), got ", at, " at [",
                     b, ", ", g, "]");
        }
}

template <bool meta>
Staged sketch_choose(const Tensor &query, const Tensor &basis, const Tensor &entries, const Maybe &length,
                     const Tensor &floor, int64_t j, int64_t archived, double scaling, double slack, bool rank_by_bound,
                     const Maybe &counter, const Maybe &valid) {
    const char *op = "sketch_choose";
    on_device(op, meta, {&query, &basis, &entries, &floor, opt(length), opt(counter), opt(valid)});
    KV_CHECK(query.dim() == 4 && basis.dim() == 4 && entries.dim() == 4, "query must be [B, G, hq, D], basis "
             "[B, G, dc, r] and entries [B, G, m, W], got ", query.sizes(), ", ", basis.sizes(), " and ",
             entries.sizes());
    int64_t B = query.size(0), G = query.size(1), hq = query.size(2), D = query.size(3);
    int64_t dc = basis.size(2), r = basis.size(3), m = entries.size(2), W = entries.size(3), dr = D - dc;
    KV_CHECK((basis.size(0) == B || basis.size(0) == 1) && basis.size(1) == G, "basis must be [B=", B, " (or 1), G=",
             G, ", dc, r], got ", basis.sizes());
    KV_CHECK(entries.size(0) == B && entries.size(1) == G, "entries must be [B=", B, ", G=", G, ", m, W], got ",
             entries.sizes());
    dtype_is(op, "query", query, at::kFloat);
    dtype_is(op, "basis", basis, at::kFloat);
    int dtype = dtype_code(entries);
    KV_CHECK(dtype == 0 || dtype == 2, "entries must be float32 or float16, got ", entries.scalar_type());
    KV_CHECK(1 <= hq && hq <= MAX_HQ && D <= MAX_D, "query rows per group 1 <= hq <= ", MAX_HQ, " and D <= ", MAX_D,
             ", got hq=", hq, ", D=", D);
    KV_CHECK(1 <= r && r <= dc && dr >= 0 && W == r + 1 + (dr ? dr + 2 : 1), "r <= dc <= D and W = r + 1 + dr + 2 "
             "with dr = D - dc (r + 2 when dr = 0), got D=", D, ", dc=", dc, ", r=", r, ", W=", W);
    rows_contiguous(op, "entries", entries);
    Tensor V = basis.stride(3) == 1 && (dc <= 1 || basis.stride(2) == r) ? basis : basis.contiguous(); /* [dc, r] */
    Tensor thr = top_j_check(op, "floor", floor, B, G, hq, m, j, archived, meta);
    int64_t *count_to = counter_of(op, counter, meta);
    Maybe lengths = lengths_of(op, length, B);
    if (valid) {
        dtype_is(op, "valid", *valid, at::kBool);
        KV_CHECK(valid->dim() == 3 && valid->size(0) == B && valid->size(1) == G && valid->size(2) >= m,
                 "valid must be None or [B=", B, ", G=", G, ", >= m=", m, "] (False: a padding row), got ",
                 valid->sizes());
    }
    Staged out = staged(B, G, hq * j, query);
    if (meta) return out;
    auto &[idx, picked, count] = out;
    Tensor q = query.contiguous();
    ran(op, kvzoo_sketch_choose(q.data_ptr<float>(), V.data_ptr<float>(), V.size(0) == 1 ? 0 : V.stride(0),
                                V.stride(1), (const char *)entries.data_ptr(), dtype, entries.stride(0),
                                entries.stride(1), entries.stride(2), ptr<int64_t>(lengths), thr.data_ptr<float>(),
                                idx.data_ptr<int64_t>(), (uint8_t *)picked.data_ptr(), count.data_ptr<int64_t>(),
                                count_to, B, G, hq, D, dc, r, m, W, j, archived, rank_by_bound, (float)scaling,
                                (float)slack, threads_for(B * G * m * W * entries.element_size()),
                                valid ? (const uint8_t *)valid->data_ptr() : nullptr, valid ? valid->stride(0) : 0,
                                valid ? valid->stride(1) : 0, valid ? valid->stride(2) : 0));
    return out;
}

/* ------------------------------------------------------------------------------------------------------------
   Quest's page choice and its one-row page add, csrc/quest.cpp
   ------------------------------------------------------------------------------------------------------------ */

using Chosen = std::tuple<Tensor, Tensor, Tensor, Tensor>; /* (rows, positions, valid) [B, G, K] and the count */

template <bool meta>
Chosen quest_choose(const Tensor &query, const Tensor &entries, const Tensor &empty_pages, const Tensor &live,
                    const Maybe &positions, int64_t pages, int64_t size, int64_t archived, bool per_head,
                    double scaling, double slack, const Maybe &counter, const Maybe &own_keys,
                    const Maybe &own_valid, const Maybe &own_position, const Maybe &open_min, const Maybe &open_max,
                    const Maybe &shift) {
    const char *op = "quest_choose";
    on_device(op, meta, {&query, &entries, &empty_pages, &live, opt(positions), opt(counter), opt(own_keys),
                         opt(own_valid), opt(own_position), opt(open_min), opt(open_max), opt(shift)});
    KV_CHECK(query.dim() == 4 && entries.dim() == 4, "query must be [B, G, hq, D] and entries [B, G, P, 2 D + 1], got ",
             query.sizes(), " and ", entries.sizes());
    int64_t B = query.size(0), G = query.size(1), hq = query.size(2), D = query.size(3), P = entries.size(2),
            W = entries.size(3);
    KV_CHECK(entries.size(0) == B && entries.size(1) == G && W == 2 * D + 1 && empty_pages.sizes().equals({B, G, P}),
             "entries must be [B=", B, ", G=", G, ", P, 2 D + 1 = ", 2 * D + 1, "] and empty [B, G, P] for query ",
             query.sizes(), ", got ", entries.sizes(), " and ", empty_pages.sizes());
    dtype_is(op, "query", query, at::kFloat);
    int dtype = dtype_code(entries);
    KV_CHECK(dtype >= 0, "entries must be float32, bfloat16 or float16, got ", entries.scalar_type());
    KV_CHECK(1 <= hq && hq <= MAX_HQ && 1 <= D && W <= MAX_W, "query rows per group 1 <= hq <= ", MAX_HQ,
             " and 3 <= 2 D + 1 <= ", MAX_W, ", got hq=", hq, ", D=", D);
    rows_contiguous(op, "entries", entries);
    dtype_is(op, "empty", empty_pages, at::kBool);
    dtype_is(op, "live", live, at::kLong);
    KV_CHECK(live.numel() == 1, "live must have one element, got shape ", live.sizes());
    int have = own_keys.has_value() + own_valid.has_value() + own_position.has_value() + open_min.has_value() +
               open_max.has_value();
    KV_CHECK(have == 0 || have == 5, "own_keys, own_valid, own_position, open_min and open_max go together");
    bool own = have == 5;
    int64_t N = own ? own_keys->size(2) : 0;
    KV_CHECK(1 <= pages && pages <= P + own && size >= 1 && archived >= 1, "1 <= pages <= P (P + 1 with the own row), "
             "size >= 1 and archived >= 1, got pages=", pages, " of P=", P, ", size=", size, ", archived=", archived);
    if (own) {
        shape_is(op, "own_keys", *own_keys, {B, G, N, D});
        shape_is(op, "own_valid", *own_valid, {B, G, N});
        shape_is(op, "own_position", *own_position, {B, G});
        shape_is(op, "open_min", *open_min, {B, G, D});
        shape_is(op, "open_max", *open_max, {B, G, D});
        KV_CHECK(own_keys->scalar_type() == entries.scalar_type(), "own_keys must be in the entries' dtype ",
                 entries.scalar_type(), ", got ", own_keys->scalar_type());
        rows_contiguous(op, "own_keys", *own_keys);
        dtype_is(op, "own_valid", *own_valid, at::kBool);
        dtype_is(op, "own_position", *own_position, at::kLong);
        dtype_is(op, "open_min", *open_min, at::kFloat);
        dtype_is(op, "open_max", *open_max, at::kFloat);
    }
    if (positions) {
        KV_CHECK(positions->dim() == 3 && positions->size(0) == B && positions->size(1) == G, "positions must be [B=",
                 B, ", G=", G, ", M], got ", positions->sizes());
        dtype_is(op, "positions", *positions, at::kLong);
    }
    if (shift) {
        shape_is(op, "shift", *shift, {B, G});
        dtype_is(op, "shift", *shift, at::kLong);
    }
    int64_t *count_to = counter_of(op, counter, meta);
    if (!meta) { /* the values the loop indexes by */
        int64_t rows = *live.data_ptr<int64_t>(), slots = P + own, most = 0;
        KV_CHECK(rows >= 1, "live (the rows indexed) must be >= 1, got ", rows);
        if (shift) /* the virtual rows before each archive: fewer than a page */
            for (int64_t b = 0; b < B; b++)
                for (int64_t g = 0; g < G; g++) {
                    int64_t s = shift->data_ptr<int64_t>()[b * shift->stride(0) + g * shift->stride(1)];
                    KV_CHECK(0 <= s && s < size, "shift must be in [0, size=", size, ") (virtual rows before an "
                             "archive), got ", s, " at [", b, ", ", g, "]");
                    most = s > most ? s : most;
                }
        KV_CHECK(!own || (rows + most) / size <= P, "(live + shift) // size (the page the own row joins) must be "
                 "<= P=", P, " (the summary's last slot or one past it), got live=", rows, ", shift up to ", most,
                 ", size=", size);
        int64_t reach = rows < slots * size ? rows : slots * size; /* the rows the pages can give */
        KV_CHECK(archived >= reach, "archived must count every row the pages can give, min(live, ", slots, " slots x ",
                 size, ") = ", reach, ", got ", archived);
        KV_CHECK(!positions || positions->size(2) >= archived, "positions (the archive list) must hold archived=",
                 archived, " entries, got ", positions->size(2));
        if (own) in_rows(op, "own_position", *own_position, N);
    }
    int64_t K = per_head ? hq * pages * size : pages * size;
    Chosen out{make({B, G, K}, at::kLong, query), make(positions ? at::IntArrayRef{B, G, K} : at::IntArrayRef{0},
               at::kLong, query), make({B, G, K}, at::kBool, query), make({}, at::kLong, query)};
    if (meta) return out;
    auto &[rows, at_, valid, count] = out;
    Tensor q = query.contiguous();
    int64_t ps[4] = {0, 0, 0, 0}, ks[3] = {0, 0, 0}, vs[3] = {0, 0, 0}, os[2] = {0, 0};
    if (positions) ps[0] = positions->stride(0), ps[1] = positions->stride(1), ps[2] = positions->stride(2),
                   ps[3] = positions->size(2);
    Maybe omin, omax; /* read only: any strides, copied dense */
    if (own) {
        for (int i = 0; i < 3; i++) ks[i] = own_keys->stride(i), vs[i] = own_valid->stride(i);
        os[0] = own_position->stride(0), os[1] = own_position->stride(1);
        omin = open_min->contiguous(), omax = open_max->contiguous();
    }
    ran(op, kvzoo_quest_choose(
                q.data_ptr<float>(), (const char *)entries.data_ptr(), dtype, entries.stride(0), entries.stride(1),
                entries.stride(2), (const uint8_t *)empty_pages.data_ptr(), empty_pages.stride(0),
                empty_pages.stride(1), empty_pages.stride(2), live.data_ptr<int64_t>(), ptr<int64_t>(positions), ps[0],
                ps[1], ps[2], ps[3], rows.data_ptr<int64_t>(), positions ? at_.data_ptr<int64_t>() : nullptr,
                (uint8_t *)valid.data_ptr(), count.data_ptr<int64_t>(), count_to, B, G, hq, D, P, pages, size,
                archived, per_head, (float)scaling, (float)slack,
                threads_for(B * G * P * W * entries.element_size()), ptr<const char>(own_keys), ks[0], ks[1], ks[2],
                N, ptr<const uint8_t>(own_valid), vs[0], vs[1], vs[2], ptr<const int64_t>(own_position), os[0], os[1],
                ptr<const float>(omin), ptr<const float>(omax), ptr<const int64_t>(shift), shift ? shift->stride(0) : 0,
                shift ? shift->stride(1) : 0));
    return out;
}

template <bool meta>
void quest_page_add(const Tensor &keys, const Tensor &valid, const Tensor &position, const Tensor &open_min,
                    const Tensor &open_max, const Tensor &entries, const Tensor &empty_pages, const Tensor &count,
                    const Tensor &length, int64_t size) {
    const char *op = "quest_page_add";
    on_device(op, meta, {&keys, &valid, &position, &open_min, &open_max, &entries, &empty_pages, &count, &length});
    KV_CHECK(keys.dim() == 4 && entries.dim() == 4, "keys must be [B, G, N, D] and entries [B, G, P, 2 D + 1], got ",
             keys.sizes(), " and ", entries.sizes());
    int64_t B = keys.size(0), G = keys.size(1), N = keys.size(2), D = keys.size(3), P = entries.size(2);
    shape_is(op, "valid", valid, {B, G, N});
    shape_is(op, "position", position, {B, G});
    shape_is(op, "open_min", open_min, {B, G, D});
    shape_is(op, "open_max", open_max, {B, G, D});
    shape_is(op, "entries", entries, {B, G, P, 2 * D + 1});
    shape_is(op, "empty", empty_pages, {B, G, P});
    int dtype = dtype_code(keys);
    KV_CHECK(dtype >= 0 && entries.scalar_type() == keys.scalar_type(), "keys must be float32, bfloat16 or float16 "
             "and entries in their dtype, got ", keys.scalar_type(), " and ", entries.scalar_type());
    rows_contiguous(op, "keys", keys);
    rows_contiguous(op, "entries", entries);
    dtype_is(op, "valid", valid, at::kBool);
    dtype_is(op, "empty", empty_pages, at::kBool);
    dtype_is(op, "position", position, at::kLong);
    dtype_is(op, "open_min", open_min, at::kFloat);
    dtype_is(op, "open_max", open_max, at::kFloat);
    KV_CHECK(open_min.is_contiguous() && open_max.is_contiguous(), "open_min and open_max must be contiguous");
    KV_CHECK(count.scalar_type() == at::kLong && length.scalar_type() == at::kLong && count.numel() == 1 &&
                 length.numel() == 1,
             "count and length must be int64 tensors of one element, got ", count.scalar_type(), " ", count.sizes(),
             " and ", length.scalar_type(), " ", length.sizes());
    KV_CHECK(size >= 1 && D >= 1, "size and D must be at least 1, got size=", size, ", D=", D);
    if (meta) return;
    int64_t done = *count.data_ptr<int64_t>(); /* the values the loop indexes by */
    KV_CHECK(0 <= done && done < P * size, "count (the rows summarised) must be in [0, P x size = ", P * size,
             "), got ", done, done >= P * size ? ": the summary is full" : "");
    in_rows(op, "position", position, N);
    int status = kvzoo_quest_page_add(
        (const char *)keys.data_ptr(), dtype, keys.stride(0), keys.stride(1), keys.stride(2),
        (const uint8_t *)valid.data_ptr(), valid.stride(0), valid.stride(1), valid.stride(2),
        position.data_ptr<int64_t>(), position.stride(0), position.stride(1), open_min.data_ptr<float>(),
        open_max.data_ptr<float>(), (char *)entries.data_ptr(), entries.stride(0), entries.stride(1),
        entries.stride(2), (uint8_t *)empty_pages.data_ptr(), empty_pages.stride(0), empty_pages.stride(1),
        empty_pages.stride(2), count.data_ptr<int64_t>(), length.data_ptr<int64_t>(), B, G, N, D, P, size);
    ran(op, status);
}

/* ------------------------------------------------------------------------------------------------------------
   decode attention over one source of rows, read where they lie, csrc/decode_attend.cpp
   ------------------------------------------------------------------------------------------------------------ */

template <bool meta>
Chosen decode_attend(const Tensor &query, const Tensor &keys, const Maybe &values, int64_t value_width,
                     const Maybe &indices, const Maybe &length, const Maybe &valid, const Maybe &pool_valid,
                     const Maybe &head_valid, double scaling, const Maybe &prior_out, const Maybe &prior_lse, bool best,
                     bool mass) {
    const char *op = "decode_attend";
    on_device(op, meta, {&query, &keys, opt(values), opt(indices), opt(length), opt(valid), opt(pool_valid),
                         opt(head_valid), opt(prior_out), opt(prior_lse)});
    KV_CHECK(query.dim() == 3 && keys.dim() == 4, "query must be [B, H, D] and keys [B, G, N, D], got ", query.sizes(),
             " and ", keys.sizes());
    int64_t B = query.size(0), H = query.size(1), D = query.size(2), G = keys.size(1), N = keys.size(2);
    KV_CHECK(keys.size(0) == B && keys.size(3) == D, "keys ", keys.sizes(), " must be [B=", B, ", G, N, D=", D,
             "] for query ", query.sizes());
    KV_CHECK(G >= 1 && H % G == 0, "H=", H, " query heads must be a multiple of G=", G, " KV groups");
    KV_CHECK(D >= 1, "keys must have D >= 1, got ", keys.sizes());
    int64_t Dv = value_width;
    if (values) {
        KV_CHECK(values->dim() == 4 && values->size(0) == B && values->size(1) == G && values->size(2) == N,
                 "values must be [B=", B, ", G=", G, ", N=", N, ", Dv], got ", values->sizes());
        Dv = values->size(3);
        KV_CHECK(Dv >= 1, "values must have Dv >= 1, got ", values->sizes());
    } else {
        KV_CHECK(1 <= Dv && Dv <= D, "value_width must be in [1, D=", D, "] when values is None, got ", Dv);
    }
    int64_t P = N;
    if (indices) {
        KV_CHECK(indices->dim() == 3 && indices->size(0) == B && indices->size(1) == G, "indices must be [B=", B,
                 ", G=", G, ", K], got ", indices->sizes());
        P = indices->size(2);
    }
    if (length) shape_is(op, "length", *length, {B});
    if (valid) shape_is(op, "valid", *valid, {B, G, P});
    if (pool_valid) shape_is(op, "pool_valid", *pool_valid, {B, G, N});
    if (head_valid) shape_is(op, "head_valid", *head_valid, {B, H, P});
    if (prior_out) shape_is(op, "prior_out", *prior_out, {B, H, Dv});
    if (prior_lse) shape_is(op, "prior_lse", *prior_lse, {B, H});
    KV_CHECK(prior_out.has_value() == prior_lse.has_value(),
             "prior_out and prior_lse come together (the prior part's output and log-sum-exp)");
    int dtype = dtype_code(keys), q_dtype = dtype_code(query);
    KV_CHECK(dtype >= 0 && q_dtype >= 0 && (!values || values->scalar_type() == keys.scalar_type()),
             "query, keys and values must be float32, bfloat16 or float16 (values in the keys' dtype), got ",
             query.scalar_type(), ", ", keys.scalar_type(), ", ",
             values ? c10::toString(values->scalar_type()) : "None");
    KV_CHECK(keys.stride(3) == 1 || D == 1,
             "keys need a contiguous last dimension (stride 1): pass the pool itself, not a transposed view");
    KV_CHECK(!values || values->stride(3) == 1 || Dv == 1, "values need a contiguous last dimension (stride 1)");
    for (auto [name, t] : {std::pair{"indices", &indices}, std::pair{"length", &length}})
        KV_CHECK(!*t || (*t)->scalar_type() == at::kInt || (*t)->scalar_type() == at::kLong, name,
                 " must be int32 or int64, got ", (*t)->scalar_type());
    for (auto [name, t] : {std::pair{"valid", &valid}, std::pair{"pool_valid", &pool_valid},
                           std::pair{"head_valid", &head_valid}})
        KV_CHECK(!*t || (*t)->scalar_type() == at::kBool, name, " must be a bool tensor, got ", (*t)->scalar_type());
    KV_CHECK(D <= MAX_D && Dv <= MAX_D, "D and Dv at most ", MAX_D, ", got D=", D, ", Dv=", Dv);
    Chosen out{make({B, H, Dv}, at::kFloat, query), make({B, H}, at::kFloat, query),
               make(best ? at::IntArrayRef{B, H} : at::IntArrayRef{0}, at::kFloat, query),
               make(mass ? at::IntArrayRef{B, H, P} : at::IntArrayRef{0}, at::kFloat, query)};
    if (meta) return out;
    auto &[o, lse, top, masses] = out;
    Tensor q = query.stride(2) == 1 ? query : query.contiguous();
    Maybe po, pl;
    if (prior_out) po = prior_out->to(at::kFloat).contiguous(), pl = prior_lse->to(at::kFloat).contiguous();
    int64_t a[A_COUNT] = {0};
    a[A_Q] = (int64_t)q.data_ptr(), a[A_Q_SB] = q.stride(0), a[A_Q_SH] = q.stride(1), a[A_Q_DTYPE] = q_dtype;
    a[A_K] = (int64_t)keys.data_ptr(), a[A_K_SB] = keys.stride(0), a[A_K_SG] = keys.stride(1),
    a[A_K_SN] = keys.stride(2);
    if (values) a[A_V] = (int64_t)values->data_ptr(), a[A_V_SB] = values->stride(0), a[A_V_SG] = values->stride(1),
                a[A_V_SN] = values->stride(2);
    a[A_DTYPE] = dtype;
    if (indices) a[A_IDX] = (int64_t)indices->data_ptr(), a[A_IDX_SB] = indices->stride(0),
                 a[A_IDX_SG] = indices->stride(1), a[A_IDX_SK] = indices->stride(2),
                 a[A_IDX_32] = indices->scalar_type() == at::kInt;
    if (length) a[A_LEN] = (int64_t)length->data_ptr(), a[A_LEN_S] = length->stride(0),
                a[A_LEN_32] = length->scalar_type() == at::kInt;
    const Maybe *flags[3] = {&valid, &pool_valid, &head_valid};
    for (int f = 0; f < 3; f++)
        if (*flags[f]) {
            const Tensor &t = **flags[f];
            a[A_VALID + 4 * f] = (int64_t)t.data_ptr();
            for (int d = 0; d < 3; d++) a[A_VALID + 4 * f + 1 + d] = t.stride(d);
        }
    if (po) a[A_PRIOR_OUT] = (int64_t)po->data_ptr(), a[A_PRIOR_LSE] = (int64_t)pl->data_ptr();
    a[A_OUT] = (int64_t)o.data_ptr(), a[A_LSE] = (int64_t)lse.data_ptr();
    a[A_BEST] = best ? (int64_t)top.data_ptr() : 0, a[A_MASS] = mass ? (int64_t)masses.data_ptr() : 0;
    a[A_B] = B, a[A_H] = H, a[A_G] = G, a[A_N] = N, a[A_P] = P, a[A_D] = D, a[A_DV] = Dv;
    a[A_THREADS] = threads_for(B * G * P * (D + (values ? Dv : 0)) * keys.element_size());
    ran(op, kvzoo_decode_attend(a, A_COUNT, (float)scaling));
    return out;
}

/* the build: OpenMP or not; the threshold of threads_for (returns the one before; None: leaves it) */
bool openmp() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
}

int64_t set_parallel_bytes(std::optional<int64_t> value) {
    int64_t before = parallel_bytes;
    if (value) parallel_bytes = *value;
    return before;
}

} // namespace

KV_LIBRARY(KVZOO_NS, m) {
    m.def("int8_estimate(Tensor query, Tensor codes, Tensor side, Tensor? length, float scaling) -> Tensor");
    m.def("int8_choose(Tensor query, Tensor codes, Tensor side, Tensor? length, Tensor threshold, int j, int archived, "
          "float scaling, float slack, Tensor(a!)? counter=None, Tensor? page_live=None, int page_rows=0, "
          "Tensor(b!)? scanned=None) -> (Tensor, Tensor, Tensor)");
    m.def("int8_page_live(Tensor query, Tensor codes, Tensor scale, Tensor empty, Tensor? length, Tensor threshold, "
          "float scaling, float slack) -> Tensor");
    m.def("sketch_choose(Tensor query, Tensor basis, Tensor entries, Tensor? length, Tensor floor, int j, "
          "int archived, float scaling, float slack, bool rank_by_bound, Tensor(a!)? counter=None, "
          "Tensor? valid=None) "
          "-> (Tensor, Tensor, Tensor)");
    m.def("quest_choose(Tensor query, Tensor entries, Tensor empty, Tensor live, Tensor? positions, int pages, "
          "int size, int archived, bool per_head, float scaling, float slack, Tensor(a!)? counter=None, "
          "Tensor? own_keys=None, Tensor? own_valid=None, Tensor? own_position=None, Tensor? open_min=None, "
          "Tensor? open_max=None, Tensor? shift=None) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("quest_page_add(Tensor keys, Tensor valid, Tensor position, Tensor(a!) open_min, Tensor(b!) open_max, "
          "Tensor(c!) entries, Tensor(d!) empty, Tensor(e!) count, Tensor(f!) length, int size) -> ()");
    m.def("decode_attend(Tensor query, Tensor keys, Tensor? values, int value_width, Tensor? indices, "
          "Tensor? length, Tensor? valid, Tensor? pool_valid, Tensor? head_valid, float scaling, "
          "Tensor? prior_out, Tensor? prior_lse, bool best, bool mass) "
          "-> (Tensor out, Tensor lse, Tensor best, Tensor mass)");
    m.def("openmp() -> bool", &openmp);
    m.def("parallel_bytes(int? value=None) -> int", &set_parallel_bytes);
}

KV_LIBRARY_IMPL(KVZOO_NS, CPU, m) {
    m.impl("int8_estimate", &int8_estimate<false>);
    m.impl("int8_choose", &int8_choose<false>);
    m.impl("int8_page_live", &int8_page_live<false>);
    m.impl("sketch_choose", &sketch_choose<false>);
    m.impl("quest_choose", &quest_choose<false>);
    m.impl("quest_page_add", &quest_page_add<false>);
    m.impl("decode_attend", &decode_attend<false>);
}

KV_LIBRARY_IMPL(KVZOO_NS, Meta, m) {
    m.impl("int8_estimate", &int8_estimate<true>);
    m.impl("int8_choose", &int8_choose<true>);
    m.impl("int8_page_live", &int8_page_live<true>);
    m.impl("sketch_choose", &sketch_choose<true>);
    m.impl("quest_choose", &quest_choose<true>);
    m.impl("quest_page_add", &quest_page_add<true>);
    m.impl("decode_attend", &decode_attend<true>);
}
