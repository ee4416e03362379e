// lessons/09_inference/attention_cache.h — MLA at decode time: what each layer keeps per token,
// and the attention of one new token per sequence against it. The subject of lesson 09.
//
// Training (common/layers/model.h) attends T queries to T keys at once. Decoding adds one token
// per step: its query must see the keys and values of every earlier token, so each layer keeps
// them in a cache and appends the new token's. Three caches, one answer:
//
//   kv        per token, per head: K = [k_nope | k_pe] (H (d_n + d_r)) and V (H d_v), what
//             multi-head attention keeps (DeepSeek-V3's inference/model.py, attn_impl "naive").
//   latent    per token: MLA's c_kv (r_kv) and the shared k_pe (d_r) only; every step
//             re-expands K_nope = c_kv W_uk and V = c_kv W_uv for all cached tokens.
//   absorbed  the latent cache, with W_uk folded into the query and W_uv into the output
//             (DeepSeek-V3's attn_impl "absorb"): per head h,
//                 q_nope,h . (W_uk,h^T c_kv)  =  (W_uk,h q_nope,h) . c_kv      scores on c_kv
//                 sum_j p_j (c_kv,j W_uv,h)   =  (sum_j p_j c_kv,j) W_uv,h     values after
//             so no per-head K or V is ever formed: the step reads r_kv + d_r numbers per token.
//
// Batched: B sequences of different lengths decode together. Each has its own position (its
// length so far) and its cache rows; the step pads them to the longest and masks the rest.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/model.h"

namespace ff::infer {

enum class CacheKind { kv, latent, absorbed };
const char* cache_name(CacheKind k);

// Planted bugs (--bug): each must make the check fail (or, int8's, measurably worse).
enum class Bug {
  none,
  rope_off_by_one,      // decode rotates q_pe and k_pe by position + 1
  absorb_transposed,    // absorbed: W_uk,h^T (d_n, r_kv) taken by a reshape of W_uk,h, not a transpose
  cache_skip_layer,     // the last layer never appends the decoded token to its cache
};

// Numbers kept per token per layer for H heads: kv H (d_n + d_r + d_v), latent and absorbed
// r_kv + d_r (whatever H).
int64_t cache_floats_per_token(const model::Config& c, CacheKind k, int64_t H);

// DeepSeek-V3's attention sizes (its config_671B.json): 128 heads, d_n 128, d_r 64, d_v 128,
// r_kv 512, 61 layers; the rest of the Config is left at its defaults.
model::Config deepseek_v3_attention();

// One layer's cache for a batch of B sequences: row j of sequence b is token j's, up to len[b];
// room for `capacity` tokens each, allocated once (what decoding at a given length costs).
// `heads`: the heads this rank computes (all of them, or a tensor-parallel rank's share: a kv
// cache splits with the heads, a latent cache is the same on every rank).
class LayerCache {
 public:
  LayerCache() = default;
  LayerCache(const model::Config& c, int64_t heads, CacheKind kind, int64_t B, int64_t capacity);
  // Appends n tokens' rows to sequence b: first and second (n, width) each, kv K
  // (H (d_n + d_r)) and V (H d_v), latent and absorbed c_kv (r_kv) and k_pe (d_r) (cache_rows
  // gives them); a width that is not the cache's is an ff::Error.
  void append(int64_t b, const Tensor& first, const Tensor& second);
  int64_t len(int64_t b) const { return len_[(size_t)b]; }
  int64_t batch() const { return (int64_t)len_.size(); }
  int64_t max_len() const;
  // The first `L` rows of every sequence as (B, L, width) tensors (rows past a sequence's
  // length are zero): kv K and V, else c_kv and k_pe.
  Tensor first(int64_t L, Device dev) const { return rows(a_, wa_, L, dev); }
  Tensor second(int64_t L, Device dev) const { return rows(b_, wb_, L, dev); }
  // Bytes held for the tokens cached so far (not the free capacity).
  int64_t bytes_used() const;

 private:
  Tensor rows(const std::vector<float>& buf, int64_t w, int64_t L, Device dev) const;
  int64_t wa_ = 0, wb_ = 0, capacity_ = 0;
  std::vector<float> a_, b_;  // (B, capacity, w) each
  std::vector<int64_t> len_;
};

// The attention of one new token per sequence, MLA's: u (B, d) the normed hidden states of
// the new tokens, positions (B) theirs (each sequence's length before this step). Appends the
// new tokens to `cache` (all three kinds from the same latents), then attends each query to
// its sequence's cached tokens, the new one included. Returns (B, d): o W_o. The heads are
// those of a's up-projections (w_o has H d_v rows): all of them, or a TP rank's, whose result
// is then its partial sum of o W_o (model::attention_heads' convention).
Tensor decode_attention(const model::Config& c, const model::Attention& a, const Tensor& u,
                        const std::vector<int64_t>& positions, LayerCache& cache, CacheKind kind,
                        Bug bug, bool append = true);

// The cache rows of n tokens from their latents (prefill fills the cache with these; decode
// appends one per step): kv the per-head K and V (of a's heads), latent and absorbed c_kv and
// k_pe as they are. l from model::attention_latents.
void cache_rows(const model::Config& c, const model::Attention& a, const model::Latents& l, CacheKind kind,
                Tensor* first, Tensor* second);

}  // namespace ff::infer
