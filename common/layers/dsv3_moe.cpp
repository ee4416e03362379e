// common/layers/dsv3_moe.cpp — the DeepSeek-V3 MoE layer of dsv3_moe.h: routing (affinities,
// node-limited selection, capacity, gating), the sequence-wise balance loss, the shared
// experts, the layer on one process with its hand-written backward, and the autograd
// reference. lessons/05_deepseek_moe/README.md writes the backward out.
#include "common/layers/dsv3_moe.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>

#include "common/core/check.h"
#include "common/core/ops.h"
#include "kernels/kernels.h"

namespace ff::dsv3 {

const char* gate_name(GateFn g) { return g == GateFn::sigmoid ? "sigmoid" : "softmax"; }
const char* overflow_name(Overflow o) { return o == Overflow::drop ? "drop" : "next-best"; }

int64_t Config::group_score_k() const {
  const int64_t k = group_score_topk > 0 ? group_score_topk : gate == GateFn::sigmoid ? 2 : 1;
  return std::min(k, experts / std::max<int64_t>(groups, 1));
}

Params init_params(const Config& c, uint64_t seed, double bias_spread, Device dev) {
  const int64_t N = c.experts, d = c.dim, f = c.ffn, Sf = c.shared * c.ffn;
  Params p;
  p.router_w = (randn({d, N}, seed) * (1.f / std::sqrt((float)d))).to(dev);
  p.bias = (randn({N}, seed + 4) * (float)bias_spread).to(dev);
  p.w1 = (randn({N, d, f}, seed + 1) * (1.f / std::sqrt((float)d))).to(dev);
  p.w3 = (randn({N, d, f}, seed + 2) * (1.f / std::sqrt((float)d))).to(dev);
  p.w2 = (randn({N, f, d}, seed + 3) * (1.f / std::sqrt((float)f))).to(dev);
  if (Sf > 0) {
    p.sw1 = (randn({d, Sf}, seed + 5) * (1.f / std::sqrt((float)d))).to(dev);
    p.sw3 = (randn({d, Sf}, seed + 6) * (1.f / std::sqrt((float)d))).to(dev);
    p.sw2 = (randn({Sf, d}, seed + 7) * (1.f / std::sqrt((float)Sf))).to(dev);
  }
  return p;
}

RecordedOp recorded_op(const Params& p, const Tensor& u, bool shared) {
  auto plain = [](const Tensor& t) { return t.defined() ? t.detach() : Tensor(); };
  RecordedOp op;
  Params& w = op.plain;
  w.router_w = plain(p.router_w), w.bias = plain(p.bias);
  w.w1 = plain(p.w1), w.w3 = plain(p.w3), w.w2 = plain(p.w2);
  w.sw1 = plain(p.sw1), w.sw3 = plain(p.sw3), w.sw2 = plain(p.sw2);
  op.inputs = {u, p.router_w, p.w1, p.w3, p.w2};
  op.weights = {1, 2, 3, 4};
  if (shared) {
    op.inputs.insert(op.inputs.end(), {p.sw1, p.sw3, p.sw2});
    op.weights.insert(op.weights.end(), {5, 6, 7});
  }
  return op;
}

std::vector<Tensor> op_input_grads(const Tensor& dx, bool shared) {
  std::vector<Tensor> grads(shared ? 8 : 5);
  grads[0] = dx;  // the balancing bias is no input: it gets no gradient
  return grads;
}

std::vector<Tensor> op_weight_grads(const Grads& g, bool shared) {
  std::vector<Tensor> wg = {g.router_w, g.w1, g.w3, g.w2};
  if (shared) wg.insert(wg.end(), {g.sw1, g.sw3, g.sw2});
  return wg;
}

Params slice_experts(const Params& p, int64_t e0, int64_t e1) {
  Params q = p;
  q.w1 = slice(p.w1, 0, e0, e1), q.w3 = slice(p.w3, 0, e0, e1), q.w2 = slice(p.w2, 0, e0, e1);
  return q;
}

moe::Params routed(const Params& p) { return {p.router_w, p.bias, p.w1, p.w3, p.w2}; }

moe::Params shared(const Params& p) {
  const int64_t d = p.sw1.size(0), Sf = p.sw1.size(1);
  return {p.router_w, p.bias, reshape(p.sw1, {1, d, Sf}), reshape(p.sw3, {1, d, Sf}),
          reshape(p.sw2, {1, Sf, d})};
}

// ----------------------------------------------------------------------------
// routing

Tensor affinities(const Config& c, const Params& p, const Tensor& x) {
  Tensor z = matmul(x, p.router_w);
  return c.gate == GateFn::sigmoid ? sigmoid(z) : softmax(z);
}

// [slide:select]
Selection select(const Config& c, const Tensor& s, const Tensor& bias) {
  const int64_t T = s.size(0), N = c.experts, K = c.topk, G = c.groups, M = c.topk_groups;
  const Device dev = s.device();
  Tensor biased = add(s, bias);  // selection only: b never reaches the gates
  Selection sel{Tensor::empty({T, K}, dev, DType::i64), Tensor::empty({T, M}, dev, DType::i64)};
  if (T > 0)
    kernels_for(dev).moe_group_topk(sel.idx.index_data(), sel.kept_groups.index_data(),
                                    biased.data(), T, N, G, M, c.group_score_k(), K);
  return sel;
}
// [/slide]

Tensor kept_groups_seed001(const Config& c, const Tensor& s) {
  std::vector<float> logits = s.to_vector();
  for (float& v : logits) {
    // a saturated affinity (0, or a sigmoid rounded to 1) clamped to the nearest float32 the
    // logit is finite for, so that no group's sum is infinite or NaN
    const double a = std::min(std::max((double)v, (double)FLT_MIN), 1.0 - (double)FLT_EPSILON / 2);
    v = c.gate == GateFn::sigmoid ? (float)(std::log(a) - std::log1p(-a)) : (float)std::log(a);
  }
  Config all = c;
  all.group_score_topk = c.experts;  // every expert of the group
  return select(all, Tensor::from_vector(logits, s.shape()).to(s.device()),
                Tensor::zeros({c.experts}, s.device())).kept_groups;
}

// Capacity, in three passes over the global slots (slot = t K + j, global token order):
//   1. demand: how many slots chose each expert;
//   2. per expert over capacity, keep the cap slots of highest affinity s_t,e (ties: the
//      earlier slot); the rest overflow. (s + b orders an expert's slots the same way: b_e is
//      the same for all of them.)
//   3. drop: overflow slots are dropped. next-best: in global slot order, each overflow slot
//      goes to its token's best expert by s + b, inside the token's kept groups, not already
//      among its K, with room left; with none, it is dropped.
Assignment assign_capacity(const Config& c, const std::vector<float>& s,
                           const std::vector<float>& bias, const std::vector<int64_t>& idx,
                           const std::vector<int64_t>& kept_groups, int64_t T_all) {
  const int64_t N = c.experts, K = c.topk, M = c.topk_groups, per_group = N / c.groups;
  Assignment a;
  a.idx = idx;
  a.kept.assign((size_t)(T_all * K), 1);
  a.experts.assign((size_t)N, ExpertLoad{});
  a.capacity = c.capacity_factor > 0
                   ? (int64_t)std::ceil(c.capacity_factor * (double)(T_all * K) / (double)N)
                   : T_all * K;
  std::vector<std::vector<int64_t>> slots_of((size_t)N);
  for (int64_t sl = 0; sl < T_all * K; sl++) slots_of[(size_t)idx[(size_t)sl]].push_back(sl);
  std::vector<int64_t> overflow;
  for (int64_t e = 0; e < N; e++) {
    ExpertLoad& L = a.experts[(size_t)e];
    std::vector<int64_t>& sl = slots_of[(size_t)e];
    L.capacity = a.capacity;
    L.demand = (int64_t)sl.size();
    if (L.demand > a.capacity) {
      std::stable_sort(sl.begin(), sl.end(), [&](int64_t u, int64_t v) {
        return s[(size_t)((u / K) * N + e)] > s[(size_t)((v / K) * N + e)];
      });
      for (size_t i = (size_t)a.capacity; i < sl.size(); i++) overflow.push_back(sl[i]);
      L.overflow = L.demand - a.capacity;
    }
    L.load = std::min(L.demand, a.capacity);
  }
  std::sort(overflow.begin(), overflow.end());  // global slot order
  for (int64_t sl : overflow) {
    const int64_t t = sl / K, e0 = idx[(size_t)sl];
    int64_t best = -1;
    if (c.overflow == Overflow::next_best) {
      float best_score = 0;
      for (int64_t m = 0; m < M; m++) {
        const int64_t g = kept_groups[(size_t)(t * M + m)];
        for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) {
          if (a.experts[(size_t)e].load >= a.capacity) continue;
          bool taken = false;
          for (int64_t j = 0; j < K; j++) taken |= a.idx[(size_t)(t * K + j)] == e;
          if (taken) continue;
          const float score = s[(size_t)(t * N + e)] + bias[(size_t)e];
          if (best < 0 || score > best_score || (score == best_score && e < best))
            best = e, best_score = score;
        }
      }
    }
    if (best < 0) {
      a.kept[(size_t)sl] = 0;
      a.experts[(size_t)e0].dropped++;
    } else {
      a.idx[(size_t)sl] = best;
      a.experts[(size_t)e0].moved_out++;
      a.experts[(size_t)best].moved_in++;
      a.experts[(size_t)best].load++;
    }
  }
  return a;
}

