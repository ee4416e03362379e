// lessons/08_mesh/options.cpp — lesson 08's flags and every check of them (options.h).
#include "lessons/08_mesh/options.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "lessons/07_dualpipe/schedules.h"
#include "lessons/08_mesh/estimate.h"

namespace ff::mesh {

// Every flag of the lesson, on cli (sp: --sp's auto | on | off, decided after the parse).
static void declare_flags(Cli& cli, Options& o, std::string* sp) {
  cli.summary(
      "A tiny DeepSeek-style language model (MLA + MoE) trained on tinyshakespeare by a DP x PP x CP x "
      "TP x EP mesh (ZeRO-1, sequence parallelism, ring attention, lesson 05's expert-parallel MoE, "
      "lesson 07's pipeline schedules); every step checked against one process.");
  cli.flag("--tp", &o.tp, "tensor-parallel ranks: attention heads, dense FFN, LM head (0: 2 when "
           "the world size is even, else 1)", 0, 64);
  // The default mesh: on a world that is a multiple of 16 with no axis given, every axis is 2
  // (DP the rest): `mpirun -np 16` runs the five-axis mesh, `-np 32` the same with DP 4.
  cli.flag("--dp", &o.dp, "data-parallel ranks (0: the world size / (tp cp))", 0, 4096);
  cli.flag("--cp", &o.cp, "context-parallel ranks: each sequence's tokens in the zigzag layout, "
           "attention by lesson 02's ring (0: 2 on a world of 16k ranks with no axis given, else 1)", 0, 64);
  cli.flag("--ep", &o.ep, "expert-parallel ranks, folded onto the dp x cp x tp ranks (consecutive "
           "ranks, tp fastest): each holds experts / ep of every MoE layer (0: as --cp)", 0, 256);
  cli.choice("--a2a", &o.a2a, {"flat", "hierarchical"},
             "--ep: lesson 04's all-to-all, or lesson 05's rail-then-node one");
  cli.flag("--ranks-per-node", &o.ranks_per_node, "ranks per node, consecutive ranks: of the "
           "EP group for --a2a hierarchical, of the world for --link (0: the job's real nodes when it "
           "spans several, else virtual nodes of 2 when ep is even, of 1 when odd)", 0, 256);
  cli.flag("--link", &o.link, "model the network as lesson 05 does: intra=BW,inter=BW,latency=T "
           "(keys left out: intra=160GB/s,inter=50GB/s,latency=3us); point-to-point messages (the "
           "all-to-alls, the CP ring, the pipeline) complete when the model says", "SPEC");
  cli.flag("--pp", &o.pp, "pipeline stages' ranks: the layers cut into stages, run by lesson 07's "
           "executor (0: as --cp)", 0, 64);
  cli.choice("--schedule", &o.schedule, {"1f1b", "zb-h1", "dualpipe", "dualpipev"},
             "--pp: the pipeline schedule (lesson 07; dualpipe: two directions, every stage on two "
             "ranks; dualpipev: two stages per rank, a V)");
  cli.choice("--overlap", &o.overlap, {"on", "off"},
             "--schedule dualpipe/dualpipev: a paired step's forward and backward interleaved, each "
             "one's all-to-alls in flight while the other computes (lesson 06), or one after the other");
  cli.flag("--microbatches", &o.microbatches, "micro-batches per step, each batch / dp / M sequences "
           "(0: 1 without PP, else 2 pp, or pp when the sequences of a DP rank do not split in 2 pp)", 0, 4096);
  cli.flag("--layers-per-stage", &o.layers_per_stage, "--pp: blocks of each stage, e.g. 1,2,1 (default: "
           "an even split, the first stages taking the remainder)", "LIST");
  cli.flag("--zero", &o.zero, "ZeRO stage: 0 (all-reduce) or 1 (optimizer state sharded over DP)", 0, 1);
  cli.choice("--sp", sp, {"auto", "on", "off"}, "sequence parallelism (auto: on when tp > 1)");
  cli.toggle("--print-mesh", &o.print_mesh, "print every group of every axis and exit");
  cli.choice("--estimate", &o.estimate, {"none", "run", "deepseek-v3"},
             "memory and communication model: run (this model and mesh, after training, next to "
             "the measured bytes) or deepseek-v3 (671B; prints and exits)");
  cli.flag("--train", &o.steps, "training steps", 1, 1000000);
  cli.flag("--batch", &o.batch, "global batch: sequences per step, split over DP", 1, 4096);
  cli.flag("--seq", &o.seq, "tokens per sequence", 2, 1024);
  cli.flag("--dim", &o.dim, "model width d", 1, 4096);
  cli.flag("--layers", &o.layers, "transformer blocks (0: the dense ones and one MoE block per "
           "pipeline stage, at least 2; with --layers-per-stage, its sum)", 0, 64);
  cli.flag("--dense-layers", &o.dense_layers, "blocks with a dense SwiGLU FFN (the rest: MoE)", 0, 64);
  cli.flag("--heads", &o.heads, "attention heads (split over TP)", 1, 256);
  cli.flag("--d-nope", &o.d_nope, "query/key head width without RoPE", 1, 1024);
  cli.flag("--d-rope", &o.d_rope, "query/key head width with RoPE (even)", 2, 1024);
  cli.flag("--d-v", &o.d_v, "value head width", 1, 1024);
  cli.flag("--q-lora", &o.q_lora, "query latent rank r_q", 1, 4096);
  cli.flag("--kv-lora", &o.kv_lora, "key-value latent rank r_kv", 1, 4096);
  cli.flag("--ffn", &o.ffn, "dense SwiGLU width", 1, 16384);
  cli.flag("--experts", &o.experts, "routed experts per MoE layer", 1, 256);
  cli.flag("--topk", &o.topk, "experts per token", 1, 256);
  cli.flag("--shared", &o.shared, "shared experts", 0, 16);
  cli.flag("--moe-ffn", &o.moe_ffn, "width of each expert", 1, 16384);
  cli.flag("--lr", &o.lr, "AdamW learning rate", 0.0, 1.0);
  cli.flag("--bias-rate", &o.bias_rate, "balancing bias update speed gamma", 0.0, 1.0);
  cli.flag("--check-every", &o.check_every, "compare with one process every K steps (and the last)", 1, 1000000);
  cli.flag("--log-every", &o.log_every, "print a step line every K steps (and the last)", 1, 1000000);
  cli.flag("--val-batches", &o.val_batches, "global batches of held-out text the final "
           "validation loss averages", 1, 10000);
  // (rank 0 samples while the others wait at the check: a few seconds at most, far inside the
  // watchdog's timeout)
  cli.flag("--sample", &o.sample, "after training, generate this many bytes (rank 0)", 0, 4000);
  cli.flag("--temperature", &o.temperature, "sampling temperature", 0.01, 100.0);
  cli.flag("--prompt", &o.prompt, "the text sampling starts from", "TEXT");
  cli.flag("--data", &o.data, "the training text (its distinct bytes are the vocabulary; the default is the course's data/tinyshakespeare.txt, found from the executable)");
  cli.choice("--bug", &o.bug,
             {"none", "kpe-per-head", "sp-norm-grad", "f-no-allreduce", "ce-local-softmax",
              "zero-no-divide", "zero-stale-shard", "local-causal-mask", "local-rope-positions",
              "ep-grad-mean", "pp-mb-sum", "dualpipe-no-pair-sum"},
             "plant a known mistake (the check must FAIL)");
  cli.epilog(
      "  make run L=08                          16 ranks: DP 2 x PP 2 x CP 2 x TP 2, EP 2 folded\n"
      "  make run L=08 NP=32                    the same with DP 4\n"
      "  make run L=08 NP=4                     DP 2 x TP 2 with SP and ZeRO-1\n"
      "  make run L=08 ARGS=\"--print-mesh\"      every group of every axis\n"
      "  make run L=08 NP=1 ARGS=\"--train 2000 --check-every 500 --log-every 250 --sample 300\"\n"
      "  make run L=08 NP=1 ARGS=\"--estimate deepseek-v3\"\n"
      "Expect: per step the loss of the mesh next to one process's; check: PASS.");
}

std::optional<Setup> parse_options(Lesson& L, Options& o) {
  Cli& cli = L.cli;
  std::string sp = "auto";
  declare_flags(cli, o, &sp);
  L.parse();
  const bool no_axis = !cli.given("--tp") && !cli.given("--dp") && !cli.given("--cp") &&
                       !cli.given("--pp") && !cli.given("--ep");
  const int64_t axis_default = no_axis && L.size() % 16 == 0 ? 2 : 1;
  for (int64_t* a : {&o.cp, &o.pp, &o.ep})
    if (*a == 0) *a = axis_default;
  if (o.tp == 0) {  // 2 on an even world; with --dp given, what the world leaves
    if (o.dp > 0 && L.size() % (o.dp * o.cp * o.pp) == 0)
      o.tp = L.size() / (o.dp * o.cp * o.pp);
    else
      o.tp = L.size() % (2 * o.cp * o.pp) == 0 ? 2 : 1;
  }
  o.sp = sp == "on" || (sp == "auto" && o.tp > 1);

  // ---- every check of the input, before any work
  if (o.estimate == "deepseek-v3") {  // the formulas at DeepSeek-V3's shape, no run
    const std::string report =
        estimate::report(estimate::deepseek_v3(), estimate::deepseek_v3_parallel(), std::nullopt);
    L.print("%s", report.c_str());
    return std::nullopt;
  }
  MeshSizes sizes;
  sizes.tp = (int)o.tp;
  sizes.cp = (int)o.cp;
  sizes.ep = (int)o.ep;
  sizes.pp = (int)o.pp;
  const int64_t tcp = o.tp * o.cp * o.pp;
  sizes.dp = o.dp > 0 ? (int)o.dp : (L.size() % tcp == 0 ? L.size() / (int)tcp : 0);
  L.usage_error_if(sizes.dp == 0, "--tp " + std::to_string(o.tp) + " x --cp " + std::to_string(o.cp) +
                                      " x --pp " + std::to_string(o.pp) + " does not divide the world of " +
                                      std::to_string(L.size()) + " ranks; give --tp, --cp, --pp and --dp "
                                      "whose product is the world size");
  L.usage_error_if(!check_mesh(sizes, L.size()).empty(),
                   check_mesh(sizes, L.size()) + (o.ep > 1 && sizes.world() != L.size()
                                                      ? " (ep is folded onto these ranks: it adds none; "
                                                        "--dp 0 takes what the others leave)"
                                                      : ""));
  if (o.print_mesh) {
    L.print("mesh %s: world = dp %d x pp %d x cp %d x tp %d = %d ranks (order tp-cp-ep-dp-pp, "
            "tp fastest)\n%s",
            mesh_name(sizes, 0).c_str(), sizes.dp, sizes.pp, sizes.cp, sizes.tp, sizes.world(),
            mesh_groups_text(sizes).c_str());
    for (int rank = 0; rank < L.size(); rank++) {
      const MeshCoords coords = mesh_coords(sizes, rank);
      const std::string ep_text =
          sizes.ep > 1 ? ", ep " + std::to_string(coords.ep) + ", edp " + std::to_string(coords.edp) : "";
      L.print("  rank %d: %s  tp %d, cp %d, dp %d, pp %d%s\n", rank, mesh_name(sizes, rank).c_str(),
              coords.tp, coords.cp, coords.dp, coords.pp, ep_text.c_str());
    }
    return std::nullopt;
  }
  L.usage_error_if(o.sp && o.tp == 1, "--sp on needs --tp > 1 (sequence parallelism splits the "
                                      "tokens over the TP ranks)");
  L.usage_error_if(o.ep > 1 && o.tp > 1 && !o.sp,
                   "--ep > 1 with --tp > 1 needs --sp on: an EP group folds over the TP ranks, and "
                   "without sequence parallelism they hold the same tokens (each would be sent to "
                   "its experts tp times)");
  L.usage_error_if(o.experts % o.ep != 0, "--experts " + std::to_string(o.experts) + " must be a "
                   "multiple of --ep " + std::to_string(o.ep) + " (every EP rank holds as many experts)");
  L.usage_error_if(o.ep == 1 && (cli.given("--a2a") || (cli.given("--ranks-per-node") && !cli.given("--link"))),
                   "--a2a and --ranks-per-node choose how the MoE's tokens travel: they need --ep > 1 "
                   "(or, --ranks-per-node, --link)");
  // Left out: the job's real nodes when it spans several (and, for --a2a hierarchical, they cut
  // the EP groups evenly), else virtual nodes of 2 when ep is even.
  const Lesson::Network net = L.network(o.ranks_per_node, o.ep % 2 == 0 ? 2 : 1,
                                       cli.given("--link") ? &o.link : nullptr, [&](int64_t R) {
                                         return o.a2a != "hierarchical" || o.ep % R == 0;
                                       });
  o.ranks_per_node = net.ranks_per_node;
  const bool real_nodes = net.real_nodes;
  const LinkModel& link = net.link;
  if (cli.given("--link")) {
    L.usage_error_if(L.size() % o.ranks_per_node != 0, "--link: --ranks-per-node " +
                     std::to_string(o.ranks_per_node) + " must divide the world of " +
                     std::to_string(L.size()) + " ranks (virtual nodes of consecutive ranks)");
  }
  L.usage_error_if(o.a2a == "hierarchical" && o.ep % o.ranks_per_node != 0,
                   "--ranks-per-node " + std::to_string(o.ranks_per_node) + " must divide --ep " +
                       std::to_string(o.ep) + " (the EP group is cut into virtual nodes)");
  L.usage_error_if(o.bug == "ep-grad-mean" && (o.ep == 1 || o.ep == o.tp),
                   "--bug ep-grad-mean needs --ep > 1 and --ep != --tp (with ep = tp, expert-DP has "
                   "dp x cp ranks and dividing by its size happens to be right)");
  L.usage_error_if(o.heads % o.tp != 0, "--heads " + std::to_string(o.heads) + " must be a multiple "
                   "of --tp " + std::to_string(o.tp) + " (every TP rank computes whole heads)");
  L.usage_error_if(o.batch % sizes.dp != 0, "--batch " + std::to_string(o.batch) + " must be a "
                   "multiple of dp " + std::to_string(sizes.dp) + " (every DP rank takes as many sequences)");
  const int64_t B = o.batch / sizes.dp, T = o.seq;
  L.usage_error_if(o.cp > 1 && T % (2 * o.cp) != 0,
                   "--seq " + std::to_string(T) + " must be a multiple of 2 x --cp = " +
                       std::to_string(2 * o.cp) + " (the zigzag layout cuts each sequence into 2 cp "
                       "equal chunks)");
  L.usage_error_if(o.cp > 1 && o.d_v > o.d_nope + o.d_rope,
                   "--cp > 1 needs --d-v <= --d-nope + --d-rope (the ring's blocks carry v padded to "
                   "the query/key width)");
  const int64_t Tc = T / o.cp;  // tokens of each sequence on one CP rank
  // PP: M micro-batches of Bm sequences each, a schedule, the layers of each stage
  // (default: 1 without PP, else 2 pp, or pp when the DP rank's sequences do not split in 2 pp)
  const int64_t M = o.microbatches > 0 ? o.microbatches
                    : o.pp == 1       ? 1
                    : B % (2 * o.pp) == 0 ? 2 * o.pp : o.pp;
  L.usage_error_if(B % M != 0, "--batch " + std::to_string(o.batch) + " / dp " + std::to_string(sizes.dp) +
                   " = " + std::to_string(B) + " sequences per DP rank must be a multiple of the " +
                   std::to_string(M) + " micro-batches (--microbatches; default 2 x --pp, or --pp)");
  const int64_t Bm = B / M;
  L.usage_error_if(o.bug == "dualpipe-no-pair-sum" && o.schedule != "dualpipe",
                   "--bug dualpipe-no-pair-sum needs --schedule dualpipe");
  L.usage_error_if(o.bug == "pp-mb-sum" && M == 1, "--bug pp-mb-sum needs more than one micro-batch "
                   "(--pp > 1 or --microbatches > 1)");
  const std::string sched_err = pp::check_args(o.schedule, o.pp, M);
  L.usage_error_if(!sched_err.empty(), "--schedule " + o.schedule + ": " + sched_err);
  const int S = (o.schedule == "dualpipev" ? 2 : 1) * (int)o.pp;  // stages
  const bool sched_pairs = o.schedule == "dualpipe" || o.schedule == "dualpipev";  // F&B steps
  std::vector<int64_t> stage_begin{0};
  if (o.layers_per_stage.empty()) {
    if (o.layers == 0) o.layers = std::max<int64_t>(2, o.dense_layers + S);  // an MoE on every stage
    L.usage_error_if(o.layers < S, "--layers " + std::to_string(o.layers) + " is fewer than the " +
                     std::to_string(S) + " pipeline stages (" + o.schedule + " on --pp " +
                     std::to_string(o.pp) + "): every stage needs a block");
    for (int st = 0; st < S; st++)
      stage_begin.push_back(stage_begin.back() + o.layers / S + (st < o.layers % S ? 1 : 0));
  } else {
    std::stringstream in(o.layers_per_stage);
    std::string item;
    bool ok = true;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      const long v = std::strtol(item.c_str(), &end, 10);
      ok = ok && !item.empty() && *end == 0 && v >= 1 && v <= 64;
      stage_begin.push_back(stage_begin.back() + (ok ? v : 0));
    }
    if (o.layers == 0) o.layers = stage_begin.back();  // --layers: the stages' sum
    L.usage_error_if(!ok || (int)stage_begin.size() != S + 1 || stage_begin.back() != o.layers,
                     "--layers-per-stage " + o.layers_per_stage + " must list " + std::to_string(S) +
                         " block counts >= 1 (one per stage of " + o.schedule + " on --pp " +
                         std::to_string(o.pp) + "), summing to --layers " + std::to_string(o.layers));
  }
  L.usage_error_if(o.sp && (Bm * Tc) % o.tp != 0,
                   "--sp: the " + std::to_string(Bm * Tc) + " tokens of a rank's micro-batch (batch / dp / "
                   "microbatches x seq / cp) must be a multiple of --tp " + std::to_string(o.tp));
  L.usage_error_if(o.dense_layers > o.layers, "--dense-layers " + std::to_string(o.dense_layers) +
                   " must be at most --layers " + std::to_string(o.layers));
  L.usage_error_if(o.topk > o.experts, "--topk " + std::to_string(o.topk) + " must be at most --experts " +
                   std::to_string(o.experts));
  L.usage_error_if(o.q_lora < 2 || o.kv_lora < 2,
                   "--q-lora and --kv-lora must be at least 2 (the RMSNorm of a single number is "
                   "+-1 whatever it was: no gradient flows through it)");
  L.usage_error_if(o.d_rope % 2 != 0, "--d-rope " + std::to_string(o.d_rope) + " must be even (RoPE rotates pairs)");
  const bool bug_kpe = o.bug == "kpe-per-head";
  L.usage_error_if(bug_kpe && o.tp != 1, "--bug kpe-per-head runs with --tp 1 (it is a model mistake, "
                   "not a TP one)");
  L.usage_error_if(o.bug == "sp-norm-grad" && !o.sp, "--bug sp-norm-grad needs sequence parallelism (--tp > 1)");
  L.usage_error_if(o.bug == "f-no-allreduce" && (o.tp == 1 || o.sp),
                   "--bug f-no-allreduce needs --tp > 1 and --sp off (under SP, gather_seq's "
                   "reduce-scatter takes f's all-reduce's place)");
  L.usage_error_if(o.bug == "ce-local-softmax" && o.tp == 1, "--bug ce-local-softmax needs --tp > 1");
  L.usage_error_if(o.bug.rfind("zero-", 0) == 0 && (o.zero != 1 || sizes.dp * sizes.cp == 1),
                   "--bug " + o.bug + " needs --zero 1 and dp x cp > 1");
  L.usage_error_if((o.bug == "local-causal-mask" || o.bug == "local-rope-positions") && o.cp == 1,
                   "--bug " + o.bug + " needs --cp > 1 (with one CP rank local and global positions "
                   "are the same)");
  CharCorpus corpus;
  const std::string err = CharCorpus::try_load(o.data, &corpus);
  L.usage_error_if(!err.empty(), err);
  L.usage_error_if(o.seq + 1 >= corpus.split_size(CharCorpus::Split::val),
                   "--seq " + std::to_string(o.seq) + " must be shorter than the validation split (" +
                       std::to_string(corpus.split_size(CharCorpus::Split::val)) + " bytes of " + o.data + ")");
  if (o.sample > 0) {
    bool ok = !o.prompt.empty();
    for (unsigned char ch : o.prompt) ok = ok && corpus.vocab().find((char)ch) != std::string::npos;
    L.usage_error_if(!ok, "--prompt must be non-empty text made of bytes of " + o.data);
  }

