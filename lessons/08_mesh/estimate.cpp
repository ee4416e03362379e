// lessons/08_mesh/estimate.cpp — the memory and communication calculator (estimate.h).
#include "lessons/08_mesh/estimate.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <sstream>

#include "common/comm/mesh.h"
#include "common/core/check.h"

namespace ff::estimate {

// ----------------------------------------------------------------------------
// the model

ModelShape tiny(const model::Config& c, int64_t micro_batch) {
  ModelShape m;
  m.name = "the tiny model";
  m.vocab = c.vocab, m.dim = c.dim, m.layers = c.layers, m.dense_layers = c.dense_layers;
  m.heads = c.heads, m.d_nope = c.d_nope, m.d_rope = c.d_rope, m.d_v = c.d_v;
  m.q_lora = c.q_lora, m.kv_lora = c.kv_lora, m.ffn = c.ffn;
  m.experts = c.experts, m.shared = c.shared, m.topk = c.topk, m.moe_ffn = c.moe_ffn;
  m.seq = c.seq_len, m.micro_batch = micro_batch;
  return m;
}

ModelShape deepseek_v3() {
  ModelShape m;
  m.name = "DeepSeek-V3";
  m.source =
      "inference/configs/config_671B.json; the report: 671B parameters, 37B activated\n"
      "(without the MTP module's 11.5B, as here), pre-training sequences of 4096 tokens";
  m.vocab = 129280, m.dim = 7168, m.layers = 61, m.dense_layers = 3;  // first_k_dense_replace
  m.heads = 128, m.d_nope = 128, m.d_rope = 64, m.d_v = 128;
  m.q_lora = 1536, m.kv_lora = 512, m.ffn = 18432;
  m.experts = 256, m.shared = 1, m.topk = 8, m.moe_ffn = 2048;
  m.seq = 4096, m.micro_batch = 1;
  return m;
}

int64_t ParamCounts::total() const {
  return embed + head + final_norm + attention + dense_ffn + router + routed_experts +
         shared_experts;
}

// One block's MLA weights and its two RMSNorms, as model.cpp's allocate() shapes them.
static int64_t mla_and_norms(const ModelShape& m) {
  const int64_t d = m.dim, H = m.heads;
  return d                                     // attn_norm
         + d * m.q_lora + m.q_lora             // w_dq, q_norm
         + m.q_lora * H * (m.d_nope + m.d_rope)  // w_uq
         + d * m.kv_lora + m.kv_lora           // w_dkv, kv_norm (DeepSeek's wkv_a minus k_pe)
         + m.kv_lora * H * m.d_nope            // w_uk
         + m.kv_lora * H * m.d_v               // w_uv
         + d * m.d_rope                        // w_kr (DeepSeek's k_pe columns of wkv_a)
         + H * m.d_v * d                       // w_o
         + d;                                  // ffn_norm
}
static int64_t dense_ffn_params(const ModelShape& m) { return 3 * m.dim * m.ffn; }
static int64_t one_expert(const ModelShape& m) { return 3 * m.dim * m.moe_ffn; }
static int64_t router_params(const ModelShape& m) { return m.dim * m.experts; }
static int64_t shared_params(const ModelShape& m) { return m.shared * one_expert(m); }

ParamCounts count_params(const ModelShape& m) {
  ParamCounts c;
  const int64_t L = m.layers, Ld = m.dense_layers, Lm = m.moe_layers();
  c.embed = m.vocab * m.dim;
  c.head = m.dim * m.vocab;
  c.final_norm = m.dim;
  c.attention = L * mla_and_norms(m);
  c.dense_ffn = Ld * dense_ffn_params(m);
  c.router = Lm * router_params(m);
  c.routed_experts = Lm * m.experts * one_expert(m);
  c.shared_experts = Lm * shared_params(m);
  return c;
}

int64_t param_count(const ModelShape& m) { return count_params(m).total(); }

int64_t activated_param_count(const ModelShape& m) {
  return param_count(m) - count_params(m).routed_experts +
         m.moe_layers() * m.topk * one_expert(m);
}

int64_t block_param_count(const ModelShape& m, int64_t i) {
  const bool moe = i >= m.dense_layers;
  return mla_and_norms(m) + (moe ? router_params(m) + m.experts * one_expert(m) +
                                       shared_params(m)
                                 : dense_ffn_params(m));
}

// ----------------------------------------------------------------------------
// the parallel configuration

std::string check(const ModelShape& m, const Parallel& p) {
  std::ostringstream why;
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab", m.vocab}, {"dim", m.dim},     {"layers", m.layers}, {"heads", m.heads},
      {"seq", m.seq},     {"micro_batch", m.micro_batch}};
  for (const auto& [what, v] : sizes)
    if (v <= 0) {
      why << what << " is " << v << ", but it must be at least 1";
      return why.str();
    }
  if (m.dense_layers < 0 || m.dense_layers > m.layers) {
    why << "dense_layers " << m.dense_layers << " must be in [0, layers = " << m.layers << "]";
    return why.str();
  }
  if (m.moe_layers() > 0 && (m.experts <= 0 || m.topk < 1 || m.topk > m.experts)) {
    why << "the MoE needs experts >= 1 and topk in [1, experts], got experts " << m.experts
        << ", topk " << m.topk;
    return why.str();
  }
  if (p.zero < 0 || p.zero > 3) {
    why << "zero is " << p.zero << ", but it must be 0..3";
    return why.str();
  }
  if (p.micro_batches < 1) {
    why << "micro_batches is " << p.micro_batches << ", but it must be at least 1";
    return why.str();
  }
  MeshSizes s;
  s.tp = p.tp, s.cp = p.cp, s.ep = p.ep, s.dp = p.dp, s.pp = p.pp;
  const bool positive = p.tp >= 1 && p.cp >= 1 && p.ep >= 1 && p.dp >= 1 && p.pp >= 1;
  const std::string mesh = check_mesh(s, positive ? s.world() : 1);  // world: sizes' product
  if (!mesh.empty()) return mesh;
  if (p.pp > m.layers) {
    why << "pp " << p.pp << " is more than the " << m.layers << " layers: a stage would have none";
    return why.str();
  }
  if (m.moe_layers() > 0 && m.experts % p.ep != 0) {
    why << "ep " << p.ep << " must divide the " << m.experts << " experts";
    return why.str();
  }
  return "";
}

