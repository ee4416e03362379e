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
// This file is the lesson (the micro-batch, the six phases, the 1F1B loop with the overlapped
// step, the checks); beside it: options.h (the flags), progress.h (MPI progress), block.h (the
// block and its weights), reference.h (one process), timeline.h (what a run records and prints).
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/layers/dsv3_moe.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/model.h"
#include "common/layers/schedule.h"
#include "common/lesson/lesson.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/options.h"
#include "lessons/06_overlap/progress.h"
#include "lessons/06_overlap/reference.h"
#include "lessons/06_overlap/timeline.h"

using namespace ff;
using namespace ff::f1b;

// One micro-batch in flight: what its forward keeps for its backward, and its messages.
struct MicroBatch {
  int m = 0;
  Tensor x, dy;             // input (a leaf: its .grad is dx) and the gradient of the output
  Tensor h, hn, u_tape, u;  // h = x + attention(x); hn: h as a leaf; u = rmsnorm(hn)
  Tensor s, idx, gates;     // routing
  moe::Plan plan;
  ep::Routes routes;
  std::vector<int64_t> order;
  Tensor xl, yl;  // rows at this rank's experts and their outputs
  std::vector<moe::ExpertCache> cache;  // one per local expert (the experts are the tiles)
  moe::ExpertCache shared_cache;
  Tensor shared_y, yp, y;
  // backward
  moe::CombineGrads cg;
  Tensor dyl, dxl;
  ep::RowFlight flight;  // the all-to-all in the air (one per micro-batch at a time)
  double posted = 0;     // when it was posted
};

// The runner: one rank's block, its micro-batches, its messages and its clock.
class Runner {
 public:
  Runner(Comm& comm, const Setup& s, Weights& w, Progress& progress)
      : comm_(comm), s_(s), w_(w), progress_(progress), mask_(model::causal_mask(s.T, s.dev)),
        n_{(double)s.T, (double)s.c.dim, (double)s.c.ffn, (double)s.c.topk, (double)s.c.experts} {
    auto l = progress_.lock();
    trace_to_wtime_ = now() - trace().now_us() * 1e-6;
  }

  Timeline tl;
  DeferredGrads attn_w;  // the attention's matmul weight gradients, set aside (autograd's W)
  std::vector<std::pair<double, std::function<void()>>> moe_w;  // the MoE's: (FLOPs, work)
  size_t moe_w_next = 0;
  dsv3::Grads g;
  int64_t overruns = 0;  // phases whose real compute outlasted their modelled time by a tile

  // ---- the forward, in three named parts with an all-to-all between each
  // [slide:f-attn]
  // F attention + gate: h = x + attn(rmsnorm(x)); u = rmsnorm(h); route u; start the dispatch.
  void f_attn_gate(MicroBatch& b) {
    const double t0 = now();
    {
      b.h = attention_block(w_, b.x, s_.H, mask_, [this] { tick(); });
      // The MoE's backward is written by hand: its input u is cut from the tape here, and
      // the norm before it is a tape of its own from the leaf hn (its backward gives dh).
      b.hn = b.h.detach();
      b.hn.requires_grad_(true);
      b.u_tape = rmsnorm(b.hn, w_.g2);
      b.u = b.u_tape.detach();
      NoGradGuard no_grad;
      b.s = dsv3::affinities(s_.c, w_.full, b.u);
      b.idx = dsv3::select(s_.c, b.s, w_.full.bias).idx;
      b.gates = dsv3::gates(s_.c, b.s, b.idx);
      b.plan = moe::permute_plan(b.idx, s_.c.experts);
      tick();
    }
    done('F', t0, flops_attention_forward(), phase("F", b, "attn+gate"));
    // the routing map: every rank's per-expert counts (a small allgather, blocking)
    wait_span([&] {
      auto l = progress_.lock();
      b.routes = ep::gather_routes(comm_, b.plan.group_sizes.to_index_vector(), s_.c.experts);
    });
    b.order = b.routes.regroup_order();
    NoGradGuard no_grad;
    start(b, moe::permute(b.u, b.plan), /*to_experts=*/true, kDispatch);
  }
  // [/slide]

