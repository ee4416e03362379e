// Every op of common/core/ops.h, three ways:
//  (a) forward against a naive loop written here (accumulating in double),
//  (b) backward against central finite differences (ff::gradcheck),
//  (c) a planted bug in each hand-written backward (wrong sign, missing term) is caught,
// plus argument errors that name the op.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <complex>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"

using namespace ff;

namespace {

// ---------------------------------------------------------------------------
// tolerances (forward checks; backward checks use gradcheck's documented defaults)

// One or two float32 roundings (2^-24 ~ 6e-8 relative each) against a double reference:
// +-*/ and affine ops, rmsnorm (x * rstd * w). 1e-6 is ~16 ulps: slack for a couple of
// roundings, while a wrong formula, index or broadcast gives errors of 1e-2 or more.
constexpr double kRoundRtol = 1e-6;
// float32 libm exp/log/sqrt are within ~1 ulp; sigmoid and silu add 2-3 roundings. 2e-6 (~32
// ulps) still fails any real mistake.
constexpr double kTranscendentalRtol = 2e-6;
// Sums and matmuls: the cpu reductions accumulate in double and round once; the cpu matmul
// (version 2 of kernels/cpu/matmul.cpp) accumulates in float, and a float32 accumulation over
// K <= 13 terms of size ~1 may drift by ~K ulps of the partial sums (~1e-6); 1e-5 absolute
// allows it and is still far below a missing or extra term (~1).
constexpr double kSumAtol = 1e-5;
constexpr double kSumRtol = 1e-5;
// softmax: float exp of (x - max), a double row sum, one scale. Relative error a few ulps;
// 1e-5 relative, and an absolute floor far below float's normal range for entries that
// underflow to 0 in float32 but not in double.
constexpr double kSoftmaxRtol = 1e-5;
constexpr double kUnderflowAtol = 1e-30;
// log_softmax and cross_entropy subtract a float32 log-sum-exp of the size of the row's
// largest |x|: its rounding is half an ulp of that size, so the absolute tolerance is a few
// ulps of max|x| (1000x rows get ~5e-4, ordinary rows ~1e-6).
constexpr double kUlpsOfInput = 4.0;
// index_add: repeated indices add 2-3 float32 terms one by one; each += rounds by half an ulp
// of a partial sum of size <= ~5.
constexpr double kAccumAtol = 2e-6;

double input_scale_atol(const Tensor& x) {
  double m = 1.0;
  for (float v : x.to_vector())
    if (std::isfinite(v)) m = std::max(m, (double)std::fabs(v));
  return kUlpsOfInput * FLT_EPSILON * m;
}

// ---------------------------------------------------------------------------
// helpers

using Vec = std::vector<double>;

Vec dv(const Tensor& t) {
  std::vector<float> f = t.to_vector();
  return Vec(f.begin(), f.end());
}

Tensor tf(const Vec& v, const Shape& s) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); i++) f[i] = (float)v[i];
  return Tensor::from_vector(f, s);
}

Tensor rnd(const Shape& s, uint64_t seed, float mult = 1.f) {
  std::vector<float> v = randn(s, seed).to_vector();
  for (float& x : v) x *= mult;
  return Tensor::from_vector(v, s);
}

Tensor leaf(Tensor t) {
  t.requires_grad_();
  return t;
}

// Positive inputs for log and sqrt (and divisors): uniform in [0.5, 2).
Tensor positive(const Shape& s, uint64_t seed) { return rand_uniform(s, seed, 0.5f, 2.f); }

// Away from 0 by at least 0.1 (for relu's kink and for divisors of either sign).
Tensor away_from_zero(const Shape& s, uint64_t seed, float margin = 0.1f) {
  std::vector<float> v = randn(s, seed).to_vector();
  for (float& x : v) x = x >= 0 ? margin + x : -margin + x;
  return Tensor::from_vector(v, s);
}

// All values distinct and at least 0.05 apart, in a scrambled order: gradcheck's steps of
// eps = 0.01 never change which element is the max / in the top k.
constexpr float kDistinctSpacing = 0.05f;
Tensor distinct(const Shape& s, uint64_t seed) {
  std::vector<float> key = randn(s, seed).to_vector();
  std::vector<size_t> order(key.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key[a] < key[b]; });
  std::vector<float> v(key.size());
  for (size_t rank = 0; rank < order.size(); rank++)
    v[order[rank]] = kDistinctSpacing * ((float)rank - (float)order.size() / 2);
  return Tensor::from_vector(v, s);
}

void check_close(const Tensor& got, const Tensor& want, double atol, double rtol) {
  REQUIRE(got.shape() == want.shape());
  Diff d = compare(got, want, atol, rtol);
  CHECK_MESSAGE(d.pass, "max abs " << d.max_abs << ", max rel " << d.max_rel << " (atol " << atol
                                   << ", rtol " << rtol << ")");
}

void check_exact(const Tensor& got, const Tensor& want) {
  REQUIRE(got.shape() == want.shape());
  CHECK(bitwise_equal(got, want));
}

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

void check_grad(const Fn& f, const std::vector<Tensor>& inputs, const GradcheckOptions& opt = {}) {
  GradcheckResult r = gradcheck(f, inputs, opt);
  CHECK_MESSAGE(r.pass, "gradcheck: " << r.worst << " (max abs err " << r.max_abs_err << ")");
}

// N-d index helpers for the naive references.
std::vector<int64_t> unravel(int64_t flat, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (size_t d = s.size(); d-- > 0;) {
    idx[d] = flat % s[d];
    flat /= s[d];
  }
  return idx;
}
int64_t ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t flat = 0;
  for (size_t d = 0; d < s.size(); d++) flat = flat * s[d] + idx[d];
  return flat;
}

const std::vector<Shape> kMatrixShapes = {{3, 5}, {1, 1}, {7, 13}, {2, 3, 4}};

// Runs `call` and checks it throws ff::Error whose message names `op`.
void check_error_names(const std::string& op, const std::function<void()>& call) {
  CAPTURE(op);
  bool threw = false;
  try {
    call();
  } catch (const Error& e) {
    threw = true;
    CHECK_MESSAGE(std::string(e.what()).find(op) != std::string::npos,
                  "message does not name the op: " << e.what());
  } catch (const std::exception& e) {
    FAIL_CHECK("threw something other than ff::Error: " << e.what());
    threw = true;
  }
  CHECK_MESSAGE(threw, "no error thrown");
}

}  // namespace

// ===========================================================================
// elementwise

