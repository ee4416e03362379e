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
//         runs lesson 02's ring (common/layers/ring_attention.h) over MLA's per-head keys and
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
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
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
#include "common/layers/ring_attention.h"
#include "common/layers/tensor_parallel.h"
#include "common/layers/zero.h"
#include "common/lesson/corpus.h"
#include "common/lesson/files.h"
#include "common/lesson/lesson.h"
#include "lessons/08_mesh/estimate.h"
#include "lessons/08_mesh/formulas.h"
#include "lessons/08_mesh/options.h"

using namespace ff;
using namespace ff::mesh;

namespace {

// How a weight is laid over the ranks: over TP (columns or rows), or, under EP, its experts
// (dim 0) over the EP ranks.
enum class Split { replicated, column, row, expert };

Split split_of(const std::string& name, int ep) {
  auto ends = [&](const char* t) {
    const size_t n = std::strlen(t);
    return name.size() >= n && name.compare(name.size() - n, n, t) == 0;
  };
  if (ep > 1 && (ends("moe.experts_w1") || ends("moe.experts_w3") || ends("moe.experts_w2")))
    return Split::expert;
  if (ends("attn.w_uq") || ends("attn.w_uk") || ends("attn.w_uv") || ends("ffn.w1") ||
      ends("ffn.w3") || name == "head")
    return Split::column;
  if (ends("attn.w_o") || ends("ffn.w2")) return Split::row;
  return Split::replicated;
}

bool is_norm_weight(const std::string& name) {
  return name.size() >= 4 && name.compare(name.size() - 4, 4, "norm") == 0;
}

// The part of a full weight of shape `full` that the rank at `co` holds.
Shape local_shape(const Shape& full, Split s, const MeshCoords& co, const MeshSizes& sizes) {
  Shape out = full;
  if (s == Split::replicated) return out;
  if (s == Split::expert) {
    out[0] = full[0] / sizes.ep;
    return out;
  }
  const int64_t dim = s == Split::column ? 1 : 0;
  int64_t b, e;
  split_range(full[(size_t)dim], sizes.tp, co.tp, &b, &e);
  out[(size_t)dim] = e - b;
  return out;
}

Tensor leaf(const Tensor& t) {
  Tensor out = t.detach().clone();
  out.requires_grad_();
  return out;
}

// [slide:shard]
// This rank's weights, cut from the full model (the same seed everywhere): heads, dense FFN, LM
// head by the TP split rule; under EP each MoE layer's experts [e N/ep, (e+1) N/ep); the rest whole.
model::Params shard_model(const model::Config& c, const model::Params& full, const MeshCoords& co,
                          const MeshSizes& sizes, bool kpe_per_head) {
  model::Params p = full;
  const int t = co.tp, tp = sizes.tp;
  auto col = [&](Tensor& w) { w = leaf(tp::column_shard(w, t, tp)); };
  auto row = [&](Tensor& w) { w = leaf(tp::row_shard(w, t, tp)); };
  const int64_t E = c.experts / sizes.ep;  // experts per EP rank
  auto experts = [&](Tensor& w) { w = leaf(slice(w, 0, co.ep * E, (co.ep + 1) * E)); };
  for (model::Block& b : p.layers) {
    col(b.attn.w_uq), col(b.attn.w_uk), col(b.attn.w_uv), row(b.attn.w_o);
    if (!b.moe) col(b.ffn.w1), col(b.ffn.w3), row(b.ffn.w2);
    if (b.moe && sizes.ep > 1) experts(b.experts.w1), experts(b.experts.w3), experts(b.experts.w2);
    if (kpe_per_head) {  // the planted bug: W_kr (d, d_r) becomes H copies side by side
      NoGradGuard ng;
      b.attn.w_kr = leaf(concat(std::vector<Tensor>((size_t)c.heads, b.attn.w_kr.detach()), 1));
    }
  }
  col(p.head);
  return p;
}
// [/slide]

// ----------------------------------------------------------------------------
// [slide:vocab-ce]
// Cross-entropy over a vocabulary split across the TP ranks. Rank r holds the logits of its
// columns [v0, v0 + V_r), (n, V_r). Per token it computes lesson 01's partial state over its
// columns, m_r = max z and l_r = sum exp(z - m_r), plus z[target] when it owns the target; one
// all-gather of those 3 numbers per token, and every rank merges them in rank order:
//     m = max_r m_r,   l = sum_r l_r exp(m_r - m),   loss_i = m + log l - z[target_i]
// Backward (by hand): dz = (exp(z - m) / l - onehot(target)) / n on the rank's own columns, no
// communication. local_softmax (a planted bug) normalises by the rank's own m_r, l_r instead.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const std::vector<int64_t>& targets,
                                    int64_t v0, Comm& tp, bool local_softmax) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const std::vector<float> z = logits.to_vector();
  std::vector<float> mine((size_t)(3 * n));
  for (int64_t i = 0; i < n; i++) {
    const float* zi = z.data() + i * V;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < V; j++) m = std::max(m, zi[j]);
    double l = 0;
    for (int64_t j = 0; j < V; j++) l += std::exp((double)zi[j] - m);
    const int64_t t = targets[(size_t)i] - v0;
    mine[(size_t)(3 * i)] = m;
    mine[(size_t)(3 * i + 1)] = (float)l;
    mine[(size_t)(3 * i + 2)] = t >= 0 && t < V ? zi[t] : 0.f;
  }
  const int P = tp.size();
  std::vector<float> all(mine.size() * (size_t)P);
  if (P > 1)
    tp.allgather(mine.data(), mine.size() * sizeof(float), all.data());
  else
    all = mine;
  // [slide:ce-merge]
  std::vector<float> m((size_t)n), l((size_t)n);
  double loss = 0;
  for (int64_t i = 0; i < n; i++) {
    float mm = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < P; r++) mm = std::max(mm, all[(size_t)(r * 3 * n + 3 * i)]);
    double ll = 0, zt = 0;
    for (int r = 0; r < P; r++) {
      const float* s = all.data() + r * 3 * n + 3 * i;
      ll += (double)s[1] * std::exp((double)s[0] - mm);
      zt += s[2];  // one rank owns the target, the others add 0
    }
    m[(size_t)i] = mm, l[(size_t)i] = (float)ll;
    loss += mm + std::log(ll) - zt;
    if (local_softmax) m[(size_t)i] = mine[(size_t)(3 * i)], l[(size_t)i] = mine[(size_t)(3 * i + 1)];
  }
  // [/slide:ce-merge]
  Tensor out = Tensor::from_vector({(float)(loss / (double)n)}, {}, logits.device());
  const Device dev = logits.device();
  return record(out, "vocab_parallel_cross_entropy", {logits},
                [z, m, l, targets, v0, n, V, dev](const Tensor& dy) -> std::vector<Tensor> {
                  const double scale = (double)dy.to_vector()[0] / (double)n;
                  std::vector<float> dz(z.size());
                  for (int64_t i = 0; i < n; i++) {
                    const int64_t t = targets[(size_t)i] - v0;
                    for (int64_t j = 0; j < V; j++) {
                      double p = std::exp((double)z[(size_t)(i * V + j)] - m[(size_t)i]) / l[(size_t)i];
                      if (j == t) p -= 1.0;
                      dz[(size_t)(i * V + j)] = (float)(p * scale);
                    }
                  }
                  return {Tensor::from_vector(dz, {n, V}, dev)};
                });
}
// [/slide]

