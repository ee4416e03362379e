// tests/progs/wait_bench.cpp — what a wait costs: small all-to-alls through Comm's watched
// waits, timed against a plain blocking MPI_Alltoallv (MPI's own wait, no watchdog).
//
//   mpirun -np 2 build/tests/wait_bench [BYTES [REPS]]      (defaults: 64 bytes, 2000 reps)
//   FF_WAIT=sleep mpirun -np 2 build/tests/wait_bench         (force a policy: spin|sleep|auto)
//
// Each rep: barrier, then one all-to-all of BYTES per peer block, timed on every rank; the
// rep's time is the slowest rank's. Four implementations, interleaved rep by rep so that a
// burst of outside load hits all of them alike:
//   mpi      MPI_Alltoallv, blocking: the reference the ratios are taken to
//   library  Comm::alltoallv        (MPI_Ialltoallv + one watched wait)
//   async    irecv from every peer, isend to every peer, wait_all (as lesson 04's async)
//   ordered  pairwise rounds of ssend/recv (as lesson 04's ordered): 2(P-1) blocking waits
// Prints min / median / max / mean over the reps of each time, min / median / max of each
// rep's ratio to mpi, and the ratio of the medians.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/check.h"

using namespace ff;

static void a2a_async(Comm& comm, const std::vector<char>& send, std::vector<char>& recv, size_t bytes) {
  const int r = comm.rank(), P = comm.size();
  std::vector<Request> reqs;
  for (int q = 0; q < P; q++)
    if (q != r) reqs.push_back(comm.irecv(recv.data() + (size_t)q * bytes, bytes, q, 3));
  for (int q = 0; q < P; q++)
    if (q != r) reqs.push_back(comm.isend(send.data() + (size_t)q * bytes, bytes, q, 3));
  std::memcpy(recv.data() + (size_t)r * bytes, send.data() + (size_t)r * bytes, bytes);
  comm.wait_all(reqs);
}

// Round s pairs r with (s - r) mod P; the lower rank of a pair sends first.
static void a2a_ordered(Comm& comm, const std::vector<char>& send, std::vector<char>& recv, size_t bytes) {
  const int r = comm.rank(), P = comm.size();
  for (int s = 0; s < P; s++) {
    const int q = ((s - r) % P + P) % P;
    if (q == r) {
      std::memcpy(recv.data() + (size_t)r * bytes, send.data() + (size_t)r * bytes, bytes);
    } else if (r < q) {
      comm.ssend(send.data() + (size_t)q * bytes, bytes, q, 4);
      comm.recv(recv.data() + (size_t)q * bytes, bytes, q, 4);
    } else {
      comm.recv(recv.data() + (size_t)q * bytes, bytes, q, 4);
      comm.ssend(send.data() + (size_t)q * bytes, bytes, q, 4);
    }
  }
}

struct Stats {
  double min, median, max, mean;
};
static Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  return {v.front(), v[v.size() / 2], v.back(), sum / (double)v.size()};
}

int main(int argc, char** argv) {
  Comm comm = Comm::world(&argc, &argv);
  const int rank = comm.rank(), P = comm.size();
  auto number = [&](int i, long lo, long hi) {
    char* end = nullptr;
    long v = std::strtol(argv[i], &end, 10);
    if (*end != '\0' || v < lo || v > hi) {
      if (rank == 0)
        std::fprintf(stderr, "error: wait_bench: argument %d is '%s', want an integer in [%ld, %ld]\n",
                     i, argv[i], lo, hi);
      Comm::exit_all(2);
    }
    return v;
  };
  if (argc > 3) {
    if (rank == 0) std::fprintf(stderr, "error: usage: wait_bench [BYTES [REPS]]\n");
    Comm::exit_all(2);
  }
  const size_t bytes = argc > 1 ? (size_t)number(1, 1, 1 << 20) : 64;
  const long reps = argc > 2 ? number(2, 1, 1000000) : 2000;
  comm.set_timeout(30);

  std::vector<char> send(bytes * (size_t)P, (char)rank), recv(bytes * (size_t)P);
  std::vector<size_t> block((size_t)P, bytes);
  std::vector<int> counts((size_t)P, (int)bytes), displs((size_t)P);
  for (int q = 0; q < P; q++) displs[(size_t)q] = q * (int)bytes;
  const char* names[4] = {"mpi", "library", "async", "ordered"};
  std::vector<double> t[4];
  for (long i = 0; i < reps + 10; i++) {  // the first 10 reps warm up and are not counted
    for (int impl = 0; impl < 4; impl++) {
      comm.barrier();
      const double t0 = MPI_Wtime();
      if (impl == 0)
        mpiCheck(MPI_Alltoallv(send.data(), counts.data(), displs.data(), MPI_BYTE, recv.data(),
                               counts.data(), displs.data(), MPI_BYTE, comm.raw()));
      if (impl == 1) comm.alltoallv(send.data(), block, recv.data(), block);
      if (impl == 2) a2a_async(comm, send, recv, bytes);
      if (impl == 3) a2a_ordered(comm, send, recv, bytes);
      double dt = (MPI_Wtime() - t0) * 1e6;
      comm.allreduce(&dt, 1, MPI_DOUBLE, MPI_MAX);
      if (i >= 10) t[impl].push_back(dt);
    }
    for (int q = 0; q < P; q++)
      FF_CHECK(recv[(size_t)q * bytes] == (char)q && recv[(size_t)q * bytes + bytes - 1] == (char)q,
               "all-to-all moved the wrong bytes");
  }
  if (rank == 0) {
    std::printf("all-to-all of %zu bytes per peer, P=%d, %ld reps (slowest rank each); waits: %s\n",
                bytes, P, reps, Comm::wait_policy().reason.c_str());
    std::printf("  %-8s %9s %9s %9s %9s   %s\n", "", "min us", "median us", "max us", "mean us", "ratio to mpi: per rep min / median / max, of medians");
    for (int impl = 0; impl < 4; impl++) {
      Stats s = stats(t[impl]);
      std::printf("  %-8s %9.1f %9.1f %9.1f %9.1f", names[impl], s.min, s.median, s.max, s.mean);
      if (impl > 0) {
        std::vector<double> ratio;
        for (long i = 0; i < reps; i++) ratio.push_back(t[impl][(size_t)i] / t[0][(size_t)i]);
        Stats q = stats(ratio);
        std::printf("   %.2f / %.2f / %.2f, %.2f", q.min, q.median, q.max, s.median / stats(t[0]).median);
      }
      std::printf("\n");
    }
  }
  Comm::exit_all(0);
}
