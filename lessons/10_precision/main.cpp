// Lesson 10 — precision: what bf16 and FP8 keep of a number, DeepSeek-V3's FP8 GEMM (whose
// narrow accumulator needs promotion and whose outliers need fine-grained scales), and training
// in mixed precision with float32 master weights sharded by ZeRO.
//
// What: the two formats every large model now trains in, written out (formats.h) and checked
//   against every device's kernels bit for bit, then measured (measure.h); then training.
//   [1] bf16: float32's sign and 8 exponent bits with 7 of its 23 mantissa bits, rounded to
//       nearest, ties to even. Half the bytes, float32's range, about 2.4 decimal digits.
//   [2] the bf16 matmul: bf16 operands, float32 sums (a product of two bf16 values is exact in
//       float32); against float64 sums of the same bf16 operands it is within the float32
//       accumulation bound, so what bf16 costs is the rounding of the inputs, not the sums.
//   [3] FP8 e4m3 as DeepSeek-V3 trains its GEMMs (technical report, section 3.3): a scale per
//       1 x 128 tile of activations and per 128 x 128 block of weights (--tile), the products
//       summed in the tensor core's accumulator, which keeps about 14 mantissa bits on the H800
//       (--acc-bits), and every 128 products (--promote) the partial sum promoted: scaled and
//       added in float32. Swept over K, the ranks taking the K values in turn: the error of the
//       recipe, of the same GEMM never promoted, of a float32 accumulator, and on activations
//       with outlier channels, of one scale per tensor instead of per tile. Then a linear
//       layer with its three GEMMs in FP8 (common/layers/fp8_linear.h: Fprop, Dgrad, Wgrad).
//   [4] lesson 08's model trained by data-parallel ranks with its matmul weights and their
//       gradients in bf16, AdamW's float32 masters, m and v sharded by lesson 08's ZeRO
//       (mixed.h; --zero, --grad-reduce, --moments bf16, --precision fp32 to compare, or fp8:
//       the linear layers' GEMMs in FP8, common/layers/fp8_linear.h's layer in the model).
// Why: bf16 halves the bytes of every weight, gradient and activation that crosses a link or
//   sits in memory (lessons 08 and 09 count them); FP8 halves them again and doubles the tensor
//   cores' rate, and the two remedies here are what make it train. The masters are what make
//   bf16 train: an update under half a bf16 step of its weight is lost without them.
// Check: the device's conversion, quantization and GEMM equal formats.cpp's loops bit for bit;
//   bf16 rounding within half a bf16 step (2^-8 relative); the bf16 matmul within
//   gamma_K sum|a||b| of float64; the promoted FP8 GEMM within its derived bound of float64
//   over the dequantized operands at every K; at the largest K the unpromoted one at least 10x
//   its error, and per-tile scales closer to float64 than one per tensor on outliers; the FP8
//   layer's three GEMMs = formats.cpp's recipe bit for bit, each within its bound. [4] every
//   step against one process in the same precision: the loss, the mean gradients within a bf16
//   bound, AdamW's new weights bit for bit; the replicas' bits; memory per rank = the formula.
// Run:  make run L=10                                   (2 ranks: [1]-[3], then [4])
//       make run L=10 ARGS="--part formats --k-max 16384 --acc-bits 13"
//       make run L=10 ARGS="--device sim"
//       make run L=10 NP=4 ARGS="--part train --zero 2 --grad-reduce bf16"
//       make run L=10 ARGS="--part train --precision fp8"
//       make run L=10 ARGS="--bug no-promotion"        (also bf16-truncate, per-tensor,
//                                                       fp8-dgrad-untransposed, no-master)
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/lesson/lesson.h"
#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "kernels/kernels.h"
#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/layers/model.h"
#include "common/lesson/corpus.h"
#include "common/util/files.h"
#include "common/util/trace.h"
#include "lessons/08_mesh/zero.h"
#include "lessons/10_precision/formats.h"
#include "common/layers/fp8_linear.h"
#include "lessons/10_precision/measure.h"
#include "lessons/10_precision/mixed.h"

using namespace ff;
using namespace ff::precision;

