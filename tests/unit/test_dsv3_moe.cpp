// The DeepSeek-V3 mixture-of-experts layer of common/layers/dsv3_moe.h (lesson 05): routing
// (sigmoid or softmax affinities, node-limited selection on s + b, capacity with drop or
// next-best, gates from the unbiased s), routed and shared SwiGLU experts, and the
// sequence-wise balance loss, with its hand-written backward. Eight checks, each against
// something independent of the one before:
//   1. dsv3::forward / dsv3::backward against dsv3::autograd_reference (the same layer in loop
//      form through the autograd core) on the same routing: both gates, with and without
//      groups, shared experts 0 / 1 / 2, capacity with drop and with next-best, alpha > 0,
//      route_scale != 1, K = 1, K = N (G = 1), N = 1, one sequence and several, odd T. The
//      routing's invariants too (experts inside the kept groups, distinct per token, loads
//      within capacity); K = N and N = 1 give the balance loss's closed form alpha;
//   2. the hand-written backward against central finite differences of the forward loss
//      sum(y * dy) + L_bal, for entries of x and of every weight, skipping (and counting) the
//      entries whose perturbation changes any routing decision;
//   3. each dsv3::Bug planted (bias_grad, no_renorm, no_shared_grad): the comparison with
//      autograd fails for exactly the gradients the bug touches and passes for the others;
//   4. PyTorch goldens (tests/reference/data/dsv3_*.npy, written by tests/reference/dsv3_moe.py
//      from DeepSeek-V3's inference/model.py; `make reference` regenerates them): routing
//      (selection, kept groups, final experts, kept slots, loads) equal; gates, y, the balance
//      loss and every gradient within the tolerances below; the planted bugs rejected;
//   5. capacity on hand-made cases worked out in the comments: drop keeps the highest
//      affinities (ties: the earlier slot); next-best moves overflow to the best expert by
//      s + b with room inside the kept groups, never to one the token already uses, and drops
//      when none has room; demand = load + dropped + moved_out - moved_in; capacity_factor 0
//      keeps everything;
//   6. selection vs gating: the bias changes tokens' experts but not their gates' formula
//      (s of the new experts, normalised; not s + b); the kept groups are those of the
//      top-group_score_topk sums, not of seed 001's whole-group logit sums (kept_groups_seed001);
//   7. seed 003's load_balance_sequence_wise differs from the report's loss (its loop index k
//      replaces top-K, and it divides by L instead of averaging over sequences);
//   8. the layer on device sim equals the layer on cpu: integer routing equal; gates, y, L_bal
//      and the gradients within check 1's float32 bounds plus check 4's affinity terms (the two
//      devices' s are not the same floats).
// FF_DSV3_VERBOSE=1 prints every measured error next to its tolerance.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "common/layers/dsv3_moe.h"
#include "common/core/npy.h"

using namespace ff;

namespace {

const bool kVerbose = std::getenv("FF_DSV3_VERBOSE") != nullptr;
constexpr double kEps = FLT_EPSILON;  // float32 machine epsilon, 2^-23 = 2 u

using dsv3::GateFn;
using dsv3::Overflow;

// ----------------------------------------------------------------------------
// problems

struct Spec {
  const char* name;
  int64_t T, L, d, f, N, K, G, M, S;
  GateFn gate;
  double route_scale, alpha, capacity;
  Overflow overflow;
  uint64_t seed;
  double bias_spread;
};

struct Problem {
  std::string name;
  dsv3::Config c;
  dsv3::Params p;
  Tensor x, dy;  // (T, d)
  int64_t T = 0;
};

Problem make_problem(const Spec& s, Device dev = Device::cpu) {
  Problem pr;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s (%s T=%lld L=%lld N=%lld K=%lld G=%lld M=%lld S=%lld C=%g %s)",
                s.name, dsv3::gate_name(s.gate), (long long)s.T, (long long)s.L, (long long)s.N,
                (long long)s.K, (long long)s.G, (long long)s.M, (long long)s.S, s.capacity,
                dsv3::overflow_name(s.overflow));
  pr.name = buf;
  dsv3::Config& c = pr.c;
  c.experts = s.N, c.topk = s.K, c.dim = s.d, c.ffn = s.f, c.shared = s.S;
  c.groups = s.G, c.topk_groups = s.M, c.gate = s.gate, c.route_scale = s.route_scale;
  c.alpha = s.alpha, c.capacity_factor = s.capacity, c.overflow = s.overflow, c.seq_len = s.L;
  pr.p = dsv3::init_params(c, s.seed, s.bias_spread, dev);
  pr.x = randn({s.T, s.d}, s.seed + 10).to(dev);
  pr.dy = randn({s.T, s.d}, s.seed + 11).to(dev);
  pr.T = s.T;
  return pr;
}

bool all_finite(const Tensor& t) {
  if (!t.defined()) return true;
  for (float v : t.to_vector())
    if (!std::isfinite(v)) return false;
  return true;
}

// The gradients of dsv3::Grads in one order, by name (std::string: doctest prints a const char*
// as a pointer). The shared experts' three are there only when S > 0.
const std::string kGradNames[8] = {"dx",   "d router_w", "d w1",  "d w2",
                                   "d w3", "d sw1",      "d sw2", "d sw3"};
std::vector<Tensor> grad_list(const dsv3::Grads& g, bool shared) {
  std::vector<Tensor> v = {g.dx, g.router_w, g.w1, g.w2, g.w3};
  if (shared) v.insert(v.end(), {g.sw1, g.sw2, g.sw3});
  return v;
}
std::vector<Tensor> input_list(const Problem& pr) {
  std::vector<Tensor> v = {pr.x, pr.p.router_w, pr.p.w1, pr.p.w2, pr.p.w3};
  if (pr.c.shared > 0) v.insert(v.end(), {pr.p.sw1, pr.p.sw2, pr.p.sw3});
  return v;
}

