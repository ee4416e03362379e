// The communication tests: one doctest binary run under mpirun at several world sizes,
//   mpirun -np 3 build/tests/mpi_tests
// Every rank runs every test case (they call collectives, so all ranks must). Each rank's
// doctest report is captured; rank 0 prints its own, then the report of every other rank
// that failed, each line prefixed "rank R| ", and a last line with the verdict of all ranks.
// The exit code is non-zero on every rank when any rank failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, P = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);

  doctest::Context ctx;
  // The report goes through a string (and mpirun's pty), not a terminal: plain text, so
  // a reader of it (tests/test_doctest.py reads --reporters=junit) sees no escapes. --force-colors still works.
  ctx.setOption("no-colors", true);
  ctx.applyCommandLine(argc, argv);
  std::ostringstream report;
  ctx.setCout(&report);
  int failed = ctx.run() != 0 ? 1 : 0;
  if (ctx.shouldExit()) {  // --help, --list-test-cases, ...: rank 0 prints, nothing ran
    if (rank == 0) std::fputs(report.str().c_str(), stdout);
    MPI_Finalize();
    return failed;
  }

  // Bring every rank's report to rank 0 (raw MPI: this must work even if Comm is broken).
  std::string text = report.str();
  int len = (int)text.size();
  std::vector<int> lens(P), flags(P), displs(P);
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Gather(&failed, 1, MPI_INT, flags.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < P; r++) displs[r] = total, total += lens[r];
  std::vector<char> all(rank == 0 ? total : 0);
  MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0,
              MPI_COMM_WORLD);
  int failed_ranks = 0;
  MPI_Allreduce(&failed, &failed_ranks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);

  if (rank == 0) {
    std::fputs(text.c_str(), stdout);
    std::string which;
    for (int r = 1; r < P; r++) {
      if (!flags[r]) continue;
      std::istringstream in(std::string(all.data() + displs[r], lens[r]));
      for (std::string line; std::getline(in, line);) std::printf("rank %d| %s\n", r, line.c_str());
    }
    for (int r = 0; r < P; r++)
      if (flags[r]) which += (which.empty() ? "" : ", ") + std::to_string(r);
    if (failed_ranks == 0)
      std::printf("mpi_tests: all %d rank(s) passed\n", P);
    else
      std::printf("mpi_tests: FAILED on rank(s) %s of %d\n", which.c_str(), P);
    std::fflush(stdout);
  }
  MPI_Finalize();
  return failed_ranks ? 1 : 0;
}
