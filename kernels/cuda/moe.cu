// kernels/cuda/moe.cu — the mixture-of-experts kernels (lessons 03, 04): the permute plan (a
// counting sort of the routing slots by expert), the grouped GEMM and its weight gradient, and
// the combine (unpermute) with its backward. The readable definitions, with the why, are the
// cpu twins in kernels/cpu/moe.cpp; these kernels compute exactly the same things.
//
// Shapes (letters of kernels/kernels.h): T tokens, k choices each, G experts; routing slot
// s = t * k + j. topk_idx, pos, gates, dgates (T*k); src_token (T*k); group_sizes (G). Packed
// rows are sorted by expert, group e being rows [off_e, off_e + n_e), n_e = group_sizes[e],
// off_e = n_0 + ... + n_{e-1}: a (M, K), c (M, Nc), dc (M, Nc), yp, dyp (T*k, d), M = sum n_e.
// w (G, K, Nc), or (G, Nc, K) with trans_w; dw (G, K, Nc); y, dy (T, d).
//
// moe_permute_plan: grid G, block 256 (8 warps): ONE BLOCK PER EXPERT. No block depends on
//   another (no atomics, no second kernel), because block e finds everything it needs itself,
//   walking all T*k slots twice:
//   1. count: each thread counts, over slots s = tid, tid + 256, ..., the slots of expert e and
//      those of experts before e; two block-wide sums (warp shuffles, then the 8 warp partials
//      through shared memory) give n_e, written to group_sizes[e], and off_e — the exclusive
//      prefix sum of the histogram at e, without ever building the histogram.
//   2. stable scatter: the slots in chunks of 256, in slot order. In a chunk, thread i tests
//      slot s0 + i; __ballot_sync gives its warp a 32-bit mask of the matching lanes, and
//      __popc(mask & the lanes below mine) counts the matches before me in my warp. Lane 0
//      posts the warp's total __popc(mask) to shared memory; after a barrier every thread adds
//      up the totals of the warps before its own (a scan of 8 numbers). A matching slot's rank
//      within expert e is then base + (matches in earlier warps) + (matches earlier in my warp),
//      base = the matches of the earlier chunks, carried in a register (the same in all
//      threads). It takes packed row off_e + rank: pos[s] = row, src_token[row] = s / k.
//      Ranks follow slot order, so this is the cpu's stable counting sort, bit for bit.
//   Why not atomics: an atomicAdd on a per-expert "next row" counter would give every slot a
//   row, but in whatever order the atomics land — not stable, not the cpu's order, and not the
//   same from one run to the next. The cost of independence: each block reads all T*k ids twice,
//   2 G T k reads in all (G = 64, T*k = 32k: 4M int64 reads, mostly from L2: microseconds). At
//   scale one would sort instead, reading each id O(1) times (per-tile histograms, one scan, a
//   scatter; CUB's radix sort does this).
//
// grouped_gemm: 32x32 shared-memory tiles, as matmul.cu's version 2, over a TILE SCHEDULE in
//   which no tile straddles two groups: group e's rows are cut into ceil(n_e / 32) row tiles
//   (its last one short), and the row tiles of all groups are numbered in order (MegaBlocks,
//   Gale et al. 2022, and JAX's ragged_dot tile grouped GEMMs the same way). Grid (column
//   tiles of Nc, row tiles), block 32x32. A block finds its row tile by walking group_sizes
//   (find_row_tile: G reads of the same address by every thread, broadcasts), so all its threads
//   get the same (group, rows); a block past the last tile leaves the loop before any barrier,
//   all threads together. Group sizes live on the device, so the host launches an upper bound:
//   sum_e ceil(n_e / 32) <= floor(M / 32) + (non-empty groups) <= M / 32 + min(G, M) — each
//   group wastes at most one short tile, and the grid at most min(G, M) idle blocks.
//   Inside a tile it is matmul v2 with b = w_e: K in steps of 32, a 32x32 tile of a and of w_e
//   staged in shared memory (each value loaded is used by 32 threads), one element of c per
//   thread, summed in a float register in the cpu loop's order. trans_w only changes which
//   global index a load of w_e reads; both ways, consecutive threads read consecutive addresses.
// grouped_gemm_dw: dw_e = a_e^T dc_e, a GEMM whose reduction runs over the group's rows. Grid
//   (column tiles of Nc, row tiles of K, G), block 32x32: block (tn, ti, e) owns a 32x32 tile of
//   dw_e; every thread computes off_e (the sum of the sizes before e); the block walks group
//   e's rows 32 at a time, staging 32 rows of a (32 of its K columns) and of dc (32 of its Nc
//   columns). An empty group runs no step: its tile is 0 when assigning, unchanged when
//   accumulating — exactly, as the cpu.
//
// moe_combine: the row layout of rows.h with rows = tokens: a warp per token (d <= 1024, block
//   (32, 4)), a block of 256 per token above. Thread c of a token's row group computes
//   y[t, c] = sum_j g_tj yp[pos[t k + j], c], j in order as the cpu. Consecutive threads read
//   consecutive columns of a packed row and write consecutive columns of y: coalesced. A
//   gather: each element of y is written by one thread, no atomics, deterministic.
// moe_combine_backward: the same layout with rows = slots. Slot s's row group writes
//   dyp[pos[s], :] = g_s dy[t, :] with plain stores (the plan is a permutation: each packed row
//   belongs to one slot) and sums dy[t, c] yp[pos[s], c] over its columns, combined over the
//   row group by row_sum (rows.h) into dgates[s].
#include <algorithm>
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/rows.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

