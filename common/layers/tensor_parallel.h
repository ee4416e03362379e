// common/layers/tensor_parallel.h — tensor parallelism (TP) and sequence parallelism (SP):
// their communication as autograd ops, and the column- and row-parallel linears built on them.
// Taught in lesson 08 (Megatron-LM names the same operators in
// megatron/core/tensor_parallel/mappings.py).
//
// A linear y = x W split over the P ranks of a TP group:
//   column-parallel  W = [W_0 | W_1 | ...] by output columns; rank r computes x W_r, its slice
//                    of y's columns. Every rank needs all of x.
//   row-parallel     W = [W_0; W_1; ...] by input rows; rank r holds x_r (its slice of x's
//                    columns) and computes x_r W_r, a partial sum: y = Σ_r x_r W_r.
// Column then row (W1/W3 column-, W2 row-parallel in a SwiGLU MLP; W_uq/W_uk/W_uv by head, then
// W_o, in attention) needs no communication between the two: the column-parallel output is
// exactly the row-parallel input. One all-reduce per sub-block in the forward (g, after the
// row-parallel matmul), one in the backward (f, before the column-parallel one).
//
// The two conjugate operators, each the other's transpose:
//   f  identity forward (x is replicated), all-reduce of the gradient backward: every rank's
//      column shard contributes a partial dx.
//   g  all-reduce forward (sums the row-parallel partials), identity backward: the gradient of
//      a replicated output is already the gradient of every partial.
// SP: outside the TP regions (norms, residuals, dropout) the activations are replicated on
// every TP rank, a waste; SP splits them along the sequence (dim 0: tokens) instead. Then
//   gather_seq   all-gather along dim 0 forward (rebuilds the full x a column-parallel matmul
//                needs), reduce-scatter backward; replaces f;
//   scatter_seq  reduce-scatter along dim 0 forward (sums the row-parallel partials and keeps
//                this rank's tokens), all-gather backward; replaces g.
// An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes as TP
// while the activations between the TP regions take 1/P of the memory.
//
// The ops work on tensors of any device: the data is staged through the host (Comm's buffers
// are host memory), and the results live on the input's device. Tensors are contiguous, so
// rank order along dim 0 is the layout of MPI's blocks. Every rank of the group must make the
// same calls in the same order (they are collectives).
#pragma once
#include <cstdint>

#include "common/comm/comm.h"
#include "common/core/tensor.h"

namespace ff::tp {

// ---- the communication ops (autograd: each records its backward with record())
Tensor f(const Tensor& x, Comm& tp);  // copy_to_tensor_model_parallel_region
Tensor g(const Tensor& x, Comm& tp);  // reduce_from_tensor_model_parallel_region
// x: this rank's rows, (n, ...) with the same n on every rank (checked: one small allgather of
// n first, so a mismatch is an ff::Error on every rank, not a hang); returns (P n, ...), rank
// r's rows at [r n, (r+1) n). gather_from_sequence_parallel_region. bf16_wire (mixed
// precision, where the rows go straight into a matmul with bf16 weights, which rounds its input
// to bf16 anyway): the rows rounded to bf16 before they travel, 2 bytes a number, and widened on
// arrival: the same values the matmul reads, half the bytes. The backward stays float32.
Tensor gather_seq(const Tensor& x, Comm& tp, bool bf16_wire = false);
// x: (T, ...) partial sums, T divisible by P (ff::Error otherwise, on every rank since every
// rank holds the same shape); returns this rank's rows [r T/P, (r+1) T/P) of the sum over
// ranks. reduce_scatter_to_sequence_parallel_region.
Tensor scatter_seq(const Tensor& x, Comm& tp);

// ---- the parallel linears (x: (..., K) activations; w_shard: a 2-D weight shard)
// x replicated, w_shard = column_shard(W): returns this rank's columns of x W.
Tensor column_parallel(const Tensor& x, const Tensor& w_shard, Comm& tp);
// x_shard = this rank's columns of the input, w_shard = row_shard(W): returns x W, replicated.
Tensor row_parallel(const Tensor& x_shard, const Tensor& w_shard, Comm& tp);
// SP: x = this rank's tokens (n, K); returns the columns of x_full W for all P n tokens.
Tensor column_parallel_sp(const Tensor& x, const Tensor& w_shard, Comm& tp);
// SP: x_shard (T, K_r); returns this rank's tokens (T / P, N) of x W.
Tensor row_parallel_sp(const Tensor& x_shard, const Tensor& w_shard, Comm& tp);

// Rank r's shard of a full 2-D weight (K, N), a copy with no autograd history: columns
// [b, e) of split_range(N, P, r) (column-parallel), or rows [b, e) of split_range(K, P, r)
// (row-parallel). A column-parallel layer followed by a row-parallel one splits their shared
// dimension the same way, so the shards match. Builds sharded models from the same seed as the
// full one.
Tensor column_shard(const Tensor& w, int r, int P);
Tensor row_shard(const Tensor& w, int r, int P);

}  // namespace ff::tp
