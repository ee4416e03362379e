// common/lesson/lesson.h — the lesson skeleton: what every lesson does the same way, so that a
// lesson's main.cpp is its algorithm, its check and its report (DESIGN §6).
//
//   int main(int argc, char** argv) {
//     return run_lesson(argc, argv, "01_online_softmax", [](Lesson& L) {
//       L.cli.summary("Online softmax: ...");                  // what --help says it is
//       int64_t rows = 4;
//       L.cli.flag("--rows", &rows, "rows of x", 1, 4096);   // the lesson's own flags
//       L.parse();                                 // + the shared ones; every check up front
//       L.usage_error_if(rows % L.size() != 0, "--rows must be a multiple of the ranks");
//       L.require_memory(3.0 * rows * cols * 4, "--rows or --cols");
//       ... the algorithm, then CheckReport check(L.comm); check.close(...) ...
//       L.dump("x", x);                            // outputs: checked, atomic, agreed on
//       return L.finish(check);                    // trace, outputs, "check: PASS"
//     });
//   }
//
// The error contract, owned here:
//  * Bad input — a flag, a world size, an output path, a size beyond memory, a SIMT_*
//    variable — is found before any work and answered by one `error:` line on rank 0 and
//    exit 2 on every rank, through MPI_Finalize (fast: no abort, no watchdog).
//  * Output paths (--dump DIR, --trace FILE, --csv FILE) are checked on rank 0 by parse():
//    missing parent directories are created, a FILE is not a directory, the place takes a
//    file. Writes are checked and atomic (common/util/files.h); a failed write does not
//    stop the run at once (other ranks may be inside a collective), it is remembered, and
//    finish() agrees on it: one `error: cannot write FILE: reason` line, exit 1 everywhere.
//  * Any other exception (a bug, a broken invariant) prints `error: rank R: what` and aborts
//    every rank: one rank may be waiting on another that will never come.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

// A lesson includes this header for the whole core it composes: tensors, ops, autograd,
// checks, Comm, flags and trace spans.
#include "common/comm/comm.h"
#include "common/comm/nccl.h"
#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "common/lesson/check_report.h"
#include "common/lesson/cli.h"
#include "common/util/trace.h"

namespace ff {

class Tensor;

// A usage error every rank has found (the same condition, evaluated everywhere): exit 2.
struct UsageError : Error {
  using Error::Error;
};

// The lessons' one clock (steady_clock: monotonic, and safe to read from any thread, unlike
// MPI_Wtime under MPI_THREAD_SINGLE):
//     Stopwatch watch;  ...  double ms = watch.ms();
struct Stopwatch {
  static double now_s();  // seconds since an arbitrary start, the same for every Stopwatch
  double start_s = now_s();
  double seconds() const { return now_s() - start_s; }
  double ms() const { return seconds() * 1e3; }
  double us() const { return seconds() * 1e6; }
};

// Times of fn() over repetitions, in microseconds: each repetition starts after a barrier and
// counts the slowest rank (MPI_MAX), so every rank returns the same figures.
struct RepTimes {
  double min = 0, median = 0, max = 0;
};
RepTimes time_reps(Comm& comm, int64_t reps, const std::function<void()>& fn);

class Lesson {
 public:
  Lesson(Comm& comm, int argc, char** argv, const std::string& program);

  Comm& comm;
  Cli cli;             // the lesson adds its flags, then calls parse()
  CommonFlags flags;   // --device --backend --seed --timeout --dump --trace --csv --max-memory
  Device device = Device::cpu;  // resolved by parse()
  Backend backend = Backend::mpi;  // resolved by parse(); nccl: comm has NCCL enabled
  int rank() const { return comm.rank(); }
  int size() const { return comm.size(); }

