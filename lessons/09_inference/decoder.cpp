// lessons/09_inference/decoder.cpp — prefill and decode over lesson 08's model (decoder.h).
#include "lessons/09_inference/decoder.h"

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/lesson/lesson.h"
#include "lessons/08_mesh/sharding.h"
#include "lessons/09_inference/moe_decode.h"

namespace ff::infer {

Decoder::Decoder(const model::Config& c, const model::Params& full, CacheKind kind, int64_t B, int64_t capacity,
                 Bug bug, Comm* comm, MoeComm how, const Int8Model* int8)
    : c_(c), full_(full), kind_(kind), bug_(bug), comm_(comm), how_(how), int8_(int8), len_((size_t)B, 0) {
  const int P = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  FF_CHECK(!int8 || P == 1, "decoder: int8 weights are read by one process");
  FF_CHECK(c.heads % P == 0, "decoder: " << c.heads << " heads over " << P << " ranks");
  heads_ = c.heads / P;
  // [slide:shards]
  // lesson 08's TP and EP cut, with P ranks on both axes: heads (W_uq, W_uk, W_uv by columns,
  // W_o by rows; the down-projections whole), dense FFN (W1, W3 columns, W2 rows), experts
  // [r N/P, (r+1) N/P); the head stays whole here, and under --moe-comm allreduce the shared
  // experts are split by columns too (seed 002's MLP)
  MeshSizes sizes;
  sizes.tp = P, sizes.ep = P;
  MeshCoords co;
  co.tp = r, co.ep = r;
  mine_ = P > 1 ? mesh::shard_model(c, full, co, sizes, /*kpe_per_head=*/false) : full;
  mine_.head = full.head;
  for (model::Block& b : mine_.layers)
    if (b.moe && P > 1 && how == MoeComm::allreduce) b.experts = moe_shard(b.experts, r, P);
  // [/slide]
  for (size_t i = 0; i < full.layers.size(); i++) caches_.emplace_back(c, heads_, kind, B, capacity);
}

Tensor Decoder::reduced(const Tensor& partial, bool count) {
  if (!comm_ || comm_->size() == 1) return partial;
  return allreduce_timed(*comm_, partial, count ? &reduce_comm_s_ : nullptr);
}

Tensor Decoder::ffn(size_t layer, const Tensor& u, bool count) {
  const model::Block& blk = full_.layers[layer];
  if (int8_ && count) return ffn_int8(layer, u);
  if (!blk.moe) return reduced(model::dense_ffn(mine_.layers[layer].ffn, u), count);
  dsv3::Config mc = c_.moe_config();
  mc.seq_len = u.size(0);  // no balance loss at inference: only the routing is used
  if (!comm_ || comm_->size() == 1) {  // lesson 05's layer
    Tensor route;
    Tensor y = model::moe_ffn(mc, blk.experts, u, &route);
    if (count) {
      std::vector<bool> read((size_t)c_.experts, false);
      for (int64_t e : route.to_index_vector()) read[(size_t)e] = true;
      for (bool r : read) experts_read_ += r;
    }
    return y;
  }
  double s = 0;
  Tensor y = moe_decode(*comm_, how_, mc, mine_.layers[layer].experts, u, &s);
  if (count) moe_comm_s_ += s;
  return y;
}

// [slide:ffn-int8]
// The FFN of a decode step with int8 weights: the same composition as the float32 one
// (model::dense_ffn; lesson 05's routing, then each chosen expert's rows, then the gated
// combine and the shared experts), every weight product an int8_matmul.
Tensor Decoder::ffn_int8(size_t layer, const Tensor& u) {
  const std::string l = "layers." + std::to_string(layer) + ".";
  auto w = [&](const char* name) -> const QuantTensor& { return int8_->q.at(l + name); };
  auto swiglu = [&](const Tensor& x, const QuantTensor& w1, const QuantTensor& w3, const QuantTensor& w2, int64_t e) {
    return int8_matmul(mul(silu(int8_matmul(x, w1, e)), int8_matmul(x, w3, e)), w2, e);
  };
  const model::Block& blk = full_.layers[layer];
  if (!blk.moe) return swiglu(u, w("ffn.w1"), w("ffn.w3"), w("ffn.w2"), 0);
  dsv3::Config mc = c_.moe_config();
  mc.seq_len = u.size(0);
  const Routed r = route(mc, blk.experts, u);  // the router in float32
  const std::vector<int64_t> sizes = r.plan.group_sizes.to_index_vector();
  const Tensor xp = moe::permute(u, r.plan);  // slots sorted by expert
  std::vector<Tensor> parts;
  for (int64_t e = 0, row = 0; e < c_.experts; row += sizes[(size_t)e], e++)
    if (sizes[(size_t)e] > 0) {
      parts.push_back(swiglu(slice(xp, 0, row, row + sizes[(size_t)e]), w("moe.experts_w1"), w("moe.experts_w3"),
                             w("moe.experts_w2"), e));
      experts_read_++;
    }
  Tensor y = moe::combine(concat(parts, 0), r.plan, r.gates);
  if (c_.shared > 0) y = add(y, swiglu(u, w("moe.shared_w1"), w("moe.shared_w3"), w("moe.shared_w2"), 0));
  return y;
}
// [/slide]

Tensor Decoder::logits(const Tensor& x) const {
  return matmul(rmsnorm(x, full_.norm, c_.norm_eps), full_.head);
}

// [slide:prefill]
Tensor Decoder::prefill(int64_t b, const std::vector<int64_t>& prompt) {
  NoGradGuard no_grad;
  const int64_t n = (int64_t)prompt.size();
  FF_CHECK(n >= 1 && len_[(size_t)b] == 0, "prefill: sequence " << b << " needs a prompt and an empty cache");
  const Device dev = full_.embed.device();
  const Tensor pos = model::positions(n, dev);
  Tensor x = embedding(full_.embed, Tensor::from_indices(prompt, {n}, dev));   // (n, d)
  for (size_t i = 0; i < full_.layers.size(); i++) {
    const model::Block& blk = full_.layers[i];
    const model::Attention& a = mine_.layers[i].attn;
    const model::Latents l = model::attention_latents(c_, a, rmsnorm(x, blk.attn_norm, c_.norm_eps), pos);
    Tensor first, second;  // this layer's cache rows of the whole prompt
    cache_rows(c_, a, l, kind_, &first, &second);
    caches_[i].append(b, first, second);
    x = add(x, reduced(model::attention_heads(c_, heads_, a, l, 1, pos), false));
    x = add(x, ffn(i, rmsnorm(x, blk.ffn_norm, c_.norm_eps), false));
  }
  len_[(size_t)b] = n;
  return logits(x);
}
// [/slide]

// [slide:step]
Tensor Decoder::step(const std::vector<int64_t>& tokens) {
  NoGradGuard no_grad;
  const int64_t B = (int64_t)len_.size();
  FF_CHECK((int64_t)tokens.size() == B, "step: " << tokens.size() << " tokens, " << B << " sequences");
  const Device dev = full_.embed.device();
  // [slide:step-short]
  Tensor x = embedding(full_.embed, Tensor::from_indices(tokens, {B}, dev));  // (B, d)
  for (size_t i = 0; i < full_.layers.size(); i++) {
    const model::Block& blk = full_.layers[i];
    const bool append = !(bug_ == Bug::cache_skip_layer && i + 1 == full_.layers.size());
    const Tensor u = rmsnorm(x, blk.attn_norm, c_.norm_eps);
    const Tensor o = decode_attention(c_, mine_.layers[i].attn, u, len_, caches_[i], kind_, bug_, append);
    x = add(x, reduced(o, true));
    x = add(x, ffn(i, rmsnorm(x, blk.ffn_norm, c_.norm_eps), true));
  }
  for (int64_t& n : len_) n++;
  return logits(x);
  // [/slide:step-short]
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
