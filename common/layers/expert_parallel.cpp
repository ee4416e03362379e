// common/layers/expert_parallel.cpp — routes and row exchange of expert_parallel.h.
#include "common/layers/expert_parallel.h"

#include <cmath>

#include "common/core/ops.h"

namespace ff::ep {

int64_t Routes::rows_to(int q) const {
  // [exercise:rows-to] How many rows this rank sends to rank q in the dispatch: its block of the all-to-all's send layout.
  int64_t n = 0;
  for (int64_t e = q * E; e < (q + 1) * E; e++) n += counts[(size_t)rank][(size_t)e];
  return n;
  // [/exercise]
}

int64_t Routes::rows_from(int p) const {
  int64_t n = 0;
  for (int64_t e = rank * E; e < (rank + 1) * E; e++) n += counts[(size_t)p][(size_t)e];
  return n;
}

std::vector<size_t> Routes::bytes(bool to, int64_t width, size_t elem) const {
  std::vector<size_t> b((size_t)P);
  for (int q = 0; q < P; q++)
    b[(size_t)q] = (size_t)((to ? rows_to(q) : rows_from(q)) * width) * elem;
  return b;
}

// [slide:regroup-order]
std::vector<int64_t> Routes::regroup_order() const {
  // [exercise:regroup-order] The received rows come grouped by source rank, then expert; return the order that groups them by expert, then source.
  // [slide:regroup-order-short]
  std::vector<int64_t> start((size_t)(P * E));  // first received row of (source p, expert e)
  int64_t row = 0;
  for (int p = 0; p < P; p++)
    for (int64_t e = 0; e < E; e++) {
      start[(size_t)(p * E + e)] = row;
      row += counts[(size_t)p][(size_t)(rank * E + e)];
    }
  std::vector<int64_t> order;
  for (int64_t e = 0; e < E; e++)
    for (int p = 0; p < P; p++)
      for (int64_t i = 0; i < counts[(size_t)p][(size_t)(rank * E + e)]; i++)
        order.push_back(start[(size_t)(p * E + e)] + i);
  return order;
  // [/slide:regroup-order-short]
  // [/exercise]
}
// [/slide]

std::vector<int64_t> Routes::local_group_sizes() const {
  std::vector<int64_t> g((size_t)E, 0);
  for (int p = 0; p < P; p++)
    for (int64_t e = 0; e < E; e++) g[(size_t)e] += counts[(size_t)p][(size_t)(rank * E + e)];
  return g;
}

Routes routes_from_counts(int P, int rank, int64_t N, std::vector<std::vector<int64_t>> counts) {
  Routes R;
  R.P = P, R.rank = rank, R.N = N, R.E = N / P;
  R.counts = std::move(counts);
  return R;
}

Routes gather_routes(Comm& comm, const std::vector<int64_t>& mine, int64_t N, bool nonblocking) {
  const int P = comm.size();
  std::vector<int64_t> all((size_t)(P * N));
  if (nonblocking) {
    Request r = comm.iallgather(mine.data(), (size_t)N * sizeof(int64_t), all.data());
    comm.wait(r);
  } else {
    comm.allgather(mine.data(), (size_t)N * sizeof(int64_t), all.data());
  }
  std::vector<std::vector<int64_t>> counts((size_t)P);
  for (int p = 0; p < P; p++) counts[(size_t)p].assign(all.begin() + p * N, all.begin() + (p + 1) * N);
  return routes_from_counts(P, comm.rank(), N, std::move(counts));
}

Tensor exchange_rows(Comm& comm, A2A how, const Tensor& rows, const std::vector<size_t>& sb,
                     const std::vector<size_t>& rb, int64_t width, int tag) {
  std::vector<float> send = rows.to_vector();
  size_t total = 0;
  for (size_t b : rb) total += b / sizeof(float);
  std::vector<float> recv(total);
  all_to_all(comm, how, send.data(), sb, recv.data(), rb, tag);
  return Tensor::from_vector(recv, {(int64_t)(total / (size_t)width), width}, rows.device());
}

Tensor exchange_rows_bf16(Comm& comm, A2A how, const Tensor& rows, const std::vector<size_t>& sb,
                          const std::vector<size_t>& rb, int64_t width, int tag) {
  const Tensor send = rows.to_dtype(DType::bf16).to(Device::cpu);
  size_t total = 0;
  for (size_t b : rb) total += b / sizeof(uint16_t);
  Tensor recv = Tensor::empty({(int64_t)(total / (size_t)width), width}, Device::cpu, DType::bf16);
  all_to_all(comm, how, send.raw(), sb, recv.raw(), rb, tag);
  return recv.to_dtype(DType::f32).to(rows.device());
}

// [slide:row-flight]
RowFlight exchange_rows_start(Comm& comm, const Tensor& rows, const std::vector<size_t>& sb,
                              const std::vector<size_t>& rb, int64_t width, int tag) {
  RowFlight f;
  f.send = rows.to_vector();
  size_t total = 0;
  for (size_t b : rb) total += b / sizeof(float);
  f.staged.resize(total);
  f.out = Tensor::full({(int64_t)(total / (size_t)width), width}, NAN, rows.device());
  f.a2a = a2a_start(comm, reinterpret_cast<const char*>(f.send.data()), sb,
                    reinterpret_cast<char*>(f.staged.data()), rb, tag);
  return f;
}
// [/slide:row-flight]

bool exchange_rows_test(Comm& comm, RowFlight& f) { return a2a_test(comm, f.a2a); }

// [slide:row-finish]
Tensor exchange_rows_finish(Comm& comm, RowFlight& f) {
  a2a_finish(comm, f.a2a);
  f.out.copy_from(Tensor::from_vector(f.staged, f.out.shape(), f.out.device()));
  return f.out;
}
// [/slide]

Tensor take_rows(const Tensor& t, const std::vector<int64_t>& order) {
  if (order.empty()) return Tensor::empty({0, t.size(1)}, t.device());
  return index_select(t, Tensor::from_indices(order, {(int64_t)order.size()}, t.device()));
}

Tensor put_rows(const Tensor& t, const std::vector<int64_t>& order) {
  std::vector<int64_t> inv(order.size());
  for (size_t i = 0; i < order.size(); i++) inv[(size_t)order[i]] = (int64_t)i;
  return take_rows(t, inv);
}

}  // namespace ff::ep
