// common/layers/schedule.cpp — the schedule generators, their checks and the simulator.
#include "common/layers/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <sstream>
#include <tuple>

#include "common/core/check.h"

namespace ff::pp {

int Schedule::stage_of(int rank, int dir) const {
  switch (layout) {
    // [slide:stage-of]
    case Layout::line: return rank;
    case Layout::dual: return dir == 0 ? rank : P - 1 - rank;
    case Layout::v: return dir == 0 ? rank : 2 * P - 1 - rank;
    // [/slide]
  }
  return rank;
}

int Schedule::rank_of(int flow, int stage) const {
  switch (layout) {
    case Layout::line: return stage;
    case Layout::dual: return flow == 0 ? stage : P - 1 - stage;
    case Layout::v: return stage < P ? stage : 2 * P - 1 - stage;
  }
  return stage;
}

int Schedule::dir_of(int flow, int stage) const {
  switch (layout) {
    case Layout::line: return 0;
    case Layout::dual: return flow;
    case Layout::v: return stage < P ? 0 : 1;
  }
  return 0;
}

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
// The generators

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

// DualPipe and DualPipeV share one eight-step program per rank: the one of the authors'
// reference implementation (deepseek-ai/DualPipe, DualPipe.step and DualPipeV.step; the
// DeepSeek-V3 technical report, §3.2.1). Both are written in "phases": phase 0 and phase 1
// are the two model chunks a rank holds. For DualPipe, n = P/2 and h = min(r, P-1-r) (the
// rank's distance from the nearer end); ranks in the second half hold the directions the
// other way round (direction = phase ^ second_half). For DualPipeV, n = P, h = r, and the
// phase is the leg of the V. `chunks` is the number of micro-batches per phase.
struct DualProgram {
  std::vector<Step>& prog;
  bool second_half;
  int f_next[2] = {0, 0}, b_next[2] = {0, 0};
  std::deque<Op> weights;  // deferred W's, run first-in first-out (WeightGradStore)

