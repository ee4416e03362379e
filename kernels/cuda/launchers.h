// kernels/cuda/launchers.h — the host-side launchers of the CUDA kernels in kernels/cuda/*.cu.
//
// Every .cu file is compiled twice: by the host compiler against the SIMT emulator into
// namespace ff::sim (device "sim"), and by nvcc into ff::cuda (device "cuda"). Each
// launcher has the signature of its KernelTable entry; pointers are device pointers.
#pragma once
#include "kernels/kernels.h"

namespace ff {

namespace sim {
#include "kernels/kernel_list.inc"
}  // namespace sim

namespace cuda {
#include "kernels/kernel_list.inc"
}  // namespace cuda

// The numbered matmul versions, kept side by side like a kernel lab (kernels/cuda/matmul.cu):
// v1 one thread per output, v2 shared-memory tiles, v3 register-blocked 2-D tiles. The
// table's matmul dispatches to the best. Same signature as KernelTable::matmul.
#define FF_MATMUL_VERSIONS(ns)                                                                   \
  namespace ns {                                                                                 \
  void matmul_v1(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,     \
                 int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,      \
                 bool accumulate);                                                               \
  void matmul_v2(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,     \
                 int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,      \
                 bool accumulate);                                                               \
  void matmul_v3(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,     \
                 int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,      \
                 bool accumulate);                                                               \
  }
FF_MATMUL_VERSIONS(sim)
FF_MATMUL_VERSIONS(cuda)
#undef FF_MATMUL_VERSIONS

}  // namespace ff
