// Kernel tests: the row reductions of kernels/cuda/reduce.cu (reduce, max_backward) and
// kernels/cuda/softmax.cu (softmax and log_softmax, forward and backward) on the device under
// test (sim, or cuda on a GPU) against their cpu twins in kernels/cpu/reduce.cpp.
//
// Shapes cross both layouts of the kernels: a warp per row (row length <= 1024) and a block
// of 256 threads per row (longer), with lengths 1, 31, 32, 33 around the warp, 1000, 1025 and
// 4097 around the block, and row counts 1, 3, 70 (70 rows: 18 blocks of 4 warps, the last one
// half idle). Inputs have x100 outliers (kt::inputs), and further sets scaled x1000, offset by
// +1000, with masked (-inf) entries and with ties for max.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// ---- tolerances
//
// The cpu kernels sum in double and round once; the CUDA kernels sum in float. A float sum
// whose longest chain of additions is k is within k * eps * sum|terms| of the exact sum
// (Higham's gamma_k = k u / (1 - k u) with u = eps / 2: a factor 2 to spare). The chains:
// a warp per row (C <= 1024) adds ceil(C / 32) <= 32 terms per lane, then 5 butterfly levels
// (37); a block per row (C = 4097, 256 threads) 17 terms per thread + 5 levels + 8 warp slots
// (30). kRowChain covers both; a lost term, a lost warp or a missing barrier is off by a
// whole term, far more than k * eps of the sum.
constexpr double kRowChain = 40;
constexpr double kEps = FLT_EPSILON;
// max and max_backward compare and copy, never round: bit-exact.
constexpr double kExact = 0.0;
// Results that underflow towards 0 (exp of -100 is subnormal): relative error is meaningless
// there, absolute error is below this.
constexpr double kUnderflowAtol = 1e-37;
// softmax y = exp(x - m) / l: l is a float sum of positive terms (chain kRowChain), and each
// link may also carry an exp rescale of <= 2 ulps (the CUDA expf error bound), so <= 3 eps per
// link; then exp, 1 / l and the product of the final write, 4 more.
constexpr double kSoftmaxRtol = (3 * kRowChain + 4) * kEps;

// The bound on a float sum with longest chain `chain` of terms whose magnitudes sum to
// abs_sum, plus half an ulp of the result for the cpu's rounding of its double sum to float.
double sum_tolerance(double chain, double abs_sum, double result) {
  return chain * kEps * abs_sum + 0.5 * kEps * std::fabs(result);
}

std::string shape_str(int64_t N, int64_t C) { return std::to_string(N) + "x" + std::to_string(C); }

// ---- one check per kernel: dut vs cpu on the same inputs x (N, C)

void check_softmax_forward(const std::vector<float>& x, int64_t N, int64_t C,
                           const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want(N * C);
  kt::cpu_kernels().softmax_forward(want.data(), x.data(), N, C);
  Tensor xd = kt::upload(x, d), y = kt::scratch(N * C, d);
  kt::dut_kernels().softmax_forward(y.data(), xd.data(), N, C);
  kt::require_close(y.to_vector(), want, kUnderflowAtol, kSoftmaxRtol,
                    "softmax_forward " + shape_str(N, C) + what);
}

// y = x - lse, lse = m + log l. |lse| <= |m| + log C, and both devices round m + log l at that
// magnitude (eps |lse| apart at most); log l inherits l's relative error (3 eps per link, as
// kSoftmaxRtol) plus logf's ulp; the subtraction rounds at |y|.
void check_log_softmax_forward(const std::vector<float>& x, int64_t N, int64_t C,
                               const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want(N * C);
  kt::cpu_kernels().log_softmax_forward(want.data(), x.data(), N, C);
  std::vector<double> tol(N * C);
  for (int64_t r = 0; r < N; r++) {
    double m = -INFINITY;
    for (int64_t j = 0; j < C; j++) m = std::fmax(m, x[r * C + j]);
    double lse_bound = (std::isinf(m) ? 0 : std::fabs(m)) + std::log((double)C);
    for (int64_t j = 0; j < C; j++)
      tol[r * C + j] = (3 * kRowChain + 2) * kEps + kEps * lse_bound +
                       kEps * std::fabs(want[r * C + j]);
  }
  Tensor xd = kt::upload(x, d), y = kt::scratch(N * C, d);
  kt::dut_kernels().log_softmax_forward(y.data(), xd.data(), N, C);
  kt::require_within(y.to_vector(), want, tol, C, "log_softmax_forward " + shape_str(N, C) + what);
}

