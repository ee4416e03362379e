// AdamW (common/core/optim.h) against torch.optim.AdamW: the parameters after each of 5 steps
// that tests/reference/adamw.py wrote into tests/reference/data (regenerate them with
// `/usr/bin/python3 tests/reference/adamw.py tests/reference/data`; the binary runs from the
// repository root). Three parameters of different shapes and gradient scales, lr 1e-2, with
// weight decay 0.1 and 0. Then: the same comparison fails for an update with a planted
// mistake; sim (and cuda) give the cpu's bits; the step lands in the parameter's storage.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "common/core/check.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "common/core/npy.h"

using namespace ff;

namespace {

const std::string kDataDir = "tests/reference/data";
constexpr int kSteps = 5, kParams = 3;
constexpr double kLr = 1e-2;  // the hyperparameters of adamw.py
const std::vector<std::pair<std::string, double>> kCases = {{"adamw_decay", 0.1},
                                                            {"adamw_nodecay", 0.0}};

// |got - want| <= atol + rtol |want| for every element of every parameter after every step.
// The golden is float64 math rounded once, so the budget is our float32 error alone
// (u = 2^-24 ~ 6e-8). A step rounds the parameter twice (the decay p (1 - lr wd) and the
// subtraction of the update): ~2u |p|, ~10u |p| over 5 steps, plus 0.5u for the golden's own
// rounding: rtol 1e-6 (~17u). The update lr mhat / (sqrt(vhat) + eps) has |mhat / sqrt(vhat)|
// <= (1 - beta1) / sqrt(1 - beta2) ~ 3.2 and its ~10 roundings give ~lr 30u ~ 2e-8 a step;
// a parameter that crosses 0 keeps the rounding error of its earlier, larger values, up
// to ~10u x (5 steps x lr x 3.2 ~ 0.16). Both fit in atol 2e-7. ff::Adam uses under 30% of
// this budget, PyTorch's own float32 AdamW under 25% (adamw.py prints it). A real mistake
// is far outside (see the planted mistakes below).
constexpr double kAtol = 2e-7, kRtol = 1e-6;

std::string data_path(const std::string& name) { return kDataDir + "/" + name + ".npy"; }

void require_data_dir() {
  REQUIRE_MESSAGE(std::filesystem::is_directory(kDataDir),
                  "golden data directory " << kDataDir << " not found: run the tests from the "
                  "repository root");
}

// Row k of a tensor stacked over steps, (kSteps, shape...) -> (shape...).
Tensor step_row(const Tensor& stacked, int k) {
  Shape shape(stacked.shape().begin() + 1, stacked.shape().end());
  std::vector<float> v = stacked.to_vector();
  int64_t n = shape_numel(shape);
  return Tensor::from_vector(std::vector<float>(v.begin() + k * n, v.begin() + (k + 1) * n), shape);
}

// The inputs: initial parameters, and gradients stacked over the steps.
struct Inputs {
  std::vector<Tensor> params, grads;
};
Inputs load_inputs() {
  Inputs in;
  for (int i = 0; i < kParams; i++) {
    in.params.push_back(load_npy(data_path("adamw_p" + std::to_string(i))));
    in.grads.push_back(load_npy(data_path("adamw_g" + std::to_string(i))));
  }
  return in;
}

// history[k][i]: parameter i after step k + 1, on cpu.
using History = std::vector<std::vector<Tensor>>;

// ff::Adam on device d.
History run_adam(Device d, double weight_decay) {
  Inputs in = load_inputs();
  std::vector<Tensor> params;
  for (const Tensor& p : in.params) params.push_back(p.to(d));
  std::vector<Tensor*> ptrs;
  for (Tensor& p : params) ptrs.push_back(&p);
  AdamConfig cfg;
  cfg.lr = kLr;
  cfg.weight_decay = weight_decay;
  Adam adam(cfg);
  History h;
  for (int k = 0; k < kSteps; k++) {
    std::vector<Tensor> grads;
    for (const Tensor& g : in.grads) grads.push_back(step_row(g, k).to(d));
    adam.step(ptrs, grads);
    h.emplace_back();
    for (const Tensor& p : params) h.back().push_back(p.to(Device::cpu));
  }
  return h;
}

// The same update as plain float loops written here, correct or with one planted mistake.
enum class Variant {
  correct,
  no_bias_correction,  // p -= lr m / (sqrt(v) + eps)
  l2_in_gradient,      // Adam's L2 penalty (g += wd p) instead of AdamW's decoupled decay
  decay_after_update,  // p = (p - lr mhat / (sqrt(vhat) + eps)) (1 - lr wd)
};
History run_loops(double weight_decay, Variant variant) {
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8, lr = kLr, wd = weight_decay;
  Inputs in = load_inputs();
  std::vector<std::vector<float>> p, m, v;
  for (const Tensor& t : in.params) {
    p.push_back(t.to_vector());
    m.emplace_back(p.back().size(), 0.f);
    v.emplace_back(p.back().size(), 0.f);
  }
  History h;
  for (int k = 0; k < kSteps; k++) {
    double bias1 = 1 - std::pow(b1, k + 1), bias2 = 1 - std::pow(b2, k + 1);
    if (variant == Variant::no_bias_correction) bias1 = bias2 = 1;
    h.emplace_back();
    for (int i = 0; i < kParams; i++) {
      std::vector<float> g = step_row(in.grads[i], k).to_vector();
      for (size_t j = 0; j < g.size(); j++) {
        float& x = p[i][j];
        if (variant == Variant::l2_in_gradient) g[j] += (float)wd * x;
        else if (variant != Variant::decay_after_update) x *= (float)(1 - lr * wd);
        m[i][j] = (float)b1 * m[i][j] + (float)(1 - b1) * g[j];
        v[i][j] = (float)b2 * v[i][j] + (float)(1 - b2) * g[j] * g[j];
        float mhat = m[i][j] / (float)bias1, vhat = v[i][j] / (float)bias2;
        x -= (float)lr * mhat / (std::sqrt(vhat) + (float)eps);
        if (variant == Variant::decay_after_update) x *= (float)(1 - lr * wd);
      }
      h.back().push_back(Tensor::from_vector(p[i], in.params[i].shape()));
    }
  }
  return h;
}

// Every parameter after every step against the golden; the first failure, if any.
struct Result {
  bool pass = true;
  double worst_abs = 0;  // the largest |got - want| seen
  std::string first_failure;
};
Result compare_history(const History& h, const std::string& case_name) {
  Result r;
  for (int i = 0; i < kParams; i++) {
    Tensor want = load_npy(data_path(case_name + "_p" + std::to_string(i)));
    for (int k = 0; k < kSteps; k++) {
      Diff d = compare(h[(size_t)k][(size_t)i], step_row(want, k), kAtol, kRtol);
      r.worst_abs = std::max(r.worst_abs, d.max_abs);
      if (!d.pass && r.pass) {
        r.pass = false;
        r.first_failure = case_name + " p" + std::to_string(i) + " after step " +
                          std::to_string(k + 1) + ": max abs " + std::to_string(d.max_abs) +
                          ", max rel " + std::to_string(d.max_rel);
      }
    }
  }
  return r;
}

}  // namespace

