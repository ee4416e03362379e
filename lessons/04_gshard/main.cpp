// Lesson 04 — GShard expert parallelism: the MoE layer of lesson 03 with its experts spread
// over the ranks, tokens moved by an all-to-all written by hand.
//
// What: P ranks, N experts, rank q holds experts [q N/P, (q+1) N/P). Tokens are data-parallel:
//   every rank routes its own batch with the (replicated) router. Then (Lepikhin et al.,
//   "GShard", 2020):
//     dispatch  each rank sorts its routing slots by expert (lesson 03's permute); since the
//               experts of one rank are consecutive, the packed rows are also grouped by
//               destination rank: one contiguous block per peer -> all-to-all
//     experts   each rank regroups what it received by local expert (rows from rank 0 first,
//               then rank 1, ...) and runs lesson 03's grouped GEMMs
//     combine   the outputs go back along the same routes (the reverse all-to-all) and each
//               rank forms y_t = sum_j g_tj E(x_t) as in lesson 03
//   The backward retraces the routes: dy is dispatched, the experts' backward runs where the
//   experts live (their gradients stay there), dx comes back by the reverse all-to-all; the
//   router is replicated, so its gradients are all-reduced.
//   The all-to-all, by hand (--a2a):
//     ordered  P rounds of pairwise exchanges with synchronous sends (one of them the copy to
//              itself), the lower rank of each pair sending first;
//     async    every irecv and isend posted at once, then waited;
//     library  MPI_Alltoallv (posted as MPI_Ialltoallv, then the watchdog's wait).
// Why: expert parallelism is how MoE models scale past one device's memory; the all-to-all is
//   its whole communication cost, twice per layer forward and twice backward.
// Run:  make run L=04 NP=4
//       make run L=04 NP=4 ARGS="--experts 8 --topk 2 --a2a ordered"
//       make run L=04 NP=4 ARGS="--bench"      (all-to-all timings, as in make bench)
// Expect: the traffic matrix, the exact data-movement checks, y / dx / router / expert
//   gradients against the single-process lesson-03 layer on all ranks' tokens, "check: PASS".
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/comm/alltoall.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/moe.h"
#include "common/lesson/lesson.h"
#include "common/lesson/moe_flags.h"
#include "kernels/kernels.h"

using namespace ff;
using ep::Routes;
using ep::exchange_rows;
using ep::put_rows;
using ep::take_rows;

// ----------------------------------------------------------------------------
// All-to-all, three ways: a2a_ordered, a2a_async and the library's, in
// common/comm/alltoall.cpp (lesson 05 dispatches with the same code). send holds one block per
// peer, back to back in rank order; recv gets one block from every rank. Both sides know every
// size beforehand (the routing counts are exchanged first), so a block of 0 bytes is simply
// not sent — and not expected — on both sides.
//   ordered: in round s = 0..P-1, rank r is paired with q = (s - r) mod P, a symmetric pairing
//     in which every pair meets exactly once; in each pair the LOWER rank Ssends first, so a
//     pair never waits on itself, and a rank stuck in round s waits only on partners in earlier
//     rounds: no cycle, no deadlock, for any P (the proof is written out beside the code).
//   async: every irecv and isend posted at once, then one wait for all of them.

// ----------------------------------------------------------------------------
// The routes (ep::Routes in common/layers/expert_parallel.h, which lesson 05 reuses):
// counts[p][e] = routing slots of rank p that chose expert e, known everywhere after one
// allgather. Everything about who sends what to whom follows from it: rows_to(q) and
// rows_from(p) are sums of counts over the experts rank q holds; the received rows arrive
// grouped by source, each source's rows sorted by local expert, and regroup_order() lists them
// grouped by local expert instead (source 0's rows of expert e, then source 1's, ...), which
// is what the grouped GEMMs want. exchange_rows() moves the rows of a tensor through the
// all-to-all; take_rows/put_rows gather rows in an order and scatter them back.

