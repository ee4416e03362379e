// lessons/09_inference/int8.cpp — per-channel symmetric int8 weights (int8.h).
#include "lessons/09_inference/int8.h"

#include <algorithm>
#include <cmath>

#include "common/core/check.h"

namespace ff::infer {

QuantTensor quantize(const Tensor& w, bool per_channel) {
  FF_CHECK(w.dim() == 2 || w.dim() == 3, "quantize: a (K, N) or (E, K, N) weight, not " << shape_str(w.shape()));
  QuantTensor t;
  t.shape = w.shape();
  const int64_t N = w.size(-1), K = w.size(-2), E = w.dim() == 3 ? w.size(0) : 1;
  const std::vector<float> v = w.to_vector();
  // [slide:quantize]
  // [slide:quantize-scale]
  // the scales: the largest magnitude of each (expert's) column, or of the whole tensor
  t.scale.assign((size_t)(per_channel ? E * N : 1), 0.f);
  for (int64_t e = 0; e < E; e++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t n = 0; n < N; n++) {
        float& s = t.scale[per_channel ? (size_t)(e * N + n) : 0];
        s = std::max(s, std::fabs(v[(size_t)((e * K + k) * N + n)]));
      }
  for (float& s : t.scale) s = s > 0.f ? s / 127.f : 1.f;  // a column of zeros: any scale
  // [/slide:quantize-scale]
  // [slide:quantize-round]
  t.q.resize(v.size());
  for (int64_t e = 0; e < E; e++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t n = 0; n < N; n++) {
        const size_t i = (size_t)((e * K + k) * N + n);
        const float s = t.scale[per_channel ? (size_t)(e * N + n) : 0];
        t.q[i] = (int8_t)std::clamp(std::lround(v[i] / s), -127L, 127L);
      }
  // [/slide:quantize-round]
  // [/slide]
  return t;
}

Tensor dequantize(const QuantTensor& t) {
  const int64_t N = t.shape.back(), K = t.shape[t.shape.size() - 2];
  const bool per_channel = t.scale.size() > 1;
  std::vector<float> v(t.q.size());
  for (size_t i = 0; i < v.size(); i++) {
    const int64_t e = (int64_t)i / (K * N), n = (int64_t)i % N;
    v[i] = (float)t.q[i] * t.scale[per_channel ? (size_t)(e * N + n) : 0];
  }
  return Tensor::from_vector(v, t.shape);
}

namespace {

// Rows [0, m) of y, columns [n0, n0 + width): acc in L1 while every row of q streams past once.
// Compiled for AVX-512, AVX2 + FMA and baseline x86-64, the best picked at start (as the cpu
// matmul's tile is); one thread.
constexpr int64_t kRows = 4, kCols = 256;
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void int8_block(float* y, const float* x, const int8_t* q, const float* s, int64_t m, int64_t K,
                              int64_t N, int64_t n0, int64_t width) {
  float acc[kRows][kCols] = {};
  for (int64_t k = 0; k < K; k++) {
    const int8_t* q_row = q + k * N + n0;
    for (int64_t i = 0; i < m; i++) {
      const float x_ik = x[i * K + k];
      for (int64_t n = 0; n < width; n++) acc[i][n] += x_ik * (float)q_row[n];
    }
  }
  for (int64_t i = 0; i < m; i++)
    for (int64_t n = 0; n < width; n++) y[i * N + n0 + n] = acc[i][n] * s[n0 + n];
}

}  // namespace

Tensor int8_matmul(const Tensor& x, const QuantTensor& w, int64_t e) {
  const int64_t N = w.shape.back(), K = w.shape[w.shape.size() - 2], M = x.size(0);
  FF_CHECK(x.dim() == 2 && x.size(1) == K && x.device() == Device::cpu,
           "int8_matmul: x " << shape_str(x.shape()) << " (on cpu) against a weight of " << shape_str(w.shape));
  const std::vector<float> xv = x.to_vector();
  std::vector<float> y((size_t)(M * N));
  const int8_t* q = w.q.data() + e * K * N;
  const std::vector<float> one_scale(w.scale.size() == 1 ? (size_t)N : 0, w.scale[0]);  // per tensor
  const float* s = w.scale.size() == 1 ? one_scale.data() : w.scale.data() + e * N;
  for (int64_t i0 = 0; i0 < M; i0 += kRows)
    for (int64_t n0 = 0; n0 < N; n0 += kCols)
      int8_block(y.data() + i0 * N, xv.data() + i0 * K, q, s, std::min(kRows, M - i0), K, N, n0,
                 std::min(kCols, N - n0));
  return Tensor::from_vector(y, {M, N});
}

Int8Model int8_model(const model::Config& c, const model::Params& full, bool per_channel) {
  Int8Model m;
  m.p = model::zero_params(c, full.embed.device());  // the structure; every tensor is filled below
  const std::vector<model::NamedTensor> from = full.named_parameters(), to = m.p.named_parameters();
  double err2 = 0, norm2 = 0;
  for (size_t i = 0; i < from.size(); i++) {
    const std::string& name = from[i].name;
    const Tensor& w = from[i].t;
    const bool quantized = w.dim() >= 2 && name != "embed" && name != "head" &&
                           name.find("router_w") == std::string::npos;
    Tensor target = to[i].t;
    if (quantized) {
      QuantTensor& q = m.q[name] = quantize(w, per_channel);
      const Tensor back = dequantize(q);
      const std::vector<float> a = w.to_vector(), b = back.to_vector();
      for (size_t k = 0; k < a.size(); k++)
        err2 += ((double)a[k] - b[k]) * ((double)a[k] - b[k]), norm2 += (double)a[k] * a[k];
      target.detach().copy_from(back.to(w.device()));
      m.int8_bytes += (int64_t)(q.q.size() * sizeof(int8_t) + q.scale.size() * sizeof(float));
      m.fp32_bytes += w.numel() * (int64_t)sizeof(float);
    } else {
      target.detach().copy_from(w);
      m.kept_bytes += w.numel() * (int64_t)sizeof(float);
    }
  }
  m.rel_error = norm2 > 0 ? std::sqrt(err2 / norm2) : 0;
  const std::vector<model::NamedTensor> bf = full.named_buffers(), bt = m.p.named_buffers();
  for (size_t i = 0; i < bf.size(); i++) {
    Tensor target = bt[i].t;
    target.copy_from(bf[i].t);
  }
  return m;
}

}  // namespace ff::infer
