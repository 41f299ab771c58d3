/* y = x W^T + b in float32, with W packed once into panels of 16 output columns.

   A panel holds 16 columns of W^T for every k, [K][16] contiguous, so one 64-byte load gives
   the 16 weights a row's x[k] multiplies. A tile of up to 8 rows by up to 3 panels keeps its 24
   accumulators in registers and reads each weight once per tile. K is taken in blocks of about
   128: a panel group's block of weights (24 KiB) stays in L1 while up to 8 row tiles use it in
   turn, each carrying its accumulators to the next block through a float32 buffer (the gated
   kernel runs all of the gate's blocks, then the up's). Over the whole of K a group's weights
   (110 KiB at SmolLM2's K of 576) lived in L2: on a Sapphire Rapids-class Xeon, two cores,
   SmolLM2's layers at 32 rows took ~1.3x as long, the 2,048-row ones ~1.05x.

   Decode steps multiply a few dozen rows by weights too large for the caches, where this runs
   ahead of oneDNN's packed sgemm (SmolLM2's layers at 32 rows, two cores of that Xeon: ~210-225
   against ~160-180 GFLOP/s); at prefill sizes it is ~10 % behind (~270-285 against ~300-310).

   Every output is one chain of fused multiply-adds over k = 0..K-1, whatever the number of
   rows, the tile a row falls in, or the thread count: a row's result does not depend on the
   rows it shares a call with. The K blocks do not break the chain: a float32 accumulator stored
   and loaded again is the same float.

   Two epilogues save a pass over the output: a residual added as the tile is stored (the
   layer's o_proj and down_proj, whose outputs transformers adds to the residual stream next),
   and SiLU(gate) * up for the MLP's joined gate-and-up weight, where a tile computes its gate
   panels and then the matching up panels into buffers in L1 and writes only their product
   (a 2,048-token prefill no longer writes and rereads [tokens, 2 x intermediate]). Each gives
   the bits of the separate operations: (x W^T + b) + residual is the same sum in the same order,
   and the product is silu_mul.h's, as the layer pass computes it.

   In calls of a few dozen rows (decode), each tile asks memory for a share of the next block of
   weights (the group's next K block, or the next group's first) while it computes. There the
   weights do not fit the caches, and without this the cores waited on each block's first tile:
   random Llama's 8 layers at 32 rows streamed their 94 MB at ~11-20 GB/s, of the ~40 GB/s two
   cores read. Prefetches change no result.

   Weights that are 4-bit affine blocks (every 32 consecutive inputs of an output column take
   values d q + m, q in 0..15, with d and m per block: a model dequantized from GGUF's Q4_1, as
   SmolLM2's default copy is) can be given a second time as `blocks`, 384 bytes per panel and 32
   k (d and m for 16 columns, then the q of two k in each byte). panel_q4_pack verifies every
   value against fma(d, q, m) and refuses the weight otherwise. Calls of up to Q4_MAX_ROWS rows
   read the blocks and rebuild each K block of a panel group into an L1 buffer, in the panel
   layout, before its tiles run: the same floats, so the same bits, from under a fifth of the
   memory traffic (a decode step's GEMMs stream their weights from memory: SmolLM2's 30 layers
   at 32 rows, weights flushed from the caches between layers, 33 -> 27 ms on two cores).
   Where AMX is on (panel_amx_use), every call of any row count multiplies on its tiles instead
   (panel_amx.c), from the blocks where there are some, else from the float32 panels when K is a
   whole number of 32s: float32 accuracy, not these bits. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "kernel_api.h"
#include "panel_q4.h"
#include "silu_mul.h"

#define TILE_ROWS 8
#define TILE_PANELS 3
/* A tile's accumulators, as they are carried from one K block to the next. */
#define TILE_FLOATS (TILE_ROWS * TILE_PANELS * PANEL)
/* K is cut into equal blocks of at most this many. */
#define K_BLOCK 128
/* Row tiles that take a K block in turn, sharing its weights from L1; their accumulators wait
   on the stack between blocks. */
#define CHUNK_TILES 8
/* Rows of x taken per pass over the weights: a block of rows stays in L2 while every panel
   group passes over it. */
#define ROW_BLOCK_BYTES (256 * 1024)
/* Row blocks of more tiles than this do not prefetch: the other chunks of the group find its
   weights in L2, and the prefetches only took cache from them (SmolLM2's 2,048-row linears
   were ~2-5 % slower with them). */
#define PREFETCH_MAX_TILES 8
/* The most rows a call reads the blocks for (without AMX): beyond, compute outweighs the
   weights' traffic, and each row block would rebuild them again. */
