// common/core/check.h — comparisons of tensors: compare() gives the max abs/rel difference
// every printed check uses (CheckReport, common/lesson/check_report.h, prints them), and
// gradcheck() a gradient by finite differences. FF_CHECK and ff::Error: common/util/error.h.
#pragma once
#include "common/util/error.h"

#include <sstream>
#include <stdexcept>
#include <string>

namespace ff {

class Tensor;

// Max absolute and max relative difference of two same-shape float tensors.
// rel = |a - b| / max(|b|, tiny), taken at the worst element.
struct Diff {
  double max_abs = 0.0;
  double max_rel = 0.0;
  bool pass = true;  // every element: |got - want| <= atol + rtol * |want|
};
Diff compare(const Tensor& got, const Tensor& want, double atol = 0.0, double rtol = 0.0);

// True when the two tensors hold exactly the same bits (data movement checks).
bool bitwise_equal(const Tensor& a, const Tensor& b);

// The largest |value| of a float tensor (any device), for tolerances and printouts.
double max_abs(const Tensor& t);


}  // namespace ff

#include <functional>
#include <vector>

namespace ff {

// Gradient check by central finite differences.
//
// f maps the inputs to one output tensor. The check differentiates the scalar
// L = sum(f(inputs) * W), W a fixed random tensor (so every output element matters
// with a different weight), by autograd and by (L(x + eps) - L(x - eps)) / (2 eps)
// for every element of every float input that requires grad. float32 arithmetic
// makes the numeric side noisy: an element passes when
//   |analytic - numeric| <= atol + rtol * |numeric|.
struct GradcheckResult {
  double max_abs_err = 0.0;
  double max_rel_err = 0.0;
  bool pass = true;
  std::string worst;  // "input I element E: analytic A numeric N" of the worst element
};
struct GradcheckOptions {
  float eps = 1e-2f;    // step: large enough that float32 rounding stays small
  double atol = 2e-3;   // absolute floor, for gradients near 0
  double rtol = 2e-2;   // relative part
  uint64_t seed = 7;    // for W
};
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          std::vector<Tensor> inputs, const GradcheckOptions& opt = {});

}  // namespace ff
