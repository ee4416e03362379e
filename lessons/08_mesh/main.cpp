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
//         over DP by the optimizer: ZeRO-0 (one all-reduce, AdamW everywhere) or ZeRO-1
//         (reduce-scatter, AdamW on this rank's shard of m and v, all-gather).
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
// Run:  make run L=08                    (16 ranks: DP 2 x PP 2 x CP 2 x TP 2, EP 2 folded)
//       make run L=08 NP=32                              (the same with DP 4)
//       make run L=08 NP=4                               (DP 2 x TP 2, SP, ZeRO-1)
//       make run L=08 NP=4 ARGS="--tp 1 --zero 0"       (plain data parallelism)
//       make run L=08 NP=4 ARGS="--cp 2"                (CP 2 x TP 2: the ring inside TP)
//       make run L=08 NP=1 ARGS="--estimate deepseek-v3" (the memory model of the real thing)
// This file is the story (set up the mesh and the model, train and check every step, report);
// beside it: options.h (the flags and their checks), sharding.h (who holds what),
// mesh_model.h (the model on the mesh and its pipeline stages), reference_check.h (the mesh
// gathered for the check), formulas.h (the bytes each axis should move), estimate.h (--estimate).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/comm/mesh.h"
#include "common/comm/overlap.h"
#include "common/layers/dsv3_ep.h"
#include "common/layers/model.h"
#include "common/layers/pipeline.h"
#include "common/layers/tensor_parallel.h"
#include "common/layers/zero.h"
#include "common/lesson/corpus.h"
#include "common/lesson/files.h"
#include "common/lesson/lesson.h"
#include "lessons/02_ring_attention/ring.h"
#include "lessons/07_dualpipe/schedules.h"
#include "lessons/08_mesh/estimate.h"
#include "lessons/08_mesh/formulas.h"
#include "lessons/08_mesh/mesh_model.h"
#include "lessons/08_mesh/options.h"
#include "lessons/08_mesh/reference_check.h"
#include "lessons/08_mesh/sharding.h"

using namespace ff;
using namespace ff::mesh;

