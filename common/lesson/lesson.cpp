// common/lesson/lesson.cpp — the lesson skeleton (see lesson.h).
#include "common/lesson/lesson.h"

#include <mpi.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/core/tensor.h"
#include "common/util/exercise.h"
#include "common/util/files.h"
#include "common/core/npy.h"
#include "common/util/trace.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/simt_emulator.h"

namespace ff {

// ----------------------------------------------------------------------------
// timing

double Stopwatch::now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

RepTimes time_reps(Comm& comm, int64_t reps, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int64_t i = 0; i < reps; i++) {
    comm.barrier();
    const Stopwatch watch;
    fn();
    double dt = watch.us();
    comm.allreduce(&dt, 1, MPI_DOUBLE, MPI_MAX);
    t.push_back(dt);
  }
  std::sort(t.begin(), t.end());
  if (t.empty()) return {};
  return {t.front(), t[t.size() / 2], t.back()};
}

// ----------------------------------------------------------------------------
// memory

// The first number after `key` in a file like /proc/meminfo, or -1.
static double read_number_after(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.compare(0, key.size(), key) == 0) {
      std::istringstream is(line.substr(key.size()));
      double v = -1;
      is >> v;
      return v;
    }
  return -1;
}

// A cgroup file holding one number ("max" means no limit), or -1.
static double read_cgroup_value(const char* path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s == "max") return -1;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  return *end ? -1 : v;
}

