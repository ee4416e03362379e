// lessons/06_overlap/timeline.cpp — the timeline rows and the time per rank (timeline.h).
#include "lessons/06_overlap/timeline.h"

#include <algorithm>
#include <cstdio>

namespace ff::f1b {

// One timeline row of `width` characters over [t0, t0 + span): each column shows what covered
// most of its time ('F', 'B', 'W', '.', or ' ' for nothing recorded).
std::string timeline_row(const std::vector<Event>& events, double t0, double span,
                                int width) {
  std::string row((size_t)width, ' ');
  const double col = span / width;
  for (int i = 0; i < width; i++) {
    const double a = t0 + i * col, b = a + col;
    double best = 0;
    for (const Event& e : events) {
      const double cover = std::min(b, e.t1) - std::max(a, e.t0);
      if (cover > best) best = cover, row[(size_t)i] = e.kind;
    }
  }
  return row;
}
std::string flights_row(const Timeline& tl, double span, int width) {
  std::vector<Event> fl;
  for (auto& f : tl.flights) fl.push_back({'~', f.first, f.second});
  return timeline_row(fl, tl.start, span, width);
}

RankTimes gather_times(Comm& comm, const Timeline& tl) {
  const double mine[3] = {tl.wall(), tl.compute(), tl.waiting()};
  std::vector<double> all((size_t)comm.size() * 3);
  comm.allgather(mine, sizeof mine, all.data());
  RankTimes t;
  for (int r = 0; r < comm.size(); r++) {
    t.wall.push_back(all[(size_t)r * 3]);
    t.compute.push_back(all[(size_t)r * 3 + 1]);
    t.wait.push_back(all[(size_t)r * 3 + 2]);
  }
  return t;
}
double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / (double)v.size();
}

std::string fmt_num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

std::string timelines_text(const std::vector<std::string>& names,
                           const std::vector<Timeline>& timelines, int64_t reps, int width) {
  double span = 0;
  for (const Timeline& tl : timelines) span = std::max(span, tl.wall());
  char line[512];
  std::snprintf(line, sizeof line,
                "\nrank 0, the fastest of %lld runs per mode (%d columns = %.1f ms; F forward, B backward,\n"
                "W weight gradients, . waiting for a message; ~ a message in flight):\n",
                (long long)reps, width, span * 1e3);
  std::string out = line;
  for (size_t i = 0; i < timelines.size(); i++) {
    const Timeline& tl = timelines[i];
    std::snprintf(line, sizeof line, "  %-24s |%s| %6.1f ms\n", names[i].c_str(),
                  timeline_row(tl.events, tl.start, span, width).c_str(), tl.wall() * 1e3);
    out += line;
    std::snprintf(line, sizeof line, "  %-24s |%s|\n", "", flights_row(tl, span, width).c_str());
    out += line;
  }
  return out;
}

double print_hidden_fraction(const std::vector<RankTimes>& times, bool print) {
  const int ranks = (int)times.front().wall.size();
  double hidden_worst = 1e300;
  const RankTimes &sequential = times.front(), &overlapped = times.back();
  if (print) {
    std::printf("\nper rank, ms: compute and waiting of the sequential run, the walls, and the hidden "
                "fraction\n(T_seq - T_ovl) / min(T_compute, T_comm): of the communication that "
                "compute could hide, how much was hidden\n");
    std::printf("  rank  compute  comm   sequential  %s  hidden\n",
                times.size() == 3 ? "W inline  W in waits" : "overlapped");
  }
  for (int r = 0; r < ranks; r++) {
    // nothing to hide on one rank (no message leaves it): no fraction
    const double compute = sequential.compute[(size_t)r], comm = sequential.wait[(size_t)r];
    const double hideable = ranks > 1 ? std::min(compute, comm) : 0;
    const double saved = sequential.wall[(size_t)r] - overlapped.wall[(size_t)r];
    const double hidden = hideable > 0 ? saved / hideable : 0;
    hidden_worst = std::min(hidden_worst, hidden);
    if (print) {
      std::printf("  %4d  %7.2f  %5.2f  %10.2f", r, sequential.compute[(size_t)r] * 1e3,
                  sequential.wait[(size_t)r] * 1e3, sequential.wall[(size_t)r] * 1e3);
      if (times.size() == 3) std::printf("  %8.2f", times[1].wall[(size_t)r] * 1e3);
      std::printf("  %10.2f  ", overlapped.wall[(size_t)r] * 1e3);
      if (ranks > 1) std::printf("%5.0f%%\n", 100 * hidden);
      else std::printf("  n/a (one rank: no messages)\n");
    }
  }
  if (print && ranks > 1)
    std::printf("hidden fraction (the worst rank): %.0f%%  (modelled network; target >= 80%% at the "
                "default shape with --progress test)\n", 100 * hidden_worst);
  return hidden_worst;
}

std::string times_csv(const std::vector<std::string>& keys, const std::vector<RankTimes>& times,
                      const std::string& progress, const LinkModel& link) {
  std::string rows;
  for (size_t i = 0; i < keys.size(); i++)
    for (size_t r = 0; r < times[i].wall.size(); r++)
      rows += keys[i] + "," + std::to_string(r) + "," + progress + "," +
              fmt_num(link.inter_bytes_per_s / 1e6) + "," + fmt_num(link.intra_bytes_per_s / 1e6) + "," +
              std::to_string(times[i].wall[r] * 1e3) + "," + std::to_string(times[i].compute[r] * 1e3) +
              "," + std::to_string(times[i].wait[r] * 1e3) + "\n";
  return rows;
}

}  // namespace ff::f1b
