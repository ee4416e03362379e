// common/layers/ring_attention.cpp — see ring_attention.h.
#include "common/layers/ring_attention.h"

#include <cmath>
#include <memory>
#include <string>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/util/trace.h"
#include "kernels/kernels.h"

namespace ff::ring {

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
  if (order == Order::naive || r % 2 == 0) {
    comm.ssend(out.data(), out_bytes, next, tag);
    comm.recv(in.data(), in_bytes, prev, tag);
  } else {
    comm.recv(in.data(), in_bytes, prev, tag);
    comm.ssend(out.data(), out_bytes, next, tag);
  }
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
// The ring, one step at a time. Rank r starts with its own block; at step s it holds the block
// of rank r - s (mod P), which arrived from r-1.

ForwardRing::ForwardRing(Comm& comm, const Config& c, const Tensor& q, const Tensor& k,
                         const Tensor& v)
    : comm_(comm), c_(c), q_(q), cur_k_(k), cur_v_(v), owner_(comm.rank()) {
  check_inputs(comm, c, q, k, v);
  const int64_t n = tokens_of(c, comm.rank());
  o_ = Tensor::zeros(block_shape(c, n), c.dev);
  m_ = Tensor::full({c.B, c.H, n}, -INFINITY, c.dev);
  l_ = Tensor::zeros({c.B, c.H, n}, c.dev);
  qpos_ = positions_of(c, comm.rank());
}

void ForwardRing::step(int s) {
  const Config& c = c_;
  const int r = comm_.rank(), P = comm_.size();
  FF_CHECK(s == steps_ && s < P, "ring: forward step " << s << " after " << steps_ << " of " << P);
  steps_++;
  const bool more = s < P - 1;
  const int next_owner = (r - s - 1 + 2 * P) % P;
  const int64_t n_next = tokens_of(c, next_owner);
  // [slide:ring-fwd]
  // the hop of this step: this block's K, V to r+1, the next block's from r-1
  Hop kv{comm_, c.order, s};
  if (more) {
    kv.out = pack({cur_k_, cur_v_});
    kv.in.resize((size_t)(2 * c.B * c.H * n_next * c.D));
    kv.start();
  }
  {
    Trace::Scope span(trace(), "fwd block of rank " + std::to_string(owner_), "compute");
    Tensor kpos = positions_of(c, owner_);
    kernels_for(c.dev).flash_forward_block(
        o_.data(), m_.data(), l_.data(), q_.data(), cur_k_.data(), cur_v_.data(), qpos_.index_data(),
        kpos.index_data(), c.B * c.H, tokens_of(c, r), tokens_of(c, owner_), c.D,
        1.f / std::sqrt((float)c.D), c.causal);
  }
  if (!more) return;
  kv.finish();
  // [/slide]
  cur_k_ = Tensor::empty(block_shape(c, n_next)), cur_v_ = Tensor::empty(block_shape(c, n_next));
  unpack(kv.in, {&cur_k_, &cur_v_}, c.dev);
  owner_ = next_owner;
}

Forward ForwardRing::finish() {
  FF_CHECK(steps_ == comm_.size(), "ring: forward finished after " << steps_ << " of "
                                                                    << comm_.size() << " steps");
  // The end of FlashAttention's forward: o /= l, and one number per row for the backward.
  const int64_t n = tokens_of(c_, comm_.rank());
  Forward f;
  f.o = div(o_, reshape(l_, {c_.B, c_.H, n, 1}));
  f.lse = add(m_, log(l_));
  f.m = m_;
  return f;
}

BackwardRing::BackwardRing(Comm& comm, const Config& c, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& dout, const Forward& f)
    : comm_(comm), c_(c), q_(q), dout_(dout), cur_k_(k), cur_v_(v), owner_(comm.rank()) {
  check_inputs(comm, c, q, k, v);
  const int64_t n = tokens_of(c, comm.rank());
  // delta_i = dO_i . o_i = sum_j P_ij dP_ij: the softmax Jacobian's row term, computed once
  delta_ = c.bug == Bug::no_delta ? Tensor::zeros({c.B, c.H, n}, c.dev) : sum(mul(dout, f.o), -1);
  lse_ = c.bug == Bug::lse_no_log ? f.m : f.lse;
  qpos_ = positions_of(c, comm.rank());
  dq_ = Tensor::zeros(block_shape(c, n), c.dev);
  // the planted bug's accumulators: whatever this rank computes, for any block, lands here
  dk_here_ = Tensor::zeros(block_shape(c, n), c.dev), dv_here_ = dk_here_.clone();
  dk_ = Tensor::zeros(block_shape(c, n), c.dev), dv_ = dk_.clone();  // travel with the block
}

void BackwardRing::step(int s) {
  const Config& c = c_;
  const int r = comm_.rank(), P = comm_.size();
  FF_CHECK(s == steps_ && s < P, "ring: backward step " << s << " after " << steps_ << " of " << P);
  steps_++;
  const bool more = s < P - 1;
  const int next_owner = (r - s - 1 + 2 * P) % P;
  const int64_t n_cur = tokens_of(c, owner_), n_next = tokens_of(c, next_owner);
  const int64_t blk = c.B * c.H * c.D;
  // K, V are known before the compute: their hop starts now (async overlaps it)
  Hop kv{comm_, c.order, 100 + s};
  if (more) {
    kv.out = pack({cur_k_, cur_v_});
    kv.in.resize((size_t)(2 * blk * n_next));
    kv.start();
  }
  {
    Trace::Scope span(trace(), "bwd block of rank " + std::to_string(owner_), "compute");
    Tensor kpos = positions_of(c, owner_);
    // (the bug needs equal block sizes, n_cur == n: lesson 02 checks)
    Tensor& dk_into = c.bug == Bug::dkv_local ? dk_here_ : dk_;
    Tensor& dv_into = c.bug == Bug::dkv_local ? dv_here_ : dv_;
    kernels_for(c.dev).flash_backward_block(
        dq_.data(), dk_into.data(), dv_into.data(), q_.data(), cur_k_.data(), cur_v_.data(),
        dout_.data(), lse_.data(), delta_.data(), qpos_.index_data(), kpos.index_data(), c.B * c.H,
        tokens_of(c, r), n_cur, c.D, 1.f / std::sqrt((float)c.D), c.causal);
  }
  // [slide:ring-bwd-dkv]
  if (P == 1) return;  // the only block is this rank's own: nothing travels, no self-send
  // dK, dV exist only now: their hop follows the block's (P hops, one more than K, V make)
  Hop dkv{comm_, c.order, 200 + s};
  dkv.out = pack({dk_, dv_});
  dkv.in.resize((size_t)(2 * blk * n_next));
  dkv.start();
  dkv.finish();
  if (more) kv.finish();
  if (more) {
    cur_k_ = Tensor::empty(block_shape(c, n_next)), cur_v_ = Tensor::empty(block_shape(c, n_next));
    unpack(kv.in, {&cur_k_, &cur_v_}, c.dev);
  }
  dk_ = Tensor::empty(block_shape(c, n_next)), dv_ = Tensor::empty(block_shape(c, n_next));
  unpack(dkv.in, {&dk_, &dv_}, c.dev);
  owner_ = next_owner;
  // [/slide]
}

Backward BackwardRing::finish() {
  FF_CHECK(steps_ == comm_.size(), "ring: backward finished after " << steps_ << " of "
                                                                     << comm_.size() << " steps");
  // After P hops the block in hand is this rank's own, with everyone's dK, dV summed in.
  FF_CHECK(owner_ == comm_.rank(), "ring bookkeeping: rank " << comm_.rank() << " ended with block "
                                                              << owner_);
  Backward b;
  b.dq = dq_;
  b.dk = c_.bug == Bug::dkv_local ? dk_here_ : dk_;
  b.dv = c_.bug == Bug::dkv_local ? dv_here_ : dv_;
  return b;
}

Forward forward(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  ForwardRing ring(comm, c, q, k, v);
  for (int s = 0; s < comm.size(); s++) ring.step(s);
  return ring.finish();
}

Backward backward(Comm& comm, const Config& c, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& dout, const Forward& f) {
  BackwardRing ring(comm, c, q, k, v, dout, f);
  for (int s = 0; s < comm.size(); s++) ring.step(s);
  return ring.finish();
}

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
