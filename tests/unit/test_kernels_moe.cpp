// Kernel tests: the mixture-of-experts kernels moe_permute_plan, grouped_gemm, grouped_gemm_dw,
// moe_combine and moe_combine_backward. Two kinds of check, each against something independent:
//   1. device vs cpu (TEST_SUITE "kernels"): kernels/cuda/moe.cu on the device under test (sim,
//      or cuda on a GPU) against kernels/cpu/moe.cpp on the same inputs. The plan's integer
//      outputs must be EQUAL (the packed order is stable, hence one order on every device);
//      float outputs are within the bounds derived below.
//   2. the cpu definitions against their meaning ("moe kernels: ..."): the plan is a stable
//      counting sort (pos and src_token invert each other); grouped_gemm is a matmul (common/
//      ops.h) per group; combine(permute(x)) with gates 1 is k x; and the backward kernels
//      (grouped_gemm with trans_w, grouped_gemm_dw, moe_combine_backward) are the gradients
//      autograd finds for the same computation built from ops (slice / matmul / concat, and
//      index_select / mul / index_add).
//
// Shapes: tokens T = 0, 1, 7, 33, 100, 128, 257 (the plan's blocks walk slots in chunks of 256:
// T*k = 256, 257, 800 and 2112 cross chunk borders); k = 1, 2 and k = G (every token picks every
// expert); G = 1, 4, 8, 64; routings with empty experts, and with every slot on one expert.
// Matrix sizes d, K, Nc in 0, 1, 5, 33, 48, 70 (not multiples of the 32x32 tiles) and 1030
// (above 1024: the combines switch from a warp to a block per row); groups of 0, 1, 31, 32, 33,
// 70, 100 rows (tiles that end inside a group, groups that fill a tile exactly or spill by one).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/core/ops.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// ----------------------------------------------------------------------------
// tolerances
//
// The cpu kernels sum in float, in loop order; the device kernels sum in float too, in the
// same order under sim (which therefore agrees bit for bit today) but possibly fused into FMAs
// by nvcc, and in another order for dgates (a warp reduction). A float dot product of n terms
// is within gamma_n S of the exact one, S = sum |terms| (Higham, "Accuracy and Stability of
// Numerical Algorithms", 3.1; any order, FMAs only round less), gamma_n = n u / (1 - n u)
// <= (n + 1) u for n <= 4095, u = eps / 2. Two such computations are within 2 (n + 1) u S =
// (n + 1) eps S of each other; accumulating onto c adds one rounding on each side, eps (S +
// |c|) in all. So, per element:
//   grouped_gemm:    (K + 2) eps S + eps |c_before|,    S = sum_i |a_ri| |w_e[i, n]|
//   grouped_gemm_dw: (n_e + 2) eps S + eps |dw_before|, S = sum over the group's rows |a| |dc|;
//                    an EMPTY group is exact: 0, or dw_before untouched (tolerance 0)
//   moe_combine:     (k + 1) eps S,                     S = sum_j |g_j| |yp[pos[s_j], c]|
//   dgates:          (d + 1) eps S,                     S = sum_c |dy[t, c]| |yp[pos[s], c]|
//   dyp = g dy:      one correctly rounded product on every device: exact (tolerance 0)
// A wrong group, row or tile, a dropped term or a missing barrier is off by a whole term
// |a_ri w_in| among K of them, orders of magnitude above (K + 2) eps times their sum.
constexpr double kEps = FLT_EPSILON;
constexpr double kExact = 0.0;

// The guard after an output: stores past its end land there and must not.
constexpr int64_t kGuard = 40;
constexpr float kGuardValue = -12345.f;

// ----------------------------------------------------------------------------
// routings and plans

// topk_idx (T*k): each token picks k DISTINCT experts out of `allowed` (as top-k would) when
// k <= |allowed|, else k experts of `allowed` with repeats (the kernels allow any ids in
// [0, G)). Deterministic: a seeded mt19937_64 and a hand-written partial Fisher-Yates.
std::vector<int64_t> make_routing(int64_t T, int64_t k, std::vector<int64_t> allowed,
                                  uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> idx;
  const int64_t n = (int64_t)allowed.size();
  for (int64_t t = 0; t < T; t++) {
    if (k <= n) {
      for (int64_t j = 0; j < k; j++) {
        const int64_t pick = j + (int64_t)(rng() % (uint64_t)(n - j));
        std::swap(allowed[(size_t)j], allowed[(size_t)pick]);
        idx.push_back(allowed[(size_t)j]);
      }
    } else {
      for (int64_t j = 0; j < k; j++) idx.push_back(allowed[rng() % (uint64_t)n]);
    }
  }
  return idx;
}
std::vector<int64_t> all_experts(int64_t G) {
  std::vector<int64_t> e((size_t)G);
  for (int64_t i = 0; i < G; i++) e[(size_t)i] = i;
  return e;
}