namespace {

struct Options {
  std::string part = "all";
  // [1]-[3] the formats
  int64_t m = 8, n = 128, k_max = 4096, tile = 128, promote = 128, acc_bits = 14, bf16_k = 1024;
  double outlier = 1e4;
  // [4] training
  std::string precision = "bf16", grad_reduce = "fp32", moments = "fp32", data = course_data_file("tinyshakespeare.txt");
  std::string fp8_experts = "off";
  int64_t steps = 20, zero = 1, batch = 8, seq = 32, log_every = 5, check_every = 1;
  double lr = 3e-3;
  std::string bug = "none";
  bool formats() const { return part != "train"; }
  bool training() const { return part != "formats"; }
};

// --csv: one file, a row per K of the FP8 sweep (kind fp8) and per training step (kind train)
const char* const kCsvHeader =
    "kind,k,m,n,promote,acc_bits,recipe,recipe_ratio,never,fp32_acc,fine,per_tensor,"
    "precision,zero,grad_reduce,no_master,dp,step,loss,loss_ref,bf16_moved,dp_bytes,lr,moments";

FormatBug bug_of(const std::string& name) {
  return name == "bf16-truncate" ? FormatBug::bf16_truncate
         : name == "no-promotion" ? FormatBug::no_promotion
         : name == "per-tensor"   ? FormatBug::per_tensor
                                  : FormatBug::none;
}

// ---- [1]-[3] the formats

// A few numbers and what bf16 keeps of them (rank 0 prints).
void print_bf16_examples(Lesson& L, FormatBug bug) {
  L.print("[1] bf16: float32's sign and exponent, 7 of its 23 mantissa bits, rounded to nearest even\n");
  L.print("  %-26s %-12s %-6s %-16s %s\n", "x", "float32", "bf16", "bf16 value", "relative error");
  const struct { const char* what; float x; } rows[] = {
      {"1/3", 1.f / 3},
      {"pi", 3.14159265f},
      {"1 + 2^-8 (a tie)", 1.f + std::ldexp(1.f, -8)},
      {"1 + 3 2^-8 (a tie)", 1.f + 3 * std::ldexp(1.f, -8)},
      {"1000.5", 1000.5f},
      {"2^-130 (subnormal)", std::ldexp(1.f, -130)},
      {"3.4e38 (past bf16's max)", 3.4e38f},
  };
  for (const auto& row : rows) {
    const uint16_t h = round_to_bf16(row.x, bug);
    const float back = widen_bf16(h);
    char err[32] = "-";
    if (std::isfinite(back)) std::snprintf(err, sizeof err, "%.2e", std::fabs((double)back - row.x) / std::fabs(row.x));
    L.print("  %-26s 0x%08x   0x%04x %-16.9g %s\n", row.what, float_bits(row.x), h, back, err);
  }
}

// ---- the flags, every check of them before any work

void parse(Lesson& L, Options& o) {
  L.cli.summary("Lesson 10: precision. bf16 and FP8 e4m3 written out and checked against every device's "
                "kernels; the bf16 matmul against float64; DeepSeek-V3's FP8 GEMM (fine-grained scales, a "
                "narrow accumulator promoted every 128 products) swept over K by the ranks.");
  L.cli.flag("--m", &o.m, "[3] rows of the activations (tokens)", 1, 4096);
  L.cli.flag("--n", &o.n, "[3] columns of the weights (output features)", 1, 4096);
  L.cli.flag("--k-max", &o.k_max, "[3] the largest K: the sweep doubles from --tile up to it", 1, 1 << 20);
  L.cli.flag("--tile", &o.tile, "[3] the scales' tile: activations 1 x TILE, weights TILE x TILE (DeepSeek-V3: 128)",
             1, 1 << 20);
  L.cli.flag("--promote", &o.promote, "[3] products summed in the narrow accumulator before each promotion "
             "(N_C; DeepSeek-V3: 128); must divide --tile", 1, 1 << 20);
  L.cli.flag("--acc-bits", &o.acc_bits, "[3] mantissa bits the tensor core's accumulator keeps (H800: about 14; "
             "23: float32)", 1, 23);
  L.cli.flag("--outlier", &o.outlier, "[3] the outlier channels' factor (every 256th channel of the activations)",
             1.0, 1e6);
  L.cli.flag("--bf16-k", &o.bf16_k, "[2] K of the bf16 matmul (64 x K times K x 64)", 1, 1 << 20);
  L.cli.choice("--part", &o.part, {"all", "formats", "train"}, "formats: [1]-[3]; train: [4]; all: both");
  L.cli.choice("--precision", &o.precision, {"bf16", "fp32", "fp8"},
               "[4] bf16: the matmul weights and their gradients bf16, AdamW's masters float32; fp32: all float32; "
               "fp8: float32 weights, the linear layers' three GEMMs in FP8 as [3] (--tile, --promote, --acc-bits)");
  L.cli.choice("--fp8-experts", &o.fp8_experts, {"off", "on"}, "[4] --precision fp8: the experts' grouped GEMMs "
               "(routed and shared) in FP8 too, as DeepSeek-V3 runs them (off: float32)");
  L.cli.choice("--grad-reduce", &o.grad_reduce, {"fp32", "bf16"}, "[4] the gradients' sum over the ranks in float32 or bf16");
  L.cli.choice("--moments", &o.moments, {"fp32", "bf16"}, "[4] AdamW's m and v in float32, or in bf16 (DeepSeek-V3's "
               "choice: 2 bytes each, widened for each step's update and rounded back)");
  L.cli.flag("--zero", &o.zero, "[4] ZeRO stage: 0 (all-reduce, AdamW everywhere), 1 (masters, m and v sharded), 2 "
             "(gradients sharded too; ZeRO-3 over bf16 weights is lesson 08's --zero 3 --precision bf16)", 0, 2);
  L.cli.flag("--train", &o.steps, "[4] training steps", 1, 100000);
  L.cli.flag("--batch", &o.batch, "[4] sequences per step, split over the ranks", 1, 4096);
  L.cli.flag("--seq", &o.seq, "[4] tokens per sequence", 2, 1024);
  L.cli.flag("--lr", &o.lr, "[4] AdamW's learning rate", 0.0, 1.0);
  L.cli.flag("--log-every", &o.log_every, "[4] a step line every K steps (and the last)", 1, 100000);
  L.cli.flag("--check-every", &o.check_every, "[4] one process's loss and gradients every K steps (and the last); "
             "AdamW's bits every step", 1, 100000);
  L.cli.flag("--data", &o.data, "[4] the training text (default: the course's data/tinyshakespeare.txt)", "FILE");
  L.cli.choice("--bug", &o.bug, {"none", "bf16-truncate", "no-promotion", "per-tensor", "fp8-dgrad-untransposed",
                                 "no-master"},
               "plant a mistake: bf16 by truncation, the FP8 GEMM never promoted, one scale per tensor, the FP8 "
               "layer's Dgrad by W instead of W^T, AdamW's update on the bf16 weights themselves (no float32 master)");
  L.parse();
  if (o.training()) {
    L.usage_error_if(o.batch % L.size() != 0, "--batch " + std::to_string(o.batch) + " must be a multiple of the " +
                                                  std::to_string(L.size()) + " ranks (each its share of the sequences)");
    CharCorpus corpus;
    const std::string err = CharCorpus::try_load(o.data, &corpus);
    L.usage_error_if(!err.empty(), "--data: " + err);
    L.usage_error_if(o.seq >= corpus.split_size(CharCorpus::Split::train),
                     "--seq " + std::to_string(o.seq) + " must be shorter than the training text");
    L.usage_error_if(o.bug == "no-master" && o.precision != "bf16", "--bug no-master needs --precision bf16");
    L.usage_error_if(o.fp8_experts == "on" && o.precision != "fp8", "--fp8-experts on needs --precision fp8");
    L.usage_error_if(o.precision != "bf16" && o.grad_reduce == "bf16",
                     "--grad-reduce bf16 needs --precision bf16 (float32 gradients are summed in float32)");
  }
  L.usage_error_if(!o.formats() && (o.bug == "bf16-truncate" || o.bug == "no-promotion" || o.bug == "per-tensor" ||
                                    o.bug == "fp8-dgrad-untransposed"),
                   "--bug " + o.bug + " plants a mistake in the formats: --part all or formats");
  L.usage_error_if(!o.training() && o.bug == "no-master", "--bug no-master plants it in the training: --part all or train");
  L.usage_error_if(L.dumping(), "--dump: lesson 10 writes no tensors (its figures read --csv)");
  if (o.formats() || (o.training() && o.precision == "fp8")) {
    L.usage_error_if(o.tile % o.promote != 0, "--promote " + std::to_string(o.promote) + " must divide --tile " +
                                                  std::to_string(o.tile) + " (a promoted chunk lies in one tile)");
    L.usage_error_if(o.tile > 1024, "--tile " + std::to_string(o.tile) + ": at most 1024 (DeepSeek-V3's is 128)");
  }
  if (o.formats()) {
    L.usage_error_if(o.k_max < o.tile, "--k-max " + std::to_string(o.k_max) + " must be at least --tile " +
                                           std::to_string(o.tile));
    // the cost: per K, about 8 GEMMs of M K N multiply-adds (the FP8 ones, their float64
    // references, the bound); the layer, 6 of 64 (2 tile)^2
    const double work = 8 * (double)o.m * (double)o.k_max * (double)o.n, layer = 6 * 64 * 4.0 * o.tile * o.tile;
    L.usage_error_if(work > 4e10, "--m x --k-max x --n = " + std::to_string((double)o.m * o.k_max * o.n) +
                                      " multiply-adds per GEMM, about 8 GEMMs each: at most 5e9 (lower --m, --n or --k-max)");
    (void)layer;
    // memory: the operands in float32 and float64, a few copies each, and the layer's W
    L.require_memory(6 * 12.0 * ((double)o.m * o.k_max + (double)o.k_max * o.n + (double)o.m * o.n) +
                         40.0 * 4 * o.tile * o.tile,
                     "--m, --n, --k-max or --tile");
  }
  if (o.training()) {
    // rank 0's one process runs the whole batch: about 2 KB of activations per token per layer
    L.usage_error_if(o.batch * o.seq > 65536, "--batch x --seq = " + std::to_string(o.batch * o.seq) +
                                                  " tokens: at most 65536 (rank 0's one process runs the whole batch)");
  }
}

// [1]-[3]: the formats, checked against the device's kernels and float64.
void formats(Lesson& L, const Options& o, CheckReport& check) {
  const FormatBug bug = bug_of(o.bug);
  const uint64_t seed = (uint64_t)L.flags.seed;
  char line[256];

  // ---- [1] bf16
  print_bf16_examples(L, bug);
  const Bf16Result b = check_bf16(L.device, bug, seed);
  L.print("  %lld floats (every one of the 65536 high halves with six low halves, and 20000 ~ N(0, 1)): worst "
          "relative error %.3e (half a bf16 step: 2^-8 = %.3e)\n\n",
          (long long)b.compared, b.worst_rel, std::ldexp(1.0, -8));
  std::snprintf(line, sizeof line, "bf16: %s's conversion = round_to_bf16, bit for bit", device_name(L.device));
  check.holds(line, b.same_bits);
  check.holds("bf16: every normal float32 within half a bf16 step (2^-8 relative)", b.worst_rel <= std::ldexp(1.0, -8));

  // ---- [2] the bf16 matmul
  const MatmulResult mm = check_bf16_matmul(L.device, 64, o.bf16_k, 64, seed + 10);
  L.print("[2] bf16 matmul, 64 x %lld times %lld x 64 on %s, float32 sums:\n", (long long)o.bf16_k,
          (long long)o.bf16_k, device_name(L.device));
  L.print("  against float64 of the same bf16 operands  %.2e relative  (worst element %.3f of gamma_K sum|a||b|)\n",
          mm.rel_bf16, mm.ratio);
  L.print("  against float64 of the float32 inputs      %.2e relative  (the inputs' rounding, each within 2^-8)\n\n",
          mm.rel_inputs);
  check.holds("bf16 matmul within gamma_K sum|a||b| of float64 over the same bf16 operands", mm.ratio <= 1);

  // ---- [3] FP8: the sweep over K, each rank its K values in turn, gathered on every rank
  std::vector<int64_t> ks;
  for (int64_t k = o.tile; k <= o.k_max; k *= 2) ks.push_back(k);
  std::vector<double> table(ks.size() * KRow::kFields, 0.0);
  for (size_t i = (size_t)L.rank(); i < ks.size(); i += (size_t)L.size()) {
    const KRow r = sweep_k(L.device, {o.m, o.n, o.tile, o.promote, o.acc_bits, o.outlier}, ks[i], bug, seed + 100 + i);
    std::memcpy(&table[i * KRow::kFields], &r, sizeof r);
  }
  L.comm.allreduce(table.data(), (int)table.size(), MPI_DOUBLE, MPI_SUM);
  std::vector<KRow> rows(ks.size());
  std::memcpy(rows.data(), table.data(), table.size() * sizeof(double));

  L.print("[3] FP8 e4m3 GEMM, %lld x K times K x %lld, relative error against float64 (%d ranks, K in turn):\n",
          (long long)o.m, (long long)o.n, L.size());
  L.print("  recipe: 1 x %lld and %lld x %lld tiles, promoted every %lld products (DeepSeek-V3's); never: one\n"
          "  scale along K, never promoted; both in a %lld-bit accumulator. fp32: the recipe, float32's.\n",
          (long long)o.tile, (long long)o.tile, (long long)o.tile, (long long)o.promote, (long long)o.acc_bits);
  L.print("  %-6s %-8s  %-8s  %-15s %-8s  | %-8s  %s\n", "K", "recipe", "/bound", "never (/recipe)", "fp32",
          "per tile", "per tensor (outliers)");
  std::string csv;
  bool within = true, same = true;
  for (const KRow& r : rows) {
    L.print("  %-6lld %.2e  %.2e  %.2e %6.1fx %.2e  | %.2e  %.2e\n", (long long)r.k, r.recipe,
            r.recipe_ratio, r.never, r.never / r.recipe, r.fp32_acc, r.fine, r.per_tensor);
    within = within && r.recipe_ratio <= 1;
    same = same && r.same_bits == 1;
    char row[256];
    std::snprintf(row, sizeof row, "fp8,%lld,%lld,%lld,%lld,%lld,%.6e,%.6e,%.6e,%.6e,%.6e,%.6e,,,,,,,,,,,,\n", (long long)r.k,
                  (long long)o.m, (long long)o.n, (long long)o.promote, (long long)o.acc_bits, r.recipe,
                  r.recipe_ratio, r.never, r.fp32_acc, r.fine, r.per_tensor);
    csv += row;
  }
  L.print("  /bound: the recipe's worst element over its bound (measure.cpp, bound_ratio); outliers: every\n"
          "  256th channel x%g, the product of the others against float64 of the float32 inputs\n\n", o.outlier);
  L.csv_append(kCsvHeader, csv);
  std::snprintf(line, sizeof line, "FP8: %s's quantization and GEMM = formats.cpp's loops, bit for bit",
                device_name(L.device));
  if (bug == FormatBug::none || bug == FormatBug::bf16_truncate) check.holds(line, same);  // (the FP8 bugs change the loops)
  check.holds("FP8 GEMM, promoted: within its bound of float64 at every K", within);
  // the claim of the report: the narrow accumulator's error grows with K unless promoted.
  // Checked once K holds 8 chunks or more (below, the two GEMMs are nearly one)
  const KRow& last = rows.back();
  if (last.k < 8 * (double)o.promote)
    L.print("  note: the largest K, %lld, holds fewer than 8 chunks of %lld: the claims (never promoted 10x worse, "
            "per tile closer than per tensor) are checked from K = %lld\n", (long long)last.k, (long long)o.promote,
            (long long)(8 * o.promote));
  if (last.k >= 8 * (double)o.promote) {
    std::snprintf(line, sizeof line, "FP8 GEMM at K = %lld: never promoted %.1fx the promoted error (at least 10x)",
                  (long long)last.k, last.never / last.recipe);
    // (with 21 bits or more the accumulator is nearly float32's: nothing for promotion to fix)
    if (o.acc_bits <= 20)
      check.holds(line, last.never >= 10 * last.recipe);
    else
      L.print("  note: --acc-bits %lld: never promoted %.1fx the promoted error (the claim is checked at 20 "
              "bits or fewer)\n", (long long)o.acc_bits, last.never / last.recipe);
    std::snprintf(line, sizeof line, "FP8 at K = %lld, outlier channels: per-tile scales %.2e, per tensor %.2e "
                  "(per tile the closer)", (long long)last.k, last.fine, last.per_tensor);
    check.holds(line, last.fine < last.per_tensor);
  }

  // ---- [3] and the linear layer: Fprop, Dgrad and Wgrad in FP8 (fp8_linear.h)
  Fp8Recipe recipe;
  recipe.tile = o.tile, recipe.promote = o.promote, recipe.acc_bits = (int)o.acc_bits;
  recipe.bug_dgrad_untransposed = o.bug == "fp8-dgrad-untransposed";
  // 64 tokens, W two tiles a side (square: the planted bug multiplies by W itself)
  const int64_t tokens = 64, width = 2 * o.tile;
  const LayerResult layer = check_fp8_layer(L.device, tokens, width, width, recipe, seed + 7);
  L.print("  a linear layer y = x W in FP8, x (%lld, %lld), W (%lld, %lld), as DeepSeek-V3 trains one (each GEMM's\n"
          "  operands quantized online, the first in 1 x %lld tiles, the second in %lld x %lld blocks; on %s):\n",
          (long long)tokens, (long long)width, (long long)width, (long long)width, (long long)o.tile,
          (long long)o.tile, (long long)o.tile, device_name(L.device));
  const char* gemms[3] = {"Fprop  y  = x W   ", "Dgrad  dx = dy W^T", "Wgrad  dW = x^T dy"};
  for (int k = 0; k < 3; k++)
    L.print("    %s  %.2e against float64 (bf16: %.2e), %.1e of its bound\n", gemms[k], layer.rel[k],
            layer.rel_bf16[k], layer.ratio[k]);
  L.print("\n");
  check.holds("FP8 linear layer: Fprop, Dgrad and Wgrad = formats.cpp's recipe on their operands, bit for bit",
              layer.same);
  check.holds("FP8 linear layer: each GEMM within its bound of float64 over its dequantized operands",
              layer.ratio[0] <= 1 && layer.ratio[1] <= 1 && layer.ratio[2] <= 1);
}

// ---- [4] mixed-precision training, data parallel

// "12.3 KiB"
std::string kib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f KiB", bytes / 1024);
  return s;
}

