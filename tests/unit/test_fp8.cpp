// Kernel tests: FP8 e4m3 (kernels/fp8.h). The rounding from float32 against the nearest of the
// 253 finite e4m3 values found by search (ties to the even code), saturation and NaN; the
// quantization's error within half an e4m3 step of each tile's scale; the FP8 GEMM against
// float64 of the dequantized operands within the bound of its float32 sums; the narrow
// accumulator's error growing with K unless the partial sums are promoted; and the device under
// test equal to the cpu, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// The finite non-negative e4m3 values by code (0x00 .. 0x7e), from the format's definition.
std::vector<double> e4m3_values() {
  std::vector<double> v;
  for (int code = 0; code <= 0x7e; code++) {
    const int e = code >> 3, m = code & 7;
    v.push_back(e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7));
  }
  return v;
}

// Round to nearest, ties to the even code, saturating at 448: by search over the values.
uint8_t reference_fp8(float f, const std::vector<double>& values) {
  const double a = std::fabs((double)f);
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (a >= 448) return sign | 0x7e;
  size_t best = 0;
  for (size_t k = 1; k < values.size(); k++) {
    const double dk = std::fabs(values[k] - a), db = std::fabs(values[best] - a);
    if (dk < db || (dk == db && k % 2 == 0)) best = k;
  }
  return sign | (uint8_t)best;
}

// n values ~ N(0, 1) with one outlier in 50 at 300 times the rest: what fine-grained scales
// are for (a tile holding the outlier loses its small values; the others do not).
std::vector<float> with_outliers(int64_t n, uint64_t seed) {
  std::vector<float> v = randn({n}, seed).to_vector();
  for (int64_t i = 0; i < n; i++)
    if (i % 50 == 7) v[(size_t)i] *= 300.f;
  return v;
}

struct Quantized {
  Tensor q, s;
};
Quantized quantize(const KernelTable& k, Device d, const std::vector<float>& x, int64_t R, int64_t C, int64_t tr,
                   int64_t tc) {
  Quantized out{Tensor::empty({R, C}, d, DType::fp8), Tensor::empty({(R + tr - 1) / tr, (C + tc - 1) / tc}, d)};
  k.fp8_quantize(out.q.fp8_data(), out.s.data(), kt::upload(x, d).data(), R, C, tr, tc);
  return out;
}
std::vector<float> dequantized(const KernelTable& k, Device d, const Quantized& q, int64_t R, int64_t C, int64_t tr,
                               int64_t tc) {
  Tensor x = kt::scratch(R * C, d);
  k.fp8_dequantize(x.data(), q.q.fp8_data(), q.s.data(), R, C, tr, tc);
  return x.to_vector();
}

