// kernels/cpu/moe_routing.cpp — DeepSeek-V3's node-limited ("group-limited") expert selection:
// the readable definition of moe_group_topk (kernels/kernels.h). CUDA version:
// kernels/cuda/moe_routing.cu.
//
// DeepSeek-V3 (arXiv 2412.19437, section 2.1.2; inference/model.py, Gate.forward) spreads its N
// routed experts over G groups — one group per node in its deployment — and lets each token
// reach experts on at most M groups, so a token's activations cross the network to at most M
// nodes instead of up to K. Per token, from its biased affinities s + b (N):
//
//   1. group score: the sum of the group's min(group_topk, N/G) largest affinities
//      (model.py: scores.topk(2, dim=-1)[0].sum(dim=-1));
//   2. keep the M groups with the largest scores;
//   3. mask the experts of the other groups with -inf and take the top K of what is left.
//
// Order and ties, the same on every device so that the integer outputs are EQUAL:
//   - "largest" is the order of topk_rows: larger value first, then the lower index on ties
//     (expert index in steps 1 and 3, group index in step 2);
//   - a group score adds its chosen affinities in ASCENDING EXPERT INDEX order, starting from
//     0.f, one float rounding per addition. Float addition is not associative: a fixed order
//     makes two group scores that differ only by rounding compare the same way on every device.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void moe_group_topk(int64_t* idx, int64_t* kept_groups, const float* scores, int64_t T, int64_t N,
                    int64_t G, int64_t M, int64_t group_topk, int64_t K) {
  const int64_t per_group = N / G, chosen = std::min(group_topk, per_group);
  std::vector<float> group_score((size_t)G), vals((size_t)std::max(chosen, std::max(M, K)));
  std::vector<int64_t> ids((size_t)chosen);
  std::vector<float> masked((size_t)N);
  for (int64_t t = 0; t < T; t++) {
    // [exercise:group-topk] Token t's group-limited choice: its M best groups into kept_groups + t M, then its K best experts among them into idx + t K.
    const float* s = scores + t * N;
    // 1. group scores: the group's `chosen` largest, added in ascending index order
    for (int64_t g = 0; g < G; g++) {
      const float* sg = s + g * per_group;
      topk_rows(vals.data(), ids.data(), sg, 1, per_group, chosen);
      std::sort(ids.begin(), ids.end());
      float sum = 0.f;
      for (int64_t i : ids) sum += sg[i];
      group_score[(size_t)g] = sum;
    }
    // 2. the M best groups, best first
    int64_t* kept = kept_groups + t * M;
    topk_rows(vals.data(), kept, group_score.data(), 1, G, M);
    // 3. the top K of the kept groups' experts: everything else masked with -inf (K <= M N/G,
    //    so the K picks are all kept experts)
    std::fill(masked.begin(), masked.end(), -INFINITY);
    for (int64_t q = 0; q < M; q++)
      std::copy(s + kept[q] * per_group, s + (kept[q] + 1) * per_group,
                masked.begin() + kept[q] * per_group);
    topk_rows(vals.data(), idx + t * K, masked.data(), 1, N, K);
    // [/exercise]
  }
}

}  // namespace ff::cpu
