// common/layers/dsv3_moe.h — the DeepSeek-V3 mixture-of-experts layer (DeepSeek-V3 technical
// report §2.1.2; inference/model.py's Gate and MoE), as named steps with their hand-written
// backward. Lesson 05 composes them, over expert-parallel ranks; lessons 06 and 08 reuse them.
//
//   z = x W_g                              router logits (T, N), x (T, d); no logit bias
//   s = sigmoid(z)   (--gate softmax: s = softmax(z))          affinities, per expert
//   selection   on s + b (b: the balancing bias, no gradient):
//               groups: the N experts in G contiguous groups; a group's score is the sum of
//               its group_score_k() largest biased affinities (2 with the sigmoid gate, 1 —
//               the maximum — with softmax); keep the top M groups, then the top K experts
//               inside them -> idx (T, K)
//   capacity    (C > 0) cap = ceil(C T K / N) slots per expert over all tokens of the EP group:
//               overflow slots are dropped, or moved to the token's next-best expert with room
//   gating      on the UNBIASED s of the final selection:
//               sigmoid: g_tj = route_scale * s_t,idx_tj / (sum_j' s_t,idx_tj' + 1e-20)
//               softmax: g_tj = route_scale * s_t,idx_tj            (no renormalisation)
//   routed      r_t = sum_{j kept} g_tj E_{idx_tj}(x_t),  E(u) = (silu(u W1) * (u W3)) W2
//   shared      h_t = (silu(x_t Ws1) * (x_t Ws3)) Ws2: S experts every token passes through,
//               ungated, fused into one SwiGLU of width S f (the same function as S separate
//               experts of width f summed: the hidden units just sit side by side)
//   y_t = r_t + h_t
//   balance     L_bal = alpha * mean over sequences of sum_i f_i P_i, per sequence of L tokens:
//               f_i = N / (K L) * #{t : i in the router's top-K of t},
//               P_i = (1/L) sum_t s_t,i / sum_j s_t,j              (f_i carries no gradient)
//
// Tensors live on the layer's device; the expert paths run common/layers/moe.h's grouped
// GEMMs, the selection runs the moe_group_topk kernel. Small (T, N) arithmetic of the
// router's backward and the capacity assignment (a sequential decision in global token order)
// run on the host, like lesson 03's router_dlogits.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/moe.h"

