// kernels/cuda/index.cu — row gather and scatter (index_select, embedding, index_add) and top-k
// per row with its backward. The cpu twins are in kernels/cpu/index.cpp.
//
// Shapes (idx is int64, every index assumed in range: the tensor layer checks them):
//   index_select_rows:  out (M, C) = src[idx[i], :], src (any rows, C), idx (M)
//   index_add_rows:     dst[idx[i], :] += src (M, C)[i, :], dst (any rows, C), idx (M)
//   topk_rows:          vals, idx (N, k) = the k largest of each row of x (N, C), descending,
//                       the lower column first on ties (as the cpu kernel's stable insertion)
//   topk_backward:      dx (N, C) = 0, then dx[i, idx[i, j]] += dvals (N, k)[i, j]
//
// Kernels:
//   index_select_rows_kernel: one thread per element of out, grid-stride. Consecutive threads
//     copy consecutive columns of a row, so both the read and the write are coalesced.
//   index_add_rows_kernel: one thread per COLUMN, grid-stride, adding the rows of src in order.
//     An index may repeat (the same token twice in a batch: embedding backward), so two rows
//     may add to one dst element. One thread per element of src with atomicAdd would be more
//     parallel, but the float sum's order would be whatever order the atomics land in: the
//     result would differ from run to run and from rank to rank by rounding, and two ranks
//     that hold a replicated weight (lesson 08's embedding over TP without SP) and compute its
//     gradient from the same tokens would drift apart. In row order the sum is the cpu
//     kernel's, bit for bit, on every run. Parallel over C only: enough for the lessons'
//     sizes (a large M would want the rows sorted by destination first, then a thread per
//     destination row).
//   topk_rows_kernel: ONE WARP PER ROW, blockDim (32, 4), grid-stride over rows; k rounds
//     of a warp-wide argmax. The output order is a total order on (value, column) — larger
//     value first, then lower column — so round q needs no list of what is taken: it picks
//     the best (value, column) that comes strictly AFTER round q-1's pick. Each lane scans
//     its columns j = lane, lane + 32, ..., then five __shfl_xor_sync steps over the
//     (value, column) pairs leave the winner in every lane. Cost O(k C / 32) per row: meant
//     for the small k and C of routing (top-2 of 8..256 experts), where a row fits a warp
//     and no shared memory or barrier is needed. (A large C with large k would want a sort.)
//     NaN has no place in the order: rows are assumed NaN-free (a NaN is never picked).
//   topk_backward: fill dx with 0 (elementwise.cu's fill), then topk_backward_scatter_kernel,
//     one thread per element of dvals, atomicAdd into dx (the indices of one row from
//     topk_rows are distinct, but the kernel does not rely on it).
#include <cmath>

#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr unsigned kTopkRowsPerBlock = 4;  // topk: blockDim (32, 4), a warp per row

