// The SIMT emulator itself: barriers under shuffled schedules, a kernel with a missing
// barrier caught by the shuffle, warp shuffles and ballots, atomics, dynamic shared
// memory, and every misuse reported as an error (never a hang).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/simt.h"

namespace {

// Every test here runs in one: it restores the emulator's options after the test changes
// them, and takes the sim device's device-memory model out meanwhile, so that these kernels
// may read and write host vectors (the emulator itself runs on any pointer; keeping device
// memory apart is the sim device's job, tested in test_sim_memory.cpp).
struct OptionsGuard {
  simt::Options saved = simt::options();
  simt::DeviceMemoryModel saved_model = simt::device_memory_model();
  OptionsGuard() { simt::device_memory_model() = {}; }
  ~OptionsGuard() {
    simt::options() = saved;
    simt::device_memory_model() = saved_model;
  }
};

// ---- kernels (ordinary CUDA, written against kernels/simt.h)

__global__ void rotate_through_shared(int* out, int n) {
  __shared__ int buf[1024];
  int t = threadIdx.x;
  buf[t] = t * 10;
  __syncthreads();
  out[t] = buf[(t + 1) % n];
}

// Tree reduction of one block in shared memory. `with_barriers` false drops the barriers
// inside the loop: the classic bug.
__global__ void block_sum(const float* x, float* out, bool with_barriers) {
  __shared__ float s[256];
  int t = threadIdx.x;
  s[t] = x[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    if (with_barriers) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

// Row sums of x (rows, 256), one block: each warp reduces its 32 values by shuffles and
// leaves them in part[warp]; after a barrier thread 0 adds the 8 parts. The barrier at the
// end of the loop keeps a fast warp from overwriting part[] with the next row's value before
// thread 0 has read this row's: `trailing_barrier` false drops it.
__global__ void rows_through_shared(const float* x, float* out, int rows, bool trailing_barrier) {
  __shared__ float part[8];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int row = 0; row < rows; row++) {
    float v = x[row * 256 + threadIdx.x];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < 8; w++) total += part[w];
      out[row] = total;
    }
    if (trailing_barrier) __syncthreads();
  }
}

__global__ void warp_sums(const float* x, float* down_out, float* xor_out, unsigned* ballot_out) {
  int t = threadIdx.x;
  float v = x[t], w = x[t];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  for (int mask = 16; mask > 0; mask /= 2) w += __shfl_xor_sync(0xffffffffu, w, mask);
  unsigned b = __ballot_sync(0xffffffffu, x[t] > 0.f);
  int lane = t % 32;
  if (lane == 0) down_out[t / 32] = v;
  xor_out[t] = w;  // every lane holds the full sum after a butterfly
  if (lane == 0) ballot_out[t / 32] = b;
}

__global__ void shfl_idx_and_up(const int* x, int* idx_out, int* up_out) {
  int t = threadIdx.x;
  idx_out[t] = __shfl_sync(0xffffffffu, x[t], 3);        // broadcast lane 3 of each warp
  up_out[t] = __shfl_up_sync(0xffffffffu, x[t], 1, 8);   // segments of 8 lanes
}

// Stream compaction within a warp: lane l with keep[l] writes to slot (the number of kept
// lanes below l), found from the warp's ballot with __popc; lane 0 writes the warp's count.
__global__ void warp_compact(const int* keep, int* slot_out, int* count_out) {
  int t = threadIdx.x, lane = t % 32;
  unsigned mask = __ballot_sync(0xffffffffu, keep[t] != 0);
  slot_out[t] = keep[t] ? __popc(mask & ((1u << lane) - 1u)) : -1;
  if (lane == 0) count_out[t / 32] = __popc(mask);
}

__global__ void histogram(const int* x, int n, int* bins, float* total) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    atomicAdd(&bins[x[i]], 1);
    atomicAdd(total, 1.f);
  }
}

__global__ void atomic_max_cas(const int* x, int* max_out, int* cas_winner) {
  int t = threadIdx.x;
  atomicMax(max_out, x[t]);
  atomicCAS(cas_winner, -1, t);  // exactly one thread wins
}

