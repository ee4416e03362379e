// lessons/08_mesh/mesh_model.h — the model on the mesh: this rank's forward of its tokens
// under TP (and SP), CP's ring over MLA's heads, EP's MoE layers, the vocabulary-parallel
// cross-entropy, and the pipeline stages lesson 07's executor runs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/layers/dsv3_ep.h"
#include "common/layers/model.h"
#include "lessons/08_mesh/fsdp.h"
#include "common/layers/pipeline.h"
#include "common/layers/tensor_parallel.h"
#include "common/lesson/lesson.h"
#include "lessons/02_ring_attention/ring.h"
#include "lessons/07_dualpipe/schedules.h"
#include "lessons/08_mesh/options.h"
#include "lessons/08_mesh/sharding.h"

namespace ff::mesh {

// Cross-entropy over a vocabulary split across the TP ranks (forward.cpp says how): logits
// (n, V_r) of this rank's columns [v0, v0 + V_r), targets (n) global ids; one all-gather of 3
// numbers per token. local_softmax: the planted bug (each rank normalises by its own max and sum).
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const std::vector<int64_t>& targets,
                                    int64_t v0, Comm& tp, bool local_softmax);

// Rows [r0, r1) of an int64 tensor (token ids, positions), on its device.
Tensor index_rows(const Tensor& t, int64_t r0, int64_t r1);
// The columns `cols` of an int64 (B, T) token batch: a CP rank's tokens of every sequence.
Tensor take_columns(const Tensor& t, const std::vector<int64_t>& cols);

// One MoE layer's routing of some token rows: its index among the MoE layers, the experts.
struct Route {
  int64_t moe_layer = 0;
  Tensor idx;  // (rows, K)
};

struct MeshModel {
  model::Config c;
  Device device = Device::cpu;
  model::Params weights;  // this TP rank's weights (shard_model)
  Comm* tp = nullptr;
  bool sp = false, ce_local_softmax = false;
  int64_t v0 = 0;   // this rank's first vocabulary column
  // CP: the ring over the cp group, and every CP rank's token positions within a sequence
  // (zigzag: rank r holds chunks r and 2cp-1-r of the 2cp chunks). Planted bugs: the causal
  // mask or RoPE from the rank-local indices 0..n-1 instead of the global positions.
  Comm* cp = nullptr;
  std::vector<std::vector<int64_t>> cp_positions;
  bool local_mask = false, local_rope = false;
  // EP: the MoE layers over the ep group (lesson 05's layer, common/layers/dsv3_ep.h), this
  // rank holding N / ep of each layer's experts; maps gets every MoE layer's routing map.
  Comm* ep = nullptr;
  dsv3::Topology* topo = nullptr;
  dsv3::Scheme scheme = dsv3::Scheme::flat;
  std::vector<dsv3::RoutingMap>* maps = nullptr;
  // ZeRO-3 (--zero 3): the units gathered before their forward and freed after (fsdp.h): unit 0
  // the embedding, 1 + l block l, layers + 1 the final norm and head. nullptr: every weight held.
  fsdp::Fsdp* fsdp = nullptr;
  void enter_unit(int u) const { if (fsdp) fsdp->before_forward(u); }
  Tensor leave_unit(int u, const Tensor& y) const { return fsdp ? fsdp->after_forward(u, y) : y; }

  // Into the TP region: f (identity forward, all-reduce of the gradient backward), or under SP
  // gather_seq (all-gather of the tokens forward, reduce-scatter backward). The planted bug
  // f-no-allreduce (f_no_allreduce): f without the all-reduce in its backward.
  bool f_no_allreduce = false;
  // --precision bf16 under SP: the gathers whose rows go straight into a bf16 matmul (the dense
  // FFN's W1 and W3, the head) send them in bf16 (tp::gather_seq's bf16_wire)
  bool bf16_wire = false;
  Tensor enter(const Tensor& x, bool to_bf16_matmul = false);
  // Out of it: g (all-reduce of the partial sums), or under SP scatter_seq (reduce-scatter).
  Tensor leave(const Tensor& y) { return sp ? tp::scatter_seq(y, *tp) : tp::g(y, *tp); }

  // MLA's heads over the CP ring (lesson 02's): this rank's queries against every CP rank's
  // keys and values (forward.cpp says how).
  Tensor attention_cp(const model::Attention& a, const model::Latents& l, int64_t H, int64_t B,
                      const Tensor& rope_pos);

  // Where this rank's tokens sit: under CP each sequence's T tokens are the zigzag chunks of
  // this CP rank (global positions, for the mask and RoPE); under SP this TP rank keeps rows
  // [r0, r0 + rows) of the B T token rows outside the TP regions.
  struct Tokens {
    int64_t B = 0, T = 0, r0 = 0, rows = 0;
    Tensor pos_all;  // (B T) global positions of every token row
    Tensor pos;      // (rows) those of this rank's rows
  };
  Tokens tokens(int64_t B, int64_t T) const;

