// kernels/table.cpp — kernels_for(): the kernel table of each device.
//   cpu  — kernels/cpu/*.cpp, the readable definitions;
//   sim  — kernels/cuda/*.cu compiled by the host compiler, run by the SIMT emulator;
//   cuda — kernels/cuda/*.cu compiled by nvcc, run on the GPU.
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/launchers.h"
#include "kernels/sim_memory.h"

namespace ff {

const KernelTable& kernels_for(Device d) {
  switch (d) {
    case Device::cpu: return cpu::kernel_table();
    case Device::sim:
      sim_memory::install();  // sim kernels check their pointers from the first launch on
      return sim::kernel_table();
    case Device::cuda:
#if FF_HAVE_CUDA
      if (device_available(Device::cuda)) return cuda::kernel_table();
      throw std::runtime_error("no kernels for device 'cuda': no CUDA GPU found (available: cpu, sim)");
#else
      throw std::runtime_error("no kernels for device 'cuda': built without nvcc (available: cpu, sim)");
#endif
  }
  throw std::runtime_error("unknown device");
}

}  // namespace ff
