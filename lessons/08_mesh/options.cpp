// lessons/08_mesh/options.cpp — lesson 08's flags and every check of them (options.h).
#include "lessons/08_mesh/options.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "lessons/07_dualpipe/schedules.h"
#include "lessons/08_mesh/checkpoint.h"
#include "lessons/08_mesh/estimate.h"

namespace ff::mesh {

const std::vector<std::string>& bug_names() {
  static const std::vector<std::string> names = {
      "none", "kpe-per-head", "sp-norm-grad", "f-no-allreduce", "ce-local-softmax", "zero-no-divide",
      "zero-stale-shard", "bucket-early", "zero3-stale-gather", "local-causal-mask", "local-rope-positions",
      "ep-grad-mean", "pp-mb-sum", "dualpipe-no-pair-sum"};
  return names;
}

const std::string& bug_name(Bug bug) { return bug_names().at((size_t)bug); }

// --bug's name as the enum (one of bug_names(): cli.choice allows no other)
static Bug bug_of(const std::string& name) {
  const auto& names = bug_names();
  return (Bug)(std::find(names.begin(), names.end(), name) - names.begin());
}

// Every flag of the lesson, on cli (sp: --sp's auto | on | off, decided after the parse; bug:
// --bug's name, Options::bug after it).
static void declare_flags(Cli& cli, Options& opts, std::string* sp, std::string* bug_flag) {
  cli.summary(
      "A tiny DeepSeek-style language model (MLA + MoE) trained on tinyshakespeare by a DP x PP x CP x "
      "TP x EP mesh (ZeRO-1, sequence parallelism, ring attention, lesson 05's expert-parallel MoE, "
      "lesson 07's pipeline schedules); every step checked against one process.");
  cli.flag("--tp", &opts.tp, "tensor-parallel ranks: attention heads, dense FFN, LM head (0: 2 when "
           "the world size is even, else 1)", 0, 64);
  // The default mesh: on a world that is a multiple of 16 with no axis given, every axis is 2
  // (DP the rest): `mpirun -np 16` runs the five-axis mesh, `-np 32` the same with DP 4.
  cli.flag("--dp", &opts.dp, "data-parallel ranks (0: the world size / (tp cp))", 0, 4096);
  cli.flag("--cp", &opts.cp, "context-parallel ranks: each sequence's tokens in the zigzag layout, "
           "attention by lesson 02's ring (0: 2 on a world of 16k ranks with no axis given, else 1)", 0, 64);
  cli.flag("--ep", &opts.ep, "expert-parallel ranks, folded onto the dp x cp x tp ranks (consecutive "
           "ranks, tp fastest): each holds experts / ep of every MoE layer (0: as --cp)", 0, 256);
  cli.choice("--a2a", &opts.a2a, {"flat", "hierarchical"},
             "--ep: lesson 04's all-to-all, or lesson 05's rail-then-node one");
  cli.flag("--ranks-per-node", &opts.ranks_per_node, "ranks per node, consecutive ranks: of the "
           "EP group for --a2a hierarchical, of the world for --link (0: the job's real nodes when it "
           "spans several, else virtual nodes of 2 when ep is even, of 1 when odd)", 0, 256);
  cli.flag("--link", &opts.link, "model the network as lesson 05 does: intra=BW,inter=BW,latency=T "
           "(keys left out: intra=160GB/s,inter=50GB/s,latency=3us); point-to-point messages (the "
           "all-to-alls, the CP ring, the pipeline) complete when the model says", "SPEC");
  cli.flag("--pp", &opts.pp, "pipeline stages' ranks: the layers cut into stages, run by lesson 07's "
           "executor (0: as --cp)", 0, 64);
  cli.choice("--schedule", &opts.schedule, {"1f1b", "zb-h1", "dualpipe", "dualpipev"},
             "--pp: the pipeline schedule (lesson 07; dualpipe: two directions, every stage on two "
             "ranks; dualpipev: two stages per rank, a V)");
  cli.choice("--overlap", &opts.overlap, {"on", "off", "compare"},
             "--schedule dualpipe/dualpipev: a paired step's forward and backward interleaved, each "
             "one's all-to-alls in flight while the other computes (lesson 06), or one after the other; "
             "compare: every step both, the gradients compared bit for bit and the hidden fraction printed");
  cli.flag("--microbatches", &opts.microbatches, "micro-batches per step, each batch / dp / M sequences "
           "(0: 1 without PP, else 2 pp, or pp when the sequences of a DP rank do not split in 2 pp)", 0, 4096);
  cli.flag("--layers-per-stage", &opts.layers_per_stage, "--pp: blocks of each stage, e.g. 1,2,1 (default: "
           "an even split, the first stages taking the remainder)", "LIST");
  cli.flag("--zero", &opts.zero, "ZeRO stage: 0 (all-reduce), 1 (optimizer state sharded over DP), 2 "
           "(gradients sharded too) or 3 (FSDP: parameters too, each layer gathered for its forward and "
           "its backward)", 0, 3);
  cli.choice("--precision", &opts.precision, {"fp32", "bf16", "fp8"},
             "fp32; bf16: the matmul weights and their gradients in bf16, AdamW's float32 master weights "
             "beside m and v; fp8: float32 weights, MLA's projections and the dense FFN in FP8 e4m3 as DeepSeek-V3 "
             "trains them (common/layers/fp8_linear.h: 1 x t and t x t scales, promoted every t). Lesson 10's "
             "precisions, on the whole mesh");
  cli.choice("--fp8-experts", &opts.fp8_experts, {"off", "on"}, "--precision fp8: the experts' grouped GEMMs in FP8 "
             "too, group by group, as DeepSeek-V3 runs them (off: float32)");
  cli.flag("--fp8-tile", &opts.fp8_tile, "--precision fp8: the tile t (0: DeepSeek-V3's 128; under --tp, the largest "
           "power of two up to 128 dividing each TP rank's share of every width TP splits)", 0, 4096);
  cli.flag("--bucket-mb", &opts.bucket_mb, "DP's gradient buckets, MB (1e6 bytes) each: each bucket's "
           "reduction starts as soon as its last gradient is in, during the backward (0: one bucket, "
           "after the backward)", 0.0, 1e6);
  cli.choice("--sp", sp, {"auto", "on", "off"}, "sequence parallelism (auto: on when tp > 1)");
  cli.toggle("--print-mesh", &opts.print_mesh, "print every group of every axis and exit");
  cli.choice("--estimate", &opts.estimate, {"none", "run", "deepseek-v3"},
             "memory and communication model: run (this model and mesh, after training, next to "
             "the measured bytes) or deepseek-v3 (671B; prints and exits)");
  cli.flag("--train", &opts.steps, "training steps, in all (with --resume: those before the checkpoint "
           "too; 0: none, to sample or validate a checkpoint)", 0, 1000000);
  cli.flag("--save", &opts.save, "write checkpoints into this directory (DIR/step-NNNNNN: every weight, "
           "AdamW's state and the biases as full tensors, .npy, with a manifest.json); a directory without "
           "another run's checkpoints", "DIR");
  cli.flag("--save-every", &opts.save_every, "--save: a checkpoint every N steps (0: after the last step only)", 0, 1000000);
  cli.flag("--keep", &opts.keep, "--save: keep the newest K of this run's checkpoints and its last K saves; "
           "another run's are never removed (0: all)", 0, 1000000);
  cli.flag("--resume", &opts.resume, "go on from a checkpoint (a step-NNNNNN directory, or a --save "
           "directory: its newest), on this run's mesh, whatever the mesh it was saved from; --seed, --batch, "
           "--seq, --lr, --bias-rate and the model flags left out take the checkpoint's", "DIR");
  cli.flag("--batch", &opts.batch, "global batch: sequences per step, split over DP", 1, 4096);
  cli.flag("--seq", &opts.seq, "tokens per sequence", 2, 1024);
  cli.flag("--dim", &opts.dim, "model width d", 1, 4096);
  cli.flag("--layers", &opts.layers, "transformer blocks (0: the dense ones and one MoE block per "
           "pipeline stage, at least 2; with --layers-per-stage, its sum)", 0, 64);
  cli.flag("--dense-layers", &opts.dense_layers, "blocks with a dense SwiGLU FFN (the rest: MoE)", 0, 64);
  cli.flag("--heads", &opts.heads, "attention heads (split over TP)", 1, 256);
  cli.flag("--d-nope", &opts.d_nope, "query/key head width without RoPE", 1, 1024);
  cli.flag("--d-rope", &opts.d_rope, "query/key head width with RoPE (even)", 2, 1024);
  cli.flag("--d-v", &opts.d_v, "value head width", 1, 1024);
  cli.flag("--q-lora", &opts.q_lora, "query latent rank r_q", 1, 4096);
  cli.flag("--kv-lora", &opts.kv_lora, "key-value latent rank r_kv", 1, 4096);
  cli.flag("--ffn", &opts.ffn, "dense SwiGLU width", 1, 16384);
  cli.flag("--experts", &opts.experts, "routed experts per MoE layer", 1, 256);
  cli.flag("--topk", &opts.topk, "experts per token", 1, 256);
  cli.flag("--shared", &opts.shared, "shared experts", 0, 16);
  cli.flag("--moe-ffn", &opts.moe_ffn, "width of each expert", 1, 16384);
  cli.flag("--lr", &opts.lr, "AdamW learning rate", 0.0, 1.0);
  cli.flag("--bias-rate", &opts.bias_rate, "balancing bias update speed gamma", 0.0, 1.0);
  cli.flag("--check-every", &opts.check_every, "compare with one process every K steps (and the last)", 1, 1000000);
  cli.flag("--log-every", &opts.log_every, "print a step line every K steps (and the last)", 1, 1000000);
  cli.flag("--val-batches", &opts.val_batches, "global batches of held-out text the final "
           "validation loss averages", 1, 10000);
  // (rank 0 samples while the others wait at the check: a few seconds at most, far inside the
  // watchdog's timeout)
  cli.flag("--sample", &opts.sample, "after training, generate this many bytes (rank 0)", 0, 4000);
  cli.flag("--temperature", &opts.temperature, "sampling temperature", 0.01, 100.0);
  cli.flag("--prompt", &opts.prompt, "the text sampling starts from", "TEXT");
  cli.flag("--data", &opts.data, "the training text (its distinct bytes are the vocabulary; the default is the course's data/tinyshakespeare.txt, found from the executable)");
  cli.choice("--bug", bug_flag, bug_names(), "plant a known mistake (the check must FAIL)");
  cli.epilog(
      "  make run L=08                          16 ranks: DP 2 x PP 2 x CP 2 x TP 2, EP 2 folded\n"
      "  make run L=08 NP=32                    the same with DP 4\n"
      "  make run L=08 NP=4                     DP 2 x TP 2 with SP and ZeRO-1\n"
      "  make run L=08 ARGS=\"--print-mesh\"      every group of every axis\n"
      "  make run L=08 NP=1 ARGS=\"--train 2000 --check-every 500 --log-every 250 --sample 300\"\n"
      "  make run L=08 NP=1 ARGS=\"--estimate deepseek-v3\"\n"
      "Expect: per step the loss of the mesh next to one process's; check: PASS.");
}

// --zero, --bucket-mb and their planted bugs against the mesh and the schedule; returns whether
// the gradient buckets can go during the backward (else *why_not says why, when asked for).
static bool check_data_parallel(Lesson& lesson, const Options& opts, const MeshSizes& sizes, std::string* why_not) {
  lesson.usage_error_if((opts.bug == Bug::zero_no_divide || opts.bug == Bug::zero_stale_shard) && (opts.zero == 0 || opts.zero == 3 || sizes.dp * sizes.cp == 1),
                        "--bug " + bug_name(opts.bug) + " needs --zero 1 or 2 and dp x cp > 1");
  const bool checkpoints = !opts.save.empty() || !opts.resume.empty();
  lesson.usage_error_if(opts.save.empty() && (lesson.cli.given("--save-every") || lesson.cli.given("--keep")),
                        "--save-every and --keep need --save DIR (they say when checkpoints are written and how many stay)");
  lesson.usage_error_if(opts.steps == 0 && opts.resume.empty(), "--train 0 needs --resume (a model to validate or sample)");
  lesson.usage_error_if(checkpoints && opts.bug != Bug::none, "--save and --resume run without --bug");
  if (!opts.save.empty()) {
    const std::string err = check_output_path(opts.save, PathKind::dir);
    lesson.usage_error_if(!err.empty(), "--save: " + err);
  }
  // (not yet for lesson 10's precisions: the dump's numpy check recomputes the model in float32)
  lesson.usage_error_if(opts.precision != "fp32" && lesson.dumping(),
                        "--precision " + opts.precision + " runs without --dump (its numpy check recomputes the "
                        "model in float32)");
  lesson.usage_error_if(opts.zero == 3 && opts.schedule != "1f1b",
                        "--zero 3 runs with --schedule 1f1b (a layer's backward must end before the next "
                        "one's starts: no split backward, one stage per rank)");
  lesson.usage_error_if(opts.bug == Bug::zero3_stale_gather && opts.zero != 3, "--bug zero3-stale-gather needs --zero 3");
  lesson.usage_error_if(opts.zero == 3 && opts.bucket_mb > 0,
                        "--bucket-mb is for --zero 0, 1 and 2 (ZeRO-3 reduces each layer's gradients as "
                        "soon as its backward ends)");
  // the buckets go during the backward when a weight's gradient is final at its last
  // backward: one stage per rank (under SP the replicated weights are their own group, summed
  // over TP after DP's reduction)
  if (opts.bucket_mb > 0 && (opts.schedule == "dualpipe" || opts.schedule == "dualpipev"))
    *why_not = "--schedule " + opts.schedule + " holds two stages per rank";
  const bool overlap = opts.bucket_mb > 0 && why_not->empty();
  lesson.usage_error_if(opts.bug == Bug::bucket_early && (!overlap || sizes.dp * sizes.cp == 1),
                        "--bug bucket-early needs --bucket-mb > 0, dp x cp > 1 and one stage per rank" +
                            (why_not->empty() ? std::string() : " (here: " + *why_not + ")"));
  return overlap;
}

// --resume: the run goes on as it was saved. Every flag of the data position (--seed, --batch,
// --seq), of the rates (--lr, --bias-rate) and of the model left out takes the checkpoint's value;
// one given must agree with it (else one error naming the field). *restored lists those taken
// that differ from the flags' defaults (--layers 0, "as the stages need", is no value of its own).
static std::optional<Manifest> restore_run(Lesson& lesson, Options& opts, std::string* restored) {
  if (opts.resume.empty()) return std::nullopt;
  std::string dir;
  Manifest m;
  const std::string err = read_checkpoint(lesson.comm, opts.resume, &dir, &m);
  lesson.usage_error_if(!err.empty(), "--resume: " + err);
  const Cli& cli = lesson.cli;
  struct IntFlag {
    const char* flag;
    int64_t* value;
    int64_t saved;
  };
  const model::Config& c = m.model;
  const IntFlag ints[] = {{"--seed", &lesson.flags.seed, m.seed}, {"--batch", &opts.batch, m.batch},
                          {"--seq", &opts.seq, m.seq},        {"--dim", &opts.dim, c.dim},
                          {"--layers", &opts.layers, c.layers}, {"--dense-layers", &opts.dense_layers, c.dense_layers},
                          {"--heads", &opts.heads, c.heads},  {"--d-nope", &opts.d_nope, c.d_nope},
                          {"--d-rope", &opts.d_rope, c.d_rope}, {"--d-v", &opts.d_v, c.d_v},
                          {"--q-lora", &opts.q_lora, c.q_lora}, {"--kv-lora", &opts.kv_lora, c.kv_lora},
                          {"--ffn", &opts.ffn, c.ffn},        {"--experts", &opts.experts, c.experts},
                          {"--topk", &opts.topk, c.topk},     {"--shared", &opts.shared, c.shared},
                          {"--moe-ffn", &opts.moe_ffn, c.moe_ffn}};
  std::vector<std::string> taken;
  for (const IntFlag& f : ints) {
    lesson.usage_error_if(cli.given(f.flag) && *f.value != f.saved,
                          "--resume: the checkpoint has " + std::string(f.flag + 2) + " = " + std::to_string(f.saved) + ", " +
                              f.flag + " " + std::to_string(*f.value) + " given (a resumed run goes on with the "
                              "checkpoint's: leave the flag out)");
    if (!cli.given(f.flag) && *f.value != f.saved && *f.value != 0) taken.push_back(std::string(f.flag + 2) + " " + std::to_string(f.saved));
    *f.value = f.saved;
  }
  for (auto [flag, value, saved] : {std::make_tuple("--lr", &opts.lr, m.lr), std::make_tuple("--bias-rate", &opts.bias_rate, m.bias_rate)}) {
    char text[96];
    std::snprintf(text, sizeof text, "%s = %g, %s %g given", flag + 2, saved, flag, *value);
    lesson.usage_error_if(cli.given(flag) && *value != saved, "--resume: the checkpoint has " + std::string(text) +
                                                                " (a resumed run goes on with the checkpoint's: leave the flag out)");
    if (!cli.given(flag) && *value != saved) {
      std::snprintf(text, sizeof text, "%s %g", flag + 2, saved);
      taken.push_back(text);
    }
    *value = saved;
  }
  for (size_t i = 0; i < taken.size(); i++) *restored += (i ? ", " : "") + taken[i];
  return m;
}

// The checkpoints' lineage (checkpoint.h): a resumed run's, on the text it was trained on, or a new
// one; --save adds only to a directory of its own lineage's checkpoints.
static std::string checkpoint_lineage(Lesson& lesson, const Options& opts, const std::optional<Manifest>& resumed,
                                      const CharCorpus& corpus) {
  if (resumed) {  // the same text, or the data position means another text's
    char text[160];
    std::snprintf(text, sizeof text, "%llu bytes (CRC-32 %08x), --data %s is %lld bytes (CRC-32 %08x)",
                  (unsigned long long)resumed->data_bytes, resumed->data_crc32, opts.data.c_str(), (long long)corpus.size(),
                  corpus.crc32());
    lesson.usage_error_if(resumed->data_bytes != (uint64_t)corpus.size() || resumed->data_crc32 != corpus.crc32(),
                          "--resume: the checkpoint's data is a text of " + std::string(text) +
                              ": the run goes on with the text it was trained on");
  }
  std::string run = resumed ? resumed->run : std::string(16, ' ');
  if (!resumed) {
    if (lesson.rank() == 0) run = new_run_id();
    lesson.comm.bcast(&run[0], run.size(), 0);
  }
  if (!opts.save.empty()) {
    const std::string err = check_save_dir(lesson.comm, opts.save, run);
    lesson.usage_error_if(!err.empty(), "--save: " + err);
  }
  return run;
}

// The planted bugs of TP and SP: each needs the layout whose mistake it is.
static void check_tp_bugs(Lesson& lesson, const Options& opts) {
  lesson.usage_error_if(opts.bug == Bug::kpe_per_head && opts.tp != 1, "--bug kpe-per-head runs with --tp 1 (it is a model mistake, "
                        "not a TP one)");
  lesson.usage_error_if(opts.bug == Bug::sp_norm_grad && !opts.sp, "--bug sp-norm-grad needs sequence parallelism (--tp > 1)");
  lesson.usage_error_if(opts.bug == Bug::sp_norm_grad && (opts.bucket_mb > 0 || opts.zero == 3),
                        "--bug sp-norm-grad runs without --bucket-mb and --zero 3 (there the replicated weights' "
                        "reductions are summed over TP after DP's, and the bug forgets the sum before it)");
  lesson.usage_error_if(opts.bug == Bug::f_no_allreduce && (opts.tp == 1 || opts.sp),
                        "--bug f-no-allreduce needs --tp > 1 and --sp off (under SP, gather_seq's "
                        "reduce-scatter takes f's all-reduce's place)");
  lesson.usage_error_if(opts.bug == Bug::ce_local_softmax && opts.tp == 1, "--bug ce-local-softmax needs --tp > 1");
}

// --precision fp8's tile t. A TP rank quantizes its shards in its own tiles, from their own
// largest values, with no communication: a tile must not straddle two ranks' shards. When t divides
// each TP rank's share of every width TP splits, a rank's tiles, blocks and promoted partial sums
// are one process's (a row-parallel product's all-reduce adds what one process's promotions add;
// per-tensor scales would need their maximum all-reduced over TP first). 0: DeepSeek-V3's 128,
// or under TP the largest power of two up to 128 that divides them all.
static void resolve_fp8_tile(Lesson& lesson, Options& opts) {
  if (opts.precision != "fp8") {
    lesson.usage_error_if(opts.fp8_tile != 0 || opts.fp8_experts != "off", "--fp8-tile and --fp8-experts are for --precision fp8");
    return;
  }
  const std::vector<std::pair<std::string, int64_t>> split{
      {"--heads x (--d-nope + --d-rope)", opts.heads * (opts.d_nope + opts.d_rope)},
      {"--heads x --d-nope", opts.heads * opts.d_nope}, {"--heads x --d-v", opts.heads * opts.d_v}, {"--ffn", opts.ffn}};
  const auto divides_all = [&](int64_t t) {
    for (const auto& [what, width] : split)
      if ((width / opts.tp) % t != 0) return false;
    return true;
  };
  if (opts.fp8_tile == 0) {
    opts.fp8_tile = 128;
    while (opts.tp > 1 && !divides_all(opts.fp8_tile)) opts.fp8_tile /= 2;
    return;
  }
  if (opts.tp == 1) return;
  for (const auto& [what, width] : split)
    lesson.usage_error_if((width / opts.tp) % opts.fp8_tile != 0,
                          "--fp8-tile " + std::to_string(opts.fp8_tile) + " must divide each TP rank's share of " + what +
                              " = " + std::to_string(width) + " / --tp " + std::to_string(opts.tp) + " = " +
                              std::to_string(width / opts.tp) + " (a tile split between two ranks would take two scales, "
                              "not one process's one; 0 picks one that divides)");
}

std::optional<Setup> parse_options(Lesson& lesson, Options& opts) {
  Cli& cli = lesson.cli;
  std::string sp = "auto", bug_flag = "none";
  declare_flags(cli, opts, &sp, &bug_flag);
  lesson.parse();
  opts.bug = bug_of(bug_flag);
  std::string restored;  // --resume: the run goes on as it was saved
  const std::optional<Manifest> resumed = restore_run(lesson, opts, &restored);
  const bool no_axis = !cli.given("--tp") && !cli.given("--dp") && !cli.given("--cp") &&
                       !cli.given("--pp") && !cli.given("--ep");
  const int64_t axis_default = no_axis && lesson.size() % 16 == 0 ? 2 : 1;
  for (int64_t* a : {&opts.cp, &opts.pp, &opts.ep})
    if (*a == 0) *a = axis_default;
  if (opts.tp == 0) {  // 2 on an even world; with --dp given, what the world leaves
    if (opts.dp > 0 && lesson.size() % (opts.dp * opts.cp * opts.pp) == 0)
      opts.tp = lesson.size() / (opts.dp * opts.cp * opts.pp);
    else
      opts.tp = lesson.size() % (2 * opts.cp * opts.pp) == 0 ? 2 : 1;
  }
  opts.sp = sp == "on" || (sp == "auto" && opts.tp > 1);

  // ---- every check of the input, before any work
  if (opts.estimate == "deepseek-v3") {  // the formulas at DeepSeek-V3's shape, no run
    const std::string report =
        estimate::report(estimate::deepseek_v3(), estimate::deepseek_v3_parallel(), std::nullopt);
    lesson.print("%s", report.c_str());
    return std::nullopt;
  }
  MeshSizes sizes;
  sizes.tp = (int)opts.tp;
  sizes.cp = (int)opts.cp;
  sizes.ep = (int)opts.ep;
  sizes.pp = (int)opts.pp;
  const int64_t tcp = opts.tp * opts.cp * opts.pp;
  sizes.dp = opts.dp > 0 ? (int)opts.dp : (lesson.size() % tcp == 0 ? lesson.size() / (int)tcp : 0);
  lesson.usage_error_if(sizes.dp == 0, "--tp " + std::to_string(opts.tp) + " x --cp " + std::to_string(opts.cp) +
                                      " x --pp " + std::to_string(opts.pp) + " does not divide the world of " +
                                      std::to_string(lesson.size()) + " ranks; give --tp, --cp, --pp and --dp "
                                      "whose product is the world size");
  lesson.usage_error_if(!check_mesh(sizes, lesson.size()).empty(),
                        check_mesh(sizes, lesson.size()) + (opts.ep > 1 && sizes.world() != lesson.size()
                                                      ? " (ep is folded onto these ranks: it adds none; "
                                                        "--dp 0 takes what the others leave)"
                                                      : ""));
  if (opts.print_mesh) {
    lesson.print("mesh %s: world = dp %d x pp %d x cp %d x tp %d = %d ranks (order tp-cp-ep-dp-pp, "
                 "tp fastest)\n%s",
                 mesh_name(sizes, 0).c_str(), sizes.dp, sizes.pp, sizes.cp, sizes.tp, sizes.world(),
                 mesh_groups_text(sizes).c_str());
    for (int rank = 0; rank < lesson.size(); rank++) {
      const MeshCoords coords = mesh_coords(sizes, rank);
      const std::string ep_text =
          sizes.ep > 1 ? ", ep " + std::to_string(coords.ep) + ", edp " + std::to_string(coords.edp) : "";
      lesson.print("  rank %d: %s  tp %d, cp %d, dp %d, pp %d%s\n", rank, mesh_name(sizes, rank).c_str(),
                   coords.tp, coords.cp, coords.dp, coords.pp, ep_text.c_str());
    }
    return std::nullopt;
  }
  lesson.usage_error_if(opts.sp && opts.tp == 1, "--sp on needs --tp > 1 (sequence parallelism splits the "
                                      "tokens over the TP ranks)");
  lesson.usage_error_if(opts.ep > 1 && opts.tp > 1 && !opts.sp,
                        "--ep > 1 with --tp > 1 needs --sp on: an EP group folds over the TP ranks, and "
                        "without sequence parallelism they hold the same tokens (each would be sent to "
                        "its experts tp times)");
  lesson.usage_error_if(opts.experts % opts.ep != 0, "--experts " + std::to_string(opts.experts) + " must be a "
                        "multiple of --ep " + std::to_string(opts.ep) + " (every EP rank holds as many experts)");
  lesson.usage_error_if(opts.ep == 1 && (cli.given("--a2a") || (cli.given("--ranks-per-node") && !cli.given("--link"))),
                        "--a2a and --ranks-per-node choose how the MoE's tokens travel: they need --ep > 1 "
                        "(or, --ranks-per-node, --link)");
  // Left out: the job's real nodes when it spans several (and, for --a2a hierarchical, they cut
  // the EP groups evenly), else virtual nodes of 2 when ep is even.
  const Lesson::Network net = lesson.network(opts.ranks_per_node, opts.ep % 2 == 0 ? 2 : 1,
                                       cli.given("--link") ? &opts.link : nullptr, [&](int64_t R) {
                                         return opts.a2a != "hierarchical" || opts.ep % R == 0;
                                       });
  opts.ranks_per_node = net.ranks_per_node;
  const bool real_nodes = net.real_nodes;
  const LinkModel& link = net.link;
  if (cli.given("--link")) {
    lesson.usage_error_if(lesson.size() % opts.ranks_per_node != 0, "--link: --ranks-per-node " +
                          std::to_string(opts.ranks_per_node) + " must divide the world of " +
                          std::to_string(lesson.size()) + " ranks (virtual nodes of consecutive ranks)");
  }
  lesson.usage_error_if(opts.a2a == "hierarchical" && opts.ep % opts.ranks_per_node != 0,
                        "--ranks-per-node " + std::to_string(opts.ranks_per_node) + " must divide --ep " +
                            std::to_string(opts.ep) + " (the EP group is cut into virtual nodes)");
  lesson.usage_error_if(opts.bug == Bug::ep_grad_mean && (opts.ep == 1 || opts.ep == opts.tp),
                        "--bug ep-grad-mean needs --ep > 1 and --ep != --tp (with ep = tp, expert-DP has "
                        "dp x cp ranks and dividing by its size happens to be right)");
  lesson.usage_error_if(opts.heads % opts.tp != 0, "--heads " + std::to_string(opts.heads) + " must be a multiple "
                        "of --tp " + std::to_string(opts.tp) + " (every TP rank computes whole heads)");
  resolve_fp8_tile(lesson, opts);
  lesson.usage_error_if(opts.batch % sizes.dp != 0, "--batch " + std::to_string(opts.batch) + " must be a "
                        "multiple of dp " + std::to_string(sizes.dp) + " (every DP rank takes as many sequences)");
  const int64_t rank_batch = opts.batch / sizes.dp, seq = opts.seq;
  lesson.usage_error_if(opts.cp > 1 && seq % (2 * opts.cp) != 0,
                        "--seq " + std::to_string(seq) + " must be a multiple of 2 x --cp = " +
                            std::to_string(2 * opts.cp) + " (the zigzag layout cuts each sequence into 2 cp "
                            "equal chunks)");
  lesson.usage_error_if(opts.cp > 1 && opts.d_v > opts.d_nope + opts.d_rope,
                        "--cp > 1 needs --d-v <= --d-nope + --d-rope (the ring's blocks carry v padded to "
                        "the query/key width)");
  const int64_t seq_per_cp = seq / opts.cp;  // tokens of each sequence on one CP rank
  // PP: M micro-batches of Bm sequences each, a schedule, the layers of each stage
  // (default: 1 without PP, else 2 pp, or pp when the DP rank's sequences do not split in 2 pp)
  const int64_t microbatches = opts.microbatches > 0 ? opts.microbatches
                    : opts.pp == 1       ? 1
                    : rank_batch % (2 * opts.pp) == 0 ? 2 * opts.pp : opts.pp;
  lesson.usage_error_if(rank_batch % microbatches != 0, "--batch " + std::to_string(opts.batch) + " / dp " + std::to_string(sizes.dp) +
                        " = " + std::to_string(rank_batch) + " sequences per DP rank must be a multiple of the " +
                        std::to_string(microbatches) + " micro-batches (--microbatches; default 2 x --pp, or --pp)");
  const int64_t microbatch = rank_batch / microbatches;
  lesson.usage_error_if(opts.bug == Bug::dualpipe_no_pair_sum && opts.schedule != "dualpipe",
                        "--bug dualpipe-no-pair-sum needs --schedule dualpipe");
  lesson.usage_error_if(opts.bug == Bug::pp_mb_sum && microbatches == 1, "--bug pp-mb-sum needs more than one micro-batch "
                        "(--pp > 1 or --microbatches > 1)");
  const std::string sched_err = pp::check_args(opts.schedule, opts.pp, microbatches);
  lesson.usage_error_if(!sched_err.empty(), "--schedule " + opts.schedule + ": " + sched_err);
  const int stages = (opts.schedule == "dualpipev" ? 2 : 1) * (int)opts.pp;  // stages
  const bool sched_pairs = opts.schedule == "dualpipe" || opts.schedule == "dualpipev";  // F&B steps
  lesson.usage_error_if(opts.overlap == "compare" && !sched_pairs,
                        "--overlap compare needs a schedule with paired F&B steps (--schedule dualpipe or dualpipev)");
  std::vector<int64_t> stage_begin{0};
  if (opts.layers_per_stage.empty()) {
    if (opts.layers == 0) opts.layers = std::max<int64_t>(2, opts.dense_layers + stages);  // an MoE on every stage
    lesson.usage_error_if(opts.layers < stages, "--layers " + std::to_string(opts.layers) + " is fewer than the " +
                          std::to_string(stages) + " pipeline stages (" + opts.schedule + " on --pp " +
                          std::to_string(opts.pp) + "): every stage needs a block");
    for (int st = 0; st < stages; st++)
      stage_begin.push_back(stage_begin.back() + opts.layers / stages + (st < opts.layers % stages ? 1 : 0));
  } else {
    std::stringstream in(opts.layers_per_stage);
    std::string item;
    bool ok = true;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      const long v = std::strtol(item.c_str(), &end, 10);
      ok = ok && !item.empty() && *end == 0 && v >= 1 && v <= 64;
      stage_begin.push_back(stage_begin.back() + (ok ? v : 0));
    }
    if (opts.layers == 0) opts.layers = stage_begin.back();  // --layers: the stages' sum
    lesson.usage_error_if(!ok || (int)stage_begin.size() != stages + 1 || stage_begin.back() != opts.layers,
                          "--layers-per-stage " + opts.layers_per_stage + " must list " + std::to_string(stages) +
                         " block counts >= 1 (one per stage of " + opts.schedule + " on --pp " +
                         std::to_string(opts.pp) + "), summing to --layers " + std::to_string(opts.layers));
  }
  lesson.usage_error_if(opts.sp && (microbatch * seq_per_cp) % opts.tp != 0,
                        "--sp: the " + std::to_string(microbatch * seq_per_cp) + " tokens of a rank's micro-batch (batch / dp / "
                        "microbatches x seq / cp) must be a multiple of --tp " + std::to_string(opts.tp));
  lesson.usage_error_if(opts.dense_layers > opts.layers, "--dense-layers " + std::to_string(opts.dense_layers) +
                        " must be at most --layers " + std::to_string(opts.layers));
  lesson.usage_error_if(opts.topk > opts.experts, "--topk " + std::to_string(opts.topk) + " must be at most --experts " +
                        std::to_string(opts.experts));
  lesson.usage_error_if(opts.q_lora < 2 || opts.kv_lora < 2,
                        "--q-lora and --kv-lora must be at least 2 (the RMSNorm of a single number is "
                        "+-1 whatever it was: no gradient flows through it)");
  lesson.usage_error_if(opts.d_rope % 2 != 0, "--d-rope " + std::to_string(opts.d_rope) + " must be even (RoPE rotates pairs)");
  check_tp_bugs(lesson, opts);
  std::string bucket_why_not;
  const bool bucket_overlap = check_data_parallel(lesson, opts, sizes, &bucket_why_not);
  lesson.usage_error_if((opts.bug == Bug::local_causal_mask || opts.bug == Bug::local_rope_positions) && opts.cp == 1,
                        "--bug " + bug_name(opts.bug) + " needs --cp > 1 (with one CP rank local and global positions "
                        "are the same)");
  CharCorpus corpus;
  const std::string err = CharCorpus::try_load(opts.data, &corpus);
  lesson.usage_error_if(!err.empty(), err);
  lesson.usage_error_if(opts.seq + 1 >= corpus.split_size(CharCorpus::Split::val),
                        "--seq " + std::to_string(opts.seq) + " must be shorter than the validation split (" +
                            std::to_string(corpus.split_size(CharCorpus::Split::val)) + " bytes of " + opts.data + ")");
  if (opts.sample > 0) {
    bool ok = !opts.prompt.empty();
    for (unsigned char ch : opts.prompt) ok = ok && corpus.vocab().find((char)ch) != std::string::npos;
    lesson.usage_error_if(!ok, "--prompt must be non-empty text made of bytes of " + opts.data);
  }

