// lessons/09_inference/options.cpp — lesson 09's flags (options.h).
#include "lessons/09_inference/options.h"

#include <algorithm>
#include <cstdlib>

#include "common/util/files.h"
#include "lessons/08_mesh/checkpoint_io.h"

namespace ff::infer {

namespace {

struct ModelFlag {
  const char* name;
  int64_t* value;
  int64_t model::Config::*field;
};

}  // namespace

Setup parse_options(Lesson& lesson, Options& opts) {
  Cli& cli = lesson.cli;
  opts.data = course_data_file("tinyshakespeare.txt");
  cli.flag("--checkpoint", &opts.checkpoint, "a lesson 08 checkpoint (its directory, or a --save directory: the "
           "newest step-*) to serve; the model is the checkpoint's (model flags given must agree). Default: the "
           "same model initialised from --seed");
  cli.choice("--cache", &opts.cache, {"kv", "latent", "absorbed", "all"},
             "what each layer keeps per token: kv (per-head K and V), latent (c_kv and k_pe, K and V re-expanded "
             "each step), absorbed (the latent cache, W_uk folded into the query and W_uv into the output); all: "
             "each of the three");
  cli.flag("--prompts", &opts.prompts, "the prompts, separated by |; --batch takes them in turn", "TEXT");
  cli.flag("--batch", &opts.batch, "sequences decoded together (different lengths: each its own positions)", 1, 256);
  cli.flag("--new", &opts.new_tokens, "tokens generated per sequence (greedy)", 1, 4096);
  cli.toggle("--bf16", &opts.bf16, "serve bf16 weights: the matmuls' weights rounded to bf16 (lesson 10's mixed "
             "precision) and read as bf16 by every decode step; embedding, norms and router float32");
  cli.toggle("--int8", &opts.int8, "serve int8 weights (symmetric, a scale per output channel, seed 002's): "
             "their memory, the logits' error and the validation perplexity against float32, the bytes generated");
  cli.flag("--val-batches", &opts.val_batches, "--int8, --bf16: validation batches (8 x 64 bytes) for the perplexity", 1, 1000);
  cli.choice("--bug", &opts.bug, {"none", "rope-off-by-one", "absorb-transposed", "cache-skip-layer", "int8-per-tensor"},
             "plant a bug: rope-off-by-one (decode rotates by position + 1), absorb-transposed (each head's "
             "W_uk^T made by a reshape, not a transpose), cache-skip-layer (the last layer never caches a decoded token): the check fails; "
             "int8-per-tensor (--int8 with one scale per tensor): no check fails, the int8 error grows");
  cli.choice("--moe-comm", &opts.moe_comm, {"alltoall", "allreduce"},
             "over several ranks, how the MoE's tokens meet their experts: alltoall (DeepEP's low-latency "
             "dispatch and combine: each rank routes its share of the rows) or allreduce (DeepSeek-V3's "
             "inference/model.py, seed 002: every rank all rows through its experts, one all-reduce)");
  cli.flag("--speed", &opts.speed, "after the check, time --new decode steps at each of these batch sizes (e.g. "
           "1,8; one process): tokens/s and the memory bandwidth a step uses (seed 002's measure)", "LIST");
  cli.flag("--link", &opts.link, "model the network as lessons 05 and 08 do: intra=BW,inter=BW,latency=T (keys "
           "left out: intra=160GB/s,inter=50GB/s,latency=3us); the decode's messages and collectives complete when "
           "the model says", "SPEC");
  cli.flag("--ranks-per-node", &opts.ranks_per_node, "--link: ranks per node, consecutive ranks (0: the job's real "
           "nodes when it spans several, else one node)", 0, 256);
  cli.flag("--data", &opts.data, "the text whose distinct bytes are the vocabulary (lesson 08's; the default is "
           "the course's data/tinyshakespeare.txt, found from the executable)");
  const ModelFlag model_flags[] = {
      {"--dim", &opts.dim, &model::Config::dim},          {"--layers", &opts.layers, &model::Config::layers},
      {"--dense-layers", &opts.dense_layers, &model::Config::dense_layers},
      {"--heads", &opts.heads, &model::Config::heads},    {"--d-nope", &opts.d_nope, &model::Config::d_nope},
      {"--d-rope", &opts.d_rope, &model::Config::d_rope}, {"--d-v", &opts.d_v, &model::Config::d_v},
      {"--q-lora", &opts.q_lora, &model::Config::q_lora}, {"--kv-lora", &opts.kv_lora, &model::Config::kv_lora},
      {"--ffn", &opts.ffn, &model::Config::ffn},          {"--experts", &opts.experts, &model::Config::experts},
      {"--topk", &opts.topk, &model::Config::topk},       {"--shared", &opts.shared, &model::Config::shared},
      {"--moe-ffn", &opts.moe_ffn, &model::Config::moe_ffn}};
  for (const ModelFlag& f : model_flags)
    cli.flag(f.name, f.value, std::string("model: as lesson 08's ") + f.name, f.name == std::string("--dense-layers") ||
             f.name == std::string("--shared") ? 0 : 1, 16384);
  cli.epilog(
      "examples:\n"
      "  make run L=09\n"
      "  make run L=09 ARGS=\"--cache absorbed --batch 8 --new 64\"\n"
      "  make run L=08 NP=1 ARGS=\"--train 600 --save /tmp/ck\" && make run L=09 ARGS=\"--checkpoint /tmp/ck\"\n");
  lesson.parse();

  Setup s;
  const std::string err = CharCorpus::try_load(opts.data, &s.corpus);
  lesson.usage_error_if(!err.empty(), "--data: " + err);
  // the model: the flags', or the checkpoint's (then every model flag given must agree)
  model::Config& c = s.c;
  for (const ModelFlag& f : model_flags) c.*f.field = *f.value;
  c.vocab = s.corpus.vocab_size();
  if (!opts.checkpoint.empty()) {
    model::Config saved;
    const std::string bad = mesh::checkpoint_model(lesson.comm, opts.checkpoint, &saved);
    lesson.usage_error_if(!bad.empty(), "--checkpoint: " + bad);
    for (const ModelFlag& f : model_flags)
      lesson.usage_error_if(cli.given(f.name) && saved.*f.field != *f.value,
                            std::string("--checkpoint: the checkpoint's model has ") + (f.name + 2) + " = " +
                                std::to_string(saved.*f.field) + ", the flags " + std::to_string(*f.value));
    lesson.usage_error_if(saved.vocab != c.vocab,
                          "--checkpoint: the checkpoint's model has a vocabulary of " + std::to_string(saved.vocab) +
                              " bytes, --data " + opts.data + " " + std::to_string(c.vocab));
    c = saved;
  }
  try {
    c.validate();
  } catch (const Error& e) {
    lesson.usage_error_if(true, e.what());
  }
  // the prompts, each byte in the vocabulary
  std::vector<std::string> texts;
  for (size_t at = 0;;) {
    const size_t bar = opts.prompts.find('|', at);
    texts.push_back(opts.prompts.substr(at, bar == std::string::npos ? std::string::npos : bar - at));
    if (bar == std::string::npos) break;
    at = bar + 1;
  }
  for (const std::string& t : texts) {
    lesson.usage_error_if(t.empty(), "--prompts: an empty prompt (each needs at least one byte; | separates them)");
    for (unsigned char ch : t)
      lesson.usage_error_if(s.corpus.vocab().find((char)ch) == std::string::npos,
                            "--prompts: the byte " + std::to_string((int)ch) + " ('" + std::string(1, (char)ch) +
                                "') is not in the vocabulary of " + opts.data + " (" +
                                std::to_string(s.corpus.vocab_size()) + " distinct bytes)");
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < opts.batch; b++) {
    s.prompts.push_back(s.corpus.encode(texts[(size_t)b % texts.size()]));
    longest = std::max<int64_t>(longest, (int64_t)s.prompts.back().size());
  }
  s.capacity = longest + opts.new_tokens;
  for (const char* k : {"kv", "latent", "absorbed"})
    if (opts.cache == "all" || opts.cache == k)
      s.kinds.push_back(k == std::string("kv") ? CacheKind::kv : k == std::string("latent") ? CacheKind::latent
                                                                                           : CacheKind::absorbed);
  s.bug = opts.bug == "rope-off-by-one" ? Bug::rope_off_by_one
          : opts.bug == "absorb-transposed" ? Bug::absorb_transposed
          : opts.bug == "cache-skip-layer" ? Bug::cache_skip_layer : Bug::none;
  s.int8_per_tensor = opts.bug == "int8-per-tensor";
  s.bf16 = opts.bf16;
  lesson.usage_error_if(opts.bf16 && opts.int8, "--bf16 and --int8: one or the other (the served weights are bf16 or int8)");
  lesson.usage_error_if(s.bug != Bug::none && opts.new_tokens < 2,
                        "--bug " + opts.bug + " plants its bug in the decode steps: it needs --new 2 or more "
                        "(--new 1 is prefill alone)");
  lesson.usage_error_if(s.int8_per_tensor && !opts.int8, "--bug int8-per-tensor plants its bug in the int8 weights: it needs --int8");
  lesson.usage_error_if((opts.int8 || opts.bf16) && s.corpus.split_size(CharCorpus::Split::val) <= 65,
                        std::string(opts.int8 ? "--int8" : "--bf16") + ": the validation text of " + opts.data + " is too short for a 64-byte window");
  s.moe_comm = opts.moe_comm == "allreduce" ? MoeComm::allreduce : MoeComm::alltoall;
  // the world: heads over the ranks (TP), routed experts over the ranks (EP)
  const int P = lesson.size();
  lesson.usage_error_if(c.heads % P != 0, std::to_string(P) + " ranks: the " + std::to_string(c.heads) +
                        " heads must split evenly over them (tensor parallelism by head)");
  lesson.usage_error_if(c.layers > c.dense_layers && c.experts % P != 0,
                        std::to_string(P) + " ranks: the " + std::to_string(c.experts) +
                            " routed experts must split evenly over them (expert parallelism)");
  lesson.usage_error_if(s.bug == Bug::absorb_transposed && opts.cache != "absorbed" && opts.cache != "all",
                        "--bug absorb-transposed lives in the absorbed attention: it needs --cache absorbed or all");
  // --link: the network, over nodes of --ranks-per-node ranks (all on one node by default)
  lesson.usage_error_if(cli.given("--ranks-per-node") && !cli.given("--link"),
                        "--ranks-per-node places the ranks for --link: give --link too");
  const Lesson::Network net = lesson.network(opts.ranks_per_node, P, cli.given("--link") ? &opts.link : nullptr);
  lesson.usage_error_if(P % net.ranks_per_node != 0, "--ranks-per-node " + std::to_string(net.ranks_per_node) +
                        " must divide the world of " + std::to_string(P) + " ranks (virtual nodes of consecutive ranks)");
  s.link = net.link;
  // --speed: batch sizes, one process
  for (size_t at = 0; !opts.speed.empty();) {
    const size_t comma = opts.speed.find(',', at);
    const std::string item = opts.speed.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    char* end = nullptr;
    const long long b = std::strtoll(item.c_str(), &end, 10);
    lesson.usage_error_if(item.empty() || *end != '\0' || b < 1 || b > 256,
                          "--speed " + opts.speed + ": a list of batch sizes in [1, 256], e.g. 1,8");
    s.speed_batches.push_back(b);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  lesson.usage_error_if(!s.speed_batches.empty() && P > 1, "--speed times one process: run it with 1 rank");
  // memory: the weights, the largest cache, and the reference forward's scores (H T^2 per layer)
  const double weights = 4.0 * (double)c.layers *
                             (double)(c.dim * (c.q_lora + c.kv_lora + c.d_rope) +
                                      c.q_lora * c.heads * c.qk_head_dim() + c.kv_lora * c.heads * (c.d_nope + c.d_v) +
                                      c.heads * c.d_v * c.dim + 3 * c.dim * std::max(c.ffn, (c.experts + c.shared) * c.moe_ffn)) +
                         8.0 * (double)(c.vocab * c.dim);
  const double cache = 4.0 * (double)(opts.batch * s.capacity * c.layers * cache_floats_per_token(c, CacheKind::kv, c.heads));
  const double reference = 4.0 * 4 * (double)(c.heads * s.capacity * s.capacity + s.capacity * c.dim * 8);
  int64_t speed_batch = 0;
  for (int64_t b : s.speed_batches) speed_batch = std::max(speed_batch, b);
  const double speed = s.speed_batches.empty() ? 0.0
                       : 256.0 * (1 << 20) + 4.0 * (double)(speed_batch * s.capacity * c.layers *
                                                             cache_floats_per_token(c, CacheKind::kv, c.heads));
  // the full weights, this rank's shard of them (the decoder's), and under --int8 the int8 model beside the float32 one
  const double models = weights * (opts.int8 ? 3 : 2);
  lesson.require_memory(models + 2 * cache + reference + speed, "--batch, --new, --speed or the model's sizes");
  return s;
}

}  // namespace ff::infer
