// common/core/ops.cpp — every differentiable op: argument checks, the forward kernel of the
// inputs' device, and the hand-written backward next to it.
//
// Backward closures run with grad mode off (see run_backward), so they may use these
// same ops to express a gradient; they capture detached outputs, never the output itself.
#include "common/core/ops.h"

#include <algorithm>
#include <cmath>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "kernels/kernels.h"

namespace ff {

using Grads = std::vector<Tensor>;

static const KernelTable& kernels_of(const Tensor& t) { return kernels_for(t.device()); }

static void check_float(const Tensor& t, const char* op) {
  FF_CHECK(t.defined(), op << ": undefined tensor");
  FF_CHECK(t.dtype() == DType::f32, op << ": expected a float32 tensor, got " << dtype_name(t.dtype()));
}

static void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  FF_CHECK(a.device() == b.device(), op << ": tensors on different devices ("
                                        << device_name(a.device()) << " and "
                                        << device_name(b.device()) << "); use .to(device)");
}

static int64_t norm_dim(const Tensor& x, int64_t dim, const char* op) {
  int64_t n = x.dim();
  FF_CHECK(dim >= -n && dim < n,
           op << ": dim " << dim << " out of range for shape " << shape_str(x.shape()));
  return dim < 0 ? dim + n : dim;
}

// x viewed as [outer, shape[dim], inner]
static void split_at(const Shape& s, int64_t dim, int64_t* outer, int64_t* inner) {
  *outer = 1;
  *inner = 1;
  for (int64_t i = 0; i < dim; i++) *outer *= s[(size_t)i];
  for (size_t i = (size_t)dim + 1; i < s.size(); i++) *inner *= s[i];
}

// Rows view of x: C = last dim, N = everything before it.
static void rows_of(const Tensor& x, const char* op, int64_t* N, int64_t* C) {
  FF_CHECK(x.dim() >= 1, op << ": needs at least one dimension, got a scalar");
  *C = x.size(-1);
  FF_CHECK(*C > 0, op << ": the last dimension is empty in shape " << shape_str(x.shape()));
  *N = x.numel() / *C;
}

static void check_indices(const Tensor& idx, int64_t high, const char* op) {
  FF_CHECK(idx.dtype() == DType::i64, op << ": indices must be int64, got " << dtype_name(idx.dtype()));
  for (int64_t v : idx.to_index_vector())
    FF_CHECK(v >= 0 && v < high, op << ": index " << v << " out of range [0, " << high << ")");
}

// ---------------------------------------------------------------------------
// elementwise binary ops with broadcasting

static Broadcast broadcast_kind(const Tensor& a, const Tensor& b, const char* op) {
  if (b.shape() == a.shape()) return Broadcast::same;
  if (b.numel() == 1) return Broadcast::scalar;
  if (a.dim() >= 1 && b.dim() == 1 && b.size(0) == a.size(-1)) return Broadcast::row;
  if (a.dim() >= 1 && b.dim() == a.dim() && b.size(-1) == 1) {
    Shape sa = a.shape(), sb = b.shape();
    sa.pop_back();
    sb.pop_back();
    if (sa == sb) return Broadcast::col;
  }
  FF_CHECK(false, op << ": cannot broadcast shape " << shape_str(b.shape()) << " against "
                     << shape_str(a.shape())
                     << " (allowed: the same shape, the last dim, a trailing 1, or one element)");
  return Broadcast::same;
}

static Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b, Broadcast bc) {
  Tensor out = Tensor::empty(a.shape(), a.device());
  int64_t C = a.dim() ? a.size(-1) : 1;
  kernels_of(a).binary(op, out.data(), a.data(), b.data(), a.numel(), C == 0 ? 1 : C, bc);
  return out;
}

// Sums a gradient shaped like a down to the broadcast operand's shape.
static Tensor reduce_to(const Tensor& g, const Shape& b_shape, Broadcast bc) {
  switch (bc) {
    case Broadcast::same: return g;
    case Broadcast::scalar: return reshape(sum_all(g), b_shape);
    case Broadcast::row: {
      int64_t C = g.size(-1);
      return sum(reshape(g, {g.numel() / C, C}), 0);
    }
    case Broadcast::col: return sum(g, -1, true);
  }
  return g;
}

