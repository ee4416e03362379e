// common/comm/comm.cpp — Comm: every blocking call is its non-blocking twin plus a watched wait.
//
// The loops that wait are wait_one() (MPI_Test) and wait_all() (MPI_Testsome), both paced by
// one Backoff against a deadline, so a deadlock (two ranks that both Ssend first, a
// collective one rank never enters) ends as one `error:` line naming rank, operation, peer,
// tag and bytes, then MPI_Abort. How they pace their polls (spin or sleep) is decided once,
// in Comm::world: see "the watchdog" below.
//
// With the link model on (Comm::set_link), a point-to-point request is done when MPI says so
// AND its modelled time has come: isend/issend take their modelled completion at the post,
// a receive when a wait first sees it complete in MPI (link_posted, link_arrived); the waits
// then sleep or poll until that time. See "the link model" below and in comm.h.
//
// Self-messages (peer == rank) work through non-blocking pairs: post irecv, then isend,
// then wait both. A *blocking* ssend to self can never be matched (the matching recv is
// only posted after ssend returns): the watchdog reports it like any other deadlock.
#include "common/comm/comm.h"

#include "common/comm/nccl.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>
#include <thread>
#include <utility>

#include "common/core/check.h"
#include "common/core/tensor.h"
#include "common/util/trace.h"

namespace ff {

// ----------------------------------------------------------------------------
// errors

// MPI counts are int: larger messages are refused (fivefold only moves small ones).
static int to_count(size_t bytes, const char* op) {
  FF_CHECK(bytes <= (size_t)INT_MAX, op << ": " << bytes << " bytes is more than MPI's int count ("
                                        << INT_MAX << ") allows");
  return (int)bytes;
}

// Byte counts and back-to-back displacements for the v-collectives.
static void counts_and_displs(const std::vector<size_t>& bytes, const char* op,
                              std::vector<int>* counts, std::vector<int>* displs) {
  counts->resize(bytes.size());
  displs->resize(bytes.size());
  size_t offset = 0;
  for (size_t i = 0; i < bytes.size(); i++) {
    (*counts)[i] = to_count(bytes[i], op);
    (*displs)[i] = to_count(offset, op);
    offset += bytes[i];
  }
  to_count(offset, op);
}

static double now_us() { return trace().now_us(); }

// ----------------------------------------------------------------------------
// the wait policy: spin or sleep (see WaitPolicy in comm.h), decided once in Comm::world

static WaitPolicy g_wait;  // until Comm::world decides: sleep, safe everywhere
static bool g_wait_decided = false;

const WaitPolicy& Comm::wait_policy() { return g_wait; }

// The whole of a small file (a cgroup or proc file); "" if it cannot be read.
static std::string read_small_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  if (in) ss << in.rdbuf();
  return ss.str();
}

double cgroup_cpu_max_cores(const std::string& cpu_max) {
  std::istringstream in(cpu_max);
  std::string quota, period;
  if (!(in >> quota >> period) || quota == "max") return 0;
  char* end = nullptr;
  const double q = std::strtod(quota.c_str(), &end);
  if (end == quota.c_str() || *end != '\0' || !(q > 0)) return 0;  // cgroup v1 writes -1: no limit
  const double p = std::strtod(period.c_str(), &end);
  if (end == period.c_str() || *end != '\0' || !(p > 0)) return 0;
  return q / p;
}

// The tightest CPU quota on this process's cgroups (0: none). cgroup v2: cpu.max of our own
// cgroup and of each parent up to the root (a parent's limit binds its children); cgroup v1:
// cpu.cfs_quota_us / cpu.cfs_period_us where the cpu controller is mounted.
static double cgroup_cores() {
  double best = 0;
  auto take = [&](double cores) {
    if (cores > 0 && (best == 0 || cores < best)) best = cores;
  };
  std::string own;  // our cgroup v2 path, from the "0::/path" line of /proc/self/cgroup
  std::istringstream lines(read_small_file("/proc/self/cgroup"));
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("0::", 0) == 0) own = line.substr(3);
  for (std::string dir = own;; dir = dir.substr(0, dir.rfind('/'))) {
    while (!dir.empty() && dir.back() == '/') dir.pop_back();
    take(cgroup_cpu_max_cores(read_small_file("/sys/fs/cgroup" + dir + "/cpu.max")));
    if (dir.empty()) break;
  }
  for (const char* v1 : {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"}) {
    const std::string base = v1;
    take(cgroup_cpu_max_cores(read_small_file(base + "/cpu.cfs_quota_us") + " " +
                              read_small_file(base + "/cpu.cfs_period_us")));
  }
  return best;
}

// Ranks of this job on this node, and the cores they may use between them: the union of
// their affinity masks (an mpirun that binds each rank to its own core gives each a
// one-core mask), capped by the cgroup quota. Collective over MPI_COMM_WORLD.
static void measure_node(int* node_ranks, double* cores) {
  MPI_Comm node = MPI_COMM_NULL;
  mpiCheck(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  mpiCheck(MPI_Comm_size(node, node_ranks));
  constexpr int kWords = CPU_SETSIZE / 64;
  uint64_t mask[kWords] = {};
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; c++)
      if (CPU_ISSET(c, &set)) mask[c / 64] |= uint64_t{1} << (c % 64);
  } else {  // no affinity to read: all the cores the machine has
    const int n = std::max(1, std::min((int)std::thread::hardware_concurrency(), CPU_SETSIZE));
    for (int c = 0; c < n; c++) mask[c / 64] |= uint64_t{1} << (c % 64);
  }
  mpiCheck(MPI_Allreduce(MPI_IN_PLACE, mask, kWords, MPI_UINT64_T, MPI_BOR, node));
  mpiCheck(MPI_Comm_free(&node));
  int n = 0;
  for (uint64_t w : mask) n += __builtin_popcountll(w);
  *cores = (double)std::max(1, n);
  const double quota = cgroup_cores();
  if (quota > 0 && quota < *cores) *cores = quota;
}

