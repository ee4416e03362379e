// common/comm/nccl.cpp — NcclComm: NCCL communicators, their streams and their launches
// (see nccl.h). Comm (comm.cpp) decides what goes here and runs the watchdog over it.
#include "common/comm/nccl.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <thread>

#include "common/core/check.h"

#if FF_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace ff {

const char* backend_name(Backend b) { return b == Backend::nccl ? "nccl" : "mpi"; }

std::string resolve_backend(const std::string& flag, Device device, bool nccl_built, Backend* out) {
  const bool on_cuda = device == Device::cuda;
  if (flag == "mpi" || (flag == "auto" && !(on_cuda && nccl_built))) {
    *out = Backend::mpi;
    return "";
  }
  if (flag == "nccl" || flag == "auto") {
    if (!nccl_built)
      return "--backend nccl: this build has no NCCL (no nccl.h and libnccl next to the CUDA "
             "toolkit or under NCCL_HOME); use --backend mpi";
    if (!on_cuda)
      return std::string("--backend nccl moves device buffers: it needs --device cuda and a GPU, "
                         "and the tensors are on ") +
             device_name(device) + "; use --backend mpi (or auto)";
    *out = Backend::nccl;
    return "";
  }
  return "--backend " + flag + ": expected mpi, nccl or auto";
}

#if FF_HAVE_NCCL

// ncclCheck(call): an NCCL error (other than a non-blocking launch still in progress) as an
// ff::Error "NCCL: <ncclGetErrorString> (file:line)", like cudaCheck and mpiCheck.
static void nccl_check(ncclResult_t rc, const char* file, int line) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  FF_CHECK(false, "NCCL: " << ncclGetErrorString(rc) << " (" << file << ":" << line << ")");
}
#define ncclCheck(call) ::ff::nccl_check((call), __FILE__, __LINE__)

static void cuda_ok(cudaError_t err, const char* file, int line) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  FF_CHECK(false, "CUDA: " << cudaGetErrorString(err) << " (" << file << ":" << line << ")");
}
#define cudaOk(call) ::ff::cuda_ok((call), __FILE__, __LINE__)

bool nccl::built() { return true; }

std::string nccl::version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "";
  // NCCL >= 2.9 codes versions as major * 10000 + minor * 100 + patch
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

