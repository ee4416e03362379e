// lessons/06_overlap/clock.cpp — the modelled-compute clock and the FLOPs of each phase
// (clock.h).
#include "lessons/06_overlap/clock.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/lesson/lesson.h"
#include "common/util/trace.h"

namespace ff::f1b {

double now() { return Stopwatch::now_s(); }

double PhaseFlops::attention_forward() const {
  const double T = (double)setup_.tokens, d = (double)setup_.moe.dim;
  const double N = (double)setup_.moe.experts;
  return 4 * 2 * T * d * d + 2 * 2 * T * T * d + 2 * T * d * N;
}
double PhaseFlops::attention_input_backward() const {
  const double T = (double)setup_.tokens, d = (double)setup_.moe.dim;
  return 4 * 2 * T * d * d + 4 * 2 * T * T * d;
}
double PhaseFlops::attention_weight_grad() const {
  return 2.0 * setup_.tokens * setup_.moe.dim * setup_.moe.dim;
}
double PhaseFlops::experts(int64_t rows) const {
  return 6.0 * (double)setup_.moe.dim * (double)setup_.moe.ffn * (double)rows;
}
double PhaseFlops::shared() const {
  return 6.0 * (double)setup_.tokens * (double)setup_.moe.dim *
         (double)(setup_.moe.shared * setup_.moe.ffn);
}
double PhaseFlops::combine() const {
  return 2.0 * (double)setup_.tokens * (double)setup_.moe.topk * (double)setup_.moe.dim;
}
double PhaseFlops::combine_backward() const {
  return 4.0 * (double)setup_.tokens * (double)setup_.moe.topk * (double)setup_.moe.dim;
}
double PhaseFlops::router() const {
  return 2.0 * (double)setup_.tokens * (double)setup_.moe.dim * (double)setup_.moe.experts;
}

PhaseClock::PhaseClock(const Setup& setup, Progress& progress)
    : setup_(setup), progress_(progress) {
  auto lock = progress_.lock();
  trace_to_now_ = now() - trace().now_us() * 1e-6;
}

void PhaseClock::end_phase(char kind, double t0, double flops, const std::string& name) {
  // [slide:modelled-compute]
  if (setup_.modelled_compute) {
    const double end = t0 + flops / setup_.flops_per_s;
    if (now() > end + kTile) overruns++;  // (small phases' bookkeeping aside)
    for (double t = now(); t < end; t = now()) {
      progress_.tick();
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(kTile, end - t)));
    }
  }
  // [/slide]
  const double t1 = now();
  timeline.events.push_back({kind, t0, t1});
  if (trace().enabled())  // the phase as modelled, on the trace's clock
    trace().add(name, "compute", (t0 - trace_to_now_) * 1e6, (t1 - trace_to_now_) * 1e6);
}

void PhaseClock::wait(const std::function<void()>& wait) {
  const double t0 = now();
  wait();
  timeline.events.push_back({'.', t0, now()});
}

void PhaseClock::flight_done(const ep::RowFlight& flight, double posted) {
  double end = now(), seen = 0;
  bool all_seen = !flight.a2a.reqs.empty();
  for (const Request& request : flight.a2a.reqs) {
    if (request.done_us < 0) all_seen = false;
    seen = std::max(seen, request.done_us);
  }
  if (all_seen) end = std::min(end, seen * 1e-6 + trace_to_now_);
  timeline.flights.push_back({posted, end});
}

}  // namespace ff::f1b
