// Kernel tests: RMSNorm and cross-entropy (kernels/cuda/norm_loss.cu), row gather/scatter and
// top-k (kernels/cuda/index.cu) on the device under test (sim, or cuda on a GPU) against their
// cpu twins in kernels/cpu/norm_loss.cpp and kernels/cpu/index.cpp.
//
// Shapes: rows N (or M) = 1, 3, 65 (65 rows: 17 blocks of 4 warps, the last one 3/4 idle; for
// dw two chunks of 64 rows, so the atomicAdd of partials is exercised); row lengths C = 1, 31,
// 33, 257, 1000 around the warp (all a warp per row) and 4097 (a block of 256 per row);
// vocabularies V = 1, 7, 1000, 4097. Inputs have x100 outliers (kt::inputs), and further sets
// are scaled x1000. Top-k: k = 1, 2 and k = C, on distinct values and on small integers with
// many ties. Gather/scatter: indices that repeat; index_add on integer-valued floats (exact in
// any order) and on random floats (order-dependent rounding, bounded below).
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
// The cpu kernels sum in double and round once (except dw and index_add, which add in float
// in row order); the CUDA kernels sum in float. A float sum whose longest chain of additions
// is k is within k * eps * sum|terms| of the exact sum (Higham's gamma_k = k u / (1 - k u),
// u = eps / 2: a factor 2 to spare). The row kernels' chain: a warp per row (C <= 1024) adds
// ceil(C / 32) <= 32 terms per lane, then 5 butterfly levels (37); a block per row (4097,
// 256 threads) 17 + 5 + 8 warp slots (30). kRowChain covers both. A lost term, a lost lane or
// warp, or a wrong index is off by a whole term, far more than k * eps of the sum.
constexpr double kRowChain = 40;
constexpr double kEps = FLT_EPSILON;
// Gathers, scatters of integer-valued floats, top-k and topk_backward copy and compare, or add
// exactly: bit-exact.
constexpr double kExact = 0.0;
// rstd = rsqrt(ss / C + eps): ss is a sum of squares, all positive, so its relative error is
// that of the chain plus the squares' rounding, (kRowChain + 1) eps; / C and + eps round twice
// more; the square root halves a relative error; rsqrtf adds <= 2 ulps (CUDA's bound) and the
// cpu's rounding of its double result half an ulp: 3 more.
constexpr double kRstdRtol = (0.5 * (kRowChain + 3) + 3) * kEps;
// y = (x * rstd) * w: rstd's error, and two roundings on each side.
constexpr double kRmsYRtol = kRstdRtol + 2 * kEps;
// cross-entropy backward: the exponent z - lse is the same float operation on both devices;
// CUDA's expf is within 2 ulps and glibc's within 1, so softmax differs by <= 3 eps relative.
constexpr double kExpUlps = 3;
// exp(z - lse) of -100 and below is subnormal or 0, where a relative bound means nothing.
constexpr double kUnderflowAtol = 1e-37;

std::string shape_str(int64_t N, int64_t C) { return std::to_string(N) + "x" + std::to_string(C); }

// An int64 output buffer on device d filled with -7, so an index the kernel forgets to write
// shows up as a mismatch.
Tensor index_scratch(int64_t n, Device d) {
  return kt::upload_indices(std::vector<int64_t>(n, -7), d);
}

// Indices in [0, high) that repeat: uniform random ones (ff::randint).
std::vector<int64_t> random_indices(int64_t n, int64_t high, uint64_t seed) {
  return ff::randint({n}, seed, high).to_index_vector();
}

// Small integers 0..4 (from |randn|): many equal values in a row, spread over its lanes.
std::vector<float> tied_inputs(int64_t n, uint64_t seed) {
  std::vector<float> v = kt::inputs(n, seed);
  for (float& e : v) e = std::fmin(4.f, std::floor(std::fabs(e) * 2.f));
  return v;
}