// ----------------------------------------------------------------------------
// The model on the mesh: this rank's forward of its DP slice, under TP (and SP).
// Rows [r0, r1) of an int64 tensor (token ids, positions), on its device.
Tensor index_rows(const Tensor& t, int64_t r0, int64_t r1) {
  const std::vector<int64_t> all = t.to_index_vector();
  const int64_t w = t.numel() / t.size(0);
  Shape s = t.shape();
  s[0] = r1 - r0;
  return Tensor::from_indices(std::vector<int64_t>(all.begin() + r0 * w, all.begin() + r1 * w), s, t.device());
}

// One MoE layer's routing of some token rows: its index among the MoE layers, the experts.
struct Route {
  int64_t moe_layer = 0;
  Tensor idx;  // (rows, K)
};

struct MeshModel {
  model::Config c;
  Device device = Device::cpu;
  model::Params p;  // this TP rank's weights (shard_model)
  Comm* tp = nullptr;
  bool sp = false, ce_local_softmax = false;
  int64_t v0 = 0;   // this rank's first vocabulary column
  // CP: the ring over the cp group, and every CP rank's token positions within a sequence
  // (zigzag: rank r holds chunks r and 2cp-1-r of the 2cp chunks). Planted bugs: the causal
  // mask or RoPE from the rank-local indices 0..n-1 instead of the global positions.
  Comm* cp = nullptr;
  std::vector<std::vector<int64_t>> cp_positions;
  bool local_mask = false, local_rope = false;
  // EP: the MoE layers over the ep group (lesson 05's layer, common/layers/dsv3_ep.h), this
  // rank holding N / ep of each layer's experts; maps gets every MoE layer's routing map.
  Comm* ep = nullptr;
  dsv3::Topology* topo = nullptr;
  dsv3::Scheme scheme = dsv3::Scheme::flat;
  std::vector<dsv3::RoutingMap>* maps = nullptr;

  // Into the TP region: f (identity forward, all-reduce of the gradient backward), or under SP
  // gather_seq (all-gather of the tokens forward, reduce-scatter backward).
  Tensor enter(const Tensor& x) { return sp ? tp::gather_seq(x, *tp) : tp::f(x, *tp); }
  // Out of it: g (all-reduce of the partial sums), or under SP scatter_seq (reduce-scatter).
  Tensor leave(const Tensor& y) { return sp ? tp::scatter_seq(y, *tp) : tp::g(y, *tp); }

  // [slide:cp-attention]
  // MLA's heads over the CP ring: this rank's queries against every CP rank's keys and values
  // (lesson 02's ring, common/layers/ring_attention.h). Per head q = [q_nope | q_pe] and
  // k = [k_nope | k_pe] (k_pe, one per token, repeated for every head), so the two inner
  // products are one of width d_nope + d_rope, the scale 1/sqrt(d_nope + d_rope) as MLA's; v is
  // padded with zeros to that width. The blocks are (B, H, n, D): the ring's mask compares the
  // global positions of every CP rank's tokens.
  Tensor attention_cp(const model::Attention& a, const model::Latents& l, int64_t H, int64_t B,
                      const Tensor& rope_pos) {
    const int64_t n = l.c_q.size(0) / B, dn = c.d_nope, dr = c.d_rope, D = dn + dr;
    // [slide:cp-ring]
    Tensor q = reshape(matmul(l.c_q, a.w_uq), {B * n, H, D});
    q = concat({slice(q, 2, 0, dn), rope(slice(q, 2, dn, D), rope_pos, c.rope_theta)}, 2);
    Tensor k_pe = l.k_pe.size(1) == dr ? concat(std::vector<Tensor>((size_t)H, reshape(l.k_pe, {B * n, 1, dr})), 1)
                                       : reshape(l.k_pe, {B * n, H, dr});  // --bug kpe-per-head
    Tensor k = concat({reshape(matmul(l.c_kv, a.w_uk), {B * n, H, dn}), k_pe}, 2);
    Tensor v = reshape(matmul(l.c_kv, a.w_uv), {B * n, H, c.d_v});
    if (c.d_v < D) v = concat({v, Tensor::zeros({B * n, H, D - c.d_v}, v.device())}, 2);
    auto blocks = [&](const Tensor& t) { return transpose(reshape(t, {B, n, H, D}), 1, 2); };
    ring::Config rc;
    rc.B = B, rc.H = H, rc.D = D, rc.causal = true, rc.order = ring::Order::async;
    rc.dev = q.device();
    rc.positions = cp_positions;
    if (local_mask)  // the silent bug: every rank's mask as if its block started the sequence
      for (std::vector<int64_t>& pos : rc.positions)
        for (size_t i = 0; i < pos.size(); i++) pos[i] = (int64_t)i;
    Tensor o = ring::attention(*cp, rc, blocks(q), blocks(k), blocks(v));       // (B, H, n, D)
    // [/slide:cp-ring]
    o = reshape(transpose(slice(o, 3, 0, c.d_v), 1, 2), {B * n, H * c.d_v});
    return matmul(o, a.w_o);
  }
  // [/slide]

