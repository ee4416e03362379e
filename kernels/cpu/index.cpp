// kernels/cpu/index.cpp — row gather/scatter (embedding, index_select, index_add)
// and top-k per row.
#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

void index_select_rows(float* out, const float* src, const int64_t* idx, int64_t M, int64_t C) {
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < C; j++) out[i * C + j] = src[idx[i] * C + j];
}

void index_add_rows(float* dst, const float* src, const int64_t* idx, int64_t M, int64_t C) {
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < C; j++) dst[idx[i] * C + j] += src[i * C + j];
}

// Selection by repeated insertion into a sorted list of k: fine for the small k of routing.
void topk_rows(float* vals, int64_t* idx, const float* x, int64_t N, int64_t C, int64_t k) {
  for (int64_t r = 0; r < N; r++) {
    float* v = vals + r * k;
    int64_t* id = idx + r * k;
    int64_t filled = 0;
    for (int64_t j = 0; j < C; j++) {
      float xv = x[r * C + j];
      // position where xv goes: after every kept value >= xv (keeps the lower index first)
      int64_t pos = filled;
      while (pos > 0 && v[pos - 1] < xv) pos--;
      if (pos >= k) continue;
      int64_t last = filled < k ? filled : k - 1;
      for (int64_t q = last; q > pos; q--) {
        v[q] = v[q - 1];
        id[q] = id[q - 1];
      }
      v[pos] = xv;
      id[pos] = j;
      if (filled < k) filled++;
    }
  }
}

void topk_backward(float* dx, const float* dvals, const int64_t* idx, int64_t N, int64_t C,
                   int64_t k) {
  for (int64_t i = 0; i < N * C; i++) dx[i] = 0.f;
  for (int64_t r = 0; r < N; r++)
    for (int64_t j = 0; j < k; j++) dx[r * C + idx[r * k + j]] += dvals[r * k + j];
}

}  // namespace ff::cpu
