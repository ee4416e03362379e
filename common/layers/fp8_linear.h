// common/layers/fp8_linear.h — a linear layer y = x W whose three GEMMs run in FP8 e4m3,
// as DeepSeek-V3 trains its linear layers (technical report, section 3.3.1, figure 6):
//
//   Fprop  y  = x W       x in 1 x t tiles (a token's t channels), W in t x t blocks
//   Dgrad  dx = dy W^T    dy in 1 x t tiles, W^T in t x t blocks
//   Wgrad  dW = x^T dy    x^T in 1 x t tiles (a channel's t tokens: x in t x 1), dy in t x t blocks
//
// each operand quantized online from its own largest magnitudes (lesson 10's formats.h, quantize), the
// products summed in the tensor core's narrow accumulator and promoted to float32 every
// `promote` (lesson 10's fp8_gemm), on the device's kernels (fp8_quantize, matmul_fp8). x, W, y
// and the gradients stay float32 tensors: FP8 lives inside the GEMMs.
#pragma once
#include <cstdint>

#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "common/layers/moe.h"

namespace ff::fp8 {

struct Fp8Recipe {
  int64_t tile = 128, promote = 128;  // t, and N_C: promote divides tile
  int acc_bits = 14;                  // the accumulator's mantissa bits (23: float32's)
  bool bug_dgrad_untransposed = false;  // the planted bug: Dgrad multiplies dy by W, not W^T
};

// A float32 tensor (R, C) quantized on its device in tr x tc tiles (the device's fp8_quantize):
// its e4m3 codes and its scales (ceil(R/tr), ceil(C/tc)).
struct DeviceFp8 {
  Tensor q, scale;
  int64_t tr = 0, tc = 0;
};
DeviceFp8 fp8_quantize_on_device(const Tensor& x, int64_t tr, int64_t tc);
// a (M, K) @ b (K, N) of quantized operands, a in 1 x t tiles and b in t x t blocks (the
// device's matmul_fp8)
Tensor fp8_gemm_on_device(const DeviceFp8& a, const DeviceFp8& b, const Fp8Recipe& r);
// a (M, K) @ b (K, N) in FP8: both quantized, then the GEMM
Tensor fp8_matmul(const Tensor& a, const Tensor& b, const Fp8Recipe& r);

// y = x W, x (M, K), W (K, N), float32 on one device; its backward is Dgrad and Wgrad in FP8.
Tensor fp8_linear(const Tensor& x, const Tensor& w, const Fp8Recipe& r);

// fp8_linear with recipe r as lesson 08's model's linear layers take it: held in a
// model::LinearScope, MLA's projections and the dense FFN run in FP8 (the attention core, the
// experts, the head, the norms and the router keep their float32 products).
model::LinearFn fp8_linears(const Fp8Recipe& r);
// fp8_matmul with recipe r as the experts' products take it: held in a moe::ExpertGemmScope, the
// routed and shared experts' Fprop, Dgrad and Wgrad run in FP8, group by group, as the report's.
moe::GemmFn fp8_expert_gemms(const Fp8Recipe& r);

}  // namespace ff::fp8
