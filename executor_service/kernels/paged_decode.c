/* Decode attention read straight from the paged KV cache (float32, CPU).
 *
 * One query token per sequence attends over that sequence's cached tokens, found through its
 * block table. Each (sequence, KV head) pair is one task: it walks the sequence's blocks, reads
 * every K and V row it needs once, for all the query heads that share the KV head, so nothing
 * is gathered into a padded copy first. Compiled and loaded by executor_service/decode_kernel.py.
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

typedef struct {
    const float *q, *key_cache, *value_cache, *sinks;
    const int64_t *block_table, *context_lens;
    float *out;
    int64_t heads, kv_heads, block_size, table_width, window;
    float scale, softcap;
} Args;

/* One (sequence, KV head) task; 0, or 1 when its scratch memory could not be had.
 * Inlined into copies where KD and VD are constants, so the loops over a head's width unroll
 * and the output accumulator stays in registers. */
static inline __attribute__((always_inline)) int task(const Args *a, int64_t b, int64_t kh,
                                                      const int64_t KD, const int64_t VD) {
    const int64_t group = a->heads / a->kv_heads;
    const int64_t context = a->context_lens[b];
    const int64_t start = (a->window > 0 && context > a->window) ? context - a->window : 0;
    const int64_t n = context - start;
    const int64_t bs = a->block_size;
    const int64_t *blocks = a->block_table + b * a->table_width;
    const int64_t krow = a->kv_heads * KD, vrow = a->kv_heads * VD;
    const float *queries = a->q + (b * a->heads + kh * group) * KD;
    float *scores = malloc(sizeof(float) * (size_t)(group * (n > 0 ? n : 1)));
    if (scores == NULL) return 1;

    /* Scores, block by block (no division per token), each K row read once for the group. */
    for (int64_t bi = start / bs; bi * bs < context; bi++) {
        const int64_t first = bi * bs > start ? bi * bs : start;
        const int64_t last = (bi + 1) * bs < context ? (bi + 1) * bs : context;
        const float *k = a->key_cache + (blocks[bi] * bs + first - bi * bs) * krow + kh * KD;
        for (int64_t pos = first; pos < last; pos++, k += krow) {
            for (int64_t g = 0; g < group; g++) {
                const float *qg = queries + g * KD;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < KD; d++) s += qg[d] * k[d];
                s *= a->scale;
                if (a->softcap > 0.0f) s = a->softcap * tanhf(s / a->softcap);
                scores[g * n + pos - start] = s;
            }
        }
    }

    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * n;
        /* Finite stand-ins for -inf: the library is built with -ffast-math. */
        const float sink = a->sinks != NULL ? a->sinks[kh * group + g] : -FLT_MAX;
        float peak = sink;
        for (int64_t t = 0; t < n; t++) peak = row[t] > peak ? row[t] : peak;
        float sum = a->sinks != NULL ? expf(sink - peak) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            row[t] = expf(row[t] - peak);
            sum += row[t];
        }
        float acc[VD];
        for (int64_t d = 0; d < VD; d++) acc[d] = 0.0f;
        for (int64_t bi = start / bs; bi * bs < context; bi++) {
            const int64_t first = bi * bs > start ? bi * bs : start;
            const int64_t last = (bi + 1) * bs < context ? (bi + 1) * bs : context;
            const float *v = a->value_cache + (blocks[bi] * bs + first - bi * bs) * vrow + kh * VD;
            for (int64_t pos = first; pos < last; pos++, v += vrow) {
                const float p = row[pos - start];
#pragma omp simd
                for (int64_t d = 0; d < VD; d++) acc[d] += p * v[d];
            }
        }
        const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
        float *dst = a->out + (b * a->heads + kh * group + g) * VD;
        for (int64_t d = 0; d < VD; d++) dst[d] = acc[d] * inverse;
    }
    free(scores);
    return 0;
}

static int task_64(const Args *a, int64_t b, int64_t kh) { return task(a, b, kh, 64, 64); }
static int task_128(const Args *a, int64_t b, int64_t kh) { return task(a, b, kh, 128, 128); }

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
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads) \
    reduction(| : failed)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            if (key_dim == 64 && value_dim == 64)
                failed |= task_64(&a, b, kh);
            else if (key_dim == 128 && value_dim == 128)
                failed |= task_128(&a, b, kh);
            else
                failed |= task(&a, b, kh, key_dim, value_dim);
        }
    }
    return failed;
}
