// Kernel tests: moe_group_topk, DeepSeek-V3's node-limited (group-limited) expert selection.
// Three kinds of check:
//   1. device vs cpu (TEST_SUITE "kernels"): kernels/cuda/moe_routing.cu on the device under
//      test (sim, or cuda on a GPU) against kernels/cpu/moe_routing.cpp on the same scores.
//      Both outputs are integers and must be EQUAL: the order and tie rules, and the order in
//      which a group's score is summed, are fixed (kernels/kernels.h), so every device decides
//      every comparison the same way.
//   2. the cpu kernel against its meaning ("moe kernels: ..."), computed here another way: per
//      row, std::sort of (score, index) pairs for the group's chosen experts and for the group
//      ranking, and std::stable_sort of the allowed experts for the final top K.
//   3. a hand-made row on which group-limited routing and plain top-K disagree (the best
//      expert sits in a group whose second expert is weak), with the answers written out.
//
// Shapes: tokens T = 0, 1, 7, 100, 257 (257 rows: not a multiple of the 4 rows of a block);
// (N, G, M, K, group_topk) with G = 1 (plain top-K), G = N (one expert per group), M = G,
// K = 1, K = M N / G (every expert of the kept groups), group_topk = 1, 2, 3 and >= N / G,
// G below, at and above 32 (one lane per group), N up to 1024, G = N = 4096 (fewer rows per
// block of the device kernel, whose group scores live in shared memory), and DeepSeek-V3's
// N = 256, G = 8, M = 4, K = 8, group_topk = 2. Rows come in four kinds (row t: kind t % 4):
//   random  N(0, 1) with an outlier x100 every 17th score (kt::inputs);
//   integer scores in {0, 1, 2, 3}: ties between experts, and group scores that tie exactly;
//   constant: every score equal, so every choice is decided by index alone;
//   permuted: every group holds a permutation of the same N / G values (0.1, 0.2, ...), so the
//     group scores are equal in exact arithmetic and differ, if at all, by float rounding —
//     which only a fixed summation order makes the same on every device.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

struct RoutingCase {
  int64_t N, G, M, K, group_topk;
  std::string name() const {
    return "N=" + std::to_string(N) + " G=" + std::to_string(G) + " M=" + std::to_string(M) +
           " K=" + std::to_string(K) + " group_topk=" + std::to_string(group_topk);
  }
};

std::vector<RoutingCase> routing_cases() {
  return {
      {64, 1, 1, 6, 2},         // G = 1: plain top-K
      {16, 1, 1, 16, 1},        // G = 1, K = N
      {16, 16, 4, 4, 1},        // G = N: one expert per group; K = M N / G
      {64, 64, 64, 8, 3},       // G = N = M (all kept), group_topk >= N / G
      {64, 64, 5, 3, 1},        // G = N = 64: two groups per lane
      {32, 4, 4, 5, 2},         // M = G
      {32, 8, 2, 1, 2},         // K = 1
      {32, 8, 3, 12, 2},        // K = M N / G
      {64, 8, 8, 64, 8},        // M = G, K = N, group_topk = N / G
      {48, 6, 2, 4, 1},         // group_topk = 1: a group's score is its best expert
      {48, 6, 3, 7, 100},       // group_topk >= N / G: the sum of the whole group
      {64, 16, 4, 6, 3},        // group_topk = 3 of 4: three-term sums
      {256, 8, 4, 8, 2},        // DeepSeek-V3
      {1024, 64, 8, 8, 2},      // N = 1024, G = 64
      {1024, 32, 4, 16, 64},    // N = 1024, whole-group sums of 32
      {4096, 4096, 3, 3, 1},    // G = 4096: 3 rows per block (the group scores fill 48 KiB)
  };
}

constexpr int64_t kTokens[] = {0, 1, 7, 100, 257};

// The scores (T, N) of a case: row t of kind t % 4 (header).
std::vector<float> make_scores(const RoutingCase& c, int64_t T, uint64_t seed) {
  const int64_t N = c.N, per_group = c.N / c.G;
  std::vector<float> s((size_t)(T * N));
  const std::vector<float> random = kt::inputs(T * N, seed);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<float> values((size_t)per_group);
  for (int64_t i = 0; i < per_group; i++) values[(size_t)i] = 0.1f * (float)(i + 1);
  for (int64_t t = 0; t < T; t++) {
    float* row = s.data() + t * N;
    switch (t % 4) {
      case 0:
        for (int64_t j = 0; j < N; j++) row[j] = random[(size_t)(t * N + j)];
        break;
      case 1:
        for (int64_t j = 0; j < N; j++) row[j] = (float)(rng() % 4);
        break;
      case 2:
        for (int64_t j = 0; j < N; j++) row[j] = 0.5f;
        break;
      default:
        for (int64_t g = 0; g < c.G; g++) {
          std::shuffle(values.begin(), values.end(), rng);
          std::copy(values.begin(), values.end(), row + g * per_group);
        }
    }
  }
  return s;
}