__global__ void dynamic_reverse(const float* x, float* y) {
  SIMT_DYNAMIC_SHARED(float, buf);
  int t = threadIdx.x, n = blockDim.x;
  buf[t] = x[t];
  __syncthreads();
  y[t] = buf[n - 1 - t];
}

__global__ void index_3d(int* out) {
  int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int per_block = blockDim.x * blockDim.y * blockDim.z;
  out[bid * per_block + tid] = bid * 1000 + tid;
}

__global__ void divergent_barrier() {
  if (threadIdx.x < 16) __syncthreads();
}
__global__ void two_barriers() {
  if (threadIdx.x % 2) __syncthreads();
  else __syncthreads();
}
__global__ void warp_missing_lane(float* out) {
  if (threadIdx.x != 5) out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.f, 1);
}
__global__ void throws_inside() {
  if (threadIdx.x == 7) throw std::runtime_error("kernel code threw");
  __syncthreads();
}
__global__ void nothing() {}

// Block b records when it ran (a ticket from a global counter).
__global__ void record_block_order(int* ticket, int* ran_at) {
  if (threadIdx.x == 0) ran_at[blockIdx.x] = atomicAdd(ticket, 1);
}

// A running count across blocks: block b reads block b - 1's result. Right only if blocks
// run in index order, which no GPU promises (a correct version needs a grid-wide scan).
__global__ void chain_across_blocks(int* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x == 0 ? 1 : out[blockIdx.x - 1] + 1;
}

// Reads dynamic shared memory before writing it, then writes it: what the next block sees.
__global__ void read_uninitialised_shared(unsigned* first_word) {
  SIMT_DYNAMIC_SHARED(unsigned, buf);
  if (threadIdx.x == 0) first_word[blockIdx.x] = buf[0];
  __syncthreads();
  buf[threadIdx.x] = 0;
}

__global__ void add_one(float* x, const float* maybe_null) {
  x[threadIdx.x] += maybe_null ? maybe_null[threadIdx.x] : 1.f;
}

std::vector<float> iota_floats(int n, float scale) {
  std::vector<float> v(n);
  for (int i = 0; i < n; i++) v[i] = scale * (float)((i * 37) % 101 - 50);
  return v;
}

}  // namespace

TEST_CASE("simt: a barrier orders writes before reads, under every shuffled schedule") {
  OptionsGuard guard;
  for (uint64_t seed : {1, 2, 3, 4, 5}) {
    simt::options().seed = seed;
    std::vector<int> out(96, -1);
    SIMT_LAUNCH(rotate_through_shared, dim3(1), dim3(96), 0, 0, out.data(), 96);
    for (int t = 0; t < 96; t++) CHECK(out[t] == ((t + 1) % 96) * 10);
  }
}

TEST_CASE("simt: a missing __syncthreads in a reduction gives a wrong sum; with it, the right one") {
  OptionsGuard guard;
  std::vector<float> x = iota_floats(4 * 256, 1.f), out(4);
  std::vector<float> want(4, 0.f);
  for (int b = 0; b < 4; b++)
    for (int i = 0; i < 256; i++) want[b] += x[b * 256 + i];
  SIMT_LAUNCH(block_sum, dim3(4), dim3(256), 0, 0, x.data(), out.data(), true);
  for (int b = 0; b < 4; b++) CHECK(out[b] == want[b]);  // small integers: exact
  int wrong = 0;
  for (uint64_t seed : {11, 12, 13}) {
    simt::options().seed = seed;
    SIMT_LAUNCH(block_sum, dim3(4), dim3(256), 0, 0, x.data(), out.data(), false);
    for (int b = 0; b < 4; b++) wrong += out[b] != want[b];
  }
  CHECK(wrong >= 10);  // the shuffle makes (nearly) every block read partial sums too early
}