// ----------------------------------------------------------------------------
// The expert-parallel layer: forward and backward with the routes above.

struct EPForward {
  moe::Forward local;   // routing, permute plan, combine result of this rank's tokens
  Routes routes;
  std::vector<int64_t> order;  // regroup order of the received rows
  Tensor xl;            // rows at this rank's experts, grouped by local expert
  moe::ExpertCache cache;
  Tensor yp_back;       // expert outputs back at the source, packed order
  moe::LoadStats global;
  double aux = 0;
};

static EPForward ep_forward(Comm& comm, A2A how, const moe::Config& c, const moe::Params& full,
                            const moe::Params& mine, const Tensor& x) {
  const int P = comm.size();
  const int64_t d = x.size(1), N = c.experts, E = N / P;
  const Device dev = x.device();
  EPForward f;
  moe::Forward& L = f.local;
  // [slide:layout]
  // route and permute, as in lesson 03: packed rows sorted by expert = grouped by destination
  L.routing = moe::route(c, full, x);
  L.plan = moe::permute_plan(L.routing.idx, N);
  Tensor xp = moe::permute(x, L.plan);
  // the routing map: every rank's counts per expert, by one allgather
  f.routes = ep::gather_routes(comm, L.plan.group_sizes.to_index_vector(), N);
  const Routes& R = f.routes;
  // [/slide]
  // [slide:dispatch-combine]
  // [slide:dispatch]
  // dispatch, regroup by local expert, run the experts
  Tensor recv = exchange_rows(comm, how, xp, R.bytes(true, d), R.bytes(false, d), d, 1);
  f.order = R.regroup_order();
  f.xl = take_rows(recv, f.order);
  std::vector<int64_t> gl = R.local_group_sizes();
  Tensor gsizes = Tensor::from_indices(gl, {E}, dev);
  Tensor yl;
  {
    Trace::Scope span(trace(), "experts forward", "compute");
    yl = moe::experts_forward(mine, f.xl, gsizes, &f.cache);
  }
  // [/slide:dispatch]
  // [slide:combine]
  // combine: back in received order, back to the sources, then y_t = sum_j g_tj yp[pos]
  f.yp_back = exchange_rows(comm, how, put_rows(yl, f.order), R.bytes(false, d), R.bytes(true, d), d, 2);
  L.yp = f.yp_back;
  L.y = moe::combine(L.yp, L.plan, L.routing.gates);
  // [/slide:combine]
  // [/slide]
  // the load-balance loss over ALL tokens: add up the ranks' sums
  L.stats = moe::load_stats(c, L.routing);
  f.global = L.stats;
  comm.allreduce(f.global.count.data(), (int)N, MPI_DOUBLE, MPI_SUM);
  comm.allreduce(f.global.prob_sum.data(), (int)N, MPI_DOUBLE, MPI_SUM);
  comm.allreduce(&f.global.tokens, 1, MPI_DOUBLE, MPI_SUM);
  f.aux = moe::aux_loss(c, f.global);
  return f;
}

