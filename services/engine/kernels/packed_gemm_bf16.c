/* y = x W^T (+ bias) in bf16 against weights packed once at load, on CPUs with AVX512_BF16: the
 * bf16 engine's linear layers, for a decode step's few rows and a prefill step's thousands alike.
 *
 *   x       [M, K] bf16, rows lda apart
 *   packed  [ceil(N / NR), ceil(K / 2), NR, 2]: panel p, pair k holds W[p*NR + j, 2k] and
 *           W[p*NR + j, 2k + 1] side by side for j = 0 .. NR-1 (zeros past N and past K), so
 *           one pair of k gives the panel's NR outputs' weights as two vectors of 16 pairs
 *   y       [M, N] bf16, rows ldy apart
 *
 * vdpbf16ps multiplies bf16 pairs exactly and adds both products to a float sum (odd term then
 * even, each add rounded to nearest even, subnormals flushed): every output is one float sum over
 * k in order from zero, then the bias (float), rounded once to bf16 (to nearest, ties to even,
 * as torch rounds). A row's result never depends on the other rows, on M or on how the items are
 * split among threads, so prefill and decode engines compute the same bits for a token.
 *
 * An item is two adjacent panels (64 outputs) over a block of rows; within one, tiles of up to
 * MR rows x 4 vectors of sums run over the whole of k, the x tile in L1 and the panels' pairs
 * streaming from L2 (re-read by each tile of the block). Items are handed out as threads come
 * free (dynamic), as packed_gemm.c's. The gated form (SwiGLU) packs gate's panel p then up's as
 * one item and writes only silu(gate) * up, from the float sums, rounded once.
 *
 * Where the CPU has AMX (and the compiler targets it) the same product runs on AMX's tiles
 * instead (product_amx, below): its sums are other bits (the tile instruction sums its 16 pairs
 * in its own way), so an engine uses one of the two for every row, decode and prefill alike
 * (packed_gemm_bf16_amx and _amx_gated, where packed_gemm_bf16_amx_ready() says they run).
 *
 * Built only where the compiler targets AVX512_BF16 (-march=native on such a CPU);
 * packed_gemm_bf16_available() says whether it was.
 */
#include <stdint.h>
#include <string.h>

#include "vector.h"

#ifdef __AVX512BF16__
#define HAVE_BF16 1
#define NR 32       /* outputs per panel: two vectors of 16 */
#define MR 6        /* rows per tile: 6 x 4 sums, 4 weight vectors and a broadcast in 32 registers */
#define MB (8 * MR) /* rows per block where there are more */
#define ONE_BLOCK (16 * MR)

typedef uint16_t bf16;

static inline float ld_bf16(bf16 v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void narrow(bf16 *dst, vf v, int64_t n) {  /* round 16 floats, store the first n */
    const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    if (n == 16)
        _mm256_storeu_si256((__m256i *)dst, h);
    else
        _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << n) - 1), h);
}

/* A panel's elements: K rounded up to pairs. */
static int64_t panel_size(int64_t K) { return (K + 1) / 2 * 2 * NR; }

int64_t packed_gemm_bf16_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * panel_size(K); }

static void pack_panel(const bf16 *w, bf16 *dst, int64_t N, int64_t K, int64_t p) {
    for (int64_t j = 0; j < NR; j++) {
        const int64_t n = p * NR + j;
        for (int64_t k = 0; k < K + K % 2; k++)
            dst[(k / 2) * 2 * NR + 2 * j + k % 2] = n < N && k < K ? w[n * K + k] : 0;
    }
}

void packed_gemm_bf16_pack(const bf16 *w, bf16 *packed, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) pack_panel(w, packed + p * panel_size(K), N, K, p);
}

void packed_gemm_bf16_pack_gated(const bf16 *gate, const bf16 *up, bf16 *packed, int64_t N, int64_t K,
                                 int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        pack_panel(gate, packed + 2 * p * panel_size(K), N, K, p);
        pack_panel(up, packed + (2 * p + 1) * panel_size(K), N, K, p);
    }
}