TEST_CASE("simt: a warp runs ahead after its shuffle: a missing trailing barrier is caught") {
  // On a GPU nothing stops warp 3 from finishing its reads, looping and writing the next
  // row's part[3] while thread 0 still reads this row's parts. The emulator completes a
  // warp collective as soon as its last lane arrives and picks threads at random, so a
  // warp can run ahead too, and the race shows.
  OptionsGuard guard;
  simt::options().shuffle = true;  // also under SIMT_SHUFFLE=0
  // Row r is all r + 1, so a part left by row r + 1 changes row r's sum. About one row in
  // ten sees a warp run ahead (a warp needs 6 turns — 5 shuffles and the store — before
  // warp 0 gets 1), so 4 x 64 rows make a miss vanishingly unlikely.
  const int rows = 64;
  std::vector<float> x(rows * 256), want(rows), out(rows);
  for (int i = 0; i < rows * 256; i++) x[i] = (float)(i / 256 + 1);
  for (int r = 0; r < rows; r++) want[r] = 256.f * (float)(r + 1);
  int wrong = 0;
  for (uint64_t seed : {1, 2, 3, 4}) {
    simt::options().seed = seed;
    SIMT_LAUNCH(rows_through_shared, dim3(1), dim3(256), 0, 0, x.data(), out.data(), rows, true);
    CHECK(out == want);
    SIMT_LAUNCH(rows_through_shared, dim3(1), dim3(256), 0, 0, x.data(), out.data(), rows, false);
    for (int r = 0; r < rows; r++) wrong += out[r] != want[r];
  }
  CHECK(wrong > 0);
}

TEST_CASE("simt: __popc of a ballot ranks a warp's matching lanes (warp compaction)") {
  OptionsGuard guard;
  std::vector<int> keep(64), slot(64), count(2);
  for (int t = 0; t < 64; t++) keep[t] = (t * 7) % 5 < 2 || t == 31;  // lane 31: the top bit
  keep[32] = 1;                                                      // lane 0 of warp 1
  SIMT_LAUNCH(warp_compact, dim3(1), dim3(64), 0, 0, keep.data(), slot.data(), count.data());
  for (int w = 0; w < 2; w++) {
    int kept = 0;
    for (int l = 0; l < 32; l++) {
      const int t = w * 32 + l;
      CHECK(slot[t] == (keep[t] ? kept : -1));
      kept += keep[t];
    }
    CHECK(count[w] == kept);
  }
  CHECK(__popc(0u) == 0);
  CHECK(__popc(0xffffffffu) == 32);
  CHECK(__popc(0x80000001u) == 2);
}

TEST_CASE("simt: warp shuffles (down, xor, idx, up with width) and ballot") {
  OptionsGuard guard;
  std::vector<float> x = iota_floats(64, 0.5f), down(2), xr(64);
  std::vector<unsigned> ballots(2);
  SIMT_LAUNCH(warp_sums, dim3(1), dim3(64), 0, 0, x.data(), down.data(), xr.data(), ballots.data());
  for (int w = 0; w < 2; w++) {
    float sum = 0.f;
    unsigned bits = 0;
    for (int l = 0; l < 32; l++) {
      sum += x[w * 32 + l];
      if (x[w * 32 + l] > 0.f) bits |= 1u << l;
    }
    CHECK(down[w] == sum);  // halves of small multiples of 0.5: exact in any order
    for (int l = 0; l < 32; l++) CHECK(xr[w * 32 + l] == sum);
    CHECK(ballots[w] == bits);
  }
  std::vector<int> xi(64), idx(64), up(64);
  std::iota(xi.begin(), xi.end(), 100);
  SIMT_LAUNCH(shfl_idx_and_up, dim3(1), dim3(64), 0, 0, xi.data(), idx.data(), up.data());
  for (int t = 0; t < 64; t++) {
    CHECK(idx[t] == 100 + (t / 32) * 32 + 3);
    CHECK(up[t] == (t % 8 == 0 ? 100 + t : 100 + t - 1));  // lane 0 of a segment keeps its own
  }
}

