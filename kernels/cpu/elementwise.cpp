// kernels/cpu/elementwise.cpp — fill, affine, binary (with broadcasting), unary ops,
// masked_fill: the readable definitions of the elementwise kernels.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void fill(float* out, int64_t n, float value) {
  for (int64_t i = 0; i < n; i++) out[i] = value;
}

void affine(float* out, const float* x, int64_t n, float alpha, float beta) {
  for (int64_t i = 0; i < n; i++) out[i] = alpha * x[i] + beta;
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

void binary(BinaryOp op, float* out, const float* a, const float* b, int64_t n, int64_t C,
            Broadcast bc) {
  for (int64_t i = 0; i < n; i++) {
    float bv = 0.f;
    switch (bc) {
      case Broadcast::same: bv = b[i]; break;
      case Broadcast::row: bv = b[i % C]; break;
      case Broadcast::col: bv = b[i / C]; break;
      case Broadcast::scalar: bv = b[0]; break;
    }
    out[i] = apply(op, a[i], bv);
  }
}

static inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }

void unary(UnaryOp op, float* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    switch (op) {
      case UnaryOp::exp: v = std::exp(v); break;
      case UnaryOp::log: v = std::log(v); break;
      case UnaryOp::sqrt: v = std::sqrt(v); break;
      case UnaryOp::sigmoid: v = sigmoidf(v); break;
      case UnaryOp::silu: v = v * sigmoidf(v); break;
      case UnaryOp::relu: v = v > 0.f ? v : 0.f; break;
      case UnaryOp::neg: v = -v; break;
    }
    out[i] = v;
  }
}

void unary_backward(UnaryOp op, float* dx, const float* x, const float* y, const float* dy,
                    int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float d = 0.f;
    switch (op) {
      case UnaryOp::exp: d = y[i]; break;                 // (e^x)' = e^x
      case UnaryOp::log: d = 1.f / x[i]; break;           // (log x)' = 1/x
      case UnaryOp::sqrt: d = 0.5f / y[i]; break;         // (sqrt x)' = 1/(2 sqrt x)
      case UnaryOp::sigmoid: d = y[i] * (1.f - y[i]); break;  // s' = s(1-s)
      case UnaryOp::silu: {                               // (x s)' = s + x s (1-s)
        float s = sigmoidf(x[i]);
        d = s * (1.f + x[i] * (1.f - s));
        break;
      }
      case UnaryOp::relu: d = x[i] > 0.f ? 1.f : 0.f; break;
      case UnaryOp::neg: d = -1.f; break;
    }
    dx[i] = dy[i] * d;
  }
}

void masked_fill(float* out, const float* x, const float* mask, int64_t n, int64_t mask_n,
                 float value) {
  for (int64_t i = 0; i < n; i++) out[i] = mask[i % mask_n] != 0.f ? value : x[i];
}

}  // namespace ff::cpu
