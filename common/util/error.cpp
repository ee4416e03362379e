// common/util/error.cpp — the library's errors (error.h).
#include "common/util/error.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace ff {

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg) {
  (void)file;
  (void)line;
  throw Error(msg);
}

void mpi_check(int code, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) std::snprintf(msg, sizeof msg, "code %d", code);
  std::fprintf(stderr, "error: MPI: %s (%s:%d)\n", msg, file, line);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);  // MPI_Abort does not return; keep the compiler and the reader sure of it
}

}  // namespace ff
