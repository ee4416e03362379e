// lessons/09_inference/decoder.cpp — prefill and decode over lesson 08's model (decoder.h).
#include "lessons/09_inference/decoder.h"

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"

namespace ff::infer {

Decoder::Decoder(const model::Config& c, const model::Params& p, CacheKind kind, int64_t B, int64_t capacity,
                 Bug bug)
    : c_(c), p_(p), kind_(kind), bug_(bug), len_((size_t)B, 0) {
  for (int64_t i = 0; i < c.layers; i++) caches_.emplace_back(c, kind, B, capacity);
}

Tensor Decoder::ffn(const model::Block& blk, const Tensor& u) const {
  if (!blk.moe) return model::dense_ffn(blk.ffn, u);
  dsv3::Config mc = c_.moe_config();
  mc.seq_len = u.size(0);  // no balance loss at inference: only the routing is used
  return model::moe_ffn(mc, blk.experts, u);
}

Tensor Decoder::logits(const Tensor& x) const {
  return matmul(rmsnorm(x, p_.norm, c_.norm_eps), p_.head);
}

// [slide:prefill]
Tensor Decoder::prefill(int64_t b, const std::vector<int64_t>& prompt) {
  NoGradGuard no_grad;
  const int64_t n = (int64_t)prompt.size();
  FF_CHECK(n >= 1 && len_[(size_t)b] == 0, "prefill: sequence " << b << " needs a prompt and an empty cache");
  const Device dev = p_.embed.device();
  const Tensor pos = model::positions(n, dev);
  Tensor x = embedding(p_.embed, Tensor::from_indices(prompt, {n}, dev));      // (n, d)
  for (size_t i = 0; i < p_.layers.size(); i++) {
    const model::Block& blk = p_.layers[i];
    const model::Latents l = model::attention_latents(c_, blk.attn, rmsnorm(x, blk.attn_norm, c_.norm_eps), pos);
    Tensor first, second;  // this layer's cache rows of the whole prompt
    cache_rows(c_, blk.attn, l, kind_, &first, &second);
    const std::vector<float> f = first.to_vector(), s = second.to_vector();
    for (int64_t t = 0; t < n; t++)
      caches_[i].append(b, &f[(size_t)(t * first.size(1))], &s[(size_t)(t * second.size(1))]);
    x = add(x, model::attention_heads(c_, c_.heads, blk.attn, l, 1, pos));
    x = add(x, ffn(blk, rmsnorm(x, blk.ffn_norm, c_.norm_eps)));
  }
  len_[(size_t)b] = n;
  return logits(x);
}
// [/slide]

// [slide:step]
Tensor Decoder::step(const std::vector<int64_t>& tokens) {
  NoGradGuard no_grad;
  const int64_t B = (int64_t)len_.size();
  FF_CHECK((int64_t)tokens.size() == B, "step: " << tokens.size() << " tokens for " << B << " sequences");
  const Device dev = p_.embed.device();
  Tensor x = embedding(p_.embed, Tensor::from_indices(tokens, {B}, dev));       // (B, d)
  for (size_t i = 0; i < p_.layers.size(); i++) {
    const model::Block& blk = p_.layers[i];
    const bool append = !(bug_ == Bug::cache_skip_layer && i + 1 == p_.layers.size());
    x = add(x, decode_attention(c_, blk.attn, rmsnorm(x, blk.attn_norm, c_.norm_eps), len_, caches_[i], kind_,
                                bug_, append));
    x = add(x, ffn(blk, rmsnorm(x, blk.ffn_norm, c_.norm_eps)));
  }
  for (int64_t& n : len_) n++;
  return logits(x);
}
// [/slide]

int64_t Decoder::cache_bytes() const {
  int64_t bytes = 0;
  for (const LayerCache& lc : caches_) bytes += lc.bytes_used();
  return bytes;
}

int64_t Decoder::cached_tokens() const {
  int64_t n = 0;
  for (int64_t l : len_) n += l;
  return n;
}

std::vector<int64_t> argmax_rows(const Tensor& logits) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const std::vector<float> z = logits.to_vector();
  std::vector<int64_t> out((size_t)n, 0);
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 1; j < V; j++)
      if (z[(size_t)(i * V + j)] > z[(size_t)(i * V + out[(size_t)i])]) out[(size_t)i] = j;
  return out;
}

}  // namespace ff::infer