static moe::Grads ep_backward(Comm& comm, A2A how, const moe::Config& c, const moe::Params& full,
                              const moe::Params& mine, const Tensor& x, const EPForward& f,
                              const Tensor& dy) {
  const int64_t d = x.size(1);
  const moe::Forward& L = f.local;
  const Routes& R = f.routes;
  // [slide:backward]
  // [slide:backward-a2a]
  // combine backward at the source: dyp (packed) and dL/dg
  moe::CombineGrads cg = moe::combine_backward(dy, L.yp, L.plan, L.routing.gates);
  // dyp travels the dispatch route to the experts; their backward runs there
  Tensor dyl = take_rows(exchange_rows(comm, how, cg.dyp, R.bytes(true, d), R.bytes(false, d), d, 3), f.order);
  moe::ExpertGrads eg;
  {
    Trace::Scope span(trace(), "experts backward", "compute");
    eg = moe::experts_backward(mine, f.cache, dyl);
  }
  // dxp comes home by the combine route; dx_t = sum of its slots' rows
  Tensor dxp = exchange_rows(comm, how, put_rows(eg.dxp, f.order), R.bytes(false, d), R.bytes(true, d), d, 4);
  Tensor dx_experts = moe::unpermute_sum(dxp, L.plan);
  // [/slide:backward-a2a]
  // [slide:backward-router]
  // the router, replicated: local gradient, then the sum over ranks (its loss is global)
  Tensor dz = moe::router_dlogits(c, L.routing, cg.dgates, f.global);
  moe::RouterGrads rg = moe::router_backward(full, x, dz);
  moe::Grads g;
  g.router_w = rg.router_w;
  g.router_b = rg.router_b;
  comm.allreduce_sum(g.router_w);
  comm.allreduce_sum(g.router_b);
  g.dx = add(dx_experts, rg.dx);
  g.w1 = eg.dw1, g.w2 = eg.dw2, g.w3 = eg.dw3;  // stay with their experts
  // [/slide:backward-router]
  // [/slide]
  return g;
}

// ----------------------------------------------------------------------------
// --bench: the three all-to-alls on uniform blocks of several sizes, as ratios to MPI's.
// Each repetition times all three, one after another, so a ratio compares runs made under
// the same machine load; min, median and max of the ratios show how steady they are.
// Returns the CSV rows (series a2a: one row per size and implementation).

static std::string bench(const Lesson& lesson, int64_t reps) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();
  lesson.print("all-to-all, P=%d, %lld repetitions after 5 warm-up (slowest rank), bytes per peer "
               "block; waits: %s\nlibrary = MPI_Ialltoallv + Comm's watched wait; ratios median "
               "[min, max]\n  %9s %10s %10s %10s %24s %24s\n", P, (long long)reps,
               Comm::wait_policy().reason.c_str(), "bytes", "library us", "ordered us", "async us",
               "ordered/library", "async/library");
  std::string rows;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (size_t bytes : {size_t(64), size_t(1) << 10, size_t(16) << 10, size_t(256) << 10,
                       size_t(1) << 20}) {
    std::vector<char> send(bytes * (size_t)P, (char)rank), recv(bytes * (size_t)P);
    std::vector<size_t> block_bytes((size_t)P, bytes);
    std::vector<double> us[3], ratio[2];
    for (int impl = 0; impl < 3; impl++)  // warm-up: first-touch of buffers and connections
      for (int warm = 0; warm < 5; warm++)
        all_to_all(comm, (A2A)impl, send.data(), block_bytes, recv.data(), block_bytes, 9);
    for (int64_t rep = 0; rep < reps; rep++) {
      for (int impl = 0; impl < 3; impl++) {
        comm.barrier();
        const Stopwatch watch;
        all_to_all(comm, (A2A)impl, send.data(), block_bytes, recv.data(), block_bytes, 9);
        double elapsed_us = watch.us();
        comm.allreduce(&elapsed_us, 1, MPI_DOUBLE, MPI_MAX);
        us[impl].push_back(elapsed_us);
      }
      for (int impl = 0; impl < 2; impl++) ratio[impl].push_back(us[impl].back() / us[2].back());
    }
    auto span = [&](const std::vector<double>& v) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "%.2f [%.2f, %.2f]", median(v),
                    *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
      return std::string(buf);
    };
    lesson.print("  %9zu %10.1f %10.1f %10.1f %24s %24s\n", bytes, median(us[2]), median(us[0]),
                 median(us[1]), span(ratio[0]).c_str(), span(ratio[1]).c_str());
    for (int impl = 0; impl < 3; impl++) {
      const std::vector<double>& t = us[impl];
      char line[160];
      std::snprintf(line, sizeof line, "a2a,%d,%zu,%s,%.3f,%.3f,%.3f\n", P, bytes,
                    impl == 0 ? "ordered" : impl == 1 ? "async" : "library", median(t),
                    *std::min_element(t.begin(), t.end()), *std::max_element(t.begin(), t.end()));
      rows += line;
    }
  }
  return rows;
}

