/* y = x W^T for a prefill step's many rows through an external single-threaded sgemm (OpenBLAS,
 * kernels/openblas.py), the rows split across the calling thread's OpenMP team.
 *
 *   x  [M, K] float32, contiguous;  w  [N, K] float32, contiguous;  y  [M, N]
 *   k_chunk: k is summed in chunks of this many terms, one call a chunk, each chunk's sums added
 *            into y (beta 1): shorter sequential sums than one call's, closer to exact (openblas.py)
 *
 * The BLAS is told to use one thread and each thread of the team makes one call on its share of
 * the rows (whole multiples of 16), so the products run on the same bound threads as torch's ops
 * and the other kernels, with no second thread pool spinning beside them. The split depends on
 * M and the team's size only: the same step gives the same bits on every run.
 */
#include <stdint.h>

#include <omp.h>

/* cblas_sgemm with 32-bit integers (LP64), as OpenBLAS exports it. */
typedef void (*cblas_sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                               const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, ROW_ALIGN = 16 };

void blas_rows(const void *sgemm, const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
               int64_t k_chunk, int num_threads) {
    const cblas_sgemm_fn gemm = (cblas_sgemm_fn)sgemm;
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t share = ((M + n - 1) / n + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
        const int64_t m0 = t * share, m1 = m0 + share < M ? m0 + share : M;
        for (int64_t k0 = 0; m0 < m1 && k0 < K; k0 += k_chunk)
            gemm(ROW_MAJOR, NO_TRANS, TRANS, (int)(m1 - m0), (int)N, (int)(K - k0 < k_chunk ? K - k0 : k_chunk), 1.f,
                 x + m0 * K + k0, (int)K, w + k0, (int)K, k0 ? 1.f : 0.f, y + m0 * N, (int)N);
    }
}
