// Kernel tests: every numbered version of kernels/cuda/matmul.cu (v1 naive, v2 shared-memory
// tiles, v3 register-blocked tiles) and the table entry, on the device under test (sim, or
// cuda on a GPU), and the cpu device's version 2 (blocked, vectorised, OpenMP threads: the cpu
// table's matmul), against the definition: the cpu matmul's version 1 (kernels/cpu/matmul.cpp,
// a triple loop that sums in double and rounds once).
//
// Shapes: M, Nc, K drawn from {1, 7, 33, 64, 65, 100}: 1x1x1, sizes that are not multiples
// of any tile (v1 blocks 32x8, v2 tiles 32x32, v3 tiles 64x64 with K-steps of 8), K below
// and above the K-step, several tiles in every direction; all four transpose combinations;
// batches of 3 with a batch stride of 0 for a and/or b; accumulate and assign.
#include <cfloat>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/launchers.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

using MatmulFn = void (*)(float* c, const float* a, const float* b, int64_t B, int64_t M,
                          int64_t Nc, int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a,
                          bool trans_b, bool accumulate);

struct MatmulVersion {
  std::string name;
  MatmulFn fn;
  Device device;  // where its pointers live
};

// The definition every version is compared with.
const MatmulFn kDefinition = cpu::matmul_v1;

// The versions built for the device under test: ff::sim::matmul_vN under the emulator,
// ff::cuda::matmul_vN on a GPU; then the table entry (which dispatches to the best one); then
// the cpu device's table entry, version 2 of kernels/cpu/matmul.cpp, whatever the device.
std::vector<MatmulVersion> versions_under_test() {
  Device d = kt::device_under_test();
  MatmulVersion table = {"matmul (table)", kt::dut_kernels().matmul, d};
  MatmulVersion cpu_v2 = {"cpu matmul v2 (cpu table)", kt::cpu_kernels().matmul, Device::cpu};
  if (d == Device::sim)
    return {{"matmul_v1", sim::matmul_v1, d}, {"matmul_v2", sim::matmul_v2, d},
            {"matmul_v3", sim::matmul_v3, d}, table, cpu_v2};
#if FF_HAVE_CUDA
  if (d == Device::cuda)
    return {{"matmul_v1", cuda::matmul_v1, d}, {"matmul_v2", cuda::matmul_v2, d},
            {"matmul_v3", cuda::matmul_v3, d}, table, cpu_v2};
#endif
  return {cpu_v2};  // FF_TEST_DEVICE=cpu: the cpu table's entry
}

// Tolerance. Each element of c is a dot product of K terms. The device sums them in float:
// by the standard bound (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1)
// its error is at most K * u * sum_p |a_ip| |b_pj|, u = 2^-24 the unit roundoff of float
// (each of the K additions rounds once, relative to a partial sum bounded by that sum;
// an FMA only rounds less; the cpu's version 2 sums in float too, starting from c when it
// accumulates, so the same bound with |c| among the terms). The definition (cpu version 1)
// sums in double and rounds once to float: at most u * the same sum; accumulate adds one more
// float rounding, at most u * (|c| + the sum). So
//   |device - cpu| <= (K + 2) * u * (sum_p |a_ip| |b_pj| + |c_before|)
// for every element, whatever the summation order: a rigorous bound, per element, rather
// than one scale for the whole matrix (the x100 outliers would make that one very loose).
// Leaving out one term, or reading a wrong index, changes an element by about |a_ip b_pj|,
// far more than K * 6e-8 times the sum of |a||b| over the row-column pair.
constexpr double kUnitRoundoff = FLT_EPSILON / 2;

// The guard after c: more than a v3 tile row (64) of values.
constexpr int64_t kGuard = 67;
constexpr float kGuardValue = -12345.f;

struct MatmulCase {
  int64_t B, M, Nc, K;
  bool trans_a, trans_b;
  bool shared_a, shared_b;  // batch stride 0: one matrix for every batch entry
  bool accumulate;
  float scale = 1.f;        // of the inputs (plus their x100 outliers)
};

std::string describe(const std::string& name, const MatmulCase& t) {
  return name + " B=" + std::to_string(t.B) + " M=" + std::to_string(t.M) +
         " Nc=" + std::to_string(t.Nc) + " K=" + std::to_string(t.K) +
         (t.trans_a ? " trans_a" : "") + (t.trans_b ? " trans_b" : "") +
         (t.shared_a ? " stride_a=0" : "") + (t.shared_b ? " stride_b=0" : "") +
         (t.accumulate ? " accumulate" : " assign");
}