namespace {

zero::Memory operator+(zero::Memory a, const zero::Memory& b) {
  a.params += b.params, a.grads += b.grads, a.optimizer += b.optimizer, a.buffers += b.buffers;
  return a;
}

// The columns `cols` of an int64 (B, T) token batch: a CP rank's tokens of every sequence.
Tensor take_columns(const Tensor& t, const std::vector<int64_t>& cols) {
  const int64_t B = t.size(0), T = t.size(1);
  const std::vector<int64_t> all = t.to_index_vector();
  std::vector<int64_t> out;
  for (int64_t b = 0; b < B; b++)
    for (int64_t j : cols) out.push_back(all[(size_t)(b * T + j)]);
  return Tensor::from_indices(out, {B, (int64_t)cols.size()}, t.device());
}

// ----------------------------------------------------------------------------
// Text from the trained model (rank 0, one process's forward on the gathered weights): each
// next byte drawn from softmax(logits / temperature) with a generator seeded by --seed.
std::string sample_text(const model::Config& c, const model::Params& p, const CharCorpus& corpus,
                        const std::string& prompt, int64_t count, double temperature,
                        uint64_t seed) {
  std::vector<int64_t> ids = corpus.encode(prompt);
  std::mt19937_64 gen(seed);
  NoGradGuard ng;
  const Device dev = p.embed.device();
  for (int64_t k = 0; k < count; k++) {
    const int64_t T = std::min<int64_t>((int64_t)ids.size(), c.seq_len);
    std::vector<int64_t> ctx(ids.end() - T, ids.end());
    Tensor in = Tensor::from_indices(ctx, {1, T}, dev);
    model::Output o = model::forward(c, p, in, in, model::positions(T, dev));
    const std::vector<float> z = slice(o.logits, 0, T - 1, T).to_vector();
    const float zmax = *std::max_element(z.begin(), z.end());
    std::vector<double> w(z.size());
    double sum = 0;
    for (size_t j = 0; j < z.size(); j++) sum += w[j] = std::exp(((double)z[j] - zmax) / temperature);
    const double u = (double)(gen() >> 11) * 0x1.0p-53 * sum;  // uniform in [0, sum)
    size_t j = 0;
    for (double acc = w[0]; acc <= u && j + 1 < w.size(); acc += w[++j]) {
    }
    ids.push_back((int64_t)j);
  }
  return corpus.decode(ids);
}

// ----------------------------------------------------------------------------

int mesh_lesson(Lesson& L) {
  Options o;
  const std::optional<Setup> setup = parse_options(L, o);
  if (!setup) return L.finish(0);  // --print-mesh or --estimate deepseek-v3: printed
  const MeshSizes& sizes = setup->sizes;
  const int64_t B = setup->B, T = setup->T, Tc = setup->Tc, M = setup->M, Bm = setup->Bm;
  const int S = setup->S;
  const bool sched_pairs = setup->sched_pairs, real_nodes = setup->real_nodes, bug_kpe = setup->bug_kpe;
  const std::vector<int64_t>& stage_begin = setup->stage_begin;
  const LinkModel& link = setup->link;
  const CharCorpus& corpus = setup->corpus;
  const model::Config& c = setup->c;
  const int64_t full_numel = setup->full_numel;

  // ---- the mesh, the model on it, the optimizer
  Mesh mesh(L.comm, sizes);
  Comm check_world = L.comm.split(0, L.rank());  // the check's own traffic, counted apart
  // DP and CP ranks hold the same weights and see different tokens: the gradients are averaged
  // over both (mesh.dp_cp(), W ranks), and ZeRO-1 shards the optimizer over them
  Comm& data = mesh.dp_cp();
  const int W = data.size();
  Comm check_dp = data.split(0, data.rank());
  const int t = mesh.coords().tp;
  const model::Params full = model::init_params(c, (uint64_t)L.flags.seed, L.device);
  MeshModel mm;
  mm.c = c;
  mm.p = shard_model(c, full, mesh.coords(), sizes, bug_kpe);
  mm.device = L.device;
  mm.tp = &mesh.tp();
  mm.sp = o.sp;
  mm.ce_local_softmax = o.bug == "ce-local-softmax";
  {
    int64_t e;
    split_range(c.vocab, sizes.tp, t, &mm.v0, &e);
  }
  mm.cp = &mesh.cp();
  for (int r = 0; r < sizes.cp; r++)
    mm.cp_positions.push_back(ring::layout_positions(ring::Layout::zigzag, T, sizes.cp, r));
  mm.local_mask = o.bug == "local-causal-mask";
  mm.local_rope = o.bug == "local-rope-positions";
  mm.ep = &mesh.ep();
  dsv3::Topology topo = dsv3::make_topology(mesh.ep(), o.a2a == "hierarchical" ? (int)o.ranks_per_node : 1);
  topo.node_comm.set_label("ep-node"), topo.rail_comm.set_label("ep-rail");
  mm.topo = &topo;
  mm.scheme = o.a2a == "hierarchical" ? dsv3::Scheme::hierarchical : dsv3::Scheme::flat;
  std::vector<dsv3::RoutingMap> maps;
  mm.maps = &maps;
  const std::vector<int64_t>& my_cols = mm.cp_positions[(size_t)mesh.coords().cp];
  // PP: the schedule, and the stages each pipeline rank holds; this rank keeps only the
  // weights of its own stages
  const pp::Schedule sched = pp::make_schedule(o.schedule, (int)o.pp, (int)M);
  const StagePlan plan{stage_begin, sched};
  release_other_stages(&mm.p, plan, mesh.coords().pp);
  int64_t held_moe = 0;  // the MoE layers of this rank's stages
  for (const model::Block& b : mm.p.layers) held_moe += b.moe && b.experts.bias.defined();
  MeshStages stages;
  stages.mm = &mm, stages.begin = stage_begin, stages.M = M, stages.Bm = Bm, stages.T = Tc;
  stages.mb_sum = o.bug == "pp-mb-sum";
  std::vector<std::string> names;
  std::vector<Shape> full_shapes;
  std::vector<Tensor*> params;  // per name: this rank's tensor, nullptr for another stage's
  std::vector<model::NamedTensor> named = mm.p.named_parameters();
  std::map<std::string, Tensor*> by_name;
  for (model::NamedTensor& n : named) by_name[n.name] = &n.t;
  for (const model::NamedTensor& n : full.named_parameters()) {
    names.push_back(n.name);
    full_shapes.push_back(n.t.shape());
    params.push_back(plan.holds(n.name, mesh.coords().pp) ? by_name.at(n.name) : nullptr);
  }
  if (bug_kpe)  // the gathered W_kr is (d, H d_r): every head's copy
    for (size_t k = 0; k < names.size(); k++)
      if (names[k].size() > 9 && names[k].compare(names[k].size() - 9, 9, "attn.w_kr") == 0)
        full_shapes[k] = {c.dim, c.heads * c.d_rope};
  // the balancing biases (no parameters) are gathered with the weights
  std::vector<std::string> all_names = names;
  std::vector<Shape> all_shapes = full_shapes;
  for (const model::NamedTensor& n : full.named_buffers())
    all_names.push_back(n.name), all_shapes.push_back(n.t.shape());
  int64_t local_numel = 0, replicated_numel = 0;
  for (size_t k = 0; k < names.size(); k++) {
    if (!params[k]) continue;
    local_numel += params[k]->numel();
    if (split_of(names[k], sizes.ep) == Split::replicated) replicated_numel += params[k]->numel();
  }
  AdamConfig ac;
  ac.lr = o.lr;
  const zero::Bug zbug = o.bug == "zero-no-divide"     ? zero::Bug::no_divide
                         : o.bug == "zero-stale-shard" ? zero::Bug::stale_shard
                                                       : zero::Bug::none;
  // [slide:ep-optimizers]
  // Two optimizers: the dense weights averaged over DP x CP (W ranks); under EP the experts
  // over expert-DP, the ranks of the stage holding the same experts (edp = dp cp tp / ep).
  // Their summed gradient holds every token of the stage once (each reached its expert through
  // one EP group), so the mean over the global batch divides it by W, not by edp (the planted
  // bug ep-grad-mean divides by edp: tp / ep too small or too big).
  Comm& edp = mesh.edp();
  zero::GroupAdam dense_opt(data, ac, (int)o.zero, zbug), expert_opt(edp, ac, (int)o.zero, zero::Bug::none);
  for (size_t k = 0; k < names.size(); k++)
    if (params[k]) (split_of(names[k], sizes.ep) == Split::expert ? expert_opt : dense_opt).add(params[k], k);
  if (o.bug != "ep-grad-mean") expert_opt.divide_by(W);
  // [/slide]
  Comm check_edp = edp.split(0, edp.rank());
  if (o.bug == "f-no-allreduce") tp::testing::set_f_skips_allreduce(true);

  // the reference: one process, on rank 0, from the same weights (resynchronised every step)
  const double n_terms = (double)(o.batch * T);  // the longest sum: a weight gradient's, over tokens
  const double eps = std::numeric_limits<float>::epsilon();
  OneProcess one_process(L, c, ac, (int)o.zero, o.bias_rate, bug_kpe, names, n_terms, corpus, o.batch);

  if (L.rank() == 0) {
    std::printf("mesh %s: dp %d x %s%stp %d = %d ranks%s, ZeRO-%lld, SP %s%s\n", mesh_name(sizes, 0).c_str(),
                sizes.dp, sizes.pp > 1 ? ("pp " + std::to_string(sizes.pp) + " x ").c_str() : "",
                sizes.cp > 1 ? ("cp " + std::to_string(sizes.cp) + " x ").c_str() : "",
                sizes.tp, sizes.world(),
                sizes.ep > 1 ? (", ep " + std::to_string(sizes.ep) + " folded on them (expert-DP " +
                                std::to_string(edp.size()) + ", " + o.a2a + " all-to-all" +
                                (o.a2a == "hierarchical" ? ", " + std::to_string(topo.R) + (real_nodes ? " ranks per node" : " ranks per virtual node") : "") + ")").c_str()
                              : "",
                (long long)o.zero, o.sp ? "on" : "off",
                o.bug == "none" ? "" : ("; planted bug: " + o.bug).c_str());
    std::printf("model: vocab %lld, d %lld, %lld layers (%lld dense, %lld MoE: %lld experts, top-%lld, "
                "%lld shared), %lld heads, r_q %lld, r_kv %lld; %lld parameters, %lld on rank 0\n",
                (long long)c.vocab, (long long)c.dim, (long long)c.layers, (long long)c.dense_layers,
                (long long)(c.layers - c.dense_layers), (long long)c.experts, (long long)c.topk,
                (long long)c.shared, (long long)c.heads, (long long)c.q_lora, (long long)c.kv_lora,
                (long long)full_numel, (long long)local_numel);
    if (sizes.pp > 1 || M > 1) {
      std::string cut;
      for (int st = 0; st < S; st++)
        cut += (st ? ", " : "") + std::to_string(stage_begin[(size_t)st + 1] - stage_begin[(size_t)st]);
      std::printf("pipeline: %s, %d stages of %s blocks (embedding on the first, head and loss on the "
                  "last), %lld micro-batches of %lld sequences per DP rank%s\n",
                  o.schedule.c_str(), S, cut.c_str(), (long long)M, (long long)Bm,
                  !sched_pairs ? ""
                  : o.overlap == "on" ? "; F&B pairs overlapped at the all-to-alls"
                                      : "; F&B pairs one after the other");
    }
    if (link.enabled) std::printf("%s (point-to-point messages; the collectives as MPI runs them)\n",
                                  describe(link).c_str());
    std::printf("batch: %lld sequences x %lld tokens per step, %lld per DP rank%s; AdamW lr %g\n\n",
                (long long)o.batch, (long long)T, (long long)B,
                sizes.cp > 1 ? (", " + std::to_string(Tc) + " tokens of each per CP rank (zigzag)").c_str() : "",
                o.lr);
    std::printf("%5s  %11s  %13s  %9s  %9s  %8s  %6s  %10s  %10s%s\n", "step", "loss (mesh)",
                "loss (1 proc)", "|diff|", "bound", "grad err", "AdamW", "TP bytes", "DP bytes",
                (std::string(sizes.cp > 1 ? "    CP bytes" : "") + (sizes.ep > 1 ? "    EP bytes   EDP bytes" : "") +
                 (sizes.pp > 1 ? "    PP bytes" : "")).c_str());
  }

  // ---- training
  bool comm_equal = true;
  std::string disagree, comm_detail;
  AxisCounts last;  // what each axis moved in the last step (Comm's counters)
  // what each axis should move in one step (EP's depends on the step's routing: below)
  StageCounts st;
  st.M = M, st.head = plan.holds("head", mesh.coords().pp);
  if (sched.layout == pp::Layout::dual) st.M = M / 2;  // a stage's copy here sees one direction's
  for (int64_t l = 0; l < c.layers; l++)
    if (plan.holds_stage(plan.stage_of_layer(l), mesh.coords().pp))
      st.L++, (l < c.dense_layers ? st.D : st.moe)++;
  AxisCounts want;  // ... and by the formulas (EP's from each step's routing maps: in the loop)
  want.tp = formula_tp(c, st, Bm * Tc, sizes.tp, o.sp, replicated_numel);
  want.dp = formula_dp(c, dense_opt.numel, W, (int)o.zero, held_moe > 0);
  want.cp = formula_cp(c, st, Bm, Tc, sizes.tp, sizes.cp);
  if (sizes.ep > 1 && expert_opt.numel > 0) want.edp = formula_dp(c, expert_opt.numel, edp.size(), (int)o.zero, false);
  want.pp = formula_pp(sched, mesh.coords().pp, stages.boundary_shape(0, 0)[0], c.dim);
  // DualPipe's pair (rank q and P-1-q of the pipeline, holding the same two stages)
  const bool dual = sched.layout == pp::Layout::dual;
  Comm pair = mesh.pp().split(std::min(mesh.coords().pp, (int)o.pp - 1 - mesh.coords().pp), mesh.coords().pp);
  pair.set_label("pp");
  if (dual) {
    want.pp["allreduce"].calls += 1 + (held_moe > 0 ? 1 : 0);
    want.pp["allreduce"].bytes += (size_t)local_numel * sizeof(float) +
                                  (held_moe > 0 ? (size_t)((c.layers - c.dense_layers) * c.experts) * sizeof(float) : 0);
  }
  std::ostringstream csv;
  L.start_trace();
  Comm::set_link(link);  // the training's messages only: the model is switched off after it
  double train_s = 0;
  for (int64_t step = 0; step < o.steps; step++) {
    const bool checking = step % o.check_every == 0 || step + 1 == o.steps;
    const bool logging = step % o.log_every == 0 || step + 1 == o.steps;
    {  // the ranks start each step together (the check before it ends on rank 0 last), so a
       // trace's step shows the step
      Trace::Category check_traffic(trace(), "check");
      check_world.barrier();
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<Trace::Scope> step_span;  // the step's training on the compute track, check excluded
    step_span.emplace(trace(), "step " + std::to_string(step), "compute");
    mesh.tp().reset_collective_counts();
    data.reset_collective_counts();
    mesh.cp().reset_collective_counts();
    for (Comm* cm : {&mesh.ep(), &topo.node_comm, &topo.rail_comm, &edp, &mesh.pp(), &pair}) cm->reset_collective_counts();
    maps.clear();
    const int64_t row0 = (int64_t)mesh.coords().dp * B;
    CharCorpus::Batch batch = corpus.batch(CharCorpus::Split::train, step, o.batch, T, row0, row0 + B,
                                           (uint64_t)L.flags.seed);
    batch = {take_columns(batch.inputs, my_cols), take_columns(batch.targets, my_cols)};

    // [slide:step]
    // 1. forward and backward of this rank's share: its DP slice, its heads (its tokens), its
    //    stages, micro-batch by micro-batch in the order of the pipeline schedule
    for (Tensor* p : params)
      if (p) p->zero_grad();
    stages.inputs = batch.inputs.to(L.device), stages.targets = batch.targets.to(L.device);
    stages.routes.clear();
    pp::ExecutorOptions exo;
    exo.overlap_pairs = o.overlap == "on";
    pp::Executor ex(mesh.pp(), sched, stages, exo);
    ex.run();
    const double ex_loss = ex.local_loss();  // the sum of the micro-batches' shares
    const std::vector<Route>& routes = stages.routes;
    // [slide:sp-grads]
    // 2. SP: each TP rank saw only its tokens, so a replicated weight's gradient is a partial
    //    sum: all-reduce them over TP (one flat buffer). The planted bug forgets the norms'.
    std::vector<float> load = expert_loads(routes, c);
    if (o.sp) {
      std::vector<Tensor*> reps;
      for (size_t k = 0; k < names.size(); k++)
        if (params[k] && split_of(names[k], sizes.ep) == Split::replicated &&
            !(o.bug == "sp-norm-grad" && is_norm_weight(names[k])))
          reps.push_back(params[k]);
      zero::sum_grads(reps, mesh.tp());
      // [/slide:sp-grads]
      if (held_moe > 0) mesh.tp().allreduce_sum(load.data(), load.size());
    }
    // [slide:dualpipe-copies]
    // DualPipe: stage s lives on rank s (direction 0) and on rank P-1-s (direction 1), each
    // copy's gradient from its direction's micro-batches: the pair sums them, so both copies
    // take the same AdamW step (the replica check compares their bits), and their MoE loads
    if (dual && o.bug != "dualpipe-no-pair-sum") {
      std::vector<Tensor*> held;
      for (Tensor* p : params)
        if (p) held.push_back(p);
      zero::sum_grads(held, pair);
      if (held_moe > 0) pair.allreduce_sum(load.data(), load.size());
    }
    // [/slide]
    // 3. the optimizer over DP: the mean gradient, AdamW (ZeRO-0 everywhere, ZeRO-1 on shards)
    dense_opt.step();
    expert_opt.step();
    // 4. the balancing bias from the loads of the whole global batch
    if (W > 1 && held_moe > 0) data.allreduce_sum(load.data(), load.size());
    update_biases(mm.p, load, c.experts, o.bias_rate);
    // [/slide]
    train_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    step_span.reset();
    last.tp = mesh.tp().collective_counts();
    last.dp = data.collective_counts();
    last.cp = mesh.cp().collective_counts();
    last.ep = merged_counts({&mesh.ep(), &topo.node_comm, &topo.rail_comm});
    last.edp = edp.collective_counts();
    last.pp = merged_counts({&mesh.pp(), &pair});
    want.ep = formula_ep(maps, mesh.coords().ep, topo.R, mm.scheme, c.dim, 1);
    const std::string differs = first_difference(last, want);
    if (!differs.empty() && comm_equal) {
      comm_equal = false;
      comm_detail = "step " + std::to_string(step) + ": " + differs;
    }

    // ---- the check (its traffic on check_world / check_dp, not counted above)
    Trace::Category check_traffic(trace(), "check");
    // the loss lives on the ranks of the last stage: each of its dp x cp groups' TP ranks
    // holds its share (the same on every TP rank)
    double loss_mesh = ex_loss;
    check_world.allreduce(&loss_mesh, 1, MPI_DOUBLE, MPI_SUM);
    loss_mesh /= (double)(W * sizes.tp);
    // the mean gradient each rank's optimizer used, and the weights after its step
    std::vector<Tensor> mean_grads(params.size());
    for (const zero::GroupAdam* g : {&dense_opt, &expert_opt}) {
      const std::vector<Tensor> mg = g->mean_grads(g == &dense_opt ? check_dp : check_edp);
      for (size_t i = 0; i < mg.size(); i++) mean_grads[g->keys[i]] = mg[i];
    }
    std::vector<Tensor> now, held_grads;
    for (size_t k = 0; k < names.size(); k++)
      if (params[k]) now.push_back(*params[k]), held_grads.push_back(mean_grads[k]);
    for (const model::NamedTensor& b : mm.p.named_buffers())  // the biases, with the weights
      if (b.t.defined()) now.push_back(b.t);
    const Gathered g_grad = gather_full(names, full_shapes, held_grads, sizes, plan, check_world);
    const Gathered g_par = gather_full(all_names, all_shapes, now, sizes, plan, check_world);
    if (disagree.empty() && !g_par.disagree.empty()) disagree = "weights " + g_par.disagree;
    if (disagree.empty() && !g_grad.disagree.empty()) disagree = "mean gradients " + g_grad.disagree;
    // the balancing biases as gathered (every rank's copy the same bits: the replica check)
    std::vector<float> my_bias;
    for (size_t i = names.size(); i < all_names.size(); i++) {
      const std::vector<float> v = g_par.full[i].to_vector();
      my_bias.insert(my_bias.end(), v.begin(), v.end());
    }

    // rank 0: one process from the same weights on the whole global batch, and AdamW on the
    // mesh's own mean gradient (reference_check.h)
    OneProcess::Step ref_step;
    if (L.rank() == 0)
      ref_step = one_process.step(L, step, checking, step + 1 == o.steps, loss_mesh, g_grad, g_par, my_bias);
    const double loss_ref = ref_step.loss, grad_ratio = ref_step.grad_ratio;
    const std::string& step_adam = ref_step.adam;
    if (L.rank() == 0) {
      const double bound = kLossBound * n_terms * eps * std::max(1.0, std::fabs(loss_ref));
      if (logging) {
        auto column = [&](bool shown, const CollectiveCounts& m) {
          const std::string b = human_bytes((double)sum_bytes(m));
          return shown ? "  " + std::string(10 - std::min<size_t>(10, b.size()), ' ') + b : std::string();
        };
        const std::string cp_col = column(sizes.cp > 1, last.cp) + column(sizes.ep > 1, last.ep) +
                                   column(sizes.ep > 1, last.edp) + column(sizes.pp > 1, last.pp);
        if (checking)
          std::printf("%5lld  %11.6f  %13.6f  %9.2e  %9.2e  %8.3f  %6s  %10s  %10s%s\n", (long long)step,
                      loss_mesh, loss_ref, std::fabs(loss_mesh - loss_ref), bound, grad_ratio,
                      step_adam.c_str(), human_bytes((double)sum_bytes(last.tp)).c_str(),
                      human_bytes((double)sum_bytes(last.dp)).c_str(), cp_col.c_str());
        else
          std::printf("%5lld  %11.6f  %13s  %9s  %9s  %8s  %6s  %10s  %10s%s\n", (long long)step, loss_mesh,
                      "-", "-", "-", "-", step_adam.c_str(), human_bytes((double)sum_bytes(last.tp)).c_str(),
                      human_bytes((double)sum_bytes(last.dp)).c_str(), cp_col.c_str());
      }
      char row[320];
      std::snprintf(row, sizeof row, "step,%d,%d,%lld,%d,%lld,%.9g,%.9g,%.6g,%zu,%zu,,,,,,%d,%zu,%d,%d,%zu,%zu,%zu,0\n",
                    sizes.dp, sizes.tp, (long long)o.zero, (int)o.sp, (long long)step, loss_mesh,
                    loss_ref, grad_ratio, sum_bytes(last.tp), sum_bytes(last.dp), sizes.cp,
                    sum_bytes(last.cp), sizes.pp, sizes.ep, sum_bytes(last.ep), sum_bytes(last.edp),
                    sum_bytes(last.pp));
      csv << row;
    }
  }
  Comm::set_link(LinkModel{});

  // ---- memory, communication per axis, the estimate
  // under EP two optimizers: the dense weights over DP x CP, the experts over expert-DP
  const zero::Memory mem = dense_opt.memory() + expert_opt.memory();
  const zero::Memory mem_formula = zero::formula(dense_opt.numel, W, (int)o.zero) +
                            (sizes.ep > 1 ? zero::formula(expert_opt.numel, edp.size(), (int)o.zero) : zero::Memory{});
  if (L.rank() == 0) {
    std::printf("\ncommunication of one step (rank 0; Comm's counters, payload bytes):\n");
    std::printf("%s", communication_text(last, want, sizes).c_str());
    if (sched_pairs && o.overlap == "on")
      std::printf("  overlap: %ld hand-overs between a paired forward and backward at their all-to-alls, "
                  "over the whole run\n", overlap::switches());
    std::printf("\nmemory of rank 0 (float32, %lld parameters here): measured vs formula "
                "(ZeRO-%lld, %s %d)\n", (long long)local_numel, (long long)o.zero,
                sizes.cp > 1 ? "dp x cp" : "dp", W);
    if (sizes.ep > 1)
      std::printf("  N = %lld dense (ZeRO over dp x cp, %d ranks) + %lld of this rank's experts "
                  "(ZeRO over edp, %d ranks)\n", (long long)dense_opt.numel, W,
                  (long long)expert_opt.numel, edp.size());
    std::printf("  parameters %10s   formula 4N            %10s\n", human_bytes((double)mem.params).c_str(),
                human_bytes((double)mem_formula.params).c_str());
    std::printf("  gradients  %10s   formula 4N            %10s\n", human_bytes((double)mem.grads).c_str(),
                human_bytes((double)mem_formula.grads).c_str());
    std::printf("  AdamW m, v %10s   formula %-13s %10s\n", human_bytes((double)mem.optimizer).c_str(),
                o.zero ? "8 ceil(N/dp)" : "8N", human_bytes((double)mem_formula.optimizer).c_str());
    std::printf("  buffers    %10s   (the collectives' flat buffers: not in the formula)\n",
                human_bytes((double)mem.buffers).c_str());
    std::printf("  seed 001's mixed precision for the same N: ZeRO-0 %s, ZeRO-1 %s (16N, 4N + 12N/dp)\n",
                human_bytes(zero::mixed_precision_bytes(local_numel, W, 0)).c_str(),
                human_bytes(zero::mixed_precision_bytes(local_numel, W, 1)).c_str());
    const double steps_s = train_s / (double)std::max<int64_t>(o.steps, 1);
    std::printf("\ntraining: %.2f ms per step (rank 0, the check excluded%s), %.0f tokens/s\n",
                steps_s * 1e3, link.enabled ? "; links modelled" : "", (double)(o.batch * T) / steps_s);
    char row[320];
    std::snprintf(row, sizeof row, "memory,%d,%d,%lld,%d,,,,,,,%zu,%zu,%zu,%zu,%zu,%d,,%d,%d,,,,0\n", sizes.dp,
                  sizes.tp, (long long)o.zero, (int)o.sp, mem.params, mem.grads, mem.optimizer,
                  mem.buffers, mem_formula.params + mem_formula.grads + mem_formula.optimizer, sizes.cp, sizes.pp, sizes.ep);
    csv << row;
  }
  if (o.estimate == "run" && L.rank() == 0) {
    estimate::Parallel par;
    par.tp = sizes.tp, par.dp = sizes.dp, par.cp = sizes.cp, par.ep = sizes.ep, par.zero = (int)o.zero;
    par.sp = o.sp;
    estimate::Measured meas{local_numel, (double)mem.params, (double)mem.grads, (double)mem.optimizer};
    std::printf("\n%s", estimate::report(estimate::tiny(c, B), par, meas).c_str());
  }
  // every rank's bytes per axis in the last step, measured and by the formula (a row each)
  if (!L.flags.csv.empty()) {
    Trace::Category check_traffic(trace(), "check");
    const CollectiveCounts* mine[12] = {&last.tp, &last.dp, &last.cp, &last.ep, &last.edp, &last.pp,
                                        &want.tp, &want.dp, &want.cp, &want.ep, &want.edp, &want.pp};
    std::vector<uint64_t> b(12), all(12 * (size_t)L.size());
    for (size_t i = 0; i < 12; i++) b[i] = sum_bytes(*mine[i]);
    check_world.allgather(b.data(), b.size() * sizeof(uint64_t), all.data());
    for (int r = 0; L.rank() == 0 && r < L.size(); r++)
      for (int f = 0; f < 2; f++) {
        const uint64_t* x = &all[12 * (size_t)r + 6 * (size_t)f];
        char row[320];
        std::snprintf(row, sizeof row, "%s,%d,%d,%lld,%d,%lld,,,,%llu,%llu,,,,,,%d,%llu,%d,%d,%llu,%llu,%llu,%d\n",
                      f ? "rank_formula" : "rank", sizes.dp, sizes.tp, (long long)o.zero, (int)o.sp,
                      (long long)(o.steps - 1), (unsigned long long)x[0], (unsigned long long)x[1],
                      sizes.cp, (unsigned long long)x[2], sizes.pp, sizes.ep, (unsigned long long)x[3],
                      (unsigned long long)x[4], (unsigned long long)x[5], r);
        csv << row;
      }
  }
  // one file for the figures: a row per step (loss, the check, bytes per axis), one for memory
  // and, per rank, one of the bytes it sent per axis in the last step and one of the formula's
  L.csv_append("kind,dp,tp,zero,sp,step,loss_mesh,loss_ref,grad_err_ratio,tp_bytes,dp_bytes,"
               "mem_params,mem_grads,mem_optimizer,mem_buffers,formula_total,cp,cp_bytes,pp,ep,"
               "ep_bytes,edp_bytes,pp_bytes,rank",
               csv.str());

  // ---- after training: the validation loss of the mesh and of one process (the mean over
  // --val-batches global batches of the held-out text), a dump, a sample
  double val_mesh = 0, val_ref = 0, val0_mesh = 0;
  {
    Trace::Category check_traffic(trace(), "check");  // not training: the trace keeps it apart
    NoGradGuard ng;
    mm.maps = nullptr;
    Comm check_pp = mesh.pp().split(0, mesh.pp().rank());
    const int64_t row0 = (int64_t)mesh.coords().dp * B;
    for (int64_t k = 0; k < o.val_batches; k++) {
      CharCorpus::Batch vb = corpus.batch(CharCorpus::Split::val, k, o.batch, T, row0, row0 + B,
                                          (uint64_t)L.flags.seed);
      vb = {take_columns(vb.inputs, my_cols), take_columns(vb.targets, my_cols)};
      double v = stages.forward_only(check_pp, sched, vb.inputs.to(L.device), vb.targets.to(L.device));
      check_world.allreduce(&v, 1, MPI_DOUBLE, MPI_SUM);
      v /= (double)(W * sizes.tp);
      if (k == 0) val0_mesh = v;
      val_mesh += v / (double)o.val_batches;
      if (L.rank() == 0) {
        CharCorpus::Batch gb = corpus.batch(CharCorpus::Split::val, k, o.batch, T, 0, o.batch,
                                            (uint64_t)L.flags.seed);
        val_ref += model::forward(c, one_process.model(), gb.inputs.to(L.device), gb.targets.to(L.device),
                                  model::positions(T, L.device)).loss.to_vector()[0] /
                   (double)o.val_batches;
      }
    }
    if (L.rank() == 0) {
      std::printf("validation loss after %lld steps (%lld batches, %lld tokens): %.6f (mesh), "
                  "%.6f (one process)\n", (long long)o.steps, (long long)o.val_batches,
                  (long long)(o.val_batches * o.batch * T), val_mesh, val_ref);
      CharCorpus::Batch gb = corpus.batch(CharCorpus::Split::val, 0, o.batch, T, 0, o.batch,
                                          (uint64_t)L.flags.seed);
      if (L.dumping()) {
        for (const model::NamedTensor& n : one_process.model().named_parameters()) L.dump(n.name, n.t);
        for (const model::NamedTensor& n : one_process.model().named_buffers()) L.dump(n.name, n.t);
        L.dump("val_inputs", gb.inputs);
        L.dump("val_targets", gb.targets);
        L.dump("val_loss", Tensor::from_vector({(float)val0_mesh}, {}));  // of batch 0
        std::ostringstream meta;
        meta << "{\"vocab\": " << c.vocab << ", \"dim\": " << c.dim << ", \"layers\": " << c.layers
             << ", \"dense_layers\": " << c.dense_layers << ", \"heads\": " << c.heads
             << ", \"d_nope\": " << c.d_nope << ", \"d_rope\": " << c.d_rope << ", \"d_v\": " << c.d_v
             << ", \"q_lora\": " << c.q_lora << ", \"kv_lora\": " << c.kv_lora << ", \"ffn\": " << c.ffn
             << ", \"experts\": " << c.experts << ", \"topk\": " << c.topk << ", \"shared\": " << c.shared
             << ", \"moe_ffn\": " << c.moe_ffn << ", \"seq\": " << T << ", \"rope_theta\": " << c.rope_theta
             << ", \"norm_eps\": " << c.norm_eps << ", \"mesh\": \"" << mesh_name(sizes, 0) << "\"}\n";
        L.dump_text("meta.json", meta.str());
      }
    }
  }
  if (o.sample > 0 && L.rank() == 0)
    std::printf("\nsample (%lld bytes, temperature %g, seed %lld):\n%s\n\n", (long long)o.sample,
                o.temperature, (long long)L.flags.seed,
                sample_text(c, one_process.model(), corpus, o.prompt, o.sample, o.temperature, (uint64_t)L.flags.seed).c_str());

  // ---- the verdict
  CheckReport check(L.comm);
  const bool root = L.rank() == 0;
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
  for (const Tensor* p : params)
    if (p && p->grad().defined()) grads_held += p->nbytes();
  std::snprintf(line, sizeof line, "memory: parameters 4N, gradients 4N (those held), AdamW's m and "
                "v %s, measured", o.zero ? "8 ceil(N/dp)" : "8N");
  check.holds(line, mem.params == mem_formula.params && mem.grads == grads_held &&
                        grads_held <= mem_formula.grads && mem.optimizer == mem_formula.optimizer);
  one_process.kpe_verdict(check, root);
  // the tolerance from one process's loss (a non-finite mesh loss must not widen it)
  double val_want = root ? val_ref : val_mesh;
  Trace::Category check_traffic(trace(), "check");
  check_world.bcast(&val_want, sizeof val_want, 0);
  check.holds("validation loss of the mesh is finite", std::isfinite(val_mesh));
  check.scalar("validation loss, mesh vs one process (same weights)", val_mesh, val_want,
               kLossBound * n_terms * eps * std::max(1.0, std::fabs(val_want)));
  return L.finish(check);
}

}  // namespace

int main(int argc, char** argv) { return run_lesson(argc, argv, "08_mesh", mesh_lesson); }
