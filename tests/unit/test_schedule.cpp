// Pipeline-parallel schedules as data (common/layers/schedule.h) and lesson 07's generators
// (lessons/07_dualpipe/schedules.h): for every generator and a grid of
// (P, M), the programs are valid, complete in the simulator and run the right number of each
// op; small programs match ones traced by hand from the published algorithms; the peak
// live activations and the warm-up forwards of every rank match the papers' tables and the
// generators' rules; the simulated bubble matches the DeepSeek-V3 Table 2 formulas (and
// ZB-H2's, from Qi et al.'s Table 2); validate() catches planted errors (and a cross-rank
// cycle it cannot see is caught by the simulator); check_args and parse_costs reject bad
// input.
//
// Every expected value below is derived from the algorithm (see the comments of
// lessons/07_dualpipe/schedules.cpp), never copied from a run.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/core/check.h"
#include "common/layers/schedule.h"
#include "lessons/07_dualpipe/schedules.h"

using namespace ff;
using namespace ff::pp;

namespace {

struct OpCounts {
  int F = 0, B = 0, I = 0, W = 0;
  int per_dir_F[2] = {0, 0};
};

// Every op a rank runs, the two halves of an overlapped pair counted separately.
OpCounts count_ops(const Schedule& s, int rank) {
  OpCounts c;
  for (const Step& st : s.ranks[(size_t)rank]) {
    std::vector<Op> ops{st.op};
    if (st.paired) ops.push_back(st.with);
    for (const Op& op : ops) {
      switch (op.kind) {
        case Kind::F:
          c.F++;
          if (op.dir == 0 || op.dir == 1) c.per_dir_F[op.dir]++;
          break;
        case Kind::B: c.B++; break;
        case Kind::I: c.I++; break;
        case Kind::W: c.W++; break;
      }
    }
  }
  return c;
}

// Forwards per rank: one per (stage the rank holds, micro-batch).
int forwards_per_rank(const Schedule& s) {
  switch (s.layout) {
    case Layout::line: return s.M;      // one stage, M micro-batches
    case Layout::dual: return s.M;      // two stages, M/2 micro-batches each
    case Layout::v: return 2 * s.M;     // two stages, M micro-batches each
  }
  return -1;
}

// Index of the step of `rank` printed as `text` (e.g. "B0(2)"); -1 when absent.
int find_step(const Schedule& s, int rank, const std::string& text) {
  const auto& prog = s.ranks[(size_t)rank];
  for (size_t i = 0; i < prog.size(); i++)
    if (to_string(prog[i]) == text) return (int)i;
  return -1;
}

// Swap two steps of a rank, found by their printed form.
void swap_steps(Schedule& s, int rank, const std::string& a, const std::string& b) {
  int i = find_step(s, rank, a), j = find_step(s, rank, b);
  REQUIRE_MESSAGE(i >= 0, a << " not on rank " << rank);
  REQUIRE_MESSAGE(j >= 0, b << " not on rank " << rank);
  std::swap(s.ranks[(size_t)rank][(size_t)i], s.ranks[(size_t)rank][(size_t)j]);
}

bool contains(const std::string& text, const std::string& word) {
  return text.find(word) != std::string::npos;
}

std::string join(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : " ") + std::to_string(x);
  return out;
}

std::vector<int> m_values(int P) { return {P, 2 * P, 2 * P + 2, 20}; }

// Peak live activations, per rank: micro-batch stages whose forward has run and whose
// backward (B, or I and then W) has not completed, the unit of the papers' memory columns
// (one micro-batch's activations on one stage). DeepSeek-V3 Table 2: 1F1B P, ZB1P (zb-h1)
// P, DualPipe P+1 (with 2x the parameters); Qi et al. Table 2: ZB-H2 (2p-1) M_B. Every value
// below is an exact equality, per rank, from the generator's rule.
std::vector<int> expected_peak_live(const std::string& name, int P, int M) {
  std::vector<int> want((size_t)P);
  for (int r = 0; r < P; r++) {
    int& w = want[(size_t)r];
    if (name == "gpipe") w = M;  // every micro-batch before the first backward
    // 1F1B: min(P-r-1, M) warm-up forwards, then one more before the first backward
    if (name == "1f1b") w = std::min(P - r, M);
    // ZB-H1: a micro-batch stays live until its W; rank r's P-r forwards before its first I
    // plus one per step of the loop, minus one W per step once r are pending: P on every rank
    if (name == "zb-h1") w = std::min(P, M);
    // ZB-H2: 2(P-r)-1 forwards before the first I, and up to 2r W's pending: 2P-1 everywhere
    if (name == "zb-h2") w = std::min(2 * P - 1, M);
    // DualPipe: P forwards in steps 1-2 (steps 3's I W F keep it there); the first pair of
    // the main loop holds its forward and its backward's micro-batch at once: P+1 on every
    // rank. DualPipeV: the same with 2P half-size stages per rank: 2P+1.
    if (name == "dualpipe") w = P + 1;
    if (name == "dualpipev") w = 2 * P + 1;
  }
  return want;
}