#define Q4_MAX_ROWS 64

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

int64_t panel_q4_bytes(int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * (k / Q4_BLOCK) * (int64_t)sizeof(Q4Block);
}

/* The q of each of a column's 32 values for d and m, if every value is fma(d, q, m). */
static int q4_levels(const float *v, float d, float m, uint8_t *q) {
    for (int i = 0; i < Q4_BLOCK; i++) {
        float level = d > 0.0f ? nearbyintf((v[i] - m) / d) : 0.0f;
        level = fminf(fmaxf(level, 0.0f), 15.0f);
        q[i] = (uint8_t)level;
        if (fmaf(d, level, m) != v[i]) return 0;
    }
    return 1;
}

/* One column's block: m is its least value (q = 0) and d the half-precision step that makes its
   largest q = 15, as Q4_1 stores them; the neighbouring half-precision steps are tried too. */
static int q4_column(const float *v, float *d, float *m, uint8_t *q) {
    float low = v[0], high = v[0];
    for (int i = 1; i < Q4_BLOCK; i++) low = fminf(low, v[i]), high = fmaxf(high, v[i]);
    /* Half precision through F16C (every AVX-512 CPU has it), not _Float16, which GCC before 12
       lacks on x86: one compile error would cost the whole kernel library. */
    const unsigned short bits = _cvtss_sh((high - low) / 15.0f, _MM_FROUND_TO_NEAREST_INT);
    for (int delta = 0; delta < 3; delta++) {
        const unsigned short tried = (unsigned short)(delta == 0 ? bits : delta == 1 ? bits + 1 : bits - 1);
        const float step = _cvtsh_ss(tried);
        if (q4_levels(v, step, low, q)) {
            *d = step, *m = low;
            return 1;
        }
    }
    return 0;
}

/* w [n][k] into panel_q4_bytes(n, k) bytes at out, [panel][k / 32] blocks; 1, or 0 (out then
   partly written) when k is not a whole number of blocks or a value is not fma(d, q, m). Padding
   columns get d = m = 0. */
int64_t panel_q4_pack(const float *w, int64_t n, int64_t k, void *out) {
    if (k % Q4_BLOCK) return 0;
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / Q4_BLOCK;
    Q4Block *packed = out;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            Q4Block *block = &packed[p * blocks + b];
            memset(block, 0, sizeof *block);
            for (int c = 0; c < PANEL && p * PANEL + c < n; c++) {
                uint8_t q[Q4_BLOCK];
                if (!q4_column(w + (p * PANEL + c) * k + b * Q4_BLOCK, &block->d[c], &block->m[c], q)) return 0;
                for (int i = 0; i < Q4_BLOCK; i += 2) block->q[i / 2][c] = (uint8_t)(q[i] | q[i + 1] << 4);
            }
        }
    return 1;
}

/* A tile's share of the next block of weights: `count` panels, `stride` floats apart from
   `lines`, of `length` lines each (a line is one k of one panel). At step i of its own block the
   tile prefetches line i of each; lines past its own block's length (only K's last block is
   shorter than the next) it prefetches before its first step. */
typedef struct {
    const float *lines;
    int64_t stride, length;
    int count;
} Prefetch;

static inline __attribute__((always_inline)) void prefetch_lines(const Prefetch *prefetch, int64_t from, int64_t to) {
    for (int q = 0; q < prefetch->count; q++)
        for (int64_t line = from; line < to && line < prefetch->length; line++)
            _mm_prefetch((const char *)(prefetch->lines + q * prefetch->stride + line * PANEL), _MM_HINT_T1);
}

