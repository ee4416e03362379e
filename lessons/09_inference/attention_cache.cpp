// lessons/09_inference/attention_cache.cpp — the three caches and the decode attention of
// attention_cache.h.
#include "lessons/09_inference/attention_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/core/check.h"
#include "common/core/ops.h"

namespace ff::infer {

const char* cache_name(CacheKind k) {
  return k == CacheKind::kv ? "kv" : k == CacheKind::latent ? "latent" : "absorbed";
}

int64_t cache_floats_per_token(const model::Config& c, CacheKind k, int64_t H) {
  return k == CacheKind::kv ? H * (c.qk_head_dim() + c.d_v) : c.kv_lora + c.d_rope;
}

model::Config deepseek_v3_attention() {
  model::Config v3;
  v3.heads = 128, v3.d_nope = 128, v3.d_rope = 64, v3.d_v = 128, v3.kv_lora = 512, v3.layers = 61;
  return v3;
}

// ----------------------------------------------------------------------------
// the cache

LayerCache::LayerCache(const model::Config& c, int64_t heads, CacheKind kind, int64_t B, int64_t capacity)
    : capacity_(capacity), len_((size_t)B, 0) {
  if (kind == CacheKind::kv) wa_ = heads * c.qk_head_dim(), wb_ = heads * c.d_v;
  else wa_ = c.kv_lora, wb_ = c.d_rope;
  a_.assign((size_t)(B * capacity * wa_), 0.f);
  b_.assign((size_t)(B * capacity * wb_), 0.f);
}

void LayerCache::append(int64_t b, const Tensor& first, const Tensor& second) {
  const int64_t n = first.size(0);
  FF_CHECK(first.dim() == 2 && second.dim() == 2 && first.size(1) == wa_ && second.size(1) == wb_ &&
               second.size(0) == n,
           "cache: rows " << shape_str(first.shape()) << " and " << shape_str(second.shape()) << " for a cache of "
                          << wa_ << " and " << wb_ << " numbers per token");
  int64_t& len = len_[(size_t)b];
  FF_CHECK(len + n <= capacity_, "cache: sequence " << b << " is full (" << capacity_ << " tokens)");
  const std::vector<float> f = first.to_vector(), s = second.to_vector();
  std::copy(f.begin(), f.end(), a_.begin() + (b * capacity_ + len) * wa_);
  std::copy(s.begin(), s.end(), b_.begin() + (b * capacity_ + len) * wb_);
  len += n;
}

int64_t LayerCache::max_len() const {
  return len_.empty() ? 0 : *std::max_element(len_.begin(), len_.end());
}

int64_t LayerCache::bytes_used() const {
  int64_t tokens = 0;
  for (int64_t n : len_) tokens += n;
  return tokens * (wa_ + wb_) * (int64_t)sizeof(float);
}

Tensor LayerCache::rows(const std::vector<float>& buf, int64_t w, int64_t L, Device dev) const {
  const int64_t B = batch();
  std::vector<float> out((size_t)(B * L * w), 0.f);
  for (int64_t b = 0; b < B; b++) {
    const int64_t n = std::min(L, len_[(size_t)b]);
    std::memcpy(&out[(size_t)(b * L * w)], &buf[(size_t)(b * capacity_ * w)], (size_t)(n * w) * sizeof(float));
  }
  return Tensor::from_vector(out, {B, L, w}, dev);
}

// ----------------------------------------------------------------------------
// the rows a token adds

void cache_rows(const model::Config& c, const model::Attention& a, const model::Latents& l, CacheKind kind,
                Tensor* first, Tensor* second) {
  if (kind != CacheKind::kv) {
    *first = l.c_kv, *second = l.k_pe;
    return;
  }
  // what MHA keeps: every head's key [k_nope | k_pe] (k_pe repeated per head) and value
  const int64_t n = l.c_kv.size(0), H = a.w_o.size(0) / c.d_v;
  Tensor k_nope = reshape(matmul(l.c_kv, a.w_uk), {n, H, c.d_nope});
  Tensor k_pe = reshape(concat(std::vector<Tensor>((size_t)H, reshape(l.k_pe, {n, 1, c.d_rope})), 1),
                        {n, H, c.d_rope});
  *first = reshape(concat({k_nope, k_pe}, 2), {n, H * c.qk_head_dim()});
  *second = matmul(l.c_kv, a.w_uv);  // (n, H d_v)
}

// ----------------------------------------------------------------------------
// the decode attention

namespace {

// scores (B, H, L) of sequences whose valid keys are the first len[b]: -inf beyond.
Tensor mask_lengths(const Tensor& scores, const LayerCache& cache) {
  const int64_t B = scores.size(0), H = scores.size(1), L = scores.size(2);
  std::vector<float> m((size_t)(B * H * L), 0.f);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t j = cache.len(b); j < L; j++) m[(size_t)((b * H + h) * L + j)] = 1.f;
  return masked_fill(scores, Tensor::from_vector(m, {B, H, L}, scores.device()),
                     -std::numeric_limits<float>::infinity());
}

// (B, L, H e) -> (B H, L, e)
Tensor per_head(const Tensor& t, int64_t H) {
  const int64_t B = t.size(0), L = t.size(1), e = t.size(2) / H;
  return reshape(transpose(reshape(t, {B, L, H, e}), 1, 2), {B * H, L, e});
}

}  // namespace