// g = route_scale * s[idx] (/ its sum + 1e-20 for sigmoid), with the core's ops, so the same
// function serves the layer (any device) and the autograd reference (recording the tape).
Tensor gates(const Config& c, const Tensor& s, const Tensor& idx) {
  const int64_t T = s.size(0), N = s.size(1), K = idx.size(1);
  std::vector<int64_t> flat = idx.to_index_vector();
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < K; j++) flat[(size_t)(t * K + j)] += t * N;
  Tensor sel = reshape(index_select(reshape(s, {T * N, 1}),
                                    Tensor::from_indices(flat, {T * K}, s.device())),
                       {T, K});
  // [slide:gates]
  if (c.gate == GateFn::sigmoid) sel = div(sel, add_scalar(sum(sel, 1, true), 1e-20f));
  return scale(sel, (float)c.route_scale);
  // [/slide]
}

Tensor plan_ids(const Config& c, const std::vector<int64_t>& idx, const std::vector<uint8_t>& kept,
                int64_t row0, int64_t rows, Device dev) {
  const int64_t K = c.topk;
  std::vector<int64_t> ids((size_t)(rows * K));
  for (int64_t i = 0; i < rows * K; i++) {
    const size_t g = (size_t)(row0 * K + i);
    ids[(size_t)i] = kept[g] ? idx[g] : c.experts;
  }
  return Tensor::from_indices(ids, {rows, K}, dev);
}