struct Routing {
  std::string name;
  int64_t T, k, G;
  std::vector<int64_t> topk_idx;  // (T*k)
};
Routing routing(int64_t T, int64_t k, int64_t G, const std::vector<int64_t>& allowed,
                uint64_t seed, const std::string& kind) {
  return {"T=" + std::to_string(T) + " k=" + std::to_string(k) + " G=" + std::to_string(G) +
              " " + kind,
          T, k, G, make_routing(T, k, allowed, seed)};
}

// The routings of the plan test: every (T, k, G) of the header's list.
std::vector<Routing> plan_routings() {
  return {
      routing(1, 1, 1, {0}, 1, "one token, one expert"),
      routing(7, 2, 4, all_experts(4), 2, "distinct"),
      routing(7, 4, 4, all_experts(4), 3, "k = G"),
      routing(33, 2, 8, {1, 5, 6}, 4, "experts 1, 5, 6 only (5 empty)"),
      routing(33, 8, 8, all_experts(8), 5, "k = G, 264 slots (2 chunks)"),
      routing(100, 1, 64, all_experts(64), 6, "distinct (some empty)"),
      routing(100, 2, 64, all_experts(64), 7, "distinct"),
      routing(100, 2, 8, {3}, 8, "every slot on expert 3 (repeats within a token)"),
      routing(100, 1, 4, {3}, 9, "every slot on the last expert"),
      routing(100, 8, 8, all_experts(8), 10, "k = G, 800 slots"),
      routing(128, 2, 4, all_experts(4), 11, "256 slots: exactly one chunk"),
      routing(257, 1, 8, all_experts(8), 12, "257 slots: one past a chunk"),
      routing(33, 64, 64, all_experts(64), 13, "k = G = 64, 2112 slots"),
      routing(0, 2, 4, all_experts(4), 14, "no tokens"),
  };
}

struct Plan {
  std::vector<int64_t> group_sizes, src_token, pos;
};
Plan cpu_plan(const Routing& r) {
  Plan p{std::vector<int64_t>((size_t)r.G), std::vector<int64_t>((size_t)(r.T * r.k)),
         std::vector<int64_t>((size_t)(r.T * r.k))};
  kt::cpu_kernels().moe_permute_plan(p.group_sizes.data(), p.src_token.data(), p.pos.data(),
                                     r.topk_idx.data(), r.T, r.k, r.G);
  return p;
}

// An int64 buffer on device d filled with -7, so an index the kernel forgets shows up.
Tensor index_scratch(int64_t n, Device d) {
  return kt::upload_indices(std::vector<int64_t>((size_t)n, -7), d);
}

std::vector<float> with_guard(std::vector<float> v) {
  v.insert(v.end(), kGuard, kGuardValue);
  return v;
}
// Splits got into the output (returned) and the guard, which must be intact.
std::vector<float> strip_guard(std::vector<float> got, const std::string& what) {
  const size_t n = got.size() - kGuard;
  kt::require_close(std::vector<float>(got.begin() + (long)n, got.end()),
                    std::vector<float>(kGuard, kGuardValue), 0, 0, what + ": guard after it");
  got.resize(n);
  return got;
}

std::vector<float> abs_of(std::vector<float> v) {
  for (float& x : v) x = std::fabs(x);
  return v;
}

int64_t total(const std::vector<int64_t>& sizes) {
  int64_t m = 0;
  for (int64_t n : sizes) m += n;
  return m;
}

// With FF_MOE_VERBOSE=1: a line with the largest error and error / tolerance of a comparison,
// and whether the two sides agree bit for bit, to see how tight the bounds are.
void report_errors(const std::vector<float>& got, const std::vector<float>& want,
                   const std::vector<double>& tol, const std::string& what) {
  const char* verbose = std::getenv("FF_MOE_VERBOSE");
  if (!verbose || std::string(verbose) != "1") return;
  double worst = 0, worst_err = 0;
  bool identical = got.size() == want.size();
  for (size_t i = 0; i < std::min(got.size(), want.size()); i++) {
    const double err = std::fabs((double)got[i] - want[i]);
    identical = identical && std::memcmp(&got[i], &want[i], sizeof(float)) == 0;
    if (tol[i] > 0) worst = std::max(worst, err / tol[i]);
    worst_err = std::max(worst_err, err);
  }
  const std::string same = identical ? "bit-identical" : "differs";
  MESSAGE(what << ": " << same << ", max error " << worst_err << ", max error / tolerance "
               << worst);
}

// kt::require_within (device vs cpu), reporting the errors first.
void require_within(const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<double>& tol, int64_t C, const std::string& what) {
  report_errors(got, want, tol, what);
  kt::require_within(got, want, tol, C, what);
}