  // The first stage: this rank's token rows, embedded (rows, d).
  Tensor embed(const Tensor& inputs, const Tokens& tok) const;
  // Blocks [l0, l1) on this rank's token rows x (rows, d). routes gets each MoE layer's chosen
  // experts for these rows (its MoE index: the layer's place among the MoE layers).
  Tensor blocks(Tensor x, int64_t l0, int64_t l1, const Tokens& tok, std::vector<Route>* routes);
  // The last stage: the LM head split over the vocabulary, every token's logits of this
  // rank's columns, and the mean loss over the B T tokens (the same on every TP rank).
  Tensor head_loss(const Tensor& x, const Tensor& targets);
};

// PP: the model cut into S stages, stage s holding blocks [begin[s], begin[s+1]), the
// embedding on the first stage and the final norm, LM head and loss on the last. Lesson 07's
// executor (common/layers/pipeline.h) walks this rank's schedule and calls forward() for each
// F; what crosses a stage boundary is the residual stream of this rank's token rows of one
// micro-batch, (rows, d): under SP each TP rank sends its slice to the same TP rank of the
// next stage, under CP its zigzag chunks.
struct MeshStages : pp::StageModel {
  MeshModel* model = nullptr;
  std::vector<int64_t> begin;  // S + 1 layer indices
  int64_t M = 1, Bm = 1, T = 1;  // micro-batches, sequences in each, tokens of each (this rank)
  bool mb_sum = false;
  Tensor inputs, targets;        // this step's (M Bm, T) sequences of this rank
  std::vector<Route> routes;     // every MoE layer's routing of every micro-batch this step

  int stages() const { return (int)begin.size() - 1; }
  // micro-batch gm's Bm sequences of this rank's M Bm, and their targets
  Tensor inputs_of(int gm) const;
  Tensor targets_of(int gm) const;
  // a micro-batch's mean loss as its share of the step's: / M (the planted bug pp-mb-sum: whole)
  Tensor share_of_step(const Tensor& loss) const;
  // micro-batch gm through stage `stage`: lesson 07's executor calls it for each F
  Tensor forward(int stage, int gm, const Tensor& x) override;
  Shape boundary_shape(int, int) const override { return {model->tokens(Bm, T).rows, model->c.dim}; }

  // The loss of this rank's (B, T) sequences through the pipeline, forward only, as one batch
  // (validation): each stage receives the previous stage's output, computes, sends it on.
  // Returns the loss on the ranks of the last stage, 0 elsewhere.
  double forward_only(Comm& pipe, const pp::Schedule& s, const Tensor& in, const Tensor& tg);
  Device device() const override { return model->device; }
};

// What this rank holds of the model on the mesh: the model (its shards of its pipeline stages'
// weights, the TP, CP and EP groups it runs over), the EP group's topology and the step's
// routing maps, the pipeline schedule and the stages the executor runs, and the table of its
// weights by name. Built in place, once (the model points into it).
struct RankModel {
  RankModel(const Options& opts, const Setup& setup, Mesh& mesh, const model::Params& full, Device dev);
  RankModel(const RankModel&) = delete;
  RankModel& operator=(const RankModel&) = delete;

  MeshModel model;
  dsv3::Topology topo;                  // the EP group's nodes (the hierarchical all-to-all)
  std::vector<dsv3::RoutingMap> maps;   // this step's routing of every EP MoE layer
  pp::Schedule sched;
  StagePlan plan;
  MeshStages stages;
  ParamTable table;
  int64_t held_moe = 0;                 // the MoE layers of this rank's stages
  std::vector<float> load;              // the last step's expert loads, whole batch (the bias's)
  int pp_rank = 0;                      // this rank's place in the pipeline
  // this CP rank's tokens of every sequence (the zigzag layout's positions)
  const std::vector<int64_t>& my_columns() const { return model.cp_positions[(size_t)model.cp->rank()]; }
};

// The balancing bias (DeepSeek-V3's auxiliary-loss-free update, lesson 05): after each step,
// b_i += gamma * sign(mean load - load_i), the loads counted over the whole global batch.
// The loads of every MoE layer of the model ((L - D) N counts), from the routes this rank saw.
std::vector<float> expert_loads(const std::vector<Route>& routes, const model::Config& c);
// The balancing bias of every MoE layer this rank holds, from every layer's loads (load: N per
// MoE layer, summed over every rank that routed), by lesson 05's rule.
void update_biases(model::Params& weights, const std::vector<float>& load, int64_t N, double gamma);

}  // namespace ff::mesh
