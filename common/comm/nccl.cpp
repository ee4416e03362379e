// common/comm/nccl.cpp — NcclComm: operations as groups of NCCL's primitives, the queue of
// point-to-point messages, and the two engines that run a group: NCCL itself (cuda, in a build
// with NCCL) and its emulation over MPI (sim, always). See nccl.h. Comm (comm.cpp) decides what
// comes here and runs the watchdog over it.
#include "common/comm/nccl.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <deque>
#include <set>
#include <thread>

#include "common/comm/comm.h"  // Comm::bf16_sum_op
#include "common/core/check.h"
#include "kernels/sim_memory.h"

#if FF_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace ff {

const char* backend_name(Backend b) { return b == Backend::nccl ? "nccl" : "mpi"; }

static int64_t g_launches = 0;
int64_t nccl::launches() { return g_launches; }
static void progress_emulated_streams();
void nccl::progress_emulated() { progress_emulated_streams(); }

std::string resolve_backend(const std::string& flag, Device device, bool nccl_built, bool gpu_per_rank,
                            Backend* out) {
  const bool on_cuda = device == Device::cuda, on_sim = device == Device::sim;
  if (flag == "mpi" || (flag == "auto" && !(on_cuda && nccl_built && gpu_per_rank))) {
    *out = Backend::mpi;
    return "";
  }
  if (flag == "nccl" || flag == "auto") {
    if (on_sim) {  // the emulation: needs nothing
      *out = Backend::nccl;
      return "";
    }
    if (!on_cuda)
      return std::string("--backend nccl moves device buffers: it needs --device cuda (or sim, where "
                         "it is emulated over MPI), and the tensors are on ") +
             device_name(device) + "; use --backend mpi (or auto)";
    if (!nccl_built)
      return "--backend nccl: this build has no NCCL (no nccl.h and libnccl next to the CUDA "
             "toolkit or under NCCL_HOME); use --backend mpi";
    if (!gpu_per_rank)
      return "--backend nccl takes one GPU per rank, and a node has more ranks than GPUs: run at "
             "most as many ranks per node as it has GPUs, or use --backend mpi (or auto)";
    *out = Backend::nccl;
    return "";
  }
  return "--backend " + flag + ": expected mpi, nccl or auto";
}

// ----------------------------------------------------------------------------
// what the engines share

// One of NCCL's primitives, as a group holds it. count is in elements of type (u8: bytes);
// peer is the root of a broadcast or a reduce.
struct NcclComm::Prim {
  enum Kind { all_reduce, all_gather, reduce_scatter, broadcast, reduce, send, recv } kind;
  const void* in;
  void* out;
  size_t count;
  Type type;
  Op op;
  int peer;
};

struct NcclTicket {
  std::weak_ptr<NcclComm> owner;  // whose queue launches it, whose engine polls it
  bool launched = false;
  bool stalled = false;  // a launch did not settle within the timeout
  std::string error;     // an error at launch
  bool done = false;     // (emulated) its launch has finished
  uint64_t seq = 0;      // (emulated) its launch's place on the stream
#if FF_HAVE_NCCL
  cudaEvent_t event = nullptr;
  ~NcclTicket() {
    if (event) cudaEventDestroy(event);
  }
#endif
};

struct NcclComm::Queued {
  bool send;
  void* buf;
  size_t bytes;
  int peer;
  Ticket ticket;
};

struct NcclEngine {
  virtual ~NcclEngine() = default;
  virtual Device device() const = 0;
  virtual bool takes(const void* p) const = 0;
  // Launches the group; every ticket is then launched (and stalled / failed, or pending).
  virtual void launch(const std::vector<NcclComm::Prim>& prims, const std::vector<NcclComm::Ticket>& tickets) = 0;
  virtual NcclState poll(NcclTicket& t, std::string* error) = 0;
  virtual bool can_split() const = 0;
  // null for a rank that is not a member
  virtual std::unique_ptr<NcclEngine> split(int color, int key, bool member) = 0;
  virtual void abort() = 0;
  virtual void set_timeout(double seconds) = 0;
};

static size_t type_bytes(NcclComm::Type t) {
  switch (t) {
    case NcclComm::Type::f32: return 4;
    case NcclComm::Type::f64: return 8;
    case NcclComm::Type::i32: return 4;
    case NcclComm::Type::i64: return 8;
    case NcclComm::Type::u8: return 1;
    case NcclComm::Type::bf16: return 2;
  }
  return 1;
}