constexpr int kPlanThreads = 256;              // permute plan: a block of 8 warps per expert
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kGemmTile = 32;                  // grouped GEMMs: 32x32 tiles, 32x32 threads
constexpr int64_t kMaxGridX = 2147483647;      // CUDA's limits on a grid
constexpr int64_t kMaxGridYZ = 65535;

// File-local (an anonymous namespace): other kernel files have helpers of the same names.
namespace {

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t n, int64_t d) {
  return (n + d - 1) / d;
}

// ----------------------------------------------------------------------------
// permute plan: a block per expert

// The sum of v over the kPlanThreads threads of the block, in every one of them.
// warp_part: kPlanWarps slots of shared memory.
__device__ long long plan_block_sum(long long v, long long* warp_part) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();  // every warp's partial is posted
  long long total = 0;
  for (int w = 0; w < kPlanWarps; w++) total += warp_part[w];
  __syncthreads();  // every thread has read the slots before they are written again
  return total;
}

// group_sizes (G), src_token (T*k), pos (T*k); topk_idx (T*k). Block e handles expert e.
__global__ void permute_plan_kernel(int64_t* group_sizes, int64_t* src_token, int64_t* pos,
                                    const int64_t* topk_idx, int64_t T, int64_t k) {
  __shared__ long long warp_part[kPlanWarps];  // the block sums of step 1
  __shared__ int warp_matches[kPlanWarps];     // step 2: matches per warp in this chunk
  const int64_t e = blockIdx.x, slots = T * k;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // 1. count: the slots of expert e (its group's size) and of the experts before e (its
  //    group's first packed row).
  long long mine = 0, before = 0;
  for (int64_t s = threadIdx.x; s < slots; s += blockDim.x) {
    const int64_t expert = topk_idx[s];
    mine += expert == e;
    before += expert < e;
  }
  const long long size_e = plan_block_sum(mine, warp_part);
  const long long off_e = plan_block_sum(before, warp_part);
  if (threadIdx.x == 0) group_sizes[e] = size_e;

  // 2. stable scatter: chunks of blockDim.x slots, in slot order. Every thread runs every
  //    chunk (s past the end just does not match), so all reach the ballot and the barriers.
  long long base = off_e;  // the packed row of expert e's next slot: off_e + matches so far
  for (int64_t s0 = 0; s0 < slots; s0 += blockDim.x) {
    const int64_t s = s0 + threadIdx.x;
    const bool match = s < slots && topk_idx[s] == e;
    const unsigned mask = __ballot_sync(kFullMask, match);  // bit l: lane l matches
    if (lane == 0) warp_matches[warp] = __popc(mask);
    __syncthreads();  // every warp's count is posted
    int in_earlier_warps = 0, in_chunk = 0;
    for (int w = 0; w < kPlanWarps; w++) {
      in_earlier_warps += w < warp ? warp_matches[w] : 0;
      in_chunk += warp_matches[w];
    }
    if (match) {
      const unsigned lanes_below = (1u << lane) - 1u;
      const int64_t row = base + in_earlier_warps + __popc(mask & lanes_below);
      pos[s] = row;
      src_token[row] = s / k;
    }
    base += in_chunk;
    __syncthreads();  // every thread has read warp_matches before the next chunk rewrites it
  }
}

