// common/core/check.cpp — tensor comparisons and the gradient check (check.h).
#include "common/core/check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/core/tensor.h"

namespace ff {

Diff compare(const Tensor& got, const Tensor& want, double atol, double rtol) {
  FF_CHECK(got.shape() == want.shape(), "compare: shapes " << shape_str(got.shape()) << " and "
                                                           << shape_str(want.shape()) << " differ");
  std::vector<float> a = got.to_vector(), b = want.to_vector();
  Diff d;
  for (size_t i = 0; i < a.size(); i++) {
    double x = a[i], y = b[i];
    bool same_inf = std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0);
    double err = same_inf ? 0.0 : std::fabs(x - y);
    if (std::isnan(x) && std::isnan(y)) err = 0.0;  // NaN where NaN is expected
    double rel = err / std::fmax(std::fabs(y), 1e-30);
    if (std::isnan(err)) {  // NaN on one side only: report it as NaN, never as a number
      d.max_abs = d.max_rel = NAN;
    } else if (!std::isnan(d.max_abs)) {
      if (err > d.max_abs) d.max_abs = err;
      if (!same_inf && err > 0 && rel > d.max_rel) d.max_rel = rel;
    }
    if (!(err <= atol + rtol * std::fabs(y))) d.pass = false;
  }
  return d;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float v : t.to_vector()) m = std::max(m, (double)std::fabs(v));
  return m;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ca = a.to(Device::cpu), cb = b.to(Device::cpu);
  return std::memcmp(ca.raw(), cb.raw(), ca.nbytes()) == 0;
}

}  // namespace ff

// ---------------------------------------------------------------------------
// gradcheck

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          std::vector<Tensor> inputs, const GradcheckOptions& opt) {
  GradcheckResult res;
  Tensor probe;
  {
    NoGradGuard no_grad;
    probe = f(inputs);
  }
  Tensor W = randn(probe.shape(), opt.seed, probe.device());
  auto loss_value = [&](const std::vector<Tensor>& in) {
    NoGradGuard no_grad;
    std::vector<float> y = f(in).to_vector(), w = W.to_vector();
    double s = 0.0;
    for (size_t i = 0; i < y.size(); i++) s += (double)y[i] * w[i];
    return s;
  };

  // analytic: dL/d(output) = W, so backward is seeded with W directly. Building L with
  // ops (sum_all(mul(f, W))) would put mul/sum/reshape on the tape, and a bug planted in
  // any of those would then fail every gradcheck, whatever op is under test.
  for (Tensor& t : inputs) t.zero_grad();
  f(inputs).backward(W);

  // numeric, element by element
  for (size_t k = 0; k < inputs.size(); k++) {
    Tensor& x = inputs[k];
    if (!x.requires_grad()) continue;
    FF_CHECK(x.device() == Device::cpu, "gradcheck perturbs cpu inputs");
    std::vector<float> analytic = x.grad().defined() ? x.grad().to_vector()
                                                     : std::vector<float>((size_t)x.numel(), 0.f);
    float* p = x.data();
    for (int64_t e = 0; e < x.numel(); e++) {
      float orig = p[e];
      p[e] = orig + opt.eps;
      double plus = loss_value(inputs);
      p[e] = orig - opt.eps;
      double minus = loss_value(inputs);
      p[e] = orig;
      double numeric = (plus - minus) / (2.0 * (double)opt.eps);
      double err = std::fabs(analytic[(size_t)e] - numeric);
      double rel = err / std::fmax(std::fabs(numeric), 1e-12);
      bool ok = err <= opt.atol + opt.rtol * std::fabs(numeric);
      if (err > res.max_abs_err) {
        res.max_abs_err = err;
        std::ostringstream os;
        os << "input " << k << " element " << e << ": analytic " << analytic[(size_t)e]
           << " numeric " << numeric;
        res.worst = os.str();
      }
      if (rel > res.max_rel_err && err > opt.atol) res.max_rel_err = rel;
      res.pass = res.pass && ok;
    }
  }
  return res;
}

}  // namespace ff
