// lessons/06_overlap/weight_grads.h — the weight gradients set aside (lesson 07's W): the
// backward's phases leave them here, to be run while a wait would idle (or at once, W inline),
// and the sums they add to.
#pragma once
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/layers/dsv3_moe.h"
#include "common/layers/moe.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/clock.h"

namespace ff::f1b {

class WeightGrads {
 public:
  WeightGrads(const Setup& setup, int ranks) : setup_(setup), ranks_(ranks), flops_(setup) {}

  DeferredGrads attention;  // the attention's matmul weight gradients (run_backward's W)
  // Sets aside one of the MoE's weight gradients, `flops` of work.
  void defer(double flops, std::function<void()> work) { moe_.push_back({flops, std::move(work)}); }
  bool empty() const { return moe_next_ == moe_.size() && attention.empty(); }
  // Runs the oldest one set aside and returns its FLOPs: the MoE's and the attention's queues
  // alternate by micro-batch order — each keeps its own first-in first-out order, which is all
  // the sums need (every weight's gradient is summed over micro-batches in order).
  double run_next();

  // The sums, over micro-batches in micro-batch order (dx left undefined).
  dsv3::Grads sums;
  void add_router(const Tensor& d_router_w) { accumulate(sums.router_w, d_router_w); }
  // The shared experts' gradients, reshaped to the fused (d, S f) and (S f, d) weights of full.
  void add_shared(const moe::ExpertGrads& shared, const dsv3::Params& full);
  // Expert e's weight gradients, (1, a, b) each, into rows e of this rank's (N/P, a, b) sums.
  void add_expert(const moe::ExpertGrads& expert, int64_t e);

 private:
  static void accumulate(Tensor& sum, const Tensor& t) { sum = sum.defined() ? add(sum, t) : t; }
  const Setup& setup_;
  int ranks_;
  PhaseFlops flops_;
  std::vector<std::pair<double, std::function<void()>>> moe_;  // (FLOPs, work)
  size_t moe_next_ = 0;
};

}  // namespace ff::f1b