namespace {
enum class Bc { same, row, col, scalar };
const char* bc_name(Bc k) {
  switch (k) {
    case Bc::same: return "same";
    case Bc::row: return "row";
    case Bc::col: return "col";
    case Bc::scalar: return "scalar";
  }
  return "?";
}
Shape b_shape(const Shape& a, Bc k) {
  switch (k) {
    case Bc::same: return a;
    case Bc::row: return {a.back()};
    case Bc::col: {
      Shape s = a;
      s.back() = 1;
      return s;
    }
    case Bc::scalar: return {1};
  }
  return a;
}
// The element of b that meets a's element at multi-index idx.
int64_t b_index(const std::vector<int64_t>& idx, const Shape& a, Bc k) {
  switch (k) {
    case Bc::same: return ravel(idx, a);
    case Bc::row: return idx.back();
    case Bc::col: {
      std::vector<int64_t> lead(idx.begin(), idx.end() - 1);
      return ravel(lead, Shape(a.begin(), a.end() - 1));
    }
    case Bc::scalar: return 0;
  }
  return 0;
}

struct BinaryCase {
  const char* name;
  Tensor (*op)(const Tensor&, const Tensor&);
  double (*ref)(double, double);
};
const BinaryCase kBinary[] = {
    {"add", ff::add, [](double a, double b) { return a + b; }},
    {"sub", ff::sub, [](double a, double b) { return a - b; }},
    {"mul", ff::mul, [](double a, double b) { return a * b; }},
    {"div", ff::div, [](double a, double b) { return a / b; }},
};
}  // namespace

TEST_CASE("ops: add/sub/mul/div, every broadcast kind: forward and gradients") {
  uint64_t seed = 100;
  for (const BinaryCase& c : kBinary)
    for (Bc k : {Bc::same, Bc::row, Bc::col, Bc::scalar})
      for (const Shape& as : kMatrixShapes) {
        CAPTURE(c.name);
        CAPTURE(bc_name(k));
        CAPTURE(shape_str(as));
        Shape bs = b_shape(as, k);
        Tensor a = leaf(rnd(as, seed++));
        // divisors stay away from 0 so a / b and its gradient stay moderate
        Tensor b = leaf(std::string(c.name) == "div" ? away_from_zero(bs, seed++, 0.5f)
                                                     : rnd(bs, seed++));
        Vec av = dv(a), bv = dv(b), want(av.size());
        for (int64_t i = 0; i < a.numel(); i++)
          want[(size_t)i] = c.ref(av[(size_t)i], bv[(size_t)b_index(unravel(i, as), as, k)]);
        check_close(c.op(a, b), tf(want, as), 0.0, kRoundRtol);
        check_grad([&](const std::vector<Tensor>& in) { return c.op(in[0], in[1]); }, {a, b});
      }
}

TEST_CASE("ops: operators +, -, *, / and unary - are the named ops") {
  Tensor a = rnd({3, 5}, 1), b = away_from_zero({3, 5}, 2);
  check_exact(a + b, add(a, b));
  check_exact(a - b, sub(a, b));
  check_exact(a * b, mul(a, b));
  check_exact(a / b, ff::div(a, b));
  check_exact(a * 2.5f, scale(a, 2.5f));
  check_exact(2.5f * a, scale(a, 2.5f));
  check_exact(-a, neg(a));
}

namespace {
struct UnaryCase {
  const char* name;  // also the name its backward is recorded under
  Tensor (*op)(const Tensor&);
  double (*ref)(double);
  Tensor (*input)(const Shape&, uint64_t);
  double rtol;
};
Tensor normal_input(const Shape& s, uint64_t seed) { return randn(s, seed); }
Tensor kink_free_input(const Shape& s, uint64_t seed) { return away_from_zero(s, seed); }
double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }
const UnaryCase kUnary[] = {
    {"scale", [](const Tensor& x) { return scale(x, -2.5f); }, [](double x) { return -2.5 * x; },
     normal_input, kRoundRtol},
    {"add_scalar", [](const Tensor& x) { return add_scalar(x, 0.75f); },
     [](double x) { return x + 0.75; }, normal_input, kRoundRtol},
    {"neg", ff::neg, [](double x) { return -x; }, normal_input, 0.0},
    {"exp", ff::exp, [](double x) { return std::exp(x); }, normal_input, kTranscendentalRtol},
    {"log", ff::log, [](double x) { return std::log(x); }, positive, kTranscendentalRtol},
    {"sqrt", ff::sqrt, [](double x) { return std::sqrt(x); }, positive, kTranscendentalRtol},
    {"sigmoid", ff::sigmoid, sigmoid_ref, normal_input, kTranscendentalRtol},
    {"silu", ff::silu, [](double x) { return x * sigmoid_ref(x); }, normal_input,
     kTranscendentalRtol},
    {"relu", ff::relu, [](double x) { return x > 0 ? x : 0.0; }, kink_free_input, 0.0},
};
}  // namespace

TEST_CASE("ops: scale, add_scalar and unary ops: forward and gradients") {
  uint64_t seed = 200;
  for (const UnaryCase& c : kUnary)
    for (const Shape& s : kMatrixShapes) {
      CAPTURE(c.name);
      CAPTURE(shape_str(s));
      Tensor x = leaf(c.input(s, seed++));
      Vec xv = dv(x), want;
      for (double v : xv) want.push_back(c.ref(v));
      Tensor y = c.op(x);
      check_close(y, tf(want, s), 0.0, c.rtol);
      CHECK(y.impl()->grad_fn->name == c.name);
      check_grad([&](const std::vector<Tensor>& in) { return c.op(in[0]); }, {x});
    }
  // Wide inputs: sigmoid saturates without overflow, exp of a large argument is inf, not NaN.
  Tensor wide = Tensor::from_vector({-100.f, -30.f, 0.f, 30.f, 100.f}, {5});
  for (float v : sigmoid(wide).to_vector()) CHECK((v >= 0.f && v <= 1.f));
  for (float v : silu(wide).to_vector()) CHECK(std::isfinite(v));
  CHECK(std::isinf(ff::exp(wide).to_vector()[4]));
  CHECK(ff::relu(Tensor::from_vector({0.f}, {1})).item() == 0.f);
}

