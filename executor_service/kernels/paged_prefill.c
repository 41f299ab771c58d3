/* Prefill attention read straight from the paged KV cache (float32, CPU).
 *
 * Each sequence's new query tokens attend causally over its whole context (cached tokens and
 * the new ones, whose K/V are already written), found through its cache slots. A task (one
 * OpenMP loop) is one tile of TILE query tokens of one sequence under one KV head (the query
 * heads sharing it are its rows). It walks the key chunks its tile can see with an online
 * softmax, through attention_chunk.c's functions, as the decode kernel does for one row: a
 * row's result depends on its position and its sequence's K/V only, not on its tile, its
 * step's other sequences, or how its prompt was cut into chunks.
 * Built with the decode kernel into one library by executor_service/kernels/cpu_kernels.py.
 *
 * Layouts:
 *   q            [tokens, heads, key_dim], token rows q_stride floats apart (heads contiguous)
 *   key_cache    [slots, kv_heads, key_dim]      value_cache [slots, kv_heads, value_dim]
 *   token_start, num_new, num_cached, slot_start   [seqs] int64: sequence s's queries are
 *                tokens [token_start, token_start + num_new) at positions [num_cached,
 *                num_cached + num_new); the slot of its context position p is
 *                slots[slot_start + p]
 *   sinks        [heads] or NULL                 one extra logit per head, joins the softmax only
 *   out          [tokens, heads, value_dim]      only the rows of the given sequences are written
 * Query heads sharing a KV head are consecutive (transformers' repeat_kv order). window > 0
 * keeps the last `window` positions up to each query's own; softcap > 0 applies
 * softcap * tanh(score / softcap) to the scaled scores.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_chunk.h"

/* Query tokens per task: the fastest of 8-36 on AMD EPYCs (SmolLM2 shapes: 7 sequences of
 * 98-500 tokens, 9/3 heads of 64) when the kernel multiplied register blocks of rows; not
 * measured again since each row is scored against 16 keys at a time (attention_chunk.c, which
 * needs 16 rows or more a tile to do so). A row's result does
 * not depend on its tile: chunks start at multiples of CHUNK, and chunks a row cannot see leave
 * it unchanged (attention_chunk.h). */
#define TILE 18

typedef struct {
    const float *q, *key_cache, *value_cache, *sinks;
    const int64_t *token_start, *num_new, *num_cached, *slot_start, *slots;
    float *out;
    int64_t q_stride, heads, kv_heads, value_dim, window;
    float scale, softcap;
} Args;