// ----------------------------------------------------------------------------
// tolerances for float32 against float32 (autograd, device sim) or float64 (PyTorch)
//
// Every gradient entry is a float32 computation whose longest chain of sums has at most
//   n = T K + d + (S + 1) f + N + L
// terms: the packed rows of one expert (<= T K) or all T rows for the weight gradients, the
// model and hidden widths d, f and S f in the experts' backward, the N experts of the router's
// softmax / normaliser, and the L tokens of a sequence in the balance loss's P. The two sides
// sum in different orders (grouped GEMM over packed rows vs a matmul per expert; the router's
// backward in double vs autograd's float32 ops), so each is within ~n eps/2 of exact times the
// sum of the terms' magnitudes, which we bound by 4 max|want| (a few roundings per term: silu's
// exp, the products around it, the gate). So, as in test_moe.cpp,
//   tol = 4 n eps max|want|,
// floored at max|want| = 1e-3 for gradients that are ~0. The router's gradient can be 0 by
// cancellation while its terms are not: the sigmoid gate of one selected expert is
// s / (s + 1e-20) = 1 (K = 1, N = 1), s / sum(s) of one expert is 1 (N = 1), so their
// derivatives are differences of two equal terms, exact 0 in double but rounding noise of the
// terms' size in autograd's float32. For d router_w the floor is therefore the terms' size,
// router_term_scale below.
double n_terms(const Problem& pr) {
  const dsv3::Config& c = pr.c;
  return (double)(pr.T * c.topk + c.dim + (c.shared + 1) * c.ffn + c.experts + c.seq_len);
}
double grad_tolerance(const Problem& pr, const Tensor& want, double floor = 0.0) {
  return 4.0 * n_terms(pr) * kEps * std::max({max_abs(want), floor, 1e-3});
}
// dW_g = x^T dz, and dz_ti is a sum of terms (router_dlogits in dsv3_moe.cpp) bounded by
//   sigmoid: A_ti = |ds_ti| s_ti (1 - s_ti),  softmax: A_ti = s_ti (|ds_ti| + sum_j |ds_tj| s_tj),
// with |ds_ti| <= rs / S (|dg_ti| + sum_j |dg_tj| s_tj / S) (sigmoid gate, i selected; rs |dg_ti|
// for softmax) + (w f_i + sum_j w f_j s_tj / Z) / Z (balance, w = alpha / (B L)). The terms'
// size is max over (c, i) of sum_t |x_tc| A_ti.
double router_term_scale(const Problem& pr, const dsv3::Forward& fw) {
  const dsv3::Config& c = pr.c;
  const int64_t T = pr.T, N = c.experts, K = c.topk, d = c.dim, L = c.seq_len;
  const std::vector<float> s = fw.s.to_vector(), x = pr.x.to_vector();
  const std::vector<float> dg = moe::combine_backward(pr.dy, fw.yp, fw.plan, fw.gates).dgates.to_vector();
  const std::vector<int64_t> idx = fw.assign.idx;
  const double rs = c.route_scale, w = c.alpha / ((double)(T / L) * (double)L);
  std::vector<double> A((size_t)(T * N));
  for (int64_t t = 0; t < T; t++) {
    const float* st = &s[(size_t)(t * N)];
    std::vector<double> ds((size_t)N, 0.0);
    double S = 1e-20, dots = 0, Z = 0, dotb = 0;
    for (int64_t j = 0; j < K; j++) S += st[idx[(size_t)(t * K + j)]];
    for (int64_t j = 0; j < K; j++)
      dots += std::fabs(dg[(size_t)(t * K + j)]) * st[idx[(size_t)(t * K + j)]] / S;
    for (int64_t j = 0; j < K; j++)
      ds[(size_t)idx[(size_t)(t * K + j)]] += c.gate == GateFn::sigmoid
                                                  ? rs / S * (std::fabs(dg[(size_t)(t * K + j)]) + dots)
                                                  : rs * std::fabs(dg[(size_t)(t * K + j)]);
    if (c.alpha != 0) {
      const double* f = &fw.bal.f[(size_t)((t / L) * N)];
      for (int64_t i = 0; i < N; i++) Z += st[i];
      for (int64_t i = 0; i < N; i++) dotb += w * f[i] * st[i] / Z;
      for (int64_t i = 0; i < N; i++) ds[(size_t)i] += (w * f[i] + dotb) / Z;
    }
    double dot = 0;
    for (int64_t i = 0; i < N; i++) dot += ds[(size_t)i] * st[i];
    for (int64_t i = 0; i < N; i++)
      A[(size_t)(t * N + i)] = c.gate == GateFn::sigmoid ? ds[(size_t)i] * st[i] * (1.0 - st[i])
                                                         : st[i] * (ds[(size_t)i] + dot);
  }
  double R = 0;
  for (int64_t cc = 0; cc < d; cc++)
    for (int64_t i = 0; i < N; i++) {
      double sum = 0;
      for (int64_t t = 0; t < T; t++) sum += std::fabs(x[(size_t)(t * d + cc)]) * A[(size_t)(t * N + i)];
      R = std::max(R, sum);
    }
  return R;
}
// y = sum_j g_j E_j(x) + h(x): dot products of length d then f (S f for h), K gated terms and
// one addition: within (d + (S + 1) f + K + 1) eps of exact times the magnitudes of its terms,
// bounded by 4 (max|routed| + max|shared|) as above (the two parts can cancel, so y alone is
// no bound). Scales holds the two maxima, from a y and the shared experts' h.
struct Scales {
  double routed = 0, shared = 0;
  double sum() const { return routed + shared; }
};
Scales scales_of(const Problem& pr, const Tensor& y) {
  if (pr.c.shared == 0) return {max_abs(y), 0.0};
  moe::ExpertCache cache;
  const Tensor h = dsv3::shared_forward(pr.p, pr.x, &cache);
  return {max_abs(sub(y.to(h.device()), h)), max_abs(h)};
}
double y_tolerance(const Problem& pr, double scale) {
  const dsv3::Config& c = pr.c;
  return 4.0 * (double)(c.dim + (c.shared + 1) * c.ffn + c.topk + 1) * kEps *
         std::max(scale, 1e-3);
}
// L_bal = alpha / B sum_q sum_i f_qi P_qi, every term >= 0 (so their sum of magnitudes is the
// value). autograd's float32: s / sum(s) (N u), the mean over L tokens (L u), times f (2 u),
// the sum of B N terms (B N u), times alpha / B (u): within (N + L + B N + 4) u relative. The
// layer sums in double from the same float32 s: ~exact. tol = (N + L + B N + 4) eps |want|
// (twice that bound).
double balance_tolerance(const Problem& pr, double want) {
  const double B = (double)(pr.T / pr.c.seq_len), N = (double)pr.c.experts;
  return (N + (double)pr.c.seq_len + B * N + 4.0) * kEps * std::fabs(want);
}
// Against float64 (PyTorch), the layer's affinities s carry their own float32 error: z = x W_g
// is a dot product of d terms, within d u S_z of exact (S_z = max over (t, i) of
// sum_c |x_tc W_ci|); sigmoid adds 3 u relative (exp, + 1, divide) and scales the error of z by
// (1 - s) <= 1; softmax doubles it (z_i - z_max) and adds (N + 3) u (exp, the row sum, divide).
// Either way s is within
//   kS = eps (d S_z + N + 4)        relative
// of exact. The router's outputs take s through at most four factors (the gate, its normaliser,
// s (1 - s) or the softmax Jacobian, the balance's s / sum(s)), so the golden tolerances add
//   gates: (2 kS + (K + 2) eps) relative;  y: that times max|routed|;
//   L_bal: 2 kS relative;                   gradients: 4 kS max|want|
// to the float32 bounds above (which cover the rest with one side exact: twice generous).
// Between two float32 devices (check 8) each side's s is within kS of exact: 2 kS apart, so
// the same terms with kS doubled (Slack's `sides` = 2).
double affinity_rel_error(const Problem& pr) {
  const int64_t T = pr.T, N = pr.c.experts, d = pr.c.dim;
  const std::vector<float> x = pr.x.to_vector(), w = pr.p.router_w.to_vector();
  double Sz = 0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < N; i++) {
      double s = 0;
      for (int64_t c = 0; c < d; c++) s += std::fabs(x[(size_t)(t * d + c)] * w[(size_t)(c * N + i)]);
      Sz = std::max(Sz, s);
    }
  return kEps * ((double)d * Sz + (double)N + 4.0);
}
struct Slack {  // the affinity terms above, for one problem
  double kS = 0;
  int64_t K = 0;
  Slack(const Problem& pr, int sides) : kS(sides * affinity_rel_error(pr)), K(pr.c.topk) {}
  double gate_rtol() const { return 2 * kS + (double)(K + 2) * kEps; }
  double y(const Scales& sc) const { return gate_rtol() * sc.routed; }
  double balance(double want) const { return 2 * kS * std::fabs(want); }
  double grad(const Tensor& want) const { return 4 * kS * max_abs(want); }
};

// ----------------------------------------------------------------------------
// routing helpers

struct Routing {  // the integer decisions of one forward, for exact comparison
  std::vector<int64_t> sel_idx, kept_groups, idx;
  std::vector<uint8_t> kept;
  bool operator==(const Routing& o) const {
    return sel_idx == o.sel_idx && kept_groups == o.kept_groups && idx == o.idx && kept == o.kept;
  }
};
Routing routing_of(const dsv3::Forward& f) {
  return {f.sel.idx.to_index_vector(), f.sel.kept_groups.to_index_vector(), f.assign.idx,
          f.assign.kept};
}

// The smallest gap, in the float32 scores of forward f, between two values whose order decides
// a routing decision: the group scores among a token's top M + 1 groups, the biased affinities
// among its top K + 1 experts of the kept groups, s at each over-full expert's capacity cut, and
// (conservatively: all of them) the biased affinities of every candidate expert of a token that
// overflowed. Another device's float32 s, within ~1e-6 of these, routes the same way when this
// margin is well above that.
double routing_margin(const dsv3::Config& c, const dsv3::Forward& f, const std::vector<float>& bias) {
  const int64_t T = f.s.size(0), N = c.experts, K = c.topk, G = c.groups, M = c.topk_groups;
  const int64_t per = N / G, gk = c.group_score_k();
  const std::vector<float> s = f.s.to_vector();
  const std::vector<int64_t> sel = f.sel.idx.to_index_vector(), kg = f.sel.kept_groups.to_index_vector();
  double margin = INFINITY;
  auto gaps = [&](std::vector<double> v, size_t first) {
    std::sort(v.begin(), v.end(), std::greater<double>());
    for (size_t i = 0; i + 1 < std::min(first, v.size()); i++) margin = std::min(margin, v[i] - v[i + 1]);
  };
  for (int64_t t = 0; t < T; t++) {
    auto biased = [&](int64_t e) { return (double)s[(size_t)(t * N + e)] + (double)bias[(size_t)e]; };
    std::vector<double> group_scores;
    for (int64_t g = 0; g < G; g++) {
      std::vector<double> v;
      for (int64_t e = g * per; e < (g + 1) * per; e++) v.push_back(biased(e));
      std::sort(v.begin(), v.end(), std::greater<double>());
      double sum = 0;
      for (int64_t i = 0; i < gk; i++) sum += v[(size_t)i];
      group_scores.push_back(sum);
    }
    if (G > 1) gaps(group_scores, (size_t)(M + 1));
    std::vector<double> allowed, candidates;
    for (int64_t m = 0; m < M; m++)
      for (int64_t e = kg[(size_t)(t * M + m)] * per; e < (kg[(size_t)(t * M + m)] + 1) * per; e++) {
        allowed.push_back(biased(e));
        const auto row = sel.begin() + t * K;
        if (std::find(row, row + K, e) == row + K) candidates.push_back(biased(e));
      }
    gaps(allowed, (size_t)(K + 1));
    bool overflowed = false;
    for (int64_t j = 0; j < K; j++)
      overflowed |= !f.assign.kept[(size_t)(t * K + j)] || f.assign.idx[(size_t)(t * K + j)] != sel[(size_t)(t * K + j)];
    if (overflowed) gaps(candidates, candidates.size());
  }
  for (int64_t e = 0; e < N; e++) {
    std::vector<double> v;
    for (int64_t sl = 0; sl < T * K; sl++)
      if (sel[(size_t)sl] == e) v.push_back(s[(size_t)((sl / K) * N + e)]);
    if ((int64_t)v.size() > f.assign.capacity) {
      std::sort(v.begin(), v.end(), std::greater<double>());
      margin = std::min(margin, v[(size_t)(f.assign.capacity - 1)] - v[(size_t)f.assign.capacity]);
    }
  }
  return margin;
}

