// lessons/10_precision/formats.cpp — see formats.h.
#include "lessons/10_precision/formats.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/fp8.h"  // float_to_fp8, fp8_to_float, accumulate_bits, kFp8Max

namespace ff::precision {

// [slide:bf16-round]
uint16_t round_to_bf16(float x, FormatBug bug) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN, sign and payload kept
  if (bug == FormatBug::bf16_truncate) return (uint16_t)(u >> 16);
  // [exercise:bf16-round] float32 -> bf16: keep the top 16 bits, rounding the 16 dropped ones to nearest, ties to even.
  uint32_t kept = u >> 16;            // sign, exponent, 7 mantissa bits
  const uint32_t dropped = u & 0xffffu;  // what bf16 cannot hold, in units of 2^-16 of a bf16 step
  const uint32_t half = 0x8000u;         // exactly half a bf16 step
  // above half: up; exactly half: up only when kept is odd, so that it ends even. A carry out of
  // the 7 mantissa bits moves to the next binade, the largest binade's to infinity: all right.
  if (dropped > half || (dropped == half && (kept & 1u))) kept++;
  return (uint16_t)kept;
  // [/exercise]
}
// [/slide]

float widen_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float Fp8::at(int64_t r, int64_t c) const { return (float)value(r, c); }

double Fp8::value(int64_t r, int64_t c) const {
  const int64_t tiles_c = (C + tc - 1) / tc;
  return (double)fp8_to_float(q[(size_t)(r * C + c)]) * scale[(size_t)((r / tr) * tiles_c + c / tc)];
}

// [slide:tile-scale]
Fp8 quantize(const std::vector<float>& x, int64_t R, int64_t C, int64_t tr, int64_t tc, FormatBug bug) {
  if (bug == FormatBug::per_tensor) tr = R, tc = C;  // one tile: the whole tensor
  Fp8 out{R, C, tr, tc, std::vector<uint8_t>((size_t)(R * C)),
          std::vector<float>((size_t)(((R + tr - 1) / tr) * ((C + tc - 1) / tc)))};
  const int64_t tiles_c = (C + tc - 1) / tc;
  for (int64_t r0 = 0; r0 < R; r0 += tr)
    for (int64_t c0 = 0; c0 < C; c0 += tc) {
      const int64_t r1 = std::min(R, r0 + tr), c1 = std::min(C, c0 + tc);
      // [exercise:tile-scale] One tile [r0, r1) x [c0, c1): its scale from its largest magnitude (448 in e4m3), its values divided by it and rounded (float_to_fp8).
      // [slide:tile-scale-core]
      float amax = 0.f;
      for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++) amax = std::max(amax, std::fabs(x[(size_t)(r * C + c)]));
      // the tile's largest magnitude lands on e4m3's largest value; a tile of zeros keeps scale 1
      const float scale = amax > 0.f ? amax / kFp8Max : 1.f;
      out.scale[(size_t)((r0 / tr) * tiles_c + c0 / tc)] = scale;
      for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++) out.q[(size_t)(r * C + c)] = float_to_fp8(x[(size_t)(r * C + c)] / scale);
      // [/slide]
      // [/exercise]
    }
  return out;
}
// [/slide]

// [slide:promotion]
std::vector<float> fp8_gemm(const Fp8& a, const Fp8& b, int64_t promote, int acc_bits, FormatBug bug) {
  const int64_t M = a.R, K = a.C, N = b.C, tk = a.tc, tn = b.tc;
  const int64_t a_tiles = (K + tk - 1) / tk, b_tiles = (N + tn - 1) / tn;
  std::vector<float> c((size_t)(M * N));
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      const uint8_t* ai = &a.q[(size_t)(i * K)];
      if (bug == FormatBug::no_promotion) {  // every product scaled and kept in the narrow sum
        float narrow = 0.f;
        for (int64_t p = 0; p < K; p++)
          narrow = accumulate_bits(std::fma(a.at(i, p), b.at(p, j), narrow), acc_bits);
        c[(size_t)(i * N + j)] = narrow;
        continue;
      }
      // [exercise:promotion] c[i, j]: K products in chunks of `promote`, each chunk summed in the narrow accumulator (accumulate_bits after every fma), then scaled by its tiles' scales and added to the float32 total.
      // [slide:promotion-core]
      float total = 0.f;  // float32, on the CUDA cores
      for (int64_t p0 = 0; p0 < K; p0 += promote) {
        float partial = 0.f;  // the tensor core's accumulator: acc_bits mantissa bits
        for (int64_t p = p0; p < std::min(K, p0 + promote); p++)
          partial = accumulate_bits(std::fma(fp8_to_float(ai[p]), fp8_to_float(b.q[(size_t)(p * N + j)]), partial),
                                    acc_bits);
        // promoted: the chunk lies in one tile of a (1 x tk) and one of b (tk x tn), so one
        // scale each, applied once per chunk rather than once per product
        const float sa = a.scale[(size_t)((i / a.tr) * a_tiles + p0 / tk)];
        const float sb = b.scale[(size_t)((p0 / b.tr) * b_tiles + j / tn)];
        total = std::fma(partial * sa, sb, total);
      }
      // [/slide]
      c[(size_t)(i * N + j)] = total;
      // [/exercise]
    }
  return c;
}
// [/slide]

}  // namespace ff::precision