// ----------------------------------------------------------------------------

static int gshard_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();
  moe::Config config;
  moe::Flags layer_flags;
  int64_t reps = 20;
  std::string a2a = "ordered";
  int64_t& batch = layer_flags.batch;
  int64_t& tokens = layer_flags.tokens;
  const int64_t& starve = layer_flags.starve;
  bool do_bench = false;
  Cli& cli = lesson.cli;
  cli.summary("GShard expert parallelism: lesson 03's MoE layer with N/P experts per rank, tokens\n"
              "dispatched and combined by a hand-written all-to-all, checked against the single-\n"
              "process layer on all ranks' tokens.");
  moe::add_flags(cli, &config, &layer_flags, "batch size PER RANK",
                 "experts N (a multiple of the world size P)");
  cli.choice("--a2a", &a2a, {"ordered", "async", "library"},
             "all-to-all: pairwise Ssend rounds, all isend/irecv at once, or MPI_Alltoallv");
  cli.toggle("--bench", &do_bench, "time the three all-to-alls instead (ratios to MPI's)");
  cli.flag("--reps", &reps, "--bench repetitions (median reported)", 1, 100000);
  cli.epilog("run:  make run L=04 NP=4 ARGS=\"--experts 8 --topk 2 --a2a ordered\"\n"
             "      make run L=04 NP=2 ARGS=\"--bench\"");
  lesson.parse();
  lesson.usage_error_if(!do_bench && config.experts % P != 0,
                        "--experts " + std::to_string(config.experts) + " is not a multiple of the " +
                            std::to_string(P) + " ranks: every rank holds N/P experts");
  moe::check_flags(comm, &config, layer_flags);
  const A2A how = a2a == "async" ? A2A::async : a2a == "library" ? A2A::library : A2A::ordered;
  if (!do_bench)
    lesson.require_memory(moe::memory_bytes(config, batch * tokens * P),
                          "--batch, --tokens, --experts, --dim or --ffn (the reference runs all "
                          "ranks' tokens in every process)");
  const Device dev = lesson.device;

  if (do_bench) {
    lesson.csv_append("series,P,bytes,impl,us,us_min,us_max", bench(lesson, reps));
    return lesson.finish(0);
  }

  const uint64_t seed = (uint64_t)lesson.flags.seed;
  const int64_t T = batch * tokens, N = config.experts, E = N / P, k = config.topk, d = config.dim,
                f = config.ffn;
  const int64_t T_all = T * P;
  // Every rank builds the same full parameters (counter-based RNG) and keeps its experts.
  moe::Params full = moe::init_params(config, seed, starve, dev);
  moe::Params mine = moe::slice_experts(full, rank * E, (rank + 1) * E);
  // Rank r's batch: rows [r T, (r+1) T) of one global (P B T, d) input; likewise dy.
  Tensor x = randn_slice({T_all, d}, 0, rank * T, (rank + 1) * T, seed + 10).to(dev);
  Tensor dy = randn_slice({T_all, d}, 0, rank * T, (rank + 1) * T, seed + 11).to(dev);
  lesson.print("== 04 GShard EP: P=%d ranks, %lld experts (%lld per rank), top-%lld, gate %s, "
               "%lld tokens per rank, d=%lld f=%lld, all-to-all %s, device %s\n", P,
               (long long)N, (long long)E, (long long)k, moe::gate_name(config.gate), (long long)T,
               (long long)d, (long long)f, a2a.c_str(), device_name(dev));
  lesson.start_trace();
  comm.barrier();
  const Stopwatch watch;
  EPForward forward = ep_forward(comm, how, config, full, mine, x);
  moe::Grads grads = ep_backward(comm, how, config, full, mine, x, forward, dy);
  double ms = watch.ms();
  comm.allreduce(&ms, 1, MPI_DOUBLE, MPI_MAX);

  const Routes& routes = forward.routes;
  // routing slots from rank `source` to rank `destination` (its experts): every rank holds the
  // counts, from one allgather
  auto slots_sent = [&](int source, int destination) {
    int64_t slots = 0;
    for (int64_t e = destination * E; e < (destination + 1) * E; e++)
      slots += routes.counts[(size_t)source][(size_t)e];
    return slots;
  };
  lesson.print("routing map (rows = source rank, columns = destination rank: routing slots "
               "sent), from one allgather of the per-expert counts\n");
  for (int source = 0; source < P && source < 8; source++) {
    lesson.print("    rank %d ->", source);
    for (int destination = 0; destination < P && destination < 8; destination++)
      lesson.print(" %6lld", (long long)slots_sent(source, destination));
    lesson.print("%s\n", P > 8 ? " ..." : "");
  }
  lesson.print("    forward + backward %.2f ms (slowest rank): 4 all-to-alls, 2 allreduces of "
               "the router gradient\n", ms);

  // ---- the reference, one process, on all ranks' tokens: the layer through autograd (what
  // lesson 03 checks its hand-written backward against) for the values, and lesson 03's
  // route -> permute -> experts steps for the rows the all-to-alls must move exactly
  Tensor x_all = randn({T_all, d}, seed + 10).to(dev), dy_all = randn({T_all, d}, seed + 11).to(dev);
  moe::Reference ref = moe::autograd_reference(config, full, x_all, dy_all);
  const moe::Grads& ref_grads = ref.grads;
  moe::Plan ref_plan = moe::permute_plan(moe::route(config, full, x_all).idx, N);
  moe::ExpertCache ref_cache;
  Tensor ref_xp = moe::permute(x_all, ref_plan);
  Tensor ref_yp = moe::experts_forward(full, ref_xp, ref_plan.group_sizes, &ref_cache);
  // reference packed rows of this rank's experts: the groups of experts [rank E, (rank+1) E)
  const std::vector<int64_t> rsizes = ref_plan.group_sizes.to_index_vector();
  int64_t row0 = 0, row1 = 0;
  for (int64_t e = 0; e < (rank + 1) * E; e++) {
    if (e < rank * E) row0 += rsizes[(size_t)e];
    row1 += rsizes[(size_t)e];
  }
  // reference packed rows of this rank's tokens' slots, in this rank's packed order
  const std::vector<int64_t> rpos = ref_plan.pos.to_index_vector(),
                             lpos = forward.local.plan.pos.to_index_vector();
  std::vector<int64_t> mine_in_ref((size_t)(T * k));
  for (int64_t slot = 0; slot < T * k; slot++)
    mine_in_ref[(size_t)lpos[(size_t)slot]] = rpos[(size_t)(rank * T * k + slot)];

  // From here on, the check: its traffic goes to the trace's "check" track, apart from the
  // algorithm's timeline.
  Trace::Category check_traffic(trace(), "check");
  CheckReport check(comm);
  const double eps = FLT_EPSILON, n_terms = (double)(T_all * k + d + f + N);
  auto tol = [&](const Tensor& t) { return 4.0 * n_terms * eps * std::max(max_abs(t), 1e-3); };
  lesson.print("data movement (must be exact: the all-to-all only copies)\n");
  check.exact("dispatch: rows at each expert", forward.xl, slice(ref_xp, 0, row0, row1));
  check.exact("combine: expert outputs back at source", forward.yp_back, take_rows(ref_yp, mine_in_ref));
  lesson.print("against the layer through autograd on all %lld tokens in one process (worst "
               "rank)\n", (long long)T_all);
  Tensor my_rows = slice(ref.y, 0, rank * T, (rank + 1) * T);
  check.close("y", forward.local.y, my_rows, tol(ref.y));
  check.scalar("aux loss (f_i, P_i summed over ranks)", forward.aux, ref.aux,
               8.0 * n_terms * eps * std::max(ref.aux, 1e-3));
  check.close("dx", grads.dx, slice(ref_grads.dx, 0, rank * T, (rank + 1) * T), tol(ref_grads.dx));
  check.close("d router_w (allreduced)", grads.router_w, ref_grads.router_w, tol(ref_grads.router_w));
  check.close("d router_b (allreduced)", grads.router_b, ref_grads.router_b, tol(ref_grads.router_b));
  auto my_experts = [&](const Tensor& t) { return slice(t, 0, rank * E, (rank + 1) * E); };
  check.close("d experts_w1 (this rank's experts)", grads.w1, my_experts(ref_grads.w1), tol(ref_grads.w1));
  check.close("d experts_w3 (this rank's experts)", grads.w3, my_experts(ref_grads.w3), tol(ref_grads.w3));
  check.close("d experts_w2 (this rank's experts)", grads.w2, my_experts(ref_grads.w2), tol(ref_grads.w2));

  // ---- outputs
  auto gather_rows = [&](const Tensor& t) {  // rank order, equal blocks -> (P * rows, cols)
    std::vector<float> mine_v = t.to_vector(), all(mine_v.size() * (size_t)P);
    comm.allgather(mine_v.data(), mine_v.size() * sizeof(float), all.data());
    Shape shape = t.shape();
    shape[0] *= P;
    return Tensor::from_vector(all, shape);
  };
  if (lesson.dumping()) {  // lesson 03's names, x = all ranks' batches in rank order
    Tensor y_all = gather_rows(forward.local.y), dx_all = gather_rows(grads.dx);
    Tensor gates_all = gather_rows(forward.local.routing.gates);
    std::vector<int64_t> idx = forward.local.routing.idx.to_index_vector(), idx_all(idx.size() * (size_t)P);
    comm.allgather(idx.data(), idx.size() * sizeof(int64_t), idx_all.data());
    Tensor w1_all = gather_rows(grads.w1), w3_all = gather_rows(grads.w3), w2_all = gather_rows(grads.w2);
    if (rank == 0) {
      const int64_t B_all = batch * P;
      auto save = [&](const char* name, const Tensor& t, const Shape& shape) {
        lesson.dump(name, t.to(Device::cpu).view(shape));
      };
      save("x", x_all, {B_all, tokens, d});
      save("dy", dy_all, {B_all, tokens, d});
      save("y", y_all, {B_all, tokens, d});
      for (const moe::NamedTensor& named :
           moe::named_parameters(full.router_w, full.router_b, full.w1, full.w3, full.w2))
        lesson.dump(named.name, named.t);
      lesson.dump("aux_loss", Tensor::from_vector({(float)forward.aux}, {}));
      save("topk_idx", Tensor::from_indices(idx_all, {B_all, tokens, k}), {B_all, tokens, k});
      save("topk_val", gates_all, {B_all, tokens, k});
      save("dx", dx_all, {B_all, tokens, d});
      for (const moe::NamedTensor& named :
           moe::named_parameters(grads.router_w, grads.router_b, w1_all, w3_all, w2_all, "d_"))
        lesson.dump(named.name, named.t);  // the experts' gradients gathered from their ranks
      lesson.dump_text("meta.json", moe::meta_json(config, P, ", \"a2a\": \"" + a2a + "\""));
    }
  }
  // series traffic: a = source rank, b = destination rank, c = routing slots sent
  std::string rows;
  for (int source = 0; source < P; source++)
    for (int destination = 0; destination < P; destination++)
      rows += "traffic," + std::to_string(P) + "," + std::to_string(N) + "," + std::to_string(k) +
              "," + std::to_string(source) + "," + std::to_string(destination) + "," +
              std::to_string(slots_sent(source, destination)) + "\n";
  lesson.csv_append("series,P,N,k,a,b,c", rows);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "04_gshard", gshard_lesson);
}
