// common/layers/zero.h — data-parallel AdamW: plain DP (ZeRO-0) and ZeRO-1.
//
// Design rule: every rank of the DP group ends a step with the same full parameters, equal to
// one process running AdamW on the mean of all ranks' gradients.
//
// Seed 001 §2.2. With data parallelism every rank holds the whole model and computes gradients
// on its own slice of the batch; a step must use the MEAN gradient over the DP ranks.
//
//   ZeRO-0 (DataParallelAdam): all-reduce the gradients (one flat buffer, the parameters in a
//     fixed order), divide by dp, and let every rank run the same AdamW on all parameters.
//     Every rank holds the whole optimizer state: the same m and v, dp times over.
//
//   ZeRO-1 (Zero1Adam): the optimizer state is split over the DP ranks instead. The gradients
//     are flattened into one buffer padded to a multiple of dp and split into dp equal
//     blocks; rank r owns block r (the "shard").
//       1. reduce-scatter: rank r receives block r of the SUM of the gradients (divide by dp);
//       2. AdamW on the shard only: m and v exist for ceil(N/dp) numbers, not N;
//       3. all-gather: every rank sends its updated block and receives all the others, so
//          every rank again holds the full, updated parameters.
//     A reduce-scatter followed by an all-gather moves the same bytes as one all-reduce
//     (ring all-reduce is exactly these two halves), so ZeRO-1 saves memory at no extra
//     communication.
//
// Memory per rank, for N parameters, everything in float32 (seed 001's mixed-precision
// 16Φ and 4Φ + 12Φ/dp become 16N and 8N + 8N/dp here):
//                 parameters   gradients   optimizer (m, v)
//     ZeRO-0      4N           4N          8N
//     ZeRO-1      4N           4N          8 * ceil(N/dp)
// plus the flat buffers the collectives need (not in the seed's formula): see Memory.
//
// The parameters are float32 tensors, on any device, with their gradients in .grad() (a
// parameter whose .grad() is undefined, e.g. an expert no token reached, contributes zeros).
// The flat buffers and ZeRO-1's shard, its m and v live on the host (Comm's buffers are host
// memory): ZeRO-1 runs AdamW on the host, ZeRO-0 on the parameters' device. The first
// step fixes the list: later steps pass the same tensors' shapes, in the same order, on every
// rank of the group.
//
// Equality of the two: both divide a float sum over the ranks by dp. MPI does not promise that
// an all-reduce and a reduce-scatter add the dp terms in the same order, so for dp >= 3 the
// mean gradients may differ in the last bits: each order's sum is within (dp-1)·u·Σ_r|g_r| of
// the exact sum (u = 2^-24), so the two means differ by at most about 2u·Σ_r|g_r| per element.
// For dp <= 2 there is one addition, and a + b == b + a: the means are bitwise equal. Everything
// after the mean is elementwise and the same on both paths, so equal mean gradients give
// bitwise-equal parameters (tests/mpi/test_zero.cpp checks both statements).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"

namespace ff::zero {

// Bytes one rank holds.
struct Memory {
  size_t params = 0;     // the full parameters (every rank has all of them in ZeRO-0 and -1)
  size_t grads = 0;      // the parameters' .grad() tensors
  size_t optimizer = 0;  // AdamW's m and v (float32 each)
  size_t buffers = 0;    // flat buffers for the collectives (not in seed 001's formula)
  size_t total() const { return params + grads + optimizer + buffers; }
};
// Two optimizers' memory together (lesson 08 under EP: the dense weights' and the experts').
inline Memory operator+(Memory a, const Memory& b) {
  a.params += b.params, a.grads += b.grads, a.optimizer += b.optimizer, a.buffers += b.buffers;
  return a;
}

// Seed 001's formula for N parameters in float32 (the table above), for stage 0 or 1; buffers 0.
Memory formula(int64_t n, int dp, int stage);
// Seed 001's own formula, mixed precision (bf16 params and grads, fp32 master copy, m and v):
// bytes per rank for stage 0..3: 16N, 4N + 12N/dp, 2N + 14N/dp, 16N/dp.
double mixed_precision_bytes(int64_t n, int dp, int stage);

// A known mistake planted on purpose, so that a check can be seen to catch it (tests, --bug).
enum class Bug {
  none,
  no_divide,    // the reduce-scattered SUM is used as if it were the mean (harmless only at dp 1)
  stale_shard,  // the all-gather sends this rank's block of the parameters from before the step
};

// ZeRO-0: all-reduce of the gradients, then the same AdamW step on every rank.
class DataParallelAdam {
 public:
  explicit DataParallelAdam(const Comm& dp, AdamConfig config = {});

