// kernels/cuda/attention.cu — attention over one (Q block, KV block) pair, FlashAttention-2
// style: flash_forward_block and flash_backward_block (kernels/kernels.h). The readable
// definition, with the math, is the cpu twin kernels/cpu/attention.cpp; this file computes
// the same thing tile by tile on the GPU.
//
// Shapes: q, o, dq, dout (BH, Sq, D); k, v, dk, dv (BH, Sk, D); m, l, lse, delta (BH, Sq);
// qpos (Sq) and kpos (Sk) are int64 GLOBAL positions (with causal, query i sees key j iff
// kpos[j] <= qpos[i]). T = kAttentionTile = 16 rows per tile, on both sides.
//
// Forward (Dao, "FlashAttention-2", 2023, Algorithm 1): grid (ceil(Sq / T), BH), block T.
//   A block owns a tile of T query rows of one (batch, head); thread t owns query row
//   i = blockIdx.x * T + t and keeps its running max m and normaliser l in registers. The
//   tile's queries Q and running outputs O (T x D each) sit in shared memory for the whole
//   kernel. The block walks the KV block tile by tile: the T threads load a K and a V tile
//   (T x D) into shared memory together, __syncthreads, then each thread scores its query
//   against the T keys (one dot product of length D each, masked ones -inf), and folds them
//   into its (m, l, o) by the online softmax: rescale l and o by exp(m_old - m_new), add
//   exp(s - m_new) and exp(s - m_new) v. A second __syncthreads keeps the next tile's load
//   from overwriting K and V while a slower thread still reads them. Every K/V element
//   loaded from global memory is used by the T threads of the block.
// Backward (Algorithm 2): grid (ceil(Sk / T), BH), block T.
//   A block owns a tile of T KEY rows: its K and V tiles stay in shared memory, and it walks
//   the Q block tile by tile, loading Q, dO, lse and delta of T queries. Per Q tile:
//     1. thread t, as key j: for each query i of the tile, p = exp(s_ij - lse_i) and
//        ds = p (dO_i . v_j - delta_i) into the T x T tiles P and dS (shared); __syncthreads.
//     2. the three tile products, every element by one thread:
//          dV_tile += P^T dO_tile,  dK_tile += scale dS^T Q_tile,  dQ_tile += scale dS K_tile
//        thread t takes elements t, t + T, ... of each (T x D) result, so neighbouring
//        threads touch neighbouring columns of a row: coalesced global reads and writes.
//        dK and dV rows belong to this block alone (no other block has these keys), so they
//        are accumulated with a plain +=; dQ rows are shared by every KV-tile block of this
//        (batch, head), so they are added with atomicAdd. __syncthreads before the next Q
//        tile overwrites the tiles. (The atomics make dq's rounding depend on the order the
//        blocks land in: a few ulps, run to run, on a GPU.)
//   The forward updates the running state o, m, l in place; the backward ACCUMULATES into
//   dq, dk, dv (kernels.h), so a ring can sum over KV blocks.
//
// The causal tile skip: a (query tile, key tile) pair whose smallest key position is larger
// than its largest query position has nothing visible and is not computed — the same rule
// as the cpu kernel, so the work skipped does not depend on the device. Each thread computes
// the min/max itself from the same positions in global memory (integers: every thread gets
// the same answer), so the whole block takes the same branch, and the __syncthreads inside
// the loop body are reached by all threads or by none. Likewise no thread returns early:
// threads whose row is past Sq (or Sk) skip the arithmetic but still take part in every
// barrier and in the cooperative loads.
//
// Shared memory. Tiles are stored with a row stride of D + 1 floats, not D: in the score
// loops each thread reads its OWN row (thread t at t * stride + c), and with stride D (a
// multiple of 32 for D = 64, 128) all T threads would hit the same bank; with D + 1 they
// hit T different ones (for even D). Rows read by all threads at once (the keys in the
// forward, the queries in the backward) are broadcasts and conflict-free either way.
//   forward:  4 tiles (Q, O, K, V) of T x (D + 1) floats, dynamic: 256 (D + 1) bytes,
//             + T int64 key positions, static: 128 bytes.
//   backward: 4 tiles (K, V, Q, dO), dynamic: 256 (D + 1) bytes, + static: P and dS, 2 x
//             T x (T + 1) floats (2,176 bytes), lse and delta (128), query positions (128).
//   At D = kMaxHeadDim = 128: 33,024 + 2,432 = 35,456 bytes, under the 48 KiB (49,152) a
//   block gets without opting in (and the emulator's limit); D = 256 would need 65,792 bytes
//   of tiles alone. Head sizes of the models this course follows are 64 (GPT-2) and 128
//   (Llama); the launchers reject a larger D with an error.
// Sums accumulate in float, like the cpu kernel; see tests/unit/test_kernels_attention.cpp
// for the error bounds.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

