// lessons/07_dualpipe/schedules.cpp — each schedule of lesson 07, built step by step: the
// program of every rank as a list of F, B, I, W and F&B steps (common/layers/schedule.h).
// Read top to bottom: the names and what each one needs, GPipe, 1F1B, the two zero-bubble
// schedules on one loop, DualPipe's eight steps (which DualPipeV shares), make_schedule, and
// the bubbles of DeepSeek-V3's Table 2.
#include "lessons/07_dualpipe/schedules.h"

#include <algorithm>
#include <deque>

#include "common/core/check.h"

namespace ff::pp {

// ---------------------------------------------------------------------------
// The names, and what each schedule needs of P and M

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b",     "zb-h1",
                                              "zb-h2", "dualpipe", "dualpipev"};
  return names;
}

std::string check_args(const std::string& name, int64_t P, int64_t M) {
  const auto& names = schedule_names();
  if (std::find(names.begin(), names.end(), name) == names.end())
    return "unknown schedule '" + name + "' (allowed: gpipe, 1f1b, zb-h1, zb-h2, dualpipe, dualpipev)";
  if (P < 1) return "--stages must be at least 1 (got " + std::to_string(P) + ")";
  if (M < 1) return "--microbatches must be at least 1 (got " + std::to_string(M) + ")";
  if (P > 1024 || M > 4096) return "at most 1024 stages and 4096 micro-batches";
  if (name == "dualpipe") {
    if (P % 2 != 0)
      return "dualpipe needs an even number of ranks P (rank r pairs with rank P-1-r), got P = " +
             std::to_string(P);
    if (M % 2 != 0 || M < 2 * P)
      return "dualpipe needs M even and M >= 2P (half of the micro-batches enter at each end), got P = " +
             std::to_string(P) + ", M = " + std::to_string(M);
  }
  if (name == "dualpipev" && M < 2 * P)
    return "dualpipev needs M >= 2P, got P = " + std::to_string(P) + ", M = " + std::to_string(M);
  return "";
}

// ---------------------------------------------------------------------------
// GPipe, 1F1B and the zero-bubble schedules: one direction, stage r on rank r

static Step one(Kind k, int dir, int mb) { return Step{Op{k, dir, mb}, false, Op{}}; }

// GPipe (Huang et al., 2019): every forward, then every backward.
static void gpipe(Schedule& s) {
  for (int r = 0; r < s.P; r++) {
    for (int m = 0; m < s.M; m++) s.ranks[r].push_back(one(Kind::F, 0, m));
    for (int m = 0; m < s.M; m++) s.ranks[r].push_back(one(Kind::B, 0, m));
  }
}

// 1F1B, non-interleaved, as in Megatron-LM (Narayanan et al., 2021). Rank r runs three phases:
// warm-up, min(P-r-1, M) forwards, as many as the ranks after it need before the first backward
// can come back; steady state, one forward then one backward at a time ("1F1B"); cool-down,
// the backwards of the micro-batches still alive. At most P-r micro-batches are alive on rank r.
static void one_f_one_b(Schedule& s) {
  for (int r = 0; r < s.P; r++) {
    auto& prog = s.ranks[r];
    // [slide:one-f-one-b]
    // [exercise:one-f-one-b] Rank r's 1F1B program into prog: warm-up forwards, then one forward and one backward at a time, then the cool-down backwards.
    const int warmup = std::min(s.P - r - 1, s.M);
    // warm-up
    for (int m = 0; m < warmup; m++) prog.push_back(one(Kind::F, 0, m));
    // steady state: 1F1B
    for (int i = 0; i < s.M - warmup; i++) {
      prog.push_back(one(Kind::F, 0, warmup + i));
      prog.push_back(one(Kind::B, 0, i));
    }
    // cool-down
    for (int m = s.M - warmup; m < s.M; m++) prog.push_back(one(Kind::B, 0, m));
    // [/exercise]
    // [/slide]
  }
}

