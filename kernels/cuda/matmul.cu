// kernels/cuda/matmul.cu — batched matmul with optional transposes: a kernel lab in the
// spirit of llm.c's dev/cuda/matmul_forward.cu. The cpu twin is kernels/cpu/matmul.cpp: its
// version 1 (a triple loop summing in double) is the definition, its version 2 the cpu device's.
//
// Build: this file compiles twice (see kernels/simt.h), by `make build` or by hand:
//   /usr/local/cuda/bin/nvcc -std=c++17 -I. -arch=sm_90 -c kernels/cuda/matmul.cu -o matmul.o
//   mpicxx -std=c++17 -Wall -Wextra -I. -x c++ -c kernels/cuda/matmul.cu -o matmul_sim.o
// Tests: tests/unit/test_kernels_matmul.cpp runs every version against the cpu kernel.
//
// Shapes (letters of kernels/kernels.h): c is (B, M, Nc), contiguous. op(a) is (M, K): a is
// (M, K), or (K, M) when trans_a. op(b) is (K, Nc): b is (K, Nc), or (Nc, K) when trans_b.
// Batch entry z reads a + z * stride_a and b + z * stride_b; a stride of 0 reuses one
// matrix for every z (a weight shared by the whole batch). accumulate: c += op(a) @ op(b),
// else c = op(a) @ op(b). Every version sums in a float register and touches c once.
//
// The numbered versions, kept side by side (all have the signature of KernelTable::matmul):
//   version 1: naive. One thread per element of c, each reading a row of op(a) and a column
//              of op(b) straight from global memory: 2 loads per FMA.
//   version 2: shared-memory tiling. A block of 32x32 threads computes a 32x32 tile of c; it
//              walks K in steps of 32, staging a 32x32 tile of op(a) and of op(b) in shared
//              memory, so each value loaded from global memory is used by 32 threads.
//              Still 2 shared-memory loads per FMA, though.
//   version 3: register blocking. A block of 64 threads computes a 64x64 tile of c, each
//              thread an 8x8 micro-tile held in registers. Per step k it reads 8 values of
//              op(a) and 8 of op(b) from shared memory into registers and does 8x8 = 64 FMAs
//              with them: 0.25 shared loads per FMA instead of 2, and each global load now
//              feeds 64 FMAs (v2: 32). The op(a) tile is stored transposed (k-major), so a
//              thread's 8 values of a column of op(a) are contiguous, like those of op(b).
//   matmul (the table entry) dispatches to version 3.
//
// Why v3 is faster (arithmetic intensity, loads per FMA): an H100 SM does 128 FMAs per clock
// but its shared memory delivers 32 floats per clock, and its L1 about the same. v1 does 2
// loads from global memory (through the caches) per FMA and v2 2 loads from shared memory per
// FMA: both keep at most about 1/8 of the FMA units busy, whatever the size of the matrices.
// v3 does 16 shared loads per 64 FMAs (0.25 per FMA, and the threads of a warp share most of
// them as broadcasts), so for the first time the FMA units, not the loads, set the pace.
// The next steps (not here): 128x128 tiles for large matrices, vectorized float4 loads,
// double-buffered tiles, and tensor cores (which need bf16/tf32, not fp32 FMAs).
//
// Ragged edges: every tile load checks its row and column against M, Nc and K and loads 0
// outside; every store checks its element. Transposes only change which global index a tile
// load reads; the loads are arranged so that consecutive threads read consecutive addresses
// (coalesced) in all four combinations.
#include <algorithm>
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cuda/launchers.h"
#include "kernels/simt.h"

