// common/layers/model.cpp — the tiny DeepSeek-style language model of model.h: parameters
// (allocation, named list, random init, loading), MLA, the dense and MoE FFNs, the whole
// forward and the loss with its gradients.
#include "common/layers/model.h"

#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/npy.h"
#include "common/util/trace.h"

namespace ff::model {

dsv3::Config Config::moe_config() const {
  dsv3::Config m;
  m.experts = experts, m.topk = topk, m.dim = dim, m.ffn = moe_ffn, m.shared = shared;
  m.groups = 1, m.topk_groups = 1;
  m.gate = dsv3::GateFn::sigmoid;
  m.route_scale = route_scale;
  m.alpha = 0.0;            // no balance loss: the bias alone balances (set outside the model)
  m.capacity_factor = 0.0;  // no capacity: every chosen slot is computed
  m.seq_len = seq_len;
  return m;
}

void Config::validate() const {
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab", vocab}, {"dim", dim},         {"layers", layers},   {"heads", heads},
      {"d_nope", d_nope}, {"d_rope", d_rope}, {"d_v", d_v},         {"q_lora", q_lora},
      {"kv_lora", kv_lora}, {"ffn", ffn},     {"seq_len", seq_len}};
  for (const auto& [what, v] : sizes) FF_CHECK(v > 0, "model: " << what << " = " << v << " must be > 0");
  FF_CHECK(dense_layers >= 0 && dense_layers <= layers,
           "model: dense_layers = " << dense_layers << " must be in [0, layers = " << layers << "]");
  FF_CHECK(d_rope % 2 == 0, "model: d_rope = " << d_rope << " must be even (RoPE rotates pairs)");
  if (dense_layers < layers) {
    FF_CHECK(experts > 0 && moe_ffn > 0, "model: experts = " << experts << " and moe_ffn = "
                                             << moe_ffn << " must be > 0");
    FF_CHECK(topk >= 1 && topk <= experts,
             "model: topk = " << topk << " must be in [1, experts = " << experts << "]");
    FF_CHECK(shared >= 0, "model: shared = " << shared << " must be >= 0");
  }
  FF_CHECK(std::isfinite(rope_theta) && rope_theta > 0.f, "model: rope_theta must be > 0");
  FF_CHECK(std::isfinite(norm_eps) && norm_eps > 0.f, "model: norm_eps must be > 0");
}

// ----------------------------------------------------------------------------
// parameters

std::vector<NamedTensor> Params::named_parameters() const {
  std::vector<NamedTensor> v = {{"embed", embed}};
  for (size_t i = 0; i < layers.size(); i++) {
    const Block& b = layers[i];
    const std::string l = "layers." + std::to_string(i) + ".";
    const Attention& a = b.attn;
    v.insert(v.end(), {{l + "attn_norm", b.attn_norm},
                       {l + "attn.w_dq", a.w_dq}, {l + "attn.q_norm", a.q_norm},
                       {l + "attn.w_uq", a.w_uq}, {l + "attn.w_dkv", a.w_dkv},
                       {l + "attn.kv_norm", a.kv_norm}, {l + "attn.w_uk", a.w_uk},
                       {l + "attn.w_uv", a.w_uv}, {l + "attn.w_kr", a.w_kr},
                       {l + "attn.w_o", a.w_o}, {l + "ffn_norm", b.ffn_norm}});
    if (!b.moe) {
      v.insert(v.end(), {{l + "ffn.w1", b.ffn.w1}, {l + "ffn.w3", b.ffn.w3},
                         {l + "ffn.w2", b.ffn.w2}});
    } else {
      const dsv3::Params& e = b.experts;
      v.insert(v.end(), {{l + "moe.router_w", e.router_w}, {l + "moe.experts_w1", e.w1},
                         {l + "moe.experts_w3", e.w3}, {l + "moe.experts_w2", e.w2}});
      if (e.sw1.defined())
        v.insert(v.end(), {{l + "moe.shared_w1", e.sw1}, {l + "moe.shared_w3", e.sw3},
                           {l + "moe.shared_w2", e.sw2}});
    }
  }
  v.insert(v.end(), {{"norm", norm}, {"head", head}});
  return v;
}