bool nccl::is_device_pointer(const void* p) {
  if (!p) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // host memory CUDA never saw: not an error to keep
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

struct NcclTicket {
  std::weak_ptr<NcclComm> owner;  // whose queue launches it, whose state a poll checks
  cudaEvent_t event = nullptr;
  bool launched = false;
  bool stalled = false;     // a launch did not settle within the timeout
  std::string error;        // an NCCL or CUDA error at launch
  ~NcclTicket() {
    if (event) cudaEventDestroy(event);
  }
};

struct NcclComm::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t legacy_done = nullptr;  // recorded on the legacy stream before each launch
  int rank = 0, size = 1;
  double timeout_s = 60;
  bool aborted = false;
  std::weak_ptr<NcclComm> self;
  struct P2p {
    bool send;
    void* buf;
    size_t bytes;
    int peer;
    Ticket ticket;
  };
  std::vector<P2p> queued;

  // A non-blocking launch (init, split, a group, finalize) is settled when
  // ncclCommGetAsyncError no longer says ncclInProgress (NCCL refuses any other call on the
  // communicator until then). Returns "" when it succeeded, "stalled" past the timeout, else
  // NCCL's error. The first group between two ranks also connects them: it settles only once
  // the peer has launched its side.
  std::string settle(ncclResult_t launch) const {
    if (launch != ncclSuccess && launch != ncclInProgress)
      return std::string(ncclGetErrorString(launch)) + ": " + ncclGetLastError(comm);
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(comm, &st);
      if (rc != ncclSuccess) st = rc;
      if (st == ncclSuccess) return "";
      if (st != ncclInProgress) return std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(comm);
      std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      if (waited.count() > timeout_s) return "stalled";
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Before a launch: the stream waits for what the legacy default stream has queued (the
  // kernels and copies that wrote the buffers). The stream itself does not block the legacy one.
  void ready() {
    cudaOk(cudaEventRecord(legacy_done, cudaStreamLegacy));
    cudaOk(cudaStreamWaitEvent(stream, legacy_done, 0));
  }

  // The ticket of what was just launched: an event recorded after it on the stream, or the
  // launch's failure.
  Ticket after(ncclResult_t launch, Ticket t = nullptr) {
    if (!t) t = std::make_shared<NcclTicket>();
    t->owner = self;
    t->launched = true;
    std::string err = settle(launch);
    if (err == "stalled") {
      t->stalled = true;
    } else if (!err.empty()) {
      t->error = err;
    } else {
      cudaOk(cudaEventCreateWithFlags(&t->event, cudaEventDisableTiming));
      cudaOk(cudaEventRecord(t->event, stream));
    }
    return t;
  }

  void make_stream() {
    cudaOk(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaOk(cudaEventCreateWithFlags(&legacy_done, cudaEventDisableTiming));
  }

  // A setup that failed: the communicator is aborted (not finalized) and the error thrown.
  [[noreturn]] void fail(const std::string& what, const std::string& err) {
    if (comm) ncclCommAbort(comm);
    aborted = true;
    FF_CHECK(false, "NCCL: " << what << ": "
                             << (err == "stalled" ? "no progress for " + std::to_string(timeout_s) + " s" : err));
    std::abort();
  }
};

// Sends and receives inside ncclGroupStart/End: the first failure is kept, the group always ends.
struct Group {
  ncclResult_t first = ncclSuccess;
  Group() { ncclGroupStart(); }
  void add(ncclResult_t rc) {
    if (first == ncclSuccess && rc != ncclSuccess && rc != ncclInProgress) first = rc;
  }
  ncclResult_t end() {
    ncclResult_t rc = ncclGroupEnd();
    return first != ncclSuccess ? first : rc;
  }
};

static ncclDataType_t nccl_type(NcclComm::Type t) {
  switch (t) {
    case NcclComm::Type::f32: return ncclFloat32;
    case NcclComm::Type::f64: return ncclFloat64;
    case NcclComm::Type::i32: return ncclInt32;
    case NcclComm::Type::i64: return ncclInt64;
  }
  return ncclFloat32;
}

static ncclRedOp_t nccl_op(NcclComm::Op op) {
  switch (op) {
    case NcclComm::Op::sum: return ncclSum;
    case NcclComm::Op::prod: return ncclProd;
    case NcclComm::Op::max: return ncclMax;
    case NcclComm::Op::min: return ncclMin;
  }
  return ncclSum;
}

static ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

NcclComm::NcclComm() : impl_(new Impl) {}

// Every rank drops its copies of a communicator at the same point of the program (as it split
// it), so finalize (which completes what is outstanding with the peers) is settled under the
// deadline before the destroy; a communicator that does not finalize in time is aborted.
NcclComm::~NcclComm() {
  if (impl_->comm && !impl_->aborted) {
    if (impl_->settle(ncclCommFinalize(impl_->comm)).empty()) ncclCommDestroy(impl_->comm);
    else ncclCommAbort(impl_->comm);
  }
  if (impl_->legacy_done) cudaEventDestroy(impl_->legacy_done);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }

std::string NcclComm::unique_id() {
  ncclUniqueId id;
  ncclCheck(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}
size_t NcclComm::id_bytes() { return sizeof(ncclUniqueId); }

std::shared_ptr<NcclComm> NcclComm::create(const std::string& id_bytes, int rank, int size, double timeout_s) {
  ncclUniqueId id;
  FF_CHECK(id_bytes.size() == sizeof id, "NCCL: a unique id of " << id_bytes.size() << " bytes, expected " << sizeof id);
  std::memcpy(&id, id_bytes.data(), sizeof id);
  std::shared_ptr<NcclComm> c(new NcclComm);
  Impl& m = *c->impl_;
  m.self = c;
  m.rank = rank;
  m.size = size;
  m.timeout_s = timeout_s;
  m.make_stream();  // (the GPU is current: the stream is on it, and NCCL takes it)
  ncclConfig_t config = nonblocking_config();
  std::string err = m.settle(ncclCommInitRankConfig(&m.comm, size, id, rank, &config));
  if (!err.empty()) m.fail("setting up a communicator of " + std::to_string(size) + " ranks", err);
  return c;
}

bool NcclComm::has_split() { return NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0); }

std::shared_ptr<NcclComm> NcclComm::split(int color, int key, bool member, int rank, int size, double timeout_s) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  flush();
  // NCCL writes the new communicator into *slot when its setup ends, possibly after a stall has
  // been reported: the slot lives on the heap, and is given up (not freed) on failure.
  ncclComm_t* slot = new ncclComm_t(nullptr);
  ncclConfig_t config = nonblocking_config();
  std::string err = impl_->settle(ncclCommSplit(impl_->comm, member ? color : NCCL_SPLIT_NOCOLOR, key, slot, &config));
  if (!err.empty()) impl_->fail("splitting a communicator of " + std::to_string(impl_->size) + " ranks", err);
  std::unique_ptr<ncclComm_t> owned(slot);
  if (!member) return nullptr;
  std::shared_ptr<NcclComm> c(new NcclComm);
  Impl& m = *c->impl_;
  m.self = c;
  m.comm = *slot;
  m.rank = rank;
  m.size = size;
  m.timeout_s = timeout_s;
  m.make_stream();
  err = m.settle(ncclSuccess);  // (the parent's settle covered it; cheap)
  if (!err.empty()) m.fail("the split communicator", err);
  return c;
#else
  (void)color, (void)key, (void)member, (void)rank, (void)size, (void)timeout_s;
  FF_CHECK(false, "NCCL " << NCCL_MAJOR << "." << NCCL_MINOR << " has no ncclCommSplit");
  return nullptr;
#endif
}

// Each collective first launches the queued point-to-point messages: on the stream they come
// before it, as they were posted before it (a peer may need them to reach the collective).

NcclComm::Ticket NcclComm::allreduce(void* buf, size_t count, Type type, Op op) {
  flush();
  impl_->ready();
  return impl_->after(ncclAllReduce(buf, buf, count, nccl_type(type), nccl_op(op), impl_->comm, impl_->stream));
}

NcclComm::Ticket NcclComm::allgather(const void* send, size_t bytes, void* recv) {
  flush();
  impl_->ready();
  return impl_->after(ncclAllGather(send, recv, bytes, ncclInt8, impl_->comm, impl_->stream));
}

NcclComm::Ticket NcclComm::allgatherv(const void* send, size_t bytes, void* recv,
                                      const std::vector<size_t>& recv_bytes) {
  flush();
  impl_->ready();
  Group g;
  size_t off = 0;
  for (int r = 0; r < impl_->size; r++) {
    if (bytes) g.add(ncclSend(send, bytes, ncclInt8, r, impl_->comm, impl_->stream));
    if (recv_bytes[(size_t)r])
      g.add(ncclRecv(static_cast<char*>(recv) + off, recv_bytes[(size_t)r], ncclInt8, r, impl_->comm, impl_->stream));
    off += recv_bytes[(size_t)r];
  }
  return impl_->after(g.end());
}

// Equal blocks: ncclReduceScatter. Unequal ones: one ncclReduce per block, to its rank, in one
// group (no scratch memory: a cudaMalloc/cudaFree could wait on NCCL kernels in flight).
NcclComm::Ticket NcclComm::reduce_scatter_sum(const float* send, float* recv, const std::vector<int>& counts) {
  flush();
  impl_->ready();
  const bool equal = std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
  if (equal)
    return impl_->after(ncclReduceScatter(send, recv, (size_t)counts[0], ncclFloat32, ncclSum, impl_->comm, impl_->stream));
  Group g;
  size_t off = 0;
  for (int r = 0; r < impl_->size; r++) {
    g.add(ncclReduce(send + off, recv, (size_t)counts[(size_t)r], ncclFloat32, ncclSum, r, impl_->comm, impl_->stream));
    off += (size_t)counts[(size_t)r];
  }
  return impl_->after(g.end());
}

NcclComm::Ticket NcclComm::bcast(void* buf, size_t bytes, int root) {
  flush();
  impl_->ready();
  return impl_->after(ncclBroadcast(buf, buf, bytes, ncclInt8, root, impl_->comm, impl_->stream));
}

NcclComm::Ticket NcclComm::alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                     const std::vector<size_t>& recv_bytes) {
  flush();
  impl_->ready();
  Group g;
  size_t so = 0, ro = 0;
  for (int r = 0; r < impl_->size; r++) {
    const size_t s = send_bytes[(size_t)r], n = recv_bytes[(size_t)r];
    if (s) g.add(ncclSend(static_cast<const char*>(send) + so, s, ncclInt8, r, impl_->comm, impl_->stream));
    if (n) g.add(ncclRecv(static_cast<char*>(recv) + ro, n, ncclInt8, r, impl_->comm, impl_->stream));
    so += s;
    ro += n;
  }
  return impl_->after(g.end());
}

NcclComm::Ticket NcclComm::send(const void* buf, size_t bytes, int peer) {
  auto t = std::make_shared<NcclTicket>();
  t->owner = impl_->self;
  impl_->queued.push_back({true, const_cast<void*>(buf), bytes, peer, t});
  return t;
}

NcclComm::Ticket NcclComm::recv(void* buf, size_t bytes, int peer) {
  auto t = std::make_shared<NcclTicket>();
  t->owner = impl_->self;
  impl_->queued.push_back({false, buf, bytes, peer, t});
  return t;
}

// Every queued message in one group: one launch, each message's own event recorded after it.
void NcclComm::flush() {
  if (impl_->queued.empty()) return;
  std::vector<Impl::P2p> q;
  q.swap(impl_->queued);
  impl_->ready();
  Group g;
  for (const Impl::P2p& m : q) {
    if (m.bytes == 0) continue;
    g.add(m.send ? ncclSend(m.buf, m.bytes, ncclInt8, m.peer, impl_->comm, impl_->stream)
                 : ncclRecv(m.buf, m.bytes, ncclInt8, m.peer, impl_->comm, impl_->stream));
  }
  Ticket first = impl_->after(g.end(), q.front().ticket);
  for (size_t i = 1; i < q.size(); i++) {
    NcclTicket& t = *q[i].ticket;
    t.launched = true;
    t.stalled = first->stalled;
    t.error = first->error;
    if (first->event) {
      cudaOk(cudaEventCreateWithFlags(&t.event, cudaEventDisableTiming));
      cudaOk(cudaEventRecord(t.event, impl_->stream));
    }
  }
}

void NcclComm::launch(const Ticket& t) {
  if (t->launched) return;
  std::shared_ptr<NcclComm> owner = t->owner.lock();
  FF_CHECK(owner, "an NCCL request outlived its communicator before it was launched");
  owner->flush();
}

NcclState NcclComm::poll(const Ticket& t, std::string* error) {
  launch(t);
  if (t->stalled) return NcclState::stalled;
  if (!t->error.empty()) {
    *error = t->error;
    return NcclState::failed;
  }
  cudaError_t q = cudaEventQuery(t->event);
  if (q == cudaSuccess) return NcclState::done;
  if (q != cudaErrorNotReady) {
    cudaGetLastError();
    *error = std::string("CUDA: ") + cudaGetErrorString(q);
    return NcclState::failed;
  }
  std::shared_ptr<NcclComm> owner = t->owner.lock();
  if (owner) {  // a peer's failure (a lost connection, an abort) shows here
    ncclResult_t st = ncclSuccess;
    ncclCommGetAsyncError(owner->impl_->comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) {
      *error = std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(owner->impl_->comm);
      return NcclState::failed;
    }
  }
  return NcclState::pending;
}

void NcclComm::abort(const Ticket& t) {
  if (std::shared_ptr<NcclComm> owner = t->owner.lock()) owner->abort();
}

void NcclComm::abort() {
  if (impl_->comm && !impl_->aborted) ncclCommAbort(impl_->comm);
  impl_->aborted = true;
}

#else  // no NCCL in this build: the interface, and create() refuses

bool nccl::built() { return false; }
std::string nccl::version() { return ""; }
bool nccl::is_device_pointer(const void*) { return false; }

struct NcclTicket {};
struct NcclComm::Impl {};

NcclComm::NcclComm() : impl_(new Impl) {}
NcclComm::~NcclComm() = default;
int NcclComm::rank() const { return 0; }
int NcclComm::size() const { return 1; }

[[noreturn]] static void no_nccl() { FF_CHECK(false, "this build has no NCCL"); std::abort(); }

std::string NcclComm::unique_id() { no_nccl(); }
size_t NcclComm::id_bytes() { return 0; }
std::shared_ptr<NcclComm> NcclComm::create(const std::string&, int, int, double) { no_nccl(); }
bool NcclComm::has_split() { return false; }
std::shared_ptr<NcclComm> NcclComm::split(int, int, bool, int, int, double) { no_nccl(); }
NcclComm::Ticket NcclComm::allreduce(void*, size_t, Type, Op) { no_nccl(); }
NcclComm::Ticket NcclComm::allgather(const void*, size_t, void*) { no_nccl(); }
NcclComm::Ticket NcclComm::allgatherv(const void*, size_t, void*, const std::vector<size_t>&) { no_nccl(); }
NcclComm::Ticket NcclComm::reduce_scatter_sum(const float*, float*, const std::vector<int>&) { no_nccl(); }
NcclComm::Ticket NcclComm::bcast(void*, size_t, int) { no_nccl(); }
NcclComm::Ticket NcclComm::alltoallv(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&) { no_nccl(); }
NcclComm::Ticket NcclComm::send(const void*, size_t, int) { no_nccl(); }
NcclComm::Ticket NcclComm::recv(void*, size_t, int) { no_nccl(); }
void NcclComm::flush() {}
void NcclComm::launch(const Ticket&) {}
NcclState NcclComm::poll(const Ticket&, std::string*) { no_nccl(); }
void NcclComm::abort(const Ticket&) {}
void NcclComm::abort() {}

#endif

}  // namespace ff