// The largest relative error of matmul_fp8 over c (M, N) against float64 products of the
// dequantized operands, relative to sum_p |a_ip b_pj|.
double worst_relative(const std::vector<float>& c, const std::vector<float>& a, const std::vector<float>& b,
                      int64_t M, int64_t N, int64_t K) {
  double worst = 0;
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double s = 0, mag = 0;
      for (int64_t p = 0; p < K; p++) s += (double)a[(size_t)(i * K + p)] * b[(size_t)(p * N + j)],
                                      mag += std::fabs((double)a[(size_t)(i * K + p)] * b[(size_t)(p * N + j)]);
      worst = std::max(worst, std::fabs(c[(size_t)(i * N + j)] - s) / mag);
    }
  return worst;
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("fp8: float32 rounds to the nearest e4m3, ties to the even code, saturating at 448; NaN stays NaN") {
  const std::vector<double> values = e4m3_values();
  CHECK(values.back() == 448.0);
  // every float32 exponent and the top mantissa bits of each, with the low bits around e4m3's
  // tie (bit 19 of float32's mantissa) and elsewhere
  int64_t checked = 0, bad = 0;
  std::string first;
  for (uint32_t high = 0; high < 0x800; high++)  // sign, exponent, 3 mantissa bits
    for (uint32_t low : {0x00000u, 0x00001u, 0x7ffffu, 0x80000u, 0x80001u, 0xfffffu}) {
      const uint32_t u = high << 20 | low;
      float f;
      std::memcpy(&f, &u, sizeof f);
      const uint8_t got = float_to_fp8(f);
      bool ok = std::isnan(f) ? (got & 0x7f) == kFp8NaN : got == reference_fp8(f, values);
      checked++;
      if (!ok && bad++ == 0) first = std::to_string(f) + " -> " + std::to_string(got) + ", want " +
                                     std::to_string(reference_fp8(f, values));
    }
  CHECK_MESSAGE(bad == 0, bad << " of " << checked << " floats round wrongly; first: " << first);
  // decoding is the definition's value
  for (int code = 0; code <= 0x7e; code++) REQUIRE(fp8_to_float((uint8_t)code) == (float)values[(size_t)code]);
  CHECK(std::isnan(fp8_to_float(0x7f)));
  CHECK(fp8_to_float(0xc0) == -2.f);
  CHECK(float_to_fp8(1e9f) == 0x7e);  // saturated, not NaN
  CHECK(float_to_fp8(-std::numeric_limits<float>::infinity()) == 0xfe);
  CHECK(float_to_fp8(1.0625f) == 0x38);  // 1 + 1/16, halfway between 1 and 1.125: to even (1)
  CHECK(float_to_fp8(1.1875f) == 0x3a);  // halfway between 1.125 and 1.25: to even (1.25)
  CHECK(accumulate_bits(1.f + std::ldexp(1.f, -20), 14) == 1.f);  // bits below the 14th dropped
}

TEST_CASE("fp8: quantized tiles come back within half an e4m3 step of their scale; the device equals the cpu") {
  const int64_t R = 70, C = 300;
  const std::vector<float> x = with_outliers(R * C, 5);
  for (auto [tr, tc] : {std::pair<int64_t, int64_t>{1, 128}, {128, 128}, {16, 32}}) {
    CAPTURE(tr);
    CAPTURE(tc);
    const KernelTable& cpu = kernels_for(Device::cpu);
    const Quantized q = quantize(cpu, Device::cpu, x, R, C, tr, tc);
    const std::vector<float> back = dequantized(cpu, Device::cpu, q, R, C, tr, tc), s = q.s.to_vector();
    const int64_t tiles_c = (C + tc - 1) / tc;
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++)
      for (int64_t c = 0; c < C; c++) {
        const double scale = s[(size_t)((r / tr) * tiles_c + c / tc)], v = x[(size_t)(r * C + c)];
        // e4m3: 3 mantissa bits, so within 2^-4 of |v| for normal values; under 2^-6 s the
        // steps are 2^-9 s: within half of that. Plus the division's and product's roundings.
        const double tol = std::max(std::ldexp(std::fabs(v), -4), std::ldexp(scale, -10)) * (1 + 1e-6);
        bad += std::fabs(back[(size_t)(r * C + c)] - v) > tol;
      }
    CHECK_MESSAGE(bad == 0, bad << " values off by more than half an e4m3 step");
    // the device under test: the same codes and scales
    const Device d = kt::device_under_test();
    const Quantized qd = quantize(kernels_for(d), d, x, R, C, tr, tc);
    const std::vector<float> codes_cpu = q.q.to_vector(), codes_dev = qd.q.to_vector();
    const std::vector<float> sd = qd.s.to_vector();
    int64_t differ = 0;
    for (size_t i = 0; i < codes_cpu.size(); i++) differ += float_bits(codes_cpu[i]) != float_bits(codes_dev[i]);
    for (size_t i = 0; i < s.size(); i++) differ += float_bits(s[i]) != float_bits(sd[i]);
    CHECK_MESSAGE(differ == 0, differ << " codes or scales differ from the cpu's on " << device_name(d));
    const std::vector<float> back_d = dequantized(kernels_for(d), d, qd, R, C, tr, tc);
    differ = 0;
    for (size_t i = 0; i < back.size(); i++) differ += float_bits(back[i]) != float_bits(back_d[i]);
    CHECK(differ == 0);
  }
}