NodeLayout node_layout_of(const std::vector<int>& node_of_rank) {
  NodeLayout l;
  std::vector<int> seen;  // the labels, in the order of their first rank
  for (size_t i = 0; i < node_of_rank.size(); i++)
    if (i == 0 || node_of_rank[i] != node_of_rank[i - 1]) seen.push_back(node_of_rank[i]);
  std::vector<int> distinct(seen);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  l.nodes = std::max<int>(1, (int)distinct.size());
  // consecutive (each node one run of ranks) and equal runs
  const size_t P = node_of_rank.size();
  if (P > 0 && seen.size() == distinct.size() && P % distinct.size() == 0) {
    const size_t R = P / distinct.size();
    bool equal = true;
    for (size_t i = 0; i < P; i++) equal = equal && node_of_rank[i] == node_of_rank[i / R * R];
    if (equal) l.ranks_per_node = (int)R;
  }
  return l;
}

NodeLayout Comm::node_layout() {
  // Each node is named by its lowest world rank.
  MPI_Comm node = MPI_COMM_NULL;
  int world_rank = 0, size = 1, leader = 0;
  mpiCheck(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  mpiCheck(MPI_Comm_size(MPI_COMM_WORLD, &size));
  mpiCheck(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node));
  leader = world_rank;
  mpiCheck(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, node));
  mpiCheck(MPI_Comm_free(&node));
  std::vector<int> all((size_t)size);
  Comm world(MPI_COMM_WORLD);
  world.allgather(&leader, sizeof leader, all.data());  // watched
  return node_layout_of(all);
}

