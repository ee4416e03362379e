// Lesson 06 — 1F1B compute/communication overlap: the forward of one micro-batch and the
// backward of another, interleaved so that each one's all-to-all hides behind the other's
// compute.
//
// What: one transformer block per rank — causal self-attention on the rank's own tokens
//   (RMSNorm, residual; weights replicated, as data parallel) and lesson 05's DeepSeek-V3 MoE
//   over the ranks (sigmoid gate, shared expert, experts spread over the ranks; residual) —
//   trained with 1F1B over M micro-batches on this one stage: F(0), then steps F(i) & B(i-1),
//   then B(M-1). Every step has four all-to-alls: the forward's dispatch and combine and the
//   backward's (the backward of a combine is a dispatch of dy, of a dispatch a combine of dx).
//     sequential  each part after the other, every all-to-all waited for at once;
//     overlapped  seed 003's step (DeepSeek-V3 §3.2.1): two micro-batches, so that while one
//                 waits for its tokens, the other has compute to do:
//       start B's dispatch | F attention + gate | start F's dispatch | wait B's dispatch |
//       B experts          | start B's combine  | wait F's dispatch  | F experts          |
//       start F's combine  | wait B's combine   | B attention        | wait F's combine   | F end
//   and the weight gradients of B (lesson 07's W) set aside and run while a wait would idle.
// Why: in DeepSeek-V3's training the all-to-alls of expert parallelism cost about as much as
//   the compute (a 1:1 ratio across nodes); hidden behind the other micro-batch's compute
//   they cost almost nothing. It works only because 1F1B pairs an F with a B: two independent
//   pieces of work on one rank.
// Run:  make run L=06                                  (4 ranks: both modes, timelines, check)
//       make run L=06 ARGS="--progress none"           (MPI moves data only inside MPI calls)
//       make run L=06 ARGS="--prefill"                 (inference: two forwards interleaved)
// Expect: the timelines of rank 0, the hidden fraction per rank, DualPipe's bubble from the
//   measured costs, overlapped == sequential bit for bit, both == one process, check: PASS.
// This file is the lesson: the micro-batch, the six phases, the 1F1B loop with the overlapped
// step, and the driver (run each variant, report, check). Beside it: options.h (the flags),
// block.h (the block, its weights and micro-batches), progress.h (MPI progress), clock.h (the
// modelled-compute clock and the FLOPs of each phase), weight_grads.h (W set aside and its
// sums), timeline.h (what a run records and prints), run_result.h (what a run hands back),
// report.h (the report and the dumps), reference.h (one process, and the check against it).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/comm/overlap.h"
#include "common/layers/dsv3_moe.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/model.h"
#include "common/lesson/lesson.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/clock.h"
#include "lessons/06_overlap/options.h"
#include "lessons/06_overlap/progress.h"
#include "lessons/06_overlap/reference.h"
#include "lessons/06_overlap/report.h"
#include "lessons/06_overlap/run_result.h"
#include "lessons/06_overlap/weight_grads.h"

using namespace ff;
using namespace ff::f1b;

// One micro-batch in flight: what its forward keeps for its backward, and its messages.
struct MicroBatch {
  int index = 0;                // m
  Tensor x, dy;                 // input (a leaf: its .grad is dx) and the gradient of the output
  Tensor h, h_leaf, u_tape, u;  // h = x + attention(x); h_leaf: h as a leaf; u = rmsnorm(h_leaf)
  Tensor affinity, idx, gates;  // routing: s (T, N), the chosen experts and their gates (T, K)
  moe::Plan plan;
  ep::Routes routes;
  std::vector<int64_t> order;           // the arrived rows, grouped by this rank's experts
  Tensor expert_x, expert_y;            // rows at this rank's experts and their outputs
  std::vector<moe::ExpertCache> cache;  // one per local expert (the experts are the tiles)
  moe::ExpertCache shared_cache;
  Tensor shared_y, y_rows, y;  // the shared experts' output; the experts' rows back home; y
  // backward
  moe::CombineGrads combine_grads;
  Tensor expert_dy, expert_dx;
  ep::RowFlight flight;  // the all-to-all in the air (one per micro-batch at a time)
  double posted = 0;     // when it was posted
};