// The guard after an output: stores past its end land there and must not.
constexpr int64_t kGuard = 16;
constexpr int64_t kUnwritten = -7;

struct Routing {
  std::vector<int64_t> idx, kept_groups;  // (T*K), (T*M), each followed by kGuard kUnwritten
};

Routing run_kernel(const KernelTable& k, const RoutingCase& c, const std::vector<float>& scores,
                   int64_t T) {
  Routing r{std::vector<int64_t>((size_t)(T * c.K + kGuard), kUnwritten),
            std::vector<int64_t>((size_t)(T * c.M + kGuard), kUnwritten)};
  k.moe_group_topk(r.idx.data(), r.kept_groups.data(), scores.data(), T, c.N, c.G, c.M,
                   c.group_topk, c.K);
  return r;
}

Routing run_device(const RoutingCase& c, const std::vector<float>& scores, int64_t T) {
  const Device d = kt::device_under_test();
  Tensor sd = kt::upload(scores, d);
  Tensor idx = kt::upload_indices(std::vector<int64_t>((size_t)(T * c.K + kGuard), kUnwritten), d);
  Tensor kept =
      kt::upload_indices(std::vector<int64_t>((size_t)(T * c.M + kGuard), kUnwritten), d);
  kt::dut_kernels().moe_group_topk(idx.index_data(), kept.index_data(), sd.data(), T, c.N, c.G,
                                   c.M, c.group_topk, c.K);
  return {idx.to_index_vector(), kept.to_index_vector()};
}

// ----------------------------------------------------------------------------
// the meaning, computed another way

