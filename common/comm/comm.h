// common/comm/comm.h — Comm: an MPI communicator with a watchdog and trace spans.
//
// Design rules:
//  * Every wait is polled against a deadline (--timeout, default 60 s). Blocking
//    calls are their non-blocking twins plus a polled wait (send = MPI_Isend + wait,
//    ssend = MPI_Issend + wait, recv = MPI_Irecv + wait, collectives = MPI_I<coll> +
//    wait), so the semantics stay those of the blocking call and a deadlock becomes
//    one line:
//      error: rank R: no progress for T s in <op> with peer P (tag G, N bytes) — likely deadlock
//    followed by MPI_Abort. Collectives name the peer "all" and the tag "-".
//  * A wait costs what the message costs where it can: with a core per rank it polls in a
//    tight loop first, and sleeps between polls only when this node has more ranks than
//    cores (or the wait is long). FF_WAIT=spin|sleep|auto (default auto) overrides; see
//    WaitPolicy, and the watchdog in watchdog.cpp.
//  * Buffers are host memory on MPI. With NCCL enabled (enable_nccl(); common/comm/nccl.h), a
//    call whose buffers are device memory goes to NCCL instead, under the same watchdog, trace
//    spans and counts. Tensor overloads stage sim/cuda tensors through the host, except cuda
//    tensors on a Comm with NCCL, whose storage NCCL moves where it is.
//  * Tracing (trace() enabled), on the "comm" track of this rank:
//      - a blocking call (send, ssend, recv, sendrecv, a collective) is one span, call to return;
//      - a non-blocking request (isend, issend, irecv) is a *flight*, from its post to its
//        completion as a wait sees it (an async event: flights overlap each other freely),
//        and the time a wait() sat blocked on it is a span "wait irecv" ("wait isend", ...;
//        wait_all: one span "wait_all" for all its requests);
//    each with its peer, tag and bytes. Spans on one track nest or are disjoint. Inside a
//    Trace::Category all of them go to the category's track instead (see trace.h).
//  * The link model (optional; Comm::set_link, the lessons' --link): an alpha-beta model
//    that delays the completion of point-to-point messages, so that topology effects are
//    visible on one machine. See "the link model" below.
//
// The link model. World rank w sits on virtual node w / ranks_per_node; a message between two
// ranks of one node takes the intra-node class of link (NVLink), between nodes the inter-node
// class (InfiniBand), to oneself the self class. Each rank has, per class, one outgoing and
// one incoming link of the class's bandwidth, and every message pays the latency once more.
// When the model is enabled, each point-to-point message (isend, issend, irecv and the
// blocking send, ssend, recv and sendrecv built on them) completes, as this rank's wait sees
// it, no earlier than its modelled time, on both sides:
//   sender    the message occupies this rank's outgoing link of its class from
//             max(its post, when that link is next free), for bytes / bandwidth, and
//             completes latency after that. Messages to several peers over one class thus
//             queue on the rank's outgoing link, one after another, as they do on a real NIC:
//             a rank that sends P-1 blocks to P-1 other nodes pays P-1 inter-node transfers
//             back to back, which is what a hierarchical all-to-all (one inter-node message
//             per node, then an intra-node fan-out) saves.
//   receiver  likewise on this rank's incoming link of the class, from when a poll (a wait's
//             MPI_Test / MPI_Testsome, or Comm::test) first sees the message complete in MPI.
//             An approximation: a receive nobody polls until late is charged from when it is
//             first seen, not from when the data arrived (for a large message over shared
//             memory, much the same: Open MPI moves it only inside MPI calls).
// A wait whose request is complete in MPI but not yet in the model keeps waiting (sleeping
// when the modelled time is more than ~100 us away) until the modelled time; the watchdog's
// deadline still applies, and the trace flight ends at the modelled completion. Messages to
// oneself are free; the blocking collectives (allreduce, alltoallv, ...) are not modelled, the
// non-blocking ones (iallreduce_sum, ireduce_scatter_sum, iallgather) are, as rings: see
// link_collective. The model and
// the link state are process-wide: set once per rank (every rank the same), they apply to
// every Comm, sub-communicators from split included (whose peers are mapped to their world
// ranks to find the class). Whether or not the model is enabled, every point-to-point send
// this process posts adds its bytes to a counter per class (Comm::bytes_sent), so lessons can
// report exact traffic per link class.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/util/error.h"
#include "kernels/device.h"