// The two handcrafted zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism",
// ICLR 2024, §2 and Figure 3) are 1F1B with each backward split into I (input gradient, on
// the critical path to the previous stage) and W (weight gradient, needed by nobody but the
// optimizer). They differ in two numbers per rank: the warm-up forwards, and how many W's
// the rank may keep pending (the oldest runs first, as validate() requires).
static void split_backward_1f1b(Schedule& s, int r, int warmup, int max_pending_w) {
  auto& prog = s.ranks[r];
  int f = 0;
  std::deque<int> pending_w;
  // [slide:split-backward]
  // warm-up
  for (; f < warmup; f++) prog.push_back(one(Kind::F, 0, f));
  // [slide:split-backward-short]
  // steady state: a forward (while any is left), an input backward, and a W once more than
  // max_pending_w are pending
  for (int b = 0; b < s.M; b++) {
    if (f < s.M) prog.push_back(one(Kind::F, 0, f++));
    prog.push_back(one(Kind::I, 0, b));
    pending_w.push_back(b);
    if ((int)pending_w.size() > max_pending_w) {
      prog.push_back(one(Kind::W, 0, pending_w.front()));
      pending_w.pop_front();
    }
  }
  // cool-down: the W's still pending
  for (int m : pending_w) prog.push_back(one(Kind::W, 0, m));
  // [/slide:split-backward-short]
  // [/slide]
}

// ZB-H1 (§2.1, Figure 3 top): 1F1B's warm-up; rank r keeps up to r W's pending and runs them
// in the cool-down, where 1F1B sits idle. Rank r holds at most (P-r-1) + 1 + r = P
// micro-batches: the peak over the ranks is 1F1B's.
static void zb_h1(Schedule& s) {
  for (int r = 0; r < s.P; r++) split_backward_1f1b(s, r, std::min(s.P - r - 1, s.M), r);
}

// ZB-H2 (§2.2, Figure 3 bottom): ZB-H1 allowed about twice the memory. Rank r runs
// 2(P-r)-1 forwards before its first I (the warm-up plus the steady state's first forward),
// P-r-1 more than ZB-H1: they fill the time in which rank r would wait for its first
// gradient. It keeps up to 2r W's pending. Every rank then holds up to 2P-1 micro-batches
// (the paper's (2p-1) M_B: 2P-2r-1 before their I, 2r waiting for their W), and at
// F = I = W no rank is ever idle between its first op and its last: the schedule is a
// parallelogram. Its bubble is zero only if the next iteration starts into the slants at
// both ends (no synchronisation at the optimizer step, the paper's §4); one iteration on
// its own, as simulate() and the lesson run it, keeps the slant: at F = I = W, (P-1)F of
// idle on every rank, before its first op and after its last.
static void zb_h2(Schedule& s) {
  for (int r = 0; r < s.P; r++) split_backward_1f1b(s, r, std::min(2 * (s.P - r - 1), s.M), 2 * r);
}

// ---------------------------------------------------------------------------
// DualPipe and DualPipeV (the DeepSeek-V3 technical report, §3.2.1; the authors' reference,
// deepseek-ai/DualPipe, whose DualPipe.step and DualPipeV.step run the same eight steps).
// A rank holds two model chunks, "phase" 0 and phase 1. In DualPipe they are the two
// directions, the other way round on the second half of the ranks (direction = phase ^
// second_half); in DualPipeV they are the two legs of the V. A chunk here is one micro-batch
// through one of the rank's two stages, as in the reference's _forward_chunk, _backward_chunk,
// _weight_chunk and _forward_backward_chunk, which the methods below are named after.
class DualProgram {
 public:
  DualProgram(std::vector<Step>& program, bool second_half) : program_(program), second_half_(second_half) {}

