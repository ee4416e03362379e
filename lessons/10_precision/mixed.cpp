// lessons/10_precision/mixed.cpp — see mixed.h.
#include "lessons/10_precision/mixed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff::precision {

void hold_in_bf16(model::Params& p) {
  for (Tensor* w : p.matmul_weights()) *w = w->detach().to_dtype(DType::bf16).requires_grad_();
}

double grad_ratio(const Tensor& got, const Tensor& want, bool bf16, double n_terms) {
  const std::vector<float> g = got.to_vector(), w = want.to_vector();
  double worst = 0, scale = 0;
  for (size_t i = 0; i < w.size(); i++)
    worst = std::max(worst, std::fabs((double)g[i] - w[i])), scale = std::max(scale, (double)std::fabs(w[i]));
  const double unit = bf16 ? kGradBound16 * std::ldexp(1.0, -8) : kLossBound * n_terms * std::numeric_limits<float>::epsilon();
  const double r = worst / (unit * std::max(scale, 1e-30));
  return std::isnan(r) ? INFINITY : r;
}

Twin::Twin(const model::Config& c, uint64_t seed, Device device, bool bf16, const AdamConfig& adam, bool root)
    : c_(c), device_(device), adam_(adam) {
  adam_.config().master_weights = true;  // the right way, whatever the ranks plant
  if (!root) return;
  p_ = model::init_params(c, seed, device);
  if (bf16) hold_in_bf16(p_);
}

double Twin::loss_and_grads(const CharCorpus::Batch& global) {
  std::vector<model::NamedTensor> named = p_.named_parameters();
  for (model::NamedTensor& n : named) n.t.zero_grad();
  const model::Output out = model::forward(c_, p_, global.inputs.to(device_), global.targets.to(device_),
                                           model::positions(c_.seq_len, device_));
  run_backward(out.loss, Tensor::full({}, 1.f, device_));
  return out.loss.item();
}

Tensor Twin::grad(size_t k) const {
  const model::NamedTensor n = p_.named_parameters()[k];
  return n.t.grad().defined() ? n.t.grad() : Tensor::zeros(n.t.shape(), n.t.device(), n.t.dtype());
}

std::string Twin::step(const std::vector<Tensor>& mesh_means, const std::vector<Tensor*>& mesh_params,
                       const std::vector<std::string>& names) {
  std::vector<model::NamedTensor> named = p_.named_parameters();
  std::vector<Tensor*> ps;
  std::vector<Tensor> gs;
  for (size_t k = 0; k < named.size(); k++) {
    ps.push_back(&named[k].t);
    gs.push_back(mesh_means[k].to(device_));
  }
  adam_.step(ps, gs);
  for (size_t k = 0; k < named.size(); k++) {
    const std::vector<float> a = named[k].t.to_vector(), b = mesh_params[k]->to_vector();
    if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) return names[k];
  }
  return "";
}

uint64_t params_hash(const std::vector<Tensor*>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const Tensor* p : params) {
    const std::vector<float> v = p->to_vector();
    const unsigned char* b = reinterpret_cast<const unsigned char*>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(float); i++) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

}  // namespace ff::precision
