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
#include "prefetch_row.h"

typedef struct {
    const float *q, *key_cache, *value_cache, *sinks;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t heads, kv_heads, block_size, table_width, window;
    float scale, softcap;
} Args;

/* Positions a row is asked for before it is read (RowsAhead): about a block ahead, as the
 * hardware prefetcher, which stops at page boundaries, cannot follow blocks that lie anywhere. On
 * an AMD EPYC, two threads, 32 sequences of 160-640 positions, each of 8 layers' caches streamed
 * from memory, this took a layer's decode attention from ~1,450 to ~850 us (random Llama shapes)
 * and from ~1,420 to ~680 us (SmolLM2's), where asking for each chunk's rows at its start had
 * been no faster than asking for none (8, 16 and 32 positions ahead measured alike). */
#define AHEAD 16

static inline int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* Asks for the rows of the count slots given, `floats` floats each from `rows` on. */
static inline void prefetch_slots(const float *rows, int64_t stride, const int64_t *slots, int64_t count,
                                  int64_t floats) {
    for (int64_t j = 0; j < count; j++) prefetch_row(rows + slots[j] * stride, floats);
}

/* One task: sequence b under KV heads [kh0, kh1). 0, or 1 when its scratch memory could not be
 * had. Like the prefill kernel it walks the keys in chunks, but in two streams, as reading goes
 * fastest: every key chunk's scores first, then the softmax of each chunk in order, then every
 * value chunk, each row asked for AHEAD positions before it is read. Walking every KV head
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
    /* The rows are asked for as one stream, every K row then every V row, AHEAD positions before
     * they are read: the first AHEAD now, then one with each key read. */
    const int64_t n = context - first, kfloats = (kh1 - kh0) * KD, vfloats = (kh1 - kh0) * VD;
    const float *krows = a->key_cache + kh0 * KD, *vrows = a->value_cache + kh0 * VD;
    prefetch_slots(krows, krow, slots, n < AHEAD ? n : AHEAD, kfloats);
    prefetch_slots(vrows, vrow, slots, clamp(AHEAD - n, 0, n), vfloats);
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = first + c * CHUNK, count = context - c0 < CHUNK ? context - c0 : CHUNK;
        /* Key j of this chunk asks for stream position c * CHUNK + j + AHEAD. */
        const int64_t p0 = c * CHUNK + AHEAD, kcount = clamp(n - p0, 0, count);
        const int64_t vstart = p0 + kcount - n, vcount = clamp((n < AHEAD ? n : AHEAD) - vstart, 0, count - kcount);
        const RowsAhead ahead[2] = {
            {krows, slots + (kcount > 0 ? p0 : 0), 0, kcount, krow, kfloats},
            {vrows, slots + (vcount > 0 ? vstart : 0), kcount, vcount, vrow, vfloats},
        };
        chunk_scores(queries, nh, group, a->key_cache, slots + c * CHUNK, count, a->kv_heads, kh0,
                     weights + c * nh * CHUNK, KD, ahead, 2);
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
        const int64_t p0 = c * CHUNK + AHEAD, vcount = clamp(n - p0, 0, count);
        const RowsAhead ahead = {vrows, slots + (vcount > 0 ? p0 : 0), 0, vcount, vrow, vfloats};
        chunk_values_by_position(a->value_cache, slots + c * CHUNK, a->kv_heads, kh0, VD, nh, group,
                                 weights + c * nh * CHUNK, rescale + c * nh, acc, c0, c0 + lo, c0 + count, &ahead);
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