// Forwards before the first backward (B or I), per rank, as --simulate prints them: the
// forward of an overlapped pair is not counted (it runs with a backward).
std::vector<int> expected_warmup(const std::string& name, int P, int M) {
  std::vector<int> want((size_t)P);
  for (int r = 0; r < P; r++) {
    int& w = want[(size_t)r];
    if (name == "gpipe") w = M;
    // 1F1B and ZB-H1: min(P-r-1, M) warm-up forwards, then the steady state's first forward
    if (name == "1f1b" || name == "zb-h1") w = std::min(P - r, M);
    // ZB-H2: P-r-1 more than ZB-H1, to fill the wait for the first gradient
    if (name == "zb-h2") w = std::min(2 * (P - r) - 1, M);
    // DualPipe: (P/2-h-1)*2 forwards of one direction, then h+1 pairs of forwards of both
    // (h = min(r, P-1-r)): P in all; the two middle ranks (h = P/2-1) do not overlap their
    // first main-loop pair, so its forward counts too: P+1. Independent of M.
    if (name == "dualpipe") w = P + (r == P / 2 - 1 || r == P / 2 ? 1 : 0);
    // DualPipeV: n = P, h = r: 2P, and 2P+1 on the last rank (h = n-1)
    if (name == "dualpipev") w = 2 * P + (r == P - 1 ? 1 : 0);
  }
  return want;
}

// Every schedule on a grid of (P, M) it allows, simulated at the default costs: the cases the
// per-rank tables below are checked on. Returns how many ran.
int for_each_grid_case(const std::function<void(const std::string&, int, int, const Simulation&)>& f) {
  int cases = 0;
  for (const std::string& name : schedule_names())
    for (int P = 1; P <= 8; P++)
      for (int M : {P, 2 * P - 1, 2 * P, 2 * P + 2, 3 * P, 20, 64}) {
        if (!check_args(name, P, M).empty()) continue;
        CAPTURE(name);
        CAPTURE(P);
        CAPTURE(M);
        cases++;
        Simulation sim = simulate(make_schedule(name, P, M), Costs{});
        REQUIRE(sim.completed);
        f(name, P, M, sim);
      }
  return cases;
}

}  // namespace


// ---------------------------------------------------------------------------
// 1. Every generator on a grid of (P, M)

TEST_CASE("schedule: every generator is valid, completes and runs each op the right number of times") {
  int cases = 0;
  for (const std::string& name : schedule_names()) {
    for (int P = 1; P <= 8; P++) {
      for (int M : m_values(P)) {
        if (!check_args(name, P, M).empty()) continue;
        CAPTURE(name);
        CAPTURE(P);
        CAPTURE(M);
        cases++;
        Schedule s = make_schedule(name, P, M);
        REQUIRE(s.ranks.size() == (size_t)P);
        CHECK(validate(s) == "");
        Simulation sim = simulate(s, Costs{});
        CHECK(sim.completed);
        CHECK(sim.stuck == "");
        for (int r = 0; r < P; r++) {
          CAPTURE(r);
          OpCounts c = count_ops(s, r);
          CHECK(c.F == forwards_per_rank(s));
          CHECK(c.B + c.I == c.F);
          CHECK(c.W == c.I);
          if (s.layout == Layout::dual) {  // M/2 per direction
            CHECK(c.per_dir_F[0] == M / 2);
            CHECK(c.per_dir_F[1] == M / 2);
          }
          if (s.layout == Layout::v) {  // M per leg of the V
            CHECK(c.per_dir_F[0] == M);
            CHECK(c.per_dir_F[1] == M);
          }
        }
      }
    }
  }
  // gpipe, 1f1b, zb-h1 and zb-h2 accept all 8 x 4 (P, M); dualpipev all but M = P (M >= 2P):
  // 8 x 3; dualpipe, besides, only even P: 4 x 3
  CHECK(cases == 4 * 32 + 24 + 12);
}