// Bytes a step's collectives moved on comm (Comm's counters: payload bytes), and a reset.
size_t bytes_moved(Comm& comm) {
  size_t b = 0;
  for (const auto& [op, count] : comm.collective_counts()) b += count.bytes;
  comm.reset_collective_counts();
  return b;
}

// [slide:mixed-step]
// Lesson 08's model in bf16 (its matmul weights; --precision fp32: none; fp8: float32 weights,
// the linear layers' GEMMs in FP8) trained by every rank
// on its share of each global batch, the gradients averaged and AdamW stepped by lesson 08's ZeRO
// over the world: the float32 masters, m and v sharded (ZeRO-1, -2) or whole on every rank
// (ZeRO-0). Every step checked against one process in the same precision (rank 0's Twin).
void train(Lesson& L, const Options& o, CheckReport& check) {
  const bool bf16 = o.precision == "bf16", fp8 = o.precision == "fp8", root = L.rank() == 0;
  // fp8: every forward of the model, the ranks' and the one process's, runs its linear layers
  // through fp8_linear while `layers` lives (the training); else matmul
  const fp8::Fp8Recipe recipe{o.tile, o.promote, (int)o.acc_bits};
  const model::LinearScope layers(fp8 ? fp8::fp8_linears(recipe) : model::LinearFn{});
  const moe::ExpertGemmScope experts(o.fp8_experts == "on" ? fp8::fp8_expert_gemms(recipe) : moe::GemmFn{});
  const int dp = L.size();
  const uint64_t seed = (uint64_t)L.flags.seed;
  CharCorpus corpus = CharCorpus::load(o.data);
  model::Config c;
  c.vocab = corpus.vocab_size(), c.seq_len = o.seq;
  model::Params p = model::init_params(c, seed, L.device);
  if (bf16) p.hold_matmuls_in_bf16();  // Megatron's layout: the weights themselves are bf16
  std::vector<model::NamedTensor> named = p.named_parameters();
  std::vector<Tensor*> params;
  std::vector<std::string> names;
  int64_t n16 = 0, n32 = 0;
  for (model::NamedTensor& n : named) {
    params.push_back(&n.t), names.push_back(n.name);
    (n.t.dtype() == DType::bf16 ? n16 : n32) += n.t.numel();
  }
  // the optimizer: AdamW with float32 masters, sharded over the ranks by lesson 08's ZeRO
  AdamConfig adam;
  adam.lr = o.lr;
  adam.master_weights = o.bug != "no-master";  // the planted bug at ZeRO-0
  adam.bf16_moments = o.moments == "bf16";
  Comm data = L.comm.split(0, L.rank());       // the training's collectives, counted apart
  zero::GroupAdam opt(data, adam, (int)o.zero, o.bug == "no-master" ? zero::Bug::no_master : zero::Bug::none);
  for (size_t k = 0; k < params.size(); k++) opt.add(params[k], k);
  opt.layout();
  opt.buckets().reduce_in_bf16(o.grad_reduce == "bf16");
  Comm check_comm = L.comm.split(0, L.rank());  // the check's traffic, apart
  Twin twin(c, seed, L.device, bf16, adam, root);

  char fp8_what[160];
  std::snprintf(fp8_what, sizeof fp8_what, "float32 weights, the linear layers' GEMMs in FP8 (1 x %lld and %lld x "
                "%lld scales, promoted every %lld products from a %lld-bit accumulator)", (long long)o.tile,
                (long long)o.tile, (long long)o.tile, (long long)o.promote, (long long)o.acc_bits);
  char held[96] = ", all float32";
  if (n16) std::snprintf(held, sizeof held, ": %lld bf16 in its matmuls, %lld float32: embedding, norms, router",
                         (long long)n16, (long long)n32);
  L.print("\n[4] mixed-precision training: lesson 08's model (%lld parameters%s), %s, data parallel over %d ranks, "
          "ZeRO-%lld, gradients reduced in %s; batch %lld x %lld tokens, AdamW lr %g%s\n",
          (long long)(n16 + n32), held,
          fp8 ? fp8_what : !bf16 ? "float32" : o.bug == "no-master" ? "bf16 weights WITHOUT float32 masters (--bug no-master)"
                                                                   : "bf16 weights with float32 masters",
          dp, (long long)o.zero, o.grad_reduce == "bf16" ? "bf16" : "float32", (long long)o.batch, (long long)o.seq, o.lr,
          adam.bf16_moments ? ", its m and v in bf16" : "");
  L.print("  %-5s %-12s %-12s %-9s %-10s %-7s %-9s %s\n", "step", "loss (mesh)", "(1 proc)", "/bound", "grad /bound",
          "AdamW", "bf16 moved", "DP bytes");
  const double n_terms = (double)(o.batch * o.seq), eps = std::numeric_limits<float>::epsilon();
  double worst_loss = 0, worst_grad = 0, last_loss = 0;
  int64_t checked = 0;  // steps one process checked (rank 0)
  std::string adam_differs, worst_grad_at = "-";
  bool replicas_agree = true;
  size_t step_bytes = 0;
  std::ostringstream csv;
  csv.precision(9);
  L.start_trace();  // --trace: each step's training on the compute track
  for (int64_t step = 0; step < o.steps; step++) {
    const int64_t rows = o.batch / dp, row0 = L.rank() * rows;
    // 1. one process's loss and gradients on the whole batch, from the same weights
    const bool checking = step % o.check_every == 0 || step + 1 == o.steps;
    double loss_ref = NAN;
    // (bf16, fp8: the shares as the ranks compute them, summed as they sum them: see mixed.h)
    if (root && checking) {
      const int shares = bf16 || fp8 ? dp : 1;
      std::vector<CharCorpus::Batch> batches;
      for (int r = 0; r < shares; r++)
        batches.push_back(corpus.batch(CharCorpus::Split::train, step, o.batch, o.seq, r * (o.batch / shares),
                                       (r + 1) * (o.batch / shares), seed));
      loss_ref = twin.loss_and_grads(batches, o.grad_reduce == "bf16");
    }
    // 2. this rank's share: forward and backward (bf16 weights give bf16 gradients)
    std::optional<Trace::Scope> span;
    span.emplace(trace(), "step " + std::to_string(step), "compute");
    const CharCorpus::Batch b = corpus.batch(CharCorpus::Split::train, step, o.batch, o.seq, row0, row0 + rows, seed);
    for (Tensor* w : params) w->zero_grad();
    const model::Output out = model::forward(c, p, b.inputs.to(L.device), b.targets.to(L.device),
                                             model::positions(o.seq, L.device));
    run_backward(out.loss, Tensor::full({}, 1.f, L.device));
    std::vector<std::vector<float>> before;  // the bf16 weights before the step: did it move them?
    for (Tensor* w : params)
      if (w->dtype() == DType::bf16) before.push_back(w->to_vector());
    // 3. the mean gradient over the ranks and AdamW (ZeRO: on this rank's shard of the masters)
    opt.step();
    span.reset();
    step_bytes = bytes_moved(data);
    // the check: the mesh's loss and mean gradients against one process's, AdamW bit for bit
    double loss = out.loss.item();
    L.comm.allreduce(&loss, 1, MPI_DOUBLE, MPI_SUM);
    loss /= dp;
    const std::vector<Tensor> means = opt.mean_grads(check_comm);
    int64_t moved = 0, i16 = 0;
    for (Tensor* w : params)
      if (w->dtype() == DType::bf16) {
        const std::vector<float> now = w->to_vector();
        for (size_t e = 0; e < now.size(); e++) moved += now[e] != before[(size_t)i16][e];
        i16++;
      }
    uint64_t h = params_hash(params);
    std::vector<uint64_t> hashes((size_t)dp);
    check_comm.allgather(&h, sizeof h, hashes.data());
    replicas_agree = replicas_agree && std::all_of(hashes.begin(), hashes.end(), [&](uint64_t x) { return x == h; });
    std::string adam_step = "=";
    double loss_ratio = NAN, grad_worst = NAN;
    if (root && checking) {
      grad_worst = 0, checked++;
      loss_ratio = std::fabs(loss - loss_ref) / (kLossBound * n_terms * eps * std::max(1.0, std::fabs(loss_ref)));
      for (size_t k = 0; k < params.size(); k++) {
        const double r = twin.grad_ratio(k, means[k], n_terms);
        if (!(r <= worst_grad)) worst_grad = r, worst_grad_at = names[k] + ", step " + std::to_string(step);
        grad_worst = std::max(grad_worst, r);
      }
      worst_loss = std::max(worst_loss, std::isnan(loss_ratio) ? INFINITY : loss_ratio);
    }
    if (root) {
      const std::string differs = twin.step(means, params, names);
      if (!differs.empty()) {
        adam_step = "differ";
        if (adam_differs.empty()) adam_differs = differs + ", step " + std::to_string(step);
      }
    }
    if (step % o.log_every == 0 || step + 1 == o.steps) {
      char ref[64] = "-            -         -         ";  // a step not checked
      if (checking) std::snprintf(ref, sizeof ref, "%-12.6f %-9.3f %-10.3f", loss_ref, loss_ratio, grad_worst);
      char moved_share[16] = "     -";
      if (n16) std::snprintf(moved_share, sizeof moved_share, "%5.1f%%", 100.0 * moved / n16);
      L.print("  %-5lld %-12.6f %s %-7s %s    %s\n", (long long)step, loss, ref, adam_step.c_str(), moved_share,
              kib((double)step_bytes).c_str());
    }
    csv << "train,,,,,,,,,,,," << o.precision << ',' << o.zero << ',' << o.grad_reduce << ',' << (o.bug == "no-master") << ',' << dp << ','
        << step << ',' << loss << ',' << loss_ref << ',' << (n16 ? (double)moved / n16 : 0.0) << ',' << step_bytes << ','
        << o.lr << ',' << o.moments << '\n';
    last_loss = loss;
  }
  L.csv_append(kCsvHeader, csv.str());

  // memory of this rank: measured (the tensors' storage, AdamW's state) against the formula
  const zero::Memory got = opt.memory(), want = zero::mixed_formula(n16, n32, dp, (int)o.zero, adam.bf16_moments ? 2 : 4);
  const double N = (double)(n16 + n32), per = (double)(got.params + got.grads + got.optimizer) / N;
  L.print("\n  memory of rank 0 (%s, ZeRO-%lld, dp %d): measured = formula (zero.h), bytes per parameter\n",
          bf16 ? "bf16 matmul weights" : "float32", (long long)o.zero, dp);
  const struct { const char* what; size_t m, f; } rows[] = {
      {"parameters", got.params, want.params}, {"gradients", got.grads, want.grads},
      {bf16 ? "optimizer (master, m, v)" : "optimizer (m, v)", got.optimizer, want.optimizer}};
  for (const auto& r : rows)
    L.print("    %-26s %10s  %10s  %6.2f B\n", r.what, kib((double)r.m).c_str(), kib((double)r.f).c_str(),
            (double)r.m / N);
  // seed 001's bytes per parameter for this stage, all in bf16 (or all float32)
  const double seed_bytes = bf16 ? zero::mixed_precision_bytes(1, dp, (int)o.zero)
                                 : o.zero == 0 ? 16.0 : o.zero == 1 ? 8.0 + 8.0 / dp : 4.0 + 12.0 / dp;
  L.print("    %-26s %10s  %10s  %6.2f B   seed 001, all %s: %.2f B\n", "total", kib(per * N).c_str(),
          kib((double)(want.params + want.grads + want.optimizer)).c_str(), per, bf16 ? "bf16" : "float32", seed_bytes);
  L.print("    (beside them: the collectives' buffers, %s, not in the formula)\n", kib((double)got.buffers).c_str());

  char line[256];
  L.comm.bcast(&checked, sizeof checked, 0);
  L.print("  the worst gradient against its bound: %s\n",
          worst_grad_at == "-" ? "none off, every mean gradient bit for bit" : worst_grad_at.c_str());
  std::snprintf(line, sizeof line, "training: loss of the ranks = one process's at %lld checked steps, |diff| <= 4 n "
                "eps max(1, |loss|): worst %.3f of the bound", (long long)checked, worst_loss);
  check.holds(line, !root || worst_loss <= 1);
  if (bf16 || fp8)
    std::snprintf(line, sizeof line, "training: mean gradients = one process's mean of the same shares', within "
                  "2 (dp-1) u sum|g_r| / dp (%s sums): worst %.3f of the bound", o.grad_reduce == "bf16" ? "bf16" : "float32",
                  worst_grad);
  else
    std::snprintf(line, sizeof line, "training: mean gradients = one process's on the whole batch, max|diff| <= 4 n "
                  "eps max|want|: worst %.3f of the bound", worst_grad);
  check.holds(line, !root || worst_grad <= 1);
  std::snprintf(line, sizeof line, "training: AdamW%s = one process's on the same mean gradients, bit for bit%s%s",
                bf16 ? " (float32 masters)" : "", adam_differs.empty() ? "" : ": not from ", adam_differs.c_str());
  check.holds(line, !root || adam_differs.empty());
  check.holds("training: every rank holds the same weights, bit for bit", replicas_agree);
  check.holds("training: memory of every rank = the formula (parameters, gradients, optimizer)",
              got.params == want.params && got.grads == want.grads && got.optimizer == want.optimizer);
  check.holds("training: the loss is finite", std::isfinite(last_loss));
}
// [/slide]
}  // namespace

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "10_precision", [](Lesson& L) {
    Options o;
    parse(L, o);
    CheckReport check(L.comm);
    if (o.formats()) formats(L, o, check);
    if (o.training()) train(L, o, check);
    return L.finish(check);
  });
}
