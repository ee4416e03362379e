// kernels/cpu/row_math.h — what the cpu row kernels (reduce.cpp, norm_loss.cpp, layout.cpp)
// share: the thread rule, the CPU clones, and an exp that the compiler can vectorise.
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

// Tensors smaller than this (256 KiB of floats) run on the calling thread: waking the OpenMP
// team costs a few microseconds, as long as one thread streams 256 KiB. Bigger ones share their
// rows among matmul_threads() threads (the same rule as the matmul: OMP_NUM_THREADS, or the
// cores divided among mpirun's ranks on this node).
constexpr int64_t kParallelElements = int64_t(1) << 16;
inline int row_threads(int64_t elements) {
  return elements >= kParallelElements ? matmul_threads() : 1;
}

// A row function compiled three times (AVX-512, AVX2 + FMA, baseline x86-64) by GCC's
// function multiversioning, the best one this CPU runs picked when the program starts: no
// -march flag, so the build still runs on any x86-64. The OpenMP loop over rows stays
// outside, in plain code. (The matmul picks its own kernels the same way, by hand:
// matmul.cpp.)
#if defined(__x86_64__)
#define FF_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FF_CPU_CLONES
#endif

// exp(x) of a float, in double, written so that a loop calling it vectorises (libm's exp is a
// call per element, which no compiler vectorises without -ffast-math). The usual method:
//   x = n ln2 + r,  n = round(x / ln2),  |r| <= ln2 / 2,   exp(x) = 2^n exp(r)
// with exp(r) from its Taylor series to r^8 (the remainder, < e^0.35 0.35^9 / 9! = 3e-10
// relative, is 0.005 of a float ulp) and 2^n written straight into a double's exponent bits.
// n ln2 and the 16 roundings of the series are double ones (~1e-14 relative), so rounded to
// float the result is within 0.51 ulp of exp(x): as good as glibc's expf (1 ulp), the bound
// the kernel tests' tolerances assume. Kept in double, it serves as an exactly-summable term.
// x is clamped to [-104, 89] (exp(-104) rounds to float 0, exp(89) to float inf; -inf gives 0
// once rounded to float — in double it is exp(-104) ~ 7e-46, too small to change a softmax
// sum, which holds a term >= 1 — and +inf gives inf) so that n + 1023 is a valid exponent; NaN
// stays NaN. Why not glibc's vector exp (libmvec)? GCC calls it only under -ffast-math, whose
// finite-math assumption would break the -inf and NaN handling the kernels rely on.
// (No row kernel calls it now: they use exp_float below, at half the cost. It stays, with its
// test, for a kernel that needs an exp term in double or exp's last half ulp.)
__attribute__((always_inline)) inline double exp_double(float xf) {
  constexpr double kLog2e = 1.4426950408889634, kLn2 = 0.6931471805599453;
  constexpr double kRoundMagic = 6755399441055744.0;  // 1.5 * 2^52: t's low bits hold n
  double x = xf;
  x = x < -104.0 ? -104.0 : x;
  x = x > 89.0 ? 89.0 : x;
  const double t = x * kLog2e + kRoundMagic;
  const double n = t - kRoundMagic;  // round(x / ln2), an integer in [-151, 129]
  const double r = x - n * kLn2;
  double p = 1.0 / 40320;  // 1/8!, then Horner down to 1 + r
  p = p * r + 1.0 / 5040;
  p = p * r + 1.0 / 720;
  p = p * r + 1.0 / 120;
  p = p * r + 1.0 / 24;
  p = p * r + 1.0 / 6;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // the low 12 bits of t are n (mod 4096): exponent field n + 1023 (a bit cast, not memcpy,
  // so that t never goes through memory and the loop around it still vectorises)
  const uint64_t bits = (__builtin_bit_cast(uint64_t, t) + 1023) << 52;
  return p * __builtin_bit_cast(double, bits);
}

