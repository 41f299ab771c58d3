/* The exponential of a softmax weight, x = score - the row's running maximum <= 0, in the
 * attention kernels' vectorised loops.
 *
 * Below EXP_LOWEST the result would be under the smallest normal float; such a weight is 0
 * here instead of a subnormal, which changes no sum that also holds the row's maximum, whose
 * weight is 1; x <= 0 keeps it under EXP_HIGHEST. (glibc's vector expf, which the kernels once
 * used, handed each such lane to its scalar expf: a 2,048-token prefill layer of the random
 * Llama took 11.6 ms instead of 7.8.) */
#ifndef SPLITSERVE_SOFTMAX_EXP_H
#define SPLITSERVE_SOFTMAX_EXP_H
#include "vector_exp.h"

static inline __attribute__((always_inline)) float softmax_exp(float x) {
    return x < EXP_LOWEST ? 0.0f : exp_in_range(x);
}
#endif
