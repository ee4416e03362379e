// lessons/02_ring_attention/ring.cpp — ring attention, read top to bottom: which tokens each
// rank holds, a block as one message, one hop in each send order (the naive one deadlocks,
// even/odd does not, async overlaps), the forward ring (the online-softmax fold of each block
// that passes) and the backward ring (dQ at home, dK/dV travelling with their block), and the
// two as one autograd op for lesson 08. ring.h says what each function takes and returns.
#include "lessons/02_ring_attention/ring.h"

#include <cmath>
#include <memory>
#include <string>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/util/trace.h"
#include "kernels/kernels.h"

namespace ff::ring {

// ----------------------------------------------------------------------------
// Which tokens each rank holds: contiguous, zigzag or striped (ring.h says which tokens each holds).

const char* layout_name(Layout l) {
  return l == Layout::contiguous ? "contiguous" : l == Layout::zigzag ? "zigzag" : "striped";
}

std::vector<int64_t> layout_positions(Layout layout, int64_t S, int P, int r) {
  std::vector<int64_t> pos;
  auto add_range = [&](int64_t parts, int64_t part) {
    int64_t b, e;
    split_range(S, parts, part, &b, &e);
    for (int64_t t = b; t < e; t++) pos.push_back(t);
  };
  // [slide:layouts]
  switch (layout) {
    case Layout::contiguous: add_range(P, r); break;
    case Layout::zigzag: add_range(2 * P, r); add_range(2 * P, 2 * P - 1 - r); break;
    case Layout::striped:
      for (int64_t t = r; t < S; t += P) pos.push_back(t);
      break;
  }
  // [/slide]
  return pos;
}

namespace {

// ----------------------------------------------------------------------------
// Moving blocks around the ring. A block is a few tensors (K and V; in the backward also dK,
// dV) packed into one host buffer: one message per hop. Device tensors are staged through the
// host, as every MPI buffer in this course (no CUDA-aware MPI assumed).

std::vector<float> pack(const std::vector<Tensor>& ts) {
  std::vector<float> buf;
  for (const Tensor& t : ts) {
    std::vector<float> h = t.to_vector();
    buf.insert(buf.end(), h.begin(), h.end());
  }
  return buf;
}
void unpack(const std::vector<float>& buf, std::vector<Tensor*> ts, Device dev) {
  size_t off = 0;
  for (Tensor* t : ts) {
    const Shape shape = t->shape();
    std::vector<float> h(buf.begin() + (std::ptrdiff_t)off,
                         buf.begin() + (std::ptrdiff_t)(off + (size_t)shape_numel(shape)));
    off += h.size();
    *t = Tensor::from_vector(h, shape, dev);
  }
}

// One synchronous hop: send `out` to r+1, receive `in` from r-1, with MPI_Ssend, which returns
// only once the receiver has started receiving (no buffering can hide an ordering mistake).
//   naive:   everyone sends first. Every rank waits in Ssend for a receiver that is itself
//            waiting in Ssend: a cycle of P waits, a deadlock for every P >= 2.
//   evenodd: even ranks send then receive, odd ranks receive then send. Odd rank r+1 receives
//            first, so even rank r's send completes; then r receives. With odd P the last rank
//            P-1 is even and sends to rank 0, also even — but rank 0's own send goes to rank 1,
//            which receives first, so rank 0 finishes sending and then receives from P-1. The
//            chain of waits always reaches an odd rank that is receiving: no cycle, any P >= 2.
void hop_sync(Comm& comm, Order order, const std::vector<float>& out, std::vector<float>& in,
              int tag) {
  const int r = comm.rank(), P = comm.size(), next = (r + 1) % P, prev = (r + P - 1) % P;
  const size_t out_bytes = out.size() * sizeof(float), in_bytes = in.size() * sizeof(float);
  // [slide:hop-sync]
  // [exercise:even-odd] One hop with synchronous sends: send `out` to next, receive `in` from prev, without deadlock for any P.
  if (order == Order::naive || r % 2 == 0) {
    comm.ssend(out.data(), out_bytes, next, tag);
    comm.recv(in.data(), in_bytes, prev, tag);
  } else {
    comm.recv(in.data(), in_bytes, prev, tag);
    comm.ssend(out.data(), out_bytes, next, tag);
  }
  // [/exercise]
  // [/slide]
}

// One hop in the protocol the order asks for, the same in the forward and the backward:
// start() before the step's compute, finish() after it. The synchronous orders do the whole
// hop in finish() (hop_sync above); async posts the receive and the send in start() and waits
// in finish(), so the transfer runs while the kernel computes (`out` and `in` are two
// buffers: double buffering).
struct Hop {
  Hop(Comm& c, Order o, int t) : comm(c), order(o), tag(t) {}
  Comm& comm;
  Order order;
  int tag;
  std::vector<float> out, in;  // what goes to r+1; what comes from r-1 (sized by the caller)
  std::vector<Request> reqs;