TEST_CASE("simt: atomics (add int and float, max, CAS) across threads and blocks") {
  OptionsGuard guard;
  const int n = 1000;
  std::vector<int> x(n), bins(7, 0);
  for (int i = 0; i < n; i++) x[i] = (i * 13) % 7;
  float total = 0.f;
  SIMT_LAUNCH(histogram, dim3((n + 127) / 128), dim3(128), 0, 0, x.data(), n, bins.data(), &total);
  std::vector<int> want(7, 0);
  for (int v : x) want[v]++;
  CHECK(bins == want);
  CHECK(total == (float)n);
  std::vector<int> y(64);
  for (int i = 0; i < 64; i++) y[i] = (i * 29) % 61;
  int mx = -1, winner = -1;
  SIMT_LAUNCH(atomic_max_cas, dim3(1), dim3(64), 0, 0, y.data(), &mx, &winner);
  CHECK(mx == 60);
  CHECK(winner >= 0);
  CHECK(winner < 64);
}

TEST_CASE("simt: dynamic shared memory, and 3-D grids and blocks") {
  OptionsGuard guard;
  std::vector<float> x = iota_floats(200, 1.f), y(200);
  SIMT_LAUNCH(dynamic_reverse, dim3(1), dim3(200), 200 * sizeof(float), 0, x.data(), y.data());
  for (int t = 0; t < 200; t++) CHECK(y[t] == x[199 - t]);
  std::vector<int> out(2 * 3 * 2 * (4 * 2 * 3), -1);
  SIMT_LAUNCH(index_3d, dim3(2, 3, 2), dim3(4, 2, 3), 0, 0, out.data());
  for (int i = 0; i < (int)out.size(); i++) CHECK(out[i] == (i / 24) * 1000 + i % 24);
}

TEST_CASE("simt: misuse is an error naming the kernel, block and thread") {
  OptionsGuard guard;
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(divergent_barrier, dim3(2), dim3(32), 0, 0),
                       doctest::Contains("kernel divergent_barrier, block ("), simt::Error);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(divergent_barrier, dim3(1), dim3(32), 0, 0),
                       doctest::Contains("has exited"), simt::Error);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(two_barriers, dim3(1), dim3(8), 0, 0),
                       doctest::Contains("barrier divergence"), simt::Error);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(warp_missing_lane, dim3(1), dim3(32), 0, 0, (float*)nullptr),
                       doctest::Contains("lane 5 named in the mask has exited"), simt::Error);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(nothing, dim3(1), dim3(1025), 0, 0),
                       doctest::Contains("more than 1024 threads"), simt::Error);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(nothing, dim3(1), dim3(32), 48 * 1024 + 4, 0),
                       doctest::Contains("over the limit of 49152"), simt::Error);
  CHECK_THROWS_WITH_AS(SIMT_LAUNCH(throws_inside, dim3(1), dim3(32), 0, 0), "kernel code threw",
                       std::runtime_error);
  // after errors, the emulator is usable again
  std::vector<int> out(32);
  SIMT_LAUNCH(rotate_through_shared, dim3(1), dim3(32), 0, 0, out.data(), 32);
  CHECK(out[0] == 10);
}

TEST_CASE("simt: with shuffling off, threads run in index order (reproducible debugging)") {
  OptionsGuard guard;
  simt::options().shuffle = false;
  std::vector<float> x = iota_floats(256, 1.f), out(1);
  float want = 0.f;
  for (float v : x) want += v;
  SIMT_LAUNCH(block_sum, dim3(1), dim3(256), 0, 0, x.data(), out.data(), true);
  CHECK(out[0] == want);
}

TEST_CASE("simt: blocks run in a shuffled order; in index order with shuffling off") {
  OptionsGuard guard;
  const int blocks = 64;
  std::vector<int> ran_at(blocks);
  auto run = [&] {
    int ticket = 0;
    SIMT_LAUNCH(record_block_order, dim3(blocks), dim3(32), 0, 0, &ticket, ran_at.data());
    std::vector<int> sorted = ran_at;
    std::sort(sorted.begin(), sorted.end());
    for (int b = 0; b < blocks; b++) REQUIRE(sorted[b] == b);  // every block ran exactly once
    int in_place = 0;
    for (int b = 0; b < blocks; b++) in_place += ran_at[b] == b;
    return in_place;
  };
  simt::options().shuffle = true;
  for (uint64_t seed : {1, 2, 3}) {
    simt::options().seed = seed;
    CHECK(run() < blocks);
  }
  simt::options().shuffle = false;
  CHECK(run() == blocks);
}

