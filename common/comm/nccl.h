// common/comm/nccl.h — the NCCL backend of Comm: collectives and point-to-point messages on
// device buffers, one rank per GPU; and on device sim, the same semantics emulated over MPI.
//
// Design rules:
//  * Comm keeps one interface. A Comm with NCCL enabled (Comm::enable_nccl, the lessons'
//    --backend nccl) hands a call to NCCL when its buffers are device memory (a cuda tensor's
//    storage, cudaPointerGetAttributes says so) and NCCL can do it; host buffers, and what NCCL
//    has no operation for (a user-defined MPI_Op, a derived datatype), go to MPI as before.
//    So a lesson's small host-side numbers (losses, timings, routing counts) stay on MPI, and
//    its tensors' gradients and activations go GPU to GPU.
//  * Setup as llm.c and PyTorch do it: rank 0 of the MPI communicator makes the ncclUniqueId,
//    MPI_Bcast hands it to the others, each calls ncclCommInitRankConfig. Comm::split makes the
//    matching NCCL communicator with ncclCommSplit (NCCL >= 2.18), else with a new id per group.
//  * Every operation is a list of NCCL's primitives (all-reduce, all-gather, reduce-scatter,
//    broadcast, reduce, send, recv) launched as one group on the communicator's stream; an
//    engine runs them: NCCL itself on cuda, or the emulation on sim (below).
//  * Every NCCL communicator is non-blocking (ncclConfig_t.blocking = 0) and has its own CUDA
//    stream (cudaStreamNonBlocking), made to wait, before each launch, for what the legacy
//    default stream (the kernels and copies) has queued: an operation starts after the kernels
//    that wrote its buffers, and a wait returns once it has finished (a CUDA event recorded
//    after it). Every request is waited before its buffers are used again, as on MPI.
//  * Nothing here blocks without a deadline. Setup and each ncclGroupEnd are settled by polling
//    ncclCommGetAsyncError; completion by polling cudaEventQuery (and ncclCommGetAsyncError,
//    for a peer's failure). Comm's watchdog does the polling, with its timeout: on expiry it
//    prints the same line as for MPI,
//      error: rank R: no progress for T s in <op> with peer P (tag G, N bytes) — likely deadlock
//    then calls ncclCommAbort and MPI_Abort — what PyTorch's NCCL watchdog does.
//  * Point-to-point: NCCL matches messages between two ranks in the order they were posted and
//    has no tags, and does not check sizes (a receive must name the sent size, or the watchdog
//    reports it). isend/irecv are queued and launched together, in one ncclGroupStart/End, when
//    a wait or test first needs one of them (or a collective, a split or a wait_all comes), so a
//    ring's receive and send posted one after the other cannot wait on each other on the
//    stream. A blocking send waits for its own message only; NCCL has no synchronous mode
//    (issend and ssend are isend and send).
//  * Device sim (the SIMT emulator's memory, no GPU) gets the same backend with an emulated
//    engine, in every build: each communicator is an MPI communicator of its own (MPI_Comm_dup,
//    split as NCCL splits) and a stream, a queue of launches run one after another: a launch
//    starts (copies its inputs out of device memory, posts its primitives as non-blocking MPI
//    calls) only once the one before it has finished, and finishes when they all have (then
//    copies its outputs in). Streams move at every poll and at every pause of Comm's waits
//    (nccl::progress_emulated), as a GPU runs them whatever its host waits for. So what the
//    stream order does on a GPU — a send that sits behind a collective its peer cannot reach, a
//    receive posted alone before a send — deadlocks on sim too, and the watchdog reports it;
//    and a receive of the wrong size, which NCCL does not check, is an error there. It checks
//    Comm's NCCL path without a GPU; NCCL's own algorithms, speed and connection setup it does
//    not model.
//  * Without NCCL in the build the real engine is absent (create() throws): the lessons refuse
//    --backend nccl on cuda before that (one `error:` line, exit 2).
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/device.h"

namespace ff {

enum class Backend { mpi, nccl };
const char* backend_name(Backend b);  // "mpi", "nccl"

namespace nccl {
// Whether this build has NCCL (nccl.h and libnccl found next to the CUDA toolkit, or NCCL_HOME).
bool built();
// The NCCL library's version at run time ("2.28.9"); "" without NCCL.
std::string version();
// Groups this process has launched on NCCL or its emulation (each operation is one).
int64_t launches();
// Moves the emulated streams (sim) of this process: Comm's waits call it at every pause, as a
// GPU runs its streams whatever the host is waiting for. Nothing without emulated streams.
void progress_emulated();
}  // namespace nccl

// The rule of --backend mpi|nccl|auto, as a pure function: auto is nccl when the tensors are on
// cuda, the build has NCCL and every rank has a GPU of its own (gpu_per_rank: no node has more
// ranks than GPUs; NCCL refuses two ranks on one GPU), else mpi; nccl needs all three on cuda,
// and nothing on sim (the emulation). Returns "" and sets *out, or the one sentence a lesson
// prints as its `error:` line.
std::string resolve_backend(const std::string& flag, Device device, bool nccl_built, bool gpu_per_rank,
                            Backend* out);

// What a wait sees of enqueued NCCL work: stalled is a launch that did not settle within the
// timeout (the watchdog's deadlock line), failed an NCCL or CUDA error.
enum class NcclState { pending, done, failed, stalled };

// Completion of work launched on an NcclComm's stream (on cuda a CUDA event), or of a queued
// point-to-point message once it is launched.
struct NcclTicket;
// How a communicator runs its launches (nccl.cpp): NCCL itself, or the emulation on sim.
struct NcclEngine;

// One NCCL communicator, its stream, and the point-to-point messages queued on it.
class NcclComm {
 public:
  // u8: untyped bytes; bf16: summed as ncclBfloat16 (each pair widened, added, rounded to bf16)
  enum class Type { f32, f64, i32, i64, u8, bf16 };
  enum class Op { sum, prod, max, min };
  using Ticket = std::shared_ptr<NcclTicket>;
  struct Prim;  // one of NCCL's primitives, as a group holds it (nccl.cpp)