  // F: the next micro-batch of the phase, forward
  void forward_chunk(int phase) { program_.push_back(Step{next_forward(phase), false, Op{}}); }
  // B, or with enable_zb (zero bubble) its input half I, the weight half W deferred
  void backward_chunk(int phase, bool enable_zb = false) {
    program_.push_back(Step{next_backward(phase, enable_zb), false, Op{}});
  }
  // W: the oldest deferred weight gradient (the reference's WeightGradStore, first in first out)
  void weight_chunk() {
    program_.push_back(Step{deferred_weights_.front(), false, Op{}});
    deferred_weights_.pop_front();
  }
  // F&B: a forward of one phase and a full backward of the other, issued together
  void forward_backward_chunk(int forward_phase, int backward_phase) {
    Op forward = next_forward(forward_phase);
    program_.push_back(Step{forward, true, next_backward(backward_phase, false)});
  }
  size_t weights_pending() const { return deferred_weights_.size(); }

 private:
  int direction(int phase) const { return phase ^ (second_half_ ? 1 : 0); }
  Op next_forward(int phase) {
    const int dir = direction(phase);
    return Op{Kind::F, dir, forwards_issued_[dir]++};
  }
  Op next_backward(int phase, bool enable_zb) {
    const int dir = direction(phase);
    Op op{enable_zb ? Kind::I : Kind::B, dir, backwards_issued_[dir]++};
    if (enable_zb) deferred_weights_.push_back(Op{Kind::W, dir, op.mb});
    return op;
  }

  std::vector<Step>& program_;
  bool second_half_;
  int forwards_issued_[2] = {0, 0}, backwards_issued_[2] = {0, 0};  // per direction
  std::deque<Op> deferred_weights_;
};

// The eight steps, named as the reference names them ("nF0B1F1B0": n rounds of a forward of
// phase 0 with a backward of phase 1, then a forward of phase 1 with a backward of phase 0). The arguments are those of DualPipeV.step: num_ranks,
// the rank, num_chunks micro-batches per phase. DualPipe runs the same program on half of its
// pipeline: DualPipe.step's num_half_ranks = P/2, half_rank = min(r, P-1-r) (the rank's
// distance from the nearer end) and half_num_chunks = M/2.
static void dual_program(DualProgram& chunk, int num_ranks, int rank, int num_chunks) {
  // where the pipeline turns: DualPipe's two middle ranks, DualPipeV's last rank (the V's bottom)
  const bool turning_rank = rank == num_ranks - 1;
  // [exercise:dualpipe-warmup] DualPipe's first three steps on this rank: nF0 (warm-up forwards of phase 0), nF0F1 (both phases alternating), nB1W1F1 (an input backward, its weight gradient, a forward).
  // Step 1: nF0 — warm-up forwards of phase 0
  const int step_1 = (num_ranks - rank - 1) * 2;
  for (int i = 0; i < step_1; i++) chunk.forward_chunk(0);
  // Step 2: nF0F1 — forwards of both phases, alternating
  const int step_2 = rank + 1;
  for (int i = 0; i < step_2; i++) {
    chunk.forward_chunk(0);
    chunk.forward_chunk(1);
  }
  // Step 3: nB1W1F1 — zero bubble: an input backward, its weight gradient, a forward
  const int step_3 = num_ranks - rank - 1;
  for (int i = 0; i < step_3; i++) {
    chunk.backward_chunk(1, /*enable_zb=*/true);
    chunk.weight_chunk();
    chunk.forward_chunk(1);
  }
  // [/exercise]
  // [slide:dual-main]
  // Step 4 (the main step): nF0B1F1B0 — overlapped forward&backward pairs. The turning rank's
  // first pair is not overlapped ("to further reduce bubble size", says the reference).
  const int step_4 = num_chunks - num_ranks * 2 + rank + 1;
  for (int i = 0; i < step_4; i++) {
    if (i == 0 && turning_rank) {
      chunk.forward_chunk(0);
      chunk.backward_chunk(1);
    } else {
      chunk.forward_backward_chunk(0, 1);
    }
    chunk.forward_backward_chunk(1, 0);
  }
  // [/slide]
  // Step 5: nB1F1B0
  const int step_5 = num_ranks - rank - 1;
  for (int i = 0; i < step_5; i++) {
    chunk.backward_chunk(1);
    chunk.forward_backward_chunk(1, 0);
  }
  // Step 6: nB1B0 — the second half of these backwards defer their weight gradients
  const int step_6 = rank + 1;
  bool enable_zb = false;
  for (int i = 0; i < step_6; i++) {
    if (i == step_6 / 2 && rank % 2 == 1) enable_zb = true;
    chunk.backward_chunk(1, enable_zb);
    if (i == step_6 / 2 && rank % 2 == 0) enable_zb = true;
    chunk.backward_chunk(0, enable_zb);
  }
  // Step 7: nWB0 — a deferred W, then an input backward
  const int step_7 = num_ranks - rank - 1;
  for (int i = 0; i < step_7; i++) {
    chunk.weight_chunk();
    chunk.backward_chunk(0, /*enable_zb=*/true);
  }
  // Step 8: nW — the remaining weight gradients
  const int step_8 = rank + 1;
  for (int i = 0; i < step_8; i++) chunk.weight_chunk();
  FF_CHECK(chunk.weights_pending() == 0,
           "dual program: " << chunk.weights_pending() << " weight gradients left");
}