Parallel deepseek_v3_parallel() {
  Parallel p;
  p.tp = 1, p.pp = 16, p.cp = 1, p.ep = 64, p.zero = 1, p.sp = false;
  p.dp = 2048 / p.pp;           // 128
  p.micro_batches = 15360 / p.dp;  // 120 sequences per DP rank per step, one per micro-batch
  p.source =
      "the report (§3.1, §3.2, §4.2): 2048 H800 GPUs, PP 16, EP 64, ZeRO-1, no TP,\n"
      "batches of 15360 sequences; derived: dp = 2048 / 16 = 128, expert-DP = 128 / 64 = 2,\n"
      "n_μ = 15360 / 128 = 120 at one sequence per micro-batch (assumed: the report gives\n"
      "no micro-batch size)";
  return p;
}

// ----------------------------------------------------------------------------
// memory

Memory zero_bytes(double n, int dp, int stage, Precision prec) {
  FF_CHECK(n >= 0 && dp >= 1 && stage >= 0 && stage <= 3,
           "estimate::zero_bytes: needs n >= 0, dp >= 1 and stage 0..3, got n "
               << n << ", dp " << dp << ", stage " << stage);
  const double W = dp;
  Memory b;
  b.params = prec.param * n / (stage >= 3 ? W : 1);
  b.grads = prec.grad * n / (stage >= 2 ? W : 1);
  b.optimizer = prec.optimizer * n / (stage >= 1 ? W : 1);
  return b;
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    default: return "full";
  }
}

double c_act(Recompute r) {
  switch (r) {
    case Recompute::none: return kCActNone;
    case Recompute::selective: return kCActSelectiveHigh;
    default: return kCActFull;
  }
}

RankParams rank_params(const ModelShape& m, const Parallel& p) {
  const ParamCounts c = count_params(m);
  RankParams r;
  r.dense = (double)c.dense() / ((double)p.tp * p.pp);
  r.expert = (double)c.expert() / ((double)p.ep * p.pp);
  return r;
}