// (value, index) pairs in routing order: larger value first, then the lower index.
bool routing_order(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

Routing brute_force(const RoutingCase& c, const std::vector<float>& scores, int64_t T) {
  const int64_t N = c.N, G = c.G, M = c.M, K = c.K, per_group = N / G;
  const int64_t chosen = std::min(c.group_topk, per_group);
  Routing r{std::vector<int64_t>((size_t)(T * K + kGuard), kUnwritten),
            std::vector<int64_t>((size_t)(T * M + kGuard), kUnwritten)};
  for (int64_t t = 0; t < T; t++) {
    const float* s = scores.data() + t * N;
    // group scores: sort the group's (score, expert) pairs, take the first `chosen`, and add
    // their scores in ascending expert order
    std::vector<std::pair<float, int64_t>> groups;
    for (int64_t g = 0; g < G; g++) {
      std::vector<std::pair<float, int64_t>> members;
      for (int64_t j = g * per_group; j < (g + 1) * per_group; j++) members.push_back({s[j], j});
      std::sort(members.begin(), members.end(), routing_order);
      std::vector<int64_t> picked;
      for (int64_t i = 0; i < chosen; i++) picked.push_back(members[(size_t)i].second);
      std::sort(picked.begin(), picked.end());
      float sum = 0.f;
      for (int64_t j : picked) sum += s[j];
      groups.push_back({sum, g});
    }
    // the group ranking
    std::sort(groups.begin(), groups.end(), routing_order);
    std::vector<bool> allowed((size_t)N, false);
    for (int64_t q = 0; q < M; q++) {
      const int64_t g = groups[(size_t)q].second;
      r.kept_groups[(size_t)(t * M + q)] = g;
      for (int64_t j = g * per_group; j < (g + 1) * per_group; j++) allowed[(size_t)j] = true;
    }
    // the allowed experts in ascending index order, stably sorted by descending score
    std::vector<int64_t> experts;
    for (int64_t j = 0; j < N; j++)
      if (allowed[(size_t)j]) experts.push_back(j);
    std::stable_sort(experts.begin(), experts.end(),
                     [s](int64_t a, int64_t b) { return s[a] > s[b]; });
    for (int64_t q = 0; q < K; q++) r.idx[(size_t)(t * K + q)] = experts[(size_t)q];
  }
  return r;
}

// ----------------------------------------------------------------------------
// the hand-made row
//
// N = 8 experts in G = 4 groups of 2, M = 2 groups kept, K = 2 experts:
//   group 0: 10, 0    (the best single expert, next to a weak one)
//   group 1:  6, 5
//   group 2:  7, 4.5
//   group 3:  1, 1
// Plain top-2: experts 0 (10) and 4 (7). With group_topk = 2 the group scores are 10, 11, 11.5,
// 2: groups 2 and 1 are kept, group 0 is not, and the top 2 of experts 2..5 are 4 (7) and 2 (6).
// With group_topk = 1 a group scores its best expert, 10, 6, 7, 1: groups 0 and 2 are kept and
// the choice is plain top-2 again.
const std::vector<float> kHandRow = {10.f, 0.f, 6.f, 5.f, 7.f, 4.5f, 1.f, 1.f};

// The hand-made row's answers: kept_groups and idx for group_topk = 2 (the limit moves the
// pick) and group_topk = 1 (plain top-2).
void check_hand_row(const Routing& r, int64_t group_topk, const std::string& where) {
  CAPTURE(where);
  const std::vector<int64_t> kept(r.kept_groups.begin(), r.kept_groups.begin() + 2);
  const std::vector<int64_t> idx(r.idx.begin(), r.idx.begin() + 2);
  if (group_topk == 2) {
    CHECK(kept == std::vector<int64_t>{2, 1});
    CHECK(idx == std::vector<int64_t>{4, 2});
  } else {
    CHECK(kept == std::vector<int64_t>{0, 2});
    CHECK(idx == std::vector<int64_t>{0, 4});
  }
  // nothing written past the outputs
  CHECK(std::vector<int64_t>(r.kept_groups.begin() + 2, r.kept_groups.end()) ==
        std::vector<int64_t>((size_t)kGuard, kUnwritten));
  CHECK(std::vector<int64_t>(r.idx.begin() + 2, r.idx.end()) ==
        std::vector<int64_t>((size_t)kGuard, kUnwritten));
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("kernels: moe_group_topk device vs cpu, idx and kept_groups equal (ties, G = 1, G = N)") {
  uint64_t seed = 900;
  for (const RoutingCase& c : routing_cases())
    for (int64_t T : kTokens) {
      const std::string what = c.name() + " T=" + std::to_string(T);
      CAPTURE(what);
      const std::vector<float> scores = make_scores(c, T, seed++);
      const Routing want = run_kernel(kt::cpu_kernels(), c, scores, T);
      const Routing got = run_device(c, scores, T);
      kt::require_equal(got.kept_groups, want.kept_groups, "moe_group_topk kept_groups, " + what);
      kt::require_equal(got.idx, want.idx, "moe_group_topk idx, " + what);
    }
}

TEST_CASE("kernels: moe_group_topk on the device, hand-made row: the group limit moves the pick") {
  for (int64_t group_topk : {2, 1})
    check_hand_row(run_device({8, 4, 2, 2, group_topk}, kHandRow, 1), group_topk,
                   std::string(device_name(kt::device_under_test())) +
                       ", group_topk = " + std::to_string(group_topk));
}

TEST_CASE("kernels: moe_group_topk on the device refuses more groups than shared memory holds") {
  // 12288 group scores fill the 48 KiB of one warp's row; one more does not fit
  const RoutingCase c{12289, 12289, 1, 1, 1};
  const std::vector<float> scores((size_t)c.N, 1.f);
  CHECK_THROWS_AS(run_device(c, scores, 1), std::invalid_argument);
}

}  // TEST_SUITE

// ----------------------------------------------------------------------------
// the cpu definition against its meaning

TEST_CASE("moe kernels: moe_group_topk (cpu) equals a brute-force group ranking and sort") {
  uint64_t seed = 950;
  for (const RoutingCase& c : routing_cases())
    for (int64_t T : kTokens) {
      const std::string what = c.name() + " T=" + std::to_string(T);
      CAPTURE(what);
      const std::vector<float> scores = make_scores(c, T, seed++);
      const Routing got = run_kernel(kt::cpu_kernels(), c, scores, T);
      const Routing want = brute_force(c, scores, T);
      CHECK(got.kept_groups == want.kept_groups);
      CHECK(got.idx == want.idx);
    }
}

TEST_CASE("moe kernels: moe_group_topk with G = 1 or M = G is plain top-K (topk_rows)") {
  uint64_t seed = 980;
  for (const RoutingCase& c : routing_cases()) {
    if (c.G != 1 && c.M != c.G) continue;
    const int64_t T = 100;
    CAPTURE(c.name());
    const std::vector<float> scores = make_scores(c, T, seed++);
    const Routing got = run_kernel(kt::cpu_kernels(), c, scores, T);
    std::vector<float> vals((size_t)(T * c.K));
    std::vector<int64_t> want((size_t)(T * c.K + kGuard), kUnwritten);
    kt::cpu_kernels().topk_rows(vals.data(), want.data(), scores.data(), T, c.N, c.K);
    CHECK(got.idx == want);
  }
}

TEST_CASE("moe kernels: moe_group_topk, hand-made row: the best expert's group is dropped") {
  // plain top-2 takes the best single expert, 0, and then 4
  float vals[2];
  int64_t top[2];
  kt::cpu_kernels().topk_rows(vals, top, kHandRow.data(), 1, 8, 2);
  CHECK(std::vector<int64_t>(top, top + 2) == std::vector<int64_t>{0, 4});
  // group_topk = 2: group 0 (10 + 0) loses to groups 2 (11.5) and 1 (11), so expert 0 is out;
  // group_topk = 1: groups 0 and 2 are kept, and the pick is plain top-2 again
  for (int64_t group_topk : {2, 1})
    check_hand_row(run_kernel(kt::cpu_kernels(), {8, 4, 2, 2, group_topk}, kHandRow, 1),
                   group_topk, "cpu, group_topk = " + std::to_string(group_topk));
}