TEST_CASE("ops: masked_fill broadcasts the mask over leading dims; no gradient where masked") {
  Shape xs{2, 3, 5};
  Tensor x = leaf(rnd(xs, 300));
  for (Shape ms : {Shape{5}, Shape{3, 5}, Shape{2, 3, 5}})
    for (float value : {-7.f, -std::numeric_limits<float>::infinity()}) {
      CAPTURE(shape_str(ms));
      CAPTURE(value);
      std::vector<float> mv;  // a random 0/1 mask
      for (int64_t v : randint(ms, 301 + ms.size(), 2).to_index_vector()) mv.push_back((float)v);
      mv[0] = 1.f;  // at least one masked and one kept position
      mv[1] = 0.f;
      Tensor mask = Tensor::from_vector(mv, ms);
      std::vector<float> xv = x.to_vector(), want(xv.size());
      int64_t m = mask.numel();
      for (int64_t i = 0; i < x.numel(); i++) {
        // the mask element under x's trailing dims: the last m positions of the flat index
        bool masked = mv[(size_t)(i % m)] != 0.f;
        want[(size_t)i] = masked ? value : xv[(size_t)i];
      }
      Tensor y = masked_fill(x, mask, value);
      check_exact(y, Tensor::from_vector(want, xs));
      if (std::isfinite(value))
        check_grad([&](const std::vector<Tensor>& in) { return masked_fill(in[0], mask, value); },
                   {x});
      // gradient of sum(y) is exactly 1 where kept and 0 where masked
      x.zero_grad();
      sum_all(y).backward();
      std::vector<float> g = x.grad().to_vector();
      for (int64_t i = 0; i < x.numel(); i++)
        CHECK(g[(size_t)i] == (mv[(size_t)(i % m)] != 0.f ? 0.f : 1.f));
    }
}

// ===========================================================================
// matmul

TEST_CASE("ops: matmul 2-D, batched, 3-D @ shared 2-D weight: forward and gradients") {
  struct Case {
    Shape a, b;
  };
  const Case cases[] = {
      {{3, 5}, {5, 4}},       {{1, 1}, {1, 1}},       {{7, 13}, {13, 3}},
      {{2, 3, 5}, {2, 5, 4}}, {{2, 3, 5}, {5, 4}},    {{2, 2, 3, 4}, {2, 2, 4, 3}},
      {{2, 2, 3, 4}, {4, 3}}, {{1, 7, 1}, {1, 1, 6}},
  };
  uint64_t seed = 400;
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.a));
    CAPTURE(shape_str(c.b));
    Tensor a = leaf(rnd(c.a, seed++)), b = leaf(rnd(c.b, seed++));
    int64_t M = c.a[c.a.size() - 2], K = c.a.back(), N = c.b.back();
    int64_t B = a.numel() / (M * K);
    bool shared = c.b.size() == 2;
    Vec av = dv(a), bv = dv(b), want((size_t)(B * M * N));
    for (int64_t z = 0; z < B; z++)
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          double s = 0;
          for (int64_t p = 0; p < K; p++)
            s += av[(size_t)((z * M + i) * K + p)] *
                 bv[(size_t)((shared ? 0 : z * K * N) + p * N + j)];
          want[(size_t)((z * M + i) * N + j)] = s;
        }
    Shape os(c.a.begin(), c.a.end() - 1);
    os.push_back(N);
    check_close(matmul(a, b), tf(want, os), kSumAtol, kSumRtol);
    check_grad([](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }, {a, b});
  }
}

// ===========================================================================
// shape and layout: exact data movement

TEST_CASE("ops: reshape is a copy-free view, with -1 inferred") {
  Tensor x = leaf(rnd({3, 5}, 500));
  struct Case {
    Shape ask, want;
  };
  const Case cases[] = {{{5, 3}, {5, 3}},     {{15}, {15}},         {{-1, 3}, {5, 3}},
                        {{3, -1, 1}, {3, 5, 1}}, {{1, -1}, {1, 15}}, {{-1}, {15}}};
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.ask));
    Tensor y = reshape(x, c.ask);
    CHECK(y.shape() == c.want);
    CHECK(y.to_vector() == x.to_vector());
    CHECK(y.data() == x.data());
    Shape ask = c.ask;
    check_grad([ask](const std::vector<Tensor>& in) { return reshape(in[0], ask); }, {x});
  }
  Tensor x3 = leaf(rnd({2, 3, 4}, 501));
  CHECK(reshape(x3, {4, -1}).shape() == Shape{4, 6});
  CHECK(reshape(Tensor::zeros({0, 3}), {-1, 3}).shape() == Shape{0, 3});
}

TEST_CASE("ops: transpose of several dim pairs on 3-D and 4-D tensors") {
  struct Case {
    Shape s;
    int64_t d0, d1;
  };
  const Case cases[] = {{{2, 3, 4}, 0, 1},    {{2, 3, 4}, 0, 2},    {{2, 3, 4}, 1, 2},
                        {{2, 3, 4}, -1, 0},   {{2, 3, 4, 5}, 0, 3}, {{2, 3, 4, 5}, 1, 2},
                        {{2, 3, 4, 5}, 3, 1}, {{2, 3, 4, 5}, 2, 2}, {{3, 5}, 0, 1}};
  uint64_t seed = 600;
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.s));
    CAPTURE(c.d0);
    CAPTURE(c.d1);
    Tensor x = leaf(rnd(c.s, seed++));
    int64_t n = (int64_t)c.s.size();
    size_t d0 = (size_t)(c.d0 < 0 ? c.d0 + n : c.d0), d1 = (size_t)(c.d1 < 0 ? c.d1 + n : c.d1);
    Shape os = c.s;
    std::swap(os[d0], os[d1]);
    std::vector<float> xv = x.to_vector(), want(xv.size());
    for (int64_t o = 0; o < x.numel(); o++) {
      std::vector<int64_t> idx = unravel(o, os);
      std::swap(idx[d0], idx[d1]);
      want[(size_t)o] = xv[(size_t)ravel(idx, c.s)];
    }
    check_exact(transpose(x, c.d0, c.d1), Tensor::from_vector(want, os));
    int64_t d0a = c.d0, d1a = c.d1;
    check_grad([=](const std::vector<Tensor>& in) { return transpose(in[0], d0a, d1a); }, {x});
  }
}

