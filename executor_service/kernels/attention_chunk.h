/* The arithmetic of attention over one chunk of keys, shared by the prefill and decode kernels
 * (paged_prefill.c, paged_decode.c) so that a query row gets the same bits whichever computes it:
 * a position first computed by a decode step and computed again by a prefill (after a failover,
 * a preemption or a migration) attends exactly as before. Both kernels only move data (find
 * slots, lay out rows) and call these functions, which are defined once (attention_chunk.c) and never
 * inlined into either, for every floating-point operation. The value sums come in two loop
 * orders (chunk_values, chunk_values_by_position) that give each row the same operations in the
 * same order; every product is fused explicitly and the kernels are built with
 * -ffp-contract=off, so the order of the loops cannot change a bit.
 *
 * A row's attention walks its keys in chunks of CHUNK positions that start at multiples of CHUNK
 * (absolute positions, so a row's chunks do not depend on how its sequence was split into steps):
 * per chunk, the rows' scores against the chunk's keys (chunk_scores), the online
 * softmax update of each row (chunk_softmax), then the rows' value sums (chunk_values); at the
 * end each row is divided by its softmax total (finish_row). */
#ifndef SPLITSERVE_ATTENTION_CHUNK_H
#define SPLITSERVE_ATTENTION_CHUNK_H
#include <stdint.h>

/* Keys per online-softmax step: the fastest of 32-128 on AMD EPYCs (SmolLM2 shapes). */
#define CHUNK 64

/* Cache rows to ask memory for while a chunk is read, one with each key: with key j of the chunk
 * (first <= j < first + count), the row of slot slots[j - first], `floats` floats from `rows`
 * on (rows of `stride` floats per slot). Asked for a fixed distance ahead, one row per key, the
 * reads form a steady stream; a chunk's rows asked for at once overflow the core's miss buffers
 * and stall it. Only memory traffic: no result depends on them. */
typedef struct {
    const float *rows;
    const int64_t *slots;
    int64_t first, count, stride, floats;
} RowsAhead;

/* queries[r][d] = src[r][d] * scale for one row of key_dim floats. */
void scale_row(const float *src, float scale, float *dst, int64_t key_dim);
/* scores[r][j] for rows r < nrows (rows KD floats apart, scores rows CHUNK apart) and keys
 * j < count: row r against the key row of KV head kh + r / rows_per_head in cache slot
 * slots[j], read where it lies (a position's heads one after another). ahead: NULL, or
 * num_ahead RowsAhead asked for along the way. */
void chunk_scores(const float *rows, int64_t nrows, int64_t rows_per_head, const float *key_cache,
                  const int64_t *slots, int64_t count, int64_t kv_heads, int64_t kh,
                  float *scores, int64_t key_dim, const RowsAhead *ahead, int num_ahead);
/* One row's online softmax over the chunk's scores w[lo, hi) (softcap > 0 caps them first):
 * w becomes the weights (0 outside [lo, hi)), and peak, total and rescale (the factor the
 * row's value sums so far are to be multiplied by) are updated. lo >= hi leaves the row as it
 * was (rescale 1, every weight 0). */
void chunk_softmax(float *w, int64_t lo, int64_t hi, float softcap, float *peak, float *total,
                   float *rescale);
/* acc[r][0..VD) = acc[r] * rescale[r] + sum over j in [j0, j1), in order, of weights[r][j - c0]
 * * V[j], for rows r < nrows (acc rows VD apart, weights rows CHUNK apart), where V[j] is the
 * value row of KV head kh in cache slot slots[j - c0]. Row by row: a row's sums do not depend
 * on the rows beside it. */
void chunk_values(const float *value_cache, const int64_t *slots, int64_t kv_heads, int64_t kh,
                  int64_t value_dim, int64_t nrows, const float *weights, const float *rescale,
                  float *acc, int64_t c0, int64_t j0, int64_t j1);
/* chunk_values for rows of several KV heads (row r reads head kh0 + r / rows_per_head), walking
 * positions outermost so that each position's value rows are read once, front to back, as the
 * decode kernel streams them; acc stays in memory between positions. Each row gets exactly
 * chunk_values' operations in the same order (its rescale, then one fused product per key in
 * key order, its odd columns multiplied and added apart), so the bits are the same. ahead: NULL,
 * or rows asked for along the way (keys counted from c0). */
void chunk_values_by_position(const float *value_cache, const int64_t *slots, int64_t kv_heads, int64_t kh0,
                              int64_t value_dim, int64_t nrows, int64_t rows_per_head, const float *weights,
                              const float *rescale, float *acc, int64_t c0, int64_t j0, int64_t j1,
                              const RowsAhead *ahead);
/* dst[0..VD) = acc / total (0 where the total is 0). */
void finish_row(const float *acc, float total, float *dst, int64_t value_dim);
#endif