// ----------------------------------------------------------------------------
// grouped GEMM: 32x32 tiles over a schedule of group-aligned row tiles

// A row tile of the schedule: packed rows [row0, min(row0 + kGemmTile, row_end)), all of
// group e (row_end is the group's end).
struct RowTile {
  int64_t e, row0, row_end;
  bool valid;  // false past the last tile of the last group
};

// Tile number `tile` of the schedule: group e's rows cut into ceil(n_e / kGemmTile) tiles, the
// groups in order. Every thread of a block calls it with the same `tile` and reads the same
// sizes, so all get the same answer and a branch on it is uniform.
__device__ RowTile find_row_tile(const int64_t* group_sizes, int64_t G, int64_t tile) {
  int64_t first_row = 0;  // of group e
  for (int64_t e = 0; e < G; e++) {
    const int64_t n = group_sizes[e], tiles = ceil_div(n, kGemmTile);
    if (tile < tiles) return {e, first_row + tile * kGemmTile, first_row + n, true};
    tile -= tiles;
    first_row += n;
  }
  return {0, 0, 0, false};
}

// c (M, Nc) (+)= a (M, K) rows of group e times op(w_e); w (G, K, Nc), or (G, Nc, K) when
// trans_w. row_tiles: the launcher's bound on the tiles of the schedule.
// T: float, or uint16_t for bf16 operands (grouped_gemm_bf16), widened as the tiles load.
template <typename T>
__global__ void grouped_gemm_kernel(float* c, const T* a, const T* w,
                                    const int64_t* group_sizes, int64_t G, int64_t K, int64_t Nc,
                                    int64_t row_tiles, bool trans_w, bool accumulate) {
  // As[r][p] = a[row0 + r][k0 + p], Ws[p][j] = op(w_e)[k0 + p][n0 + j]. The +1 column of
  // padding: with trans_w a warp stores a column of Ws, and rows of 33 floats put its 32
  // elements in 32 different banks (see matmul.cu, version 2).
  __shared__ float As[kGemmTile][kGemmTile + 1];
  __shared__ float Ws[kGemmTile][kGemmTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col_tiles = ceil_div(Nc, kGemmTile);

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const RowTile rt = find_row_tile(group_sizes, G, tile);
    if (!rt.valid) break;  // past the schedule's end (uniform; later tiles are past it too)
    const T* we = w + rt.e * K * Nc;
    for (int64_t tn = blockIdx.x; tn < col_tiles; tn += gridDim.x) {
      const int64_t n0 = tn * kGemmTile;
      float sum = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += kGemmTile) {
        // One element of each tile per thread, 0 outside the group's rows and the matrices.
        // a is (M, K): tx runs along K, so consecutive threads read consecutive addresses.
        const int64_t r = rt.row0 + ty;
        As[ty][tx] = (r < rt.row_end && k0 + tx < K) ? widen(a[r * K + k0 + tx]) : 0.f;
        if (!trans_w)  // w_e is (K, Nc): tx along Nc
          Ws[ty][tx] = (k0 + ty < K && n0 + tx < Nc) ? widen(we[(k0 + ty) * Nc + n0 + tx]) : 0.f;
        else           // w_e is (Nc, K): tx along K, stored transposed into Ws
          Ws[tx][ty] = (k0 + tx < K && n0 + ty < Nc) ? widen(we[(n0 + ty) * K + k0 + tx]) : 0.f;
        __syncthreads();  // the tiles are complete
        for (int p = 0; p < kGemmTile; p++) sum += As[ty][p] * Ws[p][tx];
        __syncthreads();  // everyone is done with the tiles before the next load
      }
      const int64_t i = rt.row0 + ty, j = n0 + tx;
      if (i < rt.row_end && j < Nc) {
        float* out = c + i * Nc + j;
        *out = accumulate ? *out + sum : sum;
      }
    }
  }
}