TEST_CASE("ops: slice along each dim") {
  Shape s{3, 4, 5};
  Tensor x = leaf(rnd(s, 700));
  std::vector<float> xv = x.to_vector();
  for (int64_t dim : {0, 1, 2, -1})
    for (int ri = 0; ri < 4; ri++) {
      size_t d = (size_t)(dim < 0 ? dim + 3 : dim);
      int64_t n = s[d];
      int64_t start = ri == 0 ? 1 : ri == 1 ? 0 : ri == 2 ? n - 1 : 2;
      int64_t end = ri == 0 ? 3 : ri == 1 ? n : ri == 2 ? n : 2;  // last: an empty slice
      CAPTURE(dim);
      CAPTURE(start);
      CAPTURE(end);
      Shape os = s;
      os[d] = end - start;
      std::vector<float> want((size_t)shape_numel(os));
      for (int64_t o = 0; o < shape_numel(os); o++) {
        std::vector<int64_t> idx = unravel(o, os);
        idx[d] += start;
        want[(size_t)o] = xv[(size_t)ravel(idx, s)];
      }
      Tensor y = slice(x, dim, start, end);
      check_exact(y, Tensor::from_vector(want, os));
      if (end > start)
        check_grad([=](const std::vector<Tensor>& in) { return slice(in[0], dim, start, end); },
                   {x});
    }
}

TEST_CASE("ops: concat of three uneven pieces along each dim") {
  Shape base{2, 3, 4};
  uint64_t seed = 800;
  for (int64_t dim : {0, 1, 2, -1}) {
    CAPTURE(dim);
    size_t d = (size_t)(dim < 0 ? dim + 3 : dim);
    std::vector<Tensor> parts;
    std::vector<int64_t> sizes = {1, 3, 2};
    for (int64_t sz : sizes) {
      Shape ps = base;
      ps[d] = sz;
      parts.push_back(leaf(rnd(ps, seed++)));
    }
    Shape os = base;
    os[d] = 6;
    std::vector<float> want((size_t)shape_numel(os));
    for (int64_t o = 0; o < shape_numel(os); o++) {
      std::vector<int64_t> idx = unravel(o, os);
      size_t p = 0;
      while (idx[d] >= sizes[p]) idx[d] -= sizes[p++];
      want[(size_t)o] = parts[p].to_vector()[(size_t)ravel(idx, parts[p].shape())];
    }
    check_exact(concat(parts, dim), Tensor::from_vector(want, os));
    check_grad([dim](const std::vector<Tensor>& in) { return concat(in, dim); }, parts);
  }
  // one piece is the identity; an empty piece adds nothing
  Tensor a = rnd({2, 3}, 1);
  check_exact(concat({a}, 0), a);
  check_exact(concat({a, Tensor::zeros({0, 3})}, 0), a);
}

// ===========================================================================
// reductions

TEST_CASE("ops: sum, mean, max along each dim, with and without keepdim; sum_all") {
  uint64_t seed = 900;
  for (Shape s : {Shape{3, 4, 5}, Shape{7, 13}, Shape{1, 1}})
    for (int64_t dim = -1; dim < (int64_t)s.size(); dim++)
      for (bool keepdim : {false, true}) {
        CAPTURE(shape_str(s));
        CAPTURE(dim);
        CAPTURE(keepdim);
        size_t d = (size_t)(dim < 0 ? dim + (int64_t)s.size() : dim);
        Shape rs = s;  // reduced shape with the dim kept as 1
        rs[d] = 1;
        Shape os = rs;
        if (!keepdim) os.erase(os.begin() + (int64_t)d);
        Tensor x = leaf(rnd(s, seed++));
        Tensor xd = leaf(distinct(s, seed++));
        Vec xv = dv(x), xdv = dv(xd);
        Vec want_sum((size_t)shape_numel(rs), 0.0);
        Vec want_max((size_t)shape_numel(rs), -INFINITY);
        for (int64_t i = 0; i < x.numel(); i++) {
          std::vector<int64_t> idx = unravel(i, s);
          idx[d] = 0;
          size_t o = (size_t)ravel(idx, rs);
          want_sum[o] += xv[(size_t)i];
          want_max[o] = std::max(want_max[o], xdv[(size_t)i]);
        }
        Vec want_mean = want_sum;
        for (double& v : want_mean) v /= (double)s[d];
        check_close(sum(x, dim, keepdim), tf(want_sum, os), kSumAtol, kSumRtol);
        check_close(mean(x, dim, keepdim), tf(want_mean, os), kSumAtol, kSumRtol);
        check_exact(ff::max(xd, dim, keepdim), tf(want_max, os));
        check_grad([=](const std::vector<Tensor>& in) { return sum(in[0], dim, keepdim); }, {x});
        check_grad([=](const std::vector<Tensor>& in) { return mean(in[0], dim, keepdim); }, {x});
        check_grad([=](const std::vector<Tensor>& in) { return ff::max(in[0], dim, keepdim); },
                   {xd});
      }
  // max's gradient goes to the first of equal maxima, as documented
  Tensor tie = leaf(Tensor::from_vector({1, 3, 3, 2, 3}, {1, 5}));
  sum_all(ff::max(tie, 1)).backward();
  CHECK(tie.grad().to_vector() == std::vector<float>{0, 1, 0, 0, 0});

  Tensor x = leaf(rnd({7, 13}, 950));
  double total = 0;
  for (double v : dv(x)) total += v;
  Tensor t = sum_all(x);
  CHECK(t.shape() == Shape{});  // 0-d, as ops.h documents
  CHECK(t.item() == doctest::Approx(total).epsilon(kSumRtol));
  check_grad([](const std::vector<Tensor>& in) { return sum_all(in[0]); }, {x});
}

// ===========================================================================
// row ops

namespace {
// x with a row of 1000x magnitude and a row holding -inf entries, for softmax-like ops.
Tensor hard_rows(uint64_t seed) {
  std::vector<float> v = randn({4, 5}, seed).to_vector();
  for (size_t j = 5; j < 10; j++) v[j] *= 1000.f;   // row 1: large magnitude
  v[10] = v[12] = -INFINITY;                         // row 2: two -inf entries
  for (size_t j = 15; j < 20; j++) v[j] *= -1000.f;  // row 3: large, and
  v[19] = -INFINITY;                                 //        one -inf
  return Tensor::from_vector(v, {4, 5});
}
Vec softmax_ref(const Vec& x, int64_t C, bool log_space) {
  Vec y(x.size());
  for (size_t r = 0; r < x.size() / (size_t)C; r++) {
    const double* xr = x.data() + r * C;
    double m = -INFINITY, l = 0;
    for (int64_t j = 0; j < C; j++) m = std::max(m, xr[j]);
    for (int64_t j = 0; j < C; j++) l += std::exp(xr[j] - m);
    for (int64_t j = 0; j < C; j++)
      y[r * C + j] = log_space ? xr[j] - m - std::log(l) : std::exp(xr[j] - m) / l;
  }
  return y;
}
}  // namespace

