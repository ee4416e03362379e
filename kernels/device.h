// kernels/device.h — the device tag and the small device-memory API.
//
// Design rule: kernels/ knows raw pointers, sizes and devices, nothing about
// tensors. Every allocation and copy of tensor storage goes through these
// functions, so a new device (the SIMT emulator "sim", a real GPU "cuda") only
// has to provide them and its kernel table (kernels.h).
#pragma once
#include <cstddef>
#include <string>

namespace ff {

enum class Device { cpu, sim, cuda };

const char* device_name(Device d);
// Parses "cpu", "sim", "cuda"; returns false on anything else.
bool parse_device(const std::string& s, Device* out);
// Whether this build and this machine can run kernels on `d`.
bool device_available(Device d);
// Why `d` is not available, in a few words ("built without nvcc", "no CUDA GPU found").
const char* device_unavailable_reason(Device d);
// The GPUs this process can see (0 without CUDA or without a GPU).
int device_gpu_count();
// cuda: makes GPU (ordinal mod the number of GPUs) current for this process.
void device_select_gpu(int ordinal);

void* device_malloc(Device d, size_t bytes);
void device_free(Device d, void* p);
void device_memset_zero(Device d, void* p, size_t bytes);
// Copies between any two devices (host staging where needed).
void device_memcpy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
// Waits until all work queued on `d` has finished (a no-op on cpu).
void device_synchronize(Device d);

}  // namespace ff