std::vector<RankParams> stage_params(const ModelShape& m, const Parallel& p) {
  std::vector<RankParams> stages((size_t)p.pp);
  const int64_t base = m.layers / p.pp, extra = m.layers % p.pp;
  int64_t layer = 0;
  for (int s = 0; s < p.pp; s++) {
    const int64_t n = base + (s < extra ? 1 : 0);
    double dense = 0, expert = 0;
    for (int64_t i = layer; i < layer + n; i++) {
      const double routed = i >= m.dense_layers ? (double)(m.experts * one_expert(m)) : 0;
      expert += routed;
      dense += (double)block_param_count(m, i) - routed;
    }
    layer += n;
    if (s == 0) dense += (double)(m.vocab * m.dim);
    if (s == p.pp - 1) dense += (double)(m.dim + m.dim * m.vocab);
    stages[(size_t)s] = {dense / p.tp, expert / p.ep};
  }
  return stages;
}

double activation_bytes_per_layer(const ModelShape& m, const Parallel& p, Recompute r,
                                  Precision prec) {
  // (B_μ / W_DP) · (L / W_CP) · (d / W_TP) · C_act: B_μ / W_DP is the rank's own micro-batch.
  return (double)m.micro_batch * ((double)m.seq / p.cp) * ((double)m.dim / p.tp) * c_act(r) *
         (prec.activation / 2);
}

// params, grads and optimizer of rp under ZeRO stage `zero`, the dense part sharded over
// w_dense ranks and the experts over w_expert.
static Memory state_bytes(const RankParams& rp, int zero, double w_dense, double w_expert,
                          Precision prec) {
  const double sharded = rp.dense / w_dense + rp.expert / w_expert, whole = rp.total();
  Memory b;
  b.params = prec.param * (zero >= 3 ? sharded : whole);
  b.grads = prec.grad * (zero >= 2 ? sharded : whole);
  b.optimizer = prec.optimizer * (zero >= 1 ? sharded : whole);
  return b;
}

static void zero_groups(const Parallel& p, ZeroGroups g, double* w_dense, double* w_expert) {
  *w_dense = g == ZeroGroups::seed ? p.dp : (double)p.dp * p.cp;
  *w_expert = g == ZeroGroups::seed ? p.dp : p.edp();
}

Memory memory_per_rank(const ModelShape& m, const Parallel& p, Recompute r, Precision prec,
                       ZeroGroups groups) {
  double wd, we;
  zero_groups(p, groups, &wd, &we);
  Memory b = state_bytes(rank_params(m, p), p.zero, wd, we, prec);
  b.activations = activation_bytes_per_layer(m, p, r, prec) * ((double)m.layers / p.pp);
  return b;
}

// ----------------------------------------------------------------------------
// communication

double pp_volume(const ModelShape& m, const Parallel& p) {
  return (double)p.micro_batches * (p.pp - 1) * m.micro_batch * m.seq * m.dim;
}

double zero3_volume(const ModelShape& m, const Parallel& p, bool cached) {
  const ParamCounts c = count_params(m);
  const double phi_r = (double)c.dense() / p.tp + (double)c.expert() / p.ep;
  return 2 * phi_r * (p.pp - 1) * (cached ? 1 : p.micro_batches);
}

// Per transformer layer, B tokens on the rank, D the width, in values (ring factors such as
// (t-1)/t dropped):
//   TP    all-reduces the (B, D) activations twice forward (after the attention's output
//         projection and after the MLP's down projection) and twice backward (the gradients
//         of their inputs):                         V_TP   = 4·B·D
//   FSDP  all-gathers the layer's weights and reduce-scatters their gradients; the trade-off
//         counts them as four D×D matrices moved once: V_FSDP = 4·D²
//   V_TP / V_FSDP = B / D: TP moves fewer values while the rank's tokens B are fewer than D.
// A real layer holds k·D² weights with k well above 4 (an MLP too), and FSDP gathers them
// again for the backward: the report prints k for the model, so the reader sees how far the
// 4·D² undercounts.
double tp_volume_per_layer(double tokens, double dim) { return 4 * tokens * dim; }
double fsdp_volume_per_layer(double dim) { return 4 * dim * dim; }

// ----------------------------------------------------------------------------
// the report

