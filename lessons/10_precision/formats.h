// lessons/10_precision/formats.h — the two number formats of lesson 10, written out on the host:
// bf16 (float32's top 16 bits, rounded to nearest even) and FP8 e4m3 with DeepSeek-V3's
// fine-grained scales and its promoted GEMM (technical report, section 3.3). The lesson checks
// every device's kernels (kernels/bf16.h, kernels/fp8.h, kernels/cpu/fp8.cpp and their CUDA
// twins) against these, bit for bit.
#pragma once
#include <cstdint>
#include <vector>

namespace ff::precision {

// A planted mistake of the formats (--bug), to see the checks fail.
enum class FormatBug {
  none,
  bf16_truncate,  // float32 -> bf16 drops the low 16 bits instead of rounding them
  no_promotion,   // the FP8 GEMM keeps its running sum in the narrow accumulator for all of K
  per_tensor,     // one scale for the whole tensor instead of one per tile
};

// ---- bf16: 1 sign bit, 8 exponent bits (float32's range), 7 mantissa bits.
// float32 -> bf16, round to nearest, ties to even; a NaN stays a (quiet) NaN, a value past
// bf16's largest becomes infinity, as the rounding carries into the exponent.
uint16_t round_to_bf16(float x, FormatBug bug = FormatBug::none);
float widen_bf16(uint16_t h);  // exact: the 16 bits become float32's top half

// ---- FP8 e4m3 with a scale per tile: x (R, C) cut into tiles of tr x tc (the last ragged).
struct Fp8 {
  int64_t R = 0, C = 0, tr = 0, tc = 0;
  std::vector<uint8_t> q;    // (R, C): x / its tile's scale, rounded to e4m3
  std::vector<float> scale;  // (ceil(R/tr), ceil(C/tc)): the tile's largest |x| / 448
  double value(int64_t r, int64_t c) const;  // the value it stands for: e4m3 times its scale, exact
  float at(int64_t r, int64_t c) const;      // the same rounded to float32
};
// DeepSeek-V3 quantizes activations in 1 x 128 tiles and weights in 128 x 128 blocks, each
// tile's scale from its own largest magnitude, so that one outlier costs only its tile.
Fp8 quantize(const std::vector<float>& x, int64_t R, int64_t C, int64_t tr, int64_t tc,
             FormatBug bug = FormatBug::none);

// c (M, N) = a @ b of a (M, K) in tiles of a.tr x tk and b (K, N) in blocks of tk x tn (the
// recipe: a.tr = 1, tk = tn = 128; one tile each: a scale per tensor), as an H800 runs it: per element, the exact e4m3 products summed in an accumulator that keeps acc_bits
// mantissa bits (about 14 on the H800, the report measures), `promote` products at a time;
// each partial sum then times its two tiles' scales and added to a float32 sum.
std::vector<float> fp8_gemm(const Fp8& a, const Fp8& b, int64_t promote, int acc_bits,
                            FormatBug bug = FormatBug::none);

}  // namespace ff::precision
