// Kernel tests: the attention blocks flash_forward_block and flash_backward_block. Four
// checks, each against something independent of the one before:
//   1. device vs cpu (TEST_SUITE "kernels"): kernels/cuda/attention.cu on the device under
//      test (sim, or cuda on a GPU) against kernels/cpu/attention.cpp on the same inputs;
//   2. cpu vs the autograd reference: softmax(Q K^T * scale + mask) V built from common/core/ops.h
//      (matmul, transpose, masked_fill, softmax, concat) and Tensor::backward — with two bugs
//      planted through the kernel's inputs that the same comparison must catch;
//   3. cpu backward vs central finite differences of the cpu forward;
//   4. cpu and device vs PyTorch (tests/reference/data/attention*_*.npy, from
//      tests/reference/ops.py; `make reference` regenerates them).
//
// A "problem" is what one rank of lesson 02 computes: a block of queries at some global
// positions, and KV blocks (other ranks' slices) folded into its running state one after
// another, then the backward of every (Q block, KV block) pair accumulated into dq and into
// each KV block's dk, dv — which start NON-ZERO here, to check the accumulation. Shapes are
// ragged (Sq, Sk in 1, 17, 33, 40: one partial tile, and 2 or 3 tiles with a short last one),
// D in 1, 8, 64, 128 (the largest the device kernels accept), BH in 1, 3; positions are a
// rank's contiguous slice, zigzag halves (non-contiguous), stripes r, r + P, ..., keys that
// start after the first queries (rows that see nothing under causal), and every problem runs
// causal and not.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/core/npy.h"
#include "common/core/ops.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// ----------------------------------------------------------------------------
// problems

struct KvBlock {
  int64_t Sk;
  std::vector<int64_t> kpos;  // (Sk) global positions
  std::vector<float> k, v;    // (BH, Sk, D)
};

struct Problem {
  std::string name;
  int64_t BH, Sq, D;
  bool causal;
  float scale;
  std::vector<int64_t> qpos;    // (Sq)
  std::vector<float> q;         // (BH, Sq, D)
  std::vector<KvBlock> blocks;  // folded into the state in this order
};

// positions: a slice [first, first + n)
std::vector<int64_t> slice_positions(int64_t first, int64_t n) {
  std::vector<int64_t> p((size_t)n);
  for (int64_t t = 0; t < n; t++) p[(size_t)t] = first + t;
  return p;
}
// zigzag halves: the first ceil(n/2) tokens at [a, ...), the rest at [b, ...) (b far after a)
std::vector<int64_t> zigzag_positions(int64_t a, int64_t b, int64_t n) {
  std::vector<int64_t> p = slice_positions(a, (n + 1) / 2), hi = slice_positions(b, n / 2);
  p.insert(p.end(), hi.begin(), hi.end());
  return p;
}
// stripes: r, r + P, r + 2P, ...
std::vector<int64_t> striped_positions(int64_t r, int64_t P, int64_t n) {
  std::vector<int64_t> p((size_t)n);
  for (int64_t t = 0; t < n; t++) p[(size_t)t] = r + t * P;
  return p;
}

// N(0, 1) inputs; with outliers (kt::inputs: every 17th x100) the scores reach ~ +-1000, where
// exp overflows unless the running max is subtracted.
std::vector<float> values(int64_t n, uint64_t seed, bool outliers) {
  return outliers ? kt::inputs(n, seed) : ff::randn({n}, seed).to_vector();
}

Problem make_problem(std::string name, int64_t BH, int64_t D, bool causal,
                     std::vector<int64_t> qpos, const std::vector<std::vector<int64_t>>& kpos,
                     uint64_t seed, bool outliers = false) {
  Problem p{name, BH, (int64_t)qpos.size(), D, causal, 1.f / std::sqrt((float)D), qpos, {}, {}};
  p.q = values(BH * p.Sq * D, seed, outliers);
  for (size_t b = 0; b < kpos.size(); b++) {
    const int64_t Sk = (int64_t)kpos[b].size();
    p.blocks.push_back({Sk, kpos[b], values(BH * Sk * D, seed + 10 + 2 * b, outliers),
                        values(BH * Sk * D, seed + 11 + 2 * b, false)});
  }
  return p;
}

Problem negative_scores(Problem p) {
  for (float& x : p.q) x = -std::fabs(x);
  for (KvBlock& b : p.blocks)
    for (float& x : b.k) x = std::fabs(x);
  return p;
}

// The device-vs-cpu problems (each is run causal and not).
std::vector<Problem> device_problems(bool causal) {
  const char* c = causal ? " causal" : "";
  return {
      // one query, one key
      make_problem(std::string("1 x 1, D 1") + c, 1, 1, causal, {0}, {{0}}, 100),
      // ring, contiguous slices of 17: rank 1's queries [17, 34) against its own block (the
      // diagonal), rank 0's (all in the past) and rank 2's (all in the future: every tile
      // skipped under causal)
      make_problem(std::string("slices of 17, D 8, BH 3") + c, 3, 8, causal,
                   slice_positions(17, 17),
                   {slice_positions(17, 17), slice_positions(0, 17), slice_positions(34, 17)}, 200),
      // uneven blocks around 33 queries at [40, 73): Sk 17, 40, 1
      make_problem(std::string("33 queries, blocks of 17, 40, 1, D 64") + c, 1, 64, causal,
                   slice_positions(40, 33),
                   {slice_positions(0, 17), slice_positions(17, 40), slice_positions(57, 1)}, 300),
      // zigzag over 8 chunks of 20: rank r holds chunks r and 7 - r; rank 1's queries against
      // all four ranks' keys (a tile of 16 rows straddles the two halves)
      make_problem(std::string("zigzag 40, D 128") + c, 1, 128, causal,
                   zigzag_positions(20, 120, 40),
                   {zigzag_positions(20, 120, 40), zigzag_positions(0, 140, 40),
                    zigzag_positions(40, 100, 40), zigzag_positions(60, 80, 40)},
                   400),
      // stripes of P = 2: queries 1, 3, ..., 65 against both ranks' keys
      make_problem(std::string("striped 33, D 128, BH 3") + c, 3, 128, causal,
                   striped_positions(1, 2, 33),
                   {striped_positions(1, 2, 33), striped_positions(0, 2, 33)}, 500),
      // keys start at 5: queries 0..4 see nothing under causal (state left at its start;
      // their lse is -inf and delta NaN, which the backward must never read)
      make_problem(std::string("late keys, D 8") + c, 1, 8, causal, slice_positions(0, 17),
                   {slice_positions(5, 33)}, 600),
      // every score negative (q <= 0 <= k): a running max started at 0 instead of -inf, or
      // padded keys past Sk scored as 0, would win the max
      negative_scores(make_problem(std::string("negative scores, 17 x 17, D 8") + c, 1, 8, causal,
                                   slice_positions(0, 17), {slice_positions(0, 17)}, 650)),
      // outliers: scores ~ +-1000
      make_problem(std::string("outliers, 40 x 33, D 8, BH 3") + c, 3, 8, causal,
                   slice_positions(30, 40), {slice_positions(0, 33), slice_positions(33, 33)}, 700,
                   true),
  };
}

