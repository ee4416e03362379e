// kernels/cpu/norm_loss.cpp — RMSNorm and cross-entropy, forward and backward.
//
// Written for speed as well as reading, as reduce.cpp: row sums in double in
// `omp simd` loops the compiler vectorises, exp_double instead of a libm call per element,
// the cross-entropy's statistics in one pass (softmax_row_stats, the online softmax), large
// tensors' rows shared among OpenMP threads (for_row_blocks; results do not depend on the
// thread count).
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/row_math.h"

namespace ff::cpu {

namespace {

// y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps): one division and square root per row.
FF_CPU_CLONES void rmsnorm_rows(float* y, float* rstd, const float* x, const float* w,
                                int64_t rows, int64_t C, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * C;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < C; j++) ss += (double)xr[j] * xr[j];
    const float rs = (float)(1.0 / std::sqrt(ss / C + eps));
    rstd[r] = rs;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) y[r * C + j] = xr[j] * rs * w[j];
  }
}

// With xhat = x * rstd and g = dy * w:
//   dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat
// dw adds in float in row order (the order the kernel tests assume, and the same whatever the
// thread count), so this one stays on one thread: rows in order, each row's dot (read from
// memory once), then its dx and its dw terms (re-read from the cache), both loops vectorised.
FF_CPU_CLONES void rmsnorm_backward_rows(float* dx, float* dw, const float* dy, const float* x,
                                         const float* w, const float* rstd, int64_t N, int64_t C) {
  for (int64_t j = 0; j < C; j++) dw[j] = 0.f;
  for (int64_t r = 0; r < N; r++) {
    const float* xr = x + r * C;
    const float* dyr = dy + r * C;
    const float rs = rstd[r];
    double dot = 0.0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < C; j++) dot += (double)dyr[j] * w[j] * xr[j] * rs;
    const float mean_gx = (float)(dot / C);
#pragma omp simd
    for (int64_t j = 0; j < C; j++) {
      const float xhat = xr[j] * rs;
      dx[r * C + j] = rs * (dyr[j] * w[j] - xhat * mean_gx);
      dw[j] += dyr[j] * xhat;
    }
  }
}

// loss = lse - z[target], lse = m + log l: one pass over the row (softmax_row_stats).
void cross_entropy_rows(float* loss, float* lse, const float* logits, const int64_t* targets,
                        int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; r++) {
    const float* z = logits + r * V;
    const RowStats s = softmax_row_stats(z, V);
    lse[r] = s.m + (float)std::log(s.l);
    loss[r] = lse[r] - z[targets[r]];
  }
}

// dlogits = (p - onehot(target)) * dloss, p = exp(z - lse): every element p * dloss in a
// vectorised loop, then the target's element corrected by the same expression as before.
FF_CPU_CLONES void cross_entropy_backward_rows(float* dlogits, const float* logits,
                                               const float* lse, const int64_t* targets,
                                               const float* dloss, int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; r++) {
    const float* z = logits + r * V;
    float* dz = dlogits + r * V;
    const float l = lse[r], d = dloss[r];
#pragma omp simd
    for (int64_t j = 0; j < V; j++) dz[j] = (float)exp_double(z[j] - l) * d;
    const int64_t t = targets[r];
    if (t >= 0 && t < V) dz[t] = ((float)exp_double(z[t] - l) - 1.f) * d;
  }
}

}  // namespace

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps) {
  for_row_blocks(N, C, [&](int64_t r0, int64_t rows) {
    rmsnorm_rows(y + r0 * C, rstd + r0, x + r0 * C, w, rows, C, eps);
  });
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  rmsnorm_backward_rows(dx, dw, dy, x, w, rstd, N, C);
}

void cross_entropy_forward(float* loss, float* lse, const float* logits, const int64_t* targets,
                           int64_t N, int64_t V) {
  for_row_blocks(N, V, [&](int64_t r0, int64_t rows) {
    cross_entropy_rows(loss + r0, lse + r0, logits + r0 * V, targets + r0, rows, V);
  });
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int64_t* targets, const float* dloss, int64_t N, int64_t V) {
  for_row_blocks(N, V, [&](int64_t r0, int64_t rows) {
    cross_entropy_backward_rows(dlogits + r0 * V, logits + r0 * V, lse + r0, targets + r0,
                                dloss + r0, rows, V);
  });
}

}  // namespace ff::cpu