/* rows x panels outputs over k0 <= kk < k1 of K = k, the weights of kk in panel j at
   w + j * panel_stride + (kk - k0) * PANEL; both sizes are constants where it is inlined, so the
   loops unroll and the accumulators live in registers. The accumulators start from `partial`
   unless k0 is 0, and go back to it unless k1 is k; after K's last block the tile writes y
   (+ bias, + residual). */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t k, int64_t k0, int64_t k1, const float *w, int64_t panel_stride, float *partial,
    float *y, int64_t n, int64_t columns, const float *bias, const float *residual, const int rows,
    const int panels, const Prefetch *prefetch) {
    __m512 acc[TILE_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            acc[r][j] = k0 > 0 ? _mm512_load_ps(partial + (r * TILE_PANELS + j) * PANEL) : _mm512_setzero_ps();
    prefetch_lines(prefetch, k1 - k0, prefetch->length);
    for (int64_t kk = k0; kk < k1; kk++) {
        __m512 weights[TILE_PANELS];
        for (int j = 0; j < panels; j++) weights[j] = _mm512_loadu_ps(w + j * panel_stride + (kk - k0) * PANEL);
        for (int q = 0; q < prefetch->count && kk - k0 < prefetch->length; q++)
            _mm_prefetch((const char *)(prefetch->lines + q * prefetch->stride + (kk - k0) * PANEL), _MM_HINT_T1);
        for (int r = 0; r < rows; r++) {
            __m512 xv = _mm512_set1_ps(x[r * k + kk]);
            for (int j = 0; j < panels; j++) acc[r][j] = _mm512_fmadd_ps(xv, weights[j], acc[r][j]);
        }
    }
    if (k1 < k) {
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < panels; j++) _mm512_store_ps(partial + (r * TILE_PANELS + j) * PANEL, acc[r][j]);
        return;
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

#define TILE_CASE(R, P)                                                                         \
    case (R) * 4 + (P):                                                                         \
        tile(x, k, k0, k1, w, panel_stride, partial, y, n, columns, bias, residual, R, P, prefetch); \
        break;
#define TILE_CASES(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3)

static void dispatch(const float *x, int64_t k, int64_t k0, int64_t k1, const float *w, int64_t panel_stride,
                     float *partial, float *y, int64_t n, int64_t columns, const float *bias, const float *residual,
                     int rows, int panels, const Prefetch *prefetch) {
    switch (rows * 4 + panels) {
        TILE_CASES(1) TILE_CASES(2) TILE_CASES(3) TILE_CASES(4)
        TILE_CASES(5) TILE_CASES(6) TILE_CASES(7) TILE_CASES(8)
    }
}

/* One call's operands: `panels` output panels in each of `halves` halves (1, or 2 when gated:
   the gate's panels, then the up's); `blocks`, when not NULL, the same weights as 4-bit blocks,
   read instead of `packed`. */
typedef struct {
    const float *x, *packed, *bias, *residual;
    const Q4Block *blocks;
    float *y;
    int64_t k, n, panels;
    int halves;
} Job;

/* A tile's piece of work: rows [r0, r0 + rows) by panels [p0, p0 + panels) of one half, over K
   block [k0, k1), whose weights lie as tile() reads them from `weights`; `partial` holds
   2 * TILE_FLOATS floats, the accumulators carried between blocks and, when gated, the gate's
   outputs waiting for the up's. */
typedef struct {
    int64_t r0, p0, k0, k1;
    int rows, panels, half;
    const float *weights;
    int64_t panel_stride;
    float *partial;
    const Prefetch *prefetch;
} Piece;

typedef void (*TileFn)(const Job *job, const Piece *piece);

static void plain_tile(const Job *job, const Piece *piece) {
    const int64_t c0 = piece->p0 * PANEL;
    const int64_t columns = job->n - c0 < piece->panels * PANEL ? job->n - c0 : piece->panels * PANEL;
    dispatch(job->x + piece->r0 * job->k, job->k, piece->k0, piece->k1, piece->weights, piece->panel_stride,
             piece->partial, job->y + piece->r0 * job->n + c0, job->n, columns, job->bias ? job->bias + c0 : NULL,
             job->residual ? job->residual + piece->r0 * job->n + c0 : NULL, piece->rows, piece->panels,
             piece->prefetch);
}

/* job->n is the width of each half, a whole number of panels. The gate's tile, when K is done,
   waits in `partial`; the up's lands in an L1 buffer, and only their product is written. */
static void gated_tile(const Job *job, const Piece *piece) {
    float up[TILE_FLOATS];
    const int64_t k = job->k, width = job->n, c0 = piece->p0 * PANEL, columns = piece->panels * PANEL;
    const int stride = TILE_PANELS * PANEL;
    float *gate = piece->partial + TILE_FLOATS;
    const float *bias = job->bias ? job->bias + piece->half * width + c0 : NULL;
    dispatch(job->x + piece->r0 * k, k, piece->k0, piece->k1, piece->weights, piece->panel_stride, piece->partial,
             piece->half ? up : gate, stride, columns, bias, NULL, piece->rows, piece->panels, piece->prefetch);
    if (piece->half == 0 || piece->k1 < k) return;
    for (int r = 0; r < piece->rows; r++)
        silu_mul_row(gate + r * stride, up + r * stride, job->y + (piece->r0 + r) * width + c0, columns);
}

/* A block of weights: K block [k0, k0 + block) of panel group g's panels in one half. */
typedef struct {
    int64_t g, half, k0;
} Block;

/* The block after `current` in a thread's order (K blocks, then halves, then groups), as tile t
   of `tiles` prefetches it while it computes its `steps` steps of the current block. None in
   calls of many row tiles, or when the next group is not the thread's (`last_group`). */
static Prefetch next_block_share(const Job *job, Block current, int64_t block, int64_t steps, int64_t row_tiles,
                                 int64_t last_group, int64_t t, int64_t tiles) {
    Prefetch share = {NULL, 0, 0, 0};
    const int64_t k = job->k;
    Block next = {current.g, current.half, current.k0 + block};
    if (next.k0 >= k) next = (Block){current.g, current.half + 1, 0};
    if (next.half == job->halves) next = (Block){current.g + 1, 0, 0};
    if (row_tiles > PREFETCH_MAX_TILES || next.g > last_group || steps == 0) return share;
    const int64_t p0 = next.g * TILE_PANELS;
    const int64_t panels = job->panels - p0 < TILE_PANELS ? job->panels - p0 : TILE_PANELS;
    share.length = k - next.k0 < block ? k - next.k0 : block;
    if (job->blocks != NULL) {
        /* The blocks' bytes, a line being 64 of them. */
        const int64_t per_panel = k / Q4_BLOCK;
        const Q4Block *first = job->blocks + (next.half * job->panels + p0 + t) * per_panel + next.k0 / Q4_BLOCK;
        share.lines = (const float *)first;
        share.stride = tiles * per_panel * (int64_t)(sizeof(Q4Block) / sizeof(float));
        share.length = share.length / Q4_BLOCK * (int64_t)(sizeof(Q4Block) / (PANEL * sizeof(float)));
    } else {
        share.lines = job->packed + (next.half * job->panels + p0 + t) * k * PANEL + next.k0 * PANEL;
        share.stride = tiles * k * PANEL;
    }
    for (int64_t j = t; j < panels; j += tiles) share.count++;
    return share;
}

/* Panels' weights for k0 <= kk < k1 (whole 4-bit blocks) from their blocks (`per_panel` apart)
   into out [panels][k1 - k0][PANEL], the layout tile() reads: fma(d, q, m), the value
   panel_q4_pack verified. */
static void q4_rebuild(const Q4Block *blocks, int64_t per_panel, int panels, int64_t k0, int64_t k1, float *out) {
    const __m512i low_nibble = _mm512_set1_epi32(15);
    for (int j = 0; j < panels; j++)
        for (int64_t b = k0 / Q4_BLOCK; b < k1 / Q4_BLOCK; b++) {
            const Q4Block *block = &blocks[j * per_panel + b];
            const __m512 d = _mm512_loadu_ps(block->d), m = _mm512_loadu_ps(block->m);
            float *lines = out + (j * (k1 - k0) + b * Q4_BLOCK - k0) * PANEL;
            for (int i = 0; i < Q4_BLOCK / 2; i++) {
                const __m512i pair = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)block->q[i]));
                const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(pair, low_nibble));
                const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 4));
                _mm512_store_ps(lines + 2 * i * PANEL, _mm512_fmadd_ps(d, even, m));
                _mm512_store_ps(lines + (2 * i + 1) * PANEL, _mm512_fmadd_ps(d, odd, m));
            }
        }
}

