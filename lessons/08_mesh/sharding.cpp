// lessons/08_mesh/sharding.cpp — who holds what on the mesh (sharding.h).
#include "lessons/08_mesh/sharding.h"

#include <cstring>
#include <map>

#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/layers/tensor_parallel.h"

namespace ff::mesh {

Split split_of(const std::string& name, int ep) {
  auto ends = [&](const char* t) {
    const size_t n = std::strlen(t);
    return name.size() >= n && name.compare(name.size() - n, n, t) == 0;
  };
  if (ep > 1 && (ends("moe.experts_w1") || ends("moe.experts_w3") || ends("moe.experts_w2")))
    return Split::expert;
  if (ends("attn.w_uq") || ends("attn.w_uk") || ends("attn.w_uv") || ends("ffn.w1") ||
      ends("ffn.w3") || name == "head")
    return Split::column;
  if (ends("attn.w_o") || ends("ffn.w2")) return Split::row;
  return Split::replicated;
}

bool is_norm_weight(const std::string& name) {
  return name.size() >= 4 && name.compare(name.size() - 4, 4, "norm") == 0;
}

// The part of a full weight of shape `full` that the rank at `co` holds.
Shape local_shape(const Shape& full, Split s, const MeshCoords& co, const MeshSizes& sizes) {
  Shape out = full;
  if (s == Split::replicated) return out;
  if (s == Split::expert) {
    out[0] = full[0] / sizes.ep;
    return out;
  }
  const int64_t dim = s == Split::column ? 1 : 0;
  int64_t b, e;
  split_range(full[(size_t)dim], sizes.tp, co.tp, &b, &e);
  out[(size_t)dim] = e - b;
  return out;
}

Tensor leaf(const Tensor& t) {
  Tensor out = t.detach().clone();
  out.requires_grad_();
  return out;
}

// [slide:shard]
// This rank's weights, cut from the full model (the same seed everywhere): heads, dense FFN, LM
// head by the TP split rule; under EP each MoE layer's experts [e N/ep, (e+1) N/ep); the rest whole.
model::Params shard_model(const model::Config& c, const model::Params& full, const MeshCoords& co,
                          const MeshSizes& sizes, bool kpe_per_head) {
  model::Params p = full;
  const int t = co.tp, tp = sizes.tp;
  // [slide:shard-short]
  auto col = [&](Tensor& w) { w = leaf(tp::column_shard(w, t, tp)); };
  auto row = [&](Tensor& w) { w = leaf(tp::row_shard(w, t, tp)); };
  const int64_t E = c.experts / sizes.ep;  // experts per EP rank
  auto experts = [&](Tensor& w) { w = leaf(slice(w, 0, co.ep * E, (co.ep + 1) * E)); };
  for (model::Block& b : p.layers) {
    col(b.attn.w_uq), col(b.attn.w_uk), col(b.attn.w_uv), row(b.attn.w_o);
    if (!b.moe) col(b.ffn.w1), col(b.ffn.w3), row(b.ffn.w2);
    if (b.moe && sizes.ep > 1) experts(b.experts.w1), experts(b.experts.w3), experts(b.experts.w2);
    if (kpe_per_head) {  // the planted bug: W_kr (d, d_r) becomes H copies side by side
      NoGradGuard no_grad;
      b.attn.w_kr = leaf(concat(std::vector<Tensor>((size_t)c.heads, b.attn.w_kr.detach()), 1));
    }
  }
  col(p.head);
  // [/slide:shard-short]
  return p;
}
// [/slide]

// The weights of the stages this pipeline rank does not hold, released (a block keeps only
// whether it is a MoE block, for the order of the balancing biases).
void release_other_stages(model::Params* p, const StagePlan& plan, int pp_rank) {
  if (!plan.holds("embed", pp_rank)) p->embed = Tensor();
  if (!plan.holds("head", pp_rank)) p->norm = Tensor(), p->head = Tensor();
  for (size_t l = 0; l < p->layers.size(); l++)
    if (!plan.holds_stage(plan.stage_of_layer((int64_t)l), pp_rank)) {
      model::Block empty;
      empty.moe = p->layers[l].moe;
      p->layers[l] = empty;
    }
}

void fill_param_table(ParamTable* table, const model::Config& c, const model::Params& full,
                      model::Params& held, const StagePlan& plan, int pp_rank, int ep,
                      bool kpe_per_head) {
  ParamTable& t = *table;
  t.held = held.named_parameters();
  std::map<std::string, Tensor*> by_name;
  for (model::NamedTensor& n : t.held) by_name[n.name] = &n.t;
  for (const model::NamedTensor& n : full.named_parameters()) {
    t.names.push_back(n.name);
    t.full_shapes.push_back(n.t.shape());
    t.params.push_back(plan.holds(n.name, pp_rank) ? by_name.at(n.name) : nullptr);
  }
  if (kpe_per_head)  // the gathered W_kr is (d, H d_r): every head's copy
    for (size_t k = 0; k < t.names.size(); k++)
      if (t.names[k].size() > 9 && t.names[k].compare(t.names[k].size() - 9, 9, "attn.w_kr") == 0)
        t.full_shapes[k] = {c.dim, c.heads * c.d_rope};
  t.all_names = t.names;
  t.all_shapes = t.full_shapes;
  for (const model::NamedTensor& n : full.named_buffers())
    t.all_names.push_back(n.name), t.all_shapes.push_back(n.t.shape());
  for (size_t k = 0; k < t.names.size(); k++) {
    if (!t.params[k]) continue;
    t.local_numel += t.params[k]->numel();
    if (split_of(t.names[k], ep) == Split::replicated) t.replicated_numel += t.params[k]->numel();
  }
}

}  // namespace ff::mesh
