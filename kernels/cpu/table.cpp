// kernels/cpu/table.cpp — the cpu device's kernel table, and kernels_for().
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_kernels.h"

namespace ff {

namespace cpu {
const KernelTable& kernel_table() {
  static const KernelTable table = {
      fill, affine, binary, unary, unary_backward, reduce, max_backward,
      softmax_forward, softmax_backward, log_softmax_forward, log_softmax_backward,
      matmul, transpose, copy_block, rmsnorm_forward, rmsnorm_backward,
      cross_entropy_forward, cross_entropy_backward, index_select_rows, index_add_rows,
      topk_rows, topk_backward, masked_fill,
  };
  return table;
}
}  // namespace cpu

const KernelTable& kernels_for(Device d) {
  if (d == Device::cpu) return cpu::kernel_table();
  throw std::runtime_error(std::string("no kernels for device '") + device_name(d) +
                           "' in this build (available: cpu)");
}

}  // namespace ff