  // Where this rank's tokens sit: under CP each sequence's T tokens are the zigzag chunks of
  // this CP rank (global positions, for the mask and RoPE); under SP this TP rank keeps rows
  // [r0, r0 + rows) of the B T token rows outside the TP regions.
  struct Tokens {
    int64_t B = 0, T = 0, r0 = 0, rows = 0;
    Tensor pos_all;  // (B T) global positions of every token row
    Tensor pos;      // (rows) those of this rank's rows
  };
  Tokens tokens(int64_t B, int64_t T) const {
    Tokens k;
    k.B = B, k.T = T, k.rows = B * T;
    const Device dev = device;
    std::vector<int64_t> seq_pos = cp_positions[(size_t)cp->rank()];  // global, for RoPE
    if (local_rope)
      for (size_t i = 0; i < seq_pos.size(); i++) seq_pos[i] = (int64_t)i;
    k.pos_all = model::tile_positions(Tensor::from_indices(seq_pos, {T}, dev), B);  // (B T)
    k.pos = k.pos_all;
    if (sp) {  // this rank's slice of the B T token rows
      k.rows = B * T / tp->size(), k.r0 = tp->rank() * k.rows;
      k.pos = index_rows(k.pos_all, k.r0, k.r0 + k.rows);
    }
    return k;
  }

  // The first stage: this rank's token rows, embedded (rows, d).
  Tensor embed(const Tensor& inputs, const Tokens& k) const {
    const std::vector<int64_t> ids = inputs.to_index_vector();
    return embedding(p.embed, Tensor::from_indices(
                                  std::vector<int64_t>(ids.begin() + k.r0, ids.begin() + k.r0 + k.rows),
                                  {k.rows}, device));
  }

  // [slide:mesh-forward]
  // Blocks [l0, l1) on this rank's token rows x (rows, d). routes gets each MoE layer's chosen
  // experts for these rows (its MoE index: the layer's place among the MoE layers).
  Tensor blocks(Tensor x, int64_t l0, int64_t l1, const Tokens& k, std::vector<Route>* routes) {
    const int64_t H = c.heads / tp->size();  // this rank's heads
    dsv3::Config mc = c.moe_config();
    mc.seq_len = k.T;
    for (int64_t l = l0; l < l1; l++) {
      const model::Block& b = p.layers[(size_t)l];
      // [slide:mla-f]
      // attention: the latents from the replicated down-projections (each rank's own tokens
      // under SP), into the TP region as one tensor, this rank's heads, out through W_o's rows
      Tensor u = rmsnorm(x, b.attn_norm, c.norm_eps);
      model::Latents lat = model::attention_latents(c, b.attn, u, k.pos);
      const int64_t rq = c.q_lora, rkv = c.kv_lora, rk = lat.k_pe.size(1);
      Tensor joined = enter(concat({lat.c_q, lat.c_kv, lat.k_pe}, 1));
      lat = {slice(joined, 1, 0, rq), slice(joined, 1, rq, rq + rkv),
             slice(joined, 1, rq + rkv, rq + rkv + rk)};
      x = add(x, leave(cp->size() == 1 ? model::attention_heads(c, H, b.attn, lat, k.B, k.pos_all)
                                        : attention_cp(b.attn, lat, H, k.B, k.pos_all)));
      // [/slide:mla-f]
      // FFN: dense SwiGLU column- then row-parallel; the MoE on this rank's tokens, its
      // experts replicated or (EP) spread over the ep group, the tokens sent to them
      u = rmsnorm(x, b.ffn_norm, c.norm_eps);
      if (!b.moe) {
        x = add(x, leave(model::dense_ffn(b.ffn, enter(u))));
      } else {
        Tensor route;
        if (ep->size() == 1) {
          x = add(x, model::moe_ffn(mc, b.experts, u, &route));
        } else {
          dsv3::RoutingMap map;
          x = add(x, dsv3::ep_layer(*ep, *topo, scheme, mc, b.experts, u, &route, &map));
          if (maps) maps->push_back(std::move(map));
        }
        routes->push_back({l - c.dense_layers, route});
      }
    }
    return x;
  }
  // [/slide]

  // The last stage: the LM head split over the vocabulary, every token's logits of this
  // rank's columns, and the mean loss over the B T tokens (the same on every TP rank).
  Tensor head_loss(const Tensor& x, const Tensor& targets) {
    Tensor logits = matmul(enter(rmsnorm(x, p.norm, c.norm_eps)), p.head);   // (B T, V_r)
    return vocab_parallel_cross_entropy(logits, targets.to_index_vector(), v0, *tp,
                                        ce_local_softmax);
  }

};

