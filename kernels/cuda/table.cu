// kernels/cuda/table.cu — the kernel table of this build of kernels/cuda/*.cu
// (ff::sim under the host compiler, ff::cuda under nvcc).
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

const KernelTable& kernel_table() {
  static const KernelTable table = FF_KERNEL_TABLE_INITIALIZER;
  return table;
}

}  // namespace ff::SIMT_DEVICE_NS