// Reads FF_WAIT and measures the node; collective over MPI_COMM_WORLD. A bad FF_WAIT is a
// usage error on every rank: the lowest rank that saw it prints the one line.
static void decide_wait_policy() {
  const char* env = std::getenv("FF_WAIT");
  const std::string mode = env ? env : "auto";
  const bool bad = mode != "spin" && mode != "sleep" && mode != "auto";
  int rank = 0, size = 1;
  mpiCheck(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  mpiCheck(MPI_Comm_size(MPI_COMM_WORLD, &size));
  int first_bad = bad ? rank : size;
  mpiCheck(MPI_Allreduce(MPI_IN_PLACE, &first_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  if (first_bad < size) {
    if (rank == first_bad)
      std::fprintf(stderr, "error: FF_WAIT='%s' is not a wait policy; want spin, sleep or auto\n",
                   mode.c_str());
    Comm::exit_all(2);
  }
  WaitPolicy w;
  measure_node(&w.node_ranks, &w.cores);  // collective: measured whatever FF_WAIT says
  char why[160];
  if (mode == "auto") {
    w.spin = w.node_ranks <= w.cores;
    std::snprintf(why, sizeof why, "auto: %d rank%s on %g core%s%s", w.node_ranks,
                  w.node_ranks == 1 ? "" : "s", w.cores, w.cores == 1 ? "" : "s",
                  w.spin ? "" : ", oversubscribed");
  } else {
    w.spin = mode == "spin";
    std::snprintf(why, sizeof why, "FF_WAIT=%s", mode.c_str());
  }
  w.reason = why;
  g_wait = w;
  g_wait_decided = true;
}

// ----------------------------------------------------------------------------
// the link model (see comm.h): process-wide, like the links it stands for

namespace {
struct LinkState {
  LinkModel model;
  // when each link of this rank is next free, on link_now_s()'s clock: [0] intra, [1] inter
  double out_free_s[2] = {0, 0}, in_free_s[2] = {0, 0};
  LinkBytes sent;
};
LinkState g_link;
}  // namespace

// The model's clock: seconds on steady_clock since the first call (the Backoff's clock too).
static double link_now_s() {
  using clock = std::chrono::steady_clock;
  static const clock::time_point epoch = clock::now();
  return std::chrono::duration<double>(clock::now() - epoch).count();
}

void Comm::set_link(const LinkModel& m) {
  FF_CHECK(std::isfinite(m.intra_bytes_per_s) && m.intra_bytes_per_s > 0 &&
               std::isfinite(m.inter_bytes_per_s) && m.inter_bytes_per_s > 0,
           "link model: bandwidths must be positive and finite, got intra "
               << m.intra_bytes_per_s << " and inter " << m.inter_bytes_per_s << " bytes/s");
  FF_CHECK(std::isfinite(m.latency_s) && m.latency_s >= 0,
           "link model: latency must be non-negative and finite, got " << m.latency_s << " s");
  FF_CHECK(m.ranks_per_node >= 1, "link model: ranks_per_node must be at least 1, got " << m.ranks_per_node);
  LinkState fresh;
  fresh.model = m;
  fresh.sent = g_link.sent;  // the counters run on; reset_bytes_sent() clears them
  g_link = fresh;
}

const LinkModel& Comm::link() { return g_link.model; }
LinkBytes Comm::bytes_sent() { return g_link.sent; }
void Comm::reset_bytes_sent() { g_link.sent = LinkBytes{}; }

int Comm::world_rank(int r) const {
  FF_CHECK(r >= 0 && r < size_, "world_rank: rank " << r << " is not in this communicator of " << size_);
  return world_ranks_ ? (*world_ranks_)[(size_t)r] : r;
}

LinkClass Comm::link_class(int peer) const {
  FF_CHECK(peer >= 0 && peer < size_,
           "link_class: peer " << peer << " is not a rank of this communicator of " << size_);
  if (peer == rank_) return LinkClass::self;
  const LinkModel& m = g_link.model;
  return m.node_of(world_rank(peer)) == m.node_of(world_rank(rank_)) ? LinkClass::intra
                                                                      : LinkClass::inter;
}

// The message of `bytes` on the link of class c whose next free time is *free_s, from t:
// it starts when both it and the link are ready, holds the link bytes / bandwidth, and is
// complete one latency later. Returns that completion.
static double charge_link(double* free_s, LinkClass c, size_t bytes, double t) {
  const LinkModel& m = g_link.model;
  const double bandwidth = c == LinkClass::intra ? m.intra_bytes_per_s : m.inter_bytes_per_s;
  const double start = std::max(t, *free_s);
  *free_s = start + (double)bytes / bandwidth;
  return *free_s + m.latency_s;
}
static int link_index(LinkClass c) { return c == LinkClass::intra ? 0 : 1; }

// A send just posted: its bytes counted by class; with the model on, its modelled completion.
void Comm::link_posted(Request& r) {
  if (r.peer < 0 || r.peer >= size_) return;  // MPI_PROC_NULL: nothing is sent
  CollectiveCount& sent = (*counts_)["send"];  // point-to-point, next to the collectives
  sent.calls++;
  sent.bytes += r.bytes;
  const LinkClass c = link_class(r.peer);
  (c == LinkClass::self ? g_link.sent.self : c == LinkClass::intra ? g_link.sent.intra
                                                                   : g_link.sent.inter) += r.bytes;
  if (!g_link.model.enabled || c == LinkClass::self || r.nccl) return;  // NCCL's are not modelled
  r.modelled = true;
  r.link_done_s = charge_link(&g_link.out_free_s[link_index(c)], c, r.bytes, link_now_s());
}

// A modelled receive a wait has just seen complete in MPI: its incoming link is charged from
// now (the source, for a wildcard receive, as the status says).
void Comm::link_arrived(Request& r, const MPI_Status& status) {
  if (!r.modelled || !r.is_recv || r.link_done_s >= 0) return;
  const int src = r.peer == MPI_ANY_SOURCE ? status.MPI_SOURCE : r.peer;
  if (!g_link.model.enabled || src < 0 || src >= size_ || src == rank_) {
    r.modelled = false;
    return;
  }
  const LinkClass c = link_class(src);
  r.link_done_s = charge_link(&g_link.in_free_s[link_index(c)], c, r.bytes, link_now_s());
}

// Whether r is done as far as the model goes (a receive not yet seen in MPI is not).
static bool link_due(const Request& r, double now_s) {
  return !r.modelled || (r.link_done_s >= 0 && now_s >= r.link_done_s);
}

// ----------------------------------------------------------------------------
// construction

Comm::Comm(MPI_Comm c) : comm_(c) {
  if (c == MPI_COMM_NULL) {  // MPI_Comm_split with color MPI_UNDEFINED
    rank_ = -1;
    size_ = 0;
    return;
  }
  mpiCheck(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
  mpiCheck(MPI_Comm_rank(c, &rank_));
  mpiCheck(MPI_Comm_size(c, &size_));
  // The world rank of each member, for the link model's virtual nodes.
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  mpiCheck(MPI_Comm_group(c, &group));
  mpiCheck(MPI_Comm_group(MPI_COMM_WORLD, &world));
  std::vector<int> mine((size_t)size_), theirs((size_t)size_);
  std::iota(mine.begin(), mine.end(), 0);
  mpiCheck(MPI_Group_translate_ranks(group, size_, mine.data(), world, theirs.data()));
  mpiCheck(MPI_Group_free(&group));
  mpiCheck(MPI_Group_free(&world));
  world_ranks_ = std::make_shared<const std::vector<int>>(std::move(theirs));
}

static int g_thread_provided = MPI_THREAD_SINGLE;

Comm Comm::world(int* argc, char*** argv, int thread_level) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int rc = MPI_Init_thread(argc, argv, thread_level, &g_thread_provided);
    if (rc != MPI_SUCCESS) {
      std::fprintf(stderr, "error: MPI_Init failed (code %d)\n", rc);
      std::exit(1);
    }
  }
  if (!g_wait_decided) decide_wait_policy();
  return Comm(MPI_COMM_WORLD);
}

int Comm::thread_level_provided() { return g_thread_provided; }

[[noreturn]] void Comm::exit_all(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
  std::exit(code);
}

Comm Comm::split(int color, int key) const {
  MPI_Comm child = MPI_COMM_NULL;
  mpiCheck(MPI_Comm_split(comm_, color, key, &child));
  Comm c(child);
  c.timeout_s_ = timeout_s_;
  if (nccl_) {
    const bool member = child != MPI_COMM_NULL;
    if (nccl_->can_split())  // every rank of this communicator takes part, members or not
      c.nccl_ = nccl_->split(color, key, member, c.rank_, c.size_, timeout_s_);
    else if (member)
      c.enable_nccl(nccl_->device());
  }
  return c;
}

void Comm::set_timeout(double seconds) {
  timeout_s_ = seconds;
  if (nccl_) nccl_->set_timeout(seconds);
}

void Comm::enable_nccl(Device device) {
  if (nccl_ || comm_ == MPI_COMM_NULL) return;
  FF_CHECK(device == Device::cuda || device == Device::sim,
           "enable_nccl: NCCL moves cuda buffers (or sim ones, emulated), not " << device_name(device) << " ones");
  if (device == Device::sim) {
    nccl_ = NcclComm::emulate(comm_, timeout_s_);
    return;
  }
  FF_CHECK(nccl::built(), "enable_nccl: this build has no NCCL");
  std::string id = rank_ == 0 ? NcclComm::unique_id() : std::string(NcclComm::id_bytes(), '\0');
  bcast(&id[0], id.size(), 0);  // host bytes: MPI, watched
  nccl_ = NcclComm::create(id, rank_, size_, timeout_s_);
}

bool Comm::to_nccl(const void* a, const void* b) const {
  return nccl_ && nccl_->takes(a) && (!b || nccl_->takes(b));
}

// ----------------------------------------------------------------------------
// the watchdog
//
// Every wait polls MPI_Test (or MPI_Testsome) and, between polls that find nothing done,
// pauses as the wait policy says. Why two policies: a small message completes in a few
// microseconds, so a wait should cost about that — but only a rank that keeps polling sees
// it then. With a core per rank, polling flat out costs nobody anything, and any sleep
// costs its wake-up latency (50 us asked, ~100 us got, whenever the first quick polls miss:
// lesson 04's 64-byte all-to-alls, ~2 us each, measured at 2.3x to 285x MPI_Alltoallv
// between runs). With ranks sharing cores (up to 32 on 2 here), a spinning rank steals the
// core from the very peer it waits for, and yielding and sleeping are what let it run.
//   spin  (each rank has a core): poll flat out, with a pause instruction, for kSpinS; a
//         wait longer than that is waiting on the peer's work, not on the message, and
//         goes on as below.
//   sleep (oversubscribed): kQuickPolls polls that yield the core, then sleeps.
// The sleeps start at 50 us and grow with the time already waited (1% of it, at most
// 1 ms), so a rank stuck for long costs ~1% of a core while a short wait still reacts
// within ~0.1 ms.
// With the link model, a wait may also hold requests MPI has completed whose modelled time
// has not come yet. No sleep goes past the earliest such time; and once MPI has nothing left
// pending, the wait sleeps until kModelSpinS before that time (a sleep overshoots by some
// 50 us), then polls the clock as above for the rest, so a modelled wait costs next to no CPU.
static constexpr double kSpinS = 2e-3;
static constexpr int kQuickPolls = 16;
static constexpr double kMinSleepS = 50e-6, kMaxSleepS = 1e-3, kSleepFraction = 0.01;
static constexpr double kModelSpinS = 100e-6;

// Tells the core this is a spin-wait loop (saves power, frees the pipeline for a sibling
// hyperthread); one instruction, no system call.
static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The pauses of one wait, and its deadline.
class Backoff {
 public:
  explicit Backoff(double timeout_s) : timeout_s_(timeout_s), start_s_(link_now_s()) {}
  // Called after a poll that found nothing new done; false once the deadline has passed.
  // due_s: the earliest modelled completion among the wait's requests MPI has completed
  // (infinity: none); mpi_pending: whether MPI still has some of them pending.
  bool pause(double due_s = kNever, bool mpi_pending = true) {
    nccl::progress_emulated();  // a GPU's streams run whatever this wait is for; sim's move here
    const double now = link_now_s(), waited = now - start_s_;
    if (waited > timeout_s_) return false;
    const double to_due = due_s - now, to_deadline = timeout_s_ - waited;
    if (!mpi_pending) {  // only the model's clock to wait for
      if (to_due > kModelSpinS)
        sleep(std::min(to_due - kModelSpinS, to_deadline + kMinSleepS));
      else if (g_wait.spin)
        cpu_relax();
      else
        std::this_thread::yield();
    } else if (g_wait.spin && waited < kSpinS) {
      cpu_relax();
    } else if (!g_wait.spin && polls_++ < kQuickPolls) {
      std::this_thread::yield();
    } else {
      sleep(std::min({kMaxSleepS, std::max(kMinSleepS, kSleepFraction * waited), std::max(0.0, to_due)}));
    }
    return true;
  }
  double waited() const { return link_now_s() - start_s_; }
  static constexpr double kNever = 1e300;

 private:
  static void sleep(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }
  double timeout_s_;
  double start_s_;
  int polls_ = 0;
};

// r's peer and tag as the watchdog names them. Collectives carry peer -1 and no tag; a
// receive may name a wildcard.
static void name_peer_and_tag(const Request& r, char (&peer)[32], char (&tag)[32]) {
  if (r.is_recv && r.peer == MPI_ANY_SOURCE) std::snprintf(peer, sizeof peer, "any");
  else if (r.peer < 0) std::snprintf(peer, sizeof peer, "all");
  else std::snprintf(peer, sizeof peer, "%d", r.peer);
  if (r.is_recv && r.tag == MPI_ANY_TAG) std::snprintf(tag, sizeof tag, "any");
  else if (r.peer < 0 && !r.is_recv) std::snprintf(tag, sizeof tag, "-");
  else std::snprintf(tag, sizeof tag, "%d", r.tag);
}

// The watchdog's line, on MPI and on NCCL alike.
void Comm::say_no_progress(const Request& r) const {
  char peer[32], tag[32];
  name_peer_and_tag(r, peer, tag);
  std::fprintf(stderr,
               "error: rank %d: no progress for %g s in %s with peer %s (tag %s, %zu bytes) "
               "— likely deadlock\n",
               rank_, timeout_s_, r.op.c_str(), peer, tag, r.bytes);
  std::fflush(stderr);
}

[[noreturn]] void Comm::report_deadlock(const Request& r) const {
  say_no_progress(r);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// The watchdog's deadline passed while MPI had completed r but the link model still held it:
// no deadlock, a modelled time longer than the timeout.
[[noreturn]] void Comm::report_link_overrun(const Request& r, double waited_s) const {
  char peer[32], tag[32];
  name_peer_and_tag(r, peer, tag);
  std::fprintf(stderr,
               "error: rank %d: %s with peer %s (tag %s, %zu bytes) is modelled to complete %g s "
               "after its wait began, past the timeout of %g s — raise the timeout or the "
               "modelled bandwidth\n",
               rank_, r.op.c_str(), peer, tag, r.bytes, waited_s + (r.link_done_s - link_now_s()),
               timeout_s_);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// A receive must get exactly the bytes it asked for: MPI accepts shorter messages, which
// would leave the tail of the buffer stale without anyone noticing.
static void check_received(const Request& r, const MPI_Status& status, int rank) {
  if (!r.is_recv || status.MPI_SOURCE == MPI_PROC_NULL) return;
  int got = 0;
  mpiCheck(MPI_Get_count(&status, MPI_BYTE, &got));
  FF_CHECK((size_t)got == r.bytes, r.op << " on rank " << rank << " from rank " << status.MPI_SOURCE
                                        << " (tag " << status.MPI_TAG << "): expected " << r.bytes
                                        << " bytes, got " << got);
}

MPI_Status Comm::wait_one(Request& r) {
  MPI_Status status;
  std::memset(&status, 0, sizeof status);
  status.MPI_SOURCE = MPI_PROC_NULL;
  if (r.nccl) {
    nccl_wait(r);
    return status;
  }
  Backoff backoff(timeout_s_);
  if (r.arrived) {  // Comm::test saw it complete in MPI (and told the model)
    status = r.status;
    r.arrived = false;
  } else {
    if (r.req == MPI_REQUEST_NULL) return status;  // already completed (or never posted)
    for (;;) {
      int done = 0;
      mpiCheck(MPI_Test(&r.req, &done, &status));
      if (done) break;
      if (!backoff.pause()) report_deadlock(r);
    }
    check_received(r, status, rank_);
    link_arrived(r, status);
  }
  while (!link_due(r, link_now_s()))
    if (!backoff.pause(r.link_done_s, /*mpi_pending=*/false)) report_link_overrun(r, backoff.waited());
  return status;
}

// ---- the watchdog on NCCL: the launch's event polled against the same deadline; on expiry the
// same line as for MPI, then ncclCommAbort (so that no kernel of it keeps the GPU busy) and
// MPI_Abort. The line comes first and the abort is bounded: ncclCommAbort can itself block.

// Aborts r's NCCL communicator from a second thread, giving it up to 2 s, then ends the job.
[[noreturn]] static void nccl_abort_and_exit(const Request& r) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<NcclTicket> t = r.nccl;
  std::thread([t, done] {
    NcclComm::abort(t);
    done->store(true);
  }).detach();
  for (int i = 0; i < 200 && !done->load(); i++) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void Comm::report_nccl_failure(const Request& r, const std::string& error) const {
  char peer[32], tag[32];
  name_peer_and_tag(r, peer, tag);
  std::fprintf(stderr, "error: rank %d: NCCL failed in %s with peer %s (%zu bytes): %s\n", rank_,
               r.op.c_str(), peer, r.bytes, error.c_str());
  std::fflush(stderr);
  nccl_abort_and_exit(r);
}

void Comm::report_nccl_stall(const Request& r) const {
  say_no_progress(r);
  nccl_abort_and_exit(r);
}

bool Comm::nccl_test(Request& r) {
  std::string error;
  switch (NcclComm::poll(r.nccl, &error)) {
    case NcclState::done: return true;
    case NcclState::pending: return false;
    case NcclState::stalled: report_nccl_stall(r);
    case NcclState::failed: report_nccl_failure(r, error);
  }
  return false;
}

void Comm::nccl_wait(Request& r) {
  Backoff backoff(timeout_s_);
  while (!nccl_test(r))
    if (!backoff.pause()) report_nccl_stall(r);
  r.nccl.reset();  // retired
}

bool Comm::test(Request& r) {
  if (r.nccl) {
    if (!nccl_test(r)) return false;
    if (r.done_us < 0) r.done_us = now_us();
    return true;  // a wait retires it
  }
  if (r.req != MPI_REQUEST_NULL) {
    int done = 0;
    MPI_Status status;
    std::memset(&status, 0, sizeof status);
    mpiCheck(MPI_Test(&r.req, &done, &status));
    if (!done) return false;
    check_received(r, status, rank_);
    link_arrived(r, status);
    r.arrived = true;
    r.status = status;
  } else if (!r.arrived) {
    return true;  // retired by a wait already (or never posted)
  }
  if (!link_due(r, link_now_s())) return false;
  if (r.done_us < 0) r.done_us = now_us();
  return true;
}

bool Comm::test_all(std::vector<Request>& rs) {
  bool all = true;
  for (Request& r : rs) all = test(r) && all;  // test every one: each poll may move data
  return all;
}

// ----------------------------------------------------------------------------
// trace records (see comm.h): blocking calls are spans, requests are flights plus the span
// of the wait that sat blocked on them

// r as a trace record [start, end): peer and tag as the completed status says for a receive
// that named a wildcard; peer "all" and no tag for a collective (peer -1, not a receive).
static Span comm_record(const std::string& name, const Request& r, const MPI_Status* status,
                        double start, double end, SpanKind kind) {
  Span s;
  s.name = name;
  s.stream = "comm";
  s.start_us = start;
  s.end_us = end;
  s.bytes = (int64_t)r.bytes;
  s.kind = kind;
  if (!r.is_recv && r.peer == -1) {
    s.peer = Span::kAllRanks;
    return s;
  }
  const bool got = r.is_recv && status && status->MPI_SOURCE != MPI_PROC_NULL;
  s.peer = got && r.peer == MPI_ANY_SOURCE ? status->MPI_SOURCE : r.peer;
  s.tag = got && r.tag == MPI_ANY_TAG ? status->MPI_TAG : r.tag;
  return s;
}

// A blocking call: one span, from its post to its return.
static void record_blocking(const Request& r, const MPI_Status& status) {
  if (trace().enabled()) trace().add(comm_record(r.op, r, &status, r.start_us, now_us(), SpanKind::span));
}

// A flight ends where it was first seen done (by test() or by this wait).
static double flight_end(const Request& r, double now) { return r.done_us >= 0 ? r.done_us : now; }

void Comm::wait(Request& r) {
  if (r.req == MPI_REQUEST_NULL && !r.arrived && !r.nccl) return;
  const double entered = trace().enabled() ? now_us() : 0.0;
  MPI_Status status = wait_one(r);
  if (!trace().enabled()) return;
  const double done = now_us();
  trace().add(comm_record(r.op, r, &status, r.start_us, flight_end(r, done), SpanKind::flight));
  trace().add(comm_record("wait " + r.op, r, &status, entered, done, SpanKind::span));
}

void Comm::wait_all(std::vector<Request>& rs) {
  // Requests on NCCL: one at a time, after those on MPI (which move only while this rank is
  // in MPI calls; NCCL's move on the GPU whatever this rank does).
  if (std::any_of(rs.begin(), rs.end(), [](const Request& r) { return r.nccl != nullptr; })) {
    for (Request& r : rs)  // launched first: a peer may need them before it answers on MPI
      if (r.nccl) NcclComm::launch(r.nccl);
    for (int pass = 0; pass < 2; pass++)
      for (Request& r : rs)
        if ((r.nccl != nullptr) == (pass == 1)) wait(r);
    return;
  }
  std::vector<MPI_Request> handles;  // the pending requests, for MPI_Testsome
  std::vector<size_t> where;         // handles[i] is rs[where[i]].req
  // Completed in MPI, not yet in the link model: (index in rs, its status). Requests test()
  // saw complete start here.
  std::vector<std::pair<size_t, MPI_Status>> held;
  std::vector<size_t> mine;          // every request this wait retires, in rs's order
  for (size_t i = 0; i < rs.size(); i++) {
    if (rs[i].req != MPI_REQUEST_NULL) {
      handles.push_back(rs[i].req);
      where.push_back(i);
    } else if (rs[i].arrived) {
      held.emplace_back(i, rs[i].status);
      rs[i].arrived = false;
    } else {
      continue;
    }
    mine.push_back(i);
  }
  if (mine.empty()) return;
  const bool tracing = trace().enabled();
  const double entered = tracing ? now_us() : 0.0;
  const int n = (int)handles.size();
  std::vector<int> indices((size_t)n);
  std::vector<MPI_Status> statuses((size_t)n);
  Backoff backoff(timeout_s_);
  for (int left = n; left > 0 || !held.empty();) {
    int count = 0;
    if (left > 0) {
      mpiCheck(MPI_Testsome(n, handles.data(), &count, indices.data(), statuses.data()));
      if (count == MPI_UNDEFINED) count = 0, left = 0;  // (cannot happen while some are pending)
    }
    for (int k = 0; k < count; k++) rs[where[indices[k]]].req = MPI_REQUEST_NULL;
    for (int k = 0; k < count; k++) {
      Request& r = rs[where[indices[k]]];
      check_received(r, statuses[k], rank_);
      link_arrived(r, statuses[k]);
      held.emplace_back(where[indices[k]], statuses[k]);
    }
    left -= count;
    // Each flight ends when its wait sees it done in MPI and in the model.
    const double now_s = link_now_s(), done = tracing ? now_us() : 0.0;
    size_t kept = 0;
    for (auto& h : held) {
      const Request& r = rs[h.first];
      if (!link_due(r, now_s)) {
        held[kept++] = h;
      } else if (tracing) {
        trace().add(comm_record(r.op, r, &h.second, r.start_us, flight_end(r, done), SpanKind::flight));
      }
    }
    const bool finished_some = kept < held.size();
    held.resize(kept);
    if (count > 0 || finished_some) continue;
    double due = Backoff::kNever;  // the earliest modelled completion of those held
    for (const auto& h : held) due = std::min(due, rs[h.first].link_done_s);
    if (backoff.pause(due, left > 0)) continue;
    for (int i = 0; i < n; i++)  // the first one, in the caller's order, still pending in MPI
      if (handles[(size_t)i] != MPI_REQUEST_NULL) report_deadlock(rs[where[(size_t)i]]);
    report_link_overrun(rs[held.front().first], backoff.waited());
  }
  if (!tracing) return;
  // The blocked time, one span: bytes of all the requests; peer and tag where they agree.
  Span s;
  s.name = op_name("wait_all");
  s.stream = "comm";
  s.start_us = entered;
  s.end_us = now_us();
  s.peer = rs[mine[0]].peer;
  s.tag = rs[mine[0]].tag;
  for (size_t i : mine) {
    const Request& r = rs[i];
    s.bytes += (int64_t)r.bytes;
    if (r.peer != s.peer || r.peer < 0) s.peer = Span::kNoPeer;
    if (r.tag != s.tag || r.tag < 0) s.tag = Span::kNoTag;
  }
  trace().add(std::move(s));
}

// ----------------------------------------------------------------------------
// point-to-point

// A send on NCCL: to a rank of this communicator (no MPI_PROC_NULL), of a size MPI could send too.
std::shared_ptr<NcclTicket> Comm::nccl_send(const void* buf, size_t bytes, int peer, const char* op) {
  FF_CHECK(peer >= 0 && peer < size_, op << " on NCCL: peer " << peer << " is not a rank of this communicator of " << size_);
  to_count(bytes, op);
  return nccl_->send(buf, bytes, peer);
}

Request Comm::isend(const void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, op_name("isend"), peer, tag, bytes, now_us()};
  if (to_nccl(buf)) r.nccl = nccl_send(buf, bytes, peer, "isend");  // queued; tags play no part
  else mpiCheck(MPI_Isend(buf, to_count(bytes, "isend"), MPI_BYTE, peer, tag, comm_, &r.req));
  link_posted(r);
  return r;
}

Request Comm::issend(const void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, op_name("issend"), peer, tag, bytes, now_us()};
  if (to_nccl(buf)) r.nccl = nccl_send(buf, bytes, peer, "issend");  // NCCL has no synchronous mode
  else mpiCheck(MPI_Issend(buf, to_count(bytes, "issend"), MPI_BYTE, peer, tag, comm_, &r.req));
  link_posted(r);
  return r;
}

Request Comm::irecv(void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, op_name("irecv"), peer, tag, bytes, now_us(), /*is_recv=*/true};
  if (to_nccl(buf)) {
    FF_CHECK(peer >= 0 && peer < size_, "irecv on NCCL: peer " << peer << " is not a rank of this communicator of "
                                                               << size_ << " (no wildcard on NCCL)");
    to_count(bytes, "irecv");
    r.nccl = nccl_->recv(buf, bytes, peer);
    return r;
  }
  mpiCheck(MPI_Irecv(buf, to_count(bytes, "irecv"), MPI_BYTE, peer, tag, comm_, &r.req));
  // Modelled unless to itself (or from nobody); a wildcard source is looked at on arrival.
  r.modelled = g_link.model.enabled && peer != rank_ && peer != MPI_PROC_NULL;
  return r;
}

void Comm::send(const void* buf, size_t bytes, int peer, int tag) {
  Request r = isend(buf, bytes, peer, tag);
  r.op = op_name("send");
  record_blocking(r, wait_one(r));
}

void Comm::ssend(const void* buf, size_t bytes, int peer, int tag) {
  Request r = issend(buf, bytes, peer, tag);
  r.op = op_name("ssend");
  record_blocking(r, wait_one(r));
}

void Comm::recv(void* buf, size_t bytes, int peer, int tag) {
  Request r = irecv(buf, bytes, peer, tag);
  r.op = op_name("recv");
  record_blocking(r, wait_one(r));
}

// The receive is posted first, so sendrecv with oneself (dest == src == rank) works.
// One span, "sendrecv", counting the bytes sent and received; its peer is the destination,
// its tag the send's, and `from` the source.
void Comm::sendrecv(const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf, size_t rbytes,
                    int src, int rtag) {
  Request rr = irecv(rbuf, rbytes, src, rtag);
  Request sr = isend(sbuf, sbytes, dest, stag);
  rr.op = sr.op = op_name("sendrecv");
  MPI_Status got = wait_one(rr);  // named after the receive while it is the one missing...
  wait_one(sr);                   // ...then after the send
  if (!trace().enabled()) return;
  Span s = comm_record(op_name("sendrecv"), sr, nullptr, rr.start_us, now_us(), SpanKind::span);
  s.bytes = (int64_t)(sbytes + rbytes);
  s.from = src == MPI_ANY_SOURCE && got.MPI_SOURCE != MPI_PROC_NULL ? got.MPI_SOURCE : src;
  trace().add(std::move(s));
}

// ----------------------------------------------------------------------------
// collectives: post, then the same watched wait, with peer "all"

std::string Comm::op_name(const char* op) const {
  return label_.empty() ? std::string(op) : label_ + " " + op;
}

Request Comm::collective(const char* op, size_t bytes) {
  CollectiveCount& c = (*counts_)[op];
  c.calls++;
  c.bytes += bytes;
  return Request{MPI_REQUEST_NULL, op_name(op), -1, -1, bytes, now_us()};
}

// The NCCL type and operation of an MPI all-reduce; false for what NCCL does not have (a
// user-defined MPI_Op, a derived datatype).
static bool nccl_reduction(MPI_Datatype type, MPI_Op op, NcclComm::Type* t, NcclComm::Op* o) {
  if (type == MPI_FLOAT) *t = NcclComm::Type::f32;
  else if (type == MPI_DOUBLE) *t = NcclComm::Type::f64;
  else if (type == MPI_INT) *t = NcclComm::Type::i32;
  else if (type == MPI_INT64_T || type == MPI_LONG_LONG) *t = NcclComm::Type::i64;
  else return false;
  if (op == MPI_SUM) *o = NcclComm::Op::sum;
  else if (op == MPI_PROD) *o = NcclComm::Op::prod;
  else if (op == MPI_MAX) *o = NcclComm::Op::max;
  else if (op == MPI_MIN) *o = NcclComm::Op::min;
  else return false;
  return true;
}

void Comm::allreduce(void* buf, int count, MPI_Datatype type, MPI_Op op) {
  int type_size = 0;
  mpiCheck(MPI_Type_size(type, &type_size));
  Request r = collective("allreduce", (size_t)count * (size_t)type_size);
  NcclComm::Type nt;
  NcclComm::Op no;
  const bool on_device = to_nccl(buf);
  FF_CHECK(!on_device || nccl_reduction(type, op, &nt, &no),
           "allreduce: a device buffer with a datatype or operation NCCL does not have (a user-defined "
           "MPI_Op, MINLOC, a derived type): copy it to the host first");
  if (on_device) r.nccl = nccl_->allreduce(buf, (size_t)count, nt, no);
  else mpiCheck(MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, op, comm_, &r.req));
  record_blocking(r, wait_one(r));  // one span, as a blocking point-to-point call
}

