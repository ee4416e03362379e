// Lesson 09 — inference: lesson 08's model served from a cache, one token per step.
//
// What: prefill a batch of prompts through the training forward, then decode greedily, one
//   token per sequence per step, each layer attending to what it cached of the earlier tokens.
//   Three caches give one answer (attention_cache.h): per-head K and V (kv), MLA's latents
//   c_kv and k_pe (latent: K and V re-expanded every step), and the latents with W_uk folded
//   into the query and W_uv into the output (absorbed: no per-head K or V at all).
// Why: decoding a token costs one pass over the weights and the cache; the cache is what grows
//   with the context and the batch. MLA keeps r_kv + d_r numbers per token and layer where
//   multi-head attention keeps H (d_n + d_r + d_v): 576 against 40,960 for DeepSeek-V3.
// Run:  make run L=09
//       make run L=09 ARGS="--cache absorbed --batch 8 --new 64"
//       make run L=08 NP=1 ARGS="--train 600 --save /tmp/ck" && make run L=09 ARGS="--checkpoint /tmp/ck"
// Expect: the cache bytes per token of each kind (this model's, measured, and DeepSeek-V3's),
//   decode speed, the generated text, and for every cache the logits of every position against
//   the full-sequence training forward, the greedy tokens against its argmax, "check: PASS".
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/lesson/lesson.h"
#include "kernels/cpu/cpu_kernels.h"
#include "lessons/08_mesh/checkpoint_io.h"
#include "lessons/09_inference/attention_cache.h"
#include "lessons/09_inference/decoder.h"
#include "lessons/09_inference/int8.h"
#include "lessons/09_inference/options.h"
#include "lessons/09_inference/speed.h"

using namespace ff;
using namespace ff::infer;

