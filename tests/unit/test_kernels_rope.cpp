// Kernel tests: rotary position embedding, kernels/cuda/rope.cu on the device under test (sim,
// or cuda on a GPU) against its cpu twin kernels/cpu/rope.cpp, forward (sign +1) and backward
// (sign -1); then, through the op (rope in common/core/ops.h) on cpu and on the device, the
// properties of a rotation: the backward rotation gives x back and every pair keeps its norm
// (both shown to fail under a bug planted in the backward); position 0 is the identity.
//
// Shapes (T, M, D): T = 1 and odd T (3, 7, 33); D = 2 (one pair), 6 (an odd number of pairs),
// 64 (DeepSeek-V3's rope head dim) and 128; M = 1 (a (T, D) tensor: MLA's k_pe) and several
// heads (q_pe, (T, H, D)); one size past the grid-stride wrap (1024 blocks x 256 threads).
// Positions are unsorted and repeat, and include 0 and the long-context ones, 100000 and
// 2^20 - 1, where an angle formed in float is visibly wrong (the last test shows the tolerance
// rejects it). Inputs have x100 outliers (kt::inputs).
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// ---- tolerances
//
// Errors are bounded per component of a pair, relative to rho = |x[2i]| + |x[2i+1]| (a
// rotated component is x[2i] cos a -+ x[2i+1] sin a, whose terms are at most rho in size, and
// it can cancel to 0, so a bound relative to the result itself would mean nothing).
// u = 2^-24, float's unit roundoff.
constexpr double kU = FLT_EPSILON / 2;
// The device vs the exact rotation of its float inputs by the exact angle: the angle reduced to
// [-pi, pi] in double and rounded to float is off by <= pi u; sincosf is within 2 ulps (CUDA's
// bound; glibc's, which sim uses, is 1), <= 2u since |sin|, |cos| <= 1; so cos a and sin a are
// each off by <= (2 + pi) u, times |x[2i]| or |x[2i+1]|: (2 + pi) u rho. The two products and
// the difference (fused into one FMA or not) round at most three times, each by u of a term
// <= rho: 3 u rho.
constexpr double kDeviceErr = (2 + M_PI) + 3;
// The cpu kernel computes in double and rounds once: half an ulp of the result, <= u rho.
constexpr double kCpuErr = 1;
// The angles themselves, in double on both devices, are within 14 2^-53 |angle| of exact
// (kernels/cpu/rope.cpp: pow and the product, 12; the device's reduction modulo 2 pi, 2 more):
// the rotated pair moves by that many radians times its norm. 1e-10 of rho at position 1e5.
constexpr double kAngleErr = 14 * DBL_EPSILON / 2;
// A factor 2 to spare on the float part. A wrong frequency, a swapped pair or a wrong sign
// is off by O(rho); an angle formed in float at position 1e5 by ~0.004 rho: both far above
// 2 (kDeviceErr + kCpuErr) u rho ~ 1.1e-6 rho.
constexpr double kSpare = 2;

double inv_freq(int64_t i, int64_t D, float theta) {
  return std::pow((double)theta, -2.0 * (double)i / (double)D);
}

// The device-vs-cpu tolerance of every element of x (T, M, D).
std::vector<double> device_tolerance(const std::vector<float>& x, const std::vector<int64_t>& pos,
                                     int64_t T, int64_t M, int64_t D, float theta) {
  std::vector<double> tol(x.size());
  for (int64_t t = 0; t < T; t++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t i = 0; i < D / 2; i++) {
        size_t k = (size_t)((t * M + m) * D + 2 * i);
        double rho = std::fabs((double)x[k]) + std::fabs((double)x[k + 1]);
        double angle = (double)pos[(size_t)t] * inv_freq(i, D, theta);
        tol[k] = tol[k + 1] =
            (kSpare * (kDeviceErr + kCpuErr) * kU + 2 * kAngleErr * angle) * rho;
      }
  return tol;
}