std::vector<Tensor*> Params::matmul_weights() {
  std::vector<Tensor*> w;
  for (Block& b : layers) {
    Attention& a = b.attn;
    w.insert(w.end(), {&a.w_dq, &a.w_uq, &a.w_dkv, &a.w_uk, &a.w_uv, &a.w_kr, &a.w_o});
    if (!b.moe)
      w.insert(w.end(), {&b.ffn.w1, &b.ffn.w3, &b.ffn.w2});
    else
      w.insert(w.end(), {&b.experts.w1, &b.experts.w3, &b.experts.w2});
    if (b.moe && b.experts.sw1.defined()) w.insert(w.end(), {&b.experts.sw1, &b.experts.sw3, &b.experts.sw2});
  }
  w.push_back(&head);
  return w;
}

void Params::hold_matmuls_in_bf16() {
  for (Tensor* w : matmul_weights()) *w = w->detach().to_dtype(DType::bf16).requires_grad_();
}

std::vector<NamedTensor> Params::named_buffers() const {
  std::vector<NamedTensor> v;
  for (size_t i = 0; i < layers.size(); i++)
    if (layers[i].moe) v.push_back({"layers." + std::to_string(i) + ".moe.bias", layers[i].experts.bias});
  return v;
}

Params zero_params(const Config& c, Device dev) {
  c.validate();
  auto leaf = [dev](const Shape& s) {
    Tensor t = Tensor::zeros(s, dev);
    t.requires_grad_();
    return t;
  };
  const int64_t d = c.dim, H = c.heads;
  Params p;
  p.embed = leaf({c.vocab, d});
  for (int64_t i = 0; i < c.layers; i++) {
    Block b;
    b.attn_norm = leaf({d});
    Attention& a = b.attn;
    a.w_dq = leaf({d, c.q_lora});
    a.q_norm = leaf({c.q_lora});
    a.w_uq = leaf({c.q_lora, H * c.qk_head_dim()});
    a.w_dkv = leaf({d, c.kv_lora});
    a.kv_norm = leaf({c.kv_lora});
    a.w_uk = leaf({c.kv_lora, H * c.d_nope});
    a.w_uv = leaf({c.kv_lora, H * c.d_v});
    a.w_kr = leaf({d, c.d_rope});
    a.w_o = leaf({H * c.d_v, d});
    b.ffn_norm = leaf({d});
    b.moe = c.is_moe(i);
    if (!b.moe) {
      b.ffn.w1 = leaf({d, c.ffn});
      b.ffn.w3 = leaf({d, c.ffn});
      b.ffn.w2 = leaf({c.ffn, d});
    } else {
      const int64_t N = c.experts, f = c.moe_ffn, Sf = c.shared * c.moe_ffn;
      dsv3::Params& e = b.experts;
      e.router_w = leaf({d, N});
      e.bias = Tensor::zeros({N}, dev);
      e.w1 = leaf({N, d, f});
      e.w3 = leaf({N, d, f});
      e.w2 = leaf({N, f, d});
      if (Sf > 0) {
        e.sw1 = leaf({d, Sf});
        e.sw3 = leaf({d, Sf});
        e.sw2 = leaf({Sf, d});
      }
    }
    p.layers.push_back(b);
  }
  p.norm = leaf({d});
  p.head = leaf({d, c.vocab});
  return p;
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

Params init_params(const Config& c, uint64_t seed, Device dev) {
  Params p = zero_params(c, dev);
  uint64_t k = 0;
  for (const NamedTensor& n : p.named_parameters()) {
    const Shape& s = n.t.shape();
    Tensor value;
    if (ends_with(n.name, "norm")) {
      value = Tensor::full(s, 1.f);
    } else if (n.name == "embed") {
      value = randn(s, seed + k);  // a lookup: one input per row, fan-in 1
    } else {                       // a matrix (or a stack of them): fan-in is its rows
      value = scale(randn(s, seed + k), 1.f / std::sqrt((float)s[s.size() - 2]));
    }
    n.t.copy_from(value.to(dev));
    k++;
  }
  return p;  // the balancing biases stay 0
}

Params load_params(const Config& c, const std::string& dir, const std::string& prefix, Device dev) {
  Params p = zero_params(c, dev);
  std::vector<NamedTensor> all = p.named_parameters(), buffers = p.named_buffers();
  all.insert(all.end(), buffers.begin(), buffers.end());
  for (const NamedTensor& n : all) {
    const std::string path = dir + "/" + prefix + n.name + ".npy";
    Tensor t = load_npy(path);
    FF_CHECK(t.dtype() == DType::f32 && t.shape() == n.t.shape(),
             path << ": " << dtype_name(t.dtype()) << " " << shape_str(t.shape()) << ", the model's "
                  << n.name << " is f32 " << shape_str(n.t.shape()));
    n.t.copy_from(t.to(dev));
  }
  return p;
}

// ----------------------------------------------------------------------------
// the pieces

namespace {

// (B T, H, e) -> (B H, T, e): each (sequence, head) pair becomes one batch of the matmuls.
Tensor heads_first(const Tensor& t, int64_t B, int64_t T, int64_t H) {
  const int64_t e = t.size(-1);
  return reshape(transpose(reshape(t, {B, T, H, e}), 1, 2), {B * H, T, e});
}

}  // namespace

Tensor causal_mask(int64_t T, Device dev) {
  std::vector<float> m((size_t)(T * T), 0.f);
  for (int64_t i = 0; i < T; i++)
    for (int64_t j = i + 1; j < T; j++) m[(size_t)(i * T + j)] = 1.f;
  return Tensor::from_vector(m, {T, T}, dev);
}

Tensor tile_positions(const Tensor& positions, int64_t B) {
  const std::vector<int64_t> p = positions.to_index_vector();
  std::vector<int64_t> out;
  out.reserve(p.size() * (size_t)B);
  for (int64_t b = 0; b < B; b++) out.insert(out.end(), p.begin(), p.end());
  return Tensor::from_indices(out, {(int64_t)out.size()}, positions.device());
}

Latents attention_latents(const Config& c, const Attention& a, const Tensor& u,
                          const Tensor& row_positions) {
  FF_CHECK(u.dim() == 2 && u.size(1) == c.dim && row_positions.shape() == Shape{u.size(0)},
           "attention_latents: u is " << shape_str(u.shape()) << " and positions "
                                      << shape_str(row_positions.shape()) << ", expected (n, "
                                      << c.dim << ") and (n)");
  Latents l;
  l.c_q = rmsnorm(linear(u, a.w_dq), a.q_norm, c.norm_eps);                  // (n, r_q)
  l.c_kv = rmsnorm(linear(u, a.w_dkv), a.kv_norm, c.norm_eps);               // (n, r_kv)
  // the decoupled RoPE key: computed once per token from u, shared by every head
  Tensor k = linear(u, a.w_kr);                                              // (n, d_r)
  if (k.size(1) == c.d_rope) {
    l.k_pe = rope(k, row_positions, c.rope_theta);
  } else {  // a w_kr of (d, H d_r): one key per head, each rotated on its own
    const int64_t n = k.size(0), H = k.size(1) / c.d_rope;
    l.k_pe = reshape(rope(reshape(k, {n, H, c.d_rope}), row_positions, c.rope_theta), {n, H * c.d_rope});
  }
  return l;
}

Tensor attention_heads(const Config& c, int64_t H, const Attention& a, const Latents& l,
                       int64_t B, const Tensor& row_positions) {
  const int64_t BT = l.c_q.size(0), T = BT / B, dn = c.d_nope, dr = c.d_rope;
  FF_CHECK(B >= 1 && BT == B * T && row_positions.shape() == Shape{BT},
           "attention_heads: " << BT << " rows are not " << B << " sequences");
  // queries: per head a no-RoPE and a RoPE part
  Tensor q = reshape(linear(l.c_q, a.w_uq), {BT, H, dn + dr});
  Tensor q_nope = slice(q, 2, 0, dn);                                       // (B T, H, d_n)
  Tensor q_pe = rope(slice(q, 2, dn, dn + dr), row_positions, c.rope_theta); // (B T, H, d_r)
  // keys and values: the shared latent c_kv, expanded per head
  Tensor k_nope = reshape(linear(l.c_kv, a.w_uk), {BT, H, dn});
  Tensor v = reshape(linear(l.c_kv, a.w_uv), {BT, H, c.d_v});

  // scores as two inner products, summed: the no-RoPE part per head ...
  Tensor s_nope = matmul(heads_first(q_nope, B, T, H),
                         transpose(heads_first(k_nope, B, T, H), 1, 2));    // (B H, T, T)
  // ... and the RoPE part: every head's queries of a sequence against its one k_pe
  Tensor s_pe;
  if (l.k_pe.size(1) == dr) {
    Tensor q_pe_rows = reshape(heads_first(q_pe, B, T, H), {B, H * T, dr});
    Tensor k_pe_t = transpose(reshape(l.k_pe, {B, T, dr}), 1, 2);           // (B, d_r, T)
    s_pe = reshape(matmul(q_pe_rows, k_pe_t), {B * H, T, T});
  } else {  // one k_pe per head, (B T, H d_r): a head's queries against its own keys
    FF_CHECK(l.k_pe.size(1) == H * dr, "attention_heads: k_pe " << shape_str(l.k_pe.shape())
                                           << " is neither (n, " << dr << ") nor (n, " << H * dr << ")");
    Tensor k_pe_h = reshape(l.k_pe, {BT, H, dr});
    s_pe = matmul(heads_first(q_pe, B, T, H), transpose(heads_first(k_pe_h, B, T, H), 1, 2));
  }
  Tensor scores = scale(add(s_nope, s_pe), 1.f / std::sqrt((float)(dn + dr)));
  scores = masked_fill(scores, causal_mask(T, l.c_q.device()), -std::numeric_limits<float>::infinity());
  Tensor probs = softmax(scores);                                           // (B H, T, T)

  Tensor o = matmul(probs, heads_first(v, B, T, H));                        // (B H, T, d_v)
  o = reshape(transpose(reshape(o, {B, H, T, c.d_v}), 1, 2), {BT, H * c.d_v});
  return linear(o, a.w_o);
}

Tensor attention(const Config& c, const Attention& a, const Tensor& u, int64_t B,
                 const Tensor& positions) {
  const int64_t T = positions.numel();
  FF_CHECK(u.dim() == 2 && u.size(0) == B * T && u.size(1) == c.dim,
           "attention: u is " << shape_str(u.shape()) << ", expected (" << B * T << ", " << c.dim << ")");
  const Tensor pos = tile_positions(positions, B);
  return attention_heads(c, c.heads, a, attention_latents(c, a, u, pos), B, pos);
}

namespace {
LinearFn g_linear;  // empty: matmul
}  // namespace

LinearScope::LinearScope(LinearFn f) : previous_(std::exchange(g_linear, std::move(f))) {}
LinearScope::~LinearScope() { g_linear = std::move(previous_); }

Tensor linear(const Tensor& x, const Tensor& w) { return g_linear ? g_linear(x, w) : matmul(x, w); }

Tensor dense_ffn(const DenseFFN& f, const Tensor& u) {
  return linear(mul(silu(linear(u, f.w1)), linear(u, f.w3)), f.w2);
}

Tensor moe_ffn(const dsv3::Config& c, const dsv3::Params& p, const Tensor& u, Tensor* route) {
  // lesson 05's layer computes forward and backward itself: it sees detached tensors, with
  // the tape off, and the whole layer is recorded below as one op
  const bool shared = c.shared > 0;
  const dsv3::RecordedOp op = dsv3::recorded_op(p, u, shared);
  const dsv3::Params& w = op.plain;
  const Tensor x = u.detach();
  // what the backward needs (routing, plan, expert activations) lives in the closure
  auto fwd = std::make_shared<dsv3::Forward>();
  {
    NoGradGuard no_grad;
    *fwd = dsv3::forward(c, w, x);
  }
  if (route) *route = fwd->idx;
  Tensor y = fwd->y;
  fwd->y = Tensor();  // the backward does not read y; the closure must not hold the output

  // The backward splits as a zero-bubble pipeline wants (autograd.h's record_split): dx now
  // (I), every weight's gradient later (W). The weight half is weight GEMMs alone (x^T dz for
  // the router, the grouped GEMMs of the routed and shared experts): only the optimizer needs
  // them, while the previous stage waits for dx.
  return record_split(y, "dsv3_moe", op.inputs, op.weights, [c, w, x, fwd, shared](const Tensor& dy) {
    auto in = std::make_shared<dsv3::InputGrads>(dsv3::backward_input(c, w, x, *fwd, dy));
    std::vector<Tensor> grads = dsv3::op_input_grads(in->dx, shared);
    in->dx = in->routed.dxp = in->shared.dxp = Tensor();  // W keeps only what it reads
    return SplitGrads{grads, [c, w, x, fwd, shared, in] {
                        Trace::Scope span(trace(), "moe weight gradients", "compute");
                        return dsv3::op_weight_grads(
                            dsv3::backward_weights(c, w, x, fwd->cache, fwd->shared_cache, *in), shared);
                      }};
  });
}

// ----------------------------------------------------------------------------
// the whole model

Output forward(const Config& c, const Params& p, const Tensor& inputs, const Tensor& targets,
               const Tensor& positions) {
  FF_CHECK(inputs.dim() == 2 && inputs.dtype() == DType::i64,
           "model: inputs must be int64 (B, T), got " << shape_str(inputs.shape()));
  FF_CHECK(targets.shape() == inputs.shape() && targets.dtype() == DType::i64,
           "model: targets " << shape_str(targets.shape()) << " must match inputs "
                             << shape_str(inputs.shape()));
  const int64_t B = inputs.size(0), T = inputs.size(1);
  FF_CHECK(positions.shape() == Shape{T}, "model: positions " << shape_str(positions.shape())
                                                               << " must be (" << T << ")");
  FF_CHECK((int64_t)p.layers.size() == c.layers, "model: parameters of " << p.layers.size()
                                                     << " layers, config of " << c.layers);
  dsv3::Config mc = c.moe_config();
  mc.seq_len = T;
  Output out;
  Tensor x = embedding(p.embed, reshape(inputs, {B * T}));                  // (B T, d)
  for (const Block& b : p.layers) {
    x = add(x, attention(c, b.attn, rmsnorm(x, b.attn_norm, c.norm_eps), B, positions));
    Tensor u = rmsnorm(x, b.ffn_norm, c.norm_eps);
    if (!b.moe) {
      x = add(x, dense_ffn(b.ffn, u));
    } else {
      Tensor route;
      x = add(x, moe_ffn(mc, b.experts, u, &route));
      out.routes.push_back(route);
    }
  }
  out.logits = matmul(rmsnorm(x, p.norm, c.norm_eps), p.head);              // (B T, V)
  out.loss = cross_entropy(out.logits, reshape(targets, {B * T}));
  return out;
}

Batch split_tokens(const Tensor& tokens) {
  FF_CHECK(tokens.dim() == 2 && tokens.dtype() == DType::i64 && tokens.size(1) >= 2,
           "model: a token batch must be int64 (B, T + 1) with T >= 1, got "
               << dtype_name(tokens.dtype()) << " " << shape_str(tokens.shape()));
  const int64_t B = tokens.size(0), T1 = tokens.size(1);
  const std::vector<int64_t> all = tokens.to_index_vector();
  std::vector<int64_t> in, tg;
  for (int64_t b = 0; b < B; b++) {
    in.insert(in.end(), all.begin() + b * T1, all.begin() + (b + 1) * T1 - 1);
    tg.insert(tg.end(), all.begin() + b * T1 + 1, all.begin() + (b + 1) * T1);
  }
  return {Tensor::from_indices(in, {B, T1 - 1}, tokens.device()),
          Tensor::from_indices(tg, {B, T1 - 1}, tokens.device())};
}

Tensor positions(int64_t T, Device dev) {
  std::vector<int64_t> p((size_t)T);
  for (int64_t t = 0; t < T; t++) p[(size_t)t] = t;
  return Tensor::from_indices(p, {T}, dev);
}

Output loss_and_grads(const Config& c, const Params& p, const Tensor& tokens) {
  for (const NamedTensor& n : p.named_parameters()) {
    Tensor t = n.t;
    t.zero_grad();
  }
  Batch b = split_tokens(tokens);
  Output out = forward(c, p, b.inputs, b.targets, positions(b.inputs.size(1), tokens.device()));
  out.loss.backward();
  return out;
}

}  // namespace ff::model
