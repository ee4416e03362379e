// kernels/cpu/reduce.cpp — sum/max along one dim of an [outer, n, inner] view,
// softmax and log_softmax along the last dim. Sums accumulate in double.
//
// Written for speed as well as reading: each row is read from memory once (its max first; the
// passes that need the max find the row in the cache), inner loops are `omp simd` loops the
// compiler vectorises (a reduction clause lets the sum be split into vector lanes: in double,
// that reordering moves the sum by about n 2^-53 of its size, far below a float's rounding),
// every exp is computed
// once, by exp_float (row_math.h: 16 lanes to a vector), not a libm call per element, and a
// row is scaled by a reciprocal computed once. Large tensors share their rows among OpenMP
// threads (row_threads); every row is computed the same way whatever the thread count, so
// results do not depend on it.
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/row_math.h"

namespace ff::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ----------------------------------------------------------------------------
// one row

// max of x[0..n): `v > m ? v : m` from m = -inf is std::fmax's answer (a NaN never compares
// greater, so it is skipped, and m is never NaN) in a form that vectorises to max instructions.
__attribute__((always_inline)) inline float row_max(const float* x, int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
  return m;
}

__attribute__((always_inline)) inline double row_sum(const float* x, int64_t n) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; j++) s += x[j];
  return s;
}

// sum_j exp(x_j - m) over a row, each term also written to e[j] when e is given: the exps run
// 16 to a vector. A double accumulator would halve that (a vector holds 8 doubles), so the
// terms go into 16 float lanes, each lane adding 4 terms before it hands its sum to a double
// lane (3 float roundings: within 3 2^-24 of those 4 terms, relative), and the 16 double lanes
// are added in lane order at the end. The lanes are written out as arrays rather than left to
// `omp simd reduction`, so that the AVX-512 clone (one 16-float vector) and the AVX2 one (two
// of 8) add in the same order: the same bits on every CPU.
constexpr int kExpLanes = 16, kExpChunk = 4 * kExpLanes;
// `next` (or null): the row after this one, asked into the L2 cache meanwhile — this loop
// reads its row from the cache and computes, so the memory is idle; prefetched, the next
// row's max pass finds it there instead of waiting on memory.
__attribute__((always_inline)) inline double exp_sum(const float* x, float m, int64_t C, float* e,
                                                     const float* next) {
  double lanes[kExpLanes] = {};
  int64_t j = 0;
  for (; j + kExpChunk <= C; j += kExpChunk) {
    if (next)
      for (int q = 0; q < kExpChunk; q += 16) __builtin_prefetch(next + j + q, 0, 2);
    float t[kExpChunk];
#pragma omp simd
    for (int k = 0; k < kExpChunk; k++) t[k] = exp_float(x[j + k] - m);
    if (e) std::memcpy(e + j, t, sizeof t);
    float acc[kExpLanes];
#pragma omp simd
    for (int k = 0; k < kExpLanes; k++)
      acc[k] = ((t[k] + t[kExpLanes + k]) + t[2 * kExpLanes + k]) + t[3 * kExpLanes + k];
#pragma omp simd
    for (int k = 0; k < kExpLanes; k++) lanes[k] += acc[k];
  }
  double l = 0.0;
  for (int k = 0; k < kExpLanes; k++) l += lanes[k];
  for (; j < C; j++) {  // the last C mod 64 terms, in double
    const float t = exp_float(x[j] - m);
    if (e) e[j] = t;
    l += t;
  }
  return l;
}

}  // namespace

// The statistics of a softmax row: m = max_j x_j, then l = sum_j exp(x_j - m) (exp_float, within
// 0.94 ulp, so a relative 0.94 2^-23, each term) by exp_sum: l is within (0.94 + 1.5) 2^-23 of
// the exact sum, relative, and log l (of the log_softmax's and the cross-entropy's
// lse = m + log l) within 2.5 2^-23, absolute — about one rounding of lse itself when |lse| >= 2.
// Two passes: the first reads the row from memory, the second finds it in the cache (a row of
// 8192 floats is 32 KiB; a core's L2 holds rows of up to ~500 000). Lesson 01's online
// recurrence (m and l together, l rescaled by exp(m_old - m_new) when the max rises) reads the
// row once, but taken a chunk at a time, as it must be to vectorise, its short loops measured
// 40% slower than the second pass costs here. An all -inf row gives m = -inf and l = NaN, so its
// softmax is NaN, as exp(-inf - -inf) says.
FF_CPU_CLONES RowStats softmax_row_stats(const float* x, int64_t C, const float* next) {
  const float m = row_max(x, C);
  return {m, exp_sum(x, m, C, nullptr, next)};
}