namespace ff {

class Tensor;
class NcclComm;
struct NcclTicket;

// ---- the link model (see the top of this file)

struct LinkModel {
  bool enabled = false;
  // per direction, per rank: the H800 cluster of DeepSeek-V3 §3.2 (NVLink 160 GB/s within a
  // node, InfiniBand 50 GB/s between nodes)
  double intra_bytes_per_s = 160e9, inter_bytes_per_s = 50e9;
  double latency_s = 3e-6;
  int ranks_per_node = 2;
  bool real_nodes = false;  // ranks_per_node is this job's real layout (NodeLayout), not a virtual one
  int node_of(int world_rank) const { return world_rank / ranks_per_node; }
};

// Where this job's ranks really are: a node is the ranks that share memory
// (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)).
struct NodeLayout {
  int nodes = 1;           // distinct nodes
  int ranks_per_node = 0;  // when every node holds the same number of consecutive world ranks
                           // (mpirun --map-by ppr:G:node, srun's block distribution): that number;
                           // else 0 (the nodes cannot be written as world rank / R)
};
// From the node of each world rank (any labels: equal labels, same node).
NodeLayout node_layout_of(const std::vector<int>& node_of_rank);

// Parses --link's "intra=BW,inter=BW,latency=T": any subset of the three keys, in any order,
// each at most once; the keys left out keep LinkModel's defaults. BW is a positive number with
// unit GB/s, MB/s, KB/s or B/s (GB = 1e9 bytes; a bare number is GB/s); T a non-negative
// number with unit s, ms, us or ns (a bare number is us). On success sets *out (enabled, the
// three values; ranks_per_node is left as it was) and returns true. On anything malformed
// (an unknown or repeated key, an empty part, a value that is not a number, zero or negative
// bandwidth, negative latency, inf or nan, an unknown unit) leaves *out alone, sets *error to
// one sentence naming the bad part and what is allowed, e.g.
//   --link: 'inter=fast': bandwidth must be a positive number with unit GB/s, MB/s, KB/s or B/s
// and returns false.
bool parse_link(const std::string& spec, LinkModel* out, std::string* error);
// One line for a lesson's output, e.g.
//   "modelled links: intra-node 160 GB/s, inter-node 50 GB/s, latency 3 us, 2 ranks per virtual node";
// for a disabled model "links not modelled (2 ranks per virtual node)"; "per node" when the
// layout is the job's real one (real_nodes).
std::string describe(const LinkModel& m);

enum class LinkClass { self, intra, inter };
const char* link_class_name(LinkClass c);  // "self", "intra", "inter"

// Bytes of point-to-point sends this process posted, per link class.
struct LinkBytes {
  size_t intra = 0, inter = 0, self = 0;
};


// A pending non-blocking operation, with what the watchdog needs to name it.
struct Request {
  MPI_Request req = MPI_REQUEST_NULL;
  std::string op;       // "isend", "irecv", ...
  int peer = -1;        // -1: a collective ("all")
  int tag = -1;
  size_t bytes = 0;
  double start_us = 0;  // when it was posted (trace time), for the trace
  bool is_recv = false;  // a receive: the message must fill exactly `bytes`
  bool modelled = false;   // the link model delays its completion (on at its post; not self)
  double link_cost_s = 0;   // a modelled collective: its time alone on the link (link_collective)
  double link_done_s = -1;  // its modelled completion on the model's clock (a receive's is
                            // known once a wait first sees it complete); < 0: not yet known
  // Set by Comm::test when it saw the request complete in MPI before any wait did (req is then
  // MPI_REQUEST_NULL): its status, and the trace time it was seen done in MPI and in the model
  // (< 0: not yet due in the model). A later wait ends the flight there, not at the wait.
  bool arrived = false;
  MPI_Status status{};
  double done_us = -1;
  // On NCCL (req stays MPI_REQUEST_NULL): the completion of its launch; null once retired.
  std::shared_ptr<NcclTicket> nccl = nullptr;
  // What MPI may read until the request completes (a non-blocking collective's counts).
  std::shared_ptr<const void> keep = nullptr;
};

// How this process's waits poll, decided once in Comm::world.
//   spin:  MPI_Test in a tight loop (with a pause instruction) for the first 2 ms of a
//          wait, then sleeps that grow with the time waited. Right when every rank has a core.
//   sleep: a few polls that yield, then sleeps (50 us and up). Right when ranks share cores:
//          a spinning rank would take the core from the very peer it waits for.
// FF_WAIT=spin|sleep picks one; FF_WAIT=auto (or FF_WAIT unset) picks spin unless this node is
// oversubscribed: more ranks of this job on it (MPI_COMM_TYPE_SHARED) than cores they may use
// (the union of their CPU affinity masks, capped by a cgroup CPU quota if there is one).
// (Before Comm::world has run: sleep, the policy that is never wrong, only slow.)
struct WaitPolicy {
  bool spin = false;
  int node_ranks = 1;  // ranks of this job on this node
  double cores = 0;    // cores they may use (measured whatever FF_WAIT says; 0 before world())
  std::string reason;  // one phrase, e.g. "auto: 2 ranks on 2 cores" or "FF_WAIT=sleep"
};

// The cores a cgroup v2 cpu.max ("QUOTA PERIOD", e.g. "200000 100000" = 2 cores) allows;
// 0 when it sets no limit ("max 100000") or cannot be read.
double cgroup_cpu_max_cores(const std::string& cpu_max);

// Collectives one communicator has run: calls and bytes per operation ("allreduce",
// "allgather", "reduce_scatter", ...). bytes is the operation's payload on this rank: the buffer
// an all-reduce or broadcast sums or sends, everything an all-gather receives (its own block
// included), everything a reduce-scatter reduces, what an all-to-all sends plus receives (the
// figure its trace span shows). What goes over the wire depends on MPI's algorithm: a ring
// all-reduce of n bytes sends 2 (P-1)/P n per rank, a ring all-gather or reduce-scatter (P-1)/P n.
// Point-to-point sends (send, ssend, isend, issend, sendrecv and the tensor sends) count under
// "send", with the bytes this rank sent.
struct CollectiveCount {
  int64_t calls = 0;
  size_t bytes = 0;
};
using CollectiveCounts = std::map<std::string, CollectiveCount>;

class Comm {
 public:
  // Initializes MPI once per process and returns MPI_COMM_WORLD. The first call (collective)
  // also decides the WaitPolicy; an FF_WAIT other than spin, sleep or auto is a usage error:
  // one `error:` line, exit 2 on every rank.
  // thread_level: what MPI_Init_thread is asked for (MPI_THREAD_SINGLE unless a lesson runs
  // MPI from a second thread); thread_level_provided() says what MPI gave.
  static Comm world(int* argc, char*** argv, int thread_level = MPI_THREAD_SINGLE);
  static int thread_level_provided();
  static const WaitPolicy& wait_policy();
  // This job's real nodes (collective over MPI_COMM_WORLD).
  static NodeLayout node_layout();
  // MPI_Finalize (if initialized and not finalized) then exit(code): the same on every rank.
  [[noreturn]] static void exit_all(int code);

