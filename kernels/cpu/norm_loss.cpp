// kernels/cpu/norm_loss.cpp — RMSNorm and cross-entropy, forward and backward.
//
// Written for speed as well as reading, as reduce.cpp: row sums in double in
// `omp simd` loops the compiler vectorises, exp_float instead of a libm call per element,
// the cross-entropy's statistics with the row read from memory once (softmax_row_stats), large
// tensors' rows shared among OpenMP threads (for_row_blocks; results do not depend on the
// thread count — rmsnorm's dw too, by partial sums over blocks of rows fixed by the shape).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
// Rows [0, rows) of one block: each row's dot (read from memory once), then its dx and its dw
// terms (re-read from the cache), both loops vectorised. The dw terms go into this block's own
// partial sums dw_part, in float, in row order (C floats stay in the L1 cache at C = 8192; C
// doubles, 64 KiB, would not, and measured 40% slower).
FF_CPU_CLONES void rmsnorm_backward_rows(float* dx, float* dw_part, const float* dy,
                                         const float* x, const float* w, const float* rstd,
                                         int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * C;
    const float* dyr = dy + r * C;
    const float rs = rstd[r];
    // dot = sum_j dy_j w_j x_j (times rstd after the sum): each term in float (two roundings),
    // 16 float lanes of 4 terms each handed to 16 double lanes, added in lane order (as
    // reduce.cpp's exp_sum: 16 terms to a vector, the same order on every CPU clone). Within
    // 5 2^-24 sum_j |dy_j w_j x_j| of the exact dot.
    double lanes[16] = {};
    int64_t j = 0;
    for (; j + 64 <= C; j += 64) {
      float t[64];
#pragma omp simd
      for (int k = 0; k < 64; k++) t[k] = dyr[j + k] * w[j + k] * xr[j + k];
#pragma omp simd
      for (int k = 0; k < 16; k++) lanes[k] += ((t[k] + t[16 + k]) + t[32 + k]) + t[48 + k];
    }
    double dot = 0.0;
    for (int k = 0; k < 16; k++) dot += lanes[k];
    for (; j < C; j++) dot += dyr[j] * w[j] * xr[j];
    const float mean_gx = (float)(dot * rs / C);
    // The second pass reads the row from the cache and computes, so the memory is idle: the
    // next row's x and dy are asked into the L2 cache meanwhile, 64 floats at a time, and its
    // dot pass finds them there.
    const bool more = r + 1 < rows;
    for (int64_t j0 = 0; j0 < C; j0 += 64) {
      if (more)
        for (int64_t q = j0; q < std::min(C, j0 + 64); q += 16) {
          __builtin_prefetch(xr + C + q, 0, 2);
          __builtin_prefetch(dyr + C + q, 0, 2);
        }
      const int64_t j1 = std::min(C, j0 + 64);
#pragma omp simd
      for (int64_t j = j0; j < j1; j++) {
        const float xhat = xr[j] * rs;
        dx[r * C + j] = rs * (dyr[j] * w[j] - xhat * mean_gx);
        dw_part[j] += dyr[j] * xhat;
      }
    }
  }
}

// dw_j = sum_b part[b][j], added in double in block order b = 0, 1, ... (the b loop outside, so
// the j loop vectorises), rounded to float once.
FF_CPU_CLONES void add_partial_sums(float* dw, const float* part, int64_t blocks, int64_t C) {
  std::vector<double> sum(part, part + C);
  for (int64_t b = 1; b < blocks; b++) {
    const float* pb = part + b * C;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) sum[j] += pb[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < C; j++) dw[j] = (float)sum[j];
}

// dw sums over all rows, so threads that share the rows must each keep partial sums. For the
// result not to depend on the thread count, the rows are cut into blocks by the shape alone —
// one block under kParallelElements elements (one thread), else kDwBlocks (or N, if fewer) —
// and the blocks' sums added in block order at the end, however many threads computed them.
// More threads than blocks would wait, so this kernel uses at most kDwBlocks. Rounding: a float
// sum in row order over a block (ceil(N / 16) rows), then exact-ish double sums of the blocks:
// within (ceil(N / 16) + 1) 2^-24 sum|terms| of exact, 16 times tighter than the plain row-order
// float sum it replaces (and which the kernel tests' bound, chain N, was derived for).
constexpr int64_t kDwBlocks = 16;

// loss = lse - z[target], lse = m + log l (softmax_row_stats).
void cross_entropy_rows(float* loss, float* lse, const float* logits, const int64_t* targets,
                        int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; r++) {
    const float* z = logits + r * V;
    const RowStats s = softmax_row_stats(z, V, r + 1 < rows ? z + V : nullptr);
    lse[r] = s.m + (float)std::log(s.l);
    loss[r] = lse[r] - z[targets[r]];
  }
}

// dlogits = (p - onehot(target)) * dloss, p = exp(z - lse) (z - lse <= 0: exp_float's domain,
// within 0.94 ulp): every element p * dloss in a vectorised loop, then the target's element
// corrected by the same expression as before.
FF_CPU_CLONES void cross_entropy_backward_rows(float* dlogits, const float* logits,
                                               const float* lse, const int64_t* targets,
                                               const float* dloss, int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; r++) {
    const float* z = logits + r * V;
    float* dz = dlogits + r * V;
    const float l = lse[r], d = dloss[r];
#pragma omp simd
    for (int64_t j = 0; j < V; j++) dz[j] = exp_float(z[j] - l) * d;
    const int64_t t = targets[r];
    if (t >= 0 && t < V) dz[t] = (exp_float(z[t] - l) - 1.f) * d;
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
  if (N == 0) {
    std::fill(dw, dw + C, 0.f);
    return;
  }
  const int64_t blocks = N * C < kParallelElements ? 1 : std::min(N, kDwBlocks);
  std::vector<float> part((size_t)(blocks * C), 0.f);  // part[b * C + j]: block b's dw_j
  const int threads = row_threads(N * C);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t r0 = b * N / blocks, r1 = (b + 1) * N / blocks;
    rmsnorm_backward_rows(dx + r0 * C, part.data() + b * C, dy + r0 * C, x + r0 * C, w, rstd + r0,
                          r1 - r0, C);
  }
  add_partial_sums(dw, part.data(), blocks, C);
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