// Integer values in [-8, 8]: their sums (fewer than 2^21 terms, so |sum| < 2^24) are exact
// in float in any order.
std::vector<float> integer_inputs(int64_t n, uint64_t seed) {
  std::vector<float> v = kt::inputs(n, seed);
  for (float& e : v) e = std::fmax(-8.f, std::fmin(8.f, std::round(e * 3.f)));
  return v;
}

const int64_t kRowCounts[] = {1, 3, 65};
const int64_t kRowLengths[] = {1, 31, 33, 257, 1000};
// A block per row (C > 1024): fewer rows, to keep the emulator quick.
const int64_t kLongRow = 4097;
const int64_t kLongRowCounts[] = {1, 3};

// ---- RMSNorm

constexpr float kRmsEps = 1e-5f;

void check_rmsnorm_forward(const std::vector<float>& x, const std::vector<float>& w, int64_t N,
                           int64_t C, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want_y(N * C), want_rstd(N);
  kt::cpu_kernels().rmsnorm_forward(want_y.data(), want_rstd.data(), x.data(), w.data(), N, C,
                                    kRmsEps);
  Tensor xd = kt::upload(x, d), wd = kt::upload(w, d);
  Tensor y = kt::scratch(N * C, d), rstd = kt::scratch(N, d);
  kt::dut_kernels().rmsnorm_forward(y.data(), rstd.data(), xd.data(), wd.data(), N, C, kRmsEps);
  kt::require_close(rstd.to_vector(), want_rstd, 0, kRstdRtol,
                    "rmsnorm_forward rstd " + shape_str(N, C) + what);
  kt::require_close(y.to_vector(), want_y, 0, kRmsYRtol,
                    "rmsnorm_forward y " + shape_str(N, C) + what);
}

// dx = rs (g - xhat mean), mean = dot / C, dot = sum_j g_j xhat_j (g = dy w, xhat = x rs).
// The float dot is within (kRowChain + 3) eps sum|terms| (+3: each term is a product of two
// rounded products), the cpu rounds dot / C to float (eps/2) and the kernel divides (eps/2);
// dx_j scales the mean's error by rs |xhat_j|, and the final expression (xhat, g, xhat mean,
// the difference, the product with rs) rounds at most four times at rs (|g_j| + |xhat_j mean|)
// on each side: 4 eps in all, 8 eps with a factor 2 to spare.
// dw_j = sum over rows of dy xhat: the cpu adds in float in row order within each of up to 16
// blocks of rows, then the blocks in double (chain <= N, that of a float sum in row order), the
// kernel in chunks of 64 rows then one atomicAdd per chunk (chain min(N, 64) + ceil(N / 64)),
// each term rounded twice on each side.
void check_rmsnorm_backward(const std::vector<float>& x, const std::vector<float>& w,
                            const std::vector<float>& dy, int64_t N, int64_t C,
                            const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> y(N * C), rstd(N), want_dx(N * C), want_dw(C);
  kt::cpu_kernels().rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, kRmsEps);
  kt::cpu_kernels().rmsnorm_backward(want_dx.data(), want_dw.data(), dy.data(), x.data(),
                                     w.data(), rstd.data(), N, C);
  std::vector<double> tol_dx(N * C), tol_dw(C, 0.0);
  for (int64_t r = 0; r < N; r++) {
    double dot = 0, abs_dot = 0;
    for (int64_t j = 0; j < C; j++) {
      double t = (double)dy[r * C + j] * w[j] * x[r * C + j] * rstd[r];
      dot += t, abs_dot += std::fabs(t);
    }
    double mean = dot / C;
    double mean_err = ((kRowChain + 3) * kEps * abs_dot + kEps * std::fabs(dot)) / C;
    for (int64_t j = 0; j < C; j++) {
      double xhat = (double)x[r * C + j] * rstd[r], g = (double)dy[r * C + j] * w[j];
      tol_dx[r * C + j] = rstd[r] * (std::fabs(xhat) * mean_err +
                                     8 * kEps * (std::fabs(g) + std::fabs(xhat * mean)));
    }
  }
  const double dw_chain = (double)N + std::min<int64_t>(N, 64) + (N + 63) / 64 + 4;
  for (int64_t j = 0; j < C; j++) {
    double abs_sum = 0;
    for (int64_t r = 0; r < N; r++)
      abs_sum += std::fabs((double)dy[r * C + j] * x[r * C + j] * rstd[r]);
    tol_dw[j] = dw_chain * kEps * abs_sum;
  }
  Tensor xd = kt::upload(x, d), wd = kt::upload(w, d), dyd = kt::upload(dy, d);
  Tensor rstdd = kt::upload(rstd, d), dx = kt::scratch(N * C, d), dw = kt::scratch(C, d);
  kt::dut_kernels().rmsnorm_backward(dx.data(), dw.data(), dyd.data(), xd.data(), wd.data(),
                                     rstdd.data(), N, C);
  kt::require_within(dx.to_vector(), want_dx, tol_dx, C,
                 "rmsnorm_backward dx " + shape_str(N, C) + what);
  kt::require_within(dw.to_vector(), want_dw, tol_dw, C,
                 "rmsnorm_backward dw " + shape_str(N, C) + what);
}