// The routing's invariants: selected and final experts inside the token's kept groups and
// distinct per token; each expert's final load = its kept slots, within capacity; the table
// adds up.
void check_routing_invariants(const Problem& pr, const dsv3::Forward& f) {
  const dsv3::Config& c = pr.c;
  const int64_t T = pr.T, N = c.experts, K = c.topk, M = c.topk_groups, per = N / c.groups;
  const std::vector<int64_t> sel = f.sel.idx.to_index_vector(), kg = f.sel.kept_groups.to_index_vector();
  const dsv3::Assignment& a = f.assign;
  CHECK(a.capacity == (c.capacity_factor > 0
                           ? (int64_t)std::ceil(c.capacity_factor * (double)(T * K) / (double)N)
                           : T * K));
  std::vector<int64_t> load((size_t)N, 0), demand((size_t)N, 0);
  bool inside = true, distinct = true;
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < K; j++) {
      for (const std::vector<int64_t>* v : {&sel, &a.idx}) {
        const int64_t e = (*v)[(size_t)(t * K + j)];
        bool in = false;
        for (int64_t m = 0; m < M; m++) in |= e / per == kg[(size_t)(t * M + m)];
        inside &= in;
        for (int64_t j2 = 0; j2 < j; j2++) distinct &= (*v)[(size_t)(t * K + j2)] != e;
      }
      demand[(size_t)sel[(size_t)(t * K + j)]]++;
      if (a.kept[(size_t)(t * K + j)]) load[(size_t)a.idx[(size_t)(t * K + j)]]++;
    }
  CHECK_MESSAGE(inside, "an expert outside the token's kept groups");
  CHECK_MESSAGE(distinct, "a token uses the same expert twice");
  for (int64_t e = 0; e < N; e++) {
    const dsv3::ExpertLoad& L = a.experts[(size_t)e];
    INFO("expert " << e);
    CHECK(L.demand == demand[(size_t)e]);
    CHECK(L.load == load[(size_t)e]);
    CHECK(L.load <= a.capacity);
    CHECK(L.demand == L.load + L.dropped + L.moved_out - L.moved_in);
    CHECK(L.overflow == L.dropped + L.moved_out);
    if (c.overflow == Overflow::drop) CHECK(L.moved_in + L.moved_out == 0);
  }
}

// ----------------------------------------------------------------------------
// 1. the comparison with autograd

// Compares the gradients; returns which passed. Logs with FF_DSV3_VERBOSE. fw: the forward
// they are of (for d router_w's floor). extra(want) is an additional tolerance (the goldens'
// affinity term), 0 against float32 references of the same s.
std::vector<bool> compare_grads(const Problem& pr, const dsv3::Forward& fw, const dsv3::Grads& got,
                                const dsv3::Grads& want, const std::string& label,
                                const std::function<double(const Tensor&)>& extra = nullptr) {
  const double router_floor = router_term_scale(pr, fw);
  std::vector<bool> pass;
  const bool shared = pr.c.shared > 0;
  const std::vector<Tensor> a = grad_list(got, shared), b = grad_list(want, shared);
  for (size_t i = 0; i < a.size(); i++) {
    REQUIRE_MESSAGE(a[i].defined(), pr.name << " " << kGradNames[i] << ": not computed");
    REQUIRE_MESSAGE(b[i].defined(), pr.name << " " << kGradNames[i] << ": reference has none");
    REQUIRE(a[i].shape() == b[i].shape());
    const Tensor bw = b[i].to(Device::cpu);
    const double tol = grad_tolerance(pr, bw, i == 1 ? router_floor : 0.0) + (extra ? extra(bw) : 0.0);
    const Diff d = compare(a[i].to(Device::cpu), bw, tol, 0.0);
    if (kVerbose)
      std::printf("  %-78s %-15s %-10s max abs %.2e  tol %.2e  (err/tol %.3f)\n", pr.name.c_str(),
                  label.c_str(), kGradNames[i].c_str(), d.max_abs, tol, d.max_abs / tol);
    pass.push_back(d.pass);
  }
  return pass;
}

// Hand-written forward and backward vs the autograd reference on the same routing.
dsv3::Forward check_against_autograd(const Problem& pr) {
  INFO(pr.name);
  const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
  const dsv3::Grads g = dsv3::backward(pr.c, pr.p, pr.x, fw, pr.dy);
  const dsv3::Reference ref = dsv3::autograd_reference(pr.c, pr.p, pr.x, pr.dy, fw.assign);
  check_routing_invariants(pr, fw);
  const double ytol = y_tolerance(pr, scales_of(pr, ref.y).sum());
  const Diff dy = compare(fw.y, ref.y, ytol, 0.0);
  CHECK_MESSAGE(dy.pass, "y: max abs " << dy.max_abs << " > " << ytol);
  const double btol = balance_tolerance(pr, ref.balance);
  CHECK_MESSAGE(std::fabs(fw.balance - ref.balance) <= btol,
                "L_bal: " << fw.balance << " vs " << ref.balance << " (tol " << btol << ")");
  if (pr.c.alpha > 0) CHECK(fw.balance > 0);
  if (kVerbose)
    std::printf("  %-78s forward         y max abs %.2e tol %.2e; L_bal err %.2e tol %.2e\n",
                pr.name.c_str(), dy.max_abs, ytol, std::fabs(fw.balance - ref.balance), btol);
  const std::vector<bool> pass = compare_grads(pr, fw, g, ref.grads, "vs autograd");
  for (size_t i = 0; i < pass.size(); i++)
    CHECK_MESSAGE(pass[i], kGradNames[i] << " differs from autograd");
  for (const Tensor& t : grad_list(g, pr.c.shared > 0)) CHECK(all_finite(t));
  CHECK(all_finite(fw.y));
  return fw;
}

// ----------------------------------------------------------------------------
// 2. finite differences

// L = sum(y * dy) + L_bal with the float32 forward, summed in double; the routing it took.
double loss_of_forward(const Problem& pr, Routing* routing) {
  const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
  const std::vector<float> y = fw.y.to_vector(), dy = pr.dy.to_vector();
  double L = fw.balance;
  for (size_t i = 0; i < y.size(); i++) L += (double)y[i] * dy[i];
  *routing = routing_of(fw);
  return L;
}

// ----------------------------------------------------------------------------
// 4. goldens

const std::string kDataDir = "tests/reference/data";

Tensor golden(const std::string& name) {
  const std::string path = kDataDir + "/dsv3_" + name + ".npy";
  REQUIRE_MESSAGE(std::filesystem::exists(path),
                  path << " not found: run the tests from the repository root "
                          "(regenerate the data with `make reference`)");
  return load_npy(path);
}

// The float64 constant of dsv3_moe.py's CASES that the float32 `stored` is the rounding of.
double script_value(float stored) {
  for (double v : {0.0, 0.3, 0.75, 1.5, 2.5})
    if ((float)v == stored) return v;
  FAIL("config value " << stored << " is none of dsv3_moe.py's constants");
  return 0;
}

// A golden case as a Problem: the configuration from dsv3_<case>_config (its layout is in
// tests/reference/dsv3_moe.py), alpha and route_scale and capacity_factor as the script's
// float64 constants (the file holds them rounded to float32).
Problem golden_problem(const std::string& cn) {
  Problem pr;
  pr.name = cn + " (golden)";
  const std::vector<float> cfg = golden(cn + "_config").to_vector();
  REQUIRE(cfg.size() == 12);
  dsv3::Config& c = pr.c;
  c.gate = cfg[0] == 0.f ? GateFn::sigmoid : GateFn::softmax;
  c.experts = (int64_t)cfg[1], c.topk = (int64_t)cfg[2], c.groups = (int64_t)cfg[3];
  c.topk_groups = (int64_t)cfg[4], c.group_score_topk = (int64_t)cfg[5], c.shared = (int64_t)cfg[6];
  c.alpha = script_value(cfg[7]);
  c.route_scale = script_value(cfg[8]);
  c.capacity_factor = script_value(cfg[9]);
  c.overflow = cfg[10] == 0.f ? Overflow::drop : Overflow::next_best;
  c.seq_len = (int64_t)cfg[11];
  pr.x = golden(cn + "_x");
  pr.dy = golden(cn + "_dy");
  pr.T = pr.x.size(0);
  c.dim = pr.x.size(1);
  pr.p.router_w = golden(cn + "_router_w");
  pr.p.bias = golden(cn + "_bias");
  pr.p.w1 = golden(cn + "_experts_w1");
  pr.p.w3 = golden(cn + "_experts_w3");
  pr.p.w2 = golden(cn + "_experts_w2");
  c.ffn = pr.p.w1.size(2);
  if (c.shared > 0) {
    pr.p.sw1 = golden(cn + "_shared_w1");
    pr.p.sw3 = golden(cn + "_shared_w3");
    pr.p.sw2 = golden(cn + "_shared_w2");
  }
  return pr;
}