/* Rows 0 .. R-1 of a tile against panels pa and pb (pb may be pa's neighbour or the gated
 * partner), sums[i][0..3] over all K: K / 2 whole pairs, then an odd K's last element alone
 * (its pair's other half zero in x as in the panel: x's row may end there). */
#define TILE(R)                                                                                   \
    static inline void step_##R(__m512 a[R][4], const bf16 *restrict x, int64_t lda,              \
                                const bf16 *restrict pa, const bf16 *restrict pb, int64_t k,       \
                                int whole) {                                                      \
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pa + k * 2 * NR);                    \
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pa + k * 2 * NR + NR);               \
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(pb + k * 2 * NR);                    \
        const __m512bh b3 = (__m512bh)_mm512_loadu_si512(pb + k * 2 * NR + NR);               \
        for (int i = 0; i < R; i++) {                                                         \
            int32_t pair = x[i * lda + 2 * k];                                                \
            if (whole) memcpy(&pair, x + i * lda + 2 * k, sizeof pair);                       \
            const __m512bh xi = (__m512bh)_mm512_set1_epi32(pair);                            \
            a[i][0] = _mm512_dpbf16_ps(a[i][0], xi, b0);                                      \
            a[i][1] = _mm512_dpbf16_ps(a[i][1], xi, b1);                                      \
            a[i][2] = _mm512_dpbf16_ps(a[i][2], xi, b2);                                      \
            a[i][3] = _mm512_dpbf16_ps(a[i][3], xi, b3);                                      \
        }                                                                                     \
    }                                                                                         \
    static void tile_##R(const bf16 *restrict x, int64_t lda, const bf16 *restrict pa,            \
                         const bf16 *restrict pb, int64_t K, vf sums[MR][4]) {                   \
        __m512 a[R][4];                                                                       \
        for (int i = 0; i < R; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K / 2; k++) step_##R(a, x, lda, pa, pb, k, 1);                \
        if (K % 2) step_##R(a, x, lda, pa, pb, K / 2, 0);                                     \
        for (int i = 0; i < R; i++)                                                           \
            for (int j = 0; j < 4; j++) sums[i][j] = (vf)a[i][j];                             \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile_fn)(const bf16 *, int64_t, const bf16 *, const bf16 *, int64_t, vf[MR][4]);
static const tile_fn TILES[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The same product with AMX's tile instructions (tdpbf16ps), on CPUs that have them: the packed
 * layout is already AMX's: 16 pairs of one panel's 16 outputs are a B tile's 16 rows of 64 bytes,
 * rows 2 * NR * 2 bytes apart. Each 16 x 16 block of sums runs over k in tiles of 16 pairs, in
 * order from zero; a tile's rows are independent of each other, so a row's bits depend on
 * nothing but its own x and the weights, whatever M is. A block of up to 32 rows x one panel's
 * 32 outputs is 4 accumulator tiles (tmm0-3), two x tiles (tmm4-5), two weight tiles (tmm6-7).
 * A k range that does not fill the last tile is copied into zeroed scratch (zeros add exact
 * zeros), so nothing past a row of x or past a panel is read. */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define TILE_PAIRS 16                       /* k pairs per tile */
#define TILE_K (2 * TILE_PAIRS)             /* k per tile */
#define PAIR_ROW (2 * NR)                   /* elements between a panel's pair rows */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state;  /* 0: not asked yet, 1: the kernel may use AMX, -1: it may not */

/* Linux hands AMX's tile state to a process only when asked (arch_prctl). */
static int amx_permitted(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                           18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return amx_state == 1;
}

/* Tiles for rows0 (<= 16) rows in tmm0-1/tmm4 and rows1 (<= 16) more in tmm2-3/tmm5. */
static void configure(int rows0, int rows1) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        const int rows = t == 6 || t == 7 ? TILE_PAIRS : (t == 2 || t == 3 || t == 5) ? rows1 : rows0;
        cfg.rows[t] = rows;
        cfg.colsb[t] = rows ? 64 : 0;
    }
    __asm__ volatile("" ::: "memory");  /* ldtilecfg's asm names only cfg's first 8 bytes as read */
    _tile_loadconfig(&cfg);
}

