// kernels/cuda/elementwise.cu — fill, affine, binary ops with broadcasting, unary ops and
// their backward, masked_fill, the AdamW step. The cpu twins are in kernels/cpu/elementwise.cpp.
//
// Every kernel here is "one thread per element" with a grid-stride loop: element i is
// handled by thread i of the grid, then i + (grid size), ... so any n works with a bounded
// grid. Consecutive threads touch consecutive addresses, so the loads and stores of a warp
// coalesce into a few memory transactions: these kernels are bound by memory bandwidth and
// `make bench` reports them in GB/s.
//
// Shapes: every pointer is a flat array of n floats unless noted; C is the row length when
// a binary op broadcasts (see Broadcast in kernels/kernels.h).
#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

// ----------------------------------------------------------------------------
// kernels

__global__ void fill_kernel(float* out, int64_t n, float value) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) out[i] = value;
}

// [slide:affine-kernel]
__global__ void affine_kernel(float* out, const float* x, int64_t n, float alpha, float beta) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) out[i] = alpha * x[i] + beta;
}
// [/slide]

__device__ __forceinline__ float apply_binary(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::add: return a + b;
    case BinaryOp::sub: return a - b;
    case BinaryOp::mul: return a * b;
    case BinaryOp::div: return a / b;
  }
  return 0.f;
}

// out (n) = a (n) op b, b broadcast as bc: same (n), row (C), col (n / C), scalar (1)
__global__ void binary_kernel(BinaryOp op, float* out, const float* a, const float* b, int64_t n,
                              int64_t C, Broadcast bc) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    float bv;
    switch (bc) {
      case Broadcast::row: bv = b[i % C]; break;
      case Broadcast::col: bv = b[i / C]; break;
      case Broadcast::scalar: bv = b[0]; break;
      default: bv = b[i]; break;
    }
    out[i] = apply_binary(op, a[i], bv);
  }
}

// expf, not __expf: the fast intrinsic is off by a few ulps, and these kernels are compared
// with the cpu ones elementwise.
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__global__ void unary_kernel(UnaryOp op, float* out, const float* x, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    float v = x[i];
    switch (op) {
      case UnaryOp::exp: v = expf(v); break;
      case UnaryOp::log: v = logf(v); break;
      case UnaryOp::sqrt: v = sqrtf(v); break;
      case UnaryOp::sigmoid: v = sigmoid(v); break;
      case UnaryOp::silu: v = v * sigmoid(v); break;
      case UnaryOp::relu: v = v > 0.f ? v : 0.f; break;
      case UnaryOp::neg: v = -v; break;
    }
    out[i] = v;
  }
}

// dx = dy * f'(x), with y = f(x) at hand for the derivatives that are cheaper through it
__global__ void unary_backward_kernel(UnaryOp op, float* dx, const float* x, const float* y,
                                      const float* dy, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    float d = 0.f;
    switch (op) {
      case UnaryOp::exp: d = y[i]; break;                      // (e^x)' = e^x
      case UnaryOp::log: d = 1.f / x[i]; break;                // (log x)' = 1/x
      case UnaryOp::sqrt: d = 0.5f / y[i]; break;              // (sqrt x)' = 1/(2 sqrt x)
      case UnaryOp::sigmoid: d = y[i] * (1.f - y[i]); break;   // s' = s (1 - s)
      case UnaryOp::silu: {                                    // (x s)' = s (1 + x (1 - s))
        float s = sigmoid(x[i]);
        d = s * (1.f + x[i] * (1.f - s));
        break;
      }
      case UnaryOp::relu: d = x[i] > 0.f ? 1.f : 0.f; break;
      case UnaryOp::neg: d = -1.f; break;
    }
    dx[i] = dy[i] * d;
  }
}

// out (n) = mask[i % mask_n] != 0 ? value : x[i]
__global__ void masked_fill_kernel(float* out, const float* x, const float* mask, int64_t n,
                                   int64_t mask_n, float value) {
  for (int64_t i = grid_index(); i < n; i += grid_stride())
    out[i] = mask[i % mask_n] != 0.f ? value : x[i];
}

// AdamW, one thread per parameter (kernels/kernels.h: AdamWStep), rounding as the cpu does:
// every product that an add or subtract takes is __fmul_rn, which nvcc does not fuse into an
// FMA, so the step's bits are the cpu's on every device (tests/unit/test_optim.cpp).
__global__ void adamw_kernel(float* p, float* m, float* v, const float* g, int64_t n, AdamWStep s) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    const float gi = g[i];
    const float mi = __fmul_rn(s.beta1, m[i]) + __fmul_rn(s.one_minus_beta1, gi);
    const float vi = __fmul_rn(s.beta2, v[i]) + __fmul_rn(s.one_minus_beta2, gi * gi);
    const float update = __fmul_rn(s.lr, (s.inv_bias1 * mi) / (sqrtf(s.inv_bias2 * vi) + s.eps));
    m[i] = mi, v[i] = vi;
    p[i] = __fmul_rn(s.decay, p[i]) - update;
  }
}

// ----------------------------------------------------------------------------
// launchers (the KernelTable entries)

void fill(float* out, int64_t n, float value) {
  if (n == 0) return;
  SIMT_LAUNCH(fill_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, out, n, value);
  SIMT_CHECK_LAUNCH();
}

// [slide:affine-launch]
void affine(float* out, const float* x, int64_t n, float alpha, float beta) {
  if (n == 0) return;
  SIMT_LAUNCH(affine_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, out, x, n, alpha, beta);
  SIMT_CHECK_LAUNCH();
}
// [/slide]

void binary(BinaryOp op, float* out, const float* a, const float* b, int64_t n, int64_t C,
            Broadcast bc) {
  if (n == 0) return;
  SIMT_LAUNCH(binary_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, op, out, a, b, n, C, bc);
  SIMT_CHECK_LAUNCH();
}

void unary(UnaryOp op, float* out, const float* x, int64_t n) {
  if (n == 0) return;
  SIMT_LAUNCH(unary_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, op, out, x, n);
  SIMT_CHECK_LAUNCH();
}

void unary_backward(UnaryOp op, float* dx, const float* x, const float* y, const float* dy,
                    int64_t n) {
  if (n == 0) return;
  SIMT_LAUNCH(unary_backward_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, op, dx, x, y,
              dy, n);
  SIMT_CHECK_LAUNCH();
}

void masked_fill(float* out, const float* x, const float* mask, int64_t n, int64_t mask_n,
                 float value) {
  if (n == 0) return;
  SIMT_LAUNCH(masked_fill_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, out, x, mask, n,
              mask_n, value);
  SIMT_CHECK_LAUNCH();
}

void adamw(float* p, float* m, float* v, const float* g, int64_t n, const AdamWStep& step) {
  if (n == 0) return;
  SIMT_LAUNCH(adamw_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, p, m, v, g, n, step);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
