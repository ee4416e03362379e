// lessons/10_precision/measure.cpp — see measure.h.
#include "lessons/10_precision/measure.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/core/ops.h"
#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "common/core/autograd.h"
#include "common/layers/fp8_linear.h"

namespace ff::precision {

using namespace fp8;  // the FP8 layer and its device GEMMs (common/layers/fp8_linear.h)

namespace {

// Activations (M, K) ~ N(0, 1), every 256th channel `outlier` times larger (0: none): LLM
// activations carry a few such channels, and a 1 x 128 tile holding one loses its small values.
constexpr int64_t kOutlierFirst = 37, kOutlierEvery = 256;
std::vector<float> activations(int64_t M, int64_t K, double outlier, uint64_t seed) {
  std::vector<float> x = randn({M, K}, seed).to_vector();
  if (outlier > 0)
    for (int64_t i = 0; i < M; i++)
      for (int64_t p = kOutlierFirst; p < K; p += kOutlierEvery) x[(size_t)(i * K + p)] *= (float)outlier;
  return x;
}

}  // namespace

// Relative error ||c - want|| / ||want|| in float64.
double relative(const std::vector<float>& c, const std::vector<double>& want) {
  double e2 = 0, r2 = 0;
  for (size_t i = 0; i < c.size(); i++) e2 += (c[i] - want[i]) * (c[i] - want[i]), r2 += want[i] * want[i];
  return std::sqrt(e2 / r2);
}

// float64 a @ b of what the operands hold: the quantized values (their dequantization) or the
// float32 inputs.
std::vector<double> exact_gemm(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t K,
                               int64_t N) {
  std::vector<double> c((size_t)(M * N));
  for (int64_t i = 0; i < M; i++)
    for (int64_t p = 0; p < K; p++)
      for (int64_t j = 0; j < N; j++) c[(size_t)(i * N + j)] += a[(size_t)(i * K + p)] * b[(size_t)(p * N + j)];
  return c;
}
std::vector<double> values(const Fp8& x) {
  std::vector<double> v((size_t)(x.R * x.C));
  for (int64_t r = 0; r < x.R; r++)
    for (int64_t c = 0; c < x.C; c++) v[(size_t)(r * x.C + c)] = x.value(r, c);
  return v;
}

// [slide:fp8-bound]
// The promoted GEMM's distance from float64 over its own dequantized operands, per element:
// a chunk of n products in an accumulator of b bits: each fma rounds to float32 (2^-24) and
// drops the bits below the b-th (under 2^-b relative), so the chunk's partial is within
// n (2^-b + 2^-24) of its products' magnitudes; then times a's scale (one rounding) and fused
// with b's into the float32 total (one more), which sums T chunks (T roundings): (2 + T) 2^-24.
// The reference is float64 of the dequantized values (each e4m3 code times its scale exact in
// double). As a ratio: error / bound, 1 fails.
double bound_ratio(const std::vector<float>& c, const Fp8& a, const Fp8& b, int64_t promote, int bits) {
  const int64_t M = a.R, K = a.C, N = b.C, T = (K + promote - 1) / promote;
  const double u = std::ldexp(1.0, -24), narrow = std::ldexp(1.0, -bits) + u;
  double worst = 0;
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double want = 0, bound = 0;
      for (int64_t p0 = 0; p0 < K; p0 += promote) {
        const int64_t n = std::min(promote, K - p0);
        double mag = 0;
        for (int64_t p = p0; p < p0 + n; p++) {
          const double x = a.value(i, p) * b.value(p, j);
          want += x, mag += std::fabs(x);
        }
        bound += (n * narrow + (2 + T) * u) * mag * (1 + 1e-12);
      }
      worst = std::max(worst, std::fabs(c[(size_t)(i * N + j)] - want) / bound);
    }
  return worst;
}
// [/slide]

// One K of the sweep.

namespace {

// The device's fp8_quantize and matmul_fp8 on the same inputs: do they give the lesson's bits?
bool device_matches(Device device, const std::vector<float>& xa, const std::vector<float>& xb, const Fp8& qa,
                    const Fp8& qb, const std::vector<float>& c, int64_t promote, int bits) {
  // the codes and the scales, then the product, each against the loops'
  auto same_as = [](const DeviceFp8& d, const Fp8& q) {
    const Tensor host = d.q.to(Device::cpu);
    bool same = std::memcmp(host.fp8_data(), q.q.data(), q.q.size()) == 0;
    const std::vector<float> s = d.scale.to_vector();
    for (size_t i = 0; i < s.size(); i++) same = same && float_bits(s[i]) == float_bits(q.scale[i]);
    return same;
  };
  const DeviceFp8 a = fp8_quantize_on_device(Tensor::from_vector(xa, {qa.R, qa.C}).to(device), qa.tr, qa.tc);
  const DeviceFp8 b = fp8_quantize_on_device(Tensor::from_vector(xb, {qb.R, qb.C}).to(device), qb.tr, qb.tc);
  Fp8Recipe r;
  r.promote = promote, r.acc_bits = bits;
  const std::vector<float> got = fp8_gemm_on_device(a, b, r).to_vector();
  bool same = same_as(a, qa) && same_as(b, qb);
  for (size_t i = 0; i < got.size(); i++) same = same && float_bits(got[i]) == float_bits(c[i]);
  return same;
}

}  // namespace