// ----------------------------------------------------------------------------
// the sequence-wise balance loss

const char* aux_count_name(AuxCount a) {
  return a == AuxCount::unbiased_topk ? "unbiased-topk" : "selected";
}

std::vector<int64_t> unbiased_topk(const std::vector<float>& sv, int64_t T, int64_t N, int64_t K) {
  std::vector<int64_t> out((size_t)(T * K)), order((size_t)N);
  for (int64_t t = 0; t < T; t++) {
    const float* st = &sv[(size_t)(t * N)];
    for (int64_t i = 0; i < N; i++) order[(size_t)i] = i;
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [st](int64_t a, int64_t b) { return st[a] > st[b] || (st[a] == st[b] && a < b); });
    std::copy(order.begin(), order.begin() + K, out.begin() + t * K);
  }
  return out;
}

BalanceStats balance_stats(const Config& c, const Tensor& s, const Tensor& idx) {
  const int64_t T = s.size(0), N = c.experts, K = c.topk, L = c.seq_len;
  FF_CHECK(T % L == 0, "balance loss: " << T << " tokens are not whole sequences of " << L);
  const std::vector<float> sv = s.to_vector();
  const std::vector<int64_t> iv =
      c.aux_count == AuxCount::selected ? idx.to_index_vector() : unbiased_topk(sv, T, N, K);
  BalanceStats b;
  b.sequences = T / L;
  b.f.assign((size_t)(b.sequences * N), 0.0);
  for (int64_t q = 0; q < b.sequences; q++) {
    double* f = &b.f[(size_t)(q * N)];
    std::vector<double> P((size_t)N, 0.0);
    for (int64_t t = q * L; t < (q + 1) * L; t++) {
      for (int64_t j = 0; j < K; j++) f[iv[(size_t)(t * K + j)]] += (double)N / (double)(K * L);
      double Z = 0;
      for (int64_t i = 0; i < N; i++) Z += sv[(size_t)(t * N + i)];
      for (int64_t i = 0; i < N; i++) P[(size_t)i] += sv[(size_t)(t * N + i)] / Z / (double)L;
    }
    for (int64_t i = 0; i < N; i++) b.loss_sum += f[i] * P[(size_t)i];
  }
  return b;
}

