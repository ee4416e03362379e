// Lesson 07 — pipeline schedules from GPipe to DualPipe: schedules as data, a simulator, and
// a real MPI executor whose gradients equal the single-process run.
//
// What: a model of L residual blocks (RMSNorm -> Linear -> SiLU -> Linear, + x) is cut into
//   stages, one per rank (two per rank for DualPipe and DualPipeV). A batch is split into M
//   micro-batches; a schedule says, for each rank, in which order it runs the forwards (F),
//   backwards (B), input-only backwards (I) and deferred weight gradients (W) of each
//   micro-batch. The schedules themselves are data, built in schedules.cpp (this folder):
//     gpipe      all forwards, then all backwards
//     1f1b       warm-up forwards, then one forward / one backward, then the cool-down
//     zb-h1      1F1B with B split into I and W, W's pushed into the cool-down bubble
//     zb-h2      ZB-H1 with more warm-up forwards and W's at the tail: a parallelogram, 2P-1 live
//     dualpipe   micro-batches enter at both ends; forward & backward pairs overlap
//     dualpipev  DualPipe folded in a V: one direction, two stages per rank
//   The executor (common/layers/pipeline.cpp, which lesson 08 reuses) walks the rank's
//   program, receives the activation (or the gradient) an op needs from the neighbouring
//   stage, runs it through the core's autograd, and sends what the next op elsewhere needs.
//   An I runs the backward with the weight gradients deferred (run_backward(..., &deferred));
//   its W runs them, first in first out. This file gives it the model, cut into stages.
// Why: the bubble — the time a rank waits for its neighbours — is the cost of pipeline
//   parallelism; each schedule trades memory and complexity to remove some of it.
// Run:  make run L=07 NP=4
//       make run L=07 NP=4 ARGS="--schedule 1f1b --microbatches 8"
//       make run L=07 NP=1 ARGS="--print-schedule --schedule dualpipe --stages 8 --microbatches 20"
//       make run L=07 NP=1 ARGS="--simulate"
// Expect: the schedule, the measured bubble of each rank next to the simulator's and the
//   formula's, loss and every parameter gradient against the single-process run, "check: PASS".
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/util/files.h"
#include "common/lesson/lesson.h"
#include "common/layers/pipeline.h"
#include "lessons/07_dualpipe/schedules.h"

using namespace ff;

using pp::Kind;
using pp::Op;
using pp::Schedule;
using pp::Step;

// ----------------------------------------------------------------------------
// The model: block l is  y = x + silu(rmsnorm(x, g_l) @ w1_l) @ w2_l, hidden width 2 dim.
// Every rank can build any layer's parameters from the seed (counter-based RNG), so a stage
// and its copy on another rank (DualPipe) start bit-identical.

struct Layer {
  Tensor g, w1, w2;
};

struct ModelConfig {
  int64_t layers = 8, dim = 32, rows = 4;  // rows per micro-batch
  uint64_t seed = 1234;
  Device dev = Device::cpu;
};

static Layer make_layer(const ModelConfig& mc, int64_t l) {
  NoGradGuard no_grad;
  const int64_t d = mc.dim, h = 2 * mc.dim;
  Layer L;
  L.g = add_scalar(scale(randn({d}, mc.seed + 100 + (uint64_t)l), 0.1f), 1.f).to(mc.dev);
  L.w1 = scale(randn({d, h}, mc.seed + 200 + (uint64_t)l), 1.f / std::sqrt((float)d)).to(mc.dev);
  L.w2 = scale(randn({h, d}, mc.seed + 300 + (uint64_t)l), 1.f / std::sqrt((float)h)).to(mc.dev);
  for (Tensor* t : {&L.g, &L.w1, &L.w2}) t->requires_grad_();
  return L;
}

static Tensor run_layers(const std::vector<Layer>& layers, Tensor x) {
  for (const Layer& L : layers) x = x + matmul(silu(matmul(rmsnorm(x, L.g), L.w1)), L.w2);
  return x;
}

