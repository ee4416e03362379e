// lessons/06_overlap/timeline.h — what a run records (compute phases, waits and message flights
// of this rank) and how the runs print it: the timeline rows, the time per rank.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "common/comm/comm.h"

namespace ff::f1b {

// What a run records: compute phases, waits and message flights of this rank, for the printed
// timeline, the compute / communication split and the costs fed to lesson 07's simulator.
struct Event {
  char kind;  // 'F' forward compute, 'B' backward compute, 'W' weight gradients, '.' waiting
  double t0, t1;
};
struct Timeline {
  double start = 0, end = 0;
  std::vector<Event> events;
  std::vector<std::pair<double, double>> flights;  // all-to-alls: posted .. seen complete
  double total(char kind) const {
    double s = 0;
    for (const Event& e : events)
      if (e.kind == kind) s += e.t1 - e.t0;
    return s;
  }
  double compute() const { return total('F') + total('B') + total('W'); }
  double waiting() const { return total('.'); }
  double wall() const { return end - start; }
};

// One timeline row of `width` characters over [t0, t0 + span): each column shows what covered
// most of its time ('F', 'B', 'W', '.', or ' ' for nothing recorded).
std::string timeline_row(const std::vector<Event>& events, double t0, double span, int width);
// The row of the message flights ('~' while one is in the air).
std::string flights_row(const Timeline& tl, double span, int width);

// Per rank: wall, compute and waiting seconds of a run, gathered to every rank.
struct RankTimes {
  std::vector<double> wall, compute, wait;
};
RankTimes gather_times(Comm& comm, const Timeline& tl);
double mean(const std::vector<double>& v);
// x as %g
std::string fmt_num(double x);

// ---- the report of lesson 06's runs (names[i] ran timelines[i], the fastest of reps)
// Rank 0's timelines on one time scale, with the messages in flight under each.
std::string timelines_text(const std::vector<std::string>& names,
                           const std::vector<Timeline>& timelines, int64_t reps, int width);
// Per rank: compute and waiting of the sequential run (times.front()), the walls of every run,
// and the hidden fraction of the overlapped one (times.back()), (T_seq - T_ovl) /
// min(T_compute, T_comm); printed when `print`. Returns the worst rank's fraction.
double print_hidden_fraction(const std::vector<RankTimes>& times, bool print);
// --csv rows: every run's (keys[i]) wall, compute and wait per rank, with the network modelled.
std::string times_csv(const std::vector<std::string>& keys, const std::vector<RankTimes>& times,
                      const std::string& progress, const LinkModel& link);

}  // namespace ff::f1b
