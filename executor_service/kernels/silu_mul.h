/* SiLU(gate) * up over one row, shared by the layer pass (layer_elementwise.c) and the gate-and-up
 * GEMM's epilogue (panel_linear.c, panel_amx.c), so that both give the same bits: the same
 * expression, vectorised the same way. */
#ifndef SPLITSERVE_SILU_MUL_H
#define SPLITSERVE_SILU_MUL_H
#include <stdint.h>

#include "vector_exp.h"

static inline __attribute__((always_inline)) void silu_mul_row(const float *gate, const float *up, float *out,
                                                               int64_t width) {
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        const float g = gate[i];
        /* Past EXP_HIGHEST torch's g / (1 + e^-g) is under 3e-37 in magnitude (0 from 88.7228
         * on, where e^-g overflows): 0 here. */
        const float e = -g < EXP_LOWEST ? 0.0f : exp_in_range(-g);
        const float silu = -g > EXP_HIGHEST ? 0.0f : g / (1.0f + e);
        out[i] = silu * up[i];
    }
}
#endif
