// kernels/cuda/rows.h — the two row layouts shared by the row kernels of reduce.cu, softmax.cu
// and norm_loss.cu: kernels that reduce each row of a row-major (rows, n) matrix (a sum, a max,
// an online-softmax state) and usually sweep the row again with the result.
//
// A row is owned by a "row group" of blockDim.x threads; threadIdx.x is the thread's place in
// the row, threadIdx.y the row within the block. Thread x reads columns x, x + blockDim.x,
// x + 2 blockDim.x, ... so consecutive threads read consecutive columns: every sweep over a
// row is coalesced. Then the group combines its partial results:
//   version 1, n <= kWarpRowMaxN = 1024: ONE WARP PER ROW, blockDim (32, 4) = 4 rows per
//     block. Each lane reads <= 32 columns; every reduction is 5 __shfl_xor_sync steps; no
//     shared memory, no barrier. Short rows (attention scores over <= 1024 keys, N = B * heads
//     * T of them) are many, so one warp each keeps the GPU full without block-wide
//     synchronisation.
//   version 2, n > 1024: ONE BLOCK PER ROW, blockDim (256, 1) = 8 warps. A warp alone would
//     walk > 32 columns per lane, and long rows are usually few (vocabulary-sized logits,
//     V = 50257 for GPT-2), so more threads per row are needed to fill the GPU. Each warp
//     reduces by shuffles, then the 8 warp results go through shared memory.
// Both: a grid-stride loop over rows (first_row() and row_stride(): grid.h's grid_index() and
// grid_stride() counted in rows), so any number of rows runs on a bounded grid (row_launch()).
//
//   for (int64_t row = first_row(); row < rows; row += row_stride()) {
//     float v = 0.f;
//     for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v += in[row * n + j];
//     v = row_sum(v, warp_sum);  // every thread of the row group, converged
//     ...
//   }
//
// Barrier rules of the row_* combiners (row_reduce, row_sum, row_merge_state):
//   - EVERY thread of the row group calls them, with the same trip count of the row loop: the
//     full-mask shuffles need all 32 lanes of the warp. (A warp shares one row, so it agrees.)
//   - They reach __syncthreads only in version 2, where blockDim.y == 1: the whole block is
//     on the same row, so the whole block arrives. Version 1 returns after the shuffles (the
//     warp is the row), so the 4 warps of a block may run different numbers of rows.
//   - The shared slots (kMaxWarpsPerRow of them, declared __shared__ by the kernel, unused in
//     version 1) are reused by the next row: a second __syncthreads makes every thread read
//     them before any thread writes them again.
//   - Every thread combines the slots in the same order, so all of them hold the same result,
//     bit for bit (float sums are not associative: a different order could differ by an ulp).
// Include after kernels/simt.h. Everything here is constexpr or inline, so several .cu files
// can include it and still link into one program.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/cuda/grid.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

constexpr unsigned kFullMask = 0xffffffffu;  // all 32 lanes take part in a shuffle
constexpr int64_t kWarpRowMaxN = 1024;       // version 1 (a warp per row) up to this row length
constexpr unsigned kRowsPerBlock = 4;        // version 1: blockDim (32, 4)
constexpr unsigned kLongRowThreads = 256;    // version 2: blockDim (256, 1)
constexpr int kMaxWarpsPerRow = kLongRowThreads / 32;  // version 2: the shared slots of a combine

// ----------------------------------------------------------------------------
// launch shape

// Version 1 or 2 by row length n; the grid covers the rows, capped like the elementwise grid
// at kMaxElementwiseBlocks * kElementwiseBlock threads (grid-stride loops take the rest).
struct RowLaunch {
  dim3 grid, block;
};
inline RowLaunch row_launch(int64_t rows, int64_t n) {
  const dim3 block = n <= kWarpRowMaxN ? dim3(32, kRowsPerBlock) : dim3(kLongRowThreads, 1);
  const int64_t blocks = (rows + block.y - 1) / block.y;
  const int64_t max_blocks = kMaxElementwiseBlocks * kElementwiseBlock / (block.x * block.y);
  return {dim3((unsigned)(blocks < max_blocks ? blocks : max_blocks)), block};
}