namespace {

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// 4 significant digits or so: 1010, 671.0, 37.52, 1.709
std::string digits(double v) {
  const double a = std::fabs(v);
  return fmt(a >= 1000 ? "%.0f" : a >= 100 ? "%.1f" : a >= 10 ? "%.2f" : "%.3f", v);
}

// A count: 98.41 T, 671.0 B, 926.7 M, 12.29 K, 65
std::string count(double v) {
  const double a = std::fabs(v);
  if (a >= 1e12) return digits(v / 1e12) + " T";
  if (a >= 1e9) return digits(v / 1e9) + " B";
  if (a >= 1e6) return digits(v / 1e6) + " M";
  if (a >= 1e4) return digits(v / 1e3) + " K";
  if (v == std::floor(v)) return fmt("%.0f", v);
  return digits(v);
}

// Bytes in the unit that keeps the number between 1 and 1024.
std::string bytes(double b) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && std::fabs(b) >= 1024) b /= 1024, u++;
  if (u == 0) return fmt("%.0f bytes", b);
  return digits(b) + " " + units[u];
}

// s padded with spaces to `width` characters (UTF-8: Φ, μ, ·, ² count one each), on the right
// (left-aligned) or on the left (right-aligned).
std::string pad(const std::string& s, size_t width, bool align_left = true) {
  size_t chars = 0;
  for (unsigned char ch : s) chars += (ch & 0xC0) != 0x80;
  const std::string fill(chars < width ? width - chars : 0, ' ');
  return align_left ? s + fill : fill + s;
}

// 671026522112 -> "671,026,522,112"
std::string grouped(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); i++) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

// Each line of a multi-line text, indented.
void indented(std::ostringstream& os, const std::string& prefix, const std::string& text) {
  std::istringstream in(text);
  std::string line;
  bool first = true;
  while (std::getline(in, line)) {
    os << (first ? prefix : std::string(prefix.size(), ' ')) << line << "\n";
    first = false;
  }
}

}  // namespace

// ---- the configuration and the parameters
static void report_config(std::ostringstream& os, const ModelShape& m, const Parallel& p) {
  os << "estimate: " << m.name << ", by seed 001's formulas (counts K/M/B/T = 1e3/6/9/12)\n";
  if (!m.source.empty()) indented(os, "  model from: ", m.source);
  os << fmt("  model: V %lld, d %lld, %lld blocks (%lld dense, %lld MoE), H %lld, d_nope %lld,\n",
            (long long)m.vocab, (long long)m.dim, (long long)m.layers,
            (long long)m.dense_layers, (long long)m.moe_layers(), (long long)m.heads,
            (long long)m.d_nope)
     << fmt("         d_rope %lld, d_v %lld, q_lora %lld, kv_lora %lld, dense ffn %lld,\n",
            (long long)m.d_rope, (long long)m.d_v, (long long)m.q_lora, (long long)m.kv_lora,
            (long long)m.ffn);
  if (m.moe_layers() > 0)
    os << fmt("         experts %lld routed + %lld shared of width %lld, top-%lld\n",
              (long long)m.experts, (long long)m.shared, (long long)m.moe_ffn,
              (long long)m.topk);
  os << fmt("  batch: %lld sequence(s) of %lld tokens per micro-batch per rank, "
            "%d micro-batch(es) per step\n",
            (long long)m.micro_batch, (long long)m.seq, p.micro_batches);
  os << fmt("  mesh:  dp %d x pp %d x cp %d x tp %d = %d ranks, ep %d folded (expert-DP %d),\n",
            p.dp, p.pp, p.cp, p.tp, p.world(), p.ep, p.edp())
     << fmt("         ZeRO-%d, SP %s\n", p.zero, p.sp ? "on" : "off");
  if (!p.source.empty()) indented(os, "  mesh from: ", p.source);
}

