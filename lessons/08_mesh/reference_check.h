// lessons/08_mesh/reference_check.h — the check's view of the mesh: every rank's tensors
// gathered and rebuilt as the full weights one process would hold, the replicas compared bit for
// bit, the tolerance a gradient is held to, and the one-process twin it is held against.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/comm/mesh.h"
#include "lessons/08_mesh/zero.h"
#include "common/core/check.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "common/lesson/corpus.h"
#include "common/lesson/lesson.h"
#include "lessons/08_mesh/options.h"
#include "lessons/08_mesh/sharding.h"

namespace ff::mesh {

// The check's view of the mesh: every rank's local tensors, gathered (one all-gather on a
// communicator of the check's own, so that the training's counters stay the training's), and
// rebuilt on every rank as the full weights one process would hold.
struct Gathered {
  std::vector<Tensor> full;     // one per named parameter, on the cpu
  std::string disagree;         // the first replicated weight whose copies differ ("" if none)
};

// The same bits (sizes included; an empty vector may have no storage to compare).
bool same_floats(const std::vector<float>& a, const std::vector<float>& b);
// Every rank's local tensors (local: this rank's tensors of the names its pipeline stages hold,
// in names' order), gathered over `world` (the check's own communicator) and joined into the
// full ones; a replica that differs from its reference copy is named in `disagree`.
Gathered gather_full(const std::vector<std::string>& names, const std::vector<Shape>& full_shapes,
                     const std::vector<Tensor>& local, const MeshSizes& sizes, const StagePlan& plan,
                     Comm& world);

// The tolerance rule of lessons 04 and 05, K n eps max|want| with K = kLossBound: n float32
// terms summed in two orders differ by at most about 2 n eps of their magnitude, and a factor 2
// covers the few roundings of each term. n is the longest sum, a weight gradient's over every
// token of the global batch (B T).
constexpr double kLossBound = 4.0;
// max |got - want| as a fraction of the bound kLossBound n eps max|want| (above): 1 fails.
double error_ratio(const Tensor& got, const Tensor& want, double n);

// --precision bf16. The mesh and one process both hold the matmul weights in bf16, round each
// matmul's float32 input to bf16 and each weight's gradient where it is made. Where the mesh
// sums in another order (TP's partial sums, the vocabulary-parallel loss, DP's shares, PP's
// micro-batches), a float32 result one ulp apart can round to the other bf16 neighbour, and
// the backward carries that on: measured, the mesh's gradients differ from one process's bf16
// ones by about as much as those differ from float32 (even on one rank, whose loss is computed
// vocabulary-parallel). No elementwise bound is then honest. What the mesh must keep is bf16's
// accuracy: against g32, the gradient of one process in float32 from the same weights (widened)
// and batch, the mesh's error is held to twice one process's bf16 error, in the 2-norm:
//     ||g_mesh - g32|| <= 2 ||g16 - g32|| + 4 n eps ||g16||
// (the mesh's roundings are as many and as large as one process's, and a DP rank's gradient is
// rounded once more, on its share). The loss, a mean over tokens: |loss_mesh - loss16| <= 4 n
// eps |loss| + 2 mean_t |l16_t - l32_t| (each token's loss against float32's: their mean
// bounds the error of a mean, and does not cancel by chance as loss16 - loss32 can). A wrong
// sum (a missing all-reduce, a shard of the wrong rank) is far out.
// --precision fp8 the same, g8 in place of g16: the weights stay float32, and each GEMM of the
// linear layers quantizes its operands from their own largest values (under TP in tiles that
// no two ranks' shards share, options.cpp: resolve_fp8_tile; so the mesh's tiles are one
// process's, and only the sums' orders differ).
struct PrecisionErrors {
  std::vector<std::vector<float>> g32;  // one process's gradients in float32, per weight
  std::vector<double> norm16;           // ||g16 - g32|| per weight (fp8: ||g8 - g32||)
  double loss32 = 0;
  double token_err = 0;                 // the mean over tokens of |token loss - float32's|
};
// That mean, from the two runs' logits (rows: tokens) and the targets.
double mean_token_error(const Tensor& logits_low, const Tensor& logits32, const Tensor& targets);
// ||got - g32|| over its bound above: 1 fails.
double precision_ratio(const Tensor& got, const Tensor& g16, const std::vector<float>& g32, double norm16, double n);

// The worst ratio to its bound seen so far, and where.
struct Worst {
  double ratio = 0;
  std::string what = "-";
  int64_t step = -1;
};

// The one-process twin rank 0 checks the mesh against (constructed on every rank, used on rank
// 0): the full model from the same seed, resynchronised to the mesh's weights after every step.
// At a checked step it computes the loss and every gradient on the whole global batch from the
// same weights (the mesh's loss and gathered mean gradients must be within the bound), and every
// step it runs AdamW on the mesh's own mean gradients (the mesh's new weights must be the same
// bits) and its own bias update from its own routes (the same bits again).
class OneProcess {
 public:
  // What the twin runs: the model, AdamW and the data, as the mesh runs them.
  struct Config {
    model::Config model;
    AdamConfig adam;
    int zero_stage = 1;              // the mesh's (ZeRO-1 and up run AdamW on the host)
    double bias_rate = 0;            // the balancing biases' update rate
    bool bug_kpe = false;            // --bug kpe-per-head: W_kr a copy per head on the mesh
    std::vector<std::string> names;  // the weights, in the model's order
    double n_terms = 0;              // the longest sum (a weight gradient's, over tokens): the bounds'
    int64_t batch = 0;               // sequences per step
    std::string precision = "fp32";  // bf16, fp8: the check above (and bf16 matmul weights)
  };
  OneProcess(const OneProcess&) = delete;  // ref_params point into its own ref_named
  OneProcess& operator=(const OneProcess&) = delete;
  OneProcess(const Lesson& lesson, Config config, const CharCorpus& corpus);
  struct Step {
    double loss = NAN;        // one process's loss (NAN: not a checked step)
    double loss_bound = NAN;  // what the mesh's may differ by
    double grad_ratio = 0;    // the worst gradient's error over its bound
    std::string adam = "=";   // "=": AdamW the same bits, "differ"
  };
  // Rank 0, after the mesh's step `step` (last: the last one, whose inputs and gradients --dump
  // keeps): loss_mesh its loss, grads and params its mean gradients and new weights gathered
  // (gather_full), mesh_bias its balancing biases.
  // mesh_load: the loads the mesh's bias update used (bf16 and fp8: one process updates its bias
  // from them, since a token whose router scores differ by a rounding may pick another expert)
  Step step(Lesson& lesson, int64_t step, bool checking, bool last, double loss_mesh, const Gathered& grads,
            const Gathered& params, const std::vector<float>& mesh_bias, const std::vector<float>& mesh_load);
  model::Params& model() { return ref; }
  // Rank 0, a resumed run: the weights, biases and AdamW state of the checkpoint in directory
  // `dir` (its full tensors, read whole: this is the check's one process, not the training).
  void resume(const std::string& dir, int64_t adam_steps);
  // The twin's lines of the check (on rank 0; the other ranks pass): the loss and every mean
  // gradient within the bound, AdamW and the bias bit for bit; and, under --bug kpe-per-head
  // only, the unchanged forward and the copies of W_kr.
  void verdict(CheckReport& check, bool root) const;
  void kpe_verdict(CheckReport& check, bool root) const;
  // bf16 (PrecisionErrors above): one process in float32 on batch gb from the bf16 twin's weights,
  // widened, against the bf16 twin's gradients (computed on gb just before)
  PrecisionErrors float32_twin(const CharCorpus::Batch& gb, const Tensor& logits_low);
  // the float32 twin's forward from this one's weights, widened (bf16 and fp8 runs)
  model::Output float32_forward(const Tensor& inputs, const Tensor& targets);