TEST_CASE("schedule: peak live activations per rank == the papers' tables") {
  const int cases = for_each_grid_case([](const std::string& name, int P, int M, const Simulation& sim) {
    CHECK(join(sim.peak_live) == join(expected_peak_live(name, P, M)));
  });
  CHECK(cases > 200);
  // The tables' columns are the worst rank, once M is large enough (M >= 2P here):
  // 1F1B P (rank 0), ZB1P P, DualPipe P+1, ZB-H2 2P-1.
  for (int P : {4, 8}) {
    for (int M : {2 * P, 3 * P, 64}) {
      CAPTURE(P);
      CAPTURE(M);
      auto worst = [&](const char* name) {
        std::vector<int> v = simulate(make_schedule(name, P, M), Costs{}).peak_live;
        return *std::max_element(v.begin(), v.end());
      };
      CHECK(worst("1f1b") == P);
      CHECK(worst("zb-h1") == P);
      CHECK(worst("dualpipe") == P + 1);
      CHECK(worst("zb-h2") == 2 * P - 1);
      CHECK(worst("dualpipev") == 2 * P + 1);  // stages half as deep: about P+1 full stages
      CHECK(worst("gpipe") == M);
    }
  }
  // As --simulate and the README print them (P = 4, M = 8).
  CHECK(join(simulate(make_schedule("1f1b", 4, 8), Costs{}).peak_live) == "4 3 2 1");
  CHECK(join(simulate(make_schedule("zb-h2", 4, 8), Costs{}).peak_live) == "7 7 7 7");
  CHECK(join(simulate(make_schedule("dualpipe", 4, 8), Costs{}).peak_live) == "5 5 5 5");
}

TEST_CASE("schedule: warm-up forwards before the first backward, per rank") {
  const int cases = for_each_grid_case([](const std::string& name, int P, int M, const Simulation& sim) {
    CHECK(join(sim.warmup) == join(expected_warmup(name, P, M)));
  });
  CHECK(cases > 200);
  // The rows --simulate prints at P = 8, M = 16 (and the README shows), spelled out.
  auto row = [](const char* name) { return join(simulate(make_schedule(name, 8, 16), Costs{}).warmup); };
  CHECK(row("gpipe") == "16 16 16 16 16 16 16 16");
  CHECK(row("1f1b") == "8 7 6 5 4 3 2 1");
  CHECK(row("zb-h1") == "8 7 6 5 4 3 2 1");
  CHECK(row("zb-h2") == "15 13 11 9 7 5 3 1");
  CHECK(row("dualpipe") == "8 8 8 9 9 8 8 8");
  CHECK(row("dualpipev") == "16 16 16 16 16 16 16 17");
  // DualPipe's warm-up does not depend on M (the slide formula P//2 + (M-1)*2 does)
  CHECK(join(simulate(make_schedule("dualpipe", 8, 40), Costs{}).warmup) == "8 8 8 9 9 8 8 8");
}

// ---------------------------------------------------------------------------
// 2. Small programs traced by hand

TEST_CASE("schedule: 1f1b P=2 M=3 by hand") {
  // rank 0: min(P-r-1, M) = 1 warm-up forward, two F/B pairs, one cool-down backward.
  // rank 1: no warm-up, three F/B pairs.
  Schedule s = make_schedule("1f1b", 2, 3);
  CHECK(format_rank(s, 0) == "rank 0: F0(0) F0(1) B0(0) F0(2) B0(1) B0(2)");
  CHECK(format_rank(s, 1) == "rank 1: F0(0) B0(0) F0(1) B0(1) F0(2) B0(2)");
}

TEST_CASE("schedule: gpipe P=2 M=2 by hand") {
  Schedule s = make_schedule("gpipe", 2, 2);
  CHECK(format_rank(s, 0) == "rank 0: F0(0) F0(1) B0(0) B0(1)");
  CHECK(format_rank(s, 1) == "rank 1: F0(0) F0(1) B0(0) B0(1)");
}

TEST_CASE("schedule: zb-h1 P=2 M=3 by hand") {
  // rank 0 keeps no W pending: each I is followed by its W.
  // rank 1 keeps one: W(b-1) after I(b), the last W at the end.
  Schedule s = make_schedule("zb-h1", 2, 3);
  CHECK(format_rank(s, 0) == "rank 0: F0(0) F0(1) I0(0) W0(0) F0(2) I0(1) W0(1) I0(2) W0(2)");
  CHECK(format_rank(s, 1) == "rank 1: F0(0) I0(0) F0(1) I0(1) W0(0) F0(2) I0(2) W0(1) W0(2)");
}

