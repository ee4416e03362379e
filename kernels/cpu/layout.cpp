// kernels/cpu/layout.cpp — data movement: transpose of two dims, block copies
// (slice/concat). Exact: no arithmetic besides the optional accumulate.
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/row_math.h"

namespace ff::cpu {

namespace {

// Tiles of kTile x kTile (i, j) pairs: a tile's 32 rows of the input and 32 rows of the output
// (4 KiB each when Cn = 1) stay in the L1 cache while it is copied, so each cache line is
// fetched once — the plain loop writes one float per line of the output and fetches every line
// again for the next i.
constexpr int64_t kTile = 32;

// An 8 x 8 block in registers: 8 rows of src (stride ls) are loaded as 8 vectors, and 8 rows of
// dst (stride ld) stored, so 64 floats move in 16 loads and stores instead of 64 of each.
// Between them, three rounds of shuffles that each interleave pairs of vectors, the standard
// AVX sequence (unpack, shuffle, permute of 128-bit halves), written with GCC's and Clang's
// portable vector extensions: the compiler picks each clone's instructions (two SSE halves in
// the baseline one, NEON on arm64). Other compilers get the plain loop.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define FF_HAVE_SHUFFLEVECTOR 1
#endif
#endif

#if defined(FF_HAVE_SHUFFLEVECTOR)
typedef float Vec8 __attribute__((vector_size(32)));

__attribute__((always_inline)) inline void transpose8x8(float* dst, int64_t ld, const float* src,
                                                        int64_t ls) {
  Vec8 r[8];  // r[i] = src row i = (i0 i1 ... i7), written a b c d e f g h for rows 0..7 below
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++) __builtin_memcpy(&r[i], src + i * ls, sizeof(Vec8));
  // round 1, pairs of rows: t0 = (a0 b0 a1 b1 | a4 b4 a5 b5), t1 = (a2 b2 a3 b3 | a6 b6 a7 b7)
  Vec8 t[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  // round 2, pairs of pairs: u0 = (a0 b0 c0 d0 | a4 b4 c4 d4), u1 = columns 1 | 5 of rows
  // a..d, u2 = columns 2 | 6, u3 = 3 | 7; u4..u7 the same for rows e..h
  Vec8 u[8];
#pragma GCC unroll 2
  for (int h = 0; h < 8; h += 4)
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
      u[h + 2 * k] = __builtin_shufflevector(t[h + k], t[h + k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[h + 2 * k + 1] =
          __builtin_shufflevector(t[h + k], t[h + k + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  // round 3, halves: column c (c < 4) = (low half of u[c], low half of u[c + 4]); column c + 4
  // the high halves
#pragma GCC unroll 4
  for (int c = 0; c < 4; c++) {
    const Vec8 lo = __builtin_shufflevector(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const Vec8 hi = __builtin_shufflevector(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    __builtin_memcpy(dst + c * ld, &lo, sizeof(Vec8));
    __builtin_memcpy(dst + (c + 4) * ld, &hi, sizeof(Vec8));
  }
}
#else
inline void transpose8x8(float* dst, int64_t ld, const float* src, int64_t ls) {
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) dst[j * ld + i] = src[i * ls + j];
}
#endif

// One tile row, 32 floats (128 bytes), to the output. A transpose bigger than the caches
// writes each output line once and never reads it back here: with `stream`, non-temporal
// stores send the lines to memory without first reading them into the cache (a plain store
// reads every line it writes to: half the traffic of a transpose out of cache, and what
// memcpy's own streaming stores avoid). SSE's 16-byte stream store is part of every x86-64;
// other CPUs copy.
inline void store_row(float* dst, const float* row, bool stream) {
#if defined(__SSE2__)
  if (stream) {
    for (int k = 0; k < kTile; k += 4) _mm_stream_ps(dst + k, _mm_load_ps(row + k));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, row, kTile * sizeof(float));
}

// out[a, j, b, i, c] = in[a, i, b, j, c] for i in [i0, i1), all j.
FF_CPU_CLONES void transpose_tile_rows(float* out, const float* in, int64_t a, int64_t D0,
                                       int64_t Bm, int64_t b, int64_t D1, int64_t Cn, int64_t i0,
                                       int64_t i1, bool stream) {
  const int64_t in_i = Bm * D1 * Cn, out_j = Bm * D0 * Cn;  // strides of i in in, j in out
  const float* src = in + ((a * D0 * Bm + b) * D1) * Cn;    // in[a, 0, b, 0, 0]
  float* dst = out + ((a * D1 * Bm + b) * D0) * Cn;         // out[a, 0, b, 0, 0]
  for (int64_t j0 = 0; j0 < D1; j0 += kTile) {
    const int64_t j1 = std::min(D1, j0 + kTile);
    if (Cn == 1) {
      // Through a 4 KiB buffer: each input row segment is read, and each output row segment
      // written, in one contiguous run. Writing straight to the output would touch 32 lines a
      // row apart in turn, and when a row is a multiple of 4 KiB (a 1024 x 1024 matrix) they
      // all fall into one set of the L1 cache and evict each other (~10x slower at 8192^2).
      // Into the buffer, 8 x 8 blocks in registers; a ragged tile at the edge (fewer than 32
      // rows or columns left), one float at a time.
      alignas(64) float tile[kTile][kTile];  // tile[j - j0][i - i0]
      const int64_t ni = i1 - i0, nj = j1 - j0;
      if (ni == kTile && nj == kTile) {  // a whole tile: loops of known length, unrolled
        for (int64_t i = 0; i < kTile; i += 8)
          for (int64_t j = 0; j < kTile; j += 8)
            transpose8x8(&tile[j][i], kTile, src + (i0 + i) * in_i + j0 + j, in_i);
        for (int64_t j = 0; j < kTile; j++) store_row(dst + (j0 + j) * out_j + i0, tile[j], stream);
        continue;
      }
      for (int64_t i = 0; i < ni; i++)
        for (int64_t j = 0; j < nj; j++) tile[j][i] = src[(i0 + i) * in_i + j0 + j];
      for (int64_t j = 0; j < nj; j++)
        std::memcpy(dst + (j0 + j) * out_j + i0, tile[j], ni * sizeof(float));
      continue;
    }
    for (int64_t i = i0; i < i1; i++)
      for (int64_t j = j0; j < j1; j++) {
        const float* s = src + i * in_i + j * Cn;
        float* d = dst + j * out_j + i * Cn;
        for (int64_t c = 0; c < Cn; c++) d[c] = s[c];
      }
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // this thread's streamed lines reach memory before it moves on
#endif
}

}  // namespace

// Swaps dims D0 and D1 of an (A, D0, Bm, D1, Cn) tensor. Tasks of kTile values of i for one
// (a, b) are shared among the threads (row_threads).
void transpose(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm, int64_t D1,
               int64_t Cn) {
  const int64_t tiles = (D0 + kTile - 1) / kTile;
  const int64_t n = A * D0 * Bm * D1 * Cn;
  const int threads = row_threads(n);
  // Streaming stores for outputs beyond the caches (8 MiB) whose tile rows start 16-byte
  // aligned: out itself, and every offset a multiple of 4 floats — out[a, j, b, i0] is at
  // ((a D1 + j) Bm + b) D0 + i0 with i0 a multiple of 32, so D0 must be a multiple of 4.
  const bool stream = n * (int64_t)sizeof(float) > (int64_t(8) << 20) && Cn == 1 &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0 && D0 % 4 == 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t task = 0; task < A * Bm * tiles; task++) {
    const int64_t a = task / (Bm * tiles), b = task / tiles % Bm, i0 = task % tiles * kTile;
    transpose_tile_rows(out, in, a, D0, Bm, b, D1, Cn, i0, std::min(D0, i0 + kTile), stream);
  }
}

// Each (o, j) moves one contiguous run of `inner` floats (a memcpy, or an add); the runs are
// independent, so large copies share them among threads (row_math.h's rule).
void copy_block(float* dst, int64_t dst_n, int64_t dst_off, const float* src, int64_t src_n,
                int64_t src_off, int64_t outer, int64_t len, int64_t inner, bool accumulate) {
  const int threads = row_threads(outer * len * inner);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < len; j++) {
      float* d = dst + (o * dst_n + dst_off + j) * inner;
      const float* s = src + (o * src_n + src_off + j) * inner;
      if (!accumulate) {
        std::copy(s, s + inner, d);
        continue;
      }
#pragma omp simd
      for (int64_t i = 0; i < inner; i++) d[i] = d[i] + s[i];
    }
}

}  // namespace ff::cpu
