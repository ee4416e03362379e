// lessons/09_inference/decoder.h — lesson 08's model served: prefill a batch of prompts, then
// decode one token per sequence per step from the caches (attention_cache.h), on one process or
// over the P ranks of a communicator.
//
//   prefill   each prompt through the training forward's own pieces (model::attention_latents,
//             attention_heads, the FFNs: the same ops as model::forward), every layer's cache
//             rows kept on the way; gives the logits of every prompt position.
//   step      the batch's next tokens, one per sequence, each at its own position: per layer
//             the decode attention over the cache (the new token appended), the FFN on B rows
//             (the MoE routes each of them on its own), the head: logits (B, V).
//
// Over P ranks (seed 002's layout: activations replicated, weights split):
//   attention  heads split (tensor parallelism): rank r holds heads [r H/P, (r+1) H/P) of
//              W_uq, W_uk, W_uv (their columns) and of W_o (its rows); the down-projections
//              W_dq, W_dkv, W_kr stay whole on every rank (seed 002's "fully replicated W_A":
//              the RMSNorm of the latents needs all of them). Each rank's o W_o is a partial
//              sum, all-reduced. A kv cache holds this rank's heads only; a latent cache is
//              the same c_kv and k_pe on every rank (the latents are per token, not per head).
//   dense FFN  W1, W3 by columns, W2 by rows; one all-reduce.
//   MoE        experts split (expert parallelism), moved as moe_decode.h says.
//   embedding and head whole on every rank (they are small here).
#pragma once
#include <cstdint>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "lessons/09_inference/attention_cache.h"
#include "lessons/09_inference/int8.h"
#include "lessons/09_inference/moe_decode.h"

namespace ff::infer {

class Decoder {
 public:
  // B sequences of at most `capacity` tokens each (prompt and decoded). comm: the ranks the
  // model is split over (heads and experts); nullptr or one rank: all of it here.
  // int8 (one process): the decode steps' FFNs and experts read these int8 weights (int8.h)
  // instead of full's float32 ones, which must be their dequantized values (Int8Model::p).
  Decoder(const model::Config& c, const model::Params& full, CacheKind kind, int64_t B, int64_t capacity,
          Bug bug = Bug::none, Comm* comm = nullptr, MoeComm how = MoeComm::alltoall,
          const Int8Model* int8 = nullptr);
  // Sequence b's prompt (at least one token): its logits at every position (n, V).
  Tensor prefill(int64_t b, const std::vector<int64_t>& prompt);
  // One token per sequence (B), each appended at its sequence's next position: logits (B, V).
  Tensor step(const std::vector<int64_t>& tokens);

  // What this rank's caches hold now, every layer: bytes and tokens.
  int64_t cache_bytes() const;
  int64_t cached_tokens() const;
  int64_t heads_here() const { return heads_; }
  // Seconds of the steps (not prefill) spent in communication: the MoE's, the all-reduces'.
  double moe_comm_s() const { return moe_comm_s_; }
  double reduce_comm_s() const { return reduce_comm_s_; }
  // One process only (speed.h times one process): the routed experts the steps have read,
  // summed over steps and MoE layers (each expert counted once per step and layer, however many
  // rows chose it): what a step reads of the experts' weights.
  int64_t experts_read() const { return experts_read_; }

 private:
  Tensor ffn(size_t layer, const Tensor& u, bool count);
  Tensor ffn_int8(size_t layer, const Tensor& u);
  Tensor reduced(const Tensor& partial, bool count);  // all-reduced over the ranks (P > 1)
  Tensor logits(const Tensor& x) const;
  model::Config c_;
  const model::Params& full_;
  CacheKind kind_;
  Bug bug_;
  Comm* comm_;
  MoeComm how_;
  const Int8Model* int8_;
  int64_t heads_;                        // this rank's
  model::Params mine_;                   // this rank's shard (lesson 08's shard_model, the head whole)
  std::vector<LayerCache> caches_;       // one per layer
  std::vector<int64_t> len_;             // tokens of each sequence so far
  double moe_comm_s_ = 0, reduce_comm_s_ = 0;
  int64_t experts_read_ = 0;
};

// Index of the largest logit of each row of (n, V) logits (the first on a tie).
std::vector<int64_t> argmax_rows(const Tensor& logits);

}  // namespace ff::infer
