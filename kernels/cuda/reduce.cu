// kernels/cuda/reduce.cu — sum or max along one dim, and the backward of max. The cpu twins
// are in kernels/cpu/reduce.cpp (softmax, the other row reduction, is in softmax.cu).
//
// Shapes: the input is viewed as [outer, n, inner] (the reduced dim in the middle);
//   reduce:        in (outer, n, inner) -> out (outer, inner)
//   max_backward:  x, dx (outer, n, inner); y, dy (outer, inner). dy goes to the FIRST j
//                  with x[o, j, i] == y[o, i]; every other dx is 0 (as the cpu kernel).
//
// Two layouts, by where the reduced dim lies in memory:
//   inner == 1 (the last dim, e.g. a sum over features): the n values of an output are
//     contiguous, so a ROW GROUP of threads shares each row — consecutive threads read
//     consecutive columns (coalesced) and combine their partial results by warp shuffles
//     (the two row layouts of kernels/cuda/rows.h, with their helpers):
//       version 1, n <= 1024: one warp per row, blockDim (32, 4) = 4 rows per block;
//         5 __shfl_xor_sync steps, no shared memory, no barrier.
//       version 2, n > 1024: one block per row, blockDim (256, 1) = 8 warps; each warp
//         reduces by shuffles, then the 8 results go through shared memory.
//     max_backward finds the first hit the same way: each thread its own first j, then
//     the smallest j over the row group (a min reduction), then a sweep writes dx.
//   inner > 1 (e.g. a sum over the batch of (B, C)): one thread per output (o, i) loops
//     over j. Neighbouring threads take neighbouring i, so each step of the loop reads
//     consecutive addresses: coalesced without any cooperation between threads.
// All loops are grid-stride, so any size runs on a bounded grid. Sums accumulate in float
// (the cpu kernel in double); max is exact: fmaxf ignores NaN as std::fmax does.
#include <climits>
#include <cmath>

#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/rows.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

// File-local (an anonymous namespace): other kernel files may have helpers of the same names.
namespace {

// ----------------------------------------------------------------------------
// the reduction op

__device__ __forceinline__ float combine(ReduceOp op, float a, float b) {
  return op == ReduceOp::sum ? a + b : fmaxf(a, b);
}
// The starting value: 0 for sum, -inf for max (also the result of an empty reduction, n == 0)
__device__ __forceinline__ float identity(ReduceOp op) {
  return op == ReduceOp::sum ? 0.f : -INFINITY;
}

// ----------------------------------------------------------------------------
// row-group helpers (inner == 1), on rows.h's row_reduce: threadIdx.x is the place in the row,
// threadIdx.y the row within the block

// Combines v over the blockDim.x threads of a row; every one of them gets the result.
// warp_part: shared memory of kMaxWarpsPerRow floats (used by version 2 only).
__device__ __forceinline__ float row_combine(ReduceOp op, float v, float* warp_part) {
  return row_reduce(v, identity(op), [op](float a, float b) { return combine(op, a, b); },
                    warp_part);
}

// The smallest j over the blockDim.x threads of a row, in every one of them (LLONG_MAX is the
// identity of min). warp_part: shared memory of kMaxWarpsPerRow (version 2 only).
__device__ __forceinline__ long long row_min(long long j, long long* warp_part) {
  return row_reduce(j, LLONG_MAX, [](long long a, long long b) { return b < a ? b : a; },
                    warp_part);
}

// ----------------------------------------------------------------------------
// kernels

// in (rows, n) -> out (rows): one warp (n <= 1024) or one block per row
__global__ void reduce_rows_kernel(ReduceOp op, float* out, const float* in, int64_t rows,
                                   int64_t n) {
  __shared__ float warp_part[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < rows; row += row_stride()) {
    const float* p = in + row * n;
    float v = identity(op);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v = combine(op, v, p[j]);
    v = row_combine(op, v, warp_part);
    if (threadIdx.x == 0) out[row] = v;
  }
}

// in (outer, n, inner) -> out (outer, inner): one thread per output, a loop over n
__global__ void reduce_columns_kernel(ReduceOp op, float* out, const float* in, int64_t outer,
                                      int64_t n, int64_t inner) {
  for (int64_t e = grid_index(); e < outer * inner; e += grid_stride()) {
    const int64_t o = e / inner, i = e % inner;
    const float* p = in + o * n * inner + i;
    float v = identity(op);
    for (int64_t j = 0; j < n; j++) v = combine(op, v, p[j * inner]);
    out[e] = v;
  }
}

// x, dx (rows, n); y, dy (rows): dx[r, j] = dy[r] at the first j with x[r, j] == y[r], else 0
__global__ void max_backward_rows_kernel(float* dx, const float* x, const float* y,
                                         const float* dy, int64_t rows, int64_t n) {
  __shared__ long long warp_part[kMaxWarpsPerRow];
  for (int64_t row = first_row(); row < rows; row += row_stride()) {
    const float* xr = x + row * n;
    const float target = y[row];
    // this thread's first hit (its columns rise, so the first found is its smallest); n: none
    long long first = n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      if (xr[j] == target) {
        first = j;
        break;
      }
    first = row_min(first, warp_part);
    const float g = dy[row];
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dx[row * n + j] = j == first ? g : 0.f;
  }
}

// x, dx (outer, n, inner); y, dy (outer, inner): one thread per (o, i), a loop over n
__global__ void max_backward_columns_kernel(float* dx, const float* x, const float* y,
                                            const float* dy, int64_t outer, int64_t n,
                                            int64_t inner) {
  for (int64_t e = grid_index(); e < outer * inner; e += grid_stride()) {
    const int64_t o = e / inner, i = e % inner;
    const float* p = x + o * n * inner + i;
    float* d = dx + o * n * inner + i;
    const float target = y[e], g = dy[e];
    bool routed = false;
    for (int64_t j = 0; j < n; j++) {
      const bool hit = !routed && p[j * inner] == target;
      d[j * inner] = hit ? g : 0.f;
      routed = routed || hit;
    }
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// launchers (row_launch, in rows.h, picks version 1 or 2 by row length)

void reduce(ReduceOp op, float* out, const float* in, int64_t outer, int64_t n, int64_t inner) {
  if (outer * inner == 0) return;  // no outputs (n == 0 still writes 0 or -inf, as cpu)
  if (inner == 1) {
    RowLaunch L = row_launch(outer, n);
    SIMT_LAUNCH(reduce_rows_kernel, L.grid, L.block, 0, 0, op, out, in, outer, n);
  } else {
    SIMT_LAUNCH(reduce_columns_kernel, elementwise_grid(outer * inner), kElementwiseBlock, 0, 0,
                op, out, in, outer, n, inner);
  }
  SIMT_CHECK_LAUNCH();
}

void max_backward(float* dx, const float* x, const float* y, const float* dy, int64_t outer,
                  int64_t n, int64_t inner) {
  if (outer * n * inner == 0) return;
  if (inner == 1) {
    RowLaunch L = row_launch(outer, n);
    SIMT_LAUNCH(max_backward_rows_kernel, L.grid, L.block, 0, 0, dx, x, y, dy, outer, n);
  } else {
    SIMT_LAUNCH(max_backward_columns_kernel, elementwise_grid(outer * inner), kElementwiseBlock, 0,
                0, dx, x, y, dy, outer, n, inner);
  }
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
