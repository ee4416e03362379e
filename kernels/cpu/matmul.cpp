// kernels/cpu/matmul.cpp — batched matmul with optional transposes, in two versions, as in
// llm.c's kernel lab (dev/cuda/*.cu: numbered versions of one op, each checked against the
// first):
//
//   c (B, M, Nc) = op(a) (B, M, K) @ op(b) (B, K, Nc)   [+ c when accumulate]
//   op(a) = a or a^T (trans_a: a is stored (K, M)), op(b) likewise; batch z reads
//   a + z * stride_a and b + z * stride_b (a stride of 0 shares one matrix), writes c + z M Nc.
//
//   version 1  matmul_v1: the plain triple loop, accumulating in double and rounding once.
//              The definition: the CUDA versions and version 2 are tested against it. Slow
//              (~1-2 GFLOP/s): its inner loop walks a column of b (or of a^T), one cache line
//              per multiply-add, and cannot vectorise.
//   version 2  matmul (the cpu device's table entry): blocked, ~50x faster. Tiles of c are
//              kept in registers while a thin strip of op(a) and op(b), packed into the order
//              the inner loop reads them, streams past; the inner loop vectorises; row strips
//              run in parallel over OpenMP threads. It sums in float (see below).
//
// make bench times both against OpenBLAS's cblas_sgemm on the same shapes (tests/bench).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/bf16.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

// ----------------------------------------------------------------------------
// version 1: the definition

void matmul_v1(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,
               int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
               bool accumulate) {
  for (int64_t z = 0; z < B; z++) {
    const float* az = a + z * stride_a;
    const float* bz = b + z * stride_b;
    float* cz = c + z * M * Nc;
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < Nc; j++) {
        double s = 0.0;
        for (int64_t p = 0; p < K; p++) {
          float av = trans_a ? az[p * M + i] : az[i * K + p];
          float bv = trans_b ? bz[j * K + p] : bz[p * Nc + j];
          s += (double)av * bv;
        }
        cz[i * Nc + j] = accumulate ? cz[i * Nc + j] + (float)s : (float)s;
      }
  }
}

// ----------------------------------------------------------------------------
// version 2: blocked, vectorised, parallel
//
// Why it is fast. A multiply-add needs an element of a and one of b; the naive loop fetches
// both from memory each time. Here c is computed in tiles of kTileRows x kTileCols (6 x 32)
// held in registers for the whole sum over p: each step of p loads one row of 32 values of
// op(b) and 6 values of op(a), and does 6 x 32 = 192 multiply-adds with them — 5 values moved
// per 32 multiply-adds instead of 2 per 1. The 32 columns are contiguous: 2 AVX-512 (or 4 AVX2)
// vector FMAs per row of the tile (tile_avx512, tile_avx2 below).
//
// Packing. Before the sums, op(b) is copied into panels of kTileCols columns, row p of a panel
// at panel + p * kTileCols, and each strip of kTileRows rows of op(a) into strip[p * kTileRows
// + r]: the inner loop then reads both with stride 1 whatever trans_a, trans_b and the strides
// are (the copy pays for the transposes, once, in O(M K + K Nc) work against the O(M K Nc)
// of the product). A ragged edge (M or Nc not a multiple of the tile) is padded with zeros,
// so the tile code has no edge cases; only the valid part of a tile is written back. Small
// products, where the copies would cost about as much as they save, read op(a) and op(b) in
// place where their layout allows (matmul below says when).
//
// Threads. Blocks of kBlockRows rows of c are independent (each reads all of packed b and its
// own rows of a, and writes its own rows of c), so an OpenMP loop shares them out among the
// threads; b is packed first, once per batch entry, its panels shared out the same way. Small
// products run on the calling thread: starting the thread team costs microseconds. How many
// threads: matmul_threads below.
//
// Rounding. Version 2 sums the K products of an element in float, in order p = 0, 1, ...
// (starting from c when accumulating), each product fused into the sum (fma: one rounding per
// term), explicitly (intrinsics, std::fma), so every instruction set below and every build
// (the sanitizer's -O1 included; the Makefile's -ffp-contract=off keeps the compiler from
// fusing anything else in kernels/cpu/) gives the same bits: within K u sum_p |a_ip b_pj|
// (+ u |c|) of the exact value, u = 2^-24 (Higham, "Accuracy and Stability of Numerical
// Algorithms", 3.1; a fused term rounds once where a product and a sum round twice), as the
// CUDA kernels are; version 1 is within u |result|. Tests that compare with the cpu matmul as
// if it were exact use version 1 (tests/unit/test_kernels_matmul.cpp). Unfused (a product
// rounded, then added: twice the arithmetic instructions of OpenBLAS's FMAs) the AVX2 tile ran
// at about 0.6-0.7 of the fused one's speed at 1024^3 (make bench's machine, alternated runs).
// Summing in double in the tile measured 3x slower on AVX-512 at 256^3 (half the lanes per
// register, a conversion per load of b, and a 6 x 16 tile to fit the registers), so version 2
// sums in float, as BLAS libraries do.

