// common/layers/pipeline.cpp — the pipeline executor (see pipeline.h; lesson 07 teaches it).
#include "common/layers/pipeline.h"

#include <algorithm>

#include "common/comm/overlap.h"
#include "common/core/check.h"
#include "common/util/trace.h"

namespace ff::pp {

// A message carries one tensor plus, as its last float, the global index of the micro-batch
// it belongs to: a receiver that gets another micro-batch than its program expects (two
// programs disagreeing on a link's order) stops with an error.
constexpr int kTagActivation = 1, kTagGradient = 2;

Executor::Executor(Comm& comm, const Schedule& s, StageModel& model, ExecutorOptions opt)
    : comm_(comm), s_(s), model_(model), opt_(std::move(opt)), r_(comm.rank()) {
  FF_CHECK(comm.size() == s.P, "pipeline: the schedule has " << s.P << " ranks, the communicator "
                                                             << comm.size());
  const std::vector<Step>& program = s.ranks[(size_t)r_];
  const bool split = std::any_of(program.begin(), program.end(), [](const Step& st) { return st.op.kind == Kind::W; });
  for (size_t i = 0; i < program.size(); i++) {
    const Step& st = program[i];
    w_total_ += st.op.kind == Kind::W;
    const Kind weights = split ? Kind::W : Kind::B;  // the op that adds into the weights' gradients
    if (st.op.kind == weights || (st.paired && st.with.kind == weights)) last_weight_step_ = i;
  }
  FF_CHECK(!opt_.before_last_weight_grads || s.layout == Layout::line,
           "pipeline: before_last_weight_grads needs one stage per rank (Layout::line)");
}

// [slide:run]
void Executor::run() {
  const std::vector<Step>& program = s_.ranks[(size_t)r_];
  for (size_t at = 0; at < program.size(); at++) {
    const Step& step = program[at];
    if (at == last_weight_step_ && opt_.before_last_weight_grads) opt_.before_last_weight_grads();
    std::vector<Op> ops = step.paired ? std::vector<Op>{step.op, step.with} : std::vector<Op>{step.op};
    // 1. everything the step needs from other ranks (a pair receives both, as DualPipe does)
    std::vector<Tensor> inbox;
    for (const Op& op : ops) inbox.push_back(receive_for(op));
    // 2. compute, timed
    const double start = trace().now_us();
    std::vector<Tensor> outbox(ops.size());
    if (step.paired && opt_.overlap_pairs) {
      // a pair is an F and a B or I (schedule.h); run_step starts them in DeepSeek-V3's
      // order (overlap::kStepOrder, as lesson 06): the backward first
      FF_CHECK(ops[0].kind == Kind::F && ops[1].kind != Kind::F,
               "a paired step is a forward and a backward: " << to_string(step));
      overlap::run_step([&] { outbox[0] = compute(ops[0], inbox[0]); },
                        [&] { outbox[1] = compute(ops[1], inbox[1]); });
    }
    else
      for (size_t i = 0; i < ops.size(); i++) outbox[i] = compute(ops[i], inbox[i]);
    if (opt_.after_compute) opt_.after_compute(step, start);
    const double end = trace().now_us();
    busy_us_ += end - start;
    if (step.paired) paired_wall_s_ += (end - start) * 1e-6;
    end_us_ = end;
    if (opt_.trace_steps) trace().add(to_string(step), "compute", start, end);
    // 3. send the results on (non-blocking: the next op does not wait for the neighbour)
    for (size_t i = 0; i < ops.size(); i++) send_after(ops[i], outbox[i]);
  }
  comm_.wait_all(pending_);
  pending_.clear();
  outbox_.clear();
}
// [/slide]

// The neighbours of op's stage along its flow: -1 at the ends of the pipeline.
int Executor::prev_stage(const Op& op) const { return s_.stage_of(r_, op.dir) - 1; }
int Executor::next_stage(const Op& op) const {
  const int st = s_.stage_of(r_, op.dir) + 1;
  return st < s_.num_stages() ? st : -1;
}

Tensor Executor::receive_for(const Op& op) {
  const int f = s_.flow_of(op.dir), gm = s_.global_mb(op.dir, op.mb);
  const int from_stage = op.kind == Kind::F ? prev_stage(op) : (op.kind == Kind::W ? -1 : next_stage(op));
  if (from_stage < 0) return Tensor();
  const int peer = s_.rank_of(f, from_stage);
  const bool grad = op.kind != Kind::F;
  if (peer == r_) {  // the bottom of the V: the neighbouring stage is on this rank
    auto& box = grad ? local_grads_ : local_acts_;
    Tensor t = box.at(gm);
    box.erase(gm);
    return t;
  }
  // the boundary between the two stages: what the earlier one sends forward
  const Shape shape = model_.boundary_shape(grad ? s_.stage_of(r_, op.dir) : from_stage, gm);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> buf((size_t)(n + 1));
  comm_.recv(buf.data(), buf.size() * sizeof(float), peer, grad ? kTagGradient : kTagActivation);
  const int got = (int)buf.back();
  FF_CHECK(got == gm, "rank " << r_ << " received the " << (grad ? "gradient" : "activation")
                              << " of micro-batch " << got << " from rank " << peer << " where its "
                              << to_string(op) << " expects micro-batch " << gm
                              << ": the two ranks' programs disagree on the order of that link");
  buf.pop_back();
  return Tensor::from_vector(buf, shape).to(model_.device());
}

// Runs op; returns what goes to the neighbouring stage (the output of F, the input gradient
// of B or I), undefined when nothing does.
Tensor Executor::compute(const Op& op, const Tensor& in) {
  const int gm = s_.global_mb(op.dir, op.mb);
  const bool last = next_stage(op) < 0;
  const std::pair<int, int> key{op.dir, op.mb};
  switch (op.kind) {
    case Kind::F: {
      Live lv;
      if (in.defined()) {
        lv.x = in.detach();
        lv.x.requires_grad_();
      }
      lv.y = model_.forward(s_.stage_of(r_, op.dir), gm, lv.x);
      if (last) loss_sum_ += lv.y.item();
      live_[key] = lv;
      peak_live_ = std::max(peak_live_, (int)live_.size());
      return last ? Tensor() : lv.y.detach();
    }
    case Kind::B:
    case Kind::I: {
      Live& lv = live_.at(key);
      const Tensor dy = last ? Tensor::full({}, 1.f, model_.device()) : in;
      // [slide:b-or-i]
      if (op.kind == Kind::B) {
        run_backward(lv.y, dy);
      } else {
        DeferredGrads w;
        run_backward(lv.y, dy, &w);
        deferred_.push_back({key, std::move(w)});
      }
      // [/slide]
      Tensor dx = lv.x.defined() ? lv.x.grad() : Tensor();
      lv.y = Tensor();  // the graph is no longer needed (a deferred W holds what it uses)
      if (op.kind == Kind::B) live_.erase(key);
      return dx;
    }
    case Kind::W: {
      FF_CHECK(!deferred_.empty() && deferred_.front().first == key,
               "rank " << r_ << ": " << to_string(op) << " is not the oldest deferred W");
      // [slide:w-fifo]
      const bool drop = opt_.drop_last_w && ++w_run_ == w_total_;  // the rank's last W
      if (!drop) deferred_.front().second.run();
      deferred_.pop_front();
      // [/slide]
      live_.erase(key);
      return Tensor();
    }
  }
  return Tensor();
}

void Executor::send_after(const Op& op, const Tensor& t) {
  if (op.kind == Kind::W) return;
  const int f = s_.flow_of(op.dir), gm = s_.global_mb(op.dir, op.mb);
  const bool fwd = op.kind == Kind::F;
  const int to_stage = fwd ? next_stage(op) : prev_stage(op);
  if (to_stage < 0) return;
  FF_CHECK(t.defined(), "rank " << r_ << ": " << to_string(op) << " has nothing to send");
  const int peer = s_.rank_of(f, to_stage);
  if (peer == r_) {
    (fwd ? local_acts_ : local_grads_)[gm] = t;
    return;
  }
  std::vector<float> buf = t.to_vector();
  buf.push_back((float)gm);
  outbox_.push_back(std::move(buf));
  const std::vector<float>& b = outbox_.back();
  pending_.push_back(comm_.isend(b.data(), b.size() * sizeof(float), peer,
                                 fwd ? kTagActivation : kTagGradient));
}

}  // namespace ff::pp