Bf16Result check_bf16(Device device, FormatBug bug, uint64_t seed) {
  std::vector<float> xs;
  for (uint32_t high = 0; high < 0x10000; high++)
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const uint32_t u = high << 16 | low;
      float f;
      std::memcpy(&f, &u, sizeof f);
      xs.push_back(f);
    }
  const std::vector<float> r = randn({20000}, seed).to_vector();
  xs.insert(xs.end(), r.begin(), r.end());
  const Tensor on_device = Tensor::from_vector(xs, {(int64_t)xs.size()}).to(device).to_dtype(DType::bf16);
  const std::vector<float> got = on_device.to_vector();  // widened: exact
  Bf16Result out;
  out.compared = (int64_t)xs.size();
  for (size_t i = 0; i < xs.size(); i++) {
    const uint16_t mine = round_to_bf16(xs[i], bug);
    const float back = widen_bf16(mine);
    out.same_bits = out.same_bits && float_bits(back) == float_bits(got[i]);
    const float a = std::fabs(xs[i]);
    if (std::isfinite(back) && a >= std::numeric_limits<float>::min())
      out.worst_rel = std::max(out.worst_rel, std::fabs((double)back - xs[i]) / a);
  }
  return out;
}


MatmulResult check_bf16_matmul(Device device, int64_t M, int64_t K, int64_t N, uint64_t seed) {
  const Tensor a = randn({M, K}, seed).to(device), b = randn({K, N}, seed + 1).to(device);
  const Tensor c = matmul(a.to_dtype(DType::bf16), b.to_dtype(DType::bf16));
  const std::vector<float> got = c.to_vector(), fa = a.to_vector(), fb = b.to_vector();
  const std::vector<float> ha = a.to_dtype(DType::bf16).to_vector(), hb = b.to_dtype(DType::bf16).to_vector();
  const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u);
  MatmulResult out;
  double e2 = 0, r2 = 0, ei2 = 0, ri2 = 0;
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double want = 0, mag = 0, exact = 0;
      for (int64_t p = 0; p < K; p++) {
        const double x = (double)ha[(size_t)(i * K + p)] * hb[(size_t)(p * N + j)];
        want += x, mag += std::fabs(x);
        exact += (double)fa[(size_t)(i * K + p)] * fb[(size_t)(p * N + j)];
      }
      const double g = got[(size_t)(i * N + j)];
      out.ratio = std::max(out.ratio, std::fabs(g - want) / (gamma * mag));
      e2 += (g - want) * (g - want), r2 += want * want;
      ei2 += (g - exact) * (g - exact), ri2 += exact * exact;
    }
  out.rel_bf16 = std::sqrt(e2 / r2), out.rel_inputs = std::sqrt(ei2 / ri2);
  return out;
}

