/* y = x W^T (+ bias) for the few rows of a decode step, against weights packed once at load.
 *
 *   x       [M, K] float32, rows lda apart
 *   packed  [ceil(N / NR), K, NR]: panel p holds W's rows p*NR .. p*NR+NR-1 transposed, so one
 *           k gives the panel's NR outputs' weights as two contiguous vectors (zeros past N)
 *   y       [M, N], rows ldy apart
 *
 * Each thread takes whole panels; a panel (K x NR floats) is read from memory once and used
 * for all M rows, MR rows at a time, with MR x 2 vector accumulators in registers. Every output
 * is one sequential sum over k, so a row's result does not depend on the other rows.
 */
#include <stdint.h>
#include <string.h>

#include "vector.h"

/* MR x 2 accumulators, two weight vectors and a broadcast fit the vector registers: 32 with
 * AVX-512, 16 with AVX2. */
#ifdef __AVX512F__
#define MR 12       /* rows per register tile */
#else
#define MR 6
#endif
#define NR (2 * W)  /* outputs per panel */

int64_t small_gemm_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * K * NR; }

void small_gemm_pack(const float *w, float *packed, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++)
        for (int64_t j = 0; j < NR; j++) {
            const int64_t n = p * NR + j;
            float *dst = packed + p * K * NR + j;
            for (int64_t k = 0; k < K; k++) dst[k * NR] = n < N ? w[n * K + k] : 0.f;
        }
}

/* rows r0 .. r0+R-1 of one panel; R <= MR, a constant in each instance */
#define TILE(R)                                                                              \
    static inline void tile_##R(const float *restrict x, int64_t lda, const float *restrict panel, \
                                int64_t K, vf out[][2], const char *next, int64_t every) {   \
        vf a[R][2];                                                                           \
        for (int i = 0; i < R; i++) a[i][0] = a[i][1] = (vf){0};                              \
        int64_t due = next ? 0 : K; /* the next k whose row of the next panel to prefetch */ \
        for (int64_t k = 0; k < K; k++) {                                                     \
            if (k == due) {                                                                   \
                due += every;                                                                 \
                for (int off = 0; off < NR * 4; off += 64)                                    \
                    __builtin_prefetch(next + k * NR * 4 + off, 0, 2);                        \
            }                                                                                 \
            const vf b0 = *(const vf *)(panel + k * NR), b1 = *(const vf *)(panel + k * NR + W); \
            for (int i = 0; i < R; i++) {                                                     \
                const float xi = x[i * lda + k];                                              \
                a[i][0] += xi * b0;                                                           \
                a[i][1] += xi * b1;                                                           \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < R; i++) { out[i][0] = a[i][0]; out[i][1] = a[i][1]; }            \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#if MR > 6
TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, vf[][2], const char *, int64_t);
static const tile_fn TILES[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6,
#if MR > 6
                                      tile_7, tile_8, tile_9, tile_10, tile_11, tile_12
#endif
};

void small_gemm(const float *x, int64_t lda, const float *packed, const float *bias, float *y,
                int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR, num_tiles = (M + MR - 1) / MR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const float *panel = packed + p * K * NR;
        const int64_t n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
        vf b[2] = {{0}, {0}};
        if (bias) memcpy(b, bias + n0, width * sizeof(float));
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            const int64_t rows = M - r0 < MR ? M - r0 : MR;
            vf acc[MR][2];
            /* Each pass over the panel also pulls a share of the next panel into L2 while this
             * one computes: pass t of T its rows t, t + T, t + 2T... (a prefetch never faults,
             * past the end neither), so the next panel's reads are spread over all the passes
             * rather than asked of the first alone, faster than memory gives them. */
            const char *next = p + 1 < num_panels ? (const char *)(panel + K * NR) + r0 / MR * NR * 4 : 0;
            TILES[rows](x + r0 * lda, lda, panel, K, acc, next, num_tiles);
            for (int64_t i = 0; i < rows; i++) {
                vf v[2] = {acc[i][0] + b[0], acc[i][1] + b[1]};
                float *dst = y + (r0 + i) * ldy + n0;
                if (width == NR) {
                    *(vfu *)dst = v[0];
                    *(vfu *)(dst + W) = v[1];
                } else {
                    memcpy(dst, v, width * sizeof(float));
                }
            }
        }
    }
}