void check_rmsnorm(int64_t N, int64_t C, float scale, uint64_t seed, const std::string& what) {
  std::vector<float> x = kt::inputs(N * C, seed, scale), w = kt::inputs(C, seed + 1);
  std::vector<float> dy = kt::inputs(N * C, seed + 2);
  check_rmsnorm_forward(x, w, N, C, what);
  check_rmsnorm_backward(x, w, dy, N, C, what);
}

// ---- cross-entropy

// lse = m + log l: l is a float sum of positive terms with an exp rescale on each link (<= 2
// ulps + the addition: 3 eps per link, chain kRowChain), which log turns into an absolute
// error; logf's own ulp and the rounding of m + log l on both devices are eps |lse| at most,
// |lse| <= |m| + log V. loss = lse - z[t] rounds once more on each side, at |loss|.
void check_cross_entropy_forward(const std::vector<float>& z, const std::vector<int64_t>& t,
                                 int64_t N, int64_t V, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want_loss(N), want_lse(N);
  kt::cpu_kernels().cross_entropy_forward(want_loss.data(), want_lse.data(), z.data(), t.data(),
                                          N, V);
  std::vector<double> tol_lse(N), tol_loss(N);
  for (int64_t r = 0; r < N; r++) {
    double m = -INFINITY;
    for (int64_t j = 0; j < V; j++) m = std::fmax(m, z[r * V + j]);
    tol_lse[r] = (3 * kRowChain + 2) * kEps + kEps * (std::fabs(m) + std::log((double)V));
    tol_loss[r] = tol_lse[r] + kEps * std::fabs(want_loss[r]);
  }
  Tensor zd = kt::upload(z, d), td = kt::upload_indices(t, d);
  Tensor loss = kt::scratch(N, d), lse = kt::scratch(N, d);
  kt::dut_kernels().cross_entropy_forward(loss.data(), lse.data(), zd.data(), td.index_data(), N,
                                          V);
  kt::require_within(lse.to_vector(), want_lse, tol_lse, 1,
                 "cross_entropy_forward lse " + shape_str(N, V) + what);
  kt::require_within(loss.to_vector(), want_loss, tol_loss, 1,
                 "cross_entropy_forward loss " + shape_str(N, V) + what);
}