// ----------------------------------------------------------------------------
// the rows of this thread's row group: a grid-stride loop over rows

__device__ __forceinline__ int64_t first_row() {
  return (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
}
__device__ __forceinline__ int64_t row_stride() { return (int64_t)gridDim.x * blockDim.y; }

// ----------------------------------------------------------------------------
// combining over a row group (barrier rules in the header)

// Combines v over the blockDim.x threads of a row with op(a, b), associative and commutative
// (a sum, max, min); every one of them gets the result. identity: op(identity, x) == x.
// warp_part: shared memory of kMaxWarpsPerRow values (used by version 2 only).
template <typename T, typename Op>
__device__ __forceinline__ T row_reduce(T v, T identity, Op op, T* warp_part) {
  // butterfly within the warp: after offsets 16, 8, 4, 2, 1 every lane holds the warp's result
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  if (blockDim.x == 32) return v;  // version 1: the warp is the row
  // version 2 (blockDim.y == 1, so the whole block is on this row): lane 0 of warp w posts to
  // slot w; every thread combines the slots in the same order, so all of them hold the same
  // result
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  v = identity;
  for (int w = 0; w < (int)blockDim.x / 32; w++) v = op(v, warp_part[w]);
  __syncthreads();  // every thread has read the slots before the next row writes them
  return v;
}

// The sum of v over the blockDim.x threads of a row, in every one of them.
// warp_sum: shared memory of kMaxWarpsPerRow floats (used by version 2 only).
__device__ __forceinline__ float row_sum(float v, float* warp_sum) {
  return row_reduce(v, 0.f, [](float a, float b) { return a + b; }, warp_sum);
}

// ----------------------------------------------------------------------------
// the online-softmax state (m, l): the max m of the values seen and l = sum exp(x - m)
// (Milakov & Gimelshein, arXiv:1805.02867; lesson 01), for softmax.cu and cross-entropy

// exp(a - b) for a <= b, with a = -inf (a state that has seen nothing finite) giving 0, never
// exp(-inf - -inf) = NaN.
__device__ __forceinline__ float rescale(float a, float b) {
  return a == -INFINITY ? 0.f : expf(a - b);
}

// (m, l) <- merge((m, l), (m2, l2)): m = max, each sum rescaled to the new max.
__device__ __forceinline__ void merge_state(float& m, float& l, float m2, float l2) {
  float m_new = fmaxf(m, m2);
  l = l * rescale(m, m_new) + l2 * rescale(m2, m_new);
  m = m_new;
}

// Merges the (m, l) of the blockDim.x threads of a row; every one of them gets the result.
// row_reduce with a two-float state (a shuffle moves one value, so m and l go separately).
// warp_m, warp_l: shared memory of kMaxWarpsPerRow floats each (used by version 2 only).
__device__ __forceinline__ void row_merge_state(float& m, float& l, float* warp_m,
                                                float* warp_l) {
  // butterfly within the warp: after offsets 16, 8, 4, 2, 1 every lane holds the warp's state
  for (int offset = 16; offset > 0; offset /= 2) {
    float m2 = __shfl_xor_sync(kFullMask, m, offset);
    float l2 = __shfl_xor_sync(kFullMask, l, offset);
    merge_state(m, l, m2, l2);
  }
  if (blockDim.x == 32) return;  // version 1: the warp is the row
  // version 2: lane 0 of warp w posts to slot w; every thread merges the slots in the same
  // order, so all of them hold the same (m, l)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  __syncthreads();
  m = -INFINITY;  // the empty state
  l = 0.f;
  for (int w = 0; w < (int)blockDim.x / 32; w++) merge_state(m, l, warp_m[w], warp_l[w]);
  __syncthreads();  // every thread has read the slots before the next row writes them
}

}  // namespace ff::SIMT_DEVICE_NS