// The MPI tags of a micro-batch's four all-to-alls: one per kind, so that an F message and a B
// message between the same two ranks never match each other, plus the micro-batch's parity, so
// that neither do two micro-batches' messages of one kind (at most two are in flight: F(i) and
// B(i-1), or a prefill pair).
constexpr int kTagDispatch = 10, kTagCombine = 20, kTagDispatchBack = 30, kTagCombineBack = 40;

// The runner: one rank's block, its micro-batches, its messages and its clock.
class Runner {
 public:
  Runner(Comm& comm, const Setup& setup, Weights& weights, Progress& progress)
      : clock(setup, progress), weight_grads(setup, comm.size()), comm_(comm), setup_(setup),
        weights_(weights), progress_(progress), mask_(model::causal_mask(setup.tokens, setup.dev)),
        flops_(setup) {}

  PhaseClock clock;          // the phases, waits and flights of this run (its Timeline)
  WeightGrads weight_grads;  // W set aside, and the MoE's weight gradients summed

  // ---- the forward, in three named parts with an all-to-all between each
  // [slide:f-attn]
  // F attention + gate: h = x + attn(rmsnorm(x)); u = rmsnorm(h); route u; start the dispatch.
  void f_attn_gate(MicroBatch& batch) {
    const double t0 = now();
    {
      batch.h = attention_block(weights_, batch.x, setup_.heads, mask_, [this] { tick(); });
      // The MoE's backward is written by hand: its input u is cut from the tape here, and
      // the norm before it is a tape of its own from the leaf h_leaf (its backward gives dh).
      batch.h_leaf = batch.h.detach();
      batch.h_leaf.requires_grad_(true);
      batch.u_tape = rmsnorm(batch.h_leaf, weights_.g2);
      batch.u = batch.u_tape.detach();
      NoGradGuard no_grad;
      batch.affinity = dsv3::affinities(setup_.moe, weights_.full, batch.u);
      batch.idx = dsv3::select(setup_.moe, batch.affinity, weights_.full.bias).idx;
      batch.gates = dsv3::gates(setup_.moe, batch.affinity, batch.idx);
      batch.plan = moe::permute_plan(batch.idx, setup_.moe.experts);
      tick();
    }
    clock.end_phase('F', t0, flops_.attention_forward(), phase("F", batch, "attn+gate"));
    // the routing map: every rank's per-expert counts (a small allgather, blocking)
    clock.wait([&] {
      auto lock = progress_.lock();
      batch.routes = ep::gather_routes(comm_, batch.plan.group_sizes.to_index_vector(),
                                       setup_.moe.experts);
    });
    batch.order = batch.routes.regroup_order();
    NoGradGuard no_grad;
    start(batch, moe::permute(batch.u, batch.plan), /*to_experts=*/true, kTagDispatch);
  }
  // [/slide]

  // F experts: the routed experts on the rows that arrived, one expert per tile, then the
  // shared expert; start the combine (the outputs go home).
  void f_experts(MicroBatch& batch) {
    // --bug early-read: the rows taken from the receive buffer before the wait (the buffer
    // holds NaN until the finish: the mistake shows every time, not by luck)
    const Tensor early =
        setup_.early_read ? ep::take_rows(batch.flight.out, batch.order) : Tensor();
    Tensor arrived = finish(batch);
    const double t0 = now();
    NoGradGuard no_grad;
    {
      batch.expert_x = setup_.early_read ? early : ep::take_rows(arrived, batch.order);
      const std::vector<int64_t> group_sizes = batch.routes.local_group_sizes();
      std::vector<Tensor> outs;
      int64_t row = 0;
      batch.cache.assign(group_sizes.size(), moe::ExpertCache());
      for (size_t e = 0; e < group_sizes.size(); e++) {
        const Tensor one_group = Tensor::from_indices({group_sizes[e]}, {1}, setup_.dev);
        const Tensor rows = slice(batch.expert_x, 0, row, row + group_sizes[e]);
        outs.push_back(
            moe::experts_forward(local_expert(weights_, e), rows, one_group, &batch.cache[e]));
        row += group_sizes[e];
        tick();
      }
      batch.expert_y =
          outs.empty() ? Tensor::zeros({0, setup_.moe.dim}, setup_.dev) : concat(outs, 0);
      if (setup_.moe.shared > 0)
        batch.shared_y = dsv3::shared_forward(weights_.full, batch.u, &batch.shared_cache);
      tick();
    }
    clock.end_phase('F', t0, flops_.experts(batch.expert_x.size(0)) + flops_.shared(),
                    phase("F", batch, "experts"));
    start(batch, ep::put_rows(batch.expert_y, batch.order), /*to_experts=*/false, kTagCombine);
  }