// T positions: unsorted, repeated, 0 and large ones first, then uniform in [0, 200000).
std::vector<int64_t> test_positions(int64_t T, uint64_t seed) {
  const std::vector<int64_t> first = {100000, 0, (1 << 20) - 1, 1, 4096, 100000, 65535, 3};
  std::vector<int64_t> random = ff::randint({T}, seed, 200000).to_index_vector();
  std::vector<int64_t> pos((size_t)T);
  for (int64_t t = 0; t < T; t++)
    pos[(size_t)t] = t < (int64_t)first.size() ? first[(size_t)t] : random[(size_t)t];
  return pos;
}

std::string shape_name(int64_t T, int64_t M, int64_t D, int sign) {
  return std::string(sign > 0 ? "rope" : "rope backward") + " (T, M, D) = (" + std::to_string(T) +
         ", " + std::to_string(M) + ", " + std::to_string(D) + ")";
}

struct RopeShape {
  int64_t T, M, D;
};
const RopeShape kShapes[] = {
    {1, 1, 2}, {1, 1, 64}, {3, 1, 2}, {7, 1, 6}, {7, 4, 64}, {33, 16, 64}, {8, 3, 128},
    // past the grid-stride wrap: 2 * 2049 * 64 = 262272 pairs > 1024 blocks x 256 threads
    {2, 2049, 128},
};

void check_rope_vs_cpu(const RopeShape& s, float theta, int sign, uint64_t seed) {
  Device d = kt::device_under_test();
  const int64_t n = s.T * s.M * s.D;
  std::vector<float> x = kt::inputs(n, seed);
  std::vector<int64_t> pos = test_positions(s.T, seed + 1);
  std::vector<float> want((size_t)n);
  kt::cpu_kernels().rope(want.data(), x.data(), pos.data(), s.T, s.M, s.D, theta, sign);
  Tensor xd = kt::upload(x, d), pd = kt::upload_indices(pos, d), y = kt::scratch(n, d);
  kt::dut_kernels().rope(y.data(), xd.data(), pd.index_data(), s.T, s.M, s.D, theta, sign);
  std::vector<double> tol = device_tolerance(x, pos, s.T, s.M, s.D, theta);
  kt::require_within(y.to_vector(), want, tol, s.D, shape_name(s.T, s.M, s.D, sign));
  // in place (y = x): each thread reads its pair before it writes it
  kt::dut_kernels().rope(xd.data(), xd.data(), pd.index_data(), s.T, s.M, s.D, theta, sign);
  CHECK_MESSAGE(bitwise_equal(xd, y), shape_name(s.T, s.M, s.D, sign) << " in place differs");
}

// ---- the properties of a rotation, through the op (forward and its hand-written backward).
// Each returns the number of elements (or pairs) outside its bound, so a test can also show
// that a planted bug makes it fail.

// The forward's error vector e1 = y - R x has |e1|_2 <= sqrt2 kDeviceErr u rho per pair
// (kDeviceErr covers the device, and the cpu's single rounding with room).
// Round trip: dx = R^T (R x + e1) + e2 = x + R^T e1 + e2, |R^T e1|_2 = |e1|_2, and e2, the
// backward's own error, is <= kDeviceErr u rho_y with rho_y <= sqrt2 |y|_2 <= sqrt2 rho
// (sign -1 runs the same code with sin negated, exactly). The angle is computed the same way
// both times, so its error cancels: per component |dx - x| <= 2 sqrt2 kDeviceErr u rho.
int64_t round_trip_violations(const std::vector<float>& x, const std::vector<float>& dx) {
  int64_t bad = 0;
  for (size_t k = 0; k + 1 < x.size(); k += 2) {
    double rho = std::fabs((double)x[k]) + std::fabs((double)x[k + 1]);
    double tol = kSpare * 2 * M_SQRT2 * kDeviceErr * kU * rho;
    for (size_t j : {k, k + 1}) bad += std::fabs((double)dx[j] - x[j]) > tol;
  }
  return bad;
}