static Tensor binary_op(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  check_float(a, name);
  check_float(b, name);
  check_same_device(a, b, name);
  Broadcast bc = broadcast_kind(a, b, name);
  Tensor out = binary_raw(op, a, b, bc);
  Shape bs = b.shape();
  return record(out, name, {a, b}, [op, a, b, bc, bs](const Tensor& g) -> Grads {
    switch (op) {
      case BinaryOp::add: return {g, reduce_to(g, bs, bc)};
      case BinaryOp::sub: return {g, neg(reduce_to(g, bs, bc))};
      case BinaryOp::mul:
        return {binary_raw(BinaryOp::mul, g, b, bc), reduce_to(mul(g, a), bs, bc)};
      case BinaryOp::div: {
        // d(a/b)/db = -a / b^2
        Tensor ga_over_b2 = binary_raw(BinaryOp::div, binary_raw(BinaryOp::div, mul(g, a), b, bc), b, bc);
        return {binary_raw(BinaryOp::div, g, b, bc), neg(reduce_to(ga_over_b2, bs, bc))};
      }
    }
    return {};
  });
}

Tensor add(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::add, a, b, "add"); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::sub, a, b, "sub"); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::mul, a, b, "mul"); }
Tensor div(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::div, a, b, "div"); }

static Tensor affine_op(const Tensor& x, float alpha, float beta, const char* name) {
  check_float(x, name);
  Tensor out = Tensor::empty(x.shape(), x.device());
  kernels_of(x).affine(out.data(), x.data(), x.numel(), alpha, beta);
  return record(out, name, {x}, [alpha](const Tensor& g) -> Grads { return {scale(g, alpha)}; });
}

Tensor scale(const Tensor& x, float s) { return affine_op(x, s, 0.f, "scale"); }
Tensor add_scalar(const Tensor& x, float s) { return affine_op(x, 1.f, s, "add_scalar"); }

// ---------------------------------------------------------------------------
// elementwise unary ops

static Tensor unary_op(UnaryOp op, const Tensor& x, const char* name) {
  check_float(x, name);
  Tensor y = Tensor::empty(x.shape(), x.device());
  kernels_of(x).unary(op, y.data(), x.data(), x.numel());
  Tensor xs = x.detach(), ys = y.detach();
  return record(y, name, {x}, [op, xs, ys](const Tensor& g) -> Grads {
    Tensor dx = Tensor::empty(xs.shape(), xs.device());
    kernels_of(xs).unary_backward(op, dx.data(), xs.data(), ys.data(), g.data(), xs.numel());
    return {dx};
  });
}

Tensor neg(const Tensor& x) { return unary_op(UnaryOp::neg, x, "neg"); }
Tensor exp(const Tensor& x) { return unary_op(UnaryOp::exp, x, "exp"); }
Tensor log(const Tensor& x) { return unary_op(UnaryOp::log, x, "log"); }
Tensor sqrt(const Tensor& x) { return unary_op(UnaryOp::sqrt, x, "sqrt"); }
Tensor sigmoid(const Tensor& x) { return unary_op(UnaryOp::sigmoid, x, "sigmoid"); }
Tensor silu(const Tensor& x) { return unary_op(UnaryOp::silu, x, "silu"); }
Tensor relu(const Tensor& x) { return unary_op(UnaryOp::relu, x, "relu"); }

static Tensor masked_fill_raw(const Tensor& x, const Tensor& mask, float value) {
  Tensor out = Tensor::empty(x.shape(), x.device());
  kernels_of(x).masked_fill(out.data(), x.data(), mask.data(), x.numel(), mask.numel(), value);
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, float value) {
  check_float(x, "masked_fill");
  check_float(mask, "masked_fill (mask)");
  check_same_device(x, mask, "masked_fill");
  bool trailing = mask.dim() <= x.dim() && mask.numel() > 0 &&
                  std::equal(mask.shape().begin(), mask.shape().end(),
                             x.shape().end() - mask.dim());
  FF_CHECK(trailing, "masked_fill: mask shape " << shape_str(mask.shape())
                         << " must equal the trailing dims of " << shape_str(x.shape()));
  Tensor ms = mask.detach();
  return record(masked_fill_raw(x, mask, value), "masked_fill", {x, mask},
                [ms](const Tensor& g) -> Grads { return {masked_fill_raw(g, ms, 0.f), Tensor()}; });
}