// Whether query i sees key position kp.
bool visible(const Problem& p, int64_t i, int64_t kp) {
  return !p.causal || kp <= p.qpos[(size_t)i];
}

// ----------------------------------------------------------------------------
// running the kernels

struct State {
  std::vector<float> o, m, l;  // (BH, Sq, D), (BH, Sq), (BH, Sq)
};
State initial_state(const Problem& p) {
  return {std::vector<float>((size_t)(p.BH * p.Sq * p.D), 0.f),
          std::vector<float>((size_t)(p.BH * p.Sq), -INFINITY),
          std::vector<float>((size_t)(p.BH * p.Sq), 0.f)};
}

// The state after folding in blocks 0, 1, ... (one entry per block), on device d.
std::vector<State> run_forward(Device d, const Problem& p) {
  const KernelTable& kernels = kernels_for(d);
  State s0 = initial_state(p);
  Tensor o = kt::upload(s0.o, d), m = kt::upload(s0.m, d), l = kt::upload(s0.l, d);
  Tensor q = kt::upload(p.q, d), qpos = kt::upload_indices(p.qpos, d);
  std::vector<State> states;
  for (const KvBlock& b : p.blocks) {
    Tensor k = kt::upload(b.k, d), v = kt::upload(b.v, d), kpos = kt::upload_indices(b.kpos, d);
    kernels.flash_forward_block(o.data(), m.data(), l.data(), q.data(), k.data(), v.data(),
                          qpos.index_data(), kpos.index_data(), p.BH, p.Sq, b.Sk, p.D, p.scale,
                          p.causal);
    states.push_back({o.to_vector(), m.to_vector(), l.to_vector()});
  }
  return states;
}

// What the backward needs from the forward: lse = m + log l and O = o / l (float, as a ring
// would compute them), and delta = rowsum(dout * O) (summed in double, rounded once).
struct Saved {
  std::vector<float> O, lse, delta;
};
Saved saved_for_backward(const Problem& p, const State& s, const std::vector<float>& dout) {
  Saved r{std::vector<float>(s.o.size()), std::vector<float>(s.m.size()),
          std::vector<float>(s.m.size())};
  for (int64_t row = 0; row < p.BH * p.Sq; row++) {
    r.lse[(size_t)row] = s.m[(size_t)row] + std::log(s.l[(size_t)row]);
    double dl = 0;
    for (int64_t c = 0; c < p.D; c++) {
      const size_t e = (size_t)(row * p.D + c);
      r.O[e] = s.o[e] / s.l[(size_t)row];
      dl += (double)dout[e] * r.O[e];
    }
    r.delta[(size_t)row] = (float)dl;
  }
  return r;
}

struct Grads {
  std::vector<float> dq;                   // (BH, Sq, D)
  std::vector<std::vector<float>> dk, dv;  // per block (BH, Sk, D)
};
// Non-zero starting gradients (the kernels accumulate onto them), or zeros.
Grads initial_grads(const Problem& p, bool zero) {
  auto init = [&](int64_t n, uint64_t seed) {
    return zero ? std::vector<float>((size_t)n, 0.f) : kt::inputs(n, seed, 0.5f);
  };
  Grads g{init(p.BH * p.Sq * p.D, 901), {}, {}};
  for (size_t b = 0; b < p.blocks.size(); b++) {
    g.dk.push_back(init(p.BH * p.blocks[b].Sk * p.D, 902 + 2 * b));
    g.dv.push_back(init(p.BH * p.blocks[b].Sk * p.D, 903 + 2 * b));
  }
  return g;
}

// The backward of every (Q block, KV block) pair on device d, accumulated onto g.
Grads run_backward(Device d, const Problem& p, const std::vector<float>& dout,
                   const std::vector<float>& lse, const std::vector<float>& delta, Grads g) {
  const KernelTable& kernels = kernels_for(d);
  Tensor q = kt::upload(p.q, d), qpos = kt::upload_indices(p.qpos, d), dq = kt::upload(g.dq, d);
  Tensor dod = kt::upload(dout, d), lsed = kt::upload(lse, d), deltad = kt::upload(delta, d);
  for (size_t bi = 0; bi < p.blocks.size(); bi++) {
    const KvBlock& b = p.blocks[bi];
    Tensor k = kt::upload(b.k, d), v = kt::upload(b.v, d), kpos = kt::upload_indices(b.kpos, d);
    Tensor dk = kt::upload(g.dk[bi], d), dv = kt::upload(g.dv[bi], d);
    kernels.flash_backward_block(dq.data(), dk.data(), dv.data(), q.data(), k.data(), v.data(),
                           dod.data(), lsed.data(), deltad.data(), qpos.index_data(),
                           kpos.index_data(), p.BH, p.Sq, b.Sk, p.D, p.scale, p.causal);
    g.dk[bi] = dk.to_vector();
    g.dv[bi] = dv.to_vector();
  }
  g.dq = dq.to_vector();
  return g;
}

