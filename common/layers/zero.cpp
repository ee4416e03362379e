// common/layers/zero.cpp — data-parallel AdamW, ZeRO-0 and ZeRO-1 (the scheme is in zero.h).
#include "common/layers/zero.h"

#include <algorithm>
#include <cstring>

#include "common/core/check.h"
#include "kernels/device.h"

namespace ff::zero {

// ---- the formulas (zero.h's table; seed 001 §2.2)

Memory formula(int64_t n, int dp, int stage) {
  FF_CHECK(n >= 0 && dp >= 1 && (stage == 0 || stage == 1),
           "zero::formula: needs n >= 0, dp >= 1 and stage 0 or 1, got n " << n << ", dp " << dp
                                                                          << ", stage " << stage);
  const size_t N = (size_t)n, shard = (N + (size_t)dp - 1) / (size_t)dp;
  Memory m;
  m.params = 4 * N;
  m.grads = 4 * N;
  m.optimizer = 8 * (stage == 0 ? N : shard);
  return m;
}

double mixed_precision_bytes(int64_t n, int dp, int stage) {
  FF_CHECK(n >= 0 && dp >= 1 && stage >= 0 && stage <= 3,
           "zero::mixed_precision_bytes: needs n >= 0, dp >= 1 and stage 0..3");
  const double N = (double)n, W = (double)dp;
  switch (stage) {
    case 0: return 16 * N;
    case 1: return 4 * N + 12 * N / W;
    case 2: return 2 * N + 14 * N / W;
    default: return 16 * N / W;
  }
}

// ---- helpers shared by both stages

namespace {

// Checks the parameters and returns N, their total number of elements.
int64_t total_numel(const std::vector<Tensor*>& params, const char* who) {
  int64_t n = 0;
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor& p = *params[i];
    FF_CHECK(p.defined() && p.dtype() == DType::f32,
             who << ": parameter " << i << " must be a float32 tensor");
    const Tensor g = p.grad();
    FF_CHECK(!g.defined() || (g.dtype() == DType::f32 && g.device() == p.device() &&
                              g.shape() == p.shape()),
             who << ": parameter " << i << " " << shape_str(p.shape())
                 << " has a gradient that is not a float32 tensor of its shape and device");
    n += p.numel();
  }
  return n;
}

// dst (N) <- every parameter's gradient back to back, in the list's order; zeros where a
// parameter has none (this rank's batch did not reach it, another rank's may have).
void flatten_grads(const std::vector<Tensor*>& params, float* dst) {
  for (const Tensor* p : params) {
    const Tensor g = p->grad();
    const size_t n = (size_t)p->numel();
    if (g.defined())
      device_memcpy(dst, Device::cpu, g.raw(), g.device(), n * sizeof(float));
    else
      std::fill(dst, dst + n, 0.f);
    dst += n;
  }
}

// dst (N) <- the parameters' values back to back; and the way back.
void flatten_params(const std::vector<Tensor*>& params, float* dst) {
  for (const Tensor* p : params) {
    device_memcpy(dst, Device::cpu, p->raw(), p->device(), (size_t)p->numel() * sizeof(float));
    dst += p->numel();
  }
}
void unflatten_params(const float* src, const std::vector<Tensor*>& params) {
  for (const Tensor* p : params) {
    device_memcpy(p->raw(), p->device(), src, Device::cpu, (size_t)p->numel() * sizeof(float));
    src += p->numel();
  }
}

// The mean from the sum. Both stages divide the same way (x / dp, not x * (1/dp), which
// rounds differently for dp = 3), so equal sums give bitwise-equal means.
void divide(float* x, int64_t n, int dp) {
  for (int64_t i = 0; i < n; i++) x[i] /= (float)dp;
}

size_t storage_bytes(const Tensor& t) { return t.defined() ? t.impl()->storage->bytes : 0; }

// Parameters and gradients as allocated (storage bytes, not shapes times four).
void count_params_and_grads(const std::vector<Tensor*>& params, Memory* m) {
  for (const Tensor* p : params) {
    m->params += storage_bytes(*p);
    m->grads += storage_bytes(p->grad());
  }
}

}  // namespace

// ---- ZeRO-0: plain data parallelism

DataParallelAdam::DataParallelAdam(const Comm& dp, AdamConfig config) : dp_(dp), adam_(config) {}

void DataParallelAdam::step(const std::vector<Tensor*>& params) {
  const int64_t n = total_numel(params, "DataParallelAdam::step");
  if (!flat_.defined()) flat_ = Tensor::zeros({n});
  FF_CHECK(flat_.numel() == n, "DataParallelAdam::step: " << n << " numbers, but the first step had "
                                                          << flat_.numel());
  // A parameter without a gradient gets one: the mean is written into it below.
  for (Tensor* p : params)
    if (!p->grad().defined()) p->impl()->grad = Tensor::zeros(p->shape(), p->device()).impl_ptr();

  // One all-reduce for all of them: one message per step instead of one per tensor.
  flatten_grads(params, flat_.data());
  if (dp_.size() > 1) dp_.allreduce_sum(flat_.data(), (size_t)n);  // a group of one: nothing to sum
  divide(flat_.data(), n, divisor_ > 0 ? divisor_ : dp_.size());

  // Every .grad() <- its mean; then every rank runs the same AdamW on the same numbers.
  std::vector<Tensor> grads;
  const float* src = flat_.data();
  for (Tensor* p : params) {
    Tensor g = p->grad();
    device_memcpy(g.raw(), g.device(), src, Device::cpu, (size_t)g.numel() * sizeof(float));
    src += g.numel();
    grads.push_back(g);
  }
  adam_.step(params, grads);
}

