// kernels/fp8.h — FP8 e4m3, the 8-bit float DeepSeek-V3 trains its GEMMs in (technical report,
// section 3.3), as bits, and the accumulator a tensor core sums its products in.
//
// e4m3 (OCP's "E4M3FN", NVIDIA's __nv_fp8_e4m3): 1 sign bit, 4 exponent bits (bias 7), 3
// mantissa bits, no infinity. Normal values (1 + m/8) 2^(e-7) for e = 1..15, the largest
// 1.75 x 2^8 = 448 (e = 15, m = 6: m = 7 there is NaN); subnormals m 2^-9 for e = 0. So about
// one decimal digit (8 values per binade) over 2^-9 .. 448: a tensor must be scaled into that
// range first (fp8_quantize's scales), and a product of two e4m3 values (4 significant bits
// each) is exact in float32.
// Narrowing rounds to nearest, ties to even, and saturates: a finite value beyond 448 becomes
// 448 (as NVIDIA's cvt.rn.satfinite does), a NaN stays NaN (S.1111.111).
//
// The accumulator: DeepSeek-V3 measured that H800 tensor cores keep about 14 bits of an FP8
// GEMM's running sum, against float32's 24 (23 stored); over K = 4096 products the error
// reached about 2%. accumulate_bits models that: each sum kept to `bits` mantissa bits,
// truncated (the bits below are dropped, as an aligned adder drops them). The remedy the
// report describes, promotion, is what matmul_fp8 does with `promote`: every so many products
// the partial sum leaves the tensor core, is scaled and added to a float32 sum.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.h"  // float_bits, float_of_bits, FF_BF16_HD

namespace ff {

constexpr float kFp8Max = 448.f;     // the largest e4m3 value
constexpr uint8_t kFp8NaN = 0x7f;    // S.1111.111

FF_BF16_HD uint8_t float_to_fp8(float f) {
  uint32_t u = float_bits(f);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | kFp8NaN;
  if (u >= 0x43e00000u) return sign | 0x7eu;  // |f| >= 448 (and infinity): saturated
  if (u < 0x3c800000u) {                        // |f| < 2^-6: subnormal, steps of 2^-9
    // |f| 2^9 is exact (a power of two), and rintf rounds it to nearest even: 0 .. 8, where
    // 8 is e = 1, m = 0, the smallest normal value
    return sign | (uint8_t)rintf(float_of_bits(u) * 512.f);
  }
  // normal: keep 3 of float32's 23 mantissa bits, rounding the 20 dropped ones to nearest even
  // (a carry moves to the next exponent; below 448 it never passes 448 itself)
  u += 0x7ffffu + ((u >> 20) & 1u);
  const uint32_t e = (u >> 23) - 127 + 7, m = (u >> 20) & 7u;
  return sign | (uint8_t)(e << 3 | m);
}

FF_BF16_HD float fp8_to_float(uint8_t h) {
  const uint32_t sign = (uint32_t)(h & 0x80u) << 24, e = (h >> 3) & 15u, m = h & 7u;
  if (e == 15 && m == 7) return float_of_bits(sign | 0x7fc00000u);
  if (e == 0) return float_of_bits(sign | float_bits((float)m * 0.001953125f));  // m 2^-9
  return float_of_bits(sign | (e - 7 + 127) << 23 | m << 20);
}

// x kept to `bits` mantissa bits (1..23), truncated toward zero; 23 and more: x itself.
FF_BF16_HD float accumulate_bits(float x, int bits) {
  if (bits >= 23) return x;
  const uint32_t drop = (1u << (23 - bits)) - 1u;
  return float_of_bits(float_bits(x) & ~drop);
}

}  // namespace ff
