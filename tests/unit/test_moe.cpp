// The mixture-of-experts layer of lesson 03, composed from the steps of common/layers/moe.h
// (layer_forward / layer_backward below), on device cpu. Five checks, each against something
// independent of the one before:
//   1. the hand-written backward against moe::autograd_reference (the same layer in the
//      loop form, through the autograd core), for both gates, with alpha = 1 so the
//      load-balance loss's path matters, on ordinary sizes, k = 1, k = N, N = 1, odd T, and
//      starved experts (exactly zero weight gradients, no NaN); forward_loop == the packed forward;
//   2. the hand-written backward against central finite differences of the forward;
//   3. each moe::Bug planted: the same comparison with autograd fails for exactly the
//      gradients the bug touches (and still passes for the others);
//   4. the load-balance loss in closed form: k = N gives exactly alpha and no gradient; all
//      tokens on one expert gives alpha N P_0; f_i carries no gradient, P_i does;
//   5. PyTorch goldens (tests/reference/data/moe_*.npy, written by tests/reference/ops.py;
//      `make reference` regenerates them): forward, routing and every gradient.
// FF_MOE_VERBOSE=1 prints every measured error next to its tolerance.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/core/check.h"
#include "common/layers/moe.h"
#include "common/core/npy.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"

using namespace ff;

