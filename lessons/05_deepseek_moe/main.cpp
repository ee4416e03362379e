// Lesson 05 — DeepSeek-V3 MoE: what changed after GShard, and why.
//
// What: lesson 04's expert-parallel layer, rebuilt as DeepSeek-V3's (technical report §2.1.2,
//   inference/model.py's Gate and MoE), on P ranks grouped into virtual nodes of R ranks:
//     sigmoid gate     s = sigmoid(x W_g): every expert scored on its own; the gates are the
//                      selected s normalised over the K selected (softmax couples all N)
//     selection vs gating
//                      experts are SELECTED on s + b, where b is a balancing bias with no
//                      gradient; the GATES come from the unbiased s. Balance is steered by
//                      nudging b, not by a loss that fights the language-model loss.
//     node-limited routing
//                      experts in G groups (one per node); a token first picks its top M
//                      groups (group score = sum of its top-2 biased affinities), then its
//                      top K experts inside them: at most M nodes per token, bounding the
//                      slow inter-node traffic
//     shared experts   S experts every token passes through, ungated
//     capacity         optional: --capacity-factor C gives each expert ceil(C T K / N) slots;
//                      the overflow is dropped (Switch) or moved to the next-best expert
//     balance loss     a small sequence-wise one, alpha sum f_i P_i per sequence
//   and the all-to-all becomes HIERARCHICAL, as DeepEP's normal kernels do it: a token crosses
//   the slow inter-node link once per target node (to the rank with its own local index
//   there, over the "rail"), then fans out over the fast intra-node link; on the way back the
//   node's partial outputs are summed before they cross the rail again.
// Why: at 256 experts on 8-GPU nodes, the flat all-to-all sends one copy of a token per
//   expert over InfiniBand (3.2x slower than NVLink on H800); node-limited routing plus the two-level
//   all-to-all cut that to at most M copies. And the aux-loss-free bias keeps experts
//   balanced without the gradient interference of lesson 03's auxiliary loss.
// Run:  make run L=05                          (8 ranks = 4 virtual nodes x 2)
//       make run L=05 ARGS="--a2a flat"        (lesson 04's all-to-all: same rows, more bytes)
//       make run L=05 ARGS="--capacity-factor 1 --overflow next-best"
// Expect: the routing demonstrations, the byte counts per link class, the checks against one
//   process on all ranks' tokens (data movement exact, values within tolerance), check: PASS.
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "common/comm/alltoall.h"
#include "common/layers/dsv3_moe.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/moe.h"
#include "common/lesson/lesson.h"
#include "lessons/05_deepseek_moe/deepseek_moe.h"

using namespace ff;
using namespace ff::deepseek;