constexpr int64_t kTileRows = 6;
constexpr int64_t kTileCols = 32;
// Cache blocking (the loop nest of Goto and van de Geijn, "Anatomy of High-Performance Matrix
// Multiplication", 2008): the sum over p is cut into slices of kDepth, so one panel of packed b
// (kDepth x kTileCols floats, 32 KiB) stays in the L1 cache while the kBlockRows rows of a
// thread's block of a (48 x 256 floats, 48 KiB, in L2) stream past it.
constexpr int64_t kDepth = 256;
constexpr int64_t kBlockRows = 8 * kTileRows;

// Products with fewer multiply-adds than this (64^3) run on one thread.
constexpr int64_t kParallelWork = int64_t(1) << 18;

// The number of OpenMP threads version 2 uses: OMP_NUM_THREADS when set; else, under mpirun
// (Open MPI sets OMPI_COMM_WORLD_LOCAL_SIZE, the ranks on this node), the cores divided
// among the node's ranks, at least 1 — so 4 ranks on a 2-core machine run one thread each
// instead of 8 threads fighting for 2 cores; else one thread per core.
int default_matmul_threads() {
  const int max_threads = omp_get_max_threads();  // OMP_NUM_THREADS, or the cores we may use
  if (std::getenv("OMP_NUM_THREADS")) return max_threads;
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks = local ? std::atoi(local) : 1;
  return ranks > 1 ? std::max(1, omp_get_num_procs() / ranks) : max_threads;
}

namespace {
int g_matmul_threads = 0;  // 0: not chosen yet (set_matmul_threads, or the default)
}  // namespace

int matmul_threads() {
  if (g_matmul_threads <= 0) g_matmul_threads = default_matmul_threads();
  return g_matmul_threads;
}
void set_matmul_threads(int n) { g_matmul_threads = n; }

