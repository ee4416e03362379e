// common/util/error.h — the library's errors.
//
// FF_CHECK(cond, msg) throws ff::Error(msg) — for bad arguments (shapes, indices, devices,
// paths) and broken invariants inside the library; messages are written to be read by a user,
// and lessons catch ff::Error at top level and print one `error:` line.
// mpiCheck(call): an MPI call's return code checked; on an error it prints
// "error: MPI: <MPI_Error_string> (file:line)" and aborts the job.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ff {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);

#define FF_CHECK(cond, msg)                                            \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::ostringstream ff_check_os_;                                 \
      ff_check_os_ << msg;                                             \
      ::ff::throw_error(__FILE__, __LINE__, ff_check_os_.str());       \
    }                                                                  \
  } while (0)

void mpi_check(int code, const char* file, int line);
#define mpiCheck(call) ::ff::mpi_check((call), __FILE__, __LINE__)

}  // namespace ff