// ----------------------------------------------------------------------------
// error bounds
//
// Every comparison below is between two float32 computations of the same exact quantity (two
// devices; the flash kernel and the autograd reference; the flash kernel and PyTorch's
// float64 answer rounded once). Each is within B of the exact value, element by element, so
// they are within 2B of each other (B + eps/2 |want| for the float64 goldens). B is computed
// here in double from the inputs, by the standard bounds: a float sum whose longest chain of
// additions is k is within k eps sum|terms| of the exact sum (Higham's gamma_k, with u = eps/2:
// a factor 2 to spare), and a product or exp adds its own rounding. With eps = FLT_EPSILON:
//
// Forward, row i (per (bh, i); j over the keys it sees in the blocks folded so far):
//   score s_ij = scale q_i . k_j: a dot of D terms, then two products: its error is at most
//     e_i = (D + 2) eps max_j a_ij,  a_ij = scale sum_c |q_ic k_jc|.
//   weights w_ij = exp(s_ij - m_i) relative to the final running max: both s_ij and m_i
//     (itself a computed score) are off by <= e_i; the exponents round (eps/2 |s_ij - m_i|
//     in all, the rescales' exponents telescope to that); exp is within 2 ulps (CUDA's expf;
//     glibc's 1) and each rescale multiplies once: 3 eps for each of the <= R + 1 exps that
//     touch a term, R = the number of KV tiles folded in (each may rescale once). So
//       rho_ij = 2 e_i + eps/2 (m_i - s_ij) + 3 eps (R + 1).
//   o_ic = sum_j w_ij v_jc: n_i terms, R rescale products and a product each: chain
//     n_i + R + 1.   B(o_ic) = sum_j w_ij |v_jc| (rho_ij + (n_i + R + 1) eps)
//   l_i = sum_j w_ij: B(l_i) = sum_j w_ij (rho_ij + (n_i + R) eps);   B(m_i) = e_i.
//   The normalised output O = o / l and lse = m + log l, with lambda_i = B(l_i) / l_i:
//     B(O_ic) = B(o_ic) / l_i + |O_ic| (lambda_i + eps),
//     B(lse_i) = e_i + lambda_i + eps (|log l_i| + |lse_i|)   (log and the sum round).
// Backward, from the inputs lse and delta, which may carry errors ell_i and dlt_i of their own
// (0 when both sides get the same floats; B(lse_i) and B(delta_i) against a reference):
//   p_ij = exp(s_ij - lse_i): pi_ij = e_ij + eps/2 |s_ij - lse_i| + 2 eps + ell_i, with e_ij
//     the score bound of this pair, (D + 2) eps a_ij.
//   ds_ij = p_ij (dO_i . v_j - delta_i): the dot (D + 1) eps b_ij, b_ij = sum_c |dO_ic v_jc|,
//     so  sigma_ij = p_ij (|g_ij| (pi_ij + eps) + (D + 1) eps b_ij + dlt_i),  g = dp - delta.
//   dv_jc = dv0 + sum_i p_ij dO_ic over the N_j queries that see key j: the cpu adds them one
//     by one (chain N_j + 1), the device adds per-tile partial sums into dv (chain <= 2 N_j
//     + 1); with the product: B(dv_jc) = sum_i p_ij |dO_ic| (pi_ij + (2 N_j + 2) eps)
//     + (2 N_j + 1) eps |dv0_jc|.
//   dk_jc = dk0 + scale sum_i ds_ij q_ic: B = scale sum_i sigma_ij |q_ic|
//     + (2 N_j + 3) eps (scale sum_i |ds_ij q_ic| + |dk0_jc|);   dq likewise over the n_i keys
//     of row i in all blocks (the device's atomics add per-tile partials: chain <= 2 n_i + 1).
// The bounds are worst cases (every rounding in the same direction): measured errors are at
// most 5e-2 of them (sim vs cpu backward; the sim forward matches cpu bit for bit), 2.4e-2
// against PyTorch and 1.4e-2 against autograd (FF_ATTENTION_VERBOSE=1 prints them). A dropped
// term, a wrong tile, a missing rescale or a missing barrier is off by a whole term, orders of
// magnitude above them; the planted-bug tests below check that the bounds are tight enough.
constexpr double kEps = FLT_EPSILON;

int64_t kv_tiles(const Problem& p, size_t nb) {  // R: KV tiles in blocks [0, nb)
  int64_t R = 0;
  for (size_t b = 0; b < nb; b++) R += (p.blocks[b].Sk + kAttentionTile - 1) / kAttentionTile;
  return R;
}

// scale * q_i . k_j in double, and a_ij = scale sum |q_ic k_jc|
void score(const Problem& p, int64_t bh, int64_t i, const KvBlock& b, int64_t j, double* s,
           double* a) {
  const float* qi = &p.q[(size_t)((bh * p.Sq + i) * p.D)];
  const float* kj = &b.k[(size_t)((bh * b.Sk + j) * p.D)];
  double dot = 0, abs_dot = 0;
  for (int64_t c = 0; c < p.D; c++)
    dot += (double)qi[c] * kj[c], abs_dot += std::fabs((double)qi[c] * kj[c]);
  *s = p.scale * dot;
  *a = p.scale * abs_dot;
}

struct ForwardBound {
  std::vector<double> o, m, l, O, lse;  // B of each element
};