// Runs one version and the definition on the same inputs and compares them.
void check_matmul(const MatmulVersion& v, const MatmulCase& t, uint64_t seed) {
  Device d = v.device;
  // Batch strides with a gap after each matrix, so a kernel that assumes stride M*K fails.
  const int64_t stride_a = t.shared_a ? 0 : t.M * t.K + 3;
  const int64_t stride_b = t.shared_b ? 0 : t.K * t.Nc + 5;
  const int64_t na = (t.shared_a ? 0 : (t.B - 1) * stride_a) + t.M * t.K;
  const int64_t nb = (t.shared_b ? 0 : (t.B - 1) * stride_b) + t.K * t.Nc;
  const int64_t nc = t.B * t.M * t.Nc;
  std::vector<float> a = kt::inputs(na, seed, t.scale), b = kt::inputs(nb, seed + 1, t.scale);

  // c before: values to add to, or a NaN pattern that an assigning kernel must overwrite.
  std::vector<float> c_before =
      t.accumulate ? kt::inputs(nc, seed + 2, t.scale) : std::vector<float>(nc, std::nanf(""));
  std::vector<float> want = c_before;
  kDefinition(want.data(), a.data(), b.data(), t.B, t.M, t.Nc, t.K, stride_a, stride_b,
              t.trans_a, t.trans_b, t.accumulate);

  // The per-element bound: sum_p |a_ip| |b_pj| is the matmul of |a| and |b|.
  std::vector<float> abs_a(a), abs_b(b), abs_sum(nc);
  for (float& x : abs_a) x = std::fabs(x);
  for (float& x : abs_b) x = std::fabs(x);
  kDefinition(abs_sum.data(), abs_a.data(), abs_b.data(), t.B, t.M, t.Nc, t.K, stride_a,
              stride_b, t.trans_a, t.trans_b, false);
  std::vector<double> tol(nc);
  for (int64_t i = 0; i < nc; i++)
    tol[i] = (t.K + 2) * kUnitRoundoff *
             ((double)abs_sum[i] + (t.accumulate ? std::fabs((double)c_before[i]) : 0.0));

  // c is followed by a guard of kGuard values that must stay as they are: a store past the
  // last row (a ragged edge handled wrong) lands there.
  std::vector<float> c_and_guard = c_before;
  c_and_guard.insert(c_and_guard.end(), kGuard, kGuardValue);
  Tensor ad = kt::upload(a, d), bd = kt::upload(b, d), cd = kt::upload(c_and_guard, d);
  v.fn(cd.data(), ad.data(), bd.data(), t.B, t.M, t.Nc, t.K, stride_a, stride_b, t.trans_a,
       t.trans_b, t.accumulate);
  device_synchronize(d);
  std::vector<float> got = cd.to_vector();
  const std::string what = describe(v.name, t);
  kt::require_close(std::vector<float>(got.begin() + nc, got.end()),
                    std::vector<float>(kGuard, kGuardValue), 0, 0, what + ": guard after c");
  got.resize(nc);
  kt::require_within(got, want, tol, 0, what);
}

// (M, Nc, K): 1x1x1; K = 1 and 7 below the K-step of v3 (8), 33 .. 100 above it and above
// v2's 32; 64 exactly one v3 tile; 65 and 100 two v3 tiles with a ragged second one; 1, 7
// and 33 thinner than a tile.
struct Mnk {
  int64_t M, Nc, K;
};
const Mnk kShapes[] = {{1, 1, 1},    {1, 100, 7},   {100, 1, 65},   {7, 33, 1},
                       {33, 7, 100}, {64, 64, 64},  {65, 100, 33},  {100, 65, 7}};

const bool kTransposes[4][2] = {{false, false}, {true, false}, {false, true}, {true, true}};

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: matmul versions, shapes x transposes, device vs cpu") {
  for (const MatmulVersion& v : versions_under_test())
    for (const Mnk& s : kShapes)
      for (const auto& tr : kTransposes)
        for (bool accumulate : {false, true})
          check_matmul(v, {1, s.M, s.Nc, s.K, tr[0], tr[1], false, false, accumulate}, 100);
}

TEST_CASE("kernels: matmul versions, batched with shared a and/or b, device vs cpu") {
  // shared: bit 0 gives a batch stride 0 for a, bit 1 for b
  const Mnk shapes[] = {{7, 33, 65}, {65, 100, 33}};
  for (const MatmulVersion& v : versions_under_test())
    for (const Mnk& s : shapes)
      for (const auto& tr : kTransposes)
        for (int shared = 0; shared < 4; shared++)
          for (bool accumulate : {false, true})
            check_matmul(v, {3, s.M, s.Nc, s.K, tr[0], tr[1], (shared & 1) != 0,
                             (shared & 2) != 0, accumulate},
                         300 + shared);
}