static void report_params(std::ostringstream& os, const ModelShape& m) {
  const ParamCounts c = count_params(m);
  const long long L = m.layers, Ld = m.dense_layers, Lm = m.moe_layers();
  os << "\nparameters, as common/layers/model.cpp allocates them\n";
  auto row = [&](const char* what, int64_t n, const std::string& detail) {
    os << "  " << pad(what, 34) << pad(count((double)n), 11, false)
       << (detail.empty() ? "" : "  " + detail) << "\n";
  };
  row("embedding V·d", c.embed, "");
  row("MLA + 2 RMSNorms, every block", c.attention,
      fmt("%lld x %s", L, count((double)mla_and_norms(m)).c_str()));
  if (Ld > 0)
    row("dense SwiGLU 3·d·ffn", c.dense_ffn,
        fmt("%lld x %s", Ld, count((double)dense_ffn_params(m)).c_str()));
  if (Lm > 0) {
    row("router d·N", c.router, fmt("%lld x %s", Lm, count((double)router_params(m)).c_str()));
    row("routed experts 3·N·d·moe_ffn", c.routed_experts,
        fmt("%lld x %lld x %s", Lm, (long long)m.experts, count((double)one_expert(m)).c_str()));
    row("shared experts 3·d·S·moe_ffn", c.shared_experts,
        fmt("%lld x %s", Lm, count((double)shared_params(m)).c_str()));
  }
  row("final norm d + head d·V", c.final_norm + c.head, "");
  const int64_t total = c.total(), active = activated_param_count(m);
  os << fmt("  total                    %19s  (%s)\n", grouped(total).c_str(),
            count((double)total).c_str())
     << fmt("  activated per token      %19s  (%s: routed experts K of N)\n",
            grouped(active).c_str(), count((double)active).c_str())
     << fmt("  Φ_dense (all but the routed experts) %s, Φ_expert (routed experts) %s\n",
            count((double)c.dense()).c_str(), count((double)c.expert()).c_str());
}

// ---- ZeRO and the 5D memory model
static void report_zero(std::ostringstream& os, const ModelShape& m, const Parallel& p) {
  const double whole = (double)param_count(m), local = rank_params(m, p).total();
  os << fmt("\nZeRO, seed 001 §2.2: bytes per rank, sharded over W = dp = %d\n", p.dp)
     << "  stage  mixed precision  " << pad("Φ = whole model " + count(whole), 26, false)
     << pad("Φ = this rank's " + count(local), 26, false) << "   fp32 (ours)\n";
  const char* formulas[] = {"16Φ", "4Φ + 12Φ/W", "2Φ + 14Φ/W", "16Φ/W"};
  for (int s = 0; s <= 3; s++)
    os << "  " << pad(std::to_string(s), 7) << pad(formulas[s], 16)
       << pad(bytes(zero_bytes(whole, p.dp, s, kMixed).total()), 27, false)
       << pad(bytes(zero_bytes(local, p.dp, s, kMixed).total()), 26, false)
       << pad(bytes(zero_bytes(local, p.dp, s, kFp32).total()), 15, false) << "\n";
  os << "  (fp32, lessons/08_mesh/zero.h: 4 bytes params + 4 grads + 8 AdamW m and v: 16N,\n"
        "   8N + 8N/W, 4N + 12N/W, 16N/W; \"this rank's\" Φ is the 5D model's Φ_local below)\n";
}

static const char* zero_div(int zero, int from) { return zero >= from ? " / W_DP" : ""; }

static void report_5d(std::ostringstream& os, const ModelShape& m, const Parallel& p) {
  const RankParams rp = rank_params(m, p);
  const Memory b = memory_per_rank(m, p, Recompute::selective, kMixed);
  os << "\n5D memory model, seed 001 §7: bytes per rank, mixed precision\n"
     << fmt("  Φ_local = Φ_dense/(tp·pp) + Φ_expert/(ep·pp) = %s + %s = %s\n",
            count(rp.dense).c_str(), count(rp.expert).c_str(), count(rp.total()).c_str())
     << "  params       " << pad(fmt("2·Φ_local%s", zero_div(p.zero, 3)), 34)
     << pad(bytes(b.params), 12, false) << "\n"
     << "  grads        " << pad(fmt("2·Φ_local%s", zero_div(p.zero, 2)), 34)
     << pad(bytes(b.grads), 12, false) << "\n"
     << "  optimizer    "
     << pad(fmt("12·Φ_local%s", zero_div(p.zero, 1)) +
                (p.zero >= 1 ? fmt(", W_DP = dp = %d", p.dp) : std::string()),
            34)
     << pad(bytes(b.optimizer), 12, false) << "\n"
     << "  activations  (B_μ/W_DP)·(L/W_CP)·(d/W_TP)·C_act per layer, B_μ/W_DP = the rank's\n"
     << fmt("               %lld sequence(s), L = %lld tokens, d = %lld; x L/pp = %s layers,\n",
            (long long)m.micro_batch, (long long)m.seq, (long long)m.dim,
            digits((double)m.layers / p.pp).c_str())
     << "               one micro-batch in flight:\n"
     << "      recompute   C_act   per layer      per rank   total per rank\n";
  struct Row {
    const char* name;
    double c;
  } rows[] = {{"none", kCActNone},
              {"selective", kCActSelectiveLow},
              {"selective", kCActSelectiveHigh},
              {"full", kCActFull}};
  const double one = activation_bytes_per_layer(m, p, Recompute::full, kMixed) / kCActFull;
  for (const Row& r : rows) {
    const double layer = one * r.c, rank = layer * m.layers / p.pp;
    os << fmt("      %-10s %5.0f %12s %13s %16s\n", r.name, r.c, bytes(layer).c_str(),
              bytes(rank).c_str(), bytes(b.params + b.grads + b.optimizer + rank).c_str());
  }
}

