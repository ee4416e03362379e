// lessons/09_inference/moe_decode.h — the MoE FFN of a decode step with its experts over the
// ranks (expert parallelism), in the two ways inference codes move the tokens.
//
// At decode the batch is small: B rows, one per sequence, and every rank holds all of them
// (the attention before it is tensor-parallel: its all-reduce leaves the rows replicated).
// Rank r holds the routed experts [r N/P, (r+1) N/P) (dsv3::slice_experts).
//
//   allreduce  DeepSeek-V3's inference/model.py and seed 002's shard_map: every rank routes
//              all B rows, runs the slots that chose its experts (the others contribute zero)
//              and its columns of the shared experts (tensor-parallel, seed 002's MLP); one
//              all-reduce of (B, d) sums the partials. The traffic does not depend on the
//              routing; every rank routes every row.
//   alltoall   DeepEP's low-latency kernels, with MPI: every rank routes only its share of the
//              rows (split_range of B), sends each chosen slot to its expert's rank (dispatch),
//              the experts run, the outputs come back (combine) and are gated; the shared
//              experts run on the row's own rank; an all-gather makes the rows replicated again
//              for the next layer's attention. At batch sizes of a few rows every message is a
//              few hundred bytes: the all-to-all costs its latency, not its bandwidth (DeepEP's
//              low-latency mode exists for this). The per-expert counts travel first, in one
//              small all-gather (lesson 04's routing map; DeepEP sends fixed-size buffers
//              instead and skips it).
// Every collective here is non-blocking and waited on at once, so that under --link the link
// model times it (Comm models the non-blocking collectives, as rings, and not the blocking ones).
// Either way the routed output of a row is lesson 05's layer's: the same experts, gates and
// slot order; only the sums over ranks associate differently (allreduce), or not at all.
#pragma once
#include <cstdint>

#include "common/comm/comm.h"
#include "common/core/tensor.h"
#include "common/layers/dsv3_moe.h"

namespace ff::infer {

enum class MoeComm { allreduce, alltoall };

// The routing of rows x on one rank, as lesson 05's layer routes them (no capacity at
// inference: every chosen slot is kept): the plan sorting the slots by expert (N + 1 groups,
// the last empty), and the gates.
struct Routed {
  moe::Plan plan;
  Tensor gates;
};
Routed route(const dsv3::Config& c, const dsv3::Params& p, const Tensor& x);
const char* moe_comm_name(MoeComm m);

// --moe-comm allreduce: the shared experts of a layer split by columns over P ranks (sw1, sw3
// by columns, sw2 by rows: seed 002's tensor-parallel MLP), everything else as it was.
dsv3::Params moe_shard(const dsv3::Params& p, int r, int P);

// The sum of t over comm, on every rank: a non-blocking all-reduce waited on at once, so that
// the link model times it; seconds, when given, gets its time added.
Tensor allreduce_timed(Comm& comm, const Tensor& t, double* seconds);

// u (B, d), the same on every rank of comm: the MoE's output (B, d), the same on every rank.
// comm_s, when given, gets the seconds spent in this layer's communication added to it.
Tensor moe_decode(Comm& comm, MoeComm how, const dsv3::Config& c, const dsv3::Params& mine, const Tensor& u,
                  double* comm_s = nullptr);

}  // namespace ff::infer