  // Averages every gradient over the group (afterwards each .grad() holds the mean, as in
  // PyTorch's DDP), then runs AdamW on all parameters.
  void step(const std::vector<Tensor*>& params);

  Memory memory(const std::vector<Tensor*>& params) const;
  Adam& adam() { return adam_; }
  // The summed gradient is divided by n instead of the group's size: for weights whose
  // gradients are summed over a group other than the one the loss is averaged over (lesson
  // 08's experts: summed over expert-DP, averaged over DP x CP).
  void divide_by(int n) { divisor_ = n; }

 private:
  Comm dp_;
  Adam adam_;
  int divisor_ = 0;  // 0: the group's size
  Tensor flat_;  // (N): every gradient back to back, the buffer the all-reduce sums in place
};

// ZeRO-1: reduce-scatter of the gradients, AdamW on this rank's shard, all-gather of the
// parameters. Each .grad() is left as this rank's own (local) gradient.
class Zero1Adam {
 public:
  explicit Zero1Adam(const Comm& dp, AdamConfig config = {}, Bug bug = Bug::none);

  void step(const std::vector<Tensor*>& params);

  Memory memory(const std::vector<Tensor*>& params) const;
  Adam& adam() { return adam_; }
  void divide_by(int n) { divisor_ = n; }  // as DataParallelAdam::divide_by

  // The layout, fixed by the first step: N numbers, padded to dp * shard, rank r owning the
  // flat positions [r * shard, (r + 1) * shard) (those >= N are padding, always zero).
  int64_t numel() const { return n_; }
  int64_t shard_size() const { return shard_; }
  int64_t shard_begin() const { return (int64_t)dp_.rank() * shard_; }
  // (shard): this rank's block of the mean gradient used by the last step.
  const Tensor& grad_shard() const { return grad_shard_; }

 private:
  Comm dp_;
  Adam adam_;
  Bug bug_;
  int divisor_ = 0;
  int64_t n_ = -1, shard_ = 0;
  Tensor flat_;         // (dp * shard): the gradients, then (its gradients spent) the parameters
  Tensor grad_shard_;   // (shard): this rank's block of the mean gradient
  Tensor param_shard_;  // (shard): this rank's block of the parameters, the tensor AdamW updates
};

// AdamW over one group of ranks that hold the same weights, ZeRO-0 or ZeRO-1 (lesson 08: the
// dense weights over DP x CP, and under EP the experts over expert-DP).
class GroupAdam {
 public:
  GroupAdam(const Comm& group, const AdamConfig& config, int zero_stage, Bug bug = Bug::none);
  // A weight of the group, and the caller's number for it (lesson 08: its place among the
  // model's named parameters).
  void add(Tensor* p, size_t key) { params.push_back(p), keys.push_back(key), numel += p->numel(); }
  void divide_by(int n) { z0_ ? z0_->divide_by(n) : z1_->divide_by(n); }
  void step();  // nothing for a group with no weight
  Memory memory() const { return z0_ ? z0_->memory(params) : z1_->memory(params); }
  // The mean gradient the last step used, per weight (ZeRO-1: every rank's shard, gathered
  // over `check`, a copy of the group's communicator that keeps the check's traffic apart).
  std::vector<Tensor> mean_grads(Comm& check) const;

  std::vector<Tensor*> params;  // the group's weights
  std::vector<size_t> keys;     // the caller's number for each
  int64_t numel = 0;            // their numbers, all together

 private:
  std::unique_ptr<DataParallelAdam> z0_;
  std::unique_ptr<Zero1Adam> z1_;
};

// Every gradient of params summed over comm, in one flat buffer (a missing gradient counts as
// zeros and is created): weights held whole by several ranks that each saw part of the tokens
// (lesson 08's replicated weights under SP, DualPipe's two copies of a stage).
void sum_grads(const std::vector<Tensor*>& params, Comm& comm);

}  // namespace ff::zero
