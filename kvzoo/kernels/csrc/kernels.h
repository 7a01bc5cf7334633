/* the C kernels' entry points (one source file per op family), which ops.cpp calls with the data pointers of the
   tensors it checked: each returns 0, or nonzero for a size it does not take (ops.cpp's checks come first) */

#ifndef KVZOO_KERNELS_H
#define KVZOO_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int kvzoo_int8_estimate(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length, float *out,
                        int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m, int64_t codes_sb, int64_t codes_sg,
                        int64_t side_sb, int64_t side_sg, int64_t side_w, float scaling, int64_t threads);

int kvzoo_int8_choose(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                      const float *threshold, int64_t *idx, uint8_t *picked, int64_t *count_out, int64_t *counter,
                      int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m, int64_t j, int64_t archived,
                      int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w,
                      float scaling, float slack, int64_t threads);

int kvzoo_int8_choose_pages(const float *q, const int8_t *codes, const uint16_t *side, const int64_t *length,
                            const float *threshold, int64_t *idx, uint8_t *picked, int64_t *count_out, int64_t *counter,
                            int64_t B, int64_t G, int64_t hq, int64_t D, int64_t m, int64_t j, int64_t archived,
                            int64_t codes_sb, int64_t codes_sg, int64_t side_sb, int64_t side_sg, int64_t side_w,
                            float scaling, float slack, int64_t threads, const uint8_t *page_live, int64_t pl_sb,
                            int64_t pl_sg, int64_t pl_sp, int64_t page_rows, int64_t *scanned);

int kvzoo_int8_page_live(const float *q, const int8_t *codes, const float *scale, const uint8_t *empty,
                         const int64_t *length, const float *threshold, uint8_t *live, int64_t B, int64_t G, int64_t hq,
                         int64_t D, int64_t P, int64_t codes_sb, int64_t codes_sg, int64_t scale_sb, int64_t scale_sg,
                         int64_t scale_sp, int64_t empty_sb, int64_t empty_sg, int64_t empty_sp, float scaling,
                         float slack, int64_t threads);

int kvzoo_sketch_choose(const float *q, const float *basis, int64_t basis_sb, int64_t basis_sg, const char *entries,
                        int64_t dtype, int64_t e_sb, int64_t e_sg, int64_t e_sm, const int64_t *length,
                        const float *floor, int64_t *idx, uint8_t *picked, int64_t *count_out, int64_t *counter,
                        int64_t B, int64_t G, int64_t hq, int64_t D, int64_t dc, int64_t r, int64_t m, int64_t W,
                        int64_t j, int64_t archived, int64_t rank_by_bound, float scaling, float slack,
                        int64_t threads, const uint8_t *valid, int64_t v_sb, int64_t v_sg, int64_t v_sm);

int kvzoo_quest_choose(const float *q, const char *entries, int64_t dtype, int64_t e_sb, int64_t e_sg, int64_t e_sp,
                       const uint8_t *empty, int64_t em_sb, int64_t em_sg, int64_t em_sp, const int64_t *live,
                       const int64_t *positions, int64_t p_sb, int64_t p_sg, int64_t p_sm, int64_t M,
                       int64_t *rows_out, int64_t *pos_out, uint8_t *valid_out, int64_t *count_out, int64_t *counter,
                       int64_t B, int64_t G, int64_t hq, int64_t D, int64_t P, int64_t n, int64_t size,
                       int64_t archived, int64_t per_head, float scaling, float slack, int64_t threads,
                       const char *own_keys, int64_t k_sb, int64_t k_sg, int64_t k_sn, int64_t N,
                       const uint8_t *own_valid, int64_t v_sb, int64_t v_sg, int64_t v_sn, const int64_t *own_pos,
                       int64_t o_sb, int64_t o_sg, const float *open_min, const float *open_max,
                       const int64_t *shift, int64_t s_sb, int64_t s_sg);

int kvzoo_quest_page_add(const char *keys, int64_t dtype, int64_t k_sb, int64_t k_sg, int64_t k_sn,
                         const uint8_t *valid, int64_t v_sb, int64_t v_sg, int64_t v_sn, const int64_t *position,
                         int64_t p_sb, int64_t p_sg, float *open_min, float *open_max, char *entries, int64_t e_sb,
                         int64_t e_sg, int64_t e_sp, uint8_t *empty, int64_t em_sb, int64_t em_sg, int64_t em_sp,
                         int64_t *count, int64_t *length, int64_t B, int64_t G, int64_t N, int64_t D, int64_t P,
                         int64_t size);

/* the parameters of kvzoo_decode_attend, in this order: an int64 array (pointers as integers, 0 for an absent
   tensor; strides in elements) */
/* clang-format off */
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
/* clang-format on */

int kvzoo_decode_attend(const int64_t *a, int64_t count, float scaling);

#ifdef __cplusplus
}
#endif

#endif /* KVZOO_KERNELS_H */
