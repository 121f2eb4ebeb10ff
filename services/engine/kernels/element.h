/* The element type a kernel object reads and writes (q, out, the KV pool, the RoPE tables),
 * chosen at compile time: each attention and RoPE source is built twice, as is and with
 * -DEPD_BF16, and every exported name carries the type (paged_decode_f32, paged_decode_bf16).
 * Arithmetic is always float: ld() widens an element, st() rounds a float to one
 * (to nearest, ties to even, as torch rounds to bfloat16).
 */
#ifndef EPD_KERNELS_ELEMENT_H
#define EPD_KERNELS_ELEMENT_H
#include <stdint.h>
#include <string.h>

#define EPD_CAT_(a, b, c) a##b##c
#define EPD_CAT(a, b, c) EPD_CAT_(a, b, c)

#ifdef EPD_BF16
typedef uint16_t elem;
#define EXPORT(base, tail) EPD_CAT(base, _bf16, tail)
static inline float ld(elem x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline elem st(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (elem)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#else
typedef float elem;
#define EXPORT(base, tail) EPD_CAT(base, _f32, tail)
static inline float ld(elem x) { return x; }
static inline elem st(float f) { return f; }
#endif

#endif
