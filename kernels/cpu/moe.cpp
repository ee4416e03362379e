// kernels/cpu/moe.cpp — the data movement and the grouped GEMM of a mixture-of-experts
// layer: the readable definitions of moe_permute_plan, grouped_gemm, grouped_gemm_dw,
// moe_combine and moe_combine_backward (kernels/kernels.h). CUDA versions: kernels/cuda/moe.cu.
//
// Each token t picks k experts; routing slot s = t * k + j carries its j-th choice. Running
// every expert on ALL tokens and masking would waste G / k of the work, and looping over
// experts with index lists launches G small GEMMs. The fast form (MegaBlocks; "ragged dot")
// sorts the slots by expert, so every expert's rows are contiguous ("permute"), multiplies
// each group of rows by its own expert's weights in ONE grouped GEMM, and puts the rows back,
// weighted by the gates ("unpermute" / combine):
//
//   topk_idx (T, k) --plan--> group_sizes (G), src_token (T*k), pos (T*k)
//   x (T, d) --gather src_token--> xp (T*k, d) --grouped GEMM per expert--> yp (T*k, d)
//   yp --combine: y_t = sum_j g_tj * yp[pos[t*k + j]]--> y (T, d)
//
// The plan is a counting sort: a histogram of the experts (group sizes), its exclusive
// prefix sum (each group's first row), then every slot, in slot order, takes the next row of
// its expert's group — which makes the order stable, hence the same on every device.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/row_math.h"

namespace ff::cpu {

void moe_permute_plan(int64_t* group_sizes, int64_t* src_token, int64_t* pos,
                      const int64_t* topk_idx, int64_t T, int64_t k, int64_t G) {
  for (int64_t e = 0; e < G; e++) group_sizes[e] = 0;
  for (int64_t s = 0; s < T * k; s++) group_sizes[topk_idx[s]]++;   // histogram
  std::vector<int64_t> next((size_t)G, 0);                          // exclusive prefix sum
  for (int64_t e = 1; e < G; e++) next[(size_t)e] = next[(size_t)(e - 1)] + group_sizes[e - 1];
  for (int64_t s = 0; s < T * k; s++) {                              // stable scatter
    const int64_t row = next[(size_t)topk_idx[s]]++;
    pos[s] = row;
    src_token[row] = s / k;
  }
}

// Both grouped GEMMs are the cpu matmul (matmul.cpp: packed, tiled, vectorised, threaded) on
// each expert's rows in turn: c[r0:r1] = a[r0:r1] w_e (or w_e^T), dw_e = a[r0:r1]^T dc[r0:r1].
// So every output sums its terms as the matmul does (fma after fma, in order, from 0; then added
// to c when accumulating), whatever the thread count. With two experts or more per thread, the
// experts themselves are shared out among the threads (dynamically: their row counts differ),
// each one's matmul on its own thread (inside the parallel loop it starts no team of its own),
// which saves a team start per expert and the matmul's ragged last row block; with fewer, each
// matmul shares its row blocks. The same sums either way.
template <class Product>
static void per_expert(const std::vector<int64_t>& first, int64_t G, int64_t work, Product product) {
  const int threads = matmul_threads();
  const bool across = threads > 1 && G >= 2 * threads && work >= (int64_t(1) << 18);
  if (!across) {  // (not a parallel region with if(false): a matmul inside one runs alone)
    for (int64_t e = 0; e < G; e++) product(e, first[(size_t)e], first[(size_t)e + 1]);
    return;
  }
#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t e = 0; e < G; e++) product(e, first[(size_t)e], first[(size_t)e + 1]);
}

// out = product (written by product(out)), or out += product when accumulating: the sum is
// formed from 0 and then added, one rounding, as the device kernels do (a matmul accumulating
// would start its sum from out, and a large out would weigh on every rounding of it).
template <class Product>
static void add_or_assign(float* out, int64_t n, bool accumulate, Product product) {
  if (!accumulate) return product(out);
  std::vector<float> sum((size_t)n);
  product(sum.data());
  for (int64_t i = 0; i < n; i++) out[i] += sum[(size_t)i];
}

static std::vector<int64_t> group_starts(const int64_t* group_sizes, int64_t G) {
  std::vector<int64_t> first((size_t)G + 1, 0);  // each group's first row
  for (int64_t e = 0; e < G; e++) first[(size_t)e + 1] = first[(size_t)e] + group_sizes[e];
  return first;
}

void grouped_gemm(float* c, const float* a, const float* w, const int64_t* group_sizes, int64_t G,
                  int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  (void)M;
  const std::vector<int64_t> first = group_starts(group_sizes, G);
  per_expert(first, G, first[(size_t)G] * K * Nc, [&](int64_t e, int64_t r0, int64_t r1) {
    // w_e is (K, Nc), or stored (Nc, K) when trans_w
    add_or_assign(c + r0 * Nc, (r1 - r0) * Nc, accumulate, [&](float* out) {
      matmul(out, a + r0 * K, w + e * K * Nc, 1, r1 - r0, Nc, K, 0, 0, false, trans_w, false);
    });
  });
}

void grouped_gemm_dw(float* dw, const float* a, const float* dc, const int64_t* group_sizes,
                     int64_t G, int64_t M, int64_t K, int64_t Nc, bool accumulate) {
  (void)M;
  const std::vector<int64_t> first = group_starts(group_sizes, G);
  per_expert(first, G, first[(size_t)G] * K * Nc, [&](int64_t e, int64_t r0, int64_t r1) {
    // dw_e (K, Nc) = a[r0:r1]^T dc[r0:r1]: a's rows read as the columns of a^T (trans_a); an
    // expert with no rows gets 0 (or keeps dw_e, accumulating)
    add_or_assign(dw + e * K * Nc, K * Nc, accumulate, [&](float* out) {
      matmul(out, a + r0 * K, dc + r0 * Nc, 1, K, Nc, r1 - r0, 0, 0, true, false, false);
    });
  });
}

// Tokens are independent (each writes its own row of y, or its own slots' rows of dyp and its
// own dgates): large ones are shared among threads, each computed as on one.
void moe_combine(float* y, const float* yp, const int64_t* pos, const float* gates, int64_t T,
                 int64_t k, int64_t d) {
  const int threads = row_threads(T * k * d);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < T; t++)
    for (int64_t c = 0; c < d; c++) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; j++) {
        const int64_t s = t * k + j;
        acc += (gates ? gates[s] : 1.f) * yp[pos[s] * d + c];
      }
      y[t * d + c] = acc;
    }
}

void moe_combine_backward(float* dyp, float* dgates, const float* dy, const float* yp,
                          const int64_t* pos, const float* gates, int64_t T, int64_t k,
                          int64_t d) {
  const int threads = row_threads(T * k * d);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      const int64_t s = t * k + j, row = pos[s];
      float dot = 0.f;
      for (int64_t c = 0; c < d; c++) {
        dyp[row * d + c] = gates[s] * dy[t * d + c];
        dot += dy[t * d + c] * yp[row * d + c];
      }
      dgates[s] = dot;
    }
}

}  // namespace ff::cpu
