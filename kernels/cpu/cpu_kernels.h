// kernels/cpu/cpu_kernels.h — the cpu device's kernels: plain C++ loops, the
// readable definition of every op. Signatures and shape conventions are those
// of KernelTable in kernels/kernels.h.
#pragma once
#include <string>

#include "kernels/kernels.h"

namespace ff::cpu {
#include "kernels/kernel_list.inc"

// matmul's versions (kernels/cpu/matmul.cpp): the table's matmul is version 2 (blocked,
// vectorised, OpenMP threads); version 1 is the plain triple loop summing in double, the
// definition both version 2 and the CUDA kernels are tested against.
void matmul_v1(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,
               int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
               bool accumulate);
// The OpenMP threads version 2 uses: OMP_NUM_THREADS when set, else the cores divided among
// mpirun's ranks on this node, else one per core. set_matmul_threads(n) overrides it (make
// bench times 1 and 2 threads); n <= 0 goes back to the default.
int matmul_threads();
void set_matmul_threads(int n);
// The instruction set version 2's kernels run here: "AVX-512", "AVX2 + FMA" or "portable",
// the best this CPU has, or a lower one named by FF_CPU_ISA=avx2|portable (make bench);
// FF_CPU_ISA=best, or unset, the best. matmul_isa_error: what is wrong with FF_CPU_ISA's
// value, or "" (a lesson answers it as bad input).
const char* matmul_isa();
// matmul_bf16 of a few rows (M <= 4, b untransposed: a decode step's product), streaming b's bf16
// values past once and widening them in registers: version 2's bits (the same sums, in the same
// order). False, doing nothing, for other shapes.
bool matmul_bf16_streamed(float* c, const uint16_t* a, const uint16_t* b, int64_t B, int64_t M, int64_t Nc,
                          int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b, bool accumulate);
std::string matmul_isa_error();
}  // namespace ff::cpu