namespace {

const bool kVerbose = std::getenv("FF_MOE_VERBOSE") != nullptr;
constexpr double kEps = FLT_EPSILON;  // float32 machine epsilon, 2^-23 = 2 u

// ----------------------------------------------------------------------------
// problems

struct Problem {
  std::string name;
  moe::Config c;
  moe::Params p;
  Tensor x, dy;  // (T, d)
  int64_t T = 0;
};

Problem make_problem(const std::string& name, int64_t T, int64_t d, int64_t f, int64_t N,
                     int64_t k, moe::Gate gate, int64_t starved = 0, uint64_t seed = 300) {
  Problem pr;
  pr.name = name + " (" + moe::gate_name(gate) + ", T=" + std::to_string(T) +
            ", N=" + std::to_string(N) + ", k=" + std::to_string(k) + ")";
  pr.c.experts = N, pr.c.topk = k, pr.c.dim = d, pr.c.ffn = f, pr.c.gate = gate;
  pr.c.alpha = 1.0;  // large, so that an error in the load-balance path shows
  pr.p = moe::init_params(pr.c, seed, starved, Device::cpu);
  pr.x = randn({T, d}, seed + 10);
  pr.dy = randn({T, d}, seed + 11);
  pr.T = T;
  return pr;
}

bool all_finite(const Tensor& t) {
  for (float v : t.to_vector())
    if (!std::isfinite(v)) return false;
  return true;
}

// ----------------------------------------------------------------------------
// 1. tolerances for float32 against float32 (autograd) or float64 (PyTorch)
//
// Every gradient entry is a float32 computation whose longest sum has at most
//   n = T k + d + f + N terms
// (the rows of one packed group for the weight gradients, the hidden and model dimensions in
// the expert's backward, the experts in the router's softmax Jacobian). The two sides sum in
// different orders (grouped GEMM over packed rows vs one matmul per expert; the router in
// double vs autograd's float softmax backward), so each is within ~n eps/2 of exact times the
// sum of the terms' magnitudes. That sum we bound by the tensor's largest value times 4 (a
// few roundings per term: silu's exp, the products around it, the gate). So
//   tol = 4 n eps max|want|,
// floored at max|want| = 1e-3 for gradients that are ~0 (N = 1's router). The same
// tolerance as lesson 03's printed check. For the goldens (float64 truth) it is the same
// bound with one side exact: twice as generous, kept for simplicity.
double grad_tolerance(const Problem& pr, const Tensor& want) {
  const double n = (double)(pr.T * pr.c.topk + pr.c.dim + pr.c.ffn + pr.c.experts);
  return 4.0 * n * kEps * std::max(max_abs(want), 1e-3);
}
// y: the expert outputs are dot products of length d and f, then k gated terms added: each
// value is within (d + f + k) eps of exact times its terms, again 4 max|y| for the terms.
double y_tolerance(const Problem& pr, const Tensor& want) {
  return 4.0 * (double)(pr.c.dim + pr.c.ffn + pr.c.topk) * kEps * std::max(max_abs(want), 1e-3);
}
// The aux loss: N float32 sums of T probabilities (each p within a few eps), combined in
// double. 8 n eps relative, as the lesson prints it.
double aux_tolerance(const Problem& pr, double want) {
  const double n = (double)(pr.T * pr.c.topk + pr.c.dim + pr.c.ffn + pr.c.experts);
  return 8.0 * n * kEps * std::max(want, 1e-3);
}

// The layer as lesson 03 composes it (lessons/03_smoe/main.cpp: smoe_forward, smoe_backward),
// from the same steps of common/layers/moe.h: these tests check the steps together; lesson
// 03's own composition is checked by its runs in tests/lessons/test_03_smoe.py against the same autograd
// reference.
moe::Forward layer_forward(const moe::Config& c, const moe::Params& p, const Tensor& x) {
  moe::Forward f;
  f.routing = moe::route(c, p, x);
  f.plan = moe::permute_plan(f.routing.idx, c.experts);
  f.yp = moe::experts_forward(p, moe::permute(x, f.plan), f.plan.group_sizes, &f.cache);
  f.y = moe::combine(f.yp, f.plan, f.routing.gates);
  f.stats = moe::load_stats(c, f.routing);
  f.aux = moe::aux_loss(c, f.stats);
  return f;
}

moe::Grads layer_backward(const moe::Config& c, const moe::Params& p, const Tensor& x,
                          const moe::Forward& f, const Tensor& dy, const moe::LoadStats& global,
                          moe::Bug bug = moe::Bug::none) {
  moe::CombineGrads cg = moe::combine_backward(dy, f.yp, f.plan, f.routing.gates);
  if (bug == moe::Bug::gate_twice) cg.dyp = mul(cg.dyp, moe::packed_gates(f.plan, f.routing.gates));
  moe::ExpertGrads eg = moe::experts_backward(p, f.cache, cg.dyp, bug);
  moe::RouterGrads rg = moe::router_backward(p, x, moe::router_dlogits(c, f.routing, cg.dgates, global));
  Tensor dx_experts = moe::unpermute_sum(eg.dxp, f.plan);
  return {bug == moe::Bug::no_router_path ? dx_experts : add(dx_experts, rg.dx), rg.router_w,
          rg.router_b, eg.dw1, eg.dw2, eg.dw3};
}

// The six gradients of moe::Grads, by name.
// (std::string: doctest prints a const char* in a message as a pointer)
const std::string kGradNames[6] = {"dx", "d router_w", "d router_b", "d w1", "d w2", "d w3"};
const std::string kInputNames[6] = {"x", "router_w", "router_b", "w1", "w2", "w3"};
std::vector<Tensor> grad_list(const moe::Grads& g) {
  return {g.dx, g.router_w, g.router_b, g.w1, g.w2, g.w3};
}

// Compares the six gradients; returns which passed. Logs with FF_MOE_VERBOSE.
std::vector<bool> compare_grads(const Problem& pr, const moe::Grads& got, const moe::Grads& want,
                                const std::string& label) {
  std::vector<bool> pass;
  const std::vector<Tensor> a = grad_list(got), b = grad_list(want);
  for (size_t i = 0; i < 6; i++) {
    REQUIRE_MESSAGE(a[i].defined(), pr.name << " " << kGradNames[i] << ": not computed");
    REQUIRE_MESSAGE(b[i].defined(), pr.name << " " << kGradNames[i] << ": reference has none");
    REQUIRE(a[i].shape() == b[i].shape());
    const double tol = grad_tolerance(pr, b[i]);
    const Diff d = compare(a[i], b[i], tol, 0.0);
    if (kVerbose)
      std::printf("  %-52s %-11s %-10s max abs %.2e  tol %.2e  (err/tol %.3f)\n", pr.name.c_str(),
                  label.c_str(), kGradNames[i].c_str(), d.max_abs, tol, d.max_abs / tol);
    pass.push_back(d.pass);
  }
  return pass;
}

// Hand-written backward vs the autograd reference, forward included. Returns the Forward.
moe::Forward check_against_autograd(const Problem& pr) {
  INFO(pr.name);
  moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
  moe::Grads g = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats);
  moe::Reference ref = moe::autograd_reference(pr.c, pr.p, pr.x, pr.dy);
  // the routing is data movement: exactly the same
  CHECK(fw.routing.idx.to_index_vector() == ref.idx.to_index_vector());
  CHECK(compare(fw.routing.gates, ref.gates, 0, 0).pass);
  const double ytol = y_tolerance(pr, ref.y);
  const Diff dy = compare(fw.y, ref.y, ytol, 0.0);
  CHECK_MESSAGE(dy.pass, "y: max abs " << dy.max_abs << " > " << ytol);
  const double atol = aux_tolerance(pr, ref.aux);
  CHECK_MESSAGE(std::fabs(fw.aux - ref.aux) <= atol,
                "aux: " << fw.aux << " vs " << ref.aux << " (tol " << atol << ")");
  if (kVerbose)
    std::printf("  %-52s forward     y max abs %.2e tol %.2e; aux err %.2e tol %.2e\n",
                pr.name.c_str(), dy.max_abs, ytol, std::fabs(fw.aux - ref.aux), atol);
  const std::vector<bool> pass = compare_grads(pr, g, ref.grads, "vs autograd");
  for (size_t i = 0; i < 6; i++) CHECK_MESSAGE(pass[i], kGradNames[i] << " differs from autograd");
  for (const Tensor& t : grad_list(g)) CHECK(all_finite(t));
  CHECK(all_finite(fw.y));
  return fw;
}

