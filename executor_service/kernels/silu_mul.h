/* SiLU(gate) * up over one row, shared by the layer pass (layer_elementwise.c) and the gate-and-up
 * GEMM's epilogue (panel_linear.c), so that both give the same bits: the same expression,
 * vectorised the same way (glibc's vector expf under -ffast-math). */
#ifndef SPLITSERVE_SILU_MUL_H
#define SPLITSERVE_SILU_MUL_H
#include <math.h>
#include <stdint.h>

/* expf overflows above this. Beyond it torch's gate / (1 + inf) is 0, but under -ffast-math
 * (finite values assumed) the vector expf's overflow came out as NaN, so the argument is clamped
 * and the result selected, both sides computed finite. */
#define SILU_EXP_CEILING 88.72f

static inline __attribute__((always_inline)) void silu_mul_row(const float *gate, const float *up, float *out,
                                                               int64_t width) {
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        const float g = gate[i];
        const float clamped = -g < SILU_EXP_CEILING ? -g : SILU_EXP_CEILING;
        const float silu = -g > SILU_EXP_CEILING ? 0.0f : g / (1.0f + expf(clamped));
        out[i] = silu * up[i];
    }
}
#endif
