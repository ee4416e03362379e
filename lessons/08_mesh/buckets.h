// lessons/08_mesh/buckets.h — data parallelism's gradient reduction: the gradients cut into
// buckets, each reduced over the DP group as soon as its last gradient is in, while the backward
// goes on (what every stage of zero.h reduces with).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/tensor.h"

namespace ff::zero {

// A float32 or bf16 tensor's values, as float32 on the host (bf16 widened: exact).
void read_floats(const Tensor& t, float* dst);
// n float32 values from the host into a float32 or bf16 tensor's storage (bf16: rounded to
// nearest even, as Tensor::to_dtype rounds on every device).
void write_floats(const Tensor& t, const float* src);

// ---- gradient buckets: the reduction over DP, overlapped with the backward
//
// PyTorch's DDP and Megatron-LM do not wait for the whole backward before they reduce: the
// parameters are cut into buckets of about bucket_bytes, the LAST parameters first (a backward
// produces the last layers' gradients first), and a bucket's collective is posted as soon as its
// last gradient of the step is in, while the backward goes on with the layers before it. The
// optimizer waits for all of them. What the backward hid is the overlap.
//
// A bucket is one flat buffer (padded to a multiple of dp for a reduce-scatter):
//   all-reduce      (ZeRO-0): the buffer becomes the sum over the group;
//   reduce-scatter  (ZeRO-1, -2): rank r receives block r of the sum, its shard of the bucket.
// Rank r's shard of the model is its block of every bucket, back to back. With one bucket
// (bucket_bytes 0) that is block r of all the parameters: the layout of seed 001's figure.
//
// When a gradient is final: a leaf's post_accumulate_grad hook (common/core/tensor.h) fires
// once per backward, as soon as the last op that read it is done, also when that backward sent
// it nothing (an expert no token reached: zeros in the bucket). Under gradient accumulation
// (pipeline micro-batches) only the last backward of the step is the last, so the hooks count
// only once arm() has been called (lesson 08 arms before the rank's last weight-gradient op).
// A parameter the last backward does not reach at all holds its bucket back until flush().
// Buckets are posted in order, bucket b only after b - 1: MPI's collectives on one
// communicator must be posted in the same order on every rank, and ranks need not see their
// gradients complete in the same order. Two GradBuckets over the same ranks interleave their
// posts as their hooks fire, so each needs its own communicator (Comm::duplicate_counted:
// lesson 08's dense and replicated weights, both over DP x CP).
struct BucketTimes {     // one step's reduction
  int buckets = 0;
  int posted_early = 0;  // posted during the backward (after arm(), before flush())
  double window_s = 0;   // arm() to flush(): the backward that could hide them (0: never armed)
  double comm_s = 0;     // the link model's time for the collectives, one after another (0: not
                         // modelled): what they take when the optimizer waits for them all at once
  double exposed_s = 0;  // how far the modelled collectives ran past the end of the backward
                         // (flush()): the communication left in sight. (What wait() sits blocked
                         // also holds the slowest rank's lateness, which is not communication.)
  // Lesson 06's measure: (T_seq - T_ovl) / min(T_compute, T_comm), with T_seq = window + comm
  // and T_ovl = window + exposed: the share of what could be hidden that was. 0 when there
  // was nothing to hide or no window.
  double hidden_fraction() const;
  // Two groups' reductions in the same step, side by side (lesson 08's dense weights and its
  // experts): their collectives share this rank's links, so their times on the links add up,
  // while the backward that hides them and what stays exposed past it are one.
  static BucketTimes concurrent(const BucketTimes& a, const BucketTimes& b) {
    BucketTimes t;
    t.buckets = a.buckets + b.buckets, t.posted_early = a.posted_early + b.posted_early;
    t.window_s = std::max(a.window_s, b.window_s), t.exposed_s = std::max(a.exposed_s, b.exposed_s);
    t.comm_s = a.comm_s + b.comm_s;
    return t;
  }
  BucketTimes& operator+=(const BucketTimes& o) {  // summed over steps
    buckets += o.buckets, posted_early += o.posted_early, window_s += o.window_s;
    comm_s += o.comm_s, exposed_s += o.exposed_s;
    return *this;
  }
};

class GradBuckets {
 public:
  // scatter: reduce-scatter (ZeRO-1, -2), else all-reduce. free_grads (ZeRO-2): a bucket's
  // .grad tensors are released once copied into its buffer, and the buffers after the step.
  GradBuckets(const Comm& group, size_t bucket_bytes, bool scatter, bool free_grads);
  ~GradBuckets();
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  // Fixes the buckets (the first step; later steps must pass the same shapes) and installs
  // the hooks.
  void layout(const std::vector<Tensor*>& params);
  bool laid_out() const { return n_ >= 0; }
  void arm();    // from now, each parameter's next gradient is its last of this step
  void flush();  // posts every bucket not yet posted, in order, and disarms (once a step)
  void wait();   // waits for every bucket; returns this step's times through times()
  const BucketTimes& times() const { return last_; }  // the last step's
  // planted bug: a bucket is posted when all but one of its gradients are in
  void post_one_early(bool on) { early_ = on; }
  // Mixed precision (lesson 10's --grad-reduce bf16): each bucket rounded to bf16 before its
  // collective, summed in bf16 (Comm's bf16 sums: each addition rounded) and widened back into
  // the float32 buffers: half the bytes on the wire, a rounding per addition. Off: float32.
  void reduce_in_bf16(bool on) { bf16_ = on; }
  bool reduces_in_bf16() const { return bf16_; }