TEST_CASE("ops: softmax and log_softmax: forward (incl. 1000x rows and -inf), gradients") {
  uint64_t seed = 1000;
  std::vector<Tensor> inputs;
  for (const Shape& s : kMatrixShapes) inputs.push_back(leaf(rnd(s, seed++)));
  inputs.push_back(leaf(rnd({3, 7}, seed++, 1000.f)));
  inputs.push_back(leaf(hard_rows(seed++)));
  for (const Tensor& x : inputs) {
    CAPTURE(shape_str(x.shape()));
    int64_t C = x.size(-1);
    check_close(softmax(x), tf(softmax_ref(dv(x), C, false), x.shape()), kUnderflowAtol,
                kSoftmaxRtol);
    check_close(log_softmax(x), tf(softmax_ref(dv(x), C, true), x.shape()), input_scale_atol(x),
                kRoundRtol);
  }
  // Gradients: ordinary rows with the defaults. 1000x rows are flat where saturated, so a wide
  // step (eps = 1) stays exact there while float32 rounding of outputs ~1e3 (6e-5) over 2 eps
  // stays below atol.
  GradcheckOptions wide;
  wide.eps = 1.f;
  for (size_t i = 0; i < 4; i++) {
    check_grad([](const std::vector<Tensor>& in) { return softmax(in[0]); }, {inputs[i]});
    check_grad([](const std::vector<Tensor>& in) { return log_softmax(in[0]); }, {inputs[i]});
  }
  check_grad([](const std::vector<Tensor>& in) { return softmax(in[0]); }, {inputs[4]}, wide);
  check_grad([](const std::vector<Tensor>& in) { return log_softmax(in[0]); }, {inputs[4]}, wide);

  // -inf entries get exactly zero gradient through softmax, and no NaN appears anywhere.
  Tensor h = inputs[5];
  h.zero_grad();
  softmax(h).backward(rnd(h.shape(), 7));
  std::vector<float> hv = h.to_vector(), g = h.grad().to_vector();
  for (size_t i = 0; i < g.size(); i++) {
    CHECK(std::isfinite(g[i]));
    if (std::isinf(hv[i])) CHECK(g[i] == 0.f);
  }
  h.zero_grad();
  log_softmax(h).backward(rnd(h.shape(), 8));
  for (float v : h.grad().to_vector()) CHECK(std::isfinite(v));
}

TEST_CASE("ops: rmsnorm over the last dim: forward and gradients of x and weight") {
  uint64_t seed = 1100;
  const float eps = 1e-5f;
  for (const Shape& s : kMatrixShapes) {
    CAPTURE(shape_str(s));
    int64_t C = s.back();
    Tensor x = leaf(rnd(s, seed++));
    Tensor w = leaf(add_scalar(rnd({C}, seed++, 0.3f), 1.f).detach());
    Vec xv = dv(x), wv = dv(w), want(xv.size());
    for (size_t r = 0; r < xv.size() / (size_t)C; r++) {
      double ss = 0;
      for (int64_t j = 0; j < C; j++) ss += xv[r * C + j] * xv[r * C + j];
      double rstd = 1.0 / std::sqrt(ss / (double)C + eps);
      for (int64_t j = 0; j < C; j++) want[r * C + j] = xv[r * C + j] * rstd * wv[(size_t)j];
    }
    check_close(rmsnorm(x, w, eps), tf(want, s), 0.0, kRoundRtol);
    check_grad([eps](const std::vector<Tensor>& in) { return rmsnorm(in[0], in[1], eps); },
               {x, w});
  }
  // A zero row stays zero (eps keeps rstd finite); eps = 0 on it is the user's choice.
  Tensor z = Tensor::zeros({2, 4});
  for (float v : rmsnorm(z, Tensor::full({4}, 1.f)).to_vector()) CHECK(v == 0.f);
}

TEST_CASE("ops: cross_entropy: mean of -log softmax at the target, incl. 1000x logits") {
  uint64_t seed = 1200;
  struct Case {
    Shape s;
    float mult;
  };
  const Case cases[] = {{{3, 5}, 1.f}, {{1, 1}, 1.f}, {{7, 13}, 1.f}, {{6, 9}, 1000.f}};
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.s));
    CAPTURE(c.mult);
    int64_t N = c.s[0], V = c.s[1];
    Tensor logits = leaf(rnd(c.s, seed++, c.mult));
    Tensor targets = randint({N}, seed++, V);
    Vec z = dv(logits);
    std::vector<int64_t> t = targets.to_index_vector();
    Vec lsm = softmax_ref(z, V, true);
    double want = 0;
    for (int64_t r = 0; r < N; r++) want -= lsm[(size_t)(r * V + t[(size_t)r])];
    want /= (double)N;
    Tensor loss = cross_entropy(logits, targets);
    CHECK(loss.numel() == 1);
    check_close(reshape(loss, {1}), tf({want}, {1}), input_scale_atol(logits), kRoundRtol);
    GradcheckOptions opt;
    // 1000x logits: the loss is ~1e3, so its float32 rounding (6e-5) over 2 eps = 0.02 would
    // swamp atol; the softmax is saturated (linear in the logits) so eps = 1 is still exact.
    if (c.mult > 1.f) opt.eps = 1.f;
    check_grad([targets](const std::vector<Tensor>& in) { return cross_entropy(in[0], targets); },
               {logits}, opt);
  }
}

TEST_CASE("ops: embedding, index_select and index_add, with repeated indices") {
  Tensor weight = leaf(rnd({7, 5}, 1300));
  Tensor idx2d = Tensor::from_indices({3, 0, 3, 6, 1, 3}, {2, 3});
  std::vector<float> wv = weight.to_vector();
  std::vector<int64_t> iv = idx2d.to_index_vector();
  std::vector<float> want;
  for (int64_t i : iv)
    for (int64_t j = 0; j < 5; j++) want.push_back(wv[(size_t)(i * 5 + j)]);
  check_exact(embedding(weight, idx2d), Tensor::from_vector(want, {2, 3, 5}));
  check_grad([idx2d](const std::vector<Tensor>& in) { return embedding(in[0], idx2d); }, {weight});

  Tensor idx = Tensor::from_indices({3, 0, 3, 6, 1, 3, 5, 0}, {8});
  want.clear();
  for (int64_t i : idx.to_index_vector())
    for (int64_t j = 0; j < 5; j++) want.push_back(wv[(size_t)(i * 5 + j)]);
  check_exact(index_select(weight, idx), Tensor::from_vector(want, {8, 5}));
  check_grad([idx](const std::vector<Tensor>& in) { return index_select(in[0], idx); }, {weight});

  Tensor base = leaf(rnd({7, 5}, 1301)), src = leaf(rnd({8, 5}, 1302));
  Tensor base_before = base.clone();
  Vec sum_want = dv(base), sv = dv(src);
  std::vector<int64_t> ix = idx.to_index_vector();
  for (size_t i = 0; i < ix.size(); i++)
    for (int64_t j = 0; j < 5; j++) sum_want[(size_t)(ix[i] * 5 + j)] += sv[i * 5 + (size_t)j];
  check_close(index_add(base, idx, src), tf(sum_want, {7, 5}), kAccumAtol, kRoundRtol);
  check_grad([idx](const std::vector<Tensor>& in) { return index_add(in[0], idx, in[1]); },
             {base, src});
  CHECK(bitwise_equal(base, base_before));  // index_add writes a new tensor, not its base
}

