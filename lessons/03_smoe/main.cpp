// Lesson 03 — a sparse mixture of experts, forward and hand-written backward.
//
// What: a router picks k of N SwiGLU experts for every token; the token's output is the
//   gate-weighted sum of those experts' outputs (Shazeer et al. 2017; Switch Transformer,
//   Fedus et al. 2021; Mixtral, Jiang et al. 2024). A load-balance loss keeps the router from
//   sending everything to a few experts. The layer is composed below (smoe_forward,
//   smoe_backward) from steps in common/layers/moe.h, one line per step, which lesson 04
//   reuses with its all-to-alls in between; this program runs it, shows the routing, and
//   checks it:
//   [1] routing: the gate variant, tokens per expert, the load-balance loss.
//   [2] forward, two ways that must agree: the readable loop over experts with index lists,
//       and the fast one — sort the routing slots by expert (permute), one grouped GEMM per
//       weight matrix over the packed rows ("ragged dot"), unsort with the gate weights.
//   [3] backward by hand — combine, SwiGLU, grouped GEMM weight gradients, the router
//       through the gate's softmax Jacobian, the load-balance loss's path — against autograd
//       of the same layer.
// Why: lecture versions of this backward are often wrong (the gate applied twice, SiLU'
//   without the upstream gradient, the router path to x forgotten). --bug plants each one;
//   the check catches it. Finite differences and PyTorch goldens check the same steps in
//   tests/unit/test_moe.cpp.
// Run:  make run L=03
//       make run L=03 ARGS="--experts 8 --topk 2 --gate topk-softmax"
// Expect: the routing table, "loop vs grouped" and each gradient against autograd with its
//   tolerance, "check: PASS".
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/layers/moe.h"
#include "common/lesson/lesson.h"
#include "common/lesson/moe_flags.h"

using namespace ff;

// ----------------------------------------------------------------------------
// The layer, composed from its steps. Shapes: x (T, d), router z (T, N), k slots per token,
// packed rows (T*k, d) grouped by expert.

// [slide:smoe-forward]
static moe::Forward smoe_forward(const moe::Config& c, const moe::Params& p, const Tensor& x) {
  moe::Forward f;
  f.routing = moe::route(c, p, x);                      // z = x W_g + b, top-k, gates g (T, k)
  f.plan = moe::permute_plan(f.routing.idx, c.experts);  // the T*k slots sorted by expert
  Tensor xp = moe::permute(x, f.plan);                   // xp = x[src_token]: packed rows
  f.yp = moe::experts_forward(p, xp, f.plan.group_sizes, &f.cache);  // grouped GEMMs: SwiGLU
  f.y = moe::combine(f.yp, f.plan, f.routing.gates);     // y_t = sum_j g_tj yp[pos[t k + j]]
  f.stats = moe::load_stats(c, f.routing);               // f_i and P_i, as sums
  f.aux = moe::aux_loss(c, f.stats);                     // alpha N sum_i f_i P_i
  return f;
}
// [/slide]

// Gradients of L = sum(y * dy) + L_aux, the forward's steps in reverse. `global`: the load
// statistics the loss was computed from. The planted bugs (--bug) bite where they are named.
static moe::Grads smoe_backward(const moe::Config& c, const moe::Params& p, const Tensor& x,
                                const moe::Forward& f, const Tensor& dy,
                                const moe::LoadStats& global, moe::Bug bug) {
  // [slide:smoe-backward]
  // combine: dyp = g dy (the gate applied once), dL/dg = <dy_t, yp>
  // [slide:smoe-backward-short]
  moe::CombineGrads cg = moe::combine_backward(dy, f.yp, f.plan, f.routing.gates);
  Tensor dyp = cg.dyp;
  if (bug == moe::Bug::gate_twice) dyp = mul(dyp, moe::packed_gates(f.plan, f.routing.gates));
  // the experts on the packed rows: dW1, dW3, dW2, dxp (--bug silu-no-upstream bites inside:
  // dA = silu'(a) * b, the upstream dH dropped)
  moe::ExpertGrads eg = moe::experts_backward(p, f.cache, dyp, bug);
  Tensor dx_experts = moe::unpermute_sum(eg.dxp, f.plan);  // each token sums its k rows
  // the router: through the gates' softmax Jacobian and the load-balance loss's path
  Tensor dz = moe::router_dlogits(c, f.routing, cg.dgates, global);
  moe::RouterGrads rg = moe::router_backward(p, x, dz);
  moe::Grads g;
  g.dx = bug == moe::Bug::no_router_path ? dx_experts : add(dx_experts, rg.dx);
  g.router_w = rg.router_w, g.router_b = rg.router_b;
  g.w1 = eg.dw1, g.w2 = eg.dw2, g.w3 = eg.dw3;
  // [/slide:smoe-backward-short]
  return g;
  // [/slide]
}

