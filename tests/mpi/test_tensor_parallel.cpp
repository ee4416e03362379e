// Tensor and sequence parallelism under mpirun (common/layers/tensor_parallel.h), at any world
// size 1..4, the whole world being the TP group. Every rank builds the full weights and inputs
// from the counter-based RNG, runs the full SwiGLU MLP y = (silu(x W1) * (x W3)) W2 as one
// process would, and compares its sharded run with the matching part of it.
//
// Tolerances are derived, not tuned. The sharded run computes the same products as the full
// one; only the order of some sums differs (a matmul kernel's blocking over the shard's width,
// the all-reduce or reduce-scatter adding P partials, where the full matmul added all terms in
// one sum). A sum of K products computed in any order is within γ_K Σ|a_k b_k| of the exact
// one (γ_K = K u / (1 - K u), u = 2^-24), so two orders differ by at most 2 γ_K (|A||B|) per
// element. Differences already present in an operand propagate to first order: through a
// matmul by at most tol(A) · max column sum of |B|, through silu by |silu'| ≤ 1.1 (and
// |silu''| ≤ 0.5 for silu'), through a product by the other factor's magnitude; each
// elementwise op adds its own rounding (u per operation, on each side). Each tolerance below is
// that bound with the maxima taken over the full tensors, and each must also stay below 1e-3
// of the values it guards (a CHECK): a loose tolerance could not catch a bug.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "common/layers/tensor_parallel.h"

using namespace ff;