// dw (G, K, Nc) (+)= a_e^T dc_e per group; a (M, K), dc (M, Nc).
template <typename T>
__global__ void grouped_gemm_dw_kernel(float* dw, const T* a, const T* dc,
                                       const int64_t* group_sizes, int64_t G, int64_t K,
                                       int64_t Nc, bool accumulate) {
  // As[r][i] = a[r0 + r][i0 + i], Ds[r][j] = dc[r0 + r][n0 + j]: 32 rows of the group. In the
  // product loop a warp (one ty) reads As[r][ty], one address: a broadcast.
  __shared__ float As[kGemmTile][kGemmTile + 1];
  __shared__ float Ds[kGemmTile][kGemmTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t k_tiles = ceil_div(K, kGemmTile), n_tiles = ceil_div(Nc, kGemmTile);

  for (int64_t e = blockIdx.z; e < G; e += gridDim.z) {
    int64_t first = 0;  // group e is packed rows [first, end)
    for (int64_t g = 0; g < e; g++) first += group_sizes[g];
    const int64_t end = first + group_sizes[e];
    float* dwe = dw + e * K * Nc;
    for (int64_t ti = blockIdx.y; ti < k_tiles; ti += gridDim.y)
      for (int64_t tn = blockIdx.x; tn < n_tiles; tn += gridDim.x) {
        const int64_t i0 = ti * kGemmTile, n0 = tn * kGemmTile;
        float sum = 0.f;
        for (int64_t r0 = first; r0 < end; r0 += kGemmTile) {
          // Thread (ty, tx) loads row r0 + ty, column tx of each tile: coalesced along rows.
          const bool row_in = r0 + ty < end;
          As[ty][tx] = (row_in && i0 + tx < K) ? widen(a[(r0 + ty) * K + i0 + tx]) : 0.f;
          Ds[ty][tx] = (row_in && n0 + tx < Nc) ? widen(dc[(r0 + ty) * Nc + n0 + tx]) : 0.f;
          __syncthreads();  // the tiles are complete
          for (int r = 0; r < kGemmTile; r++) sum += As[r][ty] * Ds[r][tx];
          __syncthreads();  // everyone is done with the tiles before the next load
        }
        const int64_t i = i0 + ty, j = n0 + tx;
        if (i < K && j < Nc) {
          float* out = dwe + i * Nc + j;
          *out = accumulate ? *out + sum : sum;
        }
      }
  }
}

// ----------------------------------------------------------------------------
// combine (unpermute): a row group (rows.h) per token, or per slot for the backward

// y (T, d) = sum_j gates[t*k + j] yp[pos[t*k + j]]; yp (T*k, d); gates nullptr: all 1.
__global__ void combine_kernel(float* y, const float* yp, const int64_t* pos, const float* gates,
                               int64_t T, int64_t k, int64_t d) {
  for (int64_t t = first_row(); t < T; t += row_stride())
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; j++) {
        const int64_t s = t * k + j;
        acc += (gates ? gates[s] : 1.f) * yp[pos[s] * d + c];
      }
      y[t * d + c] = acc;
    }
}

