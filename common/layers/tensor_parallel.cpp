// common/layers/tensor_parallel.cpp — see tensor_parallel.h.
#include "common/layers/tensor_parallel.h"

#include <string>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"

namespace ff::tp {

namespace {

// The sum of t over the group, a new tensor on t's device (Comm stages non-cpu tensors).
Tensor allreduced(const Tensor& t, Comm& tp) {
  Tensor out = t.detach().clone();
  if (tp.size() > 1) tp.allreduce_sum(out);
  return out;
}

void check_f32(const Tensor& x, const char* op) {
  FF_CHECK(x.defined(), op << ": undefined tensor");
  FF_CHECK(x.dtype() == DType::f32, op << ": needs a float32 tensor");
  FF_CHECK(x.dim() >= 1, op << ": needs a tensor with a sequence dim 0, got a 0-d tensor");
}

// All-gather along dim 0: every rank's (n, ...) rows, in rank order, as (P n, ...), of x's dtype.
Tensor gather_rows(const Tensor& x, Comm& tp) {
  Shape s = x.shape();
  s[0] *= tp.size();
  Tensor all = Tensor::empty(s, x.device(), x.dtype());
  tp.allgather(x, all);
  return all;
}

// Reduce-scatter along dim 0: (T, ...) partials -> this rank's (T / P, ...) rows of the sum.
Tensor reduce_scatter_rows(const Tensor& x, Comm& tp) {
  Shape s = x.shape();
  s[0] /= tp.size();
  Tensor mine = Tensor::empty(s, x.device());
  tp.reduce_scatter_sum(x, mine);
  return mine;
}

void check_divisible(const Tensor& x, Comm& tp, const char* op) {
  FF_CHECK(x.size(0) % tp.size() == 0,
           op << ": the sequence dim 0 of " << shape_str(x.shape()) << " (" << x.size(0)
              << " tokens) must divide by the tensor-parallel size " << tp.size()
              << " (sequence parallelism gives every TP rank the same number of tokens)");
}

}  // namespace

Tensor f(const Tensor& x, Comm& tp) {
  check_f32(x, "tp::f");
  // [exercise:tp-f] Megatron's f, before a column-parallel matmul: the identity forward; in the backward, the gradient summed over the TP group.
  Comm c = tp;
  // Identity forward: a new tensor sharing x's storage, so that the tape has its own node.
  return record(x.detach(), "tp_f", {x}, [c](const Tensor& dy) mutable -> std::vector<Tensor> {
    return {allreduced(dy, c)};
  });
  // [/exercise]
}

Tensor g(const Tensor& x, Comm& tp) {
  check_f32(x, "tp::g");
  // [exercise:tp-g] Megatron's g, after a row-parallel matmul: the partial outputs summed over the TP group; in the backward, the identity.
  return record(allreduced(x, tp), "tp_g", {x},
                [](const Tensor& dy) -> std::vector<Tensor> { return {dy}; });
  // [/exercise]
}

Tensor gather_seq(const Tensor& x, Comm& tp, bool bf16_wire) {
  check_f32(x, "tp::gather_seq");
  // Every rank must contribute the same number of rows; agree on it first, so that a mismatch
  // is the same ff::Error on every rank instead of a malformed all-gather.
  int64_t n = x.size(0);
  std::vector<int64_t> ns(tp.size());
  tp.allgather(&n, sizeof n, ns.data());
  for (int r = 0; r < tp.size(); r++)
    FF_CHECK(ns[r] == n, "tp::gather_seq: every TP rank must hold the same number of tokens; rank "
                             << r << " holds " << ns[r] << ", rank " << tp.rank() << " holds "
                             << n);
  Comm c = tp;
  const Tensor all = bf16_wire ? gather_rows(x.detach().to_dtype(DType::bf16), tp).to_dtype(DType::f32)
                               : gather_rows(x, tp);
  return record(all, "tp_gather_seq", {x},
                [c](const Tensor& dy) mutable -> std::vector<Tensor> {
                  return {reduce_scatter_rows(dy, c)};
                });
}

Tensor scatter_seq(const Tensor& x, Comm& tp) {
  check_f32(x, "tp::scatter_seq");
  check_divisible(x, tp, "tp::scatter_seq");
  Comm c = tp;
  return record(reduce_scatter_rows(x, tp), "tp_scatter_seq", {x},
                [c](const Tensor& dy) mutable -> std::vector<Tensor> {
                  return {gather_rows(dy, c)};
                });
}

Tensor column_parallel(const Tensor& x, const Tensor& w_shard, Comm& tp) {
  return matmul(f(x, tp), w_shard);
}

Tensor row_parallel(const Tensor& x_shard, const Tensor& w_shard, Comm& tp) {
  return g(matmul(x_shard, w_shard), tp);
}

Tensor column_parallel_sp(const Tensor& x, const Tensor& w_shard, Comm& tp) {
  return matmul(gather_seq(x, tp), w_shard);
}

Tensor row_parallel_sp(const Tensor& x_shard, const Tensor& w_shard, Comm& tp) {
  return scatter_seq(matmul(x_shard, w_shard), tp);
}

// Rank r's part of w (2-D) along dim, by the repo's split rule (uneven splits allowed).
static Tensor shard(const Tensor& w, int64_t dim, int r, int P, const char* what) {
  FF_CHECK(w.dim() == 2, "tp::" << what << ": needs a 2-D weight, got " << shape_str(w.shape()));
  FF_CHECK(P >= 1 && r >= 0 && r < P, "tp::" << what << ": rank " << r << " of " << P);
  int64_t b, e;
  split_range(w.size(dim), P, r, &b, &e);
  NoGradGuard ng;
  return slice(w.detach(), dim, b, e).clone();
}

Tensor column_shard(const Tensor& w, int r, int P) { return shard(w, 1, r, P, "column_shard"); }
Tensor row_shard(const Tensor& w, int r, int P) { return shard(w, 0, r, P, "row_shard"); }

}  // namespace ff::tp
