// common/lesson/cli.h — command-line flags with validation and one-line errors.
//
//   Cli cli("01_online_softmax", "One-pass online softmax, single-process and distributed.");
//   int64_t rows = 4;   cli.flag("--rows", &rows, "rows of x", 1, 1 << 20);
//   std::string order = "chain"; cli.choice("--order", &order, {"chain", "allreduce"}, "...");
//   bool causal = false; cli.toggle("--causal", &causal, "causal masking");
//   cli.parse(argc, argv, comm);
//
// parse() handles --help (usage on rank 0, exit 0 on every rank) and every error
// (unknown flag, missing value, not a number, out of range, not an allowed choice; a text
// or choice value that starts with "--" is taken for a forgotten value, so `--trace --causal`
// is an error and not a trace file named "--causal"; numbers may still be negative):
// one `error: ...` line on rank 0 naming what is allowed, exit 2 on every rank. All
// ranks see the same argv, so they all take the same path: no abort, no hang.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/device.h"

namespace ff {

class Comm;

class Cli {
 public:
  Cli(std::string program, std::string summary);

  void flag(const std::string& name, int64_t* value, const std::string& help, int64_t min,
            int64_t max);
  void flag(const std::string& name, double* value, const std::string& help, double min,
            double max);
  // a text value; metavar names it in --help ("PATH", "LIST", ...)
  void flag(const std::string& name, std::string* value, const std::string& help,
            const std::string& metavar = "PATH");
  void choice(const std::string& name, std::string* value, const std::vector<std::string>& allowed,
              const std::string& help);
  void toggle(const std::string& name, bool* value, const std::string& help);
  // Extra text printed at the end of --help (e.g. the run line and expected output).
  void epilog(const std::string& text) { epilog_ = text; }
  const std::string& epilog() const { return epilog_; }
  // What the program is, printed under the usage line of --help.
  void summary(const std::string& text) { summary_ = text; }

  // Parses argv; on --help or bad input it exits every rank (see above).
  void parse(int argc, char** argv, const Comm& comm);
  // Same, without MPI: returns "" on success, "help" for --help, else the error text.
  std::string parse_args(const std::vector<std::string>& args);
  std::string usage() const;
  // Whether argv named this flag (e.g. to pick a default that depends on another flag).
  bool given(const std::string& name) const;

 private:
  enum class Kind { integer, real, text, choice, toggle };
  struct Flag {
    std::string name, help;
    Kind kind;
    void* value;
    double min = 0, max = 0;      // real flags
    int64_t imin = 0, imax = 0;   // integer flags (exact: int64 does not fit a double)
    std::vector<std::string> allowed;
    std::string default_text;
    std::string metavar;  // text flags
  };
  Flag& add(const std::string& name, Kind kind, void* value, const std::string& help);
  std::string set(const Flag& f, const std::string& text);
  static std::string value_name(const Flag& f);
  std::string program_, summary_, epilog_;
  std::vector<Flag> flags_;
  std::vector<std::string> given_;
};

// Flags every lesson has (DESIGN §6), with their defaults.
struct CommonFlags {
  std::string device = "auto";  // cpu | sim | cuda | auto
  std::string backend = "auto"; // mpi | nccl | auto (common/comm/nccl.h: resolve_backend)
  std::string dump;             // directory for .npy dumps ("" = off)
  std::string trace;            // Chrome trace JSON path ("" = off)
  std::string csv;              // metrics CSV path ("" = off)
  int64_t seed = 1234;
  double timeout = 60.0;        // watchdog seconds
  double max_memory_gib = 0;    // memory per rank a run may use (0: what the node has)
  void add_to(Cli& cli);
  // The device named by --device, ready to use. auto is cuda when this build and machine have
  // a GPU, else cpu. A device that is not available is a usage error (one line, exit 2 on
  // every rank). With cuda, each rank takes GPU (node-local rank mod GPUs on the node).
  Device resolve_device(const Comm& comm) const;
};

// For checks after parsing (world size, flag combinations): the same message on rank 0,
// exit 2 on every rank. Every rank must call it with the same condition.
void usage_error_if(bool bad, const Comm& comm, const std::string& message);

}  // namespace ff
