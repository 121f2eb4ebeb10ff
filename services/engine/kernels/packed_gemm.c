/* y = x W^T (+ bias) against weights packed once at load: the linear layers' products on the
 * CPU in fp32, for a decode step's few rows and a prefill step's thousands alike.
 *
 *   x       [M, K] float32, rows lda apart
 *   packed  [ceil(N / NR), K, NR]: panel p holds W's rows p*NR .. p*NR+NR-1 transposed, so one
 *           k gives the panel's NR outputs' weights as two contiguous vectors (zeros past N)
 *   y       [M, N], rows ldy apart
 *
 * Every output is the same sum whatever M is: k in chunks of KC terms, each chunk summed in
 * order from zero in a register and then added to the output ((c0 + c1) + c2 ...), the bias
 * last. A row's result never depends on the other rows or on how they are split among threads,
 * and the chunks keep the sums closer to exact than one long sequence (tests/integration/
 * test_smollm2.py holds them to the float64 contract).
 *
 * The rows go in blocks of MB (a block's x stays in the core's L2), each (block, panel) pair a
 * work item (two adjacent panels with AVX-512, below); within one, each KC x NR slice of the
 * panel (24 KiB) stays in cache while every MR-row tile of the block runs over it, MR x 2
 * vector accumulators in registers. A decode step's rows (up to ONE_BLOCK) are one block, so
 * the threads split the panels: each panel (K x NR floats) is read from memory once, for all
 * rows, while the next one is prefetched. Items are handed out four at a time as threads come
 * free (dynamic), not split in equal shares up front: where another process takes part of a core
 * the other thread does more of them, rather than waiting for the slow one at the end (seven
 * 286-token prompts beside a busy process 3.2 against 4.1 s, alone 2.4 against 2.7 s); a decode
 * step's one at a time.
 *
 * The gated form (packed_gemm_gated, SwiGLU) takes gate's and up's weights packed together,
 * gate's panel p then up's (packed_gemm_pack_gated): an item computes both panels' sums for one
 * panel of outputs, exactly as the plain product would, into a scratch tile, and writes only
 * silu(gate) * up.
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
#define MB (4 * MR) /* rows per block, where there are more than ONE_BLOCK */
#define ONE_BLOCK (8 * MR)
#define KC 192      /* k per chunk */

int64_t packed_gemm_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * K * NR; }

/* Panel p of w [N, K] into dst [K, NR], zeros past N. */
static void pack_panel(const float *w, float *dst, int64_t N, int64_t K, int64_t p) {
    for (int64_t j = 0; j < NR; j++) {
        const int64_t n = p * NR + j;
        for (int64_t k = 0; k < K; k++) dst[k * NR + j] = n < N ? w[n * K + k] : 0.f;
    }
}

void packed_gemm_pack(const float *w, float *packed, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) pack_panel(w, packed + p * K * NR, N, K, p);
}

/* A gated pair (SwiGLU's gate and up, each [N, K]) packed for packed_gemm_gated: 2 x
 * packed_gemm_size(N, K) floats, gate's panel p then up's panel p, for every p. */
void packed_gemm_pack_gated(const float *gate, const float *up, float *packed, int64_t N, int64_t K,
                            int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        pack_panel(gate, packed + 2 * p * K * NR, N, K, p);
        pack_panel(up, packed + (2 * p + 1) * K * NR, N, K, p);
    }
}

/* One chunk of k (len terms) for rows 0 .. R-1 of a tile, added into their sums in out, rows
 * ldo apart (first: stored). The _pf instances also prefetch the chunk's rows due, due + every...
 * of the next panel (next: the same chunk of it); the test in the loop costs ~5%, so steps of
 * many blocks, whose panels come from L3, run without it. */
