/* Attention over one chunk of keys: the arithmetic both attention kernels share (see
 * attention_chunk.h). Every function here is called, not inlined, from paged_prefill.c and
 * paged_decode.c, so a row's result is the same machine code's whichever kernel asks. */
#include "attention_chunk.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "prefetch_row.h"
#include "softmax_exp.h"
#include "vector_lanes.h"

/* A value row's columns are summed a panel of four vectors at a time. */
#define PANEL (4 * LANES)

/* The row ahead asks for with key j, if any. */
static inline void ask_ahead(const RowsAhead *ahead, int64_t j) {
    const int64_t i = j - ahead->first;
    if (i >= 0 && i < ahead->count) prefetch_row(ahead->rows + ahead->slots[i] * ahead->stride, ahead->floats);
}

void scale_row(const float *src, float scale, float *dst, int64_t key_dim) {
    for (int64_t d = 0; d < key_dim; d++) dst[d] = src[d] * scale;
}

#if LANES == 16
/* Keys scored together: one vector of scores per row. */
#define KEY_GROUP 16

/* dot_lanes' partial sums of one row and one key, added as it adds them: (p0 + p1) + (p2 + p3). */
static inline __attribute__((always_inline)) vec partials_of(const float *x, const float *y, const int64_t KD) {
    vec partial[4] = {{0}, {0}, {0}, {0}};
    for (int64_t d = 0; d < KD; d += 4 * LANES)
        for (int i = 0; i < 4; i++) partial[i] = fma_lanes(load(x + d + i * LANES), load(y + d + i * LANES), partial[i]);
    return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

/* One row's scores against 16 keys, each the bits of dot_lanes (which needs KD a whole number of
 * 4 * LANES): the 16 keys' partial vectors are added lane with lane as lane_sum adds one
 * vector's lanes (lanes 8 apart, then 4, 2, 1), the keys' vectors interleaved so that every add
 * serves several keys. out[j] = row . key j. */
static inline __attribute__((always_inline)) void scores_16(const float *x, const float *const *keys,
                                                            float *out, const int64_t KD) {
    __m512 halves[8], quarters[4], pairs[2];
    for (int k = 0; k < 8; k++) {
        const __m512 a = partials_of(x, keys[2 * k], KD), b = partials_of(x, keys[2 * k + 1], KD);
        /* lanes 0-7: key 2k's lane l + lane l + 8; lanes 8-15: key 2k + 1's. */
        halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int m = 0; m < 4; m++) {
        const __m512 a = halves[2 * m], b = halves[2 * m + 1];
        /* 128-bit lane i: key 4m + i's lanes l + l + 4 (l < 4). */
        quarters[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    }
    for (int m = 0; m < 2; m++) {
        const __m512 a = quarters[2 * m], b = quarters[2 * m + 1];
        /* 128-bit lane i: key 8m + i's lanes l + l + 2 (l < 2), then key 8m + 4 + i's. */
        pairs[m] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    }
    /* Lane 4i + k: key 4k + i's sum; put back in key order. */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                      _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
}
#endif

/* Each score is one row's dot product with one key (dot_lanes' bits: a fixed order, whatever the
 * row's neighbours), the key's vectors read where the cache holds them. Rows of one KV head
 * follow each other, rows_per_head of them. Where the width and the rows allow, keys are scored
 * 16 at a time (scores_16, the same bits, so which way a row goes changes nothing), with the
 * rows ahead asked for spread over the group's rows. */
static inline __attribute__((always_inline)) void scores_of(
    const float *rows, int64_t nrows, int64_t rows_per_head, const float *key_cache,
    const int64_t *slots, int64_t count, int64_t krow, int64_t offset, float *scores,
    const RowsAhead *ahead, int num_ahead, const int64_t KD) {
    int64_t j = 0;
#if LANES == 16
    /* With few rows (a decode task's) each key's vectors are read for too few of them to pay
     * for the interleaving: ~5 % slower there, ~1.5x faster over a prefill tile's 36 rows. */
    if (KD % (4 * LANES) == 0 && nrows >= KEY_GROUP) {
        for (; j + KEY_GROUP <= count; j += KEY_GROUP) {
            const float *keys[KEY_GROUP];
            for (int i = 0; i < KEY_GROUP; i++) keys[i] = key_cache + slots[j + i] * krow + offset;
            int64_t asked = 0;
            for (int64_t r = 0, in_head = 0; r < nrows; r++) {
                for (const int64_t due = (r + 1) * KEY_GROUP / nrows; asked < due; asked++)
                    for (int i = 0; i < num_ahead; i++) ask_ahead(ahead + i, j + asked);
                scores_16(rows + r * KD, keys, scores + r * CHUNK + j, KD);
                if (++in_head == rows_per_head) {
                    in_head = 0;
                    for (int i = 0; i < KEY_GROUP; i++) keys[i] += KD;
                }
            }
        }
    }
#endif
    for (; j < count; j++) {
        const float *k = key_cache + slots[j] * krow + offset;
        for (int64_t r = 0, in_head = 0; r < nrows; r++) {
            scores[r * CHUNK + j] = dot_lanes(rows + r * KD, k, KD);
            if (++in_head == rows_per_head) in_head = 0, k += KD;
        }
        for (int i = 0; i < num_ahead; i++) ask_ahead(ahead + i, j);
    }
}

void chunk_scores(const float *rows, int64_t nrows, int64_t rows_per_head, const float *key_cache,
                  const int64_t *slots, int64_t count, int64_t kv_heads, int64_t kh,
                  float *scores, int64_t key_dim, const RowsAhead *ahead, int num_ahead) {
    const int64_t krow = kv_heads * key_dim, offset = kh * key_dim;
    if (ahead == NULL) num_ahead = 0;
    if (key_dim == 64)
        scores_of(rows, nrows, rows_per_head, key_cache, slots, count, krow, offset, scores, ahead, num_ahead, 64);
    else if (key_dim == 128)
        scores_of(rows, nrows, rows_per_head, key_cache, slots, count, krow, offset, scores, ahead, num_ahead, 128);
    else
        scores_of(rows, nrows, rows_per_head, key_cache, slots, count, krow, offset, scores, ahead, num_ahead,
                  key_dim);
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
    int64_t j1, const RowsAhead *ahead, const int64_t VD) {
    for (int64_t r = 0; r < nrows; r++) {
        float *out = acc + r * VD;
        int64_t d = 0;
        for (; d + LANES <= VD; d += LANES) store(out + d, load(out + d) * rescale[r]);
        for (; d < VD; d++) out[d] = out[d] * rescale[r];
    }
    for (int64_t j = j0; j < j1; j++) {
        if (ahead != NULL) ask_ahead(ahead, j - c0);
        const float *v = value_cache + slots[j - c0] * vrow + offset;
        for (int64_t r = 0, in_head = 0; r < nrows; r++) {
            const float w = weights[r * CHUNK + j - c0];
            const vec wide = broadcast(w);
            float *out = acc + r * VD;
            int64_t d = 0;
            for (; d + LANES <= VD; d += LANES) store(out + d, fma_lanes(wide, load(v + d), load(out + d)));
            for (; d < VD; d++) out[d] = out[d] + w * v[d];
            if (++in_head == rows_per_head) in_head = 0, v += VD;
        }
    }
}

void chunk_values_by_position(const float *value_cache, const int64_t *slots, int64_t kv_heads, int64_t kh0,
                              int64_t value_dim, int64_t nrows, int64_t rows_per_head, const float *weights,
                              const float *rescale, float *acc, int64_t c0, int64_t j0, int64_t j1,
                              const RowsAhead *ahead) {
    const int64_t vrow = kv_heads * value_dim, offset = kh0 * value_dim;
    if (value_dim == 64)
        values_by_position(value_cache, slots, vrow, offset, nrows, rows_per_head, weights, rescale, acc, c0, j0, j1,
                           ahead, 64);
    else if (value_dim == 128)
        values_by_position(value_cache, slots, vrow, offset, nrows, rows_per_head, weights, rescale, acc, c0, j0, j1,
                           ahead, 128);
    else
        values_by_position(value_cache, slots, vrow, offset, nrows, rows_per_head, weights, rescale, acc, c0, j0, j1,
                           ahead, value_dim);
}

void finish_row(const float *acc, float total, float *dst, int64_t value_dim) {
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < value_dim; d++) dst[d] = acc[d] * inverse;
}
