// lessons/08_mesh/forward.cpp — the forward of this rank's tokens on the mesh, in the order a token
// meets it: where its tokens sit, the embedding (the first stage), the blocks (MLA with its heads
// split over TP, over CP's ring when cp > 1; the dense FFN column- then row-parallel, the MoE
// over EP), the vocabulary-parallel loss (the last stage), and the pipeline stages lesson 07's
// executor calls.
#include "lessons/08_mesh/mesh_model.h"

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff::mesh {

// [slide:cp-attention]
// MLA's heads over the CP ring: this rank's queries against every CP rank's keys and values
// (lesson 02's ring, lessons/02_ring_attention/ring.h). Per head q = [q_nope | q_pe] and
// k = [k_nope | k_pe] (k_pe, one per token, repeated for every head), so the two inner
// products are one of width d_nope + d_rope, the scale 1/sqrt(d_nope + d_rope) as MLA's; v is
// padded with zeros to that width. The blocks are (B, H, n, D): the ring's mask compares the
// global positions of every CP rank's tokens.
Tensor MeshModel::attention_cp(const model::Attention& a, const model::Latents& l, int64_t H, int64_t B,
                               const Tensor& rope_pos) {
  const int64_t n = l.c_q.size(0) / B, dn = c.d_nope, dr = c.d_rope, D = dn + dr;
  // [slide:cp-ring]
  // [slide:cp-ring-qkv]
  Tensor q = reshape(matmul(l.c_q, a.w_uq), {B * n, H, D});
  q = concat({slice(q, 2, 0, dn), rope(slice(q, 2, dn, D), rope_pos, c.rope_theta)}, 2);
  Tensor k_pe = l.k_pe.size(1) == dr ? concat(std::vector<Tensor>((size_t)H, reshape(l.k_pe, {B * n, 1, dr})), 1)
                                     : reshape(l.k_pe, {B * n, H, dr});  // --bug kpe-per-head
  Tensor k = concat({reshape(matmul(l.c_kv, a.w_uk), {B * n, H, dn}), k_pe}, 2);
  Tensor v = reshape(matmul(l.c_kv, a.w_uv), {B * n, H, c.d_v});
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
  return matmul(out, a.w_o);
}
// [/slide]

// Where this rank's tokens sit (mesh_model.h: Tokens).
MeshModel::Tokens MeshModel::tokens(int64_t B, int64_t T) const {
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
Tensor MeshModel::embed(const Tensor& inputs, const Tokens& k) const {
  const std::vector<int64_t> ids = inputs.to_index_vector();
  enter_unit(0);
  return leave_unit(0, embedding(p.embed, Tensor::from_indices(
                                              std::vector<int64_t>(ids.begin() + k.r0, ids.begin() + k.r0 + k.rows),
                                              {k.rows}, device)));
}

// [slide:mesh-forward]
// Blocks [l0, l1) on this rank's token rows x (rows, d). routes gets each MoE layer's chosen
// experts for these rows (its MoE index: the layer's place among the MoE layers).
Tensor MeshModel::blocks(Tensor x, int64_t l0, int64_t l1, const Tokens& k, std::vector<Route>* routes) {
  const int64_t H = c.heads / tp->size();  // this rank's heads
  dsv3::Config mc = c.moe_config();
  mc.seq_len = k.T;
  for (int64_t l = l0; l < l1; l++) {
    enter_unit(1 + (int)l);
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
  Tensor logits = matmul(enter(rmsnorm(x, p.norm, c.norm_eps)), p.head);   // (B T, V_r)
  return leave_unit(unit, vocab_parallel_cross_entropy(logits, targets.to_index_vector(), v0, *tp,
                                                       ce_local_softmax));
}

// [slide:pp-stages]
// micro-batch gm through stage `stage`: lesson 07's executor calls it for each F
Tensor MeshStages::forward(int stage, int gm, const Tensor& x) {
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

// The loss of this rank's (B, T) sequences through the pipeline, forward only, as one batch
// (validation): each stage receives the previous stage's output, computes, sends it on.
// Returns the loss on the ranks of the last stage, 0 elsewhere.
double MeshStages::forward_only(Comm& pipe, const pp::Schedule& s, const Tensor& in, const Tensor& tg) {
  constexpr int kActivationTag = 3;  // a stage's output to the next stage (validation)
  NoGradGuard no_grad;
  const MeshModel::Tokens k = mm->tokens(in.size(0), in.size(1));
  const int me = pipe.rank();
  std::vector<Route> unused;
  Tensor x;
  double loss = 0;
  for (int st = 0; st < stages(); st++) {
    if (s.rank_of(0, st) != me) continue;
    if (st > 0 && s.rank_of(0, st - 1) != me) {
      std::vector<float> buf((size_t)(k.rows * mm->c.dim));
      pipe.recv(buf.data(), buf.size() * sizeof(float), s.rank_of(0, st - 1), kActivationTag);
      x = Tensor::from_vector(buf, {k.rows, mm->c.dim}, mm->device);
    }
    x = mm->blocks(st == 0 ? mm->embed(in, k) : x, begin[(size_t)st], begin[(size_t)st + 1], k, &unused);
    if (st + 1 == stages()) {
      loss = mm->head_loss(x, tg).to_vector()[0];
    } else if (s.rank_of(0, st + 1) != me) {
      const std::vector<float> buf = x.to_vector();
      pipe.send(buf.data(), buf.size() * sizeof(float), s.rank_of(0, st + 1), kActivationTag);
    }
  }
  return loss;
}
}  // namespace ff::mesh
