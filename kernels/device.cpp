// kernels/device.cpp — device-memory API. Today only the cpu device exists;
// sim and cuda are reported unavailable (and refused) until their kernels land.
#include "kernels/device.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace ff {

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

bool device_available(Device d) { return d == Device::cpu; }

static void require_available(Device d) {
  if (!device_available(d))
    throw std::runtime_error(std::string("device '") + device_name(d) +
                             "' is not available in this build (available: cpu)");
}

void* device_malloc(Device d, size_t bytes) {
  require_available(d);
  // 64-byte alignment: cache lines, and room for vector loads.
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p) throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
  return p;
}

void device_free(Device d, void* p) {
  (void)d;
  std::free(p);
}

void device_memset_zero(Device d, void* p, size_t bytes) {
  require_available(d);
  std::memset(p, 0, bytes);
}

void device_memcpy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  require_available(dst_dev);
  require_available(src_dev);
  if (bytes) std::memcpy(dst, src, bytes);
}

void device_synchronize(Device d) { require_available(d); }

}  // namespace ff
