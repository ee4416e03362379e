// common/layers/dsv3_ep.cpp — DeepSeek-V3's MoE layer over an expert-parallel group (see
// dsv3_ep.h; lesson 05 teaches it).
#include "common/layers/dsv3_ep.h"

#include <cstring>
#include <memory>
#include <numeric>

#include "common/comm/alltoall.h"
#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/util/trace.h"

namespace ff::dsv3 {

Topology make_topology(Comm& comm, int R) {
  Topology t;
  t.P = comm.size(), t.R = R, t.nodes = t.P / R;
  t.node = comm.rank() / R, t.local = comm.rank() % R;
  t.node_comm = comm.split(t.node, t.local);  // rank in node_comm = local index
  t.rail_comm = comm.split(t.local, t.node);  // rank in rail_comm = node
  return t;
}

// ----------------------------------------------------------------------------
// The layer, distributed (EPForward, in dsv3_ep.h, is what its forward keeps for the
// backward).

// ---- flat: lesson 04's all-to-all, one copy per routing slot

static void flat_dispatch(Comm& comm, A2A how, const Params& mine, const Tensor& x,
                          EPForward& f) {
  const int64_t d = x.size(1);
  Tensor xk = slice(moe::permute(x, f.plan), 0, 0, f.kept_rows);
  f.routes = ep::routes_from_counts(comm.size(), comm.rank(), f.map.N, f.map.counts());
  const ep::Routes& R = f.routes;
  // bf16 experts (mixed precision) read their rows rounded to bf16: the rows travel so, 2 bytes
  // a number, the same values (the combine's outputs and the backward's rows stay float32)
  const bool bf16 = mine.w1.defined() && mine.w1.dtype() == DType::bf16;
  Tensor recv = bf16 ? ep::exchange_rows_bf16(comm, how, xk, R.bytes(true, d, 2), R.bytes(false, d, 2), d, 1)
                     : ep::exchange_rows(comm, how, xk, R.bytes(true, d), R.bytes(false, d), d, 1);
  f.order = R.regroup_order();
  f.xl = ep::take_rows(recv, f.order);
  std::vector<int64_t> gl = R.local_group_sizes();
  Trace::Scope span(trace(), "experts forward", "compute");
  f.yl = moe::experts_forward(routed(mine), f.xl,
                              Tensor::from_indices(gl, {(int64_t)gl.size()}, x.device()), &f.cache);
}

static Tensor flat_combine(Comm& comm, A2A how, const Tensor& x, EPForward& f) {
  const int64_t d = x.size(1), TK = f.plan.tokens * f.plan.k;
  const ep::Routes& R = f.routes;
  Tensor back = ep::exchange_rows(comm, how, ep::put_rows(f.yl, f.order), R.bytes(false, d),
                                  R.bytes(true, d), d, 2);
  f.yp = f.kept_rows < TK ? concat({back, Tensor::zeros({TK - f.kept_rows, d}, x.device())}, 0) : back;
  return moe::combine(f.yp, f.plan, f.gates);
}

// ---- hierarchical: one copy per (token, node) over the rail, then a fan-out inside the node
//
// dispatch, rows [x_t | g_t] (the gates travel with the token: the combine sums inside the node)
//   hop 1 (rail)  source (n, l) sends token t to (n', l) for every node n' holding one of t's
//                 experts, once, tokens in order;
//   hop 2 (fan)   forwarder (n', l) sends each row it received (in arrival order: by source
//                 node, then token) to every rank of its node whose experts the token chose.
//   At the expert rank the rows are laid out exactly as lesson 04's flat dispatch lays them
//   out (by local expert, then source rank, then the source's slot order): the same bytes go
//   into the same grouped GEMMs.
// combine, the routes backwards, summing on the way:
//   the expert rank sums the gated outputs of a token's slots it holds (one row per token),
//   the forwarder sums its node's rows (one row per token per node), the source sums the
//   nodes' rows. The sums run in another order than the flat combine's (slot by slot): y
//   agrees with it to rounding, not bit for bit.

static void hier_plan(const Topology& topo, EPForward& f) {
  const RoutingMap& m = f.map;
  const int me = topo.node * topo.R + topo.local;
  f.rail = {}, f.fan = {};
  f.rail.send_rows.assign((size_t)topo.nodes, 0), f.rail.recv_rows.assign((size_t)topo.nodes, 0);
  f.fan.send_rows.assign((size_t)topo.R, 0), f.fan.recv_rows.assign((size_t)topo.R, 0);
  f.rail_src.clear(), f.fan_src.clear(), f.xl_row.clear(), f.xl_slot.clear();
  auto node_needs = [&](int p, int64_t t, int node) {
    for (int q = node * topo.R; q < (node + 1) * topo.R; q++)
      if (m.needs(p, t, q)) return true;
    return false;
  };
  // hop 1, sender side: my tokens, per target node
  // [exercise:rail-hop] The rail hop's sending side: for each node n, how many of my tokens go to my rail peer there (f.rail.send_rows[n]) and which, in order (f.rail_src).
  for (int n = 0; n < topo.nodes; n++)
    for (int64_t t = 0; t < m.T; t++)
      if (node_needs(me, t, n)) f.rail.send_rows[(size_t)n]++, f.rail_src.push_back(t);
  // [/exercise]
  // hop 1, forwarder side: tokens of (n', my local) that need my node, by source node
  std::vector<std::pair<int, int64_t>> arrived;  // (source rank, token), in arrival order
  for (int n = 0; n < topo.nodes; n++) {
    const int p = n * topo.R + topo.local;
    for (int64_t t = 0; t < m.T; t++)
      if (node_needs(p, t, topo.node)) f.rail.recv_rows[(size_t)n]++, arrived.push_back({p, t});
  }
  // hop 2, forwarder side: each arrived row to every rank of my node that needs it
  for (int l = 0; l < topo.R; l++)
    for (size_t i = 0; i < arrived.size(); i++)
      if (m.needs(arrived[i].first, arrived[i].second, topo.node * topo.R + l))
        f.fan.send_rows[(size_t)l]++, f.fan_src.push_back((int64_t)i);
  // hop 2, receiver side: from forwarder l, the tokens of sources (n', l) that need me
  std::vector<std::vector<int64_t>> row_of((size_t)m.P, std::vector<int64_t>((size_t)m.T, -1));
  int64_t row = 0;
  for (int l = 0; l < topo.R; l++)
    for (int n = 0; n < topo.nodes; n++) {
      const int p = n * topo.R + l;
      for (int64_t t = 0; t < m.T; t++)
        if (m.needs(p, t, me)) f.fan.recv_rows[(size_t)l]++, row_of[(size_t)p][(size_t)t] = row++;
    }
  // the expert rows, in flat's order: local expert, source rank, the source's slot order
  for (int64_t e = me * m.E; e < (me + 1) * m.E; e++)
    for (int p = 0; p < m.P; p++)
      for (int64_t t = 0; t < m.T; t++)
        for (int64_t j = 0; j < m.K; j++)
          if (m.expert(p, t, j) == e)
            f.xl_row.push_back(row_of[(size_t)p][(size_t)t]), f.xl_slot.push_back(j);
}

static std::vector<size_t> to_bytes(const std::vector<size_t>& rows, int64_t width) {
  std::vector<size_t> b(rows.size());
  for (size_t i = 0; i < rows.size(); i++) b[i] = rows[i] * (size_t)width * sizeof(float);
  return b;
}

// Rows of `rows` (n, w) in the order `src`, sent through one hop; what arrives, (m, w).
static Tensor hop_forward(Comm& hop_comm, const EPForward::Hop& hop, const Tensor& rows,
                          const std::vector<int64_t>& src, int tag) {
  const int64_t w = rows.size(1);
  return ep::exchange_rows(hop_comm, A2A::async, ep::take_rows(rows, src),
                           to_bytes(hop.send_rows, w), to_bytes(hop.recv_rows, w), w, tag);
}
// The way back: rows shaped like what the hop delivered go back to where they came from.
static Tensor hop_back(Comm& hop_comm, const EPForward::Hop& hop, const Tensor& rows, int tag) {
  const int64_t w = rows.size(1);
  return ep::exchange_rows(hop_comm, A2A::async, rows, to_bytes(hop.recv_rows, w),
                           to_bytes(hop.send_rows, w), w, tag);
}
// out[i] = sum over the rows j with dst[j] == i of rows[j], in j order: each row sent out
// (once per destination) comes back and is summed into the row it was sent from. With gates,
// row j is scaled by gates[j] first. moe::combine/unpermute_sum do it: `tokens` = n outputs,
// `k` = the most rows one output receives, missing ones pointing at an appended zero row.
static Tensor sum_back(const Tensor& rows, const std::vector<int64_t>& dst, int64_t n,
                       const std::vector<float>* gates = nullptr) {
  const int64_t w = rows.size(1), zero = rows.size(0);
  std::vector<std::vector<int64_t>> from((size_t)n);
  for (size_t j = 0; j < dst.size(); j++) from[(size_t)dst[j]].push_back((int64_t)j);
  int64_t k = 1;
  for (const auto& v : from) k = std::max<int64_t>(k, (int64_t)v.size());
  std::vector<int64_t> pos((size_t)(n * k), zero);
  std::vector<float> g((size_t)(n * k), 0.f);
  for (int64_t i = 0; i < n; i++)
    for (size_t q = 0; q < from[(size_t)i].size(); q++) {
      pos[(size_t)(i * k + (int64_t)q)] = from[(size_t)i][q];
      g[(size_t)(i * k + (int64_t)q)] = gates ? (*gates)[(size_t)from[(size_t)i][q]] : 1.f;
    }
  moe::Plan plan;
  plan.pos = Tensor::from_indices(pos, {n * k}, rows.device());
  plan.tokens = n, plan.k = k;
  Tensor padded = concat({rows, Tensor::zeros({1, w}, rows.device())}, 0);
  if (!gates) return moe::unpermute_sum(padded, plan);
  return moe::combine(padded, plan, Tensor::from_vector(g, {n, k}, rows.device()));
}

static void hier_dispatch(Topology& topo, const Params& mine, const Tensor& x, EPForward& f) {
  const int64_t d = x.size(1), K = f.map.K;
  // [slide:hier-dispatch]
  Tensor rows = concat({x, f.gates}, 1);  // [x_t | g_t]
  Tensor at_forwarder = hop_forward(topo.rail_comm, f.rail, rows, f.rail_src, 11);
  f.recv_fan = hop_forward(topo.node_comm, f.fan, at_forwarder, f.fan_src, 12);
  f.xl = ep::take_rows(slice(f.recv_fan, 1, 0, d), f.xl_row);
  // [/slide]
  std::vector<int64_t> gl((size_t)f.map.E, 0);
  const int me = topo.node * topo.R + topo.local;
  for (int64_t e = 0; e < f.map.E; e++)
    for (int p = 0; p < f.map.P; p++)
      for (int64_t t = 0; t < f.map.T; t++)
        for (int64_t j = 0; j < K; j++) gl[(size_t)e] += f.map.expert(p, t, j) == me * f.map.E + e;
  Trace::Scope span(trace(), "experts forward", "compute");
  f.yl = moe::experts_forward(routed(mine), f.xl,
                              Tensor::from_indices(gl, {f.map.E}, x.device()), &f.cache);
}

// the gate of each expert row, from the row that brought its token
static std::vector<float> xl_gates(const EPForward& f) {
  const int64_t d = f.recv_fan.size(1) - f.map.K;
  const std::vector<float> rf = f.recv_fan.to_vector();
  std::vector<float> g(f.xl_row.size());
  for (size_t i = 0; i < g.size(); i++)
    g[i] = rf[(size_t)(f.xl_row[i] * (d + f.map.K) + d + f.xl_slot[i])];
  return g;
}

static Tensor hier_combine(Topology& topo, const Tensor& x, EPForward& f) {
  const std::vector<float> g = xl_gates(f);
  // expert rank: one row per token it received, sum of its slots' gated outputs
  Tensor partial = sum_back(f.yl, f.xl_row, f.recv_fan.size(0), &g);
  // forwarder: its node's rows summed per token; source: the nodes' rows summed per token
  Tensor node_sum = sum_back(hop_back(topo.node_comm, f.fan, partial, 13), f.fan_src,
                             (int64_t)std::accumulate(f.rail.recv_rows.begin(), f.rail.recv_rows.end(), size_t(0)));
  return sum_back(hop_back(topo.rail_comm, f.rail, node_sum, 14), f.rail_src, x.size(0));
}

// ----------------------------------------------------------------------------
// The routing map's inputs from every rank, in one allgather: each rank's affinities (T N
// floats), choices (T K) and kept groups (T M) packed into one message, so that the forward
// waits on its EP peers once per layer (DeepEP likewise settles its layout in one notify step
// before the dispatch). Concatenated in rank order, as three allgathers would give them.
struct RoutingInputs {
  std::vector<float> s;
  std::vector<int64_t> idx, groups;
};

static RoutingInputs gather_routing_inputs(Comm& comm, const Tensor& s, const Tensor& idx,
                                           const Tensor& groups) {
  const std::vector<float> sv = s.to_vector();
  const std::vector<int64_t> iv = idx.to_index_vector(), gv = groups.to_index_vector();
  const size_t sb = sv.size() * sizeof(float), ib = iv.size() * sizeof(int64_t),
               gb = gv.size() * sizeof(int64_t), block = sb + ib + gb;
  std::vector<char> mine(block), every(block * (size_t)comm.size());
  std::memcpy(mine.data(), sv.data(), sb);
  std::memcpy(mine.data() + sb, iv.data(), ib);
  std::memcpy(mine.data() + sb + ib, gv.data(), gb);
  comm.allgather(mine.data(), block, every.data());
  RoutingInputs all;
  all.s.resize(sv.size() * (size_t)comm.size());
  all.idx.resize(iv.size() * (size_t)comm.size());
  all.groups.resize(gv.size() * (size_t)comm.size());
  for (size_t p = 0; p < (size_t)comm.size(); p++) {  // memcpy: the int64 parts need not be aligned
    const char* b = every.data() + p * block;
    std::memcpy(all.s.data() + p * sv.size(), b, sb);
    std::memcpy(all.idx.data() + p * iv.size(), b + sb, ib);
    std::memcpy(all.groups.data() + p * gv.size(), b + sb + ib, gb);
  }
  return all;
}

std::vector<std::vector<int64_t>> RoutingMap::counts() const {
  std::vector<std::vector<int64_t>> c((size_t)P, std::vector<int64_t>((size_t)N, 0));
  for (int p = 0; p < P; p++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < K; j++) {
        const int64_t e = expert(p, t, j);
        if (e >= 0) c[(size_t)p][(size_t)e]++;
      }
  return c;
}

// ----------------------------------------------------------------------------
// The forward: route (every rank its own tokens), the routing map, capacity, gates, then the
// experts through the chosen all-to-all, the shared experts beside them.
EPForward ep_forward(Comm& comm, Topology& topo, Scheme scheme, const Config& c, const Params& full,
                     const Params& mine, const Tensor& x) {
  const int P = comm.size(), r = comm.rank();
  const int64_t T = x.size(0), N = c.experts, K = c.topk;
  const Device dev = x.device();
  EPForward f;
  f.s = affinities(c, full, x);
  f.sel = select(c, f.s, full.bias);
  // the routing map: everybody's affinities and choices, then capacity over all of them
  RoutingMap& m = f.map;
  m.P = P, m.T = T, m.N = N, m.K = K, m.E = N / P;
  const RoutingInputs all = gather_routing_inputs(comm, f.s, f.sel.idx, f.sel.kept_groups);
  m.assign = assign_capacity(c, all.s, full.bias.to_vector(), all.idx, all.groups, T * P);
  std::vector<int64_t> my_idx(m.assign.idx.begin() + r * T * K, m.assign.idx.begin() + (r + 1) * T * K);
  f.idx = Tensor::from_indices(my_idx, {T, K}, dev);
  f.gates = gates(c, f.s, f.idx);
  f.plan = moe::permute_plan(plan_ids(c, m.assign.idx, m.assign.kept, r * T, T, dev), N + 1);
  for (int64_t e = 0; e < N; e++) f.kept_rows += f.plan.group_sizes.to_index_vector()[(size_t)e];
  Tensor routed;
  if (scheme == Scheme::flat) {
    flat_dispatch(comm, A2A::async, mine, x, f);
    routed = flat_combine(comm, A2A::async, x, f);
  } else {
    hier_plan(topo, f);
    hier_dispatch(topo, mine, x, f);
    routed = hier_combine(topo, x, f);
  }
  f.y = c.shared > 0 ? add(routed, shared_forward(full, x, &f.shared_cache)) : routed;
  // the balance loss: per sequence on its rank, then the mean over all sequences (whole
  // sequences only when there is a balance loss: lesson 08's ranks may hold parts of them)
  if (c.alpha != 0) {
    f.bal = balance_stats(c, f.s, f.sel.idx);
    double sums[2] = {f.bal.loss_sum, (double)f.bal.sequences};
    comm.allreduce(sums, 2, MPI_DOUBLE, MPI_SUM);
    f.sequences_all = (int64_t)sums[1];
    f.balance = balance_loss(c, sums[0], f.sequences_all);
  }
  return f;
}

// ----------------------------------------------------------------------------
// The backward retraces the routes. At the source the combine's backward gives dL/dg and the
// gated dy per slot (flat); hierarchically dy travels like x did, and the expert rank applies
// the gate and forms dL/dg = <dy_t, E(x_t)> itself, sending it home with the partial dx (K
// extra columns, zero but for the slots it holds: the sums on the way add zeros to it, exactly).

InputGrads ep_backward_input(Comm& comm, Topology& topo, Scheme scheme, const Config& c,
                             const Params& full, const Params& mine, const Tensor& x,
                             const EPForward& f, const Tensor& dy, Bug bug) {
  const int64_t T = x.size(0), d = x.size(1), K = c.topk, TK = T * K;
  const Device dev = x.device();
  InputGrads in;
  Tensor dgates, dx_routed;
  if (scheme == Scheme::flat) {
    const ep::Routes& R = f.routes;
    moe::CombineGrads cg = moe::combine_backward(dy, f.yp, f.plan, f.gates);
    Tensor dyl = ep::take_rows(ep::exchange_rows(comm, A2A::async, slice(cg.dyp, 0, 0, f.kept_rows),
                                                 R.bytes(true, d), R.bytes(false, d), d, 3),
                               f.order);
    {
      Trace::Scope span(trace(), "experts backward", "compute");
      in.routed = moe::experts_backward_input(routed(mine), f.cache, dyl);
    }
    Tensor dxp = ep::exchange_rows(comm, A2A::async, ep::put_rows(in.routed.dxp, f.order), R.bytes(false, d),
                                   R.bytes(true, d), d, 4);
    if (f.kept_rows < TK) dxp = concat({dxp, Tensor::zeros({TK - f.kept_rows, d}, dev)}, 0);
    dx_routed = moe::unpermute_sum(dxp, f.plan);
    dgates = cg.dgates;
  } else {
    Tensor at_forwarder = hop_forward(topo.rail_comm, f.rail, dy, f.rail_src, 15);
    Tensor dy_rows = ep::take_rows(hop_forward(topo.node_comm, f.fan, at_forwarder, f.fan_src, 16),
                                   f.xl_row);
    const std::vector<float> g = xl_gates(f);
    const int64_t n = (int64_t)g.size();
    Tensor dyl = mul(dy_rows, Tensor::from_vector(g, {n, 1}, dev));        // g dy, per slot
    std::vector<float> dg_rows = sum(mul(dy_rows, f.yl), 1, true).to_vector();  // <dy, E(x)>
    {
      Trace::Scope span(trace(), "experts backward", "compute");
      in.routed = moe::experts_backward_input(routed(mine), f.cache, dyl);
    }
    // per expert row: [dx part (d) | dL/dg in its slot's column (K)], summed home
    std::vector<float> dg_cols((size_t)(n * K), 0.f);
    for (int64_t i = 0; i < n; i++) dg_cols[(size_t)(i * K + f.xl_slot[(size_t)i])] = dg_rows[(size_t)i];
    Tensor rows = concat({in.routed.dxp, Tensor::from_vector(dg_cols, {n, K}, dev)}, 1);
    Tensor partial = sum_back(rows, f.xl_row, f.recv_fan.size(0));
    Tensor node_sum = sum_back(hop_back(topo.node_comm, f.fan, partial, 17), f.fan_src,
                               (int64_t)std::accumulate(f.rail.recv_rows.begin(), f.rail.recv_rows.end(), size_t(0)));
    Tensor home = sum_back(hop_back(topo.rail_comm, f.rail, node_sum, 18), f.rail_src, T);
    dx_routed = slice(home, 1, 0, d);
    dgates = slice(home, 1, d, d + K);
  }
  // the router (replicated): dL/dz from dL/dg and the balance loss, then its input matmul
  in.dz = router_dlogits(c, f.s, full.bias, f.idx, dgates, f.bal, f.sequences_all, bug);
  in.dx = add(dx_routed, matmul(in.dz, transpose(full.router_w, 0, 1)));
  if (c.shared > 0) {
    in.shared = shared_backward_input(full, f.shared_cache, dy);
    if (bug != Bug::no_shared_grad) in.dx = add(in.dx, in.shared.dxp);
  }
  return in;
}

Grads ep_backward_weights(const Config& c, const Params& full, const Params& mine, const Tensor& x,
                          const EPForward& f, const InputGrads& in) {
  Trace::Scope span(trace(), "moe weight gradients", "compute");
  Params p = full;  // the router and the shared experts; this rank's experts, whose rows f.cache holds
  p.w1 = mine.w1, p.w3 = mine.w3, p.w2 = mine.w2;
  return backward_weights(c, p, x, f.cache, f.shared_cache, in);
}

Grads ep_backward(Comm& comm, Topology& topo, Scheme scheme, const Config& c, const Params& full,
                  const Params& mine, const Tensor& x, const EPForward& f, const Tensor& dy, Bug bug,
                  bool reduce_replicated) {
  InputGrads in = ep_backward_input(comm, topo, scheme, c, full, mine, x, f, dy, bug);
  Grads g = ep_backward_weights(c, full, mine, x, f, in);  // the experts' stay with them
  g.dx = in.dx;
  if (reduce_replicated) {  // data parallel outside the experts
    if (c.shared > 0) comm.allreduce_sum(g.sw1), comm.allreduce_sum(g.sw2), comm.allreduce_sum(g.sw3);
    comm.allreduce_sum(g.router_w);
  }
  return g;
}

}  // namespace ff::dsv3

