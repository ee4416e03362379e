// kernels/cuda/rope.cu — rotary position embedding (RoPE), as DeepSeek-V3 applies it. The cpu
// twin, the readable definition, is kernels/cpu/rope.cpp.
//
// Shapes: x, y (T, M, D): T tokens, M rows per token (heads) sharing the token's position,
// D even; pos (T), int64. Pair p of the T M D/2 pairs is (x[2p], x[2p+1]): token
// t = p / (M D/2), frequency index i = p % (D/2). It is rotated by
// a = sign * pos[t] * theta^(-2i/D):
//     y[2p] = x[2p] cos a - x[2p+1] sin a,   y[2p+1] = x[2p] sin a + x[2p+1] cos a.
//
// Kernel: one thread per pair, grid-stride. Consecutive threads read and write consecutive
// pairs (8 bytes each), so a warp's accesses coalesce; the op is bound by memory bandwidth.
//
// The angle is formed in double and reduced to [-pi, pi] in double; only the reduced angle is
// rounded to float for sincosf. In float, pos * theta^(-2i/D) at position 1e5 (i = 0) is 1e5
// rad held to half an ulp, 2^-8 = 0.004 rad, and the pair would be rotated 0.4% of its norm
// away from where it belongs — at every long-context position. In double, the angle is within
// ~12 2^-53 of exact (kernels/cpu/rope.cpp), ~1e-10 rad at position 1e5, and the reduction
// a - 2 pi rint(a / 2 pi) adds a rounding of |a| 2^-53 and n |2 pi - fl(2 pi)| < |a| 2^-53.
// Then the float error is the reduced angle's rounding (pi 2^-24 at most) and sincosf's (CUDA:
// 2 ulps), the same at position 10^6 as at position 1. The double work is a pow, a multiply
// and a rint per pair: on a data-centre GPU FP64 runs at half the FP32 rate and this stays
// memory-bound; a consumer GPU (FP64 at 1/64) would want the D/2 inverse frequencies computed
// once into a table.
#include <cmath>

#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

constexpr double kTwoPi = 6.283185307179586;  // 2 pi rounded to double

// ----------------------------------------------------------------------------
// kernel

__global__ void rope_kernel(float* y, const float* x, const int64_t* pos, int64_t T, int64_t M,
                            int64_t D, float theta, int sign) {
  const int64_t half = D / 2, pairs_per_token = M * half, n = T * pairs_per_token;
  for (int64_t p = grid_index(); p < n; p += grid_stride()) {
    const int64_t t = p / pairs_per_token, i = p % half;
    // the angle in double, reduced to [-pi, pi], then rounded to float
    double angle = (double)pos[t] * pow((double)theta, -2.0 * (double)i / (double)D);
    float a = (float)(angle - kTwoPi * rint(angle / kTwoPi));
    float s, c;
    sincosf(a, &s, &c);
    s *= (float)sign;  // the backward rotates by -a: sin(-a) = -sin(a), cos(-a) = cos(a)
    const float x0 = x[2 * p], x1 = x[2 * p + 1];
    y[2 * p] = x0 * c - x1 * s;
    y[2 * p + 1] = x0 * s + x1 * c;
  }
}

// ----------------------------------------------------------------------------
// launcher (the KernelTable entry)

void rope(float* y, const float* x, const int64_t* pos, int64_t T, int64_t M, int64_t D,
          float theta, int sign) {
  const int64_t pairs = T * M * (D / 2);
  if (pairs == 0) return;
  SIMT_LAUNCH(rope_kernel, elementwise_grid(pairs), kElementwiseBlock, 0, 0, y, x, pos, T, M, D,
              theta, sign);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
