/* x W^T on AMX's bf16 tiles, to float32 accuracy, for weights made of 4-bit affine blocks
   (panel_q4.h) and for any float32 weights.

   A tile multiply (TDPBF16PS) takes bf16 operands and adds their products into float32. A float32
   is exactly the sum of three bf16 pieces (its top 8 significant bits, the next 8, the last 8:
   each piece truncates what the ones before left), and every product of two bf16 values is exact
   in float32.

   4-bit blocks: a block's levels q (0..15) are bf16 exactly, so q x_hi + q x_mid + q x_lo is q x
   with float32 additions only. Per block of 32 inputs and output column:

       sum_i x_i (d q_i + m) = d (sum_i q_i x_i) + m (sum_i x_i)

   The tiles give sum_i q_i x_i for 16 rows by 16 columns, the three pieces multiplied into one
   float32 tile; the vector units scale it by d and add m times the row's sum of the block's x
   to the accumulators. These are not the float path's bits (it multiplies fma(d, q, m) rounded to
   float32, in one chain over k), but as close or closer to the exact product: on random blocks
   the largest error against double precision came out ~3x below the float path's.

   Float32 weights: each weight is split into three pieces too, and piece i of x meets piece j of
   w where i + j < 3, six products of the nine; the three left out are together under 2^-21 |x w|,
   and the tiles accumulate over the whole of K. On random Llama's shapes the RMS error against
   double precision is about half the float path's.

   What holds as it does in the float path: a row's result does not depend on the rows it shares
   a call with nor on the thread count, and an epilogue (bias, residual, SiLU(gate) * up) is the
   separate operations'.

   The work is a pair of panels (two output panels, or a gate panel and its up panel) times a
   block of rows. A pair's weights are expanded to bf16 into a buffer in the tiles' layout, and
   each two row tiles of 16 take four float32 tiles (row tiles x panels). Float32 weights are
   expanded a block of 32 k at a time, just before its tiles, when one pass of row tiles covers
   the rows (up to 32), asking memory for a block a few ahead; the whole pair at once otherwise,
   for every pass to reuse. Each thread splits rows into pieces in its own buffer, laid out tile
   by tile: pieces that one core writes and the other reads took longer to move than to split
   twice. Calls of a few dozen rows (decode steps) split every row in every thread and share out
   the pairs; larger ones give each thread whole row blocks, which it multiplies by every pair.

   On a Sapphire Rapids-class Xeon (two cores), SmolLM2's layer shapes, hot caches, against the
   float path (panel_linear.c): 32 rows ~1.2-1.7x as fast, 512 rows ~1.4-1.9x. Its 30 layers with
   the weights streamed from memory: 32 rows 18.3 against 27.5 ms, 8 rows 9.7 against 10.6, but 1
   row 7.4 against 5.9: a tile multiply costs the same (~5 ns there) for 1 row as for 16, and the
   levels are expanded whatever the row count. Below 16 rows the tiles are configured that short
   all the same, so that only real rows are stored and added. Random Llama's 8 float32 layers
   (a later Xeon of the kind, two cores, median of alternated passes): 2,048 rows 236 against
   356 ms (410 against 271 GFLOP/s), 512 rows 62 against 91, 32 rows 6.4-7.1 against 6.8-7.5, and
   1-8 rows ~3.9-4.4 against ~2.6-3.0 ms: splitting the weights costs the same for one row as for 32. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "panel_q4.h"
#include "silu_mul.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux's arch_prctl request for a state component, and the component of the tiles' data. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Rows per tile, and the pieces an x is split into. */
#define TILE_ROWS 16
#define PIECES 3
/* bf16 values in one tile: 16 rows of 64 bytes. */
#define TILE_VALUES (TILE_ROWS * 32)
/* A thread's buffer of pieces holds at most this many bytes of rows: with a pair's levels (96
   KiB at K = 1,536) or a pair's float32 weights split (270 KiB at K = 1,408) it stays in a 2 MiB
   L2. */
#define PIECE_BYTES (1024 * 1024)
/* Calls of up to this many rows split every row in every thread and share out the pairs. */
#define SHARED_ROWS 64
/* Float32 weights split block by block are asked of memory this many blocks (4 KiB a pair) ahead,
   into L2: a few rows' tiles take less time than memory does to bring a block (random Llama's 8
   layers at 1 row: ~4.2 ms with 4 blocks ahead into L1, ~3.9 with 8 into L2). */
