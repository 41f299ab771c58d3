/* Exact greedy logits from an int8 screen: the two passes around the integer matmul of
   greedy_head.py.

   quantize_rows rounds each hidden row h to int8 with a scale of its own, h = s q + d, and
   reports what the bound needs of it. screened_logits takes the integer products Q = q p^T
   (p: the weight rows rounded the same way, W_v = t_v p_v + e_v; as float32, exact below 2^24
   and one rounding from exact above) and keeps, for each row, every token whose logit the
   screen cannot rule out:

       h . W_v = s t_v Q_v + s (q . e_v) + d . W_v
       |h . W_v - s t_v Q_v| <= s |q| |e_v| + |d| |W_v|          (Cauchy-Schwarz)

   A hidden state with a few channels far above the rest (SmolLM2's channel 199 runs ~50x the
   others) would make s, and with it the bound, loose for every other channel. The caller takes
   such channels O out before rounding, h = h' + h_O, and passes each token's h_O . W_v as an
   offset computed in float32: the screen value becomes s t_v Q_v + offset, and the caller adds
   the offset's rounding (a multiple of |h_O| |W_v|) to the |W_v| term.

   A token whose upper bound is below some token's lower bound cannot be the argmax. The bound
   is widened for float32 rounding (the scales, the products, a float32 matmul's own summation in
   any order), so no token a float32 matmul could make the largest is ever dropped. The kept
   tokens get their logits as the packed head computes them (panel_linear.c's float path: one
   chain of fused multiply-adds over k = 0..K-1 from zero), bit for bit; every other token gets
   -inf. The first largest index of the row is then the first largest index of the packed
   head's row: the same greedy token, whatever the screen kept or the rows beside it. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef uint32_t __attribute__((may_alias)) float_bits;

/* Relative widening of the Cauchy-Schwarz terms for the float32 arithmetic that computes them
   and the bound itself (each a few units of 2^-24). */
#define TERM_WIDEN (1.0f + 0x1p-10f)
/* Widening by the screen value's own magnitude: s t_v Q_v is three roundings from exact (four
   where Q_v itself was rounded to float32), and one more for adding the offset. */
#define SCREEN_ROUNDING 0x1p-21f
/* Absolute widening for underflow: logits this small are kept whole, never screened. */
#define UNDERFLOW_FLOOR 0x1p-100f
/* -inf, stored as bits. */
#define NEGATIVE_INFINITY_BITS 0xff800000u

/* hidden: rows of dim floats, row r at hidden + r * stride, finite and small enough that no
   logit nor bound overflows (greedy_head.py checks). Out per row: q + 128 (dim uint8, the
   zero point of oneDNN's u8 x s8 linear), its scale, s |q|, and |d| plus |h| times extra (the
   float32 rounding of a full matmul and of d, added by the caller's constant). A row of zeros
   gets scale 1 and q = 0. */
void quantize_rows(const float *hidden, int64_t rows, int64_t dim, int64_t stride, float extra, uint8_t *q,
                   float *scale, float *a_term, float *b_term) {
    for (int64_t r = 0; r < rows; r++) {
        const float *h = hidden + r * stride;
        uint8_t *qr = q + r * dim;
        float largest = 0.0f;
        for (int64_t i = 0; i < dim; i++) largest = fmaxf(largest, fabsf(h[i]));
        float s = largest > 0.0f ? largest / 127.0f : 1.0f;
        double q_sq = 0.0, d_sq = 0.0, h_sq = 0.0;
        for (int64_t i = 0; i < dim; i++) {
            float level = nearbyintf(h[i] / s);
            level = fminf(fmaxf(level, -127.0f), 127.0f);
            qr[i] = (uint8_t)((int)level + 128);
            double d = (double)h[i] - (double)s * (double)level;
            q_sq += (double)level * level;
            d_sq += d * d;
            h_sq += (double)h[i] * h[i];
        }
        scale[r] = s;
        a_term[r] = (float)((double)s * sqrt(q_sq));
        b_term[r] = (float)(sqrt(d_sq) + (double)extra * sqrt(h_sq));
    }
}

/* Tokens whose chains run side by side: each chain keeps its own order, and eight of them in
   flight cover the fused multiply-add's latency. */
enum { CHAIN_GROUP = 8 };

/* logits[v] for each v in tokens: h . W_v as panel_linear.c's float path gives it (a chain of
   fused multiply-adds over k in order, from zero, and the absent bias's + 0). */
