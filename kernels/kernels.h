// kernels/kernels.h — the table of kernels one device provides.
//
// Design rules:
//  * Kernels see raw pointers and sizes only. Shapes are given as the few
//    numbers each kernel needs (rows, cols, an [outer, n, inner] view ...).
//  * Forward kernels assign their outputs. Backward kernels assign the input
//    gradient they compute; accumulation across uses happens in autograd.
//  * Index tensors are int64 (as in PyTorch), and are assumed in range: the
//    tensor layer validates indices before calling a kernel.
//
// Letters used in shape comments: N rows, C columns (last dim), B batch,
// M/K/Nc matmul sizes, V vocabulary, k top-k count.
#pragma once
#include <cstdint>

#include "kernels/device.h"

namespace ff {

enum class BinaryOp { add, sub, mul, div };
enum class UnaryOp { exp, log, sqrt, sigmoid, silu, relu, neg };
enum class ReduceOp { sum, max };
// How the second operand of a binary op is broadcast against the first, a (n elements):
//   same:   b has n elements
//   row:    b has C elements, reused for every row of a viewed as [n/C, C]
//   col:    b has n/C elements, one per row of a viewed as [n/C, C]
//   scalar: b has 1 element
enum class Broadcast { same, row, col, scalar };

// The scalars of one AdamW step (common/core/optim.cpp computes them once per step, in double,
// and rounds each to float): p = p decay - lr (m inv_bias1) / (sqrt(v inv_bias2) + eps), after
// m = beta1 m + one_minus_beta1 g and v = beta2 v + one_minus_beta2 g g.
struct AdamWStep {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias1, inv_bias2, eps, lr;
};

struct KernelTable {
  // out[i] = value
  void (*fill)(float* out, int64_t n, float value);
  // out[i] = alpha * x[i] + beta
  void (*affine)(float* out, const float* x, int64_t n, float alpha, float beta);
  // out (n) = a (n) op b (broadcast as `bc`, C = row length)
  void (*binary)(BinaryOp op, float* out, const float* a, const float* b, int64_t n, int64_t C,
                 Broadcast bc);
  // out (n) = f(x)
  void (*unary)(UnaryOp op, float* out, const float* x, int64_t n);
  // dx (n) = dy * f'(x); y = f(x) is passed too, since some derivatives use it
  void (*unary_backward)(UnaryOp op, float* dx, const float* x, const float* y, const float* dy,
                         int64_t n);
  // in is viewed as [outer, n, inner]; out [outer, inner] = reduce over n
  void (*reduce)(ReduceOp op, float* out, const float* in, int64_t outer, int64_t n, int64_t inner);
  // max backward: dx [outer, n, inner] = dy routed to the first position that attains the max y
  void (*max_backward)(float* dx, const float* x, const float* y, const float* dy, int64_t outer,
                       int64_t n, int64_t inner);
  // y, x are (N, C); softmax along C
  void (*softmax_forward)(float* y, const float* x, int64_t N, int64_t C);
  // dx = y * (dy - sum(dy * y))
  void (*softmax_backward)(float* dx, const float* y, const float* dy, int64_t N, int64_t C);
  void (*log_softmax_forward)(float* y, const float* x, int64_t N, int64_t C);
  // dx = dy - exp(y) * sum(dy)
  void (*log_softmax_backward)(float* dx, const float* y, const float* dy, int64_t N, int64_t C);
  // c (B, M, Nc) = op(a) @ op(b) (+ c if accumulate). op(a) is (M, K): a is (M, K), or (K, M)
  // when trans_a. op(b) is (K, Nc): b is (K, Nc), or (Nc, K) when trans_b. Batch strides in
  // elements; a stride of 0 reuses the same matrix for every batch entry.
  void (*matmul)(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc,
                 int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b,
                 bool accumulate);
  // in (A, D0, Bm, D1, Cn) -> out (A, D1, Bm, D0, Cn): swaps two dims of any tensor
  void (*transpose)(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm, int64_t D1,
                    int64_t Cn);
  // dst viewed (outer, dst_n, inner), src viewed (outer, src_n, inner):
  // dst[:, dst_off + j, :] (+)= src[:, src_off + j, :] for j < len. Slice and concat use it.
  void (*copy_block)(float* dst, int64_t dst_n, int64_t dst_off, const float* src, int64_t src_n,
                     int64_t src_off, int64_t outer, int64_t len, int64_t inner, bool accumulate);
  // y (N, C) = x * rsqrt(mean(x^2) + eps) * w; rstd (N) saved for the backward
  void (*rmsnorm_forward)(float* y, float* rstd, const float* x, const float* w, int64_t N,
                          int64_t C, float eps);
  // dx (N, C), dw (C) from dy (N, C), x, w, rstd
  void (*rmsnorm_backward)(float* dx, float* dw, const float* dy, const float* x, const float* w,
                           const float* rstd, int64_t N, int64_t C);
  // loss (N) = logsumexp(logits[i]) - logits[i, target[i]]; lse (N) saved for the backward
  void (*cross_entropy_forward)(float* loss, float* lse, const float* logits,
                                const int64_t* targets, int64_t N, int64_t V);
  // dlogits (N, V) = (softmax(logits) - onehot(target)) * dloss[i]
  void (*cross_entropy_backward)(float* dlogits, const float* logits, const float* lse,
                                 const int64_t* targets, const float* dloss, int64_t N, int64_t V);
  // out (M, C) = src[idx[i], :]
  void (*index_select_rows)(float* out, const float* src, const int64_t* idx, int64_t M, int64_t C);
  // dst[idx[i], :] += src (M, C)[i, :]
  void (*index_add_rows)(float* dst, const float* src, const int64_t* idx, int64_t M, int64_t C);
  // vals, idx (N, k): the k largest of each row of x (N, C), descending, lowest index first on ties
  void (*topk_rows)(float* vals, int64_t* idx, const float* x, int64_t N, int64_t C, int64_t k);
  // dx (N, C) = 0, then dx[i, idx[i, j]] += dvals[i, j]
  void (*topk_backward)(float* dx, const float* dvals, const int64_t* idx, int64_t N, int64_t C,
                        int64_t k);
  // out (n) = mask[i % mask_n] != 0 ? value : x[i]
  void (*masked_fill)(float* out, const float* x, const float* mask, int64_t n, int64_t mask_n,
                      float value);