constexpr int kTile = (int)kAttentionTile;  // threads per block = rows per tile
constexpr int64_t kMaxHeadDim = 128;        // D limit: the shared-memory budget in the header
constexpr int64_t kMaxGridY = 65535;        // gridDim.y limit (BH)

// File-local (an anonymous namespace): other kernel files have helpers of the same names.
namespace {

// ----------------------------------------------------------------------------
// helpers

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t n, int64_t d) {
  return (n + d - 1) / d;
}

// The rows of the tile that starts at row0 of n rows: kTile, or fewer for the last tile.
__device__ __forceinline__ int tile_rows(int64_t row0, int64_t n) {
  return n - row0 < kTile ? (int)(n - row0) : kTile;
}

// The largest / smallest of pos[begin, begin + count). Every thread of a block calls these
// with the same arguments and gets the same integer, so a branch on it is uniform.
__device__ int64_t max_position(const int64_t* pos, int64_t begin, int count) {
  int64_t mx = pos[begin];
  for (int r = 1; r < count; r++) mx = pos[begin + r] > mx ? pos[begin + r] : mx;
  return mx;
}
__device__ int64_t min_position(const int64_t* pos, int64_t begin, int count) {
  int64_t mn = pos[begin];
  for (int r = 1; r < count; r++) mn = pos[begin + r] < mn ? pos[begin + r] : mn;
  return mn;
}

// tile (kTile rows of stride ld) = rows [row0, row0 + kTile) of src (n, D), 0 past row n.
// The tile is a contiguous stretch of src, so thread t copying elements t, t + kTile, ...
// reads consecutive addresses with consecutive threads (coalesced).
__device__ void load_tile(float* tile, const float* src, int64_t row0, int64_t n, int64_t D,
                          int64_t ld) {
  for (int64_t e = threadIdx.x; e < kTile * D; e += blockDim.x) {
    const int64_t r = e / D, c = e - r * D;
    tile[r * ld + c] = row0 + r < n ? src[(row0 + r) * D + c] : 0.f;
  }
}

// rows [row0, row0 + kTile) of dst (n, D) = tile, the rows past n left alone.
__device__ void store_tile(float* dst, const float* tile, int64_t row0, int64_t n, int64_t D,
                           int64_t ld) {
  for (int64_t e = threadIdx.x; e < kTile * D; e += blockDim.x) {
    const int64_t r = e / D, c = e - r * D;
    if (row0 + r < n) dst[(row0 + r) * D + c] = tile[r * ld + c];
  }
}

// a . b over D elements, summed in order (as the cpu kernel)
__device__ __forceinline__ float dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
  for (int64_t c = 0; c < D; c++) s += a[c] * b[c];
  return s;
}

// ----------------------------------------------------------------------------
// forward: a block per tile of kTile queries, a thread per query row