  // F experts: the routed experts on the rows that arrived, one expert per tile, then the
  // shared expert; start the combine (the outputs go home).
  void f_experts(MicroBatch& b) {
    // --bug early-read: the rows taken from the receive buffer before the wait (the buffer
    // holds NaN until the finish: the mistake shows every time, not by luck)
    const Tensor early = s_.early_read ? ep::take_rows(b.flight.out, b.order) : Tensor();
    Tensor arrived = finish(b);
    const double t0 = now();
    NoGradGuard no_grad;
    {
      b.xl = s_.early_read ? early : ep::take_rows(arrived, b.order);
      const std::vector<int64_t> gl = b.routes.local_group_sizes();
      std::vector<Tensor> outs;
      int64_t row = 0;
      b.cache.assign(gl.size(), moe::ExpertCache());
      for (size_t e = 0; e < gl.size(); e++) {
        moe::Params pe = expert(e);
        const Tensor one_group = Tensor::from_indices({gl[e]}, {1}, s_.dev);
        outs.push_back(moe::experts_forward(pe, slice(b.xl, 0, row, row + gl[e]), one_group,
                                            &b.cache[e]));
        row += gl[e];
        tick();
      }
      b.yl = outs.empty() ? Tensor::zeros({0, s_.c.dim}, s_.dev) : concat(outs, 0);
      if (s_.c.shared > 0) b.shared_y = dsv3::shared_forward(w_.full, b.u, &b.shared_cache);
      tick();
    }
    done('F', t0, flops_experts(b.xl.size(0)) + flops_shared(), phase("F", b, "experts"));
    start(b, ep::put_rows(b.yl, b.order), /*to_experts=*/false, kCombine);
  }

  // F end: the gated sum of each token's expert outputs, the shared expert, the residual.
  void f_end(MicroBatch& b) {
    Tensor back = finish(b);
    const double t0 = now();
    NoGradGuard no_grad;
    {
      b.yp = back;
      Tensor routed = moe::combine(b.yp, b.plan, b.gates);
      Tensor moe_out = s_.c.shared > 0 ? add(routed, b.shared_y) : routed;
      b.y = add(b.h.detach(), moe_out);
    }
    done('F', t0, 2.0 * n_.T * n_.K * n_.d, phase("F", b, "combine"));
  }

  // ---- the backward, likewise (the routes of the forward, backwards)
  // B start: the combine's backward (gates applied; dL/dg) and the dispatch of dy's rows.
  void b_start(MicroBatch& b) {
    const double t0 = now();
    NoGradGuard no_grad;
    b.cg = moe::combine_backward(b.dy, b.yp, b.plan, b.gates);
    done('B', t0, 4.0 * n_.T * n_.K * n_.d, phase("B", b, "combine bwd"));
    start(b, b.cg.dyp, /*to_experts=*/true, kDispatchBack);
  }

  // B experts: each expert's input gradient now; its weight gradients set aside (W).
  void b_experts(MicroBatch& b) {
    Tensor arrived = finish(b);
    const double t0 = now();
    NoGradGuard no_grad;
    {
      b.dyl = ep::take_rows(arrived, b.order);
      const std::vector<int64_t> gl = b.routes.local_group_sizes();
      std::vector<Tensor> dxs;
      int64_t row = 0;
      for (size_t e = 0; e < gl.size(); e++) {
        moe::Params pe = expert(e);
        moe::ExpertInputGrads in =
            moe::experts_backward_input(pe, b.cache[e], slice(b.dyl, 0, row, row + gl[e]));
        dxs.push_back(in.dxp);
        moe_w.push_back({flops_experts(gl[e]), [this, pe, cache = b.cache[e], in, e] {
                           moe::ExpertGrads eg = moe::experts_backward_weights(pe, cache, in);
                           add_expert_grads(eg, (int64_t)e);
                         }});
        row += gl[e];
        tick();
      }
      b.dxl = dxs.empty() ? Tensor::zeros({0, s_.c.dim}, s_.dev) : concat(dxs, 0);
    }
    done('B', t0, flops_experts(b.dyl.size(0)), phase("B", b, "experts"));
    if (!s_.defer_w) run_w_all();  // W inline: the experts' full backward before the combine
    start(b, ep::put_rows(b.dxl, b.order), /*to_experts=*/false, kCombineBack);
  }

