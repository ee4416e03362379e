// common/comm/collectives.cpp — the collectives: each one posted, then the same watched wait as a
// point-to-point message, with peer "all"; on NCCL when the communicator has it.
#include "common/comm/comm.h"
#include "common/comm/comm_detail.h"

#include "common/comm/nccl.h"
#include "kernels/bf16.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace ff {

using namespace detail;

// ----------------------------------------------------------------------------
// collectives: post, then the same watched wait, with peer "all"

std::string Comm::op_name(const char* op) const {
  return label_.empty() ? std::string(op) : label_ + " " + op;
}

Request Comm::collective(const char* op, size_t bytes) {
  CollectiveCount& c = (*counts_)[op];
  c.calls++;
  c.bytes += bytes;
  return Request{MPI_REQUEST_NULL, op_name(op), -1, -1, bytes, now_us()};
}

// The NCCL type and operation of an MPI all-reduce; false for what NCCL does not have (a
// user-defined MPI_Op, a derived datatype).
static bool nccl_reduction(MPI_Datatype type, MPI_Op op, NcclComm::Type* t, NcclComm::Op* o) {
  if (type == MPI_UINT16_T && op == Comm::bf16_sum_op()) {
    *t = NcclComm::Type::bf16, *o = NcclComm::Op::sum;
    return true;
  }
  if (type == MPI_FLOAT) *t = NcclComm::Type::f32;
  else if (type == MPI_DOUBLE) *t = NcclComm::Type::f64;
  else if (type == MPI_INT) *t = NcclComm::Type::i32;
  else if (type == MPI_INT64_T || type == MPI_LONG_LONG) *t = NcclComm::Type::i64;
  else return false;
  if (op == MPI_SUM) *o = NcclComm::Op::sum;
  else if (op == MPI_PROD) *o = NcclComm::Op::prod;
  else if (op == MPI_MAX) *o = NcclComm::Op::max;
  else if (op == MPI_MIN) *o = NcclComm::Op::min;
  else return false;
  return true;
}

void Comm::allreduce(void* buf, int count, MPI_Datatype type, MPI_Op op) {
  int type_size = 0;
  mpiCheck(MPI_Type_size(type, &type_size));
  Request r = collective("allreduce", (size_t)count * (size_t)type_size);
  NcclComm::Type nt;
  NcclComm::Op no;
  const bool on_device = to_nccl(buf);
  FF_CHECK(!on_device || nccl_reduction(type, op, &nt, &no),
           "allreduce: a device buffer with a datatype or operation NCCL does not have (a user-defined "
           "MPI_Op, MINLOC, a derived type): copy it to the host first");
  if (on_device) r.nccl = nccl_->allreduce(buf, (size_t)count, nt, no);
  else mpiCheck(MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, op, comm_, &r.req));
  record_blocking(r, wait_one(r));  // one span, as a blocking point-to-point call
}

void Comm::allreduce_sum(float* buf, size_t n) {
  FF_CHECK(n <= (size_t)INT_MAX, "allreduce_sum: " << n << " floats is more than MPI's int count allows");
  allreduce(buf, (int)n, MPI_FLOAT, MPI_SUM);
}

// ---- bf16 sums

static void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; i++) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

MPI_Op Comm::bf16_sum_op() {
  static const MPI_Op op = [] {
    MPI_Op o;
    mpiCheck(MPI_Op_create(&bf16_sum, /*commute=*/1, &o));
    return o;
  }();
  return op;
}

void Comm::allreduce_sum_bf16(uint16_t* buf, size_t n) {
  FF_CHECK(n <= (size_t)INT_MAX, "allreduce_sum_bf16: " << n << " values is more than MPI's int count allows");
  allreduce(buf, (int)n, MPI_UINT16_T, bf16_sum_op());
}

Request Comm::iallreduce_sum_bf16(uint16_t* buf, size_t n) {
  const int count = to_count(n * 2, "iallreduce") / 2;
  Request r = collective("allreduce", n * 2);
  if (to_nccl(buf)) r.nccl = nccl_->allreduce(buf, n, NcclComm::Type::bf16, NcclComm::Op::sum);
  else mpiCheck(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_UINT16_T, bf16_sum_op(), comm_, &r.req));
  link_collective(r, 2 * (size_ - 1), n * 2 / (size_t)size_);
  return r;
}

Request Comm::ireduce_scatter_sum_bf16(const uint16_t* send, uint16_t* recv, size_t count) {
  to_count(count * (size_t)size_ * 2, "ireduce_scatter");
  Request r = collective("reduce_scatter", count * (size_t)size_ * 2);
  auto counts = std::make_shared<std::vector<int>>((size_t)size_, (int)count);
  if (to_nccl(send, recv)) r.nccl = nccl_->reduce_scatter_sum_bf16(send, recv, count);
  else mpiCheck(MPI_Ireduce_scatter(send, recv, counts->data(), MPI_UINT16_T, bf16_sum_op(), comm_, &r.req));
  r.keep = counts;
  link_collective(r, size_ - 1, count * 2);
  return r;
}

