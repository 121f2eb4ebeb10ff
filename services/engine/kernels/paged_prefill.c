/* Prefill attention for the CPU: chunks of new tokens (fresh prompts and continued ones alike)
 * attend causally to their sequence's context where it lies, in the block-major paged KV pool.
 * The chunk's own K/V are already written there, so every key is read from the pool.
 *
 *   kv     [num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]  elem
 *   q, out [num_tokens, num_heads, head_dim]
 *   spans  [num_spans, 3]: first row in q, number of new tokens, position of the first
 *   tables [num_spans, max_blocks] block ids
 *   window > 0: a sliding-window layer, a query sees only the last `window` positions (itself
 *           included); a lane whose first keys all lie before its window gets exact zeros from
 *           them (their weight is wiped by the correction exp(MASKED - s) = 0 at its first key)
 *
 * Work item: one span, one kv head, a tile of LANES queries (row r, head h of the group, taken
 * row-major), one per vector lane. Everything is computed a lane per query, with Q and O kept
 * transposed ([D][LANES]) and each key or value element broadcast to all lanes:
 *
 *     S[t][lane]  = sum_d Q^T[d][lane] * K[t][d]
 *     O^T[d][lane] = O^T[d][lane] * corr[lane] + sum_t P[t][lane] * V[t][d]
 *
 * so the online softmax (running max m, sum l, correction corr per lane) is all lane-wise
 * vector work with no horizontal sums, and each key and value row is read once for the tile's
 * queries of all the group's heads. Keys past a query's position are masked (only in the
 * chunks that reach the tile's first position).
 *
 * The result for a query depends only on its sequence's context, never on the rest of the
 * batch. It matches torch's SDPA to ~1e-6 (another summation order, another exp).
 */
#include <stdint.h>
#include <stdlib.h>

#include "element.h"
#include "vector.h"

/* Vectors of queries per tile: each key or value element broadcast feeds NV FMAs. Three with
 * AVX-512 (two: SmolLM2's 32-sequence prefill ~5% slower on an AMD Zen 4, head_dim 128 too). */
#define NV (W == 16 ? 3 : 2)
#define LANES (NV * W)    /* queries per tile */
#define CHUNK 32          /* keys per softmax update (16: twice the rescaling of O, ~4% slower) */
#define MASKED -1e30f     /* a score that exp() takes to 0 (no inf: built with -ffast-math) */
/* Keys (SCORES) and value dims (VALUES) per register tile: NV x that many accumulators, the NV
 * lane vectors and a broadcast fit 32 AVX-512 registers at 8 and 16 AVX2 ones at 4 (at 8 AVX2
 * spilled: 54 against 95 GFLOP/s at 947 tokens on 2 Zen 3 cores). */
#define TILE_KEYS (W == 16 ? 8 : 4)

struct item { int64_t span, kv_head, first_lane, cost; };

static int by_cost_desc(const void *a, const void *b) {
    int64_t x = ((const struct item *)a)->cost, y = ((const struct item *)b)->cost;
    return (x < y) - (x > y);
}

/* Keeps a vector in a register. Left alone, GCC folds its loads into every FMA that uses it,
 * and the loads, not the FMAs, bound the loops (load ports: 2 or 3 a cycle, FMA: 2). */
#define IN_REGISTER(a) __asm__("" : "+x"(a))

/* S[t] += Q^T . K[t] for TB keys at once: qt [D][NV] lanes, krow[t] the keys' rows. */
#define SCORES(TB)                                                                            \
    do {                                                                                      \
        vf a[TB][NV] = {{{0}}};                                                               \
        for (int64_t d = 0; d < D; d++) {                                                     \
            vf x[NV];                                                                         \
            for (int v = 0; v < NV; v++) { x[v] = qt[d][v]; IN_REGISTER(x[v]); }              \
            for (int u = 0; u < TB; u++) {                                                    \
                const float k = ld(krow[t + u][d]);                                           \
                for (int v = 0; v < NV; v++) a[u][v] += x[v] * k;                             \
            }                                                                                 \
        }                                                                                     \
        for (int u = 0; u < TB; u++) for (int v = 0; v < NV; v++) s[t + u][v] = a[u][v];      \
    } while (0)