  // F end: the gated sum of each token's expert outputs, the shared expert, the residual.
  void f_end(MicroBatch& batch) {
    Tensor back = finish(batch);
    const double t0 = now();
    NoGradGuard no_grad;
    {
      batch.y_rows = back;
      Tensor routed = moe::combine(batch.y_rows, batch.plan, batch.gates);
      Tensor moe_out = setup_.moe.shared > 0 ? add(routed, batch.shared_y) : routed;
      batch.y = add(batch.h.detach(), moe_out);
    }
    clock.end_phase('F', t0, flops_.combine(), phase("F", batch, "combine"));
  }

  // ---- the backward, likewise (the routes of the forward, backwards)
  // B start: the combine's backward (gates applied; dL/dg) and the dispatch of dy's rows.
  void b_start(MicroBatch& batch) {
    const double t0 = now();
    NoGradGuard no_grad;
    batch.combine_grads = moe::combine_backward(batch.dy, batch.y_rows, batch.plan, batch.gates);
    clock.end_phase('B', t0, flops_.combine_backward(), phase("B", batch, "combine bwd"));
    start(batch, batch.combine_grads.dyp, /*to_experts=*/true, kTagDispatchBack);
  }

  // B experts: each expert's input gradient now; its weight gradients set aside (W).
  void b_experts(MicroBatch& batch) {
    Tensor arrived = finish(batch);
    const double t0 = now();
    NoGradGuard no_grad;
    {
      batch.expert_dy = ep::take_rows(arrived, batch.order);
      const std::vector<int64_t> group_sizes = batch.routes.local_group_sizes();
      std::vector<Tensor> dxs;
      int64_t row = 0;
      for (size_t e = 0; e < group_sizes.size(); e++) {
        const moe::Params params = local_expert(weights_, e);
        const Tensor rows = slice(batch.expert_dy, 0, row, row + group_sizes[e]);
        moe::ExpertInputGrads input = moe::experts_backward_input(params, batch.cache[e], rows);
        dxs.push_back(input.dxp);
        weight_grads.defer(flops_.experts(group_sizes[e]),
                           [this, params, cache = batch.cache[e], input, e] {
                             weight_grads.add_expert(
                                 moe::experts_backward_weights(params, cache, input), (int64_t)e);
                           });
        row += group_sizes[e];
        tick();
      }
      batch.expert_dx =
          dxs.empty() ? Tensor::zeros({0, setup_.moe.dim}, setup_.dev) : concat(dxs, 0);
    }
    clock.end_phase('B', t0, flops_.experts(batch.expert_dy.size(0)), phase("B", batch, "experts"));
    if (!setup_.defer_w) run_w_all();  // W inline: the experts' full backward before the combine
    start(batch, ep::put_rows(batch.expert_dx, batch.order), /*to_experts=*/false, kTagCombineBack);
  }