/* sums [32][NR] = rows r0 .. r0 + rows of x against panel pa, rows0 / rows1 as configured. */
static void block_amx(const bf16 *x, int64_t lda, const bf16 *pa, int64_t K, int rows, float sums[32][NR]) {
    const int64_t num_pairs = (K + 1) / 2, whole = K / TILE_K;  /* tiles wholly inside x's rows */
    const int two = rows > 16;
    _tile_zero(0); _tile_zero(1);
    if (two) { _tile_zero(2); _tile_zero(3); }
    for (int64_t t = 0; t < whole; t++) {
        const bf16 *b = pa + t * TILE_PAIRS * PAIR_ROW;
        _tile_loadd(4, x + t * TILE_K, lda * sizeof(bf16));
        _tile_loadd(6, b, PAIR_ROW * sizeof(bf16));
        _tile_loadd(7, b + NR, PAIR_ROW * sizeof(bf16));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * lda + t * TILE_K, lda * sizeof(bf16));
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (whole * TILE_K < K) {  /* the last, partial tile of k, from zeroed copies */
        bf16 xs[32][TILE_K] __attribute__((aligned(64))), bs[TILE_PAIRS][PAIR_ROW] __attribute__((aligned(64)));
        const int64_t k0 = whole * TILE_K, pairs = num_pairs - whole * TILE_PAIRS;
        memset(xs, 0, sizeof xs);
        memset(bs, 0, sizeof bs);
        for (int i = 0; i < rows; i++) memcpy(xs[i], x + i * lda + k0, (K - k0) * sizeof(bf16));
        memcpy(bs, pa + whole * TILE_PAIRS * PAIR_ROW, pairs * PAIR_ROW * sizeof(bf16));
        /* gcc's tile loads are asm that does not say it reads memory: without this barrier
         * the copies above are dead stores to it, and dropped. */
        __asm__ volatile("" ::: "memory");
        _tile_loadd(4, xs, TILE_K * sizeof(bf16));
        _tile_loadd(6, bs, PAIR_ROW * sizeof(bf16));
        _tile_loadd(7, &bs[0][NR], PAIR_ROW * sizeof(bf16));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xs[16], TILE_K * sizeof(bf16));
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, &sums[0][0], NR * sizeof(float));
    _tile_stored(1, &sums[0][16], NR * sizeof(float));
    if (two) {
        _tile_stored(2, &sums[16][0], NR * sizeof(float));
        _tile_stored(3, &sums[16][16], NR * sizeof(float));
    }
}

static void product_amx(const bf16 *x, int64_t lda, const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int gated, int num_threads) {
    const int64_t num_out_panels = (N + NR - 1) / NR, panel = panel_size(K);
    /* An item: 32 rows (or fewer, the last) x one panel of outputs, gated its gate and up panels. */
    const int64_t num_row_blocks = (M + 31) / 32, num_items = num_out_panels;
    #pragma omp parallel num_threads(num_threads)
    {
        int configured = -1;
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t blk = 0; blk < num_row_blocks; blk++)
            for (int64_t item = 0; item < num_items; item++) {
                const int64_t r0 = blk * 32, rows = M - r0 < 32 ? M - r0 : 32;
                if (rows != configured) {
                    configure(rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 0);
                    configured = rows;
                }
                const int64_t n0 = item * NR, width = N - n0 < NR ? N - n0 : NR;
                float sums[32][NR] __attribute__((aligned(64))), up[gated ? 32 : 1][NR] __attribute__((aligned(64)));
                const bf16 *pa = packed + (gated ? 2 * item : item) * panel;
                block_amx(x + r0 * lda, lda, pa, K, rows, sums);
                if (gated) block_amx(x + r0 * lda, lda, pa + panel, K, rows, up);
                float b[NR];
                for (int64_t j = 0; j < NR; j++) b[j] = bias && !gated && j < width ? ld_bf16(bias[n0 + j]) : 0.f;
                for (int64_t i = 0; i < rows; i++) {
                    bf16 *dst = y + (r0 + i) * ldy + n0;
                    for (int j = 0; j < 2; j++) {
                        const int64_t left = width - j * W;
                        if (left <= 0) break;
                        const vf s = *(const vfu *)&sums[i][j * W];
                        narrow(dst + j * W, gated ? vsilu(s) * *(const vfu *)&up[i][j * W]
                                                  : s + *(const vfu *)(b + j * W), left < W ? left : W);
                    }
                }
            }
        _tile_release();
    }
}
#else
#define HAVE_AMX 0
#endif