/* O^T[d] = O^T[d] * corr + sum_t P[t] V[t][d] for DB dims at once, in registers over the chunk.
 * The chunk's sum starts from zero and is added once, as flash attention adds each block's
 * product: one running sum over every key drifted further from a float64 reference than torch's
 * SDPA (largest logit error 2.41x transformers' on an AMD Zen 4, 0.72x with this). */
#define VALUES(DB)                                                                            \
    do {                                                                                      \
        vf a[DB][NV] = {{{0}}};                                                               \
        for (int64_t t = 0; t < nt; t++) {                                                    \
            vf pp[NV];                                                                        \
            for (int v = 0; v < NV; v++) { pp[v] = p[t][v]; IN_REGISTER(pp[v]); }             \
            const elem *vt = krow[t] + half + d;                                              \
            for (int i = 0; i < DB; i++) { const float x = ld(vt[i]); for (int v = 0; v < NV; v++) a[i][v] += pp[v] * x; } \
        }                                                                                     \
        for (int i = 0; i < DB; i++)                                                          \
            for (int v = 0; v < NV; v++) ot[d + i][v] = ot[d + i][v] * corr[v] + a[i][v];     \
    } while (0)

static inline __attribute__((always_inline)) void prefill_tile(
        const elem *restrict q, elem *restrict out, const elem *restrict kv,
        const int64_t *restrict table, int64_t first_row, int64_t num_new, int64_t start, int64_t window,
        int64_t kv_head, int64_t first_lane, int64_t layer, int64_t num_layers, int64_t B,
        int64_t num_heads, int64_t num_kv_heads, const int64_t D, float scale) {
    const int64_t G = num_heads / num_kv_heads, num_lanes_total = num_new * G;
    const int64_t tok_stride = num_kv_heads * D, half = B * tok_stride;
    const int64_t block_stride = num_layers * 2 * half, layer_offset = layer * 2 * half;
    /* Lane j of vector v is query v * W + j; qt and ot hold Q and O transposed. */
    vf qt[D][NV], ot[D][NV], s[CHUNK][NV], p[CHUNK][NV], m[NV], l[NV], posv[NV], corr[NV];
    int64_t row_of[LANES], head_of[LANES], min_pos = INT64_MAX, max_pos = 0;
    for (int64_t j = 0; j < LANES; j++) {
        /* Lanes past the span's end repeat its last query (computed, never written). */
        int64_t lane = first_lane + j < num_lanes_total ? first_lane + j : num_lanes_total - 1;
        row_of[j] = lane / G;
        head_of[j] = kv_head * G + lane % G;
        int64_t pos = start + row_of[j];
        posv[j / W][j % W] = (float)pos;
        min_pos = pos < min_pos ? pos : min_pos;
        max_pos = pos > max_pos ? pos : max_pos;
        const elem *qj = q + ((first_row + row_of[j]) * num_heads + head_of[j]) * D;
        for (int64_t d = 0; d < D; d++) qt[d][j / W][j % W] = ld(qj[d]) * scale;
    }
    for (int64_t d = 0; d < D; d++) for (int v = 0; v < NV; v++) ot[d][v] = splat(0.f);
    for (int v = 0; v < NV; v++) { m[v] = splat(MASKED); l[v] = splat(0.f); }
    const int64_t ctx = max_pos + 1;
    /* A key before lo lies outside every lane's window; one before hi outside some lane's. lo
     * starts a CHUNK that starts at a multiple of CHUNK, as without a window: a query's keys then
     * fall into the same softmax updates whatever other queries share its tile (the chunking of
     * its prompt, the rest of the batch), so its bits do not depend on them. */
    const int64_t lo = window > 0 && min_pos + 1 > window ? (min_pos + 1 - window) / CHUNK * CHUNK : 0;
    const int64_t hi = window > 0 ? max_pos + 1 - window : 0;
    for (int64_t c0 = lo; c0 < ctx; c0 += CHUNK) {
        const int64_t nt = ctx - c0 < CHUNK ? ctx - c0 : CHUNK;
        const elem *krow[CHUNK];
        for (int64_t t = 0; t < nt; t++) {
            int64_t pos = c0 + t;
            krow[t] = kv + table[pos / B] * block_stride + layer_offset + (pos % B) * tok_stride + kv_head * D;
        }
        int64_t t = 0;
        for (; t + TILE_KEYS <= nt; t += TILE_KEYS) SCORES(TILE_KEYS);
        for (; t < nt; t++) SCORES(1);
        if (c0 + nt - 1 > min_pos)  /* some key here lies past some query */
            for (t = 0; t < nt; t++)
                for (int v = 0; v < NV; v++)
                    s[t][v] = vselect(splat((float)(c0 + t)) > posv[v], splat(MASKED), s[t][v]);
        if (c0 < hi)  /* some key here lies before some query's window */
            for (t = 0; t < nt; t++)
                for (int v = 0; v < NV; v++)
                    s[t][v] = vselect(splat((float)(c0 + t + window)) <= posv[v], splat(MASKED), s[t][v]);
        for (int v = 0; v < NV; v++) {
            vf mx = m[v], sum = {0};
            for (t = 0; t < nt; t++) mx = vmax(mx, s[t][v]);
            for (t = 0; t < nt; t++) { p[t][v] = vexp(s[t][v] - mx); sum += p[t][v]; }
            corr[v] = vexp(m[v] - mx);
            l[v] = l[v] * corr[v] + sum;
            m[v] = mx;
        }
        int64_t d = 0;
        for (; d + TILE_KEYS <= D; d += TILE_KEYS) VALUES(TILE_KEYS);
        for (; d < D; d++) VALUES(1);
    }
    for (int64_t j = 0; j < LANES && first_lane + j < num_lanes_total; j++) {
        elem *dst = out + ((first_row + row_of[j]) * num_heads + head_of[j]) * D;
        const float inv = 1.f / l[j / W][j % W];
        for (int64_t d = 0; d < D; d++) dst[d] = st(ot[d][j / W][j % W] * inv);
    }
}

