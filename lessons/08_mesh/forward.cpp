// lessons/08_mesh/forward.cpp — the forward of this rank's tokens on the mesh, in the order a token
// meets it: where its tokens sit, the embedding (the first stage), the blocks (MLA with its heads
// split over TP, over CP's ring when cp > 1; the dense FFN column- then row-parallel, the MoE
// over EP), the vocabulary-parallel loss (the last stage), the pipeline stages lesson 07's
// executor calls; and after the step, the MoE's routes counted into the balancing bias.
#include "lessons/08_mesh/mesh_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff::mesh {

// [slide:cp-attention]
// MLA's heads over the CP ring: this rank's queries against every CP rank's keys and values
// (lesson 02's ring, lessons/02_ring_attention/ring.h). Per head q = [q_nope | q_pe] and
// k = [k_nope | k_pe] (k_pe, one per token, repeated for every head), so the two inner
// products are one of width d_nope + d_rope, the scale 1/sqrt(d_nope + d_rope) as MLA's; v is
// padded with zeros to that width. The blocks are (B, H, n, D): the ring's mask compares the
// global positions of every CP rank's tokens. The projections are the model's linear layers
// (model::linear: in FP8 under --precision fp8, as one process's).
Tensor MeshModel::attention_cp(const model::Attention& a, const model::Latents& l, int64_t H, int64_t B,
                               const Tensor& rope_pos) {
  const int64_t n = l.c_q.size(0) / B, dn = c.d_nope, dr = c.d_rope, D = dn + dr;
  // [slide:cp-ring]
  // [slide:cp-ring-qkv]
  Tensor q = reshape(model::linear(l.c_q, a.w_uq), {B * n, H, D});
  q = concat({slice(q, 2, 0, dn), rope(slice(q, 2, dn, D), rope_pos, c.rope_theta)}, 2);
  Tensor k_pe = l.k_pe.size(1) == dr ? concat(std::vector<Tensor>((size_t)H, reshape(l.k_pe, {B * n, 1, dr})), 1)
                                     : reshape(l.k_pe, {B * n, H, dr});  // --bug kpe-per-head
  Tensor k = concat({reshape(model::linear(l.c_kv, a.w_uk), {B * n, H, dn}), k_pe}, 2);
  Tensor v = reshape(model::linear(l.c_kv, a.w_uv), {B * n, H, c.d_v});
  if (c.d_v < D) v = concat({v, Tensor::zeros({B * n, H, D - c.d_v}, v.device())}, 2);
  auto blocks = [&](const Tensor& t) { return transpose(reshape(t, {B, n, H, D}), 1, 2); };
  // [/slide:cp-ring-qkv]
  ring::Config rc;
  rc.B = B, rc.H = H, rc.D = D, rc.causal = true, rc.order = ring::Order::async;
  rc.dev = q.device();
  rc.positions = cp_positions;
  // [slide:cp-ring-mask]
  if (local_mask)  // the silent bug: every rank's mask as if its block started the sequence
    for (std::vector<int64_t>& pos : rc.positions)
      for (size_t i = 0; i < pos.size(); i++) pos[i] = (int64_t)i;
      // [/slide:cp-ring-mask]
  Tensor out = ring::attention(*cp, rc, blocks(q), blocks(k), blocks(v));     // (B, H, n, D)
  // [/slide:cp-ring]
  out = reshape(transpose(slice(out, 3, 0, c.d_v), 1, 2), {B * n, H * c.d_v});
  return model::linear(out, a.w_o);
}
// [/slide]

Tensor MeshModel::enter(const Tensor& x, bool to_bf16_matmul) {
  if (sp) return tp::gather_seq(x, *tp, bf16_wire && to_bf16_matmul);
  if (!f_no_allreduce) return tp::f(x, *tp);
  // the planted bug: the identity both ways, so each rank's gradient upstream holds only the
  // share of its own heads and columns
  return record(x.detach(), "tp_f_without_allreduce", {x},
                [](const Tensor& dy) -> std::vector<Tensor> { return {dy}; });
}