  Comm() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm raw() const { return comm_; }
  // The world rank of this communicator's rank r (r itself for a default-constructed Comm).
  int world_rank(int r) const;
  void set_timeout(double seconds);
  double timeout() const { return timeout_s_; }

  // ---- point-to-point on raw host bytes
  void send(const void* buf, size_t bytes, int peer, int tag);   // standard mode (may buffer)
  void ssend(const void* buf, size_t bytes, int peer, int tag);  // synchronous: returns only once matched
  void recv(void* buf, size_t bytes, int peer, int tag);
  Request isend(const void* buf, size_t bytes, int peer, int tag);
  Request issend(const void* buf, size_t bytes, int peer, int tag);
  Request irecv(void* buf, size_t bytes, int peer, int tag);
  void wait(Request& r);
  // Polls r once without blocking (MPI_Test: this is also what makes MPI progress its
  // messages): true when it is complete in MPI and, with the link model, its modelled time has
  // come. A receive first seen complete here is charged to the model from now, as in a wait.
  // A test that returns true leaves r for wait()/wait_all() to retire (and trace) at once.
  bool test(Request& r);
  bool test_all(std::vector<Request>& rs);  // test() on each: true when all are done
  // Waits for all of rs, polling all of them (each flight ends when it completes, whatever
  // the order); the watchdog names the first one, in rs's order, still pending. Its trace
  // span "wait_all" counts the bytes of all; its peer and tag are theirs where all agree.
  void wait_all(std::vector<Request>& rs);
  void sendrecv(const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf, size_t rbytes,
                int src, int rtag);

