// kernels/cpu/matmul.cpp — batched matmul with optional transposes: the plain
// triple loop, accumulating in double. The definition the CUDA versions are
// checked against.
#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void matmul(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc, int64_t K,
            int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b, bool accumulate) {
  for (int64_t z = 0; z < B; z++) {
    const float* az = a + z * stride_a;
    const float* bz = b + z * stride_b;
    float* cz = c + z * M * Nc;
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < Nc; j++) {
        double s = 0.0;
        for (int64_t p = 0; p < K; p++) {
          float av = trans_a ? az[p * M + i] : az[i * K + p];
          float bv = trans_b ? bz[j * K + p] : bz[p * Nc + j];
          s += (double)av * bv;
        }
        cz[i * Nc + j] = accumulate ? cz[i * Nc + j] + (float)s : (float)s;
      }
  }
}

}  // namespace ff::cpu
