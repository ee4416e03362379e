// kernels/cpu/layout.cpp — data movement: transpose of two dims, block copies
// (slice/concat). Exact: no arithmetic besides the optional accumulate.
#include <algorithm>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/row_math.h"

namespace ff::cpu {

namespace {

// Tiles of kTile x kTile (i, j) pairs: a tile's 32 rows of the input and 32 rows of the output
// (4 KiB each when Cn = 1) stay in the L1 cache while it is copied, so each cache line is
// fetched once — the plain loop writes one float per line of the output and fetches every line
// again for the next i.
constexpr int64_t kTile = 32;

// out[a, j, b, i, c] = in[a, i, b, j, c] for i in [i0, i1), all j.
FF_CPU_CLONES void transpose_tile_rows(float* out, const float* in, int64_t a, int64_t D0,
                                       int64_t Bm, int64_t b, int64_t D1, int64_t Cn, int64_t i0,
                                       int64_t i1) {
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
      float tile[kTile][kTile];
      for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) tile[j - j0][i - i0] = src[i * in_i + j];
      for (int64_t j = j0; j < j1; j++)
        for (int64_t i = i0; i < i1; i++) dst[j * out_j + i] = tile[j - j0][i - i0];
      continue;
    }
    for (int64_t i = i0; i < i1; i++)
      for (int64_t j = j0; j < j1; j++) {
        const float* s = src + i * in_i + j * Cn;
        float* d = dst + j * out_j + i * Cn;
        for (int64_t c = 0; c < Cn; c++) d[c] = s[c];
      }
  }
}

}  // namespace

// Swaps dims D0 and D1 of an (A, D0, Bm, D1, Cn) tensor. Tasks of kTile values of i for one
// (a, b) are shared among the threads (row_threads).
void transpose(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm, int64_t D1,
               int64_t Cn) {
  const int64_t tiles = (D0 + kTile - 1) / kTile;
  const int threads = row_threads(A * D0 * Bm * D1 * Cn);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t task = 0; task < A * Bm * tiles; task++) {
    const int64_t a = task / (Bm * tiles), b = task / tiles % Bm, i0 = task % tiles * kTile;
    transpose_tile_rows(out, in, a, D0, Bm, b, D1, Cn, i0, std::min(D0, i0 + kTile));
  }
}

void copy_block(float* dst, int64_t dst_n, int64_t dst_off, const float* src, int64_t src_n,
                int64_t src_off, int64_t outer, int64_t len, int64_t inner, bool accumulate) {
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < len; j++) {
      float* d = dst + (o * dst_n + dst_off + j) * inner;
      const float* s = src + (o * src_n + src_off + j) * inner;
      for (int64_t i = 0; i < inner; i++) d[i] = accumulate ? d[i] + s[i] : s[i];
    }
}

}  // namespace ff::cpu