  // B attention: the rows' dx summed per token, the router and the shared expert, the norm,
  // then the attention through the tape (its matmul weight gradients set aside).
  void b_attn(MicroBatch& b) {
    Tensor back = finish(b);
    const double t0 = now();
    {
      Tensor du;
      {
        NoGradGuard no_grad;
        const Tensor dx_routed = moe::unpermute_sum(back, b.plan);
        Tensor dz = dsv3::router_dlogits(s_.c, b.s, w_.full.bias, b.idx, b.cg.dgates,
                                         dsv3::BalanceStats(), 0);
        du = add(dx_routed, matmul(dz, transpose(w_.full.router_w, 0, 1)));
        moe_w.push_back({2.0 * n_.T * n_.d * n_.N, [this, u = b.u, dz] {
                           accumulate(g.router_w, matmul(transpose(u, 0, 1), dz));
                         }});
        if (s_.c.shared > 0) {
          const moe::Params sp = dsv3::shared(w_.full);
          moe::ExpertInputGrads in = moe::experts_backward_input(sp, b.shared_cache, b.dy);
          du = add(du, in.dxp);
          moe_w.push_back({flops_shared(), [this, sp, cache = b.shared_cache, in] {
                             moe::ExpertGrads eg = moe::experts_backward_weights(sp, cache, in);
                             accumulate(g.sw1, reshape(eg.dw1, w_.full.sw1.shape()));
                             accumulate(g.sw2, reshape(eg.dw2, w_.full.sw2.shape()));
                             accumulate(g.sw3, reshape(eg.dw3, w_.full.sw3.shape()));
                           }});
        }
        tick();
      }
      // the norm before the MoE (its own small tape), then the attention's tape
      run_backward(b.u_tape, du, &attn_w, [this] { tick(); });
      run_backward(b.h, add(b.dy, b.hn.grad()), &attn_w, [this] { tick(); });
    }
    done('B', t0, 2.0 * n_.T * n_.d * n_.N + flops_shared() + flops_attention_input_backward(),
         phase("B", b, "attn"));
    if (!s_.defer_w) run_w_all();
  }

  // Runs every weight gradient still set aside (the end of the run, or W inline).
  void run_w_all() {
    while (run_one_w()) {
    }
  }
  // The lesson's clock: steady_clock, not MPI_Wtime — under --progress thread only one thread
  // may be inside MPI at a time (MPI_THREAD_SERIALIZED), and this clock is read everywhere.
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

 private:
  enum Kind { kDispatch = 1, kCombine = 2, kDispatchBack = 3, kCombineBack = 4 };

  // Expert e of this rank, as moe's grouped GEMM wants one group.
  moe::Params expert(size_t e) const {
    moe::Params all = dsv3::routed(w_.mine);
    moe::Params pe;
    pe.w1 = slice(all.w1, 0, (int64_t)e, (int64_t)e + 1);
    pe.w2 = slice(all.w2, 0, (int64_t)e, (int64_t)e + 1);
    pe.w3 = slice(all.w3, 0, (int64_t)e, (int64_t)e + 1);
    return pe;
  }
  void tick() { progress_.tick(); }

  // Posts b's rows: to the experts (dispatch: the routes' "to" sizes) or back home (combine).
  // A tag per kind: an F and a B message between the same two ranks never match each other.
  void start(MicroBatch& b, const Tensor& rows, bool to_experts, Kind kind) {
    const int64_t d = s_.c.dim;
    const std::vector<size_t> out = b.routes.bytes(to_experts, d);
    const std::vector<size_t> in = b.routes.bytes(!to_experts, d);
    const double t0 = now();
    {
      auto l = progress_.lock();
      b.flight = ep::exchange_rows_start(comm_, rows, out, in, d, 10 * kind + b.m % 2);
    }
    progress_.add(&b.flight);
    b.posted = t0;
  }

  // Waits for b's flight. With W deferred, the weight gradients set aside run first, one at a
  // time, for as long as the flight has not arrived: compute that fills the wait.
  Tensor finish(MicroBatch& b) {
    // [slide:w-in-waits]
    if (s_.defer_w)
      while (!progress_.arrived(&b.flight))
        if (!run_one_w()) break;  // nothing left to fill the wait with
    Tensor out;
    wait_span([&] { out = progress_.finish(&b.flight); });
    // [/slide]
    // The flight ends where it was first seen complete: by a poll (Request::done_us, on the
    // trace's clock) when every message was, else within this wait.
    double end = now(), seen = 0;
    bool all_seen = !b.flight.a2a.reqs.empty();
    for (const Request& r : b.flight.a2a.reqs) {
      if (r.done_us < 0) all_seen = false;
      seen = std::max(seen, r.done_us);
    }
    if (all_seen) end = std::min(end, seen * 1e-6 + trace_to_wtime_);
    tl.flights.push_back({b.posted, end});
    return out;
  }

