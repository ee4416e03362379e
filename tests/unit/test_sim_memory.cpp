// Device "sim" keeps its memory apart from the host, as a GPU does (kernels/sim_memory.h):
// fresh memory is poison, kernels refuse host and freed pointers, copies and kernels reach
// device memory while the host does not (that last one needs a crash, so it is a program of
// its own: tests/progs/sim_host_access.cpp, run by tests/test_core.py).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <unistd.h>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "kernels/kernels.h"
#include "kernels/sim_memory.h"
#include "kernels/simt.h"

using namespace ff;

namespace {

// Writes x[0 .. n + extra): extra = 1 is the classic `i <= n` bug.
__global__ void write_up_to(float* x, int n, int extra) {
  int i = threadIdx.x;
  if (i < n + extra) x[i] = 1.f;
}
// The second argument's classic `i <= n`, the first argument untouched.
__global__ void write_up_to_second(float* a, float* b, int n) {
  int i = threadIdx.x;
  if (i <= n) b[i] = a[0];
}
// Writes one past the end, then fails (barrier divergence) before the launch completes.
__global__ void write_past_then_diverge(float* x, int n) {
  if (threadIdx.x == 0) x[n] = 1.f;
  if (threadIdx.x < 32) __syncthreads();
}
__global__ void write_before_start(float* x) {
  if (threadIdx.x == 0) x[-1] = 1.f;
}
// y[i] = x[i + 1]: the last thread reads one past the end of x.
__global__ void shift_left(float* y, const float* x, int n) {
  int i = threadIdx.x;
  if (i < n) y[i] = x[i + 1];
}

// Row sums of x (rows, cols): block (c, r) adds its chunk of 32 columns of row r into out[r].
// Without an atomic, two blocks of one row read-modify-write out[r] at the same time on a GPU.
__global__ void row_sums(float* out, const float* x, int cols, bool use_atomic) {
  __shared__ float part[32];
  const int r = blockIdx.y, c = blockIdx.x * 32 + threadIdx.x;
  part[threadIdx.x] = c < cols ? x[r * cols + c] : 0.f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < 32; i++) s += part[i];
    if (use_atomic) atomicAdd(&out[r], s);
    else out[r] += s;
  }
}

// Restores the emulator's options after a test changes them.
struct OptionsGuard {
  simt::Options saved = simt::options();
  ~OptionsGuard() { simt::options() = saved; }
};

}  // namespace

TEST_CASE("sim memory: a fresh allocation is poison (NaN as float32, -1 as int64), not zero") {
  Tensor f = Tensor::empty({3, 1000}, Device::sim);
  for (float v : f.to_vector()) REQUIRE(std::isnan(v));
  Tensor i = Tensor::empty({17}, Device::sim, DType::i64);
  for (int64_t v : i.to_index_vector()) CHECK(v == -1);
  // reused memory is poisoned again, not left with the last tensor's values
  void* first = nullptr;
  {
    Tensor z = Tensor::zeros({1024}, Device::sim);
    first = z.raw();
  }
  Tensor again = Tensor::empty({1024}, Device::sim);
  REQUIRE(again.raw() == first);  // the same block, handed out again (this is what is tested)
  for (float v : again.to_vector()) REQUIRE(std::isnan(v));
}

TEST_CASE("sim memory: a kernel refuses a host pointer and freed device memory, naming the kernel") {
  const KernelTable& k = kernels_for(Device::sim);
  std::vector<float> host(64, 0.f);
  CHECK_THROWS_WITH(k.fill(host.data(), 64, 1.f),
                    doctest::Contains("is a host pointer, not device memory"));
  CHECK(host[0] == 0.f);  // nothing ran
  Tensor t = Tensor::zeros({64}, Device::sim);
  float* dangling = t.data();
  t = Tensor();  // frees it
  CHECK_THROWS_WITH(k.fill(dangling, 64, 1.f), doctest::Contains("device memory that is not allocated"));
  // a pointer into the middle of a live allocation is fine (a kernel may take a slice)
  Tensor u = Tensor::zeros({64}, Device::sim);
  k.fill(u.data() + 32, 32, 2.f);
  std::vector<float> got = u.to_vector();
  CHECK(got[31] == 0.f);
  CHECK(got[32] == 2.f);
  CHECK(got[63] == 2.f);
}

