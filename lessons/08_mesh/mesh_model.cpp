// lessons/08_mesh/mesh_model.cpp — the model on the mesh (mesh_model.h).
#include "lessons/08_mesh/mesh_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff::mesh {

// [slide:vocab-ce]
// Cross-entropy over a vocabulary split across the TP ranks. Rank r holds the logits of its
// columns [v0, v0 + V_r), (n, V_r). Per token it computes lesson 01's partial state over its
// columns, m_r = max z and l_r = sum exp(z - m_r), plus z[target] when it owns the target; one
// all-gather of those 3 numbers per token, and every rank merges them in rank order:
//     m = max_r m_r,   l = sum_r l_r exp(m_r - m),   loss_i = m + log l - z[target_i]
// Backward (by hand): dz = (exp(z - m) / l - onehot(target)) / n on the rank's own columns, no
// communication. local_softmax (a planted bug) normalises by the rank's own m_r, l_r instead.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const std::vector<int64_t>& targets,
                                    int64_t v0, Comm& tp, bool local_softmax) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const std::vector<float> z = logits.to_vector();
  std::vector<float> mine((size_t)(3 * n));
  for (int64_t i = 0; i < n; i++) {
    const float* zi = z.data() + i * V;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < V; j++) m = std::max(m, zi[j]);
    double l = 0;
    for (int64_t j = 0; j < V; j++) l += std::exp((double)zi[j] - m);
    const int64_t t = targets[(size_t)i] - v0;
    mine[(size_t)(3 * i)] = m;
    mine[(size_t)(3 * i + 1)] = (float)l;
    mine[(size_t)(3 * i + 2)] = t >= 0 && t < V ? zi[t] : 0.f;
  }
  const int P = tp.size();
  std::vector<float> all(mine.size() * (size_t)P);
  if (P > 1)
    tp.allgather(mine.data(), mine.size() * sizeof(float), all.data());
  else
    all = mine;
  // [slide:ce-merge]
  std::vector<float> m((size_t)n), l((size_t)n);
  // [slide:ce-merge-short]
  double loss = 0;
  for (int64_t i = 0; i < n; i++) {
    float mm = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < P; r++) mm = std::max(mm, all[(size_t)(r * 3 * n + 3 * i)]);
    double ll = 0, zt = 0;
    for (int r = 0; r < P; r++) {
      const float* s = all.data() + r * 3 * n + 3 * i;
      ll += (double)s[1] * std::exp((double)s[0] - mm);
      zt += s[2];  // one rank owns the target, the others add 0
    }
    m[(size_t)i] = mm, l[(size_t)i] = (float)ll;
    loss += mm + std::log(ll) - zt;
    if (local_softmax) m[(size_t)i] = mine[(size_t)(3 * i)], l[(size_t)i] = mine[(size_t)(3 * i + 1)];
  }
  // [/slide:ce-merge-short]
  // [/slide:ce-merge]
  Tensor out = Tensor::from_vector({(float)(loss / (double)n)}, {}, logits.device());
  const Device dev = logits.device();
  return record(out, "vocab_parallel_cross_entropy", {logits},
                [z, m, l, targets, v0, n, V, dev](const Tensor& dy) -> std::vector<Tensor> {
                  const double scale = (double)dy.to_vector()[0] / (double)n;
                  std::vector<float> dz(z.size());
                  for (int64_t i = 0; i < n; i++) {
                    const int64_t t = targets[(size_t)i] - v0;
                    for (int64_t j = 0; j < V; j++) {
                      double p = std::exp((double)z[(size_t)(i * V + j)] - m[(size_t)i]) / l[(size_t)i];
                      if (j == t) p -= 1.0;
                      dz[(size_t)(i * V + j)] = (float)(p * scale);
                    }
                  }
                  return {Tensor::from_vector(dz, {n, V}, dev)};
                });
}
// [/slide]

// Rows [r0, r1) of an int64 tensor (token ids, positions), on its device.
Tensor index_rows(const Tensor& t, int64_t r0, int64_t r1) {
  const std::vector<int64_t> all = t.to_index_vector();
  const int64_t w = t.numel() / t.size(0);
  Shape s = t.shape();
  s[0] = r1 - r0;
  return Tensor::from_indices(std::vector<int64_t>(all.begin() + r0 * w, all.begin() + r1 * w), s, t.device());
}

