// tests/progs/trace_demo.cpp — writes a small Chrome trace and CSV from every rank.
//
//   mpirun -np 3 build/tests/trace_demo trace.json trace.csv
//   /usr/bin/python3 scripts/check-trace.py trace.json trace.csv 3
//
// Each rank records two compute spans (Trace::Scope), a ring sendrecv and an allreduce (comm
// spans recorded by Comm), then all ranks write the trace together; rank 0 writes the files.
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "common/core/check.h"
#include "common/comm/comm.h"
#include "common/lesson/trace.h"

using namespace ff;

// Stands in for real work: a few milliseconds, longer on higher ranks so the tracks differ.
static void pretend_work(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

int main(int argc, char** argv) {
  Comm comm = Comm::world(&argc, &argv);
  const int rank = comm.rank(), P = comm.size();
  if (argc != 3) {
    if (rank == 0) std::fprintf(stderr, "error: usage: trace_demo TRACE.json TRACE.csv\n");
    Comm::exit_all(2);
  }
  comm.set_timeout(30);
  try {
    trace().enable(comm);
    std::vector<float> block(1024, (float)rank), from_left(1024);
    {
      Trace::Scope span(trace(), "prepare block", "compute");
      pretend_work(2 + rank);
    }
    comm.sendrecv(block.data(), block.size() * sizeof(float), (rank + 1) % P, 0, from_left.data(),
                  from_left.size() * sizeof(float), (rank + P - 1) % P, 0);
    {
      Trace::Scope span(trace(), "fold neighbour", "compute");
      for (size_t i = 0; i < block.size(); i++) block[i] += from_left[i];
      pretend_work(3);
    }
    comm.allreduce_sum(block.data(), block.size());
    // every element: sum over ranks of (r + left(r)) = 2 * P(P-1)/2
    FF_CHECK(block[0] == (float)(P * (P - 1)), "allreduce gave " << block[0] << ", want " << P * (P - 1));

    trace().write_chrome_json(comm, argv[1]);
    trace().write_csv(comm, argv[2]);
    if (rank == 0)
      std::printf("wrote %s and %s (%d ranks, %zu spans on rank 0)\n", argv[1], argv[2], P,
                  trace().spans().size());
  } catch (const Error& e) {
    std::fprintf(stderr, "error: rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  Comm::exit_all(0);
}
