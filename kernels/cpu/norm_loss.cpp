// kernels/cpu/norm_loss.cpp — RMSNorm and cross-entropy, forward and backward.
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

// y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps) {
  for (int64_t r = 0; r < N; r++) {
    const float* xr = x + r * C;
    double ss = 0.0;
    for (int64_t j = 0; j < C; j++) ss += (double)xr[j] * xr[j];
    float rs = (float)(1.0 / std::sqrt(ss / C + eps));
    rstd[r] = rs;
    for (int64_t j = 0; j < C; j++) y[r * C + j] = xr[j] * rs * w[j];
  }
}

// With xhat = x * rstd and g = dy * w:
//   dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  for (int64_t j = 0; j < C; j++) dw[j] = 0.f;
  for (int64_t r = 0; r < N; r++) {
    const float* xr = x + r * C;
    const float* dyr = dy + r * C;
    float rs = rstd[r];
    double dot = 0.0;
    for (int64_t j = 0; j < C; j++) dot += (double)dyr[j] * w[j] * xr[j] * rs;
    float mean_gx = (float)(dot / C);
    for (int64_t j = 0; j < C; j++) {
      float xhat = xr[j] * rs;
      dx[r * C + j] = rs * (dyr[j] * w[j] - xhat * mean_gx);
      dw[j] += dyr[j] * xhat;
    }
  }
}

void cross_entropy_forward(float* loss, float* lse, const float* logits, const int64_t* targets,
                           int64_t N, int64_t V) {
  for (int64_t r = 0; r < N; r++) {
    const float* z = logits + r * V;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < V; j++) m = std::fmax(m, z[j]);
    double l = 0.0;
    for (int64_t j = 0; j < V; j++) l += std::exp((double)(z[j] - m));
    lse[r] = m + (float)std::log(l);
    loss[r] = lse[r] - z[targets[r]];
  }
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int64_t* targets, const float* dloss, int64_t N, int64_t V) {
  for (int64_t r = 0; r < N; r++)
    for (int64_t j = 0; j < V; j++) {
      float p = std::exp(logits[r * V + j] - lse[r]);
      dlogits[r * V + j] = (p - (j == targets[r] ? 1.f : 0.f)) * dloss[r];
    }
}

}  // namespace ff::cpu
