// lessons/08_mesh/report.cpp — what lesson 08 prints and writes (report.h).
#include "lessons/08_mesh/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/comm/overlap.h"
#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "lessons/08_mesh/estimate.h"

namespace ff::mesh {

void print_header(const Lesson& lesson, const Options& opts, const Setup& setup, const RankModel& here, int edp) {
  const MeshSizes& sizes = setup.sizes;
  const model::Config& c = setup.c;
  std::string ep_text;
  if (sizes.ep > 1) {
    ep_text = ", ep " + std::to_string(sizes.ep) + " folded on them (expert-DP " + std::to_string(edp) +
              ", " + opts.a2a + " all-to-all";
    if (opts.a2a == "hierarchical")
      ep_text += ", " + std::to_string(here.topo.R) + (setup.real_nodes ? " ranks per node" : " ranks per virtual node");
    ep_text += ")";
  }
  lesson.print("mesh %s: dp %d x %s%stp %d = %d ranks%s, ZeRO-%lld, SP %s%s\n", mesh_name(sizes, 0).c_str(),
               sizes.dp, sizes.pp > 1 ? ("pp " + std::to_string(sizes.pp) + " x ").c_str() : "",
               sizes.cp > 1 ? ("cp " + std::to_string(sizes.cp) + " x ").c_str() : "", sizes.tp,
               sizes.world(), ep_text.c_str(), (long long)opts.zero, opts.sp ? "on" : "off",
               opts.bug == Bug::none ? "" : ("; planted bug: " + bug_name(opts.bug)).c_str());
  lesson.print("model: vocab %lld, d %lld, %lld layers (%lld dense, %lld MoE: %lld experts, top-%lld, "
               "%lld shared), %lld heads, r_q %lld, r_kv %lld; %lld parameters, %lld on rank 0\n",
               (long long)c.vocab, (long long)c.dim, (long long)c.layers, (long long)c.dense_layers,
               (long long)(c.layers - c.dense_layers), (long long)c.experts, (long long)c.topk,
               (long long)c.shared, (long long)c.heads, (long long)c.q_lora, (long long)c.kv_lora,
               (long long)setup.full_numel, (long long)here.table.local_numel);
  if (sizes.pp > 1 || setup.microbatches > 1) {
    std::string cut;
    for (int stage = 0; stage < setup.stages; stage++)
      cut += (stage ? ", " : "") + std::to_string(setup.stage_begin[(size_t)stage + 1] - setup.stage_begin[(size_t)stage]);
    lesson.print("pipeline: %s, %d stages of %s blocks (embedding on the first, head and loss on the "
                 "last), %lld micro-batches of %lld sequences per DP rank%s\n",
                 opts.schedule.c_str(), setup.stages, cut.c_str(), (long long)setup.microbatches, (long long)setup.microbatch,
                 !setup.sched_pairs ? ""
                 : opts.overlap == "on" ? "; F&B pairs overlapped at the all-to-alls"
                                     : "; F&B pairs one after the other");
  }
  if (setup.link.enabled)
    lesson.print("%s (point-to-point messages; the collectives as MPI runs them)\n",
                 describe(setup.link).c_str());
  lesson.print("batch: %lld sequences x %lld tokens per step, %lld per DP rank%s; AdamW lr %g%s\n",
               (long long)opts.batch, (long long)setup.seq, (long long)setup.rank_batch,
               sizes.cp > 1 ? (", " + std::to_string(setup.seq_per_cp) + " tokens of each per CP rank (zigzag)").c_str() : "",
               opts.lr, opts.precision == "bf16" ? "; bf16 matmul weights, float32 masters (lesson 10)" : "");
  if (opts.precision == "fp8")
    lesson.print("fp8: MLA's projections and the dense FFN in e4m3, 1 x %lld activation tiles, %lld x %lld weight blocks, "
                 "promoted every %lld products%s%s (lesson 10)\n",
                 (long long)opts.fp8_tile, (long long)opts.fp8_tile, (long long)opts.fp8_tile, (long long)opts.fp8_tile,
                 sizes.tp > 1 ? "; each TP shard whole tiles, quantized as one process does" : "",
                 opts.fp8_experts == "on" ? "; the experts' grouped GEMMs too" : "");
  lesson.print("\n");
  lesson.print("%5s  %11s  %13s  %9s  %9s  %8s  %6s  %10s  %10s%s\n", "step", "loss (mesh)",
               "loss (1 proc)", "|diff|", "bound", "grad err", "AdamW", "TP bytes", "DP bytes",
               (std::string(sizes.cp > 1 ? "    CP bytes" : "") + (sizes.ep > 1 ? "    EP bytes   EDP bytes" : "") +
                (sizes.pp > 1 ? "    PP bytes" : "")).c_str());
}

void print_step(const Options& opts, const MeshSizes& sizes, int64_t step, bool checking,
                bool logging, const CheckedStep& checked, double bound, const AxisCounts& last,
                std::ostringstream& csv) {
  const double loss_mesh = checked.loss_mesh, loss_ref = checked.twin.loss;
  const std::string& adam = checked.twin.adam;
  if (logging) {
    auto column = [&](bool shown, const CollectiveCounts& counts) {
      const std::string b = human_bytes((double)sum_bytes(counts));
      return shown ? "  " + std::string(10 - std::min<size_t>(10, b.size()), ' ') + b : std::string();
    };
    const std::string more_columns = column(sizes.cp > 1, last.cp) + column(sizes.ep > 1, last.ep) +
                                     column(sizes.ep > 1, last.edp) + column(sizes.pp > 1, last.pp);
    const std::string tp_bytes = human_bytes((double)sum_bytes(last.tp));
    const std::string dp_bytes = human_bytes((double)sum_bytes(last.dp));
    if (checking)
      std::printf("%5lld  %11.6f  %13.6f  %9.2e  %9.2e  %8.3f  %6s  %10s  %10s%s\n", (long long)step,
                  loss_mesh, loss_ref, std::fabs(loss_mesh - loss_ref), bound, checked.twin.grad_ratio,
                  adam.c_str(), tp_bytes.c_str(), dp_bytes.c_str(), more_columns.c_str());
    else
      std::printf("%5lld  %11.6f  %13s  %9s  %9s  %8s  %6s  %10s  %10s%s\n", (long long)step, loss_mesh,
                  "-", "-", "-", "-", adam.c_str(), tp_bytes.c_str(), dp_bytes.c_str(), more_columns.c_str());
  }
  char row[320];
  std::snprintf(row, sizeof row, "step,%d,%d,%lld,%d,%lld,%.9g,%.9g,%.6g,%zu,%zu,,,,,,%d,%zu,%d,%d,%zu,%zu,%zu,0\n",
                sizes.dp, sizes.tp, (long long)opts.zero, (int)opts.sp, (long long)step, loss_mesh, loss_ref,
                checked.twin.grad_ratio, sum_bytes(last.tp), sum_bytes(last.dp), sizes.cp,
                sum_bytes(last.cp), sizes.pp, sizes.ep, sum_bytes(last.ep), sum_bytes(last.edp),
                sum_bytes(last.pp));
  csv << row;
}

std::string memory_check_name(const Options& opts) {
  char line[256];
  const char* shard_n = opts.zero == 3 ? "sum ceil(N_u/dp)" : opts.bucket_mb > 0 ? "sum ceil(N_b/dp)" : "ceil(N/dp)";
  if (opts.precision == "bf16" && opts.zero == 3)  // zero.h's mixed_formula_units
    std::snprintf(line, sizeof line, "memory: no weight held between steps, gradients 4 %s, AdamW's masters, m and v "
                  "12 %s, measured", shard_n, shard_n);
  else if (opts.precision == "bf16")  // zero.h's mixed_formula, per optimizer group
    std::snprintf(line, sizeof line, "memory: parameters 2 N16 + 4 N32, gradients %s, AdamW's masters, m and v %s, "
                  "measured", opts.zero >= 2 ? (std::string("4 ") + shard_n).c_str() : "2 N16 + 4 N32 (those held)",
                  opts.zero == 0 ? "12 N16 + 8 N32" : (std::string("12 ") + shard_n).c_str());
  else
    std::snprintf(line, sizeof line, "memory: parameters %s%s, gradients %s%s, AdamW's m and v %s%s, measured",
                  opts.zero == 3 ? "4 " : "4N", opts.zero == 3 ? shard_n : "",
                  opts.zero >= 2 ? "4 " : "4N (those held)", opts.zero >= 2 ? shard_n : "",
                  opts.zero == 0 ? "8N" : "8 ", opts.zero == 0 ? "" : shard_n);
  return line;
}

void print_report(const Lesson& lesson, const Options& opts, const Setup& setup, const RunSummary& run,
                  std::ostringstream& csv) {
  const MeshSizes& sizes = setup.sizes;
  const zero::Memory& got = run.mem.measured;
  const zero::Memory& formula = run.mem.formula;
  lesson.print("\ncommunication of one step (rank 0; Comm's counters, payload bytes):\n");
  lesson.print("%s", communication_text(run.last, run.want, sizes).c_str());
  if (setup.sched_pairs && opts.overlap == "on")
    lesson.print("  overlap: %ld hand-overs between a paired forward and backward at their all-to-alls, "
                 "over the whole run\n", overlap::switches());
  const bool bf16 = opts.precision == "bf16";
  lesson.print("\nmemory of rank 0 (%s, %lld parameters here): measured vs formula "
               "(ZeRO-%lld, %s %d)\n", bf16 ? "the matmul weights bf16, N16 of them" : "float32",
               (long long)run.local_numel, (long long)opts.zero,
               sizes.cp > 1 ? "dp x cp" : "dp", run.data_ranks);
  if (sizes.ep > 1)
    lesson.print("  N = %lld dense (ZeRO over dp x cp, %d ranks) + %lld of this rank's experts "
                 "(ZeRO over edp, %d ranks)\n", (long long)run.dense_numel, run.data_ranks,
                 (long long)run.expert_numel, run.edp);
  const bool z3 = opts.zero == 3, z2 = opts.zero >= 2, pieces = z3 || opts.bucket_mb > 0;
  const char* shard = z3 ? "S_u" : pieces ? "S_b" : "ceil(N/dp)";  // S: the sum over units or buckets
  // bf16: zero.h's mixed_formula (parameters and gradients 2 bytes, masters, m and v 4 each)
  const std::string p_label = bf16 ? (z3 ? "0" : "2N16 + 4N32") : z3 ? std::string("4 ") + shard : "4N";
  const std::string g_label = z2 ? std::string("4 ") + shard : bf16 ? "2N16 + 4N32" : "4N";
  const std::string o_label = bf16 ? (opts.zero ? std::string("12 ") + shard : "12N16 + 8N32")
                                   : opts.zero ? std::string("8 ") + shard : "8N";
  lesson.print("  parameters %10s   formula %-13s %10s\n", human_bytes((double)got.params).c_str(), p_label.c_str(),
               human_bytes((double)formula.params).c_str());
  lesson.print("  gradients  %10s   formula %-13s %10s\n", human_bytes((double)got.grads).c_str(), g_label.c_str(),
               human_bytes((double)formula.grads).c_str());
  lesson.print("  AdamW %-4s %10s   formula %-13s %10s\n", bf16 ? "(*)" : "m, v", human_bytes((double)got.optimizer).c_str(),
               o_label.c_str(), human_bytes((double)formula.optimizer).c_str());
  if (pieces)
    lesson.print("  (%s = sum of ceil(N_%c/dp) over the %s, each sharded on its own)\n", shard, z3 ? 'u' : 'b',
                 z3 ? "units (a layer each)" : "gradient buckets");
  if (bf16) lesson.print("  (*) the float32 masters of the bf16 weights, m and v\n");
  lesson.print("  buffers    %10s   (the collectives' flat buffers: not in the formula)\n",
               human_bytes((double)got.buffers).c_str());
  if (z3)
    lesson.print("  between steps ZeRO-3 holds no whole weight; during one, at most %s of them gathered at "
                 "once (the largest units in use), %lld unit gathers per step\n",
                 human_bytes((double)run.zero3.peak_bytes).c_str(), (long long)run.zero3.gathers_per_step);
  lesson.print("  seed 001's mixed precision for the same N: ZeRO-0 %s, -1 %s, -2 %s, -3 %s "
               "(16N, 4N + 12N/dp, 2N + 14N/dp, 16N/dp)\n",
               human_bytes(zero::mixed_precision_bytes(run.local_numel, run.data_ranks, 0)).c_str(),
               human_bytes(zero::mixed_precision_bytes(run.local_numel, run.data_ranks, 1)).c_str(),
               human_bytes(zero::mixed_precision_bytes(run.local_numel, run.data_ranks, 2)).c_str(),
               human_bytes(zero::mixed_precision_bytes(run.local_numel, run.data_ranks, 3)).c_str());
  const double step_s = run.train_s / (double)std::max<int64_t>(run.trained_steps, 1);
  if (run.trained_steps == 0)
    lesson.print("\ntraining: no step in this run (--train 0)\n");
  else
    lesson.print("\ntraining: %.2f ms per step (rank 0, the check excluded%s), %.0f tokens/s\n",
                 step_s * 1e3, setup.link.enabled ? "; links modelled" : "", (double)(opts.batch * setup.seq) / step_s);
  char row[320];
  std::snprintf(row, sizeof row, "memory,%d,%d,%lld,%d,,,,,,,%zu,%zu,%zu,%zu,%zu,%d,,%d,%d,,,,0\n", sizes.dp,
                sizes.tp, (long long)opts.zero, (int)opts.sp, got.params, got.grads, got.optimizer, got.buffers,
                formula.params + formula.grads + formula.optimizer, sizes.cp, sizes.pp, sizes.ep);
  csv << row;
}

void PairCompare::overlapped(double ovl_wall_s, const std::vector<Tensor*>& params) {
  if (timing) compute.push_back(step_compute), seq.push_back(step_seq), ovl.push_back(ovl_wall_s);
  for (size_t k = 0; k < params.size() && equal; k++) {
    const std::vector<float> now = params[k] && params[k]->grad().defined() ? params[k]->grad().to_vector()
                                                                            : std::vector<float>();
    if (now.size() != grads[k].size() ||
        (!now.empty() && std::memcmp(now.data(), grads[k].data(), now.size() * sizeof(float)) != 0))
      equal = false, first_differs = "weight " + std::to_string(k);
  }
}

void print_pair_overlap(const Lesson& lesson, Comm& world, const Setup& setup, const PairCompare& c) {
  constexpr double kCommAboveNoise = 0.1;  // T_comm counted from a tenth of T_compute up
  const auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const double mine[3] = {median(c.compute), median(c.seq), median(c.ovl)};
  std::vector<double> all(3 * (size_t)world.size());
  {
    Trace::Category check_traffic(trace(), "check");
    world.allgather(mine, sizeof mine, all.data());
  }
  lesson.print("\nthe paired F&B steps (--overlap compare), per rank, ms per step (medians over the timed steps): "
               "one after the other without\nthe link model (T_compute) and with it (T_seq), overlapped (T_ovl), "
               "T_comm = T_seq - T_compute, and the hidden fraction (T_seq - T_ovl) / min(T_compute, T_comm)\n"
               "  rank  T_compute   T_comm    T_seq    T_ovl  hidden\n");
  double worst = 1e300, mean = 0;
  int counted = 0;
  for (int r = 0; r < world.size(); r++) {
    const double compute = all[3 * (size_t)r], seq = all[3 * (size_t)r + 1], ovl = all[3 * (size_t)r + 2];
    const double comm = seq - compute, hideable = std::min(compute, comm);
    const double hidden = hideable > 0 ? (seq - ovl) / hideable : 0;
    lesson.print("  %4d  %9.2f  %7.2f  %7.2f  %7.2f  %5.0f%%\n", r, compute * 1e3, comm * 1e3, seq * 1e3,
                 ovl * 1e3, 100 * hidden);
    // T_comm is a difference of two timings: under a tenth of the compute it is the noise of a
    // busy machine as much as communication, and its row's fraction says nothing: left out below
    if (comm > kCommAboveNoise * compute) worst = std::min(worst, hidden), mean += hidden, counted++;
  }
  if (counted > 0)
    lesson.print("hidden fraction of the paired steps: worst %.2f, mean %.2f over the ranks%s\n", worst,
                 mean / counted, setup.link.enabled ? "" : " (links not modelled: --link gives the messages their time)");
  else
    lesson.print("hidden fraction of the paired steps: n/a (no rank's communication measured above the noise of its "
                 "compute: --link with slower links gives the messages their time)\n");
}

double print_buckets(const Lesson& lesson, Comm& world, const Options& opts, const Setup& setup,
                     const zero::BucketTimes& all) {
  const double mine = all.hidden_fraction();
  std::vector<double> every((size_t)world.size());
  {
    Trace::Category check_traffic(trace(), "check");
    world.allgather(&mine, sizeof mine, every.data());
  }
  double worst = 1, mean = 0;
  for (double f : every) worst = std::min(worst, f), mean += f / (double)every.size();
  const int64_t steps = std::max<int64_t>(opts.steps, 1);
  lesson.print("\nDP's gradients in buckets of about %s (rank 0): %lld per step, %.1f of them posted during "
               "the backward\n", human_bytes(opts.bucket_mb * 1e6).c_str(), (long long)(all.buckets / steps),
               (double)all.posted_early / (double)steps);
  if (!setup.bucket_overlap)
    lesson.print("  all after the backward here: %s\n", setup.bucket_why_not.c_str());
  else if (!setup.link.enabled)
    lesson.print("  their hidden fraction needs --link: the link model gives the reductions their time\n");
  else
    lesson.print("  per step: reduction %.2f ms on the links, %.2f ms of it exposed, the backward's window "
                 "%.2f ms: hidden fraction (T_seq - T_ovl) / min(T_compute, T_comm) = %.2f (rank 0), "
                 "worst %.2f, mean %.2f over the ranks\n",
                 all.comm_s / (double)steps * 1e3, all.exposed_s / (double)steps * 1e3,
                 all.window_s / (double)steps * 1e3, mine, worst, mean);
  return mine;
}

void print_estimate(const Lesson& lesson, const Setup& setup, const Options& opts, const MemoryUse& mem,
                    int64_t local_numel, const AxisCounts& last) {
  estimate::Parallel par;
  par.tp = setup.sizes.tp, par.dp = setup.sizes.dp, par.cp = setup.sizes.cp, par.ep = setup.sizes.ep, par.zero = (int)opts.zero;
  par.sp = opts.sp;
  const estimate::Measured measured{local_numel, (double)mem.measured.params, (double)mem.measured.grads,
                                    (double)mem.measured.optimizer};
  lesson.print("\n%s", estimate::report(estimate::tiny(setup.c, setup.rank_batch), par, measured).c_str());
  // what the DP axis moved in this run's last step, next to the seed's PP vs ZeRO-3 volumes
  const auto moved = [&](const char* op) {
    const auto it = last.dp.find(op);
    return it == last.dp.end() ? CollectiveCount{} : it->second;
  };
  lesson.print("this run's DP axis, rank 0, last step (fp32 payload): all-gather %lld x, %s; reduce-scatter %lld x, "
               "%s; all-reduce %lld x, %s (ZeRO-%lld%s)\n",
               (long long)moved("allgather").calls, human_bytes((double)moved("allgather").bytes).c_str(),
               (long long)moved("reduce_scatter").calls, human_bytes((double)moved("reduce_scatter").bytes).c_str(),
               (long long)moved("allreduce").calls, human_bytes((double)moved("allreduce").bytes).c_str(),
               (long long)opts.zero, opts.zero == 3 ? ": every unit gathered for each micro-batch's forward and "
                                                      "backward, its gradients reduce-scattered once each" : "");
}

void rank_rows(Lesson& lesson, Comm& world, const Options& opts, const MeshSizes& sizes,
               const AxisCounts& last, const AxisCounts& want, std::ostringstream& csv) {
  Trace::Category check_traffic(trace(), "check");
  const CollectiveCounts* mine[12] = {&last.tp, &last.dp, &last.cp, &last.ep, &last.edp, &last.pp,
                                      &want.tp, &want.dp, &want.cp, &want.ep, &want.edp, &want.pp};
  std::vector<uint64_t> bytes(12), all(12 * (size_t)lesson.size());
  for (size_t i = 0; i < 12; i++) bytes[i] = sum_bytes(*mine[i]);
  world.allgather(bytes.data(), bytes.size() * sizeof(uint64_t), all.data());
  for (int r = 0; lesson.rank() == 0 && r < lesson.size(); r++)
    for (int formula = 0; formula < 2; formula++) {
      const uint64_t* x = &all[12 * (size_t)r + 6 * (size_t)formula];
      char row[320];
      std::snprintf(row, sizeof row, "%s,%d,%d,%lld,%d,%lld,,,,%llu,%llu,,,,,,%d,%llu,%d,%d,%llu,%llu,%llu,%d\n",
                    formula ? "rank_formula" : "rank", sizes.dp, sizes.tp, (long long)opts.zero, (int)opts.sp,
                    (long long)(opts.steps - 1), (unsigned long long)x[0], (unsigned long long)x[1],
                    sizes.cp, (unsigned long long)x[2], sizes.pp, sizes.ep, (unsigned long long)x[3],
                    (unsigned long long)x[4], (unsigned long long)x[5], r);
      csv << row;
    }
}

void dump_trained(Lesson& lesson, const Setup& setup, int64_t batch, const model::Params& trained,
                  double val_loss0) {
  const model::Config& c = setup.c;
  const CharCorpus::Batch batch0 = setup.corpus.batch(CharCorpus::Split::val, 0, batch, setup.seq, 0, batch,
                                                  (uint64_t)lesson.flags.seed);
  for (const model::NamedTensor& n : trained.named_parameters()) lesson.dump(n.name, n.t);
  for (const model::NamedTensor& n : trained.named_buffers()) lesson.dump(n.name, n.t);
  lesson.dump("val_inputs", batch0.inputs);
  lesson.dump("val_targets", batch0.targets);
  lesson.dump("val_loss", Tensor::from_vector({(float)val_loss0}, {}));  // of batch 0
  std::ostringstream meta;
  meta << "{\"vocab\": " << c.vocab << ", \"dim\": " << c.dim << ", \"layers\": " << c.layers
       << ", \"dense_layers\": " << c.dense_layers << ", \"heads\": " << c.heads
       << ", \"d_nope\": " << c.d_nope << ", \"d_rope\": " << c.d_rope << ", \"d_v\": " << c.d_v
       << ", \"q_lora\": " << c.q_lora << ", \"kv_lora\": " << c.kv_lora << ", \"ffn\": " << c.ffn
       << ", \"experts\": " << c.experts << ", \"topk\": " << c.topk << ", \"shared\": " << c.shared
       << ", \"moe_ffn\": " << c.moe_ffn << ", \"seq\": " << setup.seq << ", \"rope_theta\": " << c.rope_theta
       << ", \"norm_eps\": " << c.norm_eps << ", \"mesh\": \"" << mesh_name(setup.sizes, 0) << "\"}\n";
  lesson.dump_text("meta.json", meta.str());
}

std::string sample_text(const model::Config& c, const model::Params& p, const CharCorpus& corpus,
                        const std::string& prompt, int64_t count, double temperature,
                        uint64_t seed) {
  std::vector<int64_t> ids = corpus.encode(prompt);
  std::mt19937_64 gen(seed);
  NoGradGuard no_grad;
  const Device dev = p.embed.device();
  for (int64_t k = 0; k < count; k++) {
    const int64_t T = std::min<int64_t>((int64_t)ids.size(), c.seq_len);
    std::vector<int64_t> context(ids.end() - T, ids.end());
    Tensor in = Tensor::from_indices(context, {1, T}, dev);
    model::Output out = model::forward(c, p, in, in, model::positions(T, dev));
    const std::vector<float> z = slice(out.logits, 0, T - 1, T).to_vector();
    const float zmax = *std::max_element(z.begin(), z.end());
    std::vector<double> weights(z.size());
    double sum = 0;
    for (size_t j = 0; j < z.size(); j++) sum += weights[j] = std::exp(((double)z[j] - zmax) / temperature);
    const double u = (double)(gen() >> 11) * 0x1.0p-53 * sum;  // uniform in [0, sum)
    size_t j = 0;
    for (double acc = weights[0]; acc <= u && j + 1 < weights.size(); acc += weights[++j]) {
    }
    ids.push_back((int64_t)j);
  }
  return corpus.decode(ids);
}

}  // namespace ff::mesh