// dx = y (dy - dot), dot = sum_j dy_j y_j: the float dot is within (chain + 1) eps sum|dy y|
// (+1 for the rounding of each product), the cpu rounds its double dot to float (eps/2 |dot|),
// and dx_i scales that error by |y_i|; dy - dot and the product round at |dx_i| on each side.
void check_softmax_backward(const std::vector<float>& y, const std::vector<float>& dy, int64_t N,
                            int64_t C, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want(N * C);
  kt::cpu_kernels().softmax_backward(want.data(), y.data(), dy.data(), N, C);
  std::vector<double> tol(N * C);
  for (int64_t r = 0; r < N; r++) {
    double abs_dot = 0, dot = 0;
    for (int64_t j = 0; j < C; j++) {
      abs_dot += std::fabs((double)dy[r * C + j] * y[r * C + j]);
      dot += (double)dy[r * C + j] * y[r * C + j];
    }
    double dot_err = (kRowChain + 1) * kEps * abs_dot + 0.5 * kEps * std::fabs(dot);
    for (int64_t j = 0; j < C; j++)
      tol[r * C + j] = std::fabs(y[r * C + j]) * dot_err + 2 * kEps * std::fabs(want[r * C + j]);
  }
  Tensor yd = kt::upload(y, d), dyd = kt::upload(dy, d), dx = kt::scratch(N * C, d);
  kt::dut_kernels().softmax_backward(dx.data(), yd.data(), dyd.data(), N, C);
  kt::require_within(dx.to_vector(), want, tol, C, "softmax_backward " + shape_str(N, C) + what);
}

// dx = dy - exp(y) s, s = sum_j dy_j: the float s is within chain * eps * sum|dy| (+ eps/2 |s|
// for the cpu's rounding), times e = exp(y); the two exps differ by <= 3 ulps (expf 2, glibc
// 1); the final product and subtraction round at |dy| + e |s| on each side.
void check_log_softmax_backward(const std::vector<float>& y, const std::vector<float>& dy,
                                int64_t N, int64_t C, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want(N * C);
  kt::cpu_kernels().log_softmax_backward(want.data(), y.data(), dy.data(), N, C);
  std::vector<double> tol(N * C);
  for (int64_t r = 0; r < N; r++) {
    double s = 0, abs_s = 0;
    for (int64_t j = 0; j < C; j++) s += dy[r * C + j], abs_s += std::fabs(dy[r * C + j]);
    for (int64_t j = 0; j < C; j++) {
      double e = std::exp((double)y[r * C + j]);
      tol[r * C + j] = e * (sum_tolerance(kRowChain, abs_s, s) + 3 * kEps * std::fabs(s)) +
                       2 * kEps * (std::fabs(dy[r * C + j]) + e * std::fabs(s));
    }
  }
  Tensor yd = kt::upload(y, d), dyd = kt::upload(dy, d), dx = kt::scratch(N * C, d);
  kt::dut_kernels().log_softmax_backward(dx.data(), yd.data(), dyd.data(), N, C);
  kt::require_within(dx.to_vector(), want, tol, C, "log_softmax_backward " + shape_str(N, C) + what);
}

// All four softmax kernels on x; the backward ones get the cpu forward output as y.
void check_softmax_family(const std::vector<float>& x, int64_t N, int64_t C,
                          const std::string& what) {
  check_softmax_forward(x, N, C, what);
  check_log_softmax_forward(x, N, C, what);
  std::vector<float> y(N * C), logy(N * C), dy = kt::inputs(N * C, 77);
  kt::cpu_kernels().softmax_forward(y.data(), x.data(), N, C);
  kt::cpu_kernels().log_softmax_forward(logy.data(), x.data(), N, C);
  check_softmax_backward(y, dy, N, C, what);
  check_log_softmax_backward(logy, dy, N, C, what);
}

