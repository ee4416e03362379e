// kernels/cuda/moe_routing.cu — DeepSeek-V3's node-limited expert selection, moe_group_topk:
// per token, score the G groups of N/G experts, keep the M best groups, and pick the top K
// experts of those groups. The readable definition, with the why and the exact order and tie
// rules, is the cpu twin in kernels/cpu/moe_routing.cpp; this kernel computes the same integers.
//
// Shapes (kernels/kernels.h): scores (T, N), kept_groups (T, M), idx (T, K); per_group = N / G,
// chosen = min(group_topk, per_group) scores summed per group.
//
// group_topk_kernel: ONE WARP PER TOKEN ROW, blockDim (32, rows), grid-stride over rows, as
//   topk_rows (index.cu). A row is at most a few thousand floats and the work per row is
//   small, so a warp — no block-wide barriers — is the right size; rows are many (tokens).
//   Each warp has a slice of G floats of dynamic shared memory for its row's group scores.
//   Three steps per row:
//   1. group scores, ONE LANE PER GROUP (lane l takes groups l, l + 32, ...): it finds a group's
//      `chosen`-th largest (value, index) pair by `chosen` rounds of a sequential argmax (each
//      round takes the best pair strictly after the previous round's, as topk_rows), then adds
//      the group's scores that rank at or before that pair in ascending index order — the cpu
//      twin's order, so the float sums are bit-identical. (When chosen == per_group every score
//      is chosen and the rounds are skipped.) One lane per group keeps the sum sequential; a
//      shuffle tree would add in another order. It stores the score in shared memory; a
//      __syncwarp publishes the slice to the other lanes.
//   2. kept groups: M rounds of a warp-wide argmax over the (group score, group) pairs, as
//      topk_rows: lanes scan groups lane, lane + 32, ...; five __shfl_xor_sync steps leave the
//      winner in every lane; lane 0 writes kept_groups. The last pick (thr_v, thr_g) is the
//      M-th best group, so group g is kept iff its pair ranks at or before it: no list of
//      kept groups is needed.
//   3. top K of the kept groups' experts: K rounds of the same warp-wide argmax over the
//      experts j = lane, lane + 32, ... whose group j / per_group is kept; lane 0 writes idx.
//      Consecutive lanes read consecutive scores: coalesced.
//   A final __syncwarp: every lane has read the group scores before the next row rewrites them.
//   Cost per row and lane: G / 32 * chosen * per_group reads in step 1, (M G + K N) / 32 reads
//   and 10 (M + K) shuffles in steps 2-3 — microseconds for DeepSeek-V3's N = 256, G = 8,
//   M = 4, K = 8. Routing is a sliver of an MoE layer's time next to the expert GEMMs; a very
//   large K would want a sort instead of K rounds.
//   Shared memory: rows * G * 4 bytes, 4 rows per block while that fits in 48 KiB (G <= 3072),
//   fewer above; G > 12288 is refused.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

// File-local (an anonymous namespace): other kernel files have helpers of the same names.
namespace {

constexpr unsigned kRoutingFullMask = 0xffffffffu;  // all 32 lanes take part in a shuffle
constexpr unsigned kRoutingRowsPerBlock = 4;        // blockDim (32, 4): a warp per row
constexpr int64_t kRoutingMaxShared = 48 * 1024;    // bytes of dynamic shared memory per block

// Whether (av, aj) comes before (bv, bj): larger value first, then the lower index. An index
// of -1 means "no candidate" and comes after everything.
__device__ __forceinline__ bool ranks_before(float av, long long aj, float bv, long long bj) {
  if (aj < 0) return false;
  if (bj < 0) return true;
  return av > bv || (av == bv && aj < bj);
}

// Whether (av, aj) is (bv, bj) or comes before it.
__device__ __forceinline__ bool ranks_at_or_before(float av, long long aj, float bv,
                                                   long long bj) {
  return (av == bv && aj == bj) || ranks_before(av, aj, bv, bj);
}

// The warp-wide argmax: every lane passes its best (v, j) and gets the warp's best.
__device__ __forceinline__ void warp_best(float& v, long long& j) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_v = __shfl_xor_sync(kRoutingFullMask, v, offset);
    const long long other_j = __shfl_xor_sync(kRoutingFullMask, j, offset);
    if (ranks_before(other_v, other_j, v, j)) {
      v = other_v;
      j = other_j;
    }
  }
}

