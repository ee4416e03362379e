// lessons/10_precision/fp8_linear.cpp — see fp8_linear.h.
#include "lessons/10_precision/fp8_linear.h"

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "kernels/kernels.h"

namespace ff::precision {

Tensor fp8_matmul(const Tensor& a, const Tensor& b, const Fp8Recipe& r) {
  FF_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.dtype() == DType::f32 &&
               b.dtype() == DType::f32 && a.device() == b.device(),
           "fp8_matmul: float32 (M, K) and (K, N) on one device, got " << shape_str(a.shape()) << " and "
                                                                       << shape_str(b.shape()));
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), t = r.tile;
  const Device d = a.device();
  const KernelTable& k = kernels_for(d);
  auto tiles = [](int64_t n, int64_t t) { return (n + t - 1) / t; };
  Tensor qa = Tensor::empty({M, K}, d, DType::fp8), sa = Tensor::empty({M, tiles(K, t)}, d);
  Tensor qb = Tensor::empty({K, N}, d, DType::fp8), sb = Tensor::empty({tiles(K, t), tiles(N, t)}, d);
  k.fp8_quantize(qa.fp8_data(), sa.data(), a.data(), M, K, 1, t);  // a token's t channels
  k.fp8_quantize(qb.fp8_data(), sb.data(), b.data(), K, N, t, t);  // a t x t block
  Tensor c = Tensor::empty({M, N}, d);
  k.matmul_fp8(c.data(), qa.fp8_data(), sa.data(), qb.fp8_data(), sb.data(), M, N, K, t, t, r.promote, r.acc_bits,
               false);
  return c;
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

}  // namespace ff::precision
