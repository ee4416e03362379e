// common/comm/node.cpp — the node a rank runs on: its cores (the cgroup's CPU quota), how many
// ranks share it, and the wait policy (spin or sleep) that follows, decided once in Comm::world.
#include "common/comm/comm.h"
#include "common/comm/comm_detail.h"

#include <fstream>
#include <sstream>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace ff {

using namespace detail;

// ----------------------------------------------------------------------------
// the wait policy: spin or sleep (see WaitPolicy in comm.h), decided once in Comm::world

static WaitPolicy g_wait;  // until Comm::world decides: sleep, safe everywhere
static bool g_wait_decided = false;

const WaitPolicy& Comm::wait_policy() { return g_wait; }
bool detail::wait_policy_decided() { return g_wait_decided; }

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
void detail::decide_wait_policy() {
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


}  // namespace ff
