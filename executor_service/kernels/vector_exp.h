/* expf for the kernels' vectorised loops, written in plain float arithmetic so that it
 * vectorises without -ffast-math and gives the same bits with any compiler or C library: the
 * kernels used to take glibc's vector expf, which only -ffast-math enables and whose results
 * belong to the glibc version.
 *
 * e^x = 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2; ln 2 is subtracted in two parts
 * (Cody and Waite), the first with few enough bits that n times it is exact, and e^r is Cephes'
 * degree-7 polynomial (Moshier): within 1.01 ulp of the true value over the range below
 * (tests/executor/test_kernel_math.py checks every 97th float of it). Adding 1.5 * 2^23 rounds
 * x / ln 2 to the integer n. The kernels' -ffp-contract=off keeps each step rounded as written;
 * the steps are fused explicitly where the CPU has FMA (so an FMA host and one without differ
 * in the last bit).
 *
 * The range is [EXP_LOWEST, EXP_HIGHEST]: below, e^x is barely a normal float; above (ln FLT_MAX
 * is 88.7228), it overflows. A caller that needs e^x to vanish or overflow beyond them selects
 * that itself. */
#ifndef SPLITSERVE_VECTOR_EXP_H
#define SPLITSERVE_VECTOR_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* a * b + c in one rounding where the CPU has FMA (one instruction, vectorised), else in two:
 * fmaf without the instruction is a slow library call. */
static inline __attribute__((always_inline)) float fma_where_fast(float a, float b, float c) {
#if defined(__FMA__) || defined(__AVX512F__)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

#define EXP_LOWEST -87.0f
#define EXP_HIGHEST 88.72f

/* e^x for EXP_LOWEST <= x <= EXP_HIGHEST. Outside, the result is meaningless but harmless (no
 * trap, no branch): a vectorised caller computes every lane and selects what it needs. */
static inline __attribute__((always_inline)) float exp_in_range(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23 */
    const float shifted = fma_where_fast(x, 1.44269504088896341f, shifter);
    const float n = shifted - shifter;
    const float r = fma_where_fast(n, 2.12194440e-4f, fma_where_fast(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = fma_where_fast(p, r, 1.3981999507e-3f);
    p = fma_where_fast(p, r, 8.3334519073e-3f);
    p = fma_where_fast(p, r, 4.1665795894e-2f);
    p = fma_where_fast(p, r, 1.6666665459e-1f);
    p = fma_where_fast(p, r, 5.0000001201e-1f);
    const float e_r = fma_where_fast(p, r * r, r) + 1.0f;
    /* The sum's 23 mantissa bits hold 2^22 + n (bit arithmetic rather than a conversion of n,
     * which is undefined for the out-of-range lanes). 2^n is applied as two powers of two, each
     * a normal float for every n in range (-126 to 128), so the only rounding is the last
     * product's. */
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    const int32_t whole = (bits & 0x7fffff) - 0x400000, half = whole / 2;
    const uint32_t first_bits = (uint32_t)(half + 127) << 23, second_bits = (uint32_t)(whole - half + 127) << 23;
    float first, second;
    memcpy(&first, &first_bits, sizeof first);
    memcpy(&second, &second_bits, sizeof second);
    return e_r * first * second;
}
#endif
