/* The elementwise passes of a fused Llama layer (float32, CPU), each one pass over its rows.
 *
 * In torch, RMSNorm is six elementwise operations, RoPE five (two products, a negation, a
 * concatenation and a sum) and SiLU-times-up two, each a dispatch and a pass over memory, most
 * with a fresh allocation. Here each is one loop, split over rows between threads when the
 * tensor is large enough to pay for waking them. Called by
 * executor_service/cpu_forward/fused_layers.py through executor_service/kernels/layer_kernels.py.
 */
#include <math.h>
#include <stdint.h>

#include "kernel_api.h"
#include "silu_mul.h"
#include "vector_lanes.h"

/* Below this many elements a pass runs on the calling thread. With the step thread's OpenMP
 * team busy-waiting between regions a fork and join costs a microsecond or two, so a decode
 * step's passes (random Llama, 32 rows: 16k to 45k elements) split too: between packed GEMMs,
 * SiLU-times-up took 39-52 us on two threads against 54-70 us on one, RMSNorm 18-30 against
 * 21-34 (medians of 1,900 alternations each). */
#define PARALLEL_FROM 4096

/* out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps), as transformers' LlamaRMSNorm; x and out
 * are [rows, dim]. */
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
              float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        const float squares = dot_lanes(row, row, dim);
        const float inverse = 1.0f / sqrtf(squares / (float)dim + eps);
        float *dst = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) dst[d] = weight[d] * (row[d] * inverse);
    }
}

/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][width + i]: gate_up is [rows, 2 * width]
 * (gate then up, side by side), out [rows, width]. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width;
        silu_mul_row(gate, gate + width, out + r * width, width);
    }
}

/* Rotary embedding in place, as transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) *
 * sin for `heads` heads of width dim at the start of each of the rows (rows `stride` floats
 * apart); cos and sin are [rows, dim]. */
void rope(float *x, const float *cos_, const float *sin_, int64_t rows, int64_t heads,
          int64_t dim, int64_t stride, int num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_ + r * dim, *s = sin_ + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *first = x + r * stride + h * dim, *second = first + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = first[i], b = second[i];
                first[i] = a * c[i] - b * s[i];
                second[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}