  model::Config c;
  c.vocab = corpus.vocab_size(), c.dim = opts.dim, c.layers = opts.layers, c.dense_layers = opts.dense_layers;
  c.heads = opts.heads, c.d_nope = opts.d_nope, c.d_rope = opts.d_rope, c.d_v = opts.d_v;
  c.q_lora = opts.q_lora, c.kv_lora = opts.kv_lora, c.ffn = opts.ffn;
  c.experts = opts.experts, c.topk = opts.topk, c.shared = opts.shared, c.moe_ffn = opts.moe_ffn;
  c.seq_len = seq;
  const int64_t full_numel = estimate::param_count(estimate::tiny(c, rank_batch));
  // the full model three times (the mesh's copy, the reference's, the gathered one) with its
  // gradients and m, v, plus the activations of B T tokens through every layer (generously)
  const double act = 64.0 * (double)(opts.batch * seq) *
                     (double)(c.dim + c.heads * (c.qk_head_dim() * 2 + c.d_v + seq) + c.ffn +
                              c.topk * c.moe_ffn + c.vocab) * (double)c.layers * 4;
  lesson.require_memory(16.0 * 4 * (double)full_numel + act, "--dim, --layers, --batch or --seq");
  const std::string run = checkpoint_lineage(lesson, opts, resumed, corpus);  // (before corpus moves)
  return Setup{sizes, rank_batch, seq, seq_per_cp, microbatches, microbatch, stages, sched_pairs, stage_begin, link, real_nodes, std::move(corpus),
               c, full_numel, bucket_overlap, bucket_why_not, run, restored};
}

}  // namespace ff::mesh