// B of the state after folding blocks [0, nb), and of O and lse derived from it.
ForwardBound forward_bound(const Problem& p, size_t nb) {
  const int64_t R = kv_tiles(p, nb);
  ForwardBound f{std::vector<double>(p.q.size(), 0), std::vector<double>((size_t)(p.BH * p.Sq), 0),
                 std::vector<double>((size_t)(p.BH * p.Sq), 0), std::vector<double>(p.q.size(), 0),
                 std::vector<double>((size_t)(p.BH * p.Sq), 0)};
  struct Key {
    size_t b;
    int64_t j;
    double s;
  };
  for (int64_t bh = 0; bh < p.BH; bh++)
    for (int64_t i = 0; i < p.Sq; i++) {
      const int64_t row = bh * p.Sq + i;
      std::vector<Key> keys;
      double m = -INFINITY, e = 0;
      for (size_t b = 0; b < nb; b++)
        for (int64_t j = 0; j < p.blocks[b].Sk; j++) {
          if (!visible(p, i, p.blocks[b].kpos[(size_t)j])) continue;
          double s, a;
          score(p, bh, i, p.blocks[b], j, &s, &a);
          keys.push_back({b, j, s});
          m = std::max(m, s);
          e = std::max(e, (p.D + 2) * kEps * a);
        }
      if (keys.empty()) continue;  // nothing folded in: the state is untouched, exactly
      const double n = (double)keys.size();
      double l = 0, bl = 0;
      std::vector<double> o((size_t)p.D, 0), bo((size_t)p.D, 0);
      for (const Key& key : keys) {
        const double w = std::exp(key.s - m);
        const double rho = 2 * e + 0.5 * kEps * (m - key.s) + 3 * kEps * (R + 1);
        l += w;
        bl += w * (rho + (n + R) * kEps);
        const float* v = &p.blocks[key.b].v[(size_t)((bh * p.blocks[key.b].Sk + key.j) * p.D)];
        for (int64_t c = 0; c < p.D; c++) {
          o[(size_t)c] += w * v[c];
          bo[(size_t)c] += w * std::fabs(v[c]) * (rho + (n + R + 1) * kEps);
        }
      }
      const double lambda = bl / l, lse = m + std::log(l);
      f.m[(size_t)row] = e;
      f.l[(size_t)row] = bl;
      f.lse[(size_t)row] = e + lambda + kEps * (std::fabs(std::log(l)) + std::fabs(lse));
      for (int64_t c = 0; c < p.D; c++) {
        const size_t el = (size_t)(row * p.D + c);
        f.o[el] = bo[(size_t)c];
        f.O[el] = bo[(size_t)c] / l + std::fabs(o[(size_t)c] / l) * (lambda + kEps);
      }
    }
  return f;
}

struct BackwardBound {
  std::vector<double> dq;
  std::vector<std::vector<double>> dk, dv;
};

// B of the gradients of the backward over all blocks, given the inputs dout, lse, delta (with
// errors ell, dlt of their own: empty = none) and the starting gradients g0.
BackwardBound backward_bound(const Problem& p, const std::vector<float>& dout,
                             const std::vector<float>& lse, const std::vector<float>& delta,
                             const std::vector<double>& ell, const std::vector<double>& dlt,
                             const Grads& g0) {
  const int64_t D = p.D;
  // chain lengths: n_i keys seen by row i over all blocks, N_j queries that see key j
  std::vector<double> n_row((size_t)p.Sq, 0);
  std::vector<std::vector<double>> n_key;
  for (const KvBlock& b : p.blocks) {
    n_key.emplace_back((size_t)b.Sk, 0.0);
    for (int64_t i = 0; i < p.Sq; i++)
      for (int64_t j = 0; j < b.Sk; j++)
        if (visible(p, i, b.kpos[(size_t)j])) n_row[(size_t)i]++, n_key.back()[(size_t)j]++;
  }
  BackwardBound r{std::vector<double>(p.q.size(), 0), {}, {}};
  for (size_t bi = 0; bi < p.blocks.size(); bi++) {
    const KvBlock& b = p.blocks[bi];
    std::vector<double> dk((size_t)(p.BH * b.Sk * D), 0), dv(dk.size(), 0);
    for (int64_t bh = 0; bh < p.BH; bh++)
      for (int64_t j = 0; j < b.Sk; j++) {
        const double Nj = n_key[bi][(size_t)j];
        const float* kj = &b.k[(size_t)((bh * b.Sk + j) * D)];
        const float* vj = &b.v[(size_t)((bh * b.Sk + j) * D)];
        for (int64_t i = 0; i < p.Sq; i++) {
          if (!visible(p, i, b.kpos[(size_t)j])) continue;
          const size_t row = (size_t)(bh * p.Sq + i);
          const float* qi = &p.q[row * D];
          const float* doi = &dout[row * D];
          double s, a;
          score(p, bh, i, b, j, &s, &a);
          double dp = 0, bsum = 0;
          for (int64_t c = 0; c < D; c++)
            dp += (double)doi[c] * vj[c], bsum += std::fabs((double)doi[c] * vj[c]);
          const double pij = std::exp(s - lse[row]), g = dp - delta[row];
          const double pi = (D + 2) * kEps * a + 0.5 * kEps * std::fabs(s - lse[row]) + 2 * kEps +
                            (ell.empty() ? 0 : ell[row]);
          const double sigma = pij * (std::fabs(g) * (pi + kEps) + (D + 1) * kEps * bsum +
                                      (dlt.empty() ? 0 : dlt[row]));
          const double ds = pij * g, ni = n_row[(size_t)i];
          for (int64_t c = 0; c < D; c++) {
            const size_t ej = (size_t)((bh * b.Sk + j) * D + c), ei = row * D + (size_t)c;
            dv[ej] += pij * std::fabs(doi[c]) * (pi + (2 * Nj + 2) * kEps);
            dk[ej] +=
                p.scale * (sigma * std::fabs(qi[c]) + (2 * Nj + 3) * kEps * std::fabs(ds * qi[c]));
            r.dq[ei] +=
                p.scale * (sigma * std::fabs(kj[c]) + (2 * ni + 3) * kEps * std::fabs(ds * kj[c]));
          }
        }
        for (int64_t c = 0; c < D; c++) {
          const size_t ej = (size_t)((bh * b.Sk + j) * D + c);
          dv[ej] += (2 * Nj + 1) * kEps * std::fabs(g0.dv[bi][ej]);
          dk[ej] += (2 * Nj + 3) * kEps * std::fabs(g0.dk[bi][ej]);
        }
      }
    r.dk.push_back(dk);
    r.dv.push_back(dv);
  }
  for (int64_t row = 0; row < p.BH * p.Sq; row++)
    for (int64_t c = 0; c < D; c++) {
      const size_t e = (size_t)(row * D + c);
      r.dq[e] += (2 * n_row[(size_t)(row % p.Sq)] + 3) * kEps * std::fabs(g0.dq[e]);
    }
  return r;
}

