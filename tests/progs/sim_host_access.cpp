// Host code that dereferences a sim tensor's data() — a device pointer — as if it were host
// memory. On a GPU that crashes; on device "sim" it must fail too, with one error line,
// instead of quietly working (kernels/sim_memory.h). tests/test_core.py runs:
//   sim_host_access read    reads t.data()[0] on the host: error line, exit 1
//   sim_host_access write   writes it: the same
//   sim_host_access copy    the right way (to_vector): prints the value, exit 0
//   sim_host_access freed   reads a block freed at the top of the region while it was open
//   sim_host_access kernel-wild   a kernel writes far beyond every allocation: error, exit 1
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/core/tensor.h"
#include "kernels/sim_memory.h"
#include "kernels/simt.h"

__global__ void write_far(float* x) {
  if (threadIdx.x == 0) x[64 << 20] = 1.f;  // 256 MiB past its start
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  ff::Tensor t = ff::Tensor::full({4}, 2.5f, ff::Device::sim);
  if (std::strcmp(mode, "read") == 0) {
    volatile float v = t.data()[0];
    std::printf("read %g from device memory on the host\n", (double)v);
  } else if (std::strcmp(mode, "write") == 0) {
    t.data()[1] = 1.f;
    std::printf("wrote device memory from the host\n");
  } else if (std::strcmp(mode, "freed") == 0) {
    float* p;
    {
      ff::sim_memory::HostAccess open;
      p = static_cast<float*>(ff::sim_memory::allocate(4096));
      ff::sim_memory::release(p);
    }
    volatile float v = p[0];
    std::printf("read %g from freed device memory on the host\n", (double)v);
  } else if (std::strcmp(mode, "kernel-wild") == 0) {
    SIMT_LAUNCH(write_far, dim3(1), dim3(32), 0, 0, t.data());
    std::printf("a kernel wrote far out of bounds unnoticed\n");
  } else if (std::strcmp(mode, "copy") == 0) {
    std::printf("copied to the host: %g\n", (double)t.to_vector()[0]);
  } else {
    std::fprintf(stderr, "error: usage: sim_host_access read|write|copy|freed|kernel-wild\n");
    return 2;
  }
  return 0;
}
