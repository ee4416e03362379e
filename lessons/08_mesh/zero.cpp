// lessons/08_mesh/zero.cpp — data-parallel AdamW, ZeRO-0, -1 and -2
// (the scheme is in zero.h).
#include "lessons/08_mesh/zero.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/core/check.h"
#include "lessons/08_mesh/fsdp.h"
#include "kernels/device.h"

namespace ff::zero {

// ---- the formulas (zero.h's table; seed 001 §2.2)

Memory formula(int64_t n, int dp, int stage) {
  FF_CHECK(n >= 0 && dp >= 1 && stage >= 0 && stage <= 3,
           "zero::formula: needs n >= 0, dp >= 1 and stage 0..3, got n " << n << ", dp " << dp
                                                                        << ", stage " << stage);
  const size_t N = (size_t)n, shard = (N + (size_t)dp - 1) / (size_t)dp;
  Memory m;
  m.params = 4 * (stage == 3 ? shard : N);
  m.grads = 4 * (stage >= 2 ? shard : N);
  m.optimizer = 8 * (stage == 0 ? N : shard);
  return m;
}

Memory formula(const std::vector<int64_t>& buckets, int dp, int stage) {
  Memory m;
  for (int64_t n : buckets) {
    const Memory b = formula(n, dp, stage);
    m.params += b.params, m.grads += b.grads, m.optimizer += b.optimizer;
  }
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

Memory mixed_formula(int64_t n16, int64_t n32, int dp, int stage, int moment_bytes) {
  return mixed_formula(n16, n32, std::vector<int64_t>{n16 + n32}, dp, stage, moment_bytes);
}

Memory mixed_formula(int64_t n16, int64_t n32, const std::vector<int64_t>& buckets, int dp, int stage, int moment_bytes) {
  FF_CHECK(n16 >= 0 && n32 >= 0 && dp >= 1 && stage >= 0 && stage <= 2 && (moment_bytes == 4 || moment_bytes == 2),
           "zero::mixed_formula: needs n16, n32 >= 0, dp >= 1, stage 0..2 and moments of 4 or 2 bytes, got "
               << n16 << ", " << n32 << ", " << dp << ", " << stage << ", " << moment_bytes);
  const size_t N = (size_t)(n16 + n32);
  size_t shard = 0, counted = 0;  // the sum over the buckets of ceil(N_b/dp)
  for (int64_t nb : buckets) shard += ((size_t)nb + (size_t)dp - 1) / (size_t)dp, counted += (size_t)nb;
  FF_CHECK(counted == N, "zero::mixed_formula: buckets of " << counted << " parameters for " << N);
  const size_t held = 2 * (size_t)n16 + 4 * (size_t)n32;
  Memory m;
  m.params = held;
  m.grads = stage >= 2 ? 4 * shard : held;
  const size_t mv = 2 * (size_t)moment_bytes;  // m and v
  if (n16 == 0) m.optimizer = mv * (stage == 0 ? N : shard);  // float32 training: m and v
  else m.optimizer = stage == 0 ? (4 + mv) * (size_t)n16 + mv * (size_t)n32 : (4 + mv) * shard;
  return m;
}

Memory mixed_formula_units(const std::vector<int64_t>& units, int dp, int moment_bytes) {
  FF_CHECK(dp >= 1 && (moment_bytes == 4 || moment_bytes == 2),
           "zero::mixed_formula_units: needs dp >= 1 and moments of 4 or 2 bytes");
  Memory m;
  for (int64_t n : units) {
    FF_CHECK(n >= 0, "zero::mixed_formula_units: a unit of " << n << " parameters");
    const size_t shard = ((size_t)n + (size_t)dp - 1) / (size_t)dp;
    m.grads += 4 * shard;
    m.optimizer += (4 + 2 * (size_t)moment_bytes) * shard;
  }
  return m;
}

// ---- helpers

namespace {

// The mean from the sum. Every stage divides the same way (x / dp, not x * (1/dp), which
// rounds differently for dp = 3), so equal sums give bitwise-equal means.
void divide(float* x, int64_t n, int dp) {
  for (int64_t i = 0; i < n; i++) x[i] /= (float)dp;
}

// Parameters and gradients as allocated (storage bytes, not shapes times four).
void count_params_and_grads(const std::vector<Tensor*>& params, Memory* m) {
  for (const Tensor* p : params) {
    m->params += storage_bytes(*p);
    m->grads += storage_bytes(p->grad());
  }
}

}  // namespace

// ---- ZeRO-0: plain data parallelism

DataParallelAdam::DataParallelAdam(const Comm& dp, AdamConfig config, size_t bucket_bytes)
    : adam_(config), buckets_(dp, bucket_bytes, /*scatter=*/false, /*free_grads=*/false) {}

void DataParallelAdam::step(const std::vector<Tensor*>& params) {
  buckets_.layout(params);
  // 1. every bucket's all-reduce (those the backward did not post already), then wait
  buckets_.flush();
  buckets_.wait();
  if (sum_over_ && sum_over_->size() > 1) sum_over_->allreduce_sum(buckets_.flat().data(), (size_t)buckets_.flat_size());
  // 2. every .grad() <- its mean (a parameter without one gets one); the same AdamW everywhere.
  //    A bf16 parameter's mean stays float32 (means_), AdamW's master takes it unrounded
  const int dp = divisor_ > 0 ? divisor_ : buckets_.group().size();
  if (means_.empty())
    for (Tensor* p : params)
      means_.push_back(p->dtype() == DType::bf16 ? Tensor::zeros(p->shape(), p->device()) : Tensor());
  std::vector<Tensor> grads;
  for (const GradBuckets::Bucket& b : buckets_.buckets()) {
    float* src = buckets_.flat().data() + b.offset;
    divide(src, b.numel, dp);
    for (size_t i = b.first; i < b.last; i++) {
      Tensor* p = params[i];
      if (!means_[i].defined() && !p->grad().defined()) p->impl()->grad = Tensor::zeros(p->shape(), p->device()).impl_ptr();
      const Tensor dst = means_[i].defined() ? means_[i] : p->grad();
      device_memcpy(dst.raw(), p->device(), src, Device::cpu, (size_t)p->numel() * sizeof(float));
      src += p->numel();
    }
  }
  for (size_t i = 0; i < params.size(); i++) grads.push_back(means_[i].defined() ? means_[i] : params[i]->grad());
  adam_.step(params, grads);
}

std::vector<Tensor> DataParallelAdam::mean_grads(const std::vector<Tensor*>& params) const {
  std::vector<Tensor> out;
  for (size_t i = 0; i < params.size(); i++)
    out.push_back(i < means_.size() && means_[i].defined() ? means_[i] : params[i]->grad());
  return out;
}

Memory DataParallelAdam::memory(const std::vector<Tensor*>& params) const {
  Memory m;
  count_params_and_grads(params, &m);
  m.optimizer = adam_.state_bytes() + adam_.master_bytes();  // m and v, and bf16 weights' masters
  m.buffers = buckets_.bytes_held();
  for (const Tensor& t : means_) m.buffers += storage_bytes(t);  // bf16 weights' float32 means
  return m;
}

// ---- ZeRO-1 and -2: optimizer state (and for -2 the gradients) sharded over the DP group

ShardedAdam::ShardedAdam(const Comm& dp, AdamConfig config, Bug bug, int stage, size_t bucket_bytes)
    : adam_(config), bug_(bug), stage_(stage), dp_rank_(dp.rank()),
      buckets_(dp, bucket_bytes, /*scatter=*/true, /*free_grads=*/stage == 2) {
  FF_CHECK(stage == 1 || stage == 2, "ShardedAdam: stage 1 or 2, got " << stage);
}

void ShardedAdam::step(const std::vector<Tensor*>& params) {
  buckets_.layout(params);
  has_bf16_ = std::any_of(params.begin(), params.end(), [](const Tensor* p) { return p->dtype() == DType::bf16; });
  const int dp = buckets_.group().size();
  // 1. reduce-scatter: this rank gets its block of every bucket of the sum of every rank's
  //    gradients (the buckets the backward did not post already go now)
  buckets_.flush();
  buckets_.wait();
  float* grad_shard = buckets_.shard().data();
  const int64_t shard = buckets_.shard_size();
  if (sum_over_ && sum_over_->size() > 1) sum_over_->allreduce_sum(grad_shard, (size_t)shard);
  if (bug_ != Bug::no_divide) divide(grad_shard, shard, divisor_ > 0 ? divisor_ : dp);

  // 2. AdamW on this rank's blocks only. The flat buffer's gradients are spent: it now holds
  //    the parameters (identical on every rank), and this rank's blocks of them are what it
  //    updates. Adam's m and v take param_shard_'s shape: ceil(N/dp) numbers each (per bucket).
  float* flat = buckets_.flat().data();
  const auto mine = [&](const GradBuckets::Bucket& b) { return flat + b.offset + b.padded / dp * dp_rank_; };
  // Mixed precision (bf16 parameters): param_shard_ is the float32 MASTER of this rank's blocks,
  // kept from step to step (read from the parameters once; rounding them to bf16 and back would
  // lose every update below half a bf16 step). Float32 parameters are read again every step.
  // [slide:master-shard]
  const bool masters = has_bf16_ && param_shard_.defined() && masters_held_ && bug_ != Bug::no_master;
  if (!param_shard_.defined()) param_shard_ = Tensor::zeros({shard});
  // [exercise:zero1-step] ZeRO-1's update: AdamW on this rank's blocks only — gather them from flat into param_shard_ (unless it holds the masters), step, and put them back.
  if (!masters) {
    buckets_.flatten_params(flat);
    for (const GradBuckets::Bucket& b : buckets_.buckets())
      std::memcpy(param_shard_.data() + b.offset / dp, mine(b), (size_t)(b.padded / dp) * sizeof(float));
  }
  adam_.step({&param_shard_}, {buckets_.shard()});
  if (bug_ != Bug::stale_shard)
    for (const GradBuckets::Bucket& b : buckets_.buckets())
      std::memcpy(mine(b), param_shard_.data() + b.offset / dp, (size_t)(b.padded / dp) * sizeof(float));
  // [/exercise]
  // [/slide]
  masters_held_ = has_bf16_;

  // 3. all-gather, bucket by bucket: every rank contributes its updated block (already in place
  //    in flat) and receives the others'; then the full parameters are copied back.
  if (dp > 1) {
    std::vector<Request> gathers;
    for (const GradBuckets::Bucket& b : buckets_.buckets())
      gathers.push_back(buckets_.group().iallgather(mine(b), (size_t)(b.padded / dp) * sizeof(float), flat + b.offset));
    buckets_.group().wait_all(gathers);
  }
  buckets_.unflatten_params(flat);
  if (stage_ == 2) buckets_.release_flat();  // the next step's backward allocates it again
}

void ShardedAdam::restore_masters(const Tensor& shard) {
  FF_CHECK(shard.dim() == 1 && shard.numel() == shard_size() && shard.dtype() == DType::f32,
           "ShardedAdam::restore_masters: this rank's " << shard_size() << " float32 numbers, got " << shape_str(shard.shape()));
  param_shard_ = shard.clone();
  masters_held_ = true;
}

Memory ShardedAdam::memory(const std::vector<Tensor*>& params) const {
  Memory m;
  count_params_and_grads(params, &m);
  m.optimizer = adam_.state_bytes();  // m and v shaped like the one tensor it is given, the shard
  const size_t grad_shard = storage_bytes(buckets_.shard());
  m.buffers = buckets_.bytes_held() - grad_shard;
  // the shard of the parameters: with bf16 weights the float32 master copy (optimizer state, as
  // seed 001 counts it), with float32 ones a copy made for the step
  (has_bf16_ ? m.optimizer : m.buffers) += storage_bytes(param_shard_);
  // ZeRO-2 holds its gradients as the shard alone; ZeRO-1's shard is a buffer beside them
  (stage_ == 2 ? m.grads : m.buffers) += grad_shard;
  return m;
}

std::vector<float> ShardedAdam::gather_mean_grad(Comm& check) const {
  const int dp = check.size();
  const int64_t shard = shard_size();
  std::vector<float> all((size_t)(shard * dp)), out((size_t)numel());
  check.allgather(grad_shard().data(), (size_t)shard * sizeof(float), all.data());
  // Rank r's shard is its block of every bucket back to back: bucket b's block of rank r sits
  // at all[r * shard + offset / dp]. A bucket's parameters are params[first, last), whose
  // place in the parameters' order starts after every parameter before `first`.
  for (const GradBuckets::Bucket& b : buckets_.buckets()) {
    int64_t at = 0;
    for (size_t i = 0; i < b.first; i++) at += buckets_.param_numel(i);
    const int64_t block = b.padded / dp;
    for (int64_t j = 0; j < b.numel; j++)
      out[(size_t)(at + j)] = all[(size_t)((j / block) * shard + b.offset / dp + j % block)];
  }
  return out;
}

GroupAdam::GroupAdam(const Comm& group, const AdamConfig& config, int zero_stage, Bug bug, size_t bucket_bytes,
                     int fsdp_units) {
  FF_CHECK(zero_stage >= 0 && zero_stage <= 3, "GroupAdam: ZeRO stage 0..3, got " << zero_stage);
  FF_CHECK((zero_stage == 3) == (fsdp_units > 0), "GroupAdam: ZeRO-3 and only ZeRO-3 has units");
  if (zero_stage == 0)
    zero0_ = std::make_unique<DataParallelAdam>(group, config, bucket_bytes);
  else if (zero_stage < 3)
    sharded_ = std::make_unique<ShardedAdam>(group, config, bug, zero_stage, bucket_bytes);
  else
    zero3_ = std::make_unique<fsdp::ShardGroup>(group, config, fsdp_units);
}

GroupAdam::~GroupAdam() = default;

Adam* GroupAdam::adam() { return zero0_ ? &zero0_->adam() : sharded_ ? &sharded_->adam() : &zero3_->adam(); }

void GroupAdam::add(Tensor* p, size_t key, int unit) {
  params.push_back(p), keys.push_back(key), numel += p->numel();
  if (zero3_) zero3_->add(p, unit);
}

void GroupAdam::sum_after_reduce(Comm* c) {
  FF_CHECK(!zero3_, "GroupAdam::sum_after_reduce: ZeRO-3 sums its shards itself (ShardGroup::sum_grad_shards)");
  if (zero0_) zero0_->sum_after_reduce(c);
  if (sharded_) sharded_->sum_after_reduce(c);
}

void GroupAdam::divide_by(int n) {
  if (zero0_) zero0_->divide_by(n);
  if (sharded_) sharded_->divide_by(n);
  if (zero3_) zero3_->divide_by(n);
}

Memory GroupAdam::memory() const {
  if (zero3_) return zero3_->memory();
  return zero0_ ? zero0_->memory(params) : sharded_->memory(params);
}

void GroupAdam::layout() {
  if (!params.empty() && !zero3_) buckets().layout(params);
}

void GroupAdam::step() {
  if (params.empty()) return;
  if (zero3_) return zero3_->step();
  zero0_ ? zero0_->step(params) : sharded_->step(params);
}

std::vector<Tensor> GroupAdam::mean_grads(Comm& check) const {
  if (zero3_) return zero3_->mean_grads(check);
  std::vector<Tensor> out;
  if (zero0_) return zero0_->mean_grads(params);
  if (params.empty()) return out;
  const std::vector<float> flat = sharded_->gather_mean_grad(check);
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

}  // namespace ff::zero