  void wait_span(const std::function<void()>& fn) {
    const double t0 = now();
    fn();
    tl.events.push_back({'.', t0, now()});
  }

  // The oldest weight gradient set aside: the MoE's and the attention's queues alternate by
  // micro-batch order — each keeps its own first-in first-out order, which is all the sums
  // need (every weight's gradient is summed over micro-batches in order).
  bool run_one_w() {
    if (moe_w_next == moe_w.size() && attn_w.empty()) return false;
    const double t0 = now();
    double flops = 2.0 * s_.T * s_.c.dim * s_.c.dim;  // an attention projection's dW = a^T dq
    {
      NoGradGuard no_grad;
      if (moe_w_next < moe_w.size()) {
        auto item = std::move(moe_w[moe_w_next++]);
        flops = item.first;
        item.second();
      } else {
        attn_w.run_next();
      }
    }
    done('W', t0, flops, "W");
    return true;
  }

  // ---- modelled compute (--compute modelled, the default): a phase lasts its FLOPs at the
  // modelled rate, as a message lasts its bytes at the modelled bandwidth. The phase computes
  // for real first (the checks need its results), then the rest of its modelled time passes
  // in slices of kTile — the compute tiles, between which --progress test polls the messages.
  // A phase whose real compute took longer than modelled keeps its real time (an overrun,
  // counted and reported). --compute real: phases last what they take.
  static constexpr double kTile = 100e-6;
  void done(char kind, double t0, double flops, const std::string& name) {
    // [slide:modelled-compute]
    if (s_.modelled_compute) {
      const double end = t0 + flops / s_.flops_per_s;
      if (now() > end + kTile) overruns++;  // (small phases' bookkeeping aside)
      for (double t = now(); t < end; t = now()) {
        tick();
        std::this_thread::sleep_for(std::chrono::duration<double>(std::min(kTile, end - t)));
      }
    }
    // [/slide]
    const double t1 = now();
    tl.events.push_back({kind, t0, t1});
    if (trace().enabled())  // the phase as modelled, on the trace's clock
      trace().add(name, "compute", (t0 - trace_to_wtime_) * 1e6, (t1 - trace_to_wtime_) * 1e6);
  }
  // FLOPs of the matmuls of each phase (the elementwise work is left out)
  double flops_attention_forward() const {
    const double T = (double)s_.T, d = (double)s_.c.dim, N = (double)s_.c.experts;
    return 4 * 2 * T * d * d + 2 * 2 * T * T * d + 2 * T * d * N;  // q k v o, q k^T and p v, router
  }
  double flops_attention_input_backward() const {  // dx through q k v o; dq, dk, dp, dv
    const double T = (double)s_.T, d = (double)s_.c.dim;
    return 4 * 2 * T * d * d + 4 * 2 * T * T * d;
  }
  double flops_experts(int64_t rows) const {  // SwiGLU experts of width f: three matmuls a row
    return 6.0 * n_.d * n_.f * (double)rows;
  }
  double flops_shared() const {  // a SwiGLU of width S f on T rows: three matmuls
    return 6.0 * (double)s_.T * (double)s_.c.dim * (double)(s_.c.shared * s_.c.ffn);
  }

  static void accumulate(Tensor& sum, const Tensor& t) { sum = sum.defined() ? add(sum, t) : t; }
  // An expert's weight gradients, (1, a, b) each, into rows e of the (E, a, b) sums.
  void add_expert_grads(const moe::ExpertGrads& eg, int64_t e) {
    auto into = [&](Tensor& sum, const Tensor& t) {
      if (!sum.defined()) {
        Shape shape = t.shape();
        shape[0] = s_.c.experts / comm_.size();
        sum = Tensor::zeros(shape, s_.dev);
      }
      const int64_t E = sum.size(0);
      std::vector<Tensor> pieces;
      if (e > 0) pieces.push_back(slice(sum, 0, 0, e));
      pieces.push_back(add(slice(sum, 0, e, e + 1), t));
      if (e + 1 < E) pieces.push_back(slice(sum, 0, e + 1, E));
      sum = concat(pieces, 0);
    };
    into(g.w1, eg.dw1), into(g.w2, eg.dw2), into(g.w3, eg.dw3);
  }
  static std::string phase(const char* pass, const MicroBatch& b, const char* what) {
    return pass + std::to_string(b.m) + " " + what;  // "F3 experts"
  }

