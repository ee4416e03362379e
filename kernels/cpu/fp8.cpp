// kernels/cpu/fp8.cpp — device cpu's FP8 kernels (kernels/fp8.h: e4m3 and the accumulator),
// the readable definitions: a tile's scale from its largest magnitude, every value divided by
// it and rounded to e4m3; and the GEMM of two quantized operands as DeepSeek-V3 runs it on
// H800s, the products summed in the tensor core's narrow accumulator `promote` at a time, each
// partial sum then scaled and added in float32 (report, section 3.3.2).
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/fp8.h"

namespace ff::cpu {

namespace {
int64_t tiles(int64_t n, int64_t t) { return (n + t - 1) / t; }
}  // namespace

void fp8_quantize(uint8_t* q, float* s, const float* x, int64_t R, int64_t C, int64_t tr, int64_t tc) {
  const int64_t tiles_c = tiles(C, tc);
  for (int64_t r0 = 0; r0 < R; r0 += tr)
    for (int64_t c0 = 0; c0 < C; c0 += tc) {
      const int64_t r1 = std::min(R, r0 + tr), c1 = std::min(C, c0 + tc);
      float amax = 0.f;
      for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++) amax = std::max(amax, std::fabs(x[r * C + c]));
      const float scale = amax > 0.f ? amax / kFp8Max : 1.f;  // the tile's largest value -> 448
      s[(r0 / tr) * tiles_c + c0 / tc] = scale;
      for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++) q[r * C + c] = float_to_fp8(x[r * C + c] / scale);
    }
}

void fp8_dequantize(float* x, const uint8_t* q, const float* s, int64_t R, int64_t C, int64_t tr, int64_t tc) {
  const int64_t tiles_c = tiles(C, tc);
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) x[r * C + c] = fp8_to_float(q[r * C + c]) * s[(r / tr) * tiles_c + c / tc];
}

void matmul_fp8(float* c, const uint8_t* a, const float* sa, const uint8_t* b, const float* sb, int64_t M,
                int64_t N, int64_t K, int64_t tk, int64_t tn, int64_t promote, int acc_bits, bool accumulate) {
  const int64_t ka = tiles(K, tk), nb = tiles(N, tn);
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      float total = 0.f;
      for (int64_t p0 = 0; p0 < K; p0 += promote) {
        // inside the tensor core: exact products, a narrow running sum
        float partial = 0.f;
        for (int64_t p = p0; p < std::min(K, p0 + promote); p++)
          partial = accumulate_bits(std::fma(fp8_to_float(a[i * K + p]), fp8_to_float(b[p * N + j]), partial), acc_bits);
        // promoted: times the two tiles' scales (constant over the partial: promote divides tk)
        const int64_t g = p0 / tk;
        total = std::fma(partial * sa[i * ka + g], sb[g * nb + j / tn], total);
      }
      c[i * N + j] = accumulate ? c[i * N + j] + total : total;
    }
}

}  // namespace ff::cpu