TEST_CASE("schedule: zb-h2 P=4 M=8 by hand == Qi et al., Figure 3 (bottom)") {
  // The figure, micro-batches counted from 0 here. Rank r runs 2(P-r)-1 forwards before
  // its first I (7, 5, 3, 1) and keeps up to 2r W's pending (0, 2, 4, 6).
  Schedule s = make_schedule("zb-h2", 4, 8);
  CHECK(format_rank(s, 0) == "rank 0: F0(0) F0(1) F0(2) F0(3) F0(4) F0(5) F0(6) I0(0) W0(0) F0(7) "
                             "I0(1) W0(1) I0(2) W0(2) I0(3) W0(3) I0(4) W0(4) I0(5) W0(5) I0(6) W0(6) I0(7) W0(7)");
  CHECK(format_rank(s, 1) == "rank 1: F0(0) F0(1) F0(2) F0(3) F0(4) I0(0) F0(5) I0(1) F0(6) I0(2) W0(0) F0(7) "
                             "I0(3) W0(1) I0(4) W0(2) I0(5) W0(3) I0(6) W0(4) I0(7) W0(5) W0(6) W0(7)");
  CHECK(format_rank(s, 2) == "rank 2: F0(0) F0(1) F0(2) I0(0) F0(3) I0(1) F0(4) I0(2) F0(5) I0(3) F0(6) I0(4) "
                             "W0(0) F0(7) I0(5) W0(1) I0(6) W0(2) I0(7) W0(3) W0(4) W0(5) W0(6) W0(7)");
  CHECK(format_rank(s, 3) == "rank 3: F0(0) I0(0) F0(1) I0(1) F0(2) I0(2) F0(3) I0(3) F0(4) I0(4) F0(5) I0(5) "
                             "F0(6) I0(6) W0(0) F0(7) I0(7) W0(1) W0(2) W0(3) W0(4) W0(5) W0(6) W0(7)");
  CHECK(validate(s) == "");
  // At F = I = W = 1 (the defaults) it is the figure's parallelogram: rank r works without a
  // gap from t = r to t = r + 24, so the one-iteration makespan is 27 and every rank idles
  // 3 = (P-1)F, all of it before its first op or after its last.
  Simulation sim = simulate(s, Costs{});
  REQUIRE(sim.completed);
  CHECK(sim.makespan == 27);
  CHECK(join(sim.warmup) == "7 5 3 1");
  for (int r = 0; r < 4; r++) {
    CAPTURE(r);
    CHECK(sim.busy[(size_t)r] == 24);
    CHECK(sim.idle[(size_t)r] == 3);
    CHECK(sim.inner_idle[(size_t)r] == 0);
  }
}

TEST_CASE("schedule: dualpipev P=1 M=2 by hand") {
  // n = 1, h = 0, chunks = 2, the rank is special (h == n-1). Steps 1, 3, 5, 7 are empty;
  // 2: F0(0) F1(0); 4 (one round, first pair not overlapped): F0(1) B1(0), F1(1)&B0(0);
  // 6 (h+1 = 1 round, h even: zero bubble from the B0): B1(1) I0(1); 8: W0(1).
  Schedule s = make_schedule("dualpipev", 1, 2);
  CHECK(format_rank(s, 0) == "rank 0: F0(0) F1(0) F0(1) B1(0) F1(1)&B0(0) B1(1) I0(1) W0(1)");
  CHECK(validate(s) == "");
}

TEST_CASE("schedule: dualpipe P=2 M=4 by hand") {
  // n = 1, chunks = 2; both ranks have h = 0 and are special. Rank 1 is in the second half:
  // its phase p is direction p^1, so its program is rank 0's with the directions swapped.
  Schedule s = make_schedule("dualpipe", 2, 4);
  CHECK(format_rank(s, 0) == "rank 0: F0(0) F1(0) F0(1) B1(0) F1(1)&B0(0) B1(1) I0(1) W0(1)");
  CHECK(format_rank(s, 1) == "rank 1: F1(0) F0(0) F1(1) B0(0) F0(1)&B1(0) B0(1) I1(1) W1(1)");
  CHECK(validate(s) == "");
  // Traced at the default costs (F=1, B=2, I=W=1, FB=3): both ranks run in lock-step,
  // F [0,1] F [1,2] F [2,3] B [3,5] F&B [5,8] B [8,10] I [10,11] W [11,12], never idle.
  Simulation sim = simulate(s, Costs{});
  CHECK(sim.completed);
  CHECK(sim.makespan == 12);
  CHECK(sim.bubble() == 0);
}

