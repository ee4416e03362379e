// Lesson 08's memory and communication calculator (lessons/08_mesh/estimate.h). Checks, each
// against something independent of the formula under test:
//   1. param_count equals the elements common/layers/model.cpp allocates (init_params'
//      named_parameters) for several configurations, and its split into routed experts and
//      the rest equals the split by parameter name;
//   2. DeepSeek-V3 comes out within 3% of its published 671B total and 37B activated;
//   3. the ZeRO formulas give hand-computed bytes for stages 0-3 and agree with
//      lessons/08_mesh/zero.h's own formulas;
//   4. the 5D memory model divides each part by its own axes and by no other;
//   5. the communication volumes equal hand-computed values;
//   6. bad configurations are refused, and the report keeps its lines under 100 characters.
#include <doctest/doctest.h>

#include <cmath>
#include <sstream>
#include <string>

#include "common/core/check.h"
#include "common/layers/model.h"
#include "lessons/08_mesh/zero.h"
#include "lessons/08_mesh/estimate.h"

using namespace ff;
using namespace ff::estimate;

// Elements of every named parameter, and of those whose name says "experts_w" (the routed
// experts: "layers.<i>.moe.experts_w1" and so on).
struct Allocated {
  int64_t total = 0, routed = 0;
};
static Allocated allocated(const model::Config& c) {
  const model::Params p = model::init_params(c, 1);
  Allocated a;
  for (const auto& n : p.named_parameters()) {
    a.total += n.t.numel();
    if (n.name.find("experts_w") != std::string::npos) a.routed += n.t.numel();
  }
  return a;
}

TEST_CASE("estimate: param_count equals what model.cpp allocates") {
  model::Config base;  // the default tiny model: 1 dense block, 1 MoE block, 1 shared expert
  model::Config dense_only = base;
  dense_only.dense_layers = dense_only.layers = 3;
  model::Config moe_no_shared = base;
  moe_no_shared.dense_layers = 0, moe_no_shared.shared = 0, moe_no_shared.layers = 3;
  model::Config odd = base;  // every size different, so a swapped letter shows
  odd.vocab = 37, odd.dim = 24, odd.heads = 3, odd.d_nope = 10, odd.d_rope = 6, odd.d_v = 7;
  odd.q_lora = 20, odd.kv_lora = 12, odd.ffn = 40, odd.experts = 5, odd.topk = 3;
  odd.shared = 2, odd.moe_ffn = 9, odd.layers = 4, odd.dense_layers = 2;
  for (const model::Config& c : {base, dense_only, moe_no_shared, odd}) {
    CAPTURE(c.layers);
    CAPTURE(c.dense_layers);
    CAPTURE(c.shared);
    const ModelShape m = tiny(c, 1);
    const Allocated a = allocated(c);
    const ParamCounts n = count_params(m);
    CHECK(param_count(m) == a.total);
    CHECK(n.expert() == a.routed);
    CHECK(n.dense() == a.total - a.routed);
    int64_t blocks = 0;
    for (int64_t i = 0; i < m.layers; i++) blocks += block_param_count(m, i);
    CHECK(blocks + 2 * m.vocab * m.dim + m.dim == a.total);  // + embed, head, final norm
  }
  // The default model by hand: embed 4160, head 4160, final norm 64; per block MLA + norms
  // 64 + 2048 + 32 + 3072 + 2048 + 32 + 2048 + 2048 + 512 + 4096 + 64 = 16064; dense FFN
  // 3·64·128 = 24576; router 64·8 = 512; routed 3·8·64·32 = 49152; shared 3·64·32 = 6144.
  const ModelShape m = tiny(base, 1);
  CHECK(param_count(m) == 4160 + 4160 + 64 + 2 * 16064 + 24576 + 512 + 49152 + 6144);
  CHECK(count_params(m).expert() == 49152);
  // Activated: 2 of the 8 routed experts, 6 of 8 left out (each 3·64·32 = 6144).
  CHECK(activated_param_count(m) == param_count(m) - 6 * 6144);
}