double balance_loss(const Config& c, double loss_sum_all, int64_t sequences_all) {
  return sequences_all > 0 ? c.alpha * loss_sum_all / (double)sequences_all : 0.0;
}

// ----------------------------------------------------------------------------
// the router's backward (host: (T, N) arithmetic)
//   sigmoid gate, S = sum_j s_j + 1e-20 over the token's K selected, g_j = rs s_j / S:
//       ds_m = rs / S (dg_m - sum_j dg_j s_j / S)          for m selected
//   softmax gate, g_j = rs s_j:  ds_m = rs dg_m
//   balance, P_i = (1/L) sum_t s'_ti, s' = s / Z, Z = sum_i s_ti, with weight alpha / B_all:
//       ds'_ti = alpha f_qi / (B_all L)   (q: t's sequence),  ds_i += (ds'_i - <ds', s'>) / Z
//   then through the affinity: sigmoid dz = ds s (1 - s); softmax dz = s (ds - <ds, s>).
Tensor router_dlogits(const Config& c, const Tensor& s, const Tensor& bias, const Tensor& idx,
                      const Tensor& dgates, const BalanceStats& bal, int64_t sequences_all,
                      Bug bug) {
  const int64_t T = s.size(0), N = c.experts, K = c.topk, L = c.seq_len;
  const std::vector<float> sv = s.to_vector(), bv = bias.to_vector(), dg = dgates.to_vector();
  const std::vector<int64_t> iv = idx.to_index_vector();
  const double rs = c.route_scale;
  std::vector<float> dz((size_t)(T * N));
  std::vector<double> ds((size_t)N);
  for (int64_t t = 0; t < T; t++) {
    const float* st = &sv[(size_t)(t * N)];
    std::fill(ds.begin(), ds.end(), 0.0);
    const int64_t* it = &iv[(size_t)(t * K)];
    const float* dgt = &dg[(size_t)(t * K)];
    // [slide:router-bwd]
    if (c.gate == GateFn::sigmoid && bug != Bug::no_renorm) {
      auto sel = [&](int64_t j) {
        return (double)st[it[j]] + (bug == Bug::bias_grad ? (double)bv[(size_t)it[j]] : 0.0);
      };
      double S = 1e-20, dot = 0;
      for (int64_t j = 0; j < K; j++) S += sel(j);
      for (int64_t j = 0; j < K; j++) dot += (double)dgt[j] * sel(j) / S;
      for (int64_t j = 0; j < K; j++) ds[(size_t)it[j]] += rs / S * ((double)dgt[j] - dot);
    } else {
      for (int64_t j = 0; j < K; j++) ds[(size_t)it[j]] += rs * (double)dgt[j];
    }
    // [/slide]
    if (c.alpha != 0 && sequences_all > 0) {
      const double* f = &bal.f[(size_t)((t / L) * N)];
      const double w = c.alpha / ((double)sequences_all * (double)L);
      double Z = 0, dot = 0;
      for (int64_t i = 0; i < N; i++) Z += st[i];
      for (int64_t i = 0; i < N; i++) dot += w * f[i] * st[i] / Z;
      for (int64_t i = 0; i < N; i++) ds[(size_t)i] += (w * f[i] - dot) / Z;
    }
    float* dzt = &dz[(size_t)(t * N)];
    if (c.gate == GateFn::sigmoid) {
      for (int64_t i = 0; i < N; i++) dzt[i] = (float)(ds[(size_t)i] * st[i] * (1.0 - st[i]));
    } else {
      double dot = 0;
      for (int64_t i = 0; i < N; i++) dot += ds[(size_t)i] * st[i];
      for (int64_t i = 0; i < N; i++) dzt[i] = (float)(st[i] * (ds[(size_t)i] - dot));
    }
  }
  return Tensor::from_vector(dz, {T, N}, s.device());
}

