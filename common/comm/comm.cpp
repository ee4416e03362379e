// common/comm/comm.cpp — Comm: every blocking call is its non-blocking twin plus a watched wait.
//
// The one loop that waits is wait_one(): it polls MPI_Test against a deadline, so a
// deadlock (two ranks that both Ssend first, a collective one rank never enters) ends as
// one `error:` line naming rank, operation, peer, tag and bytes, then MPI_Abort.
//
// Self-messages (peer == rank) work through non-blocking pairs: post irecv, then isend,
// then wait both. A *blocking* ssend to self can never be matched (the matching recv is
// only posted after ssend returns): the watchdog reports it like any other deadlock.
#include "common/comm/comm.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "common/core/check.h"
#include "common/core/tensor.h"
#include "common/lesson/trace.h"

namespace ff {

// ----------------------------------------------------------------------------
// errors

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
}

Comm Comm::world(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int rc = MPI_Init(argc, argv);
    if (rc != MPI_SUCCESS) {
      std::fprintf(stderr, "error: MPI_Init failed (code %d)\n", rc);
      std::exit(1);
    }
  }
  return Comm(MPI_COMM_WORLD);
}

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
  return c;
}

// ----------------------------------------------------------------------------
// the watchdog

// Polling: a few quick polls first (short messages finish in microseconds), then sleep
// between polls. Ranks are oversubscribed (up to 32 on 2 cores): a spinning rank would
// steal the core from the very peer it waits for. The sleep starts at 50 us and grows
// with the time already waited (1% of it, at most 1 ms), so a rank stuck for long costs
// ~1% of a core while a short wait still reacts within ~0.1 ms.
static constexpr int kQuickPolls = 16;
static constexpr double kMinSleepS = 50e-6, kMaxSleepS = 1e-3, kSleepFraction = 0.01;

void Comm::wait_one(Request& r) {
  if (r.req == MPI_REQUEST_NULL) return;  // already completed (or never posted)
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  MPI_Status status;
  for (int poll = 0;; poll++) {
    int done = 0;
    mpiCheck(MPI_Test(&r.req, &done, &status));
    if (done) break;
    if (poll < kQuickPolls) {
      std::this_thread::yield();
      continue;
    }
    double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (waited > timeout_s_) {
      // Collectives carry peer -1 and no tag; a receive may name a wildcard.
      char peer[32], tag[32];
      if (r.is_recv && r.peer == MPI_ANY_SOURCE) std::snprintf(peer, sizeof peer, "any");
      else if (r.peer < 0) std::snprintf(peer, sizeof peer, "all");
      else std::snprintf(peer, sizeof peer, "%d", r.peer);
      if (r.is_recv && r.tag == MPI_ANY_TAG) std::snprintf(tag, sizeof tag, "any");
      else if (r.peer < 0 && !r.is_recv) std::snprintf(tag, sizeof tag, "-");
      else std::snprintf(tag, sizeof tag, "%d", r.tag);
      std::fprintf(stderr,
                   "error: rank %d: no progress for %g s in %s with peer %s (tag %s, %zu bytes) "
                   "— likely deadlock\n",
                   rank_, timeout_s_, r.op.c_str(), peer, tag, r.bytes);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
      std::exit(1);
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(
        std::min(kMaxSleepS, std::max(kMinSleepS, kSleepFraction * waited))));
  }
  // A receive must get exactly the bytes it asked for: MPI accepts shorter messages, which
  // would leave the tail of the buffer stale without anyone noticing.
  if (r.is_recv && status.MPI_SOURCE != MPI_PROC_NULL) {
    int got = 0;
    mpiCheck(MPI_Get_count(&status, MPI_BYTE, &got));
    FF_CHECK((size_t)got == r.bytes, r.op << " on rank " << rank_ << " from rank " << status.MPI_SOURCE
                                          << " (tag " << status.MPI_TAG << "): expected " << r.bytes
                                          << " bytes, got " << got);
  }
}

// Records r's span [post, completion).
static void record(const Request& r, int64_t bytes) {
  if (trace().enabled()) trace().add(r.op, "comm", r.start_us, now_us(), bytes);
}

void Comm::wait(Request& r) {
  if (r.req == MPI_REQUEST_NULL) return;
  wait_one(r);
  record(r, (int64_t)r.bytes);
}

void Comm::wait_all(std::vector<Request>& rs) {
  for (Request& r : rs) wait(r);
}

// ----------------------------------------------------------------------------
// point-to-point

Request Comm::isend(const void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, "isend", peer, tag, bytes, now_us()};
  mpiCheck(MPI_Isend(buf, to_count(bytes, "isend"), MPI_BYTE, peer, tag, comm_, &r.req));
  return r;
}

Request Comm::issend(const void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, "issend", peer, tag, bytes, now_us()};
  mpiCheck(MPI_Issend(buf, to_count(bytes, "issend"), MPI_BYTE, peer, tag, comm_, &r.req));
  return r;
}