  // ---- attention blocks, FlashAttention-2 style (lesson 02; the readable definition is
  // kernels/cpu/attention.cpp). q, o, dq, dout are (BH, Sq, D); k, v, dk, dv (BH, Sk, D);
  // m, l, lse, delta (BH, Sq): BH independent (batch, head) pairs. qpos (Sq) and kpos (Sk) are
  // the tokens' GLOBAL positions; with causal, query i sees key j iff kpos[j] <= qpos[i].
  // Both kernels walk kAttentionTile x kAttentionTile tiles of (query, key) and skip a tile
  // whose keys are all in the future of all its queries (min kpos > max qpos).
  // Forward: folds one KV block into the running state of every query row: o (unnormalised,
  // sum of exp(s - m) v), running max m and normaliser l; start from o = 0, m = -inf, l = 0.
  void (*flash_forward_block)(float* o, float* m, float* l, const float* q, const float* k,
                              const float* v, const int64_t* qpos, const int64_t* kpos, int64_t BH,
                              int64_t Sq, int64_t Sk, int64_t D, float scale, bool causal);
  // Backward of one (Q block, KV block) pair from the saved lse = m + log l (P = exp(s - lse)
  // recomputed) and delta = rowsum(dout * o). ACCUMULATES (unlike the other backward kernels):
  // dq += dS K * scale, dk += dS^T Q * scale, dv += P^T dout, so a ring can sum over blocks.
  void (*flash_backward_block)(float* dq, float* dk, float* dv, const float* q, const float* k,
                               const float* v, const float* dout, const float* lse,
                               const float* delta, const int64_t* qpos, const int64_t* kpos,
                               int64_t BH, int64_t Sq, int64_t Sk, int64_t D, float scale,
                               bool causal);