void Comm::allreduce_sum(float* buf, size_t n) {
  FF_CHECK(n <= (size_t)INT_MAX, "allreduce_sum: " << n << " floats is more than MPI's int count allows");
  allreduce(buf, (int)n, MPI_FLOAT, MPI_SUM);
}

void Comm::allgather(const void* send, size_t bytes, void* recv) {
  int n = to_count(bytes, "allgather");
  to_count(bytes * (size_t)size_, "allgather");
  Request r = collective("allgather", bytes * (size_t)size_);
  // Our own block already in place in recv: MPI forbids the aliasing, MPI_IN_PLACE says it.
  const void* s = send == static_cast<char*>(recv) + (size_t)rank_ * bytes ? MPI_IN_PLACE : send;
  if (to_nccl(send, recv)) r.nccl = nccl_->allgather(send, bytes, recv);
  else mpiCheck(MPI_Iallgather(s, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r.req));
  record_blocking(r, wait_one(r));
}

void Comm::allgatherv(const void* send, size_t bytes, void* recv,
                      const std::vector<size_t>& recv_bytes) {
  FF_CHECK(recv_bytes.size() == (size_t)size_,
           "allgatherv: " << recv_bytes.size() << " receive sizes for " << size_ << " ranks");
  FF_CHECK(recv_bytes[rank_] == bytes, "allgatherv: rank " << rank_ << " sends " << bytes
                                                           << " bytes but recv_bytes[" << rank_
                                                           << "] is " << recv_bytes[rank_]);
  std::vector<int> counts, displs;
  counts_and_displs(recv_bytes, "allgatherv", &counts, &displs);
  Request r = collective("allgatherv", std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0}));
  const void* s = send == static_cast<char*>(recv) + displs[rank_] ? MPI_IN_PLACE : send;
  if (to_nccl(send, recv)) r.nccl = nccl_->allgatherv(send, bytes, recv, recv_bytes);
  else mpiCheck(MPI_Iallgatherv(s, counts[rank_], MPI_BYTE, recv, counts.data(), displs.data(), MPI_BYTE,
                           comm_, &r.req));
  record_blocking(r, wait_one(r));
}