/* Row tiles [t0, t1) of the row block from `first` to `end`, in panel group g: each half, block
   by block of K. */
static void run_chunk(const Job *job, TileFn fn, int64_t g, int64_t last_group, int64_t first, int64_t end,
                      int64_t row_tiles, int64_t t0, int64_t t1) {
    float partial[CHUNK_TILES][2 * TILE_FLOATS] __attribute__((aligned(64)));
    float rebuilt[TILE_PANELS * K_BLOCK * PANEL] __attribute__((aligned(64)));
    const int64_t k = job->k, blocks = k > K_BLOCK ? (k + K_BLOCK - 1) / K_BLOCK : 1;
    int64_t block = (k + blocks - 1) / blocks;
    /* Read from 4-bit blocks, K blocks are whole ones of those (K_BLOCK is). */
    if (job->blocks != NULL) block = (block + Q4_BLOCK - 1) / Q4_BLOCK * Q4_BLOCK;
    const int64_t p0 = g * TILE_PANELS;
    const int panels = (int)(job->panels - p0 < TILE_PANELS ? job->panels - p0 : TILE_PANELS);
    for (int half = 0; half < job->halves; half++)
        for (int64_t k0 = 0; k0 < k; k0 += block) {
            const int64_t k1 = k - k0 < block ? k : k0 + block, first_panel = half * job->panels + p0;
            const float *weights = job->packed + first_panel * k * PANEL + k0 * PANEL;
            int64_t panel_stride = k * PANEL;
            if (job->blocks != NULL) {
                q4_rebuild(job->blocks + first_panel * (k / Q4_BLOCK), k / Q4_BLOCK, panels, k0, k1, rebuilt);
                weights = rebuilt, panel_stride = (k1 - k0) * PANEL;
            }
            for (int64_t t = t0; t < t1; t++) {
                const int64_t r0 = first + t * TILE_ROWS;
                const Block current = {g, half, k0};
                const Prefetch prefetch =
                    next_block_share(job, current, block, k1 - k0, row_tiles, last_group, t - t0, t1 - t0);
                const int rows = (int)(end - r0 < TILE_ROWS ? end - r0 : TILE_ROWS);
                const Piece piece = {r0,      p0,           k0, k1, rows, panels, half,
                                     weights, panel_stride, partial[t - t0], &prefetch};
                fn(job, &piece);
            }
        }
}