const moe::Gate kGates[2] = {moe::Gate::softmax_topk, moe::Gate::topk_softmax};

// ----------------------------------------------------------------------------
// 2. finite differences

// L = sum(y * dy) + aux, with the float32 forward, summed in double.
double loss_of_forward(const Problem& pr, std::vector<int64_t>* idx) {
  moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
  const std::vector<float> y = fw.y.to_vector(), dy = pr.dy.to_vector();
  double L = fw.aux;
  for (size_t i = 0; i < y.size(); i++) L += (double)y[i] * dy[i];
  *idx = fw.routing.idx.to_index_vector();
  return L;
}

// ----------------------------------------------------------------------------
// 5. goldens

const std::string kDataDir = "tests/reference/data";

Tensor golden(const std::string& case_name, const std::string& tensor) {
  const std::string path = kDataDir + "/" + case_name + "_" + tensor + ".npy";
  REQUIRE_MESSAGE(std::filesystem::exists(path),
                  path << " not found: run the tests from the repository root "
                          "(regenerate the data with `make reference`)");
  return load_npy(path);
}

}  // namespace

// ----------------------------------------------------------------------------
// 1. backward vs autograd, forward loop vs grouped

TEST_CASE("moe: hand-written backward equals autograd of the same layer, both gates") {
  for (moe::Gate gate : kGates) {
    check_against_autograd(make_problem("default", 24, 16, 32, 8, 2, gate));
    check_against_autograd(make_problem("k = 1", 12, 6, 10, 4, 1, gate));
    check_against_autograd(make_problem("k = N", 10, 6, 10, 4, 4, gate));
    check_against_autograd(make_problem("N = 1", 9, 6, 10, 1, 1, gate));
    check_against_autograd(make_problem("odd T", 7, 5, 9, 5, 2, gate));
    check_against_autograd(make_problem("T = 1", 1, 4, 6, 3, 2, gate));
  }
}

TEST_CASE("moe: experts with no tokens get exactly zero weight gradients, and nothing is NaN") {
  for (moe::Gate gate : kGates) {
    // the last 2 of 6 experts have router bias -30 (init_params): never picked
    const Problem pr = make_problem("starved", 7, 5, 9, 6, 2, gate, /*starved=*/2);
    const moe::Forward fw = check_against_autograd(pr);
    const std::vector<int64_t> sizes = fw.plan.group_sizes.to_index_vector();
    INFO(pr.name);
    CHECK(sizes[4] == 0);
    CHECK(sizes[5] == 0);
    const moe::Grads g = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats);
    const int64_t d = pr.c.dim, f = pr.c.ffn;
    for (const auto& [name, t] : {std::pair<const char*, Tensor>{"w1", g.w1}, {"w3", g.w3},
                                  {"w2", g.w2}}) {
      const std::vector<float> v = t.to_vector();
      for (int64_t e = 0; e < pr.c.experts; e++) {
        if (sizes[(size_t)e] != 0) continue;
        bool zero = true;
        for (int64_t i = 0; i < d * f; i++) zero = zero && v[(size_t)(e * d * f + i)] == 0.f;
        CHECK_MESSAGE(zero, "d " << std::string(name) << " of expert " << e
                                 << " (no tokens) is not exactly 0");
      }
    }
    // a starved expert's router column still gets a (tiny, finite) gradient through p
    CHECK(all_finite(g.router_w));
    CHECK(all_finite(g.router_b));
  }
}

TEST_CASE("moe: the experts' backward in two halves (input now, weights later) equals the whole, bit for bit") {
  for (moe::Gate gate : kGates) {
    const Problem pr = make_problem("halves", 9, 6, 10, 5, 2, gate, /*starved=*/1);
    const moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
    const moe::CombineGrads cg = moe::combine_backward(pr.dy, fw.yp, fw.plan, fw.routing.gates);
    const moe::ExpertGrads whole = moe::experts_backward(pr.p, fw.cache, cg.dyp);
    const moe::ExpertInputGrads in = moe::experts_backward_input(pr.p, fw.cache, cg.dyp);
    const moe::ExpertGrads w = moe::experts_backward_weights(pr.p, fw.cache, in);
    INFO(pr.name);
    CHECK(bitwise_equal(in.dxp, whole.dxp));
    CHECK(bitwise_equal(w.dw1, whole.dw1));
    CHECK(bitwise_equal(w.dw2, whole.dw2));
    CHECK(bitwise_equal(w.dw3, whole.dw3));
    // and the halves keep the planted bugs: silu-no-upstream changes dxp and dw1
    const moe::ExpertInputGrads bad = moe::experts_backward_input(pr.p, fw.cache, cg.dyp, moe::Bug::silu_no_upstream);
    CHECK_FALSE(bitwise_equal(bad.dxp, whole.dxp));
    CHECK_FALSE(bitwise_equal(moe::experts_backward_weights(pr.p, fw.cache, bad).dw1, whole.dw1));
  }
}