TEST_CASE("optim: AdamW matches torch.optim.AdamW after each of 5 steps, on every device") {
  require_data_dir();
  for (Device d : {Device::cpu, Device::sim, Device::cuda}) {
    if (!device_available(d)) continue;
    for (const auto& [case_name, wd] : kCases) {
      INFO(case_name << " on " << device_name(d));
      Result r = compare_history(run_adam(d, wd), case_name);
      CHECK_MESSAGE(r.pass, r.first_failure << " exceed atol " << kAtol << " + rtol " << kRtol
                                            << " * |want|");
    }
  }
}

TEST_CASE("optim: an update with a planted mistake fails the same comparison") {
  require_data_dir();
  // The loops written here pass when correct: the comparison tells right from wrong, not
  // ff::Adam's rounding from anything else.
  for (const auto& [case_name, wd] : kCases) {
    INFO(case_name);
    Result r = compare_history(run_loops(wd, Variant::correct), case_name);
    CHECK_MESSAGE(r.pass, r.first_failure);
  }
  // Each row: a mistake, the case that shows it, and how far off it is at least (the worst
  // element over the 5 steps): no bias correction makes the first step (1 - beta1) /
  // sqrt(1 - beta2) ~ 3.2 lr instead of lr, ~0.17 off after 5 steps; an L2 penalty wd p ~ 0.1
  // swamps the gradients of scale 1e-3 and Adam's normalization makes it a full step, ~0.09
  // off; decay after the update is off by lr wd x lr = 1e-5 a step, ~5e-5, still ~50 times
  // the tolerance.
  struct Planted {
    Variant variant;
    const char* name;
    const char* case_name;
    double off_by;
  } planted[] = {
      {Variant::no_bias_correction, "no bias correction", "adamw_nodecay", 1e-2},
      {Variant::no_bias_correction, "no bias correction", "adamw_decay", 1e-2},
      {Variant::l2_in_gradient, "L2 penalty in the gradient", "adamw_decay", 1e-2},
      {Variant::decay_after_update, "decay after the update", "adamw_decay", 2e-5},
  };
  for (const Planted& p : planted) {
    INFO(p.name << " against " << p.case_name);
    double wd = std::string(p.case_name) == "adamw_decay" ? 0.1 : 0.0;
    Result r = compare_history(run_loops(wd, p.variant), p.case_name);
    CHECK_FALSE(r.pass);
    CHECK(r.worst_abs > p.off_by);
  }
}