namespace {

// One tile of c, kTileRows x (16 halves) at c with rows ldc apart: c = (load ? c : 0) + sum
// over p < depth of a[r][p] * b[p][col], each term a fused multiply-add (one rounding:
// fma(a, b, acc)). Where the operands are read from:
struct TileOperands {
  const float* a;      // element (r, p) of op(a)'s strip at a[r * a_rs + p * a_cs]: packed,
  int64_t a_rs, a_cs;  // (1, kTileRows); a itself, (K, 1); a stored transposed, (1, M)
  const float* b;      // row p of op(b)'s panel at b + p * ldb: packed, ldb = kTileCols;
  int64_t ldb;         // b itself, its row length
  int halves;          // the tile's width: 16 columns (1) or 32 (2)
};
// Written three times, for the instruction sets of x86-64's levels, and picked when the
// program starts (isa_kernels below), so one binary runs on any x86-64 and uses AVX-512 where
// there is one:
//   avx512    the 6 x 32 tile is 12 of the 32 zmm registers; per p, 2 loads of b, 6 broadcasts
//             of a, 12 FMAs.
//   avx2      AVX2's 16 ymm registers cannot hold a 6 x 32 tile (24 of them), so it runs as
//             two 6 x 16 halves, one after the other over the same panel: 12 accumulators, 2
//             loads of b, a broadcast. Each element still sums its p in order, so the bits
//             are the same as avx512's.
//   portable  plain loops with std::fma, exactly rounded everywhere (the compiler vectorises
//             them on ARM, where FMA is baseline; x86-64 without FMA — CPUs from before 2013 —
//             calls libm's fmaf, slow but the same bits).
// Every element of c is fma(a_p, b_p, ...) applied for p = 0, 1, ... in order from c (or 0):
// the same bits on every CPU, every clone, every thread count and every build.
template <int W>
void tile_portable_w(float* c, int64_t ldc, bool load, const TileOperands& t, int64_t depth) {
  float acc[kTileRows][W];
  for (int64_t r = 0; r < kTileRows; r++)
    for (int64_t col = 0; col < W; col++) acc[r][col] = load ? c[r * ldc + col] : 0.f;
  for (int64_t p = 0; p < depth; p++) {
    const float* b_row = t.b + p * t.ldb;
#pragma GCC unroll 8
    for (int64_t r = 0; r < kTileRows; r++) {
      const float a_rp = t.a[r * t.a_rs + p * t.a_cs];
      for (int64_t col = 0; col < W; col++) acc[r][col] = std::fma(a_rp, b_row[col], acc[r][col]);
    }
  }
  for (int64_t r = 0; r < kTileRows; r++)
    for (int64_t col = 0; col < W; col++) c[r * ldc + col] = acc[r][col];
}
void tile_portable(float* c, int64_t ldc, bool load, const TileOperands& t, int64_t depth) {
  if (t.halves == 2) tile_portable_w<32>(c, ldc, load, t, depth);
  else tile_portable_w<16>(c, ldc, load, t, depth);
}

#if defined(__x86_64__)
static_assert(kTileRows == 6 && kTileCols == 32, "the x86 tiles below are written for 6 x 32");

// H zmm registers per row of the tile (16 columns each)
template <int H>
__attribute__((target("avx512f"), always_inline)) inline void tile512(float* c, int64_t ldc, bool load,
                                                                     const TileOperands& t, int64_t depth) {
  const float* ar[6];
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++) ar[r] = t.a + r * t.a_rs;
  __m512 acc[6][H];
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++)
#pragma GCC unroll 2
    for (int h = 0; h < H; h++) acc[r][h] = load ? _mm512_loadu_ps(c + r * ldc + h * 16) : _mm512_setzero_ps();
  for (int64_t p = 0; p < depth; p++) {
    const float* b_row = t.b + p * t.ldb;
    const int64_t ap = p * t.a_cs;
    __m512 b[H];
#pragma GCC unroll 2
    for (int h = 0; h < H; h++) b[h] = _mm512_loadu_ps(b_row + h * 16);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
      const __m512 a = _mm512_set1_ps(ar[r][ap]);
#pragma GCC unroll 2
      for (int h = 0; h < H; h++) acc[r][h] = _mm512_fmadd_ps(a, b[h], acc[r][h]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++)
#pragma GCC unroll 2
    for (int h = 0; h < H; h++) _mm512_storeu_ps(c + r * ldc + h * 16, acc[r][h]);
}
__attribute__((target("avx512f"))) void tile_avx512(float* c, int64_t ldc, bool load,
                                                    const TileOperands& t, int64_t depth) {
  if (t.halves == 2) tile512<2>(c, ldc, load, t, depth);
  else tile512<1>(c, ldc, load, t, depth);
}