// ---------------------------------------------------------------------------
// matmul

// ---- bfloat16

Tensor cast(const Tensor& x, DType to) {
  FF_CHECK(x.defined(), "cast: undefined tensor");
  const DType from = x.dtype();
  FF_CHECK((from == DType::f32 || from == DType::bf16) && (to == DType::f32 || to == DType::bf16),
           "cast: between float32 and bf16 only, got " << dtype_name(from) << " to " << dtype_name(to));
  if (from == to) return x;
  // the gradient of a rounding is taken as 1 (straight through): g, in the input's dtype
  return record(x.to_dtype(to), "cast", {x}, [from](const Tensor& g) -> Grads { return {g.to_dtype(from)}; });
}

// matmul of two bf16 tensors (matmul's shapes as computed there): c in float32. The backward's
// gradients are bf16 as the inputs are: dC rounded to bf16, multiplied in float32, rounded.
static Tensor matmul_bf16(const Tensor& a, const Tensor& b, int64_t B, int64_t M, int64_t N, int64_t Kd,
                          bool shared_b, const Shape& out_shape) {
  const int64_t stride_b = shared_b ? 0 : Kd * N;
  Tensor c = Tensor::empty(out_shape, a.device());
  kernels_of(a).matmul_bf16(c.data(), a.bf16_data(), b.bf16_data(), B, M, N, Kd, M * Kd, stride_b, false, false,
                            false);
  auto input_grad = [a, b, B, M, N, Kd, stride_b](const Tensor& g) -> Grads {
    const Tensor g16 = g.to_dtype(DType::bf16);
    Tensor da = Tensor::empty(a.shape(), a.device());
    kernels_of(a).matmul_bf16(da.data(), g16.bf16_data(), b.bf16_data(), B, M, Kd, N, M * N, stride_b, false,
                              true, false);
    return {da.to_dtype(DType::bf16), Tensor()};
  };
  auto weight_grad = [a, b, B, M, N, Kd, shared_b](const Tensor& g) -> Tensor {
    const Tensor g16 = g.to_dtype(DType::bf16);
    Tensor db = Tensor::empty(b.shape(), b.device());
    if (shared_b)
      kernels_of(a).matmul_bf16(db.data(), a.bf16_data(), g16.bf16_data(), 1, Kd, N, B * M, 0, 0, true, false,
                                false);
    else
      kernels_of(a).matmul_bf16(db.data(), a.bf16_data(), g16.bf16_data(), B, Kd, N, M, M * Kd, M * N, true,
                                false, false);
    return db.to_dtype(DType::bf16);
  };
  return record_split(c, "matmul_bf16", {a, b}, 1, input_grad, weight_grad);
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  // a float32 activation against a bf16 weight (mixed precision): the activation rounded to bf16
  // first, as a bf16 GEMM takes it; its gradient comes back float32 through the cast
  if (a.defined() && b.defined() && a.dtype() == DType::f32 && b.dtype() == DType::bf16)
    return matmul(cast(a, DType::bf16), b);
  const bool half = a.defined() && b.defined() && a.dtype() == DType::bf16 && b.dtype() == DType::bf16;
  if (!half) {
    check_float(a, "matmul");
    check_float(b, "matmul");
  }
  check_same_device(a, b, "matmul");
  FF_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: needs at least 2-D operands, got "
                                             << shape_str(a.shape()) << " @ " << shape_str(b.shape()));
  int64_t M = a.size(-2), Kd = a.size(-1), N = b.size(-1);
  FF_CHECK(b.size(-2) == Kd, "matmul: inner dimensions differ: " << shape_str(a.shape()) << " @ "
                                                                  << shape_str(b.shape()));
  int64_t B = 1;  // the product of the leading dims (not numel / (M K): K may be 0)
  for (int64_t i = 0; i + 2 < a.dim(); i++) B *= a.size(i);
  bool shared_b = b.dim() == 2;
  if (!shared_b) {
    FF_CHECK(b.dim() == a.dim() && std::equal(a.shape().begin(), a.shape().end() - 2, b.shape().begin()),
             "matmul: batch dims differ: " << shape_str(a.shape()) << " @ " << shape_str(b.shape())
                                           << " (b must be 2-D or have a's leading dims)");
  }
  Shape out_shape(a.shape().begin(), a.shape().end() - 2);
  out_shape.push_back(M);
  out_shape.push_back(N);
  if (half) return matmul_bf16(a, b, B, M, N, Kd, shared_b, out_shape);
  Tensor c = Tensor::empty(out_shape, a.device());
  int64_t stride_b = shared_b ? 0 : Kd * N;
  kernels_of(a).matmul(c.data(), a.data(), b.data(), B, M, N, Kd, M * Kd, stride_b, false, false, false);
  // dA = dC @ B^T (the input gradient); dB = A^T @ dC (the weight gradient, summed over the
  // batch when B is shared). Split, so that a zero-bubble pipeline can run dB later.
  auto input_grad = [a, b, B, M, N, Kd, stride_b](const Tensor& g) -> Grads {
    Tensor da = Tensor::empty(a.shape(), a.device());
    kernels_of(a).matmul(da.data(), g.data(), b.data(), B, M, Kd, N, M * N, stride_b, false, true, false);
    return {da, Tensor()};
  };
  auto weight_grad = [a, b, B, M, N, Kd, shared_b](const Tensor& g) -> Tensor {
    Tensor db = Tensor::empty(b.shape(), b.device());
    if (shared_b)
      kernels_of(a).matmul(db.data(), a.data(), g.data(), 1, Kd, N, B * M, 0, 0, true, false, false);
    else
      kernels_of(a).matmul(db.data(), a.data(), g.data(), B, Kd, N, M, M * Kd, M * N, true, false, false);
    return db;
  };
  return record_split(c, "matmul", {a, b}, 1, input_grad, weight_grad);
}

