// lessons/06_overlap/report.h — what lesson 06 prints around its runs: the opening lines, and
// after the runs rank 0's timelines, the hidden fraction per rank, the measured costs in lesson
// 07's simulator and the CSV rows; and the --dump of a run.
#pragma once
#include <vector>

#include "common/layers/moe.h"
#include "common/lesson/lesson.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/options.h"
#include "lessons/06_overlap/run_result.h"

namespace ff::f1b {

// Rank 0: the block, the schedule, the modelled network and the modelled compute.
void print_setup(const Setup& setup, const Options& opts, int ranks);
// After every variant ran: the phases that outlasted their modelled time (summed over ranks),
// rank 0's timelines on one time scale, per rank the compute, the waiting and the hidden
// fraction, the measured costs in lesson 07's simulator (why DualPipe pairs F with B), and the
// --csv rows. Collective: every rank calls it.
void report_runs(Lesson& lesson, const Setup& setup, const Options& opts,
                 const std::vector<Variant>& variants, double overruns, double phases);
// Every gradient a run computed on this rank (before any sum over ranks), named as the dumps:
// "d_" and the parameter's name, as lesson 05 names them (d_wq, d_router_w, d_experts_w1, ...).
std::vector<moe::NamedTensor> named_grads(const RunResult& run);
// --dump: what this rank computed (before any sum over ranks), for a byte-for-byte comparison
// of two runs (tests/lessons/test_06_overlap.py: sequential against overlapped): y_rank<r>_mb<m>,
// dx_rank<r>_mb<m> and each gradient as <name>_rank<r>.
void dump_run(Lesson& lesson, const RunResult& run, int64_t microbatches, bool prefill);

}  // namespace ff::f1b