namespace {

// ----------------------------------------------------------------------------
// The layer, distributed, lives in common/layers/dsv3_ep.cpp (lesson 08 runs it on its mesh):
// make_topology, the routing map, flat_dispatch/flat_combine (lesson 04's all-to-all, one
// copy per routing slot), hier_plan/hier_dispatch/hier_combine (one copy per token and node
// over the rail, then a fan-out inside the node), ep_forward and ep_backward. This file
// counts what they move, demonstrates the routing, and checks them against one process.


// ----------------------------------------------------------------------------
// Bytes per link class, counted from the routing map (every rank's sends, summed): what the
// forward's dispatch and combine put on the links. A message to oneself is a copy, not counted.

struct MapBytes {
  double intra = 0, inter = 0;
};

static MapBytes count_bytes(const RoutingMap& m, int R, Scheme scheme, int64_t d) {
  MapBytes b;
  const double row = (double)d * sizeof(float), wide = (double)(d + m.K) * sizeof(float);
  auto add = [&](int from, int to, double bytes) {
    if (from == to) return;
    (from / R == to / R ? b.intra : b.inter) += bytes;
  };
  for (int p = 0; p < m.P; p++)
    for (int64_t t = 0; t < m.T; t++) {
      // [slide:count-bytes]
      // [slide:count-bytes-flat]
      if (scheme == Scheme::flat) {
        for (int64_t j = 0; j < m.K; j++) {
          const int64_t e = m.expert(p, t, j);
          if (e >= 0) add(p, (int)(e / m.E), 2 * row);  // dispatch x, combine E(x)
        }
        continue;
      }
      // [/slide:count-bytes-flat]
      // [slide:count-bytes-hier]
      for (int n = 0; n < m.P / R; n++) {
        const int fwd = n * R + p % R;  // the rail peer on node n
        bool any = false;
        for (int q = n * R; q < (n + 1) * R; q++)
          if (m.needs(p, t, q)) {
            any = true;
            add(fwd, q, wide), add(q, fwd, row);  // fan out [x | g], partial sum back
          }
        if (any) add(p, fwd, wide), add(fwd, p, row);  // over the rail and back
      }
      // [/slide:count-bytes-hier]
      // [/slide]
    }
  return b;
}

// DeepSeek-V3's shape (N = 256 routed experts, K = 8, 8 nodes, M = 4), routed on random
// affinities: how many nodes a token reaches, and the inter-node copies per token of the flat
// and the hierarchical all-to-all, with and without the node limit. Called on rank 0 only (it
// routes 4096 tokens for the report), so it prints with printf.
static void paper_shape_counts(uint64_t seed) {
  dsv3::Config pc;
  pc.experts = 256, pc.topk = 8, pc.groups = 8, pc.topk_groups = 4;
  const int64_t T = 4096, per_node = 32;
  Tensor s = sigmoid(randn({T, pc.experts}, seed + 77));
  Tensor zero = Tensor::zeros({pc.experts});
  for (int limit : {0, 1}) {
    dsv3::Config c = pc;
    if (!limit) c.topk_groups = c.groups;
    std::vector<int64_t> idx = dsv3::select(c, s, zero).idx.to_index_vector();
    double flat = 0, hier = 0, nodes = 0;
    for (int64_t t = 0; t < T; t++) {
      const int home = (int)(t % 8);  // the token's own node, spread evenly
      std::set<int64_t> seen;
      for (int64_t j = 0; j < c.topk; j++) {
        const int64_t n = idx[(size_t)(t * c.topk + j)] / per_node;
        seen.insert(n);
        flat += n != home;
      }
      nodes += (double)seen.size();
      hier += (double)seen.size() - (double)seen.count(home);
    }
    std::printf("    %-22s %5.2f nodes per token, %5.2f experts per node reached; inter-node "
                "copies per token: flat %.2f, hierarchical %.2f (%.1fx fewer)\n",
                limit ? "node-limited (M = 4):" : "no node limit:", nodes / (double)T,
                (double)(T * c.topk) / nodes, flat / (double)T, hier / (double)T, flat / hier);
    if (limit)  // seed 001 §1.5: V_inter <= 2 B K d (M - 1) / nodes
      std::printf("    seed 001's bound 2 K (M-1)/nodes = %.2f rows per token over the inter-node "
                  "links (dispatch + combine); flat moves %.2f, hierarchical %.2f: it bounds "
                  "neither (hierarchical's bound is 2 M = %d)\n",
                  2.0 * (double)c.topk * (double)(c.topk_groups - 1) / (double)c.groups,
                  2.0 * flat / (double)T, 2.0 * hier / (double)T, (int)(2 * c.topk_groups));
  }
}

}  // namespace

// ----------------------------------------------------------------------------