// dlogits = (p - onehot) dloss, p = exp(z - lse): p within kExpUlps eps relative, scaled by
// |dloss|; the subtraction and the product round at |dlogits| on each side.
void check_cross_entropy_backward(const std::vector<float>& z, const std::vector<int64_t>& t,
                                  const std::vector<float>& dloss, int64_t N, int64_t V,
                                  const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> loss(N), lse(N), want(N * V);
  kt::cpu_kernels().cross_entropy_forward(loss.data(), lse.data(), z.data(), t.data(), N, V);
  kt::cpu_kernels().cross_entropy_backward(want.data(), z.data(), lse.data(), t.data(),
                                           dloss.data(), N, V);
  std::vector<double> tol(N * V);
  for (int64_t r = 0; r < N; r++)
    for (int64_t j = 0; j < V; j++) {
      double p = std::exp((double)(z[r * V + j] - lse[r]));
      tol[r * V + j] = std::fabs(dloss[r]) * (kExpUlps * kEps * p + kUnderflowAtol) +
                       2 * kEps * std::fabs(want[r * V + j]);
    }
  Tensor zd = kt::upload(z, d), td = kt::upload_indices(t, d), lsed = kt::upload(lse, d);
  Tensor dlossd = kt::upload(dloss, d), dz = kt::scratch(N * V, d);
  kt::dut_kernels().cross_entropy_backward(dz.data(), zd.data(), lsed.data(), td.index_data(),
                                           dlossd.data(), N, V);
  kt::require_within(dz.to_vector(), want, tol, V,
                 "cross_entropy_backward " + shape_str(N, V) + what);
}

void check_cross_entropy(int64_t N, int64_t V, float scale, uint64_t seed,
                         const std::string& what) {
  std::vector<float> z = kt::inputs(N * V, seed, scale), dloss = kt::inputs(N, seed + 1);
  std::vector<int64_t> t = random_indices(N, V, seed + 2);
  t[0] = V - 1;  // the last column as a target, in the last lane's (or thread's) stretch
  check_cross_entropy_forward(z, t, N, V, what);
  check_cross_entropy_backward(z, t, dloss, N, V, what);
}

// ---- gather and scatter of rows

// out (M, C) = src (R, C)[idx]: copies, bit-exact.
void check_index_select(int64_t R, int64_t M, int64_t C, const std::vector<int64_t>& idx,
                        const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> src = kt::inputs(R * C, 101), want(M * C);
  kt::cpu_kernels().index_select_rows(want.data(), src.data(), idx.data(), M, C);
  Tensor srcd = kt::upload(src, d), idxd = kt::upload_indices(idx, d), out = kt::scratch(M * C, d);
  kt::dut_kernels().index_select_rows(out.data(), srcd.data(), idxd.index_data(), M, C);
  kt::require_close(out.to_vector(), want, kExact, kExact,
                    "index_select_rows " + shape_str(M, C) + " from " + std::to_string(R) +
                        " rows" + what);
}

// dst (R, C)[idx] += src (M, C), dst starting from random values. Integer-valued inputs:
// exact in any order of the additions. Otherwise dst[r, j] is a float sum of 1 + count(r)
// terms on both devices in different orders, each within count(r) * eps/2 * sum|terms| of the
// exact sum (Higham), so count(r) * eps * sum|terms| apart; a row no index names must come
// back untouched (tolerance 0).
void check_index_add(int64_t R, int64_t M, int64_t C, const std::vector<int64_t>& idx,
                     bool integers, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> dst = integers ? integer_inputs(R * C, 111) : kt::inputs(R * C, 111);
  std::vector<float> src = integers ? integer_inputs(M * C, 112) : kt::inputs(M * C, 112);
  std::vector<float> want = dst;
  kt::cpu_kernels().index_add_rows(want.data(), src.data(), idx.data(), M, C);
  // Bit-exact, floats too: the device adds the rows in order, as the cpu does (no atomics, whose
  // order would change the rounding from run to run and from rank to rank).
  const std::vector<double> tol(R * C, 0.0);
  Tensor dstd = kt::upload(dst, d), srcd = kt::upload(src, d), idxd = kt::upload_indices(idx, d);
  kt::dut_kernels().index_add_rows(dstd.data(), srcd.data(), idxd.index_data(), M, C);
  kt::require_within(dstd.to_vector(), want, tol, C,
                 "index_add_rows " + shape_str(M, C) + " into " + std::to_string(R) + " rows" +
                     (integers ? " integers" : " floats") + what);
}