/* One task: tokens [t0, t0 + TILE) of sequence s under KV head kh. 0, or 1 without memory. */
static inline __attribute__((always_inline)) int attend(const Args *a, int64_t s, int64_t t0,
                                                        int64_t kh, const int64_t KD) {
    const int64_t VD = a->value_dim, group = a->heads / a->kv_heads;
    const int64_t tokens = a->num_new[s] - t0 < TILE ? a->num_new[s] - t0 : TILE;
    const int64_t rows = tokens * group;
    /* queries [rows][KD], weights [rows][CHUNK], acc [rows][VD], then per row: running maximum,
     * running sum, rescale, and the first and last key it may see. */
    float *queries = malloc(sizeof(float) * (size_t)(rows * (KD + CHUNK + VD + 5)));
    if (queries == NULL) return 1;
    float *weights = queries + rows * KD, *acc = weights + rows * CHUNK;
    float *peak = acc + rows * VD, *total = peak + rows, *rescale = total + rows;
    int64_t *bounds = malloc(sizeof(int64_t) * (size_t)(2 * rows));
    if (bounds == NULL) {
        free(queries);
        return 1;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * VD));
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, h = kh * group + r % group;
        scale_row(a->q + (a->token_start[s] + t0 + t) * a->q_stride + h * KD, a->scale,
                  queries + r * KD, KD);
        /* Finite stand-ins for -inf, as the decode kernel starts its rows. */
        peak[r] = a->sinks != NULL ? a->sinks[h] : -FLT_MAX;
        total[r] = a->sinks != NULL ? 1.0f : 0.0f;
        const int64_t end = a->num_cached[s] + t0 + t + 1;
        bounds[2 * r] = a->window > 0 && end > a->window ? end - a->window : 0;
        bounds[2 * r + 1] = end;
    }
    const int64_t first_key = bounds[0], last_key = bounds[2 * (rows - 1) + 1];
    const int64_t *slots = a->slots + a->slot_start[s];
    const int64_t context = a->num_cached[s] + a->num_new[s];
    for (int64_t c = first_key / CHUNK; c * CHUNK < last_key; c++) {
        const int64_t c0 = c * CHUNK;
        chunk_scores(queries, rows, rows, a->key_cache, slots + c0, context - c0 < CHUNK ? context - c0 : CHUNK,
                     a->kv_heads, kh, weights, KD, NULL, 0);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t lo = (bounds[2 * r] > c0 ? bounds[2 * r] : c0) - c0;
            const int64_t hi = (bounds[2 * r + 1] < c0 + CHUNK ? bounds[2 * r + 1] : c0 + CHUNK) - c0;
            chunk_softmax(weights + r * CHUNK, lo, hi, a->softcap, peak + r, total + r, rescale + r);
        }
        const int64_t j0 = (first_key > c0 ? first_key : c0), j1 = (last_key < c0 + CHUNK ? last_key : c0 + CHUNK);
        chunk_values(a->value_cache, slots + c0, a->kv_heads, kh, VD, rows, weights, rescale, acc,
                     c0, j0, j1);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, h = kh * group + r % group;
        finish_row(acc + r * VD, total[r], a->out + ((a->token_start[s] + t0 + t) * a->heads + h) * VD, VD);
    }
    free(bounds);
    free(queries);
    return 0;
}

static int attend_64(const Args *a, int64_t s, int64_t t0, int64_t kh) {
    return attend(a, s, t0, kh, 64);
}
static int attend_128(const Args *a, int64_t s, int64_t t0, int64_t kh) {
    return attend(a, s, t0, kh, 128);
}
static int attend_any(const Args *a, int64_t s, int64_t t0, int64_t kh, int64_t KD) {
    return attend(a, s, t0, kh, KD);
}

/* Returns 0, or 1 when scratch memory could not be had (out is then incomplete). */
int paged_prefill_attention(const float *q, const float *key_cache, const float *value_cache,
                            const int64_t *token_start, const int64_t *num_new,
                            const int64_t *num_cached, const int64_t *slot_start,
                            const int64_t *slots, const float *sinks, float *out, int64_t seqs,
                            int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t key_dim,
                            int64_t value_dim, float scale, int64_t window, float softcap,
                            int num_threads) {
    int64_t *task_start = malloc(sizeof(int64_t) * (size_t)(seqs + 1));
    if (task_start == NULL) return 1;
    task_start[0] = 0;
    for (int64_t s = 0; s < seqs; s++)
        task_start[s + 1] = task_start[s] + (num_new[s] + TILE - 1) / TILE * kv_heads;
    const Args a = {q,          key_cache, value_cache, sinks,    token_start, num_new,
                    num_cached, slot_start, slots,      out,      q_stride,    heads,
                    kv_heads,   value_dim, window,      scale,    softcap};
    int failed = 0;
    /* Later tiles see more keys: taking tasks from the end puts the longest first. */
    const int64_t tasks = task_start[seqs];
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int64_t i = 0; i < tasks; i++) {
        const int64_t task = tasks - 1 - i;
        int64_t s = 0;
        while (task_start[s + 1] <= task) s++;
        const int64_t within = task - task_start[s];
        const int64_t t0 = within / kv_heads * TILE, kh = within % kv_heads;
        if (key_dim == 64)
            failed |= attend_64(&a, s, t0, kh);
        else if (key_dim == 128)
            failed |= attend_128(&a, s, t0, kh);
        else
            failed |= attend_any(&a, s, t0, kh, key_dim);
    }
    free(task_start);
    return failed;
}