  int dir(int phase) const { return phase ^ (second_half ? 1 : 0); }
  Op fwd(int phase) { int d = dir(phase); return Op{Kind::F, d, f_next[d]++}; }
  Op bwd(int phase, bool zero_bubble) {
    int d = dir(phase);
    Op op{zero_bubble ? Kind::I : Kind::B, d, b_next[d]++};
    if (zero_bubble) weights.push_back(Op{Kind::W, d, op.mb});
    return op;
  }
  void F(int phase) { prog.push_back(Step{fwd(phase), false, Op{}}); }
  void B(int phase, bool zero_bubble = false) { prog.push_back(Step{bwd(phase, zero_bubble), false, Op{}}); }
  void W() {
    prog.push_back(Step{weights.front(), false, Op{}});
    weights.pop_front();
  }
  void FB(int phase_f, int phase_b) {
    Op f = fwd(phase_f);
    prog.push_back(Step{f, true, bwd(phase_b, false)});
  }
};

static void dual_program(DualProgram& p, int n, int h, int chunks) {
  bool special = h == n - 1;  // the middle ranks of DualPipe, the last rank of DualPipeV
  // 1: nF0 — warm-up forwards of phase 0
  for (int i = 0; i < (n - h - 1) * 2; i++) p.F(0);
  // 2: nF0F1 — forwards of both phases, alternating
  for (int i = 0; i < h + 1; i++) {
    p.F(0);
    p.F(1);
  }
  // 3: nB1W1F1 — zero bubble: input backward, the weight gradient, a forward
  for (int i = 0; i < n - h - 1; i++) {
    p.B(1, true);
    p.W();
    p.F(1);
  }
  // [slide:dual-main]
  // 4: nF0B1F1B0 — the main loop of overlapped forward&backward pairs. The first pair of the
  // special ranks is not overlapped ("to further reduce bubble size", says the reference).
  for (int i = 0; i < chunks - 2 * n + h + 1; i++) {
    if (i == 0 && special) {
      p.F(0);
      p.B(1);
    } else {
      p.FB(0, 1);
    }
    p.FB(1, 0);
  }
  // [/slide]
  // 5: nB1F1B0
  for (int i = 0; i < n - h - 1; i++) {
    p.B(1);
    p.FB(1, 0);
  }
  // 6: nB1B0 — the second half of these backwards defer their weight gradients
  bool zb = false;
  int step6 = h + 1;
  for (int i = 0; i < step6; i++) {
    if (i == step6 / 2 && h % 2 == 1) zb = true;
    p.B(1, zb);
    if (i == step6 / 2 && h % 2 == 0) zb = true;
    p.B(0, zb);
  }
  // 7: nWB0 — a deferred W, then an input backward
  for (int i = 0; i < n - h - 1; i++) {
    p.W();
    p.B(0, true);
  }
  // 8: nW — the remaining weight gradients
  for (int i = 0; i < h + 1; i++) p.W();
  FF_CHECK(p.weights.empty(), "dual program: " << p.weights.size() << " weight gradients left");
}

static void dualpipe(Schedule& s) {
  int n = s.P / 2;
  for (int r = 0; r < s.P; r++) {
    DualProgram p{s.ranks[r], r >= n, {0, 0}, {0, 0}, {}};
    dual_program(p, n, std::min(r, s.P - 1 - r), s.M / 2);
  }
}

// DualPipeV: the "cut-in-half" DualPipe (Sea AI Lab's V-shape; deepseek-ai/DualPipe's
// DualPipeV): one direction, the model folded in a V over the ranks.
static void dualpipev(Schedule& s) {
  for (int r = 0; r < s.P; r++) {
    DualProgram p{s.ranks[r], false, {0, 0}, {0, 0}, {}};
    dual_program(p, s.P, r, s.M);
  }
}

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
// Printing

std::string to_string(const Op& op) {
  static const char letters[] = {'F', 'B', 'I', 'W'};
  return std::string(1, letters[(int)op.kind]) + std::to_string(op.dir) + "(" +
         std::to_string(op.mb) + ")";
}

std::string to_string(const Step& step) {
  return step.paired ? to_string(step.op) + "&" + to_string(step.with) : to_string(step.op);
}

std::string format_rank(const Schedule& s, int rank) {
  std::string line = "rank " + std::to_string(rank) + ":";
  for (const Step& st : s.ranks[(size_t)rank]) line += " " + to_string(st);
  return line;
}

// ---------------------------------------------------------------------------
// Checks

namespace {
// The ops of a step, in the order they are issued.
std::vector<Op> ops_of(const Step& st) {
  if (st.paired) return {st.op, st.with};
  return {st.op};
}
bool is_backward(Kind k) { return k == Kind::B || k == Kind::I; }

// A message between stages: an activation (forward) or a gradient (backward) of a micro-batch.
struct Message {
  bool grad;
  int flow, stage, mb;  // the stage that sends it
  bool operator==(const Message& o) const {
    return grad == o.grad && flow == o.flow && stage == o.stage && mb == o.mb;
  }
};
std::string describe(const Schedule& s, const Message& m) {
  return std::string(m.grad ? "gradient of " : "activation of ") +
         to_string(Op{m.grad ? Kind::B : Kind::F, s.dir_of(m.flow, m.stage), m.mb}) + " from stage " +
         std::to_string(m.stage);
}

// What an op receives before it runs and sends after: (peer rank, message).
struct Io {
  std::vector<std::pair<int, Message>> recv, send;
};
Io io_of(const Schedule& s, int rank, const Op& op) {
  Io io;
  int S = s.num_stages(), st = s.stage_of(rank, op.dir), f = s.flow_of(op.dir);
  if (op.kind == Kind::F) {
    if (st > 0 && s.rank_of(f, st - 1) != rank) io.recv.push_back({s.rank_of(f, st - 1), {false, f, st - 1, op.mb}});
    if (st < S - 1 && s.rank_of(f, st + 1) != rank) io.send.push_back({s.rank_of(f, st + 1), {false, f, st, op.mb}});
  } else if (is_backward(op.kind)) {
    if (st < S - 1 && s.rank_of(f, st + 1) != rank) io.recv.push_back({s.rank_of(f, st + 1), {true, f, st + 1, op.mb}});
    if (st > 0 && s.rank_of(f, st - 1) != rank) io.send.push_back({s.rank_of(f, st - 1), {true, f, st, op.mb}});
  }
  return io;
}
}  // namespace

std::string validate(const Schedule& s) {
  const int S = s.num_stages(), mbs = s.mbs_per_flow();
  if ((int)s.ranks.size() != s.P) return "the schedule has " + std::to_string(s.ranks.size()) + " ranks, P = " + std::to_string(s.P);
  // state per (flow, stage, mb): 0 nothing, 1 forward done, 2 input backward done, 3 complete
  std::vector<int> state((size_t)(s.num_flows() * S * mbs), 0);
  auto at = [&](int f, int st, int mb) -> int& { return state[(size_t)((f * S + st) * mbs + mb)]; };
  // per directed link and kind (activations, gradients): each is one FIFO channel
  std::map<std::tuple<int, int, bool>, std::vector<Message>> sent, received;
  for (int r = 0; r < s.P; r++) {
    std::deque<Op> pending_w;
    for (const Step& step : s.ranks[(size_t)r]) {
      std::string where = "rank " + std::to_string(r) + ", " + to_string(step) + ": ";
      if (step.paired && (step.op.kind != Kind::F || !is_backward(step.with.kind)))
        return where + "an overlapped pair must be a forward & a backward";
      for (const Op& op : ops_of(step)) {
        int max_dir = s.layout == Layout::line ? 0 : 1;
        if (op.dir < 0 || op.dir > max_dir || op.mb < 0 || op.mb >= mbs)
          return where + "no such direction or micro-batch (d <= " + std::to_string(max_dir) +
                 ", m < " + std::to_string(mbs) + ")";
        int& st = at(s.flow_of(op.dir), s.stage_of(r, op.dir), op.mb);
        switch (op.kind) {
          case Kind::F:
            if (st != 0) return where + "forward run twice";
            st = 1;
            break;
          case Kind::B:
          case Kind::I:
            if (st != 1) return where + (st == 0 ? "backward before its forward" : "backward run twice");
            st = op.kind == Kind::B ? 3 : 2;
            if (op.kind == Kind::I) pending_w.push_back(Op{Kind::W, op.dir, op.mb});
            break;
          case Kind::W:
            if (st != 2) return where + (st < 2 ? "weight gradient before its input backward" : "weight gradient run twice");
            if (pending_w.empty() || pending_w.front().dir != op.dir || pending_w.front().mb != op.mb)
              return where + "a W must complete the oldest pending I of its rank (first in, first out)";
            pending_w.pop_front();
            st = 3;
            break;
        }
        Io io = io_of(s, r, op);
        for (auto& [peer, msg] : io.recv) received[{peer, r, msg.grad}].push_back(msg);
        for (auto& [peer, msg] : io.send) sent[{r, peer, msg.grad}].push_back(msg);
      }
    }
  }
  for (int f = 0; f < s.num_flows(); f++)
    for (int st = 0; st < S; st++)
      for (int mb = 0; mb < mbs; mb++)
        if (int state = at(f, st, mb); state != 3) {
          Op op{state == 0 ? Kind::F : state == 1 ? Kind::B : Kind::W, s.dir_of(f, st), mb};
          return "stage " + std::to_string(st) + " (rank " + std::to_string(s.rank_of(f, st)) +
                 ") never runs " + to_string(op) + (state == 1 ? " (or its I and W)" : "");
        }
  for (auto& [link, msgs] : sent) {
    const auto& got = received[link];
    for (size_t i = 0; i < msgs.size(); i++)
      if (i >= got.size() || !(got[i] == msgs[i]))
        return "link rank " + std::to_string(std::get<0>(link)) + " -> rank " +
               std::to_string(std::get<1>(link)) + (std::get<2>(link) ? " (gradients)" : " (activations)") +
               ": message " + std::to_string(i) + " sent is the " + describe(s, msgs[i]) +
               (i < got.size() ? ", but the receiver expects the " + describe(s, got[i]) : ", never received");
  }
  return "";
}

// ---------------------------------------------------------------------------
// Simulation

std::string parse_costs(const std::string& text, Costs* c) {
  // Items split at every comma, so "F=1," has an empty last item: an error, not ignored.
  std::vector<std::string> items(1);
  for (char ch : text) {
    if (ch == ',') items.emplace_back();
    else items.back() += ch;
  }
  for (const std::string& item : items) {
    if (item.empty()) return "--cost: empty item in '" + text + "' (KEY=VALUE,KEY=VALUE,...)";
    auto eq = item.find('=');
    std::string key = item.substr(0, eq);
    double* field = key == "F" ? &c->F : key == "B" ? &c->B : key == "W" ? &c->W
                  : key == "FB" ? &c->FB : key == "comm" ? &c->comm : nullptr;
    if (eq == std::string::npos || !field)
      return "--cost: '" + item + "' is not KEY=VALUE with KEY one of F, B, W, FB, comm";
    char* end = nullptr;
    std::string value = item.substr(eq + 1);
    double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(v) || v < 0)
      return "--cost: " + key + " must be a number >= 0, got '" + value + "'";
    *field = v;
  }
  if (c->F <= 0 || c->B <= 0 || c->FB <= 0) return "--cost: F, B and FB must be > 0";
  if (c->W > c->B) return "--cost: W is part of B (B = I + W), so W <= B";
  return "";
}