// ----------------------------------------------------------------------------
// the shared experts: common/layers/moe.h's expert path with one group holding every token

Tensor shared_forward(const Params& p, const Tensor& x, moe::ExpertCache* cache) {
  Tensor sizes = Tensor::from_indices({x.size(0)}, {1}, x.device());
  return moe::experts_forward(shared(p), x, sizes, cache);
}

moe::ExpertInputGrads shared_backward_input(const Params& p, const moe::ExpertCache& cache,
                                            const Tensor& dy) {
  return moe::experts_backward_input(shared(p), cache, dy);
}

moe::ExpertGrads shared_backward_weights(const Params& p, const moe::ExpertCache& cache,
                                         const moe::ExpertInputGrads& in) {
  moe::ExpertGrads g = moe::experts_backward_weights(shared(p), cache, in);
  const int64_t d = p.sw1.size(0), Sf = p.sw1.size(1);
  g.dw1 = reshape(g.dw1, {d, Sf}), g.dw3 = reshape(g.dw3, {d, Sf}), g.dw2 = reshape(g.dw2, {Sf, d});
  return g;
}

moe::ExpertGrads shared_backward(const Params& p, const moe::ExpertCache& cache, const Tensor& dy) {
  moe::ExpertInputGrads in = shared_backward_input(p, cache, dy);
  moe::ExpertGrads g = shared_backward_weights(p, cache, in);
  g.dxp = in.dxp;
  return g;
}

// ----------------------------------------------------------------------------
// the layer on one process

static std::vector<int64_t> first_n(const Tensor& t, int64_t n) {
  std::vector<int64_t> v = t.to_index_vector();
  v.resize((size_t)n);
  return v;
}

Forward forward(const Config& c, const Params& p, const Tensor& x) {
  const int64_t T = x.size(0), N = c.experts, K = c.topk, d = x.size(1);
  const Device dev = x.device();
  Forward f;
  f.s = affinities(c, p, x);
  f.sel = select(c, f.s, p.bias);
  f.assign = assign_capacity(c, f.s.to_vector(), p.bias.to_vector(), f.sel.idx.to_index_vector(),
                             f.sel.kept_groups.to_index_vector(), T);
  f.idx = Tensor::from_indices(f.assign.idx, {T, K}, dev);
  f.gates = gates(c, f.s, f.idx);
  f.plan = moe::permute_plan(plan_ids(c, f.assign.idx, f.assign.kept, 0, T, dev), N + 1);
  std::vector<int64_t> sizes = first_n(f.plan.group_sizes, N);
  for (int64_t n : sizes) f.kept_rows += n;
  Tensor xk = slice(moe::permute(x, f.plan), 0, 0, f.kept_rows);
  Tensor yk = moe::experts_forward(routed(p), xk, Tensor::from_indices(sizes, {N}, dev), &f.cache);
  f.yp = f.kept_rows < T * K ? concat({yk, Tensor::zeros({T * K - f.kept_rows, d}, dev)}, 0) : yk;
  f.y = moe::combine(f.yp, f.plan, f.gates);
  if (c.shared > 0) f.y = add(f.y, shared_forward(p, x, &f.shared_cache));
  if (c.alpha != 0) {  // whole sequences only when there is a balance loss
    f.bal = balance_stats(c, f.s, f.sel.idx);
    f.balance = balance_loss(c, f.bal.loss_sum, f.bal.sequences);
  }
  return f;
}

