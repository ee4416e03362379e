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
#include "lessons/02_ring_attention/ring.h"

using namespace ff;


using ring::Bug;
using ring::Layout;
using ring::Order;

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
// Layouts (ring::layout_positions, ring.cpp): which global token
// positions rank r holds. contiguous: tokens [r*S/P, (r+1)*S/P); zigzag: the sequence cut into
// 2P chunks, rank r holding chunks r and 2P-1-r, one early and one late, so every rank gets the
// same share of the causal triangle; striped: token t on rank t mod P.

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
  std::vector<int64_t> qpos = ring::layout_positions(c.layout, c.S, P, r);
  int64_t entries = 0;
  for (int owner = 0; owner < P; owner++) {
    std::vector<int64_t> kpos = ring::layout_positions(c.layout, c.S, P, owner);
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
// The ring (ring.cpp: ring::forward and ring::backward, each one loop of P steps). Rank r starts
// with its own K/V block; at step s it holds the block of rank r - s (mod P), which arrived
// from r-1, and folds it into its FlashAttention state (m, l, o) with flash_forward_block:
// P steps, P-1 hops. Each hop's order is --order's (ring.cpp's Hop: start before the block's
// compute, finish after it). The backward sends the blocks round again: dQ accumulates at home,
// dK and dV travel WITH their block and arrive back at its owner after P hops, fully summed.

struct Local {                    // this rank's tensors, (B, H, n, D) on the lesson's device
  Tensor q, k, v, dout;
  std::vector<int64_t> pos;       // global positions of the rank's tokens
};

static std::vector<int64_t> owner_positions(const Config& c, int P, int owner) {
  return ring::layout_positions(c.layout, c.S, P, owner);
}

// The ring's settings: the shapes, the order, the planted bug, and every rank's mask positions.
static ring::Config ring_config(const Config& c, int P) {
  ring::Config rc;
  rc.B = c.B, rc.H = c.H, rc.D = c.D;
  rc.causal = c.causal, rc.order = c.order, rc.bug = c.bug, rc.dev = c.dev;
  for (int q = 0; q < P; q++) rc.positions.push_back(mask_positions(c, owner_positions(c, P, q)));
  return rc;
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
  // the setup and the work table (rank 0 prints; the counting is cheap)
  lesson.print("== 02 ring attention: P=%d ranks, B=%lld H=%lld S=%lld D=%lld, %s, layout %s, "
               "order %s, device %s\n", P, (long long)c.B, (long long)c.H, (long long)c.S,
               (long long)c.D, c.causal ? (c.global_mask ? "causal" : "causal with LOCAL mask")
                                        : "non-causal",
               layout.c_str(), order.c_str(), device_name(c.dev));
  for (int q = 0; q < std::min(P, 8); q++)
    lesson.print("   rank %d holds tokens %s\n", q,
                 describe_positions(owner_positions(c, P, q)).c_str());
  if (P > 8) lesson.print("   ...\n");
  // The work table: the same counting rule as the kernels' tile skip.
  lesson.print("work per rank: score entries computed, in %lldx%lld tiles%s\n",
               (long long)kAttentionTile, (long long)kAttentionTile,
               c.causal ? " (a tile with every key in the future is skipped)" : "");
  for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::striped}) {
    Config cl = c;
    cl.layout = l;
    if (c.S < (l == Layout::zigzag ? 2 * P : P)) continue;
    lesson.print("  %s %-10s", l == c.layout ? "*" : " ", ring::layout_name(l));
    int64_t worst = 0, total = 0;
    for (int q = 0; q < P; q++) {
      int64_t w = ring_work(cl, P, q);
      worst = std::max(worst, w), total += w;
      if (q < 8) lesson.print(" %8lld", (long long)w);
    }
    lesson.print("%s   max/mean %.2f\n", P > 8 ? " ..." : "", (double)worst * P / (double)total);
  }

  // Inputs: every rank generates the same global tensors from the seed and takes its tokens.
  Reference R = reference(c, seed);
  Local me;
  me.pos = owner_positions(c, P, rank);
  me.q = take_tokens(R.q, me.pos).to(c.dev);
  me.k = take_tokens(R.k, me.pos).to(c.dev);
  me.v = take_tokens(R.v, me.pos).to(c.dev);
  me.dout = take_tokens(R.dout, me.pos).to(c.dev);

  if (P == 1)
    lesson.print("ring: one rank holds the whole sequence: 1 step forward and backward, no hops\n");
  else
    lesson.print("ring: %d steps forward (%d hop%s of K,V), %d backward (K,V and dK,dV travel "
                 "together; one more hop brings dK,dV home)\n", P, P - 1, P == 2 ? "" : "s", P);
  comm.barrier();
  lesson.start_trace();  // the trace covers the ring only
  const Stopwatch forward_watch;
  const ring::Config rc = ring_config(c, P);
  // P steps: fold the K/V block in hand into (m, l, o), pass it to r+1, take r-1's
  const ring::Forward fw = ring::forward(comm, rc, me.q, me.k, me.v);
  const double forward_ms = forward_watch.ms();
  const Stopwatch backward_watch;
  // P steps again: dQ accumulates here, dK and dV travel with their block back to its owner
  const ring::Backward bw = ring::backward(comm, rc, me.q, me.k, me.v, me.dout, fw);
  const Tensor &o = fw.o, &lse = fw.lse, &dq = bw.dq, &dk = bw.dk, &dv = bw.dv;
  double times[2] = {forward_ms, backward_watch.ms()};
  comm.allreduce(times, 2, MPI_DOUBLE, MPI_MAX);
  lesson.print("    forward %.2f ms, backward %.2f ms (slowest rank)\n", times[0], times[1]);

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

  lesson.print("checks: each rank's o, lse, dQ, dK, dV against its tokens of the single-process "
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
              ring::layout_name(l) + "," + std::to_string(q) + "," + std::to_string(ring_work(cl, P, q)) + "\n";
  }
  lesson.csv_append("P,S,causal,layout,rank,entries", rows);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "02_ring_attention", ring_attention_lesson);
}