  // B attention: the rows' dx summed per token, the router and the shared expert, the norm,
  // then the attention through the tape (its matmul weight gradients set aside).
  void b_attn(MicroBatch& batch) {
    Tensor back = finish(batch);
    const double t0 = now();
    {
      Tensor du;
      {
        NoGradGuard no_grad;
        const Tensor dx_routed = moe::unpermute_sum(back, batch.plan);
        Tensor dz = dsv3::router_dlogits(setup_.moe, batch.affinity, weights_.full.bias, batch.idx,
                                         batch.combine_grads.dgates, dsv3::BalanceStats(), 0);
        du = add(dx_routed, matmul(dz, transpose(weights_.full.router_w, 0, 1)));
        weight_grads.defer(flops_.router(), [this, u = batch.u, dz] {
          weight_grads.add_router(matmul(transpose(u, 0, 1), dz));
        });
        if (setup_.moe.shared > 0) {
          const moe::Params shared = dsv3::shared(weights_.full);
          moe::ExpertInputGrads input =
              moe::experts_backward_input(shared, batch.shared_cache, batch.dy);
          du = add(du, input.dxp);
          weight_grads.defer(flops_.shared(), [this, shared, cache = batch.shared_cache, input] {
            weight_grads.add_shared(moe::experts_backward_weights(shared, cache, input),
                                    weights_.full);
          });
        }
        tick();
      }
      // the norm before the MoE (its own small tape), then the attention's tape
      run_backward(batch.u_tape, du, &weight_grads.attention, [this] { tick(); });
      run_backward(batch.h, add(batch.dy, batch.h_leaf.grad()), &weight_grads.attention,
                   [this] { tick(); });
    }
    clock.end_phase('B', t0, flops_.router() + flops_.shared() + flops_.attention_input_backward(),
                    phase("B", batch, "attn"));
    if (!setup_.defer_w) run_w_all();
  }

  // Runs every weight gradient still set aside (the end of the run, or W inline).
  void run_w_all() {
    while (run_one_w()) {
    }
  }

 private:
  void tick() { progress_.tick(); }

  // Posts the batch's rows: to the experts (dispatch: the routes' "to" sizes) or back home
  // (combine), under its kind's tag.
  void start(MicroBatch& batch, const Tensor& rows, bool to_experts, int kind_tag) {
    const int64_t d = setup_.moe.dim;
    const std::vector<size_t> out = batch.routes.bytes(to_experts, d);
    const std::vector<size_t> in = batch.routes.bytes(!to_experts, d);
    const double t0 = now();
    {
      auto lock = progress_.lock();
      batch.flight = ep::exchange_rows_start(comm_, rows, out, in, d, kind_tag + batch.index % 2);
    }
    progress_.add(&batch.flight);
    batch.posted = t0;
  }

  // Waits for the batch's flight. With W deferred, the weight gradients set aside run first, one
  // at a time, for as long as the flight has not arrived: compute that fills the wait.
  Tensor finish(MicroBatch& batch) {
    // [slide:w-in-waits]
    if (setup_.defer_w)
      while (!progress_.arrived(&batch.flight))
        if (!run_one_w()) break;  // nothing left to fill the wait with
    Tensor out;
    clock.wait([&] { out = progress_.finish(&batch.flight); });
    // [/slide]
    clock.flight_done(batch.flight, batch.posted);
    return out;
  }

  // Runs the oldest weight gradient set aside, as a W phase (false: none was left).
  bool run_one_w() {
    if (weight_grads.empty()) return false;
    const double t0 = now();
    const double flops = weight_grads.run_next();
    clock.end_phase('W', t0, flops, "W");
    return true;
  }

  static std::string phase(const char* pass, const MicroBatch& batch, const char* what) {
    return pass + std::to_string(batch.index) + " " + what;  // "F3 experts"
  }

  Comm& comm_;
  const Setup& setup_;
  Weights& weights_;
  Progress& progress_;
  Tensor mask_;
  PhaseFlops flops_;
};

