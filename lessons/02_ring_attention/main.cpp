// Lesson 02 — ring attention: context parallelism with the online softmax.
//
// What: attention softmax(Q K^T / sqrt(D) + mask) V over a sequence of S tokens split across P
//   ranks. Each rank keeps the queries of its tokens; the key/value blocks travel around the
//   ring r -> r+1, and every rank folds each block that passes into its running FlashAttention
//   state (m, l, o) — lesson 01's merge, applied to blocks of keys (Liu, Zaharia & Abbeel,
//   "Ring Attention with Blockwise Transformers", 2023). The backward sends the blocks round
//   again: dQ stays home, while dK and dV travel WITH their K/V block, collecting every rank's
//   contribution, and arrive back at the block's owner fully summed.
//   The block forward/backward are the FlashAttention-2 kernels flash_forward_block and
//   flash_backward_block (kernels/cpu/attention.cpp is their readable definition,
//   kernels/cuda/attention.cu the CUDA version that --device sim/cuda runs).
// Why: attention memory and time grow with S^2; a ring spreads both over P devices while each
//   link only ever carries one block, and the next block's transfer hides behind the current
//   block's compute (--order async).
// What to look at:
//   --order naive|evenodd|async  who sends and who receives first. naive deadlocks (every rank
//                                in MPI_Ssend, nobody receiving): the watchdog names it.
//   --causal --layout contiguous|zigzag|striped   the causal mask makes late tokens more work;
//                                the table of per-rank work shows how zigzag and striped
//                                layouts balance it.
//   --mask local                 builds the causal mask from local indices: the classic bug.
//   --bug dkv-local|no-delta|lse-no-log           planted backward mistakes.
// Run:  make run L=02 NP=4
//       make run L=02 NP=4 ARGS="--causal --layout zigzag --order async"
// Expect: the per-rank work table, the checks of o, lse, dQ, dK, dV against the single-process
//   autograd reference (max abs / rel error and the tolerance), "check: PASS".
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/lesson/lesson.h"
#include "kernels/kernels.h"

using namespace ff;


enum class Order { naive, evenodd, async };
enum class Layout { contiguous, zigzag, striped };
// Planted mistakes (--bug), each one the check must catch:
//   dkv_local   dK/dV accumulated on the rank that computes them instead of travelling with
//               their block (a well-known teaching version of ring attention does this)
//   no_delta    dS = P * dP, forgetting the softmax Jacobian's row term delta = rowsum(dO * O)
//   lse_no_log  the backward recomputes P = exp(s - m) from the max alone: P not normalised
enum class Bug { none, dkv_local, no_delta, lse_no_log };

struct Config {
  int64_t B = 1, H = 2, S = 128, D = 16;
  bool causal = false;
  bool global_mask = true;  // --mask global (right) or local (the bug)
  Order order = Order::evenodd;
  Layout layout = Layout::contiguous;
  Bug bug = Bug::none;
  Device dev = Device::cpu;
};

// ----------------------------------------------------------------------------
// Layouts: which global token positions rank r holds (ascending). Every layout uses the one
// split rule of the library (split_range), so S need not divide evenly.
//   contiguous  tokens [r*S/P, (r+1)*S/P)
//   zigzag      the sequence cut into 2P chunks; rank r holds chunks r and 2P-1-r, one early
//               and one late, so every rank gets the same share of the causal triangle
//   striped     token t on rank t mod P: every rank samples the sequence uniformly

