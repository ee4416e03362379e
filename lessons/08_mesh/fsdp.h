// lessons/08_mesh/fsdp.h — ZeRO-3 (PyTorch's FSDP): the parameters sharded too, each unit (a layer)
// gathered just before its forward and its backward and freed after.
//
// Seed 001 §2.2, seed 004. ZeRO-1 and -2 (zero.h) shard what AdamW needs and the gradients; every
// rank still holds all the parameters, 4N bytes. ZeRO-3 keeps only its shard of those too:
//   memory per rank, float32:  parameters 4 ceil(N/dp) + the units in use, gradients 4 ceil(N/dp)
//   + the unit's in flight, m and v 8 ceil(N/dp): about 16N/dp, plus the largest unit or two.
// The model is cut into units (lesson 08: the embedding, each block, the final norm and head);
// each unit's weights are one flat buffer, padded to a multiple of dp, rank r holding block r:
//   forward  of unit u:  all-gather u's blocks into its weights; run u; free the weights.
//   backward of unit u:  all-gather again (an op at u's output whose backward does it, so it
//                        runs just before u's backward); run u's backward; when its last weight
//                        is done (their post_accumulate_grad hooks, common/core/tensor.h),
//                        reduce-scatter u's gradients into this rank's gradient shard (+=, one
//                        per micro-batch), free the full gradients and the weights.
//   step:                AdamW on the shards; nothing to gather after it (the next forward does).
// bf16 weights (lesson 10's mixed precision): the shard is their float32 MASTER, read from them
// once; a gather rounds the gathered masters to bf16 (the all-gather moves float32: a unit holds
// float32 norms beside its bf16 matmul weights), the bf16 gradients are widened and reduced in
// float32. Per rank: masters, m and v 12, gradients 4 bytes per parameter of the shard, 16N/dp.
// Per step and unit, over M micro-batches: 2M all-gathers of the unit (forward, backward) and M
// reduce-scatters, against ZeRO-1's one reduce-scatter and one all-gather of everything whatever
// M: 1.5 M times the traffic, for 1/dp of the parameters.
//
// "Freed" is real: the weights' Storage is released (Storage::release, PyTorch's resize_(0)), so
// every tensor that shares it, the autograd tape's captures included, sees it gone; reading it
// is an error, not a crash. A gather allocates it again.
//
// One Fsdp per model, over one or more groups of ranks (lesson 08: the dense weights over
// DP x CP, the experts over expert-DP): each group a ShardGroup, every weight in one unit of one
// group. A unit's groups are gathered, reduced and freed together, in the groups' order (their
// collectives then come in the same order on every rank).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "lessons/08_mesh/zero.h"

namespace ff::fsdp {

// The weights of one group of ranks that hold the same ones, cut into units, sharded.
class ShardGroup {
 public:
  ShardGroup(const Comm& group, AdamConfig config, int units);
  void add(Tensor* p, int unit);  // in the model's order, before shard()
  // Each rank keeps its block of every unit (the weights the same on every rank of the group)
  // and frees the weights.
  void shard();
  void gather(int unit);  // all-gather the unit's blocks into its weights (allocated again)
  void free(int unit);    // release the unit's weights
  // Reduce-scatter the unit's full gradients (a missing one counts as zeros) and add the result
  // into this rank's gradient shard; release the full gradients.
  void reduce(int unit);
  // For weights whose gradients need a sum over another group first (SP's replicated weights
  // over TP): the shards summed over `comm` (linear: summing the shards = sharding the sum).
  void sum_grad_shards(Comm& comm);
  // The mean (the shard divided by the group's size or divide_by's n), AdamW on the shard, the
  // gradient shard zeroed for the next step.
  void step();
  void divide_by(int n) { divisor_ = n; }
  bool empty(int unit) const { return units_[(size_t)unit].params.empty(); }
  int64_t numel() const;
  const std::vector<Tensor*>& params() const { return order_; }  // in add() order
  int unit_of(size_t i) const { return unit_of_[i]; }           // params()[i]'s unit
  // This rank's shards, run by run: fn(i, local, at, count) for `count` numbers of params()[i]
  // from its element `local` on, held at param_shard()[at] (and at the same place of AdamW's m
  // and v): a checkpoint maps them to the full tensors.
  void for_each_shard_run(const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) const;
  Tensor& param_shard() { return all_params_; }  // every unit's block of the weights, back to back
  int64_t shard_size() const { return all_params_.defined() ? all_params_.numel() : 0; }
  Adam& adam() { return adam_; }
  void zero_fill(int unit);  // the planted bug's "gather": the unit's weights allocated as zeros
  // The mean gradient of the last step, whole, per weight in add() order (gathered over check).
  std::vector<Tensor> mean_grads(Comm& check) const;
  zero::Memory memory() const;   // what the rank holds now (call it between steps)
  size_t unit_bytes(int unit) const;  // a unit's weights, gathered
  Comm& group() { return group_; }
  // planted bug: the backward's gather is skipped, the weights allocated again as zeros (the
  // freed memory read as if it still held them)
  bool stale_backward = false;

 private:
  struct Unit {
    std::vector<Tensor*> params;
    int64_t numel = 0, padded = 0;
  };
  Comm group_;
  Adam adam_;
  int divisor_ = 0;
  bool has_bf16_ = false;  // a bf16 weight among them: the shard holds float32 masters
  std::vector<Unit> units_;
  std::vector<Tensor*> order_;
  std::vector<int> unit_of_;  // order_'s units
  Tensor flat_;               // (largest padded): the gather's and the reduction's buffer
  // this rank's shards: every unit's block back to back, the parameters (what AdamW updates)
  // and the gradients (summed over the micro-batches); the last step's mean gradient
  Tensor all_params_, all_grads_, last_mean_;
};

// The gathers and frees around the model's units, and the hooks that end each unit's backward.
class Fsdp {
 public:
  Fsdp(std::vector<ShardGroup*> groups, int units);
  ~Fsdp();
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;

  // Shards every group and installs the hooks (once, before the first forward).
  void start();
  // Around unit u's forward: gathers it (unless in use already); after: frees it once nothing
  // else uses it and returns y through an op whose backward gathers the unit again.
  void before_forward(int unit);
  Tensor after_forward(int unit, const Tensor& y);
  // After the step's backward: any unit whose backward left a weight unreached is reduced and
  // freed now (none in lesson 08's model: every weight is read by its unit's every forward).
  void end_backward();
  // For the check: every unit gathered, and freed again.
  void gather_all();
  void free_all();
  // The most weight bytes gathered at once since start(), over every group (gather_all's not
  // counted).
  size_t peak_gathered_bytes() const { return peak_; }
  int64_t unit_gathers() const { return gathers_; }  // unit gathers so far (forward and backward)

 private:
  void use(int unit);
  void unuse(int unit);
  void weight_done(int unit);

  std::vector<ShardGroup*> groups_;
  std::vector<int> uses_;          // per unit: forwards running + backwards to come
  std::vector<int> weights_, done_;  // per unit: its weights, and those done in this backward
  std::vector<Tensor*> hooked_;
  size_t held_ = 0, peak_ = 0;
  int64_t gathers_ = 0;
};

}  // namespace ff::fsdp