TEST_CASE("moe: an ExpertGemmScope runs every expert product through its GEMM, group by group") {
  // With matmul as the scope's GEMM the experts' forward and backward are the grouped kernels'
  // within float32's rounding (another order of the same sums), the GEMM called 9 times per
  // group with tokens (3 forward, 3 for dxp, 3 weight gradients), an empty group's weight
  // gradients exactly 0; when the scope ends the kernels run again, bit for bit.
  const Problem pr = make_problem("scope", 9, 6, 10, 5, 2, kGates[0], /*starved=*/1);
  const moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
  const moe::CombineGrads cg = moe::combine_backward(pr.dy, fw.yp, fw.plan, fw.routing.gates);
  const moe::ExpertGrads plain = moe::experts_backward(pr.p, fw.cache, cg.dyp);
  const std::vector<int64_t> sizes = fw.plan.group_sizes.to_index_vector();
  const int64_t used = std::count_if(sizes.begin(), sizes.end(), [](int64_t n) { return n > 0; });
  REQUIRE(used < (int64_t)sizes.size());  // an empty group among them
  int calls = 0;
  Tensor yp;
  moe::ExpertGrads via;
  {
    moe::ExpertGemmScope scope([&](const Tensor& a, const Tensor& b) { calls++; return matmul(a, b); });
    moe::ExpertCache cache;
    yp = moe::experts_forward(pr.p, fw.cache.xp, fw.cache.group_sizes, &cache);
    via = moe::experts_backward(pr.p, cache, cg.dyp);
  }
  CHECK(calls == 9 * used);
  const auto close = [](const Tensor& got, const Tensor& want) {
    double worst = 0;
    const std::vector<float> g = got.to_vector(), w = want.to_vector();
    for (size_t i = 0; i < g.size(); i++) worst = std::max(worst, std::fabs((double)g[i] - w[i]));
    return got.shape() == want.shape() && worst <= 1e-5 * std::max(1.0, max_abs(want));
  };
  CHECK(close(yp, fw.yp));
  CHECK(close(via.dxp, plain.dxp));
  CHECK(close(via.dw1, plain.dw1));
  CHECK(close(via.dw2, plain.dw2));
  CHECK(close(via.dw3, plain.dw3));
  CHECK(!bitwise_equal(via.dw1, Tensor::zeros(via.dw1.shape())));
  for (size_t e = 0; e < sizes.size(); e++)
    if (sizes[e] == 0) CHECK(max_abs(slice(via.dw1, 0, (int64_t)e, (int64_t)e + 1)) == 0.0);
  moe::ExpertCache after;
  CHECK(bitwise_equal(moe::experts_forward(pr.p, fw.cache.xp, fw.cache.group_sizes, &after), fw.yp));
}

TEST_CASE("moe: forward_loop (index lists) equals forward (permute, grouped GEMM, combine)") {
  struct Shape5 {
    int64_t T, d, f, N, k, starved;
  };
  for (moe::Gate gate : kGates)
    for (const Shape5& s : {Shape5{7, 5, 9, 4, 2, 0}, Shape5{13, 8, 12, 5, 3, 0},
                            Shape5{1, 4, 6, 3, 1, 0}, Shape5{16, 6, 10, 8, 8, 0},
                            Shape5{11, 6, 10, 6, 2, 3}, Shape5{20, 16, 32, 1, 1, 0}}) {
      const Problem pr = make_problem("loop vs grouped", s.T, s.d, s.f, s.N, s.k, gate, s.starved);
      INFO(pr.name);
      const moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
      const Tensor y_loop = moe::forward_loop(pr.c, pr.p, pr.x, fw.routing);
      const double tol = y_tolerance(pr, y_loop);
      const Diff d = compare(fw.y, y_loop, tol, 0.0);
      if (kVerbose)
        std::printf("  %-52s loop vs grouped y max abs %.2e  tol %.2e\n", pr.name.c_str(),
                    d.max_abs, tol);
      CHECK_MESSAGE(d.pass, "max abs " << d.max_abs << " > " << tol);
      // the plan is a permutation: every packed row is one slot's, and group sizes add up
      std::vector<int64_t> pos = fw.plan.pos.to_index_vector(), sizes = fw.plan.group_sizes.to_index_vector();
      std::sort(pos.begin(), pos.end());
      for (int64_t r = 0; r < s.T * s.k; r++) CHECK(pos[(size_t)r] == r);
      int64_t total = 0;
      for (int64_t v : sizes) total += v;
      CHECK(total == s.T * s.k);
    }
}

// ----------------------------------------------------------------------------
// 2. finite differences

