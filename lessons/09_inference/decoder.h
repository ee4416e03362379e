// lessons/09_inference/decoder.h — lesson 08's model served: prefill a batch of prompts, then
// decode one token per sequence per step from the caches (attention_cache.h).
//
//   prefill   each prompt through the training forward's own pieces (model::attention_latents,
//             attention_heads, the FFNs: the same ops as model::forward), every layer's cache
//             rows kept on the way; gives the logits of every prompt position.
//   step      the batch's next tokens, one per sequence, each at its own position: per layer
//             the decode attention over the cache (the new token appended), the FFN on B rows
//             (the MoE routes each of them on its own), the head: logits (B, V).
#pragma once
#include <cstdint>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "lessons/09_inference/attention_cache.h"

namespace ff::infer {

class Decoder {
 public:
  // B sequences of at most `capacity` tokens each (prompt and decoded).
  Decoder(const model::Config& c, const model::Params& p, CacheKind kind, int64_t B, int64_t capacity,
          Bug bug = Bug::none);
  // Sequence b's prompt (at least one token): its logits at every position (n, V).
  Tensor prefill(int64_t b, const std::vector<int64_t>& prompt);
  // One token per sequence (B), each appended at its sequence's next position: logits (B, V).
  Tensor step(const std::vector<int64_t>& tokens);

  int64_t len(int64_t b) const { return len_[(size_t)b]; }
  // What the caches hold now, every layer: bytes and tokens.
  int64_t cache_bytes() const;
  int64_t cached_tokens() const;
  CacheKind kind() const { return kind_; }

 private:
  Tensor ffn(const model::Block& blk, const Tensor& u) const;
  Tensor logits(const Tensor& x) const;
  model::Config c_;
  const model::Params& p_;
  CacheKind kind_;
  Bug bug_;
  std::vector<LayerCache> caches_;  // one per layer
  std::vector<int64_t> len_;        // tokens of each sequence so far
};

// Index of the largest logit of each row of (n, V) logits (the first on a tie).
std::vector<int64_t> argmax_rows(const Tensor& logits);

}  // namespace ff::infer