  model::Config c;
  c.vocab = corpus.vocab_size(), c.dim = o.dim, c.layers = o.layers, c.dense_layers = o.dense_layers;
  c.heads = o.heads, c.d_nope = o.d_nope, c.d_rope = o.d_rope, c.d_v = o.d_v;
  c.q_lora = o.q_lora, c.kv_lora = o.kv_lora, c.ffn = o.ffn;
  c.experts = o.experts, c.topk = o.topk, c.shared = o.shared, c.moe_ffn = o.moe_ffn;
  c.seq_len = T;
  const int64_t full_numel = estimate::param_count(estimate::tiny(c, B));
  // the full model three times (the mesh's copy, the reference's, the gathered one) with its
  // gradients and m, v, plus the activations of B T tokens through every layer (generously)
  const double act = 64.0 * (double)(o.batch * T) *
                     (double)(c.dim + c.heads * (c.qk_head_dim() * 2 + c.d_v + T) + c.ffn +
                              c.topk * c.moe_ffn + c.vocab) * (double)c.layers * 4;
  L.require_memory(16.0 * 4 * (double)full_numel + act, "--dim, --layers, --batch or --seq");

  return Setup{sizes, B, T, Tc, M, Bm, S, sched_pairs, stage_begin, link, real_nodes, std::move(corpus),
               c, full_numel, bug_kpe};
}

}  // namespace ff::mesh
