// lessons/06_overlap/block.cpp — the block's attention half, its weights and micro-batches
// (block.h).
#include "lessons/06_overlap/block.h"

#include <cmath>

#include "common/core/ops.h"

namespace ff::f1b {

// The attention half, on the tape: h = x + softmax(causal(q k^T / sqrt(dh))) v Wo, with
// q, k, v from rmsnorm(x). tick() runs between its ops (the compute tiles of --progress test).
Tensor attention_block(const Weights& w, const Tensor& x, int64_t H, const Tensor& mask,
                       const std::function<void()>& tick) {
  const int64_t T = x.size(0), d = x.size(1), dh = d / H;
  auto heads = [&](const Tensor& t) { return transpose(reshape(t, {T, H, dh}), 0, 1); };
  Tensor a = rmsnorm(x, w.g1);
  tick();
  Tensor q = heads(matmul(a, w.wq));
  tick();
  Tensor k = heads(matmul(a, w.wk));
  tick();
  Tensor v = heads(matmul(a, w.wv));
  tick();
  Tensor sc = scale(matmul(q, transpose(k, 1, 2)), 1.0f / std::sqrt((float)dh));
  tick();
  Tensor p = softmax(masked_fill(sc, mask, -INFINITY));
  tick();
  Tensor o = reshape(transpose(matmul(p, v), 0, 1), {T, d});
  tick();
  Tensor h = add(x, matmul(o, w.wo));
  tick();
  return h;
}

// Micro-batch m of this rank: its tokens and the gradient its output receives, drawn from the
// seed (counter-based: rows [rank T, (rank + 1) T) of one global tensor per micro-batch).
void draw(const Setup& s, int rank, int P, int m, Tensor* x, Tensor* dy) {
  const int64_t T = s.tokens, d = s.moe.dim;
  *x = randn_slice({P * T, d}, 0, rank * T, (rank + 1) * T, s.seed + 100 + (uint64_t)m).to(s.dev);
  *dy = randn_slice({P * T, d}, 0, rank * T, (rank + 1) * T, s.seed + 500 + (uint64_t)m).to(s.dev);
}

Weights make_weights(const Setup& s, int rank, int P) {
  const int64_t d = s.moe.dim, E = s.moe.experts / P;
  Weights w;
  auto leaf = [&](Tensor t) { return t.requires_grad_(true); };
  const float sd = 1.0f / std::sqrt((float)d);
  w.g1 = leaf(add_scalar(scale(randn({d}, s.seed + 1, s.dev), 0.1f), 1.0f));
  w.g2 = leaf(add_scalar(scale(randn({d}, s.seed + 2, s.dev), 0.1f), 1.0f));
  w.wq = leaf(scale(randn({d, d}, s.seed + 3, s.dev), sd));
  w.wk = leaf(scale(randn({d, d}, s.seed + 4, s.dev), sd));
  w.wv = leaf(scale(randn({d, d}, s.seed + 5, s.dev), sd));
  w.wo = leaf(scale(randn({d, d}, s.seed + 6, s.dev), sd));
  w.full = dsv3::init_params(s.moe, s.seed + 7, /*bias_spread=*/0.05, s.dev);
  w.mine = dsv3::slice_experts(w.full, rank * E, (rank + 1) * E);
  return w;
}
moe::Params local_expert(const Weights& w, size_t e) {
  moe::Params all = dsv3::routed(w.mine);
  moe::Params one;
  one.w1 = slice(all.w1, 0, (int64_t)e, (int64_t)e + 1);
  one.w2 = slice(all.w2, 0, (int64_t)e, (int64_t)e + 1);
  one.w3 = slice(all.w3, 0, (int64_t)e, (int64_t)e + 1);
  return one;
}
std::vector<Tensor*> attention_leaves(Weights& w) {
  return {&w.g1, &w.wq, &w.wk, &w.wv, &w.wo, &w.g2};
}

}  // namespace ff::f1b
