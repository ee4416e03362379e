// common/comm/watchdog.cpp — Comm's waits: every wait polls against a deadline (the
// watchdog), so a deadlock ends as one error: line naming rank, operation, peer, tag and bytes;
// and the trace's records of what a rank sat blocked on and of the messages in flight.
#include "common/comm/comm.h"
#include "common/comm/comm_detail.h"

#include "common/comm/nccl.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace ff {

using namespace detail;

// ----------------------------------------------------------------------------
// the watchdog
//
// Every wait polls MPI_Test (or MPI_Testsome) and, between polls that find nothing done,
// pauses as the wait policy says. Why two policies: a small message completes in a few
// microseconds, so a wait should cost about that — but only a rank that keeps polling sees
// it then. With a core per rank, polling flat out costs nobody anything, and any sleep
// costs its wake-up latency (50 us asked, ~100 us got, whenever the first quick polls miss:
// lesson 04's 64-byte all-to-alls, ~2 us each, measured at 2.3x to 285x MPI_Alltoallv
// between runs). With ranks sharing cores (up to 32 on 2 here), a spinning rank steals the
// core from the very peer it waits for, and yielding and sleeping are what let it run.
//   spin  (each rank has a core): poll flat out, with a pause instruction, for kSpinS; a
//         wait longer than that is waiting on the peer's work, not on the message, and
//         goes on as below.
//   sleep (oversubscribed): kQuickPolls polls that yield the core, then sleeps.
// The sleeps start at 50 us and grow with the time already waited (1% of it, at most
// 1 ms), so a rank stuck for long costs ~1% of a core while a short wait still reacts
// within ~0.1 ms.
// With the link model, a wait may also hold requests MPI has completed whose modelled time
// has not come yet. No sleep goes past the earliest such time; and once MPI has nothing left
// pending, the wait sleeps until kModelSpinS before that time (a sleep overshoots by some
// 50 us), then polls the clock as above for the rest, so a modelled wait costs next to no CPU.
static constexpr double kSpinS = 2e-3;
static constexpr int kQuickPolls = 16;
static constexpr double kMinSleepS = 50e-6, kMaxSleepS = 1e-3, kSleepFraction = 0.01;
static constexpr double kModelSpinS = 100e-6;

// Tells the core this is a spin-wait loop (saves power, frees the pipeline for a sibling
// hyperthread); one instruction, no system call.
static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The pauses of one wait, and its deadline.
class Backoff {
 public:
  explicit Backoff(double timeout_s) : timeout_s_(timeout_s), start_s_(link_now_s()) {}
  // Called after a poll that found nothing new done; false once the deadline has passed.
  // due_s: the earliest modelled completion among the wait's requests MPI has completed
  // (infinity: none); mpi_pending: whether MPI still has some of them pending.
  bool pause(double due_s = kNever, bool mpi_pending = true) {
    nccl::progress_emulated();  // a GPU's streams run whatever this wait is for; sim's move here
    const double now = link_now_s(), waited = now - start_s_;
    if (waited > timeout_s_) return false;
    const double to_due = due_s - now, to_deadline = timeout_s_ - waited;
    if (!mpi_pending) {  // only the model's clock to wait for
      if (to_due > kModelSpinS)
        sleep(std::min(to_due - kModelSpinS, to_deadline + kMinSleepS));
      else if (Comm::wait_policy().spin)
        cpu_relax();
      else
        std::this_thread::yield();
    } else if (Comm::wait_policy().spin && waited < kSpinS) {
      cpu_relax();
    } else if (!Comm::wait_policy().spin && polls_++ < kQuickPolls) {
      std::this_thread::yield();
    } else {
      sleep(std::min({kMaxSleepS, std::max(kMinSleepS, kSleepFraction * waited), std::max(0.0, to_due)}));
    }
    return true;
  }
  double waited() const { return link_now_s() - start_s_; }
  static constexpr double kNever = 1e300;

 private:
  static void sleep(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }
  double timeout_s_;
  double start_s_;
  int polls_ = 0;
};