KRow sweep_k(Device device, const SweepShape& o, int64_t K, FormatBug bug, uint64_t seed) {
  const int64_t M = o.m, N = o.n, t = std::min(o.tile, K), promote = std::min(o.promote, t);
  const int bits = (int)o.acc_bits;
  KRow row{};
  row.k = (double)K;
  const std::vector<float> xa = activations(M, K, 0, seed), xb = randn({K, N}, seed + 1).to_vector();
  // DeepSeek-V3's recipe: 1 x t tiles of a, t x t blocks of b, promoted every `promote`
  const Fp8 qa = quantize(xa, M, K, 1, t, bug), qb = quantize(xb, K, N, t, t, bug);
  const std::vector<float> c = fp8_gemm(qa, qb, promote, bits, bug);
  row.recipe = relative(c, exact_gemm(values(qa), values(qb), M, K, N));
  row.recipe_ratio = bound_ratio(c, qa, qb, promote, bits);
  row.same_bits = bug == FormatBug::none || bug == FormatBug::bf16_truncate
                      ? device_matches(device, xa, xb, qa, qb, c, promote, bits) : 1;
  row.fp32_acc = relative(fp8_gemm(qa, qb, promote, 23, bug), exact_gemm(values(qa), values(qb), M, K, N));
  // never promoted: one tile along all of K (a row's scale, a K x t column block's), the K
  // products in the narrow accumulator
  const Fp8 wa = quantize(xa, M, K, 1, K), wb = quantize(xb, K, N, K, t);
  const std::vector<float> never = fp8_gemm(wa, wb, K, bits);
  row.never = relative(never, exact_gemm(values(wa), values(wb), M, K, N));
  // outlier channels: per-tile against per-tensor scales, both against the float32 inputs.
  // The weights' rows of those channels are zeros, so the product is the other channels' alone:
  // what it loses is what an outlier costs the small values that share its scale
  const std::vector<float> xo = activations(M, K, o.outlier, seed + 2);
  std::vector<float> wo = xb;
  for (int64_t p = kOutlierFirst; p < K; p += kOutlierEvery) std::fill(&wo[(size_t)(p * N)], &wo[(size_t)((p + 1) * N)], 0.f);
  const std::vector<double> want =
      exact_gemm(std::vector<double>(xo.begin(), xo.end()), std::vector<double>(wo.begin(), wo.end()), M, K, N);
  const Fp8 qw = quantize(wo, K, N, t, t, bug);
  row.fine = relative(fp8_gemm(quantize(xo, M, K, 1, t, bug), qw, promote, bits, bug), want);
  row.per_tensor = relative(fp8_gemm(quantize(xo, M, K, M, K), quantize(wo, K, N, K, N), promote, bits), want);
  return row;
}


// ---- [3] the FP8 linear layer

namespace {
// t (R, C) float32 on the host, transposed: (C, R)
std::vector<float> transposed(const std::vector<float>& t, int64_t R, int64_t C) {
  std::vector<float> out((size_t)(R * C));
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) out[(size_t)(c * R + r)] = t[(size_t)(r * C + c)];
  return out;
}
}  // namespace

LayerResult check_fp8_layer(Device device, int64_t M, int64_t K, int64_t N, const Fp8Recipe& r, uint64_t seed) {
  const Tensor x0 = randn({M, K}, seed), w0 = scale(randn({K, N}, seed + 1), 1.f / std::sqrt((float)K)),
               dy0 = randn({M, N}, seed + 2);
  Tensor x = x0.to(device).requires_grad_(), w = w0.to(device).requires_grad_();
  const Tensor y = fp8_linear(x, w, r);
  run_backward(y, dy0.to(device));
  const std::vector<float> xs = x0.to_vector(), ws = w0.to_vector(), dys = dy0.to_vector();
  const int64_t t = r.tile;
  // the three GEMMs by formats.cpp's loops, on the operands each one multiplies
  struct Gemm {
    Fp8 a, b;
    std::vector<float> got;  // the layer's
    std::vector<double> exact;  // float64 of the float32 operands
  };
  const std::vector<float> xt = transposed(xs, M, K), wt = transposed(ws, K, N);
  Gemm g[3] = {
      {quantize(xs, M, K, 1, t), quantize(ws, K, N, t, t), y.to_vector(), {}},        // Fprop: x W
      {quantize(dys, M, N, 1, t), quantize(wt, N, K, t, t), x.grad().to_vector(), {}},  // Dgrad: dy W^T
      {quantize(xt, K, M, 1, t), quantize(dys, M, N, t, t), w.grad().to_vector(), {}},  // Wgrad: x^T dy
  };
  auto wide = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  g[0].exact = exact_gemm(wide(xs), wide(ws), M, K, N);
  g[1].exact = exact_gemm(wide(dys), wide(wt), M, N, K);
  g[2].exact = exact_gemm(wide(xt), wide(dys), K, M, N);
  // the same three in bf16 (the bf16 matmul: inputs rounded, float32 sums), for scale
  const Tensor xh = x0.to(device).to_dtype(DType::bf16), wh = w0.to(device).to_dtype(DType::bf16),
               dyh = dy0.to(device).to_dtype(DType::bf16);
  const Tensor bf16[3] = {matmul(xh, wh), matmul(dyh, transpose(wh, 0, 1)), matmul(transpose(xh, 0, 1), dyh)};
  LayerResult out;
  for (int k = 0; k < 3; k++) {
    const std::vector<float> want = fp8_gemm(g[k].a, g[k].b, r.promote, r.acc_bits);
    out.same = out.same && want.size() == g[k].got.size() &&
               std::memcmp(want.data(), g[k].got.data(), want.size() * sizeof(float)) == 0;
    out.rel[k] = relative(g[k].got, g[k].exact);
    out.ratio[k] = bound_ratio(g[k].got, g[k].a, g[k].b, r.promote, r.acc_bits);
    out.rel_bf16[k] = relative(bf16[k].to_vector(), g[k].exact);
  }
  return out;
}

}  // namespace ff::precision