static std::vector<int64_t> layout_positions(Layout layout, int64_t S, int P, int r) {
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

// The positions the causal mask is built from: the global ones, or — the classic bug — the
// rank-local indices 0..n-1, as if every block started the sequence.
static std::vector<int64_t> mask_positions(const Config& c, const std::vector<int64_t>& global) {
  // [slide:mask-positions]
  if (c.global_mask) return global;
  std::vector<int64_t> local(global.size());
  for (size_t i = 0; i < local.size(); i++) local[i] = (int64_t)i;
  return local;
  // [/slide]
}

// (B, H, S, D) <-> (B, H, n, D): the tokens at `pos`, and back.
static Tensor take_tokens(const Tensor& x, const std::vector<int64_t>& pos) {
  const int64_t BH = x.size(0) * x.size(1), S = x.size(2), D = x.size(3), n = (int64_t)pos.size();
  Tensor out = Tensor::empty({x.size(0), x.size(1), n, D});
  for (int64_t bh = 0; bh < BH; bh++)
    for (int64_t i = 0; i < n; i++)
      std::copy_n(x.data() + (bh * S + pos[(size_t)i]) * D, D, out.data() + (bh * n + i) * D);
  return out;
}
static void put_tokens(Tensor& x, const Tensor& part, const std::vector<int64_t>& pos) {
  const int64_t BH = x.size(0) * x.size(1), S = x.size(2), D = x.size(3), n = (int64_t)pos.size();
  for (int64_t bh = 0; bh < BH; bh++)
    for (int64_t i = 0; i < n; i++)
      std::copy_n(part.data() + (bh * n + i) * D, D, x.data() + (bh * S + pos[(size_t)i]) * D);
}

// ----------------------------------------------------------------------------
// Work: both attention kernels walk kAttentionTile x kAttentionTile tiles of (query, key)
// and skip a tile whose keys are all in the future of all its queries. This counts, with the
// same rule, the score entries rank r computes over the whole ring — its share of the work.

static int64_t ring_work(const Config& c, int P, int r) {
  std::vector<int64_t> qpos = layout_positions(c.layout, c.S, P, r);
  int64_t entries = 0;
  for (int owner = 0; owner < P; owner++) {
    std::vector<int64_t> kpos = layout_positions(c.layout, c.S, P, owner);
    for (size_t i0 = 0; i0 < qpos.size(); i0 += kAttentionTile)
      for (size_t j0 = 0; j0 < kpos.size(); j0 += kAttentionTile) {
        size_t i1 = std::min(qpos.size(), i0 + kAttentionTile);
        size_t j1 = std::min(kpos.size(), j0 + kAttentionTile);
        int64_t q_max = *std::max_element(qpos.begin() + i0, qpos.begin() + i1);
        int64_t k_min = *std::min_element(kpos.begin() + j0, kpos.begin() + j1);
        if (c.causal && k_min > q_max) continue;
        entries += (int64_t)((i1 - i0) * (j1 - j0));
      }
  }
  return entries * c.B * c.H;
}

// ----------------------------------------------------------------------------
// Moving blocks around the ring. A block is a few tensors (K and V; in the backward also dK,
// dV) packed into one host buffer: one message per hop. Device tensors are staged through the
// host, as every MPI buffer in this course (no CUDA-aware MPI assumed).

static std::vector<float> pack(const std::vector<Tensor>& ts) {
  std::vector<float> buf;
  for (const Tensor& t : ts) {
    std::vector<float> h = t.to_vector();
    buf.insert(buf.end(), h.begin(), h.end());
  }
  return buf;
}
static void unpack(const std::vector<float>& buf, std::vector<Tensor*> ts, Device dev) {
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
static void hop_sync(Comm& comm, Order order, const std::vector<float>& out, std::vector<float>& in,
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

// One hop in the protocol --order asked for, the same in the forward and the backward:
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

// ----------------------------------------------------------------------------
// The ring. Rank r starts with its own block; at step s it holds the block of rank
// owner(s) = r - s (mod P), which arrived from r-1. P steps, P-1 hops in the forward.

struct Local {                    // this rank's tensors, (B, H, n, D) on the lesson's device
  Tensor q, k, v, dout;
  std::vector<int64_t> pos;       // global positions of the rank's tokens
};

struct Block {                    // the block that is passing through
  Tensor k, v;
  int owner = 0;
};

static Tensor positions_tensor(const Config& c, const std::vector<int64_t>& global) {
  std::vector<int64_t> p = mask_positions(c, global);
  return Tensor::from_indices(p, {(int64_t)p.size()}, c.dev);
}

static std::vector<int64_t> owner_positions(const Config& c, int P, int owner) {
  return layout_positions(c.layout, c.S, P, owner);
}

static Shape block_shape(const Config& c, int64_t n) { return {c.B, c.H, n, c.D}; }

// Forward. Returns o (normalised), lse = m + log l and m, all on the device.
static void ring_forward(Comm& comm, const Config& c, const Local& me, Tensor* o_out,
                         Tensor* lse_out, Tensor* m_out) {
  const int r = comm.rank(), P = comm.size();
  const int64_t n = (int64_t)me.pos.size();
  const KernelTable& kernels = kernels_for(c.dev);
  const float scale = 1.f / std::sqrt((float)c.D);
  Tensor o = Tensor::zeros(block_shape(c, n), c.dev);
  Tensor m = Tensor::full({c.B, c.H, n}, -INFINITY, c.dev);
  Tensor l = Tensor::zeros({c.B, c.H, n}, c.dev);
  Tensor qpos = positions_tensor(c, me.pos);

  Block cur{me.k, me.v, r};
  for (int s = 0; s < P; s++) {
    const bool more = s < P - 1;
    const int next_owner = (r - s - 1 + 2 * P) % P;
    const int64_t n_next = (int64_t)owner_positions(c, P, next_owner).size();
    // [slide:ring-fwd]
    // the hop of this step: this block's K, V to r+1, the next block's from r-1
    Hop kv{comm, c.order, s};
    if (more) {
      kv.out = pack({cur.k, cur.v});
      kv.in.resize((size_t)(2 * c.B * c.H * n_next * c.D));
      kv.start();
    }
    {
      const std::vector<int64_t> kpos_h = owner_positions(c, P, cur.owner);
      Trace::Scope span(trace(), "fwd block of rank " + std::to_string(cur.owner), "compute");
      Tensor kpos = positions_tensor(c, kpos_h);
      kernels.flash_forward_block(o.data(), m.data(), l.data(), me.q.data(), cur.k.data(), cur.v.data(),
                            qpos.index_data(), kpos.index_data(), c.B * c.H, n,
                            (int64_t)kpos_h.size(), c.D, scale, c.causal);
    }
    if (!more) break;
    kv.finish();
    // [/slide]
    Block nxt{Tensor::empty(block_shape(c, n_next)), Tensor::empty(block_shape(c, n_next)),
              next_owner};
    unpack(kv.in, {&nxt.k, &nxt.v}, c.dev);
    cur = nxt;
  }
  // The end of FlashAttention's forward: o /= l, and one number per row for the backward.
  *o_out = div(o, reshape(l, {c.B, c.H, n, 1}));
  *lse_out = add(m, log(l));
  *m_out = m;
}

// Backward. dQ accumulates here; dK and dV of a block travel with it and are complete when
// the block comes home: one hop more than the forward (P hops), the last one carrying only
// dK and dV.
static void ring_backward(Comm& comm, const Config& c, const Local& me, const Tensor& o,
                          const Tensor& lse, const Tensor& m_for_bug, Tensor* dq_out,
                          Tensor* dk_out, Tensor* dv_out) {
  const int r = comm.rank(), P = comm.size();
  const int64_t n = (int64_t)me.pos.size();
  const KernelTable& kernels = kernels_for(c.dev);
  const float scale = 1.f / std::sqrt((float)c.D);
  // delta_i = dO_i . o_i = sum_j P_ij dP_ij: the softmax Jacobian's row term, computed once
  Tensor delta = c.bug == Bug::no_delta ? Tensor::zeros({c.B, c.H, n}, c.dev)
                                        : sum(mul(me.dout, o), -1);
  const Tensor& lse_used = c.bug == Bug::lse_no_log ? m_for_bug : lse;
  Tensor qpos = positions_tensor(c, me.pos);
  Tensor dq = Tensor::zeros(block_shape(c, n), c.dev);
  // the planted bug's accumulators: whatever this rank computes, for any block, lands here
  Tensor dk_here = Tensor::zeros(block_shape(c, n), c.dev), dv_here = dk_here.clone();

  Block cur{me.k, me.v, r};
  Tensor dk = Tensor::zeros(block_shape(c, n), c.dev), dv = dk.clone();  // travel with cur
  for (int s = 0; s < P; s++) {
    const bool more = s < P - 1;
    const int next_owner = (r - s - 1 + 2 * P) % P;
    const int64_t n_cur = (int64_t)owner_positions(c, P, cur.owner).size();
    const int64_t n_next = (int64_t)owner_positions(c, P, next_owner).size();
    const int64_t blk = c.B * c.H * c.D;
    // K, V are known before the compute: their hop starts now (async overlaps it)
    Hop kv{comm, c.order, 100 + s};
    if (more) {
      kv.out = pack({cur.k, cur.v});
      kv.in.resize((size_t)(2 * blk * n_next));
      kv.start();
    }
    {
      const std::vector<int64_t> kpos_h = owner_positions(c, P, cur.owner);
      Trace::Scope span(trace(), "bwd block of rank " + std::to_string(cur.owner), "compute");
      Tensor kpos = positions_tensor(c, kpos_h);
      // (the bug needs equal block sizes, n_cur == n: main() checks)
      Tensor& dk_into = c.bug == Bug::dkv_local ? dk_here : dk;
      Tensor& dv_into = c.bug == Bug::dkv_local ? dv_here : dv;
      kernels.flash_backward_block(dq.data(), dk_into.data(), dv_into.data(), me.q.data(), cur.k.data(),
                             cur.v.data(), me.dout.data(), lse_used.data(), delta.data(),
                             qpos.index_data(), kpos.index_data(), c.B * c.H, n, n_cur, c.D,
                             scale, c.causal);
    }
    // [slide:ring-bwd-dkv]
    if (P == 1) break;  // the only block is this rank's own: nothing travels, no self-send
    // dK, dV exist only now: their hop follows the block's (P hops, one more than K, V make)
    Hop dkv{comm, c.order, 200 + s};
    dkv.out = pack({dk, dv});
    dkv.in.resize((size_t)(2 * blk * n_next));
    dkv.start();
    dkv.finish();
    if (more) kv.finish();
    Block nxt{Tensor::empty(block_shape(c, n_next)), Tensor::empty(block_shape(c, n_next)),
              next_owner};
    Tensor dk_next = Tensor::empty(block_shape(c, n_next)), dv_next = dk_next.clone();
    if (more) unpack(kv.in, {&nxt.k, &nxt.v}, c.dev);
    unpack(dkv.in, {&dk_next, &dv_next}, c.dev);
    cur = nxt;
    dk = dk_next;
    dv = dv_next;
    // [/slide]
  }
  // After P hops the block in hand is this rank's own, with everyone's dK, dV summed in.
  FF_CHECK(cur.owner == r, "ring bookkeeping: rank " << r << " ended with block " << cur.owner);
  *dq_out = dq;
  *dk_out = c.bug == Bug::dkv_local ? dk_here : dk;
  *dv_out = c.bug == Bug::dkv_local ? dv_here : dv;
}

// ----------------------------------------------------------------------------
// The single-process reference: attention through the autograd core, the whole sequence on
// one rank, softmax(Q K^T / sqrt(D) + mask) V with the causal mask -inf above the diagonal.

struct Reference {
  Tensor q, k, v, dout;     // (B, H, S, D) inputs, in token order
  Tensor o, lse;            // (B, H, S, D), (B, H, S, 1)
  Tensor dq, dk, dv;
};

static Reference reference(const Config& c, uint64_t seed) {
  Reference R;
  const Shape shape{c.B, c.H, c.S, c.D};
  R.q = randn(shape, seed), R.k = randn(shape, seed + 1), R.v = randn(shape, seed + 2);
  R.dout = randn(shape, seed + 3);
  Tensor q = R.q.clone().requires_grad_(), k = R.k.clone().requires_grad_(),
         v = R.v.clone().requires_grad_();
  Tensor scores = matmul(q, transpose(k, 2, 3)) * (1.f / std::sqrt((float)c.D));  // (B,H,S,S)
  if (c.causal) {
    Tensor future = Tensor::zeros({c.S, c.S});
    for (int64_t i = 0; i < c.S; i++)
      for (int64_t j = i + 1; j < c.S; j++) future.data()[i * c.S + j] = 1.f;
    scores = masked_fill(scores, future, -INFINITY);
  }
  R.o = matmul(softmax(scores), v);
  sum_all(mul(R.o, R.dout)).backward();
  R.dq = q.grad(), R.dk = k.grad(), R.dv = v.grad();
  Tensor m = max(scores, -1, /*keepdim=*/true);
  R.lse = add(m, log(sum(exp(sub(scores, m)), -1, /*keepdim=*/true)));
  R.o = R.o.detach();
  R.lse = R.lse.detach();
  return R;
}

// ----------------------------------------------------------------------------
// Reporting

// "0-15" / "0-7,56-63" / "1,5,9,... (16 tokens)": the positions a rank holds, compactly.
static std::string describe_positions(const std::vector<int64_t>& pos) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t p : pos) {
    if (!runs.empty() && runs.back().second + 1 == p)
      runs.back().second = p;
    else
      runs.push_back({p, p});
  }
  if (runs.size() > 4 && pos.size() > 2)
    return std::to_string(pos[0]) + "," + std::to_string(pos[1]) + "," + std::to_string(pos[2]) +
           ",... (" + std::to_string(pos.size()) + " tokens)";
  std::string out;
  for (auto& [a, b] : runs)
    out += (out.empty() ? "" : ",") + std::to_string(a) + (a == b ? "" : "-" + std::to_string(b));
  return out;
}

static const char* layout_name(Layout l) {
  return l == Layout::contiguous ? "contiguous" : l == Layout::zigzag ? "zigzag" : "striped";
}

// Rank 0 gathers every rank's slice of a (B, H, n, D) tensor into (B, H, S, D) token order.
static Tensor gather_tokens(Comm& comm, const Config& c, const Tensor& local, int64_t D) {
  const int P = comm.size();
  std::vector<size_t> bytes((size_t)P);
  for (int q = 0; q < P; q++)
    bytes[(size_t)q] = (size_t)(c.B * c.H * D) * owner_positions(c, P, q).size() * sizeof(float);
  std::vector<float> all;
  for (size_t b : bytes) all.resize(all.size() + b / sizeof(float));
  std::vector<float> mine = local.to_vector();
  comm.allgatherv(mine.data(), mine.size() * sizeof(float), all.data(), bytes);
  Tensor out = Tensor::empty({c.B, c.H, c.S, D});
  size_t off = 0;
  for (int q = 0; q < P; q++) {
    std::vector<int64_t> pos = owner_positions(c, P, q);
    const int64_t n = (int64_t)pos.size();
    Tensor part = Tensor::from_vector(
        std::vector<float>(all.begin() + (std::ptrdiff_t)off,
                           all.begin() + (std::ptrdiff_t)(off + bytes[(size_t)q] / sizeof(float))),
        {c.B, c.H, n, D});
    off += bytes[(size_t)q] / sizeof(float);
    put_tokens(out, part, pos);
  }
  return out;
}

// ----------------------------------------------------------------------------

static int ring_attention_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();

  Config c;
  std::string order = "evenodd", layout = "contiguous", mask = "global", bug = "none";
  Cli& cli = lesson.cli;
  cli.summary("Ring attention: the sequence split over the ranks, K/V blocks passed around a ring\n"
              "and folded into FlashAttention's online-softmax state; the backward sends dK/dV\n"
              "round with their blocks. Checked against single-process autograd attention.");
  cli.flag("--batch", &c.B, "batch size B", 1, 64);
  cli.flag("--heads", &c.H, "attention heads H", 1, 64);
  cli.flag("--seq", &c.S, "sequence length S, split over the ranks (need not divide)", 1, 1 << 16);
  cli.flag("--dim", &c.D, "head dimension D (at most 128 with --device sim/cuda)", 1, 1024);
  cli.toggle("--causal", &c.causal, "causal mask (absent: non-causal)");
  cli.choice("--order", &order, {"naive", "evenodd", "async"},
             "ring send order: naive deadlocks (the lesson), evenodd is safe, async overlaps");
  cli.choice("--layout", &layout, {"contiguous", "zigzag", "striped"},
             "which tokens each rank holds (balances the causal work)");
  cli.choice("--mask", &mask, {"global", "local"},
             "causal mask from global token positions, or local indices (the classic bug)");
  cli.choice("--bug", &bug, {"none", "dkv-local", "no-delta", "lse-no-log"},
             "plant a backward mistake to watch the check fail");
  cli.epilog("run:  make run L=02 NP=4 ARGS=\"--causal --layout zigzag --order async\"\n"
             "--order naive deadlocks on purpose; its --timeout defaults to 5 s.");
  lesson.parse();
  c.order = order == "naive" ? Order::naive : order == "async" ? Order::async : Order::evenodd;
  c.layout = layout == "zigzag" ? Layout::zigzag
             : layout == "striped" ? Layout::striped : Layout::contiguous;
  c.global_mask = mask == "global";
  c.bug = bug == "dkv-local"    ? Bug::dkv_local
          : bug == "no-delta"   ? Bug::no_delta
          : bug == "lse-no-log" ? Bug::lse_no_log : Bug::none;
  const int64_t min_seq = c.layout == Layout::zigzag ? 2 * P : P;
  lesson.usage_error_if(c.S < min_seq,
                        "--seq " + std::to_string(c.S) + " is too short for " + std::to_string(P) +
                            " ranks: the " + layout + " layout needs at least " +
                            std::to_string(min_seq) + " tokens (" +
                            (c.layout == Layout::zigzag ? "2P chunks" : "one per rank") + ")");
  lesson.usage_error_if(c.bug == Bug::dkv_local && c.S % min_seq != 0,
                        "--bug dkv-local adds every block's dK into the local one, so the blocks must be "
                        "equal: --seq must be a multiple of " + std::to_string(min_seq));
  c.dev = lesson.device;
  lesson.usage_error_if(c.dev != Device::cpu && c.D > 128,
                        "--dim " + std::to_string(c.D) + " with --device " + device_name(c.dev) +
                            ": the attention kernels hold 16 x D tiles in shared memory, D <= 128");
  // The reference holds whole (B, H, S, S) score, probability and gradient matrices and a
  // dozen (B, H, S, D) tensors; the ring's own share is small beside them.
  const double BH = (double)c.B * (double)c.H, S = (double)c.S;
  lesson.require_memory(4.0 * BH * S * (6.0 * S + 16.0 * (double)c.D),
                        "--seq (the reference is S x S per head), --batch, --heads or --dim");
  // naive deadlocks by design: do not make the student wait a minute for the watchdog
  if (c.order == Order::naive && !cli.given("--timeout")) comm.set_timeout(5.0);

  const uint64_t seed = (uint64_t)lesson.flags.seed;
  if (rank == 0) {
    std::printf("== 02 ring attention: P=%d ranks, B=%lld H=%lld S=%lld D=%lld, %s, layout %s, "
                "order %s, device %s\n", P, (long long)c.B, (long long)c.H, (long long)c.S,
                (long long)c.D, c.causal ? (c.global_mask ? "causal" : "causal with LOCAL mask")
                                         : "non-causal",
                layout.c_str(), order.c_str(), device_name(c.dev));
    for (int q = 0; q < std::min(P, 8); q++)
      std::printf("   rank %d holds tokens %s\n", q,
                  describe_positions(owner_positions(c, P, q)).c_str());
    if (P > 8) std::printf("   ...\n");
    // The work table: the same counting rule as the kernels' tile skip.
    std::printf("work per rank: score entries computed, in %lldx%lld tiles%s\n",
                (long long)kAttentionTile, (long long)kAttentionTile,
                c.causal ? " (a tile with every key in the future is skipped)" : "");
    for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::striped}) {
      Config cl = c;
      cl.layout = l;
      if (c.S < (l == Layout::zigzag ? 2 * P : P)) continue;
      std::printf("  %s %-10s", l == c.layout ? "*" : " ", layout_name(l));
      int64_t worst = 0, total = 0;
      for (int q = 0; q < P; q++) {
        int64_t w = ring_work(cl, P, q);
        worst = std::max(worst, w), total += w;
        if (q < 8) std::printf(" %8lld", (long long)w);
      }
      std::printf("%s   max/mean %.2f\n", P > 8 ? " ..." : "", (double)worst * P / (double)total);
    }
  }

  // Inputs: every rank generates the same global tensors from the seed and takes its tokens.
  Reference R = reference(c, seed);
  Local me;
  me.pos = owner_positions(c, P, rank);
  me.q = take_tokens(R.q, me.pos).to(c.dev);
  me.k = take_tokens(R.k, me.pos).to(c.dev);
  me.v = take_tokens(R.v, me.pos).to(c.dev);
  me.dout = take_tokens(R.dout, me.pos).to(c.dev);

  if (rank == 0) {
    if (P == 1)
      std::printf("ring: one rank holds the whole sequence: 1 step forward and backward, no hops\n");
    else
      std::printf("ring: %d steps forward (%d hop%s of K,V), %d backward (K,V and dK,dV travel "
                  "together; one more hop brings dK,dV home)\n", P, P - 1, P == 2 ? "" : "s", P);
  }
  comm.barrier();
  lesson.start_trace();  // the trace covers the ring only
  const double t0 = MPI_Wtime();
  Tensor o, lse, m, dq, dk, dv;
  ring_forward(comm, c, me, &o, &lse, &m);
  const double t1 = MPI_Wtime();
  ring_backward(comm, c, me, o, lse, m, &dq, &dk, &dv);
  double times[2] = {(t1 - t0) * 1e3, (MPI_Wtime() - t1) * 1e3};
  comm.allreduce(times, 2, MPI_DOUBLE, MPI_MAX);
  if (rank == 0)
    std::printf("    forward %.2f ms, backward %.2f ms (slowest rank)\n", times[0], times[1]);

  // Tolerances: worst-case float32 rounding of the sums involved (Higham, Accuracy and
  // Stability, §3.1: a sum of n terms is off by at most about n * eps * sum |terms|).
  //   o_i = sum_j P_ij v_j, with sum_j P_ij = 1:             n = S terms, |o| <= max|v|
  //   lse = m + log l, l a sum of S terms in (0, 1]:         S * eps in log l, + ulps of m
  //   dV_j = sum_i P_ij dO_i                                  S terms, <= max|dO| each
  //   dQ_i = scale * sum_j P_ij (dP_ij - delta_i) k_j, dP and delta dot products of D terms:
  //          (S + D) * eps relative on terms bounded by D * max|dO| * max|v| * max|k|
  // A factor 4 covers exp() and the few multiplications per term (each within a few ulps).
  const double eps = FLT_EPSILON, Sd = (double)c.S, Dd = (double)c.D;
  const double vmax = max_abs(R.v), domax = max_abs(R.dout),
               qkmax = std::max(max_abs(R.q), max_abs(R.k));
  const double tol_o = 4 * Sd * eps * vmax;
  const double tol_lse = 4 * Sd * eps * (1 + max_abs(R.lse));
  const double tol_dv = 4 * Sd * eps * domax;
  const double tol_dqk = 4 * (Sd + Dd) * eps * Dd * domax * vmax * qkmax / std::sqrt(Dd);

  if (rank == 0)
    std::printf("checks: each rank's o, lse, dQ, dK, dV against its tokens of the single-process "
                "autograd attention (worst rank shown)\n");
  // From here on, the check: its traffic goes to the trace's "check" track, apart from the
  // algorithm's timeline.
  Trace::Category check_traffic(trace(), "check");
  CheckReport check(comm);
  Tensor lse4 = reshape(lse, {c.B, c.H, (int64_t)me.pos.size(), 1});
  check.close("o   = softmax(QK^T/sqrt(D)+mask) V", o.to(Device::cpu), take_tokens(R.o, me.pos),
               tol_o);
  check.close("lse = m + log l", lse4.to(Device::cpu), take_tokens(R.lse, me.pos), tol_lse);
  check.close("dQ  (accumulated at home)", dq.to(Device::cpu), take_tokens(R.dq, me.pos),
               tol_dqk);
  check.close("dK  (travelled with its block)", dk.to(Device::cpu), take_tokens(R.dk, me.pos),
               tol_dqk);
  check.close("dV  (travelled with its block)", dv.to(Device::cpu), take_tokens(R.dv, me.pos),
               tol_dv);

  // ---------------- outputs: dump and csv (the trace is written by finish)
  if (lesson.dumping()) {  // whole tensors in token order, gathered to rank 0
    Tensor go = gather_tokens(comm, c, o.to(Device::cpu), c.D);
    Tensor glse = gather_tokens(comm, c, lse4.to(Device::cpu), 1);
    Tensor gdq = gather_tokens(comm, c, dq.to(Device::cpu), c.D);
    Tensor gdk = gather_tokens(comm, c, dk.to(Device::cpu), c.D);
    Tensor gdv = gather_tokens(comm, c, dv.to(Device::cpu), c.D);
    if (rank == 0) {
      lesson.dump("q", R.q), lesson.dump("k", R.k), lesson.dump("v", R.v);
      lesson.dump("do", R.dout), lesson.dump("o", go);
      lesson.dump("lse", glse.view({c.B, c.H, c.S}));
      lesson.dump("dq", gdq), lesson.dump("dk", gdk), lesson.dump("dv", gdv);
      char meta[256];
      std::snprintf(meta, sizeof meta,
                    "{\"causal\": %s, \"mask\": \"%s\", \"layout\": \"%s\", \"P\": %d, "
                    "\"scale\": %.9g, \"order\": \"%s\"}\n", c.causal ? "true" : "false",
                    mask.c_str(), layout.c_str(), P, 1.0 / std::sqrt((double)c.D), order.c_str());
      lesson.dump_text("meta.json", meta);
    }
  }
  // one row per (layout, rank): the score entries it computes (for the bar chart); appended
  std::string rows;
  for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::striped}) {
    Config cl = c;
    cl.layout = l;
    if (c.S < (l == Layout::zigzag ? 2 * P : P)) continue;
    for (int q = 0; q < P; q++)
      rows += std::to_string(P) + "," + std::to_string(c.S) + "," + (c.causal ? "1" : "0") + "," +
              layout_name(l) + "," + std::to_string(q) + "," + std::to_string(ring_work(cl, P, q)) + "\n";
  }
  lesson.csv_append("P,S,causal,layout,rank,entries", rows);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "02_ring_attention", ring_attention_lesson);
}
