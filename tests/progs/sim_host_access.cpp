// Host code that dereferences a sim tensor's data() — a device pointer — as if it were host
// memory. On a GPU that crashes; on device "sim" it must fail too, with one error line,
// instead of quietly working (kernels/sim_memory.h). scripts/run-tests.sh runs:
//   sim_host_access read    reads t.data()[0] on the host: error line, exit 1
//   sim_host_access write   writes it: the same
//   sim_host_access copy    the right way (to_vector): prints the value, exit 0
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/tensor.h"

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  ff::Tensor t = ff::Tensor::full({4}, 2.5f, ff::Device::sim);
  if (std::strcmp(mode, "read") == 0) {
    volatile float v = t.data()[0];
    std::printf("read %g from device memory on the host\n", (double)v);
  } else if (std::strcmp(mode, "write") == 0) {
    t.data()[1] = 1.f;
    std::printf("wrote device memory from the host\n");
  } else if (std::strcmp(mode, "copy") == 0) {
    std::printf("copied to the host: %g\n", (double)t.to_vector()[0]);
  } else {
    std::fprintf(stderr, "error: usage: sim_host_access read|write|copy\n");
    return 2;
  }
  return 0;
}