static void product(const bf16 *x, int64_t lda, const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int gated, int num_threads) {
    if (M == 0) return;
    const int64_t block_rows = M <= ONE_BLOCK ? M : MB, num_blocks = (M + block_rows - 1) / block_rows;
    const int64_t num_out_panels = (N + NR - 1) / NR;
    /* An item: two adjacent panels (64 outputs), or gated the gate and up panels of 32. */
    const int64_t out_per_item = gated ? NR : 2 * NR, num_items = (N + out_per_item - 1) / out_per_item;
    const int64_t panel = panel_size(K);
    const int hand_out = num_blocks == 1 ? 1 : 4;
    #pragma omp parallel for schedule(dynamic, hand_out) collapse(2) num_threads(num_threads)
    for (int64_t blk = 0; blk < num_blocks; blk++)
        for (int64_t item = 0; item < num_items; item++) {
            const int64_t n0 = item * out_per_item, width = N - n0 < out_per_item ? N - n0 : out_per_item;
            const int64_t p = 2 * item;
            const bf16 *pa = packed + p * panel;
            /* plain: the neighbour panel, or (past N) pa again, whose sums are not written */
            const bf16 *pb = gated || p + 1 < num_out_panels ? pa + panel : pa;
            const int64_t r0 = blk * block_rows, r1 = r0 + block_rows < M ? r0 + block_rows : M;
            float b[2 * NR];
            for (int64_t j = 0; j < 2 * NR; j++) b[j] = bias && !gated && j < width ? ld_bf16(bias[n0 + j]) : 0.f;
            for (int64_t i0 = r0; i0 < r1; i0 += MR) {
                const int64_t rows = r1 - i0 < MR ? r1 - i0 : MR;
                vf sums[MR][4];
                TILES[rows](x + i0 * lda, lda, pa, pb, K, sums);
                for (int64_t i = 0; i < rows; i++) {
                    bf16 *dst = y + (i0 + i) * ldy + n0;
                    if (gated) {
                        for (int j = 0; j < 2; j++) {
                            const int64_t left = width - j * W;
                            if (left > 0) narrow(dst + j * W, vsilu(sums[i][j]) * sums[i][2 + j], left < W ? left : W);
                        }
                    } else {
                        for (int j = 0; j < 4; j++) {
                            const int64_t left = width - j * W;
                            if (left > 0)
                                narrow(dst + j * W, sums[i][j] + *(const vfu *)(b + j * W), left < W ? left : W);
                        }
                    }
                }
            }
        }
}

void packed_gemm_bf16(const bf16 *x, int64_t lda, const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    product(x, lda, packed, bias, y, ldy, M, N, K, 0, num_threads);
}

void packed_gemm_bf16_gated(const bf16 *x, int64_t lda, const bf16 *packed, bf16 *y, int64_t ldy, int64_t M,
                            int64_t N, int64_t K, int num_threads) {
    product(x, lda, packed, 0, y, ldy, M, N, K, 1, num_threads);
}

#if HAVE_AMX
void packed_gemm_bf16_amx(const bf16 *x, int64_t lda, const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M) product_amx(x, lda, packed, bias, y, ldy, M, N, K, 0, num_threads);
}

void packed_gemm_bf16_amx_gated(const bf16 *x, int64_t lda, const bf16 *packed, bf16 *y, int64_t ldy, int64_t M,
                                int64_t N, int64_t K, int num_threads) {
    if (M) product_amx(x, lda, packed, 0, y, ldy, M, N, K, 1, num_threads);
}
#endif

/* Whether packed_gemm_bf16_amx (and _gated) exist and may run: built for AMX, and Linux gave this
 * process AMX's tile state (asked here, once: call it before any thread computes on tiles). */
int packed_gemm_bf16_amx_ready(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
#else
#define HAVE_BF16 0
int packed_gemm_bf16_amx_ready(void) { return 0; }
#endif

int packed_gemm_bf16_available(void) { return HAVE_BF16; }