// ----------------------------------------------------------------------------
// device vs cpu

void check_plan(const Routing& r) {
  const Device d = kt::device_under_test();
  const Plan want = cpu_plan(r);
  const int64_t S = r.T * r.k;
  Tensor idx = kt::upload_indices(r.topk_idx, d);
  Tensor sizes = index_scratch(r.G, d), src = index_scratch(S, d), pos = index_scratch(S, d);
  kt::dut_kernels().moe_permute_plan(sizes.index_data(), src.index_data(), pos.index_data(),
                                     idx.index_data(), r.T, r.k, r.G);
  kt::require_equal(sizes.to_index_vector(), want.group_sizes, "group_sizes, " + r.name);
  kt::require_equal(src.to_index_vector(), want.src_token, "src_token, " + r.name);
  kt::require_equal(pos.to_index_vector(), want.pos, "pos, " + r.name);
}

struct GemmCase {
  std::string name;
  std::vector<int64_t> sizes;  // (G) rows per group
  int64_t K, Nc;
};

std::vector<GemmCase> gemm_cases() {
  return {
      {"G=1", {7}, 5, 1},
      {"G=4, groups of 0, 33, 1, 32", {0, 33, 1, 32}, 48, 70},
      {"G=8, three empty groups", {5, 0, 0, 70, 1, 0, 31, 13}, 70, 5},
      {"G=64 from a top-2 routing of 100 tokens",
       cpu_plan(routing(100, 2, 64, all_experts(64), 20, "")).group_sizes, 1, 48},
      {"G=64 from a top-8 routing of 33 tokens",
       cpu_plan(routing(33, 8, 64, all_experts(64), 21, "")).group_sizes, 70, 33},
      {"G=4, every row in group 2", {0, 0, 100, 0}, 33, 33},
      {"G=3, K = 0 (an empty sum)", {3, 0, 4}, 0, 5},
  };
}

std::string gemm_name(const GemmCase& g, bool trans_w, bool accumulate) {
  return g.name + " K=" + std::to_string(g.K) + " Nc=" + std::to_string(g.Nc) +
         (trans_w ? " trans_w" : "") + (accumulate ? " accumulate" : " assign");
}

void check_grouped_gemm(const GemmCase& g, bool trans_w, bool accumulate, uint64_t seed) {
  const Device d = kt::device_under_test();
  const int64_t G = (int64_t)g.sizes.size(), M = total(g.sizes), K = g.K, Nc = g.Nc;
  const std::string what = "grouped_gemm " + gemm_name(g, trans_w, accumulate);
  const std::vector<float> a = kt::inputs(M * K, seed), w = kt::inputs(G * K * Nc, seed + 1);
  const std::vector<float> c_before =
      accumulate ? kt::inputs(M * Nc, seed + 2) : std::vector<float>((size_t)(M * Nc), NAN);

  std::vector<float> want = c_before, abs_sum((size_t)(M * Nc));
  const KernelTable& cpu = kt::cpu_kernels();
  cpu.grouped_gemm(want.data(), a.data(), w.data(), g.sizes.data(), G, M, K, Nc, trans_w,
                   accumulate);
  cpu.grouped_gemm(abs_sum.data(), abs_of(a).data(), abs_of(w).data(), g.sizes.data(), G, M, K,
                   Nc, trans_w, false);
  std::vector<double> tol((size_t)(M * Nc));
  for (size_t i = 0; i < tol.size(); i++)
    tol[i] = (K + 2) * kEps * abs_sum[i] + (accumulate ? kEps * std::fabs(c_before[i]) : 0.0);

  Tensor ad = kt::upload(a, d), wd = kt::upload(w, d), sd = kt::upload_indices(g.sizes, d);
  Tensor cd = kt::upload(with_guard(c_before), d);
  kt::dut_kernels().grouped_gemm(cd.data(), ad.data(), wd.data(), sd.index_data(), G, M, K, Nc,
                                 trans_w, accumulate);
  require_within(strip_guard(cd.to_vector(), what), want, tol, Nc, what);
}

