// tests/unit/kernel_check.h — what the kernel tests (tests/unit/test_kernels_*.cpp) share.
//
// Every CUDA kernel is run on the device under test and compared with its cpu twin on the
// same inputs. The device under test is "sim" (the kernels/cuda/*.cu sources run by the SIMT
// emulator), or "cuda" when FF_TEST_DEVICE=cuda — tests/test_doctest.py runs the kernel
// suite a second time that way when a GPU is present, and reports it skipped otherwise.
// Kernel tests live in TEST_SUITE("kernels").
#pragma once
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "kernels/kernels.h"

namespace kt {

using ff::Device;
using ff::Shape;
using ff::Tensor;

// The device compared against cpu: FF_TEST_DEVICE (sim by default). A named device that is
// not available fails the tests: the runner asked for it.
inline Device device_under_test() {
  const char* s = std::getenv("FF_TEST_DEVICE");
  Device d = Device::sim;
  if (s && *s && !ff::parse_device(s, &d)) FAIL("FF_TEST_DEVICE=" << s << ": not cpu, sim or cuda");
  if (!ff::device_available(d)) FAIL("FF_TEST_DEVICE=" << s << ": device not available here");
  return d;
}

inline const ff::KernelTable& cpu_kernels() { return ff::kernels_for(Device::cpu); }
inline const ff::KernelTable& dut_kernels() { return ff::kernels_for(device_under_test()); }

// n test values ~ N(0, scale^2); every 17th is an outlier ×100, so a kernel that mishandles
// large magnitudes (an overflowing exp, a lost max) fails.
inline std::vector<float> inputs(int64_t n, uint64_t seed, float scale = 1.f) {
  std::vector<float> v = ff::randn({n}, seed).to_vector();
  for (int64_t i = 0; i < n; i++) v[i] *= (i % 17 == 16) ? 100.f * scale : scale;
  return v;
}

// A tensor of shape {v.size()} on device d holding v.
inline Tensor upload(const std::vector<float>& v, Device d) {
  return Tensor::from_vector(v, {(int64_t)v.size()}, Device::cpu).to(d);
}
inline Tensor upload_indices(const std::vector<int64_t>& v, Device d) {
  return Tensor::from_indices(v, {(int64_t)v.size()}, Device::cpu).to(d);
}
// An uninitialised-looking buffer: filled with a NaN pattern, so an element the kernel
// forgets to write shows up as a mismatch instead of a lucky zero.
inline Tensor scratch(int64_t n, Device d) {
  return Tensor::full({n}, std::nanf(""), Device::cpu).to(d);
}

// Requires |got[i] - want[i]| <= tol[i] for every i (NaN and inf must match exactly: an
// element the kernel never wrote stays NaN and fails). Reports the worst element (largest
// error / tolerance), with its row and column when the data has rows of C > 0 elements.
inline void require_within(const std::vector<float>& got, const std::vector<float>& want,
                           const std::vector<double>& tol, int64_t C, const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  size_t bad = 0, worst = 0;
  double worst_ratio = -1;
  for (size_t i = 0; i < got.size(); i++) {
    double g = got[i], w = want[i], ratio = 0;  // ratio: error / tolerance
    bool ok;
    if (std::isnan(w) || std::isnan(g)) {
      ok = std::isnan(w) && std::isnan(g);
    } else if (std::isinf(w) || std::isinf(g)) {
      ok = g == w;
    } else {
      ok = std::fabs(g - w) <= tol[i];
      ratio = std::fabs(g - w) / (tol[i] > 0 ? tol[i] : 1e-300);
    }
    if (!ok) {
      bad++;
      if (ratio > worst_ratio || worst_ratio < 0) worst = i, worst_ratio = ratio;
    }
  }
  if (bad) {
    std::ostringstream os;
    os << what << " on " << ff::device_name(device_under_test()) << ": " << bad << " of "
       << got.size() << " elements differ from cpu; worst at ";
    if (C > 0) os << "row " << worst / (size_t)C << " col " << worst % (size_t)C;
    else os << "[" << worst << "]";
    os << ": got " << got[worst] << ", want " << want[worst] << " (tolerance " << tol[worst] << ")";
    FAIL(os.str());
  }
}

// The same with one tolerance for all: |got[i] - want[i]| <= atol + rtol * |want[i]|.
inline void require_close(const std::vector<float>& got, const std::vector<float>& want,
                          double atol, double rtol, const std::string& what) {
  std::vector<double> tol(want.size());
  for (size_t i = 0; i < want.size(); i++) tol[i] = atol + rtol * std::fabs((double)want[i]);
  require_within(got, want, tol, 0, what);
}
inline void require_close(const Tensor& got, const Tensor& want, double atol, double rtol,
                          const std::string& what) {
  require_close(got.to_vector(), want.to_vector(), atol, rtol, what);
}
inline void require_equal(const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                          const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  for (size_t i = 0; i < got.size(); i++)
    if (got[i] != want[i])
      FAIL(what << " on " << std::string(ff::device_name(device_under_test())) << ": index [" << i
                << "] is " << got[i] << ", cpu has " << want[i]);
}

}  // namespace kt
