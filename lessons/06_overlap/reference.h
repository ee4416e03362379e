// lessons/06_overlap/reference.h — the one-process reference the overlapped and the sequential
// runs are checked against, and that check.
#pragma once
#include <vector>

#include "common/comm/comm.h"
#include "common/core/check.h"
#include "common/core/tensor.h"
#include "common/layers/dsv3_moe.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/run_result.h"

namespace ff::f1b {

// The reference: one process, every expert, the same micro-batches — dsv3's single-process
// layer (lesson 05's reference) and the same attention. Each rank computes it for its own
// tokens (the block is per token after the attention, and the attention is per rank), and the
// parameter gradients are summed over ranks, as the distributed ones are.
struct Reference {
  std::vector<Tensor> y, dx, attn_grads;
  dsv3::Grads grads;
};

// This rank's tokens through the block as one process computes it (prefill: the forwards
// only), the parameter gradients summed over comm's ranks.
Reference reference(Comm& comm, const Setup& setup, const Weights& weights, bool prefill);

// Checks `run` (this rank's; `name` as printed) against the reference: y and dx of every
// micro-batch, and every parameter gradient summed over ranks (each rank its own experts'),
// within float32 tolerances.
void check_against_reference(CheckReport& check, Comm& comm, const Setup& setup,
                             const Weights& weights, const RunResult& run, bool prefill,
                             const char* name);

}  // namespace ff::f1b
