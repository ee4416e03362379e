// kernels/cuda/layout.cu — data movement: transpose of two dims, block copies (slice and
// concat). The cpu twins are in kernels/cpu/layout.cpp. No arithmetic besides copy_block's
// optional accumulate, so results are bit-identical to cpu.
//
// transpose: in (A, D0, Bm, D1, Cn) -> out (A, D1, Bm, D0, Cn).
//   Cn == 1 (the innermost dims are the ones swapped, e.g. Kᵀ in attention): the classic
//   shared-memory tiled transpose. A 32x32 tile is read row by row (coalesced along j) into
//   shared memory, and written row by row of the output (coalesced along i). The tile is
//   32 x 33 floats: the padding column puts the 32 elements of a tile column in 32 different
//   shared-memory banks, so the column reads do not serialise.
//   Cn > 1: the contiguous last dim does not move, so one thread per output element reads
//   and writes consecutive addresses already; no tile needed.
// copy_block: dst (outer, dst_n, inner)[:, dst_off + j, :] (+)= src (outer, src_n, inner)
//   [:, src_off + j, :] for j < len; one thread per copied element.
#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

constexpr int kTile = 32;      // transpose tile: 32 x 32 elements
constexpr int kTileRows = 8;   // a block is 32 x 8 threads; each copies 4 rows of its tile

// ----------------------------------------------------------------------------
// kernels

// in (P, D0, D1) -> out (P, D1, D0) for P = A * Bm matrices, when Cn == 1. Matrix p of the
// input is (a, b) = (p / Bm, p % Bm); its elements are at in[((a*D0 + i)*Bm + b)*D1 + j].
// grid: (ceil(D1 / 32), ceil(D0 / 32), matrices in z, grid-strided over P)
__global__ void transpose_tiled_kernel(float* out, const float* in, int64_t P, int64_t D0,
                                       int64_t Bm, int64_t D1) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts on the column reads
  const int64_t i0 = (int64_t)blockIdx.y * kTile, j0 = (int64_t)blockIdx.x * kTile;
  for (int64_t p = blockIdx.z; p < P; p += gridDim.z) {
    const int64_t a = p / Bm, b = p % Bm;
    // load: tile[r][c] = in[i0 + r, j0 + c] (threads along c read consecutive j)
    for (int r = threadIdx.y; r < kTile; r += kTileRows) {
      int64_t i = i0 + r, j = j0 + threadIdx.x;
      if (i < D0 && j < D1) tile[r][threadIdx.x] = in[((a * D0 + i) * Bm + b) * D1 + j];
    }
    __syncthreads();
    // store: out[j0 + r, i0 + c] = tile[c][r] (threads along c write consecutive i)
    for (int r = threadIdx.y; r < kTile; r += kTileRows) {
      int64_t j = j0 + r, i = i0 + threadIdx.x;
      if (i < D0 && j < D1) out[((a * D1 + j) * Bm + b) * D0 + i] = tile[threadIdx.x][r];
    }
    __syncthreads();  // before the next matrix overwrites the tile
  }
}

// The general case, Cn > 1: one thread per output element, decoded from its flat index.
__global__ void transpose_kernel(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm,
                                 int64_t D1, int64_t Cn) {
  const int64_t n = A * D0 * Bm * D1 * Cn;
  for (int64_t o = grid_index(); o < n; o += grid_stride()) {
    // o = (((a * D1 + j) * Bm + b) * D0 + i) * Cn + c
    int64_t c = o % Cn, rest = o / Cn;
    int64_t i = rest % D0;
    rest /= D0;
    int64_t b = rest % Bm;
    rest /= Bm;
    int64_t j = rest % D1, a = rest / D1;
    out[o] = in[(((a * D0 + i) * Bm + b) * D1 + j) * Cn + c];
  }
}

__global__ void copy_block_kernel(float* dst, int64_t dst_n, int64_t dst_off, const float* src,
                                  int64_t src_n, int64_t src_off, int64_t outer, int64_t len,
                                  int64_t inner, bool accumulate) {
  const int64_t n = outer * len * inner;
  for (int64_t e = grid_index(); e < n; e += grid_stride()) {
    int64_t i = e % inner, j = e / inner % len, o = e / inner / len;
    float* d = dst + (o * dst_n + dst_off + j) * inner + i;
    float s = src[(o * src_n + src_off + j) * inner + i];
    *d = accumulate ? *d + s : s;
  }
}

// ----------------------------------------------------------------------------
// launchers

void transpose(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm, int64_t D1,
               int64_t Cn) {
  const int64_t n = A * D0 * Bm * D1 * Cn;
  if (n == 0) return;
  if (Cn == 1) {
    const int64_t P = A * Bm;
    dim3 grid((unsigned)((D1 + kTile - 1) / kTile), (unsigned)((D0 + kTile - 1) / kTile),
              (unsigned)(P < 65535 ? P : 65535));
    // grid.y is at most 65535 tiles of 32 rows: D0 up to ~2M rows.
    SIMT_LAUNCH(transpose_tiled_kernel, grid, dim3(kTile, kTileRows), 0, 0, out, in, P, D0, Bm, D1);
  } else {
    SIMT_LAUNCH(transpose_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, out, in, A, D0, Bm,
                D1, Cn);
  }
  SIMT_CHECK_LAUNCH();
}

void copy_block(float* dst, int64_t dst_n, int64_t dst_off, const float* src, int64_t src_n,
                int64_t src_off, int64_t outer, int64_t len, int64_t inner, bool accumulate) {
  const int64_t n = outer * len * inner;
  if (n == 0) return;
  SIMT_LAUNCH(copy_block_kernel, elementwise_grid(n), kElementwiseBlock, 0, 0, dst, dst_n,
              dst_off, src, src_n, src_off, outer, len, inner, accumulate);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