// ----------------------------------------------------------------------------
// Which stage each weight belongs to, and which stages a pipeline rank holds.
struct StagePlan {
  std::vector<int64_t> begin;  // S + 1 layer indices
  pp::Schedule sched;
  int stages() const { return (int)begin.size() - 1; }
  int stage_of_layer(int64_t l) const {
    int st = 0;
    while (begin[(size_t)st + 1] <= l) st++;
    return st;
  }
  // the embedding on the first stage, block l's weights on its stage, the rest on the last
  int stage_of(const std::string& name) const {
    if (name == "embed") return 0;
    if (name.rfind("layers.", 0) == 0) return stage_of_layer(std::stol(name.substr(7)));
    return stages() - 1;
  }
  bool holds_stage(int stage, int pp_rank) const {
    for (int d = 0; d < (sched.layout == pp::Layout::line ? 1 : 2); d++)
      if (sched.stage_of(pp_rank, d) == stage) return true;
    return false;
  }
  bool holds(const std::string& name, int pp_rank) const { return holds_stage(stage_of(name), pp_rank); }
  int rank_of(const std::string& name) const { return sched.rank_of(0, stage_of(name)); }
};

// The weights of the stages this pipeline rank does not hold, released (a block keeps only
// whether it is a MoE block, for the order of the balancing biases).
void release_other_stages(model::Params* p, const StagePlan& plan, int pp_rank) {
  if (!plan.holds("embed", pp_rank)) p->embed = Tensor();
  if (!plan.holds("head", pp_rank)) p->norm = Tensor(), p->head = Tensor();
  for (size_t l = 0; l < p->layers.size(); l++)
    if (!plan.holds_stage(plan.stage_of_layer((int64_t)l), pp_rank)) {
      model::Block empty;
      empty.moe = p->layers[l].moe;
      p->layers[l] = empty;
    }
}

// PP: the model cut into S stages, stage s holding blocks [begin[s], begin[s+1]), the
// embedding on the first stage and the final norm, LM head and loss on the last. Lesson 07's
// executor (common/layers/pipeline.h) walks this rank's schedule and calls forward() for each
// F; what crosses a stage boundary is the residual stream of this rank's token rows of one
// micro-batch, (rows, d): under SP each TP rank sends its slice to the same TP rank of the
// next stage, under CP its zigzag chunks.
struct MeshStages : pp::StageModel {
  MeshModel* mm = nullptr;
  std::vector<int64_t> begin;  // S + 1 layer indices
  int64_t M = 1, Bm = 1, T = 1;  // micro-batches, sequences in each, tokens of each (this rank)
  bool mb_sum = false;
  Tensor inputs, targets;        // this step's (M Bm, T) sequences of this rank
  std::vector<Route> routes;     // every MoE layer's routing of every micro-batch this step

  int stages() const { return (int)begin.size() - 1; }
  // [slide:pp-stages]
  // micro-batch gm through stage `stage`: lesson 07's executor calls it for each F
  Tensor forward(int stage, int gm, const Tensor& x) override {
    const MeshModel::Tokens k = mm->tokens(Bm, T);
    Tensor in = index_rows(inputs, gm * Bm, (gm + 1) * Bm);
    Tensor y = stage == 0 ? mm->embed(in, k) : x;
    y = mm->blocks(y, begin[(size_t)stage], begin[(size_t)stage + 1], k, &routes);
    if (stage + 1 < stages()) return y;
    Tensor loss = mm->head_loss(y, index_rows(targets, gm * Bm, (gm + 1) * Bm));
    // its share of the batch's mean (the planted bug pp-mb-sum: the micro-batches' losses summed)
    return M == 1 || mb_sum ? loss : scale(loss, 1.f / (float)M);
  }
  // [/slide]
  Shape boundary_shape(int, int) const override { return {mm->tokens(Bm, T).rows, mm->c.dim}; }

  // The loss of this rank's (B, T) sequences through the pipeline, forward only, as one batch
  // (validation): each stage receives the previous stage's output, computes, sends it on.
  // Returns the loss on the ranks of the last stage, 0 elsewhere.
  double forward_only(Comm& pipe, const pp::Schedule& s, const Tensor& in, const Tensor& tg) {
    NoGradGuard ng;
    const MeshModel::Tokens k = mm->tokens(in.size(0), in.size(1));
    const int me = pipe.rank();
    std::vector<Route> unused;
    Tensor x;
    double loss = 0;
    for (int st = 0; st < stages(); st++) {
      if (s.rank_of(0, st) != me) continue;
      if (st > 0 && s.rank_of(0, st - 1) != me) {
        std::vector<float> buf((size_t)(k.rows * mm->c.dim));
        pipe.recv(buf.data(), buf.size() * sizeof(float), s.rank_of(0, st - 1), 3);
        x = Tensor::from_vector(buf, {k.rows, mm->c.dim}, mm->device);
      }
      x = mm->blocks(st == 0 ? mm->embed(in, k) : x, begin[(size_t)st], begin[(size_t)st + 1], k, &unused);
      if (st + 1 == stages()) {
        loss = mm->head_loss(x, tg).to_vector()[0];
      } else if (s.rank_of(0, st + 1) != me) {
        const std::vector<float> buf = x.to_vector();
        pipe.send(buf.data(), buf.size() * sizeof(float), s.rank_of(0, st + 1), 3);
      }
    }
    return loss;
  }
  Device device() const override { return mm->device; }
};


// ----------------------------------------------------------------------------
// The balancing bias (DeepSeek-V3's auxiliary-loss-free update, lesson 05): after each step,
// b_i += gamma * sign(mean load - load_i), the loads counted over the whole global batch.
// The loads of every MoE layer of the model ((L - D) N counts), from the routes this rank saw.
std::vector<float> expert_loads(const std::vector<Route>& routes, const model::Config& c) {
  const int64_t N = c.experts;
  std::vector<float> load((size_t)((c.layers - c.dense_layers) * N), 0.f);
  for (const Route& r : routes)
    for (int64_t e : r.idx.to_index_vector()) load[(size_t)(r.moe_layer * N + e)] += 1.f;
  return load;  // exact: counts far below 2^24
}