const char* kGoldenCases[4] = {"sigmoid_groups", "softmax", "capacity_drop", "capacity_next_best"};

// ----------------------------------------------------------------------------
// 5. capacity by hand

struct HandCase {
  dsv3::Config c;
  int64_t T;
  std::vector<float> s, bias;
  std::vector<int64_t> idx, kept_groups;
};

dsv3::Config hand_config(int64_t N, int64_t K, int64_t G, int64_t M, double C, Overflow o) {
  dsv3::Config c;
  c.experts = N, c.topk = K, c.groups = G, c.topk_groups = M, c.capacity_factor = C, c.overflow = o;
  return c;
}

dsv3::Assignment run_hand(const HandCase& h) {
  return dsv3::assign_capacity(h.c, h.s, h.bias, h.idx, h.kept_groups, h.T);
}

// {demand, overflow, dropped, moved_out, moved_in, load} of every expert
std::vector<std::vector<int64_t>> table(const dsv3::Assignment& a) {
  std::vector<std::vector<int64_t>> v;
  for (const dsv3::ExpertLoad& L : a.experts)
    v.push_back({L.demand, L.overflow, L.dropped, L.moved_out, L.moved_in, L.load});
  return v;
}

void check_bookkeeping(const dsv3::Assignment& a) {
  for (size_t e = 0; e < a.experts.size(); e++) {
    const dsv3::ExpertLoad& L = a.experts[e];
    INFO("expert " << e);
    CHECK(L.load <= a.capacity);
    CHECK(L.capacity == a.capacity);
    CHECK(L.demand == L.load + L.dropped + L.moved_out - L.moved_in);
  }
}

TEST_CASE("dsv3: by default a group scores as DeepSeek's code: the top-2 sum with the sigmoid gate, its maximum with softmax") {
  // inference/model.py's Gate: group_scores = scores.amax(-1) when the gate has no bias (the
  // softmax gate), scores.topk(2).sum(-1) when it has one (the sigmoid gate, DeepSeek-V3)
  dsv3::Config c;
  c.experts = 8, c.groups = 2, c.topk_groups = 1, c.topk = 1;
  c.gate = GateFn::sigmoid;
  CHECK(c.group_score_k() == 2);
  c.gate = GateFn::softmax;
  CHECK(c.group_score_k() == 1);
  c.group_score_topk = 3;  // given: taken, capped at N/G
  CHECK(c.group_score_k() == 3);
  c.group_score_topk = 9;
  CHECK(c.group_score_k() == 4);
  // one token: group 0 holds the larger maximum (0.5), group 1 the larger top-2 sum (0.6)
  const Tensor scores = Tensor::from_vector({0.5f, 0.f, 0.f, 0.f, 0.3f, 0.3f, 0.f, 0.f}, {1, 8});
  const Tensor bias = Tensor::zeros({8});
  c.group_score_topk = 0;
  c.gate = GateFn::softmax;
  CHECK(dsv3::select(c, scores, bias).idx.to_index_vector() == std::vector<int64_t>{0});
  c.gate = GateFn::sigmoid;
  CHECK(dsv3::select(c, scores, bias).idx.to_index_vector() == std::vector<int64_t>{4});
}

// ----------------------------------------------------------------------------
// 7. seed 003's balance loss

// Seed 003's load_balance_sequence_wise over sequences k = 1 .. B - 1 (k = 0 divides by 0):
//   alpha sum_k sum_i (N / (k L) count_ki) P_ki / L
// with count (of the experts in `sel`) and P from the layer's s, in double.
double seed003_balance_skip_k0(const dsv3::Config& c, const std::vector<float>& s,
                               const std::vector<int64_t>& sel, int64_t T, double* k0_term) {
  const int64_t N = c.experts, K = c.topk, L = c.seq_len, B = T / L;
  double total = 0;
  for (int64_t k = 0; k < B; k++) {
    std::vector<double> count((size_t)N, 0.0), P((size_t)N, 0.0);
    for (int64_t t = k * L; t < (k + 1) * L; t++) {
      for (int64_t j = 0; j < K; j++) count[(size_t)sel[(size_t)(t * K + j)]] += 1;
      double Z = 0;
      for (int64_t i = 0; i < N; i++) Z += s[(size_t)(t * N + i)];
      for (int64_t i = 0; i < N; i++) P[(size_t)i] += s[(size_t)(t * N + i)] / Z / (double)L;
    }
    double term = 0;
    const double zero_or_k = (double)(k * L);  // the seed's (k * seq_len): 0 at k = 0
    for (int64_t i = 0; i < N; i++) term += (double)N / zero_or_k * count[(size_t)i] * P[(size_t)i];
    term /= (double)L;
    if (k == 0)
      *k0_term = c.alpha * term;
    else
      total += term;
  }
  return c.alpha * total;
}

}  // namespace

// ----------------------------------------------------------------------------
// 1. backward vs autograd

TEST_CASE("dsv3: hand-written forward and backward equal autograd of the same layer") {
  const GateFn sig = GateFn::sigmoid, soft = GateFn::softmax;
  const Overflow drop = Overflow::drop, next = Overflow::next_best;
  const Spec specs[] = {
      // name              T   L  d  f   N  K  G  M  S  gate  rs   alpha  C     overflow seed bias
      {"groups",          24,  8, 8, 12, 8, 2, 4, 2, 1, sig,  2.5, 0.7,  0,    drop, 500, 0.05},
      {"groups",          24,  8, 8, 12, 8, 2, 4, 2, 1, soft, 1.5, 0.7,  0,    drop, 501, 0.05},
      {"no groups, S = 0", 16, 8, 6, 10, 6, 2, 1, 1, 0, sig,  2.5, 0.7,  0,    drop, 502, 0.05},
      {"no groups, S = 2", 16, 4, 6, 10, 6, 2, 1, 1, 2, soft, 1.5, 0.7,  0,    drop, 503, 0.05},
      {"capacity drop",   24,  8, 6, 10, 8, 2, 2, 1, 1, sig,  2.5, 0.7,  0.75, drop, 504, 0.05},
      {"capacity drop",   24,  8, 6, 10, 8, 2, 1, 1, 2, soft, 1.5, 0.7,  0.75, drop, 505, 0.05},
      {"capacity next",   24,  8, 6, 10, 8, 2, 2, 1, 1, sig,  2.5, 0.7,  0.75, next, 506, 0.05},
      {"capacity next",   24,  8, 6, 10, 8, 2, 4, 2, 0, soft, 1.5, 0.7,  0.75, next, 507, 0.05},
      {"capacity next",   20, 10, 5,  9, 6, 3, 1, 1, 1, sig,  2.5, 0.7,  1.0,  next, 508, 0.05},
      {"K = 1",           12,  4, 6, 10, 4, 1, 2, 1, 1, sig,  2.5, 0.7,  0,    drop, 509, 0.05},
      {"K = 1",           12,  4, 6, 10, 4, 1, 2, 1, 1, soft, 1.5, 0.7,  0.5,  next, 510, 0.05},
      {"K = N",           10,  5, 6, 10, 4, 4, 1, 1, 1, sig,  2.5, 0.7,  0,    drop, 511, 0.05},
      {"K = N",           10,  5, 6, 10, 4, 4, 1, 1, 1, soft, 1.5, 0.7,  0,    drop, 512, 0.05},
      {"N = 1",            9,  3, 6, 10, 1, 1, 1, 1, 1, sig,  2.5, 0.7,  0,    drop, 513, 0.05},
      {"N = 1",            9,  3, 6, 10, 1, 1, 1, 1, 1, soft, 1.5, 0.7,  0,    drop, 514, 0.05},
      {"one sequence, odd T", 7, 7, 5, 9, 6, 2, 3, 2, 1, sig,  2.5, 0.7,  0,    drop, 515, 0.05},
      {"one sequence, odd T", 7, 7, 5, 9, 6, 2, 3, 2, 1, soft, 1.0, 0.7,  0.8,  next, 516, 0.05},
      {"T = 1",            1,  1, 4,  6, 4, 2, 2, 1, 1, sig,  2.5, 0.7,  0,    drop, 517, 0.05},
  };
  int dropped_somewhere = 0, moved_somewhere = 0;
  for (const Spec& s : specs) {
    const Problem pr = make_problem(s);
    const dsv3::Forward fw = check_against_autograd(pr);
    for (const dsv3::ExpertLoad& L : fw.assign.experts)
      dropped_somewhere += (int)L.dropped, moved_somewhere += (int)L.moved_out;
    // K = N and N = 1: f_i = 1 for every expert, so L_bal = alpha sum_i P_i = alpha, with no
    // gradient (the balance's path then adds a constant to every ds_i, which s / sum(s)
    // maps to 0). Float32: as balance_tolerance.
    if (s.K == s.N) {
      INFO(pr.name);
      CHECK(std::fabs(fw.balance - s.alpha) <= balance_tolerance(pr, s.alpha));
    }
  }
  // the capacity problems above do exercise overflow: some slots dropped, some moved
  CHECK(dropped_somewhere > 0);
  CHECK(moved_somewhere > 0);
}

