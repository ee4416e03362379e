// lessons/08_mesh/zero.h — data-parallel AdamW: plain DP (ZeRO-0), ZeRO-1 and ZeRO-2, the
// sharded optimizer, with the gradients reduced in buckets that can fly during the backward
// (buckets.h); ZeRO-3's gathered units are fsdp.h's.
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
//   ZeRO-1 (ShardedAdam): the optimizer state is split over the DP ranks instead. The gradients
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
//                 parameters   gradients          optimizer (m, v)
//     ZeRO-0      4N           4N                 8N
//     ZeRO-1      4N           4N                 8 * ceil(N/dp)
//     ZeRO-2      4N           4 * ceil(N/dp)     8 * ceil(N/dp)
// ZeRO-2 (ShardedAdam, stage 2) keeps only its shard of the gradients: it reduce-scatters as
// ZeRO-1 does and releases the full gradients as soon as they are in the collective's buffer.
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
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "lessons/08_mesh/buckets.h"

namespace ff::fsdp {
class ShardGroup;
}

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

// Seed 001's formula for N parameters in float32 (the table above), for stage 0, 1 or 2, and 3
// (everything sharded: 16 ceil(N/dp)); buffers 0.
Memory formula(int64_t n, int dp, int stage);
// The same for N cut into gradient buckets of these sizes, each sharded on its own (padded to a
// multiple of dp): a shard is the sum of ceil(N_b/dp), a little over ceil(N/dp). One bucket:
// the formula above.
Memory formula(const std::vector<int64_t>& buckets, int dp, int stage);
// Seed 001's own formula, mixed precision (bf16 params and grads, fp32 master copy, m and v):
// bytes per rank for stage 0..3: 16N, 4N + 12N/dp, 2N + 14N/dp, 16N/dp.
double mixed_precision_bytes(int64_t n, int dp, int stage);

// The bytes one rank holds for n16 bf16 parameters and n32 float32 ones, one gradient bucket
// over dp ranks, as this ZeRO holds them (lesson 10's mixed precision: the weights the
// activations are multiplied by in bf16; seed 001's all-bf16 formula is mixed_precision_bytes):
//                  parameters       gradients             optimizer
//    ZeRO-0        2 n16 + 4 n32    2 n16 + 4 n32         12 n16 + 8 n32  (master, m, v; m, v)
//    ZeRO-1        2 n16 + 4 n32    2 n16 + 4 n32         12 ceil(N/dp)
//    ZeRO-2        2 n16 + 4 n32    4 ceil(N/dp)          12 ceil(N/dp)
// ZeRO-1 and -2 keep one float32 shard of every parameter, the masters (the float32 ones' as
// well: one shard, one layout); ZeRO-2's gradient shard is the float32 sum the reduce-scatter
// gave, 4 bytes where seed 001 counts 2. With n16 = 0 it is zero::formula, float32 training.
// moment_bytes: 4, or 2 with AdamW's m and v in bf16 (AdamConfig::bf16_moments, DeepSeek-V3's
// choice): the optimizer column's 8 of m and v become 4 (12 -> 8 with the master).
// (One gradient bucket; stage 0..2: ZeRO-3's is mixed_formula_units.) With several buckets of
// N_b parameters each (GradBuckets, each sharded on its own), ceil(N/dp) becomes the sum of
// ceil(N_b/dp).
Memory mixed_formula(int64_t n16, int64_t n32, int dp, int stage, int moment_bytes = 4);
Memory mixed_formula(int64_t n16, int64_t n32, const std::vector<int64_t>& buckets, int dp, int stage,
                     int moment_bytes = 4);
// ZeRO-3 over bf16 weights (fsdp.h), units of N_u parameters each sharded on its own, S the sum
// of ceil(N_u/dp): no weight held between steps (a unit is gathered for its forward and its
// backward), the float32 gradient shard 4 S, the masters, m and v (4 + 2 moment_bytes) S. Seed
// 001's 16N/dp, its 2 + 2 bytes of bf16 parameters and gradients counted as 4 of gradients.
Memory mixed_formula_units(const std::vector<int64_t>& units, int dp, int moment_bytes = 4);

