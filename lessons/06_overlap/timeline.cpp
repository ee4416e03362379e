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

}  // namespace ff::f1b
