// common/lesson/check_report.h — the printed check every lesson ends with.
#pragma once
#include <string>

#include "common/comm/comm.h"
#include "common/core/check.h"
#include "common/core/tensor.h"

namespace ff {

// The printed check of a distributed lesson: every rank compares ITS part with the matching
// part of the single-process reference; the worst result over the ranks is printed on rank 0,
// one line per comparison, and counted. Every rank must make the same calls (collectives).
//     o   = softmax(...) V   max abs err 3.6e-07  (tol 2.5e-04, values up to  2.16)  PASS
// [slide:check-report]
class CheckReport {
 public:
  explicit CheckReport(Comm& comm) : comm_(comm) {}
  // [slide:check-report-short]
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
  // [/slide:check-report-short]
  // [/slide]

 private:
  bool all_ranks(bool ok);  // true when ok on every rank
  void line(const char* what, bool pass, const std::string& detail);
  Comm& comm_;
  int failures_ = 0;
};

}  // namespace ff
