// common/core/optim.cpp — AdamW (the update equations are in optim.h).
#include "common/core/optim.h"

#include <cmath>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"

namespace ff {

void Adam::step(const std::vector<Tensor*>& params, const std::vector<Tensor>& grads) {
  FF_CHECK(params.size() == grads.size(),
           "Adam::step: " << params.size() << " parameters but " << grads.size() << " gradients");
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor &p = *params[i], &g = grads[i];
    FF_CHECK(g.defined(), "Adam::step: parameter " << i << " has no gradient (pass zeros)");
    FF_CHECK(p.dtype() == DType::f32 && g.dtype() == DType::f32 && g.shape() == p.shape() &&
                 g.device() == p.device(),
             "Adam::step: parameter " << i << " " << shape_str(p.shape()) << " on "
                 << device_name(p.device()) << " has a gradient " << shape_str(g.shape()) << " on "
                 << device_name(g.device()) << " (both float32, same shape and device)");
  }
  if (m_.empty())
    for (const Tensor* p : params) {
      m_.push_back(Tensor::zeros(p->shape(), p->device()));
      v_.push_back(Tensor::zeros(p->shape(), p->device()));
    }
  FF_CHECK(params.size() == m_.size(), "Adam::step: " << params.size()
                                           << " parameters, but the optimizer holds state for "
                                           << m_.size());
  for (size_t i = 0; i < params.size(); i++)
    FF_CHECK(params[i]->shape() == m_[i].shape() && params[i]->device() == m_[i].device(),
             "Adam::step: parameter " << i << " is " << shape_str(params[i]->shape()) << " on "
                 << device_name(params[i]->device()) << ", the optimizer's state "
                 << shape_str(m_[i].shape()) << " on " << device_name(m_[i].device()));

  NoGradGuard no_grad;
  t_++;
  const AdamConfig& c = config_;
  const double bias1 = 1.0 - std::pow(c.beta1, (double)t_);
  const double bias2 = 1.0 - std::pow(c.beta2, (double)t_);
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor &p = *params[i], &g = grads[i];
    Tensor decayed = scale(p, (float)(1.0 - c.lr * c.weight_decay));
    m_[i] = scale(m_[i], (float)c.beta1) + scale(g, (float)(1.0 - c.beta1));
    v_[i] = scale(v_[i], (float)c.beta2) + scale(g * g, (float)(1.0 - c.beta2));
    Tensor mhat = scale(m_[i], (float)(1.0 / bias1));
    Tensor vhat = scale(v_[i], (float)(1.0 / bias2));
    Tensor update = scale(mhat / add_scalar(sqrt(vhat), (float)c.eps), (float)c.lr);
    p.copy_from(decayed - update);
  }
}

void Adam::restore(std::vector<Tensor> m, std::vector<Tensor> v, int64_t t) {
  FF_CHECK(m.size() == v.size() && t >= 0, "Adam::restore: " << m.size() << " m and " << v.size()
                                                                << " v tensors, step " << t);
  m_ = std::move(m), v_ = std::move(v), t_ = t;
}

size_t Adam::state_bytes() const {
  size_t b = 0;
  for (const std::vector<Tensor>* state : {&m_, &v_})
    for (const Tensor& t : *state)
      if (t.defined()) b += t.nbytes();
  return b;
}

}  // namespace ff
