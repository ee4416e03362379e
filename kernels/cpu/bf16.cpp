// kernels/cpu/bf16.cpp — device cpu's bfloat16 kernels (kernels/bf16.h: the format and its
// rounding). The conversions go element by element. The bf16 matmul widens both operands to
// float32 — exact, a shift of each value's bits — and runs the float32 matmul (matmul.cpp:
// packed, tiled, threaded): a product of two bf16 values is exact in float32, so c holds the
// float32 matmul's bits on the widened values, on every instruction set. The widening costs a
// pass over a and b, O(M K + K Nc) against the product's O(M K Nc) — except for a few rows
// against an untransposed b (a decode step), where b streams past once at 2 bytes a value,
// widened in registers (matmul.cpp's few-rows path). The grouped GEMMs of the MoE
// (moe.cpp) the same way.
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void to_bf16(uint16_t* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(x[i]);
}

void from_bf16(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = bf16_to_float(x[i]);
}

namespace {
// The elements a batched operand spans: B entries stride apart (0: one matrix for all).
int64_t span(int64_t B, int64_t stride, int64_t one) { return B > 0 && stride > 0 ? (B - 1) * stride + one : one; }

std::vector<float> widened(const uint16_t* x, int64_t n) {
  std::vector<float> w((size_t)n);
  from_bf16(w.data(), x, n);
  return w;
}
}  // namespace

void matmul_bf16(float* c, const uint16_t* a, const uint16_t* b, int64_t B, int64_t M, int64_t Nc,
                 int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
                 bool accumulate) {
  if (B == 0 || M == 0 || Nc == 0) return;
  if (matmul_bf16_streamed(c, a, b, B, M, Nc, K, stride_a, stride_b, trans_a, trans_b, accumulate)) return;
  const std::vector<float> wa = widened(a, span(B, stride_a, M * K)), wb = widened(b, span(B, stride_b, K * Nc));
  matmul(c, wa.data(), wb.data(), B, M, Nc, K, stride_a, stride_b, trans_a, trans_b, accumulate);
}

void grouped_gemm_bf16(float* c, const uint16_t* a, const uint16_t* w, const int64_t* group_sizes,
                       int64_t G, int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  if (M == 0 || Nc == 0) return;
  const std::vector<float> wa = widened(a, M * K), ww = widened(w, G * K * Nc);
  grouped_gemm(c, wa.data(), ww.data(), group_sizes, G, M, K, Nc, trans_w, accumulate);
}

void grouped_gemm_dw_bf16(float* dw, const uint16_t* a, const uint16_t* dc,
                          const int64_t* group_sizes, int64_t G, int64_t M, int64_t K, int64_t Nc,
                          bool accumulate) {
  const std::vector<float> wa = widened(a, M * K), wdc = widened(dc, M * Nc);
  grouped_gemm_dw(dw, wa.data(), wdc.data(), group_sizes, G, M, K, Nc, accumulate);
}

}  // namespace ff::cpu
