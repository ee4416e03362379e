// common/layers/schedule.cpp — a schedule's layout, its printing, its checks and the simulator
// (the generators are lesson 07's: lessons/07_dualpipe/schedules.cpp).
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

namespace {

// One run of simulate(): every rank's place in its program and when what it waits for is ready.
class Simulator {
 public:
  Simulator(const Schedule& s, const Costs& c)
      : s_(s), c_(c), pc_((size_t)s.P, 0), free_at_((size_t)s.P, 0), live_((size_t)s.P, 0),
        backward_seen_((size_t)s.P, false) {
    sim.busy.assign((size_t)s.P, 0);
    sim.peak_live.assign((size_t)s.P, 0);
    sim.warmup.assign((size_t)s.P, 0);
  }

  // Runs rank r's next steps for as long as their inputs are there; false if none could run.
  bool advance(int r) {
    const std::vector<Step>& prog = s_.ranks[(size_t)r];
    bool ran = false;
    // [slide:sim-step]
    while (pc_[(size_t)r] < prog.size()) {
      const Step& step = prog[pc_[(size_t)r]];
      double start = free_at_[(size_t)r];
      bool blocked = false;
      for (const Op& op : ops_of(step)) {
        double t = inputs_ready(r, op);
        if (t < 0) blocked = true;
        start = std::max(start, t);
      }
      if (blocked) break;
      // [/slide:sim-step]
      run(r, step, start);
      ran = true;
    }
    return ran;
  }

  // After the last step that could run: what each unfinished rank waits for (sim.stuck).
  void explain_stuck() {
    sim.completed = true;
    for (int r = 0; r < s_.P; r++) {
      if (pc_[(size_t)r] == s_.ranks[(size_t)r].size()) continue;
      sim.completed = false;
      const Step& step = s_.ranks[(size_t)r][pc_[(size_t)r]];
      std::string waits;
      for (const Op& op : ops_of(step))
        for (auto& [peer, msg] : io_of(s_, r, op).recv)
          if (!ready_.count({msg.grad, msg.flow, msg.stage, msg.mb}))
            waits += (waits.empty() ? "" : ", ") + describe(s_, msg) + " (rank " + std::to_string(peer) + ")";
      sim.stuck += (sim.stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " at " +
                   to_string(step) + " waits for " + (waits.empty() ? "a same-rank hand-over" : waits);
    }
  }

  // Every rank's idle time: against the makespan, and between its own first start and last end.
  void idle_times() {
    const int P = s_.P;
    sim.idle.resize((size_t)P);
    for (int r = 0; r < P; r++) sim.idle[(size_t)r] = sim.makespan - sim.busy[(size_t)r];
    std::vector<double> first((size_t)P, -1), last((size_t)P, 0);  // spans are in each rank's order
    for (const Span& sp : sim.spans) {
      if (first[(size_t)sp.rank] < 0) first[(size_t)sp.rank] = sp.start;
      last[(size_t)sp.rank] = sp.end;
    }
    sim.inner_idle.assign((size_t)P, 0);
    for (int r = 0; r < P; r++)
      if (first[(size_t)r] >= 0)
        sim.inner_idle[(size_t)r] = last[(size_t)r] - first[(size_t)r] - sim.busy[(size_t)r];
  }

  Simulation sim;

 private:
  // The time the inputs of op (on rank r) have arrived, or -1 when one is still missing.
  double inputs_ready(int r, const Op& op) const {
    double t = 0;
    for (auto& peer_msg : io_of(s_, r, op).recv) {
      const Message& msg = peer_msg.second;
      auto it = ready_.find({msg.grad, msg.flow, msg.stage, msg.mb});
      if (it == ready_.end()) return -1;
      t = std::max(t, it->second + c_.comm);
    }
    // the same-rank hand-over at the bottom of the V (no message, no comm)
    int S = s_.num_stages(), st = s_.stage_of(r, op.dir), f = s_.flow_of(op.dir);
    if (op.kind == Kind::F && st > 0 && s_.rank_of(f, st - 1) == r) {
      auto it = ready_.find({false, f, st - 1, op.mb});
      if (it == ready_.end()) return -1;
      t = std::max(t, it->second);
    }
    if (is_backward(op.kind) && st < S - 1 && s_.rank_of(f, st + 1) == r) {
      auto it = ready_.find({true, f, st + 1, op.mb});
      if (it == ready_.end()) return -1;
      t = std::max(t, it->second);
    }
    return t;
  }

  // Step runs on rank r from start: its outputs are ready at its end.
  void run(int r, const Step& step, double start) {
    // [slide:sim-end]
    double cost = c_.of(step);
    double end = start + cost;
    for (const Op& op : ops_of(step)) {
      int st = s_.stage_of(r, op.dir), f = s_.flow_of(op.dir);
      if (op.kind == Kind::F) {
        ready_[{false, f, st, op.mb}] = end;
        live_[(size_t)r]++;
        if (!backward_seen_[(size_t)r] && !step.paired) sim.warmup[(size_t)r]++;
      }
      if (is_backward(op.kind)) {
        ready_[{true, f, st, op.mb}] = end;
        backward_seen_[(size_t)r] = true;
      }
    }
    // [/slide:sim-end]
    // an overlapped pair holds its forward's activations and its backward's at once
    sim.peak_live[(size_t)r] = std::max(sim.peak_live[(size_t)r], live_[(size_t)r]);
    for (const Op& op : ops_of(step))
      if (op.kind == Kind::B || op.kind == Kind::W) live_[(size_t)r]--;
    sim.busy[(size_t)r] += cost;
    sim.spans.push_back(Span{r, step, start, end});
    free_at_[(size_t)r] = end;
    sim.makespan = std::max(sim.makespan, end);
    pc_[(size_t)r]++;
  }

  const Schedule& s_;
  const Costs& c_;
  // when (forward | gradient) of (flow, stage, mb) is ready; absent = not yet
  std::map<std::tuple<bool, int, int, int>, double> ready_;
  std::vector<size_t> pc_;          // each rank's next step
  std::vector<double> free_at_;     // when each rank's last step ended
  std::vector<int> live_;           // micro-batches each rank holds activations of
  std::vector<bool> backward_seen_;  // each rank has run a backward (its warm-up is over)
};

}  // namespace

// Every rank runs its next step as soon as its inputs are there, round after round, until no
// rank can go on: all done, or stuck (a schedule whose ranks wait for each other).
Simulation simulate(const Schedule& s, const Costs& c) {
  Simulator ranks(s, c);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.P; r++) progress = ranks.advance(r) || progress;
  }
  ranks.explain_stuck();
  ranks.idle_times();
  return ranks.sim;
}

}  // namespace ff::pp
