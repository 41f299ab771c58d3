/* Attention over one chunk of keys: the arithmetic both attention kernels share (see
 * attention_chunk.h). Every function here is called, not inlined, from paged_prefill.c and
 * paged_decode.c, so a row's result is the same machine code's whichever kernel asks. */
#include "attention_chunk.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "softmax_exp.h"

/* One native vector, and a panel of four: a value row's columns are summed a panel at a time. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define PANEL (4 * LANES)

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
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
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }

void scale_row(const float *src, float scale, float *dst, int64_t key_dim) {
    for (int64_t d = 0; d < key_dim; d++) dst[d] = src[d] * scale;
}

/* One row's score against one key: products summed lane by lane over the key's vectors in order,
 * then the lanes added in a fixed tree. Vectors of keys stay where the cache holds them. */
static inline __attribute__((always_inline)) float dot(const float *q, const float *k, const int64_t KD) {
    vec acc = {0};
    int64_t d = 0;
    for (; d + LANES <= KD; d += LANES) acc += load(q + d) * load(k + d);
    float tail = 0.0f;
    for (; d < KD; d++) tail += q[d] * k[d];
#if LANES == 16
    const vec high = __builtin_shuffle(acc, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    acc += high;
#endif
#if LANES >= 8
    acc += __builtin_shuffle(acc, (ivec){4, 5, 6, 7, 0, 1, 2, 3, SHUFFLE_REST});
#endif
    acc += __builtin_shuffle(acc, (ivec){2, 3, 0, 1, SHUFFLE_REST4});
    acc += __builtin_shuffle(acc, (ivec){1, 0, 3, 2, SHUFFLE_REST4});
    return acc[0] + tail;
}

static inline __attribute__((always_inline)) void scores_of(
    const float *rows, int64_t nrows, int64_t rows_per_head, const float *key_cache,
    const int64_t *slots, int64_t count, int64_t krow, int64_t offset, float *scores,
    const int64_t KD) {
    for (int64_t j = 0; j < count; j++) {
        const float *k = key_cache + slots[j] * krow + offset;
        for (int64_t r = 0; r < nrows; r++)
            scores[r * CHUNK + j] = dot(rows + r * KD, k + r / rows_per_head * KD, KD);
    }
}

void chunk_scores(const float *rows, int64_t nrows, int64_t rows_per_head, const float *key_cache,
                  const int64_t *slots, int64_t count, int64_t kv_heads, int64_t kh,
                  float *scores, int64_t key_dim) {
    const int64_t krow = kv_heads * key_dim, offset = kh * key_dim;
    if (key_dim == 64)
        scores_of(rows, nrows, rows_per_head, key_cache, slots, count, krow, offset, scores, 64);
    else if (key_dim == 128)
        scores_of(rows, nrows, rows_per_head, key_cache, slots, count, krow, offset, scores, 128);
    else
        scores_of(rows, nrows, rows_per_head, key_cache, slots, count, krow, offset, scores, key_dim);
}

void chunk_softmax(float *w, int64_t lo, int64_t hi, float softcap, float *peak, float *total,
                   float *rescale) {
    if (lo >= hi) {
        memset(w, 0, sizeof(float) * CHUNK);
        *rescale = 1.0f;
        return;
    }
    float top = *peak;
    for (int64_t j = lo; j < hi; j++) {
        if (softcap > 0.0f) w[j] = softcap * tanhf(w[j] / softcap);
        top = w[j] > top ? w[j] : top;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = lo; j < hi; j++) {
        w[j] = softmax_exp(w[j] - top);
        sum += w[j];
    }
    for (int64_t j = 0; j < lo; j++) w[j] = 0.0f;
    for (int64_t j = hi; j < CHUNK; j++) w[j] = 0.0f;
    *rescale = expf(*peak - top);
    *total = *total * *rescale + sum;
    *peak = top;
}

/* acc[col..col + NV*LANES) of one row (chunk_values). */
static inline __attribute__((always_inline)) void values_of(
    const float *value_cache, const int64_t *slots, int64_t vrow, int64_t offset,
    const float *weights, float rescale, float *acc, int64_t c0, int64_t j0, int64_t j1,
    int64_t col, const int NV) {
    vec sum[4];
    for (int i = 0; i < NV; i++) sum[i] = load(acc + col + i * LANES) * rescale;
    for (int64_t j = j0; j < j1; j++) {
        const float *v = value_cache + slots[j - c0] * vrow + offset + col;
        const float w = weights[j - c0];
        for (int i = 0; i < NV; i++) sum[i] += w * load(v + i * LANES);
    }
    for (int i = 0; i < NV; i++) store(acc + col + i * LANES, sum[i]);
}

void chunk_values(const float *value_cache, const int64_t *slots, int64_t kv_heads, int64_t kh,
                  int64_t value_dim, int64_t nrows, const float *weights, const float *rescale,
                  float *acc, int64_t c0, int64_t j0, int64_t j1) {
    const int64_t VD = value_dim, vrow = kv_heads * VD, offset = kh * VD;
    for (int64_t r = 0; r < nrows; r++) {
        const float *w = weights + r * CHUNK;
        float *out = acc + r * VD;
        int64_t col = 0;
        for (; col + PANEL <= VD; col += PANEL)
            values_of(value_cache, slots, vrow, offset, w, rescale[r], out, c0, j0, j1, col, 4);
        for (; col + LANES <= VD; col += LANES)
            values_of(value_cache, slots, vrow, offset, w, rescale[r], out, c0, j0, j1, col, 1);
        for (; col < VD; col++) {
            float sum = out[col] * rescale[r];
            for (int64_t j = j0; j < j1; j++) sum += w[j - c0] * value_cache[slots[j - c0] * vrow + offset + col];
            out[col] = sum;
        }
    }
}

void finish_row(const float *acc, float total, float *dst, int64_t value_dim) {
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < value_dim; d++) dst[d] = acc[d] * inverse;
}
