// common/comm/alltoall.h — the all-to-all written by hand from point-to-point messages
// (taught in lesson 04, reused by lesson 05's flat expert-parallel dispatch).
//
// send holds one block per peer, back to back in rank order, block q of send_bytes[q] bytes;
// recv gets block p (recv_bytes[p] bytes) from every rank p, likewise. Both sides know every
// size beforehand (the routing counts are exchanged first), so a block of 0 bytes is simply
// not sent — and not expected — on both sides.
//   ordered  P rounds of pairwise exchanges with synchronous sends (one of them the copy to
//            itself), the lower rank of each pair sending first;
//   async    every irecv and isend posted at once, then waited;
//   library  MPI_Alltoallv (posted as MPI_Ialltoallv, then the watchdog's wait).
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "common/comm/comm.h"

namespace ff {

enum class A2A { ordered, async, library };
const char* a2a_name(A2A how);

// Prefix sums of block sizes: off[i] = bytes before block i, off[n] = total.
std::vector<size_t> block_offsets(const std::vector<size_t>& bytes);

void a2a_ordered(Comm& comm, const char* send, const std::vector<size_t>& send_bytes, char* recv,
                 const std::vector<size_t>& recv_bytes, int tag);
// (a2a_async is a2a_start then a2a_finish; between the two, inside a paired forward and
// backward (common/comm/overlap.h), the other half of the pair computes.)
void a2a_async(Comm& comm, const char* send, const std::vector<size_t>& send_bytes, char* recv,
               const std::vector<size_t>& recv_bytes, int tag);

// async in two halves, so that compute runs while the blocks are in flight (lesson 06):
// a2a_start posts every receive and every send and copies the block to itself; a2a_test polls
// them once without blocking (Open MPI moves a large message only inside MPI calls, so these
// polls are what progresses it while the caller computes); a2a_finish waits for all of them.
// send and recv belong to the flight until the finish: neither may be touched before it.
struct A2AFlight {
  std::vector<Request> reqs;
};
A2AFlight a2a_start(Comm& comm, const char* send, const std::vector<size_t>& send_bytes, char* recv,
                    const std::vector<size_t>& recv_bytes, int tag);
bool a2a_test(Comm& comm, A2AFlight& flight);
void a2a_finish(Comm& comm, A2AFlight& flight);

// One of the three, as one "all-to-all" span on the comm track of the trace.
void all_to_all(Comm& comm, A2A how, const void* send, const std::vector<size_t>& send_bytes,
                void* recv, const std::vector<size_t>& recv_bytes, int tag);

}  // namespace ff
