// common/layers/moe.h — the steps of a sparse mixture-of-experts layer, each with its
// hand-written backward: lesson 03 composes them into the layer, lesson 04 distributes them
// over expert-parallel ranks (so they live here).
//
//   z = x W_g + b_g                       router logits (T, N), x (T, d)
//   p = softmax(z)                        over all N experts (also feeds the aux loss)
//   gate softmax-topk: idx = topk(p, k),  g = p[idx]              (no renormalisation)
//   gate topk-softmax: idx = topk(z, k),  g = softmax(z[idx])     (Mixtral)
//   E_i(u) = (silu(u W1_i) * (u W3_i)) W2_i        SwiGLU expert, W1, W3 (d, f), W2 (f, d)
//   y_t = sum_{j < k} g_tj E_{idx_tj}(x_t)
//   L_aux = alpha * N * sum_i f_i P_i,  f_i = count_i / (k T),  P_i = (1/T) sum_t p_ti
//
// Tensors live on the layer's device (cpu, sim, cuda); the expert path runs the MoE kernels
// of kernels/kernels.h (permute plan, grouped GEMM, combine).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/core/tensor.h"

namespace ff {
class Comm;
}  // namespace ff

namespace ff::moe {

enum class Gate { softmax_topk, topk_softmax };
const char* gate_name(Gate g);

// Mistakes a lesson can plant in the hand-written backward, to watch the check catch them.
enum class Bug {
  none,
  gate_twice,         // the gate factor applied to the expert gradient a second time
  silu_no_upstream,   // dA = silu'(a) * b, forgetting the upstream dH
  no_router_path,     // dx without the router's term dz W_g^T
};

struct Config {
  int64_t experts = 8, topk = 2, dim = 16, ffn = 32;
  Gate gate = Gate::softmax_topk;
  double alpha = 0.01;  // weight of the load-balance loss
};

// Bytes a process needs to run the layer forward and backward on T tokens with every
// expert's parameters, plus the autograd reference beside it (for a lesson's memory check):
// parameters and two sets of gradients, and per routing slot the permuted rows, hidden
// activations and their gradients, counted generously.
double memory_bytes(const Config& c, int64_t T);
// The layer's tensors under the names the dumps use (tests/check_dump_03.py reads them):
// router_w (d, N), router_b (N), experts_w1 and experts_w3 (N, d, f), experts_w2 (N, f, d);
// with prefix "d_", the same for their gradients.
struct NamedTensor {
  std::string name;
  Tensor t;
};
std::vector<NamedTensor> named_parameters(const Tensor& router_w, const Tensor& router_b,
                                          const Tensor& w1, const Tensor& w3, const Tensor& w2,
                                          const std::string& prefix = "");

struct Params {
  Tensor router_w;  // (d, N)
  Tensor router_b;  // (N)
  Tensor w1, w3;    // (N, d, f)
  Tensor w2;        // (N, f, d)
};
// Random weights (counter-based RNG, so every rank can build the same ones), scaled by
// 1/sqrt(fan-in); router bias 0, except the last `starved` experts get -30: they are never
// picked (their softmax probability is ~1e-13), which exercises experts with no tokens.
Params init_params(const Config& c, uint64_t seed, int64_t starved, Device dev);
// Experts [e0, e1) of p, with the router (lesson 04: the experts one rank holds).
Params slice_experts(const Params& p, int64_t e0, int64_t e1);

// The router's decisions, and what the backward needs from them.
struct Routing {
  Tensor logits;  // z (T, N)
  Tensor probs;   // p (T, N)
  Tensor idx;     // (T, k) int64, descending by the gate's ranking
  Tensor gates;   // g (T, k)
};
Routing route(const Config& c, const Params& p, const Tensor& x);

// The sums behind the load-balance loss. Sums, not means, so ranks can add theirs up
// (lesson 04: the loss is over all tokens of all ranks).
struct LoadStats {
  std::vector<double> count;     // routing slots that chose expert i
  std::vector<double> prob_sum;  // sum_t p_ti
  double tokens = 0;             // T
};
LoadStats load_stats(const Config& c, const Routing& r);
double aux_loss(const Config& c, const LoadStats& global);

// ---- the expert path on packed rows (sorted by expert), shared with lesson 04
struct ExpertCache {
  Tensor xp, a, b, h;   // packed inputs (M, d); a = xp W1, b = xp W3, h = silu(a) * b (M, f)
  Tensor group_sizes;   // (G) int64, on the device
};
// The experts' products for float32 weights are the grouped GEMM kernels; a lesson may run
// another GEMM there, group by group, for a while (lesson 10: DeepSeek-V3's FP8 GEMM, which the
// report runs in its experts too) by holding an ExpertGemmScope: c = f(a, b), a (m, k), b (k, n)
// float32 on one device. Its end puts back what ran before. bf16 weights keep their kernels.
using GemmFn = std::function<Tensor(const Tensor& a, const Tensor& b)>;
class ExpertGemmScope {
 public:
  explicit ExpertGemmScope(GemmFn f);
  ~ExpertGemmScope();
  ExpertGemmScope(const ExpertGemmScope&) = delete;
  ExpertGemmScope& operator=(const ExpertGemmScope&) = delete;