static void head_logits(const float *h, const float *weight, int64_t dim, const int32_t *tokens, int64_t n,
                        float *logits) {
    int64_t i = 0;
    for (; i + CHAIN_GROUP <= n; i += CHAIN_GROUP) {
        const float *w[CHAIN_GROUP];
        float acc[CHAIN_GROUP];
        for (int j = 0; j < CHAIN_GROUP; j++) {
            w[j] = weight + (int64_t)tokens[i + j] * dim;
            acc[j] = 0.0f;
        }
        for (int64_t k = 0; k < dim; k++)
            for (int j = 0; j < CHAIN_GROUP; j++) acc[j] = fmaf(h[k], w[j][k], acc[j]);
        for (int j = 0; j < CHAIN_GROUP; j++) logits[tokens[i + j]] = acc[j] + 0.0f;
    }
    for (; i < n; i++) {
        const float *w = weight + (int64_t)tokens[i] * dim;
        float acc = 0.0f;
        for (int64_t k = 0; k < dim; k++) acc = fmaf(h[k], w[k], acc);
        logits[tokens[i]] = acc + 0.0f;
    }
}

/* One token's screen value and the half-width of the interval that holds its logit. */
static inline void screen_at(const float *row, const float *offset, int64_t v, float s, float a, float b,
                             const float *vocab_scale, const float *vocab_error, const float *vocab_norm,
                             float *screen, float *bound) {
    float product = s * vocab_scale[v] * row[v];
    float shift = offset ? offset[v] : 0.0f;
    *screen = product + shift;
    /* Both magnitudes: where the offset cancels the product, the product's rounding remains. */
    *bound = a * vocab_error[v] + b * vocab_norm[v] + SCREEN_ROUNDING * (fabsf(product) + fabsf(shift)) +
             UNDERFLOW_FLOOR;
}

/* Tokens are checked a chunk at a time: the counting pass notes which chunks keep any, and only
   those (a few per row) are walked again token by token. */
enum { CHUNK = 64 };

/* products: rows x vocab floats (q p^T); offsets: rows x vocab floats (h_O . W_v), or NULL for
   none; vocab_scale t_v, vocab_error |e_v|, vocab_norm |W_v|; hidden: the whole rows h;
   weight: vocab rows of dim floats. A row that keeps more than cap tokens gets no dot products
   (its out row is all -inf), for the caller to compute in full. counts[r]: the tokens row r
   kept. */
void screened_logits(const float *products, const float *offsets, int64_t rows, int64_t vocab, const float *scale,
                     const float *a_term, const float *b_term, const float *vocab_scale,
                     const float *vocab_error, const float *vocab_norm, const float *hidden,
                     int64_t hidden_stride, const float *weight, int64_t dim, float *out,
                     int64_t out_stride, int64_t cap, int64_t *counts, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = products + r * vocab;
        const float *offset = offsets ? offsets + r * vocab : NULL;
        const float s = scale[r], a = a_term[r] * TERM_WIDEN, b = b_term[r] * TERM_WIDEN;
        float screen, bound;
        /* The largest lower bound: no token whose upper bound is below it can be the argmax. */
        screen_at(row, offset, 0, s, a, b, vocab_scale, vocab_error, vocab_norm, &screen, &bound);
        float floor = screen - bound;
        for (int64_t v = 1; v < vocab; v++) {
            screen_at(row, offset, v, s, a, b, vocab_scale, vocab_error, vocab_norm, &screen, &bound);
            floor = fmaxf(floor, screen - bound);
        }
        /* One pass marks the chunks that keep any token, counts the kept tokens and writes -inf
           everywhere; the dot products come after, only for a row the bound narrowed enough (a
           row left to the caller is overwritten by the full head). */
        float *logits = out + r * out_stride;
        float_bits *logit_bits = (float_bits *)logits;
        uint8_t hit_chunks[(vocab + CHUNK - 1) / CHUNK];
        int64_t kept = 0;
        for (int64_t start = 0, chunk = 0; start < vocab; start += CHUNK, chunk++) {
            const int64_t end = start + CHUNK < vocab ? start + CHUNK : vocab;
            int64_t hits = 0;
            for (int64_t v = start; v < end; v++) {
                screen_at(row, offset, v, s, a, b, vocab_scale, vocab_error, vocab_norm, &screen, &bound);
                hits += screen + bound >= floor;
                logit_bits[v] = NEGATIVE_INFINITY_BITS;
            }
            hit_chunks[chunk] = hits > 0;
            kept += hits;
        }
        counts[r] = kept;
        if (kept > cap) continue;
        int32_t tokens[kept > 0 ? kept : 1];
        int64_t n = 0;
        for (int64_t start = 0, chunk = 0; start < vocab; start += CHUNK, chunk++) {
            if (!hit_chunks[chunk]) continue;
            const int64_t end = start + CHUNK < vocab ? start + CHUNK : vocab;
            for (int64_t v = start; v < end; v++) {
                screen_at(row, offset, v, s, a, b, vocab_scale, vocab_error, vocab_norm, &screen, &bound);
                if (screen + bound >= floor) tokens[n++] = (int32_t)v;
            }
        }
        head_logits(hidden + r * hidden_stride, weight, dim, tokens, n, logits);
    }
}
