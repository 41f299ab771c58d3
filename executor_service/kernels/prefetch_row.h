/* Asking memory for a row of floats before a kernel reads it, into L2, not L1 (prefetcht1,
 * locality 2): lines in flight beyond L1's miss buffers stall the loads (on an AMD EPYC, SmolLM2
 * shapes, asking for the next block's rows took a decode layer from 36.7 ms to 22.3 ms).
 *
 * Written as the instruction on x86: GCC 12's dead-code elimination drops a __builtin_prefetch
 * whose loop has no other effect (every one in attention_chunk.c's RowsAhead was gone from the
 * library, which then ran as if it asked for nothing). */
#ifndef SPLITSERVE_PREFETCH_ROW_H
#define SPLITSERVE_PREFETCH_ROW_H
#include <stdint.h>

static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 64 / (int64_t)sizeof(float)) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("prefetcht1 %0" : : "m"(row[i]));
#else
        __builtin_prefetch(row + i, 0, 2);
#endif
    }
}
#endif