// ----------------------------------------------------------------------------
// 2. finite differences

TEST_CASE("dsv3: hand-written backward equals central finite differences of the forward") {
  // L = sum(y * dy) + L_bal, so dL/dy = dy and the backward is dsv3::backward(dy). Each numeric
  // derivative is D(h) = (L(v + h) - L(v - h)) / 2h with the float32 forward. Its error:
  //   rounding: each L is within B_L of exact, B_L = sum|dy| * (y's bound, y_tolerance) +
  //     L_bal's (balance_tolerance), so D is within B_L / h;
  //   truncation: h^2 / 6 L'''. Estimated by Richardson's rule: with step 2h the h^2 term is
  //     4 times larger, so it is ~|D(2h) - D(h)| / 3, plus that difference's rounding,
  //     B_L / h / 3 + B_L / 2h / 3 = B_L / 2h.
  //   tol = 1.5 B_L / h + |D(2h) - D(h)| / 3       (as in test_moe.cpp)
  // h = 1e-2, as there. The routing (selection, kept groups, capacity cut, next-best) is
  // piecewise constant in the inputs: where v +- h or v +- 2h changes any decision, D means
  // nothing, so those entries are skipped and counted; enough must remain. The capacity problem
  // has overflow (asserted), so its finite differences see dropped and moved slots.
  // The same tolerance must reject each planted bug (that applies: bias_grad and no_renorm
  // with the sigmoid gate) on some of the entries; the sigmoid problem's bias spread is 0.3, so
  // that bias_grad's error (it normalises by sum(s + b) instead of sum(s)) is well above it.
  constexpr float kStep = 1e-2f;
  const Spec specs[] = {
      {"finite differences", 8, 4, 4, 5, 6, 2, 2, 1, 1, GateFn::sigmoid, 2.5, 0.5, 0.75,
       Overflow::next_best, 1300, 0.3},
      {"finite differences", 8, 4, 4, 5, 4, 2, 1, 1, 2, GateFn::softmax, 1.5, 0.5, 0, Overflow::drop,
       1301, 0.05},
  };
  for (const Spec& s : specs) {
    Problem pr = make_problem(s);
    INFO(pr.name);
    const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
    const Routing r0 = routing_of(fw);
    if (s.capacity > 0) {
      int overflow = 0;
      for (const dsv3::ExpertLoad& L : fw.assign.experts) overflow += (int)L.overflow;
      REQUIRE(overflow > 0);
    }
    const dsv3::Grads g = dsv3::backward(pr.c, pr.p, pr.x, fw, pr.dy);
    const dsv3::Bug bugs[3] = {dsv3::Bug::bias_grad, dsv3::Bug::no_renorm, dsv3::Bug::no_shared_grad};
    std::vector<std::vector<std::vector<float>>> buggy;  // [bug][gradient] values
    for (dsv3::Bug b : bugs) {
      buggy.emplace_back();
      for (const Tensor& t : grad_list(dsv3::backward(pr.c, pr.p, pr.x, fw, pr.dy, b), pr.c.shared > 0))
        buggy.back().push_back(t.to_vector());
    }
    int caught[3] = {0, 0, 0};
    double sum_abs_dy = 0;
    for (float v : pr.dy.to_vector()) sum_abs_dy += std::fabs(v);
    const double B_L = sum_abs_dy * y_tolerance(pr, scales_of(pr, fw.y).sum()) +
                       balance_tolerance(pr, fw.balance);
    const std::vector<Tensor> analytic_t = grad_list(g, pr.c.shared > 0);
    const std::vector<Tensor> targets = input_list(pr);
    int checked = 0, skipped = 0;
    double worst = 0;
    for (size_t ti = 0; ti < targets.size(); ti++) {
      const std::vector<float> analytic = analytic_t[ti].to_vector();
      float* v = targets[ti].data();
      const int64_t n = targets[ti].numel();
      const int64_t stride = std::max<int64_t>(1, n / 7);  // about 7 entries of each
      for (int64_t e = 0; e < n; e += stride) {
        const float v0 = v[e];
        bool stable = true;
        auto central = [&](float h) {
          Routing up, down;
          v[e] = v0 + h;
          const double Lup = loss_of_forward(pr, &up);
          v[e] = v0 - h;
          const double Ldown = loss_of_forward(pr, &down);
          v[e] = v0;
          stable &= up == r0 && down == r0;
          return (Lup - Ldown) / (2.0 * h);
        };
        const double d1 = central(kStep), d2 = central(2 * kStep);
        if (!stable) {
          skipped++;
          continue;
        }
        const double tol = 1.5 * B_L / kStep + std::fabs(d2 - d1) / 3;
        const double err = std::fabs(analytic[(size_t)e] - d1);
        worst = std::max(worst, err / tol);
        CHECK_MESSAGE(err <= tol, kGradNames[ti] << "[" << e << "]: backward " << analytic[(size_t)e]
                                                 << ", finite differences " << d1 << " (tolerance "
                                                 << tol << ")");
        for (int b = 0; b < 3; b++)
          if (std::fabs(buggy[(size_t)b][ti][(size_t)e] - d1) > tol) caught[b]++;
        checked++;
      }
    }
    if (kVerbose)
      std::printf("  %-78s %d entries (%d skipped: routing moved), B_L %.2e, tol(h) %.2e, worst "
                  "err/tol %.3f; bugs rejected at %d, %d, %d\n", pr.name.c_str(), checked, skipped,
                  B_L, 1.5 * B_L / kStep, worst, caught[0], caught[1], caught[2]);
    CHECK(checked >= 40);
    const bool sigmoid = s.gate == GateFn::sigmoid;
    CHECK_MESSAGE((caught[0] > 0) == sigmoid, "bias_grad rejected at " << caught[0] << " entries");
    CHECK_MESSAGE((caught[1] > 0) == sigmoid, "no_renorm rejected at " << caught[1] << " entries");
    CHECK_MESSAGE(caught[2] > 0, "no_shared_grad not rejected by finite differences");
    CHECK(skipped <= checked / 4);
  }
}

// ----------------------------------------------------------------------------
// 3. planted bugs

TEST_CASE("dsv3: each planted backward bug fails the comparison with autograd") {
  // Which gradients each bug spoils (order: dx, router_w, w1, w2, w3, sw1, sw2, sw3):
  //   bias_grad       the sigmoid gate's normaliser differentiated at s + b: dz wrong, so
  //                   router_w and dx (through dz W_g^T); the experts' untouched
  //   no_renorm       the sigmoid gate's backward as if g = route_scale s: router_w and dx
  //   no_shared_grad  dx misses the shared experts' term: dx only
  // With the softmax gate there is no normaliser: bias_grad and no_renorm are no-ops there
  // and every gradient must pass. So is bias_grad with K = 1: the normalised gate of one
  // expert is identically route_scale, whether normalised with s or with s + b (its ds is 0
  // both ways); no_renorm is not (it turns that 0 into route_scale dg). The untouched
  // gradients must still pass: the tolerance is tight, not merely loose. Bias spread 0.1, so
  // that s + b is far from s.
  struct Planted {
    dsv3::Bug bug;
    const char* name;
    bool spoils[8];
    bool sigmoid_only;
  } planted[] = {
      {dsv3::Bug::bias_grad, "bias_grad", {true, true, false, false, false, false, false, false}, true},
      {dsv3::Bug::no_renorm, "no_renorm", {true, true, false, false, false, false, false, false}, true},
      {dsv3::Bug::no_shared_grad, "no_shared_grad", {true, false, false, false, false, false, false, false}, false},
  };
  const Spec specs[] = {
      {"planted", 16, 8, 6, 8, 6, 2, 3, 2, 1, GateFn::sigmoid, 2.5, 0.5, 0, Overflow::drop, 700, 0.1},
      {"planted", 16, 8, 6, 8, 6, 2, 3, 2, 1, GateFn::softmax, 1.5, 0.5, 0, Overflow::drop, 701, 0.1},
      {"planted", 16, 8, 6, 8, 6, 2, 2, 1, 2, GateFn::sigmoid, 1.0, 0.5, 0.75, Overflow::next_best, 702, 0.1},
      {"planted", 9, 9, 5, 7, 4, 1, 1, 1, 1, GateFn::sigmoid, 2.5, 0.5, 0, Overflow::drop, 703, 0.1},
  };
  for (const Spec& s : specs) {
    const Problem pr = make_problem(s);
    const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
    const dsv3::Reference ref = dsv3::autograd_reference(pr.c, pr.p, pr.x, pr.dy, fw.assign);
    CHECK(max_abs(pr.p.bias) > 0.05);
    for (const Planted& b : planted) {
      INFO(pr.name << ", bug " << std::string(b.name));
      const dsv3::Grads g = dsv3::backward(pr.c, pr.p, pr.x, fw, pr.dy, b.bug);
      const std::vector<bool> pass = compare_grads(pr, fw, g, ref.grads, b.name);
      const bool applies = (!b.sigmoid_only || s.gate == GateFn::sigmoid) &&
                           !(b.bug == dsv3::Bug::bias_grad && s.K == 1);
      for (size_t i = 0; i < pass.size(); i++) {
        INFO(kGradNames[i]);
        CHECK(pass[i] == !(applies && b.spoils[i]));
      }
    }
  }
}