namespace ff::dsv3 {

enum class GateFn { sigmoid, softmax };
enum class Overflow { drop, next_best };
// What the sequence-wise balance loss's f_i counts: the report's (eq. 18) top-K of the unbiased
// affinities s, or the experts the layer selected (biased, group-limited, before capacity).
enum class AuxCount { unbiased_topk, selected };
const char* gate_name(GateFn g);
const char* overflow_name(Overflow o);

// Mistakes a lesson can plant in the hand-written backward, to watch the check catch them.
enum class Bug {
  none,
  bias_grad,       // the gate's backward differentiates s + b instead of s (the bias leaks in)
  no_renorm,       // the sigmoid gate's backward forgets the normalisation: ds = route_scale dg
  no_shared_grad,  // dx misses the shared experts' path
};

struct Config {
  int64_t experts = 8, topk = 2, dim = 16, ffn = 32;
  int64_t shared = 1;            // S shared experts (0: none), fused width S * ffn
  int64_t groups = 1, topk_groups = 1;
  // a group's score sums its top this-many biased affinities; 0: by the gate, as DeepSeek's code
  // pairs them — the top 2 for the sigmoid gate, which has the bias there (DeepSeek-V3), the
  // maximum (amax) for the softmax gate, which has none there (DeepSeek-V2; this layer's softmax
  // gate still selects on s + b); >= N/G: the sum of the whole group
  int64_t group_score_topk = 0;
  GateFn gate = GateFn::sigmoid;
  double route_scale = 1.0;
  double alpha = 0.0;            // sequence-wise balance loss weight
  double capacity_factor = 0.0;  // 0: no capacity limit
  Overflow overflow = Overflow::drop;
  int64_t seq_len = 16;          // L: tokens per sequence, for the balance loss
  AuxCount aux_count = AuxCount::unbiased_topk;  // what the balance loss's f_i counts
  int64_t group_score_k() const;  // min(group_score_topk or its default above, N / G)
};

struct Params {
  Tensor router_w;        // (d, N)
  Tensor bias;            // (N), selection only; never a gradient
  Tensor w1, w3;          // (N, d, f)
  Tensor w2;              // (N, f, d)
  Tensor sw1, sw3;        // (d, S f)  shared experts, fused (undefined when S = 0)
  Tensor sw2;             // (S f, d)
};
// Random weights, the same on every rank (counter-based RNG), scaled by 1/sqrt(fan-in); the
// bias is drawn from a normal distribution of std bias_spread (seeded) so that it changes some selections.
Params init_params(const Config& c, uint64_t seed, double bias_spread, Device dev);
// The routed experts [e0, e1) of p, everything else shared.
Params slice_experts(const Params& p, int64_t e0, int64_t e1);
// The layer as one autograd op (model::moe_ffn, dsv3::ep_layer): it computes forward and
// backward by hand on p's tensors detached (`plain`), and is recorded with the inputs u, then
// the weights whose gradients its backward leaves to W: the router's, the routed experts' W1,
// W3, W2 and, with shared experts, theirs.
struct RecordedOp {
  Params plain;
  std::vector<Tensor> inputs;  // u, router_w, w1, w3, w2[, sw1, sw3, sw2]
  std::vector<int> weights;    // the weights' places in inputs
};
RecordedOp recorded_op(const Params& p, const Tensor& u, bool shared);
// The experts as common/layers/moe.h's expert path wants them.
moe::Params routed(const Params& p);
moe::Params shared(const Params& p);  // one group: (1, d, S f), (1, S f, d)

// ---- routing
// s (T, N): sigmoid or softmax of x W_g.
Tensor affinities(const Config& c, const Params& p, const Tensor& x);

// The router's choice before capacity: idx (T, K) descending by s + b, within the kept groups.
struct Selection {
  Tensor idx;          // (T, K) int64
  Tensor kept_groups;  // (T, M) int64: the groups a token may use (next-best stays inside)
};
Selection select(const Config& c, const Tensor& s, const Tensor& bias);
// Group scores computed as seed 001 §1.5 writes them, the sum of the raw router logits
// (W_g h)_i of ALL the group's experts (no bias, no sigmoid), instead of the top-2 sum of biased
// affinities: the top M groups of each token, (T, M). The logits are recovered from the
// affinities s: log(s / (1 - s)) for the sigmoid gate; log s for the softmax gate (the logits
// up to one constant per token, which shifts every group of N/G experts alike).
Tensor kept_groups_seed001(const Config& c, const Tensor& s);

// Capacity over all tokens of the EP group, on the host. Inputs are the global (T_all, .)
// tensors in global token order. Output: the final expert of every slot (a dropped slot keeps
// its first choice) and whether the slot is kept, plus the per-expert table.
struct ExpertLoad {
  int64_t capacity = 0;       // slots the expert can take (cap; T K when there is no limit)
  int64_t demand = 0;         // slots the router chose it for
  int64_t overflow = 0;       // of those, beyond capacity
  int64_t dropped = 0;        // of the overflow, dropped (drop, or next-best found no room)
  int64_t moved_out = 0;      // of the overflow, moved to another expert (next-best)
  int64_t moved_in = 0;       // slots it received from others (next-best)
  int64_t load = 0;           // slots it finally processes
};
struct Assignment {
  std::vector<int64_t> idx;   // (T_all * K): the final expert of each slot
  std::vector<uint8_t> kept;  // (T_all * K): 0 = dropped
  std::vector<ExpertLoad> experts;
  int64_t capacity = 0;
};
Assignment assign_capacity(const Config& c, const std::vector<float>& s,
                           const std::vector<float>& bias, const std::vector<int64_t>& idx,
                           const std::vector<int64_t>& kept_groups, int64_t T_all);

// Gates from the unbiased s of the final selection idx (T, K): (T, K) on s's device.
Tensor gates(const Config& c, const Tensor& s, const Tensor& idx);
// The permute plan's expert ids: idx where kept, N (the "dropped" bin, never computed) where not.
Tensor plan_ids(const Config& c, const std::vector<int64_t>& idx, const std::vector<uint8_t>& kept,
                int64_t row0, int64_t rows, Device dev);

// ---- the sequence-wise balance loss: sums over this process's sequences, so ranks can add
// them up (the loss is their mean over all sequences).
struct BalanceStats {
  double loss_sum = 0;               // sum over sequences of sum_i f_i P_i
  std::vector<double> f;             // (sequences * N): f_i of each sequence
  int64_t sequences = 0;
};
// f_i counts, per c.aux_count, the top-K of s (the report's) or idx, the layer's selection.
BalanceStats balance_stats(const Config& c, const Tensor& s, const Tensor& idx);
const char* aux_count_name(AuxCount a);
// The top K of each token's unbiased affinities s (T, N) (ties: the lower expert): (T K) indices.
std::vector<int64_t> unbiased_topk(const std::vector<float>& s, int64_t T, int64_t N, int64_t K);
double balance_loss(const Config& c, double loss_sum_all, int64_t sequences_all);

// ---- the router's backward: dL/dz (T, N) from dL/dg (T, K) and the balance loss's path through
// P (f_i constant, 1/sequences_all from the mean), then dW_g = x^T dz, dx = dz W_g^T.
Tensor router_dlogits(const Config& c, const Tensor& s, const Tensor& bias, const Tensor& idx,
                      const Tensor& dgates, const BalanceStats& bal, int64_t sequences_all,
                      Bug bug = Bug::none);

// ---- the shared experts
Tensor shared_forward(const Params& p, const Tensor& x, moe::ExpertCache* cache);
moe::ExpertGrads shared_backward(const Params& p, const moe::ExpertCache& cache, const Tensor& dy);
// shared_backward in its two halves (moe.h's experts_backward_input / _weights): dxp now, the
// weights' gradients whenever the second runs.
moe::ExpertInputGrads shared_backward_input(const Params& p, const moe::ExpertCache& cache,
                                            const Tensor& dy);
moe::ExpertGrads shared_backward_weights(const Params& p, const moe::ExpertCache& cache,
                                         const moe::ExpertInputGrads& in);

// ---- the whole layer on one process (the reference lesson 05's ranks must equal, and the
// layer lessons 06/08 call when they do not distribute the experts).
struct Forward {
  Tensor s, gates;
  Selection sel;
  Assignment assign;       // over this call's tokens
  Tensor idx;              // (T, K) final experts
  moe::Plan plan;          // over N + 1 groups: the last one holds the dropped slots
  int64_t kept_rows = 0;   // packed rows [0, kept_rows) go to experts
  moe::ExpertCache cache, shared_cache;
  Tensor yp;               // (T K, d) expert outputs, packed; dropped rows 0
  Tensor y;                // (T, d)
  BalanceStats bal;
  double balance = 0;
};
struct Grads {
  Tensor dx, router_w, w1, w2, w3, sw1, sw2, sw3;
};
// The recorded op's gradients in recorded_op's order of inputs: the input half's (dx, the
// weights' left undefined) and the weight half's (one per weight).
std::vector<Tensor> op_input_grads(const Tensor& dx, bool shared);
std::vector<Tensor> op_weight_grads(const Grads& g, bool shared);
Forward forward(const Config& c, const Params& p, const Tensor& x);
Grads backward(const Config& c, const Params& p, const Tensor& x, const Forward& f,
               const Tensor& dy, Bug bug = Bug::none);
// backward in two halves, for a zero-bubble pipeline's I and W (the autograd op of
// model::moe_ffn and ep_layer defers the second): backward_input gives dx (router, routed and
// shared paths) and keeps what the weight gradients need; backward_weights gives those of the
// router (x^T dz), the routed experts (grouped GEMMs on the cached rows) and the shared
// experts, dx left undefined: weight GEMMs alone, no communication. Together, backward's bits.
struct InputGrads {
  Tensor dx;
  Tensor dz;                              // (T, N): the router logits' gradient
  moe::ExpertInputGrads routed, shared;   // shared: undefined when S = 0
};
InputGrads backward_input(const Config& c, const Params& p, const Tensor& x, const Forward& f,
                          const Tensor& dy, Bug bug = Bug::none);
// On the caches of either layer (Forward's, or the EP layer's): p's routed experts are the
// ones whose rows `cache` holds.
Grads backward_weights(const Config& c, const Params& p, const Tensor& x,
                       const moe::ExpertCache& cache, const moe::ExpertCache& shared_cache,
                       const InputGrads& in);

// The same layer through the autograd core (loop form, ops only), on the decisions of
// `assign` (idx, kept): the reference the hand-written backward is checked against. The loss
// is sum(y * dy) + L_bal.
struct Reference {
  Tensor y;
  double balance = 0;
  Grads grads;
};
Reference autograd_reference(const Config& c, const Params& p, const Tensor& x, const Tensor& dy,
                             const Assignment& assign);

// ---- auxiliary-loss-free balancing (DeepSeek-V3, §2.1.2), lessons 05 and 08
// After each step every expert's bias moves by gamma towards balance: up when its load is below
// the mean load, down when above, not at all when equal. With beta > 0 the load is first
// smoothed, as a fraction of the routing slots (lesson 05's --ema). Every rank applies the same
// update to the same summed loads, so the bias stays one tensor.
struct BiasUpdater {
  double gamma = 0, beta = 0;
  std::vector<double> est;  // the smoothed load fractions, one per expert (beta > 0)
  // The bias after one step whose tokens chose the experts `load` times (N numbers; slots: the
  // routing slots of the step, for the smoothed fraction).
  Tensor updated(const Tensor& bias, const std::vector<double>& load, double slots);
};

// ---- dumps: the names tests/check_dump_05.py reads
std::vector<moe::NamedTensor> named_parameters(const Params& p);
std::vector<moe::NamedTensor> named_grads(const Grads& g);
// Bytes one process needs for the layer on T tokens with every expert, the reference beside it.
double memory_bytes(const Config& c, int64_t T);

}  // namespace ff::dsv3