void Comm::reduce_scatter_sum(const float* send, float* recv, const std::vector<int>& counts) {
  FF_CHECK(counts.size() == (size_t)size_,
           "reduce_scatter_sum: " << counts.size() << " counts for " << size_ << " ranks");
  size_t total = 0;
  for (int c : counts) {
    FF_CHECK(c >= 0, "reduce_scatter_sum: negative count " << c);
    total += (size_t)c;
  }
  to_count(total * sizeof(float), "reduce_scatter");
  Request r = collective("reduce_scatter", total * sizeof(float));
  if (to_nccl(send, recv)) r.nccl = nccl_->reduce_scatter_sum(send, recv, counts);
  else mpiCheck(MPI_Ireduce_scatter(send, recv, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &r.req));
  record_blocking(r, wait_one(r));
}

void Comm::bcast(void* buf, size_t bytes, int root) {
  Request r = collective("bcast", bytes);
  to_count(bytes, "bcast");
  if (to_nccl(buf)) r.nccl = nccl_->bcast(buf, bytes, root);
  else mpiCheck(MPI_Ibcast(buf, to_count(bytes, "bcast"), MPI_BYTE, root, comm_, &r.req));
  record_blocking(r, wait_one(r));
}

void Comm::barrier() {
  Request r = collective("barrier", 0);
  mpiCheck(MPI_Ibarrier(comm_, &r.req));
  record_blocking(r, wait_one(r));
}