// ---------------------------------------------------------------------------
// shape and layout

Tensor reshape(const Tensor& x, const Shape& shape) {
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] == -1) {
      FF_CHECK(infer < 0, "reshape: more than one -1 in " << shape_str(shape));
      infer = (int64_t)i;
    } else {
      FF_CHECK(s[i] >= 0, "reshape: bad dimension in " << shape_str(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    FF_CHECK(known > 0 && x.numel() % known == 0,
             "reshape: cannot reshape " << shape_str(x.shape()) << " to " << shape_str(shape));
    s[(size_t)infer] = x.numel() / known;
  }
  FF_CHECK(shape_numel(s) == x.numel(),
           "reshape: cannot reshape " << shape_str(x.shape()) << " to " << shape_str(shape));
  Shape xs = x.shape();
  return record(x.view(s), "reshape", {x}, [xs](const Tensor& g) -> Grads { return {reshape(g, xs)}; });
}

// A bf16 tensor through an op that only moves numbers (transpose, slice, concat): the op on its
// float32 widening, narrowed back. Exact both ways (every bf16 value is a float32 value), and the
// casts carry the gradient: a bf16 tensor's gradient stays bf16.
static bool all_bf16(const std::vector<Tensor>& xs, const char* op) {
  bool any = false, all = true;
  for (const Tensor& t : xs) any = any || t.dtype() == DType::bf16, all = all && t.dtype() == DType::bf16;
  FF_CHECK(!any || all, op << ": bf16 tensors with tensors of another dtype");
  return any;
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  if (all_bf16({x}, "transpose")) return cast(transpose(cast(x, DType::f32), d0, d1), DType::bf16);
  check_float(x, "transpose");
  d0 = norm_dim(x, d0, "transpose");
  d1 = norm_dim(x, d1, "transpose");
  if (d0 > d1) std::swap(d0, d1);
  const Shape& s = x.shape();
  Shape os = s;
  std::swap(os[(size_t)d0], os[(size_t)d1]);
  Tensor out = Tensor::empty(os, x.device());
  if (d0 == d1) {
    device_memcpy(out.raw(), out.device(), x.raw(), x.device(), x.nbytes());
  } else {
    int64_t A = 1, Bm = 1, Cn = 1;
    for (int64_t i = 0; i < d0; i++) A *= s[(size_t)i];
    for (int64_t i = d0 + 1; i < d1; i++) Bm *= s[(size_t)i];
    for (size_t i = (size_t)d1 + 1; i < s.size(); i++) Cn *= s[i];
    kernels_of(x).transpose(out.data(), x.data(), A, s[(size_t)d0], Bm, s[(size_t)d1], Cn);
  }
  return record(out, "transpose", {x}, [d0, d1](const Tensor& g) -> Grads { return {transpose(g, d0, d1)}; });
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end) {
  if (all_bf16({x}, "slice")) return cast(slice(cast(x, DType::f32), dim, start, end), DType::bf16);
  check_float(x, "slice");
  dim = norm_dim(x, dim, "slice");
  int64_t n = x.size(dim);
  FF_CHECK(0 <= start && start <= end && end <= n,
           "slice: [" << start << ", " << end << ") outside [0, " << n << ") of dim " << dim);
  int64_t outer, inner;
  split_at(x.shape(), dim, &outer, &inner);
  Shape os = x.shape();
  os[(size_t)dim] = end - start;
  Tensor out = Tensor::empty(os, x.device());
  kernels_of(x).copy_block(out.data(), end - start, 0, x.data(), n, start, outer, end - start, inner, false);
  Shape xs = x.shape();
  Device dev = x.device();
  return record(out, "slice", {x}, [=](const Tensor& g) -> Grads {
    Tensor dx = Tensor::zeros(xs, dev);
    kernels_of(g).copy_block(dx.data(), n, start, g.data(), end - start, 0, outer, end - start, inner, false);
    return {dx};
  });
}

Tensor concat(const std::vector<Tensor>& xs, int64_t dim) {
  FF_CHECK(!xs.empty(), "concat: no tensors");
  if (all_bf16(xs, "concat")) {
    std::vector<Tensor> wide;
    for (const Tensor& t : xs) wide.push_back(cast(t, DType::f32));
    return cast(concat(wide, dim), DType::bf16);
  }
  for (const Tensor& t : xs) check_float(t, "concat");
  dim = norm_dim(xs[0], dim, "concat");
  Shape os = xs[0].shape();
  int64_t total = 0;
  for (const Tensor& t : xs) {
    check_same_device(xs[0], t, "concat");
    Shape a = t.shape(), b = xs[0].shape();
    FF_CHECK(a.size() == b.size(), "concat: ranks differ");
    a[(size_t)dim] = b[(size_t)dim] = 0;
    FF_CHECK(a == b, "concat: shapes " << shape_str(t.shape()) << " and " << shape_str(xs[0].shape())
                                       << " differ outside dim " << dim);
    total += t.size(dim);
  }
  os[(size_t)dim] = total;
  int64_t outer, inner;
  split_at(os, dim, &outer, &inner);
  Tensor out = Tensor::empty(os, xs[0].device());
  std::vector<int64_t> offsets;
  int64_t off = 0;
  for (const Tensor& t : xs) {
    kernels_of(t).copy_block(out.data(), total, off, t.data(), t.size(dim), 0, outer, t.size(dim), inner, false);
    offsets.push_back(off);
    off += t.size(dim);
  }
  std::vector<int64_t> sizes;
  for (const Tensor& t : xs) sizes.push_back(t.size(dim));
  return record(out, "concat", xs, [dim, offsets, sizes](const Tensor& g) -> Grads {
    Grads gs;
    for (size_t i = 0; i < sizes.size(); i++) gs.push_back(slice(g, dim, offsets[i], offsets[i] + sizes[i]));
    return gs;
  });
}

// ---------------------------------------------------------------------------
// reductions

static Shape reduced_shape(const Shape& s, int64_t dim, bool keepdim) {
  Shape os = s;
  if (keepdim) os[(size_t)dim] = 1;
  else os.erase(os.begin() + dim);
  return os;
}

// g (outer, inner) repeated n times along the middle dim -> (outer, n, inner)
static Tensor expand_along(const Tensor& g, const Shape& xs, int64_t outer, int64_t n, int64_t inner) {
  Tensor dx = Tensor::empty(xs, g.device());
  for (int64_t j = 0; j < n; j++)
    kernels_of(g).copy_block(dx.data(), n, j, g.data(), 1, 0, outer, 1, inner, false);
  return dx;
}

static Tensor reduce_op(ReduceOp op, const Tensor& x, int64_t dim, bool keepdim, const char* name) {
  check_float(x, name);
  dim = norm_dim(x, dim, name);
  int64_t outer, inner, n = x.size(dim);
  FF_CHECK(n > 0 || op == ReduceOp::sum, name << ": reducing an empty dim");
  split_at(x.shape(), dim, &outer, &inner);
  Tensor y = Tensor::empty(reduced_shape(x.shape(), dim, keepdim), x.device());
  kernels_of(x).reduce(op, y.data(), x.data(), outer, n, inner);
  Tensor xs = x.detach(), ys = y.detach();
  return record(y, name, {x}, [=](const Tensor& g) -> Grads {
    if (op == ReduceOp::sum) return {expand_along(g, xs.shape(), outer, n, inner)};
    Tensor dx = Tensor::empty(xs.shape(), xs.device());
    kernels_of(xs).max_backward(dx.data(), xs.data(), ys.data(), g.data(), outer, n, inner);
    return {dx};
  });
}

Tensor sum(const Tensor& x, int64_t dim, bool keepdim) { return reduce_op(ReduceOp::sum, x, dim, keepdim, "sum"); }
Tensor max(const Tensor& x, int64_t dim, bool keepdim) { return reduce_op(ReduceOp::max, x, dim, keepdim, "max"); }
Tensor mean(const Tensor& x, int64_t dim, bool keepdim) {
  check_float(x, "mean");
  int64_t n = x.size(norm_dim(x, dim, "mean"));
  FF_CHECK(n > 0, "mean: reducing an empty dim");
  return scale(sum(x, dim, keepdim), 1.f / (float)n);
}
Tensor sum_all(const Tensor& x) { return reshape(sum(reshape(x, {x.numel()}), 0), {}); }

// ---------------------------------------------------------------------------
// row ops

Tensor softmax(const Tensor& x) {
  check_float(x, "softmax");
  int64_t N, C;
  rows_of(x, "softmax", &N, &C);
  Tensor y = Tensor::empty(x.shape(), x.device());
  kernels_of(x).softmax_forward(y.data(), x.data(), N, C);
  Tensor ys = y.detach();
  return record(y, "softmax", {x}, [ys, N, C](const Tensor& g) -> Grads {
    Tensor dx = Tensor::empty(ys.shape(), ys.device());
    kernels_of(ys).softmax_backward(dx.data(), ys.data(), g.data(), N, C);
    return {dx};
  });
}

Tensor log_softmax(const Tensor& x) {
  check_float(x, "log_softmax");
  int64_t N, C;
  rows_of(x, "log_softmax", &N, &C);
  Tensor y = Tensor::empty(x.shape(), x.device());
  kernels_of(x).log_softmax_forward(y.data(), x.data(), N, C);
  Tensor ys = y.detach();
  return record(y, "log_softmax", {x}, [ys, N, C](const Tensor& g) -> Grads {
    Tensor dx = Tensor::empty(ys.shape(), ys.device());
    kernels_of(ys).log_softmax_backward(dx.data(), ys.data(), g.data(), N, C);
    return {dx};
  });
}

Tensor rmsnorm(const Tensor& x, const Tensor& weight, float eps) {
  check_float(x, "rmsnorm");
  check_float(weight, "rmsnorm (weight)");
  check_same_device(x, weight, "rmsnorm");
  int64_t N, C;
  rows_of(x, "rmsnorm", &N, &C);
  FF_CHECK(weight.shape() == Shape{C}, "rmsnorm: weight shape " << shape_str(weight.shape())
                                           << " must be (" << C << ")");
  FF_CHECK(eps >= 0.f, "rmsnorm: eps must be >= 0");
  Tensor y = Tensor::empty(x.shape(), x.device());
  Tensor rstd = Tensor::empty({N}, x.device());
  kernels_of(x).rmsnorm_forward(y.data(), rstd.data(), x.data(), weight.data(), N, C, eps);
  Tensor xs = x.detach(), ws = weight.detach();
  return record(y, "rmsnorm", {x, weight}, [xs, ws, rstd, N, C](const Tensor& g) -> Grads {
    Tensor dx = Tensor::empty(xs.shape(), xs.device());
    Tensor dw = Tensor::empty(ws.shape(), ws.device());
    kernels_of(xs).rmsnorm_backward(dx.data(), dw.data(), g.data(), xs.data(), ws.data(), rstd.data(), N, C);
    return {dx, dw};
  });
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets) {
  check_float(logits, "cross_entropy");
  check_same_device(logits, targets, "cross_entropy");
  FF_CHECK(logits.dim() == 2, "cross_entropy: logits must be (N, V), got " << shape_str(logits.shape()));
  int64_t N = logits.size(0), V = logits.size(1);
  FF_CHECK(N > 0 && V > 0, "cross_entropy: empty logits " << shape_str(logits.shape()));
  FF_CHECK(targets.shape() == Shape{N}, "cross_entropy: targets shape " << shape_str(targets.shape())
                                            << " must be (" << N << ")");
  check_indices(targets, V, "cross_entropy");
  Tensor loss = Tensor::empty({N}, logits.device());
  Tensor lse = Tensor::empty({N}, logits.device());
  kernels_of(logits).cross_entropy_forward(loss.data(), lse.data(), logits.data(), targets.index_data(), N, V);
  Tensor mean_loss;
  {
    NoGradGuard no_grad;
    mean_loss = scale(sum_all(loss), 1.f / (float)N);
  }
  Tensor ls = logits.detach();
  return record(mean_loss, "cross_entropy", {logits, targets}, [ls, lse, targets, N, V](const Tensor& g) -> Grads {
    Tensor dloss = Tensor::full({N}, g.item() / (float)N, g.device());
    Tensor dlogits = Tensor::empty(ls.shape(), ls.device());
    kernels_of(ls).cross_entropy_backward(dlogits.data(), ls.data(), lse.data(), targets.index_data(),
                                 dloss.data(), N, V);
    return {dlogits, Tensor()};
  });
}

Tensor index_select(const Tensor& x, const Tensor& idx) {
  check_float(x, "index_select");
  check_same_device(x, idx, "index_select");
  FF_CHECK(x.dim() == 2, "index_select: x must be (N, C), got " << shape_str(x.shape()));
  FF_CHECK(idx.dim() == 1, "index_select: indices must be 1-D, got " << shape_str(idx.shape()));
  int64_t N = x.size(0), C = x.size(1), M = idx.size(0);
  check_indices(idx, N, "index_select");
  Tensor out = Tensor::empty({M, C}, x.device());
  kernels_of(x).index_select_rows(out.data(), x.data(), idx.index_data(), M, C);
  Shape xs = x.shape();
  return record(out, "index_select", {x, idx}, [xs, idx, M, C](const Tensor& g) -> Grads {
    Tensor dx = Tensor::zeros(xs, g.device());
    kernels_of(g).index_add_rows(dx.data(), g.data(), idx.index_data(), M, C);
    return {dx, Tensor()};
  });
}

Tensor embedding(const Tensor& weight, const Tensor& idx) {
  check_float(weight, "embedding");
  FF_CHECK(weight.dim() == 2, "embedding: weight must be (V, C), got " << shape_str(weight.shape()));
  check_indices(idx, weight.size(0), "embedding");  // so a bad index names this op
  Shape os = idx.shape();
  os.push_back(weight.size(1));
  return reshape(index_select(weight, reshape(idx, {idx.numel()})), os);
}

Tensor index_add(const Tensor& base, const Tensor& idx, const Tensor& src) {
  check_float(base, "index_add");
  check_float(src, "index_add (src)");
  check_same_device(base, src, "index_add");
  check_same_device(base, idx, "index_add");
  FF_CHECK(base.dim() == 2, "index_add: base must be (N, C), got " << shape_str(base.shape()));
  FF_CHECK(idx.dim() == 1, "index_add: indices must be 1-D, got " << shape_str(idx.shape()));
  int64_t M = idx.size(0), C = base.size(1);
  FF_CHECK(src.shape() == (Shape{M, C}), "index_add: src shape " << shape_str(src.shape())
                                             << " must be (" << M << ", " << C << ")");
  check_indices(idx, base.size(0), "index_add");
  Tensor out = base.clone();
  kernels_of(base).index_add_rows(out.data(), src.data(), idx.index_data(), M, C);
  return record(out, "index_add", {base, idx, src},
                [idx](const Tensor& g) -> Grads { return {g, Tensor(), index_select(g, idx)}; });
}

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) {
  check_float(x, "topk");
  int64_t N, C;
  rows_of(x, "topk", &N, &C);
  FF_CHECK(k >= 1 && k <= C, "topk: k = " << k << " must be in [1, " << C << "]");
  Shape os = x.shape();
  os.back() = k;
  Tensor vals = Tensor::empty(os, x.device());
  Tensor idx = Tensor::empty(os, x.device(), DType::i64);
  kernels_of(x).topk_rows(vals.data(), idx.index_data(), x.data(), N, C, k);
  Shape xs = x.shape();
  vals = record(vals, "topk", {x}, [xs, idx, N, C, k](const Tensor& g) -> Grads {
    Tensor dx = Tensor::empty(xs, g.device());
    kernels_of(g).topk_backward(dx.data(), g.data(), idx.index_data(), N, C, k);
    return {dx};
  });
  return {vals, idx};
}