// The errors the backward's inputs bring against an exact reference: ell = B(lse) plus its
// rounding to float; dlt for delta = sum_c dO_ic O_ic (summed in double from the float O, whose
// error is B(O), then rounded).
void input_errors(const Problem& p, const ForwardBound& f, const Saved& saved,
                  const std::vector<float>& dout, std::vector<double>* ell,
                  std::vector<double>* dlt) {
  ell->assign(saved.lse.size(), 0);
  dlt->assign(saved.delta.size(), 0);
  for (size_t row = 0; row < ell->size(); row++) {
    (*ell)[row] = f.lse[row] + 0.5 * kEps * std::fabs(saved.lse[row]);
    double abs_dot = 0;
    for (int64_t c = 0; c < p.D; c++)
      abs_dot += std::fabs(dout[row * p.D + c]) * f.O[row * p.D + c];
    (*dlt)[row] = abs_dot + 0.5 * kEps * std::fabs(saved.delta[row]);
  }
}

// tol = factor * bound (+ eps/2 |want| for a float64 reference rounded once)
std::vector<double> tolerance(const std::vector<double>& bound, double factor,
                              const std::vector<float>& want = {}) {
  std::vector<double> t(bound.size());
  for (size_t e = 0; e < t.size(); e++)
    t[e] = factor * bound[e] + (want.empty() ? 0 : 0.5 * kEps * std::fabs(want[e]));
  return t;
}

// The number of elements outside the tolerance (NaN and inf must match exactly), and the
// largest error / tolerance among the finite ones, for the planted-bug checks and the report.
struct Outside {
  size_t count = 0;
  double worst_ratio = 0, worst_err = 0, worst_tol = 0;  // at the largest error / tolerance
};
Outside outside(const std::vector<float>& got, const std::vector<float>& want,
                const std::vector<double>& tol) {
  Outside r;
  for (size_t e = 0; e < got.size(); e++) {
    const double g = got[e], w = want[e];
    if (std::isnan(g) || std::isnan(w) || std::isinf(g) || std::isinf(w)) {
      if (!(g == w || (std::isnan(g) && std::isnan(w)))) r.count++;
      continue;
    }
    const double err = std::fabs(g - w);
    if (err > tol[e]) r.count++;
    const double ratio = tol[e] > 0 ? err / tol[e] : err > 0 ? INFINITY : 0;
    if (ratio > r.worst_ratio || (e == 0 && ratio == 0)) {
      r.worst_ratio = ratio;
      r.worst_err = err;
      r.worst_tol = tol[e];
    }
  }
  return r;
}

// FF_ATTENTION_VERBOSE=1 prints every comparison's worst error / tolerance.
void report(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
            const std::vector<double>& tol) {
  static const bool verbose = std::getenv("FF_ATTENTION_VERBOSE") != nullptr;
  if (!verbose) return;
  const Outside o = outside(got, want, tol);
  std::printf("  %-70s worst err/tol %.3g (err %.3g, tol %.3g)\n", what.c_str(), o.worst_ratio,
              o.worst_err, o.worst_tol);
}
void require_within(const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<double>& tol, int64_t C, const std::string& what) {
  report(what, got, want, tol);
  kt::require_within(got, want, tol, C, what);
}

// ----------------------------------------------------------------------------
// 1. device vs cpu

void check_device_forward(const Problem& p) {
  const Device d = kt::device_under_test();
  std::vector<State> want = run_forward(Device::cpu, p), got = run_forward(d, p);
  for (size_t b = 0; b < p.blocks.size(); b++) {
    const ForwardBound f = forward_bound(p, b + 1);
    const std::string what = "flash_forward_block " + p.name + ", after block " + std::to_string(b);
    require_within(got[b].m, want[b].m, tolerance(f.m, 2), 0, what + ": m");
    require_within(got[b].l, want[b].l, tolerance(f.l, 2), 0, what + ": l");
    require_within(got[b].o, want[b].o, tolerance(f.o, 2), p.D, what + ": o");
  }
}

void check_device_backward(const Problem& p) {
  const Device d = kt::device_under_test();
  const State s = run_forward(Device::cpu, p).back();
  const std::vector<float> dout = kt::inputs(p.BH * p.Sq * p.D, 800);
  const Saved saved = saved_for_backward(p, s, dout);
  const Grads g0 = initial_grads(p, false);
  const Grads want = run_backward(Device::cpu, p, dout, saved.lse, saved.delta, g0);
  const Grads got = run_backward(d, p, dout, saved.lse, saved.delta, g0);
  const BackwardBound bb = backward_bound(p, dout, saved.lse, saved.delta, {}, {}, g0);
  const std::string what = "flash_backward_block " + p.name;
  require_within(got.dq, want.dq, tolerance(bb.dq, 2), p.D, what + ": dq");
  for (size_t b = 0; b < p.blocks.size(); b++) {
    require_within(got.dk[b], want.dk[b], tolerance(bb.dk[b], 2), p.D,
                   what + ": dk of block " + std::to_string(b));
    require_within(got.dv[b], want.dv[b], tolerance(bb.dv[b], 2), p.D,
                   what + ": dv of block " + std::to_string(b));
  }
}