void Comm::allgather(const void* send, size_t bytes, void* recv) {
  int n = to_count(bytes, "allgather");
  to_count(bytes * (size_t)size_, "allgather");
  Request r = collective("allgather", bytes * (size_t)size_);
  // Our own block already in place in recv: MPI forbids the aliasing, MPI_IN_PLACE says it.
  const void* s = send == static_cast<char*>(recv) + (size_t)rank_ * bytes ? MPI_IN_PLACE : send;
  if (to_nccl(send, recv)) r.nccl = nccl_->allgather(send, bytes, recv);
  else mpiCheck(MPI_Iallgather(s, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r.req));
  record_blocking(r, wait_one(r));
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
  if (to_nccl(send, recv)) r.nccl = nccl_->allgatherv(send, bytes, recv, recv_bytes);
  else mpiCheck(MPI_Iallgatherv(s, counts[rank_], MPI_BYTE, recv, counts.data(), displs.data(), MPI_BYTE,
                           comm_, &r.req));
  record_blocking(r, wait_one(r));
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
  if (to_nccl(send, recv)) r.nccl = nccl_->reduce_scatter_sum(send, recv, counts);
  else mpiCheck(MPI_Ireduce_scatter(send, recv, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &r.req));
  record_blocking(r, wait_one(r));
}

Request Comm::iallreduce_sum(float* buf, size_t n) {
  const int count = to_count(n * sizeof(float), "iallreduce") / (int)sizeof(float);
  Request r = collective("allreduce", n * sizeof(float));
  if (to_nccl(buf)) r.nccl = nccl_->allreduce(buf, n, NcclComm::Type::f32, NcclComm::Op::sum);
  else mpiCheck(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, comm_, &r.req));
  link_collective(r, 2 * (size_ - 1), n * sizeof(float) / (size_t)size_);
  return r;
}

Request Comm::ireduce_scatter_sum(const float* send, float* recv, size_t count) {
  to_count(count * (size_t)size_ * sizeof(float), "ireduce_scatter");
  Request r = collective("reduce_scatter", count * (size_t)size_ * sizeof(float));
  // MPI_Ireduce_scatter with equal counts, not _block: the very call the blocking
  // reduce_scatter_sum posts (then waits on), so the two sum in the same order, bit for bit.
  // (Open MPI's blocking MPI_Reduce_scatter may sum in another order for P >= 3.)
  auto counts = std::make_shared<std::vector<int>>((size_t)size_, (int)count);
  if (to_nccl(send, recv)) r.nccl = nccl_->reduce_scatter_sum(send, recv, *counts);
  else mpiCheck(MPI_Ireduce_scatter(send, recv, counts->data(), MPI_FLOAT, MPI_SUM, comm_, &r.req));
  r.keep = counts;
  link_collective(r, size_ - 1, count * sizeof(float));
  return r;
}

Request Comm::iallgather(const void* send, size_t bytes, void* recv) {
  const int n = to_count(bytes, "iallgather");
  to_count(bytes * (size_t)size_, "iallgather");
  Request r = collective("allgather", bytes * (size_t)size_);
  const void* s = send == static_cast<char*>(recv) + (size_t)rank_ * bytes ? MPI_IN_PLACE : send;
  if (to_nccl(send, recv)) r.nccl = nccl_->allgather(send, bytes, recv);
  else mpiCheck(MPI_Iallgather(s, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r.req));
  link_collective(r, size_ - 1, bytes);
  return r;
}

void Comm::bcast(void* buf, size_t bytes, int root) {
  Request r = collective("bcast", bytes);
  to_count(bytes, "bcast");
  if (to_nccl(buf)) r.nccl = nccl_->bcast(buf, bytes, root);
  else mpiCheck(MPI_Ibcast(buf, to_count(bytes, "bcast"), MPI_BYTE, root, comm_, &r.req));
  record_blocking(r, wait_one(r));
}

void Comm::barrier() {
  Request r = collective("barrier", 0);
  mpiCheck(MPI_Ibarrier(comm_, &r.req));
  record_blocking(r, wait_one(r));
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
  if (to_nccl(send, recv)) r.nccl = nccl_->alltoallv(send, send_bytes, recv, recv_bytes);
  else mpiCheck(MPI_Ialltoallv(send, scounts.data(), sdispls.data(), MPI_BYTE, recv, rcounts.data(),
                          rdispls.data(), MPI_BYTE, comm_, &r.req));
  record_blocking(r, wait_one(r));
}


}  // namespace ff
