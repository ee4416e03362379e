// Lesson 09's pieces on their own (lessons/09_inference): the decode attention of each cache
// against the training attention (model::attention) token by token, and int8 quantization
// against its definition. Each check has a planted counterpart that must fail it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "lessons/09_inference/attention_cache.h"
#include "lessons/09_inference/int8.h"

using namespace ff;
using namespace ff::infer;

namespace {

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  REQUIRE(x.size() == y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); i++) m = std::max(m, (double)std::fabs(x[i] - y[i]));
  return m;
}

// Two sequences decoded together, of different lengths: sequence 0's first T - T2 tokens are
// prefilled (their cache rows appended, as lesson 09's prefill does), then both decode T2 steps,
// sequence 0 at positions T - T2.., sequence 1 from 0 (the shorter rows masked). Every step's
// output row against the training attention of the same sequence. Returns the largest difference.
double decode_vs_training(CacheKind kind, Bug bug) {
  model::Config c;
  c.dim = 32, c.heads = 4, c.d_nope = 8, c.d_rope = 4, c.d_v = 8, c.q_lora = 16, c.kv_lora = 16;
  c.layers = 1, c.dense_layers = 1;
  const model::Params p = model::init_params(c, 7);
  const model::Attention& a = p.layers[0].attn;
  const int64_t T = 9, T2 = 5, pre = T - T2;
  const Tensor u1 = randn({T, c.dim}, 11), u2 = randn({T2, c.dim}, 12);
  NoGradGuard no_grad;
  const Tensor want1 = model::attention(c, a, u1, 1, model::positions(T)),
               want2 = model::attention(c, a, u2, 1, model::positions(T2));
  LayerCache cache(c, c.heads, kind, 2, T);
  {  // prefill sequence 0's first tokens
    const model::Latents l = model::attention_latents(c, a, slice(u1, 0, 0, pre), model::positions(pre));
    Tensor first, second;
    cache_rows(c, a, l, kind, &first, &second);
    cache.append(0, first, second);
  }
  double worst = 0;
  for (int64_t k = 0; k < T2; k++) {
    const Tensor rows = concat({slice(u1, 0, pre + k, pre + k + 1), slice(u2, 0, k, k + 1)}, 0);
    const Tensor got = decode_attention(c, a, rows, {pre + k, k}, cache, kind, bug);
    worst = std::max(worst, max_abs_diff(slice(got, 0, 0, 1), slice(want1, 0, pre + k, pre + k + 1)));
    worst = std::max(worst, max_abs_diff(slice(got, 0, 1, 2), slice(want2, 0, k, k + 1)));
  }
  return worst;
}

}  // namespace

TEST_CASE("infer: each cache's decode attention equals the training attention, token by token") {
  for (CacheKind kind : {CacheKind::kv, CacheKind::latent, CacheKind::absorbed}) {
    CAPTURE(cache_name(kind));
    // sums of at most r_kv + d_n + d_r = 28 terms or 9 cached tokens reassociated: a few eps of
    // outputs of size ~1 (the bound of lesson 09's check, for one layer)
    CHECK(decode_vs_training(kind, Bug::none) <= 28 * FLT_EPSILON * 4);
  }
}

TEST_CASE("infer: a cache refuses rows of another width") {
  model::Config c;
  LayerCache cache(c, c.heads, CacheKind::latent, 1, 4);
  CHECK_NOTHROW(cache.append(0, Tensor::zeros({2, c.kv_lora}), Tensor::zeros({2, c.d_rope})));
  CHECK_THROWS_AS(cache.append(0, Tensor::zeros({1, c.kv_lora + 1}), Tensor::zeros({1, c.d_rope})), Error);
  CHECK_THROWS_AS(cache.append(0, Tensor::zeros({3, c.kv_lora}), Tensor::zeros({3, c.d_rope})), Error);  // full
}

TEST_CASE("infer: the planted bugs make the decode attention differ from training") {
  CHECK(decode_vs_training(CacheKind::latent, Bug::rope_off_by_one) > 1e-2);
  CHECK(decode_vs_training(CacheKind::absorbed, Bug::absorb_transposed) > 1e-2);
  CHECK(decode_vs_training(CacheKind::kv, Bug::absorb_transposed) <= 28 * FLT_EPSILON * 4);  // absorbed only
}

