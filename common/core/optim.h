// common/core/optim.h — AdamW, the optimizer the lessons train with.
//
// torch.optim.AdamW's update, for parameter p with gradient g at step t = 1, 2, ...:
//
//   p    <- p - lr * weight_decay * p               decoupled weight decay, applied first
//   m    <- beta1 * m + (1 - beta1) * g             first moment
//   v    <- beta2 * v + (1 - beta2) * g * g         second moment
//   mhat =  m / (1 - beta1^t)                       bias corrections (m, v start at 0)
//   vhat =  v / (1 - beta2^t)
//   p    <- p - lr * mhat / (sqrt(vhat) + eps)
//
// It runs in float32 with the core's ops under a NoGradGuard, so it works on every device;
// m and v live on the parameter's device. The new value is written into the parameter's
// storage (Tensor::copy_from), so every Tensor sharing it sees the step.
//
// Mixed precision (lesson 10): a bf16 parameter, with its bf16 gradient, is stepped through a
// float32 MASTER copy the optimizer keeps (made from the parameter at the first step): the
// gradient widened, the step applied to the master, the parameter then the master rounded to
// bf16. An update smaller than half a bf16 step of the weight (2^-9 of it) survives in the
// master and adds up; applied to the bf16 value itself (master_weights = false, lesson 10's
// planted bug) it is rounded away every time and the weight never moves.
//
// bf16 moments (bf16_moments, DeepSeek-V3's choice, technical report section 3.3.3): m and v
// are kept as bf16 tensors, 2 bytes each instead of 4; each step widens them, runs the same
// float32 update and rounds them back (round to nearest even).
#pragma once
#include <cstdint>
#include <vector>

#include "common/core/tensor.h"

namespace ff {

struct AdamConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool master_weights = true;  // bf16 parameters: step a float32 master copy (see above)
  bool bf16_moments = false;   // m and v kept in bf16 (see above)
};

class Adam {
 public:
  explicit Adam(AdamConfig config = {}) : config_(config) {}

  // One step for every parameter, grads[i] being the gradient of *params[i] (same shape and
  // device; a parameter that got no gradient needs zeros; a bf16 parameter's may be bf16 or,
  // reduced in float32 over data-parallel ranks, float32). The first call fixes the list:
  // later calls pass as many parameters, with the same shapes and devices, in the same order.
  void step(const std::vector<Tensor*>& params, const std::vector<Tensor>& grads);

  int64_t steps() const { return t_; }
  // The state, for a checkpoint: m and v per parameter (none before the first step).
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  // A resumed run's state, before its first step: m[i] and v[i] shaped like the i-th
  // parameter that step will pass (bf16 with bf16_moments, else float32: the step says which
  // it holds otherwise), t the steps already taken. (A bf16 parameter's master is made from
  // the parameter at that step, unless `masters` gives them: per parameter the float32 master of
  // a bf16 one, undefined for a float32 one, as a checkpoint kept them.)
  void restore(std::vector<Tensor> m, std::vector<Tensor> v, int64_t t, std::vector<Tensor> masters = {});
  // Bytes of the m and v tensors this optimizer holds (allocated at the first step).
  size_t state_bytes() const;
  // Bytes of the float32 master copies of bf16 parameters (none for float32 ones).
  size_t master_bytes() const;
  // The master copy of parameter i (undefined for a float32 parameter, or before the first step).
  const Tensor& master(size_t i) const { return master_[i]; }
  bool has_master(size_t i) const { return i < master_.size() && master_[i].defined(); }
  AdamConfig& config() { return config_; }  // e.g. to follow a learning-rate schedule
  const AdamConfig& config() const { return config_; }

 private:
  AdamConfig config_;
  int64_t t_ = 0;
  std::vector<Tensor> m_, v_;  // one of each per parameter
  std::vector<Tensor> master_;  // per parameter: the float32 master of a bf16 one, else undefined
};

}  // namespace ff
