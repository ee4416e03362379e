// lessons/02_ring_attention/ring.h — ring attention: attention over a sequence split across the
// ranks of a communicator, the key/value blocks passed around a ring and folded into
// FlashAttention's online-softmax state. Lesson 02 teaches it (ring.cpp holds the hop loops);
// lesson 08 runs it as the context-parallel (CP) axis of its mesh, through this header (a later
// lesson may include an earlier lesson's header, never the other way, never a main.cpp).
//
// Rank r holds the queries, keys and values of its tokens, (B, H, n, D) each. At step s it
// holds the K/V block of rank r - s (mod P), which arrived from r - 1; P steps, P - 1 hops. The
// backward sends the blocks round again: dQ stays home, while dK and dV travel WITH their block,
// collecting every rank's contribution, and arrive back at the block's owner fully summed after
// P hops. The block forward and backward are the FlashAttention-2 kernels flash_forward_block and
// flash_backward_block (kernels/cpu/attention.cpp is their readable definition).
//
// The causal mask compares positions: `positions[r]` are those of rank r's tokens (each rank
// knows every rank's, from the layout). They must be the GLOBAL positions; lesson 02's
// `--mask local` and lesson 08's `--bug local-causal-mask` pass rank-local indices instead, the
// classic silent bug.
#pragma once
#include <cstdint>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/tensor.h"

namespace ff::ring {

// Who sends first on each hop (lesson 02):
//   naive    everyone sends first with MPI_Ssend: a cycle of waits, a deadlock for P >= 2
//   evenodd  even ranks send then receive, odd ranks receive then send: no cycle, any P >= 2
//   async    irecv + isend posted before the block's compute, waited after: the transfer hides
//            behind the compute (double buffering)
enum class Order { naive, evenodd, async };

// Which global token positions rank r of P holds (ascending); S need not divide evenly (the
// library's split_range rule).
//   contiguous  tokens [r S/P, (r+1) S/P)
//   zigzag      the sequence cut into 2P chunks; rank r holds chunks r and 2P-1-r, one early and
//               one late, so every rank gets the same share of the causal triangle
//   striped     token t on rank t mod P
enum class Layout { contiguous, zigzag, striped };
const char* layout_name(Layout l);
std::vector<int64_t> layout_positions(Layout layout, int64_t S, int P, int r);

// Backward mistakes lesson 02 plants, each one its check must catch:
//   dkv_local   dK/dV accumulated on the rank that computes them instead of travelling with
//               their block (needs equal block sizes)
//   no_delta    dS = P * dP, forgetting the softmax Jacobian's row term delta = rowsum(dO * O)
//   lse_no_log  the backward recomputes P = exp(s - m) from the max alone: P not normalised
enum class Bug { none, dkv_local, no_delta, lse_no_log };

struct Config {
  int64_t B = 1, H = 1, D = 1;  // blocks are (B, H, n, D); the scores are scaled by 1/sqrt(D)
  bool causal = false;
  Order order = Order::evenodd;
  Bug bug = Bug::none;
  Device dev = Device::cpu;
  // positions[r]: what the causal mask compares for rank r's n_r tokens (n_r = their count)
  std::vector<std::vector<int64_t>> positions;
};

struct Forward {
  Tensor o;    // (B, H, n, D), normalised
  Tensor lse;  // (B, H, n): m + log l, what the backward recomputes P from
  Tensor m;    // (B, H, n): the running max (only lesson 02's lse-no-log bug reads it)
};
// The forward ring: P steps, each folding the K/V block in hand into (m, l, o) while it passes
// on to r+1 and the next block comes from r-1. q, k, v: this rank's (B, H, n, D) on c.dev.
// Every rank of comm calls it (a ring).
Forward forward(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v);

struct Backward {
  Tensor dq, dk, dv;  // (B, H, n, D): dK and dV of this rank's own block, summed over the ring
};
// The backward ring: P steps, each accumulating dQ at home and the dK, dV of the block in hand,
// then passing the block and its dK, dV on; after P steps each block is back at its owner with
// every rank's dK, dV summed in. f: this rank's forward().
Backward backward(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& dout, const Forward& f);

// The whole thing as one autograd op: o = attention of this rank's queries against every rank's
// keys and values; its backward is backward() above (a second trip round the ring). Every rank
// of comm must run the op and its backward in the same order.
Tensor attention(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v);

}  // namespace ff::ring