// Pair norms: | |R x + e|_2 - |x|_2 | <= |e|_2 <= sqrt2 kDeviceErr u rho (rho of the input),
// whatever the angle (the norms themselves computed in double).
int64_t norm_violations(const std::vector<float>& in, const std::vector<float>& out) {
  int64_t bad = 0;
  for (size_t k = 0; k + 1 < in.size(); k += 2) {
    double rho = std::fabs((double)in[k]) + std::fabs((double)in[k + 1]);
    double n_in = std::hypot((double)in[k], (double)in[k + 1]);
    double n_out = std::hypot((double)out[k], (double)out[k + 1]);
    bad += std::fabs(n_out - n_in) > kSpare * M_SQRT2 * kDeviceErr * kU * rho;
  }
  return bad;
}

struct RoundTrip {
  std::vector<float> x, y, dx;
};

// y = rope(x, pos), then backward with the upstream gradient y: dx = R(-a) R(a) x.
RoundTrip rotate_and_back(Device d, const Shape& shape, const std::vector<int64_t>& pos,
                          uint64_t seed) {
  std::vector<float> xv = kt::inputs(shape_numel(shape), seed);
  Tensor x = Tensor::from_vector(xv, shape).to(d);
  x.requires_grad_();
  Tensor p = Tensor::from_indices(pos, {(int64_t)pos.size()}).to(d);
  Tensor y = rope(x, p);
  REQUIRE(y.device() == d);
  REQUIRE(y.shape() == shape);
  y.backward(y.detach());
  REQUIRE(x.grad().defined());
  CHECK_FALSE(p.grad().defined());  // positions get no gradient
  return {xv, y.to_vector(), x.grad().to_vector()};
}

// What a kernel that forms the angle in float would compute: the float inverse frequency,
// the float product, float sincosf, float arithmetic.
std::vector<float> rope_float_angle(const std::vector<float>& x, const std::vector<int64_t>& pos,
                                    int64_t T, int64_t M, int64_t D, float theta) {
  std::vector<float> y(x.size());
  for (int64_t t = 0; t < T; t++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t i = 0; i < D / 2; i++) {
        float a = (float)pos[(size_t)t] * std::pow(theta, -2.f * (float)i / (float)D);
        float s = std::sin(a), c = std::cos(a);
        size_t k = (size_t)((t * M + m) * D + 2 * i);
        y[k] = x[k] * c - x[k + 1] * s;
        y[k + 1] = x[k] * s + x[k + 1] * c;
      }
  return y;
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: rope forward and backward, device vs cpu (T = 1, odd T, D = 2..128, heads)") {
  uint64_t seed = 100;
  for (const RopeShape& s : kShapes)
    for (int sign : {+1, -1}) {
      check_rope_vs_cpu(s, 10000.f, sign, seed);
      seed += 2;
    }
  // another theta (a larger base, as long-context models use), where i > 0 turns slower
  check_rope_vs_cpu({7, 4, 64}, 500000.f, +1, seed);
}

TEST_CASE("kernels: rope at position 0 is the identity, bit-exact, on cpu and the device") {
  Device d = kt::device_under_test();
  const int64_t T = 5, M = 3, D = 64, n = T * M * D;
  std::vector<float> x = kt::inputs(n, 200);
  std::vector<int64_t> zeros((size_t)T, 0);
  for (int sign : {+1, -1}) {
    std::vector<float> cpu((size_t)n);
    kt::cpu_kernels().rope(cpu.data(), x.data(), zeros.data(), T, M, D, 10000.f, sign);
    CHECK(cpu == x);
    Tensor xd = kt::upload(x, d), pd = kt::upload_indices(zeros, d), y = kt::scratch(n, d);
    kt::dut_kernels().rope(y.data(), xd.data(), pd.index_data(), T, M, D, 10000.f, sign);
    CHECK(y.to_vector() == x);
  }
}

