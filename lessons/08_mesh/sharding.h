// lessons/08_mesh/sharding.h — who holds what on the mesh: how each weight is split (TP
// columns or rows, EP experts, or whole), this rank's shard of the full model, and which
// pipeline stage each weight belongs to.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/comm/mesh.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "common/layers/schedule.h"

namespace ff::mesh {

// How a weight is laid over the ranks: over TP (columns or rows), or, under EP, its experts
// (dim 0) over the EP ranks.
enum class Split { replicated, column, row, expert };

// The split of the weight called `name` (model::Params::named_parameters' names) with ep EP
// ranks: the attention's up-projections, the dense FFN's w1, w3 and the LM head by columns,
// w_o and w2 by rows, the experts under EP by expert; the rest whole.
Split split_of(const std::string& name, int ep);
// An RMSNorm's weight (its name ends in "norm").
bool is_norm_weight(const std::string& name);
// The part of a full weight of shape `full` that the rank at `co` holds.
Shape local_shape(const Shape& full, Split s, const MeshCoords& co, const MeshSizes& sizes);
// A new trainable leaf holding t's values.
Tensor leaf(const Tensor& t);
// This rank's weights, cut from the full model (the same seed everywhere): heads, dense FFN, LM
// head by the TP split rule; under EP each MoE layer's experts [e N/ep, (e+1) N/ep); the rest
// whole. kpe_per_head: the planted bug, W_kr as one copy per head.
model::Params shard_model(const model::Config& c, const model::Params& full, const MeshCoords& co,
                          const MeshSizes& sizes, bool kpe_per_head);

// Which stage each weight belongs to, and which stages a pipeline rank holds.
struct StagePlan {
  std::vector<int64_t> begin;  // S + 1 layer indices
  pp::Schedule sched;
  int stages() const { return (int)begin.size() - 1; }
  int stage_of_layer(int64_t l) const {
    int st = 0;
    while (begin[(size_t)st + 1] <= l) st++;
    return st;
  }
  // the embedding on the first stage, block l's weights on its stage, the rest on the last
  int stage_of(const std::string& name) const {
    if (name == "embed") return 0;
    if (name.rfind("layers.", 0) == 0) return stage_of_layer(std::stol(name.substr(7)));
    return stages() - 1;
  }
  bool holds_stage(int stage, int pp_rank) const {
    for (int d = 0; d < (sched.layout == pp::Layout::line ? 1 : 2); d++)
      if (sched.stage_of(pp_rank, d) == stage) return true;
    return false;
  }
  bool holds(const std::string& name, int pp_rank) const { return holds_stage(stage_of(name), pp_rank); }
  int rank_of(const std::string& name) const { return sched.rank_of(0, stage_of(name)); }
};

// The weights of the stages this pipeline rank does not hold, released (a block keeps only
// whether it is a MoE block, for the order of the balancing biases).
void release_other_stages(model::Params* p, const StagePlan& plan, int pp_rank);

// The model's weights by their stable names (model::Params::named_parameters), as the check and
// the optimizers see them: each one's full shape, and this rank's tensor of it (nullptr for a
// weight of another pipeline stage). The balancing biases (buffers, not parameters) follow the
// weights in all_names, as the check gathers them.
struct ParamTable {
  ParamTable() = default;
  ParamTable(const ParamTable&) = delete;  // params point into its own held
  ParamTable& operator=(const ParamTable&) = delete;
  std::vector<std::string> names;
  std::vector<Shape> full_shapes;
  std::vector<Tensor*> params;
  std::vector<std::string> all_names;  // names, then the balancing biases'
  std::vector<Shape> all_shapes;
  int64_t local_numel = 0;       // the numbers this rank holds
  int64_t replicated_numel = 0;  // ... of weights every TP rank holds whole
  std::vector<model::NamedTensor> held;  // this rank's named tensors, which params point into
};
// `held` this rank's shard of `full` (shard_model, release_other_stages); under the planted bug
// kpe-per-head the gathered W_kr has every head's copy.
void fill_param_table(ParamTable* table, const model::Config& c, const model::Params& full,
                      model::Params& held, const StagePlan& plan, int pp_rank, int ep,
                      bool kpe_per_head);

}  // namespace ff::mesh
