// kernels/cuda/norm_loss.cu — RMSNorm and cross-entropy, forward and backward. The cpu twins
// are in kernels/cpu/norm_loss.cpp.
//
// Shapes: x, y, dy, dx (N, C) and logits, dlogits (N, V), row-major; w, dw (C);
// rstd, lse, loss, dloss, targets (N) (targets int64, in [0, V)).
//
// RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", arXiv:1910.07467):
//   forward:  rstd = 1 / sqrt(mean_j x_j^2 + eps),  y = x * rstd * w
//   backward: xhat = x * rstd, g = dy * w
//             dx = rstd * (g - xhat * mean_j(g_j xhat_j))      (per row)
//             dw = sum over rows of dy * xhat                  (per column, ACROSS rows)
// Cross-entropy, with lse = log sum_j exp(z_j) of a row of logits z:
//   forward:  loss = lse - z[target]; lse saved for the backward
//   backward: dlogits = (exp(z - lse) - onehot(target)) * dloss[row]
// The lse is found by the ONE-PASS ONLINE LOGSUMEXP of softmax.cu (Milakov & Gimelshein,
// arXiv:1805.02867; lesson 01): each thread keeps a running (m, l) — its max so far and
// sum_j exp(z_j - m) — rescaling l by exp(m_old - m_new) when the max grows; the states of
// the threads of a row merge by m = max(m1, m2), l = l1 exp(m1 - m) + l2 exp(m2 - m).
// Nothing overflows at any scale, since every exponent is <= 0.
//
// Parallelisation. The row kernels (rmsnorm forward, rmsnorm dx, cross-entropy forward) give
// each row to a "row group" of blockDim.x threads, as softmax.cu does: the two row layouts of
// kernels/cuda/rows.h, which also holds row_sum() and the online-softmax merges. threadIdx.x
// is the thread's place in the row, threadIdx.y the row within the block:
//   version 1, row length <= 1024: ONE WARP PER ROW, blockDim (32, 4). Every row sum is five
//     __shfl_xor_sync steps; no shared memory, no barrier. (RMSNorm rows are the model
//     width, a few hundred to a few thousand; many of them, N = B * T.)
//   version 2, longer rows: ONE BLOCK PER ROW, blockDim (256, 1) = 8 warps. Each warp reduces
//     by shuffles, the 8 warp results meet in shared memory. (Vocabulary-sized logits rows,
//     V = 50257 for GPT-2, need more than 32 threads each.)
// Grid-stride over rows in both; consecutive threads read consecutive columns (coalesced).
// The other two are not per row:
//   dw, a reduction over ROWS: one thread per column sums dy * xhat down all N rows, in order
//     (neighbouring threads, neighbouring columns: coalesced), and writes dw. Chunks of rows
//     in grid.y, their partials atomicAdded into dw, would give the GPU more parallelism when
//     C is small and N large, but dw's rounding would then depend on the order the chunks
//     finish in: it would differ from run to run and from rank to rank, and the TP ranks that
//     hold a replicated norm weight (lesson 08 without SP) and compute its gradient from the
//     same tokens would drift apart. One pass in row order gives the same bits every time.
//   cross-entropy backward, elementwise: one thread per element of dlogits, grid-stride.
// Sums accumulate in float (the cpu kernels in double; see the tests for the bounds).
#include <cmath>

#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/rows.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {


// File-local (an anonymous namespace): other kernel files have helpers of the same names.
namespace {

// ----------------------------------------------------------------------------
// RMSNorm (row kernels: blockDim (32, 4) a warp per row, (256, 1) a block per row)

// y, x (N, C), w (C), rstd (N): rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w
__global__ void rmsnorm_forward_kernel(float* y, float* rstd, const float* x, const float* w,
                                       int64_t N, int64_t C, float eps) {
  __shared__ float warp_sum[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* xr = x + row * C;
    float ss = 0.f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) ss += xr[j] * xr[j];
    ss = row_sum(ss, warp_sum);
    const float rs = rsqrtf(ss / C + eps);
    if (threadIdx.x == 0) rstd[row] = rs;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) y[row * C + j] = xr[j] * rs * w[j];
  }
}

// dx, dy, x (N, C), w (C), rstd (N): dx = rstd * (dy * w - xhat * mean(dy * w * xhat))
__global__ void rmsnorm_backward_dx_kernel(float* dx, const float* dy, const float* x,
                                           const float* w, const float* rstd, int64_t N,
                                           int64_t C) {
  __shared__ float warp_sum[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* xr = x + row * C;
    const float* dyr = dy + row * C;
    const float rs = rstd[row];
    float dot = 0.f;  // sum_j g_j xhat_j
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dot += (dyr[j] * w[j]) * (xr[j] * rs);
    const float mean_gx = row_sum(dot, warp_sum) / C;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float xhat = xr[j] * rs;
      dx[row * C + j] = rs * (dyr[j] * w[j] - xhat * mean_gx);
    }
  }
}

