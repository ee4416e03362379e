// common/comm/comm.cpp — Comm: every blocking call is its non-blocking twin plus a watched wait.
//
// Comm is written in five files, each saying one thing:
//   comm.cpp         construction (world, split, NCCL), point-to-point messages, tensors
//   collectives.cpp  the collectives (allreduce, allgather, reduce-scatter, ...), posted and
//                    then waited on like a message, with peer "all"
//   watchdog.cpp     the waits: wait_one() (MPI_Test) and wait_all() (MPI_Testsome), paced by
//                    one Backoff against a deadline, so a deadlock (two ranks that both Ssend
//                    first, a collective one rank never enters) ends as one `error:` line
//                    naming rank, operation, peer, tag and bytes, then MPI_Abort; and the
//                    trace's records of them
//   node.cpp         how the waits pace their polls (spin or sleep), decided once in
//                    Comm::world from the node's cores and ranks
//   link.cpp         the link model: with it on (Comm::set_link), a point-to-point request is
//                    done when MPI says so AND its modelled time has come (isend/issend take
//                    their modelled completion at the post, a receive when a wait first sees
//                    it complete in MPI: link_posted, link_arrived)
//
// Self-messages (peer == rank) work through non-blocking pairs: post irecv, then isend,
// then wait both. A *blocking* ssend to self can never be matched (the matching recv is
// only posted after ssend returns): the watchdog reports it like any other deadlock.
#include "common/comm/comm.h"
#include "common/comm/comm_detail.h"

#include "common/comm/nccl.h"

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/core/check.h"
#include "common/core/tensor.h"
#include "common/util/trace.h"

namespace ff {

namespace detail {

// ----------------------------------------------------------------------------
// errors

// MPI counts are int: larger messages are refused (fivefold only moves small ones).
int to_count(size_t bytes, const char* op) {
  FF_CHECK(bytes <= (size_t)INT_MAX, op << ": " << bytes << " bytes is more than MPI's int count ("
                                        << INT_MAX << ") allows");
  return (int)bytes;
}

// Byte counts and back-to-back displacements for the v-collectives.
void counts_and_displs(const std::vector<size_t>& bytes, const char* op,
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

double now_us() { return trace().now_us(); }

}  // namespace detail

using namespace detail;

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
  // The world rank of each member, for the link model's virtual nodes.
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  mpiCheck(MPI_Comm_group(c, &group));
  mpiCheck(MPI_Comm_group(MPI_COMM_WORLD, &world));
  std::vector<int> mine((size_t)size_), theirs((size_t)size_);
  std::iota(mine.begin(), mine.end(), 0);
  mpiCheck(MPI_Group_translate_ranks(group, size_, mine.data(), world, theirs.data()));
  mpiCheck(MPI_Group_free(&group));
  mpiCheck(MPI_Group_free(&world));
  world_ranks_ = std::make_shared<const std::vector<int>>(std::move(theirs));
}

static int g_thread_provided = MPI_THREAD_SINGLE;

Comm Comm::world(int* argc, char*** argv, int thread_level) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int rc = MPI_Init_thread(argc, argv, thread_level, &g_thread_provided);
    if (rc != MPI_SUCCESS) {
      std::fprintf(stderr, "error: MPI_Init failed (code %d)\n", rc);
      std::exit(1);
    }
  }
  if (!wait_policy_decided()) decide_wait_policy();
  return Comm(MPI_COMM_WORLD);
}

int Comm::thread_level_provided() { return g_thread_provided; }

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
  if (nccl_) {
    const bool member = child != MPI_COMM_NULL;
    if (nccl_->can_split())  // every rank of this communicator takes part, members or not
      c.nccl_ = nccl_->split(color, key, member, c.rank_, c.size_, timeout_s_);
    else if (member)
      c.enable_nccl(nccl_->device());
  }
  return c;
}

Comm Comm::duplicate_counted() const {
  Comm c = split(0, rank_);
  c.counts_ = counts_;
  c.label_ = label_;
  return c;
}

void Comm::set_timeout(double seconds) {
  timeout_s_ = seconds;
  if (nccl_) nccl_->set_timeout(seconds);
}