Request Comm::irecv(void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, "irecv", peer, tag, bytes, now_us(), /*is_recv=*/true};
  mpiCheck(MPI_Irecv(buf, to_count(bytes, "irecv"), MPI_BYTE, peer, tag, comm_, &r.req));
  return r;
}

void Comm::send(const void* buf, size_t bytes, int peer, int tag) {
  Request r = isend(buf, bytes, peer, tag);
  r.op = "send";
  wait(r);
}

void Comm::ssend(const void* buf, size_t bytes, int peer, int tag) {
  Request r = issend(buf, bytes, peer, tag);
  r.op = "ssend";
  wait(r);
}

void Comm::recv(void* buf, size_t bytes, int peer, int tag) {
  Request r = irecv(buf, bytes, peer, tag);
  r.op = "recv";
  wait(r);
}

// The receive is posted first, so sendrecv with oneself (dest == src == rank) works.
// One span, "sendrecv", counting the bytes sent and received.
void Comm::sendrecv(const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf, size_t rbytes,
                    int src, int rtag) {
  Request rr = irecv(rbuf, rbytes, src, rtag);
  Request sr = isend(sbuf, sbytes, dest, stag);
  rr.op = sr.op = "sendrecv";
  wait_one(rr);  // named after the receive while it is the one missing...
  wait_one(sr);  // ...then after the send
  record(rr, (int64_t)(sbytes + rbytes));
}

// ----------------------------------------------------------------------------
// collectives: post, then the same watched wait, with peer "all"

static Request collective(const char* op, size_t bytes) {
  return Request{MPI_REQUEST_NULL, op, -1, -1, bytes, now_us()};
}

void Comm::allreduce(void* buf, int count, MPI_Datatype type, MPI_Op op) {
  int type_size = 0;
  mpiCheck(MPI_Type_size(type, &type_size));
  Request r = collective("allreduce", (size_t)count * (size_t)type_size);
  mpiCheck(MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, op, comm_, &r.req));
  wait(r);
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
  mpiCheck(MPI_Iallgather(s, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r.req));
  wait(r);
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
  mpiCheck(MPI_Iallgatherv(s, counts[rank_], MPI_BYTE, recv, counts.data(), displs.data(), MPI_BYTE,
                           comm_, &r.req));
  wait(r);
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
  mpiCheck(MPI_Ireduce_scatter(send, recv, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &r.req));
  wait(r);
}

void Comm::bcast(void* buf, size_t bytes, int root) {
  Request r = collective("bcast", bytes);
  mpiCheck(MPI_Ibcast(buf, to_count(bytes, "bcast"), MPI_BYTE, root, comm_, &r.req));
  wait(r);
}

void Comm::barrier() {
  Request r = collective("barrier", 0);
  mpiCheck(MPI_Ibarrier(comm_, &r.req));
  wait(r);
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
  mpiCheck(MPI_Ialltoallv(send, scounts.data(), sdispls.data(), MPI_BYTE, recv, rcounts.data(),
                          rdispls.data(), MPI_BYTE, comm_, &r.req));
  wait(r);
}

// ----------------------------------------------------------------------------
// tensors: cpu storage is used in place; sim/cuda storage is staged through the host

void Comm::send(const Tensor& t, int peer, int tag) {
  if (t.device() == Device::cpu) return send(t.raw(), t.nbytes(), peer, tag);
  Tensor host = t.to(Device::cpu);
  send(host.raw(), host.nbytes(), peer, tag);
}

void Comm::ssend(const Tensor& t, int peer, int tag) {
  if (t.device() == Device::cpu) return ssend(t.raw(), t.nbytes(), peer, tag);
  Tensor host = t.to(Device::cpu);
  ssend(host.raw(), host.nbytes(), peer, tag);
}

void Comm::recv(Tensor& t, int peer, int tag) {
  FF_CHECK(t.defined(), "recv: the tensor must be allocated with the expected shape first");
  if (t.device() == Device::cpu) return recv(t.raw(), t.nbytes(), peer, tag);
  Tensor host = Tensor::empty(t.shape(), Device::cpu, t.dtype());
  recv(host.raw(), host.nbytes(), peer, tag);
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

void Comm::allreduce_sum(Tensor& t) {
  FF_CHECK(t.defined() && t.dtype() == DType::f32,
           "allreduce_sum: needs a float32 tensor, got "
               << (t.defined() ? dtype_name(t.dtype()) : "an undefined tensor"));
  if (t.device() == Device::cpu) return allreduce_sum(t.data(), (size_t)t.numel());
  Tensor host = t.to(Device::cpu);
  allreduce_sum(host.data(), (size_t)host.numel());
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

void Comm::bcast(Tensor& t, int root) {
  FF_CHECK(t.defined(), "bcast: the tensor must be allocated with the expected shape first");
  if (t.device() == Device::cpu) return bcast(t.raw(), t.nbytes(), root);
  Tensor host = t.to(Device::cpu);
  bcast(host.raw(), host.nbytes(), root);
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

}  // namespace ff
