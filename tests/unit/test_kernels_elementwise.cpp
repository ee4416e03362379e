// Kernel tests: the elementwise and layout kernels of kernels/cuda/elementwise.cu and
// layout.cu on the device under test (sim, or cuda on a GPU) against their cpu twins.
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// + - * and /: one correctly rounded float32 operation on both devices: bit-identical.
constexpr double kExact = 0.0;
// alpha * x + beta: nvcc (and the sim build, where the CPU has FMA) fuses it into one rounding,
// the cpu twin rounds the product and the sum. The two differ by at most one rounding of the
// product and one of the result: |d| <= eps/2 |alpha x| + eps |result| (eps = FLT_EPSILON).
constexpr double kFmaRtol = FLT_EPSILON;
// exp, log, sqrt, sigmoid and silu: the CUDA libm (expf, logf) is within 1-2 ulps of the
// correctly rounded result, as is glibc's; sigmoid and silu chain 2-3 such operations. 8 ulps
// relative (~5e-7) covers that; a wrong formula is off by far more. The absolute floor
// covers results that underflow towards 0 (exp of -100).
constexpr double kLibmRtol = 8 * FLT_EPSILON;
constexpr double kLibmAtol = 1e-37;

// Sizes around the block (256 threads) and the grid-stride wrap (1024 blocks x 256).
const std::vector<int64_t> kSizes = {1, 31, 255, 256, 257, 1000, 262144 + 3};

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: fill and affine, device vs cpu") {
  Device d = kt::device_under_test();
  for (int64_t n : kSizes) {
    Tensor out = kt::scratch(n, d);
    kt::dut_kernels().fill(out.data(), n, -2.5f);
    kt::require_close(out.to_vector(), std::vector<float>(n, -2.5f), kExact, kExact, "fill");
    std::vector<float> x = kt::inputs(n, 11);
    Tensor xd = kt::upload(x, d);
    std::vector<float> want(n);
    kt::cpu_kernels().affine(want.data(), x.data(), n, 1.5f, -0.25f);
    kt::dut_kernels().affine(out.data(), xd.data(), n, 1.5f, -0.25f);
    std::vector<double> tol(n);
    for (int64_t i = 0; i < n; i++)
      tol[i] = kFmaRtol * (0.5 * std::fabs(1.5 * x[i]) + std::fabs(want[i]));
    kt::require_within(out.to_vector(), want, tol, 0, "affine n=" + std::to_string(n));
  }
}

TEST_CASE("kernels: binary ops with every broadcast, device vs cpu") {
  Device d = kt::device_under_test();
  const struct { int64_t rows, C; } shapes[] = {{1, 1}, {3, 31}, {7, 33}, {65, 257}};
  for (auto s : shapes)
    for (BinaryOp op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div})
      for (Broadcast bc : {Broadcast::same, Broadcast::row, Broadcast::col, Broadcast::scalar}) {
        int64_t n = s.rows * s.C;
        int64_t bn = bc == Broadcast::same ? n : bc == Broadcast::row ? s.C
                   : bc == Broadcast::col  ? s.rows : 1;
        std::vector<float> a = kt::inputs(n, 1), b = kt::inputs(bn, 2), want(n);
        Tensor ad = kt::upload(a, d), bd = kt::upload(b, d), out = kt::scratch(n, d);
        kt::cpu_kernels().binary(op, want.data(), a.data(), b.data(), n, s.C, bc);
        kt::dut_kernels().binary(op, out.data(), ad.data(), bd.data(), n, s.C, bc);
        kt::require_close(out.to_vector(), want, kExact, kExact,
                          "binary op " + std::to_string((int)op) + " broadcast " +
                              std::to_string((int)bc) + " shape " + std::to_string(s.rows) + "x" +
                              std::to_string(s.C));
      }
}