// ---- top-k

// vals and idx bit-exact: top-k only compares and copies.
void check_topk(const std::vector<float>& x, int64_t N, int64_t C, int64_t k,
                const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want_vals(N * k);
  std::vector<int64_t> want_idx(N * k);
  kt::cpu_kernels().topk_rows(want_vals.data(), want_idx.data(), x.data(), N, C, k);
  Tensor xd = kt::upload(x, d), vals = kt::scratch(N * k, d), idx = index_scratch(N * k, d);
  kt::dut_kernels().topk_rows(vals.data(), idx.index_data(), xd.data(), N, C, k);
  std::string label = "topk_rows " + shape_str(N, C) + " k=" + std::to_string(k) + what;
  kt::require_close(vals.to_vector(), want_vals, kExact, kExact, label + " vals");
  kt::require_equal(idx.to_index_vector(), want_idx, label + " idx");
}

// dx (N, C) = 0, dx[i, idx[i, j]] += dvals[i, j]. Distinct indices per row (from topk): each
// element gets 0 or one term, exact. Repeated indices with integer dvals: exact in any order.
void check_topk_backward(const std::vector<float>& dvals, const std::vector<int64_t>& idx,
                         int64_t N, int64_t C, int64_t k, const std::string& what) {
  Device d = kt::device_under_test();
  std::vector<float> want(N * C);
  kt::cpu_kernels().topk_backward(want.data(), dvals.data(), idx.data(), N, C, k);
  Tensor dvd = kt::upload(dvals, d), idxd = kt::upload_indices(idx, d), dx = kt::scratch(N * C, d);
  kt::dut_kernels().topk_backward(dx.data(), dvd.data(), idxd.index_data(), N, C, k);
  kt::require_close(dx.to_vector(), want, kExact, kExact,
                    "topk_backward " + shape_str(N, C) + " k=" + std::to_string(k) + what);
}

// topk_rows and then topk_backward with the cpu's indices and random dvals.
void check_topk_both(const std::vector<float>& x, int64_t N, int64_t C, int64_t k,
                     const std::string& what) {
  check_topk(x, N, C, k, what);
  std::vector<float> vals(N * k);
  std::vector<int64_t> idx(N * k);
  kt::cpu_kernels().topk_rows(vals.data(), idx.data(), x.data(), N, C, k);
  check_topk_backward(kt::inputs(N * k, 131), idx, N, C, k, what);
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: rmsnorm forward and backward device vs cpu, C = 1..4097, N = 1, 3, 65") {
  for (int64_t C : kRowLengths)
    for (int64_t N : kRowCounts) check_rmsnorm(N, C, 1.f, 201, "");
  for (int64_t N : kLongRowCounts) check_rmsnorm(N, kLongRow, 1.f, 202, "");
}

TEST_CASE("kernels: rmsnorm forward and backward on x1000 inputs") {
  // x ~ 1000, outliers ~ 1e5: squares ~ 1e10, sums ~ 1e12, still far from float overflow;
  // rstd ~ 1e-4 to 1e-3.
  for (int64_t C : {(int64_t)33, (int64_t)1000})
    for (int64_t N : {(int64_t)3, (int64_t)65}) check_rmsnorm(N, C, 1000.f, 211, " x1000");
  check_rmsnorm(3, kLongRow, 1000.f, 212, " x1000");
}