TEST_CASE("schedule: printing ops and steps") {
  CHECK(to_string(Op{Kind::F, 0, 3}) == "F0(3)");
  CHECK(to_string(Op{Kind::W, 1, 12}) == "W1(12)");
  CHECK(to_string(Step{Op{Kind::F, 0, 3}, true, Op{Kind::B, 1, 1}}) == "F0(3)&B1(1)");
  CHECK(to_string(Step{Op{Kind::I, 1, 0}, false, Op{Kind::B, 1, 1}}) == "I1(0)");
}

// ---------------------------------------------------------------------------
// 3. The simulator against the DeepSeek-V3 Table 2 formulas

TEST_CASE("schedule: simulated bubble == Table 2 formula at the default costs") {
  const Costs c{};  // F=1, B=2, W=1, FB=3, comm=0
  for (std::string name : {"gpipe", "1f1b", "zb-h1", "dualpipe"}) {
    for (int P : {4, 8}) {
      for (int M : {2 * P, 20, 64}) {
        CAPTURE(name);
        CAPTURE(P);
        CAPTURE(M);
        Simulation sim = simulate(make_schedule(name, P, M), c);
        REQUIRE(sim.completed);
        Formula f = formula_bubble(name, P, c);
        REQUIRE(f.has);
        CHECK(sim.bubble() == f.bubble);
        // the rank that idles most works from the first moment to the last: overlapping
        // iterations would not help these schedules
        CHECK(sim.inner_bubble() == sim.bubble());
        // the formulas by hand: (P-1)*3, (P-1)*3, (P-1)*1, (P/2-1)*2
        double want = name == "zb-h1" ? (P - 1) * 1.0
                    : name == "dualpipe" ? (P / 2 - 1) * 2.0 : (P - 1) * 3.0;
        CHECK(f.bubble == want);
      }
    }
  }
}

TEST_CASE("schedule: zb-h2: inner bubble == Qi et al.'s Table 2 formula; one iteration adds the slant") {
  // Qi et al. Table 2: ZB-H2's bubble is (p-1)(T_F+T_B-2T_W), T_B the input backward (our
  // I = B-W): (P-1)(F+B-3W). It counts iterations run back to back, the optimizer step not
  // synchronised (their §4), so the parallelogram's slants are filled by the neighbouring
  // iterations: the simulator's inner_bubble(). It needs enough micro-batches (M >= 2P-1,
  // the warm-up of rank 0) and F + I >= 2W (else the formula goes negative).
  const char* costs[] = {"F=1,B=2,W=1", "F=1,B=3,W=1", "F=2,B=3,W=1", "F=1,B=2,W=0.5", "F=1,B=1.5,W=0.5"};
  for (const char* text : costs) {
    Costs c;
    REQUIRE(parse_costs(text, &c) == "");
    for (int P : {2, 4, 8}) {
      for (int M : {2 * P - 1, 2 * P, 20, 64}) {
        CAPTURE(text);
        CAPTURE(P);
        CAPTURE(M);
        Simulation sim = simulate(make_schedule("zb-h2", P, M), c);
        REQUIRE(sim.completed);
        Formula f = formula_bubble("zb-h2", P, c);
        REQUIRE(f.has);
        CHECK(sim.inner_bubble() == f.bubble);
      }
    }
  }
  // At the default costs the formula is 0 and one iteration on its own idles exactly the
  // slant, (P-1)F on every rank: as much as ZB-H1, whose bubble is inside the iteration.
  const Costs c{};
  for (int P : {4, 8}) {
    for (int M : {2 * P, 20, 64}) {
      CAPTURE(P);
      CAPTURE(M);
      Simulation sim = simulate(make_schedule("zb-h2", P, M), c);
      Formula f = formula_bubble("zb-h2", P, c);
      CHECK(f.bubble == 0);
      CHECK(sim.inner_bubble() == 0);
      CHECK(sim.bubble() == f.bubble + (P - 1) * c.F);
      CHECK(sim.bubble() == simulate(make_schedule("zb-h1", P, M), c).bubble());
      for (int r = 0; r < P; r++) CHECK(sim.idle[(size_t)r] == (P - 1) * c.F);
    }
  }
  // With I > F, ZB-H2 halves ZB-H1's bubble even within one iteration (F=1, I=2, W=1, P=8).
  Costs slow_i;
  REQUIRE(parse_costs("B=3", &slow_i) == "");
  CHECK(simulate(make_schedule("zb-h2", 8, 16), slow_i).bubble() == 7);
  CHECK(simulate(make_schedule("zb-h1", 8, 16), slow_i).bubble() == 14);
  // Where 2W > F + I the formula is no bubble any more: negative.
  Costs heavy_w;
  REQUIRE(parse_costs("B=4,W=2", &heavy_w) == "");
  CHECK(formula_bubble("zb-h2", 8, heavy_w).bubble == -7);
  CHECK(simulate(make_schedule("zb-h2", 8, 16), heavy_w).inner_bubble() == 7);
}