namespace {

Comm world() {
  Comm c = Comm::world(nullptr, nullptr);
  c.set_timeout(30);  // a broken collective ends as a watchdog line, never a hang
  return c;
}

constexpr double kU = 1.0 / (1 << 24);
double gamma_k(double k) { return k * kU / (1 - k * kU); }

// T tokens divide by 1, 2, 3 and 4 (SP needs it); F = 22 splits unevenly over 3 and 4 ranks.
constexpr int64_t kT = 12, kD = 16, kF = 22;

struct Weights {
  Tensor x, w1, w3, w2, dy;  // full, on every rank
};
Weights make_weights() {
  Weights w;
  w.x = randn({kT, kD}, 101);
  w.w1 = scale(randn({kD, kF}, 102), 1.f / std::sqrt((float)kD));
  w.w3 = scale(randn({kD, kF}, 103), 1.f / std::sqrt((float)kD));
  w.w2 = scale(randn({kF, kD}, 104), 1.f / std::sqrt((float)kF));
  w.dy = randn({kT, kD}, 105);
  return w;
}

Tensor host_map(const Tensor& t, float (*fn)(float)) {
  std::vector<float> v = t.to_vector();
  for (float& e : v) e = fn(e);
  return Tensor::from_vector(v, t.shape());
}
float fabs_(float a) { return std::fabs(a); }
float silu_grad(float a) {
  const float s = 1.f / (1.f + std::exp(-a));
  return s * (1.f + a * (1.f - s));
}
// max over the elements of |A| |B|: the Σ|a_k b_k| of the summation bound
double mm_bound(const Tensor& a, const Tensor& b) {
  return max_abs(matmul(host_map(a, fabs_), host_map(b, fabs_)));
}
// max over columns j of Σ_k |B_kj|
double col_sum(const Tensor& b) { return mm_bound(Tensor::full({1, b.size(0)}, 1.f), b); }
Tensor tr(const Tensor& t) { return transpose(t, 0, 1); }

struct Tols {
  double y, dx, dw1, dw3, dw2;
};
Tols derive(const Weights& w, int P) {
  NoGradGuard ng;
  const Tensor a1 = matmul(w.x, w.w1), a3 = matmul(w.x, w.w3), s = silu(a1), h = mul(s, a3);
  const double ta = 2 * gamma_k(kD) * std::max(mm_bound(w.x, w.w1), mm_bound(w.x, w.w3));
  const double th = 1.1 * ta * max_abs(a3) + max_abs(s) * ta + 2 * kU * max_abs(h);
  Tols t;
  t.y = 2 * gamma_k(kF + P) * mm_bound(h, w.w2) + th * col_sum(w.w2);
  const Tensor dh = matmul(w.dy, tr(w.w2));
  const double tdh = 2 * gamma_k(kD) * mm_bound(w.dy, tr(w.w2));
  const Tensor da1 = mul(mul(dh, a3), host_map(a1, silu_grad)), da3 = mul(dh, s);
  const double tda1 = 1.1 * (tdh * max_abs(a3) + max_abs(dh) * ta) +
                      0.5 * max_abs(dh) * max_abs(a3) * ta + 4 * kU * max_abs(da1);
  const double tda3 = tdh * max_abs(s) + max_abs(dh) * 1.1 * ta + 2 * kU * max_abs(da3);
  t.dw2 = 2 * gamma_k(kT) * mm_bound(tr(h), w.dy) + th * col_sum(w.dy);
  t.dw1 = 2 * gamma_k(kT) * mm_bound(tr(w.x), da1) + tda1 * col_sum(w.x);
  t.dw3 = 2 * gamma_k(kT) * mm_bound(tr(w.x), da3) + tda3 * col_sum(w.x);
  t.dx = 2 * gamma_k(2 * kF + P) * (mm_bound(da1, tr(w.w1)) + mm_bound(da3, tr(w.w3))) +
         tda1 * col_sum(tr(w.w1)) + tda3 * col_sum(tr(w.w3));
  return t;
}

struct Grads {
  Tensor y, dx, dw1, dw3, dw2;
};

// The full MLP, as one process runs it.
Grads full_mlp(const Weights& w) {
  Tensor x = w.x.clone().requires_grad_(), w1 = w.w1.clone().requires_grad_(),
         w3 = w.w3.clone().requires_grad_(), w2 = w.w2.clone().requires_grad_();
  Tensor y = matmul(mul(silu(matmul(x, w1)), matmul(x, w3)), w2);
  y.backward(w.dy);
  return {y.detach(), x.grad(), w1.grad(), w3.grad(), w2.grad()};
}

// How the sharded MLP is written: f once, shared by both column-parallel matmuls (one
// all-reduce in the backward), or the column_parallel helper for each (two, same result).
// f_without_allreduce: the classic TP bug planted, f's backward without its all-reduce (each
// rank's dx only its own columns' contribution), so that the test shows a check catches it.
enum class Form { shared_f, helpers, f_without_allreduce };

Tensor f_without_allreduce(const Tensor& x) {
  return record(x.detach(), "tp_f_without_allreduce", {x},
                [](const Tensor& dy) -> std::vector<Tensor> { return {dy}; });
}

// TP: x replicated; W1, W3 column-parallel, W2 row-parallel. One all-reduce forward (g).
Grads tp_mlp(const Weights& w, Comm& tp, Form form) {
  const int r = tp.rank(), P = tp.size();
  Tensor x = w.x.clone().requires_grad_(), w1 = tp::column_shard(w.w1, r, P).requires_grad_(),
         w3 = tp::column_shard(w.w3, r, P).requires_grad_(),
         w2 = tp::row_shard(w.w2, r, P).requires_grad_();
  Tensor a1, a3;
  if (form != Form::helpers) {
    const Tensor xf = form == Form::shared_f ? tp::f(x, tp) : f_without_allreduce(x);
    a1 = matmul(xf, w1);
    a3 = matmul(xf, w3);
  } else {
    a1 = tp::column_parallel(x, w1, tp);
    a3 = tp::column_parallel(x, w3, tp);
  }
  Tensor y = tp::row_parallel(mul(silu(a1), a3), w2, tp);
  y.backward(w.dy);
  return {y.detach(), x.grad(), w1.grad(), w3.grad(), w2.grad()};
}

// SP: x and y split along tokens; gather_seq before the column-parallel matmuls, scatter_seq
// after the row-parallel one.
Grads sp_mlp(const Weights& w, Comm& tp, Form form) {
  const int r = tp.rank(), P = tp.size();
  const int64_t n = kT / P;
  Tensor x = slice(w.x, 0, r * n, (r + 1) * n).clone().requires_grad_(),
         w1 = tp::column_shard(w.w1, r, P).requires_grad_(),
         w3 = tp::column_shard(w.w3, r, P).requires_grad_(),
         w2 = tp::row_shard(w.w2, r, P).requires_grad_();
  Tensor a1, a3;
  if (form == Form::shared_f) {
    const Tensor xg = tp::gather_seq(x, tp);
    a1 = matmul(xg, w1);
    a3 = matmul(xg, w3);
  } else {
    a1 = tp::column_parallel_sp(x, w1, tp);
    a3 = tp::column_parallel_sp(x, w3, tp);
  }
  Tensor y = tp::row_parallel_sp(mul(silu(a1), a3), w2, tp);
  y.backward(slice(w.dy, 0, r * n, (r + 1) * n).clone());
  return {y.detach(), x.grad(), w1.grad(), w3.grad(), w2.grad()};
}

// got vs want within tol; and tol small enough to mean something
void check_close(const char* what, const Tensor& got, const Tensor& want, double tol) {
  REQUIRE(got.defined());
  REQUIRE(got.shape() == want.shape());
  const Diff d = compare(got, want, tol);
  INFO(what << ": max abs err " << d.max_abs << ", tol " << tol << ", values up to "
            << max_abs(want));
  CHECK(d.pass);
  CHECK(tol < 1e-3 * max_abs(want));
}

// Compares a sharded run with the full one: the rows [row_b, row_e) of y and dx (all of them
// without SP), this rank's column shards of dW1 and dW3 and its row shard of dW2.
void check_all(const Grads& got, const Grads& full, const Tols& t, Comm& tp, int64_t row_b,
               int64_t row_e) {
  const int r = tp.rank(), P = tp.size();
  check_close("y", got.y, slice(full.y, 0, row_b, row_e), t.y);
  check_close("dx", got.dx, slice(full.dx, 0, row_b, row_e), t.dx);
  check_close("dW1 shard", got.dw1, tp::column_shard(full.dw1, r, P), t.dw1);
  check_close("dW3 shard", got.dw3, tp::column_shard(full.dw3, r, P), t.dw3);
  check_close("dW2 shard", got.dw2, tp::row_shard(full.dw2, r, P), t.dw2);
}

}  // namespace

