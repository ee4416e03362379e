// Lesson 08 — a tiny DeepSeek-style language model on a five-axis rank grid: data parallelism
// with ZeRO-1, tensor parallelism with sequence parallelism, context parallelism by lesson 02's
// ring (part 1), expert parallelism by lesson 05's layer and pipeline parallelism by lesson 07's
// executor (part 2), and the memory and communication they cost.
//
// What: a character-level decoder (common/layers/model.h: Multi-head Latent Attention, a dense
//   SwiGLU block, then lesson 05's DeepSeek-V3 MoE blocks) trained on tinyshakespeare by the
//   ranks of a DP x PP x CP x TP mesh with EP folded onto it (common/comm/mesh.h, Megatron-LM's
//   order: tp fastest, pp slowest).
//     DP  each DP rank takes B / dp of the global batch's sequences; the gradients are averaged
//         over DP by the optimizer: ZeRO-0 (all-reduce, AdamW everywhere), ZeRO-1
//         (reduce-scatter, AdamW on this rank's shard of m and v, all-gather), ZeRO-2 (the full
//         gradients released too) or ZeRO-3 (the parameters sharded too, each layer gathered
//         around its forward and its backward: fsdp.h); with --bucket-mb the
//         gradients reduced in buckets while the backward runs (buckets.h).
//     TP  the attention heads are split over the TP ranks (W_uq, W_uk, W_uv by columns, W_o by
//         rows); the down-projections W_dq, W_dkv, W_kr and the latent norms stay replicated
//         (seed 002), so TP's all-reduce in the backward carries the per-token latents
//         [c_q | c_kv | k_pe], r_q + r_kv + d_r numbers instead of d. The dense SwiGLU is
//         column- then row-parallel (one all-reduce per sub-block each way, seed 000). The LM
//         head is split over the vocabulary and its cross-entropy merges every rank's
//         (max, sum of exp) per token: lesson 01's (m, l) merge. The MoE runs replicated.
//     SP  (--sp) outside the TP regions each TP rank keeps only its slice of the tokens: the
//         all-reduces become an all-gather before the column-parallel matmuls and a
//         reduce-scatter after the row-parallel ones, and the gradients of every replicated
//         weight (the RMSNorm weights among them) are summed over TP, since each rank saw only
//         its tokens.
//     CP  (--cp) each sequence's tokens split over the CP ranks in the zigzag layout; attention
//         runs lesson 02's ring (lessons/02_ring_attention/ring.h) over MLA's per-head keys and
//         values, the mask and RoPE from global positions; gradients averaged over DP x CP.
//     EP  (--ep) each MoE layer's experts spread over an EP group of consecutive ranks of the
//         stage (folded: ep divides dp cp tp); lesson 05's layer (common/layers/dsv3_ep.h)
//         sends each token to its experts' ranks and back; the experts' gradients summed over
//         expert-DP (the ranks holding the same experts) and divided by dp cp.
//     PP  (--pp) the blocks cut into stages (embedding on the first, head and loss on the last)
//         and run micro-batch by micro-batch by lesson 07's executor (common/layers/pipeline.h)
//         in the order of --schedule 1f1b | zb-h1 | dualpipe | dualpipev; DualPipe's two
//         copies of a stage sum their gradients; paired F&B steps overlap their all-to-alls
//         (lesson 06, common/comm/overlap.h).
// Why: a model too big for one GPU in memory (ZeRO: the optimizer state split) or in compute
//   and activations (TP, SP); DeepSeek-V3 itself trains with DP + ZeRO-1, PP and EP, no TP
//   (--estimate deepseek-v3 says what that costs).
// Check: every step, the mesh's loss and its mean gradients equal one process's (rank 0
//   computes the model of common/layers/model.cpp, itself checked against PyTorch, on the
//   whole global batch from the same weights) within 4 n eps max|want|; the AdamW step equals
//   one process's on the same gradients bit for bit; the balancing bias likewise; every
//   replica of a weight holds the same bits; the communication per axis equals its formula.
// Checkpoints: --save DIR writes the model as full tensors (every rank its own slices, in place),
//   --resume DIR goes on from one on any mesh (checkpoint.h).
// Run:  make run L=08                    (16 ranks: DP 2 x PP 2 x CP 2 x TP 2, EP 2 folded)
//       make run L=08 NP=32                              (the same with DP 4)
//       make run L=08 NP=4                               (DP 2 x TP 2, SP, ZeRO-1)
//       make run L=08 NP=4 ARGS="--tp 1 --zero 0"       (plain data parallelism)
//       make run L=08 NP=4 ARGS="--cp 2"                (CP 2 x TP 2: the ring inside TP)
//       make run L=08 NP=1 ARGS="--estimate deepseek-v3" (the memory model of the real thing)
// This file is the story: the mesh, the model on it and its optimizers, then every step
// trained (train_step) and checked against one process, the report and the verdict. Beside it:
// options.h (the flags and their checks), sharding.h (who holds what), mesh_model.h (the model
// on the mesh and its pipeline stages; forward.cpp, its forward), reference_check.h (the mesh gathered for the check and
// its one-process twin), formulas.h (the bytes each axis should move), report.h (what is
// printed and written), estimate.h (--estimate).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/comm/mesh.h"
#include "common/layers/fp8_linear.h"
#include "common/layers/model.h"
#include "common/layers/pipeline.h"
#include "common/layers/tensor_parallel.h"
#include "lessons/08_mesh/zero.h"
#include "common/lesson/corpus.h"
#include "common/lesson/lesson.h"
#include "common/util/trace.h"
#include "lessons/08_mesh/checkpoint.h"
#include "lessons/08_mesh/formulas.h"
#include "lessons/08_mesh/mesh_model.h"
#include "lessons/08_mesh/options.h"
#include "lessons/08_mesh/reference_check.h"
#include "lessons/08_mesh/report.h"
#include "lessons/08_mesh/sharding.h"

