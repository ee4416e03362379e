// kernels/cpu/reduce.cpp — sum/max along one dim of an [outer, n, inner] view,
// softmax and log_softmax along the last dim. Sums accumulate in double.
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void reduce(ReduceOp op, float* out, const float* in, int64_t outer, int64_t n, int64_t inner) {
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      const float* p = in + o * n * inner + i;
      if (op == ReduceOp::sum) {
        double s = 0.0;
        for (int64_t j = 0; j < n; j++) s += p[j * inner];
        out[o * inner + i] = (float)s;
      } else {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; j++) m = std::fmax(m, p[j * inner]);
        out[o * inner + i] = m;
      }
    }
}

void max_backward(float* dx, const float* x, const float* y, const float* dy, int64_t outer,
                  int64_t n, int64_t inner) {
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      const float* p = x + o * n * inner + i;
      float* d = dx + o * n * inner + i;
      bool routed = false;
      for (int64_t j = 0; j < n; j++) {
        bool hit = !routed && p[j * inner] == y[o * inner + i];
        d[j * inner] = hit ? dy[o * inner + i] : 0.f;
        routed = routed || hit;
      }
    }
}

// Safe softmax: subtract the row max before exponentiating (two passes over the row).
void softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; r++) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < C; j++) m = std::fmax(m, xr[j]);
    double l = 0.0;
    for (int64_t j = 0; j < C; j++) {
      yr[j] = std::exp(xr[j] - m);
      l += yr[j];
    }
    float inv = (float)(1.0 / l);
    for (int64_t j = 0; j < C; j++) yr[j] *= inv;
  }
}

void softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; r++) {
    const float* yr = y + r * C;
    const float* dyr = dy + r * C;
    double dot = 0.0;
    for (int64_t j = 0; j < C; j++) dot += (double)dyr[j] * yr[j];
    for (int64_t j = 0; j < C; j++) dx[r * C + j] = yr[j] * (dyr[j] - (float)dot);
  }
}

void log_softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; r++) {
    const float* xr = x + r * C;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < C; j++) m = std::fmax(m, xr[j]);
    double l = 0.0;
    for (int64_t j = 0; j < C; j++) l += std::exp((double)(xr[j] - m));
    float lse = m + (float)std::log(l);
    for (int64_t j = 0; j < C; j++) y[r * C + j] = xr[j] - lse;
  }
}

void log_softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; r++) {
    double s = 0.0;
    for (int64_t j = 0; j < C; j++) s += dy[r * C + j];
    for (int64_t j = 0; j < C; j++)
      dx[r * C + j] = dy[r * C + j] - std::exp(y[r * C + j]) * (float)s;
  }
}

}  // namespace ff::cpu