// Where this rank's tokens sit (mesh_model.h: Tokens).
MeshModel::Tokens MeshModel::tokens(int64_t B, int64_t T) const {
  Tokens tok;
  tok.B = B, tok.T = T, tok.rows = B * T;
  const Device dev = device;
  std::vector<int64_t> seq_pos = cp_positions[(size_t)cp->rank()];  // global, for RoPE
  if (local_rope)
    for (size_t i = 0; i < seq_pos.size(); i++) seq_pos[i] = (int64_t)i;
  tok.pos_all = model::tile_positions(Tensor::from_indices(seq_pos, {T}, dev), B);  // (B T)
  tok.pos = tok.pos_all;
  if (sp) {  // this rank's slice of the B T token rows
    tok.rows = B * T / tp->size(), tok.r0 = tp->rank() * tok.rows;
    tok.pos = index_rows(tok.pos_all, tok.r0, tok.r0 + tok.rows);
  }
  return tok;
}

// The first stage: this rank's token rows, embedded (rows, d).
Tensor MeshModel::embed(const Tensor& inputs, const Tokens& tok) const {
  const std::vector<int64_t> ids = inputs.to_index_vector();
  enter_unit(0);
  return leave_unit(0, embedding(weights.embed, Tensor::from_indices(
                                              std::vector<int64_t>(ids.begin() + tok.r0, ids.begin() + tok.r0 + tok.rows),
                                              {tok.rows}, device)));
}