// The balancing bias of every MoE layer this rank holds, from every layer's loads (load: N per
// MoE layer, summed over every rank that routed), by lesson 05's rule.
void update_biases(model::Params& p, const std::vector<float>& load, int64_t N, double gamma) {
  dsv3::BiasUpdater rule;  // lesson 05's rule, once per MoE layer
  rule.gamma = gamma;
  size_t l = 0;
  for (model::Block& b : p.layers) {
    if (!b.moe) continue;
    if (b.experts.bias.defined()) {  // (undefined: a layer of another pipeline stage)
      const auto first = load.begin() + (long)(l * (size_t)N);
      b.experts.bias.copy_from(rule.updated(b.experts.bias, std::vector<double>(first, first + N), 0));
    }
    l++;
  }
}

// ----------------------------------------------------------------------------
// The check's view of the mesh: every rank's local tensors, gathered (one all-gather on a
// communicator of the check's own, so that the training's counters stay the training's), and
// rebuilt on every rank as the full weights one process would hold.
struct Gathered {
  std::vector<Tensor> full;     // one per named parameter, on the cpu
  std::string disagree;         // the first replicated weight whose copies differ ("" if none)
};

// The same bits (sizes included; an empty vector may have no storage to compare).
bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// local: this rank's tensors of the names its pipeline stages hold, in names' order.
Gathered gather_full(const std::vector<std::string>& names, const std::vector<Shape>& full_shapes,
                     const std::vector<Tensor>& local, const MeshSizes& sizes, const StagePlan& plan,
                     Comm& world) {
  std::vector<float> mine;
  for (const Tensor& t : local) {
    const std::vector<float> v = t.to_vector();
    mine.insert(mine.end(), v.begin(), v.end());
  }
  const int W = world.size();
  std::vector<int64_t> counts((size_t)W);
  int64_t n = (int64_t)mine.size();
  world.allgather(&n, sizeof n, counts.data());
  std::vector<size_t> bytes((size_t)W);
  std::vector<size_t> offset((size_t)W + 1, 0);
  for (int r = 0; r < W; r++) {
    bytes[(size_t)r] = (size_t)counts[(size_t)r] * sizeof(float);
    offset[(size_t)r + 1] = offset[(size_t)r] + (size_t)counts[(size_t)r];
  }
  std::vector<float> all(offset[(size_t)W]);
  world.allgatherv(mine.data(), mine.size() * sizeof(float), all.data(), bytes);

  // Walk every rank's buffer with that rank's local shapes (empty: a name it does not hold).
  std::vector<std::vector<Tensor>> pieces((size_t)W);
  for (int r = 0; r < W; r++) {
    const MeshCoords co = mesh_coords(sizes, r);
    size_t at = offset[(size_t)r];
    for (size_t k = 0; k < names.size(); k++) {
      if (!plan.holds(names[k], co.pp)) {
        pieces[(size_t)r].push_back(Tensor());
        continue;
      }
      const Shape s = local_shape(full_shapes[k], split_of(names[k], sizes.ep), co, sizes);
      int64_t numel = 1;
      for (int64_t d : s) numel *= d;
      pieces[(size_t)r].push_back(Tensor::from_vector(
          std::vector<float>(all.begin() + (long)at, all.begin() + (long)(at + (size_t)numel)), s));
      at += (size_t)numel;
    }
  }
  Gathered g;
  const int stage_ranks = sizes.dp * sizes.cp * sizes.tp;
  for (size_t k = 0; k < names.size(); k++) {
    const Split s = split_of(names[k], sizes.ep);
    const int q = plan.rank_of(names[k]);  // the pipeline rank holding its stage
    // the parts to join, from the first block of ranks of that pipeline rank: TP rank t's shard
    // from (tp t, all else 0); EP rank e's experts from the block's rank e
    std::vector<Tensor> parts;
    if (s == Split::expert)
      for (int e = 0; e < sizes.ep; e++) parts.push_back(pieces[(size_t)(q * stage_ranks + e)][k]);
    else
      for (int t = 0; t < sizes.tp; t++) parts.push_back(pieces[(size_t)mesh_rank(sizes, {t, 0, 0, 0, q, 0})][k]);
    // every copy equals its reference copy: DP replicas the TP shard of dp 0, expert-DP
    // replicas the experts of EP rank e, and a replicated weight the one of rank 0
    for (int r = 0; r < W && g.disagree.empty(); r++) {
      const MeshCoords co = mesh_coords(sizes, r);
      if (!plan.holds(names[k], co.pp)) continue;
      const int t = s == Split::replicated ? 0 : s == Split::expert ? co.ep : co.tp;
      const std::vector<float> a = pieces[(size_t)r][k].to_vector(), b = parts[(size_t)t].to_vector();
      if (!same_floats(a, b))
        g.disagree = names[k] + " (rank " + std::to_string(r) + ")";
    }
    NoGradGuard ng;
    g.full.push_back(s == Split::replicated ? parts[0]
                                            : concat(parts, s == Split::column ? 1 : 0));
  }
  return g;
}

// The tolerance rule of lessons 04 and 05, K n eps max|want| with K = kLossBound: n float32
// terms summed in two orders differ by at most about 2 n eps of their magnitude, and a factor 2
// covers the few roundings of each term. n is the longest sum, a weight gradient's over every
// token of the global batch (B T).
constexpr double kLossBound = 4.0;