// ----------------------------------------------------------------------------
// 2. the autograd reference: softmax(Q K^T * scale + mask) V over all blocks at once

struct Reference {
  std::vector<float> O, lse, dq;
  std::vector<std::vector<float>> dk, dv;
};

Reference autograd_reference(const Problem& p, const std::vector<float>& dout) {
  Tensor q = Tensor::from_vector(p.q, {p.BH, p.Sq, p.D});
  q.requires_grad_();
  std::vector<Tensor> ks, vs;
  std::vector<int64_t> kpos;
  for (const KvBlock& b : p.blocks) {
    ks.push_back(Tensor::from_vector(b.k, {p.BH, b.Sk, p.D}));
    vs.push_back(Tensor::from_vector(b.v, {p.BH, b.Sk, p.D}));
    ks.back().requires_grad_();
    vs.back().requires_grad_();
    kpos.insert(kpos.end(), b.kpos.begin(), b.kpos.end());
  }
  Tensor k = concat(ks, 1), v = concat(vs, 1);
  Tensor s = scale(matmul(q, transpose(k, 1, 2)), p.scale);  // (BH, Sq, Sk)
  if (p.causal) {
    std::vector<float> hidden((size_t)p.Sq * kpos.size());
    for (int64_t i = 0; i < p.Sq; i++)
      for (size_t j = 0; j < kpos.size(); j++)
        hidden[(size_t)i * kpos.size() + j] = visible(p, i, kpos[j]) ? 0.f : 1.f;
    s = masked_fill(s, Tensor::from_vector(hidden, {p.Sq, (int64_t)kpos.size()}), -INFINITY);
  }
  Tensor O = matmul(softmax(s), v);
  Tensor mx = max(s, -1, true);  // lse = max + log sum exp(s - max)
  Tensor lse = add(reshape(mx, {p.BH, p.Sq}), log(sum(exp(sub(s, mx)), -1)));
  O.backward(Tensor::from_vector(dout, {p.BH, p.Sq, p.D}));
  Reference r{O.to_vector(), lse.to_vector(), q.grad().to_vector(), {}, {}};
  for (size_t b = 0; b < p.blocks.size(); b++) {
    r.dk.push_back(ks[b].grad().to_vector());
    r.dv.push_back(vs[b].grad().to_vector());
  }
  return r;
}

// The cpu flash forward over all blocks vs the reference; then the cpu backward from
// (lse, delta) as given (the correct ones, or ones with a bug planted) vs the reference's
// gradients. Returns the number of gradient elements outside tolerance for dq, dk, dv.
struct GradMisses {
  size_t dq = 0, dk = 0, dv = 0;
};
enum class Plant { none, delta_zero, lse_is_m };

GradMisses compare_with_reference(const Problem& p, Plant plant) {
  const std::vector<float> dout = ff::randn({p.BH * p.Sq * p.D}, 810).to_vector();
  const Reference ref = autograd_reference(p, dout);
  const State s = run_forward(Device::cpu, p).back();
  const Saved saved = saved_for_backward(p, s, dout);
  const ForwardBound f = forward_bound(p, p.blocks.size());
  const std::string what = "cpu flash vs autograd, " + p.name;
  if (plant == Plant::none) {
    require_within(saved.O, ref.O, tolerance(f.O, 2), p.D, what + ": O = o / l");
    require_within(saved.lse, ref.lse, tolerance(f.lse, 2), 0, what + ": lse = m + log l");
  }
  std::vector<double> ell, dlt;
  input_errors(p, f, saved, dout, &ell, &dlt);
  const Grads g0 = initial_grads(p, true);
  const BackwardBound bb = backward_bound(p, dout, saved.lse, saved.delta, ell, dlt, g0);
  std::vector<float> lse = saved.lse, delta = saved.delta;
  if (plant == Plant::delta_zero) std::fill(delta.begin(), delta.end(), 0.f);
  if (plant == Plant::lse_is_m) lse = s.m;
  const Grads g = run_backward(Device::cpu, p, dout, lse, delta, g0);
  GradMisses miss;
  if (plant == Plant::none) {
    require_within(g.dq, ref.dq, tolerance(bb.dq, 2), p.D, what + ": dq");
    for (size_t b = 0; b < p.blocks.size(); b++) {
      require_within(g.dk[b], ref.dk[b], tolerance(bb.dk[b], 2), p.D,
                     what + ": dk " + std::to_string(b));
      require_within(g.dv[b], ref.dv[b], tolerance(bb.dv[b], 2), p.D,
                     what + ": dv " + std::to_string(b));
    }
  }
  miss.dq = outside(g.dq, ref.dq, tolerance(bb.dq, 2)).count;
  for (size_t b = 0; b < p.blocks.size(); b++) {
    miss.dk += outside(g.dk[b], ref.dk[b], tolerance(bb.dk[b], 2)).count;
    miss.dv += outside(g.dv[b], ref.dv[b], tolerance(bb.dv[b], 2)).count;
  }
  return miss;
}

// Problems for the reference: every query sees at least one key (a row that sees nothing is
// NaN in softmax, and 0 / 0 in o / l).
std::vector<Problem> reference_problems(bool causal) {
  const char* c = causal ? " causal" : "";
  return {
      make_problem(std::string("slices of 17, D 8, BH 3") + c, 3, 8, causal,
                   slice_positions(17, 17),
                   {slice_positions(17, 17), slice_positions(0, 17), slice_positions(34, 17)}, 210),
      make_problem(std::string("zigzag 40, D 16") + c, 1, 16, causal, zigzag_positions(20, 120, 40),
                   {zigzag_positions(20, 120, 40), zigzag_positions(0, 140, 40),
                    zigzag_positions(40, 100, 40), zigzag_positions(60, 80, 40)},
                   410),
      make_problem(std::string("striped 33 vs 17 + 33 + 1, D 64") + c, 1, 64, causal,
                   striped_positions(1, 2, 33),
                   {striped_positions(0, 2, 17), striped_positions(34, 2, 33), {1}}, 510),
  };
}