TEST_CASE("moe: hand-written backward equals central finite differences of the forward") {
  // L = sum(y * dy) + aux, so dL/dy = dy and the backward is layer_backward(dy). Each numeric
  // derivative is D(h) = (L(v + h) - L(v - h)) / 2h with the float32 forward. Its error:
  //   rounding: each L is within B_L of exact, B_L = sum|dy| * (bound on y's error: the
  //     y_tolerance above) + the aux loss's (aux_tolerance), so D is within B_L / h;
  //   truncation: h^2 / 6 L'''. Estimated by Richardson's rule: with step 2h the h^2 term is
  //     4 times larger, so it is ~|D(2h) - D(h)| / 3, plus that difference's rounding,
  //     B_L / h / 3 + B_L / 2h / 3 = B_L / 2h.
  //   tol = 1.5 B_L / h + |D(2h) - D(h)| / 3       (as in test_kernels_attention.cpp)
  // h = 1e-2: B_L ~ 2e-4 here, so B_L / h ~ 2e-2, against h^2 L''' / 6 ~ 1e-5 (L''' = O(1) for
  // O(1) inputs). B_L is a worst case (every y element off by its whole bound, nothing
  // cancelling between L(v + h) and L(v - h)): the measured errors use ~1e-3 of it. A larger
  // step would shrink it, but moves the router logits further, toward flipping the top-k.
  // top-k is discontinuous: a perturbation that changes the routing makes D meaningless. The
  // problem and seed are chosen so that none does at v +- h, v +- 2h — and every perturbed
  // forward asserts that its routing idx is unchanged, so this cannot pass or fail silently
  // for that reason.
  // The same tolerance must reject each planted bug on some of the elements.
  constexpr float kStep = 1e-2f;
  for (moe::Gate gate : kGates) {
    Problem pr = make_problem("finite differences", 6, 4, 6, 4, 2, gate, 0, /*seed=*/1200);
    INFO(pr.name);
    moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
    const std::vector<int64_t> idx0 = fw.routing.idx.to_index_vector();
    const moe::Grads g = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats);
    const moe::Bug bugs[3] = {moe::Bug::gate_twice, moe::Bug::silu_no_upstream,
                              moe::Bug::no_router_path};
    std::vector<std::vector<Tensor>> buggy;
    for (moe::Bug b : bugs)
      buggy.push_back(grad_list(layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats, b)));
    double sum_abs_dy = 0;
    for (float v : pr.dy.to_vector()) sum_abs_dy += std::fabs(v);
    const double B_L = sum_abs_dy * y_tolerance(pr, fw.y) + aux_tolerance(pr, fw.aux);

    int checked = 0, routing_changed = 0;
    int caught[3] = {0, 0, 0};
    double worst = 0;
    // the values perturbed, with the gradient tensor index in grad_list order
    const std::vector<std::pair<Tensor, int>> targets = {
        {pr.x, 0},    {pr.p.router_w, 1}, {pr.p.router_b, 2},
        {pr.p.w1, 3}, {pr.p.w2, 4},       {pr.p.w3, 5}};
    for (const auto& [t, gi] : targets) {
      const std::vector<float> analytic = grad_list(g)[(size_t)gi].to_vector();
      float* v = t.data();
      const int64_t n = t.numel();
      // about 8 elements of each, spread over the tensor (router_b: all N)
      const int64_t stride = std::max<int64_t>(1, n / 8);
      for (int64_t e = 0; e < n; e += stride) {
        const float v0 = v[e];
        auto central = [&](float h) {
          std::vector<int64_t> idx_up, idx_down;
          v[e] = v0 + h;
          const double up = loss_of_forward(pr, &idx_up);
          v[e] = v0 - h;
          const double down = loss_of_forward(pr, &idx_down);
          v[e] = v0;
          const bool same = idx_up == idx0 && idx_down == idx0;
          if (!same) routing_changed++;
          CHECK_MESSAGE(same, kInputNames[gi] << "[" << e << "] +- " << h
                                             << " changes the top-k routing: this element's "
                                                "finite difference means nothing");
          return (up - down) / (2.0 * h);
        };
        const double d1 = central(kStep), d2 = central(2 * kStep);
        const double tol = 1.5 * B_L / kStep + std::fabs(d2 - d1) / 3;
        const double err = std::fabs(analytic[(size_t)e] - d1);
        worst = std::max(worst, err / tol);
        CHECK_MESSAGE(err <= tol, kGradNames[gi] << "[" << e << "]: backward "
                                                 << analytic[(size_t)e] << ", finite differences "
                                                 << d1 << " (tolerance " << tol << ")");
        for (int b = 0; b < 3; b++)
          if (std::fabs(buggy[(size_t)b][(size_t)gi].to_vector()[(size_t)e] - d1) > tol)
            caught[b]++;
        checked++;
      }
    }
    if (kVerbose)
      std::printf("  %-52s %d elements, B_L %.2e, tol(h) %.2e, worst err/tol %.3f; bugs rejected "
                  "at %d, %d, %d\n", pr.name.c_str(), checked, B_L, 1.5 * B_L / kStep, worst,
                  caught[0], caught[1], caught[2]);
    CHECK_MESSAGE(routing_changed == 0,
                  routing_changed << " perturbations changed the top-k routing: pick another "
                                     "seed or a smaller step");
    CHECK(checked >= 40);
    CHECK_MESSAGE(caught[0] > 0, "gate_twice not rejected by finite differences");
    CHECK_MESSAGE(caught[1] > 0, "silu_no_upstream not rejected by finite differences");
    CHECK_MESSAGE(caught[2] > 0, "no_router_path not rejected by finite differences");
  }
}

