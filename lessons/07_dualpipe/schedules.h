// lessons/07_dualpipe/schedules.h — the schedules lesson 07 teaches, built step by step:
// GPipe, 1F1B, ZB-H1, ZB-H2, DualPipe and DualPipeV, and the bubble DeepSeek-V3's Table 2
// gives each.
//
// A schedule is data (common/layers/schedule.h: Schedule, Step, Op, and the checks and the
// simulator that read it); this file writes each rank's program. Lesson 08 runs the same
// generators on its model's stages by including this header (a later lesson may include an
// earlier lesson's header, never the other way round, never a main.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/layers/schedule.h"

namespace ff::pp {

// The names --schedule accepts, in the order they are taught.
const std::vector<std::string>& schedule_names();
// "" when the schedule can run with P ranks and M micro-batches, else why not (one line).
std::string check_args(const std::string& name, int64_t P, int64_t M);
// The generators; throw ff::Error with check_args' text on bad input.
Schedule make_schedule(const std::string& name, int P, int M);

// The bubble of the DeepSeek-V3 technical report's Table 2, where it has a row for the
// schedule: 1F1B (P-1)(F+B), ZB1P (P-1)(F+B-2W), DualPipe (P/2-1)(F&B+B-3W); GPipe's is
// 1F1B's. DualPipeV has no row; its formula, marked with a *, is DualPipe's for 2P stages.
// ZB-H2 has none either; its formula, marked **, is the Zero Bubble paper's (Qi et al.,
// Table 2: (p-1)(T_F+T_B-2T_W), their T_B being our I = B-W) and counts iterations run back
// to back with nothing synchronising them: compare it with Simulation::inner_bubble().
// bubble() also counts the idle time before a rank's first op and after its last, which one
// iteration on its own keeps: the parallelogram's slant, (P-1)F at F = I = W.
struct Formula {
  bool has = false;
  double bubble = 0;
  std::string text;  // "(P-1)(F+B)"
};
Formula formula_bubble(const std::string& name, int P, const Costs& c);

}  // namespace ff::pp
