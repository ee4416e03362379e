// kernels/cuda/grid.h — launch-shape helpers shared by the kernels in kernels/cuda/.
//
// Grid-stride loops: thread t of a grid of T threads handles elements t, t + T, t + 2T, ...
// so one bounded grid covers any n. Include after kernels/simt.h.
#pragma once
#include <cstdint>

#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

// Threads per block of the elementwise kernels: 8 warps, a common default.
constexpr unsigned kElementwiseBlock = 256;
// At most this many blocks: 1024 x 256 threads fill every SM of an H100 (132 SMs x 2048
// resident threads = 270k) while keeping the emulator's thread count bounded.
constexpr int64_t kMaxElementwiseBlocks = 1024;

inline dim3 elementwise_grid(int64_t n) {
  int64_t blocks = (n + kElementwiseBlock - 1) / kElementwiseBlock;
  return dim3((unsigned)(blocks < kMaxElementwiseBlocks ? blocks : kMaxElementwiseBlocks));
}

__device__ __forceinline__ int64_t grid_index() {
  return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return (int64_t)gridDim.x * blockDim.x; }

}  // namespace ff::SIMT_DEVICE_NS