#define AHEAD_BLOCKS 8

/* The bf16 bits of the levels 0..15, twice: the 32 words a vpermw looks a 5-bit index up in. */
static const uint16_t LEVELS_BF16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
};

/* The words a vpermt2w takes from two vectors of 16 floats, the even k's and the odd k's: each
   float's high word (its bf16 bits when truncated), column c's even k in word 2c and odd k in
   2c + 1, the layout of a tile multiply's second operand. */
static const uint16_t HIGH_WORDS[32] = {
    1, 33, 3, 35, 5, 37, 7, 39, 9, 41, 11, 43, 13, 45, 15, 47,
    17, 49, 19, 51, 21, 53, 23, 55, 25, 57, 27, 59, 29, 61, 31, 63,
};

/* Whether the tiles are granted and wanted: one flag for the process, as the kernel's grant of
   the tiles' state is the process's. Set by panel_amx_use, read by every call. */
static int amx_on;

/* Asks the kernel for the tiles when `want`; 1 when the calls will use them from now on. */
int64_t panel_amx_use(int64_t want) {
    const int on = want && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&amx_on, on, __ATOMIC_RELEASE);
    return on;
}

int panel_amx_enabled(void) { return __atomic_load_n(&amx_on, __ATOMIC_ACQUIRE); }

/* Tiles of 64-byte rows: the levels' 16 (pairs of k), and `rows` (up to 16) of the pieces and of
   the float32 products, fewer for a call of fewer rows, which then multiplies no zero rows. */
static void configure_tiles(int rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) config.bytes[i] = 64, config.rows[i] = (uint8_t)(i >= 6 ? TILE_ROWS : rows);
    _tile_loadconfig(&config);
}

/* x's rows [0, real) and zero rows up to `rows` (a multiple of 16) into pieces laid out
   [row tile][block][piece][16 rows][32] (bf16 bits), and each row's sum of each block's x into
   sums [rows][blocks] unless sums is NULL. */
static void split_rows(const float *x, int64_t real, int64_t rows, int64_t k, uint16_t *pieces, float *sums) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t blocks = k / Q4_BLOCK;
    for (int64_t row = 0; row < rows; row++)
        for (int64_t b = 0; b < blocks; b++) {
            __m512 halves[2];
            for (int h = 0; h < 2; h++)
                halves[h] = row < real ? _mm512_loadu_ps(x + row * k + b * Q4_BLOCK + h * 16) : _mm512_setzero_ps();
            uint16_t *out = pieces + ((row / TILE_ROWS * blocks + b) * PIECES * TILE_ROWS + row % TILE_ROWS) * 32;
            for (int h = 0; h < 2; h++) {
                __m512 rest = halves[h];
                for (int p = 0; p < PIECES; p++) {
                    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), top);
                    _mm256_store_si256((__m256i *)(out + p * TILE_VALUES + h * 16),
                                       _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
                    /* Exact: the piece is rest's leading bits. */
                    rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits));
                }
            }
            if (sums != NULL) sums[row * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(halves[0], halves[1]));
        }
}

/* A panel's `count` blocks of levels into out [block][16 pairs of k][16 columns][2] (bf16
   bits), the layout a tile multiply takes its second operand in; zeros for no panel. */
static void expand_levels(const Q4Block *blocks, int64_t count, uint16_t *out) {
    if (blocks == NULL) {
        memset(out, 0, sizeof(uint16_t) * (size_t)(count * TILE_VALUES));
        return;
    }
    const __m512i table = _mm512_loadu_si512(LEVELS_BF16);
    const __m512i low = _mm512_set1_epi32(0x0F), high = _mm512_set1_epi32(0xF0);
    for (int64_t b = 0; b < count; b++)
        for (int i = 0; i < Q4_BLOCK / 2; i++) {
            /* Each column's byte becomes the indices of its even k (low word) and odd k. */
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blocks[b].q[i]));
            const __m512i index =
                _mm512_or_si512(_mm512_and_si512(bytes, low), _mm512_slli_epi32(_mm512_and_si512(bytes, high), 12));
            _mm512_store_si512(out + (b * 16 + i) * 32, _mm512_permutexvar_epi16(index, table));
        }
}

/* Blocks [b0, b1) of a panel's float32 weights [k][16] into out [block][piece][16 pairs of k][16
   columns][2] (bf16 bits): each weight split as x is, into three exact pieces; zeros for no
   panel. Asks memory for as many lines from `ahead` (NULL for none) as it reads. */