TEST_CASE("kernels: rmsnorm_backward with N = 0 assigns dw = 0; many rows; dw the same bits every launch") {
  Device d = kt::device_under_test();
  const int64_t C = 33;
  Tensor dw = kt::scratch(C, d);
  Tensor none = kt::scratch(1, d), w = kt::upload(kt::inputs(C, 221), d);
  kt::dut_kernels().rmsnorm_backward(none.data(), dw.data(), none.data(), none.data(), w.data(),
                                     none.data(), 0, C);
  kt::require_close(dw.to_vector(), std::vector<float>(C, 0.f), kExact, kExact,
                    "rmsnorm_backward dw with N = 0");
  check_rmsnorm(200, 31, 1.f, 222, " 200 rows");
  // dw is the same bits on every launch (the emulator schedules each launch differently; a
  // GPU's atomics land in any order): two ranks holding a replicated norm weight stay equal.
  const int64_t N = 300;
  Tensor x = kt::upload(kt::inputs(N * C, 223), d), dy = kt::upload(kt::inputs(N * C, 224), d);
  Tensor y = kt::scratch(N * C, d), rstd = kt::scratch(N, d), dx = kt::scratch(N * C, d);
  kt::dut_kernels().rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  std::vector<float> first;
  for (int rep = 0; rep < 4; rep++) {
    kt::dut_kernels().rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    if (rep == 0) first = dw.to_vector();
    else kt::require_close(dw.to_vector(), first, kExact, kExact, "rmsnorm_backward dw, launch " + std::to_string(rep));
  }
}

TEST_CASE("kernels: cross_entropy forward and backward device vs cpu, V = 1..4097, N = 1, 3, 65") {
  for (int64_t V : {(int64_t)1, (int64_t)7, (int64_t)33, (int64_t)1000})
    for (int64_t N : kRowCounts) check_cross_entropy(N, V, 1.f, 301, "");
  for (int64_t N : kLongRowCounts) check_cross_entropy(N, kLongRow, 1.f, 302, "");
  // V = 1: lse is the only logit and the loss exactly 0, on both.
  std::vector<float> z = {3.5f}, loss(1), lse(1);
  std::vector<int64_t> t = {0};
  kt::cpu_kernels().cross_entropy_forward(loss.data(), lse.data(), z.data(), t.data(), 1, 1);
  CHECK(loss[0] == 0.f);
}

TEST_CASE("kernels: cross_entropy on x1000 logits (exp would overflow without the max)") {
  // Logits ~ 1000, outliers ~ 1e5: exp(z) overflows float beyond 88, so only the online
  // rescaling by the running max keeps l finite; every term but the max is exp(-hundreds) = 0.
  for (int64_t V : {(int64_t)7, (int64_t)1000})
    for (int64_t N : {(int64_t)3, (int64_t)65}) check_cross_entropy(N, V, 1000.f, 311, " x1000");
  check_cross_entropy(3, kLongRow, 1000.f, 312, " x1000");
  // Logits offset by +1000 with a small spread: a dense softmax at a large magnitude.
  const int64_t N = 3, V = 1000;
  std::vector<float> z = kt::inputs(N * V, 313), dloss = kt::inputs(N, 314);
  for (float& v : z) v = 1000.f + v / 100.f;
  std::vector<int64_t> t = random_indices(N, V, 315);
  check_cross_entropy_forward(z, t, N, V, " +1000");
  check_cross_entropy_backward(z, t, dloss, N, V, " +1000");
}

TEST_CASE("kernels: index_select_rows with repeated indices, device vs cpu (bit-exact)") {
  for (int64_t C : kRowLengths)
    for (int64_t M : kRowCounts) {
      check_index_select(5, M, C, random_indices(M, 5, 401), "");
      check_index_select(1, M, C, std::vector<int64_t>(M, 0), " all from row 0");
    }
}

TEST_CASE("kernels: index_add_rows with repeated indices, device vs cpu (bit-exact: in row order)") {
  for (int64_t C : kRowLengths)
    for (int64_t M : kRowCounts) {
      // 7 destination rows for up to 65 source rows: most indices repeat, some rows untouched
      std::vector<int64_t> idx = random_indices(M, 7, 411);
      check_index_add(7, M, C, idx, true, "");
      check_index_add(7, M, C, idx, false, "");
    }
  // Every source row into the same destination row: the most contended atomics.
  for (int64_t C : {(int64_t)1, (int64_t)33})
    for (bool integers : {true, false})
      check_index_add(3, 65, C, std::vector<int64_t>(65, 1), integers, " all into row 1");
}