void Comm::enable_nccl(Device device) {
  if (nccl_ || comm_ == MPI_COMM_NULL) return;
  FF_CHECK(device == Device::cuda || device == Device::sim,
           "enable_nccl: NCCL moves cuda buffers (or sim ones, emulated), not " << device_name(device) << " ones");
  if (device == Device::sim) {
    nccl_ = NcclComm::emulate(comm_, timeout_s_);
    return;
  }
  FF_CHECK(nccl::built(), "enable_nccl: this build has no NCCL");
  std::string id = rank_ == 0 ? NcclComm::unique_id() : std::string(NcclComm::id_bytes(), '\0');
  bcast(&id[0], id.size(), 0);  // host bytes: MPI, watched
  nccl_ = NcclComm::create(id, rank_, size_, timeout_s_);
}

bool Comm::to_nccl(const void* a, const void* b) const {
  return nccl_ && nccl_->takes(a) && (!b || nccl_->takes(b));
}

// ----------------------------------------------------------------------------
// point-to-point

// A send on NCCL: to a rank of this communicator (no MPI_PROC_NULL), of a size MPI could send too.
std::shared_ptr<NcclTicket> Comm::nccl_send(const void* buf, size_t bytes, int peer, const char* op) {
  FF_CHECK(peer >= 0 && peer < size_, op << " on NCCL: peer " << peer << " is not a rank of this communicator of " << size_);
  to_count(bytes, op);
  return nccl_->send(buf, bytes, peer);
}

Request Comm::isend(const void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, op_name("isend"), peer, tag, bytes, now_us()};
  if (to_nccl(buf)) r.nccl = nccl_send(buf, bytes, peer, "isend");  // queued; tags play no part
  else mpiCheck(MPI_Isend(buf, to_count(bytes, "isend"), MPI_BYTE, peer, tag, comm_, &r.req));
  link_posted(r);
  return r;
}

Request Comm::issend(const void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, op_name("issend"), peer, tag, bytes, now_us()};
  if (to_nccl(buf)) r.nccl = nccl_send(buf, bytes, peer, "issend");  // NCCL has no synchronous mode
  else mpiCheck(MPI_Issend(buf, to_count(bytes, "issend"), MPI_BYTE, peer, tag, comm_, &r.req));
  link_posted(r);
  return r;
}

Request Comm::irecv(void* buf, size_t bytes, int peer, int tag) {
  Request r{MPI_REQUEST_NULL, op_name("irecv"), peer, tag, bytes, now_us(), /*is_recv=*/true};
  if (to_nccl(buf)) {
    FF_CHECK(peer >= 0 && peer < size_, "irecv on NCCL: peer " << peer << " is not a rank of this communicator of "
                                                               << size_ << " (no wildcard on NCCL)");
    to_count(bytes, "irecv");
    r.nccl = nccl_->recv(buf, bytes, peer);
    return r;
  }
  mpiCheck(MPI_Irecv(buf, to_count(bytes, "irecv"), MPI_BYTE, peer, tag, comm_, &r.req));
  // Modelled unless to itself (or from nobody); a wildcard source is looked at on arrival.
  r.modelled = Comm::link().enabled && peer != rank_ && peer != MPI_PROC_NULL;
  return r;
}

void Comm::send(const void* buf, size_t bytes, int peer, int tag) {
  Request r = isend(buf, bytes, peer, tag);
  r.op = op_name("send");
  record_blocking(r, wait_one(r));
}

void Comm::ssend(const void* buf, size_t bytes, int peer, int tag) {
  Request r = issend(buf, bytes, peer, tag);
  r.op = op_name("ssend");
  record_blocking(r, wait_one(r));
}

void Comm::recv(void* buf, size_t bytes, int peer, int tag) {
  Request r = irecv(buf, bytes, peer, tag);
  r.op = op_name("recv");
  record_blocking(r, wait_one(r));
}

// The receive is posted first, so sendrecv with oneself (dest == src == rank) works.
// One span, "sendrecv", counting the bytes sent and received; its peer is the destination,
// its tag the send's, and `from` the source.
void Comm::sendrecv(const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf, size_t rbytes,
                    int src, int rtag) {
  Request rr = irecv(rbuf, rbytes, src, rtag);
  Request sr = isend(sbuf, sbytes, dest, stag);
  rr.op = sr.op = op_name("sendrecv");
  MPI_Status got = wait_one(rr);  // named after the receive while it is the one missing...
  wait_one(sr);                   // ...then after the send
  if (!trace().enabled()) return;
  Span s = comm_record(op_name("sendrecv"), sr, nullptr, rr.start_us, now_us(), SpanKind::span);
  s.bytes = (int64_t)(sbytes + rbytes);
  s.from = src == MPI_ANY_SOURCE && got.MPI_SOURCE != MPI_PROC_NULL ? got.MPI_SOURCE : src;
  trace().add(std::move(s));
}