TEST_CASE("sim memory: device copies, memsets and kernels reach it; why_not_device_pointer says what a pointer is") {
  Tensor t = Tensor::from_vector({1.f, 2.f, 3.f}, {3}, Device::sim);
  CHECK(sim_memory::why_not_device_pointer(t.data()) == nullptr);
  CHECK(sim_memory::why_not_device_pointer(t.data() + 2) == nullptr);
  int on_stack = 0;
  CHECK(std::strstr(sim_memory::why_not_device_pointer(&on_stack), "host pointer"));
  Tensor u = t.to(Device::sim);  // device to device
  kernels_for(Device::sim).affine(u.data(), u.data(), 3, 2.f, 1.f);
  CHECK(u.to_vector() == std::vector<float>{3.f, 5.f, 7.f});
  CHECK(t.to(Device::cpu).to_vector() == std::vector<float>{1.f, 2.f, 3.f});
  Tensor z = Tensor::zeros({5}, Device::sim);
  CHECK(z.to_vector() == std::vector<float>(5, 0.f));
}

TEST_CASE("sim memory: many allocations of mixed sizes never overlap, and freeing all gives every page back") {
  // Each live block holds its own byte pattern; after a random mix of allocations and frees
  // (which splits and merges free blocks), every pattern is intact.
  const sim_memory::Usage before = sim_memory::usage();
  std::mt19937 rng(7);
  struct Block {
    void* p;
    size_t bytes;
    unsigned char tag;
  };
  std::vector<Block> live;
  auto verify = [](const Block& b) {
    std::vector<unsigned char> back(b.bytes);
    device_memcpy(back.data(), Device::cpu, b.p, Device::sim, b.bytes);
    for (unsigned char c : back)
      if (c != b.tag) return false;
    return true;
  };
  for (int step = 0; step < 400; step++) {
    if (!live.empty() && rng() % 3 == 0) {
      size_t i = rng() % live.size();
      REQUIRE(verify(live[i]));
      device_free(Device::sim, live[i].p);
      live.erase(live.begin() + (long)i);
    } else {
      size_t bytes = 1 + rng() % (rng() % 4 == 0 ? 200000 : 9000);
      Block b{device_malloc(Device::sim, bytes), bytes, (unsigned char)(step % 251)};
      std::vector<unsigned char> pattern(bytes, b.tag);
      device_memcpy(b.p, Device::sim, pattern.data(), Device::cpu, bytes);
      live.push_back(b);
    }
  }
  for (const Block& b : live) CHECK(verify(b));
  for (const Block& b : live) device_free(Device::sim, b.p);
  // With everything freed, the free blocks have merged back and the top is where it was.
  const sim_memory::Usage after = sim_memory::usage();
  CHECK(after.live_bytes == before.live_bytes);
  CHECK(after.top_bytes == before.top_bytes);
}

TEST_CASE("sim memory: a kernel writing just past the end or before the start of an argument is caught after its launch") {
  Tensor x = Tensor::zeros({100}, Device::sim);
  SIMT_LAUNCH(write_up_to, dim3(1), dim3(128), 0, 0, x.data(), 100, 0);  // in bounds: fine
  CHECK_THROWS_WITH_AS(
      SIMT_LAUNCH(write_up_to, dim3(1), dim3(128), 0, 0, x.data(), 100, 1),
      "kernel write_up_to: argument 1: wrote past the end of its 400-byte device allocation (at byte offset 400)",
      simt::Error);
  // reported once: the redzone is poison again, so the next correct launch is fine
  SIMT_LAUNCH(write_up_to, dim3(1), dim3(128), 0, 0, x.data(), 100, 0);
  // Before the start: the redzone of the allocation just below. Find two adjacent ones.
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);  // 100 floats + redzone: one page each
  std::vector<Tensor> ts;
  const Tensor* upper = nullptr;
  const Tensor* lower = nullptr;
  ts.reserve(64);
  for (int i = 0; i < 64 && !upper; i++) {
    ts.push_back(Tensor::zeros({100}, Device::sim));
    for (const Tensor& t : ts)
      if (!upper && static_cast<char*>(ts.back().raw()) == static_cast<char*>(t.raw()) + page)
        lower = &t;
    for (const Tensor& t : ts)
      if (static_cast<char*>(ts.back().raw()) == static_cast<char*>(t.raw()) + page) upper = &ts.back();
  }
  REQUIRE(upper != nullptr);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(write_before_start, dim3(1), dim3(32), 0, 0, upper->data()),
                       "kernel write_before_start: argument 1: wrote before the start of its "
                       "400-byte device allocation (at byte offset -4)",
                       simt::Error);
  // The redzone between two adjacent arguments: an overrun of the lower one is named as such,
  // not as an underrun of the upper one.
  CHECK_THROWS_WITH_AS(
      SIMT_LAUNCH(write_up_to_second, dim3(1), dim3(128), 0, 0, upper->data(), lower->data(), 100),
      "kernel write_up_to_second: argument 2: wrote past the end of its 400-byte device "
      "allocation (at byte offset 400)",
      simt::Error);
  // A launch that fails after writing out of bounds leaves no redzone dirty for the next one.
  CHECK_THROWS_AS(SIMT_LAUNCH(write_past_then_diverge, dim3(1), dim3(128), 0, 0, x.data(), 100),
                  simt::Error);
  SIMT_LAUNCH(write_up_to, dim3(1), dim3(128), 0, 0, x.data(), 100, 0);  // not blamed: fine
}

