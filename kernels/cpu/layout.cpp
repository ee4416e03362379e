// kernels/cpu/layout.cpp — data movement: transpose of two dims, block copies
// (slice/concat). Exact: no arithmetic besides the optional accumulate.
#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void transpose(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm, int64_t D1,
               int64_t Cn) {
  for (int64_t a = 0; a < A; a++)
    for (int64_t i = 0; i < D0; i++)
      for (int64_t b = 0; b < Bm; b++)
        for (int64_t j = 0; j < D1; j++)
          for (int64_t c = 0; c < Cn; c++)
            out[(((a * D1 + j) * Bm + b) * D0 + i) * Cn + c] =
                in[(((a * D0 + i) * Bm + b) * D1 + j) * Cn + c];
}

void copy_block(float* dst, int64_t dst_n, int64_t dst_off, const float* src, int64_t src_n,
                int64_t src_off, int64_t outer, int64_t len, int64_t inner, bool accumulate) {
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < len; j++) {
      float* d = dst + (o * dst_n + dst_off + j) * inner;
      const float* s = src + (o * src_n + src_off + j) * inner;
      for (int64_t i = 0; i < inner; i++) d[i] = accumulate ? d[i] + s[i] : s[i];
    }
}

}  // namespace ff::cpu