double memory_available_per_rank(const Comm& comm, int* ranks_on_node) {
  double avail = read_number_after("/proc/meminfo", "MemAvailable:");
  avail = avail > 0 ? avail * 1024.0 : 0.0;
  // cgroup v2, then v1: the limit less what the group already uses
  double limit = read_cgroup_value("/sys/fs/cgroup/memory.max");
  double used = read_cgroup_value("/sys/fs/cgroup/memory.current");
  if (limit < 0) {
    limit = read_cgroup_value("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    used = read_cgroup_value("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  }
  if (limit > 0 && limit < 1e18) avail = avail > 0 ? std::min(avail, limit - std::max(used, 0.0))
                                                   : limit - std::max(used, 0.0);
  MPI_Comm node;
  mpiCheck(MPI_Comm_split_type(comm.raw(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &node));
  int n = 1;
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  if (ranks_on_node) *ranks_on_node = n;
  return std::max(avail, 0.0) / n;
}

static std::string gib(double bytes) {
  char buf[32];
  if (bytes >= 1 << 30) std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / (1 << 30));
  else std::snprintf(buf, sizeof buf, "%.0f MiB", std::ceil(bytes / (1 << 20)));
  return buf;
}

// ----------------------------------------------------------------------------
// parsing and checks

Lesson::Lesson(Comm& c, int argc, char** argv, const std::string& program)
    : comm(c), cli(program, ""), argc_(argc), argv_(argv) {}

void Lesson::usage_error_if(bool bad, const std::string& message) const {
  if (bad) throw UsageError(message);
}

// One string from rank 0 to every rank.
static std::string bcast_string(Comm& comm, std::string s) {
  uint64_t n = s.size();
  comm.bcast(&n, sizeof n, 0);
  s.resize(n);
  if (n) comm.bcast(&s[0], n, 0);
  return s;
}

void Lesson::parse() {
  flags.add_to(cli);
  cli.epilog(cli.epilog() + (cli.epilog().empty() ? "" : "\n") +
             "make run adds what plain mpirun needs: mpirun --oversubscribe (more ranks than cores)\n"
             "--allow-run-as-root (as root) --mca odls_base_sigkill_timeout 0 (a failing run ends at once)\n"
             "--mca pml ob1 (one machine's shared memory, without probing for network fabrics)");
  cli.parse(argc_, argv_, comm);  // --help and flag errors leave from here
  usage_error_if(!simt::environment_error().empty(), simt::environment_error());
  usage_error_if(!cpu::matmul_isa_error().empty(), cpu::matmul_isa_error());
  // Output paths, on rank 0 (it creates what is missing), before any work.
  std::string bad;
  if (rank() == 0) {
    struct Out { const char* flag; const std::string& path; PathKind kind; };
    const Out outs[] = {{"--dump", flags.dump, PathKind::dir},
                        {"--trace", flags.trace, PathKind::file},
                        {"--csv", flags.csv, PathKind::file}};
    for (const Out& o : outs) {
      if (o.path.empty() || !bad.empty()) continue;
      std::string e = check_output_path(o.path, o.kind);
      if (!e.empty()) bad = std::string(o.flag) + " " + e;
    }
    if (bad.empty() && !flags.trace.empty() && flags.trace == flags.csv)
      bad = "--trace and --csv name the same file " + flags.trace + "; give two paths";
  }
  bad = bcast_string(comm, bad);
  usage_error_if(!bad.empty(), bad);
  device = flags.resolve_device(comm);
  comm.set_timeout(flags.timeout);
  // NCCL takes one GPU per rank: whether every node has a GPU for each of its ranks (agreed).
  int crowded = 0;
  if (device == Device::cuda) {  // (the same on every rank: no collective otherwise)
    crowded = Comm::wait_policy().node_ranks > device_gpu_count() ? 1 : 0;
    comm.allreduce(&crowded, 1, MPI_INT, MPI_MAX);
  }
  std::string why = resolve_backend(flags.backend, device, nccl::built(), crowded == 0, &backend);
  usage_error_if(!why.empty(), why);
  // (said at the end, in finish(): a usage error found after this must stay one line)
  if (backend == Backend::nccl) comm.enable_nccl(device);
}

int64_t Lesson::ranks_per_node(int64_t given, int64_t virtual_default, bool* real,
                               const std::function<bool(int64_t)>& fits) const {
  const NodeLayout nodes = Comm::node_layout();  // every rank calls it, given or not
  *real = false;
  if (given > 0) return given;
  if (nodes.nodes > 1 && nodes.ranks_per_node > 0 && (!fits || fits(nodes.ranks_per_node))) {
    *real = true;
    return nodes.ranks_per_node;
  }
  return virtual_default;
}

Lesson::Network Lesson::network(int64_t given, int64_t virtual_default, const std::string* link_spec,
                                const std::function<bool(int64_t)>& fits) const {
  Network net;
  net.ranks_per_node = ranks_per_node(given, virtual_default, &net.real_nodes, fits);
  net.link.ranks_per_node = (int)net.ranks_per_node;
  net.link.real_nodes = net.real_nodes;
  if (link_spec) {
    std::string why;
    usage_error_if(!parse_link(*link_spec, &net.link, &why), why);
  }
  return net;
}

void Lesson::print(const char* format, ...) const {
  if (rank() != 0) return;
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
}

void Lesson::require_memory(double bytes, const std::string& flags_to_lower) const {
  int on_node = 1;
  double avail = memory_available_per_rank(comm, &on_node);
  const bool forced = flags.max_memory_gib > 0;
  if (forced) avail = flags.max_memory_gib * (1 << 30);
  if (bytes <= avail) return;
  std::string where = forced ? "the --max-memory of " + gib(avail) + " per rank"
                             : "the " + gib(avail) + " available to each of the " +
                                   std::to_string(on_node) + " rank" + (on_node == 1 ? "" : "s") +
                                   " on this node";
  throw UsageError("these sizes need about " + gib(bytes) + " per rank, more than " + where +
                   ": lower " + flags_to_lower + (forced ? "" : " (or set --max-memory GIB)"));
}

// ----------------------------------------------------------------------------
// outputs

void Lesson::output(const std::string& what, const std::function<void()>& write) {
  if (!write_error_.empty()) return;  // the first failure is the one reported
  try {
    write();
    if (!what.empty()) written_.push_back(what);
  } catch (const Error& e) {
    write_error_ = e.what();
  }
}

void Lesson::dump(const std::string& name, const Tensor& t) {
  if (!dumping()) return;
  output("", [&] { save_npy(flags.dump + "/" + name + ".npy", t); });
  if (write_error_.empty()) dumped_++;
}

void Lesson::dump_text(const std::string& name, const std::string& text) {
  if (!dumping()) return;
  output("", [&] { write_text_file(flags.dump + "/" + name, text); });
  if (write_error_.empty()) dumped_++;
}

void Lesson::csv_append(const std::string& header, const std::string& rows) {
  if (flags.csv.empty() || rank() != 0) return;
  output("csv " + flags.csv, [&] {
    OutputFile f(flags.csv, OutputFile::Mode::append);
    if (!f.had_content()) f.write(header + "\n");
    f.write(rows);
    f.commit();
  });
}

void Lesson::csv_with(const std::function<void(const std::string& path)>& write) {
  if (flags.csv.empty()) return;
  output(rank() == 0 ? "csv " + flags.csv : "", [&] { write(flags.csv); });
}

void Lesson::start_trace() {
  if (!flags.trace.empty()) trace().enable(comm.raw());
}

int Lesson::finish(int code) {
  finished_ = true;
  if (!flags.trace.empty() && trace().enabled())
    output(rank() == 0 ? "trace " + flags.trace + " (open in https://ui.perfetto.dev)" : "",
           [&] { trace().write_chrome_json(comm.raw(), flags.trace); });
  // Agree: the lowest rank with a failed write says which, and every rank exits 1.
  int first_bad = write_error_.empty() ? size() : rank();
  comm.allreduce(&first_bad, 1, MPI_INT, MPI_MIN);
  if (first_bad < size()) {
    if (rank() == first_bad) std::fprintf(stderr, "error: %s\n", write_error_.c_str());
    return 1;
  }
  int64_t files = dumped_;
  comm.allreduce(&files, 1, MPI_INT64_T, MPI_SUM);
  int64_t on_nccl[2] = {nccl::launches(), nccl::launches()};  // [0] the fewest, [1] the most
  if (backend == Backend::nccl) {
    comm.allreduce(&on_nccl[0], 1, MPI_INT64_T, MPI_MIN);
    comm.allreduce(&on_nccl[1], 1, MPI_INT64_T, MPI_MAX);
  }
  if (rank() == 0) {
    if (backend == Backend::nccl && device == Device::cuda)
      std::printf("    NCCL %s ran %lld to %lld launches per rank (the rest went through MPI)\n",
                  nccl::version().c_str(), (long long)on_nccl[0], (long long)on_nccl[1]);
    else if (backend == Backend::nccl)
      std::printf("    NCCL (emulated) ran %lld to %lld launches per rank (the rest went through MPI)\n",
                  (long long)on_nccl[0], (long long)on_nccl[1]);
    if (files) std::printf("    wrote %lld dump file%s to %s\n", (long long)files, files == 1 ? "" : "s",
                           flags.dump.c_str());
    for (const std::string& w : written_) std::printf("    wrote %s\n", w.c_str());
  }
  std::fflush(stdout);
  return code;
}

int Lesson::finish(const CheckReport& check) {
  int code = finish(0);
  if (code) return code;
  return check.verdict();
}

// ----------------------------------------------------------------------------
// the program

// True for the first caller among this node's ranks of this job (they share the launcher, their
// parent process). The claim is a name bound in Linux's abstract socket namespace: binding is
// exclusive, and the name goes with the process, so nothing is left behind. Elsewhere every
// caller says it.
static bool first_report_on_node() {
#if defined(__linux__)
  const int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
  if (fd < 0) return true;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = "fivefold-exercise-" + std::to_string((long)getppid());
  std::memcpy(addr.sun_path + 1, name.data(), std::min(name.size(), sizeof addr.sun_path - 2));
  const socklen_t len = (socklen_t)(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0;  // (fd stays open: the claim)
#else
  return true;
#endif
}

// A student's unwritten exercise (common/util/exercise.h), reached wherever its stub is: the
// ranks that reach it may be few (a chain's later links), the others waiting on them, so the
// job is aborted with status 2. Of the ranks on this node that reach it, the first to claim the
// report prints the one line, holds its claim a second (ranks doing the same work reach the
// stub within it, and find it taken) and aborts; the others wait for that abort to end them
// (and end the job themselves only if it never comes), so that the line is neither lost to a
// rank killed before it printed nor printed twice.
[[noreturn]] static void report_missing_exercise(const char* message) {
  if (first_report_on_node()) {
    std::fprintf(stderr, "error: %s\n", message);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(1));
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(6));
  }
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::exit(2);
}

int run_lesson(int argc, char** argv, const std::string& program,
               const std::function<int(Lesson&)>& body, int mpi_thread_level) {
  Comm comm = Comm::world(&argc, &argv, mpi_thread_level);
  set_exercise_handler(report_missing_exercise);
  int code = 1;
  try {
    Lesson lesson(comm, argc, argv, program);
    code = body(lesson);
    if (!lesson.finished()) code = lesson.finish(code);
  } catch (const UsageError& e) {  // found by every rank alike: no abort needed
    if (comm.rank() == 0) std::fprintf(stderr, "error: %s\n", e.what());
    Comm::exit_all(2);
  } catch (const ExerciseMissing& e) {  // (thrown only if the handler below was not installed)
    report_missing_exercise(e.what());
  } catch (const std::exception& e) {  // ff::Error, device errors, bad_alloc: this rank only
    std::fprintf(stderr, "error: rank %d: %s\n", comm.rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  Comm::exit_all(code);
}

}  // namespace ff