// File-local (an anonymous namespace): other kernel files may have helpers of the same names.
namespace {

// ----------------------------------------------------------------------------
// gather and scatter of rows (one thread per element)

// out (M, C) = src[idx[i], :]
__global__ void index_select_rows_kernel(float* out, const float* src, const int64_t* idx,
                                         int64_t M, int64_t C) {
  for (int64_t i = grid_index(); i < M * C; i += grid_stride()) {
    const int64_t row = i / C, col = i - row * C;
    out[i] = src[idx[row] * C + col];
  }
}

// dst[idx[i], :] += src (M, C)[i, :]; a thread per column, the rows in order (idx may repeat)
__global__ void index_add_rows_kernel(float* dst, const float* src, const int64_t* idx,
                                      int64_t M, int64_t C) {
  for (int64_t col = grid_index(); col < C; col += grid_stride())
    for (int64_t row = 0; row < M; row++) dst[idx[row] * C + col] += src[row * C + col];
}

// ----------------------------------------------------------------------------
// top-k (a warp per row: threadIdx.x the lane, threadIdx.y the row within the block)

// Whether (av, aj) comes before (bv, bj) in top-k order: larger value first, then lower column.
// A column of -1 means "no candidate" and comes after everything.
__device__ __forceinline__ bool ranks_before(float av, long long aj, float bv, long long bj) {
  if (aj < 0) return false;
  if (bj < 0) return true;
  return av > bv || (av == bv && aj < bj);
}

// vals, idx (N, k); x (N, C). Round q writes the q-th largest of the row.
__global__ void topk_rows_kernel(float* vals, int64_t* idx, const float* x, int64_t N, int64_t C,
                                 int64_t k) {
  const int lane = threadIdx.x;
  for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < N;
       row += (int64_t)gridDim.x * blockDim.y) {
    const float* xr = x + row * C;
    // the previous round's pick; (+inf, -1) comes before every (value, column)
    float prev_v = INFINITY;
    long long prev_j = -1;
    for (int64_t q = 0; q < k; q++) {
      // this lane's best among its columns that come after the previous pick
      float best_v = -INFINITY;
      long long best_j = -1;
      for (long long j = lane; j < C; j += 32) {
        const float v = xr[j];
        const bool not_taken = v < prev_v || (v == prev_v && j > prev_j);
        if (not_taken && ranks_before(v, j, best_v, best_j)) {
          best_v = v;
          best_j = j;
        }
      }
      // warp-wide argmax: a butterfly over the (value, column) pairs; every lane ends with it
      for (int offset = 16; offset > 0; offset /= 2) {
        const float other_v = __shfl_xor_sync(kFullMask, best_v, offset);
        const long long other_j = __shfl_xor_sync(kFullMask, best_j, offset);
        if (ranks_before(other_v, other_j, best_v, best_j)) {
          best_v = other_v;
          best_j = other_j;
        }
      }
      if (lane == 0) {
        vals[row * k + q] = best_v;
        idx[row * k + q] = best_j;
      }
      prev_v = best_v;
      prev_j = best_j;
    }
  }
}

// dx (N, C) += dvals (N, k) scattered to columns idx (N, k); dx zeroed before
__global__ void topk_backward_scatter_kernel(float* dx, const float* dvals, const int64_t* idx,
                                             int64_t N, int64_t C, int64_t k) {
  for (int64_t i = grid_index(); i < N * k; i += grid_stride()) {
    const int64_t row = i / k;
    atomicAdd(&dx[row * C + idx[i]], dvals[i]);
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// launchers

void index_select_rows(float* out, const float* src, const int64_t* idx, int64_t M, int64_t C) {
  if (M * C == 0) return;
  SIMT_LAUNCH(index_select_rows_kernel, elementwise_grid(M * C), dim3(kElementwiseBlock), 0, 0,
              out, src, idx, M, C);
  SIMT_CHECK_LAUNCH();
}

void index_add_rows(float* dst, const float* src, const int64_t* idx, int64_t M, int64_t C) {
  if (M * C == 0) return;
  SIMT_LAUNCH(index_add_rows_kernel, elementwise_grid(C), dim3(kElementwiseBlock), 0, 0, dst,
              src, idx, M, C);
  SIMT_CHECK_LAUNCH();
}

void topk_rows(float* vals, int64_t* idx, const float* x, int64_t N, int64_t C, int64_t k) {
  if (N * k == 0) return;  // k <= C (the tensor layer checks it), so C > 0 here
  const dim3 block(32, kTopkRowsPerBlock);
  const int64_t blocks = (N + block.y - 1) / block.y;
  const int64_t max_blocks = kMaxElementwiseBlocks * kElementwiseBlock / (block.x * block.y);
  const dim3 grid((unsigned)(blocks < max_blocks ? blocks : max_blocks));
  SIMT_LAUNCH(topk_rows_kernel, grid, block, 0, 0, vals, idx, x, N, C, k);
  SIMT_CHECK_LAUNCH();
}

void topk_backward(float* dx, const float* dvals, const int64_t* idx, int64_t N, int64_t C,
                   int64_t k) {
  if (N * C == 0) return;
  fill(dx, N * C, 0.f);
  if (k == 0) return;
  SIMT_LAUNCH(topk_backward_scatter_kernel, elementwise_grid(N * k), dim3(kElementwiseBlock), 0,
              0, dx, dvals, idx, N, C, k);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