TEST_CASE("estimate: DeepSeek-V3 has about 671B parameters, about 37B activated") {
  const ModelShape m = deepseek_v3();
  const double total = (double)param_count(m), active = (double)activated_param_count(m);
  CAPTURE(total);
  CAPTURE(active);
  CHECK(std::fabs(total / 671e9 - 1) < 0.03);
  CHECK(std::fabs(active / 37e9 - 1) < 0.03);
  // the routed experts: 58 MoE blocks x 256 experts x 3 matrices of 7168 x 2048
  CHECK(count_params(m).expert() == 58LL * 256 * 3 * 7168 * 2048);
  CHECK(m.moe_layers() == 58);
}

TEST_CASE("estimate: ZeRO bytes per rank, stages 0-3") {
  const double N = 1200;
  const int W = 4;  // N/W = 300
  // seed 001's mixed precision: 16N, 4N + 12N/W, 2N + 14N/W, 16N/W
  const double mixed[] = {19200, 4800 + 3600, 2400 + 4200, 4800};
  // fp32 (zero.h): 4N + 4N + 8N, 4N + 4N + 8N/W, 4N + 4N/W + 8N/W, 16N/W
  const double fp32[] = {19200, 9600 + 2400, 4800 + 1200 + 2400, 4800};
  for (int s = 0; s <= 3; s++) {
    CAPTURE(s);
    CHECK(zero_bytes(N, W, s, kMixed).total() == mixed[s]);
    CHECK(zero_bytes(N, W, s, kFp32).total() == fp32[s]);
    CHECK(zero_bytes(N, W, s, kMixed).total() == zero::mixed_precision_bytes(1200, W, s));
    CHECK(zero_bytes(N, W, s, kMixed).activations == 0);
  }
  // what each stage shards
  const Memory one = zero_bytes(N, W, 1, kMixed), two = zero_bytes(N, W, 2, kMixed),
               three = zero_bytes(N, W, 3, kMixed);
  CHECK(one.params == 2400);
  CHECK(one.grads == 2400);
  CHECK(one.optimizer == 3600);
  CHECK(two.grads == 600);
  CHECK(two.params == 2400);
  CHECK(three.params == 600);
  // zero.h's fp32 formula for the stages it implements (W divides N: no padding)
  for (int s = 0; s <= 1; s++) {
    const zero::Memory z = zero::formula(1200, W, s);
    const Memory e = zero_bytes(N, W, s, kFp32);
    CHECK(e.params == (double)z.params);
    CHECK(e.grads == (double)z.grads);
    CHECK(e.optimizer == (double)z.optimizer);
  }
  CHECK_THROWS_AS(zero_bytes(N, W, 4, kMixed), ff::Error);
}

static Parallel mesh(int tp, int pp, int dp, int cp, int ep, int zero = 0) {
  Parallel p;
  p.tp = tp, p.pp = pp, p.dp = dp, p.cp = cp, p.ep = ep, p.zero = zero;
  return p;
}