// Row lengths around the warp (32) and the version switch (1024 -> a block of 256 per row).
const int64_t kSoftmaxCs[] = {1, 31, 32, 33, 1000, 4097};
const int64_t kSoftmaxNs[] = {1, 3, 70};

// ---- reduce and max_backward: dut vs cpu on in (outer, n, inner)

void check_reduce(ReduceOp op, const std::vector<float>& x, int64_t outer, int64_t n,
                  int64_t inner, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want(outer * inner);
  kt::cpu_kernels().reduce(op, want.data(), x.data(), outer, n, inner);
  Tensor xd = kt::upload(x, d), out = kt::scratch(outer * inner, d);
  kt::dut_kernels().reduce(op, out.data(), xd.data(), outer, n, inner);
  std::string label = std::string(op == ReduceOp::sum ? "reduce sum " : "reduce max ") +
                      std::to_string(outer) + "x" + std::to_string(n) + "x" +
                      std::to_string(inner) + what;
  if (op == ReduceOp::max) {
    kt::require_close(out.to_vector(), want, kExact, kExact, label);
    return;
  }
  // inner == 1: the row layout (chain kRowChain); inner > 1: one thread adds the n terms of
  // its column in sequence (chain n).
  const double chain = inner == 1 ? kRowChain : (double)n;
  std::vector<double> tol(outer * inner);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      double abs_sum = 0;
      for (int64_t j = 0; j < n; j++) abs_sum += std::fabs(x[(o * n + j) * inner + i]);
      tol[o * inner + i] = sum_tolerance(chain, abs_sum, want[o * inner + i]);
    }
  kt::require_within(out.to_vector(), want, tol, inner, label);
}

// dx is routed by comparisons and copies: bit-exact. y is the cpu max, dy random.
void check_max_backward(const std::vector<float>& x, int64_t outer, int64_t n, int64_t inner,
                        const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> y(outer * inner), dy = kt::inputs(outer * inner, 91), want(outer * n * inner);
  kt::cpu_kernels().reduce(ReduceOp::max, y.data(), x.data(), outer, n, inner);
  kt::cpu_kernels().max_backward(want.data(), x.data(), y.data(), dy.data(), outer, n, inner);
  Tensor xd = kt::upload(x, d), yd = kt::upload(y, d), dyd = kt::upload(dy, d);
  Tensor dx = kt::scratch(outer * n * inner, d);
  kt::dut_kernels().max_backward(dx.data(), xd.data(), yd.data(), dyd.data(), outer, n, inner);
  kt::require_close(dx.to_vector(), want, kExact, kExact,
                    "max_backward " + std::to_string(outer) + "x" + std::to_string(n) + "x" +
                        std::to_string(inner) + what);
}

// Small integers 0..4: the max of a row appears many times, in many lanes and warps.
std::vector<float> tied_inputs(int64_t n, uint64_t seed) {
  std::vector<float> v = kt::inputs(n, seed);
  for (float& e : v) e = std::fmin(4.f, std::floor(std::fabs(e) * 2.f));
  return v;
}

// (outer, n, inner) with inner == 1: a warp per row up to n = 1024, a block per row above.
const int64_t kRowShapes[][3] = {{1, 1, 1},  {1, 31, 1},  {3, 32, 1},   {70, 33, 1},
                                 {5, 257, 1}, {2, 1000, 1}, {3, 1025, 1}, {2, 4097, 1}};
// inner > 1: one thread per column; outer, n, inner of 1 and ragged sizes.
const int64_t kColumnShapes[][3] = {{1, 1, 2}, {1, 7, 300}, {2, 31, 33}, {3, 257, 5}, {70, 1, 3}};

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: softmax_forward device vs cpu, C = 1..4097, N = 1, 3, 70") {
  for (int64_t C : kSoftmaxCs)
    for (int64_t N : kSoftmaxNs) check_softmax_forward(kt::inputs(N * C, 21), N, C, "");
}