std::string to_string(const Costs& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "F=%g,B=%g,W=%g,FB=%g,comm=%g", c.F, c.B, c.W, c.FB, c.comm);
  return buf;
}

double Costs::of(const Step& step) const {
  if (step.paired) return FB;
  switch (step.op.kind) {
    case Kind::F: return F;
    case Kind::B: return B;
    case Kind::I: return I();
    case Kind::W: return W;
  }
  return 0;
}

double Simulation::bubble() const { return idle.empty() ? 0 : *std::max_element(idle.begin(), idle.end()); }
double Simulation::inner_bubble() const {
  return inner_idle.empty() ? 0 : *std::max_element(inner_idle.begin(), inner_idle.end());
}
double Simulation::bubble_ratio() const { return makespan > 0 ? bubble() / makespan : 0; }

Simulation simulate(const Schedule& s, const Costs& c) {
  Simulation sim;
  const int P = s.P;
  sim.busy.assign((size_t)P, 0);
  sim.peak_live.assign((size_t)P, 0);
  sim.warmup.assign((size_t)P, 0);
  // when (forward | gradient) of (flow, stage, mb) is ready; absent = not yet
  std::map<std::tuple<bool, int, int, int>, double> ready;
  std::vector<size_t> pc((size_t)P, 0);
  std::vector<double> free_at((size_t)P, 0);
  std::vector<int> live((size_t)P, 0);
  std::vector<bool> backward_seen((size_t)P, false);

  // The time the inputs of op (on rank r) have arrived, or -1 when one is still missing.
  auto inputs_ready = [&](int r, const Op& op) -> double {
    double t = 0;
    for (auto& peer_msg : io_of(s, r, op).recv) {
      const Message& msg = peer_msg.second;
      auto it = ready.find({msg.grad, msg.flow, msg.stage, msg.mb});
      if (it == ready.end()) return -1;
      t = std::max(t, it->second + c.comm);
    }
    // the same-rank hand-over at the bottom of the V (no message, no comm)
    int S = s.num_stages(), st = s.stage_of(r, op.dir), f = s.flow_of(op.dir);
    if (op.kind == Kind::F && st > 0 && s.rank_of(f, st - 1) == r) {
      auto it = ready.find({false, f, st - 1, op.mb});
      if (it == ready.end()) return -1;
      t = std::max(t, it->second);
    }
    if (is_backward(op.kind) && st < S - 1 && s.rank_of(f, st + 1) == r) {
      auto it = ready.find({true, f, st + 1, op.mb});
      if (it == ready.end()) return -1;
      t = std::max(t, it->second);
    }
    return t;
  };

  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < P; r++) {
      auto& prog = s.ranks[(size_t)r];
      // [slide:sim-step]
      while (pc[(size_t)r] < prog.size()) {
        const Step& step = prog[pc[(size_t)r]];
        double start = free_at[(size_t)r];
        bool blocked = false;
        for (const Op& op : ops_of(step)) {
          double t = inputs_ready(r, op);
          if (t < 0) blocked = true;
          start = std::max(start, t);
        }
        if (blocked) break;
        double cost = c.of(step);
        double end = start + cost;
        // [/slide]
        for (const Op& op : ops_of(step)) {
          int st = s.stage_of(r, op.dir), f = s.flow_of(op.dir);
          if (op.kind == Kind::F) {
            ready[{false, f, st, op.mb}] = end;
            live[(size_t)r]++;
            if (!backward_seen[(size_t)r] && !step.paired) sim.warmup[(size_t)r]++;
          }
          if (is_backward(op.kind)) {
            ready[{true, f, st, op.mb}] = end;
            backward_seen[(size_t)r] = true;
          }
        }
        // an overlapped pair holds its forward's activations and its backward's at once
        sim.peak_live[(size_t)r] = std::max(sim.peak_live[(size_t)r], live[(size_t)r]);
        for (const Op& op : ops_of(step))
          if (op.kind == Kind::B || op.kind == Kind::W) live[(size_t)r]--;
        sim.busy[(size_t)r] += cost;
        sim.spans.push_back(Span{r, step, start, end});
        free_at[(size_t)r] = end;
        sim.makespan = std::max(sim.makespan, end);
        pc[(size_t)r]++;
        progress = true;
      }
    }
  }
  sim.completed = true;
  for (int r = 0; r < P; r++) {
    if (pc[(size_t)r] == s.ranks[(size_t)r].size()) continue;
    sim.completed = false;
    const Step& step = s.ranks[(size_t)r][pc[(size_t)r]];
    std::string waits;
    for (const Op& op : ops_of(step))
      for (auto& [peer, msg] : io_of(s, r, op).recv)
        if (!ready.count({msg.grad, msg.flow, msg.stage, msg.mb}))
          waits += (waits.empty() ? "" : ", ") + describe(s, msg) + " (rank " + std::to_string(peer) + ")";
    sim.stuck += (sim.stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " at " +
                 to_string(step) + " waits for " + (waits.empty() ? "a same-rank hand-over" : waits);
  }
  sim.idle.resize((size_t)P);
  for (int r = 0; r < P; r++) sim.idle[(size_t)r] = sim.makespan - sim.busy[(size_t)r];
  // inner idle: from the rank's first start to its last end (spans are in each rank's order)
  std::vector<double> first((size_t)P, -1), last((size_t)P, 0);
  for (const Span& sp : sim.spans) {
    if (first[(size_t)sp.rank] < 0) first[(size_t)sp.rank] = sp.start;
    last[(size_t)sp.rank] = sp.end;
  }
  sim.inner_idle.assign((size_t)P, 0);
  for (int r = 0; r < P; r++)
    if (first[(size_t)r] >= 0)
      sim.inner_idle[(size_t)r] = last[(size_t)r] - first[(size_t)r] - sim.busy[(size_t)r];
  return sim;
}

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