void check_grouped_gemm_dw(const GemmCase& g, bool accumulate, uint64_t seed) {
  const Device d = kt::device_under_test();
  const int64_t G = (int64_t)g.sizes.size(), M = total(g.sizes), K = g.K, Nc = g.Nc;
  const std::string what = "grouped_gemm_dw " + gemm_name(g, false, accumulate);
  const std::vector<float> a = kt::inputs(M * K, seed), dc = kt::inputs(M * Nc, seed + 1);
  const std::vector<float> dw_before =
      accumulate ? kt::inputs(G * K * Nc, seed + 2) : std::vector<float>((size_t)(G * K * Nc), NAN);

  std::vector<float> want = dw_before, abs_sum((size_t)(G * K * Nc));
  const KernelTable& cpu = kt::cpu_kernels();
  cpu.grouped_gemm_dw(want.data(), a.data(), dc.data(), g.sizes.data(), G, M, K, Nc, accumulate);
  cpu.grouped_gemm_dw(abs_sum.data(), abs_of(a).data(), abs_of(dc).data(), g.sizes.data(), G, M,
                      K, Nc, false);
  std::vector<double> tol((size_t)(G * K * Nc));
  for (int64_t e = 0; e < G; e++) {
    const int64_t n = g.sizes[(size_t)e];
    for (int64_t i = e * K * Nc; i < (e + 1) * K * Nc; i++)
      tol[(size_t)i] = n == 0 ? kExact  // an empty group: exactly 0, or exactly dw_before
                              : (n + 2) * kEps * abs_sum[(size_t)i] +
                                    (accumulate ? kEps * std::fabs(dw_before[(size_t)i]) : 0.0);
  }

  Tensor ad = kt::upload(a, d), dcd = kt::upload(dc, d), sd = kt::upload_indices(g.sizes, d);
  Tensor dwd = kt::upload(with_guard(dw_before), d);
  kt::dut_kernels().grouped_gemm_dw(dwd.data(), ad.data(), dcd.data(), sd.index_data(), G, M, K,
                                    Nc, accumulate);
  require_within(strip_guard(dwd.to_vector(), what), want, tol, Nc, what);
}

struct CombineCase {
  Routing r;
  int64_t d;
};

std::vector<CombineCase> combine_cases() {
  return {
      {routing(1, 1, 1, {0}, 30, ""), 1},
      {routing(7, 2, 4, all_experts(4), 31, ""), 5},
      {routing(33, 8, 8, all_experts(8), 32, "k = G"), 48},
      {routing(100, 2, 64, all_experts(64), 33, ""), 70},
      {routing(100, 1, 4, {3}, 34, "every slot on expert 3"), 33},
      {routing(7, 2, 8, {2, 6}, 35, "block per row"), 1030},
  };
}

void check_combine(const CombineCase& cc, bool with_gates, uint64_t seed) {
  const Device dev = kt::device_under_test();
  const Routing& r = cc.r;
  const int64_t T = r.T, k = r.k, d = cc.d;
  const std::string what = "moe_combine " + r.name + " d=" + std::to_string(d) +
                           (with_gates ? " gates" : " gates = nullptr (all 1)");
  const Plan p = cpu_plan(r);
  const std::vector<float> yp = kt::inputs(T * k * d, seed), gates = kt::inputs(T * k, seed + 1);
  const float* g = with_gates ? gates.data() : nullptr;

  std::vector<float> want((size_t)(T * d)), abs_sum((size_t)(T * d));
  const std::vector<float> abs_gates = abs_of(gates);
  kt::cpu_kernels().moe_combine(want.data(), yp.data(), p.pos.data(), g, T, k, d);
  kt::cpu_kernels().moe_combine(abs_sum.data(), abs_of(yp).data(), p.pos.data(),
                                with_gates ? abs_gates.data() : nullptr, T, k, d);
  std::vector<double> tol((size_t)(T * d));
  for (size_t i = 0; i < tol.size(); i++) tol[i] = (k + 1) * kEps * abs_sum[i];

  Tensor ypd = kt::upload(yp, dev), posd = kt::upload_indices(p.pos, dev);
  Tensor gd = kt::upload(gates, dev);
  Tensor yd = kt::upload(with_guard(std::vector<float>((size_t)(T * d), NAN)), dev);
  kt::dut_kernels().moe_combine(yd.data(), ypd.data(), posd.index_data(),
                                with_gates ? gd.data() : nullptr, T, k, d);
  require_within(strip_guard(yd.to_vector(), what), want, tol, d, what);
}