TEST_CASE("fp8: the GEMM of quantized operands against float64, and a narrow accumulator needs promotion") {
  // a (M, K) in 1 x 128 tiles, b (K, N) in 128 x 128 blocks, as DeepSeek-V3 quantizes
  // activations and weights
  const int64_t M = 4, N = 6, K = 4096, tk = 128, tn = 128;
  const KernelTable& cpu = kernels_for(Device::cpu);
  const std::vector<float> xa = with_outliers(M * K, 7), xb = randn({K * N}, 8).to_vector();
  const Quantized qa = quantize(cpu, Device::cpu, xa, M, K, 1, tk), qb = quantize(cpu, Device::cpu, xb, K, N, tk, tn);
  const std::vector<float> a = dequantized(cpu, Device::cpu, qa, M, K, 1, tk),
                           b = dequantized(cpu, Device::cpu, qb, K, N, tk, tn);
  auto gemm = [&](const KernelTable& k, Device d, const Quantized& A, const Quantized& B, int64_t promote, int bits,
                  int64_t tile_k) {
    Tensor c = kt::scratch(M * N, d);
    const Quantized Ad{A.q.to(d), A.s.to(d)}, Bd{B.q.to(d), B.s.to(d)};
    k.matmul_fp8(c.data(), Ad.q.fp8_data(), Ad.s.data(), Bd.q.fp8_data(), Bd.s.data(), M, N, K, tile_k, tn, promote,
                 bits, false);
    return c.to_vector();
  };
  // float32 accumulation, promoted every 128: each partial of 128 exact products rounds once
  // per product, its scaling twice, the sum once per partial: within (K + 3 K / 128) u of
  // sum |a b| (u = 2^-24)
  const std::vector<float> full = gemm(cpu, Device::cpu, qa, qb, 128, 23, tk);
  const double u = std::ldexp(1.0, -24);
  CHECK(worst_relative(full, a, b, M, N, K) <= (K + 3.0 * K / 128) * u);
  // the device under test: the same bits
  const Device d = kt::device_under_test();
  const std::vector<float> full_d = gemm(kernels_for(d), d, qa, qb, 128, 23, tk);
  int64_t differ = 0;
  for (size_t i = 0; i < full.size(); i++) differ += float_bits(full[i]) != float_bits(full_d[i]);
  CHECK_MESSAGE(differ == 0, differ << " elements differ from the cpu's on " << device_name(d));
  // 14 bits kept: promoted every 128 products the error stays small; never promoted (one scale
  // for all of K, per-tensor) it grows with K, several times larger at K = 4096
  Quantized qa1 = quantize(cpu, Device::cpu, xa, M, K, M, K);
  const Quantized qb1 = quantize(cpu, Device::cpu, xb, K, N, K, N);
  const std::vector<float> a1 = dequantized(cpu, Device::cpu, qa1, M, K, M, K),
                           b1 = dequantized(cpu, Device::cpu, qb1, K, N, K, N);
  qa1.s = Tensor::full({M, 1}, qa1.s.item());  // the GEMM reads a scale per row of a: the one
  const double promoted = worst_relative(gemm(cpu, Device::cpu, qa, qb, 128, 14, tk), a, b, M, N, K);
  const double never = worst_relative(gemm(cpu, Device::cpu, qa1, qb1, K, 14, K), a1, b1, M, N, K);
  CAPTURE(promoted);
  CAPTURE(never);
  CHECK(promoted < 1e-3);
  CHECK(never > 4 * promoted);
}

}  // TEST_SUITE("kernels")
