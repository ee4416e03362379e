// common/layers/model.h — the tiny DeepSeek-style language model: a character-level decoder
// with Multi-head Latent Attention (DeepSeek-V2 §2.1, DeepSeek-V3 inference/model.py's MLA,
// "naive" path) and, after the first `dense_layers` dense SwiGLU FFNs, lesson 05's DeepSeek-V3
// MoE layer. Single process; lesson 08 (and later lessons) distribute it.
//
// Letters: B sequences, T tokens each, d model width, V vocabulary, H heads, r_q / r_kv the
// query / key-value latent ranks, d_n = d_nope, d_r = d_rope, d_v the value head width.
//
//   x = embed[ids]                                                        (B T, d)
//   for each layer:  x = x + MLA(RMSNorm(x));  x = x + FFN(RMSNorm(x))
//   logits = RMSNorm(x) head;  loss = mean cross-entropy of the next-token targets
//
//   MLA(u), u (B T, d), positions (T) explicit (0..T-1 here; global ones under context
//   parallelism):
//     c_q  = RMSNorm(u W_dq)                     (B T, r_q)
//     q    = c_q W_uq                            (B T, H, d_n + d_r): per head [q_nope | q_pe]
//     q_pe = rope(q_pe)
//     c_kv = RMSNorm(u W_dkv)                    (B T, r_kv)
//     k_nope = c_kv W_uk  (B T, H, d_n);  v = c_kv W_uv  (B T, H, d_v)
//     k_pe = rope(u W_kr)                        (B T, d_r): ONCE per token, shared by every head
//     scores = (q_nope . k_nope + q_pe . k_pe) / sqrt(d_n + d_r)   two inner products, summed
//     o = softmax(causal(scores)) v;  MLA(u) = o W_o                (H d_v, d)
//
//   FFN, dense:  (silu(u W1) * (u W3)) W2
//   FFN, MoE:    dsv3::forward (sigmoid gate, selection on s + b, top-K, gates normalised over
//                the chosen, shared experts; one group, no capacity, no balance loss), recorded
//                as ONE autograd op whose backward is dsv3::backward.
//
// Everything but the MoE runs through the core's ops, so autograd differentiates it; the
// parameters are autograd leaves, each under a stable name (named_parameters) that goldens,
// dumps and the optimizer share.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/dsv3_moe.h"
#include "common/layers/moe.h"

namespace ff::model {

using moe::NamedTensor;

struct Config {
  int64_t vocab = 65;           // V: the corpus's distinct bytes (tinyshakespeare: 65)
  int64_t dim = 64;             // d
  int64_t layers = 2;           // L blocks
  int64_t dense_layers = 1;     // the first ones have a dense SwiGLU FFN, the rest the MoE
  int64_t heads = 4;            // H
  int64_t d_nope = 16, d_rope = 8, d_v = 16;
  int64_t q_lora = 32, kv_lora = 32;  // r_q, r_kv
  int64_t ffn = 128;            // dense SwiGLU width f
  int64_t experts = 8, topk = 2, shared = 1;
  int64_t moe_ffn = 32;         // width of each routed (and shared) expert
  double route_scale = 1.0;
  int64_t seq_len = 32;         // T
  float rope_theta = 10000.f;
  float norm_eps = 1e-6f;       // every RMSNorm (DeepSeek-V3's)

  int64_t qk_head_dim() const { return d_nope + d_rope; }
  bool is_moe(int64_t layer) const { return layer >= dense_layers; }
  dsv3::Config moe_config() const;  // the MoE layers' settings as lesson 05's layer takes them
  // Throws ff::Error naming the first setting out of range.
  void validate() const;
};

struct Attention {
  Tensor w_dq;     // (d, r_q)
  Tensor q_norm;   // (r_q)
  Tensor w_uq;     // (r_q, H (d_n + d_r))
  Tensor w_dkv;    // (d, r_kv)
  Tensor kv_norm;  // (r_kv)
  Tensor w_uk;     // (r_kv, H d_n)
  Tensor w_uv;     // (r_kv, H d_v)
  Tensor w_kr;     // (d, d_r): one k_pe per token, not per head
  Tensor w_o;      // (H d_v, d)
};

struct DenseFFN {
  Tensor w1, w3;  // (d, f)
  Tensor w2;      // (f, d)
};

struct Block {
  Tensor attn_norm;  // (d)
  Attention attn;
  Tensor ffn_norm;   // (d)
  bool moe = false;
  DenseFFN ffn;      // when !moe
  dsv3::Params experts;  // when moe; its bias (N) selects only and is no parameter
};

struct Params {
  Tensor embed;  // (V, d)
  std::vector<Block> layers;
  Tensor norm;   // (d)
  Tensor head;   // (d, V)