TEST_CASE("infer: int8 per-channel quantization keeps every weight within half a step of its column") {
  // columns of very different sizes: what per-channel scales are for
  std::vector<float> w((size_t)(6 * 4));
  for (int k = 0; k < 6; k++)
    for (int n = 0; n < 4; n++) w[(size_t)(k * 4 + n)] = std::sin(1.0f + (float)(k * 4 + n)) * std::pow(10.f, (float)-n);
  const Tensor W = Tensor::from_vector(w, {6, 4});
  const QuantTensor q = quantize(W, /*per_channel=*/true);
  REQUIRE(q.scale.size() == 4);
  const std::vector<float> back = dequantize(q).to_vector();
  for (int n = 0; n < 4; n++) {
    float colmax = 0;
    for (int k = 0; k < 6; k++) colmax = std::max(colmax, std::fabs(w[(size_t)(k * 4 + n)]));
    CHECK(q.scale[(size_t)n] == doctest::Approx(colmax / 127.f));
    bool hits_127 = false;
    for (int k = 0; k < 6; k++) {
      const size_t i = (size_t)(k * 4 + n);
      CHECK(std::abs((int)q.q[i]) <= 127);
      hits_127 = hits_127 || std::abs((int)q.q[i]) == 127;
      CHECK(std::fabs(back[i] - w[i]) <= 0.5f * q.scale[(size_t)n] * (1 + 1e-5f));
    }
    CHECK(hits_127);  // the column's largest weight uses the whole range
  }
  // per tensor (the planted bug): one scale, and the small columns lose most of their levels
  const QuantTensor t = quantize(W, /*per_channel=*/false);
  REQUIRE(t.scale.size() == 1);
  const std::vector<float> coarse = dequantize(t).to_vector();
  // the smallest column (1e-3 of the largest): its relative error, per channel and per tensor
  double err_channel = 0, err_tensor = 0, norm = 0;
  for (int k = 0; k < 6; k++) {
    const size_t i = (size_t)(k * 4 + 3);
    err_channel += std::pow(back[i] - w[i], 2), err_tensor += std::pow(coarse[i] - w[i], 2), norm += std::pow(w[i], 2);
  }
  CHECK(std::sqrt(err_channel / norm) < 0.01);
  CHECK(std::sqrt(err_tensor / norm) > 0.5);  // rounded to nothing, or nearly
}

TEST_CASE("infer: int8_matmul reads the int8 numbers and equals the product with the dequantized weights") {
  // (x q) s against x (q s): the same products, the scale applied once after the sum instead of
  // to every term: within K eps sum |x||q s| (+ eps |y|) of each other, for 1 to 9 rows (chunks
  // of 4), a (K, N) weight and expert 2 of an (E, K, N) stack, N past one 256-column block.
  const int64_t K = 70, N = 300;
  for (const Shape& shape : {Shape{K, N}, Shape{3, K, N}}) {
    const Tensor W = scale(randn(shape, 31), 0.1f);
    const QuantTensor q = quantize(W, true);
    const int64_t e = shape.size() == 3 ? 2 : 0;
    const Tensor We = shape.size() == 3 ? reshape(slice(dequantize(q), 0, e, e + 1), {K, N}) : dequantize(q);
    for (int64_t M : {1, 3, 4, 9}) {
      CAPTURE(M);
      const Tensor x = randn({M, K}, 32 + (uint64_t)M);
      auto abs_of = [](const Tensor& t) {
        std::vector<float> v = t.to_vector();
        for (float& f : v) f = std::fabs(f);
        return Tensor::from_vector(v, t.shape());
      };
      const std::vector<float> got = int8_matmul(x, q, e).to_vector(), want = matmul(x, We).to_vector(),
                               bound = matmul(abs_of(x), abs_of(We)).to_vector();
      for (size_t i = 0; i < got.size(); i++)
        CHECK(std::fabs(got[i] - want[i]) <= (K + 2) * FLT_EPSILON * bound[i]);
      if (shape.size() == 3) {  // the check can fail: another expert's numbers are far off
        const std::vector<float> other = int8_matmul(x, q, 1).to_vector();
        double worst = 0;
        for (size_t i = 0; i < got.size(); i++) worst = std::max(worst, (double)std::fabs(other[i] - want[i]));
        CHECK(worst > 1e-2);
      }
    }
  }
}

TEST_CASE("infer: expert stacks get a scale per expert and column; int8_model keeps the embedding, head, norms and router") {
  model::Config c;
  c.dim = 16, c.layers = 2, c.dense_layers = 1, c.heads = 2, c.d_nope = 4, c.d_rope = 4, c.d_v = 4;
  c.q_lora = 8, c.kv_lora = 8, c.ffn = 16, c.experts = 4, c.moe_ffn = 8;
  const model::Params p = model::init_params(c, 3);
  const QuantTensor e = quantize(p.layers[1].experts.w1, true);
  CHECK(e.scale.size() == (size_t)(c.experts * c.moe_ffn));
  const Int8Model m = int8_model(c, p, true);
  const auto from = p.named_parameters(), to = m.p.named_parameters();
  for (size_t i = 0; i < from.size(); i++) {
    CAPTURE(from[i].name);
    const bool kept = from[i].name == "embed" || from[i].name == "head" || from[i].t.dim() == 1 ||
                      from[i].name.find("router_w") != std::string::npos;
    const double d = max_abs_diff(from[i].t, to[i].t);
    if (kept) CHECK(d == 0);
    else CHECK(d > 0);
  }
  CHECK(m.int8_bytes > m.fp32_bytes / 4);  // a byte per weight, plus the scales
  CHECK(m.int8_bytes < m.fp32_bytes / 2);
  CHECK(m.rel_error > 0);
  CHECK(m.rel_error < 0.01);
}
