// lessons/08_mesh/report.h — what lesson 08 prints and writes: the run's header, a row per
// step, the communication and memory after training, the CSV rows the figures read, the dump
// of the trained model and a sample of its text. Rank 0 prints (Lesson::print, or printf in
// the functions only rank 0 calls); the CSV's per-rank rows are gathered from every rank.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>

#include "common/layers/model.h"
#include "lessons/08_mesh/zero.h"
#include "common/lesson/corpus.h"
#include "common/lesson/lesson.h"
#include "lessons/08_mesh/formulas.h"
#include "lessons/08_mesh/mesh_model.h"
#include "lessons/08_mesh/options.h"
#include "lessons/08_mesh/reference_check.h"

namespace ff::mesh {

// The mesh, the model, the pipeline, the links and the batch, then the step table's header
// (printed by rank 0). edp: the expert-DP size.
void print_header(const Lesson& lesson, const Options& opts, const Setup& setup, const RankModel& here, int edp);

// Called on rank 0 only (it holds one process's loss and gradients), so it prints with printf:
// the step's row of the table (the mesh's loss, one process's and their difference against the
// bound on a checked step, the bytes of each axis), and its CSV row into csv.
void print_step(const Options& opts, const MeshSizes& sizes, int64_t step, bool checking,
                bool logging, const CheckedStep& checked, double bound, const AxisCounts& last,
                std::ostringstream& csv);

// The memory one rank holds, measured (its optimizers') and by seed 001's formula.
struct MemoryUse {
  zero::Memory measured, formula;
};
// --overlap compare: every step's paired F&B steps run one after the other without the link
// model and with it (the gradients kept aside), then overlapped (the run trained with), all timed.
struct PairCompare {
  std::vector<std::vector<float>> grads;  // this step's, one after the other
  double step_compute = 0, step_seq = 0;  // this step's paired steps one after the other, seconds:
                                          // without the link model, and with it
  bool timing = false;                    // this step's times count (step 0 warms up)
  // T_compute, T_seq, T_ovl of every step that counts; the report takes each one's median over
  // the steps (a shared machine's hiccup in one step moves a sum, not a median)
  std::vector<double> compute, seq, ovl;
  bool equal = true;
  std::string first_differs;
  // After the overlapped run: its paired steps' wall, and its gradients against grads
  void overlapped(double ovl_wall_s, const std::vector<Tensor*>& params);
};
// Rank 0 prints every rank's compute, communication, one-after-the-other and overlapped time of
// the paired steps per step and the hidden fraction (T_seq - T_ovl) / min(T_compute, T_comm),
// lesson 06's measure, worst and mean over the ranks (gathered over `world`).
void print_pair_overlap(const Lesson& lesson, Comm& world, const Setup& setup, const PairCompare& c);

// ZeRO-3's: the most weight bytes gathered at once, and unit gathers per step.
struct Zero3Use {
  size_t peak_bytes = 0;
  int64_t gathers_per_step = 0;
};

// What the report after training tells of the run, besides the flags and the setup.
struct RunSummary {
  AxisCounts last, want;          // the last step's communication per axis: Comm's counts, the formulas'
  MemoryUse mem;                  // this rank's memory, measured and by the formula
  int64_t dense_numel = 0;        // the weights the dense optimizer holds (over dp x cp)
  int64_t expert_numel = 0;       // and the experts' (over expert-DP)
  int64_t local_numel = 0;        // every parameter this rank holds
  int data_ranks = 0;             // dp x cp: the ranks the dense weights are averaged and sharded over
  int edp = 0;                    // expert-DP's ranks
  double train_s = 0;             // the training steps' wall time
  int64_t trained_steps = 0;      // this run's steps (a resumed run's: from its checkpoint on)
  Zero3Use zero3;
};

// After training, rank 0's: the communication of the last step per axis against the formulas,
// the memory against its formula, the time per step; the memory's CSV row into csv.
// The memory check's line: the formula the stage (and --precision) holds the memory to.
std::string memory_check_name(const Options& opts);
void print_report(const Lesson& lesson, const Options& opts, const Setup& setup, const RunSummary& run,
                  std::ostringstream& csv);
// --bucket-mb: DP's gradient buckets (every group's, side by side: BucketTimes::concurrent),
// summed over the steps, on every rank; rank 0 prints how
// many there were, how many went during the backward, and under --link the hidden fraction of
// their reduction (lesson 06's measure) on rank 0, worst and mean over the ranks (gathered
// over `world`). Returns this rank's hidden fraction.
double print_buckets(const Lesson& lesson, Comm& world, const Options& opts, const Setup& setup,
                     const zero::BucketTimes& all);
// Under --estimate run: the memory model of this run's model and mesh against rank 0's.
void print_estimate(const Lesson& lesson, const Setup& setup, const Options& opts, const MemoryUse& mem,
                    int64_t local_numel, const AxisCounts& last);
// Every rank's bytes per axis in the last step, measured and by the formula: two CSV rows per
// rank, gathered over `world` into rank 0's csv.
void rank_rows(Lesson& lesson, Comm& world, const Options& opts, const MeshSizes& sizes,
               const AxisCounts& last, const AxisCounts& want, std::ostringstream& csv);

// Rank 0, under --dump: the trained model (one process's, the same weights as the mesh's), the
// validation batch 0 and its loss on the mesh, and meta.json with the model's configuration.
void dump_trained(Lesson& lesson, const Setup& setup, int64_t batch, const model::Params& trained,
                  double val_loss0);

// Text from the trained model (one process's forward on the gathered weights): each next byte
// drawn from softmax(logits / temperature) with a generator seeded by `seed`.
std::string sample_text(const model::Config& c, const model::Params& p, const CharCorpus& corpus,
                        const std::string& prompt, int64_t count, double temperature,
                        uint64_t seed);

}  // namespace ff::mesh
