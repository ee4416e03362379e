// lessons/06_overlap/report.cpp — lesson 06's report and dumps (report.h).
#include "lessons/06_overlap/report.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "common/layers/schedule.h"
#include "lessons/07_dualpipe/schedules.h"  // the one look ahead: 07's schedules, simulated at our costs
#include "lessons/06_overlap/timeline.h"

namespace ff::f1b {

void print_setup(const Setup& setup, const Options& opts, int ranks) {
  const dsv3::Config& moe = setup.moe;
  std::printf("== 06 overlap: P=%d ranks (%lld per virtual node), %lld micro-batches of %lld tokens "
              "per rank, d=%lld, %lld heads, %lld experts (%lld per rank), top-%lld, %lld shared, "
              "%s, progress %s, device %s\n%s (modelled: waits last until the modelled time)\n"
              "%s\n",
              ranks, (long long)opts.ranks_per_node, (long long)setup.microbatches,
              (long long)setup.tokens, (long long)moe.dim, (long long)setup.heads,
              (long long)moe.experts, (long long)(moe.experts / ranks), (long long)moe.topk,
              (long long)moe.shared, opts.prefill ? "prefill (forwards only)" : "1F1B",
              opts.progress.c_str(), device_name(setup.dev), describe(opts.link).c_str(),
              setup.modelled_compute
                  ? ("modelled compute: " + fmt_num(opts.gflops) + " GFLOP/s per rank (each phase "
                     "computes, then lasts its matmul FLOPs at that rate)").c_str()
                  : "compute not modelled: phases last what they take on this machine");
}

// The measured costs of the sequential run and the overlapped one with W inline (the whole
// backward in its F&B step: B = I + W, as in lesson 07's costs), slowest rank, in lesson 07's
// simulator.
static void print_costs_in_simulator(Comm& comm, const RunResult& sequential,
                                     const RunResult& overlapped, int64_t microbatches) {
  double cost[4] = {mean(sequential.f_s), mean(sequential.b_s),
                    sequential.timeline.total('W') / (double)microbatches, mean(overlapped.fb_s)};
  comm.allreduce(cost, 4, MPI_DOUBLE, MPI_MAX);
  pp::Costs costs;
  costs.F = 1.0, costs.B = cost[1] / cost[0], costs.W = std::min(cost[2] / cost[0], costs.B * 0.99);
  costs.FB = cost[3] / cost[0];
  if (comm.rank() != 0) return;
  std::printf("\nmeasured costs (slowest rank): F = %.1f ms, B = %.2f F, W = %.2f F, F&B = %.2f F "
              "(F + B = %.2f F)\n", cost[0] * 1e3, costs.B, costs.W, costs.FB, 1 + costs.B);
  const int stages = 8, microbatches_07 = 20;
  for (const char* name : {"1f1b", "dualpipe"}) {
    pp::Simulation sim = pp::simulate(pp::make_schedule(name, stages, microbatches_07), costs);
    std::printf("  lesson 07's simulator, P=%d, M=%d: %-8s bubble %5.1f F (%4.1f%% of %.1f F)\n",
                stages, microbatches_07, name, sim.bubble(), 100 * sim.bubble_ratio(), sim.makespan);
  }
}

void report_runs(Lesson& lesson, const Setup& setup, const Options& opts,
                 const std::vector<Variant>& variants, double overruns, double phases) {
  Comm& comm = lesson.comm;
  const bool rank0 = comm.rank() == 0;
  double overrun[2] = {overruns, phases};
  comm.allreduce(overrun, 2, MPI_DOUBLE, MPI_SUM);
  if (rank0 && setup.modelled_compute && overrun[0] > 0)
    std::printf("note: %.0f of %.0f compute phases took over 0.1 ms longer for real than modelled "
                "at %g GFLOP/s (this machine, or its share of it, is slower): their timings are "
                "real ones; a lower --gflops keeps every phase modelled\n",
                overrun[0], overrun[1], opts.gflops);
  // the timelines of rank 0, on one time scale, and per rank the compute, the waiting and the
  // hidden fraction
  std::vector<std::string> names, keys;
  std::vector<Timeline> best;
  for (const Variant& v : variants)
    names.push_back(v.name), keys.push_back(v.key), best.push_back(v.best.timeline);
  if (rank0) std::printf("%s", timelines_text(names, best, opts.reps, (int)opts.width).c_str());
  std::vector<RankTimes> times;
  for (const Timeline& timeline : best) times.push_back(gather_times(comm, timeline));
  const bool both = opts.mode == "both";
  if (both) print_hidden_fraction(times, rank0);
  if (both && !opts.prefill && setup.microbatches >= 2)
    print_costs_in_simulator(comm, variants.front().best, variants[1].best, setup.microbatches);
  if (!opts.prefill)
    lesson.csv_append("mode,rank,progress,inter_MBps,intra_MBps,wall_ms,compute_ms,wait_ms",
                      times_csv(keys, times, opts.progress, opts.link));
}

std::vector<moe::NamedTensor> named_grads(const RunResult& run) {
  std::vector<moe::NamedTensor> out;
  for (size_t k = 0; k < run.attn_grads.size(); k++)
    out.push_back({std::string("d_") + kAttentionNames[k], run.attn_grads[k]});
  for (const moe::NamedTensor& grad : dsv3::named_grads(run.grads))
    if (grad.t.defined()) out.push_back(grad);  // not dx (per micro-batch), nor any in prefill
  return out;
}

void dump_run(Lesson& lesson, const RunResult& run, int64_t microbatches, bool prefill) {
  const std::string me = "_rank" + std::to_string(lesson.rank());
  for (int64_t m = 0; m < microbatches; m++) {
    const std::string tag = me + "_mb" + std::to_string(m);
    lesson.dump("y" + tag, run.y[(size_t)m]);
    if (!prefill) lesson.dump("dx" + tag, run.dx[(size_t)m]);
  }
  for (const moe::NamedTensor& grad : named_grads(run)) lesson.dump(grad.name + me, grad.t);
}

}  // namespace ff::f1b