// The tokens whose experts the balancing bias changed (selection on s + b), and the first of
// them: its top-K by s and by s + b, and its gates, from s of the experts chosen. Called on rank
// 0 only (it selects every token's experts again, for the report), so it prints with printf.
static void print_selection_vs_gating(const dsv3::Config& c, const dsv3::Params& full,
                                      const Tensor& s_all, double bias_init) {
  const int64_t T_all = s_all.size(0), N = c.experts, K = c.topk;
  const Device dev = s_all.device();
  dsv3::Selection unbiased = dsv3::select(c, s_all, Tensor::zeros({N}, dev));
  const std::vector<int64_t> iu = unbiased.idx.to_index_vector();
  const std::vector<int64_t> ib_all = dsv3::select(c, s_all, full.bias).idx.to_index_vector();
  int64_t changed = 0, first = -1;
  for (int64_t t = 0; t < T_all; t++) {
    std::set<int64_t> a(iu.begin() + t * K, iu.begin() + (t + 1) * K),
        b(ib_all.begin() + t * K, ib_all.begin() + (t + 1) * K);
    if (a != b) changed++, first = first < 0 ? t : first;
  }
  std::printf("selection vs gating: the bias b (std %.3g) changes the experts of %lld of %lld "
              "tokens\n", bias_init, (long long)changed, (long long)T_all);
  if (first >= 0) {
    const std::vector<float> sv = s_all.to_vector(), bv = full.bias.to_vector();
    Tensor g1 = dsv3::gates(c, slice(s_all, 0, first, first + 1),
                            Tensor::from_indices(std::vector<int64_t>(ib_all.begin() + first * K,
                                                                      ib_all.begin() + (first + 1) * K),
                                                 {1, K}, dev));
    const std::vector<float> gv = g1.to_vector();
    std::printf("    token %lld: top-%lld by s: {", (long long)first, (long long)K);
    for (int64_t j = 0; j < K; j++) std::printf("%s%lld", j ? ", " : "", (long long)iu[(size_t)(first * K + j)]);
    std::printf("}, by s + b: {");
    for (int64_t j = 0; j < K; j++) std::printf("%s%lld", j ? ", " : "", (long long)ib_all[(size_t)(first * K + j)]);
    std::printf("}\n    its gates come from s of the experts chosen:");
    for (int64_t j = 0; j < K; j++) {
      const int64_t e = ib_all[(size_t)(first * K + j)];
      std::printf(" e%lld s=%.4f b=%+.4f g=%.4f%s", (long long)e, sv[(size_t)(first * N + e)],
                  bv[(size_t)e], gv[(size_t)j], j + 1 < K ? ";" : "\n");
    }
  }
}

// The group score: DeepSeek's (the top-2 sum of biased affinities; the maximum with the softmax
// gate) against seed 001's sum of the whole group's raw logits (how many tokens the two send
// to different nodes). Called on rank 0 only (it selects every token's
// groups again, for the report), so it prints with printf.
static void print_group_scores(const dsv3::Config& c, const dsv3::Params& full, const Tensor& s_all) {
  const int64_t T_all = s_all.size(0), N = c.experts;
  if (c.groups > 1 && c.topk_groups < c.groups) {
    const std::vector<int64_t> a = dsv3::select(c, s_all, full.bias).kept_groups.to_index_vector(),
                               b = dsv3::kept_groups_seed001(c, s_all).to_index_vector();
    int64_t differ = 0;
    const int64_t M = c.topk_groups;
    for (int64_t t = 0; t < T_all; t++)
      differ += std::set<int64_t>(a.begin() + t * M, a.begin() + (t + 1) * M) !=
                std::set<int64_t>(b.begin() + t * M, b.begin() + (t + 1) * M);
    const int64_t k = c.group_score_k();
    const std::string rule = k == 1 ? "the largest affinity" : "top-" + std::to_string(k) + " sum";
    std::printf("group score: %s (DeepSeek's code) and sum of all %lld logits (seed 001) "
                "pick different nodes for %lld of %lld tokens\n", rule.c_str(),
                (long long)(N / c.groups), (long long)differ, (long long)T_all);
  }
}

// Capacity: each expert's slots, demand, overflow, and what was dropped or moved (--overflow).
static void print_capacity(const Lesson& lesson, const RoutingMap& map, const dsv3::Config& config,
                           const std::string& overflow) {
  const int64_t T_all = (int64_t)map.P * map.T, N = config.experts, K = config.topk;
  lesson.print("capacity %lld slots per expert (C = %g, %lld slots), overflow %s\n"
               "    %6s %8s %6s %8s %8s %9s %8s %5s\n", (long long)map.assign.capacity,
               config.capacity_factor, (long long)(T_all * K), overflow.c_str(), "expert",
               "capacity", "demand", "overflow", "dropped", "moved out", "moved in", "load");
  for (int64_t e = 0; e < N; e++) {
    const dsv3::ExpertLoad& load = map.assign.experts[(size_t)e];
    lesson.print("    %6lld %8lld %6lld %8lld %8lld %9lld %8lld %5lld\n", (long long)e,
                 (long long)load.capacity, (long long)load.demand, (long long)load.overflow,
                 (long long)load.dropped, (long long)load.moved_out, (long long)load.moved_in,
                 (long long)load.load);
  }
}