TEST_CASE("ops: topk: descending, ties to the lower index, k = 1..C; values' gradients") {
  auto reference = [](const std::vector<float>& x, int64_t N, int64_t C, int64_t k,
                      std::vector<float>* vals, std::vector<int64_t>* idx) {
    for (int64_t r = 0; r < N; r++) {
      std::vector<int64_t> order(C);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return x[(size_t)(r * C + a)] > x[(size_t)(r * C + b)];
      });
      for (int64_t j = 0; j < k; j++) {
        vals->push_back(x[(size_t)(r * C + order[(size_t)j])]);
        idx->push_back(order[(size_t)j]);
      }
    }
  };
  std::vector<Tensor> inputs = {
      distinct({3, 6}, 1400), distinct({2, 3, 5}, 1401), distinct({1, 1}, 1402),
      // ties everywhere: several equal maxima, equal values straddling the k boundary
      Tensor::from_vector({1, 3, 3, 2, 3, 0, 2, 2, 2, 2, 5, -1, 5, 5, -1}, {3, 5})};
  for (const Tensor& x0 : inputs) {
    Tensor x = leaf(x0);
    int64_t C = x.size(-1), N = x.numel() / C;
    for (int64_t k = 1; k <= C; k++) {
      CAPTURE(shape_str(x.shape()));
      CAPTURE(k);
      std::vector<float> wv;
      std::vector<int64_t> wi;
      reference(x.to_vector(), N, C, k, &wv, &wi);
      Shape os = x.shape();
      os.back() = k;
      auto [vals, idx] = topk(x, k);
      check_exact(vals, Tensor::from_vector(wv, os));
      check_exact(idx, Tensor::from_indices(wi, os));
      CHECK_FALSE(idx.requires_grad());
      if (&x0 != &inputs.back())  // finite differences need a gap between kept and dropped
        check_grad([k](const std::vector<Tensor>& in) { return topk(in[0], k).first; }, {x});
    }
  }
}

// ===========================================================================
// positions

TEST_CASE("ops: rope rotates pairs by position * theta^(-2i/D): forward and gradients") {
  // The reference, written independently of the kernel: pair (x[2i], x[2i+1]) as the complex
  // number x[2i] + i x[2i+1] times e^(i a), a = pos theta^(-2i/D) (torch.polar in DeepSeek-V3's
  // apply_rotary_emb), all in double. The cpu kernel computes in double and rounds once: within
  // half an ulp of the result, u rho (rho = |x[2i]| + |x[2i+1]| <= ~9 for these randn inputs:
  // 5e-7), plus 12 2^-53 pos rho for its double angle (1e-9 at position 1e5). 1e-6 absolute;
  // a wrong frequency, pair layout (e.g. the half-split layout of GPT-NeoX) or sign is off by O(1).
  constexpr double kRopeAtol = 1e-6;
  struct Case {
    Shape shape;
    std::vector<int64_t> pos;  // explicit, unsorted, repeated: never the row index
    float theta;
  } cases[] = {
      {{4, 8}, {7, 0, 100000, 7}, 10000.f},
      {{3, 2, 6}, {5, 12, 0}, 10000.f},
      {{1, 2}, {3}, 10000.f},
      {{5, 2, 3, 4}, {65535, 1, 2, 100000, 9}, 500000.f},
  };
  uint64_t seed = 1500;
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.shape));
    CAPTURE(c.theta);
    const int64_t T = c.shape[0], D = c.shape.back();
    const int64_t rows_per_token = shape_numel(c.shape) / (T * D);  // heads sharing a position
    Tensor x = leaf(rnd(c.shape, seed++));
    Tensor pos = Tensor::from_indices(c.pos, {T});
    Vec xv = dv(x), want(xv.size());
    for (int64_t t = 0; t < T; t++)
      for (int64_t m = 0; m < rows_per_token; m++)
        for (int64_t i = 0; i < D / 2; i++) {
          double inv_freq = std::pow((double)c.theta, -2.0 * (double)i / (double)D);
          double a = (double)c.pos[(size_t)t] * inv_freq;
          size_t k = (size_t)((t * rows_per_token + m) * D + 2 * i);
          std::complex<double> z = std::complex<double>(xv[k], xv[k + 1]) * std::polar(1.0, a);
          want[k] = z.real();
          want[k + 1] = z.imag();
        }
    Tensor y = rope(x, pos, c.theta);
    check_close(y, tf(want, c.shape), kRopeAtol, 0.0);
    CHECK(y.impl()->grad_fn->name == "rope");
    // rope is linear in x: central differences are exact up to float rounding
    float theta = c.theta;
    check_grad([pos, theta](const std::vector<Tensor>& in) { return rope(in[0], pos, theta); }, {x});
  }
  // the default theta is DeepSeek-V3's 10000
  Tensor x = rnd({2, 4}, seed++), pos = Tensor::from_indices({3, 100000}, {2});
  check_exact(rope(x, pos), rope(x, pos, 10000.f));
  // positions get no gradient, and an empty batch of tokens is fine
  Tensor xl = leaf(rnd({2, 4}, seed++));
  sum_all(rope(xl, pos)).backward();
  CHECK(xl.grad().defined());
  CHECK_FALSE(pos.grad().defined());
  CHECK(rope(Tensor::zeros({0, 3, 4}), Tensor::from_indices({}, {0})).shape() == Shape{0, 3, 4});
}

// ===========================================================================
// planted bugs: every hand-written backward, wrong sign and missing term