void Comm::alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                     const std::vector<size_t>& recv_bytes) {
  FF_CHECK(send_bytes.size() == (size_t)size_ && recv_bytes.size() == (size_t)size_,
           "alltoallv: " << send_bytes.size() << " send and " << recv_bytes.size()
                         << " receive sizes for " << size_ << " ranks");
  std::vector<int> scounts, sdispls, rcounts, rdispls;
  counts_and_displs(send_bytes, "alltoallv", &scounts, &sdispls);
  counts_and_displs(recv_bytes, "alltoallv", &rcounts, &rdispls);
  size_t sent = std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0});
  size_t received = std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0});
  Request r = collective("alltoallv", sent + received);
  if (to_nccl(send, recv)) r.nccl = nccl_->alltoallv(send, send_bytes, recv, recv_bytes);
  else mpiCheck(MPI_Ialltoallv(send, scounts.data(), sdispls.data(), MPI_BYTE, recv, rcounts.data(),
                          rdispls.data(), MPI_BYTE, comm_, &r.req));
  record_blocking(r, wait_one(r));
}

// ----------------------------------------------------------------------------
// tensors: cpu storage is used in place, and cuda storage on NCCL; the rest is staged through
// the host

bool Comm::in_place(const Tensor& t) const {
  return t.device() == Device::cpu || (nccl_ && t.device() == nccl_->device());
}