// --csv, long format: per expert its slots finally processed (series load), per count of nodes
// the tokens whose kept slots reach that many (series nodes), the bytes per scheme and link class
// (series bytes).
static std::string routing_csv(const RoutingMap& m, const dsv3::Config& c, int R, int nodes,
                               int64_t d) {
  const int P = m.P;
  const int64_t N = c.experts, E = m.E, T = m.T;
  // series routing: a = expert, b = node, c = slots finally processed (the routing picture)
  std::string rows;
  for (int64_t e = 0; e < N; e++)
    rows += "load," + std::to_string(P) + "," + std::to_string(e) + "," +
            std::to_string((e / E) / R) + "," + std::to_string(m.assign.experts[(size_t)e].load) + "\n";
  // series nodes: a = M, b = nodes a token's kept slots reach, c = tokens
  std::vector<int64_t> reach((size_t)nodes + 1, 0);
  for (int p = 0; p < P; p++)
    for (int64_t t = 0; t < T; t++) {
      std::set<int> ns;
      for (int q = 0; q < P; q++)
        if (m.needs(p, t, q)) ns.insert(q / (int)R);
      reach[ns.size()]++;
    }
  for (size_t k = 0; k < reach.size(); k++)
    rows += "nodes," + std::to_string(P) + "," + std::to_string(c.topk_groups) + "," +
            std::to_string(k) + "," + std::to_string(reach[k]) + "\n";
  for (Scheme sc : {Scheme::flat, Scheme::hierarchical}) {
    MapBytes b = count_bytes(m, (int)R, sc, d);
    const char* name = sc == Scheme::flat ? "flat" : "hierarchical";
    for (int inter = 0; inter < 2; inter++)  // series bytes: a = scheme, b = link class, c = bytes
      rows += "bytes," + std::to_string(P) + "," + name + "," + (inter ? "inter" : "intra") +
              "-M" + std::to_string(c.topk_groups) + "," +
              std::to_string((long long)(inter ? b.inter : b.intra)) + "\n";
  }
  return rows;
}

// The dump's meta.json (read by tests/check_dump_05.py): the layer's settings, the world
// size, and extra_fields before the closing brace.
static std::string meta_json(const dsv3::Config& c, int P, const std::string& extra_fields) {
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "{\"gate\": \"%s\", \"N\": %lld, \"K\": %lld, \"S\": %lld, \"G\": %lld, "
                "\"M\": %lld, \"group_score_topk\": %lld, \"route_scale\": %.9g, \"alpha\": %.9g, "
                "\"capacity_factor\": %.9g, \"overflow\": \"%s\", \"seq_len\": %lld, "
                "\"d\": %lld, \"f\": %lld, \"P\": %d, \"aux_count\": \"%s\"",
                dsv3::gate_name(c.gate), (long long)c.experts, (long long)c.topk, (long long)c.shared,
                (long long)c.groups, (long long)c.topk_groups, (long long)c.group_score_k(),
                c.route_scale, c.alpha, c.capacity_factor, dsv3::overflow_name(c.overflow),
                (long long)c.seq_len, (long long)c.dim, (long long)c.ffn, P,
                dsv3::aux_count_name(c.aux_count));
  return buf + extra_fields + "}\n";
}