TEST_CASE("simt: a kernel that counts on block order is caught") {
  OptionsGuard guard;
  const int blocks = 16;
  std::vector<int> out(blocks), want(blocks);
  std::iota(want.begin(), want.end(), 1);
  simt::options().shuffle = false;  // index order: the bug hides
  SIMT_LAUNCH(chain_across_blocks, dim3(blocks), dim3(32), 0, 0, out.data());
  CHECK(out == want);
  simt::options().shuffle = true;
  // Only the index order gives the right answer; a launch's order is the identity with
  // probability 1/128 at 16 blocks (stride 1 of 8, offset 0 of 16), so 6 of 8 must fail.
  int wrong = 0;
  for (uint64_t seed = 1; seed <= 8; seed++) {
    simt::options().seed = seed;
    std::fill(out.begin(), out.end(), 0);
    SIMT_LAUNCH(chain_across_blocks, dim3(blocks), dim3(32), 0, 0, out.data());
    wrong += out != want;
  }
  CHECK(wrong >= 6);
}

TEST_CASE("simt: dynamic shared memory starts as 0xFF bytes in every block, not zero") {
  OptionsGuard guard;
  std::vector<unsigned> first(4, 0);
  SIMT_LAUNCH(read_uninitialised_shared, dim3(4), dim3(32), 32 * sizeof(unsigned), 0, first.data());
  for (unsigned w : first) CHECK(w == 0xFFFFFFFFu);  // the previous block's zeros are gone
  float f;
  std::memcpy(&f, &first[0], sizeof f);
  CHECK(std::isnan(f));
}

// A stand-in for a device-memory model: device memory is `dev`; the hooks count their calls.
namespace fake_device {
std::vector<float> dev(32, 0.f);
int opened = 0, closed = 0;
const char* why_not(const void* p) {
  auto* f = static_cast<const float*>(p);
  return f >= dev.data() && f < dev.data() + dev.size() ? nullptr : "not in the fake device";
}
void open() { opened++; }
void close() { closed++; }
}  // namespace fake_device

TEST_CASE("simt: with a device-memory model, pointer arguments are checked and memory opened per launch") {
  OptionsGuard guard;
  simt::device_memory_model() = {fake_device::why_not, fake_device::open, fake_device::close};
  fake_device::opened = fake_device::closed = 0;
  SIMT_LAUNCH(add_one, dim3(1), dim3(32), 0, 0, fake_device::dev.data(), (const float*)nullptr);
  CHECK(fake_device::dev[31] == 1.f);  // null is a fine pointer argument
  CHECK(fake_device::opened == 1);
  CHECK(fake_device::closed == 1);
  std::vector<float> host(32, 1.f);
  CHECK_THROWS_WITH_AS(
      SIMT_LAUNCH(add_one, dim3(1), dim3(32), 0, 0, fake_device::dev.data(), (const float*)host.data()),
      doctest::Contains("kernel add_one: argument 2 ("), simt::Error);
  CHECK_THROWS_WITH_AS(
      SIMT_LAUNCH(add_one, dim3(1), dim3(32), 0, 0, host.data(), (const float*)nullptr),
      doctest::Contains(") is not in the fake device: a kernel can only dereference device memory"),
      simt::Error);
  CHECK(fake_device::dev[31] == 1.f);  // refused launches ran nothing
  CHECK(fake_device::opened == 1);
  // an error inside the kernel still closes device memory
  CHECK_THROWS_AS(SIMT_LAUNCH(throws_inside, dim3(1), dim3(32), 0, 0), std::runtime_error);
  CHECK(fake_device::opened == 2);
  CHECK(fake_device::closed == 2);
}
