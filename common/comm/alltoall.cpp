// common/comm/alltoall.cpp — the hand-written all-to-alls of alltoall.h (lesson 04).
#include "common/comm/alltoall.h"

#include <cstring>

#include "common/comm/overlap.h"
#include "common/util/trace.h"

namespace ff {

const char* a2a_name(A2A how) {
  return how == A2A::ordered ? "ordered" : how == A2A::async ? "async" : "library";
}

std::vector<size_t> block_offsets(const std::vector<size_t>& bytes) {
  std::vector<size_t> off(bytes.size() + 1, 0);
  for (size_t i = 0; i < bytes.size(); i++) off[i + 1] = off[i] + bytes[i];
  return off;
}

// ordered: in round s = 0..P-1, rank r is paired with q = (s - r) mod P — the pairing is
// symmetric ((s - q) mod P = r), so each round is a set of disjoint pairs, and over the P rounds
// every pair meets exactly once (r + q = s mod P); q == r is the self block, a local copy.
// In each pair the LOWER rank Ssends first and then receives, the higher one receives first:
// each Ssend meets a receive its partner has already posted or is about to post, so a pair
// never waits on itself. Across pairs, a rank stuck in round s waits for a partner that is in a
// round < s, still finishing an earlier pair; following such waits only goes to earlier
// rounds, so it ends — at round 0, which everyone starts in. No cycle, no deadlock, for any P.
void a2a_ordered(Comm& comm, const char* send, const std::vector<size_t>& send_bytes, char* recv,
                 const std::vector<size_t>& recv_bytes, int tag) {
  const int r = comm.rank(), P = comm.size();
  const std::vector<size_t> so = block_offsets(send_bytes), ro = block_offsets(recv_bytes);
  // [slide:a2a-ordered]
  // [slide:a2a-rounds]
  for (int s = 0; s < P; s++) {
    const int q = ((s - r) % P + P) % P;
    if (q == r) {
      if (send_bytes[(size_t)r]) std::memcpy(recv + ro[(size_t)r], send + so[(size_t)r], send_bytes[(size_t)r]);
      continue;
    }
    // [/slide:a2a-rounds]
    // [slide:a2a-pair]
    auto do_send = [&] {
      if (send_bytes[(size_t)q]) comm.ssend(send + so[(size_t)q], send_bytes[(size_t)q], q, tag);
    };
    auto do_recv = [&] {
      if (recv_bytes[(size_t)q]) comm.recv(recv + ro[(size_t)q], recv_bytes[(size_t)q], q, tag);
    };
    if (r < q) do_send(), do_recv();
    else do_recv(), do_send();
    // [/slide:a2a-pair]
  }
  // [/slide]
}

// async: post every receive, then every send, then wait for all of them. MPI orders nothing
// here, so there is nothing to deadlock on; it is the library's job to progress them all.
A2AFlight a2a_start(Comm& comm, const char* send, const std::vector<size_t>& send_bytes, char* recv,
                    const std::vector<size_t>& recv_bytes, int tag) {
  const int r = comm.rank(), P = comm.size();
  const std::vector<size_t> so = block_offsets(send_bytes), ro = block_offsets(recv_bytes);
  // [slide:a2a-async]
  std::vector<Request> reqs;
  for (int q = 0; q < P; q++)
    if (q != r && recv_bytes[(size_t)q])
      reqs.push_back(comm.irecv(recv + ro[(size_t)q], recv_bytes[(size_t)q], q, tag));
  for (int q = 0; q < P; q++)
    if (q != r && send_bytes[(size_t)q])
      reqs.push_back(comm.isend(send + so[(size_t)q], send_bytes[(size_t)q], q, tag));
  if (send_bytes[(size_t)r]) std::memcpy(recv + ro[(size_t)r], send + so[(size_t)r], send_bytes[(size_t)r]);
  // ... and later: comm.wait_all(reqs)
  // [/slide]
  return A2AFlight{std::move(reqs)};
}

bool a2a_test(Comm& comm, A2AFlight& flight) { return comm.test_all(flight.reqs); }

void a2a_finish(Comm& comm, A2AFlight& flight) { comm.wait_all(flight.reqs); }

void a2a_async(Comm& comm, const char* send, const std::vector<size_t>& send_bytes, char* recv,
               const std::vector<size_t>& recv_bytes, int tag) {
  A2AFlight flight = a2a_start(comm, send, send_bytes, recv, recv_bytes, tag);
  // inside a paired forward and backward the other half computes meanwhile, testing these
  // messages between its ops
  overlap::yield([&] { a2a_test(comm, flight); });
  a2a_finish(comm, flight);
}

void all_to_all(Comm& comm, A2A how, const void* send, const std::vector<size_t>& send_bytes,
                void* recv, const std::vector<size_t>& recv_bytes, int tag) {
  Trace::Scope span(trace(), comm.label().empty() ? "all-to-all" : comm.label() + " all-to-all", "comm");
  const char* s = static_cast<const char*>(send);
  char* d = static_cast<char*>(recv);
  // [slide:a2a-three]
  switch (how) {
    case A2A::ordered: a2a_ordered(comm, s, send_bytes, d, recv_bytes, tag); break;
    case A2A::async: a2a_async(comm, s, send_bytes, d, recv_bytes, tag); break;
    case A2A::library: comm.alltoallv(s, send_bytes, d, recv_bytes); break;
  }
  // [/slide]
}

}  // namespace ff