  // the verdicts, over every step
  Worst worst_loss, worst_grad;
  double first_loss_ratio = 0;  // step 0: both from the initial weights
  int64_t checked_steps = 0;
  bool adam_equal = true, bias_equal = true, kpe_copies_equal = true;
  std::string adam_detail = "-";

 private:
  const model::Config c;
  const std::string precision;
  const bool low;  // bf16 or fp8: the check above
  const double bias_rate;
  const bool bug_kpe;
  const std::vector<std::string> names;
  const double n_terms, eps = std::numeric_limits<float>::epsilon();
  const CharCorpus& corpus;
  const int64_t batch, T;
  const uint64_t seed;
  const Device device;
  model::Params ref;
  std::vector<model::NamedTensor> ref_named;
  std::vector<Tensor*> ref_params;
  model::Params ref32;                         // bf16: the same weights widened, all float32
  std::vector<model::NamedTensor> ref32_named;
  // AdamW runs where the mesh's does: ZeRO-1 on the host (its shard lives there), ZeRO-0 on the
  // device; then the two apply the same elementwise float operations and agree bit for bit.
  const Device adam_dev;
  Adam ref_adam;
  std::vector<Tensor> ref_adam_params;  // the reference's weights where its AdamW runs
};

// The check's own communicators, beside the training's: its traffic is counted apart (the
// per-axis formulas see the training only) and the trace shows it apart.
struct CheckComms {
  CheckComms(Comm& world, Mesh& mesh)
      : world(world.split(0, world.rank())),
        dp_cp(mesh.dp_cp().split(0, mesh.dp_cp().rank())),
        edp(mesh.edp().split(0, mesh.edp().rank())),
        pp(mesh.pp().split(0, mesh.pp().rank())) {}
  Comm world, dp_cp, edp, pp;
};

struct RankModel;
// The check of one training step, on every rank: the mesh's loss (the last stage's ranks hold
// it, each TP rank the same), the mean gradient each optimizer used and the weights after its
// step, gathered into the full tensors (gather_full; a replica that differs is named in
// *disagree, the first time), and on rank 0 the twin's step from them (OneProcess::step).
struct CheckedStep {
  double loss_mesh = 0;
  OneProcess::Step twin;
};
// The step of the mesh that check_step reads: the rank's model, its three optimizers, the sizes
// and where the step stands.
struct StepOnMesh {
  const RankModel& here;
  const zero::GroupAdam& dense;       // the dense weights' (over dp x cp)
  const zero::GroupAdam& replicated;  // SP's replicated weights' (summed over TP too)
  const zero::GroupAdam& experts;     // the experts' (over expert-DP)
  const MeshSizes& sizes;
  double local_loss = 0;  // this rank's loss of the step
  int64_t step = 0;
  bool checking = false;  // a step --check-every checks
  bool last = false;      // the run's last step
};
CheckedStep check_step(Lesson& lesson, OneProcess& twin, CheckComms& comms, const StepOnMesh& s, std::string* disagree);

// The validation loss after training (the mean over --val-batches global batches of the
// held-out text, forward only): the mesh's on every rank, one process's on rank 0.
struct Validation {
  double mesh = 0, one_process = 0;
  double first_mesh = 0;  // the mesh's on batch 0 (the dump's)
  double token_err = 0;   // bf16, fp8: one process's mean |token loss - float32's| (the tolerance's)
};
Validation validate(Lesson& lesson, OneProcess& twin, CheckComms& comms, RankModel& here,
                    const Setup& setup, const Options& opts, int dp_rank);

}  // namespace ff::mesh