// ----------------------------------------------------------------------------

static int smoe_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  moe::Config config;
  moe::Flags layer_flags;
  std::string bug = "none";
  int64_t& batch = layer_flags.batch;
  int64_t& tokens = layer_flags.tokens;
  const int64_t& starve = layer_flags.starve;
  Cli& cli = lesson.cli;
  cli.summary("Sparse mixture of experts: top-k routing, SwiGLU experts, the load-balance loss,\n"
              "loop vs permute/grouped-GEMM forward, and a hand-written backward checked against\n"
              "autograd. Single process (lesson 04 distributes it).");
  moe::add_flags(cli, &config, &layer_flags, "batch size B", "experts N");
  cli.choice("--bug", &bug, {"none", "gate-twice", "silu-no-upstream", "no-router-path"},
             "plant a backward mistake to watch the check fail");
  cli.epilog("run:  make run L=03 ARGS=\"--experts 8 --topk 2 --gate topk-softmax\"");
  lesson.parse();
  lesson.usage_error_if(comm.size() != 1,
                        "lesson 03 is one process (got " + std::to_string(comm.size()) +
                            " ranks): run it with mpirun -np 1; lesson 04 spreads the experts over ranks");
  moe::check_flags(comm, &config, layer_flags);
  const moe::Bug the_bug = bug == "gate-twice"         ? moe::Bug::gate_twice
                           : bug == "silu-no-upstream" ? moe::Bug::silu_no_upstream
                           : bug == "no-router-path"   ? moe::Bug::no_router_path
                                                       : moe::Bug::none;
  lesson.require_memory(moe::memory_bytes(config, batch * tokens),
                        "--batch, --tokens, --experts, --dim or --ffn");
  const Device dev = lesson.device;
  lesson.start_trace();

  const uint64_t seed = (uint64_t)lesson.flags.seed;
  const int64_t T = batch * tokens, N = config.experts, k = config.topk, d = config.dim, f = config.ffn;
  moe::Params params = moe::init_params(config, seed, starve, dev);
  Tensor x = randn({T, d}, seed + 10).to(dev);   // the (B, T, d) input, as B*T rows
  Tensor dy = randn({T, d}, seed + 11).to(dev);  // the upstream gradient: L = sum(y * dy) + aux
  lesson.print("== 03 sparse MoE: %lld tokens (B=%lld x T=%lld), d=%lld, f=%lld, N=%lld experts, "
               "top-%lld, gate %s, alpha %g, device %s\n", (long long)T, (long long)batch,
               (long long)tokens, (long long)d, (long long)f, (long long)N, (long long)k,
               moe::gate_name(config.gate), config.alpha, device_name(dev));

  // ---------------- [1] routing
  moe::Forward forward;
  {
    Trace::Scope span(trace(), "forward (permute, grouped GEMM, combine)", "compute");
    forward = smoe_forward(config, params, x);
  }
  const std::vector<int64_t> sizes = forward.plan.group_sizes.to_index_vector();
  lesson.print("[1] routing: %s, %lld slots (token, choice)\n",
               config.gate == moe::Gate::softmax_topk
                   ? "g = top-k of softmax(z) over all N (gates sum to < 1)"
                   : "g = softmax of the top-k logits (gates sum to 1)",
               (long long)(T * k));
  lesson.print("    tokens per expert:");
  for (int64_t e = 0; e < N && e < 16; e++) lesson.print(" %lld", (long long)sizes[(size_t)e]);
  lesson.print("%s   (uniform: %.1f)\n", N > 16 ? " ..." : "", (double)(T * k) / (double)N);
  const int64_t empty = std::count(sizes.begin(), sizes.end(), 0);
  if (empty)
    lesson.print("    %lld expert%s received no tokens: no work, and a weight gradient of exactly "
                 "0\n", (long long)empty, empty == 1 ? "" : "s");
  lesson.print("    load-balance loss alpha*N*sum_i f_i P_i = %.6g  (alpha = %g when perfectly "
               "uniform)\n", forward.aux, config.alpha);

  // ---------------- [2] forward two ways
  CheckReport check(comm);
  // Both sides compute each expert output with the same float32 dot products of length d
  // and f; they differ in the GEMM kernels' summation order and in how the k gated terms are
  // added: n = d + f + k terms, each off by eps relative, bound the difference of the two y's
  // by n * eps * max|y| * 4
  // (the 4 for silu's exp and the products around it).
  const double eps = FLT_EPSILON;
  lesson.print("[2] forward: loop over experts (index lists) vs permute -> grouped GEMM -> combine\n");
  Tensor y_loop = moe::forward_loop(config, params, x, forward.routing);
  check.close("y, loop vs grouped", forward.y, y_loop, 4.0 * (double)(d + f + k) * eps * max_abs(y_loop));

  // ---------------- [3] backward
  lesson.print("[3] backward by hand vs autograd of the same layer (loop form, ops only)\n");
  moe::Grads grads;
  {
    Trace::Scope span(trace(), "backward (hand-written)", "compute");
    grads = smoe_backward(config, params, x, forward, dy, forward.stats, the_bug);
  }
  moe::Reference ref = moe::autograd_reference(config, params, x, dy);
  // Every gradient is a float32 sum over at most n = T*k + d + f + N terms (rows of a packed
  // group, a hidden or model dimension, the experts in the router's Jacobian), computed in a
  // different order on each side: tolerance 4 * n * eps times the largest value.
  const double n_terms = (double)(T * k + d + f + N);
  auto tol = [&](const Tensor& t) { return 4.0 * n_terms * eps * std::max(max_abs(t), 1e-3); };
  check.close("y (grouped) vs autograd's", forward.y, ref.y, tol(ref.y));
  check.scalar("aux loss", forward.aux, ref.aux, 8.0 * n_terms * eps * std::max(ref.aux, 1e-3));
  check.close("dx  = expert path + router path", grads.dx, ref.grads.dx, tol(ref.grads.dx));
  check.close("d router_w (through the gates)", grads.router_w, ref.grads.router_w,
              tol(ref.grads.router_w));
  check.close("d router_b", grads.router_b, ref.grads.router_b, tol(ref.grads.router_b));
  check.close("d experts_w1", grads.w1, ref.grads.w1, tol(ref.grads.w1));
  check.close("d experts_w3", grads.w3, ref.grads.w3, tol(ref.grads.w3));
  check.close("d experts_w2", grads.w2, ref.grads.w2, tol(ref.grads.w2));
  if (empty) {
    // an expert with no tokens: exactly zero, not merely small (and no NaN)
    std::vector<float> w1g = grads.w1.to_vector();
    bool zero = true;
    for (int64_t e = 0; e < N; e++)
      if (sizes[(size_t)e] == 0)
        for (int64_t i = 0; i < d * f; i++) zero = zero && w1g[(size_t)(e * d * f + i)] == 0.f;
    check.holds("experts with no tokens: dW exactly 0", zero);
  }

  // ---------------- outputs: the dump (numpy checks it: tests/check_dump_03.py) and the CSV
  auto save = [&](const char* name, const Tensor& t, const Shape& shape) {
    lesson.dump(name, t.to(Device::cpu).view(shape));
  };
  if (lesson.dumping()) {
    save("x", x, {batch, tokens, d});
    save("dy", dy, {batch, tokens, d});
    save("y", forward.y, {batch, tokens, d});
    for (const moe::NamedTensor& named :
         moe::named_parameters(params.router_w, params.router_b, params.w1, params.w3, params.w2))
      lesson.dump(named.name, named.t);
    lesson.dump("aux_loss", Tensor::from_vector({(float)forward.aux}, {}));
    save("topk_idx", forward.routing.idx, {batch, tokens, k});
    save("topk_val", forward.routing.gates, {batch, tokens, k});
    save("dx", grads.dx, {batch, tokens, d});
    for (const moe::NamedTensor& named :
         moe::named_parameters(grads.router_w, grads.router_b, grads.w1, grads.w3, grads.w2, "d_"))
      lesson.dump(named.name, named.t);
    lesson.dump_text("meta.json", moe::meta_json(config, 1, ""));
  }
  // series tokens: a = expert, b = slots; series route: a = slot, b = expert, c = packed row
  std::string rows;
  char line[160];
  for (int64_t e = 0; e < N; e++) {
    std::snprintf(line, sizeof line, "tokens,%s,%lld,%lld,%lld,%lld,%lld,0\n", moe::gate_name(config.gate),
                  (long long)N, (long long)k, (long long)T, (long long)e, (long long)sizes[(size_t)e]);
    rows += line;
  }
  const std::vector<int64_t> idx = forward.routing.idx.to_index_vector(),
                             pos = forward.plan.pos.to_index_vector();
  for (int64_t slot = 0; slot < T * k; slot++) {
    std::snprintf(line, sizeof line, "route,%s,%lld,%lld,%lld,%lld,%lld,%lld\n",
                  moe::gate_name(config.gate), (long long)N, (long long)k, (long long)T, (long long)slot,
                  (long long)idx[(size_t)slot], (long long)pos[(size_t)slot]);
    rows += line;
  }
  lesson.csv_append("series,gate,N,k,T,a,b,c", rows);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "03_smoe", smoe_lesson);
}
