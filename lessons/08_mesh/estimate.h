// lessons/08_mesh/estimate.h — lesson 08's `--estimate`: what a DP × PP × CP × TP (+ EP)
// configuration costs in memory and communication, by seed 001's formulas, for the tiny model
// the lesson runs and for DeepSeek-V3 (671B), and where those formulas fall short.
//
// Design rule: everything here is arithmetic on sizes (no tensors, no MPI), so the lesson,
// the tests and a reader can evaluate any configuration, including ones no machine here holds.
//
// Sources, by section of seed 001 ("Expert Parallelism and 5D Parallelism"):
//   §2.2  ZeRO bytes per rank, mixed precision: 16Φ, 4Φ + 12Φ/W, 2Φ + 14Φ/W, 16Φ/W
//   §3.2  communication per step: ZeRO-3 moves weights, 2·Σ|Θ_ℓ|·(W-1)/W; a pipeline moves
//         activations, n_μ·(S-1)·B_μ·L·d
//   §7    the 5D memory model: Φ_dense/(tp·pp) + Φ_expert/(ep·pp) parameters per rank,
//         optimizer 12·Φ_local/W_DP, activations (B_μ/W_DP)·(L/W_CP)·(d/W_TP)·C_act per layer
//   §9    DeepSeek-V3: TP 1, PP 16, EP 64, ZeRO-1; 671B parameters, about 37B active per token
// and seed 000's "Total GPUs = TP × PP × DP"; the TP-vs-FSDP trade-off (4·B·D against 4·D²
// per layer) is written out in estimate.cpp, tp_volume_per_layer.
//
// Counts: K = 1e3, M = 1e6, B = 1e9 (parameters, values). Bytes: KiB, MiB, GiB, TiB (2^10 ...).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/layers/model.h"

namespace ff::estimate {

// ---- the model
// The sizes param_count needs, in common/layers/model.h's letters.
struct ModelShape {
  std::string name;
  std::string source;        // where the sizes come from (printed when not empty)
  int64_t vocab = 0;         // V
  int64_t dim = 0;           // d
  int64_t layers = 0;        // L blocks
  int64_t dense_layers = 0;  // the first ones have a dense SwiGLU FFN, the rest the MoE
  int64_t heads = 0;         // H
  int64_t d_nope = 0, d_rope = 0, d_v = 0;
  int64_t q_lora = 0, kv_lora = 0;  // r_q, r_kv
  int64_t ffn = 0;           // dense SwiGLU width
  int64_t experts = 0;       // N routed experts per MoE layer
  int64_t shared = 0;        // S shared experts per MoE layer (fused width S·moe_ffn)
  int64_t topk = 0;          // K routed experts per token
  int64_t moe_ffn = 0;       // width of each routed (and shared) expert
  int64_t seq = 0;           // tokens per sequence
  int64_t micro_batch = 1;   // sequences per micro-batch per rank (seed 001's B_μ / W_DP)

  int64_t moe_layers() const { return layers - dense_layers; }
};

// The tiny model lesson 08 runs (its --dim, --layers, ... flags as a model::Config).
ModelShape tiny(const model::Config& c, int64_t micro_batch);
// DeepSeek-V3 as inference/configs/config_671B.json gives it: 61 layers (3 dense), d 7168,
// 128 heads, MLA (q_lora 1536, kv_lora 512, d_nope 128, d_rope 64, d_v 128), dense FFN 18432,
// 256 routed + 1 shared experts of width 2048, top-8, vocab 129280; sequences of 4096 tokens
// (the pre-training length), one per micro-batch. The multi-token-prediction module (one
// more layer, about 11.5B parameters of its own) is not counted: the 671B leave it out too.
ModelShape deepseek_v3();

// Parameters by kind, counting exactly what common/layers/model.cpp allocates (its
// named_parameters; the MoE balancing bias is a buffer, not a parameter).
struct ParamCounts {
  int64_t embed = 0;           // V·d
  int64_t head = 0;            // d·V
  int64_t final_norm = 0;      // d
  int64_t attention = 0;       // every block's MLA weights with its two RMSNorms (attn, ffn)
  int64_t dense_ffn = 0;       // 3·d·ffn per dense block
  int64_t router = 0;          // d·N per MoE block
  int64_t routed_experts = 0;  // 3·N·d·moe_ffn per MoE block: the only kind EP shards
  int64_t shared_experts = 0;  // 3·d·(S·moe_ffn) per MoE block
  int64_t total() const;
  int64_t expert() const { return routed_experts; }         // seed 001 §7.1's Φ_expert
  int64_t dense() const { return total() - routed_experts; }  // Φ_dense: everything else
};
ParamCounts count_params(const ModelShape& m);
int64_t param_count(const ModelShape& m);  // count_params(m).total()
// Parameters one token passes through: everything but the routed experts, plus K of them in
// every MoE block (the embedding row it reads counts as the whole table, as DeepSeek's
// "37B activated" does).
int64_t activated_param_count(const ModelShape& m);
// One block's parameters (block i, 0-based): its MLA and norms plus its FFN or MoE.
int64_t block_param_count(const ModelShape& m, int64_t i);

// ---- the parallel configuration
// world = dp·pp·cp·tp (common/comm/mesh.h); ep is folded onto the dp·cp·tp ranks of a stage.
struct Parallel {
  int tp = 1, pp = 1, dp = 1, cp = 1, ep = 1;
  int zero = 0;            // ZeRO stage 0..3 over the data-parallel ranks
  bool sp = false;         // sequence parallelism alongside TP
  int micro_batches = 1;   // n_μ per step (per DP rank)
  std::string source;      // where the configuration comes from (printed when not empty)