// DualPipe: micro-batches enter at both ends, half of them at each; rank r holds stage r of
// direction 0 and stage P-1-r of direction 1.
static void dualpipe(Schedule& s) {
  const int num_half_ranks = s.P / 2, half_num_chunks = s.M / 2;
  for (int r = 0; r < s.P; r++) {
    const int half_rank = std::min(r, s.P - 1 - r);
    DualProgram program(s.ranks[(size_t)r], /*second_half=*/r >= num_half_ranks);
    dual_program(program, num_half_ranks, half_rank, half_num_chunks);
  }
}

// DualPipeV: the "cut-in-half" DualPipe (Sea AI Lab's V-shape; deepseek-ai/DualPipe's
// DualPipeV): one direction, the model folded in a V over the ranks.
static void dualpipev(Schedule& s) {
  for (int r = 0; r < s.P; r++) {
    DualProgram program(s.ranks[(size_t)r], /*second_half=*/false);
    dual_program(program, s.P, r, s.M);
  }
}

// ---------------------------------------------------------------------------
// Every schedule by name

Schedule make_schedule(const std::string& name, int P, int M) {
  std::string bad = check_args(name, P, M);
  FF_CHECK(bad.empty(), bad);
  Schedule s;
  s.name = name;
  s.P = P;
  s.M = M;
  s.layout = name == "dualpipe" ? Layout::dual : name == "dualpipev" ? Layout::v : Layout::line;
  s.ranks.resize((size_t)P);
  if (name == "gpipe") gpipe(s);
  if (name == "1f1b") one_f_one_b(s);
  if (name == "zb-h1") zb_h1(s);
  if (name == "zb-h2") zb_h2(s);
  if (name == "dualpipe") dualpipe(s);
  if (name == "dualpipev") dualpipev(s);
  return s;
}

// ---------------------------------------------------------------------------
// The bubble each schedule should have (schedules.h says where each formula comes from)

Formula formula_bubble(const std::string& name, int P, const Costs& c) {
  Formula f;
  if (name == "1f1b" || name == "gpipe") {
    f = {true, (P - 1) * (c.F + c.B), "(P-1)(F+B)"};
  } else if (name == "zb-h1") {
    f = {true, (P - 1) * (c.F + c.B - 2 * c.W), "(P-1)(F+B-2W)"};
  } else if (name == "zb-h2") {  // Qi et al.'s Table 2, (p-1)(T_F+T_B-2T_W) with T_B = I = B-W
    f = {true, (P - 1) * (c.F + c.B - 3 * c.W), "(P-1)(F+B-3W)**"};
  } else if (name == "dualpipe") {
    f = {true, (P / 2 - 1) * (c.FB + c.B - 3 * c.W), "(P/2-1)(F&B+B-3W)"};
  } else if (name == "dualpipev") {  // not in Table 2: DualPipe's row with 2P stages
    f = {true, (P - 1) * (c.FB + c.B - 3 * c.W), "(P-1)(F&B+B-3W)*"};
  }
  return f;
}

}  // namespace ff::pp
