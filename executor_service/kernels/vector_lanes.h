/* One native float vector (GCC's vector extension) and the fixed tree that adds its lanes,
 * shared by the kernels that reduce a row: attention scores (attention_chunk.c) and RMSNorm
 * (layer_elementwise.c). The kernels are built without -ffast-math, so the compiler may not
 * reorder a sum; a reduction is vectorised by writing its order down here instead: lane i adds
 * elements i, i + LANES, ... in order, then the lanes meet in the tree below. The order depends on
 * the vector width of the host (16 lanes with AVX-512, 8 with AVX, 4 otherwise), never on how
 * many rows a call holds. */
#ifndef SPLITSERVE_VECTOR_LANES_H
#define SPLITSERVE_VECTOR_LANES_H
#include <stdint.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

/* The lanes of a shuffle mask past the first 8 (or 4): their results are never read. */
#if LANES == 16
#define SHUFFLE_REST 8, 9, 10, 11, 12, 13, 14, 15
#define SHUFFLE_REST4 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#elif LANES == 8
#define SHUFFLE_REST
#define SHUFFLE_REST4 4, 5, 6, 7
#else
#define SHUFFLE_REST4
#endif

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
/* x in every lane (the intrinsic: GCC builds the vector one lane at a time from a loop). */
static inline vec broadcast(float x) {
#if LANES == 16
    return _mm512_set1_ps(x);
#elif LANES == 8
    return _mm256_set1_ps(x);
#elif defined(__SSE__)
    return _mm_set1_ps(x);
#else
    return (vec){x, x, x, x};
#endif
}

/* a * b + c, fused (one rounding) where the CPU has FMA. Written out rather than left to the
 * compiler: the kernels are built with -ffp-contract=off, so no other product is fused. */
static inline vec fma_lanes(vec a, vec b, vec c) {
#if LANES == 16
    return _mm512_fmadd_ps(a, b, c);
#elif LANES == 8 && defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#elif defined(__FMA__)
    return _mm_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }

/* Lane by lane, the larger of a and b (b where they are equal or either is NaN). */
static inline vec max_lanes(vec a, vec b) {
    const ivec a_larger = a > b;
    return (vec)(((ivec)a & a_larger) | ((ivec)b & ~a_larger));
}

/* The largest of acc's lanes (max is exact, so the order only has to be fixed, not chosen). */
static inline float lane_max(vec acc) {
#if LANES == 16
    acc = max_lanes(acc, __builtin_shuffle(acc, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
#endif
#if LANES >= 8
    acc = max_lanes(acc, __builtin_shuffle(acc, (ivec){4, 5, 6, 7, 0, 1, 2, 3, SHUFFLE_REST}));
#endif
    acc = max_lanes(acc, __builtin_shuffle(acc, (ivec){2, 3, 0, 1, SHUFFLE_REST4}));
    acc = max_lanes(acc, __builtin_shuffle(acc, (ivec){1, 0, 3, 2, SHUFFLE_REST4}));
    return acc[0];
}

/* The sum of acc's lanes: halves added pairwise, then quarters, down to lane 0. */
static inline float lane_sum(vec acc) {
#if LANES == 16
    acc += __builtin_shuffle(acc, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
#if LANES >= 8
    acc += __builtin_shuffle(acc, (ivec){4, 5, 6, 7, 0, 1, 2, 3, SHUFFLE_REST});
#endif
    acc += __builtin_shuffle(acc, (ivec){2, 3, 0, 1, SHUFFLE_REST4});
    acc += __builtin_shuffle(acc, (ivec){1, 0, 3, 2, SHUFFLE_REST4});
    return acc[0];
}

/* sum(x[d] * y[d] for d < n): four vector partial sums (vector v of x goes to partial v % 4),
 * so that four fused products are in flight rather than one chain waiting on each; then the
 * partials added (0 + 1) + (2 + 3), then the lanes (lane_sum), then the tail past the last whole
 * vector in order. */
static inline __attribute__((always_inline)) float dot_lanes(const float *x, const float *y, int64_t n) {
    vec partial[4] = {{0}, {0}, {0}, {0}};
    int64_t d = 0;
    for (; d + 4 * LANES <= n; d += 4 * LANES)
        for (int i = 0; i < 4; i++) partial[i] = fma_lanes(load(x + d + i * LANES), load(y + d + i * LANES), partial[i]);
    for (int i = 0; d + LANES <= n; d += LANES, i++) partial[i] = fma_lanes(load(x + d), load(y + d), partial[i]);
    float sum = lane_sum((partial[0] + partial[1]) + (partial[2] + partial[3]));
    for (; d < n; d++) sum += x[d] * y[d];
    return sum;
}
#endif
