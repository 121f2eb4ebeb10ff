/* The vector type the kernels are written in: GCC vector extensions, W floats wide (a whole
 * AVX-512 register, or an AVX2 one), so the same source builds for both with -march=native. */
#ifndef EPD_KERNELS_VECTOR_H
#define EPD_KERNELS_VECTOR_H
#include <stdint.h>

#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef float vfu __attribute__((vector_size(4 * W), aligned(4)));  /* at any float address */

static inline vf splat(float x) { return (vf){0} + x; }

#endif