TEST_CASE("estimate: the 5D memory model divides by the right axes") {
  model::Config c;
  c.layers = 4, c.dense_layers = 1;  // 3 MoE blocks, so pp up to 4 keeps blocks on each stage
  const ModelShape m = tiny(c, 2);
  const ParamCounts n = count_params(m);
  const RankParams base = rank_params(m, mesh(1, 1, 1, 1, 1));
  CHECK(base.dense == (double)n.dense());
  CHECK(base.expert == (double)n.expert());

  SUBCASE("tp halves the dense parameters only") {
    const RankParams r = rank_params(m, mesh(2, 1, 1, 1, 1));
    CHECK(r.dense == base.dense / 2);
    CHECK(r.expert == base.expert);
  }
  SUBCASE("ep halves the expert parameters only") {
    const RankParams r = rank_params(m, mesh(1, 1, 2, 1, 2));
    CHECK(r.dense == base.dense);
    CHECK(r.expert == base.expert / 2);
  }
  SUBCASE("pp halves both; dp and cp neither") {
    const RankParams r = rank_params(m, mesh(1, 2, 1, 1, 1));
    CHECK(r.dense == base.dense / 2);
    CHECK(r.expert == base.expert / 2);
    const RankParams d = rank_params(m, mesh(1, 1, 2, 2, 1));
    CHECK(d.dense == base.dense);
    CHECK(d.expert == base.expert);
  }
  SUBCASE("activations: micro_batch · seq/cp · dim/tp · C_act, per layer") {
    // 2 sequences x 32 tokens x 64 wide x 34 bytes, 16-bit
    const double none = 2.0 * 32 * 64 * 34;
    CHECK(activation_bytes_per_layer(m, mesh(1, 1, 1, 1, 1), Recompute::none, kMixed) == none);
    CHECK(activation_bytes_per_layer(m, mesh(1, 1, 1, 1, 1), Recompute::none, kFp32) ==
          2 * none);
    CHECK(activation_bytes_per_layer(m, mesh(1, 1, 1, 1, 1), Recompute::selective, kMixed) ==
          none * 16 / 34);
    CHECK(activation_bytes_per_layer(m, mesh(1, 1, 1, 1, 1), Recompute::full, kMixed) ==
          none * 2 / 34);
    CHECK(activation_bytes_per_layer(m, mesh(2, 1, 1, 1, 1), Recompute::none, kMixed) ==
          none / 2);
    CHECK(activation_bytes_per_layer(m, mesh(1, 1, 1, 2, 1), Recompute::none, kMixed) ==
          none / 2);
    // dp, pp and ep leave one layer's activations alone (micro_batch is already per rank)
    CHECK(activation_bytes_per_layer(m, mesh(1, 2, 2, 1, 2), Recompute::none, kMixed) == none);
    // per rank: L/pp layers
    CHECK(memory_per_rank(m, mesh(1, 1, 1, 1, 1), Recompute::none, kMixed).activations ==
          4 * none);
    CHECK(memory_per_rank(m, mesh(1, 2, 1, 1, 1), Recompute::none, kMixed).activations ==
          2 * none);
  }
  SUBCASE("optimizer, gradients and parameters follow the ZeRO stage over dp") {
    const double phi = base.total();
    for (int zero = 0; zero <= 3; zero++) {
      CAPTURE(zero);
      const Memory one = memory_per_rank(m, mesh(1, 1, 1, 1, 1, zero), Recompute::full, kMixed);
      const Memory two = memory_per_rank(m, mesh(1, 1, 2, 1, 1, zero), Recompute::full, kMixed);
      CHECK(one.params == 2 * phi);
      CHECK(one.grads == 2 * phi);
      CHECK(one.optimizer == 12 * phi);
      CHECK(two.optimizer == (zero >= 1 ? 6 * phi : 12 * phi));
      CHECK(two.grads == (zero >= 2 ? phi : 2 * phi));
      CHECK(two.params == (zero >= 3 ? phi : 2 * phi));
      CHECK(two.activations == one.activations);
    }
  }
  SUBCASE("folded ZeRO groups: dense over dp·cp, experts over expert-DP") {
    // dp 4, ep 4: the seed shards everything over 4; folded, the experts have expert-DP 1
    const Parallel p = mesh(1, 1, 4, 1, 4, 1);
    const RankParams r = rank_params(m, p);
    const Memory seed = memory_per_rank(m, p, Recompute::full, kMixed, ZeroGroups::seed);
    const Memory folded = memory_per_rank(m, p, Recompute::full, kMixed, ZeroGroups::folded);
    CHECK(seed.optimizer == 12 * (r.dense / 4 + r.expert / 4));
    CHECK(folded.optimizer == 12 * (r.dense / 4 + r.expert / 1));
    // cp 2 joins the dense weights' group: dp·cp = 4; expert-DP = 2·2/2 = 2
    const Parallel q = mesh(1, 1, 2, 2, 2, 1);
    const RankParams s = rank_params(m, q);
    CHECK(memory_per_rank(m, q, Recompute::full, kMixed, ZeroGroups::folded).optimizer ==
          12 * (s.dense / 4 + s.expert / 2));
  }
  SUBCASE("the stages add up to the model") {
    const Parallel p = mesh(2, 3, 1, 1, 2);  // 4 blocks over 3 stages: 2, 1, 1
    double dense = 0, expert = 0;
    for (const RankParams& s : stage_params(m, p)) dense += s.dense * 2, expert += s.expert * 2;
    CHECK(dense == doctest::Approx((double)n.dense()));
    CHECK(expert == doctest::Approx((double)n.expert()));
    // stage 0: the embedding and blocks 0 (dense) and 1 (MoE)
    const RankParams s0 = stage_params(m, p)[0];
    CHECK(s0.dense * 2 == (double)(m.vocab * m.dim + block_param_count(m, 0) +
                                   block_param_count(m, 1) - n.expert() / 3));
  }
}