TEST_CASE("tensor parallel: column/row SwiGLU MLP equals the full MLP, forward and gradients") {
  Comm tp = world();
  const Weights w = make_weights();
  const Grads full = full_mlp(w);
  const Tols t = derive(w, tp.size());
  for (Form form : {Form::shared_f, Form::helpers}) {
    CAPTURE(tp.size());
    CAPTURE(form == Form::shared_f ? "f shared" : "column_parallel helpers");
    check_all(tp_mlp(w, tp, form), full, t, tp, 0, kT);
  }
}

TEST_CASE("tensor parallel: the shards cover the full weight") {
  Comm tp = world();
  const Weights w = make_weights();
  std::vector<Tensor> cols, rows;
  for (int r = 0; r < tp.size(); r++) {
    cols.push_back(tp::column_shard(w.w1, r, tp.size()));
    rows.push_back(tp::row_shard(w.w2, r, tp.size()));
  }
  CHECK(bitwise_equal(concat(cols, 1), w.w1));
  CHECK(bitwise_equal(concat(rows, 0), w.w2));
}

TEST_CASE("tensor parallel + sequence parallel: tokens split, this rank's rows equal the full MLP's") {
  Comm tp = world();
  const Weights w = make_weights();
  const Grads full = full_mlp(w);
  const Tols t = derive(w, tp.size());
  const int64_t n = kT / tp.size();
  for (Form form : {Form::shared_f, Form::helpers}) {
    CAPTURE(tp.size());
    CAPTURE(form == Form::shared_f ? "gather_seq shared" : "column_parallel_sp helpers");
    check_all(sp_mlp(w, tp, form), full, t, tp, tp.rank() * n, (tp.rank() + 1) * n);
  }
}