// o, q (BH, Sq, D); m, l (BH, Sq); k, v (BH, Sk, D); qpos (Sq); kpos (Sk).
// Dynamic shared memory: 4 tiles of kTile x (D + 1) floats.
__global__ void flash_forward_kernel(float* o, float* m, float* l, const float* q, const float* k,
                                     const float* v, const int64_t* qpos, const int64_t* kpos,
                                     int64_t Sq, int64_t Sk, int64_t D, float scale, bool causal) {
  SIMT_DYNAMIC_SHARED(float, smem);
  const int64_t ld = D + 1;  // row stride of the tiles (see the header: no bank conflicts)
  float* q_tile = smem;                 // this block's queries
  float* o_tile = q_tile + kTile * ld;  // their running outputs
  float* k_tile = o_tile + kTile * ld;  // the keys and values of the current KV tile
  float* v_tile = k_tile + kTile * ld;
  __shared__ int64_t kpos_tile[kTile];

  // this block's (batch, head) and query tile; this thread's row
  const int64_t bh = blockIdx.y;
  q += bh * Sq * D;
  o += bh * Sq * D;
  k += bh * Sk * D;
  v += bh * Sk * D;
  m += bh * Sq;
  l += bh * Sq;
  const int64_t i0 = (int64_t)blockIdx.x * kTile;
  const int t = threadIdx.x;
  const int64_t i = i0 + t;
  const bool has_row = i < Sq;  // the last tile may be short: its extra threads only help
  const float* q_row = q_tile + t * ld;
  float* o_row = o_tile + t * ld;

  load_tile(q_tile, q, i0, Sq, D, ld);
  load_tile(o_tile, o, i0, Sq, D, ld);
  float m_i = has_row ? m[i] : -INFINITY;
  float l_i = has_row ? l[i] : 0.f;
  const int64_t qpos_i = has_row ? qpos[i] : 0;
  const int64_t q_max = max_position(qpos, i0, tile_rows(i0, Sq));
  __syncthreads();  // the Q and O tiles are in place

  // [slide:tile-skip]
  for (int64_t j0 = 0; j0 < Sk; j0 += kTile) {
    const int nk = tile_rows(j0, Sk);
    // the causal tile skip: the same decision in every thread (see the header)
    if (causal && min_position(kpos, j0, nk) > q_max) continue;

    load_tile(k_tile, k, j0, Sk, D, ld);
    load_tile(v_tile, v, j0, Sk, D, ld);
    if (t < nk) kpos_tile[t] = kpos[j0 + t];
    __syncthreads();  // the K and V tiles are in place
    // [/slide]

    if (has_row) {
      // the scores of this row against the tile's keys, and their max
      float s[kTile];
      float m_tile = -INFINITY;
      for (int jj = 0; jj < nk; jj++) {
        const bool visible = !causal || kpos_tile[jj] <= qpos_i;
        s[jj] = visible ? scale * dot(q_row, k_tile + jj * ld, D) : -INFINITY;
        m_tile = fmaxf(m_tile, s[jj]);
      }
      const float m_new = fmaxf(m_i, m_tile);
      if (m_new != -INFINITY) {  // else nothing visible to this row yet: leave it as it is
        // rescale the past to the new max (an empty past, m = -inf, contributes 0)
        const float alpha = m_i == -INFINITY ? 0.f : expf(m_i - m_new);
        for (int64_t c = 0; c < D; c++) o_row[c] *= alpha;
        float l_new = l_i * alpha;
        for (int jj = 0; jj < nk; jj++) {
          const float p = expf(s[jj] - m_new);  // exp(-inf) = 0: masked
          l_new += p;
          for (int64_t c = 0; c < D; c++) o_row[c] += p * v_tile[jj * ld + c];
        }
        m_i = m_new;
        l_i = l_new;
      }
    }
    __syncthreads();  // every thread is done with K and V before the next tile is loaded
  }

  // write the state back: m and l from each thread's registers, the O tile by all threads
  // together. Thread t stores elements of rows that other threads updated; every thread's
  // last write to o_tile is followed by a barrier (the loop's last one, or the one after the
  // loads when no tile was computed), so no further __syncthreads is needed here.
  if (has_row) {
    m[i] = m_i;
    l[i] = l_i;
  }
  store_tile(o, o_tile, i0, Sq, D, ld);
}