TEST_CASE("kernels: log_softmax_forward device vs cpu, C = 1..4097, N = 1, 3, 70") {
  for (int64_t C : kSoftmaxCs)
    for (int64_t N : kSoftmaxNs) check_log_softmax_forward(kt::inputs(N * C, 22), N, C, "");
}

TEST_CASE("kernels: softmax_backward device vs cpu, C = 1..4097, N = 1, 3, 70") {
  for (int64_t C : kSoftmaxCs)
    for (int64_t N : kSoftmaxNs) {
      std::vector<float> y(N * C), x = kt::inputs(N * C, 23), dy = kt::inputs(N * C, 24);
      kt::cpu_kernels().softmax_forward(y.data(), x.data(), N, C);
      check_softmax_backward(y, dy, N, C, "");
    }
}

TEST_CASE("kernels: log_softmax_backward device vs cpu, C = 1..4097, N = 1, 3, 70") {
  for (int64_t C : kSoftmaxCs)
    for (int64_t N : kSoftmaxNs) {
      std::vector<float> y(N * C), x = kt::inputs(N * C, 25), dy = kt::inputs(N * C, 26);
      kt::cpu_kernels().log_softmax_forward(y.data(), x.data(), N, C);
      check_log_softmax_backward(y, dy, N, C, "");
    }
}

TEST_CASE("kernels: softmax family on rows x1000 and offset by +1000 (no overflow)") {
  // x1000 (outliers x1e5): exp(x) would overflow at x > 88; only exp(x - m) <= 1 is safe.
  // +1000: the same small differences at a large magnitude, where m + log l rounds coarsely.
  for (int64_t C : {(int64_t)33, (int64_t)1000, (int64_t)4097}) {
    const int64_t N = 3;
    check_softmax_family(kt::inputs(N * C, 31, 1000.f), N, C, " x1000");
    std::vector<float> x = kt::inputs(N * C, 32);
    for (float& v : x) v = 1000.f + v / 100.f;  // spread ~0.01, outliers ~1: a dense softmax
    check_softmax_family(x, N, C, " +1000");
  }
}

TEST_CASE("kernels: softmax family with masked (-inf) entries; an all -inf row gives NaN as cpu") {
  // Row r % 5: 0 only column 0 finite (the first row of a causal mask: every other lane's or
  // thread's stretch is all -inf, the guarded case), 1 the first half finite, 2 every third
  // column masked, 3 only the last column finite, 4 everything -inf (cpu: exp(-inf - -inf) =
  // NaN in every entry; the kernel must give the same).
  for (int64_t C : {(int64_t)33, (int64_t)1000, (int64_t)4097}) {
    const int64_t N = 5;
    std::vector<float> x = kt::inputs(N * C, 41);
    for (int64_t r = 0; r < N; r++)
      for (int64_t j = 0; j < C; j++) {
        bool keep = r == 0 ? j == 0 : r == 1 ? j <= C / 2 : r == 2 ? j % 3 != 0
                  : r == 3 ? j == C - 1 : false;
        if (!keep) x[r * C + j] = -INFINITY;
      }
    check_softmax_family(x, N, C, " masked");
    // What the comparison above relies on: cpu gives NaN for the all -inf row and exactly 1 at
    // the single finite entry of row 0.
    std::vector<float> y(N * C);
    kt::cpu_kernels().softmax_forward(y.data(), x.data(), N, C);
    CHECK(std::isnan(y[4 * C]));
    CHECK(y[0] == 1.f);
  }
}

