/* Decode attention read straight from the paged KV cache (float32, CPU).
 *
 * One query token per sequence attends over that sequence's cached tokens, found through its
 * block table. A task is one sequence under one KV head (the query heads sharing it are its
 * rows): it walks the sequence's keys in chunks of CHUNK positions and does exactly what the
 * prefill kernel does for a row at that position (attention_chunk.h): the same arithmetic on the
 * same numbers, so a position decoded here and recomputed later by a prefill (failover,
 * preemption, migration) gets the same bits. Its value sums walk positions outermost
 * (chunk_values_by_position: each position's rows of every KV head read once, front to back),
 * where the prefill kernel's walk a head's rows in registers (chunk_values); each row gets the
 * same operations in the same order either way. Compiled and loaded by
 * executor_service/attention/decode_kernel.py.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_chunk.h"
#include "kernel_api.h"

/* Rows asked for at the start of each block (prefetch_slots): 2-8 measured alike on an AMD EPYC. */
#define PREFETCH_ROWS 4

typedef struct {
    const float *q, *key_cache, *value_cache, *sinks;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t heads, kv_heads, block_size, table_width, window;
    float scale, softcap;
} Args;

/* Blocks lie anywhere in the cache, and the hardware prefetcher stops at page boundaries: the
 * next chunk's blocks are asked for while this chunk is read. Into L2, not L1 (locality 2, not
 * 3): lines in flight beyond L1's miss buffers stall the loads (on an AMD EPYC, SmolLM2 shapes,
 * asking for the next block's rows took a decode layer from 36.7 ms to 22.3 ms). */
static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 64 / (int64_t)sizeof(float))
        __builtin_prefetch(row + i, 0, 2);
}

/* Asks for the rows of KV heads [kh0, kh1) in the count slots given, where a block starts: the
 * rows of a block lie one after another, which the hardware prefetcher follows by itself. */
static inline void prefetch_slots(const float *cache, int64_t row, const int64_t *slots,
                                  int64_t count, int64_t kh0, int64_t kh1, int64_t width) {
    int64_t run = 0;
    for (int64_t j = 0; j < count; j++) {
        run = j > 0 && slots[j] == slots[j - 1] + 1 ? run + 1 : 0;
        if (run < PREFETCH_ROWS) prefetch_row(cache + slots[j] * row + kh0 * width, (kh1 - kh0) * width);
    }
}

/* One task: sequence b under KV heads [kh0, kh1). 0, or 1 when its scratch memory could not be
 * had. Like the prefill kernel it walks the keys in chunks, but in two streams, as reading goes
 * fastest: every key chunk's scores first, then the softmax of each chunk in order, then every
 * value chunk, each chunk's rows asked for while the one before is used. Walking every KV head
 * of a position reads the cache rows front to back, about twice as fast as one head's rows
 * strided. */
static inline __attribute__((always_inline)) int task(const Args *a, int64_t b, int64_t kh0,
                                                      int64_t kh1, const int64_t KD, const int64_t VD) {
    const int64_t group = a->heads / a->kv_heads, nh = (kh1 - kh0) * group;
    const int64_t context = a->context_lens[b];
    const int64_t start = (a->window > 0 && context > a->window) ? context - a->window : 0;
    const int64_t first = start / CHUNK * CHUNK;
    const int64_t chunks = context > first ? (context - first + CHUNK - 1) / CHUNK : 0;
    const int64_t krow = a->kv_heads * KD, vrow = a->kv_heads * VD;
    /* queries [nh][KD], acc [nh][VD], per row: running maximum, running sum; weights
     * [chunks][nh][CHUNK] and rescale [chunks][nh]; the slots of every position from first. */
    float *queries = malloc(sizeof(float) * (size_t)(nh * (KD + VD + 2) + chunks * nh * (CHUNK + 1)));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(chunks * CHUNK + 1));
    if (queries == NULL || slots == NULL) {
        free(queries);
        free(slots);
        return 1;
    }
    float *acc = queries + nh * KD, *peak = acc + nh * VD, *total = peak + nh;
    float *weights = total + nh, *rescale = weights + chunks * nh * CHUNK;
    memset(acc, 0, sizeof(float) * (size_t)(nh * VD));
    for (int64_t r = 0; r < nh; r++) {
        const int64_t h = kh0 * group + r;
        scale_row(a->q + (b * a->heads + h) * KD, a->scale, queries + r * KD, KD);
        peak[r] = a->sinks != NULL ? a->sinks[h] : -FLT_MAX;
        total[r] = a->sinks != NULL ? 1.0f : 0.0f;
    }
    {
        const int64_t *blocks = a->block_table + b * a->table_width, bs = a->block_size;
        int64_t block = first / bs, offset = first % bs;
        for (int64_t p = first; p < context; p++) {
            slots[p - first] = blocks[block] * bs + offset;
            if (++offset == bs) offset = 0, block++;
        }
    }
    prefetch_slots(a->key_cache, krow, slots, context - first < CHUNK ? context - first : CHUNK, kh0, kh1, KD);
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = first + c * CHUNK, count = context - c0 < CHUNK ? context - c0 : CHUNK;
        const int64_t *next = slots + (c + 1 < chunks ? (c + 1) * CHUNK : 0);
        const int64_t ahead = c + 1 < chunks ? context - c0 - CHUNK : context - first;
        if (c + 1 < chunks)
            prefetch_slots(a->key_cache, krow, next, ahead < CHUNK ? ahead : CHUNK, kh0, kh1, KD);
        else
            prefetch_slots(a->value_cache, vrow, next, ahead < CHUNK ? ahead : CHUNK, kh0, kh1, VD);
        chunk_scores(queries, nh, group, a->key_cache, slots + c * CHUNK, count, a->kv_heads, kh0,
                     weights + c * nh * CHUNK, KD);
    }
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = first + c * CHUNK, count = context - c0 < CHUNK ? context - c0 : CHUNK;
        const int64_t lo = (start > c0 ? start : c0) - c0;
        for (int64_t r = 0; r < nh; r++)
            chunk_softmax(weights + (c * nh + r) * CHUNK, lo, count, a->softcap, peak + r, total + r,
                          rescale + c * nh + r);
    }
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = first + c * CHUNK, count = context - c0 < CHUNK ? context - c0 : CHUNK;
        const int64_t lo = (start > c0 ? start : c0) - c0;
        if (c + 1 < chunks) {
            const int64_t ahead = context - c0 - CHUNK;
            prefetch_slots(a->value_cache, vrow, slots + (c + 1) * CHUNK, ahead < CHUNK ? ahead : CHUNK, kh0, kh1, VD);
        }
        chunk_values_by_position(a->value_cache, slots + c * CHUNK, a->kv_heads, kh0, VD, nh, group,
                                 weights + c * nh * CHUNK, rescale + c * nh, acc, c0, c0 + lo, c0 + count);
    }
    for (int64_t r = 0; r < nh; r++)
        finish_row(acc + r * VD, total[r], a->out + (b * a->heads + kh0 * group + r) * VD, VD);
    free(queries);
    free(slots);
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
