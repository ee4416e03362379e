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
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

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

void grouped_gemm(float* c, const float* a, const float* w, const int64_t* group_sizes, int64_t G,
                  int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate) {
  int64_t row0 = 0;
  for (int64_t e = 0; e < G; e++) {
    const float* we = w + e * K * Nc;
    for (int64_t r = row0; r < row0 + group_sizes[e]; r++)
      for (int64_t n = 0; n < Nc; n++) {
        float acc = 0.f;
        for (int64_t i = 0; i < K; i++)
          acc += a[r * K + i] * (trans_w ? we[n * K + i] : we[i * Nc + n]);
        c[r * Nc + n] = accumulate ? c[r * Nc + n] + acc : acc;
      }
    row0 += group_sizes[e];
  }
  (void)M;
}

void grouped_gemm_dw(float* dw, const float* a, const float* dc, const int64_t* group_sizes,
                     int64_t G, int64_t M, int64_t K, int64_t Nc, bool accumulate) {
  int64_t row0 = 0;
  for (int64_t e = 0; e < G; e++) {
    float* dwe = dw + e * K * Nc;
    for (int64_t i = 0; i < K; i++)
      for (int64_t n = 0; n < Nc; n++) {
        float acc = 0.f;
        for (int64_t r = row0; r < row0 + group_sizes[e]; r++) acc += a[r * K + i] * dc[r * Nc + n];
        dwe[i * Nc + n] = accumulate ? dwe[i * Nc + n] + acc : acc;
      }
    row0 += group_sizes[e];
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