// ----------------------------------------------------------------------------
// 1F1B on one stage: F(0); then F(i) & B(i-1) for i = 1..M-1; then B(M-1). (--prefill: the
// forwards only, in pairs.) Every rank runs the same program.
static RunResult run_schedule(Comm& comm, const Setup& setup, Weights& weights, Mode mode,
                              bool prefill) {
  Setup run_setup = setup;
  if (mode == Mode::sequential) run_setup.defer_w = false, run_setup.early_read = false;
  Progress progress(comm, mode == Mode::sequential ? ProgressMode::none : setup.progress);
  Runner runner(comm, run_setup, weights, progress);
  for (Tensor* t : attention_leaves(weights)) t->zero_grad();
  const int microbatches = (int)setup.microbatches;
  std::vector<MicroBatch> batches((size_t)microbatches);  // never resized: flights held by address
  for (int m = 0; m < microbatches; m++) {
    MicroBatch& batch = batches[(size_t)m];
    batch.index = m;
    draw(setup, comm.rank(), comm.size(), m, &batch.x, &batch.dy);
    if (!prefill) batch.x.requires_grad_(true);
  }
  auto forward_pass = [&](MicroBatch& batch) {
    runner.f_attn_gate(batch), runner.f_experts(batch), runner.f_end(batch);
  };
  auto backward_pass = [&](MicroBatch& batch) {
    runner.b_start(batch), runner.b_experts(batch), runner.b_attn(batch);
  };
  RunResult result;
  auto timed = [&](std::vector<double>* into, const std::function<void()>& step) {
    const double t0 = now();
    step();
    into->push_back(now() - t0);
  };
  {
    auto lock = progress.lock();
    comm.barrier();
  }
  runner.clock.timeline.start = now();
  if (prefill) {
    NoGradGuard no_grad;
    for (int m = 0; m < microbatches; m += 2) {
      MicroBatch& first = batches[(size_t)m];
      if (m + 1 == microbatches) {
        timed(&result.f_s, [&] { forward_pass(first); });
        continue;
      }
      MicroBatch& second = batches[(size_t)m + 1];
      if (mode == Mode::sequential) {
        timed(&result.f_s, [&] { forward_pass(first); });
        timed(&result.f_s, [&] { forward_pass(second); });
      } else {
        // [slide:prefill-step]
        timed(&result.fb_s, [&] {
          runner.f_attn_gate(first);   // first's dispatch starts...
          runner.f_attn_gate(second);  // ...and hides behind second's attention
          runner.f_experts(first);     // first's combine starts...
          runner.f_experts(second);    // ...and hides behind second's experts
          runner.f_end(first);
          runner.f_end(second);
        });
        // [/slide]
      }
    }
  } else {
    timed(&result.f_s, [&] { forward_pass(batches[0]); });
    for (int i = 1; i < microbatches; i++) {
      MicroBatch &fwd = batches[(size_t)i], &bwd = batches[(size_t)i - 1];
      if (mode == Mode::sequential) {
        timed(&result.f_s, [&] { forward_pass(fwd); });
        timed(&result.b_s, [&] { backward_pass(bwd); });
      } else {
        // [slide:overlapped-step]
        // each pass's three phases, taken in DeepSeek-V3's order: overlap::kStepOrder, the
        // backward first, then turn about (lesson 08's paired steps run the same order)
        timed(&result.fb_s, [&] {
          // [exercise:overlapped-step] The overlapped step: the forward of fwd and the backward of bwd, each pass's three phases in its own order, the two passes taking turns in DeepSeek-V3's order (overlap::kStepOrder: the backward first).
          const std::function<void()> phases[2][3] = {
              {[&] { runner.f_attn_gate(fwd); },  // F attention + gate; start F's dispatch
               [&] { runner.f_experts(fwd); },    // wait F's dispatch; F experts; start F's combine
               [&] { runner.f_end(fwd); }},       // wait F's combine; F's output
              {[&] { runner.b_start(bwd); },      // start B's dispatch (dy to the experts)
               [&] { runner.b_experts(bwd); },    // wait B's dispatch; B experts; start B's combine
               [&] { runner.b_attn(bwd); }}};     // wait B's combine; B router, norm, attention
          int next[2] = {0, 0};
          for (overlap::Pass pass : overlap::kStepOrder) phases[(int)pass][next[(int)pass]++]();
          // [/exercise]
        });
        // [/slide]
      }
    }
    timed(&result.b_s, [&] { backward_pass(batches[(size_t)microbatches - 1]); });
    runner.run_w_all();  // what is still set aside
  }
  runner.clock.timeline.end = now();
  for (MicroBatch& batch : batches) {
    result.y.push_back(batch.y);
    if (!prefill) result.dx.push_back(batch.x.grad());
  }
  if (!prefill)
    for (Tensor* t : attention_leaves(weights)) result.attn_grads.push_back(t->grad().clone());
  result.grads = runner.weight_grads.sums;
  result.timeline = runner.clock.timeline;
  result.overruns = runner.clock.overruns;
  const std::vector<Event>& events = result.timeline.events;
  result.phases = (int64_t)std::count_if(events.begin(), events.end(),
                                         [](const Event& e) { return e.kind != '.'; });
  return result;
}