Tensor take_columns(const Tensor& t, const std::vector<int64_t>& cols) {
  const int64_t B = t.size(0), T = t.size(1);
  const std::vector<int64_t> all = t.to_index_vector();
  std::vector<int64_t> out;
  for (int64_t b = 0; b < B; b++)
    for (int64_t j : cols) out.push_back(all[(size_t)(b * T + j)]);
  return Tensor::from_indices(out, {B, (int64_t)cols.size()}, t.device());
}

std::vector<float> expert_loads(const std::vector<Route>& routes, const model::Config& c) {
  const int64_t N = c.experts;
  std::vector<float> load((size_t)((c.layers - c.dense_layers) * N), 0.f);
  for (const Route& r : routes)
    for (int64_t e : r.idx.to_index_vector()) load[(size_t)(r.moe_layer * N + e)] += 1.f;
  return load;  // exact: counts far below 2^24
}

// The balancing bias of every MoE layer this rank holds, from every layer's loads (load: N per
// MoE layer, summed over every rank that routed), by lesson 05's rule.
void update_biases(model::Params& p, const std::vector<float>& load, int64_t N, double gamma) {
  dsv3::BiasUpdater rule;  // lesson 05's rule, once per MoE layer
  rule.gamma = gamma;
  size_t l = 0;
  for (model::Block& b : p.layers) {
    if (!b.moe) continue;
    if (b.experts.bias.defined()) {  // (undefined: a layer of another pipeline stage)
      const auto first = load.begin() + (long)(l * (size_t)N);
      b.experts.bias.copy_from(rule.updated(b.experts.bias, std::vector<double>(first, first + N), 0));
    }
    l++;
  }
}

RankModel::RankModel(const Options& opts, const Setup& setup, Mesh& mesh, const model::Params& full,
                     Device dev)
    : topo(dsv3::make_topology(mesh.ep(), opts.a2a == "hierarchical" ? (int)opts.ranks_per_node : 1)),
      sched(pp::make_schedule(opts.schedule, (int)opts.pp, (int)setup.microbatches)),
      plan{setup.stage_begin, sched} {
  const MeshCoords& co = mesh.coords();
  const model::Config& c = setup.c;
  mm.c = c;
  mm.p = shard_model(c, full, co, setup.sizes, opts.bug == Bug::kpe_per_head);
  mm.device = dev;
  // TP (and SP): the heads, the dense FFN and the vocabulary split over the TP ranks
  mm.tp = &mesh.tp();
  mm.sp = opts.sp;
  mm.ce_local_softmax = opts.bug == Bug::ce_local_softmax;
  int64_t vocab_end;
  split_range(c.vocab, setup.sizes.tp, co.tp, &mm.v0, &vocab_end);
  // CP: every CP rank's tokens of each sequence, in the zigzag layout
  mm.cp = &mesh.cp();
  for (int r = 0; r < setup.sizes.cp; r++)
    mm.cp_positions.push_back(ring::layout_positions(ring::Layout::zigzag, setup.seq, setup.sizes.cp, r));
  mm.local_mask = opts.bug == Bug::local_causal_mask;
  mm.local_rope = opts.bug == Bug::local_rope_positions;
  // EP: the experts over the EP group, the all-to-all flat or through the nodes
  mm.ep = &mesh.ep();
  topo.node_comm.set_label("ep-node"), topo.rail_comm.set_label("ep-rail");
  mm.topo = &topo;
  mm.scheme = opts.a2a == "hierarchical" ? dsv3::Scheme::hierarchical : dsv3::Scheme::flat;
  mm.maps = &maps;
  // PP: this rank keeps only the weights of its own stages
  pp_rank = co.pp;
  release_other_stages(&mm.p, plan, co.pp);
  for (const model::Block& b : mm.p.layers) held_moe += b.moe && b.experts.bias.defined();
  stages.mm = &mm, stages.begin = setup.stage_begin, stages.M = setup.microbatches, stages.Bm = setup.microbatch, stages.T = setup.seq_per_cp;
  stages.mb_sum = opts.bug == Bug::pp_mb_sum;
  fill_param_table(&table, c, full, mm.p, plan, co.pp, setup.sizes.ep, opts.bug == Bug::kpe_per_head);
}

}  // namespace ff::mesh