// r's peer and tag as the watchdog names them. Collectives carry peer -1 and no tag; a
// receive may name a wildcard.
static void name_peer_and_tag(const Request& r, char (&peer)[32], char (&tag)[32]) {
  if (r.is_recv && r.peer == MPI_ANY_SOURCE) std::snprintf(peer, sizeof peer, "any");
  else if (r.peer < 0) std::snprintf(peer, sizeof peer, "all");
  else std::snprintf(peer, sizeof peer, "%d", r.peer);
  if (r.is_recv && r.tag == MPI_ANY_TAG) std::snprintf(tag, sizeof tag, "any");
  else if (r.peer < 0 && !r.is_recv) std::snprintf(tag, sizeof tag, "-");
  else std::snprintf(tag, sizeof tag, "%d", r.tag);
}

// The watchdog's line, on MPI and on NCCL alike.
void Comm::say_no_progress(const Request& r) const {
  char peer[32], tag[32];
  name_peer_and_tag(r, peer, tag);
  std::fprintf(stderr,
               "error: rank %d: no progress for %g s in %s with peer %s (tag %s, %zu bytes) "
               "— likely deadlock\n",
               rank_, timeout_s_, r.op.c_str(), peer, tag, r.bytes);
  std::fflush(stderr);
}

[[noreturn]] void Comm::report_deadlock(const Request& r) const {
  say_no_progress(r);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// The watchdog's deadline passed while MPI had completed r but the link model still held it:
// no deadlock, a modelled time longer than the timeout.
[[noreturn]] void Comm::report_link_overrun(const Request& r, double waited_s) const {
  char peer[32], tag[32];
  name_peer_and_tag(r, peer, tag);
  std::fprintf(stderr,
               "error: rank %d: %s with peer %s (tag %s, %zu bytes) is modelled to complete %g s "
               "after its wait began, past the timeout of %g s — raise the timeout or the "
               "modelled bandwidth\n",
               rank_, r.op.c_str(), peer, tag, r.bytes, waited_s + (r.link_done_s - link_now_s()),
               timeout_s_);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// A receive must get exactly the bytes it asked for: MPI accepts shorter messages, which
// would leave the tail of the buffer stale without anyone noticing.
static void check_received(const Request& r, const MPI_Status& status, int rank) {
  if (!r.is_recv || status.MPI_SOURCE == MPI_PROC_NULL) return;
  int got = 0;
  mpiCheck(MPI_Get_count(&status, MPI_BYTE, &got));
  FF_CHECK((size_t)got == r.bytes, r.op << " on rank " << rank << " from rank " << status.MPI_SOURCE
                                        << " (tag " << status.MPI_TAG << "): expected " << r.bytes
                                        << " bytes, got " << got);
}

MPI_Status Comm::wait_one(Request& r) {
  MPI_Status status;
  std::memset(&status, 0, sizeof status);
  status.MPI_SOURCE = MPI_PROC_NULL;
  if (r.nccl) {
    nccl_wait(r);
    return status;
  }
  Backoff backoff(timeout_s_);
  if (r.arrived) {  // Comm::test saw it complete in MPI (and told the model)
    status = r.status;
    r.arrived = false;
  } else {
    if (r.req == MPI_REQUEST_NULL) return status;  // already completed (or never posted)
    for (;;) {
      int done = 0;
      mpiCheck(MPI_Test(&r.req, &done, &status));
      if (done) break;
      if (!backoff.pause()) report_deadlock(r);
    }
    check_received(r, status, rank_);
    link_arrived(r, status);
  }
  while (!link_due(r, link_now_s()))
    if (!backoff.pause(r.link_done_s, /*mpi_pending=*/false)) report_link_overrun(r, backoff.waited());
  return status;
}

// ---- the watchdog on NCCL: the launch's event polled against the same deadline; on expiry the
// same line as for MPI, then ncclCommAbort (so that no kernel of it keeps the GPU busy) and
// MPI_Abort. The line comes first and the abort is bounded: ncclCommAbort can itself block.

// Aborts r's NCCL communicator from a second thread, giving it up to 2 s, then ends the job.
[[noreturn]] static void nccl_abort_and_exit(const Request& r) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<NcclTicket> t = r.nccl;
  std::thread([t, done] {
    NcclComm::abort(t);
    done->store(true);
  }).detach();
  for (int i = 0; i < 200 && !done->load(); i++) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void Comm::report_nccl_failure(const Request& r, const std::string& error) const {
  char peer[32], tag[32];
  name_peer_and_tag(r, peer, tag);
  std::fprintf(stderr, "error: rank %d: NCCL failed in %s with peer %s (%zu bytes): %s\n", rank_,
               r.op.c_str(), peer, r.bytes, error.c_str());
  std::fflush(stderr);
  nccl_abort_and_exit(r);
}

void Comm::report_nccl_stall(const Request& r) const {
  say_no_progress(r);
  nccl_abort_and_exit(r);
}

bool Comm::nccl_test(Request& r) {
  std::string error;
  switch (NcclComm::poll(r.nccl, &error)) {
    case NcclState::done: return true;
    case NcclState::pending: return false;
    case NcclState::stalled: report_nccl_stall(r);
    case NcclState::failed: report_nccl_failure(r, error);
  }
  return false;
}

void Comm::nccl_wait(Request& r) {
  Backoff backoff(timeout_s_);
  while (!nccl_test(r))
    if (!backoff.pause()) report_nccl_stall(r);
  r.nccl.reset();  // retired
}

bool Comm::test(Request& r) {
  if (r.nccl) {
    if (!nccl_test(r)) return false;
    if (r.done_us < 0) r.done_us = now_us();
    return true;  // a wait retires it
  }
  if (r.req != MPI_REQUEST_NULL) {
    int done = 0;
    MPI_Status status;
    std::memset(&status, 0, sizeof status);
    mpiCheck(MPI_Test(&r.req, &done, &status));
    if (!done) return false;
    check_received(r, status, rank_);
    link_arrived(r, status);
    r.arrived = true;
    r.status = status;
  } else if (!r.arrived) {
    return true;  // retired by a wait already (or never posted)
  }
  if (!link_due(r, link_now_s())) return false;
  if (r.done_us < 0) r.done_us = now_us();
  return true;
}

bool Comm::test_all(std::vector<Request>& rs) {
  bool all = true;
  for (Request& r : rs) all = test(r) && all;  // test every one: each poll may move data
  return all;
}

// ----------------------------------------------------------------------------
// trace records (see comm.h): blocking calls are spans, requests are flights plus the span
// of the wait that sat blocked on them

// r as a trace record [start, end): peer and tag as the completed status says for a receive
// that named a wildcard; peer "all" and no tag for a collective (peer -1, not a receive).
Span detail::comm_record(const std::string& name, const Request& r, const MPI_Status* status,
                        double start, double end, SpanKind kind) {
  Span s;
  s.name = name;
  s.stream = "comm";
  s.start_us = start;
  s.end_us = end;
  s.bytes = (int64_t)r.bytes;
  s.kind = kind;
  if (!r.is_recv && r.peer == -1) {
    s.peer = Span::kAllRanks;
    return s;
  }
  const bool got = r.is_recv && status && status->MPI_SOURCE != MPI_PROC_NULL;
  s.peer = got && r.peer == MPI_ANY_SOURCE ? status->MPI_SOURCE : r.peer;
  s.tag = got && r.tag == MPI_ANY_TAG ? status->MPI_TAG : r.tag;
  return s;
}

// A blocking call: one span, from its post to its return.
void detail::record_blocking(const Request& r, const MPI_Status& status) {
  if (trace().enabled()) trace().add(comm_record(r.op, r, &status, r.start_us, now_us(), SpanKind::span));
}

// A flight ends where it was first seen done (by test() or by this wait).
static double flight_end(const Request& r, double now) { return r.done_us >= 0 ? r.done_us : now; }

void Comm::wait(Request& r) {
  if (r.req == MPI_REQUEST_NULL && !r.arrived && !r.nccl) return;
  const double entered = trace().enabled() ? now_us() : 0.0;
  MPI_Status status = wait_one(r);
  if (!trace().enabled()) return;
  const double done = now_us();
  trace().add(comm_record(r.op, r, &status, r.start_us, flight_end(r, done), SpanKind::flight));
  trace().add(comm_record("wait " + r.op, r, &status, entered, done, SpanKind::span));
}

void Comm::wait_all(std::vector<Request>& rs) {
  // Requests on NCCL: one at a time, after those on MPI (which move only while this rank is
  // in MPI calls; NCCL's move on the GPU whatever this rank does).
  if (std::any_of(rs.begin(), rs.end(), [](const Request& r) { return r.nccl != nullptr; })) {
    for (Request& r : rs)  // launched first: a peer may need them before it answers on MPI
      if (r.nccl) NcclComm::launch(r.nccl);
    for (int pass = 0; pass < 2; pass++)
      for (Request& r : rs)
        if ((r.nccl != nullptr) == (pass == 1)) wait(r);
    return;
  }
  std::vector<MPI_Request> handles;  // the pending requests, for MPI_Testsome
  std::vector<size_t> where;         // handles[i] is rs[where[i]].req
  // Completed in MPI, not yet in the link model: (index in rs, its status). Requests test()
  // saw complete start here.
  std::vector<std::pair<size_t, MPI_Status>> held;
  std::vector<size_t> mine;          // every request this wait retires, in rs's order
  for (size_t i = 0; i < rs.size(); i++) {
    if (rs[i].req != MPI_REQUEST_NULL) {
      handles.push_back(rs[i].req);
      where.push_back(i);
    } else if (rs[i].arrived) {
      held.emplace_back(i, rs[i].status);
      rs[i].arrived = false;
    } else {
      continue;
    }
    mine.push_back(i);
  }
  if (mine.empty()) return;
  const bool tracing = trace().enabled();
  const double entered = tracing ? now_us() : 0.0;
  const int n = (int)handles.size();
  std::vector<int> indices((size_t)n);
  std::vector<MPI_Status> statuses((size_t)n);
  Backoff backoff(timeout_s_);
  for (int left = n; left > 0 || !held.empty();) {
    int count = 0;
    if (left > 0) {
      mpiCheck(MPI_Testsome(n, handles.data(), &count, indices.data(), statuses.data()));
      if (count == MPI_UNDEFINED) count = 0, left = 0;  // (cannot happen while some are pending)
    }
    for (int k = 0; k < count; k++) rs[where[indices[k]]].req = MPI_REQUEST_NULL;
    for (int k = 0; k < count; k++) {
      Request& r = rs[where[indices[k]]];
      check_received(r, statuses[k], rank_);
      link_arrived(r, statuses[k]);
      held.emplace_back(where[indices[k]], statuses[k]);
    }
    left -= count;
    // Each flight ends when its wait sees it done in MPI and in the model.
    const double now_s = link_now_s(), done = tracing ? now_us() : 0.0;
    size_t kept = 0;
    for (auto& h : held) {
      const Request& r = rs[h.first];
      if (!link_due(r, now_s)) {
        held[kept++] = h;
      } else if (tracing) {
        trace().add(comm_record(r.op, r, &h.second, r.start_us, flight_end(r, done), SpanKind::flight));
      }
    }
    const bool finished_some = kept < held.size();
    held.resize(kept);
    if (count > 0 || finished_some) continue;
    double due = Backoff::kNever;  // the earliest modelled completion of those held
    for (const auto& h : held) due = std::min(due, rs[h.first].link_done_s);
    if (backoff.pause(due, left > 0)) continue;
    for (int i = 0; i < n; i++)  // the first one, in the caller's order, still pending in MPI
      if (handles[(size_t)i] != MPI_REQUEST_NULL) report_deadlock(rs[where[(size_t)i]]);
    report_link_overrun(rs[held.front().first], backoff.waited());
  }
  if (!tracing) return;
  // The blocked time, one span: bytes of all the requests; peer and tag where they agree.
  Span s;
  s.name = op_name("wait_all");
  s.stream = "comm";
  s.start_us = entered;
  s.end_us = now_us();
  s.peer = rs[mine[0]].peer;
  s.tag = rs[mine[0]].tag;
  for (size_t i : mine) {
    const Request& r = rs[i];
    s.bytes += (int64_t)r.bytes;
    if (r.peer != s.peer || r.peer < 0) s.peer = Span::kNoPeer;
    if (r.tag != s.tag || r.tag < 0) s.tag = Span::kNoTag;
  }
  trace().add(std::move(s));
}


}  // namespace ff