TEST_CASE("schedule: formula_bubble rows") {
  const Costs c{};
  CHECK(formula_bubble("1f1b", 4, c).text == "(P-1)(F+B)");
  CHECK(formula_bubble("gpipe", 4, c).text == "(P-1)(F+B)");
  CHECK(formula_bubble("zb-h1", 4, c).text == "(P-1)(F+B-2W)");
  CHECK(formula_bubble("zb-h2", 4, c).text == "(P-1)(F+B-3W)**");
  CHECK(formula_bubble("zb-h2", 4, c).bubble == 0);           // 3 * (1 + 2 - 3)
  CHECK(formula_bubble("dualpipe", 4, c).text == "(P/2-1)(F&B+B-3W)");
  CHECK(formula_bubble("dualpipev", 4, c).bubble == 3 * (3 + 2 - 3.0));  // (P-1)(F&B+B-3W)
  CHECK_FALSE(formula_bubble("pipedream", 4, c).has);
}

TEST_CASE("schedule: 1f1b and gpipe makespan (M+P-1)(F+B), every rank idle (P-1)(F+B)") {
  Costs c;
  REQUIRE(parse_costs("F=2,B=3", &c) == "");
  for (std::string name : {"1f1b", "gpipe"}) {
    for (int P : {1, 2, 4, 8}) {
      for (int M : {P, 2 * P, 20}) {
        CAPTURE(name);
        CAPTURE(P);
        CAPTURE(M);
        Simulation sim = simulate(make_schedule(name, P, M), c);
        REQUIRE(sim.completed);
        CHECK(sim.makespan == (M + P - 1) * 5.0);
        for (int r = 0; r < P; r++) {
          CAPTURE(r);
          CHECK(sim.busy[(size_t)r] == M * 5.0);
          CHECK(sim.idle[(size_t)r] == (P - 1) * 5.0);
        }
        CHECK(sim.bubble() == formula_bubble(name, P, c).bubble);
        CHECK(sim.bubble_ratio() == doctest::Approx((P - 1.0) / (M + P - 1.0)));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// 4. validate() and the simulator catch broken schedules

TEST_CASE("schedule: validate catches planted errors") {
  // 1f1b P=3 M=4 — rank 0: F0(0) F0(1) F0(2) B0(0) F0(3) B0(1) B0(2) B0(3)
  //                 rank 1: F0(0) F0(1) B0(0) F0(2) B0(1) F0(3) B0(2) B0(3)
  const Schedule base = make_schedule("1f1b", 3, 4);
  REQUIRE(validate(base) == "");

  SUBCASE("a backward before its forward") {
    Schedule s = base;
    swap_steps(s, 1, "F0(0)", "B0(0)");
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "backward before its forward"), e);
    CHECK_MESSAGE(contains(e, "rank 1"), e);
  }
  SUBCASE("an op that never runs") {
    Schedule s = base;
    s.ranks[2].erase(s.ranks[2].begin() + find_step(s, 2, "B0(3)"));
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "never runs B0(3)"), e);
    CHECK_MESSAGE(contains(e, "stage 2"), e);
  }
  SUBCASE("a forward that never runs") {
    Schedule s = base;
    // drop F0(3) and B0(3) from rank 1 (so the first error is the missing forward)
    s.ranks[1].erase(s.ranks[1].begin() + find_step(s, 1, "B0(3)"));
    s.ranks[1].erase(s.ranks[1].begin() + find_step(s, 1, "F0(3)"));
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "never runs F0(3)"), e);
  }
  SUBCASE("a forward run twice") {
    Schedule s = base;
    s.ranks[0].insert(s.ranks[0].begin() + 2, s.ranks[0][1]);  // F0(1) again
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "forward run twice"), e);
  }
  SUBCASE("a backward run twice") {
    Schedule s = base;
    s.ranks[1].push_back(s.ranks[1].back());  // B0(3) again
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "backward run twice"), e);
  }
  SUBCASE("forwards swapped on rank 0: activations arrive out of order on link 0 -> 1") {
    Schedule s = base;
    swap_steps(s, 0, "F0(0)", "F0(1)");
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "link"), e);
    CHECK_MESSAGE(contains(e, "rank 0 -> rank 1"), e);
    CHECK_MESSAGE(contains(e, "activations"), e);
  }
  SUBCASE("backwards swapped on rank 1: gradients out of order on the links to and from it") {
    Schedule s = base;
    // rank 1: F0(0) F0(1) B0(1) F0(2) B0(0) ... — still F before B for each micro-batch, but
    // it now receives the gradients from rank 2, and sends them to rank 0, as 1, 0 instead of
    // 0, 1. Links are checked in the order (sender, receiver): 1 -> 0 is reported first.
    swap_steps(s, 1, "B0(0)", "B0(1)");
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "link rank 1 -> rank 0 (gradients)"), e);
  }
  SUBCASE("forwards and backwards swapped on rank 2: activations out of order on link 1 -> 2") {
    Schedule s = base;
    // rank 2 (no warm-up): F0(0) B0(0) F0(1) B0(1) ... becomes F0(1) B0(1) F0(0) B0(0) ...
    swap_steps(s, 2, "F0(0)", "F0(1)");
    swap_steps(s, 2, "B0(0)", "B0(1)");
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "link rank 1 -> rank 2 (activations)"), e);
  }
}

