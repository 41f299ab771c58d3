/* The kernels that decode_layers.c calls, declared once: the files that define them include
 * this too, so a signature that drifts from its callers does not compile. */
#ifndef SPLITSERVE_KERNEL_API_H
#define SPLITSERVE_KERNEL_API_H
#include <stdint.h>

void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps,
              int num_threads);
void rope(float *x, const float *cos_, const float *sin_, int64_t rows, int64_t heads, int64_t dim,
          int64_t stride, int num_threads);
int paged_decode_attention(const float *q, const float *key_cache, const float *value_cache,
                           const int64_t *block_table, const int64_t *context_lens,
                           const float *sinks, float *out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                           int64_t block_size, int64_t table_width, float scale, int64_t window,
                           float softcap, int num_threads);
#ifdef __AVX512F__
void panel_linear(const float *x, int64_t m, int64_t k, const float *packed, const void *blocks, int64_t n,
                  const float *bias, const float *residual, float *y, int threads);
void panel_linear_silu_mul(const float *x, int64_t m, int64_t k, const float *packed, const void *blocks,
                           int64_t width, const float *bias, float *y, int threads);
#endif
#endif