// Micro-batch gm (0..M-1): its input rows and regression targets, rows [gm R, (gm+1) R) of
// one global (M R, dim) tensor each.
static Tensor mb_input(const ModelConfig& mc, int64_t M, int gm) {
  return randn_slice({M * mc.rows, mc.dim}, 0, gm * mc.rows, (gm + 1) * mc.rows, mc.seed + 1).to(mc.dev);
}
static Tensor mb_target(const ModelConfig& mc, int64_t M, int gm) {
  return randn_slice({M * mc.rows, mc.dim}, 0, gm * mc.rows, (gm + 1) * mc.rows, mc.seed + 2).to(mc.dev);
}
// The loss of the batch is the mean over micro-batches of each one's mean squared error.
static Tensor mb_loss(const Tensor& y, const Tensor& target, int64_t M) {
  Tensor d = y - target;
  return sum_all(d * d) * (1.f / (float)(y.numel() * M));
}

// ----------------------------------------------------------------------------
// The executor (common/layers/pipeline.h: receive, compute, send, for each step of the rank's
// program; an I defers its weight gradients to its W) runs this model, cut into stages.

enum class Bug { none, drop_w, no_copy_sum };

struct Options {
  bool sleep = true;      // --compute sleep: each op lasts its cost in units of unit_ms
  double unit_ms = 10;
  pp::Costs costs;
  Bug bug = Bug::none;
};

// The stages this rank holds (one, or two for DualPipe and DualPipeV), L / S layers each.
class Stages : public pp::StageModel {
 public:
  Stages(int rank, const Schedule& s, const ModelConfig& mc) : s_(s), mc_(mc) {
    const int64_t per_stage = mc.layers / s.num_stages();
    for (int d = 0; d < (s.layout == pp::Layout::line ? 1 : 2); d++) {
      Chunk c;
      c.dir = d;
      c.stage = s.stage_of(rank, d);
      for (int64_t l = c.stage * per_stage; l < (c.stage + 1) * per_stage; l++)
        c.layers.push_back(make_layer(mc, l));
      chunks_.push_back(std::move(c));
    }
  }
  struct Chunk {
    int dir = 0, stage = 0;
    std::vector<Layer> layers;
  };
  const std::vector<Chunk>& chunks() const { return chunks_; }

  Tensor forward(int stage, int gm, const Tensor& x) override {
    const Chunk& c = chunks_[chunks_.size() == 1 || chunks_[0].stage == stage ? 0 : 1];
    Tensor y = run_layers(c.layers, x.defined() ? x : mb_input(mc_, s_.M, gm));
    if (stage + 1 == s_.num_stages()) y = mb_loss(y, mb_target(mc_, s_.M, gm), s_.M);
    return y;
  }
  Shape boundary_shape(int, int) const override { return {mc_.rows, mc_.dim}; }
  Device device() const override { return mc_.dev; }

 private:
  const Schedule& s_;
  const ModelConfig& mc_;
  std::vector<Chunk> chunks_;
};

// ----------------------------------------------------------------------------
// The simulator's table (--simulate)