  // ---- mixture of experts: permute -> grouped GEMM -> unpermute (lessons 03, 04; the readable
  // definitions are in kernels/cpu/moe.cpp). T tokens, each routed to k experts of G: routing
  // SLOT s = t * k + j is token t's j-th choice, topk_idx[s] its expert. PACKED order sorts the
  // T * k slots by expert, stably (slots of one expert keep their slot order), so that each
  // expert's rows are contiguous: group e is packed rows [off_e, off_e + group_sizes[e]),
  // off_e = sum of the sizes before e.
  // group_sizes (G) = slots per expert (the histogram); src_token (T*k): packed row -> its
  // token; pos (T*k): slot -> its packed row (the inverse permutation).
  void (*moe_permute_plan)(int64_t* group_sizes, int64_t* src_token, int64_t* pos,
                           const int64_t* topk_idx, int64_t T, int64_t k, int64_t G);
  // c (M, Nc) (+)= rows of a (M, K) in group e times w_e, w (G, K, Nc) — or w (G, Nc, K) used
  // transposed when trans_w. group_sizes (G) sum to M. ("ragged dot", grouped GEMM)
  void (*grouped_gemm)(float* c, const float* a, const float* w, const int64_t* group_sizes,
                       int64_t G, int64_t M, int64_t K, int64_t Nc, bool trans_w, bool accumulate);
  // dw (G, K, Nc) (+)= per group a_e^T dc_e, a (M, K), dc (M, Nc): the weight gradient of
  // grouped_gemm. An empty group gets exactly 0 (or is left as is when accumulating).
  void (*grouped_gemm_dw)(float* dw, const float* a, const float* dc, const int64_t* group_sizes,
                          int64_t G, int64_t M, int64_t K, int64_t Nc, bool accumulate);
  // y (T, d) = sum_j gates[t*k + j] * yp[pos[t*k + j]], yp (T*k, d) packed; gates == nullptr
  // means all 1 (then it is the backward of the permute: dx = sum of the token's packed rows).
  // A gather, so deterministic: no atomics.
  void (*moe_combine)(float* y, const float* yp, const int64_t* pos, const float* gates, int64_t T,
                      int64_t k, int64_t d);
  // Backward of moe_combine with gates: dyp[pos[s]] = gates[s] * dy[t] (assigned; every packed
  // row is one slot's), dgates[s] = <dy[t], yp[pos[s]]>.
  void (*moe_combine_backward)(float* dyp, float* dgates, const float* dy, const float* yp,
                               const int64_t* pos, const float* gates, int64_t T, int64_t k,
                               int64_t d);

  // ---- DeepSeek-V3's node-limited routing (the readable definition is
  // kernels/cpu/moe_routing.cpp). scores (T, N): the biased affinities s + b of T tokens over N
  // experts, split into G groups of N/G contiguous experts (G divides N, 1 <= M <= G,
  // group_topk >= 1, 1 <= K <= M N/G; scores finite). Per token: a group's score is the sum of
  // its min(group_topk, N/G) largest scores (lower expert first on ties), added in ascending
  // expert index order from 0.f; kept_groups (T, M) = the M groups of largest score,
  // descending, lower group first on ties; idx (T, K) = the K largest scores among the kept
  // groups' experts, descending, lower expert first on ties (as topk_rows). G == 1 or M == G:
  // idx is plain top-K.
  void (*moe_group_topk)(int64_t* idx, int64_t* kept_groups, const float* scores, int64_t T,
                         int64_t N, int64_t G, int64_t M, int64_t group_topk, int64_t K);

