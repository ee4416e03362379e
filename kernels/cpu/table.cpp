// kernels/cpu/table.cpp — the cpu device's kernel table.
#include "kernels/cpu/cpu_kernels.h"

namespace ff {

namespace cpu {
const KernelTable& kernel_table() {
  static const KernelTable table = FF_KERNEL_TABLE_INITIALIZER;
  return table;
}
}  // namespace cpu

}  // namespace ff
