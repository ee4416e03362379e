// kernels/cpu/elementwise.cpp — fill, affine, binary (with broadcasting), unary ops,
// masked_fill, the AdamW step: the readable definitions of the elementwise kernels.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/row_math.h"

namespace ff::cpu {

// f(i) for i < n: a loop the compiler vectorises (omp simd: GCC's -O2 cost model would not,
// for a trip count it does not know), shared among threads when the elements all the f(i)
// touch (n, or `elements` when each f(i) is a row) reach row_math.h's size. Each element is
// computed on its own, so neither changes a bit.
template <class F>
static inline void each(int64_t n, F f, int64_t elements = -1) {  // elements: what f(i)s touch in all
  const int threads = row_threads(elements < 0 ? n : elements);
#pragma omp parallel for simd schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n; i++) f(i);
}

void fill(float* out, int64_t n, float value) {
  each(n, [=](int64_t i) { out[i] = value; });
}

void affine(float* out, const float* x, int64_t n, float alpha, float beta) {
  each(n, [=](int64_t i) { out[i] = alpha * x[i] + beta; });
}

static inline float apply(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::add: return a + b;
    case BinaryOp::sub: return a - b;
    case BinaryOp::mul: return a * b;
    case BinaryOp::div: return a / b;
  }
  return 0.f;
}

// out = a op b, b broadcast as bc; the op and the broadcast chosen outside the loop
template <BinaryOp op>
static void binary_op(float* out, const float* a, const float* b, int64_t n, int64_t C, Broadcast bc) {
  switch (bc) {
    case Broadcast::same: return each(n, [=](int64_t i) { out[i] = apply(op, a[i], b[i]); });
    case Broadcast::scalar: {
      const float bv = b[0];
      return each(n, [=](int64_t i) { out[i] = apply(op, a[i], bv); });
    }
    case Broadcast::row:  // b (C) against every row of C
    case Broadcast::col:  // b[r] against all of row r
      if (C == 0) return;
      const bool row = bc == Broadcast::row;
      each(n / C, [=](int64_t r) {
        const float* ar = a + r * C;
        float* outr = out + r * C;
        if (row)
          for (int64_t j = 0; j < C; j++) outr[j] = apply(op, ar[j], b[j]);
        else
          for (int64_t j = 0; j < C; j++) outr[j] = apply(op, ar[j], b[r]);
      }, n);
      for (int64_t i = n / C * C; i < n; i++)  // a last, partial row (n not a multiple of C)
        out[i] = apply(op, a[i], row ? b[i % C] : b[i / C]);
      return;
  }
}

void binary(BinaryOp op, float* out, const float* a, const float* b, int64_t n, int64_t C,
            Broadcast bc) {
  switch (op) {
    case BinaryOp::add: return binary_op<BinaryOp::add>(out, a, b, n, C, bc);
    case BinaryOp::sub: return binary_op<BinaryOp::sub>(out, a, b, n, C, bc);
    case BinaryOp::mul: return binary_op<BinaryOp::mul>(out, a, b, n, C, bc);
    case BinaryOp::div: return binary_op<BinaryOp::div>(out, a, b, n, C, bc);
  }
}

static inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }

// The op chosen outside the loop; elements shared among threads as `each` does. exp and log
// are libm's (a call per element, which no compiler vectorises), the rest vectorise.
void unary(UnaryOp op, float* out, const float* x, int64_t n) {
  switch (op) {
    case UnaryOp::exp: return each(n, [=](int64_t i) { out[i] = std::exp(x[i]); });
    case UnaryOp::log: return each(n, [=](int64_t i) { out[i] = std::log(x[i]); });
    case UnaryOp::sqrt: return each(n, [=](int64_t i) { out[i] = std::sqrt(x[i]); });
    case UnaryOp::sigmoid: return each(n, [=](int64_t i) { out[i] = sigmoidf(x[i]); });
    case UnaryOp::silu: return each(n, [=](int64_t i) { out[i] = x[i] * sigmoidf(x[i]); });
    case UnaryOp::relu: return each(n, [=](int64_t i) { out[i] = x[i] > 0.f ? x[i] : 0.f; });
    case UnaryOp::neg: return each(n, [=](int64_t i) { out[i] = -x[i]; });
  }
}

void unary_backward(UnaryOp op, float* dx, const float* x, const float* y, const float* dy,
                    int64_t n) {
  switch (op) {
    case UnaryOp::exp: return each(n, [=](int64_t i) { dx[i] = dy[i] * y[i]; });  // (e^x)' = e^x
    case UnaryOp::log: return each(n, [=](int64_t i) { dx[i] = dy[i] * (1.f / x[i]); });  // 1/x
    case UnaryOp::sqrt: return each(n, [=](int64_t i) { dx[i] = dy[i] * (0.5f / y[i]); });  // 1/(2 sqrt x)
    case UnaryOp::sigmoid:  // s' = s(1-s)
      return each(n, [=](int64_t i) { dx[i] = dy[i] * (y[i] * (1.f - y[i])); });
    case UnaryOp::silu:  // (x s)' = s + x s (1-s)
      return each(n, [=](int64_t i) {
        const float s = sigmoidf(x[i]);
        dx[i] = dy[i] * (s * (1.f + x[i] * (1.f - s)));
      });
    case UnaryOp::relu: return each(n, [=](int64_t i) { dx[i] = dy[i] * (x[i] > 0.f ? 1.f : 0.f); });
    case UnaryOp::neg: return each(n, [=](int64_t i) { dx[i] = dy[i] * -1.f; });
  }
}

void masked_fill(float* out, const float* x, const float* mask, int64_t n, int64_t mask_n,
                 float value) {
  if (mask_n == 0) return;
  // the mask repeats every mask_n elements: one pass of it per block
  each(n / mask_n, [=](int64_t blk) {
    const float* xb = x + blk * mask_n;
    float* ob = out + blk * mask_n;
    for (int64_t j = 0; j < mask_n; j++) ob[j] = mask[j] != 0.f ? value : xb[j];
  }, n);
  for (int64_t i = n / mask_n * mask_n; i < n; i++) out[i] = mask[i % mask_n] != 0.f ? value : x[i];
}

// One pass over the parameters instead of the dozen tensor ops (each a pass and an allocation)
// the step is written as in optim.cpp's comment; the same roundings in the same order (the
// compiler fuses none of them here: -ffp-contract=off), so the same bits as those ops.
void adamw(float* p, float* m, float* v, const float* g, int64_t n, const AdamWStep& s) {
  each(n, [=](int64_t i) {
    const float gi = g[i];
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * gi;
    const float vi = s.beta2 * v[i] + s.one_minus_beta2 * (gi * gi);
    const float update = s.lr * ((s.inv_bias1 * mi) / (std::sqrt(s.inv_bias2 * vi) + s.eps));
    m[i] = mi, v[i] = vi;
    p[i] = s.decay * p[i] - update;
  });
}

}  // namespace ff::cpu
