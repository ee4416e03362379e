// common/core/check.h — errors and comparisons.
//
// FF_CHECK(cond, msg) throws ff::Error(msg) — for bad arguments (shapes, indices,
// devices) and broken invariants inside the library; messages are written to be read
// by a user, and lessons catch ff::Error at top level and print one `error:` line.
// compare() gives the max abs/rel difference used by every printed check.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ff {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);

#define FF_CHECK(cond, msg)                                            \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::ostringstream ff_check_os_;                                 \
      ff_check_os_ << msg;                                             \
      ::ff::throw_error(__FILE__, __LINE__, ff_check_os_.str());       \
    }                                                                  \
  } while (0)

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

class Comm;
// The printed check of a distributed lesson: every rank compares ITS part with the matching
// part of the single-process reference; the worst result over the ranks is printed on rank 0,
// one line per comparison, and counted. Every rank must make the same calls (collectives).
//     o   = softmax(...) V   max abs err 3.6e-07  (tol 2.5e-04, values up to  2.16)  PASS
// [slide:check-report]
class CheckReport {
 public:
  explicit CheckReport(Comm& comm) : comm_(comm) {}
  // |got - want| <= atol elementwise (no relative part: values near 0 make it meaningless)
  void close(const char* what, const Tensor& got, const Tensor& want, double atol);
  // |got - want| <= atol + rtol |want| elementwise: for values compared relatively (softmax
  // outputs span many orders of magnitude); prints the max abs and max rel differences
  void close(const char* what, const Tensor& got, const Tensor& want, double atol, double rtol);
  // the same bits (data that was only moved, never computed)
  void exact(const char* what, const Tensor& got, const Tensor& want);
  void scalar(const char* what, double got, double want, double atol);
  // a condition the lesson checked itself (e.g. "exactly zero")
  void holds(const char* what, bool ok);
  int failures() const { return failures_; }
  // "check: PASS (0 comparisons failed)" on rank 0; returns the exit code (0 or 1)
  int verdict() const;
  // [/slide]

 private:
  bool all_ranks(bool ok);  // true when ok on every rank
  void line(const char* what, bool pass, const std::string& detail);
  Comm& comm_;
  int failures_ = 0;
};

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