// --dump: every rank's rows gathered (rank order), and on rank 0 the layer's inputs, outputs,
// parameters, routing, gradients and sizes, as tests/check_dump_05.py reads them.
static void dump_layer(Lesson& lesson, const dsv3::Config& c, const dsv3::Params& full,
                       const EPForward& fw, const dsv3::Grads& g, const Tensor& x_all,
                       const Tensor& dy_all, int64_t batch, const std::string& a2a, int R) {
  Comm& comm = lesson.comm;
  const int P = comm.size();
  const RoutingMap& m = fw.map;
  const int64_t d = c.dim, K = c.topk, T_all = x_all.size(0);
  auto gather_rows = [&](const Tensor& t) {  // rank order, equal blocks -> (P * rows, cols)
    std::vector<float> all = allgather_vec(comm, t.to_vector());
    Shape s = t.shape();
    s[0] *= P;
    return Tensor::from_vector(all, s);
  };
  Tensor y_all = gather_rows(fw.y), dx_all = gather_rows(g.dx), gates_all = gather_rows(fw.gates);
  Tensor w1_all = gather_rows(g.w1), w3_all = gather_rows(g.w3), w2_all = gather_rows(g.w2);
  if (lesson.rank() == 0) {
    const int64_t B_all = batch * P, L = c.seq_len;
    auto save = [&](const char* name, const Tensor& t, const Shape& shape) {
      lesson.dump(name, t.to(Device::cpu).view(shape));
    };
    save("x", x_all, {B_all, L, d});
    save("dy", dy_all, {B_all, L, d});
    save("y", y_all, {B_all, L, d});
    for (const moe::NamedTensor& nt : dsv3::named_parameters(full)) lesson.dump(nt.name, nt.t.to(Device::cpu));
    lesson.dump("aux_loss", Tensor::from_vector({(float)fw.balance}, {}));
    std::vector<int64_t> kept(m.assign.kept.begin(), m.assign.kept.end());
    save("topk_idx", Tensor::from_indices(m.assign.idx, {T_all, K}), {B_all, L, K});
    save("kept", Tensor::from_indices(kept, {T_all, K}), {B_all, L, K});
    save("gates", gates_all, {B_all, L, K});
    save("dx", dx_all, {B_all, L, d});
    dsv3::Grads all = g;
    all.dx = dx_all, all.w1 = w1_all, all.w3 = w3_all, all.w2 = w2_all;
    for (const moe::NamedTensor& nt : dsv3::named_grads(all))
      if (nt.name != "dx") lesson.dump(nt.name, nt.t.to(Device::cpu));
    lesson.dump_text("meta.json", meta_json(c, P, ", \"a2a\": \"" + a2a +
                                                            "\", \"ranks_per_node\": " +
                                                            std::to_string(R) +
                                                            ", \"residual\": false"));
  }
}

