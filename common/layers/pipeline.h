// common/layers/pipeline.h — the pipeline executor: runs a schedule (schedule.h) on real
// tensors over MPI. Taught in lesson 07; lesson 08 runs its model's stages with it.
//
// Each rank walks its program. For every step it receives what the step needs from the
// neighbouring stage (the activation for an F, the gradient for a B or I; from itself at the
// bottom of a V), runs the op through the core's autograd, and sends what the next op
// elsewhere needs, non-blocking. An I runs the backward with the weight gradients deferred
// (run_backward(..., &deferred)); its W runs them, first in first out.
//
// What a stage computes comes from a StageModel, the lesson's model cut into stages.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/autograd.h"
#include "common/core/tensor.h"
#include "common/layers/schedule.h"

namespace ff::pp {

class StageModel {
 public:
  virtual ~StageModel() = default;
  // The forward of micro-batch gm (0..M-1) through stage `stage`. x is the previous stage's
  // output as a leaf that requires grad, or undefined on the first stage (the model reads the
  // micro-batch's input itself). Returns the stage's output; on the last stage the
  // micro-batch's loss, a scalar, scaled as its share of the batch's loss.
  virtual Tensor forward(int stage, int gm, const Tensor& x) = 0;
  // The shape of what leaves stage `stage` for micro-batch gm, forward (and its gradient back).
  virtual Shape boundary_shape(int stage, int gm) const = 0;
  virtual Device device() const = 0;
};

struct ExecutorOptions {
  // Called after each step's compute and before its sends, with the step's start time on the
  // trace clock (lesson 07 stretches each op to its cost there).
  std::function<void(const Step&, double start_us)> after_compute;
  bool drop_last_w = false;  // planted bug: the rank's last W is skipped
  // A paired step (F&B) runs its forward and its backward interleaved, each one's all-to-alls
  // in flight while the other computes (common/comm/overlap.h); else the F, then the B.
  bool overlap_pairs = false;
  bool trace_steps = true;   // a "compute" span per step, named by the step ("F0(3)&B1(1)")
  // Called once, just before the rank's last step that adds into the weights' gradients (its
  // last B, or its last W when the schedule splits the backward): from there on, a weight's
  // next gradient is its last of the batch (lesson 08 arms its gradient buckets there,
  // lessons/08_mesh/buckets.h). On a layout that holds one stage per rank (Layout::line) only: with
  // two stages a rank's last such step is the last of one of them, not of both.
  std::function<void()> before_last_weight_grads;
};

class Executor {
 public:
  // comm: the pipeline's ranks, rank r running s.ranks[r].
  Executor(Comm& comm, const Schedule& s, StageModel& model, ExecutorOptions opt = {});

  void run();

  double local_loss() const { return loss_sum_; }  // the sum of this rank's micro-batch losses
  int peak_live() const { return peak_live_; }      // most micro-batches held at once
  double busy_us() const { return busy_us_; }       // time inside ops
  double end_us() const { return end_us_; }         // when the last op ended (trace clock)
  // The paired steps (F&B) alone: their compute's wall time, seconds (lesson 08's --overlap
  // compare times them one after the other and overlapped).
  double paired_wall_s() const { return paired_wall_s_; }

 private:
  struct Live {  // what a micro-batch leaves on this stage between its F and its B (or W)
    Tensor x;    // the stage's input, a leaf: its .grad is what goes back to the previous stage
    Tensor y;    // the stage's output (the loss on the last stage), with its autograd graph
  };
  int prev_stage(const Op& op) const;
  int next_stage(const Op& op) const;
  Tensor receive_for(const Op& op);
  Tensor compute(const Op& op, const Tensor& in);
  void send_after(const Op& op, const Tensor& t);

  Comm& comm_;
  const Schedule& s_;
  StageModel& model_;
  ExecutorOptions opt_;
  const int r_;
  std::map<std::pair<int, int>, Live> live_;                          // (dir, mb) -> state
  std::deque<std::pair<std::pair<int, int>, DeferredGrads>> deferred_;  // W's, FIFO
  std::map<int, Tensor> local_acts_, local_grads_;  // hand-overs between this rank's stages
  std::deque<std::vector<float>> outbox_;           // send buffers alive until the sends end
  std::vector<Request> pending_;
  double loss_sum_ = 0;
  int peak_live_ = 0;
  int w_run_ = 0, w_total_ = 0;  // for drop_last_w
  size_t last_weight_step_ = 0;  // for before_last_weight_grads
  double busy_us_ = 0, end_us_ = 0;
  double paired_wall_s_ = 0;
};

}  // namespace ff::pp
