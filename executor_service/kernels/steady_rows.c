/* A steady decode step's bookkeeping over the executor's persistent batch
 * (runner/request_rows.py): gathering the step's inputs from the rows' tables, and writing its
 * sampled tokens back.
 *
 * Each is one pass over the step's rows in place of a dozen numpy operations. After a forward
 * has swept the caches, every numpy or torch call on the host costs tens of microseconds of
 * misses before it does any work, so the number of calls, not the arithmetic, is what a step's
 * host work costs; these two make it two.
 *
 * Tables are row-major: ints[row * int_cols + column], blocks[row * block_cols + i],
 * tokens[row * token_cols + i]. `columns` names the ints columns the functions read and write,
 * so the layout has one owner, request_rows.py.
 */
#include <stddef.h>
#include <stdint.h>

enum { COL_COMPUTED, COL_NUM_TOKENS, COL_NUM_BLOCKS, COL_LAST_TOKEN };

/* Every row must be one token behind (computed + 1 == known tokens) with room in its blocks for
 * that token. Then, per row i: its last token, its position (its computed count), its context
 * length and the cache slot its token's K/V go to; and its block table kept up to date in
 * `table` ([rows, table_cols], kept by the caller from step to step): held[i] says how many of
 * row i's blocks it holds already, and only the blocks added since are copied (and checked to
 * lie in the cache). A steady step's rows only ever gain blocks while they are the same rows, so
 * a step copies what changed, not every context's whole table. Entries past a row's blocks are
 * 0, the padding the tables use.
 *
 * Returns 0; -1 when a row is not one token behind or lacks room, -2 when a new block id lies
 * outside the cache, -3 when a row holds more blocks than table_cols (the caller widens the
 * table and starts it over, held all 0). Nothing is promised of the outputs then. */
int64_t steady_gather(
    const int64_t *ints, int64_t int_cols, const int64_t *columns,
    const int64_t *blocks, int64_t block_cols,
    const int64_t *rows, int64_t num_rows, int64_t block_size, int64_t num_cache_blocks,
    int64_t *last_tokens, int64_t *positions, int64_t *context_lens, int64_t *slots,
    int64_t *table, int64_t table_cols, int64_t *held)
{
    const int64_t computed_col = columns[COL_COMPUTED], tokens_col = columns[COL_NUM_TOKENS];
    const int64_t blocks_col = columns[COL_NUM_BLOCKS], last_col = columns[COL_LAST_TOKEN];
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t *row = ints + rows[i] * int_cols;
        const int64_t end = row[computed_col] + 1;
        if (end != row[tokens_col] || end > row[blocks_col] * block_size)
            return -1;
        if (row[blocks_col] > table_cols)
            return -3;
    }
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t *row = ints + rows[i] * int_cols;
        const int64_t *source = blocks + rows[i] * block_cols;
        const int64_t count = row[blocks_col];
        int64_t *out = table + i * table_cols;
        for (int64_t b = held[i]; b < count; b++) {
            if (source[b] < 0 || source[b] >= num_cache_blocks)
                return -2;
            out[b] = source[b];
        }
        for (int64_t b = count; b < held[i]; b++)
            out[b] = 0;
        held[i] = count;
        const int64_t position = row[computed_col];
        last_tokens[i] = row[last_col];
        positions[i] = position;
        context_lens[i] = position + 1;
        slots[i] = out[position / block_size] * block_size + position % block_size;
    }
    return 0;
}

/* A steady step ran: row i's last token is computed and sampled[i] is its next one, written
 * after its known tokens. Where counts is not NULL, the rows at `penalised` (places in rows)
 * count their token once more in their row of counts ([*, vocab] float32, counts_rows[j] the row
 * of penalised[j]).
 *
 * Returns 0; else, writing nothing: the token table width a row's new token needs when it is
 * wider than token_cols, or -1 when a penalised row's token lies outside the vocabulary. */
int64_t steady_decoded(
    int64_t *ints, int64_t int_cols, const int64_t *columns,
    int32_t *tokens, int64_t token_cols,
    const int64_t *rows, int64_t num_rows, const int64_t *sampled,
    float *counts, int64_t vocab, const int64_t *penalised, const int64_t *counts_rows, int64_t num_penalised)
{
    const int64_t computed_col = columns[COL_COMPUTED], tokens_col = columns[COL_NUM_TOKENS];
    const int64_t last_col = columns[COL_LAST_TOKEN];
    int64_t needed = 0;
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t end = ints[rows[i] * int_cols + tokens_col];
        if (end + 1 > needed)
            needed = end + 1;
    }
    if (needed > token_cols)
        return needed;
    if (counts != NULL) {
        for (int64_t j = 0; j < num_penalised; j++) {
            const int64_t token = sampled[penalised[j]];
            if (token < 0 || token >= vocab)
                return -1;
        }
    }
    for (int64_t i = 0; i < num_rows; i++) {
        int64_t *row = ints + rows[i] * int_cols;
        const int64_t end = row[tokens_col];
        tokens[rows[i] * token_cols + end] = (int32_t)sampled[i];
        row[computed_col] = end;
        row[tokens_col] = end + 1;
        row[last_col] = sampled[i];
    }
    if (counts != NULL) {
        for (int64_t j = 0; j < num_penalised; j++)
            counts[counts_rows[j] * vocab + sampled[penalised[j]]] += 1.0f;
    }
    return 0;
}