TEST_CASE("schedule: validate catches a W that is not first in, first out") {
  // zb-h1 P=3 M=4, rank 2 keeps two W's pending:
  //   F0(0) I0(0) F0(1) I0(1) F0(2) I0(2) W0(0) F0(3) I0(3) W0(1) W0(2) W0(3)
  Schedule s = make_schedule("zb-h1", 3, 4);
  REQUIRE(validate(s) == "");
  REQUIRE(format_rank(s, 2) == "rank 2: F0(0) I0(0) F0(1) I0(1) F0(2) I0(2) W0(0) F0(3) I0(3) W0(1) W0(2) W0(3)");
  SUBCASE("the last two W's") { swap_steps(s, 2, "W0(2)", "W0(3)"); }
  SUBCASE("the first two W's") { swap_steps(s, 2, "W0(0)", "W0(1)"); }
  std::string e = validate(s);
  CHECK_MESSAGE(contains(e, "first in, first out"), e);
  CHECK_MESSAGE(contains(e, "rank 2"), e);
}

TEST_CASE("schedule: validate catches a W before its I and a missing W") {
  Schedule s = make_schedule("zb-h1", 3, 4);
  SUBCASE("W before I") {
    // rank 0 runs I0(0) W0(0) back to back: swap them
    swap_steps(s, 0, "I0(0)", "W0(0)");
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "weight gradient before its input backward"), e);
  }
  SUBCASE("a W never runs") {
    s.ranks[1].pop_back();  // rank 1's last step is a deferred W
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "never runs W"), e);
  }
}

TEST_CASE("schedule: validate catches an overlapped pair that is not forward & backward") {
  Schedule base = make_schedule("dualpipe", 4, 8);
  REQUIRE(validate(base) == "");
  int k = -1;
  for (size_t i = 0; i < base.ranks[0].size(); i++)
    if (base.ranks[0][i].paired) { k = (int)i; break; }
  REQUIRE(k >= 0);
  SUBCASE("backward & forward") {
    Schedule s = base;
    std::swap(s.ranks[0][(size_t)k].op, s.ranks[0][(size_t)k].with);
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "overlapped pair"), e);
  }
  SUBCASE("forward & W") {
    Schedule s = base;
    s.ranks[0][(size_t)k].with.kind = Kind::W;
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "overlapped pair"), e);
  }
  SUBCASE("no such micro-batch") {
    Schedule s = base;
    s.ranks[3][0].op.mb = 4;  // M/2 = 4 per direction: 0..3
    std::string e = validate(s);
    CHECK_MESSAGE(contains(e, "no such direction or micro-batch"), e);
  }
}

