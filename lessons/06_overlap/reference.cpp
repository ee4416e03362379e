// lessons/06_overlap/reference.cpp — the one-process reference and the check against it
// (reference.h).
#include "lessons/06_overlap/reference.h"

#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <string>

#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/layers/model.h"

namespace ff::f1b {

Reference reference(Comm& comm, const Setup& setup, const Weights& weights, bool prefill) {
  Weights ref_weights = weights;  // its own leaves: the gradients must not mix with the runs'
  for (Tensor* t : attention_leaves(ref_weights)) *t = t->detach().clone().requires_grad_(true);
  const Tensor mask = model::causal_mask(setup.tokens, setup.dev);
  dsv3::Config moe = setup.moe;
  moe.seq_len = setup.tokens;
  Reference ref;
  auto acc = [](Tensor& sum, const Tensor& t) { sum = sum.defined() ? add(sum, t) : t; };
  for (int m = 0; m < (int)setup.microbatches; m++) {
    Tensor x, dy;
    draw(setup, comm.rank(), comm.size(), m, &x, &dy);
    if (prefill) {
      NoGradGuard no_grad;
      Tensor h = attention_block(ref_weights, x, setup.heads, mask);
      ref.y.push_back(add(h, dsv3::forward(moe, ref_weights.full, rmsnorm(h, ref_weights.g2)).y));
      continue;
    }
    x.requires_grad_(true);
    Tensor h = attention_block(ref_weights, x, setup.heads, mask);
    Tensor h_leaf = h.detach();
    h_leaf.requires_grad_(true);
    Tensor u_tape = rmsnorm(h_leaf, ref_weights.g2);
    Tensor u = u_tape.detach();
    NoGradGuard no_grad;
    dsv3::Forward forward = dsv3::forward(moe, ref_weights.full, u);
    ref.y.push_back(add(h.detach(), forward.y));
    dsv3::Grads grads = dsv3::backward(moe, ref_weights.full, u, forward, dy);
    run_backward(u_tape, grads.dx);
    run_backward(h, add(dy, h_leaf.grad()));
    ref.dx.push_back(x.grad());
    acc(ref.grads.router_w, grads.router_w), acc(ref.grads.w1, grads.w1);
    acc(ref.grads.w2, grads.w2), acc(ref.grads.w3, grads.w3);
    if (moe.shared > 0)
      acc(ref.grads.sw1, grads.sw1), acc(ref.grads.sw2, grads.sw2), acc(ref.grads.sw3, grads.sw3);
  }
  if (prefill) return ref;
  for (Tensor* t : attention_leaves(ref_weights)) {
    Tensor grad = t->grad().clone();
    comm.allreduce_sum(grad);
    ref.attn_grads.push_back(grad);
  }
  for (Tensor* t : {&ref.grads.router_w, &ref.grads.w1, &ref.grads.w2, &ref.grads.w3,
                    &ref.grads.sw1, &ref.grads.sw2, &ref.grads.sw3})
    if (t->defined()) comm.allreduce_sum(*t);
  return ref;
}

void check_against_reference(CheckReport& check, Comm& comm, const Setup& setup,
                             const Weights& weights, const RunResult& run, bool prefill,
                             const char* name) {
  const int rank = comm.rank(), ranks = comm.size();
  const dsv3::Config& moe = setup.moe;
  const int64_t T = setup.tokens, d = moe.dim, M = setup.microbatches;
  Reference ref = reference(comm, setup, weights, prefill);
  // Tolerances, as lessons 04 and 05: float32 sums of at most n terms in another order (the
  // reference's experts run as one grouped GEMM over N + 1 groups, the distributed ones one
  // expert at a time; the gradients are summed over micro-batches and ranks in another order)
  // differ by at most about n eps times the values summed: 4 n eps max|want|.
  const double eps = FLT_EPSILON;
  const double n = (double)(M * ranks * T * moe.topk + T + d +
                            moe.ffn * std::max<int64_t>(moe.shared, 1) + moe.experts);
  auto tol = [&](const Tensor& t) {  // the same on every rank: the largest value anywhere
    double largest = max_abs(t);
    comm.allreduce(&largest, 1, MPI_DOUBLE, MPI_MAX);
    return 4.0 * n * eps * std::max(largest, 1e-3);
  };
  if (rank == 0)
    std::printf("%s vs one process holding every expert (every micro-batch; gradients summed over "
                "ranks):\n", name);
  std::vector<Tensor> ys, ref_ys, dxs, ref_dxs;  // (M, T, d) each
  for (int64_t m = 0; m < M; m++) {
    ys.push_back(reshape(run.y[(size_t)m], {1, T, d}));
    ref_ys.push_back(reshape(ref.y[(size_t)m], {1, T, d}));
    if (prefill) continue;
    dxs.push_back(reshape(run.dx[(size_t)m], {1, T, d}));
    ref_dxs.push_back(reshape(ref.dx[(size_t)m], {1, T, d}));
  }
  check.close("y", concat(ys, 0), concat(ref_ys, 0), tol(concat(ref_ys, 0)));
  if (prefill) return;
  check.close("dx", concat(dxs, 0), concat(ref_dxs, 0), tol(concat(ref_dxs, 0)));
  for (size_t k = 0; k < run.attn_grads.size(); k++) {
    Tensor grad = run.attn_grads[k].clone();
    comm.allreduce_sum(grad);
    check.close((std::string("d ") + kAttentionNames[k]).c_str(), grad, ref.attn_grads[k],
                tol(ref.attn_grads[k]));
  }
  const int64_t local_experts = moe.experts / ranks;
  dsv3::Grads grads = run.grads;
  for (Tensor* t : {&grads.router_w, &grads.sw1, &grads.sw2, &grads.sw3})
    if (t->defined()) *t = t->clone(), comm.allreduce_sum(*t);
  auto mine = [&](const Tensor& t) {
    return slice(t, 0, rank * local_experts, (rank + 1) * local_experts);
  };
  const dsv3::Grads& want = ref.grads;
  check.close("d router_w", grads.router_w, want.router_w, tol(want.router_w));
  check.close("d w1 (each rank its experts)", grads.w1, mine(want.w1), tol(want.w1));
  check.close("d w2 (each rank its experts)", grads.w2, mine(want.w2), tol(want.w2));
  check.close("d w3 (each rank its experts)", grads.w3, mine(want.w3), tol(want.w3));
  if (moe.shared > 0) {
    check.close("d shared w1", grads.sw1, want.sw1, tol(want.sw1));
    check.close("d shared w2", grads.sw2, want.sw2, tol(want.sw2));
    check.close("d shared w3", grads.sw3, want.sw3, tol(want.sw3));
  }
}

}  // namespace ff::f1b