// ----------------------------------------------------------------------------
// reduce and max_backward

namespace {

FF_CPU_CLONES void reduce_rows(ReduceOp op, float* out, const float* in, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; r++)
    out[r] = op == ReduceOp::sum ? (float)row_sum(in + r * n, n) : row_max(in + r * n, n);
}

// inner > 1: out[i] = op over j of p[j * inner + i], for columns [i0, i1). Walking j outside
// and i inside reads memory in order and vectorises over i; each column still adds its terms
// in order j = 0, 1, ... (in double), as the plain loop did.
FF_CPU_CLONES void reduce_columns(ReduceOp op, float* out, const float* p, int64_t n,
                                  int64_t inner, int64_t i0, int64_t i1) {
  const int64_t w = i1 - i0;
  if (op == ReduceOp::sum) {
    std::vector<double> acc((size_t)w, 0.0);
    for (int64_t j = 0; j < n; j++) {
      const float* pj = p + j * inner + i0;
#pragma omp simd
      for (int64_t i = 0; i < w; i++) acc[i] += pj[i];
    }
    for (int64_t i = 0; i < w; i++) out[i0 + i] = (float)acc[i];
  } else {
    float* o = out + i0;
    for (int64_t i = 0; i < w; i++) o[i] = kNegInf;
    for (int64_t j = 0; j < n; j++) {
      const float* pj = p + j * inner + i0;
#pragma omp simd
      for (int64_t i = 0; i < w; i++) o[i] = pj[i] > o[i] ? pj[i] : o[i];
    }
  }
}

constexpr int64_t kColumnBlock = 1024;  // columns per task of reduce_columns: 8 KiB of sums

}  // namespace

void reduce(ReduceOp op, float* out, const float* in, int64_t outer, int64_t n, int64_t inner) {
  if (inner == 1) {
    for_row_blocks(outer, n, [&](int64_t r0, int64_t rows) {
      reduce_rows(op, out + r0, in + r0 * n, rows, n);
    });
    return;
  }
  const int threads = row_threads(outer * n * inner);
  const int64_t blocks = (inner + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t task = 0; task < outer * blocks; task++) {
    const int64_t o = task / blocks, i0 = (task % blocks) * kColumnBlock;
    reduce_columns(op, out + o * inner, in + o * n * inner, n, inner, i0,
                   std::min(inner, i0 + kColumnBlock));
  }
}

namespace {

// dx routes dy to the first j where x equals the max y, zeros elsewhere: one pass that writes
// the zeros and finds that j (a min reduction over the hits: n when there is none).
FF_CPU_CLONES void max_backward_rows(float* dx, const float* x, const float* y, const float* dy,
                                     int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; r++) {
    const float* p = x + r * n;
    float* d = dx + r * n;
    const float yr = y[r];
    int64_t first = n;
#pragma omp simd reduction(min : first)
    for (int64_t j = 0; j < n; j++) {
      first = p[j] == yr && j < first ? j : first;
      d[j] = 0.f;
    }
    if (first < n) d[first] = dy[r];
  }
}

// inner > 1: the same per column, j outside and i inside (in memory order).
FF_CPU_CLONES void max_backward_columns(float* d, const float* p, const float* y, const float* dy,
                                        int64_t n, int64_t inner) {
  std::vector<int64_t> first((size_t)inner, n);
  for (int64_t j = 0; j < n; j++) {
    const float* pj = p + j * inner;
    float* dj = d + j * inner;
#pragma omp simd
    for (int64_t i = 0; i < inner; i++) {
      first[i] = pj[i] == y[i] && first[i] == n ? j : first[i];
      dj[i] = 0.f;
    }
  }
  for (int64_t i = 0; i < inner; i++)
    if (first[i] < n) d[first[i] * inner + i] = dy[i];
}

}  // namespace