void check_combine_backward(const CombineCase& cc, uint64_t seed) {
  const Device dev = kt::device_under_test();
  const Routing& r = cc.r;
  const int64_t T = r.T, k = r.k, d = cc.d;
  const std::string what = "moe_combine_backward " + r.name + " d=" + std::to_string(d);
  const Plan p = cpu_plan(r);
  const std::vector<float> yp = kt::inputs(T * k * d, seed), gates = kt::inputs(T * k, seed + 1),
                           dy = kt::inputs(T * d, seed + 2);

  std::vector<float> want_dyp((size_t)(T * k * d)), want_dg((size_t)(T * k));
  std::vector<float> abs_dyp((size_t)(T * k * d)), abs_dg((size_t)(T * k));
  const KernelTable& cpu = kt::cpu_kernels();
  cpu.moe_combine_backward(want_dyp.data(), want_dg.data(), dy.data(), yp.data(), p.pos.data(),
                           gates.data(), T, k, d);
  cpu.moe_combine_backward(abs_dyp.data(), abs_dg.data(), abs_of(dy).data(), abs_of(yp).data(),
                           p.pos.data(), gates.data(), T, k, d);
  std::vector<double> tol_dg((size_t)(T * k));
  for (size_t i = 0; i < tol_dg.size(); i++) tol_dg[i] = (d + 1) * kEps * abs_dg[i];

  Tensor ypd = kt::upload(yp, dev), posd = kt::upload_indices(p.pos, dev);
  Tensor gd = kt::upload(gates, dev), dyd = kt::upload(dy, dev);
  Tensor dypd = kt::upload(with_guard(std::vector<float>((size_t)(T * k * d), NAN)), dev);
  Tensor dgd = kt::upload(with_guard(std::vector<float>((size_t)(T * k), NAN)), dev);
  kt::dut_kernels().moe_combine_backward(dypd.data(), dgd.data(), dyd.data(), ypd.data(),
                                         posd.index_data(), gd.data(), T, k, d);
  require_within(strip_guard(dypd.to_vector(), what + ": dyp"), want_dyp,
                     std::vector<double>(want_dyp.size(), kExact), d, what + ": dyp");
  require_within(strip_guard(dgd.to_vector(), what + ": dgates"), want_dg, tol_dg, k,
                     what + ": dgates");
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: moe_permute_plan device vs cpu, bit-identical (ragged T, k = 1, 2, G)") {
  for (const Routing& r : plan_routings()) check_plan(r);
}

TEST_CASE("kernels: moe grouped_gemm device vs cpu, empty groups, trans_w both ways, accumulate") {
  uint64_t seed = 100;
  for (const GemmCase& g : gemm_cases())
    for (bool trans_w : {false, true})
      for (bool accumulate : {false, true}) check_grouped_gemm(g, trans_w, accumulate, seed += 3);
}

TEST_CASE("kernels: moe grouped_gemm_dw device vs cpu; an empty group gets exactly 0 or is kept") {
  uint64_t seed = 200;
  for (const GemmCase& g : gemm_cases())
    for (bool accumulate : {false, true}) check_grouped_gemm_dw(g, accumulate, seed += 3);
}

TEST_CASE("kernels: moe grouped GEMMs with no rows (M = 0): nothing past c is written, dw = 0") {
  const GemmCase none{"G=4, no rows", {0, 0, 0, 0}, 5, 7};
  for (bool trans_w : {false, true})
    for (bool accumulate : {false, true}) check_grouped_gemm(none, trans_w, accumulate, 300);
  for (bool accumulate : {false, true}) check_grouped_gemm_dw(none, accumulate, 310);
}

TEST_CASE("kernels: moe_combine device vs cpu, with gates and with gates = nullptr") {
  uint64_t seed = 400;
  for (const CombineCase& c : combine_cases())
    for (bool with_gates : {true, false}) check_combine(c, with_gates, seed += 3);
}

TEST_CASE("kernels: moe_combine_backward device vs cpu (dyp bit-exact, dgates within bound)") {
  uint64_t seed = 500;
  for (const CombineCase& c : combine_cases()) check_combine_backward(c, seed += 3);
  // d = 0: nothing to gather, but every dgates is an empty dot product, 0
  check_combine_backward({routing(7, 2, 4, all_experts(4), 36, ""), 0}, 520);
}

}  // TEST_SUITE

// ----------------------------------------------------------------------------
// the cpu definitions against their meaning

namespace {

Tensor leaf(const std::vector<float>& v, const Shape& shape) {
  Tensor t = Tensor::from_vector(v, shape);
  t.requires_grad_();
  return t;
}

// |got[i] - want[i]| <= tol[i] for every i (cpu against cpu: no device in the message).
void check_close_to(const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<double>& tol, const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  report_errors(got, want, tol, what);
  for (size_t i = 0; i < got.size(); i++)
    if (!(std::fabs((double)got[i] - want[i]) <= tol[i]))
      FAIL(what << ": [" << i << "] is " << got[i] << ", want " << want[i] << " (tolerance "
                << tol[i] << ")");
}

}  // namespace