static void report_measured(std::ostringstream& os, const ModelShape& m, const Parallel& p,
                            const Measured& got) {
  // The run's rank 0 is stage 0, tp 0, ep 0 (common/comm/mesh.h's order).
  const Memory seed = memory_per_rank(m, p, Recompute::full, kFp32, ZeroGroups::seed);
  double wd, we;
  zero_groups(p, ZeroGroups::folded, &wd, &we);
  const RankParams s0 = stage_params(m, p)[0];
  const Memory stage0 = state_bytes(s0, p.zero, wd, we, kFp32);
  os << "\nthis run, rank 0, fp32 (4-byte params and grads, 8-byte AdamW state):\n"
     << "                   measured   seed §7 (mean stage, W_DP = dp)"
        "   stage 0, ZeRO groups folded\n"
     << fmt("  parameters %14s %34s %29s\n", grouped(got.params).c_str(),
            count(rank_params(m, p).total()).c_str(), count(s0.total()).c_str());
  auto row = [&](const char* what, double measured, double a, double b) {
    os << fmt("  %-10s %14s %34s %29s\n", what, bytes(measured).c_str(), bytes(a).c_str(),
              bytes(b).c_str());
  };
  row("params", got.bytes_params, seed.params, stage0.params);
  row("grads", got.bytes_grads, seed.grads, stage0.grads);
  row("optimizer", got.bytes_optimizer, seed.optimizer, stage0.optimizer);
  os << fmt("  (folded: dense state over dp·cp = %.0f ranks, experts over expert-DP = %.0f)\n",
            wd, we);
}

// ---- communication
static void report_pp_zero3(std::ostringstream& os, const ModelShape& m, const Parallel& given) {
  Parallel p = given;
  os << "\nPP vs ZeRO-3, seed 001 §3.2: values moved per step by the S ranks of one pipeline\n";
  if (p.pp == 1) {
    p.pp = 2;
    os << "  (pp is 1, nothing is cut by depth: the numbers are for S = 2)\n";
  }
  const ParamCounts c = count_params(m);
  const double phi_r = (double)c.dense() / p.tp + (double)c.expert() / p.ep;
  const double vpp = pp_volume(m, p), vz = zero3_volume(m, p, true),
               vz_all = zero3_volume(m, p, false);
  auto volume = [&](const std::string& what, double v) {
    os << "  " << pad(what, 52) << pad(count(v), 10, false) << " values"
       << pad(bytes(2 * v), 12, false) << " bf16\n";
  };
  volume(fmt("PP      n_μ·(S-1)·B_μ·L·d = %d·%d·%lld·%lld·%lld", p.micro_batches, p.pp - 1,
             (long long)m.micro_batch, (long long)m.seq, (long long)m.dim),
         vpp);
  os << "  ZeRO-3  2·Φ_r·(S-1), Φ_r = Φ_dense/tp + Φ_expert/ep = " << count(phi_r) << ":\n";
  volume("          gathered once per step (cached)", vz);
  volume(fmt("          gathered again every micro-batch (x%d)", p.micro_batches), vz_all);
  if (vpp > 0)
    os << "  the pipeline moves " << digits(vz / vpp) << "x fewer values than cached ZeRO-3\n";
}