TEST_CASE("sequence parallel: gather_seq's bf16 wire sends the values a bf16 matmul reads, in half the bytes") {
  // The gathered rows then a matmul with bf16 weights: forward, the input's gradient and the
  // weight's gradient are the bits of the float32 gather's; the all-gather moves 2 bytes a number.
  Comm tp = world();
  const int r = tp.rank(), P = tp.size();
  const int64_t n = 3, K = 8, N = 5;
  const Tensor w = randn({K, N}, 41).to_dtype(DType::bf16);
  Tensor out[2], dx[2], dw[2];
  size_t bytes[2];
  for (int wire = 0; wire < 2; wire++) {
    Tensor x = randn({n, K}, 900 + (uint64_t)r).requires_grad_(), wk = w.clone().requires_grad_();
    tp.reset_collective_counts();
    Tensor y = matmul(tp::gather_seq(x, tp, wire == 1), wk);
    bytes[wire] = tp.collective_counts().at("allgather").bytes;
    y.backward(randn({P * n, N}, 77));
    out[wire] = y.detach(), dx[wire] = x.grad(), dw[wire] = wk.grad();
  }
  CHECK(bitwise_equal(out[0], out[1]));
  CHECK(bitwise_equal(dx[0], dx[1]));
  CHECK(bitwise_equal(dw[0], dw[1]));
  const size_t count = sizeof(int64_t) * (size_t)P;  // the token-count check's allgather
  CHECK(bytes[0] == count + (size_t)(P * n * K) * 4);
  CHECK(bytes[1] == count + (size_t)(P * n * K) * 2);
  // and the rows arrive rounded to bf16: a float32 matmul would see the difference
  Tensor x = randn({n, K}, 900 + (uint64_t)r);
  CHECK(bitwise_equal(tp::gather_seq(x, tp, true), tp::gather_seq(x.to_dtype(DType::bf16).to_dtype(DType::f32), tp)));
  CHECK(!bitwise_equal(tp::gather_seq(x, tp, true), tp::gather_seq(x, tp)));
}

TEST_CASE("tensor parallel: a planted bug (f without its backward all-reduce) is caught") {
  Comm tp = world();
  const Weights w = make_weights();
  const Grads full = full_mlp(w);
  const Tols t = derive(w, tp.size());
  const Grads bad = tp_mlp(w, tp, Form::f_without_allreduce);
  CAPTURE(tp.size());
  const Diff d = compare(bad.dx, full.dx, t.dx);
  if (tp.size() == 1) {
    CHECK(d.pass);  // one rank: the all-reduce is the identity, nothing is missing
  } else {
    CHECK_FALSE(d.pass);       // dx lacks the other ranks' columns' contributions
    CHECK(d.max_abs > 100 * t.dx);  // by far more than rounding
  }
  // The forward does not see the bug, nor do the weight gradients: only dx does.
  CHECK(compare(bad.y, full.y, t.y).pass);
  CHECK(compare(bad.dw1, tp::column_shard(full.dw1, tp.rank(), tp.size()), t.dw1).pass);
  // And with f itself, the same run is right.
  CHECK(compare(tp_mlp(w, tp, Form::shared_f).dx, full.dx, t.dx).pass);
}

TEST_CASE("tensor parallel: bad sequence lengths are an ff::Error on every rank, never a hang") {
  Comm tp = world();
  const int P = tp.size();
  int errors = 0, expected = 0;
  std::string msg;
  // scatter_seq of P + 1 tokens: not divisible by P > 1
  if (P > 1) {
    expected++;
    try {
      tp::scatter_seq(randn({P + 1, 4}, 7), tp);
    } catch (const Error& e) {
      errors++;
      msg = e.what();
    }
    CHECK(msg.find("must divide by the tensor-parallel size") != std::string::npos);
    // gather_seq with rank 0 holding one token more than the others
    expected++;
    try {
      tp::gather_seq(randn({2 + (tp.rank() == 0 ? 1 : 0), 4}, 8), tp);
    } catch (const Error& e) {
      errors++;
      CHECK(std::string(e.what()).find("same number of tokens") != std::string::npos);
    }
  }
  // a 0-d tensor has no sequence dim (at any P)
  expected++;
  try {
    tp::gather_seq(Tensor::zeros({}), tp);
  } catch (const Error&) {
    errors++;
  }
  CHECK(errors == expected);
  // Every rank got here (a collective completes) and every rank threw each time.
  int all = errors;
  tp.allreduce(&all, 1, MPI_INT, MPI_SUM);
  CHECK(all == expected * P);
  // The group still works after the errors.
  Tensor one = Tensor::full({1}, 1.f);
  CHECK(tp::g(one, tp).item() == (float)P);
}