namespace ff::dsv3 {

Tensor ep_layer(Comm& comm, Topology& topo, Scheme scheme, const Config& c, const Params& p,
                const Tensor& u, Tensor* route, RoutingMap* map) {
  // ep_forward and ep_backward compute by hand on detached tensors, the tape off; the whole
  // layer is recorded below as one op
  const bool shared = c.shared > 0;
  const RecordedOp op = recorded_op(p, u, shared);
  const Params& w = op.plain;
  const Tensor x = u.detach();
  auto fwd = std::make_shared<EPForward>();
  {
    NoGradGuard no_grad;
    *fwd = ep_forward(comm, topo, scheme, c, w, w, x);
  }
  if (route) *route = fwd->idx;
  if (map) *map = fwd->map;
  Tensor y = fwd->y;
  fwd->y = Tensor();  // the backward does not read y; the closure must not hold the output
  // split as model::moe_ffn's op: I = every all-to-all and dx, W = the weight GEMMs, local
  Comm* cm = &comm;
  Topology* tp = &topo;
  return record_split(y, "dsv3_ep", op.inputs, op.weights, [cm, tp, scheme, c, w, x, fwd, shared](const Tensor& dy) {
    auto in = std::make_shared<InputGrads>(ep_backward_input(*cm, *tp, scheme, c, w, w, x, *fwd, dy, Bug::none));
    std::vector<Tensor> grads = op_input_grads(in->dx, shared);
    in->dx = in->routed.dxp = in->shared.dxp = Tensor();  // W keeps only what it reads
    return SplitGrads{grads, [c, w, x, fwd, shared, in] {
                        return op_weight_grads(ep_backward_weights(c, w, w, x, *fwd, *in), shared);
                      }};
  });
}

}  // namespace ff::dsv3