// ----------------------------------------------------------------------------
// 3. finite differences

// L = sum(O * W) of the cpu forward over all blocks (O = o / l in float, L summed in double).
double loss_of_forward(const Problem& p, const std::vector<float>& W) {
  const State s = run_forward(Device::cpu, p).back();
  double L = 0;
  for (int64_t e = 0; e < p.BH * p.Sq * p.D; e++)
    L += (double)(s.o[(size_t)e] / s.l[(size_t)(e / p.D)]) * W[(size_t)e];
  return L;
}

// ----------------------------------------------------------------------------
// 4. PyTorch goldens: q, k, v (BH, S, D), dy = dO, scale (); o, lse, dq, dk, dv

std::vector<float> load_golden(const std::string& case_name, const std::string& tensor) {
  return load_npy("tests/reference/data/" + case_name + "_" + tensor + ".npy").to_vector();
}

// Rows [j0, j0 + n) of x (BH, S, D) as (BH, n, D)
std::vector<float> rows(const std::vector<float>& x, int64_t BH, int64_t S, int64_t D, int64_t j0,
                        int64_t n) {
  std::vector<float> out;
  for (int64_t bh = 0; bh < BH; bh++)
    out.insert(out.end(), x.begin() + (bh * S + j0) * D, x.begin() + (bh * S + j0 + n) * D);
  return out;
}

void check_golden(const std::string& case_name, bool causal, Device d) {
  const int64_t BH = 2, S = 20, D = 8, split = 12;  // the keys in two blocks: [0, 12), [12, 20)
  Problem p{case_name, BH, S, D, causal, load_golden(case_name, "scale")[0], slice_positions(0, S),
            load_golden(case_name, "q"), {}};
  const std::vector<float> k = load_golden(case_name, "k"), v = load_golden(case_name, "v");
  for (auto [j0, n] : {std::pair<int64_t, int64_t>{0, split}, {split, S - split}})
    p.blocks.push_back(
        {n, slice_positions(j0, n), rows(k, BH, S, D, j0, n), rows(v, BH, S, D, j0, n)});
  const std::vector<float> dout = load_golden(case_name, "dy");
  const std::string what = case_name + " golden on " + device_name(d);

  const State s = run_forward(d, p).back();
  const Saved saved = saved_for_backward(p, s, dout);
  const ForwardBound f = forward_bound(p, p.blocks.size());
  const std::vector<float> want_o = load_golden(case_name, "o"),
                           want_lse = load_golden(case_name, "lse");
  require_within(saved.O, want_o, tolerance(f.O, 1, want_o), D, what + ": o");
  require_within(saved.lse, want_lse, tolerance(f.lse, 1, want_lse), 0, what + ": lse");

  std::vector<double> ell, dlt;
  input_errors(p, f, saved, dout, &ell, &dlt);
  const Grads g0 = initial_grads(p, true);
  const Grads g = run_backward(d, p, dout, saved.lse, saved.delta, g0);
  const BackwardBound bb = backward_bound(p, dout, saved.lse, saved.delta, ell, dlt, g0);
  const std::vector<float> want_dq = load_golden(case_name, "dq");
  require_within(g.dq, want_dq, tolerance(bb.dq, 1, want_dq), D, what + ": dq");
  const std::vector<float> want_dk = load_golden(case_name, "dk"),
                           want_dv = load_golden(case_name, "dv");
  for (size_t b = 0; b < 2; b++) {
    const int64_t j0 = b == 0 ? 0 : split, n = p.blocks[b].Sk;
    const std::vector<float> wk = rows(want_dk, BH, S, D, j0, n),
                             wv = rows(want_dv, BH, S, D, j0, n);
    require_within(g.dk[b], wk, tolerance(bb.dk[b], 1, wk), D,
                   what + ": dk block " + std::to_string(b));
    require_within(g.dv[b], wv, tolerance(bb.dv[b], 1, wv), D,
                   what + ": dv block " + std::to_string(b));
  }
}

}  // namespace

// ----------------------------------------------------------------------------

TEST_SUITE("kernels") {

TEST_CASE("kernels: attention, flash_forward_block device vs cpu, KV blocks folded in turn") {
  for (bool causal : {false, true})
    for (const Problem& p : device_problems(causal)) check_device_forward(p);
}

TEST_CASE("kernels: attention, flash_backward_block device vs cpu, onto non-zero dq, dk, dv") {
  for (bool causal : {false, true})
    for (const Problem& p : device_problems(causal)) check_device_backward(p);
}

TEST_CASE("kernels: attention, an empty KV block changes nothing; D > 128 is refused") {
  const Device d = kt::device_under_test();
  // Sk = 0 (an empty KV block): nothing changes
  Problem p = make_problem("empty", 1, 8, true, slice_positions(0, 5), {{}}, 620);
  std::vector<State> s = run_forward(d, p);
  CHECK(s[0].l == initial_state(p).l);
  CHECK(s[0].o == initial_state(p).o);
  if (d == Device::cpu) return;  // the limit is the device kernels' shared memory
  const int64_t D = 129;
  Tensor x = kt::upload(std::vector<float>(16 * D, 0.f), d),
         st = kt::upload(std::vector<float>(16, 0.f), d);
  Tensor pos = kt::upload_indices(slice_positions(0, 16), d);
  const KernelTable& kernels = kt::dut_kernels();
  CHECK_THROWS_AS(
      kernels.flash_forward_block(x.data(), st.data(), st.data(), x.data(), x.data(), x.data(),
                            pos.index_data(), pos.index_data(), 1, 16, 16, D, 1.f, true),
      std::invalid_argument);
  CHECK_THROWS_AS(
      kernels.flash_backward_block(x.data(), x.data(), x.data(), x.data(), x.data(), x.data(), x.data(),
                             st.data(), st.data(), pos.index_data(), pos.index_data(), 1, 16, 16,
                             D, 1.f, true),
      std::invalid_argument);
}

TEST_CASE("kernels: attention, flash blocks vs PyTorch goldens, cpu and device") {
  for (Device d : {Device::cpu, kt::device_under_test()}) {
    check_golden("attention", false, d);
    check_golden("attention_causal", true, d);
  }
}

}  // TEST_SUITE