// ----------------------------------------------------------------------------
// backward: a block per tile of kTile keys, a thread per key row (then per element)

// dq, q, dout (BH, Sq, D); dk, dv, k, v (BH, Sk, D); lse, delta (BH, Sq); qpos (Sq);
// kpos (Sk). Dynamic shared memory: 4 tiles of kTile x (D + 1) floats.
__global__ void flash_backward_kernel(float* dq, float* dk, float* dv, const float* q,
                                      const float* k, const float* v, const float* dout,
                                      const float* lse, const float* delta, const int64_t* qpos,
                                      const int64_t* kpos, int64_t Sq, int64_t Sk, int64_t D,
                                      float scale, bool causal) {
  SIMT_DYNAMIC_SHARED(float, smem);
  const int64_t ld = D + 1;  // row stride of the tiles
  float* k_tile = smem;                 // this block's keys and values
  float* v_tile = k_tile + kTile * ld;
  float* q_tile = v_tile + kTile * ld;  // the queries and dO of the current Q tile
  float* do_tile = q_tile + kTile * ld;
  __shared__ float p_tile[kTile][kTile + 1];   // P[i][j] of (current Q tile, this KV tile)
  __shared__ float ds_tile[kTile][kTile + 1];  // dS[i][j]; + 1: column reads conflict-free
  __shared__ float lse_tile[kTile], delta_tile[kTile];
  __shared__ int64_t qpos_tile[kTile];

  // this block's (batch, head) and key tile; this thread's key row
  const int64_t bh = blockIdx.y;
  q += bh * Sq * D;
  dout += bh * Sq * D;
  dq += bh * Sq * D;
  k += bh * Sk * D;
  v += bh * Sk * D;
  dk += bh * Sk * D;
  dv += bh * Sk * D;
  lse += bh * Sq;
  delta += bh * Sq;
  const int64_t j0 = (int64_t)blockIdx.x * kTile;
  const int t = threadIdx.x;
  const int nk = tile_rows(j0, Sk);
  const bool has_key = t < nk;  // the last tile may be short
  const int64_t kpos_j = has_key ? kpos[j0 + t] : 0;
  const int64_t k_min = min_position(kpos, j0, nk);
  const float* k_row = k_tile + t * ld;
  const float* v_row = v_tile + t * ld;

  load_tile(k_tile, k, j0, Sk, D, ld);
  load_tile(v_tile, v, j0, Sk, D, ld);
  // (the first barrier inside the loop makes the K and V tiles visible before any use)

  for (int64_t i0 = 0; i0 < Sq; i0 += kTile) {
    const int ni = tile_rows(i0, Sq);
    // the causal tile skip: the same decision in every thread
    if (causal && k_min > max_position(qpos, i0, ni)) continue;

    load_tile(q_tile, q, i0, Sq, D, ld);
    load_tile(do_tile, dout, i0, Sq, D, ld);
    if (t < ni) {
      lse_tile[t] = lse[i0 + t];
      delta_tile[t] = delta[i0 + t];
      qpos_tile[t] = qpos[i0 + t];
    }
    __syncthreads();  // the Q, dO (and, the first time, K, V) tiles are in place

    // 1. column t of P and dS: key j = j0 + t against every query of the tile
    for (int ii = 0; ii < kTile; ii++) {
      float p = 0.f, ds = 0.f;  // hidden pairs (and rows past the ends) contribute nothing
      if (has_key && ii < ni && (!causal || kpos_j <= qpos_tile[ii])) {
        p = expf(scale * dot(q_tile + ii * ld, k_row, D) - lse_tile[ii]);
        const float dp = dot(do_tile + ii * ld, v_row, D);
        ds = p * (dp - delta_tile[ii]);
      }
      p_tile[ii][t] = p;
      ds_tile[ii][t] = ds;
    }
    __syncthreads();  // all of P and dS are in place

    // 2. the tile products, element (r, c) of each kTile x D result by one thread
    for (int64_t e = t; e < kTile * D; e += blockDim.x) {
      const int r = (int)(e / D);
      const int64_t c = e - r * D;
      if (r < nk) {  // dV, dK of key j0 + r: rows only this block writes
        float dv_sum = 0.f, dk_sum = 0.f;
        for (int ii = 0; ii < ni; ii++) {
          dv_sum += p_tile[ii][r] * do_tile[ii * ld + c];
          dk_sum += ds_tile[ii][r] * q_tile[ii * ld + c];
        }
        dv[(j0 + r) * D + c] += dv_sum;
        dk[(j0 + r) * D + c] += scale * dk_sum;
      }
      if (r < ni) {  // dQ of query i0 + r: every KV-tile block adds to it
        float dq_sum = 0.f;
        for (int jj = 0; jj < nk; jj++) dq_sum += ds_tile[r][jj] * k_tile[jj * ld + c];
        atomicAdd(&dq[(i0 + r) * D + c], scale * dq_sum);
      }
    }
    __syncthreads();  // every thread is done with the tiles before the next Q tile
  }
}

