// lessons/05_deepseek_moe/deepseek_moe.h — what the lesson's two files share: the two-level
// network, the routing map, and the expert-parallel layer (main.cpp) that the training demo
// (train.cpp) runs every step.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/layers/dsv3_moe.h"
#include "common/layers/expert_parallel.h"
#include "common/lesson/lesson.h"

namespace ff {

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
Topology make_topology(Comm& comm, int R);

// The routing map: every slot of every rank's tokens, after capacity (see main.cpp).
struct RoutingMap {
  int P = 1;
  int64_t T = 0, N = 0, K = 0, E = 0;  // tokens per rank, experts, top-K, experts per rank
  dsv3::Assignment assign;             // global slots: rank p's token t, slot j at (p T + t) K + j
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
  dsv3::Selection sel;
  RoutingMap map;
  moe::Plan plan;                // N + 1 groups, the last holding dropped slots
  int64_t kept_rows = 0;
  ep::Routes routes;             // flat: per-expert counts of every rank
  std::vector<int64_t> order;    // flat: regroup order of the received rows
  Tensor xl, yl;                 // rows at this rank's experts (grouped by local expert), outputs
  moe::ExpertCache cache, shared_cache;
  Tensor yp;                     // flat: expert outputs back at the source, packed
  Tensor y;                      // (T, d)
  dsv3::BalanceStats bal;
  double balance = 0;
  int64_t sequences_all = 0;
  // hierarchical: the three hops and their row lists (see hier_* below)
  struct Hop {
    std::vector<size_t> send_rows, recv_rows;   // rows per peer in the hop's communicator
  } rail, fan;
  std::vector<int64_t> rail_src, fan_src;       // rows sent: source row of each, in order
  Tensor recv_fan;               // rows received from the forwarders: [x | gates (K)]
  std::vector<int64_t> xl_row, xl_slot;         // per xl row: its row in recv_fan and slot j
};

EPForward ep_forward(Comm& comm, Topology& topo, Scheme scheme, const dsv3::Config& c,
                     const dsv3::Params& full, const dsv3::Params& mine, const Tensor& x);
dsv3::Grads ep_backward(Comm& comm, Topology& topo, Scheme scheme, const dsv3::Config& c,
                        const dsv3::Params& full, const dsv3::Params& mine, const Tensor& x,
                        const EPForward& f, const Tensor& dy, dsv3::Bug bug);

// The training demo (train.cpp): --train STEPS.
struct TrainOptions {
  int64_t steps = 0, batch = 2, log_every = 10;
  std::string balance = "bias";  // none | aux | bias
  std::string bug = "none";      // none | ema-zero-init | bias-peek
  double lr = 3e-3, gamma = 0.01, aux_alpha = 0.01, ema = 0.0;
  std::string data = "data/tinyshakespeare.txt";
};
int run_training(Lesson& lesson, Topology& topo, Scheme scheme, dsv3::Config c,
                 const TrainOptions& o);

}  // namespace ff