  int world() const { return dp * pp * cp * tp; }
  int edp() const { return dp * cp * tp / ep; }  // expert-DP: ranks holding the same experts
};
// "" when the configuration is usable for m, else one sentence saying what is wrong.
std::string check(const ModelShape& m, const Parallel& p);
// DeepSeek-V3's training configuration (technical report §3.2): PP 16, EP 64, ZeRO-1, no TP,
// on 2048 GPUs, so dp = 2048 / 16 = 128; 15360 sequences per step (the final batch size) at
// one sequence per micro-batch gives n_μ = 15360 / 128 = 120.
Parallel deepseek_v3_parallel();

// ---- memory (seed 001 §2.2 and §7)
// Bytes per parameter (params, grads, optimizer) and per activation value.
struct Precision {
  const char* name;
  double param, grad, optimizer, activation;
};
// Seed 001's mixed precision: bf16 params and grads, fp32 master copy, m and v (4 + 4 + 4).
constexpr Precision kMixed = {"mixed precision", 2, 2, 12, 2};
// What lesson 08 runs (lessons/08_mesh/zero.h): float32 params and grads, AdamW's m and v.
constexpr Precision kFp32 = {"fp32", 4, 4, 8, 4};

// Bytes one rank holds.
struct Memory {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  double total() const { return params + grads + optimizer + activations; }
};

// Seed 001 §2.2 for n parameters over W = dp data-parallel ranks (no other axis): ZeRO-1
// shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the parameters too (exact
// division, as the seed writes it). kMixed gives 16N, 4N + 12N/W, 2N + 14N/W, 16N/W.
Memory zero_bytes(double n, int dp, int stage, Precision prec);

// Seed 001 §7.2's C_act, bytes per token per hidden unit per layer (16-bit activations),
// by recomputation strategy, exactly as the seed states them.
enum class Recompute { none, selective, full };
const char* recompute_name(Recompute r);
constexpr double kCActNone = 34;           // no recomputation
constexpr double kCActSelectiveLow = 10;   // selective recomputation: "10-16"
constexpr double kCActSelectiveHigh = 16;  //   (memory_per_rank takes the high end)
constexpr double kCActFull = 2;            // full recomputation: only the layer's input
double c_act(Recompute r);

// Seed 001 §7.1: the parameters one rank holds, Φ_dense/(tp·pp) and Φ_expert/(ep·pp) — the
// average over the pipeline stages.
struct RankParams {
  double dense = 0, expert = 0;
  double total() const { return dense + expert; }
};
RankParams rank_params(const ModelShape& m, const Parallel& p);
// The same per stage, for layers cut into pp contiguous runs as evenly as possible (the first
// L mod pp stages one block more), the embedding on stage 0 and the final norm and head on the
// last: what the average leaves out.
std::vector<RankParams> stage_params(const ModelShape& m, const Parallel& p);

// Which ranks ZeRO shards over. seed: every parameter over W_DP = dp (seed 001 §7.3). folded:
// what the mesh replicates, dense parameters over dp·cp (CP ranks hold the same weights) and
// routed experts over expert-DP = dp·cp·tp/ep only.
enum class ZeroGroups { seed, folded };

// Seed 001 §7.2: activation bytes of one layer for one micro-batch on one rank,
// micro_batch · (seq / cp) · (dim / tp) · C_act, scaled by prec.activation / 2 (C_act counts
// 16-bit values).
double activation_bytes_per_layer(const ModelShape& m, const Parallel& p, Recompute r,
                                  Precision prec);
// Seed 001 §7.4: params + grads + optimizer (ZeRO stage p.zero over `groups`) for
// rank_params(m, p), and activations of layers / pp layers for ONE micro-batch in flight.
Memory memory_per_rank(const ModelShape& m, const Parallel& p, Recompute r, Precision prec,
                       ZeroGroups groups = ZeroGroups::seed);

// ---- communication (seed 001 §3.2), in values (elements), per step
// The pipeline: n_μ·(S-1)·B_μ·L·d, the activations crossing the S-1 stage boundaries forward
// (S = p.pp, n_μ = p.micro_batches, B_μ = m.micro_batch, L = m.seq, d = m.dim).
double pp_volume(const ModelShape& m, const Parallel& p);
// The same S = p.pp ranks sharding every layer with ZeRO-3 instead of holding whole layers:
// each rank all-gathers and reduce-scatters the weights it computes with,
// Φ_r = Φ_dense/tp + Φ_expert/ep, moving 2·Φ_r·(S-1)/S; over the S ranks 2·Φ_r·(S-1), once
// per step when the gathered weights are cached over the micro-batches (§3.3), n_μ times
// when they are not.
double zero3_volume(const ModelShape& m, const Parallel& p, bool cached);
// TP against FSDP per transformer layer (estimate.cpp states the formulas): B tokens per rank
// per step, D the width.
double tp_volume_per_layer(double tokens, double dim);  // 4·B·D
double fsdp_volume_per_layer(double dim);               // 4·D²

// ---- the report
// What lesson 08's run allocated on one rank (float32).
struct Measured {
  int64_t params = 0;
  double bytes_params = 0, bytes_grads = 0, bytes_optimizer = 0;
};
// The printable estimate (lines under 100 characters, each ending in '\n'): the configuration,
// parameter counts, the ZeRO 0-3 table, the 5D memory model, PP against ZeRO-3, TP against
// FSDP, and where the seeds' formulas are incomplete for this configuration; with `measured`,
// the run's bytes next to the fp32 formula. Throws ff::Error (check's sentence) for a
// configuration check refuses.
std::string report(const ModelShape& m, const Parallel& p,
                   const std::optional<Measured>& measured = std::nullopt);

}  // namespace ff::estimate
