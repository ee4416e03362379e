// kernels/cuda_runtime.cu — the device-memory API of device "cuda" on the CUDA runtime.
// Compiled by nvcc only (when it exists); kernels/device.cpp calls these for Device::cuda.
#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/device.h"

namespace ff {

void cuda_check(cudaError_t err, const char* file, int line) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear it, so the next launch check does not report it again
  throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err) + " (" + file +
                           ":" + std::to_string(line) + ")");
}
#define cudaCheck(call) ::ff::cuda_check((call), __FILE__, __LINE__)

namespace cuda_runtime {

bool available() {
  static const bool ok = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return ok;
}

void* malloc(size_t bytes) {
  void* p = nullptr;
  cudaCheck(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
  return p;
}
// Called from tensor destructors, which must not throw: after a kernel fault every CUDA call
// fails, cudaFree too, while the error that reported the fault unwinds the stack.
void free(void* p) {
  cudaError_t err = cudaFree(p);
  if (err == cudaSuccess || err == cudaErrorCudartUnloading) return;
  cudaGetLastError();
  static bool said = false;  // after a kernel fault every free fails: say it once
  if (!said) std::fprintf(stderr, "warning: cudaFree: %s\n", cudaGetErrorString(err));
  said = true;
}
void memset_zero(void* p, size_t bytes) { cudaCheck(cudaMemset(p, 0, bytes)); }
void memcpy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) {
  cudaMemcpyKind kind = dst_on_device ? (src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                      : (src_on_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  cudaCheck(cudaMemcpy(dst, src, bytes, kind));
}
void synchronize() { cudaCheck(cudaDeviceSynchronize()); }
int count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
void select(int ordinal) {
  int n = 0;
  cudaCheck(cudaGetDeviceCount(&n));
  cudaCheck(cudaSetDevice(ordinal % n));
}

}  // namespace cuda_runtime
}  // namespace ff