namespace {

// One cache's run: every sequence's tokens (prompt, then generated) and the logits of every
// position but the last (prefill's, then one row per decode step), and the decode's time.
struct Run {
  CacheKind kind;
  std::vector<std::vector<int64_t>> tokens;
  std::vector<std::vector<float>> logits;  // per sequence, (len - 1) x V
  double decode_s = 0, moe_comm_s = 0, reduce_comm_s = 0;
  int64_t steps = 0, cache_bytes = 0, cached_tokens = 0, heads_here = 0;
};

Run generate(Comm& comm, const model::Config& c, const model::Params& p, const Setup& s, CacheKind kind,
             int64_t new_tokens, const Int8Model* int8 = nullptr) {
  const int64_t B = (int64_t)s.prompts.size(), V = c.vocab;
  Run run;
  run.kind = kind, run.tokens = s.prompts, run.logits.resize((size_t)B);
  Decoder dec(c, p, kind, B, s.capacity, s.bug, &comm, s.moe_comm, int8);
  std::vector<int64_t> next((size_t)B);
  for (int64_t b = 0; b < B; b++) {  // prefill: every prompt position's logits, the first new token
    const Tensor z = dec.prefill(b, s.prompts[(size_t)b]);
    run.logits[(size_t)b] = z.to_vector();
    next[(size_t)b] = argmax_rows(slice(z, 0, z.size(0) - 1, z.size(0)))[0];
  }
  comm.barrier();
  const Stopwatch watch;
  // [slide:generate]
  for (int64_t k = 1; k < new_tokens; k++) {  // decode: feed the last new token, get the next
    for (int64_t b = 0; b < B; b++) run.tokens[(size_t)b].push_back(next[(size_t)b]);
    const Tensor z = dec.step(next);                                         // (B, V)
    const std::vector<float> zv = z.to_vector();
    next = argmax_rows(z);
    for (int64_t b = 0; b < B; b++)
      run.logits[(size_t)b].insert(run.logits[(size_t)b].end(), zv.begin() + b * V, zv.begin() + (b + 1) * V);
    run.steps++;
  }
  // [/slide]
  run.decode_s = watch.seconds();
  for (int64_t b = 0; b < B; b++) run.tokens[(size_t)b].push_back(next[(size_t)b]);
  run.cache_bytes = dec.cache_bytes(), run.cached_tokens = dec.cached_tokens(), run.heads_here = dec.heads_here();
  run.moe_comm_s = dec.moe_comm_s(), run.reduce_comm_s = dec.reduce_comm_s();
  return run;
}

// [slide:bound]
// The caches change only how the attention's sums associate: the scores
// (d_n + d_r terms; absorbed: r_kv after a d_n), the values (a term per
// cached token), absorbed's W_uv after the sum (r_kv). A sum of n terms
// re-associated moves by at most n eps times the sum of its terms' sizes
// (Higham's gamma_n): to first order, per layer, with logits of size max|z|,
//     tol = layers n eps max|z|,   n the longest of those sums.
// Over ranks the partial sums of W_o (H d_v) and W2 (f) are all-reduced too.
double cache_bound(const model::Config& c, const Setup& s, int ranks, double zmax) {
  int64_t n = std::max(s.capacity, c.kv_lora + c.d_nope + c.d_rope);
  if (ranks > 1) n = std::max({n, c.heads * c.d_v, c.ffn, c.moe_ffn * std::max<int64_t>(c.shared, 1)});
  return (double)c.layers * (double)n * FLT_EPSILON * zmax;
}
// [/slide]
// --bf16: every matmul rounds its activation to bf16 first. A value the caches moved by a
// float32 bit may round to the other bf16 neighbour, a whole bf16 step away (2^-7 of it): to
// first order one such flip per layer, in the attention's output (what the caches change),
// carried to the logits by the residual stream: layers 2^-7 max|z| beside the above.
double bf16_bound(const model::Config& c, double zmax) { return (double)c.layers * std::ldexp(1.0, -7) * zmax; }

// The full-sequence training forward of each sequence but its last token: (len - 1) x V.
std::vector<std::vector<float>> reference_logits(const model::Config& c, const model::Params& p,
                                                 const std::vector<std::vector<int64_t>>& tokens) {
  NoGradGuard no_grad;
  std::vector<std::vector<float>> out;
  for (const std::vector<int64_t>& seq : tokens) {
    const int64_t T = (int64_t)seq.size() - 1;
    const Device dev = p.embed.device();
    const Tensor in = Tensor::from_indices(std::vector<int64_t>(seq.begin(), seq.end() - 1), {1, T}, dev);
    out.push_back(model::forward(c, p, in, in, model::positions(T, dev)).logits.to_vector());
  }
  return out;
}

// Mean cross-entropy over --val-batches validation batches (8 x 64 bytes), as perplexity.
double val_perplexity(const model::Config& c, const model::Params& p, const CharCorpus& corpus, int64_t batches,
                      uint64_t seed) {
  NoGradGuard no_grad;
  double sum = 0;
  for (int64_t k = 0; k < batches; k++) {
    const CharCorpus::Batch b = corpus.batch(CharCorpus::Split::val, k, 8, 64, 0, 8, seed);
    const Device dev = p.embed.device();
    sum += model::forward(c, p, b.inputs.to(dev), b.targets.to(dev), model::positions(64, dev)).loss.item();
  }
  return std::exp(sum / (double)batches);
}

// The served weights (int8's or bf16's) against the float32 ones on the same tokens: the logits,
// the validation perplexity, the bytes float32 generates from the same prompts.
void compare_with_float32(Lesson& L, const char* name, const model::Config& c, const model::Params& fp32,
                          const model::Params& served_p, const Setup& s, const Options& opts, const Run& served) {
  const std::vector<std::vector<float>> want = reference_logits(c, fp32, served.tokens);
  double worst = 0, zmax = 0, sq = 0;
  size_t n = 0;
  for (size_t b = 0; b < want.size(); b++)
    for (size_t i = 0; i < want[b].size(); i++, n++) {
      const double d = served.logits[b][i] - want[b][i];
      worst = std::max(worst, std::fabs(d)), zmax = std::max(zmax, (double)std::fabs(want[b][i])), sq += d * d;
    }
  L.print("  logits, %s vs float32 on the same tokens: max|diff| %.3g, rms %.3g (float32 logits up to %.3g)\n", name,
          worst, std::sqrt(sq / (double)n), zmax);
  const double p32 = val_perplexity(c, fp32, s.corpus, opts.val_batches, (uint64_t)L.flags.seed),
               ps = val_perplexity(c, served_p, s.corpus, opts.val_batches, (uint64_t)L.flags.seed);
  L.print("  validation perplexity (%lld batches of 8 x 64 bytes): float32 %.4f, %s %.4f (%+.2f%%)\n",
          (long long)opts.val_batches, p32, name, ps, 100 * (ps / p32 - 1));
  Setup s32 = s;
  s32.bug = Bug::none, s32.bf16 = false;
  const Run r32 = generate(L.comm, c, fp32, s32, served.kind, opts.new_tokens);
  int64_t same = 0, total = 0, first_diff = -1;  // the earliest new byte where a sequence parts
  for (size_t b = 0; b < r32.tokens.size(); b++)
    for (size_t t = s.prompts[b].size(); t < r32.tokens[b].size(); t++, total++) {
      const bool eq = r32.tokens[b][t] == served.tokens[b][t];
      same += eq;
      const int64_t at = (int64_t)(t - s.prompts[b].size());
      if (!eq && (first_diff < 0 || at < first_diff)) first_diff = at;
    }
  L.print("  generated bytes, %s = float32's: %lld of %lld%s\n", name, (long long)same, (long long)total,
          first_diff < 0 ? "" : (" (the earliest difference at new byte " + std::to_string(first_diff) + ")").c_str());
}

// --int8: what the int8 weights cost in memory and in answers, against the float32 ones.
void report_int8(Lesson& L, const model::Config& c, const model::Params& fp32, const Int8Model& q, const Setup& s,
                 const Options& opts, const Run& served) {
  L.print("int8 weights (%s scales): %.1f KiB (the numbers and their scales) against %.1f KiB in float32: %.3fx; "
          "kept in float32 (embedding, head, norms, router): %.1f KiB\n",
          s.int8_per_tensor ? "per-tensor" : "per-channel", q.int8_bytes / 1024.0, q.fp32_bytes / 1024.0,
          (double)q.int8_bytes / (double)q.fp32_bytes, q.kept_bytes / 1024.0);
  if (L.size() == 1 && L.device == Device::cpu)
    L.print("  decode steps read the FFNs' and experts' int8 numbers (int8_matmul); the attention's are dequantized at load\n");
  else
    L.print("  every weight dequantized at load (int8_matmul reads int8 on one process on the cpu device)\n");
  L.print("  the weights' relative error ||W - q s|| / ||W||: %.3g\n", q.rel_error);
  compare_with_float32(L, "int8", c, fp32, q.p, s, opts, served);
}

// --bf16: the matmuls' weights rounded to bf16 (every decode step reads them so), against float32.
void report_bf16(Lesson& L, const model::Config& c, const model::Params& fp32, const model::Params& p16, const Setup& s,
                 const Options& opts, const Run& served) {
  double b16 = 0, b32 = 0, kept = 0, e2 = 0, w2 = 0;
  const std::vector<model::NamedTensor> a = p16.named_parameters(), w = fp32.named_parameters();
  for (size_t k = 0; k < a.size(); k++) {
    if (a[k].t.dtype() != DType::bf16) {
      kept += (double)a[k].t.nbytes();
      continue;
    }
    b16 += (double)a[k].t.nbytes(), b32 += (double)w[k].t.nbytes();
    const std::vector<float> x = a[k].t.to_vector(), y = w[k].t.to_vector();
    for (size_t i = 0; i < x.size(); i++) e2 += (double)(x[i] - y[i]) * (x[i] - y[i]), w2 += (double)y[i] * y[i];
  }
  L.print("bf16 weights (the matmuls', model::Params::matmul_weights): %.1f KiB against %.1f KiB in float32: %.3fx; "
          "kept in float32 (embedding, norms, router): %.1f KiB\n", b16 / 1024, b32 / 1024, b16 / b32, kept / 1024);
  L.print("  every decode step reads them as bf16 (the bf16 matmul: float32 sums)\n");
  L.print("  the weights' relative error ||W - bf16(W)|| / ||W||: %.3g\n", std::sqrt(e2 / w2));
  compare_with_float32(L, "bf16", c, fp32, p16, s, opts, served);
}

// The caches' runs against the training forward: every position's logits within the bound,
// every greedy token the reference's argmax (or within 2 tol of it: a tie, both logits within
// tol of their exact value), the caches' bytes equal (or parting first at such a tie). --dump:
// each cache's tokens, logits and reference logits (rank 0).
void check_runs(Lesson& L, CheckReport& check, const model::Config& c, const model::Params& served, const Setup& s,
                const std::vector<Run>& runs) {
  const int64_t V = c.vocab;
  std::vector<std::vector<std::vector<float>>> wants;
  std::vector<double> tols;
  for (const Run& r : runs) {
    const std::vector<std::vector<float>> want = reference_logits(c, served, r.tokens);
    double worst = 0, zmax = 0;
    for (size_t b = 0; b < want.size(); b++)
      for (size_t i = 0; i < want[b].size(); i++) {
        worst = std::max(worst, (double)std::fabs(r.logits[b][i] - want[b][i]));
        zmax = std::max(zmax, (double)std::fabs(want[b][i]));
      }
    const double tol = cache_bound(c, s, L.size(), zmax) + (s.bf16 ? bf16_bound(c, zmax) : 0.0);
    char what[200];
    std::snprintf(what, sizeof what, "logits, %s cache vs the training forward, every position: max|diff| %.1e <= %.1e",
                  cache_name(r.kind), worst, tol);
    check.holds(what, worst <= tol);
    bool greedy = true;
    for (size_t b = 0; b < want.size(); b++)
      for (size_t t = s.prompts[b].size(); t < r.tokens[b].size(); t++) {
        const float* z = &want[b][(t - 1) * (size_t)V];
        greedy = greedy && z[r.tokens[b][t]] >= *std::max_element(z, z + V) - (float)(2 * tol);
      }
    check.holds((std::string("greedy tokens, ") + cache_name(r.kind) + " cache = the training forward's argmax, every step").c_str(), greedy);
    if (L.dumping() && L.rank() == 0)
      for (size_t b = 0; b < want.size(); b++) {
        const std::string tag = std::string(cache_name(r.kind)) + ".seq" + std::to_string(b);
        const int64_t n = (int64_t)r.tokens[b].size();
        L.dump("tokens." + tag, Tensor::from_indices(r.tokens[b], {n}));
        L.dump("logits." + tag, Tensor::from_vector(r.logits[b], {n - 1, V}));
        L.dump("reference." + tag, Tensor::from_vector(want[b], {n - 1, V}));
      }
    wants.push_back(want), tols.push_back(tol);
  }
  for (size_t k = 1; k < runs.size(); k++) {
    bool same = true;  // equal, or first parting where the reference's two candidates tie
    for (size_t b = 0; b < runs[0].tokens.size(); b++) {
      const std::vector<int64_t>&x = runs[0].tokens[b], &y = runs[k].tokens[b];
      size_t t = 0;
      while (t < x.size() && x[t] == y[t]) t++;
      if (t == x.size()) continue;
      const float* z = &wants[0][b][(t - 1) * (size_t)V];
      same = same && std::fabs(z[x[t]] - z[y[t]]) <= 2 * tols[0];
    }
    check.holds((std::string("generated bytes, ") + cache_name(runs[k].kind) + " cache = " + cache_name(runs[0].kind) +
                 " cache's").c_str(), same);
  }
}

void print_cache_sizes(Lesson& L, const model::Config& c, const std::vector<Run>& runs) {
  const model::Config v3 = deepseek_v3_attention();
  L.print("cache per token per layer%s: numbers kept (bytes measured in this run's caches / tokens / layers)\n",
          L.size() > 1 ? " on one rank" : "");
  L.print("  %-9s %28s %14s %26s\n", "cache", "this model", "measured", "DeepSeek-V3 (61 layers)");
  for (const Run& r : runs) {
    const int64_t n = cache_floats_per_token(c, r.kind, r.heads_here), v = cache_floats_per_token(v3, r.kind, v3.heads);
    const double measured = (double)r.cache_bytes / (double)r.cached_tokens / (double)c.layers;
    L.print("  %-9s %9lld floats = %5lld B %11.0f B %9lld = %6.1f KiB bf16/token\n", cache_name(r.kind),
            (long long)n, (long long)(4 * n), measured, (long long)v, 2.0 * (double)(v * v3.layers) / 1024);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "09_inference", [](Lesson& L) {
    L.cli.summary("Lesson 09: inference. Lesson 08's model prefilled and decoded from a cache: per-head K and V, "
                  "MLA's latents, or the latents with W_uk and W_uv absorbed; every position's logits checked against "
                  "the full-sequence training forward.");
    Options opts;
    const Setup s = parse_options(L, opts);
    const model::Config& c = s.c;

    // ---- the weights: a lesson 08 checkpoint, or the same model from the seed
    model::Params p;
    if (!opts.checkpoint.empty()) {
      const std::string err = mesh::load_checkpoint_weights(L.comm, opts.checkpoint, c, &p, L.device);
      L.usage_error_if(!err.empty(), "--checkpoint: " + err);
      L.print("weights: %s (lesson 08's checkpoint)\n", mesh::checkpoint_dir(opts.checkpoint).c_str());
    } else {
      p = model::init_params(c, (uint64_t)L.flags.seed, L.device);
      L.print("weights: initialised from --seed %lld (untrained: give --checkpoint DIR for lesson 08's)\n",
              (long long)L.flags.seed);
    }
    L.print("model: vocab %lld, d %lld, %lld layers (%lld dense, %lld MoE: %lld experts, top-%lld), %lld heads, "
            "r_kv %lld, d_nope %lld, d_rope %lld, d_v %lld\n",
            (long long)c.vocab, (long long)c.dim, (long long)c.layers, (long long)c.dense_layers,
            (long long)(c.layers - c.dense_layers), (long long)c.experts, (long long)c.topk, (long long)c.heads,
            (long long)c.kv_lora, (long long)c.d_nope, (long long)c.d_rope, (long long)c.d_v);
    L.print("batch: %zu prompts of %zu to %zu bytes, %lld new tokens each (greedy)\n\n", s.prompts.size(),
            std::min_element(s.prompts.begin(), s.prompts.end(), [](auto& a, auto& b) { return a.size() < b.size(); })->size(),
            std::max_element(s.prompts.begin(), s.prompts.end(), [](auto& a, auto& b) { return a.size() < b.size(); })->size(),
            (long long)opts.new_tokens);
    L.start_trace();

    // ---- --bf16: the matmuls' weights held in bf16 (the decode's matmuls read them as bf16;
    // the float32 ones kept to compare)
    model::Params p16;
    if (opts.bf16) {
      p16 = p;
      for (Tensor* w : p16.matmul_weights()) *w = w->detach().to_dtype(DType::bf16);
    }
    // ---- --int8: the served model's weights through int8 (the float32 ones kept to compare)
    Int8Model q;
    if (opts.int8) q = int8_model(c, p, !s.int8_per_tensor);
    const model::Params& served = opts.int8 ? q.p : opts.bf16 ? p16 : p;

    // ---- decode with each cache (under --link, the network modelled)
    if (s.link.enabled) L.print("%s\n\n", describe(s.link).c_str());
    Comm::set_link(s.link);
    std::vector<Run> runs;
    // int8 on one process: the decode steps' FFNs and experts read the int8 numbers themselves
    const Int8Model* reads_int8 = opts.int8 && L.size() == 1 && L.device == Device::cpu ? &q : nullptr;
    for (CacheKind kind : s.kinds) runs.push_back(generate(L.comm, c, served, s, kind, opts.new_tokens, reads_int8));
    Comm::set_link(LinkModel{});  // the rest (the check, int8's comparison) unmodelled
    print_cache_sizes(L, c, runs);
    L.print("\ndecode speed (batch %zu, %d rank%s%s):\n", s.prompts.size(), L.size(), L.size() > 1 ? "s" : "",
            L.size() > 1 ? (std::string(", MoE ") + moe_comm_name(s.moe_comm) + "; rank 0's time in communication").c_str() : "");
    for (const Run& r : runs) {
      L.print("  %-9s %lld steps in %.1f ms: %.0f tokens/s", cache_name(r.kind), (long long)r.steps, r.decode_s * 1e3,
              r.steps > 0 ? (double)(r.steps * (int64_t)s.prompts.size()) / r.decode_s : 0.0);
      if (L.size() > 1)
        L.print(", MoE %.1f ms (%.0f%%), attention and FFN all-reduces %.1f ms (%.0f%%)", r.moe_comm_s * 1e3,
                100 * r.moe_comm_s / r.decode_s, r.reduce_comm_s * 1e3, 100 * r.reduce_comm_s / r.decode_s);
      L.print("\n");
    }
    std::string csv;
    for (const Run& r : runs) {
      char line[400];
      std::snprintf(line, sizeof line, "cache,%s,%d,,%zu,%lld,%.6g,%lld,,,,,,,,,,%d\n", cache_name(r.kind), L.size(),
                    s.prompts.size(), (long long)cache_floats_per_token(c, r.kind, r.heads_here),
                    (double)r.cache_bytes / (double)r.cached_tokens / (double)c.layers,
                    (long long)cache_floats_per_token(deepseek_v3_attention(), r.kind, 128),
                    (int)opts.int8);
      csv += line;
      std::snprintf(line, sizeof line, "decode,%s,%d,%s,%zu,,,,%lld,%.6g,%.6g,%.6g,%.6g,,,,,%d\n", cache_name(r.kind),
                    L.size(), moe_comm_name(s.moe_comm), s.prompts.size(), (long long)r.steps, r.decode_s, r.moe_comm_s,
                    r.reduce_comm_s, (double)(r.steps * (int64_t)s.prompts.size()) / r.decode_s, (int)opts.int8);
      csv += line;
    }
    L.csv_append(kCsvHeader, csv);
    L.print("\ngenerated (%s cache):\n", cache_name(runs[0].kind));
    for (size_t b = 0; b < std::min<size_t>(s.prompts.size(), 4); b++) {
      std::string text;  // a newline shown as \n, so that each sequence stays on its line
      for (char ch : s.corpus.decode(runs[0].tokens[b])) text += ch == '\n' ? std::string("\\n") : std::string(1, ch);
      L.print("  [%zu] %s\n", b, text.c_str());
    }

    if (opts.int8) {
      L.print("\n");
      report_int8(L, c, p, q, s, opts, runs[0]);
    }
    if (opts.bf16) {
      L.print("\n");
      report_bf16(L, c, p, p16, s, opts, runs[0]);
    }

    // ---- the check: every position's logits against the full-sequence training forward (of
    // the served weights: float32, or int8's)
    L.print("\n");
    CheckReport check(L.comm);
    check_runs(L, check, c, served, s, runs);
    if (!s.speed_batches.empty()) {  // --speed, after the check
      const CacheKind kind = s.kinds.size() == 1 ? s.kinds[0] : CacheKind::absorbed;
      L.print("\n");
      const int threads = cpu::matmul_threads();  // the cpu device's kernels' threads
      const double bandwidth = read_bandwidth(threads);
      print_speed(L, decode_speed(c, served, s, kind, s.speed_batches, opts.new_tokens, reads_int8), kind, bandwidth, threads,
                  opts.int8, opts.bf16);
    }
    return L.finish(check);
  });
}
