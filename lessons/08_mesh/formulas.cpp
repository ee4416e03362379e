// lessons/08_mesh/formulas.cpp — the bytes each mesh axis should move in one training step
// (formulas.h), and Comm's counts of what it did move.
#include "lessons/08_mesh/formulas.h"

#include <cstdio>
#include <sstream>

#include "lessons/08_mesh/mesh_model.h"

namespace ff::mesh {

// [slide:comm-formula]
// The collectives one training step runs on each axis, as calls and payload bytes (Comm's
// counters: an all-reduce's buffer, everything an all-gather receives, everything a
// reduce-scatter reduces). Per micro-batch (M of them) n = this rank's Bm T tokens, lat =
// r_q + r_kv + d_r per token; this rank's stages hold L blocks of which D dense (the whole
// model without PP) and, on the last stage, the head; P = tp.
//   TP     forward: g after W_o (L) and after W2 (D), n d each; the cross-entropy's all-gather
//          of (m, l, z_target), 3 n per rank;
//          backward: f's all-reduce of the latents (L, n lat), before W1/W3 (D, n d) and
//          before the head (n d).
//   TP+SP  the same bytes, each all-reduce now a reduce-scatter and an all-gather: gather_seq
//          (L latents, D + 1 of n d; each first agrees on the token count: 8 P bytes) and its
//          backward reduce-scatter; scatter_seq (L + D of n d) and its backward all-gather;
//          once per step, one all-reduce of every replicated weight's gradient and one of the
//          MoE loads.
//   DP     (dp > 1) ZeRO-0 one all-reduce of the N local parameters' gradients; ZeRO-1 one
//          reduce-scatter and one all-gather of dp * ceil(N / dp); one all-reduce of the MoE
//          loads.
CollectiveCounts formula_tp(const model::Config& c, const StageCounts& st,
                            int64_t n, int P, bool sp, int64_t replicated_numel, bool bf16_wire) {
  CollectiveCounts f;
  if (P == 1) return f;
  const int64_t L = st.L, D = st.D, h = st.head ? 1 : 0, M = st.M, d = c.dim,
                lat = c.q_lora + c.kv_lora + c.d_rope;
  const size_t fl = sizeof(float);
  auto add = [&](const char* op, int64_t calls, int64_t numbers, size_t bytes = sizeof(float)) {
    f[op].calls += calls;
    f[op].bytes += (size_t)numbers * bytes;
  };
  add("allgather", h * M, h * M * 3 * n * P);  // the cross-entropy's (m, l, z_target)
  if (!sp) {
    add("allreduce", (L + D) * M, (L + D) * M * n * d);          // g, forward
    add("allreduce", L * M, L * M * n * lat);                     // f on the latents, backward
    add("allreduce", (D + h) * M, (D + h) * M * n * d);           // f before W1/W3 and the head
  } else {
    add("allgather", L * M, L * M * n * lat);                     // gather_seq of the latents
    add("allgather", (D + h) * M, (D + h) * M * n * d, bf16_wire ? 2 : fl);  // ... before W1/W3 and the head
    f["allgather"].calls += (L + D + h) * M;                      // each gather_seq's token-count check
    f["allgather"].bytes += (size_t)((L + D + h) * M) * sizeof(int64_t) * (size_t)P;
    add("reduce_scatter", (L + D) * M, (L + D) * M * n * d);      // scatter_seq, forward
    add("reduce_scatter", L * M, L * M * n * lat);                // gather_seq's backward
    add("reduce_scatter", (D + h) * M, (D + h) * M * n * d);
    add("allgather", (L + D) * M, (L + D) * M * n * d);           // scatter_seq's backward
    add("allreduce", 1, replicated_numel);                        // replicated weights' gradients
    if (st.moe > 0) add("allreduce", 1, (c.layers - c.dense_layers) * c.experts);  // the MoE loads
  }
  return f;
}

std::vector<int64_t> bucket_numels(const std::vector<int64_t>& sizes, size_t bucket_bytes) {
  std::vector<int64_t> out;
  int64_t numel = 0;
  for (size_t i = sizes.size(); i-- > 0;) {
    numel += sizes[i];
    if ((bucket_bytes > 0 && (size_t)numel * sizeof(float) >= bucket_bytes) || i == 0) out.push_back(numel), numel = 0;
  }
  return out;
}

Group group_of(const std::string& name, const Options& opts, int ep) {
  const Split s = split_of(name, ep);
  if (s == Split::expert) return Group::experts;
  // under SP the replicated weights' gradients are partial sums over TP: with ZeRO-3 or the
  // buckets they form their own group, reduced over DP first, then summed over TP
  return opts.sp && (opts.zero == 3 || opts.bucket_mb > 0) && s == Split::replicated ? Group::replicated : Group::dense;
}

int unit_of(const std::string& name, int64_t layers) {
  if (name == "embed") return 0;
  if (name.rfind("layers.", 0) == 0) return 1 + std::stoi(name.substr(7));
  return (int)layers + 1;
}

std::vector<int64_t> group_buckets(const RankModel& here, const Setup& setup, const Options& opts, Group g) {
  std::vector<int64_t> sizes;                                // the group's weights, in the model's order
  std::vector<int64_t> units((size_t)setup.c.layers + 2, 0);  // ZeRO-3: per unit
  for (size_t k = 0; k < here.table.names.size(); k++)
    if (const Tensor* p = here.table.params[k])
      if (group_of(here.table.names[k], opts, setup.sizes.ep) == g) {
        sizes.push_back(p->numel());
        units[(size_t)unit_of(here.table.names[k], setup.c.layers)] += p->numel();
      }
  if (sizes.empty()) return {};
  if (opts.zero < 3) return bucket_numels(sizes, (size_t)(opts.bucket_mb * 1e6));
  std::vector<int64_t> held;
  for (int64_t n : units)
    if (n > 0) held.push_back(n);
  return held;
}

zero::Memory group_memory(const RankModel& here, const Setup& setup, const Options& opts, Group g, int ranks) {
  if (opts.precision != "bf16") return zero::formula(group_buckets(here, setup, opts, g), ranks, (int)opts.zero);
  int64_t n16 = 0, n32 = 0;
  for (size_t k = 0; k < here.table.names.size(); k++)
    if (const Tensor* p = here.table.params[k])
      if (group_of(here.table.names[k], opts, setup.sizes.ep) == g) (p->dtype() == DType::bf16 ? n16 : n32) += p->numel();
  if (n16 + n32 == 0) return zero::Memory{};
  if (opts.zero == 3)  // float32 ZeRO-3 for a group with no bf16 weight (SP's replicated norms)
    return n16 == 0 ? zero::formula(group_buckets(here, setup, opts, g), ranks, 3)
                    : zero::mixed_formula_units(group_buckets(here, setup, opts, g), ranks);
  return zero::mixed_formula(n16, n32, group_buckets(here, setup, opts, g), ranks, (int)opts.zero);
}

CollectiveCounts formula_dp(const model::Config& c, const std::vector<int64_t>& pieces, int dp,
                            int zero, bool loads, int64_t M) {
  CollectiveCounts f;
  const size_t fl = sizeof(float);
  if (dp == 1) return f;  // a group of one moves nothing
  for (int64_t numel : pieces) {
    if (zero == 3) {
      const size_t padded = (size_t)((numel + dp - 1) / dp * dp);
      f["allgather"].calls += 2 * M, f["allgather"].bytes += 2 * (size_t)M * padded * fl;
      f["reduce_scatter"].calls += M, f["reduce_scatter"].bytes += (size_t)M * padded * fl;
    } else if (zero == 0) {
      f["allreduce"].calls++, f["allreduce"].bytes += (size_t)numel * fl;
    } else {
      const size_t padded = (size_t)((numel + dp - 1) / dp * dp);
      f["reduce_scatter"].calls++, f["reduce_scatter"].bytes += padded * fl;
      f["allgather"].calls++, f["allgather"].bytes += padded * fl;
    }
  }
  if (loads) {
    f["allreduce"].calls += 1;
    f["allreduce"].bytes += (size_t)((c.layers - c.dense_layers) * c.experts) * fl;
  }
  return f;
}
// [/slide]

// [slide:cp-formula]
// CP: the ring's point-to-point messages ("send"), per attention layer: the forward passes every
// K/V block on, P - 1 hops; the backward passes them again (P - 1 hops) and dK/dV travel with
// them back to their owner (P hops). Each message is a block of this rank's B sequences x n
// tokens x its H / tp heads x (d_nope + d_rope) for K and the same for V (padded), or dK, dV.
CollectiveCounts formula_cp(const model::Config& c, const StageCounts& st,
                            int64_t B, int64_t n, int tp, int P) {
  CollectiveCounts f;
  if (P == 1) return f;
  const int64_t hops = (int64_t)(P - 1) + (P - 1) + P, msgs = st.L * st.M * hops;
  const size_t block = (size_t)(2 * B * (c.heads / tp) * n * (c.d_nope + c.d_rope)) * sizeof(float);
  f["send"] = {msgs, (size_t)msgs * block};
  return f;
}

// [slide:pp-formula]
// PP: what this rank's program sends to the other pipeline ranks, read off the schedule: each
// F whose next stage lives elsewhere sends the activation, each B or I whose previous stage
// lives elsewhere sends its gradient; one message of rows x d floats plus the micro-batch's
// index (a float) each. At the bottom of DualPipeV's V the next stage is on the same rank: no
// message.
CollectiveCounts formula_pp(const pp::Schedule& s, int me, int64_t rows, int64_t d) {
  CollectiveCounts f;
  const size_t msg = (size_t)(rows * d + 1) * sizeof(float);
  for (const pp::Step& step : s.ranks[(size_t)me])
    for (const pp::Op& op : step.paired ? std::vector<pp::Op>{step.op, step.with} : std::vector<pp::Op>{step.op}) {
      const int stage = s.stage_of(me, op.dir);
      const int to = op.kind == pp::Kind::F ? stage + 1 : op.kind == pp::Kind::W ? -1 : stage - 1;
      if (to < 0 || to >= s.num_stages() || s.rank_of(s.flow_of(op.dir), to) == me) continue;
      f["send"].calls += 1, f["send"].bytes += msg;
    }
  return f;
}
// [/slide]

// [slide:ep-formula]
// EP: per MoE layer, the routing map's all-gather (every rank's affinities T N floats, choices
// T K and kept groups T M int64, one message; the per-expert counts are read off the map; the
// model has no balance loss, so no all-reduce of it); then the rows, counted from the routing map. Flat (lesson 04):
// one row of d floats per routing slot whose expert lives on another rank, each way, in the
// forward (dispatch x, combine E(x)) and again in the backward (dy out, dx back).
// Hierarchical (lesson 05): per hop (rail: one row per token and remote node; fan: one per row
// and rank of the node that needs it) the same four messages, [x | g] (d + K wide) out and d
// back in the forward, d out and d + K back in the backward. Messages to oneself are copies.
CollectiveCounts formula_ep(const std::vector<dsv3::RoutingMap>& maps,
                            int me, int R, dsv3::Scheme scheme, int64_t d,
                            int64_t groups_kept, bool bf16_experts) {
  CollectiveCounts f;
  const size_t fl = sizeof(float), ix = sizeof(int64_t);
  // rows sent to and received from every peer of one hop, messages and bytes both ways: each row
  // goes out and comes back twice a step (forward, backward), row_bytes the two goings' bytes
  auto messages = [&](const std::vector<int64_t>& to, const std::vector<int64_t>& from, int self,
                      size_t to_row_bytes, size_t from_row_bytes) {
    for (size_t q = 0; q < to.size(); q++) {
      if ((int)q == self) continue;
      if (to[q] > 0) f["send"].calls += 2, f["send"].bytes += (size_t)to[q] * to_row_bytes;
      if (from[q] > 0) f["send"].calls += 2, f["send"].bytes += (size_t)from[q] * from_row_bytes;
    }
  };
  for (const dsv3::RoutingMap& m : maps) {
    const bool flat = scheme == dsv3::Scheme::flat;
    f["allgather"].calls += 1;
    f["allgather"].bytes += (size_t)m.P * ((size_t)(m.T * m.N) * fl + (size_t)(m.T * (m.K + groups_kept)) * ix);
    if (flat) {
      std::vector<int64_t> to((size_t)m.P, 0), from((size_t)m.P, 0);
      for (int p = 0; p < m.P; p++)
        for (int64_t t = 0; t < m.T; t++)
          for (int64_t j = 0; j < m.K; j++) {
            const int64_t e = m.expert(p, t, j);
            if (e < 0) continue;
            if (p == me) to[(size_t)(e / m.E)]++;
            if (e / m.E == me) from[(size_t)p]++;
          }
      // to: the dispatch (bf16 experts: 2 bytes a number) and the backward's dy; from: the
      // combine's outputs and the backward's dx, float32
      messages(to, from, me, (size_t)d * ((bf16_experts ? 2 : fl) + fl), (size_t)(2 * d) * fl);
      continue;
    }
    const int nodes = m.P / R, node = me / R, local = me % R;
    auto node_needs = [&](int p, int64_t t, int n) {
      for (int q = n * R; q < (n + 1) * R; q++)
        if (m.needs(p, t, q)) return true;
      return false;
    };
    std::vector<int64_t> rail_to((size_t)nodes, 0), rail_from((size_t)nodes, 0), fan_to((size_t)R, 0),
        fan_from((size_t)R, 0);
    for (int n = 0; n < nodes; n++)
      for (int64_t t = 0; t < m.T; t++) {
        rail_to[(size_t)n] += node_needs(me, t, n);
        const int src = n * R + local;  // rows of my rail peer on node n, forwarded by me
        if (!node_needs(src, t, node)) continue;
        rail_from[(size_t)n]++;
        for (int l = 0; l < R; l++) fan_to[(size_t)l] += m.needs(src, t, node * R + l);
      }
    for (int p = 0; p < m.P; p++)
      for (int64_t t = 0; t < m.T; t++) fan_from[(size_t)(p % R)] += m.needs(p, t, me);
    messages(rail_to, rail_from, node, (size_t)(2 * d + m.K) * fl, (size_t)(2 * d + m.K) * fl);
    messages(fan_to, fan_from, local, (size_t)(2 * d + m.K) * fl, (size_t)(2 * d + m.K) * fl);
  }
  return f;
}
// [/slide]

std::string human_bytes(double b) {
  char s[32];
  if (b >= 1 << 20)
    std::snprintf(s, sizeof s, "%.2f MiB", b / (1 << 20));
  else if (b >= 1 << 10)
    std::snprintf(s, sizeof s, "%.1f KiB", b / (1 << 10));
  else
    std::snprintf(s, sizeof s, "%.0f B", b);
  return s;
}

std::string counts_text(const CollectiveCounts& m) {
  std::ostringstream text;
  bool first = true;
  for (const auto& [op, cc] : m) {
    text << (first ? "" : ", ") << op << " " << cc.calls << " x, " << human_bytes((double)cc.bytes);
    first = false;
  }
  return first ? "none" : text.str();
}

size_t sum_bytes(const CollectiveCounts& m) {
  size_t b = 0;
  for (const auto& [op, cc] : m) b += cc.bytes;
  return b;
}

CollectiveCounts merged_counts(const std::vector<Comm*>& comms) {
  CollectiveCounts out;
  for (const Comm* cm : comms)
    for (const auto& [op, cc] : cm->collective_counts()) {
      out[op].calls += cc.calls;
      out[op].bytes += cc.bytes;
    }
  return out;
}

bool same_counts(const CollectiveCounts& a, const CollectiveCounts& b) {
  auto nonzero = [](const CollectiveCounts& m) {
    CollectiveCounts out;
    for (const auto& [op, cc] : m)
      if (cc.calls) out[op] = cc;
    return out;
  };
  const CollectiveCounts x = nonzero(a), y = nonzero(b);
  if (x.size() != y.size()) return false;
  for (const auto& [op, cc] : x) {
    auto it = y.find(op);
    if (it == y.end() || it->second.calls != cc.calls || it->second.bytes != cc.bytes) return false;
  }
  return true;
}

std::string first_difference(const AxisCounts& got, const AxisCounts& want) {
  const struct {
    const char* axis;
    const CollectiveCounts &got, &want;
  } axes[] = {{"tp", got.tp, want.tp}, {"dp", got.dp, want.dp},    {"cp", got.cp, want.cp},
              {"ep", got.ep, want.ep}, {"edp", got.edp, want.edp}, {"pp", got.pp, want.pp}};
  for (const auto& a : axes)
    if (!same_counts(a.got, a.want))
      return std::string(a.axis) + " " + counts_text(a.got) + ", formula " + counts_text(a.want);
  return "";
}

std::string communication_text(const AxisCounts& got, const AxisCounts& want, const MeshSizes& sizes) {
  std::string out;
  auto axis = [&](bool shown, const char* name, const CollectiveCounts& g, const CollectiveCounts& w) {
    if (shown) out += "  " + std::string(name) + ": " + counts_text(g) + "\n      formula: " + counts_text(w) + "\n";
  };
  axis(true, "tp", got.tp, want.tp);
  axis(sizes.cp > 1, "cp", got.cp, want.cp);
  axis(sizes.ep > 1, "ep", got.ep, want.ep);
  axis(true, sizes.cp > 1 ? "dp x cp" : "dp", got.dp, want.dp);
  axis(sizes.ep > 1, "edp", got.edp, want.edp);
  axis(sizes.pp > 1, "pp", got.pp, want.pp);
  return out;
}

void AxisComms::reset() const {
  for (Comm* comm : {tp, dp, cp, edp}) comm->reset_collective_counts();
  for (Comm* comm : ep) comm->reset_collective_counts();
  for (Comm* comm : pp) comm->reset_collective_counts();
}

AxisCounts AxisComms::counts() const {
  AxisCounts got;
  got.tp = tp->collective_counts(), got.dp = dp->collective_counts(), got.cp = cp->collective_counts();
  got.ep = merged_counts(ep), got.edp = edp->collective_counts(), got.pp = merged_counts(pp);
  return got;
}

AxisCounts expected_counts(const RankModel& here, const Setup& setup, const Options& opts,
                           int data_ranks, int edp,
                           bool pair_sums) {
  const model::Config& c = setup.c;
  const int pp_rank = here.pp_rank;
  StageCounts st;
  st.M = here.sched.layout == pp::Layout::dual ? setup.microbatches / 2 : setup.microbatches;  // a stage's copy sees one direction's
  st.head = here.plan.holds("head", pp_rank);
  for (int64_t l = 0; l < c.layers; l++)
    if (here.plan.holds_stage(here.plan.stage_of_layer(l), pp_rank))
      st.L++, (l < c.dense_layers ? st.D : st.moe)++;
  AxisCounts want;
  // under ZeRO-3 or with the buckets, SP sums the replicated weights' reduced gradients over TP
  // (ZeRO-0: the bucket sums; ZeRO-1 to -3: this rank's shards), not the gradients
  int64_t replicated = here.table.replicated_numel;
  const std::vector<int64_t> rep_units = group_buckets(here, setup, opts, Group::replicated);
  if (!rep_units.empty() && opts.zero > 0) {
    replicated = 0;
    for (int64_t n : rep_units) replicated += (n + data_ranks - 1) / data_ranks;
  }
  want.tp = formula_tp(c, st, setup.microbatch * setup.seq_per_cp, setup.sizes.tp, opts.sp, replicated,
                       opts.precision == "bf16");
  want.dp = formula_dp(c, group_buckets(here, setup, opts, Group::dense), data_ranks, (int)opts.zero,
                       here.held_moe > 0, st.M);
  for (const auto& [op, n] : formula_dp(c, rep_units, data_ranks, (int)opts.zero, false, st.M))
    want.dp[op].calls += n.calls, want.dp[op].bytes += n.bytes;
  want.cp = formula_cp(c, st, setup.microbatch, setup.seq_per_cp, setup.sizes.tp, setup.sizes.cp);
  const std::vector<int64_t> expert_buckets = group_buckets(here, setup, opts, Group::experts);
  if (setup.sizes.ep > 1 && !expert_buckets.empty())
    want.edp = formula_dp(c, expert_buckets, edp, (int)opts.zero, false, st.M);
  want.pp = formula_pp(here.sched, pp_rank, here.stages.boundary_shape(0, 0)[0], c.dim);
  if (pair_sums) {
    const bool loads = here.held_moe > 0;
    want.pp["allreduce"].calls += 1 + (loads ? 1 : 0);
    want.pp["allreduce"].bytes += (size_t)here.table.local_numel * sizeof(float) +
                                  (loads ? (size_t)((c.layers - c.dense_layers) * c.experts) * sizeof(float) : 0);
  }
  return want;
}

}  // namespace ff::mesh
