// lessons/08_mesh/buckets.cpp — see buckets.h.
#include "lessons/08_mesh/buckets.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/core/check.h"
#include "kernels/bf16.h"
#include "kernels/device.h"

namespace ff::zero {

namespace {

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Checks the parameters and returns N, their total number of elements. A parameter is float32
// or bf16 (lesson 10's mixed precision), its gradient of its own dtype; the buffers are float32.
int64_t total_numel(const std::vector<Tensor*>& params, const char* who) {
  int64_t n = 0;
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor& p = *params[i];
    FF_CHECK(p.defined() && (p.dtype() == DType::f32 || p.dtype() == DType::bf16),
             who << ": parameter " << i << " must be a float32 or bf16 tensor");
    const Tensor g = p.grad();
    FF_CHECK(!g.defined() || (g.dtype() == p.dtype() && g.device() == p.device() && g.shape() == p.shape()),
             who << ": parameter " << i << " " << shape_str(p.shape()) << " " << dtype_name(p.dtype())
                 << " has a gradient that is not a tensor of its dtype, shape and device");
    n += p.numel();
  }
  return n;
}

// dst <- the gradients of params[first, last) back to back, as float32; zeros where a parameter
// has none (this rank's batch did not reach it, another rank's may have).
void flatten_grads(const std::vector<Tensor*>& params, size_t first, size_t last, float* dst) {
  for (size_t i = first; i < last; i++) {
    const Tensor g = params[i]->grad();
    const size_t n = (size_t)params[i]->numel();
    if (g.defined())
      read_floats(g, dst);
    else
      std::fill(dst, dst + n, 0.f);
    dst += n;
  }
}

}  // namespace

// A float32 or bf16 tensor's values, as float32 on the host (bf16 widened: exact).
void read_floats(const Tensor& t, float* dst) {
  const Tensor f = t.dtype() == DType::bf16 ? t.to_dtype(DType::f32) : t;
  device_memcpy(dst, Device::cpu, f.raw(), f.device(), (size_t)f.numel() * sizeof(float));
}

// n float32 values from the host into a float32 or bf16 tensor's storage (bf16: rounded to
// nearest even, as Tensor::to_dtype rounds on every device).
void write_floats(const Tensor& t, const float* src) {
  const size_t n = (size_t)t.numel();
  if (t.dtype() == DType::f32) return device_memcpy(t.raw(), t.device(), src, Device::cpu, n * sizeof(float));
  Tensor host = Tensor::empty({(int64_t)n});
  std::memcpy(host.data(), src, n * sizeof(float));
  const Tensor narrow = host.to_dtype(DType::bf16);
  device_memcpy(t.raw(), t.device(), narrow.raw(), Device::cpu, n * sizeof(uint16_t));
}

size_t storage_bytes(const Tensor& t) { return t.defined() ? t.impl()->storage->bytes : 0; }

double BucketTimes::hidden_fraction() const {
  const double can = std::min(window_s, comm_s);
  if (can <= 0) return 0;
  return std::clamp((comm_s - exposed_s) / can, 0.0, 1.0);
}


// ---- the buckets

GradBuckets::GradBuckets(const Comm& group, size_t bucket_bytes, bool scatter, bool free_grads)
    : group_(group), bucket_bytes_(bucket_bytes), scatter_(scatter), free_grads_(free_grads) {}

GradBuckets::~GradBuckets() {
  for (Tensor* p : params_) p->impl()->post_accumulate_grad = nullptr;
}