  // ---- rotary position embedding, as DeepSeek-V3 applies it (the readable definition is
  // kernels/cpu/rope.cpp). x, y (T, M, D): T tokens, M rows per token (heads; 1 for a (T, D)
  // tensor) that share the token's position, D even. pos (T): the tokens' positions (GLOBAL
  // ones under context parallelism), >= 0. Each consecutive pair (x[2i], x[2i+1]) of a row is
  // rotated as a complex number by sign * pos[t] * theta^(-2i/D), i < D/2: sign = +1 is the
  // forward, sign = -1 the inverse rotation (the backward). y may be x.
  void (*rope)(float* y, const float* x, const int64_t* pos, int64_t T, int64_t M, int64_t D,
               float theta, int sign);
  // ---- bfloat16 (kernels/bf16.h: the format, the rounding). out (n) = x rounded to bf16 (to
  // nearest, ties to even; NaN stays NaN); out (n) = x widened to float32 (exact).
  void (*to_bf16)(uint16_t* out, const float* x, int64_t n);
  void (*from_bf16)(float* out, const uint16_t* x, int64_t n);
  // matmul's contract (above) with a and b in bf16 and c in float32: every product exact in
  // float32, summed there, so c holds the bits matmul gives on the widened a and b.
  void (*matmul_bf16)(float* c, const uint16_t* a, const uint16_t* b, int64_t B, int64_t M,
                      int64_t Nc, int64_t K, int64_t stride_a, int64_t stride_b, bool trans_a,
                      bool trans_b, bool accumulate);
  // grouped_gemm and grouped_gemm_dw with bf16 operands and a float32 result, the same way
  void (*grouped_gemm_bf16)(float* c, const uint16_t* a, const uint16_t* w,
                            const int64_t* group_sizes, int64_t G, int64_t M, int64_t K, int64_t Nc,
                            bool trans_w, bool accumulate);
  void (*grouped_gemm_dw_bf16)(float* dw, const uint16_t* a, const uint16_t* dc,
                               const int64_t* group_sizes, int64_t G, int64_t M, int64_t K,
                               int64_t Nc, bool accumulate);
  // ---- FP8 e4m3 (kernels/fp8.h) with fine-grained scales, as DeepSeek-V3 trains (lesson 10).
  // x (R, C) in tiles of tr x tc (the last ones ragged): s (ceil(R/tr), ceil(C/tc)) = the
  // tile's largest |x| / 448 (1 for a tile of zeros), q (R, C) = x / s rounded to e4m3.
  void (*fp8_quantize)(uint8_t* q, float* s, const float* x, int64_t R, int64_t C, int64_t tr,
                       int64_t tc);
  // x (R, C) = q times its tile's scale
  void (*fp8_dequantize)(float* x, const uint8_t* q, const float* s, int64_t R, int64_t C,
                         int64_t tr, int64_t tc);
  // c (M, N) (+)= a @ b of quantized operands: a (M, K), scales sa (M, ceil(K/tk)) (tiles
  // 1 x tk); b (K, N), scales sb (ceil(K/tk), ceil(N/tn)) (tiles tk x tn). Per element of c,
  // in order of K: the e4m3 products (exact) summed `promote` at a time (promote divides tk)
  // in an accumulator of acc_bits mantissa bits (accumulate_bits), each partial sum then
  // times its tiles' scales, fused into a float32 sum: fma(partial sa, sb, sum).
  void (*matmul_fp8)(float* c, const uint8_t* a, const float* sa, const uint8_t* b,
                     const float* sb, int64_t M, int64_t N, int64_t K, int64_t tk, int64_t tn,
                     int64_t promote, int acc_bits, bool accumulate);
  // one AdamW step of n parameters, in place: m, v and p updated from g (AdamWStep above), each
  // element on its own, every operation rounded to float in the order written there
  void (*adamw)(float* p, float* m, float* v, const float* g, int64_t n, const AdamWStep& step);
};

// The tile edge of the attention kernels (queries and keys), the same on every device, so the
// tiles skipped under a causal mask — the work a rank does — do not depend on the device.
constexpr int64_t kAttentionTile = 16;

// The kernels of device d. Throws if d has none in this build.
const KernelTable& kernels_for(Device d);

// The initializer of a KernelTable from the functions of one device's namespace.
#define FF_KERNEL_TABLE_INITIALIZER                                                          \
  {                                                                                          \
    fill, affine, binary, unary, unary_backward, reduce, max_backward, softmax_forward,      \
        softmax_backward, log_softmax_forward, log_softmax_backward, matmul, transpose,      \
        copy_block, rmsnorm_forward, rmsnorm_backward, cross_entropy_forward,                \
        cross_entropy_backward, index_select_rows, index_add_rows, topk_rows, topk_backward, \
        masked_fill, flash_forward_block, flash_backward_block, moe_permute_plan,            \
        grouped_gemm, grouped_gemm_dw, moe_combine, moe_combine_backward, moe_group_topk,    \
        rope, to_bf16, from_bf16, matmul_bf16, grouped_gemm_bf16, grouped_gemm_dw_bf16,      \
        fp8_quantize, fp8_dequantize, matmul_fp8, adamw                                      \
  }

}  // namespace ff
