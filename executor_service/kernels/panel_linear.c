/* y = x W^T + b in float32, with W packed once into panels of 16 output columns.

   A panel holds 16 columns of W^T for every k, [K][16] contiguous, so one 64-byte load gives
   the 16 weights a row's x[k] multiplies. A tile of up to 8 rows by up to 3 panels keeps its 24
   accumulators in registers over the whole of K and reads each weight once per tile; the
   tiles of a panel group reuse its weights from L2. Decode steps multiply a few dozen rows by
   weights too large for the caches, where this runs ahead of oneDNN's packed sgemm (SmolLM2's
   layers at 32 rows, two cores: ~185 against ~160 GFLOP/s; at 8 rows ~117 against ~81), and
   within a few percent of it at prefill sizes.

   Every output is one chain of fused multiply-adds over k = 0..K-1, whatever the number of
   rows, the tile a row falls in, or the thread count: a row's result does not depend on the
   rows it shares a call with.

   Two epilogues save a pass over the output: a residual added as the tile is stored (the
   layer's o_proj and down_proj, whose outputs transformers adds to the residual stream next),
   and SiLU(gate) * up for the MLP's joined gate-and-up weight, where a tile computes its gate
   panels and then the matching up panels into buffers in L1 and writes only their product
   (a 2,048-token prefill no longer writes and rereads [tokens, 2 x intermediate]). Each gives
   the bits of the separate operations: (x W^T + b) + residual is the same sum in the same order,
   and the product is silu_mul.h's, as the layer pass computes it.

   In calls of a few dozen rows (decode), each tile asks memory for a share of the next panel
   group's weights while it computes. There the weights do not fit the caches, and without this
   the cores waited on each group's first tile: random Llama's 8 layers at 32 rows streamed their
   94 MB at ~11-20 GB/s, of the ~40 GB/s two cores read. Prefetches change no result. */

#include <stddef.h>
#include <stdint.h>

#include "silu_mul.h"

#define PANEL 16
#define TILE_ROWS 8
#define TILE_PANELS 3
/* Rows of x taken per pass over the weights: a block of rows stays in L2 while every panel
   group passes over it. */
#define ROW_BLOCK_BYTES (256 * 1024)
/* Row blocks of more tiles than this do not prefetch: their tiles reuse each group's weights
   from L2, and the prefetches only took L1 from them (SmolLM2's 2,048-row linears were ~2 %
   slower with them). */
#define PREFETCH_MAX_TILES 8

int64_t panel_linear_available(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

int64_t panel_packed_floats(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * k * PANEL; }

/* w [n][k] (row-major, as nn.Linear holds it) into out [ceil(n/16)][k][16], zero-padded. */
void panel_pack(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < PANEL; c++) {
                int64_t column = p * PANEL + c;
                out[(p * k + kk) * PANEL + c] = column < n ? w[column * k + kk] : 0.0f;
            }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* A tile's share of the next panel group's weights: at step kk of K it prefetches the lines
   first + kk * step + [0, count) of the group's `lines` 64-byte lines (a line is one k of one
   panel). The group's row tiles take interleaved shares that cover it between them. */
typedef struct {
    const float *next;
    int64_t lines, first, step, count;
} Prefetch;

static const Prefetch NO_PREFETCH = {NULL, 0, 0, 0, 0};

/* The share of tile t of `tiles` row tiles, whose panel group starts at panel p0 of `panels`
   (packed from `packed`, K = k). */
static Prefetch prefetch_share(const float *packed, int64_t k, int64_t p0, int64_t panels, int64_t t, int64_t tiles) {
    const int64_t next = p0 + TILE_PANELS;
    if (next >= panels || tiles > PREFETCH_MAX_TILES) return NO_PREFETCH;
    const int64_t next_panels = panels - next < TILE_PANELS ? panels - next : TILE_PANELS;
    const int64_t count = (next_panels + tiles - 1) / tiles;
    const Prefetch share = {packed + next * k * PANEL, next_panels * k, t * count, tiles * count, count};
    return share;
}

/* rows x panels outputs; both are constants where it is inlined, so the loops unroll and the
   accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t k, const float *w, float *y, int64_t n, int64_t columns, const float *bias,
    const float *residual, const int rows, const int panels, const Prefetch *prefetch) {
    __m512 acc[TILE_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t panel_stride = k * PANEL;
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 weights[TILE_PANELS];
        for (int j = 0; j < panels; j++) weights[j] = _mm512_loadu_ps(w + j * panel_stride + kk * PANEL);
        if (prefetch->next != NULL) {
            const int64_t line = prefetch->first + kk * prefetch->step;
            for (int64_t i = 0; i < prefetch->count && line + i < prefetch->lines; i++)
                _mm_prefetch((const char *)(prefetch->next + (line + i) * PANEL), _MM_HINT_T0);
        }
        for (int r = 0; r < rows; r++) {
            __m512 xv = _mm512_set1_ps(x[r * k + kk]);
            for (int j = 0; j < panels; j++) acc[r][j] = _mm512_fmadd_ps(xv, weights[j], acc[r][j]);
        }
    }
    for (int j = 0; j < panels; j++) {
        int64_t left = columns - j * PANEL;
        __mmask16 mask = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * PANEL) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 out = _mm512_add_ps(acc[r][j], b);
            if (residual) {
                /* The linear's output is rounded before the residual joins it, as in torch; the
                   empty asm keeps -ffast-math from reassociating the two sums. */
                __asm__("" : "+v"(out));
                out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, residual + r * n + j * PANEL));
            }
            _mm512_mask_storeu_ps(y + r * n + j * PANEL, mask, out);
        }
    }
}