// ----------------------------------------------------------------------------
// 4. goldens

TEST_CASE("dsv3: routing, forward and gradients match PyTorch (tests/reference/data/dsv3_*)") {
  for (const char* case_name : kGoldenCases) {
    const std::string cn = case_name;
    INFO(cn);
    const Problem pr = golden_problem(cn);
    const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
    const dsv3::Grads g = dsv3::backward(pr.c, pr.p, pr.x, fw, pr.dy);
    // routing: exactly PyTorch's (dsv3_moe.py draws until every decision has a margin of 1e-4)
    CHECK(fw.sel.idx.to_index_vector() == golden(cn + "_sel_idx").to_index_vector());
    CHECK(fw.sel.kept_groups.to_index_vector() == golden(cn + "_kept_groups").to_index_vector());
    CHECK(fw.assign.idx == golden(cn + "_idx").to_index_vector());
    const std::vector<int64_t> kept_want = golden(cn + "_kept").to_index_vector();
    CHECK(std::vector<int64_t>(fw.assign.kept.begin(), fw.assign.kept.end()) == kept_want);
    const std::vector<int64_t> load_want = golden(cn + "_load").to_index_vector();
    for (int64_t e = 0; e < pr.c.experts; e++)
      CHECK(fw.assign.experts[(size_t)e].load == load_want[(size_t)e]);
    check_routing_invariants(pr, fw);
    if (pr.c.capacity_factor > 0) {  // the script asserts overflow; so must the layer see it
      int64_t dropped = 0;
      for (int64_t k : kept_want) dropped += k == 0;
      CHECK(dropped > 0);
    }
    // gates, y, L_bal, gradients: the float32 bounds plus the affinities' error (kS)
    const Slack slack(pr, 1);
    const double gate_rtol = slack.gate_rtol();
    const Diff dg = compare(fw.gates, golden(cn + "_gates"), 0.0, gate_rtol);
    CHECK_MESSAGE(dg.pass, "gates: max rel " << dg.max_rel << " > " << gate_rtol);
    const Tensor want_y = golden(cn + "_y");
    const Scales sc = scales_of(pr, want_y);
    const double ytol = y_tolerance(pr, sc.sum()) + slack.y(sc);
    const Diff dy = compare(fw.y, want_y, ytol, 0.0);
    CHECK_MESSAGE(dy.pass, "y: max abs " << dy.max_abs << " > " << ytol);
    const double want_bal = golden(cn + "_balance").item();
    const double btol = balance_tolerance(pr, want_bal) + slack.balance(want_bal);
    CHECK_MESSAGE(std::fabs(fw.balance - want_bal) <= btol,
                  "L_bal " << fw.balance << " vs " << want_bal << " (tol " << btol << ")");
    if (kVerbose)
      std::printf("  %-78s forward         kS %.2e; gates max rel %.2e tol %.2e; y max abs %.2e "
                  "tol %.2e; L_bal err %.2e tol %.2e\n", pr.name.c_str(), slack.kS, dg.max_rel, gate_rtol,
                  dy.max_abs, ytol, std::fabs(fw.balance - want_bal), btol);
    dsv3::Grads want;
    want.dx = golden(cn + "_dx");
    want.router_w = golden(cn + "_d_router_w");
    want.w1 = golden(cn + "_d_experts_w1");
    want.w3 = golden(cn + "_d_experts_w3");
    want.w2 = golden(cn + "_d_experts_w2");
    if (pr.c.shared > 0) {
      want.sw1 = golden(cn + "_d_shared_w1");
      want.sw3 = golden(cn + "_d_shared_w3");
      want.sw2 = golden(cn + "_d_shared_w2");
    }
    const auto extra = [&](const Tensor& w) { return slack.grad(w); };
    const std::vector<bool> pass = compare_grads(pr, fw, g, want, "vs PyTorch", extra);
    for (size_t i = 0; i < pass.size(); i++)
      CHECK_MESSAGE(pass[i], kGradNames[i] << " differs from PyTorch");
    // the same comparison rejects the planted bugs (dx is spoiled by each; bias_grad and
    // no_renorm only with the sigmoid gate)
    for (dsv3::Bug bug : {dsv3::Bug::bias_grad, dsv3::Bug::no_renorm, dsv3::Bug::no_shared_grad}) {
      if (bug != dsv3::Bug::no_shared_grad && pr.c.gate != GateFn::sigmoid) continue;
      const dsv3::Grads gb = dsv3::backward(pr.c, pr.p, pr.x, fw, pr.dy, bug);
      CHECK_FALSE(compare_grads(pr, fw, gb, want, "bug vs PyTorch", extra)[0]);
    }
  }
}

// ----------------------------------------------------------------------------
// 5. capacity by hand

TEST_CASE("dsv3: capacity by hand: drop keeps the highest affinities, next-best the best expert with room") {
  // N = 6 in G = 2 groups {0, 1, 2} {3, 4, 5}, M = 1, K = 1, T = 6, capacity_factor 2:
  // cap = ceil(2 * 6 * 1 / 6) = 2. Tokens 0..4 chose expert 0 (group 0), token 5 expert 3.
  // s[t, 0] = 0.6 0.9 0.7 0.7 0.5: expert 0 keeps token 1 (0.9) and, of the tie at 0.7, the
  // earlier slot, token 2. Tokens 0, 3, 4 overflow and are dropped. Expert 3 (demand 1) keeps.
  HandCase h;
  h.c = hand_config(6, 1, 2, 1, 2.0, Overflow::drop);
  h.T = 6;
  const float a[5] = {0.6f, 0.9f, 0.7f, 0.7f, 0.5f};
  for (int64_t t = 0; t < 6; t++) {
    // expert 3 (outside the kept group 0) scores highest: next-best must not go there
    const std::vector<float> row = {t < 5 ? a[t] : 0.2f, 0.5f, 0.4f, 0.95f, 0.1f, 0.1f};
    h.s.insert(h.s.end(), row.begin(), row.end());
  }
  h.bias = {0.f, 0.f, 0.2f, 0.f, 0.f, 0.f};
  h.idx = {0, 0, 0, 0, 0, 3};
  h.kept_groups = {0, 0, 0, 0, 0, 1};
  const dsv3::Assignment a_drop = run_hand(h);
  CHECK(a_drop.capacity == 2);
  CHECK(a_drop.idx == h.idx);  // a dropped slot keeps its first choice
  CHECK(a_drop.kept == std::vector<uint8_t>{0, 1, 1, 0, 0, 1});
  //                     demand overflow dropped out in load
  CHECK(table(a_drop) == std::vector<std::vector<int64_t>>{{5, 3, 3, 0, 0, 2},
                                                           {0, 0, 0, 0, 0, 0},
                                                           {0, 0, 0, 0, 0, 0},
                                                           {1, 0, 0, 0, 0, 1},
                                                           {0, 0, 0, 0, 0, 0},
                                                           {0, 0, 0, 0, 0, 0}});
  check_bookkeeping(a_drop);

  SUBCASE("next-best: the best expert by s + b with room, inside the kept groups") {
    // The same, with next-best. Candidates of tokens 0, 3, 4 (kept group 0, not expert 0):
    // expert 1 (s + b = 0.5) and expert 2 (0.4 + 0.2 = 0.6: best by s + b, not by s); expert 3
    // (0.95) is outside the kept group. In global slot order: token 0 -> 2 (load 1), token 3
    // -> 2 (load 2, full), token 4 -> 1.
    h.c.overflow = Overflow::next_best;
    const dsv3::Assignment a = run_hand(h);
    CHECK(a.idx == std::vector<int64_t>{2, 0, 0, 2, 1, 3});
    CHECK(a.kept == std::vector<uint8_t>{1, 1, 1, 1, 1, 1});
    CHECK(table(a) == std::vector<std::vector<int64_t>>{{5, 3, 0, 3, 0, 2},
                                                        {0, 0, 0, 0, 1, 1},
                                                        {0, 0, 0, 0, 2, 2},
                                                        {1, 0, 0, 0, 0, 1},
                                                        {0, 0, 0, 0, 0, 0},
                                                        {0, 0, 0, 0, 0, 0}});
    check_bookkeeping(a);
  }
  SUBCASE("next-best with no room left: dropped") {
    // capacity_factor 1: cap = 1. Expert 0 keeps token 1; tokens 0, 2, 3, 4 overflow. Token 0
    // -> 2 (0.6; full), token 2 -> 1 (full), tokens 3 and 4 find no room in group 0: dropped.
    h.c.overflow = Overflow::next_best;
    h.c.capacity_factor = 1.0;
    const dsv3::Assignment a = run_hand(h);
    CHECK(a.capacity == 1);
    CHECK(a.idx == std::vector<int64_t>{2, 0, 1, 0, 0, 3});
    CHECK(a.kept == std::vector<uint8_t>{1, 1, 1, 0, 0, 1});
    CHECK(table(a) == std::vector<std::vector<int64_t>>{{5, 4, 2, 2, 0, 1},
                                                        {0, 0, 0, 0, 1, 1},
                                                        {0, 0, 0, 0, 1, 1},
                                                        {1, 0, 0, 0, 0, 1},
                                                        {0, 0, 0, 0, 0, 0},
                                                        {0, 0, 0, 0, 0, 0}});
    check_bookkeeping(a);
  }
  SUBCASE("capacity_factor 0 keeps everything") {
    h.c.capacity_factor = 0;
    for (Overflow o : {Overflow::drop, Overflow::next_best}) {
      h.c.overflow = o;
      const dsv3::Assignment a = run_hand(h);
      CHECK(a.capacity == h.T * h.c.topk);
      CHECK(a.idx == h.idx);
      CHECK(a.kept == std::vector<uint8_t>(6, 1));
      CHECK(a.experts[0].load == 5);
      CHECK(a.experts[0].overflow == 0);
      check_bookkeeping(a);
    }
  }
}