// ----------------------------------------------------------------------------
// 3. planted bugs

TEST_CASE("moe: each planted backward bug fails the comparison with autograd") {
  // Which gradients each bug spoils (grad_list order: dx, router_w, router_b, w1, w2, w3):
  //   gate_twice       the packed rows' upstream scaled by g again: every expert gradient and
  //                    dx's expert part; the router's dL/dg is computed before, untouched
  //   silu_no_upstream dA = silu'(a) * b without dH: dW1 and dx; dW2, dW3 (via dB) untouched
  //   no_router_path   dx without dz W_g^T: dx only
  // The untouched ones must still pass: the tolerance is tight, not merely loose.
  // One exception is not a gap in the check: with topk-softmax and k = 1 the gate is
  // softmax of one logit, identically 1, so applying it twice changes nothing — there
  // gate_twice must pass everywhere.
  struct Planted {
    moe::Bug bug;
    const char* name;
    bool spoils[6];
  } planted[] = {
      {moe::Bug::gate_twice, "gate_twice", {true, false, false, true, true, true}},
      {moe::Bug::silu_no_upstream, "silu_no_upstream", {true, false, false, true, false, false}},
      {moe::Bug::no_router_path, "no_router_path", {true, false, false, false, false, false}},
  };
  for (moe::Gate gate : kGates)
    for (const Problem& pr : {make_problem("planted", 12, 6, 10, 4, 2, gate),
                              make_problem("planted", 7, 5, 9, 5, 1, gate)}) {
      const moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
      const moe::Reference ref = moe::autograd_reference(pr.c, pr.p, pr.x, pr.dy);
      for (const Planted& b : planted) {
        INFO(pr.name << ", bug " << std::string(b.name));
        const moe::Grads g = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats, b.bug);
        const std::vector<bool> pass = compare_grads(pr, g, ref.grads, b.name);
        const bool gate_is_one = gate == moe::Gate::topk_softmax && pr.c.topk == 1;
        for (size_t i = 0; i < 6; i++) {
          INFO(kGradNames[i]);
          const bool spoiled = b.spoils[i] && !(b.bug == moe::Bug::gate_twice && gate_is_one);
          CHECK(pass[i] == !spoiled);
        }
      }
    }
}

// ----------------------------------------------------------------------------
// 4. the load-balance loss in closed form

TEST_CASE("moe: load-balance loss, k = N: exactly alpha and no gradient") {
  // Every token picks every expert: f_i = T / (N T) = 1/N, so L_aux = alpha N sum_i P_i / N =
  // alpha (sum_i P_i = 1). Its gradient w.r.t. p_ti is the same alpha / T for every i, and
  // the softmax Jacobian maps a constant to zero: dz_t = p_t (c - c sum_i p_ti) = 0.
  // Float32: the probabilities of a row sum to 1 within ~N eps, and P_i's float32 sums of T
  // values are within ~T eps: |aux - alpha| <= alpha (N + T) eps, |dz| <= 2 N eps alpha / T.
  for (moe::Gate gate : kGates) {
    for (double alpha : {1.0, 0.01}) {
      Problem pr = make_problem("k = N", 9, 6, 10, 5, 5, gate);
      pr.c.alpha = alpha;
      INFO(pr.name << ", alpha " << alpha);
      const moe::Routing r = moe::route(pr.c, pr.p, pr.x);
      const moe::LoadStats s = moe::load_stats(pr.c, r);
      const double aux = moe::aux_loss(pr.c, s);
      const double N = (double)pr.c.experts, T = (double)pr.T;
      CHECK(std::fabs(aux - alpha) <= alpha * (N + T) * kEps);
      const Tensor dz = moe::router_dlogits(pr.c, r, Tensor::zeros({pr.T, pr.c.topk}), s);
      CHECK(max_abs(dz) <= 2.0 * N * kEps * alpha / T);
      if (kVerbose)
        std::printf("  %-52s |aux - alpha| %.2e (tol %.2e), max |dz_aux| %.2e (tol %.2e)\n",
                    pr.name.c_str(), std::fabs(aux - alpha), alpha * (N + T) * kEps, max_abs(dz),
                    2.0 * N * kEps * alpha / T);
    }
  }
}