using namespace ff;
using namespace ff::mesh;

namespace {

// The optimizers of a rank: the dense weights' and, under EP, the experts'; under ZeRO-3 with
// SP the replicated weights' apart (their gradient shards summed over TP); the ZeRO-3 units.
struct Optimizers {
  Optimizers(const Options& opts, const Setup& setup, Mesh& mesh, RankModel& here, const AdamConfig& adam);
  zero::GroupAdam dense, experts, replicated;
  std::optional<fsdp::Fsdp> fsdp;
  // From here on a weight's next gradient is its last of the step: each group's buckets post
  // their reduction as soon as they fill, while the backward goes on (buckets.h)
  void arm_buckets() { dense.arm(), experts.arm(), replicated.arm(); }
};

zero::Bug zero_bug(Bug bug) {  // the ZeRO optimizer's own planted bugs
  return bug == Bug::zero_no_divide ? zero::Bug::no_divide : bug == Bug::zero_stale_shard ? zero::Bug::stale_shard : zero::Bug::none;
}
// The one-process twin's configuration: the mesh's model, AdamW, ZeRO stage, rates and batch.
OneProcess::Config twin_config(const Options& opts, const Setup& setup, const AdamConfig& adam, const ParamTable& table,
                               double n_terms) {
  OneProcess::Config twin;
  twin.model = setup.c, twin.adam = adam, twin.zero_stage = (int)opts.zero, twin.bias_rate = opts.bias_rate;
  twin.bug_kpe = opts.bug == Bug::kpe_per_head, twin.names = table.names, twin.n_terms = n_terms, twin.batch = opts.batch;
  twin.precision = opts.precision;
  return twin;
}
int zero3_units(const Options& opts, const Setup& setup) {  // ZeRO-3's: embedding, blocks, head
  return opts.zero == 3 ? (int)setup.c.layers + 2 : 0;
}

Optimizers::Optimizers(const Options& opts, const Setup& setup, Mesh& mesh, RankModel& here, const AdamConfig& adam)
    : dense(mesh.dp_cp(), adam, (int)opts.zero, zero_bug(opts.bug), (size_t)(opts.bucket_mb * 1e6), zero3_units(opts, setup)),
      experts(mesh.edp(), adam, (int)opts.zero, zero::Bug::none, (size_t)(opts.bucket_mb * 1e6), zero3_units(opts, setup)),
      replicated(mesh.dp_cp().duplicate_counted(), adam, (int)opts.zero, zero_bug(opts.bug),
                 (size_t)(opts.bucket_mb * 1e6), zero3_units(opts, setup)) {  // under SP, with ZeRO-3 or buckets:
                 // its own communicator, so that its buckets' order and the dense ones' never mix
  // [slide:ep-optimizers]
  // Two optimizers: the dense weights averaged over DP x CP (data_ranks); under EP the experts
  // over expert-DP (the stage's ranks holding the same experts, edp = dp cp tp / ep). Their
  // summed gradient holds every token of the stage once, so the mean divides it by data_ranks,
  // not by edp (the planted bug ep-grad-mean: off by tp / ep).
  const ParamTable& table = here.table;
  for (size_t k = 0; k < table.names.size(); k++)
    if (table.params[k]) {
      const Group g = group_of(table.names[k], opts, setup.sizes.ep);
      (g == Group::experts ? experts : g == Group::replicated ? replicated : dense)
          .add(table.params[k], k, unit_of(table.names[k], setup.c.layers));
    }
  if (opts.bug != Bug::ep_grad_mean) experts.divide_by(mesh.dp_cp().size());
  // [/slide]
  dense.layout(), experts.layout(), replicated.layout();  // the buckets, and the hooks that post them
  if (opts.zero < 3 && !replicated.params.empty()) replicated.sum_after_reduce(&mesh.tp());  // SP's sum
  if (opts.bug == Bug::bucket_early) dense.buckets().post_one_early(true);
  if (opts.zero < 3) return;
  // ZeRO-3: every group's shards, gathered unit by unit around the model's forward and backward
  std::vector<fsdp::ShardGroup*> sharded;
  for (zero::GroupAdam* g : {&dense, &replicated, &experts})
    if (g->shards()) sharded.push_back(g->shards()), g->shards()->stale_backward = opts.bug == Bug::zero3_stale_gather;
  fsdp.emplace(sharded, zero3_units(opts, setup));
  fsdp->start();
  here.model.fsdp = &*fsdp;
}

// --overlap compare: the step's forward and backward twice more before it with its paired F&B
// steps one after the other: without the link model (their compute, T_compute) and with it
// (T_seq); the gradients kept aside (train_step compares the overlapped run's with them, bit
// for bit). Lesson 06's measure then takes T_comm = T_seq - T_compute.
void sequential_passes(const Setup& setup, Mesh& mesh, RankModel& here, const CharCorpus::Batch& batch,
                       Device device, PairCompare* compare) {
  for (int pass = 0; pass < 2; pass++) {
    Comm::set_link(pass == 0 ? LinkModel{} : setup.link);  // every rank, between two steps' messages
    for (Tensor* p : here.table.params)
      if (p) p->zero_grad();
    here.stages.inputs = batch.inputs.to(device), here.stages.targets = batch.targets.to(device);
    here.stages.routes.clear();
    pp::ExecutorOptions one_after_other;
    one_after_other.overlap_pairs = false;
    pp::Executor executor(mesh.pp(), here.sched, here.stages, one_after_other);
    executor.run();
    (pass == 0 ? compare->step_compute : compare->step_seq) = executor.paired_wall_s();
  }
  compare->grads.clear();
  for (Tensor* p : here.table.params)
    compare->grads.push_back(p && p->grad().defined() ? p->grad().to_vector() : std::vector<float>());
  here.maps.clear();
}

// --resume: every rank's slices of the checkpoint, on this mesh; the check's twin reads it whole.
// Returns the steps done before this run (0 without --resume).
int64_t resume_if_asked(Lesson& lesson, Options& opts, const Setup& setup, Mesh& mesh, RankModel& here,
                        Optimizers& opt, OneProcess& one_process) {
  if (opts.resume.empty()) return 0;
  const CheckpointInfo got = resume_checkpoint(lesson, opts.resume, opts, setup, mesh, here,
                                               {{&opt.dense, &opt.replicated, &opt.experts}});
  one_process.resume(got.dir, got.adam_steps);
  if (opts.steps == 0) opts.steps = got.steps_done;  // --train 0: no step, the model as it was saved
  lesson.print("resumed from %s: %lld steps done (%s checked and read in %.1f ms, %.0f MB/s)\n",
               got.dir.c_str(), (long long)got.steps_done, human_bytes((double)got.bytes).c_str(),
               got.seconds * 1e3, (double)got.bytes / got.seconds / 1e6);
  lesson.print("  the run goes on: lineage %s, seed %lld, step %lld's batch next%s%s\n", setup.run.c_str(),
               (long long)lesson.flags.seed, (long long)got.steps_done, setup.restored.empty() ? "" : "; from the checkpoint: ",
               setup.restored.c_str());
  return got.steps_done;
}

// pp = 1 (the whole model, one stage, on every rank): this rank's micro-batches one after the
// other, each its forward (forward.cpp), its share of the step's loss and its backward
// (core/autograd.cpp), the weights' gradients adding up over the micro-batches. Returns the sum
// of the shares.
double forward_backward(const Setup& setup, RankModel& here, Optimizers& opt, Device device) {
  MeshModel& model = here.model;
  MeshStages& step = here.stages;  // this step's sequences, by micro-batch, and their routes
  const MeshModel::Tokens tokens = model.tokens(step.Bm, step.T);
  double loss_sum = 0;
  for (int gm = 0; gm < step.M; gm++) {
    Trace::Scope span(trace(), "F+B(" + std::to_string(gm) + ")", "compute");  // --trace
    Tensor x = model.embed(step.inputs_of(gm), tokens);
    x = model.blocks(x, 0, setup.c.layers, tokens, &step.routes);
    const Tensor loss = step.share_of_step(model.head_loss(x, step.targets_of(gm)));
    loss_sum += loss.item();
    // DP's gradient buckets fly during the last micro-batch's backward
    if (gm + 1 == step.M && setup.bucket_overlap) opt.arm_buckets();
    run_backward(loss, Tensor::full({}, 1.f, device));
  }
  return loss_sum;
}

// pp > 1 (or a V of two stages on one rank): lesson 07's executor runs this rank's program of
// the schedule, calling MeshStages::forward (forward.cpp) for each F and run_backward for each
// B, I and W. Returns the sum of this rank's micro-batches' shares of the loss (0 off the last
// stage).
double pipeline_forward_backward(const Options& opts, const Setup& setup, Mesh& mesh, RankModel& here,
                                 Optimizers& opt, PairCompare* compare) {
  pp::ExecutorOptions executor_options;
  executor_options.overlap_pairs = opts.overlap != "off";
  // DP's gradient buckets fly from the rank's last step that adds into the weights' gradients
  if (setup.bucket_overlap) executor_options.before_last_weight_grads = [&opt] { opt.arm_buckets(); };
  pp::Executor executor(mesh.pp(), here.sched, here.stages, executor_options);
  executor.run();
  if (compare) compare->overlapped(executor.paired_wall_s(), here.table.params);
  return executor.local_loss();
}

// [slide:step]
// One training step of this rank on its share of the global batch (its DP rows, its CP
// columns); returns its share of the loss (on the last pipeline stage; 0 elsewhere).
double train_step(const Options& opts, const Setup& setup, Mesh& mesh, RankModel& here, Comm& pair,
                  Optimizers& opt, const CharCorpus::Batch& batch, Device device, PairCompare* compare) {
  const ParamTable& table = here.table;
  const bool dual = here.sched.layout == pp::Layout::dual;
  // 1. forward and backward of this rank's share: its DP slice, its heads (its tokens), its
  //    stages, micro-batch by micro-batch (under PP in the order of the pipeline schedule)
  for (Tensor* p : table.params)
    if (p) p->zero_grad();
  here.stages.inputs = batch.inputs.to(device), here.stages.targets = batch.targets.to(device);
  here.stages.routes.clear();
  const double local_loss = setup.stages == 1 ? forward_backward(setup, here, opt, device)
                                              : pipeline_forward_backward(opts, setup, mesh, here, opt, compare);
  if (opt.fsdp) opt.fsdp->end_backward();
  std::vector<float> load = expert_loads(here.stages.routes, setup.c);
  // [slide:sp-grads]
  // [slide:sp-grads-why]
  // 2. SP: each TP rank saw only its tokens, so a replicated weight's gradient is a partial
  //    sum: all-reduce them over TP (one flat buffer). The planted bug forgets the norms'.
  // [/slide:sp-grads-why]
  if (opts.sp && !opt.replicated.params.empty()) {
    // ZeRO-3 and the buckets reduce them over DP first: the sum over TP of the reduced
    // gradients (ZeRO-1 to -3: of the shards) is the reduction of the sum. The buckets' optimizer
    // step does it (sum_after_reduce); ZeRO-3's shards are summed here.
    if (opt.fsdp) opt.replicated.shards()->sum_grad_shards(mesh.tp());
    if (here.held_moe > 0) mesh.tp().allreduce_sum(load.data(), load.size());
  // [slide:sp-grads-short]
  } else if (opts.sp) {
    std::vector<Tensor*> replicated;
    for (size_t k = 0; k < table.names.size(); k++)
      if (table.params[k] && split_of(table.names[k], setup.sizes.ep) == Split::replicated &&
          !(opts.bug == Bug::sp_norm_grad && is_norm_weight(table.names[k])))
        replicated.push_back(table.params[k]);
    zero::sum_grads(replicated, mesh.tp());
    if (here.held_moe > 0) mesh.tp().allreduce_sum(load.data(), load.size());
  }
  // [/slide:sp-grads-short]
  // [/slide:sp-grads]
  // [slide:dualpipe-copies]
  // DualPipe: stage s lives on rank s (direction 0) and on rank P-1-s (direction 1), each
  // copy's gradient from its direction's micro-batches: the pair sums them, so both copies
  // take the same AdamW step (the replica check compares their bits), and their MoE loads
  if (dual && opts.bug != Bug::dualpipe_no_pair_sum) {
    std::vector<Tensor*> held;
    for (Tensor* p : table.params)
      if (p) held.push_back(p);
    zero::sum_grads(held, pair);
    if (here.held_moe > 0) pair.allreduce_sum(load.data(), load.size());
  }
  // [/slide]
  // 3. the optimizer over DP: the mean gradient, AdamW (ZeRO-0 everywhere, ZeRO-1 on shards);
  //    every group's remaining buckets posted before any group waits
  opt.dense.flush(), opt.replicated.flush(), opt.experts.flush();
  opt.dense.step();
  opt.replicated.step();
  opt.experts.step();
  // 4. the balancing bias from the loads of the whole global batch
  if (mesh.dp_cp().size() > 1 && here.held_moe > 0) mesh.dp_cp().allreduce_sum(load.data(), load.size());
  update_biases(here.model.weights, load, setup.c.experts, opts.bias_rate);
  here.load = std::move(load);
  return local_loss;
}
// [/slide]

int mesh_lesson(Lesson& lesson) {
  Options opts;
  const std::optional<Setup> parsed = parse_options(lesson, opts);
  if (!parsed) return lesson.finish(0);  // --print-mesh or --estimate deepseek-v3: printed
  const Setup& setup = *parsed;
  const MeshSizes& sizes = setup.sizes;
  const bool root = lesson.rank() == 0;

  // ---- the mesh, the model on it (this rank's shards of its stages), the optimizers
  Mesh mesh(lesson.comm, sizes);
  CheckComms check_comms(lesson.comm, mesh);  // the check's traffic, counted apart
  // DP and CP ranks hold the same weights and see different tokens: the gradients are averaged
  // over both (mesh.dp_cp(), of data_ranks ranks), and ZeRO shards over them
  Comm& data = mesh.dp_cp();
  const int data_ranks = data.size();
  model::Params full = model::init_params(setup.c, (uint64_t)lesson.flags.seed, lesson.device);
  if (opts.precision == "bf16") full.hold_matmuls_in_bf16();  // its shards bf16 too, AdamW's masters float32
  // fp8: every forward of the model, the mesh's and the one process's, runs MLA's projections and
  // the dense FFN through fp8_linear while `fp8_layers` lives (the run); else matmul. A TP rank's
  // shards are whole tiles (options.cpp: resolve_fp8_tile), so it quantizes them as one process does.
  const fp8::Fp8Recipe recipe{opts.fp8_tile, /*promote=*/opts.fp8_tile};
  const model::LinearScope fp8_layers(opts.precision == "fp8" ? fp8::fp8_linears(recipe) : model::LinearFn{});
  const moe::ExpertGemmScope fp8_experts(opts.fp8_experts == "on" ? fp8::fp8_expert_gemms(recipe) : moe::GemmFn{});
  RankModel here(opts, setup, mesh, full, lesson.device);
  const ParamTable& table = here.table;
  AdamConfig adam;
  adam.lr = opts.lr;
  Comm& edp = mesh.edp();
  Optimizers opt(opts, setup, mesh, here, adam);
  zero::GroupAdam &dense_opt = opt.dense, &expert_opt = opt.experts, &replicated_opt = opt.replicated;
  std::optional<fsdp::Fsdp>& fsdp = opt.fsdp;
  // DualPipe's pair: pipeline ranks q and P-1-q hold the same two stages
  const bool dual = here.sched.layout == pp::Layout::dual;
  const int pp_rank = mesh.coords().pp;
  Comm pair = mesh.pp().split(std::min(pp_rank, (int)opts.pp - 1 - pp_rank), pp_rank);
  pair.set_label("pp");

  // the reference: one process, on rank 0, from the same weights (resynchronised every step)
  const double n_terms = (double)(opts.batch * setup.seq);  // the longest sum: a weight gradient's, over tokens
  const double eps = std::numeric_limits<float>::epsilon();
  OneProcess one_process(lesson, twin_config(opts, setup, adam, table, n_terms), setup.corpus);
  const int64_t first_step = resume_if_asked(lesson, opts, setup, mesh, here, opt, one_process);
  Lineage lineage{setup.run, {}};  // --save: this run's checkpoints (--keep prunes the lineage's)
  print_header(lesson, opts, setup, here, edp.size());

  // ---- training: every step trained, its traffic per axis counted, and checked
  const AxisComms axes{&mesh.tp(), &data, &mesh.cp(), &edp,
                       {&mesh.ep(), &here.topo.node_comm, &here.topo.rail_comm}, {&mesh.pp(), &pair}};
  AxisCounts want =
      expected_counts(here, setup, opts, data_ranks, edp.size(), dual);
  AxisCounts last;  // what each axis moved in the last step (Comm's counters)
  bool comm_equal = true;
  std::string disagree, comm_detail;
  std::ostringstream csv;
  lesson.start_trace();
  Comm::set_link(setup.link);  // the training's messages only: the model is switched off after it
  double train_s = 0;
  zero::BucketTimes bucket_times;                   // the groups' together, summed over the steps
  std::optional<PairCompare> compare;               // --overlap compare
  if (opts.overlap == "compare") compare.emplace();
  int64_t gathers_in_step = 0;                      // ZeRO-3's unit gathers in the last step
  for (int64_t step = first_step; step < opts.steps; step++) {
    const bool checking = step % opts.check_every == 0 || step + 1 == opts.steps;
    const bool logging = step % opts.log_every == 0 || step + 1 == opts.steps;
    {  // the ranks start each step together (the check before it ends on rank 0 last), so a
       // trace's step shows the step
      Trace::Category check_traffic(trace(), "check");
      check_comms.world.barrier();
    }
    const Stopwatch watch;
    std::optional<Trace::Scope> step_span;  // the step's training on the compute track, check excluded
    step_span.emplace(trace(), "step " + std::to_string(step), "compute");
    axes.reset();
    here.maps.clear();
    const int64_t row0 = (int64_t)mesh.coords().dp * setup.rank_batch;
    CharCorpus::Batch batch = setup.corpus.batch(CharCorpus::Split::train, step, opts.batch, setup.seq, row0, row0 + setup.rank_batch,
                                             (uint64_t)lesson.flags.seed);
    batch = {take_columns(batch.inputs, here.my_columns()), take_columns(batch.targets, here.my_columns())};

    const int64_t gathers_before = fsdp ? fsdp->unit_gathers() : 0;
    if (compare) {  // --overlap compare: the pairs one after the other first, their traffic forgotten
      sequential_passes(setup, mesh, here, batch, lesson.device, &*compare);
      compare->timing = step > 0 || opts.steps == 1;  // step 0 warms up
      axes.reset();
    }
    const double local_loss = train_step(opts, setup, mesh, here, pair, opt, batch, lesson.device,
                                         compare ? &*compare : nullptr);
    if (opts.zero < 3) {
      zero::BucketTimes step_times;
      for (zero::GroupAdam* g : {&dense_opt, &replicated_opt, &expert_opt})
        if (!g->params.empty()) step_times = zero::BucketTimes::concurrent(step_times, g->buckets().times());
      bucket_times += step_times;
    }

    train_s += watch.seconds();
    if (fsdp) gathers_in_step = fsdp->unit_gathers() - gathers_before;
    step_span.reset();
    // what each axis moved against the formulas (EP's from this step's routing)
    last = axes.counts();
    want.ep = formula_ep(here.maps, mesh.coords().ep, here.topo.R, here.model.scheme, setup.c.dim, 1,
                         opts.precision == "bf16");
    const std::string differs = first_difference(last, want);
    if (!differs.empty() && comm_equal) {
      comm_equal = false;
      comm_detail = "step " + std::to_string(step) + ": " + differs;
    }
    // the check: the mesh's loss, mean gradients and new weights against one process's
    if (fsdp) {  // the check reads every weight
      Trace::Category check_traffic(trace(), "check");
      fsdp->gather_all();
    }
    StepOnMesh on_mesh{here, dense_opt, replicated_opt, expert_opt, sizes};
    on_mesh.local_loss = local_loss, on_mesh.step = step, on_mesh.checking = checking, on_mesh.last = step + 1 == opts.steps;
    const CheckedStep checked = check_step(lesson, one_process, check_comms, on_mesh, &disagree);
    if (fsdp) fsdp->free_all();
    if (root) {  // one process's loss, the row's reference, is rank 0's: print_step is rank 0's
      print_step(opts, sizes, step, checking, logging, checked, checked.twin.loss_bound, last, csv);
    }
    if (!opts.save.empty() && ((opts.save_every > 0 && (step + 1) % opts.save_every == 0) || step + 1 == opts.steps))
      save_checkpoint(lesson, opts.save, opts.keep, opts, setup, mesh, here, {{&dense_opt, &replicated_opt, &expert_opt}},
                      &lineage, step + 1);
  }
  Comm::set_link(LinkModel{});

  // ---- memory, communication per axis, the estimate, the CSV
  // under EP two optimizers: the dense weights over DP x CP, the experts over expert-DP
  RunSummary run;
  run.last = last, run.want = want;
  MemoryUse& mem = run.mem;
  mem.measured = dense_opt.memory() + replicated_opt.memory() + expert_opt.memory();
  mem.formula = group_memory(here, setup, opts, Group::dense, data_ranks) +
                group_memory(here, setup, opts, Group::replicated, data_ranks) +
                (sizes.ep > 1 ? group_memory(here, setup, opts, Group::experts, edp.size()) : zero::Memory{});
  run.dense_numel = dense_opt.numel, run.expert_numel = expert_opt.numel, run.local_numel = table.local_numel;
  run.data_ranks = data_ranks, run.edp = edp.size();
  run.train_s = train_s, run.trained_steps = opts.steps - first_step;
  if (fsdp) run.zero3 = {fsdp->peak_gathered_bytes(), gathers_in_step};
  print_report(lesson, opts, setup, run, csv);
  if (compare) print_pair_overlap(lesson, check_comms.world, setup, *compare);
  if (opts.bucket_mb > 0) print_buckets(lesson, check_comms.world, opts, setup, bucket_times);
  if (opts.estimate == "run") print_estimate(lesson, setup, opts, mem, table.local_numel, last);
  if (!lesson.flags.csv.empty()) rank_rows(lesson, check_comms.world, opts, sizes, last, want, csv);
  // one file for the figures: a row per step (loss, the check, bytes per axis), one for memory
  // and, per rank, one of the bytes it sent per axis in the last step and one of the formula's
  lesson.csv_append("kind,dp,tp,zero,sp,step,loss_mesh,loss_ref,grad_err_ratio,tp_bytes,dp_bytes,"
               "mem_params,mem_grads,mem_optimizer,mem_buffers,formula_total,cp,cp_bytes,pp,ep,"
               "ep_bytes,edp_bytes,pp_bytes,rank",
               csv.str());

  // ---- after training: the validation loss of the mesh and of one process, a dump, a sample
  const Validation val = validate(lesson, one_process, check_comms, here, setup, opts, mesh.coords().dp);
  lesson.print("validation loss after %lld steps (%lld batches, %lld tokens): %.6f (mesh), "
               "%.6f (one process)\n", (long long)opts.steps, (long long)opts.val_batches,
               (long long)(opts.val_batches * opts.batch * setup.seq), val.mesh, val.one_process);
  // the trained model whole is one process's, on rank 0: it alone dumps it and draws the sample
  if (root && lesson.dumping()) dump_trained(lesson, setup, opts.batch, one_process.model(), val.first_mesh);
  if (opts.sample > 0) {
    const std::string sample = root ? sample_text(setup.c, one_process.model(), setup.corpus, opts.prompt, opts.sample,
                                                  opts.temperature, (uint64_t)lesson.flags.seed)
                                    : std::string();
    lesson.print("\nsample (%lld bytes, temperature %g, seed %lld):\n%s\n\n", (long long)opts.sample,
                 opts.temperature, (long long)lesson.flags.seed, sample.c_str());
  }

  // ---- the verdict
  CheckReport check(lesson.comm);
  char line[512];
  one_process.verdict(check, root);  // the loss, the gradients, AdamW and the bias
  std::snprintf(line, sizeof line, "every copy of a replicated weight (over TP and DP%s) and of the "
                "bias holds the same bits%s%s", dual ? ", and DualPipe's two of every stage" : "",
                disagree.empty() ? "" : ": not ", disagree.c_str());
  check.holds(line, !root || disagree.empty());
  std::snprintf(line, sizeof line, "communication per axis = the formula, every step%s%s",
                comm_equal ? "" : ": ", comm_detail.c_str());
  check.holds(line, comm_equal);
  // measured: the storage of the parameter and gradient tensors, and the m and v AdamW holds;
  // a parameter no token reached (an idle expert under ZeRO-1) may hold no gradient at all
  size_t grads_held = 0;
  for (const Tensor* p : table.params)
    if (p && p->grad().defined()) grads_held += p->nbytes();
  const bool trained = opts.steps > first_step;  // (--resume --train 0: no gradient yet)
  const bool grads_ok = opts.zero >= 2 ? grads_held == 0 && (mem.measured.grads == mem.formula.grads ||
                                                             (!trained && mem.measured.grads == 0))
                                       : mem.measured.grads == grads_held && grads_held <= mem.formula.grads;
  check.holds(memory_check_name(opts).c_str(), mem.measured.params == mem.formula.params && grads_ok &&
                        mem.measured.optimizer == mem.formula.optimizer);
  if (compare)
    check.holds(("the overlapped pairs' gradients = one after the other's, bit for bit, every step" +
                 (compare->equal ? std::string() : ": not " + compare->first_differs)).c_str(), compare->equal);
  one_process.kpe_verdict(check, root);
  // the tolerance from one process's loss (a non-finite mesh loss must not widen it)
  // (bf16, fp8: and twice one process's mean error of a token's loss, as the training's loss)
  double val_want[2] = {root ? val.one_process : val.mesh, 2 * val.token_err};
  Trace::Category check_traffic(trace(), "check");
  check_comms.world.bcast(val_want, sizeof val_want, 0);
  check.holds("validation loss of the mesh is finite", std::isfinite(val.mesh));
  check.scalar("validation loss, mesh vs one process (same weights)", val.mesh, val_want[0],
               kLossBound * n_terms * eps * std::max(1.0, std::fabs(val_want[0])) + val_want[1]);
  return lesson.finish(check);
}

}  // namespace

int main(int argc, char** argv) { return run_lesson(argc, argv, "08_mesh", mesh_lesson); }
