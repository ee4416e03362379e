// tests/progs/ssend_deadlock.cpp — a real deadlock, caught by the watchdog.
//
//   mpirun -np 2 build/tests/ssend_deadlock --timeout 3
//
// Both ranks Ssend to each other first. A synchronous send returns only once the matching
// receive has started, and each rank's receive comes after its own send: neither can ever
// return. Expected: within --timeout seconds, a line like
//   error: rank 0: no progress for 3 s in ssend with peer 1 (tag 7, 16 bytes) — likely deadlock
// and a non-zero exit (MPI_Abort). The test runner runs this under `timeout`.
//
//   mpirun -np 2 build/tests/ssend_deadlock --nccl cuda --timeout 3   (two GPUs, a build with NCCL)
//   mpirun -np 2 build/tests/ssend_deadlock --nccl sim --timeout 3    (NCCL emulated, no GPU)
//
// The same on NCCL, with device buffers: both ranks receive first, and NCCL has no synchronous
// send to make the point with. The watchdog polls the launch (its CUDA event on cuda), prints
// the same line and aborts the NCCL communicator (ncclCommAbort):
//   error: rank 0: no progress for 3 s in recv with peer 1 (tag 7, 16 bytes) — likely deadlock
//
//   mpirun -np 2 build/tests/ssend_deadlock --nccl sim --mismatch
//
// No deadlock: rank 0 sends 12 bytes where rank 1 receives 16. NCCL does not check sizes (on a
// GPU this hangs or reads past the message); the emulation does:
//   error: rank 1: NCCL failed in recv with peer 0 (16 bytes): a receive of 16 bytes from rank 0 got a message of 12
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/comm/comm.h"
#include "common/comm/nccl.h"
#include "kernels/device.h"

using namespace ff;

static int peer_of(int rank) { return 1 - rank; }

int main(int argc, char** argv) {
  Comm comm = Comm::world(&argc, &argv);
  const int rank = comm.rank();
  auto usage_error = [&](const std::string& msg) {
    if (rank == 0) std::fprintf(stderr, "error: %s\n", msg.c_str());
    Comm::exit_all(2);
  };

  double timeout_s = 3;
  bool on_nccl = false, mismatch = false;
  Device dev = Device::cuda;
  for (int i = 1; i < argc; i++) {
    if (std::strcmp(argv[i], "--nccl") == 0 && i + 1 < argc) {
      on_nccl = true;
      const std::string d = argv[++i];
      if (d != "cuda" && d != "sim") usage_error("--nccl " + d + ": want cuda or sim");
      dev = d == "sim" ? Device::sim : Device::cuda;
    } else if (std::strcmp(argv[i], "--mismatch") == 0) {
      mismatch = true;
    } else if (std::strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) {
      char* end = nullptr;
      timeout_s = std::strtod(argv[++i], &end);
      if (*end != '\0' || !(timeout_s > 0 && timeout_s <= 3600))
        usage_error(std::string("--timeout ") + argv[i] + ": want seconds in (0, 3600]");
    } else {
      usage_error(std::string("unknown argument '") + argv[i] + "' (usage: ssend_deadlock [--nccl cuda|sim [--mismatch]] [--timeout S], default 3)");
    }
  }
  if (comm.size() != 2)
    usage_error("ssend_deadlock needs exactly 2 ranks (got " + std::to_string(comm.size()) + ")");
  comm.set_timeout(timeout_s);
  if (on_nccl) {
    if (dev == Device::cuda && (!nccl::built() || device_gpu_count() < 2))
      usage_error("--nccl cuda needs a build with NCCL and two GPUs (this one: " +
                  std::string(nccl::built() ? "NCCL " + nccl::version() : "no NCCL") + ", " +
                  std::to_string(device_gpu_count()) + " GPU(s)); --nccl sim emulates it");
    if (dev == Device::cuda) device_select_gpu(rank);  // one machine: rank r takes GPU r
    comm.enable_nccl(dev);
    void* in = device_malloc(dev, 16);
    if (mismatch) {
      if (rank == 0) comm.send(in, 12, 1, /*tag=*/7);
      else comm.recv(in, 16, 0, 7);  // the emulation's error line
      comm.barrier();
      std::printf("rank %d: the sizes were not checked?!\n", rank);
      Comm::exit_all(0);
    }
    if (rank == 0)
      std::printf("both ranks receive from each other on NCCL before sending: the watchdog should "
                  "report it within %g s\n", timeout_s);
    std::fflush(stdout);
    comm.recv(in, 16, peer_of(rank), /*tag=*/7);  // never completes
    std::printf("rank %d: no deadlock?! the receive completed without a send\n", rank);
    Comm::exit_all(0);
  }

  const int peer = peer_of(rank);
  int out[4] = {rank, rank, rank, rank}, in[4] = {0, 0, 0, 0};
  if (rank == 0)
    std::printf("both ranks Ssend to each other before receiving: the watchdog should report it "
                "within %g s\n", timeout_s);
  std::fflush(stdout);
  comm.ssend(out, sizeof out, peer, /*tag=*/7);  // never returns
  comm.recv(in, sizeof in, peer, 7);
  std::printf("rank %d: no deadlock?! the Ssend returned without a matching receive\n", rank);
  Comm::exit_all(0);
}
