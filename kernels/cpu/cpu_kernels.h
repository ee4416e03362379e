// kernels/cpu/cpu_kernels.h — the cpu device's kernels: plain C++ loops, the
// readable definition of every op. Signatures and shape conventions are those
// of KernelTable in kernels/kernels.h.
#pragma once
#include "kernels/kernels.h"

namespace ff::cpu {
#include "kernels/kernel_list.inc"
}  // namespace ff::cpu
