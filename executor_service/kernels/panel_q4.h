/* The 4-bit affine blocks that panel_linear.c packs and panel_amx.c multiplies by, declared once
 * for both. */
#ifndef SPLITSERVE_PANEL_Q4_H
#define SPLITSERVE_PANEL_Q4_H
#include <stdint.h>

/* Output columns per panel. */
#define PANEL 16
/* Inputs per 4-bit block. */
#define Q4_BLOCK 32

/* A panel's 32 k of 4-bit blocks: each column's d and m, then q[k][column] two k to a byte (the
   even k in the low nibble). */
typedef struct {
    float d[PANEL], m[PANEL];
    uint8_t q[Q4_BLOCK / 2][PANEL];
} Q4Block;

/* y = x W^T (+ bias, + residual), or SiLU(gate) * up of a joined [gate; up] weight (`gated`,
 * `n` then the width of each half), on AMX's tiles (panel_amx.c), W read from its 4-bit blocks
 * or, when blocks is NULL, from its float32 panels (panel_linear.c's layout). Returns 0, or 1
 * (y then not written) when K is not a whole number of 32s or its scratch memory could not be
 * had. */
int panel_amx_linear(const float *x, int64_t m, int64_t k, const float *packed, const Q4Block *blocks, int64_t n,
                     int gated, const float *bias, const float *residual, float *y, int threads);
/* Whether panel_amx_linear may be called: AMX compiled in, granted by the kernel and wanted. */
int panel_amx_enabled(void);
#endif