// dw (C) = sum over the rows of dy * xhat, in row order; dy, x (N, C), rstd (N).
// One thread per column (grid-stride over columns).
__global__ void rmsnorm_backward_dw_kernel(float* dw, const float* dy, const float* x,
                                           const float* rstd, int64_t N, int64_t C) {
  for (int64_t j = grid_index(); j < C; j += grid_stride()) {
    float sum = 0.f;
    for (int64_t row = 0; row < N; row++) sum += dy[row * C + j] * (x[row * C + j] * rstd[row]);
    dw[j] = sum;
  }
}

// ----------------------------------------------------------------------------
// cross-entropy

// loss, lse (N), logits (N, V), targets (N): lse = logsumexp of the row (online, one read),
// loss = lse - logits[row, target]. Row kernel, as above.
__global__ void cross_entropy_forward_kernel(float* loss, float* lse, const float* logits,
                                             const int64_t* targets, int64_t N, int64_t V) {
  __shared__ float warp_m[kMaxWarpsPerRow], warp_l[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < N; row += row_stride()) {
    const float* z = logits + row * V;
    float m = -INFINITY, l = 0.f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = z[j];
      if (v > m) {  // the max grows: rescale the terms so far from exp(z - m) to exp(z - v)
        l *= rescale(m, v);
        m = v;
      }
      l += rescale(v, m);  // exp(v - m)
    }
    row_merge_state(m, l, warp_m, warp_l);
    if (threadIdx.x == 0) {
      const float row_lse = m + logf(l);
      lse[row] = row_lse;
      loss[row] = row_lse - z[targets[row]];
    }
  }
}

// dlogits, logits (N, V); lse, targets, dloss (N). One thread per element, grid-stride.
__global__ void cross_entropy_backward_kernel(float* dlogits, const float* logits,
                                              const float* lse, const int64_t* targets,
                                              const float* dloss, int64_t N, int64_t V) {
  for (int64_t i = grid_index(); i < N * V; i += grid_stride()) {
    const int64_t row = i / V, j = i - row * V;
    const float p = expf(logits[i] - lse[row]);  // softmax, from the saved lse
    dlogits[i] = (p - (j == targets[row] ? 1.f : 0.f)) * dloss[row];
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// launchers (row_launch, in rows.h, picks version 1 or 2 of the row kernels by row length)

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps) {
  // C == 0 still writes rstd (NaN: 0 / 0, as the cpu kernel); N == 0 has nothing to write.
  if (N == 0) return;
  RowLaunch L = row_launch(N, C);
  SIMT_LAUNCH(rmsnorm_forward_kernel, L.grid, L.block, 0, 0, y, rstd, x, w, N, C, eps);
  SIMT_CHECK_LAUNCH();
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  if (C == 0) return;
  if (N == 0) {  // no rows: dw = 0
    fill(dw, C, 0.f);
    return;
  }
  RowLaunch L = row_launch(N, C);
  SIMT_LAUNCH(rmsnorm_backward_dx_kernel, L.grid, L.block, 0, 0, dx, dy, x, w, rstd, N, C);
  SIMT_CHECK_LAUNCH();
  // dw: one thread per column, the elementwise grid over C (capped, grid-stride)
  SIMT_LAUNCH(rmsnorm_backward_dw_kernel, elementwise_grid(C), dim3(kElementwiseBlock), 0, 0, dw, dy, x,
              rstd, N, C);
  SIMT_CHECK_LAUNCH();
}

void cross_entropy_forward(float* loss, float* lse, const float* logits, const int64_t* targets,
                           int64_t N, int64_t V) {
  if (N * V == 0) return;  // V == 0 has no valid target
  RowLaunch L = row_launch(N, V);
  SIMT_LAUNCH(cross_entropy_forward_kernel, L.grid, L.block, 0, 0, loss, lse, logits, targets, N,
              V);
  SIMT_CHECK_LAUNCH();
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int64_t* targets, const float* dloss, int64_t N, int64_t V) {
  if (N * V == 0) return;
  SIMT_LAUNCH(cross_entropy_backward_kernel, elementwise_grid(N * V), dim3(kElementwiseBlock), 0,
              0, dlogits, logits, lse, targets, dloss, N, V);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