// ----------------------------------------------------------------------------
// the emulated engine (device sim): a stream of launches over MPI

namespace {

class SimEngine final : public NcclEngine {
 public:
  SimEngine(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors become the ticket's, not an abort
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // splits go over a communicator of their own: a blocking MPI_Comm_split must not come
    // between the stream's non-blocking collectives, whose order every rank must keep
    MPI_Comm_dup(comm_, &control_);
    all().insert(this);
  }
  // What is in flight is finished first (NCCL's finalize does the same), within the timeout;
  // a stream that does not drain keeps its buffers and communicators (leaked, not freed under
  // MPI's feet).
  ~SimEngine() override {
    const auto start = std::chrono::steady_clock::now();
    while (!stream_.empty() && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < timeout_s_) {
      progress();
      if (!stream_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    all().erase(this);
    if (!stream_.empty()) {
      new std::deque<Launch>(std::move(stream_));  // given up
      return;
    }
    MPI_Comm_free(&control_);
    MPI_Comm_free(&comm_);
  }
  Device device() const override { return Device::sim; }
  bool takes(const void* p) const override {
    char* base = nullptr;
    size_t bytes = 0;
    return p && sim_memory::allocation_of(p, &base, &bytes);
  }
  bool can_split() const override { return true; }
  std::unique_ptr<NcclEngine> split(int color, int key, bool member) override {
    progress_all();
    MPI_Comm child = MPI_COMM_NULL;  // every rank of this one takes part, as in ncclCommSplit
    MPI_Comm_split(control_, member ? color : MPI_UNDEFINED, key, &child);
    if (!member) return nullptr;
    return std::unique_ptr<NcclEngine>(new SimEngine(child, timeout_s_));
  }
  void abort() override {}
  void set_timeout(double seconds) override { timeout_s_ = seconds; }

  void launch(const std::vector<NcclComm::Prim>& prims, const std::vector<NcclComm::Ticket>& tickets) override {
    Launch l;
    l.prims = prims;
    l.seq = ++launched_;
    for (const NcclComm::Ticket& t : tickets) {
      t->launched = true;
      t->seq = l.seq;
      l.tickets.push_back(t);
    }
    stream_.push_back(std::move(l));
    progress();
  }

  NcclState poll(NcclTicket& t, std::string* error) override {
    progress_all();
    if (!t.error.empty()) {
      *error = t.error;
      return NcclState::failed;
    }
    return t.seq <= finished_ ? NcclState::done : NcclState::pending;
  }

  // A GPU runs every stream on its own; here they move when polled: any poll, and every pause
  // of Comm's waits (nccl::progress_emulated), moves them all.
  static void progress_all() {
    for (SimEngine* e : all()) e->progress();
  }

 private:
  // A launch: its primitives, the host copies they run on, and their MPI requests.
  struct Launch {
    std::vector<NcclComm::Prim> prims;
    std::vector<std::weak_ptr<NcclTicket>> tickets;
    std::string error;  // an MPI error, or a receive of the wrong size
    uint64_t seq = 0;
    bool started = false;
    std::vector<std::vector<char>> host;  // one per primitive
    std::vector<MPI_Request> reqs;
  };

  static MPI_Datatype mpi_type(NcclComm::Type t) {
    switch (t) {
      case NcclComm::Type::f32: return MPI_FLOAT;
      case NcclComm::Type::f64: return MPI_DOUBLE;
      case NcclComm::Type::i32: return MPI_INT;
      case NcclComm::Type::i64: return MPI_INT64_T;
      case NcclComm::Type::u8: return MPI_BYTE;
      case NcclComm::Type::bf16: return MPI_UINT16_T;
    }
    return MPI_BYTE;
  }
  static MPI_Op mpi_op(NcclComm::Op op, NcclComm::Type type) {
    if (type == NcclComm::Type::bf16) return Comm::bf16_sum_op();  // NcclComm takes only sums of bf16
    switch (op) {
      case NcclComm::Op::sum: return MPI_SUM;
      case NcclComm::Op::prod: return MPI_PROD;
      case NcclComm::Op::max: return MPI_MAX;
      case NcclComm::Op::min: return MPI_MIN;
    }
    return MPI_SUM;
  }

  void copy_out(std::vector<char>& host, const void* dev, size_t bytes) {
    host.resize(std::max<size_t>(bytes, 1));
    if (bytes) device_memcpy(host.data(), Device::cpu, dev, Device::sim, bytes);
  }

  // The head of the stream runs: its inputs are read out of device memory now (as a kernel
  // reads them when it runs), and each primitive is posted as a non-blocking MPI call, in the
  // group's order (the same on every rank, as NCCL requires of a group's collectives).
  void start(Launch& l) {
    l.started = true;
    l.host.resize(l.prims.size());
    const int size = size_;
    for (size_t i = 0; i < l.prims.size(); i++) {
      const NcclComm::Prim& p = l.prims[i];
      std::vector<char>& h = l.host[i];
      const size_t n = p.count * type_bytes(p.type);
      const int count = (int)p.count;
      const MPI_Datatype t = mpi_type(p.type);
      MPI_Request r = MPI_REQUEST_NULL;
      int rc = MPI_SUCCESS;
      switch (p.kind) {
        case NcclComm::Prim::all_reduce:
          copy_out(h, p.in, n);
          rc = MPI_Iallreduce(MPI_IN_PLACE, h.data(), count, t, mpi_op(p.op, p.type), comm_, &r);
          break;
        case NcclComm::Prim::all_gather: {
          std::vector<char> mine;
          copy_out(mine, p.in, n);
          h.resize(std::max<size_t>(n * (size_t)size, 1));
          std::memcpy(h.data() + n * (size_t)rank_, mine.data(), n);
          rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, h.data(), count, t, comm_, &r);
          break;
        }
        case NcclComm::Prim::reduce_scatter:
          copy_out(h, p.in, n * (size_t)size);
          rc = MPI_Ireduce_scatter_block(MPI_IN_PLACE, h.data(), count, t, mpi_op(p.op, p.type), comm_, &r);
          break;
        case NcclComm::Prim::broadcast:
          copy_out(h, p.in, n);
          rc = MPI_Ibcast(h.data(), count, t, p.peer, comm_, &r);
          break;
        case NcclComm::Prim::reduce:
          copy_out(h, p.in, n);
          rc = MPI_Ireduce(rank_ == p.peer ? MPI_IN_PLACE : h.data(), h.data(), count, t, mpi_op(p.op, p.type), p.peer, comm_, &r);
          break;
        case NcclComm::Prim::send:
          copy_out(h, p.in, n);
          rc = MPI_Isend(h.data(), count, t, p.peer, kTag, comm_, &r);
          break;
        case NcclComm::Prim::recv:
          h.resize(std::max<size_t>(n, 1));
          rc = MPI_Irecv(h.data(), count, t, p.peer, kTag, comm_, &r);
          break;
      }
      if (rc != MPI_SUCCESS && l.error.empty()) l.error = "MPI: " + mpi_error(rc);
      l.reqs.push_back(r);
    }
  }

  static std::string mpi_error(int rc) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return std::string(text, (size_t)len);
  }