static void print_simulation_table(const pp::Costs& c) {
  std::printf("== simulated bubbles, costs %s (B = I + W, FB = an overlapped F&B pair)\n",
              pp::to_string(c).c_str());
  std::printf("   bubble: the largest idle time of a rank (makespan - its busy time); "
              "formula: DeepSeek-V3 Table 2\n");
  std::printf("%-10s %3s %4s %9s %8s %9s  %-20s %8s %10s\n", "schedule", "P", "M", "makespan",
              "bubble", "formula", "(formula)", "ratio", "peak live");
  for (const std::string& name : pp::schedule_names())
    for (int P : {4, 8})
      for (int M : {2 * P, 20, 64}) {
        if (!pp::check_args(name, P, M).empty()) continue;
        pp::Simulation sim = pp::simulate(pp::make_schedule(name, P, M), c);
        pp::Formula f = pp::formula_bubble(name, P, c);
        char fv[32] = "-";
        if (f.has) std::snprintf(fv, sizeof fv, "%g", f.bubble);
        std::printf("%-10s %3d %4d %9g %8g %9s  %-20s %7.1f%% %10d\n", name.c_str(), P, M,
                    sim.makespan, sim.bubble(), fv, f.has ? f.text.c_str() : "", 100 * sim.bubble_ratio(),
                    *std::max_element(sim.peak_live.begin(), sim.peak_live.end()));
      }
  std::printf("   * dualpipev has no row in Table 2: the formula shown is DualPipe's for 2P stages\n");
  std::printf("   ** zb-h2: Qi et al.'s Table 2, for iterations run back to back (Simulation::inner_bubble);"
              " one iteration adds the slant (P-1)F\n");

  std::printf("== forwards each rank runs before its first backward, P = 8, M = 16\n");
  for (const std::string& name : pp::schedule_names()) {
    pp::Simulation sim = pp::simulate(pp::make_schedule(name, 8, 16), c);
    std::printf("%-10s", name.c_str());
    for (int w : sim.warmup) std::printf(" %3d", w);
    std::printf("\n");
  }
  std::printf("   the slide formula P//2 + (M-1)*2 gives %d at P = 8, M = 16: more forwards than\n"
              "   a rank has micro-batches (dualpipe runs 8 per direction, 16 in all)\n", 8 / 2 + 15 * 2);
  auto ratio = [&](const char* name, int P, int M) {
    return 100 * pp::simulate(pp::make_schedule(name, P, M), c).bubble_ratio();
  };
  std::printf("== \"DualPipe cuts the bubble from 47%% to 3%%\", at these costs:\n");
  std::printf("   1f1b     P=8 M=8  %5.1f%%   M=16 %5.1f%%   M=64 %5.1f%%\n", ratio("1f1b", 8, 8),
              ratio("1f1b", 8, 16), ratio("1f1b", 8, 64));
  std::printf("   dualpipe P=8 M=16 %5.1f%%   M=32 %5.1f%%   M=64 %5.1f%%\n", ratio("dualpipe", 8, 16),
              ratio("dualpipe", 8, 32), ratio("dualpipe", 8, 64));

}

// Bubble ratio vs M at P = 8 for every schedule, as CSV (for the figure).
static std::string simulation_csv(const pp::Costs& c) {
  std::string text = "schedule,P,M,makespan,bubble,ratio\n";
  for (const std::string& name : pp::schedule_names())
    for (int M = 8; M <= 64; M += 2) {
      if (!pp::check_args(name, 8, M).empty()) continue;
      pp::Simulation sim = pp::simulate(pp::make_schedule(name, 8, M), c);
      char line[128];
      std::snprintf(line, sizeof line, "%s,8,%d,%g,%g,%g\n", name.c_str(), M, sim.makespan,
                    sim.bubble(), sim.bubble_ratio());
      text += line;
    }
  return text;
}

// The bubble of every rank: busy and idle time (in cost units with --compute sleep, else ms:
// unit_us microseconds each), the idle fraction measured, simulated and by Table 2's formula,
// and the peak of live activations (the simulator's in brackets). Every rank's numbers, on rank 0.
static void print_bubble_table(const pp::Formula& formula, const pp::Simulation& sim,
                               const std::vector<double>& all_busy, const std::vector<double>& all_peak,
                               const std::vector<double>& all_over, double makespan_us, double unit_us,
                               bool sleep) {
  const int P = (int)all_busy.size();
  std::printf("bubble per rank (%s): idle = makespan - busy; simulator at --cost; formula %s\n",
              sleep ? "in cost units" : "in ms", formula.has ? formula.text.c_str() : "-");
  std::printf("  rank   busy    idle  measured  simulated  formula   peak live (sim)\n");
  for (int r = 0; r < P; r++) {
    double idle = (makespan_us - all_busy[(size_t)r]) / unit_us;
    char fr[16] = "     -";
    if (formula.has)
      std::snprintf(fr, sizeof fr, "%5.1f%%", 100 * formula.bubble / (formula.bubble + sim.busy[(size_t)r]));
    std::printf("  %4d %6.1f %7.1f %8.1f%% %9.1f%% %8s %7d (%d)\n", r, all_busy[(size_t)r] / unit_us,
                idle, 100 * idle * unit_us / makespan_us, 100 * sim.idle[(size_t)r] / sim.makespan, fr,
                (int)all_peak[(size_t)r], sim.peak_live[(size_t)r]);
  }
  std::printf("  makespan %.1f (simulated %g)\n", makespan_us / unit_us, sim.makespan);
  int over = 0;
  for (double o : all_over) over += (int)o;
  if (sleep && over > 0)
    std::printf("  note: %d ops took longer than their cost (the machine is busy); raise --unit-ms\n", over);
}