TEST_CASE("schedule: a cross-rank cycle passes validate but the simulator gets stuck") {
  // P=2 M=2. Rank 0 runs B(0) before F(1); rank 1 runs F(1) before B(0). Each stage is F
  // before B and every link is in order, so validate() accepts it — but rank 0's B0(0)
  // needs rank 1's B0(0), which comes after rank 1's F0(1), which needs rank 0's F0(1),
  // which comes after rank 0's B0(0).
  Schedule s = make_schedule("1f1b", 2, 2);
  auto step = [](Kind k, int m) { return Step{Op{k, 0, m}, false, Op{}}; };
  s.ranks[0] = {step(Kind::F, 0), step(Kind::B, 0), step(Kind::F, 1), step(Kind::B, 1)};
  s.ranks[1] = {step(Kind::F, 0), step(Kind::F, 1), step(Kind::B, 0), step(Kind::B, 1)};
  CHECK(validate(s) == "");
  Simulation sim = simulate(s, Costs{});
  CHECK_FALSE(sim.completed);
  CHECK(sim.spans.size() == 2);  // the two F0(0)'s
  CHECK_MESSAGE(contains(sim.stuck, "rank 0 at B0(0) waits for gradient of B0(0) from stage 1 (rank 1)"), sim.stuck);
  CHECK_MESSAGE(contains(sim.stuck, "rank 1 at F0(1) waits for activation of F0(1) from stage 0 (rank 0)"), sim.stuck);
}

// ---------------------------------------------------------------------------
// 5. Argument checks

TEST_CASE("schedule: check_args and make_schedule reject bad arguments") {
  struct Bad {
    const char* name;
    int P, M;
    const char* word;
  };
  const Bad bad[] = {
      {"pipedream", 4, 8, "unknown schedule 'pipedream'"},
      {"1f1b", 0, 8, "--stages must be at least 1"},
      {"1f1b", 4, 0, "--microbatches must be at least 1"},
      {"dualpipe", 3, 6, "even number of ranks"},
      {"dualpipe", 4, 6, "M >= 2P"},      // M < 2P
      {"dualpipe", 2, 5, "M even"},       // odd M (>= 2P)
      {"dualpipev", 4, 7, "dualpipev needs M >= 2P"},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.name);
    CAPTURE(b.P);
    CAPTURE(b.M);
    std::string e = check_args(b.name, b.P, b.M);
    CHECK_MESSAGE(contains(e, b.word), e);
    std::string thrown;
    try {
      make_schedule(b.name, b.P, b.M);
    } catch (const ff::Error& err) {
      thrown = err.what();
    }
    CHECK(!thrown.empty());
    CHECK(thrown == e);
  }
  // the edges that are allowed
  CHECK(check_args("dualpipe", 2, 4) == "");
  CHECK(check_args("dualpipev", 3, 6) == "");  // odd P is fine for the V
  CHECK(check_args("1f1b", 8, 1) == "");       // fewer micro-batches than stages
  CHECK_NOTHROW(make_schedule("1f1b", 8, 1));
}

TEST_CASE("schedule: parse_costs") {
  Costs c;
  CHECK(parse_costs("F=2,B=3", &c) == "");
  CHECK(c.F == 2);
  CHECK(c.B == 3);
  CHECK(c.W == 1);  // untouched
  CHECK(c.FB == 3);
  CHECK(c.comm == 0);
  CHECK(c.I() == 2);

  Costs d;
  CHECK(parse_costs("comm=0.5,FB=2.5,W=0.5", &d) == "");
  CHECK(d.comm == 0.5);
  CHECK(d.FB == 2.5);
  CHECK(d.W == 0.5);
  CHECK(d.F == 1);
  Costs back;
  CHECK(parse_costs(to_string(d), &back) == "");  // to_string round-trips
  CHECK(to_string(back) == to_string(d));

  struct Bad {
    const char* text;
    const char* word;
  };
  const Bad bad[] = {
      {"X=1", "KEY=VALUE"},
      {"F", "KEY=VALUE"},
      {"F=abc", "F must be a number >= 0"},
      {"F=", "F must be a number >= 0"},
      {"F=-1", "F must be a number >= 0"},
      {"F=0", "must be > 0"},
      {"W=5", "W <= B"},  // W is part of B = 2
  };
  for (const Bad& b : bad) {
    CAPTURE(b.text);
    Costs e;
    std::string err = parse_costs(b.text, &e);
    CHECK_MESSAGE(contains(err, b.word), err);
  }
}
