// Prints the devices this build and this machine can run kernels on, one line:
//   devices: cpu sim [cuda]
// scripts/run-tests.sh uses it to run the kernel tests on cuda when a GPU is present.
#include <cstdio>

#include "kernels/device.h"

int main() {
  std::printf("devices:");
  for (ff::Device d : {ff::Device::cpu, ff::Device::sim, ff::Device::cuda})
    if (ff::device_available(d)) std::printf(" %s", ff::device_name(d));
  std::printf("\n");
  return 0;
}