#define TILE(R, NAME, PF)                                                                     \
    static void NAME(const float *restrict x, int64_t lda, const float *restrict panel, int64_t len, \
                     float *restrict out, int64_t ldo, int first, const char *next, int64_t due,   \
                     int64_t every) {                                                         \
        vf a[R][2];                                                                           \
        for (int i = 0; i < R; i++) a[i][0] = a[i][1] = (vf){0};                              \
        if (!PF || !next) due = len;                                                          \
        for (int64_t k = 0; k < len; k++) {                                                   \
            if (PF && k == due) {                                                             \
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
        for (int i = 0; i < R; i++) {                                                         \
            vfu *o = (vfu *)(out + i * ldo), *o1 = (vfu *)(out + i * ldo + W);                \
            *o = first ? a[i][0] : *o + a[i][0];                                              \
            *o1 = first ? a[i][1] : *o1 + a[i][1];                                            \
        }                                                                                     \
    }
#define TILES_FOR(R) TILE(R, tile_##R, 0) TILE(R, tile_##R##_pf, 1)
TILES_FOR(1) TILES_FOR(2) TILES_FOR(3) TILES_FOR(4) TILES_FOR(5) TILES_FOR(6)
#if MR > 6
TILES_FOR(7) TILES_FOR(8) TILES_FOR(9) TILES_FOR(10) TILES_FOR(11) TILES_FOR(12)
#endif

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, const char *,
                        int64_t, int64_t);
static const tile_fn TILES[2][MR + 1] = {
    {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6,
#if MR > 6
     tile_7, tile_8, tile_9, tile_10, tile_11, tile_12
#endif
    },
    {0, tile_1_pf, tile_2_pf, tile_3_pf, tile_4_pf, tile_5_pf, tile_6_pf,
#if MR > 6
     tile_7_pf, tile_8_pf, tile_9_pf, tile_10_pf, tile_11_pf, tile_12_pf
#endif
    },
};

/* A step of many blocks takes two adjacent panels an item with AVX-512 (SPAN 2): MR / 2 rows x
 * 4 vectors, half the broadcasts per FMA of MR x 2, measured ~3-5% faster on an AMD Zen 4 (the
 * same sums). AVX2's 16 registers do not hold 3 x 4 accumulators and their operands. */
#ifdef __AVX512F__
#define SPAN 2
#define PAIR_TILE(R)                                                                          \
    static void pair_##R(const float *restrict x, int64_t lda, const float *restrict pa,       \
                         const float *restrict pb, int64_t len, float *restrict out, int64_t ldo, int first) { \
        vf a[R][4];                                                                           \
        for (int i = 0; i < R; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = (vf){0};          \
        for (int64_t k = 0; k < len; k++) {                                                   \
            const vf b0 = *(const vf *)(pa + k * NR), b1 = *(const vf *)(pa + k * NR + W);    \
            const vf b2 = *(const vf *)(pb + k * NR), b3 = *(const vf *)(pb + k * NR + W);    \
            for (int i = 0; i < R; i++) {                                                     \
                const float xi = x[i * lda + k];                                              \
                a[i][0] += xi * b0;                                                           \
                a[i][1] += xi * b1;                                                           \
                a[i][2] += xi * b2;                                                           \
                a[i][3] += xi * b3;                                                           \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < R; i++)                                                           \
            for (int j = 0; j < 4; j++) {                                                     \
                vfu *o = (vfu *)(out + i * ldo + j * W);                                      \
                *o = first ? a[i][j] : *o + a[i][j];                                          \
            }                                                                                 \
    }
PAIR_TILE(1) PAIR_TILE(2) PAIR_TILE(3) PAIR_TILE(4) PAIR_TILE(5) PAIR_TILE(6)
typedef void (*pair_fn)(const float *, int64_t, const float *, const float *, int64_t, float *, int64_t, int);
static const pair_fn PAIRS[MR / 2 + 1] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6};
#else
#define SPAN 1
#endif

/* y = x W^T + bias, or gated (bias none): y = silu(x Wg^T) * (x Wu^T), from panels packed by
 * packed_gemm_pack_gated. The gated product's two sums for an output are those of two plain
 * products; they meet in a scratch tile and only silu(g) * u is written. */
static void product(const float *x, int64_t lda, const float *packed, const float *bias, float *y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int gated, int num_threads) {
    /* Up to ONE_BLOCK rows (a decode step's) are one block, so each panel is read from memory
     * once for all of them, the next one prefetched meanwhile. */
    const int64_t block_rows = M <= ONE_BLOCK ? M : MB, num_out_panels = (N + NR - 1) / NR;
    const int64_t num_blocks = M <= ONE_BLOCK ? 1 : (M + MB - 1) / MB;
    const int64_t num_panels = gated ? 2 * num_out_panels : num_out_panels;
    const tile_fn *tiles = TILES[num_blocks == 1];
    /* An item is one panel; with SPAN 2 two adjacent ones where there are many blocks; gated,
     * always the two (gate's and up's) of one panel of outputs. */
    const int64_t span = gated ? 2 : num_blocks == 1 ? 1 : SPAN, num_items = (num_panels + span - 1) / span;
    /* A decode step's items one at a time: four of its few panels a hand-out left a thread idle
     * at the end (qkv, o, gate-up and down at 32 rows ~3% slower). */
    const int hand_out = num_blocks == 1 ? 1 : 4;
    #pragma omp parallel for schedule(dynamic, hand_out) collapse(2) num_threads(num_threads)
    for (int64_t blk = 0; blk < num_blocks; blk++)
        for (int64_t item = 0; item < num_items; item++) {
            const int64_t p = item * span, np = num_panels - p < span ? num_panels - p : span;
            const float *panel = packed + p * K * NR;
            const int64_t out_panels = gated ? 1 : np, n0 = (gated ? item : p) * NR;
            const int64_t width = N - n0 < out_panels * NR ? N - n0 : out_panels * NR;
            const int64_t r0 = blk * block_rows, r1 = r0 + block_rows < M ? r0 + block_rows : M;
            const int64_t num_tiles = (r1 - r0 + MR - 1) / MR;
            /* Whole plain panels sum into y; gated ones and a narrower last one into a scratch tile. */
            float scratch[ONE_BLOCK * 2 * NR];
            const int direct = !gated && width == np * NR;
            float *out = direct ? y + r0 * ldy + n0 : scratch;
            const int64_t ldo = direct ? ldy : np * NR;
#ifdef __AVX512F__
            if (np == 2 && num_blocks > 1) {
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t len = K - k0 < KC ? K - k0 : KC;
                    for (int64_t i0 = 0; i0 < r1 - r0; i0 += MR / 2) {
                        const int64_t rows = r1 - r0 - i0 < MR / 2 ? r1 - r0 - i0 : MR / 2;
                        PAIRS[rows](x + (r0 + i0) * lda + k0, lda, panel + k0 * NR, panel + (K + k0) * NR, len,
                                    out + i0 * ldo, ldo, k0 == 0);
                    }
                }
            } else
#endif
            /* A panel at a time, all its chunks, while the next one (in memory) is prefetched:
             * pass t of the block's T tiles over a chunk also pulls the next panel's rows t,
             * t + T, t + 2T... of that chunk into L2 (a prefetch never faults, past the end
             * neither), so the next panel's reads are spread over all the passes rather than
             * asked of the first alone, faster than memory gives them. */
            for (int64_t q = 0; q < np; q++) {
                const float *pq = panel + q * K * NR;
                const char *next = p + q + 1 < num_panels ? (const char *)(pq + K * NR) : 0;
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t len = K - k0 < KC ? K - k0 : KC;
                    for (int64_t t = 0; t < num_tiles; t++) {
                        const int64_t i0 = t * MR, rows = r1 - r0 - i0 < MR ? r1 - r0 - i0 : MR;
                        tiles[rows](x + (r0 + i0) * lda + k0, lda, pq + k0 * NR, len, out + i0 * ldo + q * NR, ldo,
                                    k0 == 0, next ? next + k0 * NR * 4 : 0, t, num_tiles);
                    }
                }
            }
            if (gated) {
                for (int64_t i = 0; i < r1 - r0; i++) {
                    float *dst = y + (r0 + i) * ldy + n0;
                    for (int64_t j = 0; j < width; j += W) {
                        const vf h = vsilu(*(const vfu *)(out + i * ldo + j)) * *(const vfu *)(out + i * ldo + NR + j);
                        if (j + W <= width)
                            *(vfu *)(dst + j) = h;
                        else
                            for (int64_t l = 0; j + l < width; l++) dst[j + l] = h[l];
                    }
                }
            } else if (!direct) {
                for (int64_t i = 0; i < r1 - r0; i++) {
                    float *dst = y + (r0 + i) * ldy + n0;
                    const float *sums = out + i * ldo;
                    for (int64_t j = 0; j < width; j++) dst[j] = bias ? sums[j] + bias[n0 + j] : sums[j];
                }
            } else if (bias) {
                for (int64_t i = 0; i < r1 - r0; i++) {
                    float *dst = y + (r0 + i) * ldy + n0;
                    for (int64_t j = 0; j < width; j++) dst[j] += bias[n0 + j];
                }
            }
        }
}

void packed_gemm(const float *x, int64_t lda, const float *packed, const float *bias, float *y,
                 int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    product(x, lda, packed, bias, y, ldy, M, N, K, 0, num_threads);
}

void packed_gemm_gated(const float *x, int64_t lda, const float *packed, float *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K, int num_threads) {
    product(x, lda, packed, 0, y, ldy, M, N, K, 1, num_threads);
}
