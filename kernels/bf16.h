// kernels/bf16.h — bfloat16, the 16-bit float of mixed-precision training, as bits.
//
// A bf16 value is the upper half of a float32: 1 sign bit, the same 8 exponent bits, 7 mantissa
// bits (float32 has 23). So it covers float32's whole range (about 1e-38 to 3e38) with about
// 2-3 decimal digits: 1 + 2^-8 is the first value after 1. Widening to float32 is exact (16 zero
// bits appended); narrowing rounds the 16 dropped bits to the nearest value, ties to the even
// one, as every tensor library and the hardware conversions do:
//   - a NaN stays a NaN (quiet; rounding its payload could otherwise carry it to infinity);
//   - a float above the largest bf16 (about 3.39e38) that rounds up becomes infinity;
//   - subnormal floats round to bf16's subnormals like any other value.
// A product of two bf16 values has at most 16 significant bits, so float32 holds it exactly:
// a bf16 matmul summing in float32 rounds once per term, in the sum, wherever the product is
// fused into it or not.
//
// Stored as uint16_t everywhere (kernels, tensors): the bits, not a C++ arithmetic type.
// Plain inline functions, compiled for the host, the SIMT emulator and (FF_BF16_HD) the GPU.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FF_BF16_HD __host__ __device__ __forceinline__
#else
#define FF_BF16_HD inline
#endif

namespace ff {

FF_BF16_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FF_BF16_HD float float_of_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

FF_BF16_HD float bf16_to_float(uint16_t h) { return float_of_bits((uint32_t)h << 16); }

FF_BF16_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);  // NaN: quiet
  // round to nearest, ties to even: add just under half a bf16 ulp, plus one when the kept
  // half is odd; a carry out of the mantissa moves to the next binade (or to infinity)
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// An operand element as the float32 a kernel multiplies: itself, or a bf16 widened. Lets one
// kernel template read float32 or bf16 operands (cuda/matmul.cu, cuda/moe.cu).
FF_BF16_HD float widen(float v) { return v; }
FF_BF16_HD float widen(uint16_t v) { return bf16_to_float(v); }

}  // namespace ff