  // [slide:hop]
  void start() {
    if (order != Order::async) return;
    const int r = comm.rank(), P = comm.size();
    reqs.push_back(comm.irecv(in.data(), in.size() * sizeof(float), (r + P - 1) % P, tag));
    reqs.push_back(comm.isend(out.data(), out.size() * sizeof(float), (r + 1) % P, tag));
  }
  void finish() {
    if (order == Order::async) comm.wait_all(reqs);
    else hop_sync(comm, order, out, in, tag);
  }
  // [/slide]
};

// The message tags of the hops: one per step and kind, so that a message of one step can never
// be taken for another step's (forward K/V: step s; backward K/V: 100 + s; their dK/dV: 200 + s).
constexpr int kTagForwardKV = 0, kTagBackwardKV = 100, kTagBackwardGrads = 200;

// ----------------------------------------------------------------------------
// What a rank knows of every rank's block: its token count and positions.

int64_t tokens_of(const Config& c, int owner) { return (int64_t)c.positions[(size_t)owner].size(); }

Tensor positions_of(const Config& c, int owner) {
  const std::vector<int64_t>& p = c.positions[(size_t)owner];
  return Tensor::from_indices(p, {(int64_t)p.size()}, c.dev);
}

Shape block_shape(const Config& c, int64_t n) { return {c.B, c.H, n, c.D}; }

void check_inputs(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  FF_CHECK((int)c.positions.size() == comm.size(),
           "ring: positions of " << c.positions.size() << " ranks for a ring of " << comm.size());
  const Shape want = block_shape(c, tokens_of(c, comm.rank()));
  for (const Tensor* t : {&q, &k, &v})
    FF_CHECK(t->shape() == want && t->device() == c.dev,
             "ring: q, k, v must be " << shape_str(want) << " on " << device_name(c.dev) << ", got "
                                      << shape_str(t->shape()) << " on " << device_name(t->device()));
}

}  // namespace

// ----------------------------------------------------------------------------
// The forward ring. Rank r starts with its own block; at step s it holds the block of rank
// r - s (mod P), which arrived from r-1, and folds it into FlashAttention's running state of
// its queries: the row max m, the normaliser l and the unnormalised output o (lesson 01's
// merge, one block of keys at a time). P steps, P-1 hops.

Forward forward(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_inputs(comm, c, q, k, v);
  const int rank = comm.rank(), P = comm.size();
  const int64_t n = tokens_of(c, rank);
  Tensor o = Tensor::zeros(block_shape(c, n), c.dev);
  Tensor m = Tensor::full({c.B, c.H, n}, -INFINITY, c.dev);
  Tensor l = Tensor::zeros({c.B, c.H, n}, c.dev);
  const Tensor qpos = positions_of(c, rank);
  Tensor k_block = k, v_block = v;  // the block in hand
  int owner = rank;                 // whose block it is
  for (int step = 0; step < P; step++) {
    const bool more = step < P - 1;
    const int next_owner = (rank - step - 1 + 2 * P) % P;
    const int64_t n_next = tokens_of(c, next_owner);
    // [slide:ring-fwd]
    // [slide:ring-fwd-start]
    // the hop of this step: this block's K, V to r+1, the next block's from r-1
    Hop kv{comm, c.order, kTagForwardKV + step};
    if (more) {
      kv.out = pack({k_block, v_block});
      kv.in.resize((size_t)(2 * c.B * c.H * n_next * c.D));
      kv.start();
    }
    // [/slide:ring-fwd-start]
    // [slide:ring-fwd-compute]
    {
      Trace::Scope span(trace(), "fwd block of rank " + std::to_string(owner), "compute");
      Tensor kpos = positions_of(c, owner);
      kernels_for(c.dev).flash_forward_block(
          o.data(), m.data(), l.data(), q.data(), k_block.data(), v_block.data(), qpos.index_data(),
          kpos.index_data(), c.B * c.H, n, tokens_of(c, owner), c.D, 1.f / std::sqrt((float)c.D),
          c.causal);
    }
    if (!more) break;
    kv.finish();
    // [/slide:ring-fwd-compute]
    // [/slide]
    k_block = Tensor::empty(block_shape(c, n_next)), v_block = Tensor::empty(block_shape(c, n_next));
    unpack(kv.in, {&k_block, &v_block}, c.dev);
    owner = next_owner;
  }
  // The end of FlashAttention's forward: o /= l, and one number per row for the backward.
  Forward f;
  f.o = div(o, reshape(l, {c.B, c.H, n, 1}));
  f.lse = add(m, log(l));
  f.m = m;
  return f;
}

// ----------------------------------------------------------------------------
// The backward ring. The blocks go round again. P_ij = exp(s_ij - lse_i) is recomputed from
// the forward's lse; dQ of this rank's queries accumulates at home, while the dK, dV of the block
// in hand get this rank's share and then travel on WITH the block: after P hops every block is
// back at its owner, with every rank's share summed in.

Backward backward(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& dout, const Forward& f) {
  check_inputs(comm, c, q, k, v);
  const int rank = comm.rank(), P = comm.size();
  const int64_t n = tokens_of(c, rank), row = c.B * c.H * c.D;  // floats per token of a block
  // delta_i = dO_i . o_i = sum_j P_ij dP_ij: the softmax Jacobian's row term, computed once
  const Tensor delta = c.bug == Bug::no_delta ? Tensor::zeros({c.B, c.H, n}, c.dev) : sum(mul(dout, f.o), -1);
  const Tensor lse = c.bug == Bug::lse_no_log ? f.m : f.lse;
  const Tensor qpos = positions_of(c, rank);
  Tensor dq = Tensor::zeros(block_shape(c, n), c.dev);
  // the planted bug's accumulators: whatever this rank computes, for any block, lands here
  Tensor dk_here = Tensor::zeros(block_shape(c, n), c.dev), dv_here = dk_here.clone();
  Tensor dk = Tensor::zeros(block_shape(c, n), c.dev), dv = dk.clone();  // travel with the block
  Tensor k_block = k, v_block = v;  // the block in hand
  int owner = rank;                 // whose block it is
  for (int step = 0; step < P; step++) {
    const bool more = step < P - 1;
    const int next_owner = (rank - step - 1 + 2 * P) % P;
    const int64_t n_cur = tokens_of(c, owner), n_next = tokens_of(c, next_owner);
    // K, V are known before the compute: their hop starts now (async overlaps it)
    Hop kv{comm, c.order, kTagBackwardKV + step};
    if (more) {
      kv.out = pack({k_block, v_block});
      kv.in.resize((size_t)(2 * row * n_next));
      kv.start();
    }
    {
      Trace::Scope span(trace(), "bwd block of rank " + std::to_string(owner), "compute");
      Tensor kpos = positions_of(c, owner);
      // (the bug needs equal block sizes, n_cur == n: lesson 02 checks)
      Tensor& dk_into = c.bug == Bug::dkv_local ? dk_here : dk;
      Tensor& dv_into = c.bug == Bug::dkv_local ? dv_here : dv;
      kernels_for(c.dev).flash_backward_block(
          dq.data(), dk_into.data(), dv_into.data(), q.data(), k_block.data(), v_block.data(),
          dout.data(), lse.data(), delta.data(), qpos.index_data(), kpos.index_data(), c.B * c.H, n,
          n_cur, c.D, 1.f / std::sqrt((float)c.D), c.causal);
    }
    // [slide:ring-bwd-dkv]
    if (P == 1) break;  // the only block is this rank's own: nothing travels, no self-send
    // [exercise:dkv-route] After this step's compute: send dK, dV on with their block and take in the next block, its K, V and its dK, dV so far.
    // [slide:ring-bwd-dkv-hop]
    // dK, dV exist only now: their hop follows the block's (P hops, one more than K, V make)
    Hop dkv{comm, c.order, kTagBackwardGrads + step};
    dkv.out = pack({dk, dv});
    dkv.in.resize((size_t)(2 * row * n_next));
    dkv.start();
    dkv.finish();
    if (more) kv.finish();
    // [/slide:ring-bwd-dkv-hop]
    if (more) {
      k_block = Tensor::empty(block_shape(c, n_next)), v_block = Tensor::empty(block_shape(c, n_next));
      unpack(kv.in, {&k_block, &v_block}, c.dev);
    }
    dk = Tensor::empty(block_shape(c, n_next)), dv = Tensor::empty(block_shape(c, n_next));
    unpack(dkv.in, {&dk, &dv}, c.dev);
    owner = next_owner;
    // [/exercise]
    // [/slide]
  }
  // After P hops the block in hand is this rank's own, with everyone's dK, dV summed in.
  FF_CHECK(owner == rank, "ring bookkeeping: rank " << rank << " ended with block " << owner);
  Backward b;
  b.dq = dq;
  b.dk = c.bug == Bug::dkv_local ? dk_here : dk;
  b.dv = c.bug == Bug::dkv_local ? dv_here : dv;
  return b;
}

// ----------------------------------------------------------------------------
// The two rings as one autograd op (lesson 08's context-parallel attention).

Tensor attention(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  const Tensor q0 = q.detach(), k0 = k.detach(), v0 = v.detach();
  auto f = std::make_shared<Forward>();
  {
    NoGradGuard ng;
    *f = forward(comm, c, q0, k0, v0);
  }
  // the closure keeps o for the backward's delta, as a view of its own: it must not hold the
  // output's node, or the output would keep itself alive
  Tensor out = f->o;
  f->o = out.detach();
  Comm ring = comm;
  return record(out, "ring_attention", {q, k, v},
                [ring, c, q0, k0, v0, f](const Tensor& dy) mutable -> std::vector<Tensor> {
                  Backward b = backward(ring, c, q0, k0, v0, dy, *f);
                  return {b.dq, b.dk, b.dv};
                });
}

}  // namespace ff::ring
