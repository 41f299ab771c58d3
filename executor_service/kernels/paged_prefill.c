/* Prefill attention read straight from the paged KV cache (float32, CPU).
 *
 * Each sequence's new query tokens attend causally over its whole context (cached tokens and
 * the new ones, whose K/V are already written), found through its cache slots. Two phases,
 * each one OpenMP loop:
 *   1. pack: every sequence's keys, per KV head, in chunks of CHUNK keys stored transposed
 *      ([key_dim][CHUNK]), so the score product reads whole vectors of keys. Packed once per
 *      call and shared by all the query tiles of the sequence.
 *   2. attend: a task is one tile of TILE query tokens of one sequence under one KV head (the
 *      query heads sharing it are its rows). It walks the key chunks its tile can see with an
 *      online softmax: scores by a register-blocked product of ROWS query rows by 4 vectors of
 *      keys, then the running maximum and sum, then the value product of ROWS rows by up to
 *      4 vectors of value columns, read from the cache rows where they lie.
 * Built with the decode kernel into one library by executor_service/cpu_kernels.py.
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
 * softcap * tanh(score / softcap) to the scaled scores. value_dim must be a multiple of 16.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "softmax_exp.h"

/* One native vector, and how many rows a micro-kernel keeps in registers: ROWS x 4 vector
 * accumulators plus 4 loaded vectors must fit the register file (32 registers with AVX-512 and
 * on AArch64, 16 with AVX and SSE). */
#if defined(__AVX512F__)
#define LANES 16
#define ROWS 6
#elif defined(__AVX__)
#define LANES 8
#define ROWS 3
#elif defined(__aarch64__)
#define LANES 4
#define ROWS 6
#else
#define LANES 4
#define ROWS 3
#endif
#define PANEL (4 * LANES)
/* Keys per online-softmax step and query tokens per task: the fastest of 32-128 keys and 8-36
 * tokens on AMD EPYCs (SmolLM2 shapes: 7 sequences of 98-500 tokens, 9/3 heads of 64). A tile
 * of 18 tokens is a whole number of ROWS-row blocks for query-head groups of 1, 2, 3, 4 and 6:
 * 16 padded random Llama's 32 rows (groups of 2) to 36. A 2,048-token step's 8 layers took
 * 29.3 -> 24.8 ms there (groups of 3: 27.8 -> 25.9). A row's result does not depend on its
 * tile: chunks start at multiples of CHUNK, and chunks a row cannot see leave it unchanged. */
#define CHUNK 64
#define TILE 18
_Static_assert(CHUNK % PANEL == 0, "the score product reads whole panels of keys");

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }

typedef struct {
    const float *q, *key_cache, *value_cache, *sinks;
    const int64_t *token_start, *num_new, *num_cached, *slot_start, *slots;
    /* first packed chunk of each sequence (chunks of all sequences counted one after another) */
    const int64_t *chunk_start;
    float *out, *packed;
    int64_t q_stride, heads, kv_heads, value_dim, window;
    float scale, softcap;
} Args;

static inline int64_t chunks_of(int64_t context) { return (context + CHUNK - 1) / CHUNK; }

/* Chunk c of sequence s under KV head kh: [key_dim][CHUNK] floats. */
static inline float *packed_chunk(const Args *a, int64_t s, int64_t kh, int64_t c,
                                  const int64_t KD) {
    const int64_t context = a->num_cached[s] + a->num_new[s];
    const int64_t index = a->chunk_start[s] * a->kv_heads + kh * chunks_of(context) + c;
    return a->packed + index * KD * CHUNK;
}

static inline __attribute__((always_inline)) void pack(const Args *a, int64_t s, int64_t kh,
                                                       int64_t c, const int64_t KD) {
    const int64_t context = a->num_cached[s] + a->num_new[s];
    float *dst = packed_chunk(a, s, kh, c, KD);
    const int64_t first = c * CHUNK;
    const int64_t count = context - first < CHUNK ? context - first : CHUNK;
    const int64_t krow = a->kv_heads * KD;
    for (int64_t j = 0; j < count; j++) {
        const float *src = a->key_cache + a->slots[a->slot_start[s] + first + j] * krow + kh * KD;
        for (int64_t d = 0; d < KD; d++) dst[d * CHUNK + j] = src[d];
    }
    /* Keys past the context are never attended, but the product reads whole panels. */
    for (int64_t d = 0; count < CHUNK && d < KD; d++)
        memset(dst + d * CHUNK + count, 0, sizeof(float) * (size_t)(CHUNK - count));
}