static void report_tp_fsdp(std::ostringstream& os, const ModelShape& m, const Parallel& p) {
  os << "\nTP vs FSDP per transformer layer (B = tokens per rank per step, D = width, bf16):\n"
        "  TP all-reduces activations, 2 forward + 2 backward:     V_TP   = 4·B·D\n"
        "  FSDP gathers weights and scatters their gradients:      V_FSDP = 4·D²\n"
        "  V_TP / V_FSDP = B / D: TP moves fewer bytes while B < D\n";
  auto example = [&](const std::string& what, double B, double D) {
    const double t = tp_volume_per_layer(B, D), f = fsdp_volume_per_layer(D);
    os << "  " << what << "\n"
       << fmt("      B/D = %s: TP %s, FSDP %s: ", digits(B / D).c_str(), bytes(2 * t).c_str(),
              bytes(2 * f).c_str())
       << (t == f ? std::string("the same bytes")
                  : fmt("%s moves %sx fewer bytes", t < f ? "TP" : "FSDP",
                        digits(t < f ? f / t : t / f).c_str()))
       << "\n";
  };
  example("Llama-70B, D 8192, B = 16 tokens:", 16, 8192);
  example("Llama-70B, D 8192, the 16 as sequences of 4096 tokens, B = 65536:", 16 * 4096, 8192);
  const double B = (double)m.micro_batch * m.seq / p.cp;
  example(fmt("%s, D %lld, B = %lld x %lld / cp %d = %s tokens:", m.name.c_str(),
              (long long)m.dim, (long long)m.micro_batch, (long long)m.seq, p.cp,
              count(B).c_str()),
          B, (double)m.dim);
  const double D2 = (double)m.dim * m.dim;
  os << fmt("  (a block here holds k·D² weights, k = %s dense, %s MoE, not 4: FSDP's real\n",
            digits(block_param_count(m, 0) / D2).c_str(),
            m.moe_layers() > 0 ? digits(block_param_count(m, m.layers - 1) / D2).c_str() : "-")
     << "   volume is about 3·k·D², a gather forward, a gather backward, a reduce-scatter)\n";
}