TEST_CASE("optim: AdamW on sim (and cuda) gives the cpu's bits") {
  require_data_dir();
  for (Device d : {Device::sim, Device::cuda}) {
    if (!device_available(d)) continue;
    for (const auto& [case_name, wd] : kCases) {
      History cpu = run_adam(Device::cpu, wd), dev = run_adam(d, wd);
      for (int k = 0; k < kSteps; k++)
        for (int i = 0; i < kParams; i++) {
          INFO(case_name << " on " << device_name(d) << ": p" << i << " after step " << k + 1);
          CHECK(bitwise_equal(dev[(size_t)k][(size_t)i], cpu[(size_t)k][(size_t)i]));
        }
    }
  }
}

TEST_CASE("optim: the step is written into the parameter's storage and counted") {
  Tensor w = Tensor::from_vector({1.f, -2.f, 3.f, -4.f}, {2, 2});
  Tensor alias = w.view({4});  // shares w's storage
  Adam adam;                   // lr 1e-3
  CHECK(adam.steps() == 0);
  adam.step({&w}, {Tensor::from_vector({1.f, 1.f, -1.f, -1.f}, {2, 2})});
  CHECK(adam.steps() == 1);
  // step 1 moves each element by lr * sign(g) (mhat / sqrt(vhat) = g / |g|, eps aside)
  std::vector<float> want = {1.f - 1e-3f, -2.f - 1e-3f, 3.f + 1e-3f, -4.f + 1e-3f};
  CHECK(compare(alias, Tensor::from_vector(want, {4}), 1e-6).pass);
  CHECK(bitwise_equal(alias.view({2, 2}), w));
}

TEST_CASE("optim: mismatched parameters and gradients are errors that say what differs") {
  Tensor w = Tensor::zeros({2, 3});
  Adam adam;
  CHECK_THROWS_WITH_AS(adam.step({&w}, {}), "Adam::step: 1 parameters but 0 gradients", Error);
  CHECK_THROWS_WITH_AS(adam.step({&w}, {Tensor::zeros({3, 2})}),
                       doctest::Contains("has a gradient (3, 2)"), Error);
  CHECK_THROWS_WITH_AS(adam.step({&w}, {Tensor()}), doctest::Contains("has no gradient"), Error);
  adam.step({&w}, {Tensor::zeros({2, 3})});
  Tensor other = Tensor::zeros({3, 2});
  CHECK_THROWS_WITH_AS(adam.step({&other}, {Tensor::zeros({3, 2})}),
                       doctest::Contains("the optimizer's state (2, 3)"), Error);
}

TEST_CASE("optim: Tensor::copy_from writes in place and refuses another shape, dtype or device") {
  Tensor a = Tensor::zeros({2, 2});
  Tensor view = a.view({4});
  a.copy_from(Tensor::from_vector({1, 2, 3, 4}, {2, 2}));
  CHECK(view.to_vector() == std::vector<float>{1, 2, 3, 4});
  CHECK_THROWS_AS(a.copy_from(Tensor::zeros({4})), Error);
  CHECK_THROWS_AS(a.copy_from(Tensor::zeros({2, 2}, Device::cpu, DType::i64)), Error);
  if (device_available(Device::sim))
    CHECK_THROWS_WITH_AS(a.copy_from(Tensor::zeros({2, 2}, Device::sim)),
                         doctest::Contains("on sim into a float32 tensor of shape (2, 2) on cpu"),
                         Error);
}