  // Setup on cuda, as llm.c does it: rank 0 makes a unique id (id_bytes() of it), the caller
  // hands it to every rank (Comm::enable_nccl: by its watched MPI broadcast), and every rank
  // of `size` calls create() with it. Settled within timeout_s; throws ff::Error (naming
  // NCCL's error, or the timeout) on failure, and when the build has no NCCL.
  static std::string unique_id();
  static size_t id_bytes();
  static std::shared_ptr<NcclComm> create(const std::string& id, int rank, int size, double timeout_s);
  // Setup on sim: the emulation, over a duplicate of the MPI communicator (collective).
  static std::shared_ptr<NcclComm> emulate(MPI_Comm mpi, double timeout_s);
  // Whether split() works here (ncclCommSplit: NCCL >= 2.18; always, emulated). Without it,
  // Comm::split sets up each group with a new id instead.
  bool can_split() const;
  // Collective over this communicator: every member calls it, in the same order as the MPI
  // split it mirrors; the ranks of one color form the new one, ordered by key. A rank that is
  // not a member (member false) gets null; rank and size are its new ones.
  std::shared_ptr<NcclComm> split(int color, int key, bool member, int rank, int size, double timeout_s);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  int rank() const { return rank_; }
  void set_timeout(double seconds);  // the deadline of launches and setup (Comm::set_timeout)
  int size() const { return size_; }
  Device device() const;  // cuda, or sim (emulated)
  // Whether p is memory this communicator moves: the current GPU's (cuda), the emulator's (sim).
  bool takes(const void* p) const;

  // Collectives, launched at once on the stream (buffers: device memory), after the queued
  // point-to-point messages.
  Ticket allreduce(void* buf, size_t count, Type type, Op op);  // in place
  // recv holds size() blocks of `bytes`; send may be this rank's block of recv (in place).
  Ticket allgather(const void* send, size_t bytes, void* recv);
  // Blocks of different sizes, back to back: grouped sends and receives.
  Ticket allgatherv(const void* send, size_t bytes, void* recv, const std::vector<size_t>& recv_bytes);
  // counts[r] floats of the sum to rank r: ncclReduceScatter when all are equal, else one
  // ncclReduce per block to its rank, grouped.
  Ticket reduce_scatter_sum(const float* send, float* recv, const std::vector<int>& counts);
  Ticket reduce_scatter_sum_bf16(const uint16_t* send, uint16_t* recv, size_t count);  // equal blocks
  Ticket bcast(void* buf, size_t bytes, int root);
  // Grouped ncclSend/ncclRecv, one pair per peer (MPI_Alltoallv's layout, in bytes).
  Ticket alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes);
  // Point-to-point: queued until flush() launches them together: a poll of one of their tickets,
  // a collective or a split on this communicator, or Comm::wait_all.
  Ticket send(const void* buf, size_t bytes, int peer);
  Ticket recv(void* buf, size_t bytes, int peer);
  void flush();

  // The ticket's communicator's queue launched, if the ticket is still in it.
  static void launch(const Ticket& t);
  // One poll (a queued message is launched first, which on cuda settles under the timeout: the
  // first messages between two ranks connect them, and wait for the peer's launch): done,
  // pending, stalled, or failed (an NCCL error, asynchronous or at launch, or a CUDA error:
  // *error says which). A ticket knows its communicator.
  static NcclState poll(const Ticket& t, std::string* error);
  // ncclCommAbort (of the ticket's communicator): the watchdog's way out of a stuck one.
  static void abort(const Ticket& t);
  void abort();

 private:
  NcclComm(std::unique_ptr<NcclEngine> engine, int rank, int size, double timeout_s);
  static std::shared_ptr<NcclComm> adopt(std::unique_ptr<NcclEngine> engine, int rank, int size, double timeout_s);
  Ticket run(const std::vector<Prim>& prims);  // flush, then one group
  std::unique_ptr<NcclEngine> engine_;
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 60;
  std::weak_ptr<NcclComm> self_;
  struct Queued;
  std::vector<Queued> queued_;
};

}  // namespace ff