 private:
  GemmFn previous_;
};

// yp (M, d) = E_e(xp rows of group e) for every group, G = p.w1.size(0) experts.
Tensor experts_forward(const Params& p, const Tensor& xp, const Tensor& group_sizes,
                       ExpertCache* cache);
struct ExpertGrads {
  Tensor dxp, dw1, dw2, dw3;
};
ExpertGrads experts_backward(const Params& p, const ExpertCache& cache, const Tensor& dyp,
                             Bug bug = Bug::none);
// The same backward in its two halves, for a lesson that defers the weight gradients
// (lesson 06, as lesson 07's I and W): the input half gives dxp now and keeps what the
// weights need; the weight half gives dw1, dw2, dw3 (dxp left undefined) whenever it runs.
struct ExpertInputGrads {
  Tensor dxp;          // (M, d)
  Tensor dyp, da, db;  // kept for the weight half
};
ExpertInputGrads experts_backward_input(const Params& p, const ExpertCache& cache,
                                        const Tensor& dyp, Bug bug = Bug::none);
ExpertGrads experts_backward_weights(const Params& p, const ExpertCache& cache,
                                     const ExpertInputGrads& in);

// ---- the layer's other steps, each forward with its hand-written backward beside it.
// Lesson 03 composes them into the layer (smoe_forward / smoe_backward in its main.cpp);
// lesson 04 composes the same steps with the all-to-alls in between.

// The permute plan: the T*k routing slots sorted by expert (a counting sort, kernel
// moe_permute_plan), so that each expert's rows are contiguous ("packed").
struct Plan {
  Tensor group_sizes;  // (N) int64: slots per expert, in expert order
  Tensor src_token;    // (T*k) int64: the token of packed row i
  Tensor pos;          // (T*k) int64: the packed row of slot s = t*k + j
  int64_t tokens = 0, k = 0;  // T, k
};
Plan permute_plan(const Tensor& idx, int64_t experts);
// xp (T*k, d) = x[src_token]: every token's row once per expert that chose it
Tensor permute(const Tensor& x, const Plan& plan);
// y (T, d): y_t = sum_j g_tj yp[pos[t*k + j]]   (unpermute and combine in one kernel)
Tensor combine(const Tensor& yp, const Plan& plan, const Tensor& gates);
// combine's backward: dyp[pos[s]] = g_s dy_t (the gate applied once), dL/dg_s = <dy_t, yp[pos[s]]>
struct CombineGrads {
  Tensor dyp;     // (T*k, d), packed order
  Tensor dgates;  // (T, k)
};
CombineGrads combine_backward(const Tensor& dy, const Tensor& yp, const Plan& plan,
                              const Tensor& gates);
// permute's backward: dx_t = sum over its k slots of dxp[pos[t*k + j]]
Tensor unpermute_sum(const Tensor& dxp, const Plan& plan);
// Each packed row's gate, (T*k, 1): what --bug gate-twice multiplies in a second time.
Tensor packed_gates(const Plan& plan, const Tensor& gates);
// The router's backward, given dL/dz: dW_g = x^T dz, db = sum_t dz_t, dx = dz W_g^T.
struct RouterGrads {
  Tensor router_w, router_b, dx;
};
RouterGrads router_backward(const Params& p, const Tensor& x, const Tensor& dlogits);
// The router's part of the backward, given dL/dg (T, k): dL/dz (T, N), including the
// load-balance loss's path through p.
Tensor router_dlogits(const Config& c, const Routing& r, const Tensor& dgates,
                      const LoadStats& global);

// What a forward keeps for its backward.
struct Forward {
  Routing routing;
  Plan plan;
  ExpertCache cache;
  Tensor yp;        // expert outputs, packed (T*k, d)
  Tensor y;         // (T, d)
  LoadStats stats;  // this process's tokens
  double aux = 0;
};
struct Grads {
  Tensor dx, router_w, router_b, w1, w2, w3;
};

// The readable form of the forward: for each expert, the list of (token, slot) that chose it;
// the same y as the packed one.
Tensor forward_loop(const Config& c, const Params& p, const Tensor& x, const Routing& r);

// The same layer through the autograd core (loop form, ops only): the reference the
// hand-written backward is checked against.
struct Reference {
  Tensor y;
  double aux = 0;
  Grads grads;
  Tensor idx, gates;
};
Reference autograd_reference(const Config& c, const Params& p, const Tensor& x, const Tensor& dy);

}  // namespace ff::moe
