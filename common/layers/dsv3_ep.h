// common/layers/dsv3_ep.h — DeepSeek-V3's MoE layer distributed over an expert-parallel group:
// the routing map, the flat (lesson 04) and hierarchical (rail, then node; DeepEP's normal
// kernels) all-to-all, and the backward along the same routes. Taught in lesson 05
// (lessons/05_deepseek_moe/README.md explains every hop); lesson 08 runs it on its mesh's EP
// groups.
//
// The layer's parameters: `full` holds what every rank of the group has (the router, the
// balancing bias, the shared experts); `mine` holds this rank's E = N / P routed experts,
// global experts [rank E, (rank + 1) E) (w1, w3 (E, d, f), w2 (E, f, d)). Every rank of the
// group passes the same number of tokens T.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/layers/dsv3_moe.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/moe.h"

namespace ff::dsv3 {

// The two-level network: ranks r = node * R + local. node_comm joins the R ranks of a node
// (NVLink), rail_comm joins the ranks with the same local index on every node (InfiniBand:
// in DeepSeek's clusters each GPU has its own NIC, and GPU l of one node talks to GPU l of
// another).
struct Topology {
  int P = 1, R = 1, nodes = 1, node = 0, local = 0;
  Comm node_comm, rail_comm;
  int node_of(int r) const { return r / R; }
  int local_of(int r) const { return r % R; }
};
// Collective over comm; R must divide comm.size().
Topology make_topology(Comm& comm, int R);

// The routing map: every slot of every rank's tokens, after capacity. Every rank routes its
// own tokens; then one allgather gives every rank the affinities, the selections and the kept
// groups of ALL tokens (T N + T K + T M numbers per rank, one message). Capacity is global (cap =
// ceil(C T K / N) over the EP group), so every rank runs the same deterministic assignment on
// the same global data and keeps its own rows; and the hierarchical all-to-all's senders,
// forwarders and receivers all read who needs what from it. (DeepEP exchanges per-rank counts
// and per-token rank masks instead; the map here is the readable version, small at these
// sizes.)
struct RoutingMap {
  int P = 1;
  int64_t T = 0, N = 0, K = 0, E = 0;  // tokens per rank, experts, top-K, experts per rank
  Assignment assign;                   // global slots: rank p's token t, slot j at (p T + t) K + j
  int64_t expert(int p, int64_t t, int64_t j) const {  // -1: dropped
    const size_t s = (size_t)(((int64_t)p * T + t) * K + j);
    return assign.kept[s] ? assign.idx[s] : -1;
  }
  // Whether rank q holds an expert of one of token (p, t)'s kept slots.
  bool needs(int p, int64_t t, int q) const {
    for (int64_t j = 0; j < K; j++) {
      const int64_t e = expert(p, t, j);
      if (e >= 0 && e / E == q) return true;
    }
    return false;
  }
  // counts[p][e]: kept slots of rank p's tokens routed to expert e — what lesson 04 gathers
  // from every rank, read here off the map.
  std::vector<std::vector<int64_t>> counts() const;
};

enum class Scheme { flat, hierarchical };

// Every rank's `mine`, concatenated in rank order (one allgather; equal sizes on every rank).
template <typename V>
std::vector<V> allgather_vec(Comm& comm, const std::vector<V>& mine) {
  std::vector<V> all(mine.size() * (size_t)comm.size());
  comm.allgather(mine.data(), mine.size() * sizeof(V), all.data());
  return all;
}

// What the distributed layer's forward keeps for its backward.
struct EPForward {
  Tensor s, gates, idx;          // this rank's tokens: affinities, gates, final experts (T, K)
  Selection sel;
  RoutingMap map;
  moe::Plan plan;                // N + 1 groups, the last holding dropped slots
  int64_t kept_rows = 0;
  ep::Routes routes;             // flat: per-expert counts of every rank
  std::vector<int64_t> order;    // flat: regroup order of the received rows
  Tensor xl, yl;                 // rows at this rank's experts (grouped by local expert), outputs
  moe::ExpertCache cache, shared_cache;
  Tensor yp;                     // flat: expert outputs back at the source, packed
  Tensor y;                      // (T, d)
  BalanceStats bal;
  double balance = 0;
  int64_t sequences_all = 0;
  // hierarchical: the three hops and their row lists (see dsv3_ep.cpp)
  struct Hop {
    std::vector<size_t> send_rows, recv_rows;   // rows per peer in the hop's communicator
  } rail, fan;
  std::vector<int64_t> rail_src, fan_src;       // rows sent: source row of each, in order
  Tensor recv_fan;               // rows received from the forwarders: [x | gates (K)]
  std::vector<int64_t> xl_row, xl_slot;         // per xl row: its row in recv_fan and slot j
};

// The forward of x (T, d), this rank's tokens: route, the routing map, capacity, gates, then
// the experts through the chosen all-to-all, the shared experts beside them. Collective over
// comm (and topo's communicators when hierarchical).
EPForward ep_forward(Comm& comm, Topology& topo, Scheme scheme, const Config& c, const Params& full,
                     const Params& mine, const Tensor& x);

// The backward along the forward's routes. Returns dx and the gradients of this rank's
// experts (w1, w3, w2: from every token of the group routed to them) and, from this rank's
// tokens, of the router and the shared experts. With reduce_replicated (lesson 05) those two
// are summed over comm, as data parallelism outside the experts; lesson 08 leaves them to its
// own optimizer, which reduces every replicated weight over its data-parallel ranks.
Grads ep_backward(Comm& comm, Topology& topo, Scheme scheme, const Config& c, const Params& full,
                  const Params& mine, const Tensor& x, const EPForward& f, const Tensor& dy, Bug bug,
                  bool reduce_replicated = true);
// ep_backward in two halves, for a zero-bubble pipeline's I and W (ep_layer's op defers the
// second): ep_backward_input runs every all-to-all and gives dx, keeping what the weight
// gradients need (at this rank's experts, the gradients of the rows they received);
// ep_backward_weights is local, weight GEMMs alone on this rank's cached rows: the router's,
// this rank's experts' and the shared experts' gradients, none reduced. Together, ep_backward's
// bits (before its reduction).
InputGrads ep_backward_input(Comm& comm, Topology& topo, Scheme scheme, const Config& c,
                             const Params& full, const Params& mine, const Tensor& x,
                             const EPForward& f, const Tensor& dy, Bug bug);
Grads ep_backward_weights(const Config& c, const Params& full, const Params& mine, const Tensor& x,
                          const EPForward& f, const InputGrads& in);

}  // namespace ff::dsv3

namespace ff::dsv3 {

// The layer as one autograd op, as model::moe_ffn is for one process: y = layer(u) over the
// group, its backward ep_backward (the router's and shared experts' gradients left unreduced),
// split: ep_backward_input is the op's I (all the communication), ep_backward_weights its W.
// p holds the router, the balancing bias, the shared experts and this rank's experts (it is
// both ep_forward's `full` and `mine`); u and every weight but the bias are the op's inputs.
// route gets the final experts of this rank's tokens (T, K); map, when given, the routing map.
Tensor ep_layer(Comm& comm, Topology& topo, Scheme scheme, const Config& c, const Params& p,
                const Tensor& u, Tensor* route, RoutingMap* map = nullptr);

}  // namespace ff::dsv3