Tensor decode_attention(const model::Config& c, const model::Attention& a, const Tensor& u,
                        const std::vector<int64_t>& positions, LayerCache& cache, CacheKind kind,
                        Bug bug, bool append) {
  const int64_t B = u.size(0), H = a.w_o.size(0) / c.d_v, dn = c.d_nope, dr = c.d_rope, r = c.kv_lora;
  const Device dev = u.device();
  std::vector<int64_t> pos(positions);
  if (bug == Bug::rope_off_by_one)
    for (int64_t& p : pos) p += 1;
  const Tensor row_pos = Tensor::from_indices(pos, {B}, dev);
  // the new tokens' latents, and their rows appended to the cache
  const model::Latents l = model::attention_latents(c, a, u, row_pos);
  if (append) {
    Tensor first, second;
    cache_rows(c, a, l, kind, &first, &second);
    for (int64_t b = 0; b < B; b++) cache.append(b, slice(first, 0, b, b + 1), slice(second, 0, b, b + 1));
  }
  const int64_t L = cache.max_len();
  // the queries: per head a no-RoPE and a RoPE part, as in training
  Tensor q = reshape(matmul(l.c_q, a.w_uq), {B, H, dn + dr});
  Tensor q_nope = slice(q, 2, 0, dn);                                          // (B, H, d_n)
  Tensor q_pe = rope(slice(q, 2, dn, dn + dr), row_pos, c.rope_theta);         // (B, H, d_r)
  const float inv = 1.f / std::sqrt((float)(dn + dr));

  Tensor probs, o;  // (B, H, L) and (B, H d_v)
  if (kind == CacheKind::kv) {
    // [slide:decode-kv]
    Tensor K = per_head(cache.first(L, dev), H);                               // (B H, L, d_n + d_r)
    Tensor V = per_head(cache.second(L, dev), H);                              // (B H, L, d_v)
    Tensor qh = reshape(concat({q_nope, q_pe}, 2), {B * H, dn + dr, 1});
    Tensor scores = reshape(matmul(K, qh), {B, H, L});
    probs = softmax(mask_lengths(scale(scores, inv), cache));
    o = reshape(matmul(reshape(probs, {B * H, 1, L}), V), {B, H * c.d_v});
    // [/slide]
  } else if (kind == CacheKind::latent) {
    // [slide:decode-latent]
    // [exercise:latent-attention] Decode attention from the latent cache: K's no-RoPE part and V re-expanded from c_kv (W_uk, W_uv), the scores of both parts, the masked softmax, the output. Set probs (B, H, L) and o (B, H d_v).
    Tensor c_kv = cache.first(L, dev), k_pe = cache.second(L, dev);            // (B, L, r), (B, L, d_r)
    Tensor k_nope = per_head(matmul(c_kv, a.w_uk), H);                         // (B H, L, d_n): re-expanded
    Tensor V = per_head(matmul(c_kv, a.w_uv), H);                              // (B H, L, d_v)
    Tensor s_nope = reshape(matmul(k_nope, reshape(q_nope, {B * H, dn, 1})), {B, H, L});
    Tensor s_pe = transpose(matmul(k_pe, transpose(q_pe, 1, 2)), 1, 2);        // (B, H, L)
    probs = softmax(mask_lengths(scale(add(s_nope, s_pe), inv), cache));
    o = reshape(matmul(reshape(probs, {B * H, 1, L}), V), {B, H * c.d_v});
    // [/exercise]
    // [/slide]
  } else {
    // [slide:decode-absorbed]
    // [exercise:absorbed-attention] Decode attention on the latent cache without forming K or V: W_uk folded into the query (q_lat, per head in the latent space), W_uv applied after the sum over positions. Set probs (B, H, L) and o (B, H d_v).
    Tensor c_kv = cache.first(L, dev), k_pe = cache.second(L, dev);            // (B, L, r), (B, L, d_r)
    // W_uk per head, (H, d_n, r): the query moves into the latent space, q_lat,h = W_uk,h q_nope,h
    Tensor w_uk = transpose(reshape(a.w_uk, {r, H, dn}), 0, 1);                // (H, r, d_n)
    Tensor w_uk_h = bug == Bug::absorb_transposed ? reshape(w_uk, {H, dn, r})  // the bug: a reshape
                                                  : transpose(w_uk, 1, 2);     // (H, d_n, r)
    Tensor q_lat = transpose(matmul(transpose(q_nope, 0, 1), w_uk_h), 0, 1);    // (B, H, r)
    Tensor s_nope = matmul(c_kv, transpose(q_lat, 1, 2));                      // (B, L, H)
    Tensor s_pe = matmul(k_pe, transpose(q_pe, 1, 2));                         // (B, L, H)
    probs = softmax(mask_lengths(scale(transpose(add(s_nope, s_pe), 1, 2), inv), cache));
    Tensor o_lat = matmul(probs, c_kv);                                        // (B, H, r): values, still latent
    Tensor w_uv_h = transpose(reshape(a.w_uv, {r, H, c.d_v}), 0, 1);          // (H, r, d_v)
    o = reshape(transpose(matmul(transpose(o_lat, 0, 1), w_uv_h), 0, 1), {B, H * c.d_v});
    // [/exercise]
    // [/slide]
  }
  return matmul(o, a.w_o);
}

}  // namespace ff::infer