TEST_CASE("attention: cpu flash blocks folded over all KV blocks equal the autograd reference") {
  for (bool causal : {false, true})
    for (const Problem& p : reference_problems(causal)) {
      GradMisses miss = compare_with_reference(p, Plant::none);
      CHECK(miss.dq + miss.dk + miss.dv == 0);
    }
}

TEST_CASE("attention: bugs planted through the backward's inputs fail the reference check") {
  for (bool causal : {false, true}) {
    const Problem p = reference_problems(causal)[0];
    INFO(p.name);
    // delta = 0: dS = P * dP, the softmax Jacobian without its row term. dq and dk are wrong;
    // dv = P^T dO does not use delta, and must still pass (the bound is not just loose).
    GradMisses miss = compare_with_reference(p, Plant::delta_zero);
    CHECK(miss.dq > 0);
    CHECK(miss.dk > 0);
    CHECK(miss.dv == 0);
    // lse = m (without + log l): P = exp(s - m) is not normalised, every gradient is off
    miss = compare_with_reference(p, Plant::lse_is_m);
    CHECK(miss.dq > 0);
    CHECK(miss.dk > 0);
    CHECK(miss.dv > 0);
  }
}

TEST_CASE("attention: cpu flash backward equals central finite differences of the cpu forward") {
  // L = sum(O * W), W random: dL/dO = W, so the backward's dout is W. Each numeric derivative
  // is (L(x + h) - L(x - h)) / 2h with the float32 forward. Its error has two parts:
  //   rounding: each L is within B_L = sum |W_ic| B(O_ic) of exact (the forward bound), so the
  //     quotient is within B_L / h;
  //   truncation: h^2 / 6 L'''. Estimated from the same data by Richardson's rule: with step
  //     2h the h^2 term is 4 times larger, so it is about |D(2h) - D(h)| / 3 (plus that
  //     difference's rounding, B_L / 2h / 3 + B_L / h / 3 = B_L / 2h).
  // h = 1e-2: the balance of B_L / h (~1e-4 / h here) and h^2 (|L'''| = O(1) for O(1) inputs).
  // Inputs without outliers, a problem small enough for a forward per perturbed element.
  constexpr float kStep = 1e-2f;
  for (bool causal : {false, true}) {
    Problem p =
        make_problem(std::string("fd") + (causal ? " causal" : ""), 1, 4, causal,
                     slice_positions(3, 5), {slice_positions(0, 4), slice_positions(4, 4)}, 1000);
    const std::vector<float> W = ff::randn({p.BH * p.Sq * p.D}, 1001).to_vector();
    const State s = run_forward(Device::cpu, p).back();
    const Saved saved = saved_for_backward(p, s, W);
    const Grads g = run_backward(Device::cpu, p, W, saved.lse, saved.delta, initial_grads(p, true));
    // the planted bug delta = 0 (as in the reference test): the same tolerance must reject it
    const Grads bug =
        run_backward(Device::cpu, p, W, saved.lse, std::vector<float>(saved.delta.size(), 0.f),
                     initial_grads(p, true));
    const ForwardBound f = forward_bound(p, p.blocks.size());
    double B_L = 0;
    for (size_t e = 0; e < W.size(); e++) B_L += std::fabs(W[e]) * f.O[e];
    // the analytic side's own bound is far below these (the backward bound, ~1e-6)
    int checked = 0, bug_caught = 0;
    double worst = 0;
    auto check_element = [&](std::vector<float>& x, size_t e, float analytic, float analytic_bug,
                             const char* name) {
      const float x0 = x[e];
      auto central = [&](float h) {
        x[e] = x0 + h;
        const double up = loss_of_forward(p, W);
        x[e] = x0 - h;
        const double down = loss_of_forward(p, W);
        x[e] = x0;
        return (up - down) / (2.0 * h);
      };
      const double d1 = central(kStep), d2 = central(2 * kStep);
      const double tol = 1.5 * B_L / kStep + std::fabs(d2 - d1) / 3;
      worst = std::max(worst, std::fabs(analytic - d1) / tol);
      if (std::fabs(analytic_bug - d1) > tol) bug_caught++;
      CHECK_MESSAGE(std::fabs(analytic - d1) <= tol,
                    p.name << " d" << name << "[" << e << "]: backward " << analytic
                           << ", finite differences " << d1 << " (tolerance " << tol << ")");
      checked++;
    };
    for (size_t e = 0; e < p.q.size(); e += 2) check_element(p.q, e, g.dq[e], bug.dq[e], "q");
    for (size_t b = 0; b < p.blocks.size(); b++)
      for (size_t e = 0; e < p.blocks[b].k.size(); e += 2) {
        check_element(p.blocks[b].k, e, g.dk[b][e], bug.dk[b][e], "k");
        check_element(p.blocks[b].v, e + 1, g.dv[b][e + 1], bug.dv[b][e + 1], "v");
      }
    if (std::getenv("FF_ATTENTION_VERBOSE"))
      std::printf(
          "  finite differences %-10s %d elements, B_L %.3g, worst err/tol %.3g; "
          "delta = 0 rejected at %d\n",
          p.name.c_str(), checked, B_L, worst, bug_caught);
    CHECK(checked >= 24);
    CHECK(bug_caught > 0);
  }
}