InputGrads backward_input(const Config& c, const Params& p, const Tensor& x, const Forward& f,
                          const Tensor& dy, Bug bug) {
  const int64_t T = x.size(0), K = c.topk, d = x.size(1);
  const Device dev = x.device();
  InputGrads in;
  moe::CombineGrads cg = moe::combine_backward(dy, f.yp, f.plan, f.gates);
  in.routed = moe::experts_backward_input(routed(p), f.cache, slice(cg.dyp, 0, 0, f.kept_rows));
  Tensor dxp = f.kept_rows < T * K
                   ? concat({in.routed.dxp, Tensor::zeros({T * K - f.kept_rows, d}, dev)}, 0)
                   : in.routed.dxp;
  in.dz = router_dlogits(c, f.s, p.bias, f.idx, cg.dgates, f.bal, f.bal.sequences, bug);
  in.dx = add(moe::unpermute_sum(dxp, f.plan), matmul(in.dz, transpose(p.router_w, 0, 1)));
  if (c.shared > 0) {
    in.shared = shared_backward_input(p, f.shared_cache, dy);  // ungated: dy as it is
    if (bug != Bug::no_shared_grad) in.dx = add(in.dx, in.shared.dxp);
  }
  return in;
}

Grads backward_weights(const Config& c, const Params& p, const Tensor& x,
                       const moe::ExpertCache& cache, const moe::ExpertCache& shared_cache,
                       const InputGrads& in) {
  Grads g;
  g.router_w = matmul(transpose(x, 0, 1), in.dz);
  moe::ExpertGrads eg = moe::experts_backward_weights(routed(p), cache, in.routed);
  g.w1 = eg.dw1, g.w2 = eg.dw2, g.w3 = eg.dw3;
  if (c.shared > 0) {
    moe::ExpertGrads sg = shared_backward_weights(p, shared_cache, in.shared);
    g.sw1 = sg.dw1, g.sw2 = sg.dw2, g.sw3 = sg.dw3;
  }
  return g;
}

Grads backward(const Config& c, const Params& p, const Tensor& x, const Forward& f,
               const Tensor& dy, Bug bug) {
  InputGrads in = backward_input(c, p, x, f, dy, bug);
  Grads g = backward_weights(c, p, x, f.cache, f.shared_cache, in);
  g.dx = in.dx;
  return g;
}

// ----------------------------------------------------------------------------
// the autograd reference: the same layer in loop form, ops only

Reference autograd_reference(const Config& c, const Params& params, const Tensor& x0,
                             const Tensor& dy, const Assignment& assign) {
  const int64_t T = x0.size(0), N = c.experts, K = c.topk, L = c.seq_len;
  auto leaf = [](const Tensor& t) {
    return t.defined() ? t.to(Device::cpu).clone().requires_grad_() : Tensor();
  };
  Params p{leaf(params.router_w), params.bias.to(Device::cpu), leaf(params.w1), leaf(params.w3),
           leaf(params.w2), leaf(params.sw1), leaf(params.sw3), leaf(params.sw2)};
  Tensor x = leaf(x0);
  Tensor s = affinities(c, p, x);
  Tensor g = gates(c, s, Tensor::from_indices(assign.idx, {T, K}));
  // the loop form wants dropped slots out of every expert's list: expert -1
  std::vector<int64_t> loop_idx = assign.idx;
  for (size_t i = 0; i < loop_idx.size(); i++)
    if (!assign.kept[i]) loop_idx[i] = -1;
  moe::Config mc;
  mc.experts = N, mc.topk = K;
  moe::Routing r;
  r.idx = Tensor::from_indices(loop_idx, {T, K});
  r.gates = g;
  Tensor y = moe::forward_loop(mc, routed(p), x, r);
  if (c.shared > 0) y = add(y, matmul(mul(silu(matmul(x, p.sw1)), matmul(x, p.sw3)), p.sw2));
  // L_bal = alpha / B sum_q sum_i f_qi P_qi, P_q = mean over the sequence of s / sum(s)
  Tensor loss = sum_all(mul(y, dy.to(Device::cpu)));
  double bal_value = 0;
  if (c.alpha != 0) {
    const int64_t B = T / L;
    Tensor sel_idx = select(c, s.detach(), p.bias).idx;
    BalanceStats bs = balance_stats(c, s.detach(), sel_idx);
    std::vector<float> f(bs.f.begin(), bs.f.end());
    Tensor P = mean(reshape(div(s, sum(s, 1, true)), {B, L, N}), 1);  // (B, N)
    Tensor bal = scale(sum_all(mul(P, Tensor::from_vector(f, {B, N}))), (float)(c.alpha / (double)B));
    bal_value = bal.item();
    loss = add(loss, bal);
  }
  loss.backward();
  Reference ref;
  ref.y = y.detach();
  ref.balance = bal_value;
  ref.grads = {x.grad(), p.router_w.grad(), p.w1.grad(), p.w2.grad(), p.w3.grad(),
               c.shared > 0 ? p.sw1.grad() : Tensor(), c.shared > 0 ? p.sw2.grad() : Tensor(),
               c.shared > 0 ? p.sw3.grad() : Tensor()};
  return ref;
}

