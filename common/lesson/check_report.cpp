// common/lesson/check_report.cpp — the printed check (check_report.h).
#include "common/lesson/check_report.h"

#include <cmath>
#include <cstdio>

#include "common/util/trace.h"

namespace ff {

bool CheckReport::all_ranks(bool ok) {
  Trace::Category check_traffic(trace(), "check");  // kept apart from the algorithm's
  int bad = ok ? 0 : 1;
  comm_.allreduce(&bad, 1, MPI_INT, MPI_MAX);
  return bad == 0;
}

void CheckReport::line(const char* what, bool pass, const std::string& detail) {
  if (!pass) failures_++;
  if (comm_.rank() == 0)
    std::printf("    %-44s %s  %s\n", what, detail.c_str(), pass ? "PASS" : "FAIL");
}

void CheckReport::close(const char* what, const Tensor& got, const Tensor& want, double atol) {
  Trace::Category check_traffic(trace(), "check");
  Diff d = compare(got.to(Device::cpu), want.to(Device::cpu), atol, 0.0);
  double v[2] = {d.max_abs, max_abs(want)};
  comm_.allreduce(v, 2, MPI_DOUBLE, MPI_MAX);
  const bool pass = all_ranks(d.pass);
  char buf[128];
  std::snprintf(buf, sizeof buf, "max abs err %.2e  (tol %.1e, values up to %6.3f)", v[0], atol,
                v[1]);
  line(what, pass, buf);
}

void CheckReport::close(const char* what, const Tensor& got, const Tensor& want, double atol,
                        double rtol) {
  Trace::Category check_traffic(trace(), "check");
  Diff d = compare(got.to(Device::cpu), want.to(Device::cpu), atol, rtol);
  double v[2] = {d.max_abs, d.max_rel};
  comm_.allreduce(v, 2, MPI_DOUBLE, MPI_MAX);
  const bool pass = all_ranks(d.pass);
  char buf[128];
  std::snprintf(buf, sizeof buf, "max abs %.2e  max rel %.2e  (tol %.1e + %.1e |want|)", v[0], v[1],
                atol, rtol);
  line(what, pass, buf);
}

void CheckReport::exact(const char* what, const Tensor& got, const Tensor& want) {
  const bool ok = got.shape() == want.shape() &&
                  bitwise_equal(got.to(Device::cpu), want.to(Device::cpu));
  line(what, all_ranks(ok), comm_.size() > 1 ? "bitwise equal on every rank" : "bitwise equal");
}

void CheckReport::scalar(const char* what, double got, double want, double atol) {
  const bool pass = all_ranks(std::fabs(got - want) <= atol);
  char buf[128];
  std::snprintf(buf, sizeof buf, "%.7g vs %.7g  (tol %.1e)", got, want, atol);
  line(what, pass, buf);
}

void CheckReport::holds(const char* what, bool ok) { line(what, all_ranks(ok), ""); }

int CheckReport::verdict() const {
  if (comm_.rank() == 0)
    std::printf("check: %s (%d comparison%s failed)\n", failures_ ? "FAIL" : "PASS", failures_,
                failures_ == 1 ? "" : "s");
  return failures_ ? 1 : 0;
}

}  // namespace ff