static void expand_floats(const float *panel, int64_t b0, int64_t b1, const float *ahead, uint16_t *out) {
    if (panel == NULL) {
        memset(out, 0, sizeof(uint16_t) * (size_t)((b1 - b0) * PIECES * TILE_VALUES));
        return;
    }
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u), interleave = _mm512_loadu_si512(HIGH_WORDS);
    for (int64_t b = b0; b < b1; b++)
        for (int i = 0; i < Q4_BLOCK / 2; i++) {
            __m512 even = _mm512_loadu_ps(panel + (b * Q4_BLOCK + 2 * i) * PANEL);
            __m512 odd = _mm512_loadu_ps(panel + (b * Q4_BLOCK + 2 * i + 1) * PANEL);
            if (ahead != NULL) {
                _mm_prefetch((const char *)(ahead + 2 * i * PANEL), _MM_HINT_T1);
                _mm_prefetch((const char *)(ahead + (2 * i + 1) * PANEL), _MM_HINT_T1);
            }
            for (int p = 0; p < PIECES; p++) {
                _mm512_store_si512(out + (((b - b0) * PIECES + p) * 16 + i) * 32,
                                   _mm512_permutex2var_epi16(_mm512_castps_si512(even), interleave,
                                                             _mm512_castps_si512(odd)));
                if (p + 1 == PIECES) break;
                /* Exact: the piece is the float's leading bits. */
                even = _mm512_sub_ps(even, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(even), top)));
                odd = _mm512_sub_ps(odd, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(odd), top)));
            }
        }
}

/* One call's operands: `panels` panels in the weight, taken `pairs` pairs at a time (two
   neighbours, or when `gated` a gate panel and its up panel, n / 16 panels further on); the
   weight is its 4-bit blocks, or when `blocks` is NULL its float32 panels, `packed`. */
typedef struct {
    const float *x, *bias, *residual, *packed;
    const Q4Block *blocks;
    float *y;
    int64_t m, k, n, panels, pairs;
    int gated;
} AmxJob;

/* The panels of pair p, the second -1 where an odd panel count leaves none. */
static void pair_panels(const AmxJob *job, int64_t p, int64_t panels[2]) {
    const int64_t first = job->gated ? p : 2 * p, second = job->gated ? p + job->n / PANEL : 2 * p + 1;
    panels[0] = first;
    panels[1] = second < job->panels ? second : -1;
}

/* The blocks of pair p's two panels (the second NULL where there is none). */
static void pair_blocks(const AmxJob *job, int64_t p, const Q4Block *blocks[2]) {
    int64_t panels[2];
    pair_panels(job, p, panels);
    for (int j = 0; j < 2; j++) blocks[j] = panels[j] < 0 ? NULL : job->blocks + panels[j] * (job->k / Q4_BLOCK);
}

/* The float32 panels of pair p (the second NULL where there is none). */
static void pair_floats(const AmxJob *job, int64_t p, const float *floats[2]) {
    int64_t panels[2];
    pair_panels(job, p, panels);
    for (int j = 0; j < 2; j++) floats[j] = panels[j] < 0 ? NULL : job->packed + panels[j] * job->k * PANEL;
}

/* A block's four (or two) float32 tiles, [row tile * 2 + panel][16][16], scaled by d and
   added to acc with m times the rows' sums, for the first `rows` rows of the two row tiles. */
static inline void add_block(const float products[4][TILE_ROWS][PANEL], int tiles, int rows, const Q4Block *blocks[2],
                             int64_t b, const float *sums, int64_t per_panel, float acc[2 * TILE_ROWS][2 * PANEL]) {
    for (int t = 0; t < tiles; t++) {
        const int row_tile = t / 2, panel = t % 2;
        if (blocks[panel] == NULL) continue;
        const __m512 d = _mm512_loadu_ps(blocks[panel][b].d), m = _mm512_loadu_ps(blocks[panel][b].m);
        for (int r = 0; r < TILE_ROWS && row_tile * TILE_ROWS + r < rows; r++) {
            float *out = acc[row_tile * TILE_ROWS + r] + panel * PANEL;
            const __m512 before = b > 0 ? _mm512_load_ps(out) : _mm512_setzero_ps();
            const __m512 shifted = _mm512_fmadd_ps(_mm512_set1_ps(sums[(row_tile * TILE_ROWS + r) * per_panel + b]), m,
                                                   before);
            _mm512_store_ps(out, _mm512_fmadd_ps(_mm512_load_ps(products[t][r]), d, shifted));
        }
    }
}

