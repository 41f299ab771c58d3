/* Decode attention read straight from the paged KV cache (float32, CPU).
 *
 * One query token per sequence attends over that sequence's cached tokens, found through its
 * block table. A task is one sequence (or one of its KV heads, when sequences are too few to
 * occupy every thread): it walks the sequence's blocks and reads every K and V row it needs
 * once, for all the query heads that share each KV head, so nothing is gathered into a padded
 * copy first. Compiled and loaded by executor_service/decode_kernel.py.
 *
 * Layouts (all contiguous):
 *   q            [batch, heads, key_dim]
 *   key_cache    [slots, kv_heads, key_dim]     slot = block * block_size + offset
 *   value_cache  [slots, kv_heads, value_dim]
 *   block_table  [batch, table_width]           int64 block ids, row b for sequence b
 *   context_lens [batch]                        int64, tokens each sequence attends over
 *   sinks        [heads] or NULL                one extra logit per head, joins the softmax only
 *   out          [batch, heads, value_dim]
 * Query heads sharing a KV head are consecutive (transformers' repeat_kv order).
 * window > 0 keeps only the last `window` positions; softcap > 0 applies
 * softcap * tanh(score / softcap) to the scaled scores, as transformers' eager attention does.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernel_api.h"
#include "softmax_exp.h"

typedef struct {
    const float *q, *key_cache, *value_cache, *sinks;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t heads, kv_heads, block_size, table_width, window;
    float scale, softcap;
} Args;

/* Blocks lie anywhere in the cache, and the hardware prefetcher stops at page boundaries: the
 * same row of the sequence's next block is asked for while this block's row is read, one block
 * (block_size rows) ahead of its use. Into L2, not L1 (locality 2, not 3): a block's worth of
 * lines in flight overflows L1's miss buffers, and on an AMD EPYC (2 threads, SmolLM2 shapes,
 * 590 MB of K/V) that took the kernel from 36.7 ms to 22.3 ms, 16 to 26 GB/s. */
static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 64 / (int64_t)sizeof(float))
        __builtin_prefetch(row + i, 0, 2);
}

/* Positions [first, last) of block bi that a sequence attends to (its window starts at
 * `start`, its context ends at `context`), the first of their rows in `cache` (rows of `row`
 * floats, from float `col` on), and the same row of the sequence's next block, or NULL when
 * the context ends in this block. */
typedef struct {
    int64_t first, last;
    const float *rows, *next;
} BlockSpan;

static inline BlockSpan block_span(const float *cache, const int64_t *blocks, int64_t bi,
                                   int64_t bs, int64_t start, int64_t context, int64_t row,
                                   int64_t col) {
    BlockSpan span;
    span.first = bi * bs > start ? bi * bs : start;
    span.last = (bi + 1) * bs < context ? (bi + 1) * bs : context;
    const int64_t offset = span.first - bi * bs;
    span.rows = cache + (blocks[bi] * bs + offset) * row + col;
    span.next = span.last < context ? cache + (blocks[bi + 1] * bs + offset) * row + col : NULL;
    return span;
}

/* One task: sequence b, KV heads [kh0, kh1); 0, or 1 when its scratch memory could not be had.
 * Walking every KV head of a token before the next token reads each block's K and V rows front
 * to back, which streams from memory about twice as fast as reading one head's rows strided.
 * Inlined into copies where KD and VD are constants, so the loops over a head's width unroll. */