  // Its outputs into device memory, now that every request is complete.
  void finish(Launch& l) {
    const int size = size_;
    for (size_t i = 0; i < l.prims.size(); i++) {
      const NcclComm::Prim& p = l.prims[i];
      const size_t n = p.count * type_bytes(p.type);
      const bool writes = p.kind != NcclComm::Prim::send && (p.kind != NcclComm::Prim::reduce || rank_ == p.peer);
      const size_t out = p.kind == NcclComm::Prim::all_gather ? n * (size_t)size : n;
      if (writes && out) device_memcpy(p.out, Device::sim, l.host[i].data(), Device::cpu, out);
    }
  }

  // One launch at a time, in order, as a stream runs them. A receive must get exactly its
  // bytes (NCCL would hang or read past the message; here it is the ticket's error).
  void progress() {
    while (!stream_.empty()) {
      Launch& head = stream_.front();
      if (!head.started) start(head);
      int done = 0;
      std::vector<MPI_Status> st(head.reqs.size());
      if (head.error.empty()) {
        const int rc = MPI_Testall((int)head.reqs.size(), head.reqs.data(), &done, st.data());
        if (rc != MPI_SUCCESS) {
          head.error = "MPI: " + mpi_error(rc);
          for (const MPI_Status& x : st)
            if (x.MPI_ERROR != MPI_SUCCESS && x.MPI_ERROR != MPI_ERR_PENDING) head.error = "MPI: " + mpi_error(x.MPI_ERROR);
        }
      }
      if (head.error.empty() && !done) return;
      for (size_t i = 0; head.error.empty() && i < head.prims.size(); i++) {
        const NcclComm::Prim& p = head.prims[i];
        if (p.kind != NcclComm::Prim::recv) continue;
        int got = 0;
        MPI_Get_count(&st[i], MPI_BYTE, &got);
        const size_t want = p.count * type_bytes(p.type);
        if ((size_t)got != want)
          head.error = "a receive of " + std::to_string(want) + " bytes from rank " + std::to_string(p.peer) +
                       " got a message of " + std::to_string(got);
      }
      if (head.error.empty()) finish(head);
      for (const std::weak_ptr<NcclTicket>& w : head.tickets)
        if (std::shared_ptr<NcclTicket> t = w.lock()) t->error = head.error;
      if (!head.error.empty()) {  // the watchdog reports it and ends the job: the stream stops
        new std::deque<Launch>(std::move(stream_));  // its requests may still be live: kept
        stream_.clear();
        return;
      }
      finished_ = head.seq;
      stream_.pop_front();
    }
  }