// ---------------------------------------------------------------------------
// positions

// Rotary position embedding; the kernels are kernels/cpu/rope.cpp and kernels/cuda/rope.cu.
Tensor rope(const Tensor& x, const Tensor& positions, float theta) {
  check_float(x, "rope");
  FF_CHECK(positions.defined(), "rope: undefined positions tensor");
  check_same_device(x, positions, "rope");
  FF_CHECK(x.dim() >= 2, "rope: x must be (T, D) or (T, ..., D), got " << shape_str(x.shape()));
  int64_t T = x.size(0), D = x.size(-1);
  FF_CHECK(D > 0 && D % 2 == 0, "rope: the last dim D = " << D << " of " << shape_str(x.shape())
                                     << " must be even and > 0 (it holds D/2 pairs)");
  FF_CHECK(positions.dtype() == DType::i64,
           "rope: positions must be int64, got " << dtype_name(positions.dtype()));
  FF_CHECK(positions.shape() == Shape{T}, "rope: positions shape " << shape_str(positions.shape())
                                              << " must be (" << T << "), one per token of x "
                                              << shape_str(x.shape()));
  FF_CHECK(std::isfinite(theta) && theta > 0.f, "rope: theta = " << theta << " must be > 0");
  for (int64_t p : positions.to_index_vector())
    FF_CHECK(p >= 0, "rope: position " << p << " is negative (positions must be >= 0)");
  int64_t M = T > 0 ? x.numel() / (T * D) : 0;  // the middle dims: heads sharing a position
  Tensor y = Tensor::empty(x.shape(), x.device());
  kernels_of(x).rope(y.data(), x.data(), positions.index_data(), T, M, D, theta, +1);
  Tensor ps = positions.detach();
  return record(y, "rope", {x, positions}, [ps, T, M, D, theta](const Tensor& g) -> Grads {
    // y = R(a) x with R orthogonal, so dx = R(a)^T g = R(-a) g
    Tensor dx = Tensor::empty(g.shape(), g.device());
    kernels_of(g).rope(dx.data(), g.data(), ps.index_data(), T, M, D, theta, -1);
    return {dx, Tensor()};
  });
}

}  // namespace ff