  // The trainable tensors (autograd leaves), in a fixed order, under names such as
  // "embed", "layers.0.attn.w_dq", "layers.1.moe.experts_w1", "norm", "head".
  std::vector<NamedTensor> named_parameters() const;
  // What is loaded and saved but not trained by the optimizer: the MoE balancing biases,
  // "layers.<i>.moe.bias".
  std::vector<NamedTensor> named_buffers() const;
  // The weights the activations are multiplied by (lesson 10 holds them in bf16, Megatron's
  // mixed precision): MLA's projections, the dense FFN's and the experts' matrices, the LM
  // head. Not the embedding (a lookup), the norms' weights or the router (DeepSeek-V3 keeps
  // them in higher precision).
  std::vector<Tensor*> matmul_weights();
  // Those weights rounded to bf16, leaves again (Megatron's layout: the weights themselves bf16,
  // so autograd gives them bf16 gradients; lessons 08 and 10 --precision bf16).
  void hold_matmuls_in_bf16();
};

// Every parameter and buffer of the model, zero, on dev (the parameters autograd leaves): the
// structure, for what fills it (init_params, load_params, a checkpoint's checks).
Params zero_params(const Config& c, Device dev = Device::cpu);
// Random weights from the counter-based RNG: parameter number k gets seed + k (in
// named_parameters order), matrices N(0, 1) / sqrt(fan_in), norm weights 1, biases 0.
Params init_params(const Config& c, uint64_t seed, Device dev = Device::cpu);
// Every parameter and buffer read from DIR/<prefix><name>.npy (shapes checked), as leaves.
Params load_params(const Config& c, const std::string& dir, const std::string& prefix,
                   Device dev = Device::cpu);

// ---- the pieces, composed by forward()
// u (B T, d), positions (T): MLA's output (B T, d) = attention_heads(attention_latents(u)).
Tensor attention(const Config& c, const Attention& a, const Tensor& u, int64_t B,
                 const Tensor& positions);
// MLA in its two halves, for lessons that distribute it (tensor parallelism splits the heads
// and keeps the per-token latents replicated, seed 002's "fully replicated W_A"):
//   latents  what every head reads, from the down-projections: c_q = RMSNorm(u W_dq),
//            c_kv = RMSNorm(u W_dkv), k_pe = rope(u W_kr). u (n, d), one position per row (n).
//   heads    H heads whose up-projections are a.w_uq, a.w_uk, a.w_uv (their columns) and a.w_o
//            (its rows): all c.heads of them for one process, a TP rank's share under TP, when
//            the result is that rank's partial sum of o W_o. The latents' n rows are B whole
//            sequences (causal attention within each).
// A w_kr of (d, H d_r) instead of (d, d_r) gives every head its own k_pe, (n, H d_r): the
// per-head keys of ordinary RoPE attention, which lesson 08 plants as a bug in MLA.
struct Latents {
  Tensor c_q, c_kv, k_pe;  // (n, r_q), (n, r_kv), (n, d_r)
};
Latents attention_latents(const Config& c, const Attention& a, const Tensor& u,
                          const Tensor& row_positions);
Tensor attention_heads(const Config& c, int64_t H, const Attention& a, const Latents& l,
                       int64_t B, const Tensor& row_positions);
// (T, T): mask[i][j] = 1 where key j is after query i, those scores -inf before the softmax (a
// token sees itself and the tokens before it).
Tensor causal_mask(int64_t T, Device dev);
// positions (T) repeated for each of B sequences: (B T), one per row of the activations.
Tensor tile_positions(const Tensor& positions, int64_t B);
Tensor dense_ffn(const DenseFFN& f, const Tensor& u);
// The product of the linear layers, x (n, k) by their weight w (k, m): MLA's seven projections
// and the dense FFN's three. By default matmul; a lesson may run another GEMM there for a
// while (lesson 10: DeepSeek-V3's FP8 GEMMs, which the report runs in these layers) by holding
// a LinearScope. The attention core's products, the experts' grouped GEMM and the head stay
// matmul.
using LinearFn = std::function<Tensor(const Tensor& x, const Tensor& w)>;
Tensor linear(const Tensor& x, const Tensor& w);
// While it lives, linear() runs f (empty: matmul); its end puts back what ran before, on every
// way out of the scope (an error's exception included). One thread's model at a time.
class LinearScope {
 public:
  explicit LinearScope(LinearFn f);
  ~LinearScope();
  LinearScope(const LinearScope&) = delete;
  LinearScope& operator=(const LinearScope&) = delete;

 private:
  LinearFn previous_;
};
// u (B T, d): lesson 05's layer as one autograd op "dsv3_moe", its backward split (dx in a
// zero-bubble pipeline's I, every weight's gradient in its W). route, when given, receives the
// experts each token was sent to, (B T, K) int64.
Tensor moe_ffn(const dsv3::Config& c, const dsv3::Params& p, const Tensor& u,
               Tensor* route = nullptr);

// ---- the whole model
struct Output {
  Tensor loss;                // () mean cross-entropy
  Tensor logits;              // (B T, V)
  std::vector<Tensor> routes; // one (B T, K) int64 per MoE layer, in layer order
};
// inputs, targets int64 (B, T); positions int64 (T).
Output forward(const Config& c, const Params& p, const Tensor& inputs, const Tensor& targets,
               const Tensor& positions);

// A batch of B sequences of T + 1 tokens (int64 (B, T + 1)) split into inputs (B, T), the
// first T, and next-token targets (B, T), the last T.
struct Batch {
  Tensor inputs, targets;
};
Batch split_tokens(const Tensor& tokens);
// Positions 0..T-1 as an int64 tensor.
Tensor positions(int64_t T, Device dev = Device::cpu);

// The loss of a (B, T + 1) token batch at positions 0..T-1, and every parameter's gradient
// (old gradients are cleared first): afterwards p.grad() of each named parameter holds it.
Output loss_and_grads(const Config& c, const Params& p, const Tensor& tokens);

}  // namespace ff::model