void Comm::send(const Tensor& t, int peer, int tag) {
  if (in_place(t)) return send(t.raw(), t.nbytes(), peer, tag);
  Tensor host = t.to(Device::cpu);
  send(host.raw(), host.nbytes(), peer, tag);
}

void Comm::ssend(const Tensor& t, int peer, int tag) {
  if (in_place(t)) return ssend(t.raw(), t.nbytes(), peer, tag);
  Tensor host = t.to(Device::cpu);
  ssend(host.raw(), host.nbytes(), peer, tag);
}

void Comm::recv(Tensor& t, int peer, int tag) {
  FF_CHECK(t.defined(), "recv: the tensor must be allocated with the expected shape first");
  if (in_place(t)) return recv(t.raw(), t.nbytes(), peer, tag);
  Tensor host = Tensor::empty(t.shape(), Device::cpu, t.dtype());
  recv(host.raw(), host.nbytes(), peer, tag);
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

static void check_f32(const Tensor& t, const char* op) {
  FF_CHECK(t.defined() && t.dtype() == DType::f32,
           op << ": needs a float32 tensor, got " << (t.defined() ? dtype_name(t.dtype()) : "an undefined tensor"));
}

void Comm::allreduce_sum(Tensor& t) {
  check_f32(t, "allreduce_sum");
  if (in_place(t)) return allreduce_sum(t.data(), (size_t)t.numel());
  Tensor host = t.to(Device::cpu);
  allreduce_sum(host.data(), (size_t)host.numel());
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

void Comm::bcast(Tensor& t, int root) {
  FF_CHECK(t.defined(), "bcast: the tensor must be allocated with the expected shape first");
  if (in_place(t)) return bcast(t.raw(), t.nbytes(), root);
  Tensor host = t.to(Device::cpu);
  bcast(host.raw(), host.nbytes(), root);
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

void Comm::allgather(const Tensor& mine, Tensor& all) {
  FF_CHECK(mine.defined() && all.defined() && all.dtype() == mine.dtype() &&
               all.nbytes() == mine.nbytes() * (size_t)size_ && all.device() == mine.device(),
           "allgather: `all` must be allocated with " << size_ << " times the elements of `mine`, "
                                                      "same dtype and device");
  if (in_place(mine)) return allgather(mine.raw(), mine.nbytes(), all.raw());
  Tensor h_mine = mine.to(Device::cpu), h_all = Tensor::empty(all.shape(), Device::cpu, all.dtype());
  allgather(h_mine.raw(), h_mine.nbytes(), h_all.raw());
  device_memcpy(all.raw(), all.device(), h_all.raw(), Device::cpu, h_all.nbytes());
}

void Comm::reduce_scatter_sum(const Tensor& all, Tensor& mine) {
  check_f32(all, "reduce_scatter_sum");
  check_f32(mine, "reduce_scatter_sum");
  FF_CHECK(all.numel() == mine.numel() * size_ && all.device() == mine.device(),
           "reduce_scatter_sum: `all` must have " << size_ << " times the elements of `mine`, on its device");
  FF_CHECK(mine.numel() <= INT_MAX, "reduce_scatter_sum: " << mine.numel() << " floats per rank is more than MPI's int count allows");
  const std::vector<int> counts((size_t)size_, (int)mine.numel());
  if (in_place(all)) return reduce_scatter_sum(all.data(), mine.data(), counts);
  Tensor h_all = all.to(Device::cpu), h_mine = Tensor::empty(mine.shape(), Device::cpu);
  reduce_scatter_sum(h_all.data(), h_mine.data(), counts);
  device_memcpy(mine.raw(), mine.device(), h_mine.raw(), Device::cpu, h_mine.nbytes());
}

}  // namespace ff
