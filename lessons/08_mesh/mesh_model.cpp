// lessons/08_mesh/mesh_model.cpp — the model on the mesh (mesh_model.h): rows and columns of a
// rank's tokens, and all a rank holds, built once (RankModel).
#include "lessons/08_mesh/mesh_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff::mesh {

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

RankModel::RankModel(const Options& opts, const Setup& setup, Mesh& mesh, const model::Params& full,
                     Device dev)
    : topo(dsv3::make_topology(mesh.ep(), opts.a2a == "hierarchical" ? (int)opts.ranks_per_node : 1)),
      sched(pp::make_schedule(opts.schedule, (int)opts.pp, (int)setup.microbatches)),
      plan{setup.stage_begin, sched} {
  const MeshCoords& co = mesh.coords();
  const model::Config& c = setup.c;
  model.c = c;
  model.weights = shard_model(c, full, co, setup.sizes, opts.bug == Bug::kpe_per_head);
  model.device = dev;
  // TP (and SP): the heads, the dense FFN and the vocabulary split over the TP ranks
  model.tp = &mesh.tp();
  model.sp = opts.sp;
  model.ce_local_softmax = opts.bug == Bug::ce_local_softmax;
  model.f_no_allreduce = opts.bug == Bug::f_no_allreduce;
  model.bf16_wire = opts.precision == "bf16";
  int64_t vocab_end;
  split_range(c.vocab, setup.sizes.tp, co.tp, &model.v0, &vocab_end);
  // CP: every CP rank's tokens of each sequence, in the zigzag layout
  model.cp = &mesh.cp();
  for (int r = 0; r < setup.sizes.cp; r++)
    model.cp_positions.push_back(ring::layout_positions(ring::Layout::zigzag, setup.seq, setup.sizes.cp, r));
  model.local_mask = opts.bug == Bug::local_causal_mask;
  model.local_rope = opts.bug == Bug::local_rope_positions;
  // EP: the experts over the EP group, the all-to-all flat or through the nodes
  model.ep = &mesh.ep();
  topo.node_comm.set_label("ep-node"), topo.rail_comm.set_label("ep-rail");
  model.topo = &topo;
  model.scheme = opts.a2a == "hierarchical" ? dsv3::Scheme::hierarchical : dsv3::Scheme::flat;
  model.maps = &maps;
  // PP: this rank keeps only the weights of its own stages
  pp_rank = co.pp;
  release_other_stages(&model.weights, plan, co.pp);
  for (const model::Block& b : model.weights.layers) held_moe += b.moe && b.experts.bias.defined();
  stages.model = &model, stages.begin = setup.stage_begin, stages.M = setup.microbatches, stages.Bm = setup.microbatch, stages.T = setup.seq_per_cp;
  stages.mb_sum = opts.bug == Bug::pp_mb_sum;
  fill_param_table(&table, c, full, model.weights, plan, co.pp, setup.sizes.ep, opts.bug == Bug::kpe_per_head);
}

}  // namespace ff::mesh