// max |got - want| as a fraction of the bound kLossBound n eps max|want| (above): 1 fails.
double error_ratio(const Tensor& got, const Tensor& want, double n) {
  const std::vector<float> a = got.to_vector(), b = want.to_vector();
  double diff = 0, big = 0;
  for (size_t i = 0; i < a.size(); i++) {
    diff = std::max(diff, (double)std::fabs(a[i] - b[i]));
    if (std::isnan(a[i]) || std::isnan(b[i])) diff = INFINITY;
    big = std::max(big, (double)std::fabs(b[i]));
  }
  const double bound = kLossBound * n * std::numeric_limits<float>::epsilon() * std::max(big, 1e-30);
  return diff / bound;
}


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
  model::Params ref;
  std::vector<model::NamedTensor> ref_named;
  std::vector<Tensor*> ref_params;
  // AdamW runs where the mesh's does: ZeRO-1 on the host (its shard lives there), ZeRO-0 on the
  // device; then the two apply the same elementwise float operations and agree bit for bit.
  const Device adam_dev = o.zero == 1 ? Device::cpu : L.device;
  Adam ref_adam(ac);
  std::vector<Tensor> ref_adam_params;  // the reference's weights where its AdamW runs
  if (L.rank() == 0) {
    ref = model::init_params(c, (uint64_t)L.flags.seed, L.device);
    ref_named = ref.named_parameters();
    for (model::NamedTensor& n : ref_named) ref_params.push_back(&n.t);
  }

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
  const double eps = std::numeric_limits<float>::epsilon();
  const double n_terms = (double)(o.batch * T);  // the longest sum: a weight gradient's, over tokens
  struct Worst {
    double ratio = 0;
    std::string what = "-";
    int64_t step = -1;
  } worst_loss, worst_grad;
  bool adam_equal = true, bias_equal = true, comm_equal = true, kpe_copies_equal = true;
  std::string disagree, comm_detail, adam_detail = "-";
  int64_t checked_steps = 0;
  double first_loss_ratio = 0;  // step 0: both from the initial weights
  CollectiveCounts last_tp, last_dp, last_cp, last_ep, last_edp, last_pp;
  // what each axis should move in one step (EP's depends on the step's routing: below)
  StageCounts st;
  st.M = M, st.head = plan.holds("head", mesh.coords().pp);
  if (sched.layout == pp::Layout::dual) st.M = M / 2;  // a stage's copy here sees one direction's
  for (int64_t l = 0; l < c.layers; l++)
    if (plan.holds_stage(plan.stage_of_layer(l), mesh.coords().pp))
      st.L++, (l < c.dense_layers ? st.D : st.moe)++;
  const CollectiveCounts want_tp = formula_tp(c, st, Bm * Tc, sizes.tp, o.sp, replicated_numel),
                         want_dp = formula_dp(c, dense_opt.numel, W, (int)o.zero, held_moe > 0),
                         want_cp = formula_cp(c, st, Bm, Tc, sizes.tp, sizes.cp),
                         want_edp = sizes.ep > 1 && expert_opt.numel > 0 ? formula_dp(c, expert_opt.numel, edp.size(), (int)o.zero, false)
                                                 : CollectiveCounts{};
  CollectiveCounts want_pp = formula_pp(sched, mesh.coords().pp, stages.boundary_shape(0, 0)[0], c.dim);
  // DualPipe's pair (rank q and P-1-q of the pipeline, holding the same two stages)
  const bool dual = sched.layout == pp::Layout::dual;
  Comm pair = mesh.pp().split(std::min(mesh.coords().pp, (int)o.pp - 1 - mesh.coords().pp), mesh.coords().pp);
  pair.set_label("pp");
  if (dual) {
    want_pp["allreduce"].calls += 1 + (held_moe > 0 ? 1 : 0);
    want_pp["allreduce"].bytes += (size_t)local_numel * sizeof(float) +
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
    last_tp = mesh.tp().collective_counts();
    last_dp = data.collective_counts();
    last_cp = mesh.cp().collective_counts();
    last_ep = merged_counts({&mesh.ep(), &topo.node_comm, &topo.rail_comm});
    last_edp = edp.collective_counts();
    last_pp = merged_counts({&mesh.pp(), &pair});
    const struct {
      const char* axis;
      const CollectiveCounts& got;
      CollectiveCounts want;
    } axes[] = {
        {"tp", last_tp, want_tp},
        {"dp", last_dp, want_dp},
        {"cp", last_cp, want_cp},
        {"ep", last_ep, formula_ep(maps, mesh.coords().ep, topo.R, mm.scheme, c.dim, 1)},
        {"edp", last_edp, want_edp},
        {"pp", last_pp, want_pp},
    };
    for (const auto& a : axes)
      if (!same_counts(a.got, a.want) && comm_equal) {
        comm_equal = false;
        comm_detail = "step " + std::to_string(step) + ": " + a.axis + " " + counts_text(a.got) +
                      ", formula " + counts_text(a.want);
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

    double loss_ref = NAN, grad_ratio = 0;
    std::string step_adam = "=";
    if (L.rank() == 0) {
      // the reference gradient from the same weights and the whole global batch
      std::vector<float> ref_load;
      if (checking) {
        checked_steps++;
        CharCorpus::Batch gb = corpus.batch(CharCorpus::Split::train, step, o.batch, T, 0, o.batch,
                                            (uint64_t)L.flags.seed);
        for (Tensor* p : ref_params) p->zero_grad();
        model::Output out = model::forward(c, ref, gb.inputs.to(L.device), gb.targets.to(L.device),
                                           model::positions(T, L.device));
        out.loss.backward();
        loss_ref = out.loss.to_vector()[0];
        if (L.dumping() && step + 1 == o.steps) {
          // the last step as the mesh ran it: the weights before it, the global batch, the
          // mesh's loss and its mean gradient of every weight (gathered over TP, DP and CP)
          for (size_t k = 0; k < names.size(); k++) {
            L.dump("last_step." + names[k], *ref_params[k]);
            L.dump("last_step.grad." + names[k], g_grad.full[k]);
          }
          for (const model::NamedTensor& n : ref.named_buffers()) L.dump("last_step." + n.name, n.t);
          L.dump("last_step.inputs", gb.inputs);
          L.dump("last_step.targets", gb.targets);
          L.dump("last_step.loss", Tensor::from_vector({(float)loss_mesh}, {}));
        }
        double lr_ratio = std::fabs(loss_mesh - loss_ref) /
                          (kLossBound * n_terms * eps * std::max(1.0, std::fabs(loss_ref)));
        if (std::isnan(lr_ratio)) lr_ratio = INFINITY;
        if (lr_ratio > worst_loss.ratio || worst_loss.step < 0) worst_loss = {lr_ratio, "loss", step};
        if (step == 0) first_loss_ratio = lr_ratio;
        for (size_t k = 0; k < names.size(); k++) {
          Tensor want = ref_params[k]->grad().defined() ? ref_params[k]->grad()
                                                        : Tensor::zeros(ref_params[k]->shape());
          Tensor got = g_grad.full[k];
          if (bug_kpe && got.shape() != want.shape()) got = slice(got, 1, 0, c.d_rope);
          double r = error_ratio(got, want, n_terms);
          if (std::isnan(r)) r = INFINITY;
          grad_ratio = std::max(grad_ratio, r);
          if (r > worst_grad.ratio || worst_grad.step < 0) worst_grad = {r, names[k], step};
        }
        std::vector<Route> ref_routes;
        for (size_t l = 0; l < out.routes.size(); l++) ref_routes.push_back({(int64_t)l, out.routes[l]});
        ref_load = expert_loads(ref_routes, c);
      }
      // AdamW on the mesh's own mean gradient, from the same weights: the same bits expected
      if (ref_adam_params.empty())
        for (Tensor* p : ref_params) ref_adam_params.push_back(p->detach().to(adam_dev).clone());
      std::vector<Tensor> grads;
      std::vector<Tensor*> ps;
      for (size_t k = 0; k < names.size(); k++) {
        Tensor gk = g_grad.full[k];
        if (bug_kpe && gk.shape() != ref_adam_params[k].shape()) gk = slice(gk, 1, 0, c.d_rope).clone();
        grads.push_back(gk.to(adam_dev));
        ps.push_back(&ref_adam_params[k]);
      }
      ref_adam.step(ps, grads);
      for (size_t k = 0; k < names.size(); k++) {
        Tensor mesh_w = g_par.full[k];
        if (bug_kpe && mesh_w.shape() != ref_adam_params[k].shape()) {
          // every head's copy of W_kr: one shared key means they stay equal
          for (int64_t h = 1; h < c.heads && kpe_copies_equal; h++)
            if (!bitwise_equal(slice(mesh_w, 1, 0, c.d_rope), slice(mesh_w, 1, h * c.d_rope, (h + 1) * c.d_rope)))
              kpe_copies_equal = false;
          mesh_w = slice(mesh_w, 1, 0, c.d_rope).clone();
        }
        if (!bitwise_equal(mesh_w, ref_adam_params[k])) {
          step_adam = "differ";
          if (adam_equal) adam_detail = names[k] + ", step " + std::to_string(step);
          adam_equal = false;
        }
        // resynchronise: the next step starts from the mesh's weights
        ref_adam_params[k].copy_from(mesh_w.to(adam_dev));
        ref_params[k]->detach().copy_from(mesh_w.to(L.device));
      }
      std::vector<model::NamedTensor> rb = ref.named_buffers();
      if (checking) {  // the reference's own bias update from its own routes
        update_biases(ref, ref_load, c.experts, o.bias_rate);
        std::vector<float> ref_bias;
        for (const model::NamedTensor& b : rb) {
          const std::vector<float> v = b.t.to_vector();
          ref_bias.insert(ref_bias.end(), v.begin(), v.end());
        }
        if (!same_floats(ref_bias, my_bias))
          bias_equal = false;
      }
      size_t at = 0;
      for (const model::NamedTensor& b : rb) {
        const size_t n = (size_t)b.t.numel();
        b.t.copy_from(Tensor::from_vector(std::vector<float>(my_bias.begin() + (long)at,
                                                             my_bias.begin() + (long)(at + n)),
                                          b.t.shape(), b.t.device()));
        at += n;
      }
    }
    if (L.rank() == 0) {
      const double bound = kLossBound * n_terms * eps * std::max(1.0, std::fabs(loss_ref));
      if (logging) {
        auto column = [&](bool shown, const CollectiveCounts& m) {
          const std::string b = human_bytes((double)sum_bytes(m));
          return shown ? "  " + std::string(10 - std::min<size_t>(10, b.size()), ' ') + b : std::string();
        };
        const std::string cp_col = column(sizes.cp > 1, last_cp) + column(sizes.ep > 1, last_ep) +
                                   column(sizes.ep > 1, last_edp) + column(sizes.pp > 1, last_pp);
        if (checking)
          std::printf("%5lld  %11.6f  %13.6f  %9.2e  %9.2e  %8.3f  %6s  %10s  %10s%s\n", (long long)step,
                      loss_mesh, loss_ref, std::fabs(loss_mesh - loss_ref), bound, grad_ratio,
                      step_adam.c_str(), human_bytes((double)sum_bytes(last_tp)).c_str(),
                      human_bytes((double)sum_bytes(last_dp)).c_str(), cp_col.c_str());
        else
          std::printf("%5lld  %11.6f  %13s  %9s  %9s  %8s  %6s  %10s  %10s%s\n", (long long)step, loss_mesh,
                      "-", "-", "-", "-", step_adam.c_str(), human_bytes((double)sum_bytes(last_tp)).c_str(),
                      human_bytes((double)sum_bytes(last_dp)).c_str(), cp_col.c_str());
      }
      char row[320];
      std::snprintf(row, sizeof row, "step,%d,%d,%lld,%d,%lld,%.9g,%.9g,%.6g,%zu,%zu,,,,,,%d,%zu,%d,%d,%zu,%zu,%zu,0\n",
                    sizes.dp, sizes.tp, (long long)o.zero, (int)o.sp, (long long)step, loss_mesh,
                    loss_ref, grad_ratio, sum_bytes(last_tp), sum_bytes(last_dp), sizes.cp,
                    sum_bytes(last_cp), sizes.pp, sizes.ep, sum_bytes(last_ep), sum_bytes(last_edp),
                    sum_bytes(last_pp));
      csv << row;
    }
  }
  Comm::set_link(LinkModel{});

  // ---- memory, communication per axis, the estimate
  // under EP two optimizers: the dense weights over DP x CP, the experts over expert-DP
  const zero::Memory mem = dense_opt.memory() + expert_opt.memory();
  const zero::Memory want = zero::formula(dense_opt.numel, W, (int)o.zero) +
                            (sizes.ep > 1 ? zero::formula(expert_opt.numel, edp.size(), (int)o.zero) : zero::Memory{});
  if (L.rank() == 0) {
    std::printf("\ncommunication of one step (rank 0; Comm's counters, payload bytes):\n");
    std::printf("  tp: %s\n      formula: %s\n", counts_text(last_tp).c_str(),
                counts_text(want_tp).c_str());
    if (sizes.cp > 1)
      std::printf("  cp: %s\n      formula: %s\n", counts_text(last_cp).c_str(),
                  counts_text(want_cp).c_str());
    if (sizes.ep > 1)
      std::printf("  ep: %s\n      formula: %s\n", counts_text(last_ep).c_str(),
                  counts_text(formula_ep(maps, mesh.coords().ep, topo.R, mm.scheme, c.dim, 1)).c_str());
    std::printf("  %s: %s\n      formula: %s\n", sizes.cp > 1 ? "dp x cp" : "dp", counts_text(last_dp).c_str(),
                counts_text(want_dp).c_str());
    if (sizes.ep > 1)
      std::printf("  edp: %s\n      formula: %s\n", counts_text(last_edp).c_str(),
                  counts_text(want_edp).c_str());
    if (sizes.pp > 1)
      std::printf("  pp: %s\n      formula: %s\n", counts_text(last_pp).c_str(), counts_text(want_pp).c_str());
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
                human_bytes((double)want.params).c_str());
    std::printf("  gradients  %10s   formula 4N            %10s\n", human_bytes((double)mem.grads).c_str(),
                human_bytes((double)want.grads).c_str());
    std::printf("  AdamW m, v %10s   formula %-13s %10s\n", human_bytes((double)mem.optimizer).c_str(),
                o.zero ? "8 ceil(N/dp)" : "8N", human_bytes((double)want.optimizer).c_str());
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
                  mem.buffers, want.params + want.grads + want.optimizer, sizes.cp, sizes.pp, sizes.ep);
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
    const CollectiveCounts last_ep_want = formula_ep(maps, mesh.coords().ep, topo.R, mm.scheme, c.dim, 1);
    const CollectiveCounts* mine[12] = {&last_tp, &last_dp, &last_cp, &last_ep, &last_edp, &last_pp,
                                        &want_tp, &want_dp, &want_cp, &last_ep_want, &want_edp, &want_pp};
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
        val_ref += model::forward(c, ref, gb.inputs.to(L.device), gb.targets.to(L.device),
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
        for (const model::NamedTensor& n : ref.named_parameters()) L.dump(n.name, n.t);
        for (const model::NamedTensor& n : ref.named_buffers()) L.dump(n.name, n.t);
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
                sample_text(c, ref, corpus, o.prompt, o.sample, o.temperature, (uint64_t)L.flags.seed).c_str());

  // ---- the verdict
  CheckReport check(L.comm);
  const bool root = L.rank() == 0;
  char line[512];
  std::snprintf(line, sizeof line,
                "loss of the mesh = one process's at %lld checked steps, |diff| <= 4 n eps |loss| "
                "(n = B T = %.0f): worst %.3f of the bound",
                (long long)checked_steps, n_terms, worst_loss.ratio);
  check.holds(line, !root || worst_loss.ratio <= 1.0);
  std::snprintf(line, sizeof line,
                "mean gradient of every weight = one process's, max|diff| <= 4 n eps max|want|: "
                "worst %.3f of the bound (%s, step %lld)",
                worst_grad.ratio, worst_grad.what.c_str(), (long long)worst_grad.step);
  check.holds(line, !root || worst_grad.ratio <= 1.0);
  std::snprintf(line, sizeof line, "AdamW step = one process's on the same gradients, bit for bit, "
                "every step%s%s", adam_equal ? "" : ": first differs at ", adam_equal ? "" : adam_detail.c_str());
  check.holds(line, !root || adam_equal);
  check.holds("balancing bias = one process's update from its own routes, bit for bit",
              !root || bias_equal);
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
  check.holds(line, mem.params == want.params && mem.grads == grads_held &&
                        grads_held <= want.grads && mem.optimizer == want.optimizer);
  if (bug_kpe) {
    std::snprintf(line, sizeof line, "k_pe: the forward is unchanged, the loss of step 0 = one "
                  "process's (%.3f of the bound)", first_loss_ratio);
    check.holds(line, !root || first_loss_ratio <= 1.0);
    check.holds("k_pe: every head's copy of W_kr stays equal (one key shared by the heads)",
                !root || kpe_copies_equal);
  }
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
