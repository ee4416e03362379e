// lessons/08_mesh/fsdp.cpp — ZeRO-3 (the scheme is in fsdp.h).
#include "lessons/08_mesh/fsdp.h"

#include <algorithm>
#include <cstring>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "kernels/device.h"
#include "lessons/08_mesh/buckets.h"

namespace ff::fsdp {

namespace {
size_t storage_bytes(const Tensor& t) { return t.defined() ? t.impl()->storage->bytes : 0; }
}  // namespace

// ---- one group's shards

ShardGroup::ShardGroup(const Comm& group, AdamConfig config, int units)
    : group_(group), adam_(config), units_((size_t)units) {}

void ShardGroup::add(Tensor* p, int unit) {
  FF_CHECK(unit >= 0 && unit < (int)units_.size(), "fsdp: unit " << unit << " of " << units_.size());
  FF_CHECK(p->defined() && (p->dtype() == DType::f32 || p->dtype() == DType::bf16),
           "fsdp: a weight must be a float32 or bf16 tensor");
  has_bf16_ = has_bf16_ || p->dtype() == DType::bf16;
  units_[(size_t)unit].params.push_back(p);
  units_[(size_t)unit].numel += p->numel();
  order_.push_back(p);
  unit_of_.push_back(unit);
}

int64_t ShardGroup::numel() const {
  int64_t n = 0;
  for (const Unit& u : units_) n += u.numel;
  return n;
}

void ShardGroup::shard() {
  if (order_.empty()) return;  // a group with no weight here holds nothing
  const int dp = group_.size();
  int64_t largest = 0, total = 0;
  for (Unit& u : units_) {
    u.padded = (u.numel + dp - 1) / dp * dp;
    largest = std::max(largest, u.padded);
    total += u.padded / dp;
  }
  flat_ = Tensor::zeros({std::max<int64_t>(largest, 1)});
  // AdamW sees one tensor: every unit's block back to back
  all_params_ = Tensor::zeros({std::max<int64_t>(total, 1)});
  all_grads_ = Tensor::zeros({std::max<int64_t>(total, 1)});
  int64_t at = 0;
  for (Unit& u : units_) {
    const int64_t block = u.padded / dp;
    // this rank's block of the unit's weights, flattened
    // (bf16 weights widened: the shard is their float32 master from here on)
    float* flat = flat_.data();
    int64_t k = 0;
    for (Tensor* p : u.params) {
      zero::read_floats(*p, flat + k);
      k += p->numel();
    }
    std::fill(flat + k, flat + u.padded, 0.f);
    std::memcpy(all_params_.data() + at, flat + block * group_.rank(), (size_t)block * sizeof(float));
    at += block;
  }
  for (size_t i = 0; i < units_.size(); i++) free((int)i);
}

// The unit's shard of the parameters / gradients: [begin, begin + block) of all_params_ / all_grads_.
static int64_t shard_begin(const std::vector<int64_t>& blocks, size_t unit) {
  int64_t at = 0;
  for (size_t i = 0; i < unit; i++) at += blocks[i];
  return at;
}

void ShardGroup::gather(int unit) {
  Unit& u = units_[(size_t)unit];
  if (u.params.empty()) return;
  FF_CHECK(flat_.defined(), "fsdp: gather before shard()");
  const int dp = group_.size();
  const int64_t block = u.padded / dp;
  std::vector<int64_t> blocks;
  for (const Unit& x : units_) blocks.push_back(x.padded / dp);
  const float* mine = all_params_.data() + shard_begin(blocks, (size_t)unit);
  float* flat = flat_.data();
  if (dp > 1)
    group_.allgather(mine, (size_t)block * sizeof(float), flat);
  else
    std::memcpy(flat, mine, (size_t)block * sizeof(float));
  int64_t k = 0;
  for (Tensor* p : u.params) {  // a bf16 weight: its master rounded to nearest even
    p->impl()->storage->allocate(p->nbytes());
    zero::write_floats(*p, flat + k);
    k += p->numel();
  }
}

void ShardGroup::zero_fill(int unit) {
  for (Tensor* p : units_[(size_t)unit].params) {
    p->impl()->storage->allocate(p->nbytes());
    const std::vector<float> zeros((size_t)p->numel(), 0.f);
    zero::write_floats(*p, zeros.data());
  }
}

void ShardGroup::free(int unit) {
  for (Tensor* p : units_[(size_t)unit].params) p->impl()->storage->release();
}

void ShardGroup::reduce(int unit) {
  Unit& u = units_[(size_t)unit];
  if (u.params.empty()) return;
  const int dp = group_.size();
  const int64_t block = u.padded / dp;
  float* flat = flat_.data();
  int64_t k = 0;
  for (Tensor* p : u.params) {  // the full gradients, back to back (zeros where none)
    const Tensor g = p->grad();
    if (g.defined())
      zero::read_floats(g, flat + k);  // a bf16 gradient widened: the sums are float32
    else
      std::fill(flat + k, flat + k + p->numel(), 0.f);
    k += p->numel();
    p->impl()->grad = nullptr;  // this rank keeps only its shard
  }
  std::fill(flat + k, flat + u.padded, 0.f);
  std::vector<float> sum((size_t)block);
  if (dp > 1)
    group_.reduce_scatter_sum(flat, sum.data(), std::vector<int>((size_t)dp, (int)block));
  else
    std::memcpy(sum.data(), flat, (size_t)block * sizeof(float));
  std::vector<int64_t> blocks;
  for (const Unit& x : units_) blocks.push_back(x.padded / dp);
  float* shard = all_grads_.data() + shard_begin(blocks, (size_t)unit);
  for (int64_t i = 0; i < block; i++) shard[i] += sum[(size_t)i];  // micro-batches add up
}

void ShardGroup::sum_grad_shards(Comm& comm) {
  if (order_.empty() || comm.size() == 1) return;
  comm.allreduce_sum(all_grads_.data(), (size_t)all_grads_.numel());
}

void ShardGroup::step() {
  if (order_.empty()) return;
  const int n = divisor_ > 0 ? divisor_ : group_.size();
  float* g = all_grads_.data();
  for (int64_t i = 0; i < all_grads_.numel(); i++) g[i] /= (float)n;  // as zero.cpp divides
  adam_.step({&all_params_}, {all_grads_});
  last_mean_ = all_grads_.clone();
  std::fill(g, g + all_grads_.numel(), 0.f);
}

std::vector<Tensor> ShardGroup::mean_grads(Comm& check) const {
  const int dp = check.size();
  const int64_t total = last_mean_.defined() ? last_mean_.numel() : 0;
  std::vector<float> all((size_t)(total * dp));
  if (total > 0) check.allgather(last_mean_.data(), (size_t)total * sizeof(float), all.data());
  // rank r's shards: every unit's block back to back; unit u's block of rank r at
  // all[r * total + (the blocks before u)]
  std::vector<std::vector<float>> full(units_.size());
  int64_t at = 0;
  for (size_t u = 0; u < units_.size(); u++) {
    const int64_t block = units_[u].padded / dp;
    full[u].resize((size_t)units_[u].padded);
    for (int r = 0; r < dp; r++)
      std::copy(all.begin() + (long)(r * total + at), all.begin() + (long)(r * total + at + block),
                full[u].begin() + (long)(r * block));
    at += block;
  }
  std::vector<Tensor> out;
  std::vector<int64_t> next(units_.size(), 0);
  for (size_t i = 0; i < order_.size(); i++) {
    const size_t u = (size_t)unit_of_[i];
    const int64_t n = order_[i]->numel();
    out.push_back(Tensor::from_vector(std::vector<float>(full[u].begin() + (long)next[u],
                                                         full[u].begin() + (long)(next[u] + n)),
                                      order_[i]->shape()));
    next[u] += n;
  }
  return out;
}

zero::Memory ShardGroup::memory() const {
  zero::Memory m;
  for (const Tensor* p : order_) m.params += storage_bytes(*p), m.grads += storage_bytes(p->grad());
  // with bf16 weights the shard is their float32 master: optimizer state, as ZeRO-1's (zero.cpp)
  (has_bf16_ ? m.optimizer : m.params) += storage_bytes(all_params_);
  m.grads += storage_bytes(all_grads_);
  m.optimizer += adam_.state_bytes();
  m.buffers = storage_bytes(flat_) + storage_bytes(last_mean_);
  return m;
}

void ShardGroup::for_each_shard_run(const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) const {
  const int dp = group_.size(), r = group_.rank();
  int64_t shard_at = 0;  // where the unit's block starts in this rank's shard
  for (size_t u = 0; u < units_.size(); u++) {
    const Unit& unit = units_[u];
    const int64_t block = unit.padded / dp, lo = r * block, hi = std::min(unit.numel, lo + block);
    int64_t start = 0;  // the unit-relative position of a weight's first element
    for (size_t i = 0; i < order_.size() && start < hi; i++) {
      if (unit_of_[i] != (int)u) continue;
      const int64_t n = order_[i]->numel(), a = std::max(lo, start), z = std::min(hi, start + n);
      if (a < z) fn(i, a - start, shard_at + (a - lo), z - a);
      start += n;
    }
    shard_at += block;
  }
}

size_t ShardGroup::unit_bytes(int unit) const {
  size_t bytes = 0;
  for (const Tensor* p : units_[(size_t)unit].params) bytes += p->nbytes();
  return bytes;
}

// ---- the units' schedule

Fsdp::Fsdp(std::vector<ShardGroup*> groups, int units)
    : groups_(std::move(groups)), uses_((size_t)units, 0), weights_((size_t)units, 0), done_((size_t)units, 0) {}

Fsdp::~Fsdp() {
  for (Tensor* p : hooked_) p->impl()->post_accumulate_grad = nullptr;
}

void Fsdp::start() {
  for (ShardGroup* g : groups_) {
    g->shard();
    const std::vector<Tensor*>& ps = g->params();
    for (size_t i = 0; i < ps.size(); i++) {
      const int unit = g->unit_of(i);
      weights_[(size_t)unit]++;
      ps[i]->impl()->post_accumulate_grad = [this, unit] { weight_done(unit); };
      hooked_.push_back(ps[i]);
    }
  }
}

void Fsdp::use(int unit) {
  if (uses_[(size_t)unit]++ > 0) return;  // gathered already
  for (ShardGroup* g : groups_) {
    g->gather(unit);
    held_ += g->unit_bytes(unit);
  }
  gathers_++;
  peak_ = std::max(peak_, held_);
}

void Fsdp::unuse(int unit) {
  FF_CHECK(uses_[(size_t)unit] > 0, "fsdp: unit " << unit << " freed more often than gathered");
  if (--uses_[(size_t)unit] > 0) return;
  for (ShardGroup* g : groups_) {
    g->free(unit);
    held_ -= g->unit_bytes(unit);
  }
}

// [slide:fsdp-hooks-short]
void Fsdp::before_forward(int unit) { use(unit); }

Tensor Fsdp::after_forward(int unit, const Tensor& y) {
  unuse(unit);
  if (!grad_enabled() || !y.requires_grad()) return y;
  // the pre-backward: an identity whose backward gathers the unit before its backward runs
  Tensor out = record(y.detach(), "fsdp_gather", {y}, [this, unit](const Tensor& g) {
    // [/slide:fsdp-hooks-short]
    bool stale = false;
    for (ShardGroup* grp : groups_) stale = stale || grp->stale_backward;
    if (stale && uses_[(size_t)unit] == 0) {  // planted bug: freed memory read as if it held the weights
      uses_[(size_t)unit]++;
      for (ShardGroup* grp : groups_) grp->zero_fill(unit), held_ += grp->unit_bytes(unit);
    } else {
      use(unit);
    }
    return std::vector<Tensor>{g};
  });
  return out;
}

void Fsdp::weight_done(int unit) {
  if (++done_[(size_t)unit] < weights_[(size_t)unit]) return;
  done_[(size_t)unit] = 0;
  for (ShardGroup* g : groups_) g->reduce(unit);  // the groups' order: the same on every rank
  unuse(unit);
}

void Fsdp::end_backward() {
  for (size_t u = 0; u < uses_.size(); u++) {
    if (done_[u] > 0) {  // a backward that left a weight unreached: reduce what came
      done_[u] = 0;
      for (ShardGroup* g : groups_) g->reduce((int)u);
    }
    while (uses_[u] > 0) unuse((int)u);
  }
}

void Fsdp::gather_all() {
  const size_t peak = peak_;  // the check's gathers are not the training's
  for (size_t u = 0; u < uses_.size(); u++) use((int)u);
  peak_ = peak;
}

void Fsdp::free_all() {
  for (size_t u = 0; u < uses_.size(); u++) unuse((int)u);
}

}  // namespace ff::fsdp
