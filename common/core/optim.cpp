// common/core/optim.cpp — AdamW (the update equations are in optim.h).
#include "common/core/optim.h"

#include <cmath>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "kernels/kernels.h"

namespace ff {

void Adam::step(const std::vector<Tensor*>& params, const std::vector<Tensor>& grads) {
  FF_CHECK(params.size() == grads.size(),
           "Adam::step: " << params.size() << " parameters but " << grads.size() << " gradients");
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor &p = *params[i], &g = grads[i];
    FF_CHECK(g.defined(), "Adam::step: parameter " << i << " has no gradient (pass zeros)");
    FF_CHECK((p.dtype() == DType::f32 || p.dtype() == DType::bf16) &&
                 (g.dtype() == p.dtype() || (p.dtype() == DType::bf16 && g.dtype() == DType::f32)) &&
                 g.shape() == p.shape() && g.device() == p.device(),
             "Adam::step: parameter " << i << " " << shape_str(p.shape()) << " " << dtype_name(p.dtype()) << " on "
                 << device_name(p.device()) << " has a gradient " << shape_str(g.shape()) << " "
                 << dtype_name(g.dtype()) << " on " << device_name(g.device())
                 << " (float32 or bf16, the same, or float32 for a bf16 one; same shape and device)");
  }
  const DType moments = config_.bf16_moments ? DType::bf16 : DType::f32;
  if (m_.empty())
    for (const Tensor* p : params) {
      m_.push_back(Tensor::zeros(p->shape(), p->device(), moments));
      v_.push_back(Tensor::zeros(p->shape(), p->device(), moments));
    }
  if (master_.size() != params.size()) {  // the first step (or the first after restore())
    master_.clear();
    for (const Tensor* p : params) {
      // a bf16 parameter's float32 copy, exact
      master_.push_back(p->dtype() == DType::bf16 ? p->to_dtype(DType::f32) : Tensor());
    }
  }
  FF_CHECK(params.size() == m_.size(), "Adam::step: " << params.size()
                                           << " parameters, but the optimizer holds state for "
                                           << m_.size());
  for (size_t i = 0; i < params.size(); i++)
    FF_CHECK(params[i]->shape() == m_[i].shape() && params[i]->device() == m_[i].device() &&
                 m_[i].dtype() == moments && v_[i].dtype() == moments,
             "Adam::step: parameter " << i << " is " << shape_str(params[i]->shape()) << " on "
                 << device_name(params[i]->device()) << ", the optimizer's state "
                 << shape_str(m_[i].shape()) << " " << dtype_name(m_[i].dtype()) << " on "
                 << device_name(m_[i].device()) << " (moments in " << dtype_name(moments) << ")");

  t_++;
  const AdamConfig& c = config_;
  const double bias1 = 1.0 - std::pow(c.beta1, (double)t_);
  const double bias2 = 1.0 - std::pow(c.beta2, (double)t_);
  // The step, as tensor ops it would be (each rounded to float, in this order):
  //   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g g
  //   p = p (1 - lr wd) - lr (m / bias1) / (sqrt(v / bias2) + eps)
  // run as one kernel pass per parameter (KernelTable::adamw), m and v updated in place.
  const AdamWStep step{(float)(1.0 - c.lr * c.weight_decay), (float)c.beta1, (float)(1.0 - c.beta1),
                       (float)c.beta2, (float)(1.0 - c.beta2), (float)(1.0 / bias1),
                       (float)(1.0 / bias2), (float)c.eps, (float)c.lr};
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor &p = *params[i], &g = grads[i];
    const KernelTable& k = kernels_for(p.device());
    // bf16 moments: widened for the step, rounded back after it
    const bool narrow = config_.bf16_moments;
    const Tensor m = narrow ? m_[i].to_dtype(DType::f32) : m_[i], v = narrow ? v_[i].to_dtype(DType::f32) : v_[i];
    if (p.dtype() == DType::f32) {
      k.adamw(p.data(), m.data(), v.data(), g.data(), p.numel(), step);
    } else {
      // bf16: the step on the float32 master (or, without one, on the bf16 value widened), then
      // rounded into the parameter
      const Tensor g32 = g.dtype() == DType::f32 ? g : g.to_dtype(DType::f32);
      const Tensor w = config_.master_weights ? master_[i] : p.to_dtype(DType::f32);
      k.adamw(w.data(), m.data(), v.data(), g32.data(), p.numel(), step);
      k.to_bf16(p.bf16_data(), w.data(), p.numel());
    }
    if (narrow) {
      k.to_bf16(m_[i].bf16_data(), m.data(), p.numel());
      k.to_bf16(v_[i].bf16_data(), v.data(), p.numel());
    }
  }
}

void Adam::restore(std::vector<Tensor> m, std::vector<Tensor> v, int64_t t, std::vector<Tensor> masters) {
  FF_CHECK(m.size() == v.size() && t >= 0, "Adam::restore: " << m.size() << " m and " << v.size()
                                                                << " v tensors, step " << t);
  // copies: the steps update m and v in place, and the caller's tensors stay its own
  m_.clear(), v_.clear();
  for (size_t i = 0; i < m.size(); i++) m_.push_back(m[i].clone()), v_.push_back(v[i].clone());
  FF_CHECK(masters.empty() || masters.size() == m.size(), "Adam::restore: " << masters.size() << " masters for "
                                                                             << m.size() << " parameters");
  master_.clear();  // (none: made from the parameters at the next step)
  for (const Tensor& w : masters) master_.push_back(!w.defined() ? Tensor() : w.dtype() == DType::f32 ? w.clone() : w.to_dtype(DType::f32));
  t_ = t;
}

size_t Adam::master_bytes() const {
  size_t b = 0;
  for (const Tensor& t : master_)
    if (t.defined()) b += t.nbytes();
  return b;
}

size_t Adam::state_bytes() const {
  size_t b = 0;
  for (const std::vector<Tensor>* state : {&m_, &v_})
    for (const Tensor& t : *state)
      if (t.defined()) b += t.nbytes();
  return b;
}

}  // namespace ff
