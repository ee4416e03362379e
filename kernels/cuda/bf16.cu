// kernels/cuda/bf16.cu — the bfloat16 conversions on the GPU (and, compiled by the host
// compiler, on device sim): one thread per element, a grid-stride loop, kernels/bf16.h's
// rounding. The cpu twins are in kernels/cpu/bf16.cpp; the bf16 matmul is in matmul.cu.
#include "kernels/bf16.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"

namespace ff::SIMT_DEVICE_NS {

__global__ void to_bf16_kernel(uint16_t* out, const float* x, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) out[i] = float_to_bf16(x[i]);
}

__global__ void from_bf16_kernel(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) out[i] = bf16_to_float(x[i]);
}

void to_bf16(uint16_t* out, const float* x, int64_t n) {
  if (n == 0) return;
  SIMT_LAUNCH(to_bf16_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, out, x, n);
  SIMT_CHECK_LAUNCH();
}

void from_bf16(float* out, const uint16_t* x, int64_t n) {
  if (n == 0) return;
  SIMT_LAUNCH(from_bf16_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, out, x, n);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
