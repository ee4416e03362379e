// lessons/06_overlap/clock.h — the lesson's clock: each compute phase, wait and message flight of
// a run timed into its Timeline, with the compute modelled at a FLOP rate (--compute modelled)
// as the link model models the messages; and the FLOPs of each phase of the block.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "common/layers/expert_parallel.h"
#include "lessons/06_overlap/block.h"
#include "lessons/06_overlap/progress.h"
#include "lessons/06_overlap/timeline.h"

namespace ff::f1b {

// Seconds on the lessons' clock (Stopwatch::now_s, steady_clock), not MPI_Wtime: under
// --progress thread only one thread may be inside MPI at a time (MPI_THREAD_SERIALIZED), and
// this clock is read everywhere.
double now();

// FLOPs of the matmuls of each phase of the block (the elementwise work is left out).
class PhaseFlops {
 public:
  explicit PhaseFlops(const Setup& setup) : setup_(setup) {}
  double attention_forward() const;         // q k v o, q k^T and p v, the router
  double attention_input_backward() const;  // dx through q k v o; dq, dk, dp, dv
  double attention_weight_grad() const;     // one projection's dW = a^T dq
  double experts(int64_t rows) const;       // SwiGLU experts of width f: three matmuls a row
  double shared() const;                    // a SwiGLU of width S f on the T rows
  double combine() const;                   // the gated sum of each token's K outputs
  double combine_backward() const;          // its gradients: of the outputs and of the gates
  double router() const;                    // the router's dz W_g^T, or its weight gradient u^T dz

 private:
  const Setup& setup_;
};

// Times one run on this rank into `timeline`. Under --compute modelled (the default) a compute
// phase lasts its FLOPs at the modelled rate, as a message lasts its bytes at the modelled
// bandwidth: the phase computes for real first (the checks need its results), then the rest of
// its modelled time passes in slices of kTile — the compute tiles, between which --progress test
// polls the messages. A phase whose real compute took longer than modelled keeps its real time
// (an overrun, counted and reported). --compute real: phases last what they take.
class PhaseClock {
 public:
  PhaseClock(const Setup& setup, Progress& progress);
  // A compute phase ('F', 'B' or 'W') begun at t0 of `flops` ends (at once, if not modelled);
  // it is recorded, and traced under `name` ("F3 experts").
  void end_phase(char kind, double t0, double flops, const std::string& name);
  // Runs `wait` (a wait for messages), recorded as waiting ('.').
  void wait(const std::function<void()>& wait);
  // Records a flight posted at `posted` and just waited for. It ends where it was first seen
  // complete: by a poll (Request::done_us, on the trace's clock) when every message was, else
  // now, within the wait.
  void flight_done(const ep::RowFlight& flight, double posted);

  Timeline timeline;
  int64_t overruns = 0;  // phases whose real compute outlasted their modelled time by a tile

 private:
  static constexpr double kTile = 100e-6;
  const Setup& setup_;
  Progress& progress_;
  // now() - the trace clock's seconds: Request::done_us is on the trace's clock (MPI_Wtime, so
  // read under the progress lock)
  double trace_to_now_ = 0;
};

}  // namespace ff::f1b
