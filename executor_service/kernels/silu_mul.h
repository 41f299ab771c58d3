/* SiLU(gate) * up over one row, shared by the layer pass (layer_elementwise.c) and the gate-and-up
 * GEMM's epilogue (panel_linear.c, panel_amx.c), so that both give the same bits: the same
 * expression, vectorised the same way. */
#ifndef SPLITSERVE_SILU_MUL_H
#define SPLITSERVE_SILU_MUL_H
#include <stdint.h>

#include "activation_math.h"

static inline __attribute__((always_inline)) void silu_mul_row(const float *gate, const float *up, float *out,
                                                               int64_t width) {
#pragma omp simd
    for (int64_t i = 0; i < width; i++) out[i] = silu_of(gate[i]) * up[i];
}
#endif