static int deepseek_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();
  Flags flags;
  Cli& cli = lesson.cli;
  declare_flags(cli, &flags);
  dsv3::Config& config = flags.c;
  int64_t &batch = flags.batch, &ranks_per_node = flags.R, &reps = flags.reps;
  const double bias_init = flags.bias_init;
  const std::string &gate = flags.gate, &a2a = flags.a2a, &overflow = flags.overflow, &bug = flags.bug,
                    &link_spec = flags.link_spec;
  TrainOptions& train = flags.train;
  lesson.parse();
  // default: the job's real nodes when it spans several, else virtual nodes of 2 when P is even
  const Lesson::Network net = lesson.network(cli.given("--ranks-per-node") ? ranks_per_node : 0,
                                             P % 2 == 0 ? 2 : 1, cli.given("--link") ? &link_spec : nullptr);
  ranks_per_node = net.ranks_per_node;
  const bool real_nodes = net.real_nodes;
  const LinkModel& link = net.link;
  lesson.usage_error_if(P % ranks_per_node != 0, "--ranks-per-node " + std::to_string(ranks_per_node) +
                                                     " does not divide the " + std::to_string(P) + " ranks");
  const int nodes = (int)(P / ranks_per_node);
  if (config.groups == 0) config.groups = nodes;
  if (!cli.given("--topk-groups"))
    config.topk_groups = std::min<int64_t>(config.topk_groups, config.groups);
  lesson.usage_error_if(config.experts % P != 0, "--experts " + std::to_string(config.experts) +
                                                     " is not a multiple of the " + std::to_string(P) +
                                                     " ranks: every rank holds N/P experts");
  lesson.usage_error_if(config.experts % config.groups != 0,
                        "--groups " + std::to_string(config.groups) + " does not divide --experts " +
                            std::to_string(config.experts));
  lesson.usage_error_if(config.topk_groups > config.groups,
                        "--topk-groups " + std::to_string(config.topk_groups) + " is more than the " +
                            std::to_string(config.groups) + " groups");
  lesson.usage_error_if(config.topk > config.topk_groups * (config.experts / config.groups),
                        "--topk " + std::to_string(config.topk) + " is more than the " +
                            std::to_string(config.topk_groups * (config.experts / config.groups)) +
                            " experts in " + std::to_string(config.topk_groups) +
                            " groups: K must be at most M N / G");
  lesson.usage_error_if(cli.given("--capacity-factor") && config.capacity_factor <= 0,
                        "--capacity-factor must be > 0 (leave it out for no capacity limit)");
  const bool train_bug = bug == "ema-zero-init" || bug == "bias-peek";
  lesson.usage_error_if(train_bug && train.steps == 0, "--bug " + bug + " plants a training bug: "
                        "it needs --train STEPS");
  lesson.usage_error_if(train.steps > 0 && bug != "none" && !train_bug,
                        "--bug " + bug + " plants a backward bug, for the layer check: leave "
                        "out --train");
  lesson.usage_error_if(train_bug && train.balance != "bias", "--bug " + bug +
                        " is a bug of the bias update: it needs --balance bias");
  lesson.usage_error_if(cli.given("--seq-alpha") && (train.steps == 0 || train.balance != "bias"),
                        "--seq-alpha weighs the sequence-wise loss beside the bias in training: it "
                        "needs --train STEPS and --balance bias (--aux-alpha weighs --balance aux's, "
                        "--alpha the layer check's)");
  // the balance loss's weight in this run: the layer check's --alpha, or training's
  const double balance_weight = train.steps == 0            ? config.alpha
                                : train.balance == "aux"    ? train.aux_alpha
                                : train.balance == "bias"   ? train.seq_alpha
                                                            : 0.0;
  lesson.usage_error_if(cli.given("--aux-count") && balance_weight == 0,
                        "--aux-count chooses what the balance loss counts, and this run has none "
                        "(its weight is 0): give --alpha, --aux-alpha or --seq-alpha a weight");
  lesson.usage_error_if(cli.given("--link") && train.steps > 0,
                        "--link times the layer's all-to-alls: leave out --train");
  config.gate = gate == "sigmoid" ? dsv3::GateFn::sigmoid : dsv3::GateFn::softmax;
  config.aux_count = flags.aux_count == "selected" ? dsv3::AuxCount::selected : dsv3::AuxCount::unbiased_topk;
  config.overflow = overflow == "drop" ? dsv3::Overflow::drop : dsv3::Overflow::next_best;
  const dsv3::Bug the_bug = bug == "bias-grad"        ? dsv3::Bug::bias_grad
                            : bug == "no-renorm"      ? dsv3::Bug::no_renorm
                            : bug == "no-shared-grad" ? dsv3::Bug::no_shared_grad
                                                      : dsv3::Bug::none;
  const Scheme scheme = a2a == "flat" ? Scheme::flat : Scheme::hierarchical;
  const int64_t T = batch * config.seq_len, N = config.experts, E = N / P, K = config.topk, d = config.dim;
  const int64_t T_all = T * P;
  lesson.require_memory(dsv3::memory_bytes(config, T_all),
                        "--batch, --tokens, --experts, --dim or --ffn (the reference runs all "
                        "ranks' tokens in every process)");
  const Device dev = lesson.device;
  const uint64_t seed = (uint64_t)lesson.flags.seed;
  Topology topo = make_topology(comm, (int)ranks_per_node);
  if (train.steps > 0) {
    train.batch = batch, train.bug = bug;
    return run_training(lesson, topo, scheme, config, train);
  }

  dsv3::Params full = dsv3::init_params(config, seed, bias_init, dev);
  dsv3::Params mine = dsv3::slice_experts(full, rank * E, (rank + 1) * E);
  Tensor x = randn_slice({T_all, d}, 0, rank * T, (rank + 1) * T, seed + 10).to(dev);
  Tensor dy = randn_slice({T_all, d}, 0, rank * T, (rank + 1) * T, seed + 11).to(dev);
  lesson.print("== 05 DeepSeek-V3 MoE: P=%d ranks = %d %snodes x %lld, %lld routed experts (%lld "
               "per rank) in %lld groups, top-%lld within %lld groups, %lld shared, gate %s, "
               "%lld tokens per rank, all-to-all %s, device %s\n",
               P, nodes, real_nodes ? "" : "virtual ", (long long)ranks_per_node, (long long)N,
               (long long)E, (long long)config.groups, (long long)K, (long long)config.topk_groups,
               (long long)config.shared, gate.c_str(), (long long)T, a2a.c_str(), device_name(dev));
  lesson.start_trace();
  Comm::set_link(link);  // enabled only with --link
  comm.barrier();
  Comm::reset_bytes_sent();
  const Stopwatch watch;
  EPForward forward = ep_forward(comm, topo, scheme, config, full, mine, x);
  dsv3::Grads grads = ep_backward(comm, topo, scheme, config, full, mine, x, forward, dy, the_bug);
  double ms = watch.ms();
  comm.allreduce(&ms, 1, MPI_DOUBLE, MPI_MAX);
  const LinkBytes sent = Comm::bytes_sent();  // this rank's point-to-point sends, by class
  double sent_all[2] = {(double)sent.intra, (double)sent.inter};
  comm.allreduce(sent_all, 2, MPI_DOUBLE, MPI_SUM);
  // --link: both schemes' forward + backward, timed under the modelled network
  double modelled_ms[2] = {0, 0};
  if (link.enabled)
    for (Scheme timed : {Scheme::flat, Scheme::hierarchical}) {
      RepTimes times = time_reps(comm, reps, [&] {
        EPForward pass_forward = ep_forward(comm, topo, timed, config, full, mine, x);
        ep_backward(comm, topo, timed, config, full, mine, x, pass_forward, dy, dsv3::Bug::none);
      });
      modelled_ms[timed == Scheme::hierarchical] = times.median / 1e3;
    }
  Comm::set_link(LinkModel{});  // the check's traffic is not modelled

  // ---- what the routing did, on all tokens (every rank holds the map; rank 0 prints)
  const RoutingMap& map = forward.map;
  Tensor x_all = randn({T_all, d}, seed + 10).to(dev), dy_all = randn({T_all, d}, seed + 11).to(dev);
  Tensor s_all = dsv3::affinities(config, full, x_all);
  if (rank == 0) {  // rank 0 alone selects every token's experts again, for these two reports
    print_selection_vs_gating(config, full, s_all, bias_init);
    print_group_scores(config, full, s_all);
  }
  if (config.capacity_factor > 0) print_capacity(lesson, map, config, overflow);
  const MapBytes flat_bytes = count_bytes(map, (int)ranks_per_node, Scheme::flat, d),
                 hier_bytes = count_bytes(map, (int)ranks_per_node, Scheme::hierarchical, d);
  lesson.print("bytes on the links, forward (dispatch + combine), all ranks; the backward moves the same:\n");
  lesson.print("    %-13s intra-node %9.0f B, inter-node %9.0f B\n", "flat", flat_bytes.intra,
               flat_bytes.inter);
  lesson.print("    %-13s intra-node %9.0f B, inter-node %9.0f B\n", "hierarchical", hier_bytes.intra,
               hier_bytes.inter);
  lesson.print("    inter-node bytes: hierarchical / flat = %.2f (%.1fx fewer)\n",
               hier_bytes.inter / std::max(flat_bytes.inter, 1.0),
               flat_bytes.inter / std::max(hier_bytes.inter, 1.0));
  if (link.enabled)
    lesson.print("%s\n    forward + backward under it (median of %lld, slowest rank): flat %.3f ms, "
                 "hierarchical %.3f ms: hierarchical / flat = %.2f (modelled network, real "
                 "compute)\n", describe(link).c_str(), (long long)reps, modelled_ms[0],
                 modelled_ms[1], modelled_ms[1] / modelled_ms[0]);
  lesson.print("at DeepSeek-V3's shape (N = 256, K = 8, 8 nodes of 32 experts; random affinities):\n");
  if (rank == 0) paper_shape_counts(seed);  // rank 0 alone routes the paper's shape
  lesson.print("forward + backward %.2f ms (slowest rank)\n", ms);

  // ---- the reference: one process, all ranks' tokens, the same layer (hand-written backward
  // aside: the autograd core on the loop form) and the packed steps for the exact rows
  dsv3::Forward ref_forward = dsv3::forward(config, full, x_all);
  dsv3::Reference ref = dsv3::autograd_reference(config, full, x_all, dy_all, ref_forward.assign);
  const std::vector<int64_t> rsizes = ref_forward.plan.group_sizes.to_index_vector();
  int64_t row0 = 0, row1 = 0;  // this rank's experts' rows in the reference's packed order
  for (int64_t e = 0; e < (rank + 1) * E; e++)
    row0 += e < rank * E ? rsizes[(size_t)e] : 0, row1 += rsizes[(size_t)e];
  Tensor ref_xp = moe::permute(x_all, ref_forward.plan);

  Trace::Category check_traffic(trace(), "check");
  CheckReport check(comm);
  const double eps = FLT_EPSILON,
               n_terms = (double)(T_all * K + d + config.ffn * std::max<int64_t>(config.shared, 1) + N);
  auto tol = [&](const Tensor& t) { return 4.0 * n_terms * eps * std::max(max_abs(t), 1e-3); };
  deepseek::check_selection(lesson, check, config, ref_forward.s, full.bias, ref_forward.sel);
  lesson.print("data movement (must be exact: the all-to-alls only copy)\n");
  check.holds("routing: every slot's expert and kept flag equal one process's",
              map.assign.idx == ref_forward.assign.idx && map.assign.kept == ref_forward.assign.kept);
  {
    MapBytes want = count_bytes(map, (int)ranks_per_node, scheme, d);  // forward; the backward moves the same
    check.holds("bytes sent per link class (Comm's counters) = twice the routing map's forward count",
                sent_all[0] == 2 * want.intra && sent_all[1] == 2 * want.inter);
  }
  check.exact("dispatch: rows at each expert", forward.xl, slice(ref_xp, 0, row0, row1));
  check.exact("experts: outputs at each expert", forward.yl, slice(ref_forward.yp, 0, row0, row1));
  lesson.print("against the layer through autograd on all %lld tokens in one process (worst "
               "rank)\n", (long long)T_all);
  const dsv3::Grads& ref_grads = ref.grads;
  auto mine_rows = [&](const Tensor& t) { return slice(t, 0, rank * T, (rank + 1) * T); };
  check.close("y", forward.y, mine_rows(ref.y), tol(ref.y));
  check.scalar("balance loss (sequences of all ranks)", forward.balance, ref.balance,
               8.0 * n_terms * eps * std::max(std::fabs(ref.balance), 1e-3));
  check.close("dx", grads.dx, mine_rows(ref_grads.dx), tol(ref_grads.dx));
  check.close("d router_w (allreduced)", grads.router_w, ref_grads.router_w, tol(ref_grads.router_w));
  auto my_experts = [&](const Tensor& t) { return slice(t, 0, rank * E, (rank + 1) * E); };
  check.close("d experts_w1 (this rank's experts)", grads.w1, my_experts(ref_grads.w1), tol(ref_grads.w1));
  check.close("d experts_w3 (this rank's experts)", grads.w3, my_experts(ref_grads.w3), tol(ref_grads.w3));
  check.close("d experts_w2 (this rank's experts)", grads.w2, my_experts(ref_grads.w2), tol(ref_grads.w2));
  if (config.shared > 0) {
    check.close("d shared_w1 (allreduced)", grads.sw1, ref_grads.sw1, tol(ref_grads.sw1));
    check.close("d shared_w3 (allreduced)", grads.sw3, ref_grads.sw3, tol(ref_grads.sw3));
    check.close("d shared_w2 (allreduced)", grads.sw2, ref_grads.sw2, tol(ref_grads.sw2));
  }

  // ---- outputs
  if (lesson.dumping())
    dump_layer(lesson, config, full, forward, grads, x_all, dy_all, batch, a2a, (int)ranks_per_node);
  lesson.csv_append("series,P,a,b,c", routing_csv(map, config, (int)ranks_per_node, nodes, d));
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "05_deepseek_moe", deepseek_lesson);
}