TEST_CASE("moe kernels: the permute plan is a stable counting sort; pos and src_token invert") {
  for (const Routing& r : plan_routings()) {
    CAPTURE(r.name);
    const Plan p = cpu_plan(r);
    const int64_t S = r.T * r.k;
    // group_sizes is the histogram of the experts
    std::vector<int64_t> hist((size_t)r.G, 0), first((size_t)r.G, 0);
    for (int64_t e : r.topk_idx) hist[(size_t)e]++;
    CHECK(p.group_sizes == hist);
    for (int64_t e = 1; e < r.G; e++) first[(size_t)e] = first[(size_t)e - 1] + hist[(size_t)e - 1];
    // pos is a permutation of the packed rows, each slot inside its expert's group, and
    // src_token[pos[s]] is the slot's token
    std::vector<int> seen((size_t)S, 0);
    for (int64_t s = 0; s < S; s++) {
      const int64_t row = p.pos[(size_t)s], e = r.topk_idx[(size_t)s];
      REQUIRE((0 <= row && row < S));
      seen[(size_t)row]++;
      CHECK(first[(size_t)e] <= row);
      CHECK(row < first[(size_t)e] + hist[(size_t)e]);
      CHECK(p.src_token[(size_t)row] == s / r.k);
    }
    CHECK(std::count(seen.begin(), seen.end(), 1) == S);
    // stable: within a group, the slots keep their order
    for (int64_t s = 0; s < S; s++)
      for (int64_t s2 = s + 1; s2 < S; s2++)
        if (r.topk_idx[(size_t)s] == r.topk_idx[(size_t)s2])
          CHECK(p.pos[(size_t)s] < p.pos[(size_t)s2]);
  }
}

TEST_CASE("moe kernels: combine(permute(x)) with gates = 1 is k x") {
  // Integer-valued x (|x| <= 50): k x and every partial sum of k copies are exact floats, so
  // the property holds exactly, whatever the order of the additions.
  for (const Routing& r : plan_routings()) {
    CAPTURE(r.name);
    const int64_t d = 5, T = r.T, k = r.k;
    std::vector<float> x((size_t)(T * d));
    for (size_t i = 0; i < x.size(); i++) x[i] = (float)((int64_t)(i * 37 % 101) - 50);
    const Plan p = cpu_plan(r);
    std::vector<float> xp((size_t)(T * k * d)), y((size_t)(T * d)), want((size_t)(T * d));
    const KernelTable& cpu = kt::cpu_kernels();
    cpu.index_select_rows(xp.data(), x.data(), p.src_token.data(), T * k, d);  // permute
    cpu.moe_combine(y.data(), xp.data(), p.pos.data(), nullptr, T, k, d);       // unpermute
    for (size_t i = 0; i < want.size(); i++) want[i] = (float)k * x[i];
    CHECK(y == want);
  }
}

TEST_CASE("moe kernels: the cpu grouped_gemm with w^T gives the bits of the same product with w transposed first") {
  // trans_w transposes each expert's weights once and runs the rows as the plain product does:
  // the same products in the same order as a dot product along a row of w, so the result
  // equals the plain product on explicitly transposed weights bit for bit (groups of 5, 1, 0
  // and 9 rows, K and Nc past the 32-blocks of the transpose, assign and accumulate).
  const std::vector<int64_t> sizes = {5, 1, 0, 9};
  const int64_t G = 4, M = 15, K = 37, Nc = 70;
  const std::vector<float> a = kt::inputs(M * K, 910), w = kt::inputs(G * Nc * K, 911), c0 = kt::inputs(M * Nc, 912);
  std::vector<float> wt((size_t)(G * K * Nc));  // each expert's (Nc, K) as (K, Nc)
  for (int64_t e = 0; e < G; e++)
    for (int64_t n = 0; n < Nc; n++)
      for (int64_t i = 0; i < K; i++) wt[(size_t)((e * K + i) * Nc + n)] = w[(size_t)((e * Nc + n) * K + i)];
  for (bool accumulate : {false, true}) {
    std::vector<float> got = c0, want = c0;
    cpu::grouped_gemm(got.data(), a.data(), w.data(), sizes.data(), G, M, K, Nc, /*trans_w=*/true, accumulate);
    cpu::grouped_gemm(want.data(), a.data(), wt.data(), sizes.data(), G, M, K, Nc, /*trans_w=*/false, accumulate);
    CHECK(got == want);
  }
}