// p (T, N) in double from x, router_w, router_b: the independent reference of the tests below
std::vector<double> probs_double(const Problem& pr) {
  const int64_t T = pr.T, N = pr.c.experts, d = pr.c.dim;
  const std::vector<float> x = pr.x.to_vector(), w = pr.p.router_w.to_vector(),
                           b = pr.p.router_b.to_vector();
  std::vector<double> p((size_t)(T * N));
  for (int64_t t = 0; t < T; t++) {
    double m = -1e300, s = 0;
    for (int64_t i = 0; i < N; i++) {
      double z = b[(size_t)i];
      for (int64_t c = 0; c < d; c++) z += (double)x[(size_t)(t * d + c)] * w[(size_t)(c * N + i)];
      p[(size_t)(t * N + i)] = z;
      m = std::max(m, z);
    }
    for (int64_t i = 0; i < N; i++) {
      double& v = p[(size_t)(t * N + i)];
      s += (v = std::exp(v - m));
    }
    for (int64_t i = 0; i < N; i++) p[(size_t)(t * N + i)] /= s;
  }
  return p;
}

// dL_aux/dz in double: dz_ti = p_ti (a_i - sum_j a_j p_tj), a_i = alpha N f_i / T, f_i =
// count_i / (k T) a constant.
std::vector<double> aux_dlogits_double(const Problem& pr, const std::vector<double>& p,
                                       const std::vector<double>& count) {
  const int64_t T = pr.T, N = pr.c.experts;
  std::vector<double> a((size_t)N), dz((size_t)(T * N));
  for (int64_t i = 0; i < N; i++)
    a[(size_t)i] = pr.c.alpha * (double)N * count[(size_t)i] / ((double)pr.c.topk * T) / (double)T;
  for (int64_t t = 0; t < T; t++) {
    double dot = 0;
    for (int64_t i = 0; i < N; i++) dot += a[(size_t)i] * p[(size_t)(t * N + i)];
    for (int64_t i = 0; i < N; i++)
      dz[(size_t)(t * N + i)] = p[(size_t)(t * N + i)] * (a[(size_t)i] - dot);
  }
  return dz;
}

TEST_CASE("moe: load-balance loss, all tokens on one expert (k = 1): alpha N P_0") {
  // Router bias +3 on expert 0 and a router scaled down to 0.3 of init_params': every token
  // picks expert 0 (asserted), yet P_0 is far from 1, so the value tests P and not just f.
  // f = (1, 0, ..., 0): L_aux = alpha N P_0, and dL_aux/dz_ti = (alpha N / T) p_t0 (1[i=0] - p_ti).
  // Float32: P_0 is a float32 sum of T probabilities, each within a few eps: alpha N (T + 4) eps.
  for (moe::Gate gate : kGates) {
    Problem pr = make_problem("one expert", 13, 6, 10, 4, 1, gate);
    pr.p.router_w = scale(pr.p.router_w, 0.3f);
    pr.p.router_b = Tensor::from_vector({3.f, 0.f, 0.f, 0.f}, {4});
    INFO(pr.name);
    const moe::Routing r = moe::route(pr.c, pr.p, pr.x);
    for (int64_t e : r.idx.to_index_vector()) REQUIRE(e == 0);
    const moe::LoadStats s = moe::load_stats(pr.c, r);
    const std::vector<double> p = probs_double(pr);
    const int64_t T = pr.T, N = pr.c.experts;
    double P0 = 0;
    for (int64_t t = 0; t < T; t++) P0 += p[(size_t)(t * N)] / (double)T;
    CHECK(P0 < 0.95);  // the bias does not simply saturate the softmax
    const double want = pr.c.alpha * (double)N * P0, tol = pr.c.alpha * (double)N * (T + 4) * kEps;
    const double aux = moe::aux_loss(pr.c, s);
    CHECK_MESSAGE(std::fabs(aux - want) <= tol, "aux " << aux << ", alpha N P_0 " << want);
    // and its gradient: P_i carries one, through every p_ti (f_0 = 1, the others 0)
    const Tensor dz = moe::router_dlogits(pr.c, r, Tensor::zeros({T, 1}), s);
    const std::vector<double> want_dz = aux_dlogits_double(pr, p, {(double)T, 0, 0, 0});
    std::vector<float> w(want_dz.begin(), want_dz.end());
    const Tensor want_t = Tensor::from_vector(w, {T, N});
    // a few float32 roundings of p (softmax: ~4 eps) and of the product: 8 eps max|dz|
    const double dz_tol = 8.0 * kEps * max_abs(want_t);
    const Diff d = compare(dz, want_t, dz_tol, 0.0);
    CHECK_MESSAGE(d.pass, "d aux / dz: max abs " << d.max_abs << " > " << dz_tol);
    CHECK(max_abs(want_t) > 1e-3);
    if (kVerbose)
      std::printf("  %-52s aux err %.2e (tol %.2e), P_0 %.3f; dz err %.2e (tol %.2e)\n",
                  pr.name.c_str(), std::fabs(aux - want), tol, P0, d.max_abs, dz_tol);
  }
}