void GradBuckets::layout(const std::vector<Tensor*>& params) {
  const int64_t n = total_numel(params, "GradBuckets::layout");
  if (n_ >= 0) {
    FF_CHECK(n == n_ && params.size() == params_.size(),
             "GradBuckets: " << params.size() << " parameters of " << n << " numbers, but the first step had "
                             << params_.size() << " of " << n_);
    return;
  }
  FF_CHECK(n > 0, "GradBuckets: no parameters");
  params_ = params;
  n_ = n;
  // Cut from the last parameter back: a bucket closes once it holds bucket_bytes (0: never).
  // Each bucket keeps its parameters in the list's order, so one bucket is the plain layout.
  const int dp = group_.size();
  std::vector<std::pair<size_t, size_t>> ranges;  // [first, last), last parameters first
  size_t last = params.size(), bytes = 0;
  for (size_t i = params.size(); i-- > 0;) {
    bytes += (size_t)params[i]->numel() * sizeof(float);
    if ((bucket_bytes_ > 0 && bytes >= bucket_bytes_) || i == 0) {
      ranges.push_back({i, last});
      last = i, bytes = 0;
    }
  }
  // buckets_[0] is posted first: it holds the last parameters. Its buffer comes first too.
  bucket_of_.assign(params.size(), 0);
  int64_t offset = 0;
  for (const auto& [first, end] : ranges) {
    Bucket b;
    b.first = first, b.last = end, b.offset = offset;
    for (size_t i = first; i < end; i++) b.numel += params[i]->numel(), bucket_of_[i] = buckets_.size();
    b.padded = scatter_ ? (b.numel + dp - 1) / dp * dp : b.numel;  // an all-reduce needs no padding
    offset += b.padded;
    buckets_.push_back(b);
  }
  flat_size_ = offset;
  for (size_t i = 0; i < params.size(); i++)
    params[i]->impl()->post_accumulate_grad = [this, i] { ready(i); };
}

void GradBuckets::ensure_buffers() {
  if (!flat_.defined()) flat_ = Tensor::zeros({flat_size_});
  if (scatter_ && !shard_.defined()) shard_ = Tensor::zeros({shard_size()});
}

void GradBuckets::arm() {
  FF_CHECK(laid_out(), "GradBuckets::arm before layout");
  armed_ = true;
  armed_at_ = now_s();
  seen_.assign(params_.size(), 0);
  missing_.clear();
  for (const Bucket& b : buckets_) missing_.push_back((int)(b.last - b.first));
}

// [slide:bucket-ready]
void GradBuckets::ready(size_t param) {
  for (Request& r : requests_) group_.test(r);  // MPI moves a collective only inside MPI calls
  if (!armed_ || seen_[param]) return;
  seen_[param] = 1;
  const size_t b = bucket_of_[param];
  missing_[b]--;
  // in order: this bucket and every full one after it, once all before them have gone
  while (next_ < buckets_.size() && (missing_[next_] == 0 || (early_ && missing_[next_] <= 1 &&
                                                              buckets_[next_].last - buckets_[next_].first > 1)))
    post(next_++), times_.posted_early++;
}
// [/slide]

void GradBuckets::post(size_t b) {
  ensure_buffers();
  const Bucket& k = buckets_[b];
  float* buf = flat_.data() + k.offset;
  flatten_grads(params_, k.first, k.last, buf);
  std::fill(buf + k.numel, buf + k.padded, 0.f);
  if (free_grads_)  // ZeRO-2: the full gradients are in the buffer; this rank keeps only its shard
    for (size_t i = k.first; i < k.last; i++) params_[i]->impl()->grad = nullptr;
  const int dp = group_.size();
  if (bf16_ && dp > 1) {  // the bucket in bf16 on the wire, widened back in wait()
    if (flat16_.empty()) flat16_.resize((size_t)flat_size_), shard16_.resize(scatter_ ? (size_t)shard_size() : 0);
    uint16_t* b16 = flat16_.data() + k.offset;
    for (int64_t i = 0; i < k.padded; i++) b16[i] = float_to_bf16(buf[i]);
    if (scatter_)
      requests_.push_back(group_.ireduce_scatter_sum_bf16(b16, shard16_.data() + k.offset / dp, (size_t)(k.padded / dp)));
    else
      requests_.push_back(group_.iallreduce_sum_bf16(b16, (size_t)k.numel));
  } else if (scatter_ && dp == 1) {
    std::memcpy(shard_.data() + k.offset, buf, (size_t)k.padded * sizeof(float));
  } else if (scatter_) {
    requests_.push_back(group_.ireduce_scatter_sum(buf, shard_.data() + k.offset / dp, (size_t)(k.padded / dp)));
  } else if (dp > 1) {
    requests_.push_back(group_.iallreduce_sum(buf, (size_t)k.numel));
  }
}

