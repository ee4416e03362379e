// common/lesson/trace.h — per-rank time spans, gathered into one Chrome-trace JSON (opens in
// Perfetto and chrome://tracing) and a CSV for plots.
//
// Each rank is one process track ("rank R") with one thread track per stream
// ("compute", "comm", ...). Times are microseconds since the trace epoch, which
// every rank takes right after a barrier, so ranks line up to within a barrier's skew.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ff {

class Comm;

struct Span {
  std::string name;    // e.g. "fold block", "allreduce"
  std::string stream;  // e.g. "compute", "comm"
  double start_us = 0, end_us = 0;
  int64_t bytes = 0;   // bytes moved (comm spans), 0 otherwise
};

class Trace {
 public:
  // Starts recording; the epoch is taken after a barrier on comm.
  void enable(const Comm& comm);
  bool enabled() const { return enabled_; }
  double now_us() const;  // since the epoch
  void add(const std::string& name, const std::string& stream, double start_us, double end_us,
           int64_t bytes = 0);
  const std::vector<Span>& spans() const { return spans_; }
  void clear() { spans_.clear(); }

  // Collective: every rank calls them; rank 0 writes the file. Throws ff::Error if the
  // file cannot be written (on rank 0).
  void write_chrome_json(const Comm& comm, const std::string& path) const;
  void write_csv(const Comm& comm, const std::string& path) const;
  // All ranks' spans on rank 0 (empty elsewhere), with the rank of each.
  std::vector<std::pair<int, Span>> gather(const Comm& comm) const;

  // RAII span: records [construction, destruction) when tracing is enabled.
  class Scope {
   public:
    Scope(Trace& t, std::string name, std::string stream, int64_t bytes = 0);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Trace& t_;
    std::string name_, stream_;
    int64_t bytes_;
    double start_;
  };

 private:
  bool enabled_ = false;
  double epoch_s_ = 0;
  std::vector<Span> spans_;
};

// The process-wide trace that Comm and lessons record into.
Trace& trace();

}  // namespace ff