// Whether two runs computed the same bits: every y (and dx), every gradient.
static bool same_bits(const RunResult& a, const RunResult& b, bool prefill) {
  bool same = a.y.size() == b.y.size();
  for (size_t m = 0; same && m < a.y.size(); m++) {
    same = bitwise_equal(a.y[m], b.y[m]);
    if (!prefill) same = same && bitwise_equal(a.dx[m], b.dx[m]);
  }
  const std::vector<moe::NamedTensor> grads_a = named_grads(a), grads_b = named_grads(b);
  same = same && grads_a.size() == grads_b.size();
  for (size_t k = 0; same && k < grads_a.size(); k++)
    same = bitwise_equal(grads_a[k].t, grads_b[k].t);
  return same;
}

// ----------------------------------------------------------------------------
// The driver: the variants of the schedule, each run --reps times (the fastest timed, the first
// checked), the report, then the checks: overlapped == sequential bit for bit, and against one
// process.
static int overlap_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  Options opts;
  const Setup setup = parse_options(lesson, &opts);
  Weights weights = make_weights(setup, comm.rank(), comm.size());
  if (comm.rank() == 0) print_setup(setup, opts, comm.size());
  Comm::set_link(opts.link);
  lesson.start_trace();

  const bool prefill = opts.prefill;
  std::vector<Variant> variants = schedule_variants(opts, setup);
  double overruns = 0, phases = 0;  // compute phases that outlasted their modelled time, of all
  for (int64_t rep = 0; rep < opts.reps; rep++)
    for (Variant& v : variants) {
      Setup variant_setup = setup;
      variant_setup.defer_w = v.defer_w;
      RunResult run = run_schedule(comm, variant_setup, weights, v.mode, prefill);
      overruns += (double)run.overruns, phases += (double)run.phases;
      double wall = run.timeline.wall();
      comm.allreduce(&wall, 1, MPI_DOUBLE, MPI_MAX);
      if (v.first) v.first_result = run, v.first = false;
      if (wall < v.best_wall) v.best_wall = wall, v.best = run;
    }
  report_runs(lesson, setup, opts, variants, overruns, phases);

  // ---- the checks
  CheckReport check(comm);  // every rank compares its part; rank 0 prints the worst
  const bool both = opts.mode == "both";  // then variants: sequential, then the overlapped ones
  if (both)
    lesson.print("\noverlapped == sequential, bit for bit (%s):\n",
                 prefill ? "every output" : "every y, dx and gradient of every micro-batch");
  if (both)
    for (size_t i = 1; i < variants.size(); i++)
      check.holds((variants[i].name + " == sequential").c_str(),
                  same_bits(variants[i].first_result, variants.front().first_result, prefill));
  // against one process: the sequential run when there is one
  const Variant& checked = opts.mode == "overlapped" ? variants.back() : variants.front();
  Trace::Category check_traffic(trace(), "check");  // the reference's traffic: its own track
  check_against_reference(check, comm, setup, weights, checked.first_result, prefill,
                          checked.mode == Mode::sequential ? "sequential" : "overlapped");
  if (lesson.dumping()) dump_run(lesson, checked.first_result, setup.microbatches, prefill);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  // MPI_THREAD_SERIALIZED for --progress thread (two threads call MPI, one at a time)
  return run_lesson(argc, argv, "06_overlap", overlap_lesson, MPI_THREAD_SERIALIZED);
}