TEST_CASE("dsv3: capacity, next-best never gives a token an expert it already uses") {
  // N = 4, one group, K = 2, T = 3, capacity_factor 1: cap = ceil(1 * 3 * 2 / 4) = 2.
  //   s        e0   e1   e2    e3      idx (by s, descending)
  //   t0      0.9  0.8  0.3   0.2      {0, 1}
  //   t1      0.8  0.7  0.1   0.6      {0, 1}
  //   t2      0.5  0.6  0.45  0.4      {1, 0}
  // e0 keeps t0, t1 (0.9, 0.8): slot 5 (t2, j = 1) overflows; e1 keeps t0, t1 (0.8, 0.7):
  // slot 4 (t2, j = 0) overflows. Global slot order: slot 4 first -> best of {e2 0.45, e3 0.4}
  // = e2 (load 1 of 2). Slot 5: e2 still has room and scores higher than e3, but t2 now uses
  // it: -> e3.
  HandCase h;
  h.c = hand_config(4, 2, 1, 1, 1.0, Overflow::next_best);
  h.T = 3;
  h.s = {0.9f, 0.8f, 0.3f, 0.2f, 0.8f, 0.7f, 0.1f, 0.6f, 0.5f, 0.6f, 0.45f, 0.4f};
  h.bias = {0.f, 0.f, 0.f, 0.f};
  h.idx = {0, 1, 0, 1, 1, 0};
  h.kept_groups = {0, 0, 0};
  const dsv3::Assignment a = run_hand(h);
  CHECK(a.capacity == 2);
  CHECK(a.idx == std::vector<int64_t>{0, 1, 0, 1, 2, 3});
  CHECK(a.kept == std::vector<uint8_t>(6, 1));
  CHECK(table(a) == std::vector<std::vector<int64_t>>{{3, 1, 0, 1, 0, 2},
                                                      {3, 1, 0, 1, 0, 2},
                                                      {0, 0, 0, 0, 1, 1},
                                                      {0, 0, 0, 0, 1, 1}});
  check_bookkeeping(a);
  // with drop instead: t2 loses both slots
  h.c.overflow = Overflow::drop;
  const dsv3::Assignment d = run_hand(h);
  CHECK(d.kept == std::vector<uint8_t>{1, 1, 1, 1, 0, 0});
  check_bookkeeping(d);
}

TEST_CASE("dsv3: capacity bookkeeping holds on random routings, and the layer drops what it says") {
  // demand = load + dropped + moved_out - moved_in and load <= cap for every expert, over
  // capacity factors from scarce to ample, both overflow rules; and a token whose slots are
  // all dropped gets y = the shared experts' output alone.
  for (double C : {0.3, 0.75, 1.0, 1.25})
    for (Overflow o : {Overflow::drop, Overflow::next_best}) {
      const Spec s = {"bookkeeping", 32, 8, 4, 6, 8, 2, 2, 1, 1, GateFn::sigmoid, 2.5, 0.1, C, o,
                      900, 0.05};
      const Problem pr = make_problem(s);
      INFO(pr.name);
      const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
      check_routing_invariants(pr, fw);
      check_bookkeeping(fw.assign);
      moe::ExpertCache cache;
      const std::vector<float> h = dsv3::shared_forward(pr.p, pr.x, &cache).to_vector();
      const std::vector<float> y = fw.y.to_vector();
      int all_dropped = 0;
      for (int64_t t = 0; t < pr.T; t++) {
        if (fw.assign.kept[(size_t)(t * 2)] || fw.assign.kept[(size_t)(t * 2 + 1)]) continue;
        all_dropped++;
        for (int64_t c = 0; c < pr.c.dim; c++)  // y = 0 + h: one exact addition of 0
          CHECK(y[(size_t)(t * pr.c.dim + c)] == h[(size_t)(t * pr.c.dim + c)]);
      }
      // C = 0.3: cap = ceil(0.3 * 64 / 8) = 3, 24 of the 64 slots: 40 slots lost, so at least
      // 8 tokens lose both
      if (C == 0.3) CHECK(all_dropped >= 8);
    }
}

// ----------------------------------------------------------------------------
// 6. selection vs gating

TEST_CASE("dsv3: the bias changes the selection, the gates come from the unbiased s") {
  // Without a bias, then with b = +1 on expert 3: s + b > 1 > every other s + b, so expert 3
  // becomes every token's first choice, and the tokens that did not use it change experts.
  // Their gates are route_scale * s of the new experts, normalised (sigmoid) or not (softmax),
  // computed here in double from the layer's float32 s: the layer's float32 gate is within
  // (K + 3) u (the K - 1 additions, + 1e-20, the division and the scale; u = eps / 2) relative.
  // The gates s + b would give are far away: the check can tell them apart.
  for (GateFn gate : {GateFn::sigmoid, GateFn::softmax}) {
    const Spec s = {"bias", 12, 12, 6, 8, 6, 2, 1, 1, 1, gate, 2.5, 0.3, 0, Overflow::drop, 1000, 0};
    Problem pr = make_problem(s);
    INFO(pr.name);
    const int64_t T = pr.T, N = pr.c.experts, K = pr.c.topk;
    const std::vector<int64_t> before = dsv3::forward(pr.c, pr.p, pr.x).assign.idx;
    pr.p.bias = Tensor::from_vector({0, 0, 0, 1.f, 0, 0}, {N});
    const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
    const std::vector<float> sv = fw.s.to_vector(), gv = fw.gates.to_vector();
    int changed = 0;
    double worst = 0;
    const double rtol = (double)(K + 3) * kEps / 2;
    for (int64_t t = 0; t < T; t++) {
      CHECK(fw.assign.idx[(size_t)(t * K)] == 3);
      bool differs = false;
      for (int64_t j = 0; j < K; j++) differs |= fw.assign.idx[(size_t)(t * K + j)] != before[(size_t)(t * K + j)];
      if (!differs) continue;
      changed++;
      double S = 0, Sb = 0;
      for (int64_t j = 0; j < K; j++) {
        const int64_t e = fw.assign.idx[(size_t)(t * K + j)];
        S += sv[(size_t)(t * N + e)];
        Sb += sv[(size_t)(t * N + e)] + (e == 3 ? 1.0 : 0.0);
      }
      for (int64_t j = 0; j < K; j++) {
        const int64_t e = fw.assign.idx[(size_t)(t * K + j)];
        const double se = sv[(size_t)(t * N + e)], sbe = se + (e == 3 ? 1.0 : 0.0);
        const double want = gate == GateFn::sigmoid ? 2.5 * se / S : 2.5 * se;
        const double with_bias = gate == GateFn::sigmoid ? 2.5 * sbe / Sb : 2.5 * sbe;
        const double got = gv[(size_t)(t * K + j)];
        worst = std::max(worst, std::fabs(got - want) / (rtol * std::fabs(want)));
        CHECK(std::fabs(got - want) <= rtol * std::fabs(want));
        if (j == 0) CHECK(std::fabs(with_bias - want) > 1e3 * rtol * std::fabs(want));
      }
    }
    if (kVerbose)
      std::printf("  %-78s %d tokens changed experts; gates worst err/tol %.3f\n", pr.name.c_str(),
                  changed, worst);
    CHECK(changed > 0);
    // the same forward through autograd: the gates' gradient is of s, not of s + b
    check_against_autograd(pr);
  }
}

