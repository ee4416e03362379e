// kernels/cpu/rope.cpp — rotary position embedding (RoPE), the readable definition.
// The CUDA kernel is kernels/cuda/rope.cu.
//
// As DeepSeek-V3 applies it (inference/model.py, apply_rotary_emb): the last dim of x is read
// as D/2 complex numbers z_i = x[2i] + i x[2i+1] (consecutive pairs, torch.view_as_complex),
// and z_i is multiplied by e^(i a), a = pos * theta^(-2i/D) (torch.polar of the angles):
//
//     y[2i]   = x[2i] cos a - x[2i+1] sin a
//     y[2i+1] = x[2i] sin a + x[2i+1] cos a
//
// A rotation is orthogonal, so its backward is the rotation by -a (sign = -1): the transpose
// of the 2 x 2 rotation matrix is its inverse.
//
// Shapes: x, y (T, M, D); pos (T). The M rows of a token (its heads) share its position.
//
// Precision: everything in double, rounded to float once at the end. The angle must be: at
// position 1e5 (i = 0) it is 1e5 rad, which a float holds only to half an ulp, 2^-8 = 0.004
// rad, and a float theta^(-2i/D) (relative error ~2^-24) moves it by as much again — the
// rotated pair would be off by 0.4% of its norm. In double, pow is within an ulp, and the
// rounding of -2i/D moves theta^(-2i/D) by at most ln(theta) 2^-53 relative (9.2 2^-53 for
// theta = 10^4), so the angle is within ~12 2^-53 of pos theta^(-2i/D): 1.3e-10 rad at
// position 1e5. glibc's cos and sin reduce large arguments exactly and are within an ulp.
// So each output is within half a float ulp of the exact rotation of the float inputs, plus
// 12 2^-53 pos |(x[2i], x[2i+1])|, which stays below a float ulp of the pair for positions
// up to ~10^7.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void rope(float* y, const float* x, const int64_t* pos, int64_t T, int64_t M, int64_t D,
          float theta, int sign) {
  const int64_t half = D / 2;
  std::vector<double> cos_a((size_t)half), sin_a((size_t)half);
  for (int64_t t = 0; t < T; t++) {
    // the token's D/2 angles, shared by its M rows
    for (int64_t i = 0; i < half; i++) {
      double inv_freq = std::pow((double)theta, -2.0 * (double)i / (double)D);
      double angle = (double)pos[t] * inv_freq;
      cos_a[(size_t)i] = std::cos(angle);
      sin_a[(size_t)i] = sign * std::sin(angle);  // sin(-a) = -sin(a)
    }
    for (int64_t m = 0; m < M; m++) {
      const float* xr = x + (t * M + m) * D;
      float* yr = y + (t * M + m) * D;
      for (int64_t i = 0; i < half; i++) {
        double x0 = xr[2 * i], x1 = xr[2 * i + 1], c = cos_a[(size_t)i], s = sin_a[(size_t)i];
        yr[2 * i] = (float)(x0 * c - x1 * s);
        yr[2 * i + 1] = (float)(x0 * s + x1 * c);
      }
    }
  }
}

}  // namespace ff::cpu