// ---- where the formulas fall short, with this configuration's numbers
static void report_incomplete(std::ostringstream& os, const ModelShape& m, const Parallel& p) {
  os << "\nwhere the seeds' formulas are incomplete, for this configuration:\n";
  // the world size
  const long long tpd = (long long)p.tp * p.pp * p.dp;
  os << fmt("  - seed 000's Total GPUs = TP x PP x DP = %d x %d x %d = %lld", p.tp, p.pp, p.dp, tpd)
     << (p.cp == 1 ? fmt(": right only because cp = 1;\n    the world is dp x pp x cp x tp = %d\n",
                         p.world())
                   : fmt(", but cp = %d: the world\n    is dp x pp x cp x tp = %d\n", p.cp,
                         p.world()));
  if (p.ep > 1) {
    const long long w5 = (long long)p.world() * p.ep;
    os << fmt("  - seed 001 §2.1's W = DP x TP x PP x CP x EP = %lld counts EP's ranks twice:"
              " ep %d\n", w5, p.ep)
       << fmt("    is folded onto the dp x cp x tp = %d ranks of a stage (expert-DP %d),"
              " world %d;\n", p.dp * p.cp * p.tp, p.edp(), p.world())
       << fmt("    §8.2's W_DP = W/(TP x PP x CP x EP) = %d/%d = %d is the expert-DP size,"
              " not the\n", p.world(), p.tp * p.pp * p.cp * p.ep, p.edp())
       << fmt("    dense weights' data parallelism (dp x cp = %d)\n", p.dp * p.cp);
  }
  // the ZeRO groups
  const Memory seed = memory_per_rank(m, p, Recompute::selective, kMixed, ZeroGroups::seed);
  const Memory folded = memory_per_rank(m, p, Recompute::selective, kMixed, ZeroGroups::folded);
  if (folded.optimizer != seed.optimizer)
    os << fmt("  - §7.3 shards all optimizer state over W_DP = dp = %d, but the mesh replicates\n",
              p.dp)
       << fmt("    the dense weights on dp x cp = %d ranks and the routed experts on expert-DP =\n",
              p.dp * p.cp)
       << fmt("    %d: optimizer %s, not %s; total %s, not %s\n", p.edp(),
              bytes(folded.optimizer).c_str(), bytes(seed.optimizer).c_str(),
              bytes(folded.total()).c_str(), bytes(seed.total()).c_str());
  // the pipeline's balance
  if (p.pp > 1) {
    const std::vector<RankParams> stages = stage_params(m, p);
    size_t heavy = 0;
    for (size_t s = 1; s < stages.size(); s++)
      if (stages[s].total() > stages[heavy].total()) heavy = s;
    const double mean = rank_params(m, p).total();
    const int64_t lo = m.layers / p.pp, hi = lo + (m.layers % p.pp ? 1 : 0);
    os << fmt("  - Φ/pp is the mean stage: %lld blocks over %d stages, %lld",
              (long long)m.layers, p.pp, (long long)hi)
       << (hi != lo ? fmt(" or %lld", (long long)lo) : std::string()) << " per stage;\n"
       << fmt("    the embedding sits on stage 0, the head on stage %d: the heaviest, stage %zu,\n",
              p.pp - 1, heavy)
       << fmt("    holds %s parameters per rank against the mean %s (%+.1f%%)\n",
              count(stages[heavy].total()).c_str(), count(mean).c_str(),
              100 * (stages[heavy].total() / mean - 1));
  }
  // activations
  const double sel =
      activation_bytes_per_layer(m, p, Recompute::selective, kMixed) * m.layers / p.pp;
  if (p.pp > 1)
    os << fmt("  - §7.2 holds one micro-batch; 1F1B keeps up to pp = %d in flight on stage 0:\n",
              p.pp)
       << fmt("    %d x %s = %s of activations (selective, C_act 16)\n", p.pp,
              bytes(sel).c_str(), bytes(sel * p.pp).c_str());
  const double scores = 5.0 * m.heads * m.seq / m.dim;
  os << "  - C_act = 34 is Korthikanti et al. 2022's count for a GPT layer (attention and a 4d\n"
        "    MLP) with the attention core recomputed; storing the scores too adds 5·H·L/d =\n"
     << fmt("    5·%lld·%lld/%lld = %s per token and hidden unit."
            " It knows nothing of MLA's latents",
            (long long)m.heads, (long long)m.seq, (long long)m.dim, digits(scores).c_str())
     << (m.moe_layers() > 0 ? "\n" : ".\n");
  if (m.moe_layers() > 0)
    os << fmt("    nor of the K experts each token visits (K·moe_ffn = %lld against a GPT's"
              " 4d = %lld)\n", (long long)(m.topk * m.moe_ffn), (long long)(4 * m.dim));
  const double logits = (double)m.micro_batch * m.seq / p.cp * m.vocab;
  os << fmt("  - nor of the logits on the last stage: B_μ·L·V = %s values, %s in bf16\n",
            count(logits).c_str(), bytes(2 * logits).c_str());
  if (p.tp > 1) {
    // model.h: tensor parallelism splits MLA's heads; every TP rank keeps the latents' down-
    // projections W_dq, W_dkv, W_kr and the block's norms whole
    const double whole = (double)(m.dim * (m.q_lora + m.kv_lora + m.d_rope) + m.q_lora +
                                  m.kv_lora + 2 * m.dim);
    os << fmt("  - §7.1 divides every dense weight by tp = %d, but MLA's down-projections and\n",
              p.tp)
       << fmt("    the norms (%s per block) stay whole on each TP rank: %s more per rank\n",
              count(whole).c_str(), count(whole * m.layers / p.pp * (1 - 1.0 / p.tp)).c_str());
  }
  if (p.tp > 1 && !p.sp)
    os << fmt("  - without SP only the matmuls' activations shrink by tp = %d (Korthikanti: the\n",
              p.tp)
       << "    norms' and dropouts' 10 of the 34 stay whole); §7.2 divides all of them by W_TP\n";
  if (p.pp > 1)
    os << "  - §3.2's PP volume is the forward pass: the backward sends as many gradient values\n"
       << fmt("    back, %s in all\n", count(2 * pp_volume(m, p)).c_str());
}

std::string report(const ModelShape& m, const Parallel& p,
                   const std::optional<Measured>& measured) {
  const std::string why = check(m, p);
  FF_CHECK(why.empty(), "estimate: " << why);
  std::ostringstream os;
  report_config(os, m, p);
  report_params(os, m);
  report_zero(os, m, p);
  report_5d(os, m, p);
  if (measured) report_measured(os, m, p, *measured);
  report_pp_zero3(os, m, p);
  report_tp_fsdp(os, m, p);
  report_incomplete(os, m, p);
  return os.str();
}

}  // namespace ff::estimate
