// lessons/10_precision/mixed.cpp — see mixed.h.
#include "lessons/10_precision/mixed.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "kernels/bf16.h"

namespace ff::precision {


Twin::Twin(const model::Config& c, uint64_t seed, Device device, bool bf16, const AdamConfig& adam, bool root)
    : c_(c), device_(device), adam_(adam) {
  adam_.config().master_weights = true;  // the right way, whatever the ranks plant
  if (!root) return;
  p_ = model::init_params(c, seed, device);
  if (bf16) p_.hold_matmuls_in_bf16();
}

double Twin::loss_and_grads(const std::vector<CharCorpus::Batch>& batches, bool bf16_sums) {
  std::vector<model::NamedTensor> named = p_.named_parameters();
  const int shares = (int)batches.size();
  sum_.assign(named.size(), {}), abs_sum_.assign(named.size(), {});
  double loss = 0;
  for (int s = 0; s < shares; s++) {  // each share as its rank computes it, then their sum in rank order
    for (model::NamedTensor& n : named) n.t.zero_grad();
    const CharCorpus::Batch& b = batches[(size_t)s];
    const model::Output out = model::forward(c_, p_, b.inputs.to(device_), b.targets.to(device_),
                                             model::positions(c_.seq_len, device_));
    run_backward(out.loss, Tensor::full({}, 1.f, device_));
    loss += out.loss.item();
    for (size_t k = 0; k < named.size(); k++) {
      const Tensor g = named[k].t.grad();
      const std::vector<float> v = g.defined() ? g.to_vector() : std::vector<float>((size_t)named[k].t.numel(), 0.f);
      if (s == 0) sum_[k].assign(v.size(), 0.f), abs_sum_[k].assign(v.size(), 0.f);
      for (size_t i = 0; i < v.size(); i++) {
        // --grad-reduce bf16: each term rounded to bf16 (a float32 weight's gradient is; a bf16
        // one's already is) and every partial sum, as the buckets and Comm's bf16 sum round them
        const float term = bf16_sums ? bf16_to_float(float_to_bf16(v[i])) : v[i];
        sum_[k][i] = s == 0 ? term : sum_[k][i] + term;
        if (bf16_sums && s > 0) sum_[k][i] = bf16_to_float(float_to_bf16(sum_[k][i]));
        abs_sum_[k][i] += std::fabs(term);
      }
    }
  }
  for (std::vector<float>& g : sum_)
    for (float& x : g) x /= (float)shares;  // as zero.cpp divides
  shares_ = shares, bf16_sums_ = bf16_sums;
  return loss / shares;
}

Tensor Twin::grad(size_t k) const { return Tensor::from_vector(sum_[k], p_.named_parameters()[k].t.shape()); }

double Twin::grad_ratio(size_t k, const Tensor& got, double n_terms) const {
  // One share (float32 runs: the whole batch in one piece, lesson 08's check): 4 n eps max|want|.
  // Shares (bf16 runs): the ranks sum the same shares' gradients in another order (MPI's). Each
  // order's sum is within (shares - 1) u sum_r |g_r| of the exact one (every addition rounds by
  // at most u of a partial sum, itself at most sum_r |g_r|), so the two within twice that, and
  // the means within that over shares; u = 2^-24 (float32 sums) or 2^-8 (bf16's), 1.01 for
  // gamma_n. Bit for bit at 2 ranks (one addition, and a + b = b + a).
  const std::vector<float> g = got.to_vector();
  const std::vector<float>& want = sum_[k];
  double worst = 0;
  if (shares_ == 1) {
    double scale = 0, diff = 0;
    for (size_t i = 0; i < want.size(); i++) {
      const double d = std::fabs((double)g[i] - want[i]);
      if (!(d <= diff)) diff = d;  // (a NaN stays)
      scale = std::max(scale, (double)std::fabs(want[i]));
    }
    worst = diff / (kLossBound * n_terms * std::numeric_limits<float>::epsilon() * std::max(scale, 1e-30));
  } else {
    const double u = bf16_sums_ ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
    for (size_t i = 0; i < want.size(); i++) {
      const double d = std::fabs((double)g[i] - want[i]);
      const double r = d == 0 ? 0 : d / (2.02 * (shares_ - 1) * u * abs_sum_[k][i] / shares_);
      if (!(r <= worst)) worst = r;  // (a NaN stays)
    }
  }
  return std::isnan(worst) ? INFINITY : worst;
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
  for (size_t k = 0; k < named.size(); k++)
    if (!bitwise_equal(named[k].t, *mesh_params[k])) return names[k];
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