#define TILE_CASE(R, P) \
    case (R) * 4 + (P): tile(x, k, w, y, n, columns, bias, residual, R, P, prefetch); break;
#define TILE_CASES(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3)

static void dispatch(const float *x, int64_t k, const float *w, float *y, int64_t n, int64_t columns,
                     const float *bias, const float *residual, int rows, int panels, const Prefetch *prefetch) {
    switch (rows * 4 + panels) {
        TILE_CASES(1) TILE_CASES(2) TILE_CASES(3) TILE_CASES(4)
        TILE_CASES(5) TILE_CASES(6) TILE_CASES(7) TILE_CASES(8)
    }
}

/* One call's operands: `panels` output panels (all of n's, or each half's when gated). A tile is
   rows [r0, r0 + rows) by panels [p0, p0 + panels), row tile t of the `tiles` its row block has. */
typedef struct {
    const float *x, *packed, *bias, *residual;
    float *y;
    int64_t k, n, panels;
} Job;

typedef void (*TileFn)(const Job *job, int64_t r0, int rows, int64_t p0, int panels, int64_t t, int64_t tiles);

static void plain_tile(const Job *job, int64_t r0, int rows, int64_t p0, int panels, int64_t t, int64_t tiles) {
    int64_t c0 = p0 * PANEL, columns = job->n - c0 < panels * PANEL ? job->n - c0 : panels * PANEL;
    const Prefetch prefetch = prefetch_share(job->packed, job->k, p0, job->panels, t, tiles);
    dispatch(job->x + r0 * job->k, job->k, job->packed + p0 * job->k * PANEL, job->y + r0 * job->n + c0, job->n,
             columns, job->bias ? job->bias + c0 : NULL, job->residual ? job->residual + r0 * job->n + c0 : NULL,
             rows, panels, &prefetch);
}

/* job->n is the width of each half, a whole number of panels; the up panels follow the gate's. */
static void gated_tile(const Job *job, int64_t r0, int rows, int64_t p0, int panels, int64_t t, int64_t tiles) {
    float gate[TILE_ROWS * TILE_PANELS * PANEL], up[TILE_ROWS * TILE_PANELS * PANEL];
    const int64_t k = job->k, width = job->n, c0 = p0 * PANEL, columns = panels * PANEL, half = job->panels;
    const int stride = TILE_PANELS * PANEL;
    const float *x = job->x + r0 * k, *up_panels = job->packed + half * k * PANEL;
    const Prefetch gate_next = prefetch_share(job->packed, k, p0, half, t, tiles);
    const Prefetch up_next = prefetch_share(up_panels, k, p0, half, t, tiles);
    dispatch(x, k, job->packed + p0 * k * PANEL, gate, stride, columns, job->bias ? job->bias + c0 : NULL, NULL,
             rows, panels, &gate_next);
    dispatch(x, k, up_panels + p0 * k * PANEL, up, stride, columns, job->bias ? job->bias + width + c0 : NULL, NULL,
             rows, panels, &up_next);
    for (int r = 0; r < rows; r++)
        silu_mul_row(gate + r * stride, up + r * stride, job->y + (r0 + r) * width + c0, columns);
}

/* Every tile of an m-row output of job->panels panels, split between threads. */
static void run_tiles(const Job *job, TileFn fn, int64_t m, int threads) {
    const int64_t k = job->k, panels = job->panels;
    int64_t groups = (panels + TILE_PANELS - 1) / TILE_PANELS;
    int64_t row_block = (int64_t)(ROW_BLOCK_BYTES / ((size_t)(k > 0 ? k : 1) * sizeof(float))) / TILE_ROWS * TILE_ROWS;
    if (row_block < TILE_ROWS) row_block = TILE_ROWS;
#pragma omp parallel num_threads(threads)
    for (int64_t first = 0; first < m; first += row_block) {
        int64_t end = m - first < row_block ? m : first + row_block;
        int64_t tiles = (end - first + TILE_ROWS - 1) / TILE_ROWS;
        /* Group-major, so that a thread's tiles share their weights; split by tiles, not groups,
           so that few groups (a 512-wide output is 11) still split evenly between threads. */
#pragma omp for collapse(2) schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t t = 0; t < tiles; t++) {
                int64_t p0 = g * TILE_PANELS, r0 = first + t * TILE_ROWS;
                fn(job, r0, (int)(end - r0 < TILE_ROWS ? end - r0 : TILE_ROWS), p0,
                   (int)(panels - p0 < TILE_PANELS ? panels - p0 : TILE_PANELS), t, tiles);
            }
        }
    }
}

/* y [m][n] = x W^T + bias (+ residual): x [m][k], W packed by panel_pack, bias [n] or NULL,
   residual [m][n] or NULL (it may be y itself). */
void panel_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                  const float *residual, float *y, int threads) {
    Job job = {x, packed, bias, residual, y, k, n, (n + PANEL - 1) / PANEL};
    run_tiles(&job, plain_tile, m, threads);
}

/* y [m][width] = silu(x Wg^T + bg) * (x Wu^T + bu), for gate and up joined into one weight
   ([gate; up], 2 * width outputs) packed by panel_pack; width a multiple of 16, bias [2 * width]
   or NULL. */
void panel_linear_silu_mul(const float *x, int64_t m, int64_t k, const float *packed, int64_t width,
                           const float *bias, float *y, int threads) {
    Job job = {x, packed, bias, NULL, y, k, width, width / PANEL};
    run_tiles(&job, gated_tile, m, threads);
}
#endif
