// lessons/09_inference/moe_decode.cpp — the decode step's MoE over expert-parallel ranks
// (moe_decode.h).
#include "lessons/09_inference/moe_decode.h"

#include <algorithm>

#include "common/comm/alltoall.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/tensor_parallel.h"
#include "common/lesson/lesson.h"
#include "common/util/trace.h"

namespace ff::infer {

const char* moe_comm_name(MoeComm m) { return m == MoeComm::allreduce ? "allreduce" : "alltoall"; }

dsv3::Params moe_shard(const dsv3::Params& p, int r, int P) {
  dsv3::Params mine = p;
  if (p.sw1.defined()) {
    mine.sw1 = tp::column_shard(p.sw1, r, P);
    mine.sw3 = tp::column_shard(p.sw3, r, P);
    mine.sw2 = tp::row_shard(p.sw2, r, P);
  }
  return mine;
}

Routed route(const dsv3::Config& c, const dsv3::Params& p, const Tensor& x) {
  const int64_t T = x.size(0);
  const Tensor s = dsv3::affinities(c, p, x);
  const dsv3::Selection sel = dsv3::select(c, s, p.bias);
  const dsv3::Assignment a = dsv3::assign_capacity(c, s.to_vector(), p.bias.to_vector(), sel.idx.to_index_vector(),
                                                   sel.kept_groups.to_index_vector(), T);
  Routed r;
  r.gates = dsv3::gates(c, s, Tensor::from_indices(a.idx, {T, c.topk}, x.device()));
  r.plan = moe::permute_plan(dsv3::plan_ids(c, a.idx, a.kept, 0, T, x.device()), c.experts + 1);
  return r;
}

namespace {

Tensor decode_allreduce(Comm& comm, const dsv3::Config& c, const dsv3::Params& mine, const Tensor& u,
                        double* comm_s) {
  const int64_t T = u.size(0), K = c.topk, d = u.size(1), E = mine.w1.size(0);
  const int64_t e0 = comm.rank() * E;
  const Routed r = route(c, mine, u);
  // the packed slots of this rank's experts, [rows before e0, rows of e0..e0+E): computed;
  // every other slot's output stays zero
  const std::vector<int64_t> sizes = r.plan.group_sizes.to_index_vector();
  int64_t before = 0, here = 0;
  for (int64_t e = 0; e < e0; e++) before += sizes[(size_t)e];
  std::vector<int64_t> local(sizes.begin() + e0, sizes.begin() + e0 + E);
  for (int64_t n : local) here += n;
  // [slide:ar-core]
  const Tensor xp = moe::permute(u, r.plan);
  moe::ExpertCache cache;
  const Tensor yl = moe::experts_forward(dsv3::routed(mine), slice(xp, 0, before, before + here),
                                         Tensor::from_indices(local, {E}, u.device()), &cache);
  std::vector<Tensor> parts;
  if (before > 0) parts.push_back(Tensor::zeros({before, d}, u.device()));
  parts.push_back(yl);
  if (T * K - before - here > 0) parts.push_back(Tensor::zeros({T * K - before - here, d}, u.device()));
  Tensor y = moe::combine(concat(parts, 0), r.plan, r.gates);
  if (mine.sw1.defined()) y = add(y, dsv3::shared_forward(mine, u, &cache));  // this rank's columns
  // [/slide]
  return allreduce_timed(comm, y, comm_s);
}

Tensor decode_alltoall(Comm& comm, const dsv3::Config& c, const dsv3::Params& mine, const Tensor& u,
                       double* comm_s) {
  const int P = comm.size(), me = comm.rank();
  const int64_t B = u.size(0), d = u.size(1), N = c.experts;
  const Device dev = u.device();
  int64_t b0 = 0, b1 = 0;
  split_range(B, P, me, &b0, &b1);  // this rank's rows
  const Tensor x = slice(u, 0, b0, b1);
  // route this rank's rows (none when B < P: it still takes part in every exchange)
  Routed r;
  std::vector<int64_t> sizes((size_t)N, 0);
  Tensor xk = Tensor::zeros({0, d}, dev);
  if (b1 > b0) {
    r = route(c, mine, x);
    sizes = r.plan.group_sizes.to_index_vector();
    sizes.resize((size_t)N);  // the last group holds dropped slots: none at inference
    int64_t kept = 0;
    for (int64_t n : sizes) kept += n;
    xk = slice(moe::permute(x, r.plan), 0, 0, kept);  // slots sorted by expert: a block per rank
  }
  // the counts per expert of every rank (lesson 04's routing map), then dispatch, the experts, combine
  Stopwatch watch;
  const ep::Routes R = ep::gather_routes(comm, sizes, N, /*nonblocking=*/true);
  // [slide:a2a-core]
  const Tensor recv = ep::exchange_rows(comm, A2A::async, xk, R.bytes(true, d), R.bytes(false, d), d, 1);
  double moved = watch.seconds();
  const std::vector<int64_t> order = R.regroup_order(), gl = R.local_group_sizes();
  moe::ExpertCache cache;
  const Tensor yl = moe::experts_forward(dsv3::routed(mine), ep::take_rows(recv, order),
                                         Tensor::from_indices(gl, {(int64_t)gl.size()}, dev), &cache);
  watch = Stopwatch();
  const Tensor back = ep::exchange_rows(comm, A2A::async, ep::put_rows(yl, order), R.bytes(false, d),
                                        R.bytes(true, d), d, 2);
  moved += watch.seconds();
  // [/slide]
  Tensor y_own = Tensor::zeros({b1 - b0, d}, dev);
  if (b1 > b0) {
    y_own = moe::combine(back, r.plan, r.gates);
    if (mine.sw1.defined()) y_own = add(y_own, dsv3::shared_forward(mine, x, &cache));
  }
  // every rank needs every row for the next attention: all-gather them (blocks of the largest
  // share, ceil(B / P) rows, the shorter ones padded)
  watch = Stopwatch();
  const int64_t block = (B + P - 1) / P;
  std::vector<float> own((size_t)(block * d), 0.f), all((size_t)(P * block * d));
  const std::vector<float> mine_rows = y_own.to_vector();
  std::copy(mine_rows.begin(), mine_rows.end(), own.begin());
  Request gather = comm.iallgather(own.data(), own.size() * sizeof(float), all.data());
  comm.wait(gather);
  moved += watch.seconds();
  if (comm_s) *comm_s += moved;
  std::vector<float> rows((size_t)(B * d));
  for (int q = 0; q < P; q++) {
    int64_t q0 = 0, q1 = 0;
    split_range(B, P, q, &q0, &q1);
    std::copy(all.begin() + q * block * d, all.begin() + (q * block + q1 - q0) * d, rows.begin() + q0 * d);
  }
  return Tensor::from_vector(rows, {B, d}, dev);
}

}  // namespace

Tensor allreduce_timed(Comm& comm, const Tensor& t, double* seconds) {
  const Stopwatch watch;
  std::vector<float> sum = t.to_vector();
  Request req = comm.iallreduce_sum(sum.data(), sum.size());
  comm.wait(req);
  if (seconds) *seconds += watch.seconds();
  return Tensor::from_vector(sum, t.shape(), t.device());
}

Tensor moe_decode(Comm& comm, MoeComm how, const dsv3::Config& c, const dsv3::Params& mine, const Tensor& u,
                  double* comm_s) {
  Trace::Scope span(trace(), std::string("moe (") + moe_comm_name(how) + ")", "compute");
  return how == MoeComm::allreduce ? decode_allreduce(comm, c, mine, u, comm_s)
                                   : decode_alltoall(comm, c, mine, u, comm_s);
}

}  // namespace ff::infer
