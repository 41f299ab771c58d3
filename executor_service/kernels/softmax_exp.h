/* The exponential of a softmax weight, x = score - the row's running maximum <= 0, in the
 * attention kernels' vectorised loops.
 *
 * glibc's vector expf hands every lane below its range (x < -87.3, where the result is under the
 * smallest normal float) to the scalar expf, one lane at a time. Attention scores of real models
 * land there often: a 2,048-token prefill layer of the random Llama took 11.6 ms instead of 7.8.
 * Such a weight is 0 here instead of a subnormal, which changes no sum that also holds the row's
 * maximum, whose weight is 1. The argument is clamped as well as the result selected: in a
 * vectorised loop both sides of the select are computed for every lane, so expf must never see
 * the out-of-range value. */
#ifndef SPLITSERVE_SOFTMAX_EXP_H
#define SPLITSERVE_SOFTMAX_EXP_H
#include <math.h>

#define SOFTMAX_EXP_FLOOR -87.0f

static inline float softmax_exp(float x) {
    return x < SOFTMAX_EXP_FLOOR ? 0.0f : expf(x > SOFTMAX_EXP_FLOOR ? x : SOFTMAX_EXP_FLOOR);
}
#endif