  // Adds the shared flags, parses argv, checks the SIMT_*/FF_* environment and every output
  // path, resolves --device and --backend (nccl: sets up NCCL on comm; finish() says how many
  // launches went to it) and sets the watchdog. Any bad input: exit 2 (see above).
  void parse();
  // A check after parsing that every rank evaluates the same way: throws UsageError.
  void usage_error_if(bool bad, const std::string& message) const;
  // Refuses a run whose estimated memory per rank is beyond what this node has for each of
  // its ranks (or --max-memory): one line naming the estimate, what is available and the
  // flags to lower. Every rank must pass the same estimate.
  void require_memory(double bytes_per_rank, const std::string& flags_to_lower) const;

  // The network a lesson's messages cross (05, 06, 08), collective:
  //  * the ranks per node (--ranks-per-node): given > 0, the flag's value, a virtual layout;
  //    given == 0 (left out), the job's real layout (Comm::node_layout) when it spans several
  //    nodes with the same number of consecutive ranks on each and fits(R) accepts it, else
  //    virtual_default;
  //  * when link_spec is given (--link SPEC), the link model over those nodes (parse_link; a
  //    SPEC it refuses is a usage error on every rank).
  struct Network {
    int64_t ranks_per_node = 1;
    bool real_nodes = false;  // the job's own nodes, else virtual ones of consecutive ranks
    LinkModel link;           // enabled under --link
  };
  Network network(int64_t given, int64_t virtual_default, const std::string* link_spec,
                  const std::function<bool(int64_t)>& fits = nullptr) const;

  // printf on rank 0 only (the lessons' report: one copy, however many ranks).
  void print(const char* format, ...) const __attribute__((format(printf, 2, 3)));

  // ---- outputs: each write is checked and atomic; a failure is remembered for finish()
  bool dumping() const { return !flags.dump.empty(); }
  // DIR/name.npy, written by the calling rank (rank-local dumps: name it after the rank).
  void dump(const std::string& name, const Tensor& t);
  // DIR/name (e.g. "meta.json"), written by the calling rank.
  void dump_text(const std::string& name, const std::string& text);
  // Rows (CSV lines, each ending in '\n') appended to --csv by rank 0; the header is written
  // first when the file is new or empty. Other ranks' calls do nothing.
  void csv_append(const std::string& header, const std::string& rows);
  // --csv replaced by what write(path) writes (e.g. a collective trace CSV); every rank calls.
  void csv_with(const std::function<void(const std::string& path)>& write);
  // Starts recording trace spans (the lesson's timeline starts here) when --trace is given.
  void start_trace();

  // The end of every run: writes the trace (collective), agrees on every write, says on
  // rank 0 what was written, prints the verdict and returns the exit code (0 pass, 1 fail).
  int finish(const CheckReport& check);
  // For a run without a printed check (a --simulate or --bench mode): returns code.
  int finish(int code);
  bool finished() const { return finished_; }

 private:
  int64_t ranks_per_node(int64_t given, int64_t virtual_default, bool* real,
                         const std::function<bool(int64_t)>& fits) const;
  void output(const std::string& what, const std::function<void()>& write);
  int argc_;
  char** argv_;
  std::string write_error_;            // the first failed write on this rank
  std::vector<std::string> written_;   // what this rank wrote (for the summary)
  int64_t dumped_ = 0;                 // .npy/.json files this rank wrote into --dump
  bool finished_ = false;
};

// The whole program: MPI up, body(lesson), the error contract above, MPI down. Returns (and
// exits with) 0 when the check passed, 1 when it failed or a write failed, 2 on bad input.
// mpi_thread_level: what MPI_Init_thread is asked for (Comm::world).
int run_lesson(int argc, char** argv, const std::string& program,
               const std::function<int(Lesson&)>& body, int mpi_thread_level = MPI_THREAD_SINGLE);

// Memory this process may use on its node, in bytes: the smaller of MemAvailable and the
// cgroup's remaining limit, shared by the ranks on the node (for require_memory).
double memory_available_per_rank(const Comm& comm, int* ranks_on_node);

}  // namespace ff