  Comm& comm_;
  const Setup& s_;
  Weights& w_;
  Progress& progress_;
  Tensor mask_;
  struct {
    double T, d, f, K, N;
  } n_;  // the sizes, for the FLOP counts
  // now() - the trace clock's seconds: Request::done_us is on the trace's clock (MPI_Wtime, so
  // read under the progress lock)
  double trace_to_wtime_ = 0;
};

// ----------------------------------------------------------------------------
// The schedules on this stage.
enum class Mode { sequential, overlapped };

struct RunResult {
  std::vector<Tensor> y, dx;        // per micro-batch
  std::vector<Tensor> attn_grads;   // kAttentionNames' order
  dsv3::Grads g;
  Timeline tl;
  std::vector<double> f_s, b_s, fb_s;  // durations of lone F steps, lone B steps, F&B steps
  int64_t overruns = 0, phases = 0;    // compute phases that outlasted their modelled time, of all
};

// 1F1B on one stage: F(0); then F(i) & B(i-1) for i = 1..M-1; then B(M-1). (--prefill: the
// forwards only, in pairs.) Every rank runs the same program.
static RunResult run_schedule(Comm& comm, const Setup& s, Weights& w, Mode mode, bool prefill) {
  Setup ss = s;
  if (mode == Mode::sequential) ss.defer_w = false, ss.early_read = false;
  Progress progress(comm, mode == Mode::sequential ? ProgressMode::none : s.progress);
  Runner run(comm, ss, w, progress);
  for (Tensor* t : attention_leaves(w)) t->zero_grad();
  std::vector<MicroBatch> mbs((size_t)s.M);  // not resized below: flights are held by address
  for (int m = 0; m < (int)s.M; m++) {
    MicroBatch& b = mbs[(size_t)m];
    b.m = m;
    draw(s, comm.rank(), comm.size(), m, &b.x, &b.dy);
    if (!prefill) b.x.requires_grad_(true);
  }
  auto F = [&](MicroBatch& b) { run.f_attn_gate(b), run.f_experts(b), run.f_end(b); };
  auto B = [&](MicroBatch& b) { run.b_start(b), run.b_experts(b), run.b_attn(b); };
  RunResult r;
  auto timed = [&](std::vector<double>* into, const std::function<void()>& fn) {
    const double t0 = run.now();
    fn();
    into->push_back(run.now() - t0);
  };
  {
    auto l = progress.lock();
    comm.barrier();
  }
  run.tl.start = run.now();
  if (prefill) {
    NoGradGuard no_grad;
    for (int m = 0; m < (int)s.M; m += 2) {
      MicroBatch& a = mbs[(size_t)m];
      if (m + 1 == (int)s.M) {
        timed(&r.f_s, [&] { F(a); });
        continue;
      }
      MicroBatch& b = mbs[(size_t)m + 1];
      if (mode == Mode::sequential) {
        timed(&r.f_s, [&] { F(a); });
        timed(&r.f_s, [&] { F(b); });
      } else {
        // [slide:prefill-step]
        timed(&r.fb_s, [&] {
          run.f_attn_gate(a);  // a's dispatch starts...
          run.f_attn_gate(b);  // ...and hides behind b's attention
          run.f_experts(a);    // a's combine starts...
          run.f_experts(b);    // ...and hides behind b's experts
          run.f_end(a);
          run.f_end(b);
        });
        // [/slide]
      }
    }
  } else {
    timed(&r.f_s, [&] { F(mbs[0]); });
    for (int i = 1; i < (int)s.M; i++) {
      MicroBatch &f = mbs[(size_t)i], &b = mbs[(size_t)i - 1];
      if (mode == Mode::sequential) {
        timed(&r.f_s, [&] { F(f); });
        timed(&r.b_s, [&] { B(b); });
      } else {
        // [slide:overlapped-step]
        timed(&r.fb_s, [&] {
          run.b_start(b);      // start B's dispatch (dy to the experts)
          run.f_attn_gate(f);  // F attention + gate; start F's dispatch
          run.b_experts(b);    // wait B's dispatch; B experts; start B's combine
          run.f_experts(f);    // wait F's dispatch; F experts; start F's combine
          run.b_attn(b);       // wait B's combine; B router, norm, attention
          run.f_end(f);        // wait F's combine; F's output
        });
        // [/slide]
      }
    }
    timed(&r.b_s, [&] { B(mbs[(size_t)s.M - 1]); });
    run.run_w_all();  // what is still set aside
  }
  run.tl.end = run.now();
  for (MicroBatch& b : mbs) {
    r.y.push_back(b.y);
    if (!prefill) r.dx.push_back(b.x.grad());
  }
  if (!prefill)
    for (Tensor* t : attention_leaves(w)) r.attn_grads.push_back(t->grad().clone());
  r.g = run.g;
  r.tl = run.tl;
  r.overruns = run.overruns;
  r.phases = (int64_t)std::count_if(r.tl.events.begin(), r.tl.events.end(),
                                    [](const Event& e) { return e.kind != '.'; });
  return r;
}

