// kernels/cpu/attention.cpp — attention over one (Q block, KV block) pair, FlashAttention-2
// style: the readable definition of flash_forward_block and flash_backward_block
// (kernels/kernels.h). The CUDA versions are in kernels/cuda/attention.cu.
//
// Attention of a query row q_i over keys k_j and values v_j:
//     s_ij = scale * q_i . k_j     (scale = 1/sqrt(D); s_ij = -inf where the mask hides j)
//     P_ij = exp(s_ij - lse_i),    lse_i = log sum_j exp(s_ij)
//     o_i  = sum_j P_ij v_j
// Forward (Dao, "FlashAttention-2", 2023, Algorithm 1): the keys arrive block by block and
// each row keeps the online-softmax state of lesson 01 plus the running output,
//     m_i = max_j s_ij,  l_i = sum_j exp(s_ij - m_i),  o_i = sum_j exp(s_ij - m_i) v_j,
// rescaling l and o by exp(m_old - m_new) whenever the max grows. After the last block the
// caller divides o by l and keeps lse = m + log l: one number per row is all the backward
// needs, instead of the (Sq, Sk) matrix P.
// Backward (Algorithm 2): P is recomputed from lse, then with dO the upstream gradient
//     dV_j += sum_i P_ij dO_i
//     dP_ij = dO_i . v_j
//     dS_ij = P_ij (dP_ij - delta_i),   delta_i = sum_j P_ij dP_ij = dO_i . o_i
//     dQ_i += scale sum_j dS_ij k_j,    dK_j += scale sum_i dS_ij q_i
// (the softmax Jacobian applied row by row: delta is the row's sum of P * dP, which equals
// dO_i . o_i because o_i = sum_j P_ij v_j — so it is precomputed once, not per block).
//
// The mask uses GLOBAL positions qpos, kpos: a rank that holds tokens 512..767 of the
// sequence must mask with those numbers, not with 0..255 (lesson 02's --mask local bug).
// Both kernels walk tiles of kAttentionTile queries x kAttentionTile keys and skip a tile in
// which every key is in the future of every query — the work saved by causal masking, and
// what the load-balanced layouts of lesson 02 distribute evenly.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace ff::cpu {

namespace {

struct Tile {
  int64_t i0, i1, j0, j1;  // queries [i0, i1), keys [j0, j1)
};

// True when every key of the tile lies in the future of every query: nothing to compute.
bool tile_all_future(const Tile& t, const int64_t* qpos, const int64_t* kpos) {
  int64_t q_max = qpos[t.i0], k_min = kpos[t.j0];
  for (int64_t i = t.i0; i < t.i1; i++) q_max = std::max(q_max, qpos[i]);
  for (int64_t j = t.j0; j < t.j1; j++) k_min = std::min(k_min, kpos[j]);
  return k_min > q_max;
}

// Calls fn(tile) for every tile that has at least one visible (query, key) pair.
template <typename Fn>
void for_each_tile(int64_t Sq, int64_t Sk, const int64_t* qpos, const int64_t* kpos, bool causal,
                   Fn fn) {
  for (int64_t i0 = 0; i0 < Sq; i0 += kAttentionTile)
    for (int64_t j0 = 0; j0 < Sk; j0 += kAttentionTile) {
      Tile t{i0, std::min(i0 + kAttentionTile, Sq), j0, std::min(j0 + kAttentionTile, Sk)};
      if (causal && tile_all_future(t, qpos, kpos)) continue;
      fn(t);
    }
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t c = 0; c < n; c++) s += a[c] * b[c];
  return s;
}

}  // namespace

void flash_forward_block(float* o, float* m, float* l, const float* q, const float* k,
                         const float* v, const int64_t* qpos, const int64_t* kpos, int64_t BH,
                         int64_t Sq, int64_t Sk, int64_t D, float scale, bool causal) {
  std::vector<float> s((size_t)kAttentionTile);
  for (int64_t bh = 0; bh < BH; bh++) {
    const float* qb = q + bh * Sq * D;
    const float* kb = k + bh * Sk * D;
    const float* vb = v + bh * Sk * D;
    float* ob = o + bh * Sq * D;
    float* mb = m + bh * Sq;
    float* lb = l + bh * Sq;
    for_each_tile(Sq, Sk, qpos, kpos, causal, [&](const Tile& t) {
      for (int64_t i = t.i0; i < t.i1; i++) {
        // the scores of this row against the tile's keys, and their max
        float m_tile = -INFINITY;
        for (int64_t j = t.j0; j < t.j1; j++) {
          bool visible = !causal || kpos[j] <= qpos[i];
          float sij = visible ? scale * dot(qb + i * D, kb + j * D, D) : -INFINITY;
          s[(size_t)(j - t.j0)] = sij;
          m_tile = std::max(m_tile, sij);
        }
        // [slide:fold]
        const float m_new = std::max(mb[i], m_tile);
        if (m_new == -INFINITY) continue;  // nothing visible to this row yet
        // rescale the past to the new max (an empty past, m = -inf, contributes 0)
        const float alpha = mb[i] == -INFINITY ? 0.f : std::exp(mb[i] - m_new);
        float* oi = ob + i * D;
        for (int64_t c = 0; c < D; c++) oi[c] *= alpha;
        float l_new = lb[i] * alpha;
        for (int64_t j = t.j0; j < t.j1; j++) {
          const float p = std::exp(s[(size_t)(j - t.j0)] - m_new);  // exp(-inf) = 0: masked
          l_new += p;
          for (int64_t c = 0; c < D; c++) oi[c] += p * vb[j * D + c];
        }
        mb[i] = m_new;
        lb[i] = l_new;
        // [/slide]
      }
    });
  }
}

void flash_backward_block(float* dq, float* dk, float* dv, const float* q, const float* k,
                          const float* v, const float* dout, const float* lse, const float* delta,
                          const int64_t* qpos, const int64_t* kpos, int64_t BH, int64_t Sq,
                          int64_t Sk, int64_t D, float scale, bool causal) {
  for (int64_t bh = 0; bh < BH; bh++) {
    const float* qb = q + bh * Sq * D;
    const float* kb = k + bh * Sk * D;
    const float* vb = v + bh * Sk * D;
    const float* dob = dout + bh * Sq * D;
    float* dqb = dq + bh * Sq * D;
    float* dkb = dk + bh * Sk * D;
    float* dvb = dv + bh * Sk * D;
    for_each_tile(Sq, Sk, qpos, kpos, causal, [&](const Tile& t) {
      for (int64_t i = t.i0; i < t.i1; i++)
        for (int64_t j = t.j0; j < t.j1; j++) {
          if (causal && kpos[j] > qpos[i]) continue;  // P_ij = 0: no gradient either way
          const float p = std::exp(scale * dot(qb + i * D, kb + j * D, D) - lse[bh * Sq + i]);
          const float dp = dot(dob + i * D, vb + j * D, D);
          const float ds = p * (dp - delta[bh * Sq + i]);
          for (int64_t c = 0; c < D; c++) {
            dvb[j * D + c] += p * dob[i * D + c];
            dqb[i * D + c] += scale * ds * kb[j * D + c];
            dkb[j * D + c] += scale * ds * qb[i * D + c];
          }
        }
    });
  }
}

}  // namespace ff::cpu
