// common/layers/fp8_linear.cpp — see fp8_linear.h.
#include "common/layers/fp8_linear.h"

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "kernels/kernels.h"

namespace ff::fp8 {

DeviceFp8 fp8_quantize_on_device(const Tensor& x, int64_t tr, int64_t tc) {
  FF_CHECK(x.dim() == 2 && x.dtype() == DType::f32, "fp8_quantize_on_device: a float32 (R, C) tensor, got "
                                                        << shape_str(x.shape()));
  const int64_t R = x.size(0), C = x.size(1);
  DeviceFp8 out{Tensor::empty({R, C}, x.device(), DType::fp8),
                Tensor::empty({(R + tr - 1) / tr, (C + tc - 1) / tc}, x.device()), tr, tc};
  kernels_for(x.device()).fp8_quantize(out.q.fp8_data(), out.scale.data(), x.data(), R, C, tr, tc);
  return out;
}

Tensor fp8_gemm_on_device(const DeviceFp8& a, const DeviceFp8& b, const Fp8Recipe& r) {
  const int64_t M = a.q.size(0), K = a.q.size(1), N = b.q.size(1);
  FF_CHECK(b.q.size(0) == K && a.tr == 1 && a.tc == b.tr && a.q.device() == b.q.device(),
           "fp8_gemm_on_device: a (M, K) in 1 x t tiles, b (K, N) in t x tn blocks on one device");
  Tensor c = Tensor::empty({M, N}, a.q.device());
  kernels_for(a.q.device()).matmul_fp8(c.data(), a.q.fp8_data(), a.scale.data(), b.q.fp8_data(), b.scale.data(), M, N,
                                       K, a.tc, b.tc, r.promote, r.acc_bits, false);
  return c;
}

Tensor fp8_matmul(const Tensor& a, const Tensor& b, const Fp8Recipe& r) {
  FF_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.device() == b.device(),
           "fp8_matmul: (M, K) and (K, N) on one device, got " << shape_str(a.shape()) << " and " << shape_str(b.shape()));
  // a token's t channels; a t x t block
  return fp8_gemm_on_device(fp8_quantize_on_device(a, 1, r.tile), fp8_quantize_on_device(b, r.tile, r.tile), r);
}

// [slide:fp8-linear]
Tensor fp8_linear(const Tensor& x, const Tensor& w, const Fp8Recipe& r) {
  const Tensor y = fp8_matmul(x.detach(), w.detach(), r);  // Fprop
  return record(y, "fp8_linear", {x, w}, [x, w, r](const Tensor& dy) -> std::vector<Tensor> {
    const Tensor wt = r.bug_dgrad_untransposed ? w.detach() : transpose(w.detach(), 0, 1);
    const Tensor dx = fp8_matmul(dy, wt, r);                              // Dgrad: dy W^T
    const Tensor dw = fp8_matmul(transpose(x.detach(), 0, 1), dy, r);    // Wgrad: x^T dy
    return {dx, dw};
  });
}
// [/slide]

model::LinearFn fp8_linears(const Fp8Recipe& r) {
  return [r](const Tensor& x, const Tensor& w) { return fp8_linear(x, w, r); };
}

moe::GemmFn fp8_expert_gemms(const Fp8Recipe& r) {
  return [r](const Tensor& a, const Tensor& b) { return fp8_matmul(a, b, r); };
}

}  // namespace ff::fp8