// one 6 x 16 half: 2 ymm registers per row. Packed: the operands' strides are the packed
// layout's constants (the addresses then need no multiplies and fewer registers).
template <bool Packed>
__attribute__((target("avx2,fma"), always_inline)) inline void tile256_half(float* c, int64_t ldc, bool load,
                                                                           const TileOperands& t, int64_t depth,
                                                                           int half) {
  const int64_t a_rs = Packed ? 1 : t.a_rs, a_cs = Packed ? kTileRows : t.a_cs;
  const int64_t ldb = Packed ? kTileCols : t.ldb;
  const float* ar[6];
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++) ar[r] = t.a + r * a_rs;
  float* cc = c + half * 16;
  const float* bb = t.b + half * 16;
  __m256 acc[6][2];
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++)
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) acc[r][h] = load ? _mm256_loadu_ps(cc + r * ldc + h * 8) : _mm256_setzero_ps();
  for (int64_t p = 0; p < depth; p++) {
    const float* b_row = bb + p * ldb;
    const int64_t ap = p * a_cs;
    const __m256 b0 = _mm256_loadu_ps(b_row), b1 = _mm256_loadu_ps(b_row + 8);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
      const __m256 a = _mm256_broadcast_ss(ar[r] + ap);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++)
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(cc + r * ldc + h * 8, acc[r][h]);
}
__attribute__((target("avx2,fma"))) void tile_avx2(float* c, int64_t ldc, bool load,
                                                   const TileOperands& t, int64_t depth) {
  const bool packed = t.a_rs == 1 && t.a_cs == kTileRows && t.ldb == kTileCols;
  for (int half = 0; half < t.halves; half++)
    if (packed) tile256_half<true>(c, ldc, load, t, depth, half);
    else tile256_half<false>(c, ldc, load, t, depth, half);
}
#endif

// A few rows of c (M <= kFewRows) against an untransposed b: what a decode step does with every
// weight (one row per sequence). Packing b costs as much as such a product and a 6-row tile
// would be mostly padding, so instead each row of b streams past once, from memory, while the
// rows of c (columns [j0, j0 + width), width <= kFewCols) stay in L1. The sum of an element
// runs in the same order as the tiles' (p = 0, 1, ..., from c or 0, each term an fma): the
// bits are version 2's, whichever path a shape takes. The body is compiled once per
// instruction set, like the tiles (the wrappers below), and vectorised along j. T: float, or
// uint16_t for bf16 operands (matmul_bf16), widened as they are read: b then streams past at
// 2 bytes a weight, what a bf16 decode step is for.
constexpr int64_t kFewRows = 4, kFewCols = 256;
template <typename T>
inline __attribute__((always_inline)) void few_rows_body(float* c, const T* a, const T* b, int64_t M,
                                                         int64_t Nc, int64_t K, int64_t j0, int64_t width,
                                                         bool trans_a, bool accumulate) {
  float acc[kFewRows][kFewCols];
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < width; j++) acc[i][j] = accumulate ? c[i * Nc + j0 + j] : 0.f;
  for (int64_t p = 0; p < K; p++) {
    const T* b_row = b + p * Nc + j0;
    for (int64_t i = 0; i < M; i++) {
      const float a_ip = widen(trans_a ? a[p * M + i] : a[i * K + p]);
#pragma omp simd
      for (int64_t j = 0; j < width; j++) acc[i][j] = std::fma(a_ip, widen(b_row[j]), acc[i][j]);
    }
  }
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < width; j++) c[i * Nc + j0 + j] = acc[i][j];
}
#define FF_FEW_ROWS_ARGS(T)                                                           \
  float *c, const T *a, const T *b, int64_t M, int64_t Nc, int64_t K, int64_t j0, \
      int64_t width, bool trans_a, bool accumulate
#define FF_FEW_ROWS_CLONES(suffix, T)                                                                    \
  void few_rows_portable##suffix(FF_FEW_ROWS_ARGS(T)) {                                                  \
    few_rows_body(c, a, b, M, Nc, K, j0, width, trans_a, accumulate);                                    \
  }                                                                                                      \
  FF_FEW_ROWS_X86(suffix, T)
#if defined(__x86_64__)
#define FF_FEW_ROWS_X86(suffix, T)                                                                       \
  __attribute__((target("avx512f"))) void few_rows_avx512##suffix(FF_FEW_ROWS_ARGS(T)) {                 \
    few_rows_body(c, a, b, M, Nc, K, j0, width, trans_a, accumulate);                                    \
  }                                                                                                      \
  __attribute__((target("avx2,fma"))) void few_rows_avx2##suffix(FF_FEW_ROWS_ARGS(T)) {                  \
    few_rows_body(c, a, b, M, Nc, K, j0, width, trans_a, accumulate);                                    \
  }
