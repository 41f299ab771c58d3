/* The activations of layers that are not fused (every architecture but Llama's), one pass over
 * a contiguous tensor. An element's bits depend on its value alone (activation_math.h), so the
 * pass may split the tensor between threads anywhere. Called by
 * executor_service/cpu_forward/kernel_activations.py through
 * executor_service/kernels/layer_kernels.py. */
#include <stdint.h>

#include "activation_math.h"

/* Below this many elements the pass runs on the calling thread (layer_elementwise.c's
 * threshold: waking the team costs a microsecond or two). */
#define PARALLEL_FROM 4096
/* A thread's share is whole chunks, so that each runs the vectorised loop from an aligned
 * start; the bits would be the same with any split. */
#define CHUNK 1024

enum activation_kind { ACTIVATION_SILU, ACTIVATION_SIGMOID, ACTIVATION_GELU_TANH, ACTIVATION_GELU_ERF, ACTIVATION_QUICK_GELU };

#define ACTIVATION_PASS(name, element)                                                   \
    static void name(const float *x, float *out, int64_t n, int num_threads) {           \
        const int64_t chunks = (n + CHUNK - 1) / CHUNK;                                 \
        _Pragma("omp parallel for num_threads(num_threads) if (n >= PARALLEL_FROM)")   \
        for (int64_t c = 0; c < chunks; c++) {                                          \
            const int64_t end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;             \
            _Pragma("omp simd")                                                         \
            for (int64_t i = c * CHUNK; i < end; i++) out[i] = element(x[i]);           \
        }                                                                               \
    }

ACTIVATION_PASS(silu_pass, silu_of)
ACTIVATION_PASS(sigmoid_pass, sigmoid_of)
ACTIVATION_PASS(gelu_tanh_pass, gelu_tanh_of)
ACTIVATION_PASS(gelu_erf_pass, gelu_erf_of)
ACTIVATION_PASS(quick_gelu_pass, quick_gelu_of)

/* out = activation(x) over n floats (out may be x); returns 0, or -1 for an unknown kind. */
int activation(int kind, const float *x, float *out, int64_t n, int num_threads) {
    switch (kind) {
    case ACTIVATION_SILU: silu_pass(x, out, n, num_threads); return 0;
    case ACTIVATION_SIGMOID: sigmoid_pass(x, out, n, num_threads); return 0;
    case ACTIVATION_GELU_TANH: gelu_tanh_pass(x, out, n, num_threads); return 0;
    case ACTIVATION_GELU_ERF: gelu_erf_pass(x, out, n, num_threads); return 0;
    case ACTIVATION_QUICK_GELU: quick_gelu_pass(x, out, n, num_threads); return 0;
    default: return -1;
    }
}
