// lessons/10_precision/measure.h — what lesson 10's [1]-[3] measure: the device's bf16 conversion
// against round_to_bf16, the bf16 matmul against float64, and one K of the FP8 sweep (the
// recipe, never promoted, a float32 accumulator, outlier channels per tile and per tensor), each
// GEMM against float64 and the device's kernels against formats.cpp's loops.
#pragma once
#include <cstdint>
#include <vector>

#include "common/core/tensor.h"
#include "lessons/10_precision/formats.h"
#include "common/layers/fp8_linear.h"

namespace ff::precision {

using fp8::Fp8Recipe;  // the FP8 recipe (common/layers/fp8_linear.h)

// ---- [1] bf16
struct Bf16Result {
  bool same_bits = true;    // the device's conversion = round_to_bf16
  double worst_rel = 0;     // max |widen(bf16(x)) - x| / |x| over normal x
  int64_t compared = 0;
};
// Every high half of a float32 (sign, exponent, the 7 kept bits: 65536 of them) with a few
// low halves (0, 1, just under half, half, just over half, all ones), and random ones: the
// lesson's rounding against the device's (Tensor::to_dtype runs the to_bf16 kernel).
Bf16Result check_bf16(Device device, FormatBug bug, uint64_t seed);

// ---- [2] the bf16 matmul against float64
struct MatmulResult {
  double ratio = 0;          // max |C - C64| / bound, bound = gamma_K sum_k |a_ik b_kj|
  double rel_bf16 = 0;       // ||C - C64|| / ||C64||: the float32 sums
  double rel_inputs = 0;     // ||C - A B|| / ||A B||, A B of the float32 inputs in float64
};
MatmulResult check_bf16_matmul(Device device, int64_t M, int64_t K, int64_t N, uint64_t seed);

// ---- [3] the FP8 GEMM against float64
// ||c - want|| / ||want||, in float64
double relative(const std::vector<float>& c, const std::vector<double>& want);
// float64 a (M, K) @ b (K, N)
std::vector<double> exact_gemm(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t K,
                               int64_t N);
// the values a quantized tensor stands for (e4m3 times its scale), in float64
std::vector<double> values(const Fp8& x);
// The promoted GEMM c = a b's worst element against its bound over float64 of the dequantized
// operands (measure.cpp derives it): 1 fails.
double bound_ratio(const std::vector<float>& c, const Fp8& a, const Fp8& b, int64_t promote, int bits);

// ---- [3] the FP8 sweep: one K
struct SweepShape {
  int64_t m = 8, n = 128, tile = 128, promote = 128, acc_bits = 14;
  double outlier = 1e4;  // the outlier channels' factor
};
// One K's row (plain doubles, no initializers: the ranks' rows travel as one MPI_DOUBLE array)
struct KRow {
  double k;
  double recipe;      // tiles, promoted, narrow accumulator: vs float64 of its operands
  double recipe_ratio;  // its worst element against the bound (<= 1)
  double never;       // one K-wide tile, never promoted, narrow accumulator
  double fp32_acc;    // the recipe with a float32 accumulator
  double fine;        // outlier activations, per-tile scales: vs float64 of the float32 inputs
  double per_tensor;  // the same, one scale per tensor
  double same_bits;   // 1: the device's quantization and GEMM = the lesson's loops
  static constexpr int kFields = 8;
};
static_assert(sizeof(KRow) == KRow::kFields * sizeof(double), "KRow travels as kFields doubles");
KRow sweep_k(Device device, const SweepShape& shape, int64_t K, FormatBug bug, uint64_t seed);

// ---- [3] the FP8 linear layer (fp8_linear.h): x (M, K), W (K, N), an upstream gradient dy
struct LayerResult {
  bool same = true;   // y, dx, dW = formats.cpp's recipe on the operands each GEMM multiplies
  double rel[3] = {};       // Fprop, Dgrad, Wgrad: relative error against float64 of the float32 operands
  double ratio[3] = {};     // their worst element over the promoted GEMM's bound (dequantized operands)
  double rel_bf16[3] = {};  // the same three GEMMs in bf16, against float64
};
LayerResult check_fp8_layer(Device device, int64_t M, int64_t K, int64_t N, const Fp8Recipe& r, uint64_t seed);

}  // namespace ff::precision