/* scores[r][0..CHUNK) = sum_d rows[r][d] * keys[d][.] for ROWS rows. */
static inline __attribute__((always_inline)) void score_rows(const float *rows,
                                                             const float *keys, float *scores,
                                                             const int64_t KD) {
    for (int64_t p = 0; p < CHUNK; p += PANEL) {
        vec acc[ROWS][4] = {{{0}}};
        for (int64_t d = 0; d < KD; d++) {
            const float *k = keys + d * CHUNK + p;
            const vec k0 = load(k), k1 = load(k + LANES), k2 = load(k + 2 * LANES),
                      k3 = load(k + 3 * LANES);
            for (int r = 0; r < ROWS; r++) {
                const float x = rows[r * KD + d];
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
                acc[r][2] += x * k2;
                acc[r][3] += x * k3;
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int i = 0; i < 4; i++) store(scores + r * CHUNK + p + i * LANES, acc[r][i]);
    }
}

/* acc[r][col..col + NV*LANES) = acc * rescale[r] + sum_j weights[r][j] * V[j], j in [j0, j1). */
static inline __attribute__((always_inline)) void weigh_values(
    const Args *a, const int64_t *slots, int64_t kh, const float *weights, const float *rescale,
    float *acc, int64_t j0, int64_t j1, int64_t col, const int NV) {
    const int64_t VD = a->value_dim, vrow = a->kv_heads * VD;
    vec sum[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < NV; i++) sum[r][i] = load(acc + r * VD + col + i * LANES) * rescale[r];
    for (int64_t j = j0; j < j1; j++) {
        const float *v = a->value_cache + slots[j] * vrow + kh * VD + col;
        vec values[4];
        for (int i = 0; i < NV; i++) values[i] = load(v + i * LANES);
        for (int r = 0; r < ROWS; r++) {
            const float w = weights[r * CHUNK + j - j0];
            for (int i = 0; i < NV; i++) sum[r][i] += w * values[i];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < NV; i++) store(acc + r * VD + col + i * LANES, sum[r][i]);
}

/* One task: tokens [t0, t0 + TILE) of sequence s under KV head kh. 0, or 1 without memory. */
static inline __attribute__((always_inline)) int attend(const Args *a, int64_t s, int64_t t0,
                                                        int64_t kh, const int64_t KD) {
    const int64_t VD = a->value_dim, group = a->heads / a->kv_heads;
    const int64_t tokens = a->num_new[s] - t0 < TILE ? a->num_new[s] - t0 : TILE;
    const int64_t rows = tokens * group, padded = (rows + ROWS - 1) / ROWS * ROWS;
    /* queries [padded][KD], weights [padded][CHUNK], acc [padded][VD], then per row: running
     * maximum, running sum, rescale, and the first and last key it may see. */
    float *queries = malloc(sizeof(float) * (size_t)(padded * (KD + CHUNK + VD + 5)));
    if (queries == NULL) return 1;
    float *weights = queries + padded * KD, *acc = weights + padded * CHUNK;
    float *peak = acc + padded * VD, *total = peak + padded, *rescale = total + padded;
    int64_t *bounds = malloc(sizeof(int64_t) * (size_t)(2 * padded));
    if (bounds == NULL) {
        free(queries);
        return 1;
    }
    memset(queries, 0, sizeof(float) * (size_t)(padded * KD));
    memset(acc, 0, sizeof(float) * (size_t)(padded * VD));
    for (int64_t r = 0; r < padded; r++) {
        const int64_t t = r / group, h = kh * group + r % group;
        if (r >= rows) {
            peak[r] = 0.0f, total[r] = 0.0f, bounds[2 * r] = bounds[2 * r + 1] = 0;
            continue;
        }
        const float *src = a->q + (a->token_start[s] + t0 + t) * a->q_stride + h * KD;
        for (int64_t d = 0; d < KD; d++) queries[r * KD + d] = src[d] * a->scale;
        /* Finite stand-ins for -inf: the library is built with -ffast-math. */
        peak[r] = a->sinks != NULL ? a->sinks[h] : -FLT_MAX;
        total[r] = a->sinks != NULL ? 1.0f : 0.0f;
        const int64_t end = a->num_cached[s] + t0 + t + 1;
        bounds[2 * r] = a->window > 0 && end > a->window ? end - a->window : 0;
        bounds[2 * r + 1] = end;
    }
    const int64_t first_key = bounds[0], last_key = bounds[2 * (rows - 1) + 1];
    const int64_t *slots = a->slots + a->slot_start[s];
    for (int64_t c = first_key / CHUNK; c * CHUNK < last_key; c++) {
        const int64_t c0 = c * CHUNK;
        const float *keys = packed_chunk(a, s, kh, c, KD);
        for (int64_t r = 0; r < padded; r += ROWS)
            score_rows(queries + r * KD, keys, weights + r * CHUNK, KD);
        for (int64_t r = 0; r < padded; r++) {
            float *w = weights + r * CHUNK;
            const int64_t lo = (bounds[2 * r] > c0 ? bounds[2 * r] : c0) - c0;
            const int64_t hi = (bounds[2 * r + 1] < c0 + CHUNK ? bounds[2 * r + 1] : c0 + CHUNK) - c0;
            if (lo >= hi) {
                memset(w, 0, sizeof(float) * CHUNK);
                rescale[r] = 1.0f;
                continue;
            }
            float top = peak[r];
            for (int64_t j = lo; j < hi; j++) {
                if (a->softcap > 0.0f) w[j] = a->softcap * tanhf(w[j] / a->softcap);
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
            rescale[r] = expf(peak[r] - top);
            total[r] = total[r] * rescale[r] + sum;
            peak[r] = top;
        }
        const int64_t j0 = (first_key > c0 ? first_key : c0), j1 = (last_key < c0 + CHUNK ? last_key : c0 + CHUNK);
        for (int64_t r = 0; r < padded; r += ROWS) {
            int64_t col = 0;
            for (; col + PANEL <= VD; col += PANEL)
                weigh_values(a, slots, kh, weights + r * CHUNK + (j0 - c0), rescale + r,
                             acc + r * VD, j0, j1, col, 4);
            for (; col < VD; col += LANES)
                weigh_values(a, slots, kh, weights + r * CHUNK + (j0 - c0), rescale + r,
                             acc + r * VD, j0, j1, col, 1);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, h = kh * group + r % group;
        float *dst = a->out + ((a->token_start[s] + t0 + t) * a->heads + h) * VD;
        const float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        for (int64_t d = 0; d < VD; d++) dst[d] = acc[r * VD + d] * inverse;
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
    int64_t *chunk_start = malloc(sizeof(int64_t) * (size_t)(seqs + 1));
    int64_t *task_start = malloc(sizeof(int64_t) * (size_t)(seqs + 1));
    if (chunk_start == NULL || task_start == NULL) {
        free(chunk_start);
        free(task_start);
        return 1;
    }
    chunk_start[0] = task_start[0] = 0;
    for (int64_t s = 0; s < seqs; s++) {
        chunk_start[s + 1] = chunk_start[s] + chunks_of(num_cached[s] + num_new[s]);
        task_start[s + 1] = task_start[s] + (num_new[s] + TILE - 1) / TILE * kv_heads;
    }
    float *packed = malloc(sizeof(float) * (size_t)(chunk_start[seqs] * kv_heads * key_dim * CHUNK));
    if (packed == NULL) {
        free(chunk_start);
        free(task_start);
        return 1;
    }
    const Args a = {q,          key_cache, value_cache, sinks,    token_start, num_new,
                    num_cached, slot_start, slots,      chunk_start, out,       packed,
                    q_stride,   heads,     kv_heads,    value_dim, window,     scale,
                    softcap};
    const int64_t packs = chunk_start[seqs] * kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t s = 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < packs; i++) {
            while (chunk_start[s + 1] * kv_heads <= i) s++;
            const int64_t within = i - chunk_start[s] * kv_heads;
            const int64_t chunks = chunk_start[s + 1] - chunk_start[s];
            if (key_dim == 64)
                pack(&a, s, within / chunks, within % chunks, 64);
            else if (key_dim == 128)
                pack(&a, s, within / chunks, within % chunks, 128);
            else
                pack(&a, s, within / chunks, within % chunks, key_dim);
        }
    }
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
    free(packed);
    free(chunk_start);
    free(task_start);
    return failed;
}
