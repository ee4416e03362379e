// lessons/08_mesh/formulas.h — what one training step should move on each axis of the mesh,
// by formula, and Comm's counts of what it did move.
//
// Every step, lesson 08 compares the calls and payload bytes Comm counted on each axis's
// communicator (tp, cp, ep, dp x cp, expert-DP, pp) with these formulas, and prints both
// (`tp: allreduce 12 x, 48.0 KiB` / `formula: ...`). The formulas are written from the model's
// sizes, the mesh and the schedule alone, never from a run; formulas.cpp says what each counts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/comm/mesh.h"
#include "common/layers/dsv3_ep.h"
#include "common/layers/model.h"
#include "common/layers/schedule.h"
#include "lessons/08_mesh/options.h"
#include "lessons/08_mesh/zero.h"

namespace ff::mesh {

// What this rank's pipeline stages hold, for the formulas.
struct StageCounts {
  int64_t L = 0, D = 0, moe = 0, M = 1;  // blocks, dense ones, MoE ones; micro-batches
  bool head = true;
};

// TP (tp = P ranks; sp: sequence parallelism), per step: n = this rank's tokens per
// micro-batch, replicated_numel the weights every TP rank holds whole (their gradients'
// all-reduce under SP). bf16_wire: --precision bf16, whose gathers before W1/W3 and the head
// move 2 bytes a number (tp::gather_seq).
CollectiveCounts formula_tp(const model::Config& c, const StageCounts& st, int64_t n, int P,
                            bool sp, int64_t replicated_numel, bool bf16_wire = false);
// DP (or dp x cp, or expert-DP), over `dp` ranks, per piece of `pieces` (their numbers of
// weights): ZeRO-0's all-reduce of a gradient bucket, or ZeRO-1 and -2's reduce-scatter and
// all-gather of one padded to a multiple of dp; ZeRO-3's 2M all-gathers (each micro-batch's
// forward and backward) and M reduce-scatters of a unit, padded likewise (M micro-batches);
// loads: the MoE loads' all-reduce too.
CollectiveCounts formula_dp(const model::Config& c, const std::vector<int64_t>& pieces, int dp, int zero,
                            bool loads, int64_t M = 1);
// The buckets of weights of these sizes (in the model's order) of about bucket_bytes each,
// cut from the last weight back (zero.h's rule); bucket_bytes 0: one bucket.
std::vector<int64_t> bucket_numels(const std::vector<int64_t>& sizes, size_t bucket_bytes);
// CP: the ring attention's messages, B sequences of n tokens per rank, over P = cp ranks.
CollectiveCounts formula_cp(const model::Config& c, const StageCounts& st, int64_t B, int64_t n,
                            int tp, int P);
// PP: the activations and gradients rank `me` sends under schedule s, rows x d floats each.
CollectiveCounts formula_pp(const pp::Schedule& s, int me, int64_t rows, int64_t d);
// EP: the routing maps' all-gathers and the rows the all-to-alls move, from every MoE layer's
// routing map (R ranks per node for the hierarchical scheme). bf16_experts: the flat dispatch's
// rows travel in bf16 (dsv3_ep.cpp), 2 bytes a number.
CollectiveCounts formula_ep(const std::vector<dsv3::RoutingMap>& maps, int me, int R,
                            dsv3::Scheme scheme, int64_t d, int64_t groups_kept, bool bf16_experts = false);

// ---- the counts, compared and printed
// One step's counts on every axis, or the formulas' (ep: the EP group's communicator and the
// hierarchical all-to-all's node and rail ones; pp: the pipeline's and DualPipe's pair's).
struct AxisCounts {
  CollectiveCounts tp, dp, cp, ep, edp, pp;
};
// The first axis whose counts are not the formula's, "tp allreduce 3 x, 1.5 KiB, formula
// allreduce 2 x, 1.0 KiB"; "" when every axis agrees.
// The communicators each axis's traffic runs on (EP's through the nodes and rails too, PP's
// DualPipe pair too): their counters zeroed before a step and read after it.
struct AxisComms {
  Comm *tp, *dp, *cp, *edp;
  std::vector<Comm*> ep, pp;
  void reset() const;
  AxisCounts counts() const;
};

std::string first_difference(const AxisCounts& got, const AxisCounts& want);
// Two lines per axis of this mesh, "  tp: <counts>" and "      formula: <counts>" (dp named
// "dp x cp" under CP; cp, ep, edp and pp only where the mesh has them).
std::string communication_text(const AxisCounts& got, const AxisCounts& want, const MeshSizes& sizes);

struct RankModel;
// The optimizer groups of lesson 08: the dense weights (over DP x CP), under ZeRO-3 with SP the
// replicated ones apart (their gradient shards summed over TP), the experts (over expert-DP).
enum class Group { dense, replicated, experts };
Group group_of(const std::string& name, const Options& opts, int ep);
// Which ZeRO-3 unit holds the weight: 0 the embedding, 1 + l block l, layers + 1 the final norm
// and the head.
int unit_of(const std::string& name, int64_t layers);
// The pieces of this rank's weights of group g reduced one by one: the gradient buckets by
// --bucket-mb (ZeRO 0 to 2), the units (ZeRO-3; those with weights here).
std::vector<int64_t> group_buckets(const RankModel& here, const Setup& setup, const Options& opts, Group g);
// The memory formula of group g's optimizer over `ranks` ranks: zero::formula of its buckets, or
// under --precision bf16 zero::mixed_formula of its bf16 and float32 weights (one bucket).
zero::Memory group_memory(const RankModel& here, const Setup& setup, const Options& opts, Group g, int ranks);
// What each axis should move in one step of this rank, by the formulas above (EP's depends on
// the step's routing: formula_ep after the step). The weights of each optimizer group come from
// `here` (group_buckets); data_ranks: the ranks the dense weights' optimizer spans (dp x cp); edp:
// the experts' (expert-DP); pair_sums: the DualPipe pair's all-reduce of every gradient this rank
// holds and of the MoE loads.
AxisCounts expected_counts(const RankModel& here, const Setup& setup, const Options& opts,
                           int data_ranks, int edp,
                           bool pair_sums);

// "1.50 KiB", "2.00 MiB", "12 B"
std::string human_bytes(double b);
// "allreduce 3 x, 1.5 KiB, send 8 x, 4.0 KiB" (or "none")
std::string counts_text(const CollectiveCounts& m);
// The payload bytes of every operation counted.
size_t sum_bytes(const CollectiveCounts& m);
// Several communicators' counts as one (lesson 05's hierarchical all-to-all runs on the EP
// group's node and rail communicators).
CollectiveCounts merged_counts(const std::vector<Comm*>& comms);
// The same calls and bytes for every operation that ran (operations counted 0 times aside).
bool same_counts(const CollectiveCounts& a, const CollectiveCounts& b);

}  // namespace ff::mesh
