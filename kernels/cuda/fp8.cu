// kernels/cuda/fp8.cu — the FP8 kernels on the GPU (and, compiled by the host compiler, on
// device sim), the same arithmetic in the same order as their cpu twins (kernels/cpu/fp8.cpp).
//   fp8_quantize: one block per tile; its threads find the tile's largest magnitude (a max is
//     exact in any order), then each divides and rounds its elements.
//   fp8_dequantize: one thread per element.
//   matmul_fp8: one thread per element of c, its products in order of K. This is the
//     arithmetic of DeepSeek-V3's GEMM, not its speed: on Hopper the products run on the tensor
//     cores (wgmma with e4m3 operands), and every 128 of them the partial sums move to CUDA
//     cores' registers, are scaled and added in float32 (DeepGEMM does this).
#include <algorithm>

#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/fp8.h"

namespace ff::SIMT_DEVICE_NS {

constexpr unsigned kQuantizeThreads = 128;

__global__ void fp8_quantize_kernel(uint8_t* q, float* s, const float* x, int64_t R, int64_t C, int64_t tr,
                                    int64_t tc) {
  __shared__ float amax[kQuantizeThreads];
  const int64_t tiles_c = (C + tc - 1) / tc, tiles_r = (R + tr - 1) / tr;
  for (int64_t tile = blockIdx.x; tile < tiles_r * tiles_c; tile += gridDim.x) {
    const int64_t r0 = tile / tiles_c * tr, c0 = tile % tiles_c * tc;
    const int64_t rows = (r0 + tr < R ? tr : R - r0), cols = (c0 + tc < C ? tc : C - c0);
    float m = 0.f;
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x)
      m = fmaxf(m, fabsf(x[(r0 + e / cols) * C + c0 + e % cols]));
    amax[threadIdx.x] = m;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) amax[threadIdx.x] = fmaxf(amax[threadIdx.x], amax[threadIdx.x + half]);
      __syncthreads();
    }
    const float scale = amax[0] > 0.f ? amax[0] / kFp8Max : 1.f;
    if (threadIdx.x == 0) s[tile] = scale;
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x) {
      const int64_t at = (r0 + e / cols) * C + c0 + e % cols;
      q[at] = float_to_fp8(x[at] / scale);
    }
    __syncthreads();  // amax is reused by the block's next tile
  }
}

__global__ void fp8_dequantize_kernel(float* x, const uint8_t* q, const float* s, int64_t R, int64_t C,
                                      int64_t tr, int64_t tc) {
  const int64_t tiles_c = (C + tc - 1) / tc;
  for (int64_t i = grid_index(); i < R * C; i += grid_stride()) {
    const int64_t r = i / C, c = i % C;
    x[i] = fp8_to_float(q[i]) * s[(r / tr) * tiles_c + c / tc];
  }
}

__global__ void matmul_fp8_kernel(float* c, const uint8_t* a, const float* sa, const uint8_t* b,
                                  const float* sb, int64_t M, int64_t N, int64_t K, int64_t tk, int64_t tn,
                                  int64_t promote, int acc_bits, bool accumulate) {
  const int64_t ka = (K + tk - 1) / tk, nb = (N + tn - 1) / tn;
  for (int64_t e = grid_index(); e < M * N; e += grid_stride()) {
    const int64_t i = e / N, j = e % N;
    float total = 0.f;
    for (int64_t p0 = 0; p0 < K; p0 += promote) {
      float partial = 0.f;
      const int64_t p1 = p0 + promote < K ? p0 + promote : K;
      for (int64_t p = p0; p < p1; p++)
        partial = accumulate_bits(fmaf(fp8_to_float(a[i * K + p]), fp8_to_float(b[p * N + j]), partial), acc_bits);
      const int64_t g = p0 / tk;
      total = fmaf(partial * sa[i * ka + g], sb[g * nb + j / tn], total);
    }
    c[e] = accumulate ? c[e] + total : total;
  }
}

void fp8_quantize(uint8_t* q, float* s, const float* x, int64_t R, int64_t C, int64_t tr, int64_t tc) {
  const int64_t n_tiles = ((R + tr - 1) / tr) * ((C + tc - 1) / tc);
  if (n_tiles == 0) return;
  SIMT_LAUNCH(fp8_quantize_kernel, dim3((unsigned)std::min<int64_t>(n_tiles, kMaxElementwiseBlocks)),
              kQuantizeThreads, 0, 0, q, s, x, R, C, tr, tc);
  SIMT_CHECK_LAUNCH();
}

void fp8_dequantize(float* x, const uint8_t* q, const float* s, int64_t R, int64_t C, int64_t tr, int64_t tc) {
  if (R * C == 0) return;
  SIMT_LAUNCH(fp8_dequantize_kernel, elementwise_grid(R * C), kElementwiseBlock, 0, 0, x, q, s, R, C, tr, tc);
  SIMT_CHECK_LAUNCH();
}

void matmul_fp8(float* c, const uint8_t* a, const float* sa, const uint8_t* b, const float* sb, int64_t M,
                int64_t N, int64_t K, int64_t tk, int64_t tn, int64_t promote, int acc_bits, bool accumulate) {
  if (M * N == 0) return;
  SIMT_LAUNCH(matmul_fp8_kernel, elementwise_grid(M * N), kElementwiseBlock, 0, 0, c, a, sa, b, sb, M, N, K, tk, tn,
              promote, acc_bits, accumulate);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