// exp(x) of a float, in float: the same method with float arithmetic, so a vector holds twice
// as many lanes (16 in an AVX-512 register, against exp_double's 8) and it costs half as much.
// For the kernels whose exps, not their bytes, set the speed: the softmax family's forwards,
// the cross-entropy and the log_softmax backward. What float needs that double did not:
//  - ln2 in two parts (Cody and Waite): n * kLn2Hi is exact (n has at most 8 bits, kLn2Hi 9) and
//    so is r_hi = x - n * kLn2Hi (Sterbenz: the two are within a factor of 2 of each other);
//    r_lo = -n * kLn2Lo rounds, by less than 1e-9. r = r_hi + r_lo, rounded, only feeds r^2 q;
//  - exp(r) = 1 + (r_hi + (r_lo + r^2 q(r))), q the Taylor series 1/2 + r/6 + ... + r^5/5040 (to
//    r^7 in all: the remainder, < e^0.35 0.35^8 / 8! = 7e-9 relative, is 0.12 ulp). The small
//    terms are added first: r^2 q <= 0.07, so the roundings inside it are scaled down by 0.07,
//    and the rounding of r never reaches the linear term. What is left: the last two additions
//    (0.5 ulp and 0.25 ulp), the remainder, and the small terms' roundings.
// In all within 0.94 ulp of exp(x) over the whole range (tests/unit/test_cpu_exp.cpp sweeps it),
// where glibc's expf is within 0.5 and CUDA's within 2. The kernel tests compare softmax terms
// and the cross-entropy's gradient with glibc's under tolerances of 3 ulps and more.
// Domain: x <= 88 — the row kernels pass x - max <= 0, or a log-probability (<= 0); above 88.37
// the exponent field would overflow (no clamp there: a second clamp measured 20% slower in a
// summing loop). x is clamped below at -88: under 2^-126 (x < -87.34) results come out as
// subnormals, and under exp(-87.68) ~ 8e-39 as 0 (expf would give a subnormal: an absolute error
// under 1e-38, nothing to a softmax, whose largest term is 1); -inf gives 0; NaN stays NaN.
__attribute__((always_inline)) inline float exp_float(float x) {
  constexpr float kLog2e = 1.44269504f;
  constexpr float kLn2Hi = 0.693359375f;     // 355 / 512, exactly
  constexpr float kLn2Lo = -2.12194440e-4f;  // ln2 - kLn2Hi, within 2e-12
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: t's low bits hold n
  x = x < -88.f ? -88.f : x;
  const float t = x * kLog2e + kRoundMagic;
  const float n = t - kRoundMagic;  // round(x / ln2), an integer in [-127, 127] for x <= 88
  const float r_hi = x - n * kLn2Hi, r_lo = -(n * kLn2Lo);  // r_hi exact
  const float r = r_hi + r_lo;
  float q = 1.f / 5040;  // 1/7!, then Horner down to 1/2
  q = q * r + 1.f / 720;
  q = q * r + 1.f / 120;
  q = q * r + 1.f / 24;
  q = q * r + 1.f / 6;
  q = q * r + 0.5f;
  const float p = 1.f + (r_hi + (r_lo + (r * r) * q));
  // the low 9 bits of t are n (mod 512): 2^n's exponent field n + 127, in [0, 254] (0, for
  // n = -127, makes the scale and the result 0)
  const uint32_t bits = (__builtin_bit_cast(uint32_t, t) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// The statistics of a softmax row (reduce.cpp), shared with the cross-entropy (norm_loss.cpp):
// m = max_j x_j and l = sum_j exp(x_j - m), the row read from memory once.
struct RowStats {
  float m;
  double l;
};
// next: the row after this one (or null), prefetched while this one's exps are computed.
RowStats softmax_row_stats(const float* x, int64_t C, const float* next = nullptr);

// Shares rows [0, N) of an (N, C) tensor among row_threads(N * C) threads, a contiguous block of
// rows each, calling rows_fn(first_row, row_count) once per block. Every row is computed the
// same way whatever the thread count, so results do not depend on it.
template <typename RowsFn>
void for_row_blocks(int64_t N, int64_t C, RowsFn rows_fn) {
  const int threads = row_threads(N * C);
  const int64_t per = (N + threads - 1) / threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < threads; t++) {
    const int64_t r0 = std::min(N, t * per), r1 = std::min(N, r0 + per);
    if (r1 > r0) rows_fn(r0, r1 - r0);
  }
}

}  // namespace ff::cpu