// --dump: per stage, the parameters and the pipeline's gradients (DualPipe: summed copies, from
// the direction-0 copy); rank 0 adds the inputs, targets, the loss and the run's sizes.
static void dump_run(Lesson& lesson, const Stages& model, const std::vector<std::vector<Tensor>>& grads,
                     const Schedule& s, const std::string& schedule, const ModelConfig& mc, int M,
                     double loss) {
  const int64_t per_stage = mc.layers / s.num_stages();
  const auto& ch = model.chunks();
  for (size_t c = 0; c < ch.size(); c++) {
    if (s.layout == pp::Layout::dual && c == 1) continue;  // the other copy of a stage
    for (int64_t i = 0; i < per_stage; i++) {
      int64_t l = ch[c].stage * per_stage + i;
      const Layer& L = ch[c].layers[(size_t)i];
      std::string p = "layer" + std::to_string(l) + "_";
      lesson.dump(p + "g", L.g.detach().to(Device::cpu));
      lesson.dump(p + "w1", L.w1.detach().to(Device::cpu));
      lesson.dump(p + "w2", L.w2.detach().to(Device::cpu));
      lesson.dump(p + "dg", grads[c][(size_t)(3 * i)]);
      lesson.dump(p + "dw1", grads[c][(size_t)(3 * i + 1)]);
      lesson.dump(p + "dw2", grads[c][(size_t)(3 * i + 2)]);
    }
  }
  if (lesson.rank() == 0) {
    lesson.dump("x", randn({M * mc.rows, mc.dim}, mc.seed + 1));
    lesson.dump("target", randn({M * mc.rows, mc.dim}, mc.seed + 2));
    lesson.dump("loss", Tensor::from_vector({(float)loss}, {}));
    char meta[256];
    std::snprintf(meta, sizeof meta,
                  "{\"schedule\": \"%s\", \"P\": %d, \"M\": %d, \"layers\": %lld, \"dim\": %lld, "
                  "\"rows\": %lld, \"eps\": 1e-5}\n", schedule.c_str(), s.P, M, (long long)mc.layers,
                  (long long)mc.dim, (long long)mc.rows);
    lesson.dump_text("meta.json", meta);
  }
}

// What runs: the schedule and the model, each rank's program (the first 8), and the timing.
static void print_header(const Schedule& s, const std::string& schedule, const ModelConfig& mc,
                         const Options& opt, double unit_ms) {
  std::printf("== 07 pipeline: %s, P=%d ranks, %d stages, M=%d micro-batches, %lld blocks of "
              "width %lld (%lld rows per micro-batch), device %s\n",
              schedule.c_str(), s.P, s.num_stages(), s.M, (long long)mc.layers, (long long)mc.dim,
              (long long)mc.rows, device_name(mc.dev));
  for (int r = 0; r < std::min(s.P, 8); r++) {
    std::string line = pp::format_rank(s, r);
    std::printf("  %s\n", line.size() > 150 ? (line.substr(0, 147) + "...").c_str() : line.c_str());
  }
  if (opt.sleep)
    std::printf("timing: --compute sleep, each op lasts its cost x %g ms (%s)\n", unit_ms,
                pp::to_string(opt.costs).c_str());
  else
    std::printf("timing: --compute real, each op lasts what its kernels take\n");
}