/* Every tile of an m-row output of job->panels panels. Each thread takes an even share of the
   (group, row tile) pairs of every row block, group-major, so that its tiles share their
   weights; split by tiles, not groups, so that few groups (a 512-wide output is 11) still
   split evenly between threads. */
static void run_tiles(const Job *job, TileFn fn, int64_t m, int threads) {
    const int64_t k = job->k, groups = (job->panels + TILE_PANELS - 1) / TILE_PANELS;
    int64_t row_block = (int64_t)(ROW_BLOCK_BYTES / ((size_t)(k > 0 ? k : 1) * sizeof(float))) / TILE_ROWS * TILE_ROWS;
    if (row_block < TILE_ROWS) row_block = TILE_ROWS;
#pragma omp parallel num_threads(threads)
    {
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t first = 0; first < m; first += row_block) {
            const int64_t end = m - first < row_block ? m : first + row_block;
            const int64_t tiles = (end - first + TILE_ROWS - 1) / TILE_ROWS;
            const int64_t lo = groups * tiles * thread / team, hi = groups * tiles * (thread + 1) / team;
            const int64_t last_group = hi > 0 ? (hi - 1) / tiles : -1;
            for (int64_t item = lo; item < hi;) {
                const int64_t g = item / tiles, t0 = item % tiles;
                int64_t t1 = hi - g * tiles < tiles ? hi - g * tiles : tiles;
                if (t1 - t0 > CHUNK_TILES) t1 = t0 + CHUNK_TILES;
                run_chunk(job, fn, g, last_group, first, end, tiles, t0, t1);
                item = g * tiles + t1;
            }
        }
    }
}

/* The blocks a call of m rows reads, if any. */
static const Q4Block *blocks_for(const void *blocks, int64_t m) { return m <= Q4_MAX_ROWS ? blocks : NULL; }

/* y [m][n] = x W^T + bias (+ residual): x [m][k], W packed by panel_pack (and by panel_q4_pack
   into blocks, or blocks NULL), bias [n] or NULL, residual [m][n] or NULL (it may be y itself). */
void panel_linear(const float *x, int64_t m, int64_t k, const float *packed, const void *blocks, int64_t n,
                  const float *bias, const float *residual, float *y, int threads) {
    if (panel_amx_enabled() && !panel_amx_linear(x, m, k, packed, blocks, n, 0, bias, residual, y, threads))
        return;
    Job job = {x, packed, bias, residual, blocks_for(blocks, m), y, k, n, (n + PANEL - 1) / PANEL, 1};
    run_tiles(&job, plain_tile, m, threads);
}

/* y [m][width] = silu(x Wg^T + bg) * (x Wu^T + bu), for gate and up joined into one weight
   ([gate; up], 2 * width outputs) packed by panel_pack (and its blocks by panel_q4_pack, or
   NULL); width a multiple of 16, bias [2 * width] or NULL. */
void panel_linear_silu_mul(const float *x, int64_t m, int64_t k, const float *packed, const void *blocks,
                           int64_t width, const float *bias, float *y, int threads) {
    if (panel_amx_enabled() && !panel_amx_linear(x, m, k, packed, blocks, width, 1, bias, NULL, y, threads))
        return;
    Job job = {x, packed, bias, NULL, blocks_for(blocks, m), y, k, width, width / PANEL, 2};
    run_tiles(&job, gated_tile, m, threads);
}
#endif