/* One piece of x's rows, the tile at `first` and when `both` the next row tile's at `second`,
   times the pair's weights in tiles 6 and 7, added into tiles 0-3 (row tile x panel). */
static inline void multiply_piece(const uint16_t *first, const uint16_t *second, int both) {
    _tile_loadd(4, first, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (both) {
        _tile_loadd(5, second, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Row tiles `tile` and, when `both`, the next, times a pair's panels over all of K, into acc
   [32 rows][2 panels' columns], its first `rows` rows. With each block it asks memory for the
   same block of `next` (the next pair's panels, NULL for none). */
static void multiply_tiles(const uint16_t *pieces, const float *sums, int64_t tile, int both, int rows,
                           const uint16_t *levels,
                           const Q4Block *blocks[2], const Q4Block *const next[2], int64_t per_panel,
                           float acc[2 * TILE_ROWS][2 * PANEL]) {
    float products[4][TILE_ROWS][PANEL] __attribute__((aligned(64)));
    const uint16_t *first = pieces + tile * per_panel * PIECES * TILE_VALUES;
    const uint16_t *second = first + per_panel * PIECES * TILE_VALUES;
    sums += tile * TILE_ROWS * per_panel;
    for (int64_t b = 0; b < per_panel; b++) {
        for (int j = 0; j < 2; j++)
            for (size_t line = 0; next[j] != NULL && line < sizeof(Q4Block); line += 64)
                _mm_prefetch((const char *)&next[j][b] + line, _MM_HINT_T0);
        _tile_loadd(6, levels + b * TILE_VALUES, 64);
        _tile_loadd(7, levels + (per_panel + b) * TILE_VALUES, 64);
        _tile_zero(0);
        _tile_zero(1);
        if (both) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int p = 0; p < PIECES; p++)
            multiply_piece(first + (b * PIECES + p) * TILE_VALUES, second + (b * PIECES + p) * TILE_VALUES, both);
        _tile_stored(0, products[0], 64);
        _tile_stored(1, products[1], 64);
        if (both) {
            _tile_stored(2, products[2], 64);
            _tile_stored(3, products[3], 64);
        }
        add_block((const float(*)[TILE_ROWS][PANEL])products, both ? 4 : 2, rows, blocks, b, sums, per_panel, acc);
    }
}

/* As multiply_tiles, for a pair of float32 panels split into pieces by expand_floats: all of
   them already in `weights` (blocks of both panels, the second's after the first's), or when
   `floats` is given, each block in turn into `weights` just before its tiles run (one pass of
   row tiles over the pair: the block stays in L1). Piece i of x meets piece j of w for i + j < 3
   only: the three dropped products are together under 2^-21 |x w|, the size of the float32
   roundings of the sum, so the four tiles accumulate over the whole of K. */
static void multiply_float_tiles(const uint16_t *pieces, int64_t tile, int both, uint16_t *weights,
                                 const float *const floats[2], const float *const next[2], int64_t blocks,
                                 float acc[2 * TILE_ROWS][2 * PANEL]) {
    const uint16_t *first = pieces + tile * blocks * PIECES * TILE_VALUES;
    const uint16_t *second = first + blocks * PIECES * TILE_VALUES;
    /* A panel's pieces: one block's when split block by block, else all of them. */
    const int64_t panel_values = (floats ? 1 : blocks) * PIECES * TILE_VALUES;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        if (floats)
            for (int j = 0; j < 2; j++) {
                const float *ahead = b + AHEAD_BLOCKS < blocks ? floats[j] : next[j];
                if (ahead != NULL) ahead += (b + AHEAD_BLOCKS) % blocks * Q4_BLOCK * PANEL;
                expand_floats(floats[j], b, b + 1, ahead, weights + j * panel_values);
            }
        const uint16_t *block = floats ? weights : weights + b * PIECES * TILE_VALUES;
        for (int w = 0; w < PIECES; w++) {
            _tile_loadd(6, block + w * TILE_VALUES, 64);
            _tile_loadd(7, block + panel_values + w * TILE_VALUES, 64);
            for (int p = 0; p + w < PIECES; p++)
                multiply_piece(first + (b * PIECES + p) * TILE_VALUES, second + (b * PIECES + p) * TILE_VALUES, both);
        }
    }
    _tile_stored(0, acc[0], sizeof acc[0]);
    _tile_stored(1, acc[0] + PANEL, sizeof acc[0]);
    if (both) {
        _tile_stored(2, acc[TILE_ROWS], sizeof acc[0]);
        _tile_stored(3, acc[TILE_ROWS] + PANEL, sizeof acc[0]);
    }
}

/* acc's first `rows` rows, output rows from `row`, into y through the call's epilogue; `both`
   when the pair has its second panel. */
static void store_rows(const AmxJob *job, int64_t p, int both, int64_t row, int64_t rows,
                       float acc[2 * TILE_ROWS][2 * PANEL]) {
    const int64_t n = job->n;
    if (job->gated) {
        const int64_t column = p * PANEL;
        const __m512 gate_bias = job->bias ? _mm512_loadu_ps(job->bias + column) : _mm512_setzero_ps();
        const __m512 up_bias = job->bias ? _mm512_loadu_ps(job->bias + n + column) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            float gate[PANEL] __attribute__((aligned(64))), up[PANEL] __attribute__((aligned(64)));
            _mm512_store_ps(gate, _mm512_add_ps(_mm512_load_ps(acc[r]), gate_bias));
            _mm512_store_ps(up, _mm512_add_ps(_mm512_load_ps(acc[r] + PANEL), up_bias));
            silu_mul_row(gate, up, job->y + (row + r) * n + column, PANEL);
        }
        return;
    }
    for (int panel = 0; panel < 1 + both; panel++) {
        const int64_t column = (2 * p + panel) * PANEL, left = n - column;
        const __mmask16 mask = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 bias = job->bias ? _mm512_maskz_loadu_ps(mask, job->bias + column) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            __m512 out = _mm512_add_ps(_mm512_load_ps(acc[r] + panel * PANEL), bias);
            if (job->residual) {
                /* Rounded before the residual joins it, as in torch (and panel_linear.c). */
                __asm__("" : "+v"(out));
                out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, job->residual + (row + r) * n + column));
            }
            _mm512_mask_storeu_ps(job->y + (row + r) * n + column, mask, out);
        }
    }
}

