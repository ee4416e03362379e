// lessons/09_inference/speed.cpp — decode speed and bandwidth (speed.h).
#include "lessons/09_inference/speed.h"

#include <algorithm>
#include <thread>
#include <cstdio>
#include <string>

#include "lessons/09_inference/decoder.h"

namespace ff::infer {

double read_bandwidth(int threads) {
  const size_t n = (size_t)64 << 20;  // 64 Mi floats: 256 MiB, far beyond any cache
  std::vector<float> a(n, 1.f);
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    std::vector<float> totals((size_t)threads, 0.f);
    auto sum = [&](int t) {  // thread t sums its share
      float acc[16] = {};    // independent sums, so the loop is bound by the reads, not the adds
      const size_t begin = n / 16 * (size_t)t / (size_t)threads * 16, end = n / 16 * (size_t)(t + 1) / (size_t)threads * 16;
      for (size_t i = begin; i < end; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += a[i + (size_t)k];
      for (float x : acc) totals[(size_t)t] += x;
    };
    const Stopwatch watch;
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; t++) pool.emplace_back(sum, t);
    sum(0);
    for (std::thread& th : pool) th.join();
    const double s = watch.seconds();
    float total = 0;
    for (float x : totals) total += x;
    if (total != (float)n) throw Error("read_bandwidth: the sum is wrong");  // keeps the loops alive
    best = std::max(best, (double)(n * sizeof(float)) / s);
  }
  return best;
}

namespace {

// Bytes of the weights every step reads whole (everything but the embedding and the routed
// experts), and of one routed expert: as they are held (float32 4 bytes, bf16 2); with int8, the
// FFNs' and experts' as int8 numbers and their scales (what int8_matmul reads).
void weight_bytes(const model::Params& p, const Int8Model* int8, double* always, double* per_expert) {
  *always = 0, *per_expert = 0;
  std::string first_moe;
  for (const model::NamedTensor& n : p.named_parameters()) {
    double bytes = (double)n.t.nbytes();
    const bool ffn = n.name.find(".ffn.") != std::string::npos || n.name.find(".moe.experts_") != std::string::npos ||
                     n.name.find(".moe.shared_") != std::string::npos;
    if (int8 && ffn) {
      const QuantTensor& q = int8->q.at(n.name);
      bytes = (double)q.q.size() + 4.0 * (double)q.scale.size();
    }
    if (n.name == "embed") continue;
    if (n.name.find("moe.experts_") != std::string::npos) {  // one expert's w1, w3, w2 (every MoE layer alike)
      const std::string layer = n.name.substr(0, n.name.find(".moe."));
      if (first_moe.empty()) first_moe = layer;
      if (layer == first_moe) *per_expert += bytes / (double)n.t.size(0);
      continue;
    }
    *always += bytes;
  }
}

}  // namespace

std::vector<SpeedRow> decode_speed(const model::Config& c, const model::Params& p, const Setup& s, CacheKind kind,
                                   const std::vector<int64_t>& batches, int64_t steps, const Int8Model* int8) {
  double always = 0, per_expert = 0;
  weight_bytes(p, int8, &always, &per_expert);
  std::vector<SpeedRow> rows;
  for (int64_t B : batches) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = std::max<int64_t>(longest, (int64_t)s.prompts[(size_t)b % s.prompts.size()].size());
    Decoder dec(c, p, kind, B, longest + steps + 1, Bug::none, nullptr, MoeComm::alltoall, int8);
    std::vector<int64_t> next((size_t)B);
    for (int64_t b = 0; b < B; b++) {
      const Tensor z = dec.prefill(b, s.prompts[(size_t)b % s.prompts.size()]);
      next[(size_t)b] = argmax_rows(slice(z, 0, z.size(0) - 1, z.size(0)))[0];
    }
    const double cache_before = (double)dec.cache_bytes();
    const Stopwatch watch;
    for (int64_t k = 0; k < steps; k++) next = argmax_rows(dec.step(next));
    const double seconds = watch.seconds();
    SpeedRow r;
    r.batch = B, r.steps = steps;
    r.step_ms = seconds * 1e3 / (double)steps;
    r.tokens_per_s = (double)(B * steps) / seconds;
    r.weight_bytes = always + per_expert * (double)dec.experts_read() / (double)steps + 4.0 * (double)(B * c.dim);
    r.cache_bytes = (cache_before + (double)dec.cache_bytes()) / 2;  // grows linearly over the steps
    r.gb_per_s = (r.weight_bytes + r.cache_bytes) / seconds * (double)steps / 1e9;
    rows.push_back(r);
  }
  return rows;
}

const char* const kCsvHeader =
    "kind,cache,ranks,moe_comm,batch,floats,bytes_measured,floats_v3,steps,seconds,moe_comm_s,reduce_comm_s,"
    "tokens_per_s,weight_bytes,cache_bytes,gb_per_s,bandwidth,int8";

void print_speed(Lesson& L, const std::vector<SpeedRow>& rows, CacheKind kind, double bandwidth, int threads,
                 bool int8, bool bf16) {
  L.print("decode speed (one process, %s cache; it reads memory at %.1f GB/s with %d threads, measured)%s:\n",
          cache_name(kind), bandwidth / 1e9, threads,
          int8 ? "; the FFNs and experts read int8, the attention float32"
               : bf16 ? "; every matmul reads its bf16 weights, 2 bytes each" : "");
  L.print("  %5s %9s %10s %14s %13s %9s %6s\n", "batch", "ms/step", "tokens/s", "weights/step", "cache/step",
          "GB/s", "util");
  std::string csv;
  for (const SpeedRow& r : rows) {
    L.print("  %5lld %9.3f %10.0f %11.2f MB %10.3f MB %9.2f %5.1f%%\n", (long long)r.batch, r.step_ms, r.tokens_per_s,
            r.weight_bytes / 1e6, r.cache_bytes / 1e6, r.gb_per_s, 100 * r.gb_per_s * 1e9 / bandwidth);
    char line[400];
    std::snprintf(line, sizeof line, "speed,%s,1,,%lld,,,,%lld,%.6g,,,%.6g,%.6g,%.6g,%.6g,%.6g,%d\n", cache_name(kind),
                  (long long)r.batch, (long long)r.steps, r.step_ms * 1e-3 * (double)r.steps, r.tokens_per_s,
                  r.weight_bytes, r.cache_bytes, r.gb_per_s * 1e9, bandwidth, (int)int8);
    csv += line;
  }
  L.csv_append(kCsvHeader, csv);
}

}  // namespace ff::infer