TEST_CASE("estimate: communication volumes") {
  const ModelShape m = tiny(model::Config{}, 2);  // 2 x 32 tokens, d 64
  Parallel p = mesh(1, 2, 1, 1, 2);
  p.micro_batches = 4;
  // n_μ (S-1) B_μ L d = 4 · 1 · 2 · 32 · 64
  CHECK(pp_volume(m, p) == 16384);
  // Φ_r = Φ_dense + Φ_expert / ep = (120896 - 49152) + 49152 / 2; 2 Φ_r (S-1)
  const double phi_r = (120896 - 49152) + 49152 / 2;
  CHECK(zero3_volume(m, p, true) == 2 * phi_r);
  CHECK(zero3_volume(m, p, false) == 4 * 2 * phi_r);
  // TP against FSDP: Llama-70B, B = 16 tokens, D = 8192
  CHECK(tp_volume_per_layer(16, 8192) == 524288);
  CHECK(fsdp_volume_per_layer(8192) == 268435456);
  CHECK(tp_volume_per_layer(16, 8192) / fsdp_volume_per_layer(8192) == 16.0 / 8192);
}

// Characters (UTF-8 code points) of the longest line, and whether any line ends in a space.
static void check_lines(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  size_t longest = 0;
  bool trailing = false;
  while (std::getline(in, line)) {
    size_t chars = 0;
    for (unsigned char ch : line) chars += (ch & 0xC0) != 0x80;
    if (chars > longest) longest = chars;
    if (!line.empty() && line.back() == ' ') trailing = true;
  }
  CHECK(longest < 100);
  CHECK_FALSE(trailing);
}

TEST_CASE("estimate: configurations refused, and the report") {
  const ModelShape m = tiny(model::Config{}, 1);
  CHECK(check(m, mesh(1, 1, 2, 1, 2)).empty());
  CHECK(check(m, mesh(1, 1, 2, 1, 3)).find("ep 3") != std::string::npos);  // ep | dp·cp·tp
  CHECK(check(m, mesh(1, 3, 1, 1, 1)).find("pp 3") != std::string::npos);  // 2 layers only
  CHECK(check(m, mesh(1, 1, 1, 1, 1, 4)).find("zero") != std::string::npos);
  CHECK(check(m, mesh(0, 1, 1, 1, 1)) != "");
  CHECK_THROWS_AS(report(m, mesh(1, 1, 2, 1, 3)), ff::Error);

  const Parallel ds = deepseek_v3_parallel();
  CHECK(ds.world() == 2048);
  CHECK(ds.edp() == 2);
  CHECK(check(deepseek_v3(), ds).empty());
  const std::string big = report(deepseek_v3(), ds);
  check_lines(big);
  CHECK(big.find("= 1 x 16 x 128 = 2048") != std::string::npos);  // seed 000's formula
  CHECK(big.find("= 131072 counts EP's ranks twice") != std::string::npos);
  CHECK(big.find("TP moves 512.0x fewer bytes") != std::string::npos);  // Llama-70B, B = 16

  Parallel p = mesh(2, 2, 1, 1, 2, 1);
  p.micro_batches = 3;
  Measured got;
  got.params = 4321, got.bytes_params = 4 * 4321, got.bytes_grads = 4 * 4321;
  got.bytes_optimizer = 8 * 4321;
  const std::string small = report(m, p, got);
  check_lines(small);
  CHECK(small.find("4,321") != std::string::npos);
  CHECK(report(m, p).find("this run") == std::string::npos);
}