TEST_CASE("moe: load-balance loss: f_i carries no gradient, P_i does") {
  // A non-uniform router (k < N): the aux path alone (dy = 0, so dL/dg = 0) is nonzero, equals
  // the closed form with f_i a constant, and the whole backward with dy = 0 equals autograd's
  // (whose f is a constant tensor) — the aux loss's gradient reaches router_w, router_b and x.
  for (moe::Gate gate : kGates) {
    Problem pr = make_problem("aux only", 11, 6, 10, 5, 2, gate);
    pr.dy = Tensor::zeros({pr.T, pr.c.dim});
    INFO(pr.name);
    const moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
    const Tensor dz = moe::router_dlogits(pr.c, fw.routing, Tensor::zeros({pr.T, pr.c.topk}),
                                          fw.stats);
    const std::vector<double> want_dz = aux_dlogits_double(pr, probs_double(pr), fw.stats.count);
    std::vector<float> w(want_dz.begin(), want_dz.end());
    const Tensor want_t = Tensor::from_vector(w, {pr.T, pr.c.experts});
    const double dz_tol = 8.0 * kEps * max_abs(want_t);  // as in the test above
    CHECK(compare(dz, want_t, dz_tol, 0.0).pass);
    CHECK(max_abs(want_t) > 1e-3);  // P_i carries gradient
    const moe::Grads g = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats);
    check_against_autograd(pr);
    CHECK(max_abs(g.router_b) > 1e-3);
    CHECK(max_abs(g.router_w) > 1e-3);
    CHECK(max_abs(g.dx) > 1e-3);
    CHECK(max_abs(g.w1) == 0.0);  // dy = 0: the experts get nothing
  }
}

// ----------------------------------------------------------------------------
// 5. goldens

TEST_CASE("moe: forward, routing and gradients match PyTorch (tests/reference/data/moe_*)") {
  for (const char* case_name : {"moe_softmax_topk", "moe_topk_softmax"}) {
    INFO(std::string(case_name));
    const std::string cn = case_name;
    Problem pr;
    pr.name = cn + " golden";
    pr.x = golden(cn, "x");
    pr.dy = golden(cn, "dy");
    pr.p = {golden(cn, "router_w"), golden(cn, "router_b"), golden(cn, "w1"), golden(cn, "w3"),
            golden(cn, "w2")};
    pr.T = pr.x.size(0);
    pr.c.dim = pr.x.size(1);
    pr.c.ffn = pr.p.w1.size(2);
    pr.c.experts = pr.p.w1.size(0);
    pr.c.topk = golden(cn, "topk_idx").size(1);
    pr.c.alpha = golden(cn, "alpha").item();
    pr.c.gate = cn == "moe_softmax_topk" ? moe::Gate::softmax_topk : moe::Gate::topk_softmax;
    const moe::Forward fw = layer_forward(pr.c, pr.p, pr.x);
    const moe::Grads g = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats);
    // routing: exactly PyTorch's (ops.py asserts every decision has a margin)
    CHECK(fw.routing.idx.to_index_vector() == golden(cn, "topk_idx").to_index_vector());
    const Tensor want_gates = golden(cn, "gates"), want_y = golden(cn, "y");
    // gates: a softmax of N (or k) values, a few eps relative
    CHECK(compare(fw.routing.gates, want_gates, 8.0 * kEps, 0.0).pass);
    const double ytol = y_tolerance(pr, want_y);
    const Diff dy = compare(fw.y, want_y, ytol, 0.0);
    CHECK_MESSAGE(dy.pass, "y: max abs " << dy.max_abs << " > " << ytol);
    const double want_aux = golden(cn, "aux").item(), atol = aux_tolerance(pr, want_aux);
    CHECK_MESSAGE(std::fabs(fw.aux - want_aux) <= atol, "aux " << fw.aux << " vs " << want_aux);
    if (kVerbose)
      std::printf("  %-52s forward     y max abs %.2e tol %.2e; aux err %.2e tol %.2e\n",
                  pr.name.c_str(), dy.max_abs, ytol, std::fabs(fw.aux - want_aux), atol);
    const moe::Grads want{golden(cn, "dx"), golden(cn, "d_router_w"), golden(cn, "d_router_b"),
                          golden(cn, "d_w1"), golden(cn, "d_w2"), golden(cn, "d_w3")};
    const std::vector<bool> pass = compare_grads(pr, g, want, "vs PyTorch");
    for (size_t i = 0; i < 6; i++) CHECK_MESSAGE(pass[i], kGradNames[i] << " differs from PyTorch");
    // and the same comparison rejects every planted bug (dx is spoiled by all three; k = 2,
    // so no gate is identically 1)
    for (moe::Bug bug :
         {moe::Bug::gate_twice, moe::Bug::silu_no_upstream, moe::Bug::no_router_path}) {
      const moe::Grads gb = layer_backward(pr.c, pr.p, pr.x, fw, pr.dy, fw.stats, bug);
      CHECK_FALSE(compare_grads(pr, gb, want, "bug vs PyTorch")[0]);
    }
  }
}
