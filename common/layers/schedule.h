// common/layers/schedule.h — pipeline-parallel schedules as data: the types, the checks, a
// simulator. Lesson 07 builds the schedules themselves (lessons/07_dualpipe/schedules.h: GPipe,
// 1F1B, ZB-H1, ZB-H2, DualPipe, DualPipeV); the executor (pipeline.h) runs any of them.
//
// A schedule is, for each rank, the ordered list of what it computes. Notation (code,
// printouts, tests):
//   F<d>(m)  forward of micro-batch m in direction/phase d
//   B<d>(m)  full backward
//   I<d>(m)  backward for the inputs only (the weight gradient is deferred)
//   W<d>(m)  the deferred weight gradient of the backward I<d>(m)
//   X&Y      a forward and a backward of different micro-batches issued together
// 1F1B-family schedules have d = 0 only. In dualpipe d is the global direction (0: the
// micro-batch enters at rank 0, 1: at rank P-1) and m runs 0..M/2-1 within a direction; in
// dualpipev d is the phase (0: stage r, the down leg of the V; 1: stage 2P-1-r) and m runs
// 0..M-1.
//
// The model is cut into num_stages() consecutive stages. A micro-batch belongs to a "flow"
// (dualpipe has two, one per direction; the others one) and visits stages 0..S-1 in order
// on its way forward; stage_of/rank_of say where each stage of each flow lives.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ff::pp {

// [slide:op-step]
enum class Kind : uint8_t { F, B, I, W };

struct Op {
  Kind kind = Kind::F;
  int dir = 0;  // direction (dualpipe) or phase (dualpipev); 0 otherwise
  int mb = 0;   // micro-batch index within its direction
};

// One step of a rank's program: one op, or a forward and a backward issued together.
struct Step {
  Op op;
  bool paired = false;
  Op with;  // the backward of an overlapped pair (op is then the forward)
};
// [/slide]

enum class Layout {
  line,  // stage r on rank r, micro-batches enter at rank 0 (gpipe, 1f1b, zb-h1, zb-h2)
  dual,  // two directions: rank r holds stage r (d = 0) and stage P-1-r (d = 1)
  v      // one direction folded in a V: rank r holds stages r (d = 0) and 2P-1-r (d = 1)
};

struct Schedule {
  std::string name;
  int P = 1;  // ranks
  int M = 1;  // micro-batches (both directions together for dualpipe)
  Layout layout = Layout::line;
  std::vector<std::vector<Step>> ranks;  // ranks[r] = rank r's program

  int num_stages() const { return layout == Layout::v ? 2 * P : P; }
  int num_flows() const { return layout == Layout::dual ? 2 : 1; }
  int mbs_per_flow() const { return layout == Layout::dual ? M / 2 : M; }
  int flow_of(int dir) const { return layout == Layout::dual ? dir : 0; }
  int stage_of(int rank, int dir) const;   // the stage an op of direction/phase dir runs
  int rank_of(int flow, int stage) const;  // where stage `stage` of flow `flow` lives
  int dir_of(int flow, int stage) const;   // the d printed for that stage's ops
  // global micro-batch index 0..M-1 (direction 1 of dualpipe after direction 0)
  int global_mb(int dir, int mb) const { return flow_of(dir) * mbs_per_flow() + mb; }
};

std::string to_string(const Op& op);      // "F0(3)"
std::string to_string(const Step& step);  // "F0(3)&B1(1)"
std::string format_rank(const Schedule& s, int rank);  // "rank R: op op ..."

// Structural checks: every stage runs F, then B (or I then W), exactly once per micro-batch
// and direction, in that order; a W completes the oldest pending I of its rank (FIFO);
// on each directed link the activations, and the gradients, are received in the order they
// are sent (each kind is one first-in first-out channel, as MPI's non-overtaking rule makes a tag). "" when all hold.
std::string validate(const Schedule& s);

// ---- simulation
struct Costs {
  double F = 1, B = 2, W = 1, FB = 3, comm = 0;  // B = I + W; FB: an overlapped pair
  double I() const { return B - W; }
  double of(const Step& step) const;  // what one step costs (a pair: FB)
};
// "F=1,B=2,W=1,FB=3,comm=0" (any subset, any order); "" or the error.
std::string parse_costs(const std::string& text, Costs* costs);
std::string to_string(const Costs& c);

struct Span {
  int rank = 0;
  Step step;
  double start = 0, end = 0;
};
struct Simulation {
  bool completed = false;
  std::string stuck;            // when not completed: what each stuck rank waits for
  double makespan = 0;
  std::vector<double> busy;     // per rank: time computing
  std::vector<double> idle;     // per rank: makespan - busy (the bubble)
  std::vector<double> inner_idle;  // per rank: idle between its own first start and last end
  std::vector<int> peak_live;   // per rank: most micro-batch stages holding activations at once
  std::vector<int> warmup;      // per rank: forwards before the first backward
  std::vector<Span> spans;
  double bubble() const;        // the largest idle time of a rank
  double bubble_ratio() const;  // bubble / makespan
  // The largest inner idle time: the bubble left when the previous and the next iteration
  // fill each rank's start and end, i.e. when nothing synchronises the ranks between
  // iterations (what ZB-H2's zero bubble assumes; Qi et al., §4).
  double inner_bubble() const;
};
// Discrete-event run: each rank executes its steps in order, a step starts when the rank
// is free and its inputs have arrived (comm after the producing step ends, 0 on the same
// rank). Ranks wait forever on a cyclic schedule: completed = false, and stuck says why.
Simulation simulate(const Schedule& s, const Costs& c);

}  // namespace ff::pp
