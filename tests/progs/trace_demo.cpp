// tests/progs/trace_demo.cpp — writes a small Chrome trace and CSV from every rank.
//
//   mpirun -np 3 build/tests/trace_demo trace.json trace.csv
//   /usr/bin/python3 scripts/check-trace.py trace.json trace.csv 3
//
// Each rank records what a lesson's trace holds, so that the checker's rules are exercised:
//   * compute spans (Trace::Scope), one of them with comm spans inside it on the comm track;
//   * a ring sendrecv and an allreduce (blocking: one span each, recorded by Comm);
//   * concurrent requests: irecv from both neighbours and isend to both, posted together,
//     compute while they fly, then wait_all — four flights that overlap each other and the
//     compute span, and one "wait_all" span for the time blocked;
//   * one irecv + isend pair waited one by one ("wait irecv", "wait isend" spans) inside a
//     span of the program's own on the comm track;
//   * the end-of-run check inside Trace::Category "check": its allreduce and compute go to
//     the "check" track, away from the algorithm's.
// Then all ranks write the trace together; rank 0 writes the files.
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "common/core/check.h"
#include "common/comm/comm.h"
#include "common/util/trace.h"

using namespace ff;

// Stands in for real work: a few milliseconds, longer on higher ranks so the tracks differ.
static void pretend_work(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

int main(int argc, char** argv) {
  Comm comm = Comm::world(&argc, &argv);
  const int rank = comm.rank(), P = comm.size();
  const int right = (rank + 1) % P, left = (rank + P - 1) % P;
  if (argc != 3) {
    if (rank == 0) std::fprintf(stderr, "error: usage: trace_demo TRACE.json TRACE.csv\n");
    Comm::exit_all(2);
  }
  comm.set_timeout(30);
  try {
    trace().enable(comm.raw());
    const size_t n = 1024, bytes = n * sizeof(float);
    std::vector<float> block(n, (float)rank), from_left(n), from_right(n);
    {
      Trace::Scope span(trace(), "prepare block", "compute");
      pretend_work(2 + rank);
    }
    comm.sendrecv(block.data(), bytes, right, 0, from_left.data(), bytes, left, 0);
    {
      Trace::Scope span(trace(), "fold neighbour", "compute");
      for (size_t i = 0; i < n; i++) block[i] += from_left[i];
      pretend_work(3);
    }
    comm.allreduce_sum(block.data(), n);
    // every element: sum over ranks of (r + left(r)) = 2 * P(P-1)/2
    FF_CHECK(block[0] == (float)(P * (P - 1)), "allreduce gave " << block[0] << ", want " << P * (P - 1));

    // Halo exchange with both neighbours: four requests in flight at once, over compute.
    std::vector<float> to_left(n, (float)(10 * rank + 1)), to_right(n, (float)(10 * rank + 2));
    std::vector<Request> halo;
    halo.push_back(comm.irecv(from_left.data(), bytes, left, 1));
    halo.push_back(comm.irecv(from_right.data(), bytes, right, 2));
    halo.push_back(comm.isend(to_right.data(), bytes, right, 1));
    halo.push_back(comm.isend(to_left.data(), bytes, left, 2));
    {
      Trace::Scope span(trace(), "interior while halos fly", "compute");
      pretend_work(2 + 2 * (rank % 2));
    }
    comm.wait_all(halo);
    FF_CHECK(from_left[0] == (float)(10 * left + 2) && from_right[0] == (float)(10 * right + 1),
             "halo exchange gave " << from_left[0] << " and " << from_right[0]);

    // One pair waited one by one, inside a Scope of the lesson's own on the comm track (as
    // lesson 04's "all-to-all"): Comm's wait spans nest in it.
    {
      Trace::Scope span(trace(), "shift by one", "comm");
      Request rr = comm.irecv(from_left.data(), bytes, left, 3);
      Request sr = comm.isend(block.data(), bytes, right, 3);
      comm.wait(rr);
      comm.wait(sr);
    }

    // The check, on its own track.
    {
      Trace::Category check_scope(trace(), "check");
      Trace::Scope span(trace(), "compare with reference", "compute");
      double err = 0;
      for (size_t i = 0; i < n; i++) err += block[i] == (float)(P * (P - 1)) ? 0.0 : 1.0;
      comm.allreduce(&err, 1, MPI_DOUBLE, MPI_SUM);
      FF_CHECK(err == 0, err << " elements differ");
    }

    trace().write_chrome_json(comm.raw(), argv[1]);
    trace().write_csv(comm.raw(), argv[2]);
    if (rank == 0)
      std::printf("wrote %s and %s (%d ranks, %zu records on rank 0)\n", argv[1], argv[2], P,
                  trace().spans().size());
  } catch (const Error& e) {
    std::fprintf(stderr, "error: rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  Comm::exit_all(0);
}