// Every gradient a run computed on this rank (before any sum over ranks), named as the dumps.
using NamedGrad = std::pair<std::string, Tensor>;
static std::vector<NamedGrad> named_grads(const RunResult& r) {
  std::vector<NamedGrad> out;
  for (size_t k = 0; k < r.attn_grads.size(); k++)
    out.push_back({std::string("d") + kAttentionNames[k], r.attn_grads[k]});
  const std::pair<const char*, const Tensor*> moe_grads[] = {
      {"d_router_w", &r.g.router_w}, {"d_w1", &r.g.w1},           {"d_w2", &r.g.w2},
      {"d_w3", &r.g.w3},             {"d_shared_w1", &r.g.sw1}, {"d_shared_w2", &r.g.sw2},
      {"d_shared_w3", &r.g.sw3}};
  for (const auto& [name, t] : moe_grads)
    if (t->defined()) out.push_back({name, *t});
  return out;
}

static int overlap_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();
  Options o;
  const Setup s = parse_options(lesson, &o);
  const dsv3::Config& c = s.c;
  const std::string &mode = o.mode, &progress = o.progress;
  const double gflops = o.gflops;
  const int64_t R = o.R, reps = o.reps;
  const bool prefill = o.prefill;
  const LinkModel& link = o.link;
  const int64_t T = s.T, d = c.dim, K = c.topk, M = s.M;
  Weights w = make_weights(s, rank, P);
  if (rank == 0)
    std::printf("== 06 overlap: P=%d ranks (%lld per virtual node), %lld micro-batches of %lld tokens "
                "per rank, d=%lld, %lld heads, %lld experts (%lld per rank), top-%lld, %lld shared, "
                "%s, progress %s, device %s\n%s (modelled: waits last until the modelled time)\n"
                "%s\n",
                P, (long long)R, (long long)M, (long long)T, (long long)d, (long long)s.H,
                (long long)c.experts, (long long)(c.experts / P), (long long)K, (long long)c.shared,
                prefill ? "prefill (forwards only)" : "1F1B", progress.c_str(), device_name(s.dev),
                describe(link).c_str(),
                s.modelled_compute
                    ? ("modelled compute: " + fmt_num(gflops) + " GFLOP/s per rank (each phase computes, then "
                       "lasts its matmul FLOPs at that rate)").c_str()
                    : "compute not modelled: phases last what they take on this machine");
  Comm::set_link(link);
  lesson.start_trace();

  const bool run_seq = mode != "overlapped", run_ovl = mode != "sequential";
  // --mode both also runs the overlapped step with the weight gradients inline, to show what
  // deferring them buys.
  struct Variant {
    std::string name, key;  // as printed; in the CSV
    Mode mode = Mode::sequential;
    bool defer_w = false;
    RunResult best;
    double best_wall = 1e300;
    bool first = true;
    RunResult first_result;
  };
  std::vector<Variant> variants;
  auto variant = [&](const std::string& name, Mode m, bool defer_w) {
    Variant v;
    v.name = name, v.mode = m, v.defer_w = defer_w;
    v.key = m == Mode::sequential ? "sequential"
            : prefill             ? "overlapped"
            : defer_w             ? "overlapped-w-in-waits"
                                  : "overlapped-w-inline";
    variants.push_back(v);
  };
  if (run_seq) variant("sequential", Mode::sequential, false);
  if (run_ovl && mode == "both" && !prefill)
    variant("overlapped, W inline", Mode::overlapped, false);
  if (run_ovl)
    variant(prefill ? "overlapped" : s.defer_w ? "overlapped, W in waits" : "overlapped, W inline",
            Mode::overlapped, !prefill && s.defer_w);
  double overrun[2] = {0, 0};  // phases that outlasted their modelled time, phases in all
  for (int64_t rep = 0; rep < reps; rep++)
    for (Variant& v : variants) {
      Setup sv = s;
      sv.defer_w = v.defer_w;
      RunResult r = run_schedule(comm, sv, w, v.mode, prefill);
      overrun[0] += (double)r.overruns, overrun[1] += (double)r.phases;
      double wall = r.tl.wall();
      comm.allreduce(&wall, 1, MPI_DOUBLE, MPI_MAX);
      if (v.first) v.first_result = r, v.first = false;
      if (wall < v.best_wall) v.best_wall = wall, v.best = r;
    }

  comm.allreduce(overrun, 2, MPI_DOUBLE, MPI_SUM);
  if (rank == 0 && s.modelled_compute && overrun[0] > 0)
    std::printf("note: %.0f of %.0f compute phases took over 0.1 ms longer for real than modelled at %g GFLOP/s "
                "(this machine, or its share of it, is slower): their timings are real ones; a "
                "lower --gflops keeps every phase modelled\n", overrun[0], overrun[1], gflops);
  // ---- the timelines of rank 0, on one time scale, and per rank the compute, the waiting and
  // the hidden fraction
  std::vector<std::string> names, keys;
  std::vector<Timeline> best;
  for (const Variant& v : variants) names.push_back(v.name), keys.push_back(v.key), best.push_back(v.best.tl);
  if (rank == 0) std::printf("%s", timelines_text(names, best, reps).c_str());
  std::vector<RankTimes> times;
  for (const Timeline& tl : best) times.push_back(gather_times(comm, tl));
  if (run_seq && run_ovl) print_hidden_fraction(times, rank == 0);
  // ---- the measured costs in lesson 07's simulator: why DualPipe pairs F with B
  if (run_seq && run_ovl && !prefill && M >= 2) {
    // F&B with the whole backward in it (W inline, when that variant ran): B = I + W, as in
    // lesson 07's costs
    const RunResult &sq = variants.front().best, &ov = variants[1].best;
    double cost[4] = {mean(sq.f_s), mean(sq.b_s), sq.tl.total('W') / (double)M, mean(ov.fb_s)};
    comm.allreduce(cost, 4, MPI_DOUBLE, MPI_MAX);
    pp::Costs pc;
    pc.F = 1.0, pc.B = cost[1] / cost[0], pc.W = std::min(cost[2] / cost[0], pc.B * 0.99);
    pc.FB = cost[3] / cost[0];
    if (rank == 0) {
      std::printf("\nmeasured costs (slowest rank): F = %.1f ms, B = %.2f F, W = %.2f F, F&B = %.2f F "
                  "(F + B = %.2f F)\n", cost[0] * 1e3, pc.B, pc.W, pc.FB, 1 + pc.B);
      const int Pp = 8, Mp = 20;
      for (const char* name : {"1f1b", "dualpipe"}) {
        pp::Simulation sim = pp::simulate(pp::make_schedule(name, Pp, Mp), pc);
        std::printf("  lesson 07's simulator, P=%d, M=%d: %-8s bubble %5.1f F (%4.1f%% of %.1f F)\n", Pp,
                    Mp, name, sim.bubble(), 100 * sim.bubble_ratio(), sim.makespan);
      }
    }
  }
  if (!prefill)
    lesson.csv_append("mode,rank,progress,inter_MBps,intra_MBps,wall_ms,compute_ms,wait_ms",
                      times_csv(keys, times, progress, link));

  // ---- the checks
  CheckReport check(comm);  // every rank compares its part; rank 0 prints the worst
  if (rank == 0 && run_seq && run_ovl)
    std::printf("\noverlapped == sequential, bit for bit (%s):\n",
                prefill ? "every output" : "every y, dx and gradient of every micro-batch");
  const RunResult* seq = run_seq ? &variants.front().first_result : nullptr;
  if (run_seq && run_ovl)
    for (size_t i = 1; i < variants.size(); i++) {
      const RunResult& ov = variants[i].first_result;
      bool same = true;
      for (int64_t m = 0; m < M; m++) {
        same = same && bitwise_equal(ov.y[(size_t)m], seq->y[(size_t)m]);
        if (!prefill) same = same && bitwise_equal(ov.dx[(size_t)m], seq->dx[(size_t)m]);
      }
      const std::vector<NamedGrad> a = named_grads(ov), b = named_grads(*seq);
      same = same && a.size() == b.size();
      for (size_t k = 0; same && k < a.size(); k++) same = bitwise_equal(a[k].second, b[k].second);
      check.holds((variants[i].name + " == sequential").c_str(), same);
    }
  const RunResult& got = seq ? *seq : variants.back().first_result;
  Trace::Category check_traffic(trace(), "check");  // the reference's traffic: its own track
  Reference ref = reference(comm, s, w, prefill);
  // Tolerances, as lessons 04 and 05: float32 sums of at most n terms in another order (the
  // reference's experts run as one grouped GEMM over N + 1 groups, the distributed ones one
  // expert at a time; the gradients are summed over micro-batches and ranks in another order)
  // differ by at most about n eps times the values summed: 4 n eps max|want|.
  const double eps = FLT_EPSILON;
  const double n = (double)(M * P * T * K + T + d + c.ffn * std::max<int64_t>(c.shared, 1) + c.experts);
  auto tol = [&](const Tensor& t) {  // the same on every rank: the largest value anywhere
    double m = max_abs(t);
    comm.allreduce(&m, 1, MPI_DOUBLE, MPI_MAX);
    return 4.0 * n * eps * std::max(m, 1e-3);
  };
  if (rank == 0)
    std::printf("%s vs one process holding every expert (every micro-batch; gradients summed over "
                "ranks):\n", run_seq ? "sequential" : "overlapped");
  std::vector<Tensor> ys, rys, dxs, rdxs;
  for (int64_t m = 0; m < M; m++) {
    ys.push_back(reshape(got.y[(size_t)m], {1, T, d}));
    rys.push_back(reshape(ref.y[(size_t)m], {1, T, d}));
    if (prefill) continue;
    dxs.push_back(reshape(got.dx[(size_t)m], {1, T, d}));
    rdxs.push_back(reshape(ref.dx[(size_t)m], {1, T, d}));
  }
  check.close("y", concat(ys, 0), concat(rys, 0), tol(concat(rys, 0)));
  if (!prefill) {
    check.close("dx", concat(dxs, 0), concat(rdxs, 0), tol(concat(rdxs, 0)));
    for (size_t k = 0; k < got.attn_grads.size(); k++) {
      Tensor gk = got.attn_grads[k].clone();
      comm.allreduce_sum(gk);
      check.close((std::string("d ") + kAttentionNames[k]).c_str(), gk, ref.attn_grads[k],
                  tol(ref.attn_grads[k]));
    }
    const int64_t E = c.experts / P;
    dsv3::Grads g = got.g;
    for (Tensor* t : {&g.router_w, &g.sw1, &g.sw2, &g.sw3})
      if (t->defined()) *t = t->clone(), comm.allreduce_sum(*t);
    auto mine = [&](const Tensor& t) { return slice(t, 0, rank * E, (rank + 1) * E); };
    check.close("d router_w", g.router_w, ref.g.router_w, tol(ref.g.router_w));
    check.close("d w1 (each rank its experts)", g.w1, mine(ref.g.w1), tol(ref.g.w1));
    check.close("d w2 (each rank its experts)", g.w2, mine(ref.g.w2), tol(ref.g.w2));
    check.close("d w3 (each rank its experts)", g.w3, mine(ref.g.w3), tol(ref.g.w3));
    if (c.shared > 0) {
      check.close("d shared w1", g.sw1, ref.g.sw1, tol(ref.g.sw1));
      check.close("d shared w2", g.sw2, ref.g.sw2, tol(ref.g.sw2));
      check.close("d shared w3", g.sw3, ref.g.sw3, tol(ref.g.sw3));
    }
  }
  // --dump: what this rank computed (before any sum over ranks), for a byte-for-byte
  // comparison of two runs (tests/lessons.sh: sequential against overlapped)
  if (lesson.dumping()) {
    const std::string me = "_rank" + std::to_string(rank);
    for (int64_t m = 0; m < M; m++) {
      const std::string tag = me + "_mb" + std::to_string(m);
      lesson.dump("y" + tag, got.y[(size_t)m]);
      if (!prefill) lesson.dump("dx" + tag, got.dx[(size_t)m]);
    }
    for (const NamedGrad& g : named_grads(got)) lesson.dump(g.first + me, g.second);
  }
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  // MPI_THREAD_SERIALIZED for --progress thread (two threads call MPI, one at a time)
  return run_lesson(argc, argv, "06_overlap", overlap_lesson, MPI_THREAD_SERIALIZED);
}