// ----------------------------------------------------------------------------
// tensors: cpu storage is used in place, and cuda storage on NCCL; the rest is staged through
// the host

bool Comm::in_place(const Tensor& t) const {
  return t.device() == Device::cpu || (nccl_ && t.device() == nccl_->device());
}

void Comm::send(const Tensor& t, int peer, int tag) {
  if (in_place(t)) return send(t.raw(), t.nbytes(), peer, tag);
  Tensor host = t.to(Device::cpu);
  send(host.raw(), host.nbytes(), peer, tag);
}

void Comm::ssend(const Tensor& t, int peer, int tag) {
  if (in_place(t)) return ssend(t.raw(), t.nbytes(), peer, tag);
  Tensor host = t.to(Device::cpu);
  ssend(host.raw(), host.nbytes(), peer, tag);
}

void Comm::recv(Tensor& t, int peer, int tag) {
  FF_CHECK(t.defined(), "recv: the tensor must be allocated with the expected shape first");
  if (in_place(t)) return recv(t.raw(), t.nbytes(), peer, tag);
  Tensor host = Tensor::empty(t.shape(), Device::cpu, t.dtype());
  recv(host.raw(), host.nbytes(), peer, tag);
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

static void check_f32(const Tensor& t, const char* op) {
  FF_CHECK(t.defined() && t.dtype() == DType::f32,
           op << ": needs a float32 tensor, got " << (t.defined() ? dtype_name(t.dtype()) : "an undefined tensor"));
}

void Comm::allreduce_sum(Tensor& t) {
  if (t.defined() && t.dtype() == DType::bf16) {  // summed as NCCL sums bf16 (allreduce_sum_bf16)
    if (in_place(t)) return allreduce_sum_bf16(t.bf16_data(), (size_t)t.numel());
    Tensor host = t.to(Device::cpu);
    allreduce_sum_bf16(host.bf16_data(), (size_t)host.numel());
    device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
    return;
  }
  check_f32(t, "allreduce_sum");
  if (in_place(t)) return allreduce_sum(t.data(), (size_t)t.numel());
  Tensor host = t.to(Device::cpu);
  allreduce_sum(host.data(), (size_t)host.numel());
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

void Comm::bcast(Tensor& t, int root) {
  FF_CHECK(t.defined(), "bcast: the tensor must be allocated with the expected shape first");
  if (in_place(t)) return bcast(t.raw(), t.nbytes(), root);
  Tensor host = t.to(Device::cpu);
  bcast(host.raw(), host.nbytes(), root);
  device_memcpy(t.raw(), t.device(), host.raw(), Device::cpu, host.nbytes());
}

void Comm::allgather(const Tensor& mine, Tensor& all) {
  FF_CHECK(mine.defined() && all.defined() && all.dtype() == mine.dtype() &&
               all.nbytes() == mine.nbytes() * (size_t)size_ && all.device() == mine.device(),
           "allgather: `all` must be allocated with " << size_ << " times the elements of `mine`, "
                                                      "same dtype and device");
  if (in_place(mine)) return allgather(mine.raw(), mine.nbytes(), all.raw());
  Tensor h_mine = mine.to(Device::cpu), h_all = Tensor::empty(all.shape(), Device::cpu, all.dtype());
  allgather(h_mine.raw(), h_mine.nbytes(), h_all.raw());
  device_memcpy(all.raw(), all.device(), h_all.raw(), Device::cpu, h_all.nbytes());
}

void Comm::reduce_scatter_sum(const Tensor& all, Tensor& mine) {
  check_f32(all, "reduce_scatter_sum");
  check_f32(mine, "reduce_scatter_sum");
  FF_CHECK(all.numel() == mine.numel() * size_ && all.device() == mine.device(),
           "reduce_scatter_sum: `all` must have " << size_ << " times the elements of `mine`, on its device");
  FF_CHECK(mine.numel() <= INT_MAX, "reduce_scatter_sum: " << mine.numel() << " floats per rank is more than MPI's int count allows");
  const std::vector<int> counts((size_t)size_, (int)mine.numel());
  if (in_place(all)) return reduce_scatter_sum(all.data(), mine.data(), counts);
  Tensor h_all = all.to(Device::cpu), h_mine = Tensor::empty(mine.shape(), Device::cpu);
  reduce_scatter_sum(h_all.data(), h_mine.data(), counts);
  device_memcpy(mine.raw(), mine.device(), h_mine.raw(), Device::cpu, h_mine.nbytes());
}

}  // namespace ff