TEST_CASE("kernels: matmul versions, edge cases, device vs cpu") {
  for (const MatmulVersion& v : versions_under_test()) {
    const Device d = v.device;
    // K = 0: an empty sum. Assign writes zeros, accumulate leaves c as it was.
    check_matmul(v, {2, 7, 5, 0, false, false, false, false, false}, 400);
    check_matmul(v, {2, 7, 5, 0, true, true, false, true, true}, 400);
    // Large magnitudes: inputs ~1e3 with outliers ~1e5, products up to ~1e10.
    check_matmul(v, {2, 33, 65, 100, false, true, false, false, true, 1e3f}, 500);
    // Nothing to compute (B, M or Nc is 0): c is not touched.
    const int64_t empty[3][4] = {{0, 4, 4, 4}, {2, 0, 4, 4}, {2, 4, 0, 4}};  // B, M, Nc, K
    for (const auto& e : empty) {
      Tensor a = kt::upload(kt::inputs(64, 1), d), b = kt::upload(kt::inputs(64, 2), d);
      Tensor c = kt::upload(std::vector<float>(8, 7.f), d);
      v.fn(c.data(), a.data(), b.data(), e[0], e[1], e[2], e[3], 16, 16, false, false, false);
      kt::require_close(c.to_vector(), std::vector<float>(8, 7.f), 0, 0,
                        v.name + " with an empty output leaves c alone");
    }
  }
}

TEST_CASE("kernels: cpu matmul v2 on shapes past its blocks, 1 and 2 threads, vs v1") {
  // Version 2 cuts the sum over p into slices of 256 and c into blocks of 48 rows of 6 x 32
  // tiles, and goes parallel from 64^3 multiply-adds: K = 600 is three slices (the last one
  // ragged), M = 130 three row blocks (the last ragged), Nc = 97 four panels (the last 1
  // wide). On one thread and on two (the blocks split between them), batched with a shared b.
  const MatmulVersion v2 = {"cpu matmul v2", cpu::matmul, Device::cpu};
  const int threads = cpu::matmul_threads();
  for (int n : {1, 2}) {
    cpu::set_matmul_threads(n);
    for (const auto& tr : kTransposes)
      for (bool accumulate : {false, true}) {
        check_matmul(v2, {1, 130, 97, 600, tr[0], tr[1], false, false, accumulate}, 700);
        check_matmul(v2, {2, 50, 33, 300, tr[0], tr[1], false, true, accumulate}, 701);
      }
  }
  cpu::set_matmul_threads(threads);
}

TEST_CASE("kernels: cpu matmul v2's few-rows path gives the tiles' bits, row by row") {
  // Up to 4 rows against an untransposed b stream b instead of packing it (a decode step's
  // shape); the sum of each element runs in the same order either way, so every row of a
  // 13-row product (tiles) equals the same row computed alone and in pairs (the few-rows
  // path), bit for bit: K past one 256-slice, ragged column blocks, a^T, accumulate, batched
  // with a shared b, 1 and 2 threads.
  const int threads = cpu::matmul_threads();
  const int64_t M = 13, Nc = 300, K = 513, Bz = 2;
  const std::vector<float> a = kt::inputs(Bz * M * K, 801), b = kt::inputs(K * Nc, 802), c0 = kt::inputs(Bz * M * Nc, 803);
  for (int n : {1, 2}) {
    cpu::set_matmul_threads(n);
    for (bool trans_a : {false, true})
      for (bool accumulate : {false, true}) {
        CAPTURE(n);
        CAPTURE(trans_a);
        CAPTURE(accumulate);
        std::vector<float> whole = c0;
        cpu::matmul(whole.data(), a.data(), b.data(), Bz, M, Nc, K, M * K, 0, trans_a, false, accumulate);
        for (int64_t rows : {1, 2}) {
          std::vector<float> parts = c0;
          for (int64_t z = 0; z < Bz; z++)
            for (int64_t i0 = 0; i0 < M; i0 += rows) {
              const int64_t m = std::min(rows, M - i0);
              // rows [i0, i0 + m) of batch z: op(a) rows are a's rows, or a^T's (columns of the stored (K, M) a)
              std::vector<float> ai((size_t)(m * K));
              for (int64_t i = 0; i < m; i++)
                for (int64_t p = 0; p < K; p++)
                  ai[(size_t)(trans_a ? p * m + i : i * K + p)] =
                      trans_a ? a[(size_t)(z * M * K + p * M + i0 + i)] : a[(size_t)(z * M * K + (i0 + i) * K + p)];
              cpu::matmul(parts.data() + z * M * Nc + i0 * Nc, ai.data(), b.data(), 1, m, Nc, K, 0, 0, trans_a, false,
                          accumulate);
            }
          CHECK(parts == whole);
        }
      }
  }
  cpu::set_matmul_threads(threads);
}

}  // TEST_SUITE
