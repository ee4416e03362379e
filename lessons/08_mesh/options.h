// lessons/08_mesh/options.h — lesson 08's flags, what they and the world size decide, and every
// check of them, before any work (the lesson contract: bad input is one error: line, exit 2).
//
//   Options opts;
//   const std::optional<Setup> parsed = parse_options(L, opts);
//   if (!parsed) return lesson.finish(0);   // --print-mesh or --estimate deepseek-v3 printed
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/comm/mesh.h"
#include "common/layers/model.h"
#include "common/lesson/corpus.h"
#include "common/util/files.h"
#include "common/lesson/lesson.h"

namespace ff::mesh {

// --bug: a known mistake planted in the step, so that the check is seen to FAIL where it must
// (tests/lessons/test_08_mesh.py plants each). Parsed once with the flags; the step asks
// `opts.bug == Bug::...` where the mistake goes, never the flag's text.
enum class Bug {
  none,
  kpe_per_head,          // the shared RoPE key W_kr as a copy per head (a model mistake)
  sp_norm_grad,          // SP: the norms' weight gradients not summed over TP
  f_no_allreduce,        // Megatron's f: no all-reduce in its backward
  ce_local_softmax,      // the vocabulary-parallel cross-entropy's softmax over local columns
  zero_no_divide,        // ZeRO-1/2: the gradient shard summed, not averaged
  zero_stale_shard,      // ZeRO-1/2: the updated shard never gathered back
  bucket_early,          // a gradient bucket reduced before its last gradient arrived
  zero3_stale_gather,    // ZeRO-3: the backward on weights already released
  local_causal_mask,     // CP: the causal mask from local positions
  local_rope_positions,  // CP: RoPE at local positions
  ep_grad_mean,          // EP: the experts' gradient averaged over expert-DP, not data ranks
  pp_mb_sum,             // PP: micro-batch losses summed, not averaged
  dualpipe_no_pair_sum,  // DualPipe: the two copies of a stage not summed
};
// The flag's spelling of each ("none", "kpe-per-head", ...), in the order above.
const std::vector<std::string>& bug_names();
const std::string& bug_name(Bug bug);

// The flags, as given (0 for an axis, --layers or --microbatches: decided from the world)
struct Options {
  int64_t tp = 0, dp = 0, cp = 0, ep = 0, pp = 0, zero = 1, ranks_per_node = 0, microbatches = 0;
  bool sp = true, print_mesh = false;
  int64_t steps = 20, batch = 8, seq = 32, check_every = 1, log_every = 1;
  int64_t dim = 64, layers = 0, dense_layers = 1, heads = 4, d_nope = 16, d_rope = 8, d_v = 16;
  int64_t q_lora = 32, kv_lora = 32, ffn = 128, experts = 8, topk = 2, shared = 1, moe_ffn = 32;
  double lr = 3e-3, bias_rate = 1e-3, temperature = 0.8, bucket_mb = 0;
  int64_t sample = 0, val_batches = 8, save_every = 0, keep = 2;
  std::string prompt = "ROMEO:", data = course_data_file("tinyshakespeare.txt"), estimate = "none",
              a2a = "flat", schedule = "1f1b", layers_per_stage, overlap = "on", link, save, resume;
  // --precision bf16: the matmul weights (and so their gradients) bf16, AdamW's float32 masters
  // beside m and v; fp8: the linear layers' GEMMs in FP8 (lesson 10's precisions, on the mesh)
  std::string precision = "fp32";
  // --precision fp8: the tile t (1 x t activation tiles, t x t weight blocks, promoted every t
  // products); 0 on the command line: chosen by parse_options
  int64_t fp8_tile = 0;
  // --precision fp8: the experts' grouped GEMMs (routed and shared) in FP8 too ("on"), as the
  // report runs them, or float32 ("off", the default: lesson 10's measurements)
  std::string fp8_experts = "off";
  Bug bug = Bug::none;
};

// What the flags and the world size decide, every check passed.
struct Setup {
  MeshSizes sizes;                   // dp x pp x cp x tp (ep folded onto them)
  int64_t rank_batch = 0;            // sequences of a DP rank per step (--batch / dp)
  int64_t seq = 0;                   // tokens per sequence (--seq)
  int64_t seq_per_cp = 0;            // tokens of each sequence on one CP rank (seq / cp)
  int64_t microbatches = 1;          // micro-batches per step
  int64_t microbatch = 0;            // sequences per micro-batch (rank_batch / microbatches)
  int stages = 1;                    // pipeline stages (2 pp under dualpipev)
  bool sched_pairs = false;          // the schedule pairs a forward and a backward in one step
  std::vector<int64_t> stage_begin;  // stage s holds blocks [stage_begin[s], stage_begin[s + 1])
  LinkModel link;                    // --link (and the nodes, for the hierarchical all-to-all)
  bool real_nodes = false;           // --ranks-per-node from the job's real nodes
  CharCorpus corpus;                 // --data
  model::Config c;                   // the model
  int64_t full_numel = 0;            // its parameters
  // --bucket-mb > 0 and the buckets can go during the backward: one stage per rank (a line
  // schedule) and no sum over TP before DP's (sequence parallelism's replicated weights)
  bool bucket_overlap = false;
  std::string bucket_why_not;        // else, when buckets are asked for: why they wait
  std::string run;                   // the checkpoints' lineage: the resumed one's, or drawn anew
  std::string restored;              // --resume: the flags taken from the checkpoint ("" if none)
};

// Declares the flags on lesson.cli, parses them, fills in the defaults and checks everything against
// the world size, the data and the memory (lesson.usage_error_if: one error: line, exit 2 on every
// rank). --print-mesh and --estimate deepseek-v3 print what they show and return nothing.
std::optional<Setup> parse_options(Lesson& lesson, Options& opts);

}  // namespace ff::mesh
