// lessons/01_online_softmax/online_softmax.cu — the online softmax as CUDA kernels.
//
// The same recurrence as fold_block() and merge() in main.cpp, mapped onto a GPU:
//
//   row_states      one warp per row. Lane i folds columns i, i + 32, i + 64, ... one at a
//                   time into its own (m, l) — the online recurrence with blocks of one
//                   element. Then the 32 states are merged by a butterfly of
//                   __shfl_xor_sync: after 5 steps (offsets 16, 8, 4, 2, 1) every lane holds
//                   the merge of all 32. No shared memory and no __syncthreads: the merge
//                   is associative and commutative, so any pairing is right.
//   normalise       y = exp(x - m) / l, one thread per element.
//   decode_partial  flash-decoding (split-K): the keys of each query are cut into chunks;
//                   block (chunk, query) folds its chunk into (m, l, o). Thread c owns output
//                   column o[c] and runs the whole recurrence itself (m and l are the same
//                   in every thread of the block: recomputing them is cheaper than sharing).
//   merge_states    the chunks' states of each query merged with the same rule, o rescaled
//                   exactly like l.
//
// The guard: exp(a - b) with a = -inf ("nothing seen yet") is 0, never exp(-inf + inf) = NaN.
#include "lessons/01_online_softmax/online_softmax.h"

#include "kernels/simt.h"

namespace ff::online_softmax::SIMT_DEVICE_NS {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;  // row_states: 4 rows per block of 128 threads

// exp(a - b) for a <= b; a = -inf (an empty state) contributes 0.
__device__ __forceinline__ float rescale(float a, float b) {
  return a == -INFINITY ? 0.f : expf(a - b);
}

// (m, l) <- merge((m, l), (m2, l2))
__device__ __forceinline__ void merge_ml(float& m, float& l, float m2, float l2) {
  float m_new = fmaxf(m, m2);
  l = l * rescale(m, m_new) + l2 * rescale(m2, m_new);
  m = m_new;
}

// ----------------------------------------------------------------------------
// kernels

// x (rows, n) -> state (rows, 2). Block: kWarpsPerBlock warps, one row each.
__global__ void row_states_kernel(float* state, const float* x, int64_t rows, int64_t n) {
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp leaves together: the shuffles below stay full
  const float* xr = x + row * n;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = lane; j < n; j += 32) {
    float v = xr[j];
    if (v > m) {  // the max grows: rescale the past to the new max
      l *= rescale(m, v);
      m = v;
    }
    l += rescale(v, m);
  }
  // [slide:warp-butterfly]
  for (int offset = 16; offset > 0; offset /= 2) {
    float m2 = __shfl_xor_sync(kFullMask, m, offset);
    float l2 = __shfl_xor_sync(kFullMask, l, offset);
    merge_ml(m, l, m2, l2);
  }
  // [/slide]
  if (lane == 0) {
    state[2 * row] = m;
    state[2 * row + 1] = l;
  }
}

// y (rows, n) = exp(x - m) / l
__global__ void normalise_kernel(float* y, const float* x, const float* state, int64_t rows,
                                 int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float* st = state + 2 * (i / n);
    y[i] = rescale(x[i], st[0]) / st[1];
  }
}

// s (nq, nk), v (nk, dv) -> partial (nq, splits, 2 + dv). Block (chunk, query).
__global__ void decode_partial_kernel(float* partial, const float* s, const float* v, int64_t nk,
                                      int64_t dv, int64_t splits) {
  const int64_t chunk = blockIdx.x, q = blockIdx.y;
  const int64_t per = (nk + splits - 1) / splits;
  const int64_t t0 = chunk * per, t1 = t0 + per < nk ? t0 + per : nk;
  const float* sq = s + q * nk;
  float* out = partial + (q * splits + chunk) * (2 + dv);
  for (int64_t c = threadIdx.x; c < dv; c += blockDim.x) {
    // [slide:decode-partial]
    float m = -INFINITY, l = 0.f, o = 0.f;
    for (int64_t t = t0; t < t1; t++) {
      float st = sq[t];
      if (st > m) {
        float f = rescale(m, st);
        l *= f;
        o *= f;
        m = st;
      }
      float p = rescale(st, m);
      l += p;
      o += p * v[t * dv + c];
    }
    // [/slide]
    out[2 + c] = o;
    if (c == 0) {
      out[0] = m;
      out[1] = l;
    }
  }
}

// partial (nq, splits, 2 + dv) -> state (nq, 2 + dv). Block: one query.
__global__ void merge_states_kernel(float* state, const float* partial, int64_t dv,
                                    int64_t splits) {
  const int64_t q = blockIdx.x;
  const float* in = partial + q * splits * (2 + dv);
  float* out = state + q * (2 + dv);
  for (int64_t c = threadIdx.x; c < dv; c += blockDim.x) {
    float m = -INFINITY, l = 0.f, o = 0.f;
    for (int64_t k = 0; k < splits; k++) {
      const float* st = in + k * (2 + dv);
      float m_new = fmaxf(m, st[0]);
      float fa = rescale(m, m_new), fb = rescale(st[0], m_new);
      l = l * fa + st[1] * fb;
      o = o * fa + st[2 + c] * fb;
      m = m_new;
    }
    out[2 + c] = o;
    if (c == 0) {
      out[0] = m;
      out[1] = l;
    }
  }
}

// ----------------------------------------------------------------------------
// launchers

// Threads for dv output columns: whole warps, at most 256.
static unsigned column_threads(int64_t dv) {
  int64_t t = (dv + 31) / 32 * 32;
  return (unsigned)(t < 256 ? t : 256);
}

void row_states(float* state, const float* x, int64_t rows, int64_t n) {
  if (rows == 0) return;
  dim3 grid((unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
  SIMT_LAUNCH(row_states_kernel, grid, dim3(32 * kWarpsPerBlock), 0, 0, state, x, rows, n);
  SIMT_CHECK_LAUNCH();
}

void normalise(float* y, const float* x, const float* state, int64_t rows, int64_t n) {
  if (rows * n == 0) return;
  int64_t blocks = (rows * n + 255) / 256;
  SIMT_LAUNCH(normalise_kernel, dim3((unsigned)(blocks < 1024 ? blocks : 1024)), dim3(256), 0, 0,
              y, x, state, rows, n);
  SIMT_CHECK_LAUNCH();
}

void decode_partial(float* partial, const float* s, const float* v, int64_t nq, int64_t nk,
                    int64_t dv, int64_t splits) {
  if (nq == 0) return;
  SIMT_LAUNCH(decode_partial_kernel, dim3((unsigned)splits, (unsigned)nq), dim3(column_threads(dv)),
              0, 0, partial, s, v, nk, dv, splits);
  SIMT_CHECK_LAUNCH();
}

void merge_states(float* state, const float* partial, int64_t nq, int64_t dv, int64_t splits) {
  if (nq == 0) return;
  SIMT_LAUNCH(merge_states_kernel, dim3((unsigned)nq), dim3(column_threads(dv)), 0, 0, state,
              partial, dv, splits);
  SIMT_CHECK_LAUNCH();
}

}  // namespace ff::online_softmax::SIMT_DEVICE_NS