TEST_CASE("moe kernels: grouped_gemm and its gradients equal per-group matmuls under autograd") {
  // c = concat_e (a_e @ op(w_e)) with ops (slice, reshape, transpose, matmul, concat); then
  // the backward of dc: dA must be grouped_gemm(dc, w) with the other transposition, dW must be
  // grouped_gemm_dw(a, dc) (or its transpose when trans_w). The ops' matmul (the cpu matmul's
  // version 2) and the kernels both sum in float, in different orders: within (n + 2) eps S of
  // each other (header: two float sums; n the length of the sum).
  for (const GemmCase& g : gemm_cases())
    for (bool trans_w : {false, true}) {
      const std::string what = gemm_name(g, trans_w, false);
      CAPTURE(what);
      const int64_t G = (int64_t)g.sizes.size(), M = total(g.sizes), K = g.K, Nc = g.Nc;
      const std::vector<float> av = kt::inputs(M * K, 600), wv = kt::inputs(G * K * Nc, 601),
                               dcv = kt::inputs(M * Nc, 602);
      Tensor a = leaf(av, {M, K}), w = leaf(wv, trans_w ? Shape{G, Nc, K} : Shape{G, K, Nc});
      std::vector<Tensor> parts;
      int64_t row0 = 0;
      for (int64_t e = 0; e < G; e++) {
        const int64_t n = g.sizes[(size_t)e];
        if (n > 0) {
          Tensor we = reshape(slice(w, 0, e, e + 1), trans_w ? Shape{Nc, K} : Shape{K, Nc});
          parts.push_back(matmul(slice(a, 0, row0, row0 + n), trans_w ? transpose(we, 0, 1) : we));
        }
        row0 += n;
      }
      Tensor c = concat(parts, 0);
      c.backward(Tensor::from_vector(dcv, {M, Nc}));

      // forward
      const KernelTable& cpu = kt::cpu_kernels();
      std::vector<float> got((size_t)(M * Nc)), S((size_t)(M * Nc));
      cpu.grouped_gemm(got.data(), av.data(), wv.data(), g.sizes.data(), G, M, K, Nc, trans_w,
                       false);
      cpu.grouped_gemm(S.data(), abs_of(av).data(), abs_of(wv).data(), g.sizes.data(), G, M, K,
                       Nc, trans_w, false);
      std::vector<double> tol(S.size());
      for (size_t i = 0; i < S.size(); i++) tol[i] = (K + 2) * kEps * S[i];
      check_close_to(got, c.to_vector(), tol, "grouped_gemm vs matmul per group");

      // dA = dc op(w_e)^T: grouped_gemm of dc (M, Nc) with w_e (K, Nc) read as (Nc, K), i.e.
      // the opposite trans_w
      std::vector<float> da((size_t)(M * K)), da_abs((size_t)(M * K));
      cpu.grouped_gemm(da.data(), dcv.data(), wv.data(), g.sizes.data(), G, M, Nc, K, !trans_w,
                       false);
      cpu.grouped_gemm(da_abs.data(), abs_of(dcv).data(), abs_of(wv).data(), g.sizes.data(), G, M,
                       Nc, K, !trans_w, false);
      tol.assign(da.size(), 0);
      for (size_t i = 0; i < da.size(); i++) tol[i] = (Nc + 2) * kEps * da_abs[i];
      check_close_to(da, a.grad().to_vector(), tol, "dA = grouped_gemm(dc, w, !trans_w)");

      // dW_e = a_e^T dc_e (K, Nc); stored (Nc, K) when trans_w. Untouched experts: exactly 0.
      std::vector<float> dw((size_t)(G * K * Nc)), dw_abs((size_t)(G * K * Nc));
      cpu.grouped_gemm_dw(dw.data(), av.data(), dcv.data(), g.sizes.data(), G, M, K, Nc, false);
      cpu.grouped_gemm_dw(dw_abs.data(), abs_of(av).data(), abs_of(dcv).data(), g.sizes.data(), G,
                          M, K, Nc, false);
      std::vector<float> want_dw = w.grad().to_vector(), got_dw((size_t)(G * K * Nc));
      tol.assign(dw.size(), 0);
      for (int64_t e = 0; e < G; e++)
        for (int64_t i = 0; i < K; i++)
          for (int64_t n = 0; n < Nc; n++) {
            const size_t src = (size_t)((e * K + i) * Nc + n);
            const size_t dst = (size_t)(trans_w ? (e * Nc + n) * K + i : (e * K + i) * Nc + n);
            got_dw[dst] = dw[src];
            tol[dst] = (g.sizes[(size_t)e] + 2) * kEps * dw_abs[src];
          }
      check_close_to(got_dw, want_dw, tol, "dW = grouped_gemm_dw(a, dc)");
    }
}