// The launchers' shape checks: what the kernels cannot do, as an error a user can read.
void check_attention_shape(const char* kernel, int64_t BH, int64_t D) {
  if (D > kMaxHeadDim)
    throw std::invalid_argument(std::string(kernel) + ": head size D = " + std::to_string(D) +
                                " is over the limit of " + std::to_string(kMaxHeadDim) +
                                " of the cuda/sim kernels (their tiles must fit in 48 KiB of "
                                "shared memory)");
  if (BH > kMaxGridY)
    throw std::invalid_argument(std::string(kernel) + ": BH = " + std::to_string(BH) +
                                " (batch x heads) is over the grid's limit of " +
                                std::to_string(kMaxGridY));
}

// The dynamic shared memory of both kernels: 4 tiles of kTile x (D + 1) floats.
size_t four_tiles_bytes(int64_t D) { return 4 * (size_t)kTile * (size_t)(D + 1) * sizeof(float); }

}  // namespace

// ----------------------------------------------------------------------------
// launchers

void flash_forward_block(float* o, float* m, float* l, const float* q, const float* k,
                         const float* v, const int64_t* qpos, const int64_t* kpos, int64_t BH,
                         int64_t Sq, int64_t Sk, int64_t D, float scale, bool causal) {
  check_attention_shape("flash_forward_block", BH, D);
  if (BH * Sq * Sk == 0) return;  // no query, or no key to fold in: the state is unchanged
  const dim3 grid((unsigned)ceil_div(Sq, kTile), (unsigned)BH);
  SIMT_LAUNCH(flash_forward_kernel, grid, dim3(kTile), four_tiles_bytes(D), 0, o, m, l, q, k, v,
              qpos, kpos, Sq, Sk, D, scale, causal);
  SIMT_CHECK_LAUNCH();
}

void flash_backward_block(float* dq, float* dk, float* dv, const float* q, const float* k,
                          const float* v, const float* dout, const float* lse, const float* delta,
                          const int64_t* qpos, const int64_t* kpos, int64_t BH, int64_t Sq,
                          int64_t Sk, int64_t D, float scale, bool causal) {
  check_attention_shape("flash_backward_block", BH, D);
  if (BH * Sq * Sk * D == 0) return;  // nothing to add to
  const dim3 grid((unsigned)ceil_div(Sk, kTile), (unsigned)BH);
  SIMT_LAUNCH(flash_backward_kernel, grid, dim3(kTile), four_tiles_bytes(D), 0, dq, dk, dv, q, k,
              v, dout, lse, delta, qpos, kpos, Sq, Sk, D, scale, causal);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::SIMT_DEVICE_NS
