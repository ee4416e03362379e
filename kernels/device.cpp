// kernels/device.cpp — the device-memory API.
//   cpu:  host memory;
//   sim:  host memory too (its kernels run on the CPU), but kept apart from the host as a
//         GPU's is: kernels/sim_memory.h;
//   cuda: the CUDA runtime (kernels/cuda_runtime.cu), when built with nvcc and a GPU is present.
#include "kernels/device.h"

#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "kernels/sim_memory.h"

namespace ff {

#if FF_HAVE_CUDA
namespace cuda_runtime {
bool available();
void* malloc(size_t bytes);
void free(void* p);
void memset_zero(void* p, size_t bytes);
void memcpy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes);
void synchronize();
void select(int ordinal);
int count();
}  // namespace cuda_runtime
#endif

const char* device_name(Device d) {
  switch (d) {
    case Device::cpu: return "cpu";
    case Device::sim: return "sim";
    case Device::cuda: return "cuda";
  }
  return "?";
}

bool parse_device(const std::string& s, Device* out) {
  if (s == "cpu") { *out = Device::cpu; return true; }
  if (s == "sim") { *out = Device::sim; return true; }
  if (s == "cuda") { *out = Device::cuda; return true; }
  return false;
}

bool device_available(Device d) {
  if (d != Device::cuda) return true;
#if FF_HAVE_CUDA
  return cuda_runtime::available();
#else
  return false;
#endif
}

const char* device_unavailable_reason(Device d) {
  if (device_available(d)) return "available";
#if FF_HAVE_CUDA
  return "no CUDA GPU found";
#else
  return "built without nvcc";
#endif
}

int device_gpu_count() {
#if FF_HAVE_CUDA
  return cuda_runtime::available() ? cuda_runtime::count() : 0;
#else
  return 0;
#endif
}

void device_select_gpu(int ordinal) {
#if FF_HAVE_CUDA
  cuda_runtime::select(ordinal);
#else
  (void)ordinal;
#endif
}

static void require_available(Device d) {
  if (device_available(d)) return;
  throw std::runtime_error(std::string("device '") + device_name(d) + "' is not available: " +
                           device_unavailable_reason(d) + " (available: cpu, sim)");
}

// cpu and sim memory is host memory.
[[maybe_unused]] static bool on_host(Device d) { return d != Device::cuda; }

void* device_malloc(Device d, size_t bytes) {
  require_available(d);
#if FF_HAVE_CUDA
  if (d == Device::cuda) return cuda_runtime::malloc(bytes);
#endif
  if (d == Device::sim) return sim_memory::allocate(bytes);
  // 64-byte alignment: cache lines, and room for vector loads.
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p) throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
  return p;
}

void device_free(Device d, void* p) {
#if FF_HAVE_CUDA
  if (d == Device::cuda) return cuda_runtime::free(p);
#endif
  if (d == Device::sim) return sim_memory::release(p);
  std::free(p);
}

void device_memset_zero(Device d, void* p, size_t bytes) {
  require_available(d);
#if FF_HAVE_CUDA
  if (d == Device::cuda) return cuda_runtime::memset_zero(p, bytes);
#endif
  std::optional<sim_memory::HostAccess> open;  // sim memory is reachable for the memset only
  if (d == Device::sim) open.emplace();
  std::memset(p, 0, bytes);
}

void device_memcpy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  require_available(dst_dev);
  require_available(src_dev);
  if (bytes == 0) return;
  std::optional<sim_memory::HostAccess> open;  // sim memory is reachable for the copy only
  if (dst_dev == Device::sim || src_dev == Device::sim) open.emplace();
#if FF_HAVE_CUDA
  if (!on_host(dst_dev) || !on_host(src_dev))
    return cuda_runtime::memcpy(dst, !on_host(dst_dev), src, !on_host(src_dev), bytes);
#endif
  std::memcpy(dst, src, bytes);
}

void device_synchronize(Device d) {
  require_available(d);
#if FF_HAVE_CUDA
  if (!on_host(d)) cuda_runtime::synchronize();
#endif
}

}  // namespace ff