/* Pairs [p0, p1) of 4-bit blocks times the row block of `rows` rows from `row`, already split. */
static void multiply_block_pairs(const AmxJob *job, int64_t p0, int64_t p1, int64_t row, int64_t rows,
                                 const uint16_t *pieces, const float *sums, uint16_t *levels) {
    float acc[2 * TILE_ROWS][2 * PANEL] __attribute__((aligned(64)));
    const int64_t per_panel = job->k / Q4_BLOCK, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const Q4Block *none[2] = {NULL, NULL};
    for (int64_t p = p0; p < p1; p++) {
        const Q4Block *blocks[2], *next[2] = {NULL, NULL};
        pair_blocks(job, p, blocks);
        if (p + 1 < p1) pair_blocks(job, p + 1, next);
        expand_levels(blocks[0], per_panel, levels);
        expand_levels(blocks[1], per_panel, levels + per_panel * TILE_VALUES);
        for (int64_t t = 0; t < tiles; t += 2) {
            const int left = (int)(rows - t * TILE_ROWS < 2 * TILE_ROWS ? rows - t * TILE_ROWS : 2 * TILE_ROWS);
            /* The first row tiles fetch the next pair's blocks, while the weights stream. */
            multiply_tiles(pieces, sums, t, t + 1 < tiles, left, levels, blocks, t == 0 ? next : none, per_panel,
                           acc);
            store_rows(job, p, blocks[1] != NULL, row + t * TILE_ROWS, left, acc);
        }
    }
}

/* Pairs [p0, p1) of float32 panels times the row block of `rows` rows from `row`, already split;
   `weights` takes each pair's pieces in turn (or one block's, when one pass of tiles covers the
   rows). */