void max_backward(float* dx, const float* x, const float* y, const float* dy, int64_t outer,
                  int64_t n, int64_t inner) {
  if (inner == 1) {
    for_row_blocks(outer, n, [&](int64_t r0, int64_t rows) {
      max_backward_rows(dx + r0 * n, x + r0 * n, y + r0, dy + r0, rows, n);
    });
    return;
  }
  const int threads = row_threads(outer * n * inner);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t o = 0; o < outer; o++)
    max_backward_columns(dx + o * n * inner, x + o * n * inner, y + o * inner, dy + o * inner, n,
                         inner);
}

// ----------------------------------------------------------------------------
// softmax and log_softmax along the last dim: rows [r0, r1) of (N, C)

namespace {

// y = exp(x - m) / l, each exp computed once: three sweeps of the row, softmax_row_stats's two
// (the max, then the sum of e_j = exp(x_j - m), each e_j also written to y) and a third that
// scales y by 1 / l (the row is still in the cache). Rounding: e_j within 0.94 ulp (exp_float), l within 2.5 2^-23 of the exact sum
// (relative), 1 / l rounded to float and the product: within 5 ulps of the exact softmax (the
// kernel tests allow 124, the goldens 1e-5).
FF_CPU_CLONES void softmax_rows(float* y, const float* x, int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    const float m = row_max(xr, C);
    const double l = exp_sum(xr, m, C, yr, r + 1 < rows ? xr + C : nullptr);
    const float inv_l = (float)(1.0 / l);
#pragma omp simd
    for (int64_t j = 0; j < C; j++) yr[j] *= inv_l;
  }
}

// dx = y (dy - dot), dot = sum_j dy_j y_j (float products are exact in double)
FF_CPU_CLONES void softmax_backward_rows(float* dx, const float* y, const float* dy, int64_t rows,
                                         int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float* yr = y + r * C;
    const float* dyr = dy + r * C;
    double dot = 0.0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < C; j++) dot += (double)dyr[j] * yr[j];
    const float d = (float)dot;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) dx[r * C + j] = yr[j] * (dyr[j] - d);
  }
}

// y = x - lse, lse = m + log l: the statistics pass, then one subtraction per element.
FF_CPU_CLONES void log_softmax_rows(float* y, const float* x, int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * C;
    const RowStats s = softmax_row_stats(xr, C, r + 1 < rows ? xr + C : nullptr);
    const float lse = s.m + (float)std::log(s.l);
#pragma omp simd
    for (int64_t j = 0; j < C; j++) y[r * C + j] = xr[j] - lse;
  }
}

// dx = dy - exp(y) s, s = sum_j dy_j (y is a log-probability, <= 0: exp_float's domain)
FF_CPU_CLONES void log_softmax_backward_rows(float* dx, const float* y, const float* dy,
                                             int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; r++) {
    const float* yr = y + r * C;
    const float* dyr = dy + r * C;
    const float s = (float)row_sum(dyr, C);
#pragma omp simd
    for (int64_t j = 0; j < C; j++) dx[r * C + j] = dyr[j] - exp_float(yr[j]) * s;
  }
}

}  // namespace

void softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
  for_row_blocks(N, C, [&](int64_t r0, int64_t rows) { softmax_rows(y + r0 * C, x + r0 * C, rows, C); });
}

void softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  for_row_blocks(N, C, [&](int64_t r0, int64_t rows) {
    softmax_backward_rows(dx + r0 * C, y + r0 * C, dy + r0 * C, rows, C);
  });
}

void log_softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
  for_row_blocks(N, C, [&](int64_t r0, int64_t rows) { log_softmax_rows(y + r0 * C, x + r0 * C, rows, C); });
}

void log_softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  for_row_blocks(N, C, [&](int64_t r0, int64_t rows) {
    log_softmax_backward_rows(dx + r0 * C, y + r0 * C, dy + r0 * C, rows, C);
  });
}

}  // namespace ff::cpu