namespace {
struct OpCase {
  std::string name;  // the name passed to record() in common/core/ops.cpp
  Fn f;
  std::vector<Tensor> inputs;
  GradcheckOptions opt;
};

std::vector<OpCase> op_cases() {
  uint64_t s = 2000;
  auto R = [&](const Shape& sh) { return leaf(rnd(sh, s++)); };
  Tensor mask = Tensor::from_vector({1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0}, {3, 5});
  Tensor idx = Tensor::from_indices({3, 0, 3, 5, 1, 3, 2, 0}, {8});
  Tensor targets = randint({7}, s++, 13);
  Tensor positions = Tensor::from_indices({100000, 0, 17}, {3});
  return {
      {"add", [](auto& in) { return add(in[0], in[1]); }, {R({3, 5}), R({5})}, {}},
      {"sub", [](auto& in) { return sub(in[0], in[1]); }, {R({3, 5}), R({3, 1})}, {}},
      {"mul", [](auto& in) { return mul(in[0], in[1]); }, {R({3, 5}), R({3, 5})}, {}},
      {"div", [](auto& in) { return ff::div(in[0], in[1]); },
       {R({3, 5}), leaf(away_from_zero({5}, s++, 0.5f))}, {}},
      {"scale", [](auto& in) { return scale(in[0], 1.5f); }, {R({3, 5})}, {}},
      {"add_scalar", [](auto& in) { return add_scalar(in[0], 2.f); }, {R({3, 5})}, {}},
      {"neg", [](auto& in) { return neg(in[0]); }, {R({3, 5})}, {}},
      {"exp", [](auto& in) { return ff::exp(in[0]); }, {R({3, 5})}, {}},
      {"log", [](auto& in) { return ff::log(in[0]); }, {leaf(positive({3, 5}, s++))}, {}},
      {"sqrt", [](auto& in) { return ff::sqrt(in[0]); }, {leaf(positive({3, 5}, s++))}, {}},
      {"sigmoid", [](auto& in) { return sigmoid(in[0]); }, {R({3, 5})}, {}},
      {"silu", [](auto& in) { return silu(in[0]); }, {R({3, 5})}, {}},
      {"relu", [](auto& in) { return relu(in[0]); }, {leaf(away_from_zero({3, 5}, s++))}, {}},
      {"masked_fill", [mask](auto& in) { return masked_fill(in[0], mask, -3.f); },
       {R({2, 3, 5})}, {}},
      {"matmul", [](auto& in) { return matmul(in[0], in[1]); }, {R({2, 3, 5}), R({5, 4})}, {}},
      {"reshape", [](auto& in) { return reshape(in[0], {5, -1}); }, {R({3, 5})}, {}},
      {"transpose", [](auto& in) { return transpose(in[0], 0, 2); }, {R({2, 3, 4})}, {}},
      {"slice", [](auto& in) { return slice(in[0], 1, 1, 3); }, {R({3, 4, 5})}, {}},
      {"concat", [](auto& in) { return concat(in, 1); }, {R({2, 1, 3}), R({2, 3, 3}), R({2, 2, 3})},
       {}},
      {"sum", [](auto& in) { return sum(in[0], 1); }, {R({3, 4, 5})}, {}},
      {"max", [](auto& in) { return ff::max(in[0], 2, true); }, {leaf(distinct({3, 4, 5}, s++))},
       {}},
      {"softmax", [](auto& in) { return softmax(in[0]); }, {R({4, 7})}, {}},
      {"log_softmax", [](auto& in) { return log_softmax(in[0]); }, {R({4, 7})}, {}},
      {"rmsnorm", [](auto& in) { return rmsnorm(in[0], in[1]); }, {R({3, 5}), R({5})}, {}},
      {"cross_entropy", [targets](auto& in) { return cross_entropy(in[0], targets); },
       {R({7, 13})}, {}},
      {"index_select", [idx](auto& in) { return index_select(in[0], idx); }, {R({6, 4})}, {}},
      {"index_add", [idx](auto& in) { return index_add(in[0], idx, in[1]); },
       {R({6, 4}), R({8, 4})}, {}},
      {"topk", [](auto& in) { return topk(in[0], 3).first; }, {leaf(distinct({3, 6}, s++))}, {}},
      {"rope", [positions](auto& in) { return rope(in[0], positions); }, {R({3, 2, 6})}, {}},
  };
}
}  // namespace

TEST_CASE("ops: a planted wrong sign in any backward fails gradcheck; without it, it passes") {
  for (OpCase& c : op_cases()) {
    CAPTURE(c.name);
    {
      Tensor out = c.f(c.inputs);
      REQUIRE(out.impl()->grad_fn != nullptr);
      CHECK(out.impl()->grad_fn->name == c.name);  // the bug below lands on this op
    }
    CHECK(gradcheck(c.f, c.inputs, c.opt).pass);
    testing::PlantedBug bug(c.name, testing::Bug::flip_sign);
    CHECK_FALSE(gradcheck(c.f, c.inputs, c.opt).pass);
  }
}

TEST_CASE("ops: a dropped gradient term in two-input ops fails gradcheck") {
  for (OpCase& c : op_cases()) {
    if (c.name != "matmul" && c.name != "mul" && c.name != "div" && c.name != "rmsnorm" &&
        c.name != "index_add")
      continue;
    CAPTURE(c.name);
    REQUIRE(c.inputs.size() == 2);
    CHECK(gradcheck(c.f, c.inputs, c.opt).pass);
    testing::PlantedBug bug(c.name, testing::Bug::drop_first_input);
    CHECK_FALSE(gradcheck(c.f, c.inputs, c.opt).pass);
    // The second input's gradient is still right: only the dropped term is wrong.
    Tensor keep_first = c.inputs[0].detach();
    std::vector<Tensor> only_second = {keep_first, c.inputs[1]};
    CHECK(gradcheck(c.f, only_second, c.opt).pass);
  }
}

TEST_CASE("gradcheck is not fooled by a bug in an op outside the function under test") {
  // gradcheck seeds backward with its weights directly: a bug in the ops one would use to
  // build the loss (mul, sum, reshape, scale) must not fail the check of exp.
  Tensor x = leaf(rnd({3, 4}, 3000));
  Fn f = [](const std::vector<Tensor>& in) { return ff::exp(in[0]); };
  for (const char* other : {"mul", "sum", "reshape", "scale", "add"}) {
    CAPTURE(other);
    testing::PlantedBug bug(other, testing::Bug::flip_sign);
    CHECK(gradcheck(f, {x}).pass);
  }
  testing::PlantedBug bug("exp", testing::Bug::flip_sign);
  CHECK_FALSE(gradcheck(f, {x}).pass);
}

