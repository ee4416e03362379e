// lessons/06_overlap/block.h — the transformer block lesson 06 runs on every rank: its sizes
// and options (Setup), its weights (attention replicated, the experts spread over the ranks),
// its attention half, and the micro-batches drawn from the seed.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/dsv3_moe.h"
#include "lessons/06_overlap/progress.h"

namespace ff::f1b {

// The block's weights. Attention and norms are replicated (every rank the same, from the
// seed), the routed experts spread over the ranks as in lessons 04 and 05.
struct Weights {
  Tensor g1, wq, wk, wv, wo, g2;  // autograd leaves
  dsv3::Params full, mine;        // the MoE: every expert (router, shared) and this rank's
};

struct Setup {
  dsv3::Config moe;  // the MoE layer (lesson 05's): d, f, N experts, top-K, S shared
  int64_t tokens = 64, heads = 4, microbatches = 8;  // T per micro-batch per rank, H, M
  ProgressMode progress = ProgressMode::test;
  bool defer_w = true;
  bool early_read = false;  // --bug early-read
  bool modelled_compute = true;  // --compute modelled: phases last FLOPs / flops_per_s
  double flops_per_s = 1e9;
  Device dev = Device::cpu;
  uint64_t seed = 0;
};

// The attention half, on the tape: h = x + softmax(causal(q k^T / sqrt(dh))) v Wo, with
// q, k, v from rmsnorm(x). tick() runs between its ops (the compute tiles of --progress test).
Tensor attention_block(const Weights& w, const Tensor& x, int64_t H, const Tensor& mask,
                       const std::function<void()>& tick = [] {});

// Micro-batch m of this rank: its tokens and the gradient its output receives, drawn from the
// seed (counter-based: rows [rank T, (rank + 1) T) of one global tensor per micro-batch).
void draw(const Setup& s, int rank, int P, int m, Tensor* x, Tensor* dy);
// The block's weights, the same on every rank from the seed; this rank's experts of P ranks.
Weights make_weights(const Setup& s, int rank, int P);
// This rank's expert e (of w.mine), as moe's grouped GEMM wants one group.
moe::Params local_expert(const Weights& w, size_t e);
// The attention's and the norms' leaves, in kAttentionNames' order.
std::vector<Tensor*> attention_leaves(Weights& w);
inline const char* const kAttentionNames[] = {"g1", "wq", "wk", "wv", "wo", "g2"};

}  // namespace ff::f1b