#else
#define FF_FEW_ROWS_X86(suffix, T)
#endif
FF_FEW_ROWS_CLONES(, float)
FF_FEW_ROWS_CLONES(_bf16, uint16_t)
#undef FF_FEW_ROWS_CLONES
#undef FF_FEW_ROWS_X86
#undef FF_FEW_ROWS_ARGS

// The kernels of one instruction set.
struct IsaKernels {
  const char* name;
  void (*tile)(float*, int64_t, bool, const TileOperands&, int64_t);
  void (*few_rows)(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool);
  void (*few_rows_bf16)(float*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        bool, bool);
};

const IsaKernels& isa_kernels() {
  static const IsaKernels chosen = [] {
    const IsaKernels portable{"portable", tile_portable, few_rows_portable, few_rows_portable_bf16};
#if defined(__x86_64__)
    const IsaKernels avx512{"AVX-512", tile_avx512, few_rows_avx512, few_rows_avx512_bf16};
    const IsaKernels avx2{"AVX2 + FMA", tile_avx2, few_rows_avx2, few_rows_avx2_bf16};
    __builtin_cpu_init();
    const bool has512 = __builtin_cpu_supports("avx512f");
    const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    // FF_CPU_ISA=avx2 or portable runs a lower level than the CPU has (make bench measures
    // the AVX2 kernels on an AVX-512 machine so), best (or unset) the best it has; a level the
    // CPU lacks is not taken (a lesson refuses any other value: matmul_isa_error)
    const char* want = std::getenv("FF_CPU_ISA");
    const std::string w = want ? want : "";
    if (w == "portable") return portable;
    if (w == "avx2" && has2) return avx2;
    if (has512 && w != "avx2") return avx512;
    if (has2) return avx2;
#endif
    return portable;
  }();
  return chosen;
}

// Packing. Panel of op(b) columns [j0, j0 + kTileCols): row p at dst + p * kTileCols, zeros
// past column Nc. b untransposed: each row's 32 columns are contiguous, copied as a block;
// transposed (b stored (Nc, K)): column j of op(b) is row j of b, read along p.
void pack_b_panel(float* dst, const float* b, int64_t j0, int64_t Nc, int64_t K, bool trans_b) {
  const int64_t w = std::min(kTileCols, Nc - j0);
  if (!trans_b) {
    for (int64_t p = 0; p < K; p++) {
      std::copy(b + p * Nc + j0, b + p * Nc + j0 + w, dst + p * kTileCols);
      std::fill(dst + p * kTileCols + w, dst + (p + 1) * kTileCols, 0.f);
    }
    return;
  }
  for (int64_t col = 0; col < kTileCols; col++) {
    const float* src = b + (j0 + col) * K;
    if (col < w)
      for (int64_t p = 0; p < K; p++) dst[p * kTileCols + col] = src[p];
    else
      for (int64_t p = 0; p < K; p++) dst[p * kTileCols + col] = 0.f;
  }
}

// Strip of op(a) rows [i0, i0 + kTileRows), columns [p0, p0 + depth): row r of column p at
// dst[p * kTileRows + r], zeros past row M. a untransposed: each row read along p; transposed
// (a stored (K, M)): each column p holds the strip's rows side by side.
void pack_a_strip(float* dst, const float* a, int64_t i0, int64_t p0, int64_t depth, int64_t M,
                  int64_t K, bool trans_a) {
  const int64_t h = std::min(kTileRows, M - i0);
  if (!trans_a) {
    for (int64_t r = 0; r < kTileRows; r++) {
      const float* src = a + (i0 + r) * K + p0;
      if (r < h)
        for (int64_t p = 0; p < depth; p++) dst[p * kTileRows + r] = src[p];
      else
        for (int64_t p = 0; p < depth; p++) dst[p * kTileRows + r] = 0.f;
    }
    return;
  }
  for (int64_t p = 0; p < depth; p++) {
    const float* src = a + (p0 + p) * M + i0;
    for (int64_t r = 0; r < kTileRows; r++) dst[p * kTileRows + r] = r < h ? src[r] : 0.f;
  }
}

}  // namespace