TEST_CASE("kernels: unary ops and their backward, device vs cpu") {
  Device d = kt::device_under_test();
  for (int64_t n : {(int64_t)1, (int64_t)257, (int64_t)5000})
    for (UnaryOp op : {UnaryOp::exp, UnaryOp::log, UnaryOp::sqrt, UnaryOp::sigmoid, UnaryOp::silu,
                       UnaryOp::relu, UnaryOp::neg}) {
      std::vector<float> x = kt::inputs(n, 3), dy = kt::inputs(n, 4);
      // exp of the x100 outliers overflows to inf on both devices: keep it to |x| < 80 so the
      // comparison tests values, and log/sqrt get positive inputs.
      for (float& v : x) {
        if (op == UnaryOp::exp) v = std::fmax(-80.f, std::fmin(80.f, v));
        if (op == UnaryOp::log || op == UnaryOp::sqrt) v = std::fabs(v) + 1e-3f;
      }
      std::vector<float> y(n), dx(n);
      kt::cpu_kernels().unary(op, y.data(), x.data(), n);
      kt::cpu_kernels().unary_backward(op, dx.data(), x.data(), y.data(), dy.data(), n);
      Tensor xd = kt::upload(x, d), yd = kt::upload(y, d), dyd = kt::upload(dy, d);
      Tensor out = kt::scratch(n, d), dxd = kt::scratch(n, d);
      kt::dut_kernels().unary(op, out.data(), xd.data(), n);
      kt::dut_kernels().unary_backward(op, dxd.data(), xd.data(), yd.data(), dyd.data(), n);
      std::string what = "unary op " + std::to_string((int)op) + " n=" + std::to_string(n);
      kt::require_close(out.to_vector(), y, kLibmAtol, kLibmRtol, what);
      std::vector<double> tol(n);
      for (int64_t i = 0; i < n; i++) {
        tol[i] = kLibmAtol + kLibmRtol * std::fabs(dx[i]);
        if (op == UnaryOp::silu) {
          // s (1 + x (1 - s)) passes through 0 near x = -1.28: there the fused x (1 - s) + 1
          // and a libm sigmoid a few ulps off move the result by a few ulps of its terms,
          // s and |x| s (1 - s), not of the (tiny) result.
          const double s = 1.0 / (1.0 + std::exp(-(double)x[i]));
          tol[i] += kLibmRtol * std::fabs(dy[i]) * (s + std::fabs(x[i]) * s * (1.0 - s));
        }
      }
      kt::require_within(dxd.to_vector(), dx, tol, 0, what + " backward");
    }
}

TEST_CASE("kernels: masked_fill with a broadcast mask, device vs cpu") {
  Device d = kt::device_under_test();
  for (auto [n, mask_n] : {std::pair<int64_t, int64_t>{1, 1}, {64, 8}, {999, 333}, {1000, 1000}}) {
    std::vector<float> x = kt::inputs(n, 5), mask(mask_n), want(n);
    for (int64_t i = 0; i < mask_n; i++) mask[i] = (i * 7) % 3 == 0 ? 1.f : 0.f;
    Tensor xd = kt::upload(x, d), md = kt::upload(mask, d), out = kt::scratch(n, d);
    kt::cpu_kernels().masked_fill(want.data(), x.data(), mask.data(), n, mask_n, -INFINITY);
    kt::dut_kernels().masked_fill(out.data(), xd.data(), md.data(), n, mask_n, -INFINITY);
    kt::require_close(out.to_vector(), want, kExact, kExact, "masked_fill n=" + std::to_string(n));
  }
}

TEST_CASE("kernels: transpose of two dims (tiled and general), device vs cpu, bit-exact") {
  Device d = kt::device_under_test();
  // (A, D0, Bm, D1, Cn): Cn == 1 takes the tiled kernel (ragged tiles: 33, 70, 1); Cn > 1 the
  // general one.
  const int64_t shapes[][5] = {{1, 1, 1, 1, 1},  {1, 33, 1, 70, 1}, {3, 32, 1, 32, 1},
                               {2, 5, 3, 40, 1}, {1, 64, 1, 1, 1},  {2, 3, 4, 5, 6},
                               {1, 7, 1, 9, 16}};
  for (auto& s : shapes) {
    int64_t n = s[0] * s[1] * s[2] * s[3] * s[4];
    std::vector<float> x = kt::inputs(n, 6), want(n);
    Tensor xd = kt::upload(x, d), out = kt::scratch(n, d);
    kt::cpu_kernels().transpose(want.data(), x.data(), s[0], s[1], s[2], s[3], s[4]);
    kt::dut_kernels().transpose(out.data(), xd.data(), s[0], s[1], s[2], s[3], s[4]);
    kt::require_close(out.to_vector(), want, kExact, kExact,
                      "transpose " + std::to_string(s[0]) + "x" + std::to_string(s[1]) + "x" +
                          std::to_string(s[2]) + "x" + std::to_string(s[3]) + "x" +
                          std::to_string(s[4]));
  }
}

TEST_CASE("kernels: copy_block (slice, concat, accumulate), device vs cpu") {
  Device d = kt::device_under_test();
  // outer, dst_n, dst_off, src_n, src_off, len, inner
  const int64_t cases[][7] = {{1, 1, 0, 1, 0, 1, 1}, {3, 10, 2, 7, 1, 5, 33}, {4, 9, 0, 9, 0, 9, 1},
                              {2, 100, 60, 50, 10, 40, 3}};
  for (auto& c : cases)
    for (bool acc : {false, true}) {
      std::vector<float> dst = kt::inputs(c[0] * c[1] * c[6], 7), src = kt::inputs(c[0] * c[3] * c[6], 8);
      std::vector<float> want = dst;
      Tensor dd = kt::upload(dst, d), sd = kt::upload(src, d);
      kt::cpu_kernels().copy_block(want.data(), c[1], c[2], src.data(), c[3], c[4], c[0], c[5], c[6], acc);
      kt::dut_kernels().copy_block(dd.data(), c[1], c[2], sd.data(), c[3], c[4], c[0], c[5], c[6], acc);
      kt::require_close(dd.to_vector(), want, kExact, kExact,
                        std::string("copy_block") + (acc ? " accumulate" : ""));
    }
}

}  // TEST_SUITE
