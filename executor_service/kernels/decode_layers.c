/* A pure decode step's whole decoder-layer stack of a fused Llama in one call (float32, CPU).
 *
 * Per layer it calls, in the order and with the operands of the Python loop (lean_forward.py
 * through fused_layers.py and paged_attention.py), the kernels that loop calls one by one:
 * RMSNorm, the packed QKV GEMM, RoPE on Q and K, the new K and V rows written to their cache
 * slots, decode attention, o_proj added into the residual stream, RMSNorm, the gated MLP GEMM and
 * down_proj added into the stream. The arithmetic is theirs, so the hidden states are the loop's
 * to the bit; what goes is the interpreter between them: ~270 calls per step, each with its
 * argument checks, views and allocations (SmolLM2: ~5 ms of a ~79 ms decode step on two cores).
 * Loaded by executor_service/cpu_forward/decode_program.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_api.h"

#ifdef __AVX512F__

/* One decoder layer's weights as the fused modules hold them: RMSNorm weights, and packed GEMM
 * weights (panel_linear.c's layout) with their 4-bit blocks or NULL and their bias or NULL; the
 * gated weight is [gate; up]. */
typedef struct {
    const float *input_norm, *post_norm;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    const void *qkv_blocks, *o_blocks, *gate_up_blocks, *down_blocks;
} LayerWeights;

/* The model's shapes, and the step's operands that every layer shares. */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin;                /* [rows, head_dim] */
    const int64_t *slots;                  /* [rows]: each new token's cache slot */
    const int64_t *block_table;            /* [rows, table_width] */
    const int64_t *context_lens;           /* [rows] */
    int64_t block_size, table_width;
    int threads;
} Step;

/* hidden [rows, hidden] through layers [0, count), in place; key_caches[i] and value_caches[i]
 * are layer i's [slots, kv_heads, head_dim]. Returns 0, or 1 when scratch memory could not be
 * had (hidden is then partly computed). */
int decode_layers(const LayerWeights *layers, int64_t count, float *const *key_caches,
                  float *const *value_caches, const Step *s, float *hidden) {
    const int64_t rows = s->rows, dim = s->head_dim;
    const int64_t q_width = s->heads * dim, kv_width = s->kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int64_t widest = qkv_width > s->intermediate ? qkv_width : s->intermediate;
    /* normed [rows, hidden], product [rows, widest] (QKV, then the MLP's hidden), queries and
     * attended [rows, q_width] */
    float *normed = malloc(sizeof(float) * (size_t)(rows * (s->hidden + widest + 2 * q_width)));
    if (normed == NULL) return 1;
    float *product = normed + rows * s->hidden, *queries = product + rows * widest;
    float *attended = queries + rows * q_width;
    int failed = 0;
    for (int64_t i = 0; i < count && !failed; i++) {
        const LayerWeights *w = &layers[i];
        rms_norm(hidden, w->input_norm, normed, rows, s->hidden, s->eps, s->threads);
        panel_linear(normed, rows, s->hidden, w->qkv, w->qkv_blocks, qkv_width, w->qkv_bias, NULL, product,
                     s->threads);
        rope(product, s->cos, s->sin, rows, s->heads + s->kv_heads, dim, qkv_width, s->threads);
        for (int64_t r = 0; r < rows; r++) {
            const float *row = product + r * qkv_width;
            memcpy(queries + r * q_width, row, sizeof(float) * (size_t)q_width);
            memcpy(key_caches[i] + s->slots[r] * kv_width, row + q_width, sizeof(float) * (size_t)kv_width);
            memcpy(value_caches[i] + s->slots[r] * kv_width, row + q_width + kv_width,
                   sizeof(float) * (size_t)kv_width);
        }
        failed = paged_decode_attention(queries, key_caches[i], value_caches[i], s->block_table, s->context_lens,
                                        NULL, attended, rows, s->heads, s->kv_heads, dim, dim, s->block_size,
                                        s->table_width, s->scale, 0, 0.0f, s->threads);
        panel_linear(attended, rows, q_width, w->o, w->o_blocks, s->hidden, w->o_bias, hidden, hidden, s->threads);
        rms_norm(hidden, w->post_norm, normed, rows, s->hidden, s->eps, s->threads);
        panel_linear_silu_mul(normed, rows, s->hidden, w->gate_up, w->gate_up_blocks, s->intermediate,
                              w->gate_up_bias, product, s->threads);
        panel_linear(product, rows, s->intermediate, w->down, w->down_blocks, s->hidden, w->down_bias, hidden,
                     hidden, s->threads);
    }
    free(normed);
    return failed;
}

#endif