  static std::set<SimEngine*>& all() {  // this process's streams
    static std::set<SimEngine*> engines;
    return engines;
  }
  static constexpr int kTag = 0;  // NCCL has no tags: messages between two ranks match in order
  MPI_Comm comm_;
  MPI_Comm control_ = MPI_COMM_NULL;
  double timeout_s_;
  int rank_ = 0, size_ = 1;
  std::deque<Launch> stream_;
  uint64_t launched_ = 0, finished_ = 0;
};

}  // namespace

static void progress_emulated_streams() { SimEngine::progress_all(); }

// ----------------------------------------------------------------------------
// the NCCL engine (device cuda)

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

static ncclDataType_t nccl_type(NcclComm::Type t) {
  switch (t) {
    case NcclComm::Type::f32: return ncclFloat32;
    case NcclComm::Type::f64: return ncclFloat64;
    case NcclComm::Type::i32: return ncclInt32;
    case NcclComm::Type::i64: return ncclInt64;
    case NcclComm::Type::u8: return ncclUint8;
    case NcclComm::Type::bf16: return ncclBfloat16;
  }
  return ncclUint8;
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

namespace {

class CudaEngine final : public NcclEngine {
 public:
  CudaEngine(double timeout_s) : timeout_s_(timeout_s) {
    // (the GPU is current: the stream is on it, and NCCL takes it)
    cudaOk(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaOk(cudaEventCreateWithFlags(&legacy_done_, cudaEventDisableTiming));
  }
  // Every rank drops its copies of a communicator at the same point of the program (as it split
  // it), so finalize (which completes what is outstanding with the peers) is settled under the
  // deadline before the destroy; a communicator that does not finalize in time is aborted.
  ~CudaEngine() override {
    if (comm_ && !aborted_) {
      if (settle(ncclCommFinalize(comm_)).empty()) ncclCommDestroy(comm_);
      else ncclCommAbort(comm_);
    }
    cudaEventDestroy(legacy_done_);
    cudaStreamDestroy(stream_);
  }

  void init(const ncclUniqueId& id, int rank, int size) {
    ncclConfig_t config = nonblocking_config();
    std::string err = settle(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
    if (!err.empty()) fail("setting up a communicator of " + std::to_string(size) + " ranks", err);
  }

  Device device() const override { return Device::cuda; }
  bool takes(const void* p) const override {
    if (!p) return false;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // host memory CUDA never saw: not an error to keep
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  bool can_split() const override { return NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0); }

  std::unique_ptr<NcclEngine> split(int color, int key, bool member) override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    // NCCL writes the new communicator into *slot when its setup ends, possibly after a stall has
    // been reported: the slot lives on the heap, and is given up (not freed) on failure.
    ncclComm_t* slot = new ncclComm_t(nullptr);
    ncclConfig_t config = nonblocking_config();
    std::string err = settle(ncclCommSplit(comm_, member ? color : NCCL_SPLIT_NOCOLOR, key, slot, &config));
    if (!err.empty()) fail("splitting a communicator", err);
    std::unique_ptr<ncclComm_t> owned(slot);
    if (!member) return nullptr;
    std::unique_ptr<CudaEngine> c(new CudaEngine(timeout_s_));
    c->comm_ = *slot;
    err = c->settle(ncclSuccess);  // (the parent's settle covered it; cheap)
    if (!err.empty()) c->fail("the split communicator", err);
    return c;
#else
    (void)color, (void)key, (void)member;
    FF_CHECK(false, "NCCL " << NCCL_MAJOR << "." << NCCL_MINOR << " has no ncclCommSplit");
    return nullptr;
#endif
  }

  void launch(const std::vector<NcclComm::Prim>& prims, const std::vector<NcclComm::Ticket>& tickets) override {
    // The stream first waits for what the legacy default stream has queued (the kernels and
    // copies that wrote the buffers); it does not make the legacy stream wait in turn.
    cudaOk(cudaEventRecord(legacy_done_, cudaStreamLegacy));
    cudaOk(cudaStreamWaitEvent(stream_, legacy_done_, 0));
    ncclResult_t first = ncclSuccess;
    auto add = [&](ncclResult_t rc) {
      if (first == ncclSuccess && rc != ncclSuccess && rc != ncclInProgress) first = rc;
    };
    ncclGroupStart();
    for (const NcclComm::Prim& p : prims) {
      const ncclDataType_t t = nccl_type(p.type);
      switch (p.kind) {
        case NcclComm::Prim::all_reduce: add(ncclAllReduce(p.in, p.out, p.count, t, nccl_op(p.op), comm_, stream_)); break;
        case NcclComm::Prim::all_gather: add(ncclAllGather(p.in, p.out, p.count, t, comm_, stream_)); break;
        case NcclComm::Prim::reduce_scatter: add(ncclReduceScatter(p.in, p.out, p.count, t, nccl_op(p.op), comm_, stream_)); break;
        case NcclComm::Prim::broadcast: add(ncclBroadcast(p.in, p.out, p.count, t, p.peer, comm_, stream_)); break;
        case NcclComm::Prim::reduce: add(ncclReduce(p.in, p.out, p.count, t, nccl_op(p.op), p.peer, comm_, stream_)); break;
        case NcclComm::Prim::send: add(ncclSend(p.in, p.count, t, p.peer, comm_, stream_)); break;
        case NcclComm::Prim::recv: add(ncclRecv(p.out, p.count, t, p.peer, comm_, stream_)); break;
      }
    }
    ncclResult_t end = ncclGroupEnd();
    const std::string err = settle(first != ncclSuccess ? first : end);
    for (const NcclComm::Ticket& t : tickets) {
      t->launched = true;
      if (err == "stalled") {
        t->stalled = true;
      } else if (!err.empty()) {
        t->error = err;
      } else {  // each its own event, recorded after the group
        cudaOk(cudaEventCreateWithFlags(&t->event, cudaEventDisableTiming));
        cudaOk(cudaEventRecord(t->event, stream_));
      }
    }
  }

  NcclState poll(NcclTicket& t, std::string* error) override {
    if (t.stalled) return NcclState::stalled;
    if (!t.error.empty()) {
      *error = t.error;
      return NcclState::failed;
    }
    cudaError_t q = cudaEventQuery(t.event);
    if (q == cudaSuccess) return NcclState::done;
    if (q != cudaErrorNotReady) {
      cudaGetLastError();
      *error = std::string("CUDA: ") + cudaGetErrorString(q);
      return NcclState::failed;
    }
    ncclResult_t st = ncclSuccess;  // a peer's failure (a lost connection, an abort) shows here
    ncclCommGetAsyncError(comm_, &st);
    if (st != ncclSuccess && st != ncclInProgress) {
      *error = std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(comm_);
      return NcclState::failed;
    }
    return NcclState::pending;
  }

  void abort() override {
    if (comm_ && !aborted_) ncclCommAbort(comm_);
    aborted_ = true;
  }
  void set_timeout(double seconds) override { timeout_s_ = seconds; }

 private:
  // A non-blocking launch (init, split, a group, finalize) is settled when
  // ncclCommGetAsyncError no longer says ncclInProgress (NCCL refuses any other call on the
  // communicator until then). Returns "" when it succeeded, "stalled" past the timeout, else
  // NCCL's error. The first group between two ranks also connects them: it settles only once
  // the peer has launched its side.
  std::string settle(ncclResult_t launch) const {
    if (launch != ncclSuccess && launch != ncclInProgress)
      return std::string(ncclGetErrorString(launch)) + ": " + ncclGetLastError(comm_);
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(comm_, &st);
      if (rc != ncclSuccess) st = rc;
      if (st == ncclSuccess) return "";
      if (st != ncclInProgress) return std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(comm_);
      std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      if (waited.count() > timeout_s_) return "stalled";
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // A setup that failed: the communicator is aborted (not finalized) and the error thrown.
  [[noreturn]] void fail(const std::string& what, const std::string& err) {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;  // gone: a later call is NCCL's invalid-argument error, not a use of freed memory
    aborted_ = true;
    FF_CHECK(false, "NCCL: " << what << ": "
                             << (err == "stalled" ? "no progress for " + std::to_string(timeout_s_) + " s" : err));
    std::abort();
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t legacy_done_ = nullptr;  // recorded on the legacy stream before each launch
  double timeout_s_;
  bool aborted_ = false;
};

}  // namespace

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
  std::unique_ptr<CudaEngine> e(new CudaEngine(timeout_s));
  e->init(id, rank, size);
  return adopt(std::move(e), rank, size, timeout_s);
}

#else  // no NCCL in this build: the emulation only

bool nccl::built() { return false; }
std::string nccl::version() { return ""; }
std::string NcclComm::unique_id() { FF_CHECK(false, "this build has no NCCL"); return ""; }
size_t NcclComm::id_bytes() { return 0; }
std::shared_ptr<NcclComm> NcclComm::create(const std::string&, int, int, double) {
  FF_CHECK(false, "this build has no NCCL");
  return nullptr;
}

#endif

// ----------------------------------------------------------------------------
// NcclComm: operations as groups, and the queue

NcclComm::NcclComm(std::unique_ptr<NcclEngine> engine, int rank, int size, double timeout_s)
    : engine_(std::move(engine)), rank_(rank), size_(size), timeout_s_(timeout_s) {}

NcclComm::~NcclComm() = default;

std::shared_ptr<NcclComm> NcclComm::adopt(std::unique_ptr<NcclEngine> engine, int rank, int size, double timeout_s) {
  std::shared_ptr<NcclComm> c(new NcclComm(std::move(engine), rank, size, timeout_s));
  c->self_ = c;
  return c;
}

std::shared_ptr<NcclComm> NcclComm::emulate(MPI_Comm mpi, double timeout_s) {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(mpi, &dup);
  int rank = 0, size = 1;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  return adopt(std::unique_ptr<NcclEngine>(new SimEngine(dup, timeout_s)), rank, size, timeout_s);
}

Device NcclComm::device() const { return engine_->device(); }
bool NcclComm::takes(const void* p) const { return engine_->takes(p); }
bool NcclComm::can_split() const { return engine_->can_split(); }

std::shared_ptr<NcclComm> NcclComm::split(int color, int key, bool member, int rank, int size, double timeout_s) {
  flush();
  std::unique_ptr<NcclEngine> e = engine_->split(color, key, member);
  if (!member) return nullptr;
  return adopt(std::move(e), rank, size, timeout_s);
}

// Each operation first launches the queued point-to-point messages: on the stream they come
// before it, as they were posted before it (a peer may need them to reach the operation).
NcclComm::Ticket NcclComm::run(const std::vector<Prim>& prims) {
  flush();
  Ticket t = std::make_shared<NcclTicket>();
  t->owner = self_;
  engine_->launch(prims, {t});
  g_launches++;
  return t;
}

NcclComm::Ticket NcclComm::allreduce(void* buf, size_t count, Type type, Op op) {
  FF_CHECK(type != Type::bf16 || op == Op::sum, "NcclComm::allreduce: bf16 is summed, nothing else");
  return run({{Prim::all_reduce, buf, buf, count, type, op, -1}});
}

NcclComm::Ticket NcclComm::allgather(const void* send, size_t bytes, void* recv) {
  return run({{Prim::all_gather, send, recv, bytes, Type::u8, Op::sum, -1}});
}

NcclComm::Ticket NcclComm::allgatherv(const void* send, size_t bytes, void* recv,
                                      const std::vector<size_t>& recv_bytes) {
  std::vector<Prim> g;
  size_t off = 0;
  for (int r = 0; r < size_; r++) {
    if (bytes) g.push_back({Prim::send, send, nullptr, bytes, Type::u8, Op::sum, r});
    if (recv_bytes[(size_t)r])
      g.push_back({Prim::recv, nullptr, static_cast<char*>(recv) + off, recv_bytes[(size_t)r], Type::u8, Op::sum, r});
    off += recv_bytes[(size_t)r];
  }
  return run(g);
}

NcclComm::Ticket NcclComm::reduce_scatter_sum_bf16(const uint16_t* send, uint16_t* recv, size_t count) {
  return run({{Prim::reduce_scatter, send, recv, count, Type::bf16, Op::sum, -1}});
}

// Equal blocks: ncclReduceScatter. Unequal ones: one ncclReduce per block, to its rank, in one
// group (no scratch memory: a cudaMalloc/cudaFree could wait on NCCL kernels in flight).
NcclComm::Ticket NcclComm::reduce_scatter_sum(const float* send, float* recv, const std::vector<int>& counts) {
  const bool equal = std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
  if (equal) return run({{Prim::reduce_scatter, send, recv, (size_t)counts[0], Type::f32, Op::sum, -1}});
  std::vector<Prim> g;
  size_t off = 0;
  for (int r = 0; r < size_; r++) {
    g.push_back({Prim::reduce, send + off, recv, (size_t)counts[(size_t)r], Type::f32, Op::sum, r});
    off += (size_t)counts[(size_t)r];
  }
  return run(g);
}

NcclComm::Ticket NcclComm::bcast(void* buf, size_t bytes, int root) {
  return run({{Prim::broadcast, buf, buf, bytes, Type::u8, Op::sum, root}});
}

NcclComm::Ticket NcclComm::alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                     const std::vector<size_t>& recv_bytes) {
  std::vector<Prim> g;
  size_t so = 0, ro = 0;
  for (int r = 0; r < size_; r++) {
    const size_t s = send_bytes[(size_t)r], n = recv_bytes[(size_t)r];
    if (s) g.push_back({Prim::send, static_cast<const char*>(send) + so, nullptr, s, Type::u8, Op::sum, r});
    if (n) g.push_back({Prim::recv, nullptr, static_cast<char*>(recv) + ro, n, Type::u8, Op::sum, r});
    so += s;
    ro += n;
  }
  return run(g);
}

NcclComm::Ticket NcclComm::send(const void* buf, size_t bytes, int peer) {
  auto t = std::make_shared<NcclTicket>();
  t->owner = self_;
  queued_.push_back({true, const_cast<void*>(buf), bytes, peer, t});
  return t;
}

NcclComm::Ticket NcclComm::recv(void* buf, size_t bytes, int peer) {
  auto t = std::make_shared<NcclTicket>();
  t->owner = self_;
  queued_.push_back({false, buf, bytes, peer, t});
  return t;
}

// Every queued message in one group: one launch.
void NcclComm::flush() {
  if (queued_.empty()) return;
  std::vector<Queued> q;
  q.swap(queued_);
  std::vector<Prim> g;
  std::vector<Ticket> tickets;
  for (const Queued& m : q) {
    tickets.push_back(m.ticket);
    if (m.bytes == 0) continue;
    if (m.send) g.push_back({Prim::send, m.buf, nullptr, m.bytes, Type::u8, Op::sum, m.peer});
    else g.push_back({Prim::recv, nullptr, m.buf, m.bytes, Type::u8, Op::sum, m.peer});
  }
  engine_->launch(g, tickets);
  if (!g.empty()) g_launches++;
}

void NcclComm::set_timeout(double seconds) {
  timeout_s_ = seconds;
  engine_->set_timeout(seconds);
}

void NcclComm::launch(const Ticket& t) {
  if (t->launched) return;
  std::shared_ptr<NcclComm> owner = t->owner.lock();
  FF_CHECK(owner, "an NCCL request outlived its communicator before it was launched");
  owner->flush();
}

NcclState NcclComm::poll(const Ticket& t, std::string* error) {
  launch(t);
  std::shared_ptr<NcclComm> owner = t->owner.lock();
  FF_CHECK(owner, "an NCCL request outlived its communicator");
  return owner->engine_->poll(*t, error);
}

void NcclComm::abort(const Ticket& t) {
  if (std::shared_ptr<NcclComm> owner = t->owner.lock()) owner->abort();
}

void NcclComm::abort() { engine_->abort(); }

}  // namespace ff
