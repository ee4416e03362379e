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

// The model's matmul weights (model::Params::matmul_weights) rounded to bf16, leaves again.
void hold_in_bf16(model::Params& p);


// The tolerance a bf16 run's mean gradient is held to against one process's, per tensor:
// kGradBound16 2^-8 max|want|. Both sides round the gradient to bf16 (2^-8 of it each: the
// mesh every rank's share, one process the whole), and an activation's bf16 rounding may fall
// the other way when its float32 value differs in the last bit (the sums' orders, dp 3's
// scaling): a factor 2 for those. A float32 run keeps lesson 08's 4 n eps max|want|.
constexpr double kGradBound16 = 4.0;
constexpr double kLossBound = 4.0;  // lesson 08's K n eps rule (reference_check.h), float32
double grad_ratio(const Tensor& got, const Tensor& want, bool bf16, double n_terms);

// Rank 0's one process: the same model from the same seed, in the same precision, with its own
// AdamW keeping float32 masters (the right way, whatever the ranks plant).
class Twin {
 public:
  Twin(const model::Config& c, uint64_t seed, Device device, bool bf16, const AdamConfig& adam, bool root);
  // The loss of the whole global batch from its weights (the mesh's, while they agree), and
  // every weight's gradient (grad(k)).
  double loss_and_grads(const CharCorpus::Batch& global);
  Tensor grad(size_t k) const;
  // AdamW on the mesh's mean gradients; returns the first weight whose bits then differ from
  // the mesh's, "" if none.
  std::string step(const std::vector<Tensor>& mesh_means, const std::vector<Tensor*>& mesh_params,
                   const std::vector<std::string>& names);

 private:
  model::Config c_;
  Device device_;
  model::Params p_;
  Adam adam_;
};

// The bits of every parameter, hashed (FNV-1a): equal on every rank when the replicas agree.
uint64_t params_hash(const std::vector<Tensor*>& params);

}  // namespace ff::precision
