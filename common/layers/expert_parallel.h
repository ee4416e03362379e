// common/layers/expert_parallel.h — what expert parallelism needs besides the layer: the
// routes (who sends which rows to whom, from the routing counts of every rank) and moving rows
// of a tensor through an all-to-all. Taught in lesson 04; lesson 05 reuses it.
#pragma once
#include <cstdint>
#include <vector>

#include "common/comm/alltoall.h"
#include "common/core/tensor.h"

namespace ff::ep {

// counts[p][e] = routing slots of rank p that chose expert e; rank q holds experts
// [q E, (q+1) E). Every rank holds the same counts (one allgather), so both sides of every
// message know its size.
struct Routes {
  int P = 1, rank = 0;
  int64_t N = 0, E = 0;                      // experts in all, per rank
  std::vector<std::vector<int64_t>> counts;  // [P][N]
  int64_t rows_to(int q) const;              // rows this rank sends to rank q
  int64_t rows_from(int p) const;            // rows this rank receives from rank p
  // Bytes per peer of rows `width` numbers wide, `elem` bytes each (float32's 4, bf16's 2): to =
  // what this rank sends, else what it receives.
  std::vector<size_t> bytes(bool to, int64_t width, size_t elem = sizeof(float)) const;
  // The received rows arrive grouped by source, each source's rows sorted by local expert.
  // The experts want them grouped by local expert: for expert e, source 0's rows of e, then
  // source 1's, ... order[i] = the received row that becomes local packed row i.
  std::vector<int64_t> regroup_order() const;
  std::vector<int64_t> local_group_sizes() const;  // rows per local expert
};
// The routes from this rank's per-expert counts (the first N entries of `mine`): one allgather.
// nonblocking: the all-gather posted and waited on at once (Comm's link model times the
// non-blocking collectives only: lesson 09's decode under --link).
Routes gather_routes(Comm& comm, const std::vector<int64_t>& mine, int64_t N, bool nonblocking = false);
// The routes from every rank's counts, when each rank can work them out alone (lesson 05's
// routing map holds every rank's choices, so no allgather of counts is needed).
Routes routes_from_counts(int P, int rank, int64_t N, std::vector<std::vector<int64_t>> counts);

// Rows (n, width) of a device tensor through an all-to-all; returns the received rows.
Tensor exchange_rows(Comm& comm, A2A how, const Tensor& rows, const std::vector<size_t>& send_bytes,
                     const std::vector<size_t>& recv_bytes, int64_t width, int tag);
// The same for float32 rows that travel rounded to bf16 (2 bytes a number; the byte counts are
// bf16's) and arrive widened to float32: for rows a bf16 GEMM reads, which rounds them anyway.
Tensor exchange_rows_bf16(Comm& comm, A2A how, const Tensor& rows, const std::vector<size_t>& send_bytes,
                          const std::vector<size_t>& recv_bytes, int64_t width, int tag);

// exchange_rows (async) in two halves, for a lesson that computes while the rows travel
// (lesson 06). The rows leave at the start; what arrives lands in a staging buffer, and `out`
// — filled with NaN at the start — gets it only at the finish, as a GPU kernel's output is not
// there before its event: compute that reads `out` before the finish reads NaN every time,
// whatever the network did. A RowFlight may be moved, not copied, while in flight.
struct RowFlight {
  std::vector<float> send, staged;
  A2AFlight a2a;
  Tensor out;  // (received rows, width) on the rows' device; valid after the finish
};
RowFlight exchange_rows_start(Comm& comm, const Tensor& rows, const std::vector<size_t>& send_bytes,
                              const std::vector<size_t>& recv_bytes, int64_t width, int tag);
bool exchange_rows_test(Comm& comm, RowFlight& flight);  // polls once: true when all arrived
Tensor exchange_rows_finish(Comm& comm, RowFlight& flight);

// Rows of t in the order `order` (a gather); and the inverse scatter.
Tensor take_rows(const Tensor& t, const std::vector<int64_t>& order);
Tensor put_rows(const Tensor& t, const std::vector<int64_t>& order);

}  // namespace ff::ep
