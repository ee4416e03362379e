// lessons/01_online_softmax/online_softmax.h — the lesson's own CUDA kernels
// (online_softmax.cu), built for device sim (namespace ff::online_softmax::sim, run by the SIMT
// emulator) and, when nvcc exists, for device cuda (ff::online_softmax::cuda). Pointers are device
// pointers; a state is (m, l) or (m, l, o[dv]) as in main.cpp.
#pragma once
#include <cstdint>

#define LESSON01_KERNELS                                                                      \
  /* state (rows, 2) = the (m, l) of each row of x (rows, n): one warp per row, each lane   \
     folds its columns with the online recurrence, the lanes merge with __shfl_xor_sync */  \
  void row_states(float* state, const float* x, int64_t rows, int64_t n);                    \
  /* y (rows, n) = exp(x - m) / l with the row's state (rows, 2) */                          \
  void normalise(float* y, const float* x, const float* state, int64_t rows, int64_t n);     \
  /* split-K flash-decoding, step 1: scores s (nq, nk), values v (nk, dv); the keys are cut   \
     into `splits` chunks and each block folds one chunk of one query into a state          \
     (m, l, o[dv]): partial (nq, splits, 2 + dv) */                                          \
  void decode_partial(float* partial, const float* s, const float* v, int64_t nq, int64_t nk,  \
                      int64_t dv, int64_t splits);                                           \
  /* step 2: state (nq, 2 + dv) = the merge of each query's `splits` partial states */       \
  void merge_states(float* state, const float* partial, int64_t nq, int64_t dv, int64_t splits);

namespace ff::online_softmax {
namespace sim {
LESSON01_KERNELS
}
namespace cuda {
LESSON01_KERNELS
}
}  // namespace ff::online_softmax