// ----------------------------------------------------------------------------
// dumps and sizes

std::vector<moe::NamedTensor> named_parameters(const Params& p) {
  std::vector<moe::NamedTensor> v = {{"router_w", p.router_w}, {"bias", p.bias},
                                     {"experts_w1", p.w1}, {"experts_w3", p.w3},
                                     {"experts_w2", p.w2}};
  if (p.sw1.defined())
    v.insert(v.end(), {{"shared_w1", p.sw1}, {"shared_w3", p.sw3}, {"shared_w2", p.sw2}});
  return v;
}

std::vector<moe::NamedTensor> named_grads(const Grads& g) {
  std::vector<moe::NamedTensor> v = {{"dx", g.dx}, {"d_router_w", g.router_w},
                                     {"d_experts_w1", g.w1}, {"d_experts_w3", g.w3},
                                     {"d_experts_w2", g.w2}};
  if (g.sw1.defined())
    v.insert(v.end(), {{"d_shared_w1", g.sw1}, {"d_shared_w3", g.sw3}, {"d_shared_w2", g.sw2}});
  return v;
}

double memory_bytes(const Config& c, int64_t T) {
  const double N = (double)c.experts, d = (double)c.dim, f = (double)c.ffn,
               Sf = (double)(c.shared * c.ffn);
  const double params = 3.0 * N * d * f + 3.0 * d * Sf + d * N;
  const double slots = (double)T * (double)c.topk;
  return 4.0 * (3.0 * params + 4.0 * slots * (2.0 * d + 3.0 * f) +
                4.0 * (double)T * (2.0 * d + 3.0 * Sf) + 8.0 * (double)T * N);
}

Tensor BiasUpdater::updated(const Tensor& bias, const std::vector<double>& load, double slots) {
  const int64_t N = (int64_t)load.size();
  FF_CHECK(bias.numel() == N, "BiasUpdater: " << N << " loads for a bias of " << bias.numel());
  std::vector<float> b = bias.to_vector();
  // [slide:bias-update]
  double total = 0;
  for (double l : load) total += l;
  const double mean = total / (double)N;  // exact when the loads balance (whole counts)
  for (int64_t i = 0; i < N; i++) {
    double err = mean - load[(size_t)i];
    if (beta > 0) {
      est[(size_t)i] = beta * est[(size_t)i] + (1 - beta) * load[(size_t)i] / slots;
      err = 1.0 / (double)N - est[(size_t)i];
    }
    b[(size_t)i] += (float)(gamma * (err > 0 ? 1.0 : err < 0 ? -1.0 : 0.0));
  }
  // [/slide]
  return Tensor::from_vector(b, {N}, bias.device());
}

}  // namespace ff::dsv3
