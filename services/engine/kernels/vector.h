/* The vector type the kernels are written in: GCC vector extensions, W floats wide (a whole
 * AVX-512 register, or an AVX2 one), so the same source builds for both with -march=native. */
#ifndef EPD_KERNELS_VECTOR_H
#define EPD_KERNELS_VECTOR_H
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef float vfu __attribute__((vector_size(4 * W), aligned(4)));  /* at any float address */

static inline vf splat(float x) { return (vf){0} + x; }

static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* e^x for x <= 0 (exp(x) = 2^n e^r, |r| <= ln2 / 2; Cephes' polynomial for e^r), 0 below -87
 * (AVX-512: subnormal down to about -103, then 0). AVX-512 rounds and scales in one instruction
 * each (vrndscaleps, vscalefps) where the generic path takes eight: the same bits for x >= -87
 * but at exact ties of x log2(e) + 1/2, and the prefill kernel ~5% faster on an AMD Zen 4. */
static inline vf vexp(vf x) {
#ifdef __AVX512F__
    x = vmax(x, splat(-110.0f));  /* 2^-159 and below: 0 in float */
    const vf fn = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vf lo = splat(-87.0f);
    vi under = x < lo;
    x = vmax(x, lo);
    vf y = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(y, vi);
    n -= (vi)(__builtin_convertvector(n, vf) > y) & 1;  /* truncation -> floor */
    vf fn = __builtin_convertvector(n, vf);
#endif
    vf r = x - fn * 0.693359375f;
    r = r + fn * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
#ifdef __AVX512F__
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)fn);
#else
    vf scale = (vf)((n + 127) << 23);
    return vselect(under, splat(0.f), p * scale);
#endif
}

/* x * sigmoid(x), one exp of -|x| (never overflows): x / (1 + e^-x), or for x < 0 the same
 * value as x e^x / (1 + e^x). A few ulps from torch's SiLU (another exp). */
static inline vf vsilu(vf x) {
    const vi negative = x < 0;
    const vf e = vexp(vselect(negative, x, -x));
    return vselect(negative, x * e, x) / (1.0f + e);
}

#endif
