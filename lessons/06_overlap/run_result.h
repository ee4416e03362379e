// lessons/06_overlap/run_result.h — what one run of lesson 06's schedule hands back to the checks
// and the report (its outputs and gradients, its timeline, its step durations), and the variants
// of the schedule the driver runs and times.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/dsv3_moe.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/options.h"
#include "lessons/06_overlap/timeline.h"

namespace ff::f1b {

// The schedules on this stage.
enum class Mode { sequential, overlapped };

struct RunResult {
  std::vector<Tensor> y, dx;        // per micro-batch
  std::vector<Tensor> attn_grads;   // kAttentionNames' order
  dsv3::Grads grads;                // the MoE's (dx left undefined: it is per micro-batch, above)
  Timeline timeline;
  std::vector<double> f_s, b_s, fb_s;  // durations of lone F steps, lone B steps, F&B steps
  int64_t overruns = 0, phases = 0;    // compute phases that outlasted their modelled time, of all
};

// One variant of the schedule (--mode both: sequential; overlapped with W inline; overlapped
// with W in the waits): the fastest of its --reps runs, for the timings, and its first, for the
// checks.
struct Variant {
  std::string name, key;  // as printed; in the CSV
  Mode mode = Mode::sequential;
  bool defer_w = false;
  RunResult best;
  double best_wall = 1e300;
  bool first = true;
  RunResult first_result;
};

// The variants --mode asks for, in the order they run and print: sequential first, then the
// overlapped one — and with --mode both (not prefill) the overlapped step with the weight
// gradients inline before it, to show what deferring them buys.
std::vector<Variant> schedule_variants(const Options& opts, const Setup& setup);

}  // namespace ff::f1b
