// bf16 sums over MPI and NCCL (Comm::allreduce_sum_bf16 and its non-blocking twins), for any
// world size 1..4: every rank ends with the same bits; with two ranks, the one sum rounded once
// (each pair of values widened, added in float32, rounded to bf16); with more, within one
// rounding per addition of the exact sum; on device sim through the NCCL emulation, the same
// bits as on MPI.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "kernels/bf16.h"

using namespace ff;

namespace {

Comm world() { return Comm::world(nullptr, nullptr); }

// Rank r's n values: N(0, 1), a different draw per rank, rounded to bf16.
std::vector<uint16_t> values_of(int r, int64_t n) {
  std::vector<uint16_t> v((size_t)n);
  const std::vector<float> x = randn({n}, 100 + (uint64_t)r).to_vector();
  for (int64_t i = 0; i < n; i++) v[(size_t)i] = float_to_bf16(x[(size_t)i]);
  return v;
}

// Every rank's copy of v gathered: true when all hold the same bits.
bool same_everywhere(Comm& c, const std::vector<uint16_t>& v) {
  std::vector<uint16_t> all(v.size() * (size_t)c.size());
  c.allgather(v.data(), v.size() * 2, all.data());
  for (int r = 0; r < c.size(); r++)
    for (size_t i = 0; i < v.size(); i++)
      if (all[(size_t)r * v.size() + i] != v[i]) return false;
  return true;
}

// The sum's error against the exact sum of every rank's values, in units of its bound: one
// rounding (half a bf16 ulp, 2^-8 relative) per addition, each of a partial sum at most
// sum_r |x_r|.
double worst_of_bound(const std::vector<uint16_t>& got, int P, int64_t n, int64_t offset = 0) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); i++) {
    double exact = 0, mag = 0;
    for (int r = 0; r < P; r++) {
      const double x = bf16_to_float(values_of(r, n)[(size_t)offset + i]);
      exact += x, mag += std::fabs(x);
    }
    const double bound = (P - 1) * std::ldexp(1.0, -8) * mag;
    const double err = std::fabs(bf16_to_float(got[i]) - exact);
    worst = std::max(worst, bound > 0 ? err / bound : (err > 0 ? 1e300 : 0));
  }
  return worst;
}

}  // namespace

TEST_CASE("comm: bf16 all-reduce and reduce-scatter sum as NCCL does, the same bits on every rank") {
  Comm c = world();
  const int r = c.rank(), P = c.size();
  const int64_t n = 1000;
  std::vector<uint16_t> mine = values_of(r, n), sum = mine;
  c.allreduce_sum_bf16(sum.data(), (size_t)n);
  CHECK(same_everywhere(c, sum));
  CHECK(worst_of_bound(sum, P, n) <= 1.0);
  if (P == 2) {  // one addition: the widened pair's sum, rounded once
    const std::vector<uint16_t> a = values_of(0, n), b = values_of(1, n);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++)
      differ += sum[(size_t)i] != float_to_bf16(bf16_to_float(a[(size_t)i]) + bf16_to_float(b[(size_t)i]));
    CHECK(differ == 0);
  }
  // the non-blocking reduce-scatter: this rank's block of the same sum, within the bound
  const size_t block = (size_t)(n / P);
  std::vector<uint16_t> all = values_of(r, block * (size_t)P), got(block);
  Request req = c.ireduce_scatter_sum_bf16(all.data(), got.data(), block);
  c.wait(req);
  CHECK(worst_of_bound(got, P, (int64_t)block * P, (int64_t)(block * (size_t)r)) <= 1.0);
  // and the tensor call: a bf16 tensor, on the host and on device sim (staged through the host)
  for (Device d : {Device::cpu, Device::sim}) {
    Tensor t = cast(Tensor::from_vector(randn({n}, 100 + (uint64_t)r).to_vector(), {n}), DType::bf16).to(d);
    c.allreduce_sum(t);
    const std::vector<float> v = t.to_vector();
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += float_to_bf16(v[(size_t)i]) != sum[(size_t)i];
    CHECK_MESSAGE(differ == 0, differ << " elements differ from allreduce_sum_bf16's on " << device_name(d));
  }
}

TEST_CASE("comm: bf16 sums on NCCL (the emulation on device sim) give MPI's bits") {
  Comm c = world();
  const int r = c.rank();
  const int64_t n = 513;
  std::vector<uint16_t> want = values_of(r, n);
  c.allreduce_sum_bf16(want.data(), (size_t)n);  // on MPI, before NCCL is enabled
  Comm nc = c.duplicate_counted();
  nc.enable_nccl(Device::sim);
  Tensor t = cast(Tensor::from_vector(randn({n}, 100 + (uint64_t)r).to_vector(), {n}), DType::bf16).to(Device::sim);
  Request req = nc.iallreduce_sum_bf16(t.bf16_data(), (size_t)n);
  nc.wait(req);
  const std::vector<float> got = t.to_vector();
  int64_t differ = 0;
  for (int64_t i = 0; i < n; i++) differ += float_to_bf16(got[(size_t)i]) != want[(size_t)i];
  CHECK_MESSAGE(differ == 0, differ << " of " << n << " elements differ from MPI's bf16 sum");
}
