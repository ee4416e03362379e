// common/layers/moe.cpp — the mixture-of-experts layer of common/layers/moe.h: routing, the load-balance
// loss, the expert path (permute -> grouped GEMM -> combine) and its hand-written backward,
// and the autograd reference. The math of the backward is written out in
// lessons/03_smoe/README.md; the comments here name each step.
#include "common/layers/moe.h"

#include <cmath>
#include <cstdio>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "kernels/device.h"
#include "kernels/kernels.h"

namespace ff::moe {

const char* gate_name(Gate g) {
  return g == Gate::softmax_topk ? "softmax-topk" : "topk-softmax";
}

double memory_bytes(const Config& c, int64_t T) {
  const double N = (double)c.experts, d = (double)c.dim, f = (double)c.ffn;
  const double params = 3.0 * N * d * f + d * N + N;
  const double slots = (double)T * (double)c.topk;
  return 4.0 * (3.0 * params + 4.0 * slots * (2.0 * d + 3.0 * f) + 6.0 * (double)T * (d + N));
}

std::vector<NamedTensor> named_parameters(const Tensor& router_w, const Tensor& router_b,
                                          const Tensor& w1, const Tensor& w3, const Tensor& w2,
                                          const std::string& prefix) {
  return {{prefix + "router_w", router_w}, {prefix + "router_b", router_b},
          {prefix + "experts_w1", w1}, {prefix + "experts_w3", w3}, {prefix + "experts_w2", w2}};
}

Params init_params(const Config& c, uint64_t seed, int64_t starved, Device dev) {
  const int64_t N = c.experts, d = c.dim, f = c.ffn;
  FF_CHECK(starved >= 0 && starved < N, "starved experts must be in [0, " << N << ")");
  Params p;
  p.router_w = (randn({d, N}, seed) * (1.f / std::sqrt((float)d))).to(dev);
  std::vector<float> b((size_t)N, 0.f);
  for (int64_t i = N - starved; i < N; i++) b[(size_t)i] = -30.f;
  p.router_b = Tensor::from_vector(b, {N}, dev);
  p.w1 = (randn({N, d, f}, seed + 1) * (1.f / std::sqrt((float)d))).to(dev);
  p.w3 = (randn({N, d, f}, seed + 2) * (1.f / std::sqrt((float)d))).to(dev);
  p.w2 = (randn({N, f, d}, seed + 3) * (1.f / std::sqrt((float)f))).to(dev);
  return p;
}

Params slice_experts(const Params& p, int64_t e0, int64_t e1) {
  return {p.router_w, p.router_b, slice(p.w1, 0, e0, e1), slice(p.w3, 0, e0, e1),
          slice(p.w2, 0, e0, e1)};
}

// ----------------------------------------------------------------------------
// routing and the load-balance loss

// [slide:smoe-route]
Routing route(const Config& c, const Params& p, const Tensor& x) {
  // [slide:smoe-route-body]
  Routing r;
  r.logits = add(matmul(x, p.router_w), p.router_b);
  r.probs = softmax(r.logits);
  if (c.gate == Gate::softmax_topk) {
    // the k largest probabilities are the gates, as they are: they sum to less than 1
    auto [vals, idx] = topk(r.probs, c.topk);
    r.gates = vals, r.idx = idx;
  } else {
    // the k largest logits, renormalised among themselves: the gates sum to 1
    auto [vals, idx] = topk(r.logits, c.topk);
    r.gates = softmax(vals), r.idx = idx;
  }
  return r;
  // [/slide:smoe-route-body]
}
// [/slide]

LoadStats load_stats(const Config& c, const Routing& r) {
  LoadStats s;
  s.count.assign((size_t)c.experts, 0.0);
  for (int64_t e : r.idx.to_index_vector()) s.count[(size_t)e] += 1;
  std::vector<float> ps = sum(r.probs, 0).to_vector();
  s.prob_sum.assign(ps.begin(), ps.end());
  s.tokens = (double)r.probs.size(0);
  return s;
}

// [slide:smoe-aux]
// L_aux = alpha * N * sum_i f_i P_i, f_i = count_i / (k T), P_i = prob_sum_i / T (Switch
// Transformer, eq. 4; Mixtral's form with top-k). With perfectly uniform routing f_i = P_i =
// 1/N and L_aux = alpha; any imbalance the router is confident about raises it.
// [slide:smoe-aux-fn]
double aux_loss(const Config& c, const LoadStats& g) {
  double loss = 0;
  for (int64_t i = 0; i < c.experts; i++) {
    double f = g.count[(size_t)i] / ((double)c.topk * g.tokens);
    double P = g.prob_sum[(size_t)i] / g.tokens;
    loss += f * P;
  }
  return c.alpha * (double)c.experts * loss;
}
// [/slide:smoe-aux-fn]
// [/slide]

// ----------------------------------------------------------------------------
// the expert path

namespace {

GemmFn g_expert_gemm;  // ExpertGemmScope's; empty: the grouped GEMM kernels

// Expert e's weight as a (K, N) matrix for a (M, K) x (K, N) product: w[e], or w[e]^T (trans_w:
// w holds (G, N, K))
Tensor weight_of(const Tensor& w, int64_t e, int64_t K, int64_t N, bool trans_w) {
  const Tensor we = reshape(slice(w, 0, e, e + 1), trans_w ? Shape{N, K} : Shape{K, N});
  return trans_w ? transpose(we, 0, 1).clone() : we.clone();
}

// c (M, N) (+)= the rows of each group e times its weight, through g_expert_gemm one group at a time
void grouped_by_fn(float* c, const Tensor& x, const Tensor& w, const std::vector<int64_t>& sizes, int64_t M,
                   int64_t K, int64_t N, bool trans_w, bool accumulate) {
  NoGradGuard no_grad;
  std::vector<Tensor> parts;
  int64_t r0 = 0;
  for (size_t e = 0; e < sizes.size(); r0 += sizes[e], e++)
    if (sizes[e] > 0)
      parts.push_back(g_expert_gemm(slice(x, 0, r0, r0 + sizes[e]).clone(), weight_of(w, (int64_t)e, K, N, trans_w)));
  FF_CHECK(r0 == M, "moe: the groups hold " << r0 << " rows of " << M);
  const Tensor out = concat(parts, 0);
  std::vector<float> sum = out.to_vector();
  if (accumulate) {
    std::vector<float> prev(sum.size());
    device_memcpy(prev.data(), Device::cpu, c, x.device(), prev.size() * sizeof(float));
    for (size_t i = 0; i < sum.size(); i++) sum[i] = prev[i] + sum[i];
  }
  device_memcpy(c, x.device(), sum.data(), Device::cpu, sum.size() * sizeof(float));
}

// The expert GEMMs in their weights' precision: float32 weights as they are (or through an
// ExpertGemmScope's GEMM); bf16 weights (mixed precision, lesson 10) with the activations rounded
// to bf16 first, as a bf16 GEMM takes them, the products summed in float32 (kernels/bf16.h), the
// result float32.
void grouped(const KernelTable& k, float* c, const Tensor& x, const Tensor& w, const Tensor& group_sizes, int64_t G,
             int64_t M, int64_t K, int64_t N, bool trans_w, bool accumulate) {
  const int64_t* gs = group_sizes.index_data();
  if (g_expert_gemm && w.dtype() == DType::f32)
    grouped_by_fn(c, x, w, group_sizes.to_index_vector(), M, K, N, trans_w, accumulate);
  else if (w.dtype() == DType::bf16)
    k.grouped_gemm_bf16(c, x.to_dtype(DType::bf16).bf16_data(), w.bf16_data(), gs, G, M, K, N, trans_w,
                        accumulate);
  else
    k.grouped_gemm(c, x.data(), w.data(), gs, G, M, K, N, trans_w, accumulate);
}

// dw (G, K, N) = a_e^T dc_e per group, in w's dtype: a bf16 weight's gradient is bf16, from a
// and dc rounded to bf16 (an empty group's is 0)
Tensor grouped_dw(const KernelTable& k, const Tensor& a, const Tensor& dc, const Tensor& w, const Tensor& group_sizes,
                  int64_t G, int64_t M, int64_t K, int64_t N) {
  const int64_t* gs = group_sizes.index_data();
  const bool half = w.dtype() == DType::bf16;
  if (g_expert_gemm && !half) {  // a_e^T dc_e through the scope's GEMM, group by group
    NoGradGuard no_grad;
    const std::vector<int64_t> sizes = group_sizes.to_index_vector();
    std::vector<Tensor> parts;
    int64_t r0 = 0;
    for (size_t e = 0; e < sizes.size(); r0 += sizes[e], e++)
      parts.push_back(sizes[e] == 0 ? Tensor::zeros({1, K, N}, a.device())
                                    : reshape(g_expert_gemm(transpose(slice(a, 0, r0, r0 + sizes[e]), 0, 1).clone(),
                                                            slice(dc, 0, r0, r0 + sizes[e]).clone()),
                                              {1, K, N}));
    return concat(parts, 0);
  }
  Tensor dw = Tensor::zeros({G, K, N}, a.device());
  if (M > 0 && half)
    k.grouped_gemm_dw_bf16(dw.data(), a.to_dtype(DType::bf16).bf16_data(), dc.to_dtype(DType::bf16).bf16_data(),
                           gs, G, M, K, N, false);
  else if (M > 0)
    k.grouped_gemm_dw(dw.data(), a.data(), dc.data(), gs, G, M, K, N, false);
  return half ? dw.to_dtype(DType::bf16) : dw;
}

}  // namespace

ExpertGemmScope::ExpertGemmScope(GemmFn f) : previous_(std::move(g_expert_gemm)) { g_expert_gemm = std::move(f); }
ExpertGemmScope::~ExpertGemmScope() { g_expert_gemm = std::move(previous_); }

Tensor experts_forward(const Params& p, const Tensor& xp, const Tensor& group_sizes,
                       ExpertCache* cache) {
  const int64_t M = xp.size(0), G = p.w1.size(0), d = p.w1.size(1), f = p.w1.size(2);
  const Device dev = xp.device();
  const KernelTable& kernels = kernels_for(dev);
  cache->xp = xp;
  cache->group_sizes = group_sizes;
  cache->a = Tensor::empty({M, f}, dev);
  cache->b = Tensor::empty({M, f}, dev);
  Tensor yp = Tensor::empty({M, d}, dev);
  if (M == 0) {  // no rows at all (a rank that receives no tokens in lesson 04)
    cache->h = cache->a;
    return yp;
  }
  // a = xp W1_e, b = xp W3_e for the rows of each group e: one grouped GEMM each
  grouped(kernels, cache->a.data(), xp, p.w1, group_sizes, G, M, d, f, /*trans_w=*/false,
          /*accumulate=*/false);
  grouped(kernels, cache->b.data(), xp, p.w3, group_sizes, G, M, d, f, false, false);
  cache->h = mul(silu(cache->a), cache->b);  // SwiGLU
  grouped(kernels, yp.data(), cache->h, p.w2, group_sizes, G, M, f, d, false, false);
  return yp;
}

// With dyp = dL/d(expert output) of each packed row (the gate already applied, once):
//   yp = h W2        ->  dH  = dyp W2^T,           dW2 = h^T dyp
//   h = silu(a) * b  ->  dA  = dH * b * silu'(a),   dB  = dH * silu(a)
//                        silu'(a) = s (1 + a (1 - s)), s = sigmoid(a)
//   a = xp W1, b = xp W3 -> dW1 = xp^T dA, dW3 = xp^T dB, dxp = dA W1^T + dB W3^T
// every product per group, by the grouped GEMM kernels.
ExpertInputGrads experts_backward_input(const Params& p, const ExpertCache& cache,
                                        const Tensor& dyp, Bug bug) {
  const int64_t M = dyp.size(0), G = p.w1.size(0), d = p.w1.size(1), f = p.w1.size(2);
  const Device dev = dyp.device();
  const KernelTable& kernels = kernels_for(dev);
  const Tensor& gs = cache.group_sizes;
  ExpertInputGrads g;
  g.dyp = dyp;
  g.dxp = Tensor::empty({M, d}, dev);
  if (M == 0) return g;
  Tensor dh = Tensor::empty({M, f}, dev);
  grouped(kernels, dh.data(), dyp, p.w2, gs, G, M, d, f, /*trans_w=*/true, false);

  // [slide:smoe-silu-bwd]
  Tensor s = silu(cache.a), db, da = Tensor::empty({M, f}, dev);
  // [exercise:swiglu-backward] From dH, the gradients of h = silu(a) * b: db = dB and da = dA.
  db = mul(dh, s);
  // dA = silu'(a) * (dH * b): the kernel multiplies its "upstream" argument by silu'(a)
  kernels.unary_backward(UnaryOp::silu, da.data(), cache.a.data(), s.data(), mul(dh, cache.b).data(), M * f);
  // [/exercise]
  // [/slide]
  if (bug == Bug::silu_no_upstream)  // the planted mistake: silu'(a) times b, without dH
    kernels.unary_backward(UnaryOp::silu, da.data(), cache.a.data(), s.data(), cache.b.data(), M * f);

  grouped(kernels, g.dxp.data(), da, p.w1, gs, G, M, f, d, /*trans_w=*/true, false);
  grouped(kernels, g.dxp.data(), db, p.w3, gs, G, M, f, d, true, /*accumulate=*/true);
  g.da = da, g.db = db;
  return g;
}

ExpertGrads experts_backward_weights(const Params& p, const ExpertCache& cache,
                                     const ExpertInputGrads& in) {
  const int64_t M = in.dyp.size(0), G = p.w1.size(0), d = p.w1.size(1), f = p.w1.size(2);
  const KernelTable& kernels = kernels_for(in.dyp.device());
  const Tensor& gs = cache.group_sizes;
  ExpertGrads g;
  g.dw2 = grouped_dw(kernels, cache.h, in.dyp, p.w2, gs, G, M, f, d);
  g.dw1 = grouped_dw(kernels, cache.xp, in.da, p.w1, gs, G, M, d, f);
  g.dw3 = grouped_dw(kernels, cache.xp, in.db, p.w3, gs, G, M, d, f);
  return g;
}

ExpertGrads experts_backward(const Params& p, const ExpertCache& cache, const Tensor& dyp,
                             Bug bug) {
  ExpertInputGrads in = experts_backward_input(p, cache, dyp, bug);
  ExpertGrads g = experts_backward_weights(p, cache, in);
  g.dxp = in.dxp;
  return g;
}

// ----------------------------------------------------------------------------
// the layer

Plan permute_plan(const Tensor& idx, int64_t N) {
  const int64_t T = idx.size(0), k = idx.size(1);
  const Device dev = idx.device();
  Plan plan{Tensor::empty({N}, dev, DType::i64), Tensor::empty({T * k}, dev, DType::i64),
            Tensor::empty({T * k}, dev, DType::i64), T, k};
  kernels_for(dev).moe_permute_plan(plan.group_sizes.index_data(), plan.src_token.index_data(),
                                    plan.pos.index_data(), idx.index_data(), T, k, N);
  return plan;
}

Tensor permute(const Tensor& x, const Plan& plan) { return index_select(x, plan.src_token); }

Tensor combine(const Tensor& yp, const Plan& plan, const Tensor& gates) {
  const int64_t d = yp.size(1);
  Tensor y = Tensor::empty({plan.tokens, d}, yp.device());
  kernels_for(yp.device()).moe_combine(y.data(), yp.data(), plan.pos.index_data(), gates.data(),
                                       plan.tokens, plan.k, d);
  return y;
}

CombineGrads combine_backward(const Tensor& dy, const Tensor& yp, const Plan& plan,
                              const Tensor& gates) {
  const int64_t T = plan.tokens, k = plan.k, d = dy.size(1);
  const Device dev = dy.device();
  CombineGrads g{Tensor::empty({T * k, d}, dev), Tensor::empty({T, k}, dev)};
  kernels_for(dev).moe_combine_backward(g.dyp.data(), g.dgates.data(), dy.data(), yp.data(),
                                        plan.pos.index_data(), gates.data(), T, k, d);
  return g;
}

// the combine kernel without gates: each token sums its k packed rows
Tensor unpermute_sum(const Tensor& dxp, const Plan& plan) {
  const int64_t d = dxp.size(1);
  Tensor dx = Tensor::empty({plan.tokens, d}, dxp.device());
  kernels_for(dxp.device()).moe_combine(dx.data(), dxp.data(), plan.pos.index_data(), nullptr,
                                        plan.tokens, plan.k, d);
  return dx;
}

Tensor packed_gates(const Plan& plan, const Tensor& gates) {
  const int64_t Tk = plan.tokens * plan.k;
  std::vector<float> gp((size_t)Tk), gh = gates.to_vector();
  std::vector<int64_t> pos = plan.pos.to_index_vector();
  for (int64_t s = 0; s < Tk; s++) gp[(size_t)pos[(size_t)s]] = gh[(size_t)s];
  return Tensor::from_vector(gp, {Tk, 1}, gates.device());
}

RouterGrads router_backward(const Params& p, const Tensor& x, const Tensor& dz) {
  return {matmul(transpose(x, 0, 1), dz), sum(dz, 0), matmul(dz, transpose(p.router_w, 0, 1))};
}

// The loop form, shared by forward_loop and the autograd reference: for each expert, the
// routing slots that chose it (host index lists), its tokens' rows, its FFN, and the result
// added back into the tokens' rows weighted by the slots' gates. `gates` may carry autograd.
static Tensor loop_layer(const Params& p, const Tensor& x, const std::vector<int64_t>& idx,
                         const Tensor& gates, int64_t k) {
  const int64_t T = x.size(0), d = x.size(1), f = p.w1.size(2), N = p.w1.size(0);
  const Device dev = x.device();
  Tensor y = Tensor::zeros({T, d}, dev);
  // [slide:smoe-loop]
  // [slide:smoe-loop-select]
  Tensor gate_rows = reshape(gates, {T * k, 1});
  for (int64_t e = 0; e < N; e++) {
    std::vector<int64_t> tokens, slots;
    for (int64_t s = 0; s < T * k; s++)
      if (idx[(size_t)s] == e) tokens.push_back(s / k), slots.push_back(s);
    if (tokens.empty()) continue;  // an expert nobody chose: no work, no gradient
    // [/slide:smoe-loop-select]
    // [slide:smoe-loop-expert]
    const int64_t n = (int64_t)tokens.size();
    Tensor tok = Tensor::from_indices(tokens, {n}, dev);
    Tensor xe = index_select(x, tok);                                           // (n, d)
    Tensor w1 = reshape(slice(p.w1, 0, e, e + 1), {d, f});
    Tensor w3 = reshape(slice(p.w3, 0, e, e + 1), {d, f});
    Tensor w2 = reshape(slice(p.w2, 0, e, e + 1), {f, d});
    Tensor out = matmul(mul(silu(matmul(xe, w1)), matmul(xe, w3)), w2);         // E_e(x)
    Tensor g = index_select(gate_rows, Tensor::from_indices(slots, {n}, dev));  // (n, 1)
    y = index_add(y, tok, mul(out, g));
    // [/slide:smoe-loop-expert]
  }
  // [/slide]
  return y;
}

Tensor forward_loop(const Config& c, const Params& p, const Tensor& x, const Routing& r) {
  return loop_layer(p, x, r.idx.to_index_vector(), r.gates, c.topk);
}

// dL/dz from dL/dg, plus the load-balance loss's path. Small (T, N) arithmetic: on the host.
//   L_aux through p: dL_aux/dp_ti = alpha N f_i / T_total (f_i carries no gradient)
//   softmax-topk: g_tj = p_t[idx_tj], so dp_t = aux_t + scatter(dg_t at idx_t), and through
//                 the softmax, dz_t = p_t * (dp_t - <dp_t, p_t>)
//   topk-softmax: g_t = softmax(z_t[idx_t]), so dz_t[idx_tj] += g_tj (dg_tj - <dg_t, g_t>);
//                 the aux path still goes through the full softmax p_t
Tensor router_dlogits(const Config& c, const Routing& r, const Tensor& dgates,
                      const LoadStats& global) {
  const int64_t T = r.probs.size(0), N = c.experts, k = c.topk;
  const std::vector<float> p = r.probs.to_vector(), g = r.gates.to_vector(),
                           dg = dgates.to_vector();
  const std::vector<int64_t> idx = r.idx.to_index_vector();
  std::vector<double> daux((size_t)N);
  for (int64_t i = 0; i < N; i++)
    daux[(size_t)i] = c.alpha * (double)N * (global.count[(size_t)i] / ((double)k * global.tokens)) /
                      global.tokens;
  std::vector<float> dz((size_t)(T * N));
  std::vector<double> dp((size_t)N);
  for (int64_t t = 0; t < T; t++) {
    const float* pt = &p[(size_t)(t * N)];
    // [exercise:router-backward] Token t's row of dz = dL/d(router logits), from dp (the aux path, daux) and dg.
    dp = daux;
    if (c.gate == Gate::softmax_topk)
      for (int64_t j = 0; j < k; j++) dp[(size_t)idx[(size_t)(t * k + j)]] += dg[(size_t)(t * k + j)];
    double dot = 0;
    for (int64_t i = 0; i < N; i++) dot += dp[(size_t)i] * pt[i];
    for (int64_t i = 0; i < N; i++) dz[(size_t)(t * N + i)] = (float)(pt[i] * (dp[(size_t)i] - dot));
    if (c.gate == Gate::topk_softmax) {
      double gdg = 0;
      for (int64_t j = 0; j < k; j++) gdg += (double)g[(size_t)(t * k + j)] * dg[(size_t)(t * k + j)];
      for (int64_t j = 0; j < k; j++) {
        const size_t s = (size_t)(t * k + j);
        dz[(size_t)(t * N + idx[s])] += (float)(g[s] * (dg[s] - gdg));
      }
    }
    // [/exercise]
  }
  return Tensor::from_vector(dz, {T, N}, r.probs.device());
}

Reference autograd_reference(const Config& c, const Params& params, const Tensor& x0,
                             const Tensor& dy) {
  auto leaf = [](const Tensor& t) { return t.to(Device::cpu).clone().requires_grad_(); };
  Params p{leaf(params.router_w), leaf(params.router_b), leaf(params.w1), leaf(params.w3),
           leaf(params.w2)};
  Tensor x = leaf(x0);
  Routing r = route(c, p, x);  // the same ops as the layer's router, now recording autograd
  std::vector<int64_t> idx = r.idx.to_index_vector();
  Tensor y = loop_layer(p, x, idx, r.gates, c.topk);
  // L_aux = alpha N sum_i f_i P_i, with f_i a constant and P_i = mean_t p_ti differentiable
  LoadStats s = load_stats(c, r);
  std::vector<float> f((size_t)c.experts);
  for (int64_t i = 0; i < c.experts; i++)
    f[(size_t)i] = (float)(s.count[(size_t)i] / ((double)c.topk * s.tokens));
  Tensor aux = scale(sum_all(mul(mean(r.probs, 0), Tensor::from_vector(f, {c.experts}))),
                     (float)(c.alpha * (double)c.experts));
  add(sum_all(mul(y, dy.to(Device::cpu))), aux).backward();
  Reference ref;
  ref.y = y.detach();
  ref.aux = aux.item();
  ref.idx = r.idx;
  ref.gates = r.gates.detach();
  ref.grads = {x.grad(), p.router_w.grad(), p.router_b.grad(), p.w1.grad(), p.w2.grad(),
               p.w3.grad()};
  return ref;
}

}  // namespace ff::moe
