// common/core/ops.h — differentiable ops. Each op checks its arguments, runs the kernel
// of its inputs' device (kernels_for(device)), and records a hand-written backward.
//
// Shapes: "rows" ops (softmax, rmsnorm, cross_entropy, topk, index ops) act on the
// last dim and treat all leading dims as rows. Negative dims count from the end.
#pragma once
#include <utility>
#include <vector>

#include "common/core/tensor.h"

namespace ff {

// ---- elementwise. b broadcasts against a when b has a's shape, a's last dim (a row
// vector), a's leading dims with a trailing 1 (one value per row), or one element.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, float s);        // s * x
Tensor add_scalar(const Tensor& x, float s);   // x + s
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor silu(const Tensor& x);
Tensor relu(const Tensor& x);
// out = mask != 0 ? value : x. mask is float, shaped like x's trailing dims (broadcast over
// the leading ones). No gradient flows to masked positions.
Tensor masked_fill(const Tensor& x, const Tensor& mask, float value);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator*(const Tensor& a, float s) { return scale(a, s); }
inline Tensor operator*(float s, const Tensor& a) { return scale(a, s); }
inline Tensor operator-(const Tensor& a) { return neg(a); }

// ---- matmul: a (..., M, K) @ b (K, N) or b (..., K, N) with the same leading dims. Both
// float32, or both bf16: then the product is float32 (each term exact, summed in float32) and
// the gradients are bf16, dC rounded to bf16 before it is multiplied. A float32 a against a
// bf16 b (an activation against a mixed-precision weight): a rounded to bf16 first (cast).
Tensor matmul(const Tensor& a, const Tensor& b);
// x as float32 or bf16 (kernels/bf16.h: round to nearest even; widening is exact); x itself
// when it already is. The gradient goes back unchanged in value, in x's dtype.
Tensor cast(const Tensor& x, DType to);

// ---- shape and layout (float32, or bf16: the numbers moved exactly, bf16 gradients)
Tensor reshape(const Tensor& x, const Shape& shape);      // a view; one dim may be -1
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1); // copies
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end);  // [start, end)
Tensor concat(const std::vector<Tensor>& xs, int64_t dim);

// ---- reductions along one dim (the dim is removed unless keepdim)
Tensor sum(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor max(const Tensor& x, int64_t dim, bool keepdim = false);  // gradient to the first argmax
Tensor sum_all(const Tensor& x);                                 // 0-d: shape ()

// ---- rows
Tensor softmax(const Tensor& x);       // along the last dim
Tensor log_softmax(const Tensor& x);
Tensor rmsnorm(const Tensor& x, const Tensor& weight, float eps = 1e-5f);
// mean over rows of -log softmax(logits)[target]; logits (N, V), targets int64 (N)
Tensor cross_entropy(const Tensor& logits, const Tensor& targets);
// weight (V, C), idx int64 of any shape -> (idx.shape..., C)
Tensor embedding(const Tensor& weight, const Tensor& idx);
// x (N, C), idx int64 (M) -> (M, C): rows of x
Tensor index_select(const Tensor& x, const Tensor& idx);
// base (N, C) with src (M, C) added at rows idx (M); repeated indices accumulate
Tensor index_add(const Tensor& base, const Tensor& idx, const Tensor& src);
// the k largest of each row of x (..., C): values (..., k) and int64 indices (..., k),
// descending; indices carry no gradient.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k);

// ---- positions
// Rotary position embedding as DeepSeek-V3 applies it: each consecutive pair (x[2i], x[2i+1])
// of the last dim is rotated as a complex number by positions[t] * theta^(-2i/D), i < D/2.
// x float32 (T, D) or (T, ..., D), D even: the first dim is the token, the middle dims (heads)
// share its position. positions int64 (T), >= 0: explicit, since under context parallelism
// they are the GLOBAL positions of a rank's tokens, not row numbers. Returns x's shape.
// Backward: the upstream gradient rotated by -angle; positions get no gradient.
Tensor rope(const Tensor& x, const Tensor& positions, float theta = 10000.f);

}  // namespace ff