// The score of one group, by one thread: sg (n) its scores; the sum of its `chosen` largest
// (lower index first on ties), added in ascending index order.
__device__ float group_score(const float* sg, int64_t n, int64_t chosen) {
  // the chosen-th largest pair: rounds of a sequential argmax, each after the previous pick
  float thr_v = INFINITY;
  long long thr_j = -1;
  if (chosen < n) {
    for (int64_t r = 0; r < chosen; r++) {
      float best_v = -INFINITY;
      long long best_j = -1;
      for (long long i = 0; i < n; i++) {
        const float v = sg[i];
        const bool not_taken = v < thr_v || (v == thr_v && i > thr_j);
        if (not_taken && ranks_before(v, i, best_v, best_j)) {
          best_v = v;
          best_j = i;
        }
      }
      thr_v = best_v;
      thr_j = best_j;
    }
  }
  float sum = 0.f;
  for (long long i = 0; i < n; i++)
    if (chosen >= n || ranks_at_or_before(sg[i], i, thr_v, thr_j)) sum += sg[i];
  return sum;
}

// idx (T, K), kept_groups (T, M); scores (T, N). A warp per row (threadIdx.y), lanes threadIdx.x.
__global__ void group_topk_kernel(int64_t* idx, int64_t* kept_groups, const float* scores,
                                  int64_t T, int64_t N, int64_t G, int64_t M, int64_t group_topk,
                                  int64_t K) {
  SIMT_DYNAMIC_SHARED(float, smem);
  float* gscore = smem + threadIdx.y * G;  // this warp's row: the G group scores
  const int lane = threadIdx.x;
  const int64_t per_group = N / G, chosen = group_topk < per_group ? group_topk : per_group;

  for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < T;
       row += (int64_t)gridDim.x * blockDim.y) {
    const float* s = scores + row * N;

    // 1. group scores, a lane per group
    for (int64_t g = lane; g < G; g += 32)
      gscore[g] = group_score(s + g * per_group, per_group, chosen);
    __syncwarp(kRoutingFullMask);  // every group score is in shared memory

    // 2. the M best groups; (thr_v, thr_g) ends as the M-th
    float thr_v = INFINITY;
    long long thr_g = -1;
    for (int64_t q = 0; q < M; q++) {
      float best_v = -INFINITY;
      long long best_g = -1;
      for (long long g = lane; g < G; g += 32) {
        const float v = gscore[g];
        const bool not_taken = v < thr_v || (v == thr_v && g > thr_g);
        if (not_taken && ranks_before(v, g, best_v, best_g)) {
          best_v = v;
          best_g = g;
        }
      }
      warp_best(best_v, best_g);
      if (lane == 0) kept_groups[row * M + q] = best_g;
      thr_v = best_v;
      thr_g = best_g;
    }

    // 3. the top K experts of the kept groups
    float prev_v = INFINITY;
    long long prev_j = -1;
    for (int64_t q = 0; q < K; q++) {
      float best_v = -INFINITY;
      long long best_j = -1;
      for (long long j = lane; j < N; j += 32) {
        const long long g = j / per_group;
        if (!ranks_at_or_before(gscore[g], g, thr_v, thr_g)) continue;  // group not kept
        const float v = s[j];
        const bool not_taken = v < prev_v || (v == prev_v && j > prev_j);
        if (not_taken && ranks_before(v, j, best_v, best_j)) {
          best_v = v;
          best_j = j;
        }
      }
      warp_best(best_v, best_j);
      if (lane == 0) idx[row * K + q] = best_j;
      prev_v = best_v;
      prev_j = best_j;
    }
    __syncwarp(kRoutingFullMask);  // every lane is done with gscore before the next row
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// launcher

void moe_group_topk(int64_t* idx, int64_t* kept_groups, const float* scores, int64_t T, int64_t N,
                    int64_t G, int64_t M, int64_t group_topk, int64_t K) {
  if (T == 0) return;
  const int64_t row_bytes = G * (int64_t)sizeof(float);  // one row's group scores
  if (row_bytes > kRoutingMaxShared)
    throw std::invalid_argument("moe_group_topk: G = " + std::to_string(G) +
                                " groups exceed the cuda/sim kernel's shared memory (at most " +
                                std::to_string(kRoutingMaxShared / sizeof(float)) + ")");
  const unsigned rows =
      (unsigned)std::min<int64_t>(kRoutingRowsPerBlock, kRoutingMaxShared / row_bytes);
  const dim3 block(32, rows);
  const int64_t blocks = (T + rows - 1) / rows;
  const int64_t max_blocks = kMaxElementwiseBlocks * kElementwiseBlock / (32 * rows);
  const dim3 grid((unsigned)std::min(blocks, max_blocks));
  SIMT_LAUNCH(group_topk_kernel, grid, block, (size_t)(rows * row_bytes), 0, idx, kept_groups,
              scores, T, N, G, M, group_topk, K);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