#define PAGED_PREFILL(name, HEAD_DIM)                                                          \
    int name(const elem *q, elem *out, const elem *kv, const int64_t *spans,                   \
             const int64_t *tables, int64_t num_spans, int64_t max_blocks, int64_t window,     \
             int64_t layer, int64_t num_layers, int64_t block_size, int64_t num_heads,         \
             int64_t num_kv_heads, int64_t head_dim, float scale, int num_threads) {           \
        const int64_t G = num_heads / num_kv_heads;                                            \
        int64_t num_items = 0;                                                                 \
        for (int64_t s = 0; s < num_spans; s++)                                                \
            num_items += num_kv_heads * ((spans[3 * s + 1] * G + LANES - 1) / LANES);          \
        struct item *items = malloc((num_items ? num_items : 1) * sizeof *items);              \
        if (!items) return -1;                                                                 \
        int64_t at = 0;                                                                        \
        for (int64_t s = 0; s < num_spans; s++) {                                              \
            const int64_t lanes = spans[3 * s + 1] * G;                                        \
            for (int64_t h = 0; h < num_kv_heads; h++)                                         \
                for (int64_t f = 0; f < lanes; f += LANES) {                                   \
                    int64_t last = (f + LANES < lanes ? f + LANES : lanes) - 1;                \
                    items[at++] = (struct item){s, h, f, spans[3 * s + 2] + last / G + 1};      \
                }                                                                              \
        }                                                                                      \
        /* Longest contexts first, so the last items to run are the short ones. */             \
        qsort(items, num_items, sizeof *items, by_cost_desc);                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")              \
        for (int64_t i = 0; i < num_items; i++) {                                              \
            const int64_t *sp = spans + 3 * items[i].span;                                     \
            prefill_tile(q, out, kv, tables + items[i].span * max_blocks, sp[0], sp[1], sp[2], window, \
                         items[i].kv_head, items[i].first_lane, layer, num_layers, block_size, \
                         num_heads, num_kv_heads, HEAD_DIM, scale);                            \
        }                                                                                      \
        free(items);                                                                           \
        return 0;                                                                              \
    }

PAGED_PREFILL(EXPORT(paged_prefill, ), head_dim)
PAGED_PREFILL(EXPORT(paged_prefill, _d64), 64)
PAGED_PREFILL(EXPORT(paged_prefill, _d128), 128)