Memory DataParallelAdam::memory(const std::vector<Tensor*>& params) const {
  Memory m;
  count_params_and_grads(params, &m);
  m.optimizer = adam_.state_bytes();  // m and v, each shaped like its parameter
  m.buffers = storage_bytes(flat_);
  return m;
}

// ---- ZeRO-1: optimizer state sharded over the DP group

Zero1Adam::Zero1Adam(const Comm& dp, AdamConfig config, Bug bug)
    : dp_(dp), adam_(config), bug_(bug) {}

void Zero1Adam::step(const std::vector<Tensor*>& params) {
  const int64_t n = total_numel(params, "Zero1Adam::step");
  const int dp = dp_.size();
  if (n_ < 0) {
    // The layout: pad N up to a multiple of dp so that every rank owns an equal block
    // (MPI's reduce-scatter and all-gather with equal counts); the padding stays zero.
    FF_CHECK(n > 0, "Zero1Adam::step: no parameters");
    n_ = n;
    shard_ = (n + dp - 1) / dp;
    flat_ = Tensor::zeros({shard_ * dp});
    grad_shard_ = Tensor::zeros({shard_});
    param_shard_ = Tensor::zeros({shard_});
  }
  FF_CHECK(n == n_, "Zero1Adam::step: " << n << " numbers, but the first step had " << n_);
  float* flat = flat_.data();
  float* mine = flat + shard_begin();  // this rank's block of the flat buffer

  // 1. reduce-scatter: this rank gets block r of the sum of every rank's gradients.
  flatten_grads(params, flat);
  std::fill(flat + n_, flat + shard_ * dp, 0.f);
  if (dp > 1)
    dp_.reduce_scatter_sum(flat, grad_shard_.data(), std::vector<int>(dp, (int)shard_));
  else  // a group of one: its block is the whole buffer
    std::memcpy(grad_shard_.data(), flat, (size_t)shard_ * sizeof(float));
  if (bug_ != Bug::no_divide) divide(grad_shard_.data(), shard_, divisor_ > 0 ? divisor_ : dp);

  // 2. AdamW on block r only. The flat buffer's gradients are spent: it now holds the
  //    parameters (identical on every rank), and block r of them is what this rank updates.
  //    Adam's m and v take param_shard_'s shape: ceil(N/dp) numbers each.
  flatten_params(params, flat);
  std::fill(flat + n_, flat + shard_ * dp, 0.f);
  std::memcpy(param_shard_.data(), mine, (size_t)shard_ * sizeof(float));
  adam_.step({&param_shard_}, {grad_shard_});
  if (bug_ != Bug::stale_shard)
    std::memcpy(mine, param_shard_.data(), (size_t)shard_ * sizeof(float));

  // 3. all-gather: every rank contributes its updated block (already in place in flat) and
  //    receives the others'; then the full parameters are copied back into the model.
  if (dp > 1) dp_.allgather(mine, (size_t)shard_ * sizeof(float), flat);
  unflatten_params(flat, params);
}

Memory Zero1Adam::memory(const std::vector<Tensor*>& params) const {
  Memory m;
  count_params_and_grads(params, &m);
  m.optimizer = adam_.state_bytes();  // m and v shaped like the one tensor it is given, the shard
  m.buffers = storage_bytes(flat_) + storage_bytes(grad_shard_) + storage_bytes(param_shard_);
  return m;
}

GroupAdam::GroupAdam(const Comm& group, const AdamConfig& config, int zero_stage, Bug bug) {
  if (zero_stage == 0)
    z0_ = std::make_unique<DataParallelAdam>(group, config);
  else
    z1_ = std::make_unique<Zero1Adam>(group, config, bug);
}

void GroupAdam::step() {
  if (params.empty()) return;
  z0_ ? z0_->step(params) : z1_->step(params);
}

std::vector<Tensor> GroupAdam::mean_grads(Comm& check) const {
  std::vector<Tensor> out;
  if (z0_ || params.empty()) {
    for (Tensor* p : params) out.push_back(p->grad());
    return out;
  }
  std::vector<float> flat((size_t)(z1_->shard_size() * check.size()));
  check.allgather(z1_->grad_shard().to_vector().data(), (size_t)z1_->shard_size() * sizeof(float),
                  flat.data());
  size_t at = 0;
  for (Tensor* p : params) {
    const size_t n = (size_t)p->numel();
    out.push_back(Tensor::from_vector(std::vector<float>(flat.begin() + (long)at,
                                                         flat.begin() + (long)(at + n)),
                                      p->shape()));
    at += n;
  }
  return out;
}

void sum_grads(const std::vector<Tensor*>& params, Comm& comm) {
  for (Tensor* p : params)
    if (!p->grad().defined()) p->impl()->grad = Tensor::zeros(p->shape(), p->device()).impl_ptr();
  std::vector<float> flat((size_t)total_numel(params, "sum_grads"));
  flatten_grads(params, flat.data());
  comm.allreduce_sum(flat.data(), flat.size());
  const float* src = flat.data();
  for (Tensor* p : params) {
    device_memcpy(p->grad().raw(), p->device(), src, Device::cpu, (size_t)p->numel() * sizeof(float));
    src += p->numel();
  }
}

}  // namespace ff::zero