namespace ff::SIMT_DEVICE_NS {

// ----------------------------------------------------------------------------
// shared helpers

// op(a)[i][p] of batch entry a (already offset by z * stride_a): a is (M, K), or (K, M) when
// trans_a. The caller has checked i < M and p < K.
template <typename T>
__device__ __forceinline__ float op_a(const T* a, int64_t i, int64_t p, int64_t M, int64_t K,
                                      bool trans_a) {
  return widen(trans_a ? a[p * M + i] : a[i * K + p]);
}
// op(b)[p][j]: b is (K, Nc), or (Nc, K) when trans_b. The caller has checked p < K, j < Nc.
template <typename T>
__device__ __forceinline__ float op_b(const T* b, int64_t p, int64_t j, int64_t Nc, int64_t K,
                                      bool trans_b) {
  return widen(trans_b ? b[j * K + p] : b[p * Nc + j]);
}

// CUDA's limits on a grid: x up to 2^31 - 1 blocks, y and z up to 65535. Each kernel loops
// over blocks of work with a stride of the grid size, so a clamped grid still covers
// everything (on realistic shapes every loop runs once).
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridYZ = 65535;

inline dim3 clamped_grid(int64_t x, int64_t y, int64_t z) {
  return dim3((unsigned)std::min(x, kMaxGridX), (unsigned)std::min(y, kMaxGridYZ),
              (unsigned)std::min(z, kMaxGridYZ));
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t n, int64_t d) {
  return (n + d - 1) / d;
}

// ----------------------------------------------------------------------------
// version 1: naive, one thread per element of c

// Block of 32 x 8 threads: threadIdx.x runs along a row of c, so a warp writes 32
// consecutive elements of c and (without trans_b) reads 32 consecutive elements of b.
constexpr int kV1BlockX = 32;
constexpr int kV1BlockY = 8;

// c (B, M, Nc); a (M, K) or (K, M) per batch entry; b (K, Nc) or (Nc, K) per batch entry
__global__ void matmul_kernel_v1(float* c, const float* a, const float* b, int64_t B, int64_t M,
                                 int64_t Nc, int64_t K, int64_t stride_a, int64_t stride_b,
                                 bool trans_a, bool trans_b, bool accumulate) {
  for (int64_t z = blockIdx.z; z < B; z += gridDim.z) {
    const float* az = a + z * stride_a;
    const float* bz = b + z * stride_b;
    float* cz = c + z * M * Nc;
    for (int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; i < M;
         i += (int64_t)gridDim.y * blockDim.y)
      for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < Nc;
           j += (int64_t)gridDim.x * blockDim.x) {
        float sum = 0.f;
        for (int64_t p = 0; p < K; p++)
          sum += op_a(az, i, p, M, K, trans_a) * op_b(bz, p, j, Nc, K, trans_b);
        float* out = cz + i * Nc + j;
        *out = accumulate ? *out + sum : sum;
      }
  }
}

void matmul_v1(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,
               int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
               bool accumulate) {
  if (B == 0 || M == 0 || Nc == 0) return;
  dim3 block(kV1BlockX, kV1BlockY);
  dim3 grid = clamped_grid(ceil_div(Nc, kV1BlockX), ceil_div(M, kV1BlockY), B);
  SIMT_LAUNCH(matmul_kernel_v1, grid, block, 0, 0, c, a, b, B, M, Nc, K, stride_a, stride_b,
              trans_a, trans_b, accumulate);
  SIMT_CHECK_LAUNCH();
}

// ----------------------------------------------------------------------------
// version 2: shared-memory tiles, one thread per element of c

// A block of kTile x kTile threads computes a kTile x kTile tile of c.
constexpr int kTile = 32;

