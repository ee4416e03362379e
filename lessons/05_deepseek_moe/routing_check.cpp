// lessons/05_deepseek_moe/routing_check.cpp — the group-limited selection checked by its
// definition (deepseek_moe.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "lessons/05_deepseek_moe/deepseek_moe.h"

namespace ff::deepseek {

bool routing_is_group_limited(const dsv3::Config& c, const Tensor& s, const Tensor& bias,
                              const dsv3::Selection& sel) {
  const int64_t T = s.size(0), N = c.experts, K = c.topk, G = c.groups, M = c.topk_groups;
  const int64_t per = N / G, top = c.group_score_k();
  const std::vector<float> sv = s.to_vector(), bv = bias.to_vector();
  const std::vector<int64_t> idx = sel.idx.to_index_vector(), kept = sel.kept_groups.to_index_vector();
  for (int64_t t = 0; t < T; t++) {
    std::vector<double> x((size_t)N), score((size_t)G);
    for (int64_t e = 0; e < N; e++) x[(size_t)e] = (double)sv[(size_t)(t * N + e)] + bv[(size_t)e];
    for (int64_t g = 0; g < G; g++) {
      std::vector<double> v(x.begin() + g * per, x.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      for (int64_t i = 0; i < top; i++) score[(size_t)g] += v[(size_t)i];
    }
    std::vector<bool> is_kept((size_t)G, false), chosen((size_t)N, false);
    for (int64_t m = 0; m < M; m++) {
      const int64_t g = kept[(size_t)(t * M + m)];
      if (g < 0 || g >= G || is_kept[(size_t)g]) return false;
      is_kept[(size_t)g] = true;
    }
    for (int64_t g = 0; g < G; g++)
      for (int64_t h = 0; h < G; h++)
        if (is_kept[(size_t)g] && !is_kept[(size_t)h] &&
            score[(size_t)h] > score[(size_t)g] + 1e-5 * std::max(1.0, std::fabs(score[(size_t)g])))
          return false;
    double worst_chosen = INFINITY;
    for (int64_t j = 0; j < K; j++) {
      const int64_t e = idx[(size_t)(t * K + j)];
      if (e < 0 || e >= N || chosen[(size_t)e] || !is_kept[(size_t)(e / per)]) return false;
      chosen[(size_t)e] = true;
      worst_chosen = std::min(worst_chosen, x[(size_t)e]);
    }
    for (int64_t e = 0; e < N; e++)
      if (is_kept[(size_t)(e / per)] && !chosen[(size_t)e] &&
          x[(size_t)e] > worst_chosen + 1e-5 * std::max(1.0, std::fabs(worst_chosen)))
        return false;
  }
  return true;
}

void check_selection(Lesson& lesson, CheckReport& check, const dsv3::Config& c, const Tensor& s,
                     const Tensor& bias, const dsv3::Selection& sel) {
  lesson.print("the selection, by its definition (the one-process reference routes with the same kernel)\n");
  check.holds("routing: each token's K experts are the best of its M best groups",
              routing_is_group_limited(c, s, bias, sel));
}

}  // namespace ff::deepseek