// [slide:mesh-forward]
// Blocks [l0, l1) on this rank's token rows x (rows, d). routes gets each MoE layer's chosen
// experts for these rows (its MoE index: the layer's place among the MoE layers).
Tensor MeshModel::blocks(Tensor x, int64_t l0, int64_t l1, const Tokens& tok, std::vector<Route>* routes) {
  const int64_t H = c.heads / tp->size();  // this rank's heads
  dsv3::Config mc = c.moe_config();
  mc.seq_len = tok.T;
  for (int64_t l = l0; l < l1; l++) {
    enter_unit(1 + (int)l);
    const model::Block& b = weights.layers[(size_t)l];
    // [slide:mla-f]
    // attention: the latents from the replicated down-projections (each rank's own tokens
    // under SP), into the TP region as one tensor, this rank's heads, out through W_o's rows
    Tensor u = rmsnorm(x, b.attn_norm, c.norm_eps);
    model::Latents lat = model::attention_latents(c, b.attn, u, tok.pos);
    const int64_t rq = c.q_lora, rkv = c.kv_lora, rk = lat.k_pe.size(1);
    Tensor joined = enter(concat({lat.c_q, lat.c_kv, lat.k_pe}, 1));
    lat = {slice(joined, 1, 0, rq), slice(joined, 1, rq, rq + rkv),
           slice(joined, 1, rq + rkv, rq + rkv + rk)};
    x = add(x, leave(cp->size() == 1 ? model::attention_heads(c, H, b.attn, lat, tok.B, tok.pos_all)
                                      : attention_cp(b.attn, lat, H, tok.B, tok.pos_all)));
    // [/slide:mla-f]
    // FFN: dense SwiGLU column- then row-parallel; the MoE on this rank's tokens, its
    // experts replicated or (EP) spread over the ep group, the tokens sent to them
    u = rmsnorm(x, b.ffn_norm, c.norm_eps);
    if (!b.moe) {
      x = add(x, leave(model::dense_ffn(b.ffn, enter(u, /*to_bf16_matmul=*/true))));
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
    x = leave_unit(1 + (int)l, x);
  }
  return x;
}
// [/slide]

// The last stage: the LM head split over the vocabulary, every token's logits of this
// rank's columns, and the mean loss over the B T tokens (the same on every TP rank).
Tensor MeshModel::head_loss(const Tensor& x, const Tensor& targets) {
  const int unit = (int)c.layers + 1;
  enter_unit(unit);
  Tensor logits = matmul(enter(rmsnorm(x, weights.norm, c.norm_eps), /*to_bf16_matmul=*/true), weights.head);   // (B T, V_r)
  return leave_unit(unit, vocab_parallel_cross_entropy(logits, targets.to_index_vector(), v0, *tp,
                                                       ce_local_softmax));
}

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
  // [slide:ce-merge-short]
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
  // [/slide:ce-merge-short]
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

Tensor MeshStages::inputs_of(int gm) const { return index_rows(inputs, gm * Bm, (gm + 1) * Bm); }
Tensor MeshStages::targets_of(int gm) const { return index_rows(targets, gm * Bm, (gm + 1) * Bm); }
Tensor MeshStages::share_of_step(const Tensor& loss) const {
  return M == 1 || mb_sum ? loss : scale(loss, 1.f / (float)M);
}

// [slide:pp-stages]
// micro-batch gm through stage `stage`: lesson 07's executor calls it for each F (pp > 1)
Tensor MeshStages::forward(int stage, int gm, const Tensor& x) {
  const MeshModel::Tokens tok = model->tokens(Bm, T);
  Tensor y = stage == 0 ? model->embed(inputs_of(gm), tok) : x;
  y = model->blocks(y, begin[(size_t)stage], begin[(size_t)stage + 1], tok, &routes);
  if (stage + 1 < stages()) return y;
  return share_of_step(model->head_loss(y, targets_of(gm)));
}
// [/slide]

// The loss of this rank's (B, T) sequences through the pipeline, forward only, as one batch
// (validation): each stage receives the previous stage's output, computes, sends it on.
// Returns the loss on the ranks of the last stage, 0 elsewhere.
double MeshStages::forward_only(Comm& pipe, const pp::Schedule& s, const Tensor& in, const Tensor& tg) {
  constexpr int kActivationTag = 3;  // a stage's output to the next stage (validation)
  NoGradGuard no_grad;
  const MeshModel::Tokens tok = model->tokens(in.size(0), in.size(1));
  const int me = pipe.rank();
  std::vector<Route> unused;
  Tensor x;
  double loss = 0;
  for (int st = 0; st < stages(); st++) {
    if (s.rank_of(0, st) != me) continue;
    if (st > 0 && s.rank_of(0, st - 1) != me) {
      std::vector<float> buf((size_t)(tok.rows * model->c.dim));
      pipe.recv(buf.data(), buf.size() * sizeof(float), s.rank_of(0, st - 1), kActivationTag);
      x = Tensor::from_vector(buf, {tok.rows, model->c.dim}, model->device);
    }
    x = model->blocks(st == 0 ? model->embed(in, tok) : x, begin[(size_t)st], begin[(size_t)st + 1], tok, &unused);
    if (st + 1 == stages()) {
      loss = model->head_loss(x, tg).to_vector()[0];
    } else if (s.rank_of(0, st + 1) != me) {
      const std::vector<float> buf = x.to_vector();
      pipe.send(buf.data(), buf.size() * sizeof(float), s.rank_of(0, st + 1), kActivationTag);
    }
  }
  return loss;
}
// ---- after the step's forward: the MoE's routes counted, and the balancing bias they move

std::vector<float> expert_loads(const std::vector<Route>& routes, const model::Config& c) {
  const int64_t N = c.experts;
  std::vector<float> load((size_t)((c.layers - c.dense_layers) * N), 0.f);
  for (const Route& r : routes)
    for (int64_t e : r.idx.to_index_vector()) load[(size_t)(r.moe_layer * N + e)] += 1.f;
  return load;  // exact: counts far below 2^24
}

// The balancing bias of every MoE layer this rank holds, from every layer's loads (load: N per
// MoE layer, summed over every rank that routed), by lesson 05's rule.
void update_biases(model::Params& weights, const std::vector<float>& load, int64_t N, double gamma) {
  dsv3::BiasUpdater rule;  // lesson 05's rule, once per MoE layer
  rule.gamma = gamma;
  size_t l = 0;
  for (model::Block& b : weights.layers) {
    if (!b.moe) continue;
    if (b.experts.bias.defined()) {  // (undefined: a layer of another pipeline stage)
      const auto first = load.begin() + (long)(l * (size_t)N);
      b.experts.bias.copy_from(rule.updated(b.experts.bias, std::vector<double>(first, first + N), 0));
    }
    l++;
  }
}

}  // namespace ff::mesh