TEST_CASE("kernels: rope op on the device: backward undoes forward, pair norms kept") {
  const std::vector<int64_t> pos = {100000, 0, 7, (1 << 20) - 1, 3, 4096, 100000};
  for (Device d : {Device::cpu, kt::device_under_test()}) {
    CAPTURE(std::string(device_name(d)));
    for (const Shape& shape : {Shape{7, 64}, Shape{7, 4, 64}, Shape{7, 2, 3, 6}}) {
      CAPTURE(shape_str(shape));
      RoundTrip r = rotate_and_back(d, shape, pos, 300);
      CHECK(round_trip_violations(r.x, r.dx) == 0);
      CHECK(norm_violations(r.x, r.y) == 0);   // forward
      CHECK(norm_violations(r.y, r.dx) == 0);  // backward
      CHECK(r.y != r.x);                       // and it did rotate
    }
  }
}

TEST_CASE("kernels: rope op on the device: a bug planted in the backward fails the properties") {
  const std::vector<int64_t> pos = {100000, 0, 7, 3};
  for (Device d : {Device::cpu, kt::device_under_test()}) {
    CAPTURE(std::string(device_name(d)));
    {
      testing::PlantedBug bug("rope", testing::Bug::flip_sign);  // dx = -x: round trip fails
      RoundTrip r = rotate_and_back(d, {4, 2, 8}, pos, 310);
      CHECK(round_trip_violations(r.x, r.dx) > 0);
    }
    {
      testing::PlantedBug bug("rope", testing::Bug::scale_by_1_01);  // backward norms off 1%
      RoundTrip r = rotate_and_back(d, {4, 2, 8}, pos, 311);
      CHECK(norm_violations(r.y, r.dx) > 0);
      CHECK(round_trip_violations(r.x, r.dx) > 0);
    }
  }
}

TEST_CASE("kernels: rope op refuses positions on another device than x") {
  Device d = kt::device_under_test();
  Tensor x = randn({3, 4}, 500);
  Tensor pos = Tensor::from_indices({0, 1, 2}, {3}).to(d);
  CHECK_THROWS_WITH_AS(rope(x, pos), doctest::Contains("rope: tensors on different devices"),
                       Error);
  CHECK_THROWS_WITH_AS(rope(x.to(d), pos.to(Device::cpu)), doctest::Contains("different devices"),
                       Error);
}

}  // TEST_SUITE

TEST_CASE("rope kernels: an angle formed in float fails the tolerance at position 1e5") {
  // Why the kernels form the angle in double: the same comparison that the device passes
  // rejects a float angle at long-context positions by orders of magnitude, and accepts it
  // only where the angle is small.
  const int64_t T = 4, M = 2, D = 64, n = T * M * D;
  const float theta = 10000.f;
  std::vector<float> x = kt::inputs(n, 400);
  for (const std::vector<int64_t>& pos :
       {std::vector<int64_t>{100000, 100001, 99999, 65535}, std::vector<int64_t>{0, 1, 2, 3}}) {
    std::vector<float> want((size_t)n);
    kt::cpu_kernels().rope(want.data(), x.data(), pos.data(), T, M, D, theta, +1);
    std::vector<float> got = rope_float_angle(x, pos, T, M, D, theta);
    std::vector<double> tol = device_tolerance(x, pos, T, M, D, theta);
    double worst = 0;
    for (size_t k = 0; k < got.size(); k++)
      worst = std::fmax(worst, std::fabs((double)got[k] - want[k]) / tol[k]);
    CAPTURE(pos[0]);
    CAPTURE(worst);  // error / tolerance at the worst element
    if (pos[0] >= 65535) CHECK(worst > 100);
    else CHECK(worst <= 1);
  }
}