// dyp[pos[s]] = gates[s] dy[t], dgates[s] = <dy[t], yp[pos[s]]>; dy (T, d), yp, dyp (T*k, d).
__global__ void combine_backward_kernel(float* dyp, float* dgates, const float* dy,
                                        const float* yp, const int64_t* pos, const float* gates,
                                        int64_t T, int64_t k, int64_t d) {
  __shared__ float warp_sum[kMaxWarpsPerRow];  // row_sum's slots (a block per slot only)
  for (int64_t s = first_row(); s < T * k; s += row_stride()) {
    const int64_t t = s / k, row = pos[s];
    const float g = gates[s];
    float dot = 0.f;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      const float dyc = dy[t * d + c];
      dyp[row * d + c] = g * dyc;
      dot += dyc * yp[row * d + c];
    }
    dot = row_sum(dot, warp_sum);  // every thread of the row group, converged
    if (threadIdx.x == 0) dgates[s] = dot;
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// launchers

void moe_permute_plan(int64_t* group_sizes, int64_t* src_token, int64_t* pos,
                      const int64_t* topk_idx, int64_t T, int64_t k, int64_t G) {
  if (G == 0) return;  // (G < 2^31 blocks: far more experts than any model has)
  SIMT_LAUNCH(permute_plan_kernel, dim3((unsigned)G), dim3(kPlanThreads), 0, 0, group_sizes,
              src_token, pos, topk_idx, T, k);
  SIMT_CHECK_LAUNCH();
}

template <typename T>
static void launch_grouped_gemm(float* c, const T* a, const T* w, const int64_t* group_sizes, int64_t G,
                                int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  if (M == 0 || Nc == 0) return;
  const int64_t row_tiles = M / kGemmTile + std::min(G, M);  // >= the schedule's tiles
  const dim3 grid((unsigned)std::min(ceil_div(Nc, kGemmTile), kMaxGridX),
                  (unsigned)std::min(row_tiles, kMaxGridYZ));
  SIMT_LAUNCH(grouped_gemm_kernel<T>, grid, dim3(kGemmTile, kGemmTile), 0, 0, c, a, w, group_sizes,
              G, K, Nc, row_tiles, trans_w, accumulate);
  SIMT_CHECK_LAUNCH();
}

template <typename T>
static void launch_grouped_gemm_dw(float* dw, const T* a, const T* dc, const int64_t* group_sizes,
                                   int64_t G, int64_t K, int64_t Nc, bool accumulate) {
  if (G == 0 || K == 0 || Nc == 0) return;
  const dim3 grid((unsigned)std::min(ceil_div(Nc, kGemmTile), kMaxGridX),
                  (unsigned)std::min(ceil_div(K, kGemmTile), kMaxGridYZ),
                  (unsigned)std::min(G, kMaxGridYZ));
  SIMT_LAUNCH(grouped_gemm_dw_kernel<T>, grid, dim3(kGemmTile, kGemmTile), 0, 0, dw, a, dc,
              group_sizes, G, K, Nc, accumulate);
  SIMT_CHECK_LAUNCH();
}

void grouped_gemm(float* c, const float* a, const float* w, const int64_t* group_sizes, int64_t G,
                  int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  launch_grouped_gemm(c, a, w, group_sizes, G, M, K, Nc, trans_w, accumulate);
}

void grouped_gemm_dw(float* dw, const float* a, const float* dc, const int64_t* group_sizes,
                     int64_t G, int64_t M, int64_t K, int64_t Nc, bool accumulate) {
  (void)M;  // the rows are the groups' (sizes on the device); M == 0 still writes dw = 0
  launch_grouped_gemm_dw(dw, a, dc, group_sizes, G, K, Nc, accumulate);
}

// bf16 operands: the same kernels, each tile widened as it loads (as matmul_bf16 in matmul.cu)
void grouped_gemm_bf16(float* c, const uint16_t* a, const uint16_t* w, const int64_t* group_sizes,
                       int64_t G, int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  launch_grouped_gemm(c, a, w, group_sizes, G, M, K, Nc, trans_w, accumulate);
}

void grouped_gemm_dw_bf16(float* dw, const uint16_t* a, const uint16_t* dc,
                          const int64_t* group_sizes, int64_t G, int64_t M, int64_t K, int64_t Nc,
                          bool accumulate) {
  (void)M;
  launch_grouped_gemm_dw(dw, a, dc, group_sizes, G, K, Nc, accumulate);
}

void moe_combine(float* y, const float* yp, const int64_t* pos, const float* gates, int64_t T,
                 int64_t k, int64_t d) {
  if (T == 0 || d == 0) return;  // (k == 0 still writes y = 0)
  const RowLaunch L = row_launch(T, d);
  SIMT_LAUNCH(combine_kernel, L.grid, L.block, 0, 0, y, yp, pos, gates, T, k, d);
  SIMT_CHECK_LAUNCH();
}

void moe_combine_backward(float* dyp, float* dgates, const float* dy, const float* yp,
                          const int64_t* pos, const float* gates, int64_t T, int64_t k,
                          int64_t d) {
  if (T * k == 0) return;  // (d == 0 still writes dgates = 0)
  const RowLaunch L = row_launch(T * k, d);
  SIMT_LAUNCH(combine_backward_kernel, L.grid, L.block, 0, 0, dyp, dgates, dy, yp, pos, gates, T,
              k, d);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