static inline __attribute__((always_inline)) int task(const Args *a, int64_t b, int64_t kh0,
                                                      int64_t kh1, const int64_t KD,
                                                      const int64_t VD) {
    const int64_t group = a->heads / a->kv_heads;
    const int64_t context = a->context_lens[b];
    const int64_t start = (a->window > 0 && context > a->window) ? context - a->window : 0;
    const int64_t n = context - start;
    const int64_t bs = a->block_size;
    const int64_t *blocks = a->block_table + b * a->table_width;
    const int64_t krow = a->kv_heads * KD, vrow = a->kv_heads * VD;
    const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;
    const float *queries = a->q + (b * a->heads + h0) * KD;
    /* scores [nh][n], acc [nh][VD], inverse [nh] */
    float *scores = malloc(sizeof(float) * (size_t)(nh * (n > 0 ? n : 1) + nh * VD + nh));
    if (scores == NULL) return 1;
    float *acc = scores + nh * (n > 0 ? n : 1), *inverse = acc + nh * VD;
    /* The first blocks of both passes have no block before them to prefetch them. */
    if (n > 0) {
        const BlockSpan k0 =
            block_span(a->key_cache, blocks, start / bs, bs, start, context, krow, kh0 * KD);
        const BlockSpan v0 =
            block_span(a->value_cache, blocks, start / bs, bs, start, context, vrow, kh0 * VD);
        for (int64_t t = 0; t < k0.last - k0.first; t++) {
            prefetch_row(k0.rows + t * krow, (kh1 - kh0) * KD);
            prefetch_row(v0.rows + t * vrow, (kh1 - kh0) * VD);
        }
    }

    for (int64_t bi = start / bs; bi * bs < context; bi++) {
        const BlockSpan span =
            block_span(a->key_cache, blocks, bi, bs, start, context, krow, kh0 * KD);
        const float *k = span.rows;
        for (int64_t pos = span.first; pos < span.last; pos++, k += krow) {
            if (span.next != NULL)
                prefetch_row(span.next + (pos - span.first) * krow, (kh1 - kh0) * KD);
            for (int64_t h = 0; h < nh; h++) {
                const float *qh = queries + h * KD, *kh = k + (h / group) * KD;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < KD; d++) s += qh[d] * kh[d];
                s *= a->scale;
                if (a->softcap > 0.0f) s = a->softcap * tanhf(s / a->softcap);
                scores[h * n + pos - start] = s;
            }
        }
    }

    for (int64_t h = 0; h < nh; h++) {
        float *row = scores + h * n;
        /* Finite stand-ins for -inf: the library is built with -ffast-math. */
        const float sink = a->sinks != NULL ? a->sinks[h0 + h] : -FLT_MAX;
        float peak = sink;
        for (int64_t t = 0; t < n; t++) peak = row[t] > peak ? row[t] : peak;
        float sum = a->sinks != NULL ? expf(sink - peak) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            row[t] = softmax_exp(row[t] - peak);
            sum += row[t];
        }
        inverse[h] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }

    for (int64_t i = 0; i < nh * VD; i++) acc[i] = 0.0f;
    for (int64_t bi = start / bs; bi * bs < context; bi++) {
        const BlockSpan span =
            block_span(a->value_cache, blocks, bi, bs, start, context, vrow, kh0 * VD);
        const float *v = span.rows;
        for (int64_t pos = span.first; pos < span.last; pos++, v += vrow) {
            if (span.next != NULL)
                prefetch_row(span.next + (pos - span.first) * vrow, (kh1 - kh0) * VD);
            for (int64_t h = 0; h < nh; h++) {
                const float p = scores[h * n + pos - start];
                const float *vh = v + (h / group) * VD;
                float *out = acc + h * VD;
#pragma omp simd
                for (int64_t d = 0; d < VD; d++) out[d] += p * vh[d];
            }
        }
    }
    float *dst = a->out + (b * a->heads + h0) * VD;
    for (int64_t h = 0; h < nh; h++)
        for (int64_t d = 0; d < VD; d++) dst[h * VD + d] = acc[h * VD + d] * inverse[h];
    free(scores);
    return 0;
}

static int task_64(const Args *a, int64_t b, int64_t kh0, int64_t kh1) {
    return task(a, b, kh0, kh1, 64, 64);
}
static int task_128(const Args *a, int64_t b, int64_t kh0, int64_t kh1) {
    return task(a, b, kh0, kh1, 128, 128);
}

/* Returns 0, or 1 when scratch memory could not be had (out is then incomplete). */
int paged_decode_attention(const float *q, const float *key_cache, const float *value_cache,
                           const int64_t *block_table, const int64_t *context_lens,
                           const float *sinks, float *out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                           int64_t block_size, int64_t table_width, float scale, int64_t window,
                           float softcap, int num_threads) {
    const Args a = {q,     key_cache, value_cache, sinks,       block_table, context_lens,
                    out,   heads,     kv_heads,    block_size,  table_width, window,
                    scale, softcap};
    /* A task takes all KV heads of its sequence when there are sequences enough to keep every
     * thread busy, else one KV head, so a lone long sequence still spreads over the threads. */
    const int64_t span = batch >= 2 * (int64_t)num_threads ? kv_heads : 1;
    const int64_t per_sequence = kv_heads / span;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int64_t t = 0; t < batch * per_sequence; t++) {
        const int64_t b = t / per_sequence, kh0 = (t % per_sequence) * span, kh1 = kh0 + span;
        if (key_dim == 64 && value_dim == 64)
            failed |= task_64(&a, b, kh0, kh1);
        else if (key_dim == 128 && value_dim == 128)
            failed |= task_128(&a, b, kh0, kh1);
        else
            failed |= task(&a, b, kh0, kh1, key_dim, value_dim);
    }
    return failed;
}
