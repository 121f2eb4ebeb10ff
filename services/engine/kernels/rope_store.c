/* RoPE for q and k and the store of k and v in the paged KV pool, in one pass over the fused
 * q/k/v projection's output (instead of a split, six elementwise passes and two scatters).
 *
 *   qkv       [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]   q | k | v per token
 *   cos, sin  [num_tokens, head_dim]
 *   q_out     [num_tokens, num_heads, head_dim]
 *   k_out     [num_tokens, num_kv_heads, head_dim]   (k as stored, for attention in torch)
 *   kv        the pool as rows of num_kv_heads * head_dim elements; token t's K goes to row
 *             slot_rows[t] + k_offset, its V to row slot_rows[t] + v_offset
 *
 * The rotate-half layout: x' = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
 * In float32 each element takes the same three rounded operations, in the same order, as the
 * torch expression above; this file is compiled without -ffast-math and without contracting
 * them into fused multiply-adds, so the results are torch's bit for bit. In bfloat16 the three
 * are computed in float and rounded once (torch rounds each to bfloat16: ours is the closer).
 */
#include <stdint.h>

#include "element.h"

static inline void rope_row(const elem *restrict x, elem *restrict y, const elem *restrict c,
                            const elem *restrict s, int64_t num_heads, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < num_heads; h++, x += D, y += D) {
        for (int64_t i = 0; i < half; i++) y[i] = st(ld(x[i]) * ld(c[i]) + (-ld(x[i + half])) * ld(s[i]));
        for (int64_t i = half; i < D; i++) y[i] = st(ld(x[i]) * ld(c[i]) + ld(x[i - half]) * ld(s[i]));
    }
}

void EXPORT(rope_store, )(const elem *qkv, const elem *cos, const elem *sin, elem *q_out,
                          elem *k_out, elem *kv, const int64_t *slot_rows, int64_t k_offset, int64_t v_offset,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int num_threads) {
    const int64_t D = head_dim, q_size = num_heads * D, kv_size = num_kv_heads * D;
    const int64_t row = q_size + 2 * kv_size;
    /* 16 rows at a time to whichever thread is free: see packed_gemm.c's note on sharing cores. */
    #pragma omp parallel for schedule(dynamic, 16) num_threads(num_threads)
    for (int64_t t = 0; t < num_tokens; t++) {
        const elem *x = qkv + t * row, *c = cos + t * D, *s = sin + t * D;
        elem *k_dst = kv + (slot_rows[t] + k_offset) * kv_size, *v_dst = kv + (slot_rows[t] + v_offset) * kv_size;
        rope_row(x, q_out + t * q_size, c, s, num_heads, D);
        rope_row(x + q_size, k_dst, c, s, num_kv_heads, D);
        for (int64_t i = 0; i < kv_size; i++) k_out[t * kv_size + i] = k_dst[i];
        for (int64_t i = 0; i < kv_size; i++) v_dst[i] = x[q_size + kv_size + i];
    }
}