TEST_CASE("kernels: topk_rows and topk_backward device vs cpu, k = 1, 2, C") {
  for (int64_t C : kRowLengths)
    for (int64_t N : kRowCounts) {
      std::vector<float> x = kt::inputs(N * C, 501);
      for (int64_t k : {(int64_t)1, (int64_t)2})
        if (k <= C) check_topk_both(x, N, C, k, "");
      // k = C, a full sort of the row: k rounds of a warp argmax, so keep it to short rows
      if (C <= 257 && N <= 3) check_topk_both(x, N, C, C, "");
    }
  check_topk_both(kt::inputs(3 * 1000, 502, 1000.f), 3, 1000, 2, " x1000");
  check_topk_both(kt::inputs(3 * 33, 503, 1000.f), 3, 33, 33, " x1000");
}

TEST_CASE("kernels: topk_rows with ties takes the lower column first, as the cpu kernel") {
  // Small integers 0..4: the max repeats in many lanes; k = C sorts the whole row, so every
  // tie's order is checked.
  for (int64_t C : {(int64_t)31, (int64_t)33, (int64_t)257})
    for (int64_t N : {(int64_t)1, (int64_t)3}) {
      std::vector<float> x = tied_inputs(N * C, 511);
      check_topk_both(x, N, C, 1, " ties");
      check_topk_both(x, N, C, 2, " ties");
      check_topk_both(x, N, C, C, " ties");
    }
  check_topk_both(tied_inputs(65 * 1000, 512), 65, 1000, 2, " ties");
  // All equal, with -inf and +inf at the ends: ties everywhere, infinities ordered.
  std::vector<float> x(40, 1.f);
  x[0] = -INFINITY, x[39] = INFINITY, x[7] = -INFINITY;
  check_topk_both(x, 1, 40, 40, " equal and inf");
  // What the comparisons rely on: the cpu kernel's order on a hand-made row.
  std::vector<float> row = {1.f, 3.f, 2.f, 3.f, 2.f}, vals(4);
  std::vector<int64_t> idx(4);
  kt::cpu_kernels().topk_rows(vals.data(), idx.data(), row.data(), 1, 5, 4);
  CHECK(vals == std::vector<float>{3.f, 3.f, 2.f, 2.f});
  CHECK(idx == std::vector<int64_t>{1, 3, 2, 4});
}

TEST_CASE("kernels: topk_backward with repeated indices accumulates, device vs cpu") {
  // The kernel's contract is dx[i, idx[i, j]] += dvals[i, j]: repeated columns add up (integer
  // dvals: exact in any order); columns no index names are 0.
  for (int64_t C : {(int64_t)1, (int64_t)5, (int64_t)33})
    for (int64_t N : kRowCounts) {
      const int64_t k = 8;
      check_topk_backward(integer_inputs(N * k, 521), random_indices(N * k, C, 522), N, C, k,
                          " repeated");
    }
}

TEST_CASE("kernels: norm, loss and index kernels beyond one grid (grid-stride loops)") {
  // The row kernels' grid holds at most 8192 rows (2048 blocks of 4 warps), the elementwise
  // grids 2^18 threads: more rows or elements wrap around the grid-stride loop, and each must
  // still be done exactly once. 2^18 fibers a launch: the costliest test of this file.
  const int64_t N = 8193, C = 2;
  check_rmsnorm_forward(kt::inputs(N * C, 601), kt::inputs(C, 602), N, C, " beyond one grid");
  std::vector<float> z = kt::inputs(N * C, 603);
  std::vector<int64_t> t = random_indices(N, C, 604);
  check_cross_entropy_forward(z, t, N, C, " beyond one grid");
  check_topk(z, N, C, 1, " beyond one grid");
  const int64_t M = 262147, R = 3;  // 2^18 + 3 elements of one column
  check_index_select(R, M, 1, random_indices(M, R, 605), " beyond one grid");
  check_index_add(R, M, 1, random_indices(M, R, 606), true, " beyond one grid");
}

}  // TEST_SUITE
