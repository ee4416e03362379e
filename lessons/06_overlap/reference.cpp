// lessons/06_overlap/reference.cpp — the one-process reference (reference.h).
#include "lessons/06_overlap/reference.h"

#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/layers/model.h"

namespace ff::f1b {

Reference reference(Comm& comm, const Setup& s, const Weights& w0, bool prefill) {
  Weights w = w0;  // its own leaves: the gradients must not mix with the runs'
  for (Tensor* t : attention_leaves(w)) *t = t->detach().clone().requires_grad_(true);
  const Tensor mask = model::causal_mask(s.T, s.dev);
  dsv3::Config c = s.c;
  c.seq_len = s.T;
  Reference ref;
  auto acc = [](Tensor& sum, const Tensor& t) { sum = sum.defined() ? add(sum, t) : t; };
  for (int m = 0; m < (int)s.M; m++) {
    Tensor x, dy;
    draw(s, comm.rank(), comm.size(), m, &x, &dy);
    if (prefill) {
      NoGradGuard no_grad;
      Tensor h = attention_block(w, x, s.H, mask);
      ref.y.push_back(add(h, dsv3::forward(c, w.full, rmsnorm(h, w.g2)).y));
      continue;
    }
    x.requires_grad_(true);
    Tensor h = attention_block(w, x, s.H, mask);
    Tensor hn = h.detach();
    hn.requires_grad_(true);
    Tensor u_tape = rmsnorm(hn, w.g2);
    Tensor u = u_tape.detach();
    NoGradGuard no_grad;
    dsv3::Forward f = dsv3::forward(c, w.full, u);
    ref.y.push_back(add(h.detach(), f.y));
    dsv3::Grads g = dsv3::backward(c, w.full, u, f, dy);
    run_backward(u_tape, g.dx);
    run_backward(h, add(dy, hn.grad()));
    ref.dx.push_back(x.grad());
    acc(ref.g.router_w, g.router_w), acc(ref.g.w1, g.w1), acc(ref.g.w2, g.w2), acc(ref.g.w3, g.w3);
    if (c.shared > 0) acc(ref.g.sw1, g.sw1), acc(ref.g.sw2, g.sw2), acc(ref.g.sw3, g.sw3);
  }
  if (prefill) return ref;
  for (Tensor* t : attention_leaves(w)) {
    Tensor g = t->grad().clone();
    comm.allreduce_sum(g);
    ref.attn_grads.push_back(g);
  }
  for (Tensor* t : {&ref.g.router_w, &ref.g.w1, &ref.g.w2, &ref.g.w3, &ref.g.sw1, &ref.g.sw2,
                    &ref.g.sw3})
    if (t->defined()) comm.allreduce_sum(*t);
  return ref;
}

}  // namespace ff::f1b