TEST_CASE("ops: every op's graph is freed after use (no backward closure owns its output)") {
  for (OpCase& c : op_cases()) {
    CAPTURE(c.name);
    std::weak_ptr<TensorImpl> out_impl;
    std::weak_ptr<Node> node;
    {
      Tensor out = c.f(c.inputs);
      out_impl = out.impl_ptr();
      node = out.impl()->grad_fn;
      out.backward(Tensor::full(out.shape(), 1.f));
    }
    CHECK(out_impl.expired());
    CHECK(node.expired());
  }
}

// ===========================================================================
// argument errors name the op

TEST_CASE("ops: bad shapes, broadcasts, dims and indices throw ff::Error naming the op") {
  Tensor a = rnd({3, 5}, 1), a3 = rnd({2, 3, 4}, 2), idx_i64 = Tensor::from_indices({0, 1}, {2});
  check_error_names("add", [&] { add(a, rnd({3, 4}, 3)); });
  check_error_names("sub", [&] { sub(a, rnd({5, 3}, 3)); });
  check_error_names("mul", [&] { mul(a, rnd({5, 1}, 3)); });  // trailing 1 but wrong rows
  check_error_names("div", [&] { ff::div(rnd({4}, 3), rnd({3}, 3)); });
  check_error_names("exp", [&] { ff::exp(idx_i64); });
  check_error_names("masked_fill", [&] { masked_fill(a3, rnd({3, 5}, 3), 0.f); });
  check_error_names("masked_fill", [&] { masked_fill(a, rnd({2, 3, 5}, 3), 0.f); });
  check_error_names("matmul", [&] { matmul(a, rnd({4, 2}, 3)); });
  check_error_names("matmul", [&] { matmul(a3, rnd({3, 4, 2}, 3)); });
  check_error_names("matmul", [&] { matmul(rnd({5}, 3), rnd({5, 2}, 3)); });
  check_error_names("reshape", [&] { reshape(a, {-1, -1}); });
  check_error_names("reshape", [&] { reshape(a, {4, 4}); });
  check_error_names("reshape", [&] { reshape(a, {-1, 4}); });
  check_error_names("reshape", [&] { reshape(a, {-3, -5}); });
  check_error_names("transpose", [&] { transpose(a3, 0, 3); });
  check_error_names("transpose", [&] { transpose(a3, -4, 0); });
  check_error_names("slice", [&] { slice(a, 1, 3, 2); });
  check_error_names("slice", [&] { slice(a, 1, 0, 6); });
  check_error_names("slice", [&] { slice(a, 2, 0, 1); });
  check_error_names("concat", [&] { concat({}, 0); });
  check_error_names("concat", [&] { concat({a, a3}, 0); });
  check_error_names("concat", [&] { concat({a, rnd({3, 4}, 3)}, 0); });
  check_error_names("sum", [&] { sum(a, 2); });
  check_error_names("mean", [&] { mean(a, -3); });
  check_error_names("max", [&] { ff::max(a, 5); });
  check_error_names("max", [&] { ff::max(Tensor::zeros({3, 0}), 1); });
  check_error_names("softmax", [&] { softmax(Tensor::full({}, 1.f)); });
  check_error_names("log_softmax", [&] { log_softmax(Tensor::zeros({3, 0})); });
  check_error_names("rmsnorm", [&] { rmsnorm(a, rnd({4}, 3)); });
  Tensor logits = rnd({4, 6}, 4);
  check_error_names("cross_entropy", [&] { cross_entropy(logits, Tensor::from_indices({0, 1, 6, 2}, {4})); });
  check_error_names("cross_entropy", [&] { cross_entropy(logits, Tensor::from_indices({0, -1, 5, 2}, {4})); });
  check_error_names("cross_entropy", [&] { cross_entropy(logits, Tensor::from_indices({0, 1, 2}, {3})); });
  check_error_names("cross_entropy", [&] { cross_entropy(logits, rnd({4}, 3)); });
  check_error_names("cross_entropy", [&] { cross_entropy(a3, Tensor::from_indices({0, 1}, {2})); });
  check_error_names("embedding", [&] { embedding(rnd({7, 5}, 3), Tensor::from_indices({1, 7}, {2})); });
  check_error_names("embedding", [&] { embedding(rnd({7}, 3), idx_i64); });
  check_error_names("index_select", [&] { index_select(rnd({6, 4}, 3), Tensor::from_indices({6}, {1})); });
  check_error_names("index_select", [&] { index_select(rnd({6, 4}, 3), Tensor::from_indices({-1}, {1})); });
  check_error_names("index_select", [&] { index_select(rnd({6, 4}, 3), Tensor::from_indices({0, 1}, {1, 2})); });
  check_error_names("index_select", [&] { index_select(a3, idx_i64); });
  check_error_names("index_add", [&] { index_add(rnd({6, 4}, 3), Tensor::from_indices({6, 0}, {2}), rnd({2, 4}, 3)); });
  check_error_names("index_add", [&] { index_add(rnd({6, 4}, 3), idx_i64, rnd({3, 4}, 3)); });
  check_error_names("topk", [&] { topk(a, 0); });
  check_error_names("topk", [&] { topk(a, 6); });
  Tensor pos3 = Tensor::from_indices({0, 1, 2}, {3});
  check_error_names("rope", [&] { rope(a, pos3); });                         // D = 5 is odd
  check_error_names("rope", [&] { rope(a3, Tensor::from_indices({0, 1, 2}, {3})); });  // T = 2
  check_error_names("rope", [&] { rope(rnd({3, 4}, 3), Tensor::from_indices({0, 1}, {2})); });
  check_error_names("rope", [&] { rope(rnd({3, 4}, 3), Tensor::from_indices({0, 1, 2}, {1, 3})); });
  check_error_names("rope", [&] { rope(rnd({3, 4}, 3), rnd({3}, 3)); });    // float positions
  check_error_names("rope", [&] { rope(rnd({4}, 3), Tensor::from_indices({0}, {1})); });  // 1-D x
  check_error_names("rope", [&] { rope(rnd({3, 4}, 3), Tensor::from_indices({0, -1, 2}, {3})); });
  check_error_names("rope", [&] { rope(rnd({3, 4}, 3), pos3, 0.f); });
  check_error_names("rope", [&] { rope(idx_i64, Tensor::from_indices({0, 1}, {2})); });
}