  // The layout. N numbers; bucket b holds params [first, last) at flat[offset, offset +
  // padded), padded a multiple of dp when scattered; this rank's block of it is at shard[offset / dp, +
  // padded / dp).
  struct Bucket {
    size_t first = 0, last = 0;
    int64_t offset = 0, numel = 0, padded = 0;
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int64_t numel() const { return n_; }
  int64_t flat_size() const { return flat_size_; }     // sum of padded
  int64_t shard_size() const { return flat_size_ / group_.size(); }
  Tensor& flat() { return flat_; }    // (flat_size): stage 0: the sums after wait()
  Tensor& shard() { return shard_; }  // (shard_size): stages 1, 2: this rank's blocks of the sums
  const Tensor& shard() const { return shard_; }
  Comm& group() { return group_; }
  size_t bytes_held() const;          // the buffers' storage
  void release_flat() { flat_ = Tensor(); }  // ZeRO-2, after the step (the backward re-allocates)
  int64_t param_numel(size_t i) const { return params_[i]->numel(); }

  // This rank's shard, run by run: fn(param, local, at, count) for `count` numbers of
  // params()[param] from its element `local` on, held at shard()[at] (a checkpoint maps them
  // to the full tensors).
  void for_each_shard_run(const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) const;
  // The flat buffer <-> the parameters (or their gradients), in the layout's order.
  void flatten_params(float* flat) const;
  void unflatten_params(const float* flat) const;

 private:
  void ready(size_t param);
  void post(size_t b);
  void ensure_buffers();

  Comm group_;
  size_t bucket_bytes_;
  bool scatter_, free_grads_, early_ = false, bf16_ = false;
  std::vector<Tensor*> params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // param -> bucket
  int64_t n_ = -1, flat_size_ = 0;
  Tensor flat_, shard_;
  std::vector<uint16_t> flat16_, shard16_;  // --grad-reduce bf16: what the collectives move
  // this step
  bool armed_ = false, flushed_ = false;
  std::vector<char> seen_;         // param's last gradient in
  std::vector<int> missing_;       // per bucket: params not yet in
  size_t next_ = 0;                // the next bucket to post
  std::vector<Request> requests_;  // one per posted bucket
  double armed_at_ = 0, flushed_at_ = 0;  // flushed_at_ on the link model's clock
  BucketTimes times_, last_;
};

// Every gradient of params summed over comm, in one flat buffer (a missing gradient counts as
// zeros and is created): weights held whole by several ranks that each saw part of the tokens
// (lesson 08's replicated weights under SP, DualPipe's two copies of a stage).
void sum_grads(const std::vector<Tensor*>& params, Comm& comm);

// The bytes a tensor's storage holds (0 for none): memory as allocated, not shape times four.
size_t storage_bytes(const Tensor& t);

}  // namespace ff::zero