// c (B, M, Nc); a (M, K) or (K, M) per batch entry; b (K, Nc) or (Nc, K) per batch entry
__global__ void matmul_kernel_v2(float* c, const float* a, const float* b, int64_t B, int64_t M,
                                 int64_t Nc, int64_t K, int64_t stride_a, int64_t stride_b,
                                 bool trans_a, bool trans_b, bool accumulate) {
  // As[i][p] = op(a)[m0 + i][k0 + p], Bs[p][j] = op(b)[k0 + p][n0 + j]. The +1 column of
  // padding: with a transpose, a warp stores a column of the tile, and rows of 33 floats put
  // the 32 elements of a column in 32 different shared-memory banks (rows of 32 would put
  // them all in one bank: a 32-way conflict).
  __shared__ float As[kTile][kTile + 1];
  __shared__ float Bs[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles_m = ceil_div(M, kTile), tiles_n = ceil_div(Nc, kTile);

  // Blocks loop over (batch entry, tile row, tile column); the bounds are the same for every
  // thread of a block, so all of them reach the same barriers.
  for (int64_t z = blockIdx.z; z < B; z += gridDim.z)
    for (int64_t tm = blockIdx.y; tm < tiles_m; tm += gridDim.y)
      for (int64_t tn = blockIdx.x; tn < tiles_n; tn += gridDim.x) {
        const float* az = a + z * stride_a;
        const float* bz = b + z * stride_b;
        const int64_t m0 = tm * kTile, n0 = tn * kTile;
        float sum = 0.f;
        for (int64_t k0 = 0; k0 < K; k0 += kTile) {
          // Load one element of each tile per thread, 0 outside the matrices. Consecutive
          // threads (tx) read consecutive addresses: along p without trans_a (a is (M, K)),
          // along i with trans_a (a is (K, M)); likewise for b.
          int ai = trans_a ? tx : ty, ap = trans_a ? ty : tx;
          As[ai][ap] = (m0 + ai < M && k0 + ap < K) ? op_a(az, m0 + ai, k0 + ap, M, K, trans_a)
                                                    : 0.f;
          int bp = trans_b ? tx : ty, bj = trans_b ? ty : tx;
          Bs[bp][bj] = (k0 + bp < K && n0 + bj < Nc) ? op_b(bz, k0 + bp, n0 + bj, Nc, K, trans_b)
                                                     : 0.f;
          __syncthreads();  // the tiles are complete
          for (int p = 0; p < kTile; p++) sum += As[ty][p] * Bs[p][tx];
          __syncthreads();  // everyone is done with the tiles before the next load
        }
        const int64_t i = m0 + ty, j = n0 + tx;
        if (i < M && j < Nc) {
          float* out = c + z * M * Nc + i * Nc + j;
          *out = accumulate ? *out + sum : sum;
        }
      }
}

void matmul_v2(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,
               int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
               bool accumulate) {
  if (B == 0 || M == 0 || Nc == 0) return;
  dim3 block(kTile, kTile);
  dim3 grid = clamped_grid(ceil_div(Nc, kTile), ceil_div(M, kTile), B);
  SIMT_LAUNCH(matmul_kernel_v2, grid, block, 0, 0, c, a, b, B, M, Nc, K, stride_a, stride_b,
              trans_a, trans_b, accumulate);
  SIMT_CHECK_LAUNCH();
}

// ----------------------------------------------------------------------------
// version 3: register-blocked 2-D tiles, an 8x8 micro-tile of c per thread

constexpr int kBM = 64;  // rows of c per block
constexpr int kBN = 64;  // columns of c per block
constexpr int kBK = 8;   // step along K: the depth of the shared-memory tiles
constexpr int kTM = 8;   // rows of c per thread
constexpr int kTN = 8;   // columns of c per thread
constexpr int kV3Threads = (kBM / kTM) * (kBN / kTN);  // 8 x 8 = 64 threads
// Shared rows are padded from 64 to 68 floats: with that, the transposed stores of a tile
// load (8 consecutive threads writing down a column) land in distinct banks, and rows stay
// 16-byte aligned so the compiler can read a thread's 8 contiguous values as two float4s.
constexpr int kPad = 4;

// c (B, M, Nc); a (M, K) or (K, M) per batch entry; b (K, Nc) or (Nc, K) per batch entry.
// T: float, or uint16_t for bf16 operands (matmul_bf16), widened as the tiles are loaded.
template <typename T>
__global__ void matmul_kernel_v3(float* c, const T* a, const T* b, int64_t B, int64_t M,
                                 int64_t Nc, int64_t K, int64_t stride_a, int64_t stride_b,
                                 bool trans_a, bool trans_b, bool accumulate) {
  // As[p][i] = op(a)[m0 + i][k0 + p]: the op(a) tile stored transposed, k-major, so that a
  // thread's kTM values of one column of op(a) are contiguous (as its kTN values of a row of
  // Bs are), and the threads of a warp reading them hit few distinct addresses (broadcast).
  // Bs[p][j] = op(b)[k0 + p][n0 + j].
  alignas(16) __shared__ float As[kBK][kBM + kPad];
  alignas(16) __shared__ float Bs[kBK][kBN + kPad];
  const int t = threadIdx.x;
  // This thread's micro-tile: rows row0 .. row0 + kTM - 1, columns col0 .. col0 + kTN - 1
  // of the block's tile.
  const int row0 = (t / (kBN / kTN)) * kTM;
  const int col0 = (t % (kBN / kTN)) * kTN;
  const int64_t tiles_m = ceil_div(M, kBM), tiles_n = ceil_div(Nc, kBN);

  for (int64_t z = blockIdx.z; z < B; z += gridDim.z)
    for (int64_t tm = blockIdx.y; tm < tiles_m; tm += gridDim.y)
      for (int64_t tn = blockIdx.x; tn < tiles_n; tn += gridDim.x) {
        const T* az = a + z * stride_a;
        const T* bz = b + z * stride_b;
        const int64_t m0 = tm * kBM, n0 = tn * kBN;
        float acc[kTM][kTN] = {};  // the micro-tile of c, in registers
        float a_frag[kTM], b_frag[kTN];

        for (int64_t k0 = 0; k0 < K; k0 += kBK) {
          // Load the kBM x kBK tile of op(a) and the kBK x kBN tile of op(b), kBM * kBK /
          // kV3Threads = 8 elements of each per thread, 0 outside the matrices. Element e of a
          // tile goes to (row, column) such that consecutive threads read consecutive global
          // addresses: along p when a is (M, K), along i when a is (K, M) (trans_a); along j
          // when b is (K, Nc), along p when b is (Nc, K) (trans_b).
          for (int e = t; e < kBM * kBK; e += kV3Threads) {
            int i = trans_a ? e % kBM : e / kBK;
            int p = trans_a ? e / kBM : e % kBK;
            As[p][i] = (m0 + i < M && k0 + p < K) ? op_a(az, m0 + i, k0 + p, M, K, trans_a) : 0.f;
          }
          for (int e = t; e < kBK * kBN; e += kV3Threads) {
            int p = trans_b ? e % kBK : e / kBN;
            int j = trans_b ? e / kBK : e % kBN;
            Bs[p][j] = (k0 + p < K && n0 + j < Nc) ? op_b(bz, k0 + p, n0 + j, Nc, K, trans_b)
                                                   : 0.f;
          }
          __syncthreads();  // the tiles are complete

          // The outer-product form: for each p, a column of op(a) (kTM values) times a row of
          // op(b) (kTN values) adds kTM x kTN products to the micro-tile. 16 shared loads, 64
          // FMAs. (All loop bounds are compile-time constants: nvcc unrolls them fully and
          // keeps acc, a_frag and b_frag in registers.)
          for (int p = 0; p < kBK; p++) {
            for (int r = 0; r < kTM; r++) a_frag[r] = As[p][row0 + r];
            for (int s = 0; s < kTN; s++) b_frag[s] = Bs[p][col0 + s];
            for (int r = 0; r < kTM; r++)
              for (int s = 0; s < kTN; s++) acc[r][s] += a_frag[r] * b_frag[s];
          }
          __syncthreads();  // everyone is done with the tiles before the next load
        }

        // Write the micro-tile, skipping the elements outside c (ragged edges).
        float* cz = c + z * M * Nc;
        for (int r = 0; r < kTM; r++) {
          const int64_t i = m0 + row0 + r;
          if (i >= M) break;
          for (int s = 0; s < kTN; s++) {
            const int64_t j = n0 + col0 + s;
            if (j >= Nc) break;
            float* out = cz + i * Nc + j;
            *out = accumulate ? *out + acc[r][s] : acc[r][s];
          }
        }
      }
}

void matmul_v3(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,
               int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
               bool accumulate) {
  if (B == 0 || M == 0 || Nc == 0) return;
  dim3 grid = clamped_grid(ceil_div(Nc, kBN), ceil_div(M, kBM), B);
  SIMT_LAUNCH(matmul_kernel_v3<float>, grid, kV3Threads, 0, 0, c, a, b, B, M, Nc, K, stride_a, stride_b,
              trans_a, trans_b, accumulate);
  SIMT_CHECK_LAUNCH();
}

// bf16 operands, float32 c: version 3 with its tiles widened as they are loaded into shared
// memory, so each product is exact and the sums are version 3's, in its order: c holds the
// bits matmul gives on the widened operands. A tensor-core version would keep the tiles in
// bf16 and hand 16 x 16 x 16 fragments to mma (nvcuda::wmma, or mma.sync m16n8k16 with bf16
// inputs and float32 accumulators), summing each fragment's 16 products in the hardware's
// order: close to these sums, not their bits.
void matmul_bf16(float* c, const uint16_t* a, const uint16_t* b, int64_t B, int64_t M, int64_t Nc,
                 int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
                 bool accumulate) {
  if (B == 0 || M == 0 || Nc == 0) return;
  dim3 grid = clamped_grid(ceil_div(Nc, kBN), ceil_div(M, kBM), B);
  SIMT_LAUNCH(matmul_kernel_v3<uint16_t>, grid, kV3Threads, 0, 0, c, a, b, B, M, Nc, K, stride_a,
              stride_b, trans_a, trans_b, accumulate);
  SIMT_CHECK_LAUNCH();
}

// ----------------------------------------------------------------------------
// the table entry: the best version

void matmul(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc, int64_t K,
            int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b, bool accumulate) {
  matmul_v3(c, a, b, B, M, Nc, K, stride_a, stride_b, trans_a, trans_b, accumulate);
}

}  // namespace ff::SIMT_DEVICE_NS