  // ---- collectives
  // In place: buf (count elements of `type`) becomes the reduction over all ranks.
  void allreduce(void* buf, int count, MPI_Datatype type, MPI_Op op);
  void allreduce_sum(float* buf, size_t n);
  // recv holds size() blocks of `bytes` each, rank r's at r * bytes.
  void allgather(const void* send, size_t bytes, void* recv);
  // Blocks of different sizes: recv_bytes[r] from rank r, laid out back to back.
  void allgatherv(const void* send, size_t bytes, void* recv, const std::vector<size_t>& recv_bytes);
  // send holds sum(counts) floats on every rank; recv gets counts[rank] floats: this rank's
  // block (blocks laid out back to back in rank order) of the elementwise sum over ranks.
  void reduce_scatter_sum(const float* send, float* recv, const std::vector<int>& counts);
  // Non-blocking twins, for a collective that flies while this rank computes (the DP axis's
  // gradient buckets, lessons/08_mesh/buckets.h): posted and counted now, finished by wait() or
  // wait_all() (test() progresses it). The buffers must stay untouched until then. On NCCL
  // when the buffers are device memory. ireduce_scatter_sum gives every rank an equal block of
  // `count` floats (send holds size() * count).
  Request iallreduce_sum(float* buf, size_t n);
  Request ireduce_scatter_sum(const float* send, float* recv, size_t count);
  // bf16 (kernels/bf16.h: the bits as uint16_t), summed as NCCL sums ncclBfloat16: each
  // partial sum of two widened to float32, added, rounded back to bf16. In MPI, the datatype
  // MPI_UINT16_T with the operation bf16_sum_op() (a user-defined MPI_Op, created once).
  void allreduce_sum_bf16(uint16_t* buf, size_t n);
  Request iallreduce_sum_bf16(uint16_t* buf, size_t n);
  Request ireduce_scatter_sum_bf16(const uint16_t* send, uint16_t* recv, size_t count);
  static MPI_Op bf16_sum_op();
  Request iallgather(const void* send, size_t bytes, void* recv);
  void bcast(void* buf, size_t bytes, int root);
  void barrier();
  // Byte counts and displacements per peer, as MPI_Alltoallv with MPI_BYTE.
  void alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                 const std::vector<size_t>& recv_bytes);
  // Ranks with the same color form a new Comm, ordered by key (MPI_Comm_split); with NCCL
  // enabled, the matching NCCL communicator too (ncclCommSplit).
  Comm split(int color, int key) const;
  // The same ranks as a new communicator, counted (and labelled) as this one: two streams of
  // collectives over one group that must not depend on each other's order on every rank (lesson
  // 08's dense and replicated gradient buckets, each posting as its hooks fire). Collective.
  Comm duplicate_counted() const;

  // ---- NCCL (common/comm/nccl.h)
  // Collective: sets up NCCL on this communicator, so that calls on buffers of `device` go to
  // it. cuda: rank 0's unique id by bcast, the GPU selected first; throws ff::Error when the
  // build has no NCCL. sim: the emulation over MPI (common/comm/nccl.h), in every build.
  // Communicators split from this one afterwards get their own.
  void enable_nccl(Device device = Device::cuda);
  bool nccl_enabled() const { return nccl_ != nullptr; }
  // The collectives run on this communicator (copies of a Comm share the counts; split() starts
  // new ones), and a reset to zero.
  const CollectiveCounts& collective_counts() const { return *counts_; }
  // A name for this communicator ("tp", "dp", ...: lesson 08's mesh axes) that prefixes its
  // operations in trace spans and watchdog messages, e.g. "tp allreduce"; "" (the default,
  // and what split() gives) leaves them bare. The counts above stay keyed by the bare operation.
  void set_label(const std::string& label) { label_ = label; }
  const std::string& label() const { return label_; }
  void reset_collective_counts() { counts_->clear(); }