// A known mistake planted on purpose, so that a check can be seen to catch it (tests, --bug).
enum class Bug {
  none,
  no_divide,    // the reduce-scattered SUM is used as if it were the mean (harmless only at dp 1)
  stale_shard,  // the all-gather sends this rank's block of the parameters from before the step
  no_master,    // bf16 parameters: the shard read again from them every step, no float32 master
};

// ZeRO-0: all-reduce of the gradients, then the same AdamW step on every rank.
class DataParallelAdam {
 public:
  // bucket_bytes: 0, one bucket (one all-reduce for all); else buckets of about that size.
  explicit DataParallelAdam(const Comm& dp, AdamConfig config = {}, size_t bucket_bytes = 0);

  // Averages every gradient over the group (afterwards each .grad() holds the mean, as in
  // PyTorch's DDP), then runs AdamW on all parameters.
  void step(const std::vector<Tensor*>& params);

  Memory memory(const std::vector<Tensor*>& params) const;
  Adam& adam() { return adam_; }
  const Adam& adam() const { return adam_; }
  // The summed gradient is divided by n instead of the group's size: for weights whose
  // gradients are summed over a group other than the one the loss is averaged over (lesson
  // 08's experts: summed over expert-DP, averaged over DP x CP).
  void divide_by(int n) { divisor_ = n; }
  // The reduced gradients summed over `c` too, before the divide (weights each rank of c saw
  // only part of the tokens of: lesson 08's replicated weights under SP, summed over TP).
  void sum_after_reduce(Comm* c) { sum_over_ = c; }
  GradBuckets& buckets() { return buckets_; }
  // The mean gradient the last step used, per parameter (a bf16 parameter's float32 mean)
  std::vector<Tensor> mean_grads(const std::vector<Tensor*>& params) const;

 private:
  Adam adam_;
  int divisor_ = 0;  // 0: the group's size
  Comm* sum_over_ = nullptr;
  GradBuckets buckets_;
  std::vector<Tensor> means_;  // per parameter: a bf16 one's mean gradient in float32, else undefined
};

// ZeRO-1 and ZeRO-2: reduce-scatter of the gradients, AdamW on this rank's shard, all-gather of
// the parameters.
//   stage 1: each .grad() is left as this rank's own (local) gradient: 4N bytes held;
//   stage 2: each bucket's .grad() tensors are released as soon as they are copied into its
//            buffer, and the flat buffers after the step: a rank holds only its shard of the
//            gradients (4N/dp) between steps.
class ShardedAdam {
 public:
  ShardedAdam(const Comm& dp, AdamConfig config = {}, Bug bug = Bug::none, int stage = 1,
              size_t bucket_bytes = 0);

  void step(const std::vector<Tensor*>& params);

  Memory memory(const std::vector<Tensor*>& params) const;
  Adam& adam() { return adam_; }
  const Adam& adam() const { return adam_; }
  void divide_by(int n) { divisor_ = n; }  // as DataParallelAdam::divide_by
  // As DataParallelAdam's: the reduced shards summed over c (a sum of shards is the shard of
  // the sum, as long as every rank of c cuts the same buckets).
  void sum_after_reduce(Comm* c) { sum_over_ = c; }
  GradBuckets& buckets() { return buckets_; }
  const GradBuckets& buckets() const { return buckets_; }
  int stage() const { return stage_; }

  // The layout, fixed by the first step (GradBuckets). With one bucket, rank r owns the flat
  // positions [r * shard, (r + 1) * shard) (those >= N are padding, always zero).
  int64_t numel() const { return buckets_.numel(); }
  int64_t shard_size() const { return buckets_.shard_size(); }
  int64_t shard_begin() const { return (int64_t)dp_rank_ * shard_size(); }
  // (shard): this rank's blocks of the mean gradient used by the last step.
  const Tensor& grad_shard() const { return buckets_.shard(); }
  // (shard): this rank's blocks of the parameters, the float32 masters of bf16 ones when
  // masters_held() (after a step with bf16 parameters); a checkpoint keeps them.
  const Tensor& param_shard() const { return param_shard_; }
  bool masters_held() const { return masters_held_; }
  // A resumed run's masters, before its first step: this rank's blocks (a checkpoint's weights)
  void restore_masters(const Tensor& shard);
  // The mean gradient of the last step, whole (N, in the parameters' order), gathered over
  // `check` (a copy of the group's communicator that keeps the check's traffic apart).
  std::vector<float> gather_mean_grad(Comm& check) const;

