// The tiny DeepSeek-style language model of common/layers/model.h (MLA + dense SwiGLU + lesson
// 05's MoE as one autograd op). Checks, each against something independent:
//   1. PyTorch goldens (tests/reference/data/model_*.npy, written by tests/reference/model.py
//      from DeepSeek-V3's inference/model.py in float64 on the same float32 weights; `make
//      reference` regenerates them): the batch is the corpus's bytes at the recorded offsets;
//      the MoE routing equal; the loss and every parameter's gradient within the tolerances
//      below; one AdamW step equal to torch.optim.AdamW's;
//   2. the same comparison fails with a bug planted in a backward: RoPE's (flip_sign, which
//      touches q_pe and k_pe's paths only) and the MoE op's (a 1% error);
//   3. central finite differences of the float32 loss on entries of every parameter, skipping
//      (and counting) perturbations that change a routing decision;
//   4. the structure: names unique and stable, every parameter a leaf, the balancing bias no
//      parameter, k_pe's projection W_kr one (d, d_rope) matrix per layer shared by the heads
//      (no per-head copy), init deterministic with norm weights 1;
//   5. a few AdamW steps on one batch lower its loss;
//   6. on device sim (the CUDA kernels under the SIMT emulator), check 1's loss, routing and
//      gradients within the same tolerances.
// FF_MODEL_VERBOSE=1 prints every measured error next to its tolerance.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "common/lesson/corpus.h"
#include "common/core/npy.h"

using namespace ff;
using ff::testing::Bug;
using ff::testing::PlantedBug;

