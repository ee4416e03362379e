// kernels/cuda/softmax.cu — softmax and log_softmax along the last dim, forward and
// backward. The cpu twins are in kernels/cpu/reduce.cpp.
//
// Shapes: x, y, dy, dx are (N, C), row-major; every kernel works on whole rows.
//
// Forward: the ONE-PASS ONLINE SOFTMAX (Milakov & Gimelshein, "Online normalizer calculation
// for softmax", arXiv:1805.02867; lesson 01 of this course). The safe softmax needs the row
// max m before it can sum l = sum_j exp(x_j - m), so the cpu kernel reads the row twice
// before it writes y. The online form finds (m, l) in ONE read: each thread keeps a running
// (m, l) over its columns j = t, t + T, t + 2T, ... and when a new value beats m, rescales
// the sum so far by exp(m_old - m_new) — the past terms were exp(x - m_old), and
// exp(x - m_old) * exp(m_old - m_new) = exp(x - m_new). Two states merge the same way:
//     m = max(m1, m2),   l = l1 * exp(m1 - m) + l2 * exp(m2 - m)
// an associative, commutative rule, so the threads' states can be combined in any tree:
// a butterfly of __shfl_xor_sync inside a warp, then through shared memory across warps.
// A second sweep writes y = exp(x - m) / l (log_softmax: y = x - (m + log l)). Memory
// traffic: 2 reads + 1 write of the row instead of 3 + 1, and nothing overflows at any
// scale since every exponent is <= 0.
//   The guard: a state that has seen only -inf (a fully masked stretch of an attention row,
//   or a thread with no columns at all, C < 32) is (m, l) = (-inf, 0), and exp(-inf - -inf)
//   would be NaN; rescale() returns 0 for it instead. A row that is -inf EVERYWHERE ends with
//   (-inf, 0) and gives NaN in every y, exactly as the cpu kernel (exp(-inf - -inf) there).
//
// Backward, with the same row sums by warp shuffles:
//   softmax:      dx = y * (dy - sum_j dy_j y_j)
//   log_softmax:  dx = dy - exp(y) * sum_j dy_j
//
// Parallelisation: the two row layouts of kernels/cuda/rows.h, which also holds rescale(),
// merge_state(), row_merge_state() and row_sum(). A row is owned by a "row group" of
// blockDim.x threads; threadIdx.x is the thread's place in the row, threadIdx.y the row
// within the block:
//   version 1, C <= 1024: ONE WARP PER ROW, blockDim (32, 4) = 4 rows per block; every
//     reduction is 5 shuffles, no shared memory, no barrier. For attention scores over
//     <= 1024 keys: short rows, but many (N = B * heads * T).
//   version 2, C > 1024: ONE BLOCK PER ROW, blockDim (256, 1) = 8 warps; the 8 warp results
//     go through shared memory. For vocabulary-sized logits: long rows, usually few.
// Both: grid-stride over rows, so any N runs on a bounded grid. Consecutive threads read
// consecutive columns, so every sweep over a row is coalesced.
#include <cmath>

#include "kernels/cuda/launchers.h"
#include "kernels/cuda/rows.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

// File-local (an anonymous namespace): other kernel files may have helpers of the same names.
namespace {

// ----------------------------------------------------------------------------
// the online softmax of a row (rescale and the merges are in rows.h)

// Pass 1 of the forward kernels: the max m and the sum l = sum_j exp(x_j - m) of row xr (C),
// in one read of the row (the online softmax), then merged across the row group.
__device__ void row_max_and_sum(const float* xr, int64_t C, float& m, float& l, float* warp_m,
                                float* warp_l) {
  m = -INFINITY;
  l = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float v = xr[j];
    if (v > m) {  // the max grows: rescale the terms so far from exp(x - m) to exp(x - v)
      l *= rescale(m, v);
      m = v;
    }
    l += rescale(v, m);  // exp(v - m); 0 while the whole stretch so far is -inf
  }
  row_merge_state(m, l, warp_m, warp_l);
}

// ----------------------------------------------------------------------------
// kernels (blockDim (32, 4): a warp per row; (256, 1): a block per row — see the header)

// y, x (N, C): y = exp(x - m) / l
__global__ void softmax_forward_kernel(float* y, const float* x, int64_t N, int64_t C) {
  __shared__ float warp_m[kMaxWarpsPerRow], warp_l[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* xr = x + row * C;
    float* yr = y + row * C;
    float m, l;
    row_max_and_sum(xr, C, m, l, warp_m, warp_l);
    const float inv_l = 1.f / l;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv_l;
  }
}

// y, x (N, C): y = x - lse, lse = m + log l (= log sum_j exp(x_j), without overflow)
__global__ void log_softmax_forward_kernel(float* y, const float* x, int64_t N, int64_t C) {
  __shared__ float warp_m[kMaxWarpsPerRow], warp_l[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* xr = x + row * C;
    float* yr = y + row * C;
    float m, l;
    row_max_and_sum(xr, C, m, l, warp_m, warp_l);
    const float lse = m + logf(l);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) yr[j] = xr[j] - lse;
  }
}

// dx, y, dy (N, C): dx = y * (dy - sum_j dy_j y_j)
__global__ void softmax_backward_kernel(float* dx, const float* y, const float* dy, int64_t N,
                                        int64_t C) {
  __shared__ float warp_sum[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* yr = y + row * C;
    const float* dyr = dy + row * C;
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dot += dyr[j] * yr[j];
    dot = row_sum(dot, warp_sum);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dx[row * C + j] = yr[j] * (dyr[j] - dot);
  }
}

// dx, y, dy (N, C), y = log_softmax(x): dx = dy - softmax(x) * sum_j dy_j
__global__ void log_softmax_backward_kernel(float* dx, const float* y, const float* dy, int64_t N,
                                            int64_t C) {
  __shared__ float warp_sum[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* yr = y + row * C;
    const float* dyr = dy + row * C;
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += dyr[j];
    s = row_sum(s, warp_sum);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
      dx[row * C + j] = dyr[j] - expf(yr[j]) * s;
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// launchers (row_launch, in rows.h, picks version 1 or 2 by row length)

void softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
  if (N * C == 0) return;
  RowLaunch L = row_launch(N, C);
  SIMT_LAUNCH(softmax_forward_kernel, L.grid, L.block, 0, 0, y, x, N, C);
  SIMT_CHECK_LAUNCH();
}

void softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  if (N * C == 0) return;
  RowLaunch L = row_launch(N, C);
  SIMT_LAUNCH(softmax_backward_kernel, L.grid, L.block, 0, 0, dx, y, dy, N, C);
  SIMT_CHECK_LAUNCH();
}

void log_softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
  if (N * C == 0) return;
  RowLaunch L = row_launch(N, C);
  SIMT_LAUNCH(log_softmax_forward_kernel, L.grid, L.block, 0, 0, y, x, N, C);
  SIMT_CHECK_LAUNCH();
}

void log_softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  if (N * C == 0) return;
  RowLaunch L = row_launch(N, C);
  SIMT_LAUNCH(log_softmax_backward_kernel, L.grid, L.block, 0, 0, dx, y, dy, N, C);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