  // ---- the link model (process-wide; see the top of this file)
  // Sets the model for every Comm of this process and starts every link idle. Every rank
  // should set the same one. Refuses (ff::Error) a bandwidth that is not positive and finite,
  // a latency that is negative or not finite, or ranks_per_node < 1.
  static void set_link(const LinkModel& m);
  static const LinkModel& link();
  // The model's clock (seconds, steady): what Request::link_done_s is measured on.
  static double link_clock_s();
  // The class of the link to peer (a rank of this communicator): self, or intra / inter as
  // this rank's and peer's world ranks share a virtual node of link().ranks_per_node or not
  // (which holds whether or not the model is enabled).
  LinkClass link_class(int peer) const;
  // Bytes of every point-to-point send (isend, issend, send, ssend, sendrecv, tensor sends)
  // this process has posted on any Comm since the start or the last reset, per class.
  static LinkBytes bytes_sent();
  static void reset_bytes_sent();

  // ---- tensors (float32 or int64; staged through the host when not on cpu, except cuda
  // tensors with NCCL enabled)
  void send(const Tensor& t, int peer, int tag);
  void ssend(const Tensor& t, int peer, int tag);
  void recv(Tensor& t, int peer, int tag);  // t must already have the right shape and dtype
  void allreduce_sum(Tensor& t);
  void bcast(Tensor& t, int root);
  // all (P n, ...) <- every rank's mine (n, ...) in rank order; all must be allocated.
  void allgather(const Tensor& mine, Tensor& all);
  // mine (n, ...) <- this rank's block of the sum of all (P n, ...) over ranks (float32).
  void reduce_scatter_sum(const Tensor& all, Tensor& mine);

 private:
  explicit Comm(MPI_Comm c);
  Request collective(const char* op, size_t bytes);  // counted, then posted by the caller
  std::string op_name(const char* op) const;          // op, after the label when there is one
  MPI_Status wait_one(Request& r);  // the watchdog loop: returns when r completes
  void say_no_progress(const Request& r) const;  // the watchdog's one line
  [[noreturn]] void report_deadlock(const Request& r) const;
  [[noreturn]] void report_link_overrun(const Request& r, double waited_s) const;
  void link_posted(Request& r);                             // count a send; model its sending
  // With the model on, a non-blocking collective as a ring over this communicator: `steps`
  // messages of `chunk` bytes each leave this rank one after another on its outgoing link of
  // the communicator's slowest class (inter-node when any member is on another node), so it
  // completes no earlier than steps x (chunk / bandwidth + latency) after its post, queued
  // behind what that link already carries. A ring all-reduce of n bytes over P ranks is
  // 2 (P-1) steps of n/P, a reduce-scatter or all-gather P-1 steps.
  void link_collective(Request& r, int steps, size_t chunk);
  void link_arrived(Request& r, const MPI_Status& status);  // model a receive's arrival
  // Whether a call on these buffers goes to NCCL: enabled, and each non-null one on the device.
  bool to_nccl(const void* a, const void* b = nullptr) const;
  std::shared_ptr<NcclTicket> nccl_send(const void* buf, size_t bytes, int peer, const char* op);
  bool nccl_test(Request& r);    // one poll of r's launch; the watchdog's lines on a failure
  void nccl_wait(Request& r);    // the watchdog loop for a request on NCCL
  [[noreturn]] void report_nccl_failure(const Request& r, const std::string& error) const;
  [[noreturn]] void report_nccl_stall(const Request& r) const;
  // A tensor whose storage this Comm's calls can use in place: on cpu, or NCCL's device.
  bool in_place(const Tensor& t) const;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 60.0;
  std::shared_ptr<CollectiveCounts> counts_ = std::make_shared<CollectiveCounts>();
  std::string label_;
  std::shared_ptr<const std::vector<int>> world_ranks_;  // world rank of each rank (null: the identity)
  std::shared_ptr<NcclComm> nccl_;  // null: MPI only
};

}  // namespace ff