namespace {

const bool kVerbose = std::getenv("FF_MODEL_VERBOSE") != nullptr;
const std::string kDataDir = "tests/reference/data";
const std::string kCorpus = "data/tinyshakespeare.txt";

// ---- tolerances
// float32 unit roundoff u = 2^-24 ~ 6e-8. The goldens are float64 math rounded once, so every
// budget below is our float32 error alone.
//
// A gradient element is a sum over the B T = 64 tokens of products of ~50 float32 operations
// deep (forward and backward through 2 blocks: matmuls with K <= 128 terms, rmsnorms, softmax,
// silu, rope, cross-entropy), each rounding adding ~u relative to the size of the terms it
// combines. Those terms scale with the tensor's largest gradient, not with the element (an
// element near 0 is a cancellation of O(max) terms), so the bound is normwise per tensor:
// |got - want| <= kGradTol * max|want|. With random-walk growth ~ sqrt(depth * K) u ~ 80 u =
// 5e-6 of max per element (worst-case linear growth, depth * K u, would be ~4e-4, but it needs
// every rounding to push the same way). We take 2e-5, 4x the random-walk estimate. Measured on
// cpu: at most 1.2e-6 (q_norm, kv_norm), and PyTorch's own float32 model 1.5e-6
// (tests/reference/model.py asserts the same bound for it). A 1% error in any op's backward
// (scale_by_1_01) moves its gradients by ~1e-2 of their size: 500x the bound.
constexpr double kGradTol = 2e-5;
// The loss: the mean of 64 cross-entropies of ~4.6 each, after the same forward chain: the
// same 80 u relative estimate, ~2e-5 absolute at 4.6; 1e-5 relative.
constexpr double kLossRelTol = 1e-5;
// One AdamW step (t = 1: m_hat = g, v_hat = g^2, so the update is lr g / (|g| + eps)) applied to
// the golden gradients: float32 rounding of p (1 - lr wd) - update, a few u of |p| and of lr,
// as tests/unit/test_optim.cpp's kAdamTol.
constexpr double kAdamAtol = 2e-7, kAdamRtol = 1e-6;
// The same step applied to OUR gradients g = g64 + e, |e| <= dg = kGradTol max|g64|: the update
// u(g) = lr g / (|g| + eps) moves by at most lr eps dg / (|g64| - dg + eps)^2 when the sign is
// certain (|g64| > dg), and by at most 2 lr when it is not. The bound is per element
// (adam_bound); the elements of the second kind are counted and printed.
constexpr double kLr = 1e-3, kWeightDecay = 0.1;
// Finite differences: central, step h = 1e-2, on the float32 loss L ~ 4.6. Its rounding noise,
// a few ulps of 4.6 (ulp 4.8e-7), divided by 2h gives ~5e-5 in the worst case, ~1e-5
// typically; the truncation h^2 L''' / 6 is relative to the entry's own curvature, ~1e-3 of
// the largest entries (~0.1). Measured: at most 1.2e-5 absolute.
constexpr float kFdStep = 1e-2f;
constexpr double kFdAtol = 5e-5, kFdRtol = 1e-3;

std::string data_path(const std::string& name) { return kDataDir + "/model_" + name + ".npy"; }

void require_data_dir() {
  REQUIRE_MESSAGE(std::filesystem::is_directory(kDataDir),
                  "golden data directory " << kDataDir << " not found: run the tests from the "
                  "repository root (regenerate the data with `make reference`)");
}

// ---- the golden's configuration: model.h's defaults, checked against the file
model::Config golden_config() {
  model::Config c;
  const std::vector<int64_t> v = load_npy(data_path("config")).to_index_vector();
  REQUIRE(v.size() >= 17);
  const int64_t want[] = {c.vocab, c.dim, c.layers, c.dense_layers, c.heads, c.d_nope, c.d_rope,
                          c.d_v, c.q_lora, c.kv_lora, c.ffn, c.experts, c.topk, c.shared,
                          c.moe_ffn, c.seq_len};
  for (size_t i = 0; i < std::size(want); i++)
    REQUIRE_MESSAGE(v[i] == want[i], "model_config[" << i << "] = " << v[i]
                                         << ", model.h's default " << want[i]);
  return c;
}

struct Golden {
  model::Config c;
  model::Params p;
  Tensor tokens;
};
Golden load_golden() {
  require_data_dir();
  Golden g;
  g.c = golden_config();
  g.p = model::load_params(g.c, kDataDir, "model_w_");
  g.tokens = load_npy(data_path("tokens"));
  return g;
}

// ---- gradient comparison
struct GradReport {
  std::vector<std::string> failed;  // parameter names
  double worst = 0;                 // max over parameters of max|got - want| / max|want|
};
GradReport compare_grads(const model::Params& p, bool print = kVerbose) {
  GradReport r;
  for (const model::NamedTensor& n : p.named_parameters()) {
    Tensor want = load_npy(data_path("grad_" + n.name));
    Tensor got = n.t.grad();
    REQUIRE_MESSAGE(got.defined(), n.name << ": no gradient reached it");
    REQUIRE(got.shape() == want.shape());
    const double scale = max_abs(want);
    Diff d = compare(got, want, kGradTol * scale, 0.0);
    const double err = d.max_abs / scale;
    r.worst = std::max(r.worst, err);
    if (!d.pass) r.failed.push_back(n.name);
    if (print)
      std::printf("  d %-26s max abs %.3g  = %.3g of max |grad| %.3g (tol %.0e)%s\n", n.name.c_str(),
                  d.max_abs, err, scale, kGradTol, d.pass ? "" : "  FAIL");
  }
  return r;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// the update's worst-case move for a gradient known to within dg (see kAdamAtol's comment)
double adam_bound(double g64, double dg, double eps) {
  const double a = std::fabs(g64);
  if (a <= dg) return 2 * kLr;
  const double lo = a - dg + eps;
  return kLr * eps * dg / (lo * lo);
}

}  // namespace

// ---------------------------------------------------------------------------

TEST_CASE("model: the golden batch is the corpus's bytes at the recorded offsets") {
  require_data_dir();
  std::ifstream f(kCorpus, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot read " << kCorpus);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CharCorpus corpus = CharCorpus::from_text(text);
  model::Config c = golden_config();
  CHECK(corpus.vocab_size() == c.vocab);
  const std::vector<int64_t> cfg = load_npy(data_path("config")).to_index_vector();
  Tensor tokens = load_npy(data_path("tokens"));
  const int64_t B = cfg[16], T1 = c.seq_len + 1;
  REQUIRE(tokens.shape() == (Shape{B, T1}));
  REQUIRE((int64_t)cfg.size() == 17 + B);
  const std::vector<int64_t> got = tokens.to_index_vector();
  for (int64_t b = 0; b < B; b++) {
    const int64_t o = cfg[(size_t)(17 + b)];
    REQUIRE(o + T1 <= corpus.split_size(CharCorpus::Split::train));
    const std::vector<int64_t> want = corpus.encode(text.substr((size_t)o, (size_t)T1));
    CHECK(std::equal(want.begin(), want.end(), got.begin() + b * T1));
  }
}

TEST_CASE("model: loss, routing, every gradient and one AdamW step equal PyTorch's") {
  Golden g = load_golden();
  model::Output out = model::loss_and_grads(g.c, g.p, g.tokens);

  // the routing: an integer decision with a margin of >= 1e-4 in the golden (model.py)
  int64_t moe_layer = 0;
  for (int64_t i = 0; i < g.c.layers; i++) {
    if (!g.c.is_moe(i)) continue;
    Tensor want = load_npy(data_path("route_" + std::to_string(i)));
    INFO("MoE layer " << i);
    CHECK(bitwise_equal(out.routes[(size_t)moe_layer++], want));
  }
  CHECK(moe_layer == g.c.layers - g.c.dense_layers);

  const double loss = out.loss.item(), want_loss = load_npy(data_path("loss")).item();
  if (kVerbose) std::printf("  loss %.7f, PyTorch %.7f\n", loss, want_loss);
  CHECK(std::fabs(loss - want_loss) <= kLossRelTol * std::fabs(want_loss));

  GradReport r = compare_grads(g.p);
  CHECK_MESSAGE(r.failed.empty(), r.failed.size() << " gradients outside the tolerance, first "
                                                  << (r.failed.empty() ? "" : r.failed[0]));
  if (kVerbose) std::printf("  worst gradient error %.3g of max |grad| (tol %.0e)\n", r.worst, kGradTol);

  AdamConfig ac;  // the repo's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8), decay 0.1
  ac.lr = kLr, ac.weight_decay = kWeightDecay;
  std::vector<model::NamedTensor> named = g.p.named_parameters();

  SUBCASE("AdamW on the golden gradients: float32 rounding only") {
    std::vector<Tensor*> params;
    std::vector<Tensor> grads;
    for (model::NamedTensor& n : named) {
      params.push_back(&n.t);
      grads.push_back(load_npy(data_path("grad_" + n.name)));
    }
    Adam(ac).step(params, grads);
    for (const model::NamedTensor& n : named) {
      Diff d = compare(n.t, load_npy(data_path("adamw_" + n.name)), kAdamAtol, kAdamRtol);
      CHECK_MESSAGE(d.pass, n.name << ": max abs " << d.max_abs);
    }
  }
  SUBCASE("AdamW on our gradients: within the bound the gradient tolerance implies") {
    std::vector<Tensor*> params;
    std::vector<Tensor> grads;
    for (model::NamedTensor& n : named) {
      params.push_back(&n.t);
      grads.push_back(n.t.grad());
    }
    Adam(ac).step(params, grads);
    int64_t unsure = 0, total = 0, failed = 0;
    for (size_t k = 0; k < named.size(); k++) {
      const std::vector<float> got = named[k].t.to_vector();
      const std::vector<float> want = load_npy(data_path("adamw_" + named[k].name)).to_vector();
      const std::vector<float> g64 = load_npy(data_path("grad_" + named[k].name)).to_vector();
      const double dg = kGradTol * max_abs(load_npy(data_path("grad_" + named[k].name)));
      for (size_t i = 0; i < got.size(); i++) {
        if (std::fabs(g64[i]) <= dg) unsure++;
        const double bound = kAdamAtol + kAdamRtol * std::fabs(want[i]) + adam_bound(g64[i], dg, ac.eps);
        if (std::fabs((double)got[i] - want[i]) > bound) failed++;
        total++;
      }
    }
    if (kVerbose)
      std::printf("  AdamW on our gradients: %lld of %lld elements with an uncertain sign "
                  "(|g| <= %.0e max|g|), bound 2 lr\n", (long long)unsure, (long long)total, kGradTol);
    CHECK(failed == 0);
  }
}

TEST_CASE("model: a bug planted in RoPE's or the MoE op's backward fails the gradient check") {
  Golden g = load_golden();
  SUBCASE("rope flip_sign: the q_pe and k_pe paths are wrong, the forward is not") {
    PlantedBug bug("rope", Bug::flip_sign);
    model::Output out = model::loss_and_grads(g.c, g.p, g.tokens);
    CHECK(std::fabs(out.loss.item() - load_npy(data_path("loss")).item()) <=
          kLossRelTol * 5);
    GradReport r = compare_grads(g.p, false);
    CHECK(contains(r.failed, "layers.0.attn.w_kr"));
    CHECK(contains(r.failed, "layers.1.attn.w_kr"));
    CHECK(contains(r.failed, "layers.0.attn.w_uq"));
    CHECK(!contains(r.failed, "head"));  // downstream of every attention: untouched
  }
  SUBCASE("dsv3_moe scale_by_1_01: the MoE layer's gradients are 1% off") {
    PlantedBug bug("dsv3_moe", Bug::scale_by_1_01);
    model::loss_and_grads(g.c, g.p, g.tokens);
    GradReport r = compare_grads(g.p, false);
    CHECK(contains(r.failed, "layers.1.moe.experts_w1"));
    CHECK(contains(r.failed, "layers.1.moe.router_w"));
    CHECK(contains(r.failed, "layers.1.moe.shared_w2"));
    CHECK(!contains(r.failed, "norm"));  // after the MoE: untouched
    CHECK(!contains(r.failed, "head"));
  }
}

TEST_CASE("model: gradients equal central finite differences of the loss, every parameter") {
  Golden g = load_golden();
  model::Batch b = model::split_tokens(g.tokens);
  const Tensor pos = model::positions(g.c.seq_len);
  model::Output base = model::loss_and_grads(g.c, g.p, g.tokens);
  auto loss_at = [&](std::vector<Tensor>* routes) {
    NoGradGuard no_grad;
    model::Output o = model::forward(g.c, g.p, b.inputs, b.targets, pos);
    *routes = o.routes;
    return (double)o.loss.item();
  };
  auto same_routes = [&](const std::vector<Tensor>& r) {
    for (size_t i = 0; i < r.size(); i++)
      if (!bitwise_equal(r[i], base.routes[i])) return false;
    return true;
  };
  int64_t checked = 0, skipped = 0;
  double worst = 0;
  for (const model::NamedTensor& n : g.p.named_parameters()) {
    const std::vector<float> grad = n.t.grad().to_vector();
    std::vector<float> w = n.t.to_vector();
    // the entry with the largest gradient (the most signal over the float32 noise) and two more
    // at fixed places
    std::vector<size_t> entries = {(size_t)(std::max_element(grad.begin(), grad.end(),
                                                            [](float a, float c) { return std::fabs(a) < std::fabs(c); }) -
                                            grad.begin()),
                                   w.size() / 3, w.size() - 1};
    for (size_t e : entries) {
      const float w0 = w[e];
      std::vector<Tensor> r_plus, r_minus;
      w[e] = w0 + kFdStep;
      n.t.copy_from(Tensor::from_vector(w, n.t.shape()));
      const double lp = loss_at(&r_plus);
      w[e] = w0 - kFdStep;
      n.t.copy_from(Tensor::from_vector(w, n.t.shape()));
      const double lm = loss_at(&r_minus);
      w[e] = w0;
      n.t.copy_from(Tensor::from_vector(w, n.t.shape()));
      if (!same_routes(r_plus) || !same_routes(r_minus)) {
        skipped++;
        continue;
      }
      const double fd = (lp - lm) / (2.0 * (double)kFdStep), an = grad[e];
      const double err = std::fabs(fd - an);
      worst = std::max(worst, err / (kFdAtol + kFdRtol * std::fabs(fd)));
      if (kVerbose)
        std::printf("  %-26s [%5zu] autograd %+.6e  fd %+.6e  err %.2e\n", n.name.c_str(), e, an, fd, err);
      CHECK_MESSAGE(err <= kFdAtol + kFdRtol * std::fabs(fd),
                    n.name << "[" << e << "]: autograd " << an << ", finite differences " << fd);
      checked++;
    }
  }
  if (kVerbose)
    std::printf("  %lld entries checked, %lld skipped (routing changed); worst err / tol %.2f\n",
                (long long)checked, (long long)skipped, worst);
  CHECK(skipped * 10 <= checked);  // a skip is the exception
}

TEST_CASE("model: names, leaves, the shared k_pe projection and a deterministic init") {
  model::Config c;
  model::Params p = model::init_params(c, 123);
  std::vector<model::NamedTensor> named = p.named_parameters();
  std::set<std::string> names;
  int64_t count = 0;
  for (const model::NamedTensor& n : named) {
    names.insert(n.name);
    CHECK_MESSAGE(n.t.requires_grad(), n.name << " is not a leaf requiring grad");
    CHECK(n.t.impl()->grad_fn == nullptr);
    count += n.t.numel();
  }
  CHECK(names.size() == named.size());  // unique
  CHECK(names.count("embed") == 1);
  CHECK(names.count("layers.0.attn.w_dq") == 1);
  CHECK(names.count("layers.0.ffn.w1") == 1);
  CHECK(names.count("layers.1.moe.experts_w1") == 1);
  CHECK(names.count("layers.1.moe.shared_w2") == 1);
  CHECK(names.count("head") == 1);
  CHECK(names.count("layers.1.moe.bias") == 0);  // selects only: no gradient, not trained
  REQUIRE(p.named_buffers().size() == 1);
  CHECK(p.named_buffers()[0].name == "layers.1.moe.bias");
  CHECK(!p.named_buffers()[0].t.requires_grad());
  CHECK(max_abs(p.named_buffers()[0].t) == 0.0);
  if (kVerbose) std::printf("  %zu parameter tensors, %lld values\n", named.size(), (long long)count);

  // k_pe: one projection per layer, (d, d_rope), not (d, H d_rope): every head reads the same
  for (const model::Block& b : p.layers) CHECK(b.attn.w_kr.shape() == (Shape{c.dim, c.d_rope}));

  // init: the same seed gives the same bits; norms are 1; matrices ~ 1/sqrt(fan_in)
  model::Params q = model::init_params(c, 123);
  std::vector<model::NamedTensor> named_q = q.named_parameters();
  for (size_t i = 0; i < named.size(); i++) CHECK(bitwise_equal(named[i].t, named_q[i].t));
  CHECK(max_abs(sub(p.layers[0].attn.q_norm, Tensor::full({c.q_lora}, 1.f))) == 0.0);
  CHECK(!bitwise_equal(p.layers[0].attn.w_uk, p.layers[1].attn.w_uk));  // a seed each
  const std::vector<float> wq = p.layers[0].attn.w_dq.to_vector();
  double ss = 0;
  for (float v : wq) ss += (double)v * v;
  CHECK(std::sqrt(ss / (double)wq.size()) == doctest::Approx(1.0 / std::sqrt((double)c.dim)).epsilon(0.1));

  // a bad config names the setting
  model::Config bad = c;
  bad.d_rope = 7;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("d_rope = 7"), ff::Error);
}

TEST_CASE("model: a few AdamW steps on one batch lower its loss") {
  model::Config c;
  model::Params p = model::init_params(c, 7);
  Tensor tokens = randint({2, c.seq_len + 1}, 99, c.vocab);
  AdamConfig ac;
  ac.lr = 1e-2;
  Adam adam(ac);
  std::vector<model::NamedTensor> named = p.named_parameters();
  std::vector<Tensor*> params;
  for (model::NamedTensor& n : named) params.push_back(&n.t);
  double first = 0, last = 0;
  for (int step = 0; step < 8; step++) {
    model::Output out = model::loss_and_grads(c, p, tokens);
    last = out.loss.item();
    if (step == 0) first = last;
    REQUIRE(std::isfinite(last));
    std::vector<Tensor> grads;
    for (const model::NamedTensor& n : named) grads.push_back(n.t.grad());
    adam.step(params, grads);
  }
  if (kVerbose) std::printf("  loss %.4f -> %.4f after 8 steps\n", first, last);
  CHECK(first > 3.0);
  CHECK(last < first - 1.0);
}

TEST_CASE("model: on device sim, the loss, routing and every gradient equal PyTorch's too") {
  // The same golden comparison through the CUDA kernels run by the SIMT emulator: the sim
  // build fuses a * b + c (as nvcc does) and sums in other orders, which changes roundings
  // but not their count: the same tolerances hold.
  Golden g = load_golden();
  model::Params p = model::load_params(g.c, kDataDir, "model_w_", Device::sim);
  model::Output out = model::loss_and_grads(g.c, p, g.tokens.to(Device::sim));
  REQUIRE(out.loss.device() == Device::sim);
  REQUIRE(p.layers[1].attn.w_kr.grad().device() == Device::sim);
  CHECK(bitwise_equal(out.routes[0].to(Device::cpu), load_npy(data_path("route_1"))));
  const double want_loss = load_npy(data_path("loss")).item();
  CHECK(std::fabs(out.loss.item() - want_loss) <= kLossRelTol * std::fabs(want_loss));
  for (const model::NamedTensor& n : p.named_parameters()) {
    Tensor want = load_npy(data_path("grad_" + n.name));
    Diff d = compare(n.t.grad().to(Device::cpu), want, kGradTol * max_abs(want), 0.0);
    if (kVerbose)
      std::printf("  sim d %-26s %.3g of max |grad|\n", n.name.c_str(), d.max_abs / max_abs(want));
    CHECK_MESSAGE(d.pass, n.name << " on sim: max abs " << d.max_abs);
  }
}

TEST_CASE("model: all-dense and all-MoE stacks, and sequences shorter than seq_len") {
  model::Config c;
  c.layers = 2;
  for (int64_t dense : {int64_t(2), int64_t(0)}) {
    c.dense_layers = dense;
    model::Params p = model::init_params(c, 5);
    Tensor tokens = randint({3, 9}, 17, c.vocab);  // B = 3, T = 8
    model::Output out = model::loss_and_grads(c, p, tokens);
    INFO("dense_layers = " << dense);
    CHECK(std::isfinite(out.loss.item()));
    CHECK(out.logits.shape() == (Shape{3 * 8, c.vocab}));
    CHECK((int64_t)out.routes.size() == c.layers - dense);
    int64_t moe_tensors = 0, dense_tensors = 0;
    for (const model::NamedTensor& n : p.named_parameters()) {
      CHECK_MESSAGE(n.t.grad().defined(), n.name << " got no gradient");
      moe_tensors += n.name.find(".moe.") != std::string::npos;
      dense_tensors += n.name.find(".ffn.") != std::string::npos;
    }
    CHECK(moe_tensors == (c.layers - dense) * 7);  // router, 3 routed, 3 shared
    CHECK(dense_tensors == dense * 3);
  }
}

// ---------------------------------------------------------------------------
// The MoE op's backward split into I (dx) and W (every weight's gradient), as a zero-bubble
// pipeline runs it: run_backward(y, dy, &deferred) computes dx, deferred.run() the rest.
namespace {

struct MoeLeaves {
  dsv3::Params p;
  Tensor u;
  // the same values on every call (seeded); the balancing bias is no leaf
  MoeLeaves(const dsv3::Config& c, int64_t T) {
    p = dsv3::init_params(c, 41, 0.5, Device::cpu);
    for (Tensor* t : {&p.router_w, &p.w1, &p.w3, &p.w2, &p.sw1, &p.sw3, &p.sw2})
      if (t->defined()) t->requires_grad_();
    u = randn({T, c.dim}, 42).requires_grad_();
  }
  std::vector<std::pair<std::string, Tensor>> grads() const {
    std::vector<std::pair<std::string, Tensor>> g = {{"dx", u.grad()}, {"router_w", p.router_w.grad()},
                                                     {"w1", p.w1.grad()}, {"w3", p.w3.grad()},
                                                     {"w2", p.w2.grad()}};
    if (p.sw1.defined())
      g.insert(g.end(), {{"sw1", p.sw1.grad()}, {"sw3", p.sw3.grad()}, {"sw2", p.sw2.grad()}});
    return g;
  }
};

// The names of the gradients of `got` that are missing or not bit for bit those of `want`.
std::vector<std::string> differing(const MoeLeaves& got, const MoeLeaves& want) {
  std::vector<std::string> out;
  const auto g = got.grads(), w = want.grads();
  for (size_t i = 0; i < g.size(); i++)
    if (!g[i].second.defined() || !bitwise_equal(g[i].second, w[i].second)) out.push_back(g[i].first);
  return out;
}

// Every branch of the layer: shared experts or none, a balance loss, capacity with dropped
// slots (the packed rows past kept_rows) or none.
std::vector<dsv3::Config> moe_configs() {
  std::vector<dsv3::Config> cs;
  for (int64_t shared : {1, 0})
    for (double capacity : {0.0, 1.0}) {
      dsv3::Config c;
      c.shared = shared, c.capacity_factor = capacity, c.alpha = 0.01, c.seq_len = 16;
      cs.push_back(c);
    }
  return cs;
}

}  // namespace

TEST_CASE("model: the MoE op defers every weight gradient to W; I then W equals one backward bit for bit") {
  const int64_t T = 32;
  for (const dsv3::Config& c : moe_configs()) {
    CAPTURE(c.shared);
    CAPTURE(c.capacity_factor);
    Tensor dy = randn({T, c.dim}, 43);
    MoeLeaves full(c, T), split(c, T);
    run_backward(model::moe_ffn(c, full.p, full.u), dy);
    {  // the op's gradients are the hand-written backward's (dsv3::backward, in one piece)
      NoGradGuard no_grad;
      dsv3::Params w = full.p;
      for (Tensor* t : {&w.router_w, &w.w1, &w.w3, &w.w2, &w.sw1, &w.sw3, &w.sw2})
        if (t->defined()) *t = t->detach();
      const Tensor x = full.u.detach();
      dsv3::Grads g = dsv3::backward(c, w, x, dsv3::forward(c, w, x), dy);
      CHECK(bitwise_equal(full.u.grad(), g.dx));
      CHECK(bitwise_equal(full.p.router_w.grad(), g.router_w));
      CHECK(bitwise_equal(full.p.w1.grad(), g.w1));
      CHECK(bitwise_equal(full.p.w2.grad(), g.w2));
      CHECK(bitwise_equal(full.p.w3.grad(), g.w3));
      if (c.shared > 0) CHECK(bitwise_equal(full.p.sw2.grad(), g.sw2));
    }

    DeferredGrads deferred;
    run_backward(model::moe_ffn(c, split.p, split.u), dy, &deferred);
    CHECK(deferred.size() == 1);  // the op's one W
    REQUIRE(split.u.grad().defined());
    CHECK(bitwise_equal(split.u.grad(), full.u.grad()));  // I: dx, whole
    for (const auto& [name, g] : split.grads())
      if (name != "dx") CHECK_MESSAGE(!g.defined(), name << " was computed in I");
    deferred.run();
    CHECK(differing(split, full).empty());
  }
}

TEST_CASE("model: the MoE op's I-then-W check fails with W skipped or a bug planted in the op's gradients") {
  const int64_t T = 32;
  dsv3::Config c = moe_configs()[1];  // shared experts, capacity
  Tensor dy = randn({T, c.dim}, 43);
  MoeLeaves full(c, T);
  run_backward(model::moe_ffn(c, full.p, full.u), dy);
  const std::vector<std::string> weights = {"router_w", "w1", "w3", "w2", "sw1", "sw3", "sw2"};
  SUBCASE("W skipped: every weight's gradient is missing, dx is right") {
    MoeLeaves s(c, T);
    DeferredGrads deferred;
    run_backward(model::moe_ffn(c, s.p, s.u), dy, &deferred);
    deferred.clear();
    CHECK(differing(s, full) == weights);
  }
  SUBCASE("scale_by_1_01 planted in the op: every gradient, I's and W's, is 1% off") {
    MoeLeaves s(c, T);
    {
      testing::PlantedBug bug("dsv3_moe", Bug::scale_by_1_01);
      DeferredGrads deferred;
      run_backward(model::moe_ffn(c, s.p, s.u), dy, &deferred);
      deferred.run();
    }
    std::vector<std::string> all = weights;
    all.insert(all.begin(), "dx");
    CHECK(differing(s, full) == all);
    CHECK_FALSE(compare(s.p.w2.grad(), full.p.w2.grad(), 0.0, 1e-3).pass);  // not rounding: 1%
  }
  SUBCASE("drop_first_input planted in the op: dx is zero, the deferred weights are untouched") {
    MoeLeaves s(c, T);
    {
      testing::PlantedBug bug("dsv3_moe", Bug::drop_first_input);
      DeferredGrads deferred;
      run_backward(model::moe_ffn(c, s.p, s.u), dy, &deferred);
      deferred.run();
    }
    CHECK(differing(s, full) == std::vector<std::string>{"dx"});
  }
}

TEST_CASE("model: with deferral, I leaves every MoE and matmul weight's gradient to W; then one backward's bits") {
  model::Config c;  // dense then MoE block
  model::Params full = model::init_params(c, 5), split = model::init_params(c, 5);
  Tensor tokens = randint({2, 17}, 19, c.vocab);
  model::loss_and_grads(c, full, tokens);
  model::Batch b = model::split_tokens(tokens);
  model::Output out = model::forward(c, split, b.inputs, b.targets, model::positions(b.inputs.size(1)));
  DeferredGrads deferred;
  run_backward(out.loss, Tensor::full({}, 1.f), &deferred);
  const std::vector<model::NamedTensor> got = split.named_parameters(), want = full.named_parameters();
  int moe = 0, now = 0;
  for (const model::NamedTensor& n : got) {
    const bool is_moe = n.name.find(".moe.") != std::string::npos;
    moe += is_moe;
    if (is_moe) CHECK_MESSAGE(!n.t.grad().defined(), n.name << " was computed in I");
    now += n.t.grad().defined();  // embeddings and norm weights: never deferred
  }
  CHECK(moe == 7);
  CHECK(now > 0);
  CHECK(now < (int)got.size() - moe);  // the attention's and dense FFN's matmul weights wait too
  deferred.run();
  for (size_t i = 0; i < got.size(); i++) {
    REQUIRE_MESSAGE(got[i].t.grad().defined(), got[i].name);
    CHECK_MESSAGE(bitwise_equal(got[i].t.grad(), want[i].t.grad()), got[i].name);
  }
}

TEST_CASE("model: a LinearScope runs its product in the ten linear layers of a forward, and ends") {
  model::Config c;
  c.seq_len = 8;
  const model::Params p = model::init_params(c, 5);
  const Tensor tokens = randint({2, 9}, 6, c.vocab);
  const double plain = model::loss_and_grads(c, p, tokens).loss.item();
  int calls = 0;
  double doubled = 0;
  {
    // each linear layer's product doubled: counted, and seen in the loss
    const model::LinearScope twice([&](const Tensor& x, const Tensor& w) { return calls++, scale(matmul(x, w), 2.f); });
    doubled = model::loss_and_grads(c, p, tokens).loss.item();
  }
  // seven projections in every layer's MLA, three matrices in every dense FFN
  CHECK(calls == 7 * c.layers + 3 * c.dense_layers);
  CHECK(doubled != plain);
  // the scope has ended: matmul again, the same loss bit for bit, the product not called
  const double after = model::loss_and_grads(c, p, tokens).loss.item();
  CHECK(after == plain);
  CHECK(calls == 7 * c.layers + 3 * c.dense_layers);
}
