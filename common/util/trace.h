// common/util/trace.h — per-rank time spans, gathered into one Chrome-trace JSON (opens in
// Perfetto and chrome://tracing) and a CSV for plots.
//
// Design rules:
//  * Each rank is one process track ("rank R") with one thread track per stream ("compute",
//    "comm", "check", ...). Times are microseconds since the trace epoch, which every rank
//    takes right after a barrier, so ranks line up to within a barrier's skew.
//  * Two kinds of record:
//      span    time this rank's thread spent in something (computing, blocked in a send or a
//              wait): a complete event (ph "X") on its stream's track. Spans on one track
//              nest or are disjoint, as calls on one thread do; scripts/check-trace.py checks it.
//      flight  a message's life from post to completion (an isend/irecv): a nestable async
//              event pair (ph "b"/"e", one id each), since concurrent requests overlap
//              without nesting and would draw as mangled spans on one track.
//    Comm records both (see comm.h). The time a rank sat blocked in a wait is a span, the
//    time its message was on the way a flight: a plot of overlap wants exactly that split.
//  * Communication records carry peer, tag and bytes (JSON args and CSV columns).
//  * The end-of-run check's traffic is kept apart from the algorithm's: inside a
//    Trace::Category scope every record goes to that category's own track and "cat", e.g.
//        {
//          Trace::Category check_scope(trace(), "check");
//          ... the check: gathers, compares, allreduces ...
//        }
//    puts the check's spans and flights on a track named "check" (the UI can hide it) and
//    leaves the "comm" and "compute" tracks to the algorithm.
//  * The CSV has one row per record:
//        rank,name,stream,start_us,end_us,bytes,kind,peer,tag,from
//    kind is span or flight; peer is a rank, "all" (a collective) or empty (no peer: compute);
//    tag a number or empty; from is a sendrecv's source (its peer is the destination), else
//    empty. Readers should look columns up by name (csv.DictReader): new ones go at the end.
//  * Writing is collective (every rank calls, rank 0 writes), checked and atomic
//    (common/util/files.h): a failure throws ff::Error "cannot write PATH: <strerror>".
#pragma once
#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ff {


enum class SpanKind { span, flight };
const char* span_kind_name(SpanKind k);  // "span", "flight"

struct Span {
  static constexpr int kNoPeer = INT_MIN;       // not communication (or no source: from)
  static constexpr int kAllRanks = INT_MIN + 1;  // a collective
  static constexpr int kNoTag = INT_MIN;         // not point-to-point

  std::string name;    // e.g. "fold block", "allreduce", "wait irecv"
  std::string stream;  // the track: "compute", "comm", or a category such as "check"
  double start_us = 0, end_us = 0;
  int64_t bytes = 0;   // bytes moved (communication), 0 otherwise
  SpanKind kind = SpanKind::span;
  int peer = kNoPeer;  // the other rank (a sendrecv's destination), kAllRanks, or kNoPeer
  int tag = kNoTag;
  int from = kNoPeer;  // a sendrecv's source
  uint64_t id = 0;     // flights: the async event id, unique in the whole trace
};

class Trace {
 public:
  // Starts recording; the epoch is taken after a barrier on comm.
  void enable(MPI_Comm comm);
  bool enabled() const { return enabled_; }
  void disable() { enabled_ = false; }  // stops recording (the spans so far are kept)
  double now_us() const;  // since the epoch
  // A span of this thread's time on `stream`'s track (or the current Category's).
  void add(const std::string& name, const std::string& stream, double start_us, double end_us,
           int64_t bytes = 0);
  // Any record, as given, except: inside a Category its stream becomes the category's, and a
  // flight with id 0 gets a fresh id.
  void add(Span s);
  const std::vector<Span>& spans() const { return spans_; }
  void clear() { spans_.clear(); }
  // The category records go to now ("" outside any Category).
  const std::string& category() const { return category_; }
  // Sets it outside a Category scope's discipline: for code that switches between call stacks
  // on one thread (common/comm/overlap.h gives each its own).
  void set_category(const std::string& c) { category_ = c; }

  // Collective: every rank calls them; rank 0 writes the file. Throws ff::Error if the
  // file cannot be written (on rank 0).
  void write_chrome_json(MPI_Comm comm, const std::string& path) const;
  void write_csv(MPI_Comm comm, const std::string& path) const;
  // All ranks' records on rank 0 (empty elsewhere), with the rank of each.
  std::vector<std::pair<int, Span>> gather(MPI_Comm comm) const;

  // RAII span: records [construction, destruction) when tracing is enabled, on the track of
  // the Category current at construction.
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

  // RAII category: while it lives, every record (spans of any stream, Comm's spans and
  // flights) goes to the stream `name` (its own track, and "cat" in the JSON). Categories
  // nest; the innermost wins, and the previous one is restored on destruction.
  class Category {
   public:
    Category(Trace& t, std::string name);
    ~Category();
    Category(const Category&) = delete;
    Category& operator=(const Category&) = delete;

   private:
    Trace& t_;
    std::string previous_;
  };

 private:
  bool enabled_ = false;
  double epoch_s_ = 0;
  uint64_t next_id_ = 0;  // flight ids: rank in the high 32 bits, a count in the low ones
  std::string category_;
  std::vector<Span> spans_;
};

// The process-wide trace that Comm and lessons record into.
Trace& trace();

}  // namespace ff
