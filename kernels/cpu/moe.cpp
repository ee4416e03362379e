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

// Both grouped GEMMs sum each output's terms in the readable order (c[r][n] over i = 0..K-1,
// dw[i][n] over the group's rows in order), starting from 0: the loops are only turned so that
// the innermost runs along n, contiguous in w, dc and the output, which the compiler vectorises
// (a vector lane per n, each lane adding its terms in the same order: the same bits as the
// scalar loop; -ffp-contract=off keeps every product rounded before its sum). Rows (of c) and
// weight rows i (of dw) are independent, so they are shared among threads, with row_math.h's
// rule for when that pays.
FF_CPU_CLONES static void gemm_row(float* cr, const float* ar, const float* we, int64_t K,
                                   int64_t Nc, float* acc, bool accumulate) {
  for (int64_t n = 0; n < Nc; n++) acc[n] = 0.f;
  for (int64_t i = 0; i < K; i++) {
    const float ai = ar[i];
    const float* wi = we + i * Nc;
    for (int64_t n = 0; n < Nc; n++) acc[n] += ai * wi[n];
  }
  for (int64_t n = 0; n < Nc; n++) cr[n] = accumulate ? cr[n] + acc[n] : acc[n];
}

// out (K, Nc) = in^T, in (Nc, K): in blocks, so that both sides stay in the cache.
static void transpose_rows(float* out, const float* in, int64_t Nc, int64_t K) {
  constexpr int64_t kBlock = 32;
  for (int64_t n0 = 0; n0 < Nc; n0 += kBlock)
    for (int64_t i0 = 0; i0 < K; i0 += kBlock)
      for (int64_t n = n0; n < std::min(Nc, n0 + kBlock); n++)
        for (int64_t i = i0; i < std::min(K, i0 + kBlock); i++) out[i * Nc + n] = in[n * K + i];
}

void grouped_gemm(float* c, const float* a, const float* w, const int64_t* group_sizes, int64_t G,
                  int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  (void)M;
  if (!trans_w) {
    std::vector<int64_t> expert_of;  // row -> its group
    for (int64_t e = 0; e < G; e++) expert_of.insert(expert_of.end(), (size_t)group_sizes[e], e);
    const int64_t rows = (int64_t)expert_of.size();
    const int threads = row_threads(rows * K * Nc / 8);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      std::vector<float> acc((size_t)Nc);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; r++)
        gemm_row(c + r * Nc, a + r * K, w + expert_of[(size_t)r] * K * Nc, K, Nc, acc.data(), accumulate);
    }
    return;
  }
  // w^T (each expert's w stored (Nc, K)): the expert's weights transposed once into (K, Nc), then
  // the rows as above — the same products summed in the same order (i = 0, 1, ...) as a dot
  // product along a row of w, so the same bits, with the inner loop along n vectorised instead
  // of a scalar sum per output
  std::vector<float> wt((size_t)(K * Nc));
  int64_t r0 = 0;
  for (int64_t e = 0; e < G; r0 += group_sizes[e], e++) {
    if (group_sizes[e] == 0) continue;
    const float* we = w + e * K * Nc;
    transpose_rows(wt.data(), we, Nc, K);
    const int64_t r1 = r0 + group_sizes[e];
    const int t = row_threads((r1 - r0) * K * Nc / 8);
#pragma omp parallel num_threads(t) if (t > 1)
    {
      std::vector<float> acc((size_t)Nc);
#pragma omp for schedule(static)
      for (int64_t r = r0; r < r1; r++) gemm_row(c + r * Nc, a + r * K, wt.data(), K, Nc, acc.data(), accumulate);
    }
  }
}

FF_CPU_CLONES static void gemm_dw_row(float* dwi, const float* a, const float* dc, int64_t i,
                                      int64_t r0, int64_t r1, int64_t K, int64_t Nc, float* acc,
                                      bool accumulate) {
  for (int64_t n = 0; n < Nc; n++) acc[n] = 0.f;
  for (int64_t r = r0; r < r1; r++) {
    const float ari = a[r * K + i];
    const float* dcr = dc + r * Nc;
    for (int64_t n = 0; n < Nc; n++) acc[n] += ari * dcr[n];
  }
  for (int64_t n = 0; n < Nc; n++) dwi[n] = accumulate ? dwi[n] + acc[n] : acc[n];
}

void grouped_gemm_dw(float* dw, const float* a, const float* dc, const int64_t* group_sizes,
                     int64_t G, int64_t M, int64_t K, int64_t Nc, bool accumulate) {
  std::vector<int64_t> first((size_t)G + 1, 0);  // each group's first row
  for (int64_t e = 0; e < G; e++) first[(size_t)e + 1] = first[(size_t)e] + group_sizes[e];
  const int threads = row_threads(first[(size_t)G] * K * Nc / 8);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> acc((size_t)Nc);
#pragma omp for schedule(static)
    for (int64_t ei = 0; ei < G * K; ei++) {  // (expert e, weight row i) pairs
      const int64_t e = ei / K, i = ei % K;
      gemm_dw_row(dw + e * K * Nc + i * Nc, a, dc, i, first[(size_t)e], first[(size_t)e + 1], K, Nc,
                  acc.data(), accumulate);
    }
  }
  (void)M;
}

void moe_combine(float* y, const float* yp, const int64_t* pos, const float* gates, int64_t T,
                 int64_t k, int64_t d) {
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