 private:
  Adam adam_;
  Bug bug_;
  int stage_;
  int divisor_ = 0;
  Comm* sum_over_ = nullptr;
  int dp_rank_;
  GradBuckets buckets_;
  Tensor param_shard_;  // (shard): this rank's blocks of the parameters, the tensor AdamW updates
  bool has_bf16_ = false;      // some parameter is bf16: param_shard_ is their float32 master
  bool masters_held_ = false;  // param_shard_ holds the masters of the last step
};

// AdamW over one group of ranks that hold the same weights, ZeRO-0, -1, -2 or -3 (lesson 08: the
// dense weights over DP x CP, and under EP the experts over expert-DP). ZeRO-3 is
// fsdp.h's ShardGroup: its units are the caller's (add's unit), and an fsdp::Fsdp
// over the groups gathers and frees them around the model's units.
class GroupAdam {
 public:
  // fsdp_units: ZeRO-3's number of units (0 for the other stages)
  GroupAdam(const Comm& group, const AdamConfig& config, int zero_stage, Bug bug = Bug::none,
            size_t bucket_bytes = 0, int fsdp_units = 0);
  ~GroupAdam();
  // A weight of the group, the caller's number for it (lesson 08: its place among the model's
  // named parameters) and, under ZeRO-3, its unit.
  void add(Tensor* p, size_t key, int unit = 0);
  void divide_by(int n);
  void sum_after_reduce(Comm* c);  // ZeRO-0 to -2 (DataParallelAdam::sum_after_reduce)
  void step();  // nothing for a group with no weight
  // Fixes the buckets and installs their hooks before the first step (step() does it too).
  void layout();
  void arm() { if (!params.empty() && !zero3_) buckets().arm(); }  // GradBuckets::arm (not ZeRO-3's)
  // GradBuckets::flush: the backward is over, every bucket goes (step() does it too; lesson 08
  // flushes every group before any waits, so that no group's window holds another's wait)
  void flush() { if (!params.empty() && !zero3_) buckets().flush(); }
  fsdp::ShardGroup* shards() { return zero3_.get(); }  // ZeRO-3's, else nullptr
  // The stage's AdamW (ZeRO-0: m and v per weight; ZeRO-1, -2: one shard tensor laid out by
  // sharded()->buckets(); ZeRO-3: one laid out by shards()).
  Adam* adam();
  const ShardedAdam* sharded() const { return sharded_.get(); }
  ShardedAdam* sharded() { return sharded_.get(); }
  Memory memory() const;
  // The mean gradient the last step used, per weight (ZeRO-1, -2: every rank's shard, gathered
  // over `check`, a copy of the group's communicator that keeps the check's traffic apart).
  std::vector<Tensor> mean_grads(Comm& check) const;
  // The gradient buckets (their hooks, arm() and this step's times); nullptr for a group with
  // no weight before its first step.
  GradBuckets& buckets() { return zero0_ ? zero0_->buckets() : sharded_->buckets(); }

  std::vector<Tensor*> params;  // the group's weights
  std::vector<size_t> keys;     // the caller's number for each
  int64_t numel = 0;            // their numbers, all together

 private:
  // the group's stage, one of the three set
  std::unique_ptr<DataParallelAdam> zero0_;  // ZeRO-0
  std::unique_ptr<ShardedAdam> sharded_;     // ZeRO-1 and ZeRO-2
  std::unique_ptr<fsdp::ShardGroup> zero3_;  // ZeRO-3
};

}  // namespace ff::zero