TEST_CASE("sim memory: a kernel reading one past the end reads NaN (the redzone), not a neighbour's value") {
  Tensor x = Tensor::from_vector({1.f, 2.f, 3.f, 4.f}, {4}, Device::sim);
  Tensor y = Tensor::zeros({4}, Device::sim);
  SIMT_LAUNCH(shift_left, dim3(1), dim3(32), 0, 0, y.data(), x.data(), 4);
  std::vector<float> got = y.to_vector();
  CHECK(got[0] == 2.f);
  CHECK(got[2] == 4.f);
  CHECK(std::isnan(got[3]));
}

TEST_CASE("sim memory: the race check catches two blocks writing one element without an atomic") {
  OptionsGuard guard;
  const int rows = 3, cols = 100;  // 4 blocks of 32 columns per row
  std::vector<float> xs(rows * cols), want(rows, 0.f);
  for (int i = 0; i < rows * cols; i++) xs[i] = (float)(i % 7);  // small integers: exact sums
  for (int i = 0; i < rows * cols; i++) want[i / cols] += xs[i];
  Tensor x = Tensor::from_vector(xs, {rows * cols}, Device::sim);
  auto run = [&](bool use_atomic) {
    Tensor out = Tensor::zeros({rows}, Device::sim);
    SIMT_LAUNCH(row_sums, dim3(4, rows), dim3(32), 0, 0, out.data(), x.data(), cols, use_atomic);
    return out.to_vector();
  };
  simt::options().racecheck = false;
  CHECK(run(false) == want);  // blocks one after another: without the check the race hides
  simt::options().racecheck = true;
  const uint64_t checked = simt::stats().racecheck_launches;
  std::string error;
  try {
    run(false);
  } catch (const simt::Error& e) {
    error = e.what();
  }
  CHECK(error.find("kernel row_sums: race: blocks (") == 0);
  CHECK(error.find(" both wrote argument 1 at byte offset ") != std::string::npos);
  CHECK(run(true) == want);  // atomicAdd: fine
  CHECK(simt::stats().racecheck_launches == checked + 2);
  // the check skips a block's unchanged pages at once: a race two pages into an allocation
  // (bytes 10000 to 10011 of 12000) is found all the same
  Tensor big = Tensor::zeros({3000}, Device::sim);
  error.clear();
  try {
    SIMT_LAUNCH(row_sums, dim3(4, rows), dim3(32), 0, 0, big.data() + 2500, x.data(), cols, false);
  } catch (const simt::Error& e) {
    error = e.what();
  }
  CHECK(error.find(" both wrote argument 1 at byte offset 100") != std::string::npos);
  // over the budget, a launch is skipped and counted, not checked
  simt::options().racecheck_budget_bytes = 16;
  const uint64_t skipped = simt::stats().racecheck_skipped;
  CHECK(run(false) == want);
  CHECK(simt::stats().racecheck_skipped == skipped + 1);
}