void GradBuckets::flush() {
  FF_CHECK(laid_out(), "GradBuckets::flush before layout");
  if (flushed_) return;  // this step's already
  flushed_ = true;
  times_.window_s = armed_ ? now_s() - armed_at_ : 0;
  flushed_at_ = Comm::link_clock_s();
  while (next_ < buckets_.size()) post(next_++);
  armed_ = false;
}

void GradBuckets::wait() {
  // T_comm: what the collectives take on the link model, one after another; exposed: how far
  // the last of them ends after the backward did (0: not modelled)
  times_.comm_s = times_.exposed_s = 0;
  for (const Request& r : requests_)
    if (r.modelled) {
      times_.comm_s += r.link_cost_s;
      times_.exposed_s = std::max(times_.exposed_s, r.link_done_s - flushed_at_);
    }
  group_.wait_all(requests_);
  if (bf16_ && group_.size() > 1) {  // the bf16 sums, widened (exact) into the float32 buffers
    const int dp = group_.size();
    for (const Bucket& b : buckets_) {
      const int64_t at = scatter_ ? b.offset / dp : b.offset, n = scatter_ ? b.padded / dp : b.numel;
      const uint16_t* src = (scatter_ ? shard16_.data() : flat16_.data()) + at;
      float* dst = (scatter_ ? shard_.data() : flat_.data()) + at;
      for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
    }
  }
  times_.buckets = (int)buckets_.size();
  last_ = times_;
  times_ = BucketTimes{};
  flushed_ = false;
  requests_.clear();
  next_ = 0;
}

void GradBuckets::for_each_shard_run(const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) const {
  const int dp = group_.size(), r = group_.rank();
  for (const Bucket& b : buckets_) {
    const int64_t block = b.padded / dp, lo = r * block, hi = std::min(b.numel, lo + block);
    int64_t start = 0;  // the bucket-relative position of params[i]'s first element
    for (size_t i = b.first; i < b.last && start < hi; i++) {
      const int64_t n = params_[i]->numel(), a = std::max(lo, start), z = std::min(hi, start + n);
      if (a < z) fn(i, a - start, b.offset / dp + (a - lo), z - a);
      start += n;
    }
  }
}

size_t GradBuckets::bytes_held() const {
  return storage_bytes(flat_) + storage_bytes(shard_) + (flat16_.size() + shard16_.size()) * sizeof(uint16_t);
}

void GradBuckets::flatten_params(float* flat) const {
  for (const Bucket& b : buckets_) {
    float* dst = flat + b.offset;
    for (size_t i = b.first; i < b.last; i++) {
      read_floats(*params_[i], dst);
      dst += params_[i]->numel();
    }
    std::fill(dst, flat + b.offset + b.padded, 0.f);
  }
}

void GradBuckets::unflatten_params(const float* flat) const {
  for (const Bucket& b : buckets_) {
    const float* src = flat + b.offset;
    for (size_t i = b.first; i < b.last; i++) {
      write_floats(*params_[i], src);
      src += params_[i]->numel();
    }
  }
}

// ---- a sum over ranks of whole gradients

void sum_grads(const std::vector<Tensor*>& params, Comm& comm) {
  for (Tensor* p : params)
    if (!p->grad().defined()) p->impl()->grad = Tensor::zeros(p->shape(), p->device(), p->dtype()).impl_ptr();
  std::vector<float> flat((size_t)total_numel(params, "sum_grads"));
  flatten_grads(params, 0, params.size(), flat.data());
  comm.allreduce_sum(flat.data(), flat.size());
  const float* src = flat.data();
  for (Tensor* p : params) {
    write_floats(p->grad(), src);
    src += p->numel();
  }
}

}  // namespace ff::zero