TEST_CASE("kernels: softmax and reduce rows beyond one grid (grid-stride over rows)") {
  // The launchers cap a grid at 2^18 threads: 1024 blocks for a block per row, 2048 blocks of
  // 4 warps (8192 rows) for a warp per row. More rows wrap around the grid-stride loop: each
  // row must still be done exactly once, and a block's second row reuses its shared-memory
  // slots. (The barrier after the slots are read is NOT caught here: the emulator completes a
  // warp collective only once every runnable thread has run, so all reads of the slots finish
  // before any thread gets past the next row's first shuffle. On a GPU it is a real race.)
  // The costliest test of this file: 2^18 fibers a launch.
  const int64_t N = 1025, C = 1025;
  std::vector<float> x = kt::inputs(N * C, 71), y(N * C), dy = kt::inputs(N * C, 72);
  check_softmax_forward(x, N, C, " beyond one grid");
  kt::cpu_kernels().softmax_forward(y.data(), x.data(), N, C);
  check_softmax_backward(y, dy, N, C, " beyond one grid");
  check_reduce(ReduceOp::sum, x, N, C, 1, " beyond one grid");
  check_max_backward(x, N, C, 1, " beyond one grid");
  check_log_softmax_forward(kt::inputs(8193 * 2, 73), 8193, 2, " beyond one grid");
}

TEST_CASE("kernels: reduce sum and max along the last dim (inner == 1), device vs cpu") {
  for (auto& s : kRowShapes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      int64_t n = s[0] * s[1] * s[2];
      check_reduce(op, kt::inputs(n, 51), s[0], s[1], s[2], "");
      check_reduce(op, kt::inputs(n, 52, 1000.f), s[0], s[1], s[2], " x1000");
    }
}

TEST_CASE("kernels: reduce sum and max along a middle dim (inner > 1), device vs cpu") {
  for (auto& s : kColumnShapes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      int64_t n = s[0] * s[1] * s[2];
      check_reduce(op, kt::inputs(n, 53), s[0], s[1], s[2], "");
      check_reduce(op, kt::inputs(n, 54, 1000.f), s[0], s[1], s[2], " x1000");
    }
}

TEST_CASE("kernels: reduce max skips NaN and handles -inf rows; n == 0 gives 0 and -inf") {
  // std::fmax and fmaxf both ignore a NaN operand (`a > b ? a : b` would not); an all -inf
  // row has max -inf. A NaN at the end of a thread's columns is the one a wrong max keeps.
  for (int64_t inner : {(int64_t)1, (int64_t)3}) {
    const int64_t outer = 2, n = 40;
    std::vector<float> x = kt::inputs(outer * n * inner, 55);
    x[5 * inner] = x[(n - 1) * inner] = std::nanf("");
    for (int64_t j = 0; j < n * inner; j++) x[n * inner + j] = -INFINITY;
    check_reduce(ReduceOp::max, x, outer, n, inner, " NaN and -inf");
    check_max_backward(x, outer, n, inner, " NaN and -inf");
  }
  // An empty reduced dim still writes every output: the identity of the op.
  for (int64_t inner : {(int64_t)1, (int64_t)4})
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) check_reduce(op, {}, 3, 0, inner, " n=0");
}

TEST_CASE("kernels: max_backward with ties routes to the first max, device vs cpu") {
  for (auto& s : kRowShapes) check_max_backward(tied_inputs(s[0] * s[1] * s[2], 61), s[0], s[1], s[2], " ties");
  for (auto& s : kColumnShapes) check_max_backward(tied_inputs(s[0] * s[1] * s[2], 62), s[0], s[1], s[2], " ties");
  // The first max late in the row, after other lanes' (and, at 4097, other warps') columns:
  // ties at j = 1000 and j = 4000 and at the very end; the min over the row must pick 1000.
  const int64_t n = 4097;
  std::vector<float> x(n, 0.f);
  x[1000] = x[4000] = x[n - 1] = 1.f;
  check_max_backward(x, 1, n, 1, " late ties");
  std::vector<float> y(n);
  kt::cpu_kernels().max_backward(y.data(), x.data(), std::vector<float>{1.f}.data(),
                                 std::vector<float>{2.f}.data(), 1, n, 1);
  CHECK(y[1000] == 2.f);
  CHECK(y[4000] == 0.f);
  // Distinct values, large magnitude: exactly one hit per row.
  check_max_backward(kt::inputs(3 * 1000, 63, 1000.f), 3, 1000, 1, " x1000");
}

}  // TEST_SUITE