const char* matmul_isa() { return isa_kernels().name; }

std::string matmul_isa_error() {
  const char* want = std::getenv("FF_CPU_ISA");
  const std::string w = want ? want : "";
  if (w.empty() || w == "best" || w == "avx2" || w == "portable") return "";
  return "FF_CPU_ISA='" + w + "' is not one of the cpu kernels' instruction sets; want best, avx2 or portable";
}

// The few-rows path over a batch, its column blocks shared among the threads.
template <typename T, typename Fn>
void few_rows_matmul(Fn few_rows, float* c, const T* a, const T* b, int64_t B, int64_t M, int64_t Nc, int64_t K,
                     int64_t stride_a, int64_t stride_b, bool trans_a, bool accumulate) {
  const int64_t blocks = (Nc + kFewCols - 1) / kFewCols;
  const int threads = M * Nc * K >= kParallelWork && !omp_in_parallel() ? matmul_threads() : 1;
  for (int64_t z = 0; z < B; z++) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++)
      few_rows(c + z * M * Nc, a + z * stride_a, b + z * stride_b, M, Nc, K, blk * kFewCols,
               std::min(kFewCols, Nc - blk * kFewCols), trans_a, accumulate);
  }
}

bool matmul_bf16_streamed(float* c, const uint16_t* a, const uint16_t* b, int64_t B, int64_t M, int64_t Nc,
                          int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b, bool accumulate) {
  if (M > kFewRows || trans_b) return false;
  few_rows_matmul(isa_kernels().few_rows_bf16, c, a, b, B, M, Nc, K, stride_a, stride_b, trans_a, accumulate);
  return true;
}

