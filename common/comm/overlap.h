// common/comm/overlap.h — a forward and a backward of two micro-batches, interleaved so that
// each one's all-to-alls are in flight while the other computes: lesson 06's overlap, for the
// paired steps of a pipeline schedule (DualPipe's "F&B", common/layers/pipeline.h).
//
// The two run as two fibers (Boost.Context) on this thread and take turns at the all-to-alls:
// when one has posted an all-to-all's sends and receives (a2a_start, common/comm/alltoall.h)
// it hands the CPU to the other, which runs until it posts one of its own (or ends); then the
// first finishes its all-to-all, whose messages have moved meanwhile, and goes on. The
// backward starts (kStepOrder below), so with DeepSeek-V3's block the backward's dispatch flies
// during the forward's attention, the forward's dispatch during the backward's experts, and so
// on. While one half is suspended, the other polls its messages between ops.
//
// The turns are taken at the same points of the program on every rank (each all-to-all's
// start), so the collectives both halves issue on a communicator (TP's all-gathers, the
// routing maps' all-gathers) come in the same order on all its ranks, as MPI requires.
// Each fiber keeps its own autograd mode (a backward runs under NoGradGuard, the forward
// records) and its own trace category: the second half's spans go to a track of their own,
// "paired backward", since two interleaved call stacks on one track would not nest.
//
// Nothing about the numbers changes: each half computes what it computes alone, in the same
// order, so the result is the sequential one bit for bit (tests/mpi/test_overlap.cpp).
#pragma once
#include <functional>

namespace ff::overlap {

// DeepSeek-V3's overlapped step (report §3.2.1; seed 003's OverlappedOp.step), the one order
// lessons 06 and 08 both run: the backward starts, and the two passes take turns at each
// all-to-all, so that every all-to-all has a compute phase of the other pass to hide behind:
//   backward  start its dispatch (dy to the experts)
//   forward   attention and gate; start its dispatch          (hides B's dispatch)
//   backward  its experts; start its combine                  (hides F's dispatch)
//   forward   its experts; start its combine                  (hides B's combine)
//   backward  router, norm and attention                      (hides F's combine)
//   forward   its output
// Lesson 06 runs its six phases in this order; run_step below starts the pass kStepOrder[0]
// and lets the all-to-alls hand over, which gives the same alternation.
enum class Pass { forward, backward };
inline constexpr Pass kStepOrder[6] = {Pass::backward, Pass::forward, Pass::backward,
                                       Pass::forward,  Pass::backward, Pass::forward};

// Runs a forward and a backward interleaved as above, the pass kStepOrder[0] first; returns
// when both have ended. An exception in either is rethrown here once both have stopped (the
// other runs on to its end).
void run_step(const std::function<void()>& forward, const std::function<void()>& backward);

// Inside run_step: hand the CPU to the other half until it yields back or ends (no-op outside
// a pair, or when the other half has ended). a2a_async calls it between start and finish,
// with poll = one test of its messages: while this half is suspended the other calls poll
// between its ops (autograd's set_between_ops), since MPI moves messages, and the link model
// sees them arrive, only inside MPI calls (lesson 06's --progress test).
void yield(const std::function<void()>& poll = {});

// Switches taken so far on this thread (every yield that handed over): for tests and reports.
long switches();

}  // namespace ff::overlap
