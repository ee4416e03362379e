// kernels/simt.h — the portability layer: one .cu source, two compilers.
//
// Under nvcc this header is plain CUDA plus two macros. Under the host compiler it maps
// the CUDA built-ins a kernel uses onto the SIMT emulator (kernels/simt_emulator.h),
// which runs every thread of a block as a fiber on the CPU. A kernel file reads as
// ordinary CUDA; the only differences a reader sees are:
//
//   SIMT_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)
//       is kernel<<<grid, block, smem_bytes, stream>>>(args...), since <<< >>> is nvcc-only;
//   SIMT_DYNAMIC_SHARED(float, buf);
//       is `extern __shared__ float buf[];`, which the host compiler cannot express.
//
// Each kernel file defines its launchers in namespace ff::SIMT_DEVICE_NS, which is
// ff::cuda under nvcc and ff::sim under the host compiler, so both builds of the same
// file link into one program side by side.
#pragma once

#if defined(__CUDACC__)
// ---------------------------------------------------------------------------- nvcc
#include <cuda_runtime.h>

#define SIMT_DEVICE_NS cuda
#define SIMT_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define SIMT_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
// After every launch: a bad configuration or a fault becomes an error with file and line.
#define SIMT_CHECK_LAUNCH() ::ff::cuda_check(cudaGetLastError(), __FILE__, __LINE__)

namespace ff {
void cuda_check(cudaError_t err, const char* file, int line);
using simt_stream_t = cudaStream_t;
}  // namespace ff

#else
// ---------------------------------------------------------------------------- emulator
#include <math.h>  // expf, logf, sqrtf, fmaxf ... in the global namespace, as in CUDA

#include <cmath>

#include "kernels/simt_emulator.h"

#define SIMT_DEVICE_NS sim
#define SIMT_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::simt::launch_kernel(#kernel, (grid), (block), (smem), kernel, ##__VA_ARGS__)
#define SIMT_DYNAMIC_SHARED(type, name) \
  type* name = reinterpret_cast<type*>(::simt::dynamic_shared_memory())
#define SIMT_CHECK_LAUNCH() ((void)0)  // the emulator throws simt::Error on the spot

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
// Blocks run one after another, so one static array per kernel is the block's shared
// memory. (CUDA shared memory starts uninitialised; so does this, between blocks.)
#define __shared__ static

using dim3 = ::simt::dim3;
using uint3 = ::simt::dim3;
#define threadIdx (::simt::current_thread().thread_idx)
#define blockIdx (::simt::current_block().block_idx)
#define blockDim (::simt::current_block().block_dim)
#define gridDim (::simt::current_block().grid_dim)
#define warpSize 32
#define __syncthreads() ::simt::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::simt::syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_sync(mask, v, lane, ...) \
  ::simt::shfl(::simt::Shfl::idx, __FILE__, __LINE__, (mask), (v), (lane), ##__VA_ARGS__)
#define __shfl_xor_sync(mask, v, lane_mask, ...) \
  ::simt::shfl(::simt::Shfl::bfly, __FILE__, __LINE__, (mask), (v), (lane_mask), ##__VA_ARGS__)
#define __shfl_down_sync(mask, v, delta, ...) \
  ::simt::shfl(::simt::Shfl::down, __FILE__, __LINE__, (mask), (v), (delta), ##__VA_ARGS__)
#define __shfl_up_sync(mask, v, delta, ...) \
  ::simt::shfl(::simt::Shfl::up, __FILE__, __LINE__, (mask), (v), (delta), ##__VA_ARGS__)
#define __ballot_sync(mask, pred) ::simt::ballot(__FILE__, __LINE__, (mask), (pred))

// Atomics: fibers switch only at barriers and warp collectives, so a read-modify-write
// between them is atomic by construction. Each returns the old value, as in CUDA, and tells
// the race check (simt::Options::racecheck) that several blocks may change *p.
template <typename T>
inline T atomicAdd(T* p, T v) {
  ::simt::note_atomic(p, sizeof(T));
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  ::simt::note_atomic(p, sizeof(T));
  T old = *p;
  *p = old < v ? v : old;
  return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
  ::simt::note_atomic(p, sizeof(T));
  T old = *p;
  *p = v < old ? v : old;
  return old;
}
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
  ::simt::note_atomic(p, sizeof(T));
  T old = *p;
  if (old == compare) *p = v;
  return old;
}
template <typename T>
inline T atomicExch(T* p, T v) {
  ::simt::note_atomic(p, sizeof(T));
  T old = *p;
  *p = v;
  return old;
}

// Math intrinsics: the fast CUDA versions map to the precise host ones.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// A product rounded to float on its own, never fused into a following add (CUDA's __fmul_rn;
// the sim build fuses a * b + c where it can, -ffp-contract=fast, and an empty asm that takes
// the product is something no compiler can fuse across).
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  __asm__("" : "+g"(r));
  return r;
}
inline float __int_as_float(int i) {
  float f;
  __builtin_memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  __builtin_memcpy(&i, &f, sizeof i);
  return i;
}
// Integer intrinsics: the number of set bits (of a ballot mask, say).
inline int __popc(unsigned int x) { return __builtin_popcount(x); }

namespace ff {
using simt_stream_t = void*;
}

#endif