static void multiply_float_pairs(const AmxJob *job, int64_t p0, int64_t p1, int64_t row, int64_t rows,
                                 const uint16_t *pieces, uint16_t *weights) {
    float acc[2 * TILE_ROWS][2 * PANEL] __attribute__((aligned(64)));
    const int64_t blocks = job->k / Q4_BLOCK, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    /* More than one pass of row tiles: each pass reuses the pair split once. */
    const int whole_pair = tiles > 2;
    for (int64_t p = p0; p < p1; p++) {
        const float *floats[2], *next[2] = {NULL, NULL};
        pair_floats(job, p, floats);
        if (p + 1 < p1) pair_floats(job, p + 1, next);
        if (whole_pair) {
            expand_floats(floats[0], 0, blocks, NULL, weights);
            expand_floats(floats[1], 0, blocks, NULL, weights + blocks * PIECES * TILE_VALUES);
        }
        for (int64_t t = 0; t < tiles; t += 2) {
            const int left = (int)(rows - t * TILE_ROWS < 2 * TILE_ROWS ? rows - t * TILE_ROWS : 2 * TILE_ROWS);
            multiply_float_tiles(pieces, t, t + 1 < tiles, weights, whole_pair ? NULL : floats, next, blocks, acc);
            store_rows(job, p, floats[1] != NULL, row + t * TILE_ROWS, left, acc);
        }
    }
}

static int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

/* The call's work: x split into pieces row block by row block, each block times the pairs of
   the weight. */
static int run_job(const AmxJob *job, int threads) {
    const int64_t m = job->m, k = job->k, per_panel = k / Q4_BLOCK, shared = m <= SHARED_ROWS;
    const int floats = job->blocks == NULL;
    int64_t cap = PIECE_BYTES / (k * PIECES * (int64_t)sizeof(uint16_t)) / TILE_ROWS * TILE_ROWS;
    if (cap < 2 * TILE_ROWS) cap = 2 * TILE_ROWS;
    /* Row blocks: a whole number per thread when threads take them, as even as 16s allow. */
    int64_t count = (m + cap - 1) / cap;
    if (!shared) count = round_up(count, threads);
    const int64_t block_rows = round_up((m + count - 1) / count, TILE_ROWS);
    count = (m + block_rows - 1) / block_rows;
    /* Each thread's buffers, cut from one allocation made before any thread starts: nothing is
       written unless all of them could be had (y may be the residual). */
    const size_t piece_bytes = sizeof(uint16_t) * (size_t)(block_rows * k * PIECES);
    const size_t level_bytes = sizeof(uint16_t) * (size_t)(2 * per_panel * TILE_VALUES * (floats ? PIECES : 1));
    const size_t sum_bytes = floats ? 0 : (size_t)round_up((int64_t)sizeof(float) * block_rows * per_panel, 64);
    const size_t per_thread = piece_bytes + level_bytes + sum_bytes;
    char *scratch = aligned_alloc(64, per_thread * (size_t)threads);
    if (scratch == NULL) return 1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        char *own = scratch + per_thread * (size_t)thread;
        uint16_t *pieces = (uint16_t *)own, *levels = (uint16_t *)(own + piece_bytes);
        float *sums = floats ? NULL : (float *)(own + piece_bytes + level_bytes);
        configure_tiles(m < TILE_ROWS ? (int)m : TILE_ROWS);
        for (int64_t b = shared ? 0 : thread; b < count; b += shared ? 1 : team) {
            const int64_t row = b * block_rows, rows = m - row < block_rows ? m - row : block_rows;
            split_rows(job->x + row * k, rows, round_up(rows, TILE_ROWS), k, pieces, sums);
            const int64_t p0 = shared ? job->pairs * thread / team : 0;
            const int64_t p1 = shared ? job->pairs * (thread + 1) / team : job->pairs;
            if (floats)
                multiply_float_pairs(job, p0, p1, row, rows, pieces, levels);
            else
                multiply_block_pairs(job, p0, p1, row, rows, pieces, sums, levels);
        }
        _tile_release();
    }
    free(scratch);
    return 0;
}

int panel_amx_linear(const float *x, int64_t m, int64_t k, const float *packed, const Q4Block *blocks, int64_t n,
                     int gated, const float *bias, const float *residual, float *y, int threads) {
    if (k % Q4_BLOCK) return 1;
    const int64_t panels = gated ? 2 * n / PANEL : (n + PANEL - 1) / PANEL;
    const AmxJob job = {x, bias, residual, packed, blocks, y, m, k, n, panels, gated ? n / PANEL : (panels + 1) / 2,
                        gated};
    return run_job(&job, threads);
}
#else
int64_t panel_amx_use(int64_t want) {
    (void)want;
    return 0;
}

int panel_amx_enabled(void) { return 0; }

int panel_amx_linear(const float *x, int64_t m, int64_t k, const float *packed, const Q4Block *blocks, int64_t n,
                     int gated, const float *bias, const float *residual, float *y, int threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)blocks, (void)n, (void)gated, (void)bias, (void)residual, (void)y,
        (void)threads;
    return 1;
}
#endif
