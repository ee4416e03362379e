// Prints the devices this build and this machine can run kernels on, the GPUs, and the
// backends that can move tensors between ranks:
//   devices: cpu sim [cuda]
//   gpus: N
//   backends: mpi [nccl VERSION]
// tests/test_doctest.py uses it to run the kernel tests on cuda when a GPU is present;
// scripts/gpu-check.sh to run the lessons on NCCL when the build has it.
#include <cstdio>

#include "common/comm/nccl.h"
#include "kernels/device.h"

int main() {
  std::printf("devices:");
  for (ff::Device d : {ff::Device::cpu, ff::Device::sim, ff::Device::cuda})
    if (ff::device_available(d)) std::printf(" %s", ff::device_name(d));
  std::printf("\ngpus: %d\nbackends: mpi", ff::device_gpu_count());
  if (ff::nccl::built()) std::printf(" nccl %s", ff::nccl::version().c_str());
  std::printf("\n");
  return 0;
}