// ----------------------------------------------------------------------------

static int dualpipe_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), world = comm.size();
  std::string schedule = "dualpipe", compute = "sleep", cost_text = "F=1,B=2,W=1,FB=3,comm=0";
  std::string bug = "none";
  int64_t stages = 0, micro = 0;
  bool print_schedule = false, do_simulate = false;
  double unit_ms = 10;
  ModelConfig mc;
  mc.layers = 0;
  Cli& cli = lesson.cli;
  cli.summary("Pipeline schedules (gpipe, 1f1b, zb-h1, zb-h2, dualpipe, dualpipev) as data: printed,\n"
              "simulated, and executed on P ranks with gradients checked against one process.");
  cli.choice("--schedule", &schedule, pp::schedule_names(), "the schedule");
  cli.flag("--stages", &stages, "P, pipeline ranks (0 = the world size)", 0, 1024);
  cli.flag("--microbatches", &micro, "M, micro-batches per step (0 = 2P)", 0, 4096);
  cli.toggle("--print-schedule", &print_schedule, "print each rank's program and exit");
  cli.toggle("--simulate", &do_simulate, "print the simulator's table for every schedule and exit");
  cli.choice("--compute", &compute, {"real", "sleep"},
             "op timing: the kernels alone, or stretched to --cost x --unit-ms");
  cli.flag("--cost", &cost_text, "op costs for --simulate and --compute sleep", "K=V,...");
  cli.flag("--unit-ms", &unit_ms, "milliseconds per cost unit with --compute sleep", 0.1, 10000);
  cli.flag("--layers", &mc.layers, "blocks in the model, a multiple of the stages (0 = 2 per stage)", 0, 4096);
  cli.flag("--dim", &mc.dim, "model width (the hidden layer is 2 dim)", 1, 4096);
  cli.flag("--rows", &mc.rows, "rows per micro-batch", 1, 1 << 16);
  cli.choice("--bug", &bug, {"none", "drop-w", "no-copy-sum"},
             "plant a bug: skip each rank's last deferred W / do not sum DualPipe's copies");
  cli.epilog("run:  make run L=07 NP=4 ARGS=\"--schedule zb-h1 --microbatches 8\"\n"
             "      make run L=07 NP=1 ARGS=\"--print-schedule --schedule dualpipe --stages 8 --microbatches 20\"");
  lesson.parse();

  Options opt;
  std::string cost_error = pp::parse_costs(cost_text, &opt.costs);
  lesson.usage_error_if(!cost_error.empty(), cost_error);
  if (do_simulate) {
    if (rank == 0) print_simulation_table(opt.costs);
    lesson.csv_with([&](const std::string& path) {
      if (rank == 0) write_text_file(path, simulation_csv(opt.costs));
    });
    return lesson.finish(0);
  }
  const int P = stages > 0 ? (int)stages : world;
  const int M = micro > 0 ? (int)micro : 2 * P;
  lesson.usage_error_if(!pp::check_args(schedule, P, M).empty(), pp::check_args(schedule, P, M));
  const Schedule s = pp::make_schedule(schedule, P, M);
  const std::string invalid = pp::validate(s);
  lesson.usage_error_if(!invalid.empty(), "schedule " + schedule + " is broken: " + invalid);
  if (print_schedule) {
    for (int r = 0; r < P; r++) lesson.print("%s\n", pp::format_rank(s, r).c_str());
    return lesson.finish(0);
  }
  lesson.usage_error_if(P != world,
                        "--stages " + std::to_string(P) + " with " + std::to_string(world) +
                            " ranks: the executor runs one pipeline rank per MPI rank (--print-schedule "
                            "and --simulate work for any P)");
  if (mc.layers == 0) mc.layers = 2 * s.num_stages();
  lesson.usage_error_if(mc.layers % s.num_stages() != 0,
                        "--layers " + std::to_string(mc.layers) + " is not a multiple of the " +
                            std::to_string(s.num_stages()) + " stages of " + schedule);
  // One op sleeps cost x --unit-ms: keep the longest op under a minute (and its duration a
  // number the clock can hold).
  const double longest_ms = std::max({opt.costs.F, opt.costs.B, opt.costs.FB}) * unit_ms;
  lesson.usage_error_if(compute == "sleep" && longest_ms > 60e3,
                        "--cost x --unit-ms makes one op sleep " + std::to_string((int64_t)longest_ms) +
                            " ms; at most 60000 ms: lower --unit-ms or the costs");
  // Parameters (w1, w2: dim x 2 dim; g) with their gradients, in the pipeline and in the
  // one-process reference (3 copies, 2 with DualPipe's second copy), and per micro-batch
  // every block's saved activations (a few rows x 2 dim each), on every rank.
  const double D = (double)mc.dim, rows_all = (double)M * (double)mc.rows;
  lesson.require_memory(4.0 * (double)mc.layers * (4.0 * 4.0 * D * D + 8.0 * rows_all * D),
                        "--layers, --dim, --rows or --microbatches");
  mc.seed = (uint64_t)lesson.flags.seed;
  mc.dev = lesson.device;
  opt.sleep = compute == "sleep";
  opt.unit_ms = unit_ms;
  opt.bug = bug == "drop-w" ? Bug::drop_w : bug == "no-copy-sum" ? Bug::no_copy_sum : Bug::none;

  const pp::Simulation sim = pp::simulate(s, opt.costs);
  if (rank == 0) print_header(s, schedule, mc, opt, unit_ms);

  // ---- the pipeline
  Stages model(rank, s, mc);
  pp::ExecutorOptions eo;
  eo.drop_last_w = opt.bug == Bug::drop_w;
  int overran = 0;
  if (opt.sleep)  // each op stretched to its cost (an op that took longer is counted)
    eo.after_compute = [&](const Step& step, double start) {
      const double left_us = start + opt.costs.of(step) * opt.unit_ms * 1e3 - trace().now_us();
      if (left_us > 0) std::this_thread::sleep_for(std::chrono::microseconds((int64_t)left_us));
      else overran++;
    };
  pp::Executor ex(comm, s, model, eo);
  trace().enable(comm.raw());  // always: the executor's spans give the measured bubble and --csv
  ex.run();

  // DualPipe: stage s has two copies (rank s for direction 0, rank P-1-s for direction 1);
  // each saw half of the micro-batches. Partners swap gradients and both copies get the sum.
  std::vector<std::vector<Tensor>> grads;  // per chunk: the grads of its layers' g, w1, w2
  for (const auto& c : model.chunks()) {
    std::vector<Tensor> gs;
    for (const Layer& L : c.layers)
      for (const Tensor* t : {&L.g, &L.w1, &L.w2})
        gs.push_back(t->grad().defined() ? t->grad().to(Device::cpu) : Tensor::zeros(t->shape()));
    grads.push_back(gs);
  }
  if (s.layout == pp::Layout::dual && opt.bug != Bug::no_copy_sum) {
    std::vector<float> mine, theirs;
    for (auto& gs : grads)
      for (auto& t : gs) {
        std::vector<float> v = t.to_vector();
        mine.insert(mine.end(), v.begin(), v.end());
      }
    theirs.resize(mine.size());
    // [slide:copy-sum]
    const int partner = P - 1 - rank;
    comm.sendrecv(mine.data(), mine.size() * sizeof(float), partner, 3, theirs.data(),
                  theirs.size() * sizeof(float), partner, 3);
    // mine = [stage r (d 0), stage P-1-r (d 1)], theirs = [stage P-1-r (d 0), stage r (d 1)]
    const size_t half = mine.size() / 2;
    for (size_t i = 0; i < half; i++) {
      mine[i] += theirs[half + i];
      mine[half + i] += theirs[i];
    }
    // [/slide]
    size_t at = 0;
    for (auto& gs : grads)
      for (auto& t : gs) {
        std::vector<float> v(mine.begin() + (long)at, mine.begin() + (long)(at + (size_t)t.numel()));
        t = Tensor::from_vector(v, t.shape());
        at += (size_t)t.numel();
      }
  }
  double loss = ex.local_loss();
  comm.allreduce(&loss, 1, MPI_DOUBLE, MPI_SUM);

  // ---- timing: the bubble of each rank, measured, simulated and by formula
  double busy_us = ex.busy_us(), makespan_us = ex.end_us();
  comm.allreduce(&makespan_us, 1, MPI_DOUBLE, MPI_MAX);
  std::vector<double> all_busy((size_t)P), all_peak((size_t)P), all_over((size_t)P);
  double mine_peak = ex.peak_live(), mine_over = overran;
  comm.allgather(&busy_us, sizeof(double), all_busy.data());
  comm.allgather(&mine_peak, sizeof(double), all_peak.data());
  comm.allgather(&mine_over, sizeof(double), all_over.data());
  const pp::Formula formula = pp::formula_bubble(schedule, P, opt.costs);
  if (rank == 0)
    print_bubble_table(formula, sim, all_busy, all_peak, all_over, makespan_us,
                       opt.sleep ? unit_ms * 1e3 : 1e3, opt.sleep);

  // ---- the reference: the same model and micro-batches in one process
  std::vector<Layer> all;
  for (int64_t l = 0; l < mc.layers; l++) all.push_back(make_layer(mc, l));
  double ref_loss = 0;
  for (int gm = 0; gm < M; gm++) {
    Tensor l = mb_loss(run_layers(all, mb_input(mc, M, gm)), mb_target(mc, M, gm), M);
    ref_loss += l.item();
    run_backward(l, Tensor::full({}, 1.f, mc.dev));
  }

  // From here on, the check: its traffic goes to the trace's "check" track, apart from the
  // algorithm's timeline.
  Trace::Category check_traffic(trace(), "check");
  CheckReport check(comm);
  lesson.print("against one process running all %lld blocks on the same %d micro-batches (worst rank)\n",
               (long long)mc.layers, M);
  check.scalar("loss", loss, ref_loss, 8.0 * M * FLT_EPSILON * std::max(std::fabs(ref_loss), 1e-3));
  const int64_t per_stage = mc.layers / s.num_stages();
  const char* names[3] = {"g (norm)", "w1", "w2"};
  for (size_t c = 0; c < model.chunks().size(); c++) {
    const auto& ch = model.chunks()[c];
    for (int k = 0; k < 3; k++) {
      std::vector<Tensor> got, want;
      for (int64_t i = 0; i < per_stage; i++) {
        got.push_back(reshape(grads[c][(size_t)(3 * i + k)], {-1}));
        const Layer& L = all[(size_t)(ch.stage * per_stage + i)];
        want.push_back(reshape((k == 0 ? L.g : k == 1 ? L.w1 : L.w2).grad().to(Device::cpu), {-1}));
      }
      Tensor g = concat(got, 0), w = concat(want, 0);
      // M micro-batches summed in another order (and DualPipe's two copies added): a few
      // roundings per addition of the largest value
      double tol = 8.0 * M * FLT_EPSILON * std::max(max_abs(w), 1e-6);
      std::string what = std::string("d ") + names[k] +
                         (ch.dir == 0 ? " of this rank's first stage" : " of this rank's second stage");
      check.close(what.c_str(), g, w, tol);
    }
  }

  // --csv: every span of the run (the trace JSON is written by finish)
  lesson.csv_with([&](const std::string& path) { trace().write_csv(comm.raw(), path); });
  if (lesson.dumping()) dump_run(lesson, model, grads, s, schedule, mc, M, loss);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "07_dualpipe", dualpipe_lesson);
}