void matmul(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc, int64_t K,
            int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b, bool accumulate) {
  if (B == 0 || M == 0 || Nc == 0) return;
  const IsaKernels& isa = isa_kernels();
  if (M <= kFewRows && !trans_b) {  // a few rows: b streamed, not packed (few_rows_body)
    few_rows_matmul(isa.few_rows, c, a, b, B, M, Nc, K, stride_a, stride_b, trans_a, accumulate);
    return;
  }
  const int64_t panels = (Nc + kTileCols - 1) / kTileCols;
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  const int threads = M * Nc * K >= kParallelWork && !omp_in_parallel() ? matmul_threads() : 1;
  // Packing or reading in place. A packed panel or strip is contiguous, which keeps it in L1
  // however far apart its rows are in memory (rows 4 KiB apart all land in one set of the L1
  // cache, and a 1024-wide matrix read in place ran at half the speed). The copy costs about
  // 1/M of the product for b and 1/(Nc/32) for a, so small products, where it would cost as
  // much as it saves, read their operands in place where they can:
  //  - op(b)'s panels (kTileCols columns) are packed once per batch entry (panel jp at
  //    packed_b + jp * K * kTileCols, row p at + p * kTileCols, zeros past column Nc:
  //    pack_b_panel), except with at most kInPlaceBlocks blocks of rows, where an untransposed
  //    b's panels of 32 or exactly 16 columns are read in place (their rows are contiguous);
  //  - op(a)'s strips (kTileRows rows) of a block are packed for each slice of kDepth
  //    (pack_a_strip), except with at most kInPlacePanels panels, where they are read in place
  //    (a ragged last strip is always packed, with zero rows).
  constexpr int64_t kInPlaceBlocks = 3, kInPlacePanels = 3;
  const bool pack_a = panels > kInPlacePanels;
  // panels [0, first_packed) in place (all but perhaps the last, ragged one), the rest packed
  const bool b_in_place = !trans_b && blocks <= kInPlaceBlocks;
  const int64_t last_width = Nc - (panels - 1) * kTileCols;
  const int64_t first_packed =
      !b_in_place ? 0 : last_width == kTileCols || last_width == kTileCols / 2 ? panels : panels - 1;
  std::unique_ptr<float[]> packed_b(first_packed < panels ? new float[(size_t)(panels * K * kTileCols)] : nullptr);

  for (int64_t z = 0; z < B; z++) {
    const float* az = a + z * stride_a;
    const float* bz = b + z * stride_b;
    float* cz = c + z * M * Nc;
    const bool pack_b = z == 0 || stride_b != 0;  // a batch that shares b packs it once
#pragma omp parallel num_threads(threads)
    {
      if (pack_b && first_packed < panels) {
#pragma omp for schedule(static)
        for (int64_t jp = first_packed; jp < panels; jp++)
          pack_b_panel(packed_b.get() + jp * K * kTileCols, bz, jp * kTileCols, Nc, K, trans_b);
        // (the end of an omp for waits for every thread: all of b is packed past this line)
      }

      // blocks of kBlockRows rows of c, shared out among the threads
      std::vector<float> packed_a((size_t)(kBlockRows * std::min(K, kDepth)));
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t i0 = blk * kBlockRows;
        const int64_t strips = (std::min(kBlockRows, M - i0) + kTileRows - 1) / kTileRows;
        if (K == 0 && !accumulate)  // an empty sum
          std::fill(cz + i0 * Nc, cz + std::min(M, i0 + kBlockRows) * Nc, 0.f);
        for (int64_t p0 = 0; p0 < K; p0 += kDepth) {
          const int64_t depth = std::min(kDepth, K - p0);
          // c holds the sum over p < p0 already (or, at p0 = 0, what to accumulate onto)
          const bool add_to_c = accumulate || p0 > 0;
          // the block's strips of op(a), packed or in place (above)
          TileOperands strip[kBlockRows / kTileRows];
          for (int64_t s = 0; s < strips; s++) {
            const int64_t row0 = i0 + s * kTileRows;
            TileOperands& t = strip[s];
            if (pack_a || M - row0 < kTileRows) {
              t.a = packed_a.data() + s * depth * kTileRows, t.a_rs = 1, t.a_cs = kTileRows;
              pack_a_strip(packed_a.data() + s * depth * kTileRows, az, row0, p0, depth, M, K, trans_a);
            } else if (!trans_a) {
              t.a = az + row0 * K + p0, t.a_rs = K, t.a_cs = 1;
            } else {
              t.a = az + p0 * M + row0, t.a_rs = 1, t.a_cs = M;
            }
          }
          // each panel of b is read into L1 once, then every strip of the block is multiplied
          // with it (the block's strips stay in L2)
          for (int64_t jp = 0; jp < panels; jp++) {
            const int64_t col0 = jp * kTileCols, cols = std::min(kTileCols, Nc - col0);
            for (int64_t s = 0; s < strips; s++) {
              const int64_t row0 = i0 + s * kTileRows, rows = std::min(kTileRows, M - row0);
              TileOperands t = strip[s];
              if (jp < first_packed)
                t.b = bz + p0 * Nc + col0, t.ldb = Nc;
              else
                t.b = packed_b.get() + (jp * K + p0) * kTileCols, t.ldb = kTileCols;
              t.halves = cols > kTileCols / 2 ? 2 : 1;
              if (rows == kTileRows && cols == 16 * t.halves) {  // a whole tile: in c itself
                isa.tile(cz + row0 * Nc + col0, Nc, add_to_c, t, depth);
                continue;
              }
              // a ragged edge: through a whole tile on the stack, only its valid part kept
              float tile[kTileRows * kTileCols] = {};
              if (add_to_c)
                for (int64_t r = 0; r < rows; r++)
                  for (int64_t col = 0; col < cols; col++)
                    tile[r * kTileCols + col] = cz[(row0 + r) * Nc + col0 + col];
              isa.tile(tile, kTileCols, true, t, depth);
              for (int64_t r = 0; r < rows; r++)
                for (int64_t col = 0; col < cols; col++)
                  cz[(row0 + r) * Nc + col0 + col] = tile[r * kTileCols + col];
            }
          }
        }
      }
    }
  }
}

}  // namespace ff::cpu
