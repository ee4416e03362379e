// lessons/10_precision/mixed.h — mixed-precision training, data parallel: lesson 08's model
// (common/layers/model.h) with its matmul weights held in bf16, trained by lesson 08's ZeRO
// (lessons/08_mesh/zero.h: the float32 master weights and AdamW's m and v sharded over the
// ranks), and the one process rank 0 checks it against.
//
// Megatron-LM's layout, not autocast: the weights the activations are multiplied by are bf16
// tensors (2 bytes), their gradients bf16 (2 bytes); the optimizer holds a float32 master of each
// (4 bytes) beside m and v (4 + 4), the 16 bytes of seed 001. The embedding (a lookup), the
// norms' weights and the router stay float32, as DeepSeek-V3 keeps them; the formula counts
// them apart (zero.h's mixed_formula).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "common/lesson/corpus.h"
#include "lessons/08_mesh/zero.h"

namespace ff::precision {


constexpr double kLossBound = 4.0;  // lesson 08's K n eps rule (reference_check.h), float32

// Rank 0's one process: the same model from the same seed, in the same precision, with its own
// AdamW keeping float32 masters (the right way, whatever the ranks plant).
//   float32 runs: the loss and gradients of the whole global batch in one piece (lesson 08's
//     check: the mean over the ranks' shares differs from it by float32 sums' orders).
//   bf16 runs: each rank's share computed as that rank computes it, their gradients summed in rank
//     order and divided. In bf16 a gradient is rounded where it is made, so the whole batch's
//     differs from the mean of the shares' by a bf16 rounding of each (and an activation may
//     round the other way): not a bound to check a sum against. What data parallelism must get
//     right, the reduction and the mean, is held to the sums' orders.
//   fp8 runs (float32 weights, FP8 GEMMs in the linear layers): as bf16 runs, share by share.
//     Wgrad quantizes x^T in 1 x t tiles along the tokens, so a share's tiles are not the whole
//     batch's: its scales, and so its rounding, differ.
class Twin {
 public:
  Twin(const model::Config& c, uint64_t seed, Device device, bool bf16, const AdamConfig& adam, bool root);
  // The mean loss of the global batch given as its shares (one: in one piece) and the mean of
  // their gradients (bf16_sums: summed as --grad-reduce bf16 sums, each partial sum rounded).
  double loss_and_grads(const std::vector<CharCorpus::Batch>& shares, bool bf16_sums);
  Tensor grad(size_t k) const;  // weight k's mean gradient (float32)
  // The ranks' mean gradient of weight k against grad(k): the worst element over its bound (above
  // and in mixed.cpp); 1 fails, a NaN is infinite.
  double grad_ratio(size_t k, const Tensor& got, double n_terms) const;
  // AdamW on the mesh's mean gradients; returns the first weight whose bits then differ from
  // the mesh's, "" if none.
  std::string step(const std::vector<Tensor>& mesh_means, const std::vector<Tensor*>& mesh_params,
                   const std::vector<std::string>& names);

 private:
  model::Config c_;
  Device device_;
  model::Params p_;
  Adam adam_;
  std::vector<std::vector<float>> sum_, abs_sum_;  // per weight: the mean gradient, sum_r |g_r|
  int shares_ = 1;
  bool bf16_sums_ = false;
};

// The bits of every parameter, hashed (FNV-1a): equal on every rank when the replicas agree.
uint64_t params_hash(const std::vector<Tensor*>& params);

}  // namespace ff::precision