TEST_CASE("dsv3: kept groups are ranked by their top-2 sums, not by seed 001's whole-group logit sums") {
  // N = 8 in G = 2 groups of 4, M = 1, group_score_topk = 2 (DeepSeek-V3's). Per token, in
  // double from the layer's float32 s + b: the kept group is the one with the larger sum of its
  // 2 best (select); seed 001's (kept_groups_seed001) the one with the larger sum of all 4 raw
  // logits log(s / (1 - s)), no bias; idx = the top K of the kept group. Tokens whose two group scores are within 1e-5 (float rounding could order
  // them either way) are skipped; the seed gives tokens on which the two rules disagree.
  const Spec s = {"groups", 48, 8, 6, 8, 8, 2, 2, 1, 1, GateFn::sigmoid, 2.5, 0.3, 0, Overflow::drop,
                  1100, 0.05};
  const Problem pr = make_problem(s);
  const int64_t T = pr.T, N = 8, K = 2;
  const Tensor sc = dsv3::affinities(pr.c, pr.p, pr.x);
  const dsv3::Selection sel = dsv3::select(pr.c, sc, pr.p.bias);
  const std::vector<int64_t> kg = sel.kept_groups.to_index_vector(), idx = sel.idx.to_index_vector();
  const std::vector<int64_t> kg_all = dsv3::kept_groups_seed001(pr.c, sc).to_index_vector();
  const std::vector<float> sv = sc.to_vector(), b = pr.p.bias.to_vector();
  int disagree = 0, checked = 0;
  for (int64_t t = 0; t < T; t++) {
    double top2[2], all[2];
    std::vector<std::pair<double, int64_t>> in_group[2];
    for (int64_t g = 0; g < 2; g++) {
      std::vector<double> v;
      double logit_sum = 0;
      for (int64_t e = 4 * g; e < 4 * g + 4; e++) {
        const double se = (double)sv[(size_t)(t * N + e)];
        v.push_back(se + b[(size_t)e]);
        in_group[g].push_back({-v.back(), e});
        logit_sum += std::log(se) - std::log1p(-se);
      }
      std::sort(v.begin(), v.end(), std::greater<double>());
      top2[g] = v[0] + v[1];
      all[g] = logit_sum;
      std::sort(in_group[g].begin(), in_group[g].end());
    }
    if (std::fabs(top2[0] - top2[1]) < 1e-5 || std::fabs(all[0] - all[1]) < 1e-4) continue;
    checked++;
    const int64_t g_top2 = top2[1] > top2[0] ? 1 : 0, g_all = all[1] > all[0] ? 1 : 0;
    INFO("token " << t);
    CHECK(kg[(size_t)t] == g_top2);
    CHECK(kg_all[(size_t)t] == g_all);
    disagree += g_top2 != g_all;
    for (int64_t j = 0; j < K; j++) CHECK(idx[(size_t)(t * K + j)] == in_group[g_top2][(size_t)j].second);
  }
  if (kVerbose)
    std::printf("  group scores: %d tokens checked, %d where top-2 and seed 001's logit sums disagree\n",
                checked, disagree);
  CHECK(checked >= T - 2);
  CHECK(disagree > 0);
}

// ----------------------------------------------------------------------------
// 7. seed 003's balance loss

TEST_CASE("dsv3: seed 003's sequence-wise balance loss is not the report's") {
  // Seed 003 writes, per sequence k of bs,  fi = Nr / (k * seq_len) * count;
  // l_bal += (fi * pi).sum() / seq_len;  return alpha * l_bal. Its loop index k shadows top-K:
  // term k is (K / k) X_k / L with X_k = sum_i f_ki P_ki the report's per-sequence sum, against
  // the report's alpha * mean_k X_k; at k = 0 it divides by zero. On golden case sigmoid_groups:
  //   - the layer's L_bal equals the report's value written by dsv3_moe.py (tolerance as in
  //     the golden test);
  //   - the seed's k >= 1 terms computed here from the layer's s and selection equal the
  //     script's (the same tolerance: the same P's, the same float32 s error);
  //   - the k = 0 term is not finite (here and in the script);
  //   - the two values differ by far more than that tolerance.
  const Problem pr = golden_problem("sigmoid_groups");
  const dsv3::Forward fw = dsv3::forward(pr.c, pr.p, pr.x);
  const double paper = golden("seed003_balance_paper").item();
  const double seed_want = golden("seed003_balance_skip_k0").item();
  const double k0_want = golden("seed003_balance_k0_term").item();
  double k0 = 0;
  // f counts what the report's loss counts (the top K of s), so that only the seed's loop differs
  const std::vector<float> s = fw.s.to_vector();
  const double seed = seed003_balance_skip_k0(pr.c, s, dsv3::unbiased_topk(s, pr.T, pr.c.experts, pr.c.topk),
                                              pr.T, &k0);
  const Slack slack(pr, 1);
  const double tol_paper = balance_tolerance(pr, paper) + slack.balance(paper);
  const double tol_seed = balance_tolerance(pr, seed_want) + slack.balance(seed_want);
  CHECK(std::fabs(fw.balance - paper) <= tol_paper);
  CHECK(std::fabs(seed - seed_want) <= tol_seed);
  CHECK_FALSE(std::isfinite(k0));
  CHECK_FALSE(std::isfinite(k0_want));
  CHECK(std::fabs(seed - paper) > 100 * (tol_paper + tol_seed));
  if (kVerbose)
    std::printf("  seed 003: %.6f (k >= 1; k = 0 term %g), the report's: %.6f (layer %.6f)\n", seed,
                k0, paper, fw.balance);
}

// ----------------------------------------------------------------------------
// 8. device sim vs cpu

TEST_CASE("dsv3: the layer on device sim equals the layer on cpu") {
  // The same parameters and inputs on both devices (counter-based RNG). The sim kernels run
  // the CUDA sources (FMA-contracted where the CPU has FMA, and their own summation orders), so
  // floats differ by rounding: y, L_bal and the gradients must be within the float32 bounds of
  // the autograd comparison (two float32 computations of the same values in different orders)
  // plus the affinity terms of the golden comparison with kS doubled (Slack(pr, 2)): unlike in
  // check 1, the two sides' s are not the same floats here.
  // The routing is integer data: equal — on problems whose routing margin (routing_margin, in
  // the cpu scores) is far above the ~1e-6 by which the devices' s can differ.
  if (!device_available(Device::sim)) return;
  const Spec specs[] = {
      {"sim vs cpu", 16, 8, 6, 8, 6, 2, 3, 2, 1, GateFn::sigmoid, 2.5, 0.5, 0.75, Overflow::next_best, 1400, 0.05},
      {"sim vs cpu", 16, 8, 6, 8, 6, 2, 1, 1, 2, GateFn::softmax, 1.5, 0.5, 0.75, Overflow::drop, 1401, 0.05},
  };
  for (const Spec& s : specs) {
    const Problem cpu = make_problem(s, Device::cpu), sim = make_problem(s, Device::sim);
    INFO(cpu.name);
    const dsv3::Forward fc = dsv3::forward(cpu.c, cpu.p, cpu.x);
    const dsv3::Forward fs = dsv3::forward(sim.c, sim.p, sim.x);
    REQUIRE(fs.y.device() == Device::sim);
    const double margin = routing_margin(cpu.c, fc, cpu.p.bias.to_vector());
    REQUIRE_MESSAGE(margin > 1e-4, "routing margin " << margin << ": pick another seed");
    CHECK(routing_of(fs) == routing_of(fc));
    int overflow = 0;
    for (const dsv3::ExpertLoad& L : fc.assign.experts) overflow += (int)L.overflow;
    CHECK(overflow > 0);
    const Slack slack(cpu, 2);
    const Scales sc = scales_of(cpu, fc.y);
    const double ytol = y_tolerance(cpu, sc.sum()) + slack.y(sc);
    const Diff dy = compare(fs.y.to(Device::cpu), fc.y, ytol, 0.0);
    CHECK_MESSAGE(dy.pass, "y: max abs " << dy.max_abs << " > " << ytol);
    const double btol = balance_tolerance(cpu, fc.balance) + slack.balance(fc.balance);
    CHECK(std::fabs(fs.balance - fc.balance) <= btol);
    const Diff dgt = compare(fs.gates.to(Device::cpu), fc.gates, 0.0, slack.gate_rtol());
    CHECK_MESSAGE(dgt.pass, "gates: max rel " << dgt.max_rel << " > " << slack.gate_rtol());
    if (kVerbose)
      std::printf("  %-78s routing margin %.2e; y max abs %.2e tol %.2e; L_bal err %.2e tol %.2e\n",
                  cpu.name.c_str(), margin, dy.max_abs, ytol, std::fabs(fs.balance - fc.balance), btol);
    const dsv3::Grads gc = dsv3::backward(cpu.c, cpu.p, cpu.x, fc, cpu.dy);
    const dsv3::Grads gs = dsv3::backward(sim.c, sim.p, sim.x, fs, sim.dy);
    REQUIRE(gs.dx.device() == Device::sim);
    const std::vector<bool> pass = compare_grads(cpu, fc, gs, gc, "sim vs cpu",
                                                 [&](const Tensor& w) { return slack.grad(w); });
    for (size_t i = 0; i < pass.size(); i++)
      CHECK_MESSAGE(pass[i], kGradNames[i] << " on sim differs from cpu");
  }
}