TEST_CASE("moe kernels: moe_combine and its backward equal index_select / mul / index_add") {
  // y = index_add(0, token of slot, gates * index_select(yp, pos)): slot s's packed row, scaled
  // by its gate, added to its token. Its autograd gradients are dyp and dgates.
  for (const CombineCase& cc : combine_cases()) {
    const Routing& r = cc.r;
    CAPTURE(r.name);
    const int64_t T = r.T, k = r.k, d = cc.d, S = T * k;
    const Plan p = cpu_plan(r);
    const std::vector<float> ypv = kt::inputs(S * d, 700), gv = kt::inputs(S, 701),
                             dyv = kt::inputs(T * d, 702);
    std::vector<int64_t> token_of_slot((size_t)S);
    for (int64_t s = 0; s < S; s++) token_of_slot[(size_t)s] = s / k;
    Tensor yp = leaf(ypv, {S, d}), gates = leaf(gv, {S});
    Tensor rows = index_select(yp, Tensor::from_indices(p.pos, {S}));
    Tensor y = index_add(Tensor::zeros({T, d}), Tensor::from_indices(token_of_slot, {S}),
                         mul(rows, reshape(gates, {S, 1})));
    y.backward(Tensor::from_vector(dyv, {T, d}));

    const KernelTable& cpu = kt::cpu_kernels();
    std::vector<float> got((size_t)(T * d)), y_abs((size_t)(T * d));
    cpu.moe_combine(got.data(), ypv.data(), p.pos.data(), gv.data(), T, k, d);
    cpu.moe_combine(y_abs.data(), abs_of(ypv).data(), p.pos.data(), abs_of(gv).data(), T, k, d);
    std::vector<double> tol(got.size());
    for (size_t i = 0; i < got.size(); i++) tol[i] = (k + 1) * kEps * y_abs[i];
    check_close_to(got, y.to_vector(), tol, "moe_combine vs index_add of gated rows");

    std::vector<float> dyp((size_t)(S * d)), dg((size_t)S), dyp_abs((size_t)(S * d)),
        dg_abs((size_t)S);
    cpu.moe_combine_backward(dyp.data(), dg.data(), dyv.data(), ypv.data(), p.pos.data(),
                             gv.data(), T, k, d);
    cpu.moe_combine_backward(dyp_abs.data(), dg_abs.data(), abs_of(dyv).data(), abs_of(ypv).data(),
                             p.pos.data(), gv.data(), T, k, d);
    // dyp: each packed row is one slot's g_s dy[t], one product on both sides: exact
    check_close_to(dyp, yp.grad().to_vector(), std::vector<double>(dyp.size(), kExact),
                   "dyp vs autograd");
    tol.assign(dg.size(), 0);
    for (size_t i = 0; i < dg.size(); i++) tol[i] = (d + 1) * kEps * dg_abs[i];
    check_close_to(dg, gates.grad().to_vector(), tol, "dgates vs autograd");
  }
}

TEST_CASE("moe kernels: the cpu grouped GEMMs give the bits of the plain scalar loops (threaded sizes too)") {
  // the readable definition: each output sums its terms in order from 0, each term fused into
  // the sum (std::fma, as the cpu matmul's tiles do), then adds it to c when accumulating, as
  // the cpu kernel's comment promises; a reordered or unfused sum would differ in the last bits
  const KernelTable& cpu = kt::cpu_kernels();
  std::vector<GemmCase> cases = gemm_cases();
  cases.push_back({"G=3, 300 rows (threaded)", {100, 0, 200}, 64, 64});
  uint64_t seed = 900;
  for (const GemmCase& g : cases) {
    const int64_t G = (int64_t)g.sizes.size(), M = total(g.sizes), K = g.K, Nc = g.Nc;
    const std::vector<float> a = kt::inputs(M * K, seed++), w = kt::inputs(G * K * Nc, seed++);
    const std::vector<float> dc = kt::inputs(M * Nc, seed++), c_before = kt::inputs(M * Nc, seed++),
                             before = kt::inputs(G * K * Nc, seed++);
    for (bool trans : {false, true})
      for (bool acc : {false, true}) {
        std::vector<float> want = c_before, got = c_before;
        int64_t row0 = 0;
        for (int64_t e = 0; e < G; e++) {
          const float* we = w.data() + e * K * Nc;
          for (int64_t r = row0; r < row0 + g.sizes[(size_t)e]; r++)
            for (int64_t n = 0; n < Nc; n++) {
              float s = 0.f;
              for (int64_t i = 0; i < K; i++) s = std::fma(a[r * K + i], trans ? we[n * K + i] : we[i * Nc + n], s);
              want[r * Nc + n] = acc ? want[r * Nc + n] + s : s;
            }
          row0 += g.sizes[(size_t)e];
        }
        cpu.grouped_gemm(got.data(), a.data(), w.data(), g.sizes.data(), G, M, K, Nc, trans, acc);
        INFO(gemm_name(g, trans, acc));
        CHECK((want.empty() || std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0));
      }
    for (bool acc : {false, true}) {
      std::vector<float> want = before, got = before;
      int64_t row0 = 0;
      for (int64_t e = 0; e < G; e++) {
        for (int64_t i = 0; i < K; i++)
          for (int64_t n = 0; n < Nc; n++) {
            float s = 0.f;
            for (int64_t r = row0; r < row0 + g.sizes[(size_t)e]; r++) s = std::fma(a[r * K + i], dc[r * Nc + n], s);
            float& o = want[(size_t)(e * K * Nc + i * Nc + n)];
            o = acc ? o + s : s;
          }
        row0 += g.sizes[(size_t)e];
      }
      cpu.grouped_gemm_dw(got.data(), a.data(), dc.data(), g.sizes.data(), G, M, K, Nc, acc);
      INFO("grouped_gemm_dw " << gemm_name(g, false, acc));
      CHECK((want.empty() || std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0));
    }
  }
}
