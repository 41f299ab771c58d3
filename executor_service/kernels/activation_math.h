/* The activations transformers' models name (SiLU, sigmoid, the two GELUs, quick GELU) for one
 * float, in plain IEEE operations and the explicit fused products of vector_exp.h. torch
 * computes an element in the scalar tail of its vectorised loop with other code than inside
 * it, and which elements fall in the tail, or start a thread's share, depends on the tensor's
 * size: a row's bits then depend on the step it is in. Here the vectorised loop and its scalar
 * remainder run the same operations, so an element's bits depend on its value alone
 * (-ffp-contract=off keeps the compiler from fusing one and not the other). */
#ifndef SPLITSERVE_ACTIVATION_MATH_H
#define SPLITSERVE_ACTIVATION_MATH_H
#include "vector_exp.h"

/* 1 / (1 + e^-x): 1 where e^-x is under EXP_LOWEST's, 0 where it overflows (torch's is then
 * under 2e-38). */
static inline __attribute__((always_inline)) float sigmoid_of(float x) {
    const float e = -x < EXP_LOWEST ? 0.0f : exp_in_range(-x);
    return -x > EXP_HIGHEST ? 0.0f : 1.0f / (1.0f + e);
}

/* x / (1 + e^-x), as torch's SiLU writes it; 0 past EXP_HIGHEST, where torch's is under 3e-37
 * in magnitude. */
static inline __attribute__((always_inline)) float silu_of(float x) {
    const float e = -x < EXP_LOWEST ? 0.0f : exp_in_range(-x);
    return -x > EXP_HIGHEST ? 0.0f : x / (1.0f + e);
}

/* The tanh approximation, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), as
 * x / (1 + e^(-2u)): the same value without tanh's cancellation near 0. */
static inline __attribute__((always_inline)) float gelu_tanh_of(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float e = -2.0f * u < EXP_LOWEST ? 0.0f : exp_in_range(-2.0f * u);
    return -2.0f * u > EXP_HIGHEST ? 0.0f : x / (1.0f + e);
}

/* erfc(t) for t >= 0: Numerical Recipes' Chebyshev fit erfc(t) = w exp(-t^2 + P(w)), w = 1 /
 * (1 + t / 2), within 1.2e-7 of the value relative to it. t^2 is split into its rounded square
 * and the rounding's error, and e^(-t^2) taken from the first alone, so that the large part of
 * the exponent is exact: a few ulp in all (tests/executor/test_kernel_math.py). */
static inline __attribute__((always_inline)) float erfc_nonnegative(float t) {
    const float w = 1.0f / fma_where_fast(0.5f, t, 1.0f);
    float p = 0.17087277f;
    p = fma_where_fast(p, w, -0.82215223f);
    p = fma_where_fast(p, w, 1.48851587f);
    p = fma_where_fast(p, w, -1.13520398f);
    p = fma_where_fast(p, w, 0.27886807f);
    p = fma_where_fast(p, w, -0.18628806f);
    p = fma_where_fast(p, w, 0.09678418f);
    p = fma_where_fast(p, w, 0.37409196f);
    p = fma_where_fast(p, w, 1.00002368f);
    p = fma_where_fast(p, w, -1.26551223f);
    const float square = t * t;
#if defined(__FMA__) || defined(__AVX512F__)
    const float square_error = fmaf(t, t, -square);
#else
    const float square_error = 0.0f;
#endif
    const float tail = -square < EXP_LOWEST ? 0.0f : exp_in_range(-square);
    return w * tail * exp_in_range(p - square_error);
}

/* 0.5 x (1 + erf(x / sqrt(2))), as torch's exact GELU, written 0.5 x erfc(-x / sqrt(2)) so that
 * the negative side, where the result is small, keeps its relative accuracy. */
static inline __attribute__((always_inline)) float gelu_erf_of(float x) {
    const float c = erfc_nonnegative(fabsf(x) * 0.70710678118654752f);
    const float half = 0.5f * x;
    return x <= 0.0f ? half * c : x - half * c;
}

/* x sigmoid(1.702 x), transformers' QuickGELU. */
static inline __attribute__((always_inline)) float quick_gelu_of(float x) {
    return x * sigmoid_of(1.702f * x);
}
#endif
