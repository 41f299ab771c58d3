/* Attention over one chunk of keys: the arithmetic both attention kernels share (see
 * attention_chunk.h). Every function here is called, not inlined, from paged_prefill.c and
 * paged_decode.c, so a row's result is the same machine code's whichever kernel asks. */
#include "attention_chunk.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "softmax_exp.h"
#include "vector_lanes.h"

/* A value row's columns are summed a panel of four vectors at a time. */
#define PANEL (4 * LANES)

void scale_row(const float *src, float scale, float *dst, int64_t key_dim) {
    for (int64_t d = 0; d < key_dim; d++) dst[d] = src[d] * scale;
}

/* Each score is one row's dot product with one key (dot_lanes: a fixed order, whatever the row's
 * neighbours), the key's vectors read where the cache holds them. */
static inline __attribute__((always_inline)) void scores_of(
    const float *rows, int64_t nrows, int64_t rows_per_head, const float *key_cache,
    const int64_t *slots, int64_t count, int64_t krow, int64_t offset, float *scores,
    const int64_t KD) {
    for (int64_t j = 0; j < count; j++) {
        const float *k = key_cache + slots[j] * krow + offset;
        for (int64_t r = 0; r < nrows; r++)
            scores[r * CHUNK + j] = dot_lanes(rows + r * KD, k + r / rows_per_head * KD, KD);
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
    if (softcap > 0.0f)
        for (int64_t j = lo; j < hi; j++) w[j] = softcap * tanhf(w[j] / softcap);
    /* Positions outside [lo, hi) get -FLT_MAX, which loses every max and whose weight is 0. */
    for (int64_t j = 0; j < lo; j++) w[j] = -FLT_MAX;
    for (int64_t j = hi; j < CHUNK; j++) w[j] = -FLT_MAX;
    vec highest = load(w);
    for (int64_t j = LANES; j < CHUNK; j += LANES) highest = max_lanes(load(w + j), highest);
    const float chunk_top = lane_max(highest), top = chunk_top > *peak ? chunk_top : *peak;
    for (int64_t j = 0; j < CHUNK; j++) w[j] = softmax_exp(w[j] - top);
    /* Summed over the whole chunk, zeros included, so that each position's lane is fixed. */
    vec lanes = {0};
    for (int64_t j = 0; j < CHUNK; j += LANES) lanes += load(w + j);
    const float sum = lane_sum(lanes);
    *rescale = softmax_exp(*peak - top);
    *total = *total * *rescale + sum;
    *peak = top;
}

/* acc[r][col..col + NV*LANES) of ROWS consecutive rows (chunk_values; acc and weights rows VD
 * and CHUNK apart). Each value vector is read once for all the rows; each row's sums are the
 * same fused products in the same key order as when it is computed alone, so blocking rows
 * changes no bit (tests/executor/test_attention_invariance.py). */
static inline __attribute__((always_inline)) void values_of(
    const float *value_cache, const int64_t *slots, int64_t vrow, int64_t offset,
    const float *weights, const float *rescale, float *acc, int64_t VD, int64_t c0, int64_t j0, int64_t j1,
    int64_t col, const int NV, const int ROWS) {
    vec sum[2][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < NV; i++) sum[r][i] = load(acc + r * VD + col + i * LANES) * rescale[r];
    for (int64_t j = j0; j < j1; j++) {
        const float *v = value_cache + slots[j - c0] * vrow + offset + col;
        vec values[4];
        for (int i = 0; i < NV; i++) values[i] = load(v + i * LANES);
        for (int r = 0; r < ROWS; r++) {
            const vec w = broadcast(weights[r * CHUNK + j - c0]);
            for (int i = 0; i < NV; i++) sum[r][i] = fma_lanes(w, values[i], sum[r][i]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < NV; i++) store(acc + r * VD + col + i * LANES, sum[r][i]);
}

/* Every column of ROWS consecutive rows: whole panels, whole vectors, then the odd columns one
 * at a time, each in key order. */
static inline __attribute__((always_inline)) void rows_values(
    const float *value_cache, const int64_t *slots, int64_t vrow, int64_t offset,
    const float *weights, const float *rescale, float *acc, int64_t VD, int64_t c0, int64_t j0, int64_t j1,
    const int ROWS) {
    int64_t col = 0;
    for (; col + PANEL <= VD; col += PANEL)
        values_of(value_cache, slots, vrow, offset, weights, rescale, acc, VD, c0, j0, j1, col, 4, ROWS);
    for (; col + LANES <= VD; col += LANES)
        values_of(value_cache, slots, vrow, offset, weights, rescale, acc, VD, c0, j0, j1, col, 1, ROWS);
    for (int r = 0; r < ROWS; r++)
        for (int64_t d = col; d < VD; d++) {
            float sum = acc[r * VD + d] * rescale[r];
            for (int64_t j = j0; j < j1; j++)
                sum += weights[r * CHUNK + j - c0] * value_cache[slots[j - c0] * vrow + offset + d];
            acc[r * VD + d] = sum;
        }
}

void chunk_values(const float *value_cache, const int64_t *slots, int64_t kv_heads, int64_t kh,
                  int64_t value_dim, int64_t nrows, const float *weights, const float *rescale,
                  float *acc, int64_t c0, int64_t j0, int64_t j1) {
    const int64_t VD = value_dim, vrow = kv_heads * VD, offset = kh * VD;
    int64_t r = 0;
    for (; r + 2 <= nrows; r += 2)
        rows_values(value_cache, slots, vrow, offset, weights + r * CHUNK, rescale + r, acc + r * VD, VD, c0, j0,
                    j1, 2);
    if (r < nrows)
        rows_values(value_cache, slots, vrow, offset, weights + r * CHUNK, rescale + r, acc + r * VD, VD, c0, j0,
                    j1, 1);
}

static inline __attribute__((always_inline)) void values_by_position(
    const float *value_cache, const int64_t *slots, int64_t vrow, int64_t offset, int64_t nrows,
    int64_t rows_per_head, const float *weights, const float *rescale, float *acc, int64_t c0, int64_t j0,
    int64_t j1, const int64_t VD) {
    for (int64_t r = 0; r < nrows; r++) {
        float *out = acc + r * VD;
        int64_t d = 0;
        for (; d + LANES <= VD; d += LANES) store(out + d, load(out + d) * rescale[r]);
        for (; d < VD; d++) out[d] = out[d] * rescale[r];
    }
    for (int64_t j = j0; j < j1; j++) {
        const float *row = value_cache + slots[j - c0] * vrow + offset;
        for (int64_t r = 0; r < nrows; r++) {
            const float *v = row + r / rows_per_head * VD;
            const float w = weights[r * CHUNK + j - c0];
            const vec wide = broadcast(w);
            float *out = acc + r * VD;
            int64_t d = 0;
            for (; d + LANES <= VD; d += LANES) store(out + d, fma_lanes(wide, load(v + d), load(out + d)));
            for (; d < VD; d++) out[d] = out[d] + w * v[d];
        }
    }
}

void chunk_values_by_position(const float *value_cache, const int64_t *slots, int64_t kv_heads, int64_t kh0,
                              int64_t value_dim, int64_t nrows, int64_t rows_per_head, const float *weights,
                              const float *rescale, float *acc, int64_t c0, int64_t j0, int64_t j1) {
    const int64_t vrow = kv_heads * value_dim, offset = kh0 * value_dim;
    if (value_dim == 64)
        values_by_position(value_cache, slots, vrow, offset, nrows, rows_per_head, weights, rescale, acc, c0, j0, j1,
                           64);
    else if (value_dim == 128)
        values_by_position(value_cache, slots, vrow, offset, nrows, rows_per_head, weights, rescale, acc, c0, j0, j1,
                           128);
    else
        values_by_position(value_cache, slots, vrow, offset, nrows, rows_per_head, weights, rescale, acc, c0, j0, j1,
                           value_dim);
}

void finish_row(const float *acc, float total, float *dst, int64_t value_dim) {
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < value_dim; d++) dst[d] = acc[d] * inverse;
}
