// Data-parallel AdamW under mpirun (lessons/08_mesh/zero.h), at any world size 1..4, the whole
// world being the DP group. Every rank's gradient of parameter i at step s comes from the
// counter-based RNG with a seed of (rank, i, s), so each rank can regenerate every other
// rank's gradients and compute the mean gradient itself, with no communication.
//
// Two kinds of gradients:
//   exact: randn rounded to multiples of 2^-8 (|g| < 2^4). A sum of at most 4 of them needs
//          at most 8 + 6 = 14 significant bits, so every partial sum is exact in float32 and
//          every summation order (the all-reduce's, the reduce-scatter's, a loop's) gives the
//          same bits. Any difference is then a bug, never rounding: the checks are bitwise.
//   randn: general floats. The sum orders may differ (dp >= 3), and the mean gradients are
//          compared within the bound derived in zero.h: |a - b| <= 2.02 u Σ_r |g_r| (u = 2^-24,
//          the 1.01 covering the γ_k = k u / (1 - k u) of the summation bound); at dp <= 2
//          there is one addition, commutative in IEEE arithmetic: bitwise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/ops.h"
#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "lessons/08_mesh/fsdp.h"
#include "lessons/08_mesh/zero.h"

using namespace ff;

namespace {

Comm world() { return Comm::world(nullptr, nullptr); }

constexpr int kSteps = 4;
const AdamConfig kAdam{/*lr=*/1e-2, /*beta1=*/0.9, /*beta2=*/0.999, /*eps=*/1e-8,
                       /*weight_decay=*/0.1};

// The parameter lists: mixed shapes with N = 73 (prime: never a multiple of dp > 1); one
// number (ranks 1.. own only padding); N = 16 (a multiple of 1, 2, 4 but not 3).
const std::vector<std::vector<Shape>> kLists = {
    {{7, 5}, {13}, {3, 2, 4}, {1}},
    {{1}},
    {{4, 4}},
};

std::vector<Tensor> make_params(const std::vector<Shape>& shapes) {
  std::vector<Tensor> ps;
  for (size_t i = 0; i < shapes.size(); i++) ps.push_back(randn(shapes[i], 1000 + i));
  return ps;
}
std::vector<Tensor*> pointers(std::vector<Tensor>& ps) {
  std::vector<Tensor*> out;
  for (Tensor& p : ps) out.push_back(&p);
  return out;
}

// Rank r's gradient of parameter i at step s.
std::vector<float> grad_of(const Shape& shape, int r, size_t i, int s, bool exact) {
  std::vector<float> g = randn(shape, 7000000 + 10000 * (uint64_t)s + 100 * (uint64_t)r + i).to_vector();
  if (exact)
    for (float& x : g) x = std::max(-15.f, std::min(15.f, std::round(x * 256.f) / 256.f));
  return g;
}
// Sets every parameter's .grad() to this rank's gradient for step s.
void set_grads(std::vector<Tensor>& ps, int rank, int s, bool exact) {
  for (size_t i = 0; i < ps.size(); i++)
    ps[i].impl()->grad =
        Tensor::from_vector(grad_of(ps[i].shape(), rank, i, s, exact), ps[i].shape()).impl_ptr();
}
// The mean over all dp ranks, summed in rank order (the same x / dp as zero.cpp), and the
// rounding bound against any other order: 2.02 u Σ_r |g_r| per element.
void mean_grads(const std::vector<Tensor>& ps, int dp, int s, bool exact,
                std::vector<Tensor>* mean, std::vector<std::vector<float>>* bound) {
  mean->clear(), bound->clear();
  for (size_t i = 0; i < ps.size(); i++) {
    std::vector<float> sum(ps[i].numel(), 0.f), abs_sum(ps[i].numel(), 0.f);
    for (int r = 0; r < dp; r++) {
      std::vector<float> g = grad_of(ps[i].shape(), r, i, s, exact);
      for (size_t k = 0; k < g.size(); k++) sum[k] += g[k], abs_sum[k] += std::fabs(g[k]);
    }
    for (size_t k = 0; k < sum.size(); k++) sum[k] /= (float)dp, abs_sum[k] *= 2.02f * 0x1p-24f;
    mean->push_back(Tensor::from_vector(sum, ps[i].shape()));
    bound->push_back(abs_sum);
  }
}

// How many elements differ by more than tol (0: bitwise), and the largest difference.
struct Diff {
  int64_t count = 0;
  double max = 0;
};
void add_diff(const float* a, const float* b, int64_t n, const float* tol, Diff* d) {
  for (int64_t k = 0; k < n; k++) {
    const double e = std::fabs((double)a[k] - (double)b[k]);
    if (a[k] != b[k] && e > (tol ? tol[k] : 0.f)) d->count++;
    d->max = std::max(d->max, e);
  }
}
Diff diff_params(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  Diff d;
  for (size_t i = 0; i < a.size(); i++) add_diff(a[i].data(), b[i].data(), a[i].numel(), nullptr, &d);
  return d;
}

// ZeRO-0's mean gradient (its .grad() after a step), flattened and padded like ZeRO-1's.
std::vector<float> flat_mean(const std::vector<Tensor>& p0, const zero::ShardedAdam& z1, int dp) {
  std::vector<float> flat(z1.shard_size() * dp, 0.f);
  int64_t at = 0;
  for (const Tensor& p : p0) {
    const float* g = p.grad().data();
    std::copy(g, g + p.numel(), flat.begin() + at);
    at += p.numel();
  }
  return flat;
}

// Runs ZeRO-0 and ZeRO-1 (with `bug`) side by side from the same parameters for kSteps steps
// and counts, bitwise, ZeRO-1's (or with stage and bucket_bytes, ZeRO-2's, in buckets)
// parameters and mean gradient that differ from ZeRO-0's.
// The gradient matters: AdamW is nearly invariant to the gradient's scale (m / sqrt(v)), so a
// gradient dp times too large moves the parameters only through eps, below float rounding
// for dp = 2 or 4; the mean gradient itself is off by a factor dp.
struct Versus {
  Diff params, grads;
};
Versus sharded_vs_zero0(const std::vector<Shape>& shapes, bool exact, zero::Bug bug, int stage = 1,
                        size_t bucket_bytes = 0) {
  Comm c = world();
  Comm check = c.split(0, c.rank());
  std::vector<Tensor> p0 = make_params(shapes), p1 = make_params(shapes);
  zero::DataParallelAdam z0(c, kAdam);
  zero::ShardedAdam z(c, kAdam, bug, stage, bucket_bytes);
  Versus v;
  for (int s = 0; s < kSteps; s++) {
    set_grads(p0, c.rank(), s, exact);
    set_grads(p1, c.rank(), s, exact);
    z0.step(pointers(p0));
    z.step(pointers(p1));
    Diff d = diff_params(p0, p1);
    v.params.count += d.count, v.params.max = std::max(v.params.max, d.max);
    // the mean gradient ShardedAdam used (every rank's shard, gathered) against ZeRO-0's .grad()
    const std::vector<float> mean = z.gather_mean_grad(check);
    int64_t at = 0;
    for (const Tensor& p : p0) add_diff(mean.data() + at, p.grad().data(), p.numel(), nullptr, &v.grads), at += p.numel();
    if (stage == 2)  // ZeRO-2 keeps no full gradient after its step
      for (const Tensor& p : p1) CHECK_FALSE(p.grad().defined());
  }
  return v;
}

}  // namespace

TEST_CASE("zero: ZeRO-0 equals one process running AdamW on the mean gradient") {
  Comm c = world();
  for (bool exact : {true, false})
    for (const auto& shapes : kLists) {
      CAPTURE(exact);
      CAPTURE(shapes.size());
      std::vector<Tensor> p = make_params(shapes), ref = make_params(shapes);
      zero::DataParallelAdam z0(c, kAdam);
      Adam adam(kAdam);
      for (int s = 0; s < kSteps; s++) {
        CAPTURE(s);
        std::vector<Tensor> mean;
        std::vector<std::vector<float>> bound;
        mean_grads(p, c.size(), s, exact, &mean, &bound);
        set_grads(p, c.rank(), s, exact);
        z0.step(pointers(p));
        // The averaged gradient, now in every .grad(): bitwise for exact gradients or dp <= 2,
        // else within the summation bound.
        Diff dg;
        const bool bitwise = exact || c.size() <= 2;
        for (size_t i = 0; i < p.size(); i++)
          add_diff(p[i].grad().data(), mean[i].data(), mean[i].numel(),
                   bitwise ? nullptr : bound[i].data(), &dg);
        CHECK_MESSAGE(dg.count == 0, dg.count << " gradient elements off, max " << dg.max);
        if (exact) {
          // The same mean, the same AdamW: the same parameters, to the bit.
          adam.step(pointers(ref), mean);
          Diff dp = diff_params(p, ref);
          CHECK_MESSAGE(dp.count == 0, dp.count << " parameters differ, max " << dp.max);
        }
      }
    }
}

TEST_CASE("zero: ZeRO-1 equals ZeRO-0 over several steps (padding, mixed shapes)") {
  Comm c = world();
  for (const auto& shapes : kLists) {
    CAPTURE(shapes.size());
    // Exact gradients: both reductions give the same mean, so the parameters are bitwise equal.
    Versus v = sharded_vs_zero0(shapes, /*exact=*/true, zero::Bug::none);
    CHECK_MESSAGE(v.params.count == 0, v.params.count << " parameters differ, max " << v.params.max);
    CHECK_MESSAGE(v.grads.count == 0, v.grads.count << " gradients differ, max " << v.grads.max);
    if (c.size() <= 2) {  // one addition per element: bitwise for any gradients
      Versus g = sharded_vs_zero0(shapes, /*exact=*/false, zero::Bug::none);
      CHECK_MESSAGE(g.params.count == 0, g.params.count << " parameters differ, max " << g.params.max);
      CHECK_MESSAGE(g.grads.count == 0, g.grads.count << " gradients differ, max " << g.grads.max);
    }
  }
}

TEST_CASE("zero: ZeRO-1's mean-gradient shard is ZeRO-0's, within the summation bound") {
  Comm c = world();
  for (bool exact : {true, false})
    for (const auto& shapes : kLists) {
      CAPTURE(exact);
      CAPTURE(shapes.size());
      std::vector<Tensor> p0 = make_params(shapes), p1 = make_params(shapes);
      zero::DataParallelAdam z0(c, kAdam);
      zero::ShardedAdam z1(c, kAdam);
      for (int s = 0; s < 2; s++) {
        std::vector<Tensor> mean;
        std::vector<std::vector<float>> bound;
        mean_grads(p0, c.size(), s, exact, &mean, &bound);
        set_grads(p0, c.rank(), s, exact);
        set_grads(p1, c.rank(), s, exact);
        z0.step(pointers(p0));
        z1.step(pointers(p1));
        // ZeRO-0's mean gradient, flattened and padded like ZeRO-1's; the bound likewise.
        std::vector<float> flat = flat_mean(p0, z1, c.size()), tol(flat.size(), 0.f);
        int64_t at = 0;
        for (const auto& b : bound) std::copy(b.begin(), b.end(), tol.begin() + at), at += b.size();
        REQUIRE(at == z1.numel());
        Diff d;
        const bool bitwise = exact || c.size() <= 2;
        add_diff(z1.grad_shard().data(), flat.data() + z1.shard_begin(), z1.shard_size(),
                 bitwise ? nullptr : tol.data() + z1.shard_begin(), &d);
        CHECK_MESSAGE(d.count == 0, d.count << " shard elements off, max " << d.max);
      }
    }
}

TEST_CASE("zero: memory per rank, measured against the formula") {
  Comm c = world();
  const int dp = c.size();
  for (const auto& shapes : kLists) {
    CAPTURE(shapes.size());
    std::vector<Tensor> p0 = make_params(shapes), p1 = make_params(shapes);
    zero::DataParallelAdam z0(c, kAdam);
    zero::ShardedAdam z1(c, kAdam);
    set_grads(p0, c.rank(), 0, true);
    set_grads(p1, c.rank(), 0, true);
    CHECK(z1.memory(pointers(p1)).optimizer == 0);  // nothing before the first step
    z0.step(pointers(p0));
    z1.step(pointers(p1));
    int64_t n = 0;
    for (const Tensor& t : p0) n += t.numel();
    const size_t shard = (size_t)((n + dp - 1) / dp);
    const zero::Memory m0 = z0.memory(pointers(p0)), m1 = z1.memory(pointers(p1));
    const zero::Memory f0 = zero::formula(n, dp, 0), f1 = zero::formula(n, dp, 1);
    CHECK(m0.params == 4 * (size_t)n);
    CHECK(m0.grads == 4 * (size_t)n);
    CHECK(m0.optimizer == 8 * (size_t)n);
    CHECK(m1.optimizer == shard * 8);  // ceil(N/dp) numbers of m and of v
    CHECK(m0.buffers == 4 * (size_t)n);
    CHECK(m1.buffers == 4 * shard * dp + 2 * 4 * shard);  // flat, grad shard, param shard
    for (auto [m, f] : {std::pair{m0, f0}, std::pair{m1, f1}}) {
      CHECK(m.params == f.params);
      CHECK(m.grads == f.grads);
      CHECK(m.optimizer == f.optimizer);
    }
    // ~1/dp of ZeRO-0's: dp shards hold at least all of it, and at most dp - 1 padding numbers.
    CHECK(m1.optimizer * dp >= m0.optimizer);
    CHECK(m1.optimizer * dp < m0.optimizer + 8 * (size_t)dp);
  }
  CHECK(zero::mixed_precision_bytes(1000, 4, 0) == 16000.0);
  CHECK(zero::mixed_precision_bytes(1000, 4, 1) == 4000.0 + 3000.0);
  CHECK(zero::mixed_precision_bytes(1000, 4, 3) == 4000.0);
}

TEST_CASE("zero: planted errors are caught by the ZeRO-1 vs ZeRO-0 comparison") {
  Comm c = world();
  for (const auto& shapes : kLists) {
    CAPTURE(shapes.size());
    // A stale shard: the all-gather sends the block from before the step. Caught at any dp
    // (at dp 1 the whole update is lost).
    Versus stale = sharded_vs_zero0(shapes, /*exact=*/true, zero::Bug::stale_shard);
    CHECK_MESSAGE(stale.params.count > 0, "a stale shard went unnoticed");
    // No divide: the step uses dp times the mean gradient, which the gradient comparison sees
    // (the parameters may not: see sharded_vs_zero0). At dp 1 the sum is the mean: no bug.
    // Counted over the group: a rank that owns only padding (the one-number list) has no
    // gradient to get wrong.
    Versus sum = sharded_vs_zero0(shapes, /*exact=*/true, zero::Bug::no_divide);
    float wrong = (float)sum.grads.count;
    c.allreduce_sum(&wrong, 1);
    if (c.size() > 1)
      CHECK_MESSAGE(wrong > 0, "the missing divide by dp went unnoticed");
    else
      CHECK(sum.grads.count + sum.params.count == 0);
  }
}

namespace {

// A list long enough to cut: 10 tensors of 1..10 rows of 3.
std::vector<Shape> ladder() {
  std::vector<Shape> s;
  for (int64_t i = 1; i <= 10; i++) s.push_back({i, 3});
  return s;
}

}  // namespace

TEST_CASE("zero: ZeRO-1 and ZeRO-2, one bucket or many, equal ZeRO-0 bit for bit") {
  Comm c = world();
  std::vector<std::vector<Shape>> lists = kLists;
  lists.push_back(ladder());
  for (const auto& shapes : lists)
    for (int stage : {1, 2})
      for (size_t bucket_bytes : {size_t{0}, size_t{40}, size_t{100}}) {
        CAPTURE(shapes.size());
        CAPTURE(stage);
        CAPTURE(bucket_bytes);
        for (bool exact : {true, false}) {
          if (!exact && c.size() > 2) continue;  // several additions: orders may differ (zero.h)
          Versus v = sharded_vs_zero0(shapes, exact, zero::Bug::none, stage, bucket_bytes);
          CHECK_MESSAGE(v.params.count == 0, v.params.count << " parameters differ, max " << v.params.max);
          CHECK_MESSAGE(v.grads.count == 0, v.grads.count << " gradients differ, max " << v.grads.max);
        }
      }
}

TEST_CASE("zero: the buckets cut the parameters from the last one back, each padded on its own") {
  Comm c = world();
  const int dp = c.size();
  std::vector<Tensor> p = make_params(ladder());  // 3, 6, ..., 30 numbers
  zero::ShardedAdam z(c, kAdam, zero::Bug::none, 2, /*bucket_bytes=*/200);  // 50 numbers
  set_grads(p, c.rank(), 0, true);
  z.step(pointers(p));
  // from the end: 30 + 27 = 57 >= 50 | 24 + 21 + 18 = 63 | 15 + 12 + 9 + 6 + 3 = 45, the
  // first parameter closing the last bucket whatever its size
  const auto& b = z.buckets().buckets();
  REQUIRE(b.size() == 3);
  CHECK((b[0].first == 8 && b[0].last == 10 && b[0].numel == 57));
  CHECK((b[1].first == 5 && b[1].last == 8 && b[1].numel == 63));
  CHECK((b[2].first == 0 && b[2].last == 5 && b[2].numel == 45));
  int64_t shard = 0;
  for (const auto& k : b) {
    CHECK(k.padded % dp == 0);
    CHECK(k.padded - k.numel < dp);
    shard += k.padded / dp;
  }
  CHECK(z.shard_size() == shard);
  // ZeRO-2's memory: the gradients are the shard, m and v the shard twice; the formula per bucket
  const zero::Memory m = z.memory(pointers(p));
  const zero::Memory f = zero::formula(std::vector<int64_t>{57, 63, 45}, dp, 2);
  CHECK(m.params == f.params);
  CHECK(m.grads == 4 * (size_t)shard);
  CHECK(m.grads == f.grads);
  CHECK(m.optimizer == f.optimizer);
  CHECK(m.buffers == 4 * (size_t)shard);  // the parameter shard; the flat buffer is released
  CHECK(zero::formula(std::vector<int64_t>{165}, dp, 2).grads == zero::formula(165, dp, 2).grads);
  CHECK(zero::formula(165, dp, 3).params == 4 * (size_t)((165 + dp - 1) / dp));
}

namespace {
// One backward through autograd on every rank: loss = sum_i sum(w_i * x_i), x_i from the rank,
// so d loss / d w_i = x_i; the buckets armed before it (or not) and the bug (or not).
struct HookRun {
  std::vector<Tensor> params;
  std::vector<float> mean;  // the mean gradient the step used, whole
  zero::BucketTimes times;
};
HookRun hooked_step(bool arm, bool early) {
  Comm c = world();
  Comm check = c.split(0, c.rank());
  HookRun run;
  run.params = make_params(ladder());
  for (Tensor& p : run.params) p.requires_grad_();
  zero::ShardedAdam z(c, kAdam, zero::Bug::none, 2, /*bucket_bytes=*/200);
  z.buckets().layout(pointers(run.params));
  z.buckets().post_one_early(early);
  if (arm) z.buckets().arm();
  Tensor loss;
  for (size_t i = 0; i < run.params.size(); i++) {
    const Tensor x = Tensor::from_vector(grad_of(run.params[i].shape(), c.rank(), i, 0, true), run.params[i].shape());
    const Tensor term = sum_all(mul(run.params[i], x));
    loss = loss.defined() ? add(loss, term) : term;
  }
  loss.backward();
  z.step(pointers(run.params));
  run.mean = z.gather_mean_grad(check);
  run.times = z.buckets().times();
  return run;
}
}  // namespace

TEST_CASE("zero: buckets posted by the backward's hooks give the step of buckets posted after it") {
  Comm c = world();
  const HookRun after = hooked_step(/*arm=*/false, false), during = hooked_step(/*arm=*/true, false);
  CHECK(after.times.posted_early == 0);
  CHECK(during.times.posted_early == 3);  // every bucket went during the backward
  CHECK(during.times.buckets == 3);
  CHECK(after.mean == during.mean);
  CHECK(diff_params(after.params, during.params).count == 0);
  // the planted bug: a bucket posted with one gradient still missing. That gradient is
  // reduced as zeros (ZeRO-2 has released the rest): the mean differs, whatever dp.
  const HookRun early = hooked_step(/*arm=*/true, /*early=*/true);
  CHECK(early.mean != during.mean);
}

TEST_CASE("zero: the buckets' hidden fraction is lesson 06's (T_seq - T_ovl) / min(T_compute, T_comm)") {
  zero::BucketTimes t;
  t.window_s = 10, t.comm_s = 4, t.exposed_s = 1;  // T_seq 14, T_ovl 11: 3 of 4 hidden
  CHECK(t.hidden_fraction() == doctest::Approx(0.75));
  t.exposed_s = 4;  // nothing hidden
  CHECK(t.hidden_fraction() == 0.0);
  t.window_s = 2, t.exposed_s = 2;  // a window shorter than the communication: at most 2 hideable
  CHECK(t.hidden_fraction() == doctest::Approx(1.0));
  t.window_s = 0;  // never armed
  CHECK(t.hidden_fraction() == 0.0);
}

namespace {

// Mixed precision: bf16 weights (with bf16 gradients) beside float32 ones. Rank r's gradient at
// step s is grad_of's exact one rounded to bf16: still a multiple of 2^-8 under 16, so its sums
// over the ranks are exact in float32 in any order, and the checks are bitwise at any dp.
const std::vector<Shape> kMixed = {{7, 5}, {13}, {3, 2, 4}, {1}};
bool is_bf16(size_t i) { return i % 2 == 0; }  // {7, 5} and {3, 2, 4}

// Weights N(0, 1), or (near_one) 1 + N(0, 0.01^2): there half a bf16 step is 2^-9 or 2^-8
std::vector<Tensor> mixed_params(bool near_one) {
  std::vector<Tensor> ps;
  for (size_t i = 0; i < kMixed.size(); i++) {
    Tensor p = randn(kMixed[i], 2000 + i);
    if (near_one) p = add(scale(p, 0.01f), Tensor::full(kMixed[i], 1.f));
    ps.push_back(is_bf16(i) ? p.to_dtype(DType::bf16) : p);
  }
  return ps;
}
// Rank r's gradients at step s (steady: (1 + r) / 4 everywhere, every step the same sign, so
// AdamW's update is about lr each step)
std::vector<float> bf16_grad_of(const Shape& shape, int r, size_t i, int s, bool steady) {
  if (steady) return std::vector<float>((size_t)shape_numel(shape), 0.25f * (float)(1 + r));
  return Tensor::from_vector(grad_of(shape, r, i, s, true), shape).to_dtype(DType::bf16).to_vector();
}
void set_mixed_grads(std::vector<Tensor>& ps, int rank, int s, bool steady) {
  for (size_t i = 0; i < ps.size(); i++) {
    const Tensor g = Tensor::from_vector(bf16_grad_of(ps[i].shape(), rank, i, s, steady), ps[i].shape());
    ps[i].impl()->grad = (is_bf16(i) ? g.to_dtype(DType::bf16) : g).impl_ptr();
  }
}
// The mean over the ranks in float32 (exact sums, then / dp as zero.cpp divides)
std::vector<Tensor> mixed_means(const std::vector<Tensor>& ps, int dp, int s, bool steady) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < ps.size(); i++) {
    std::vector<float> sum((size_t)ps[i].numel(), 0.f);
    for (int r = 0; r < dp; r++) {
      const std::vector<float> g = bf16_grad_of(ps[i].shape(), r, i, s, steady);
      for (size_t k = 0; k < g.size(); k++) sum[k] += g[k];
    }
    for (float& x : sum) x /= (float)dp;
    out.push_back(Tensor::from_vector(sum, ps[i].shape()));
  }
  return out;
}
// Elements whose bits differ (bf16 compared widened: exact)
int64_t differing(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); i++) {
    CHECK(a[i].dtype() == b[i].dtype());
    const std::vector<float> x = a[i].to_vector(), y = b[i].to_vector();
    for (size_t k = 0; k < x.size(); k++) n += x[k] != y[k];
  }
  return n;
}

// ZeRO `stage` over the mixed list for `steps` steps against one process's AdamW with float32
// masters on the mean gradient; returns the most parameter elements that differed after a step,
// and through `moved` how many of the bf16 weights' elements changed from their start. slow:
// weights near 1, steady gradients, lr 1e-4 (AdamW's update about lr, a twentieth of a bf16 step).
int64_t mixed_vs_one_process(int stage, int steps, bool slow, zero::Bug bug, int64_t* moved) {
  Comm c = world();
  AdamConfig adam = kAdam;
  if (slow) adam.lr = 1e-4, adam.weight_decay = 0;
  std::vector<Tensor> p = mixed_params(slow), ref = mixed_params(slow), start = mixed_params(slow);
  zero::DataParallelAdam z0(c, adam);
  zero::ShardedAdam z(c, adam, bug, std::max(stage, 1));
  Adam one(adam);
  int64_t worst = 0;
  for (int s = 0; s < steps; s++) {
    set_mixed_grads(p, c.rank(), s, slow);
    stage == 0 ? z0.step(pointers(p)) : z.step(pointers(p));
    one.step(pointers(ref), mixed_means(ref, c.size(), s, slow));
    worst = std::max(worst, differing(p, ref));
  }
  *moved = 0;
  for (size_t i = 0; i < p.size(); i++)
    if (is_bf16(i)) {
      const std::vector<float> a = p[i].to_vector(), b = start[i].to_vector();
      for (size_t k = 0; k < a.size(); k++) *moved += a[k] != b[k];
    }
  return worst;
}

}  // namespace

TEST_CASE("zero: bf16 weights with float32 masters: ZeRO-0, -1 and -2 equal one process's AdamW, bit for bit") {
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    int64_t moved = 0;
    CHECK(mixed_vs_one_process(stage, kSteps, false, zero::Bug::none, &moved) == 0);
    CHECK(moved > 0);
    // An update of about 1e-4 on weights near 1 is under half a bf16 step (2^-9 below 1,
    // 2^-8 above): only a master that keeps it adds it up. 60 steps (6e-3) move every weight,
    // all with one process's masters.
    CHECK(mixed_vs_one_process(stage, 60, true, zero::Bug::none, &moved) == 0);
    CHECK(moved == 7 * 5 + 3 * 2 * 4);
  }
  // The planted bug: ZeRO-1's shard read again from the bf16 weights every step. The small
  // updates round away: the weights stay put and part from one process's
  int64_t moved = 0;
  CHECK(mixed_vs_one_process(1, 60, true, zero::Bug::no_master, &moved) > 0);
  CHECK(moved == 0);
}

namespace {

// ZeRO-3 (fsdp.h) over the mixed list, as two units ({7, 5}, {13}; {3, 2, 4}, {1}): each step
// every unit gathered, its gradients set and reduced, then AdamW on the shards; against one
// process's AdamW with masters as mixed_vs_one_process. Returns the most elements that differed
// after a step, `moved` as there; `memory`: the group's after the last step.
int64_t zero3_mixed_vs_one_process(int steps, bool slow, int64_t* moved, zero::Memory* memory) {
  Comm c = world();
  AdamConfig adam = kAdam;
  if (slow) adam.lr = 1e-4, adam.weight_decay = 0;
  std::vector<Tensor> p = mixed_params(slow), ref = mixed_params(slow), start = mixed_params(slow);
  fsdp::ShardGroup group(c, adam, 2);
  for (size_t i = 0; i < p.size(); i++) group.add(&p[i], (int)i / 2);
  group.shard();
  Adam one(adam);
  int64_t worst = 0;
  for (int s = 0; s < steps; s++) {
    for (int u = 0; u < 2; u++) {
      group.gather(u);
      for (size_t i = 2 * (size_t)u; i < 2 * (size_t)u + 2; i++) {  // this unit's gradients, set_mixed_grads's
        const Tensor g = Tensor::from_vector(bf16_grad_of(p[i].shape(), c.rank(), i, s, slow), p[i].shape());
        p[i].impl()->grad = (is_bf16(i) ? g.to_dtype(DType::bf16) : g).impl_ptr();
      }
      group.reduce(u);
      group.free(u);
    }
    group.step();
    one.step(pointers(ref), mixed_means(ref, c.size(), s, slow));
    for (int u = 0; u < 2; u++) group.gather(u);
    worst = std::max(worst, differing(p, ref));
    *memory = group.memory();
    for (int u = 0; u < 2; u++) group.free(u);
  }
  for (int u = 0; u < 2; u++) group.gather(u);
  *moved = 0;
  for (size_t i = 0; i < p.size(); i++)
    if (is_bf16(i)) {
      const std::vector<float> a = p[i].to_vector(), b = start[i].to_vector();
      for (size_t k = 0; k < a.size(); k++) *moved += a[k] != b[k];
    }
  for (int u = 0; u < 2; u++) group.free(u);
  *memory = group.memory();
  return worst;
}

}  // namespace

TEST_CASE("zero: ZeRO-3 over bf16 weights: float32 masters in the shard, one process's AdamW bit for bit, 16 bytes / dp") {
  int64_t moved = 0;
  zero::Memory m;
  CHECK(zero3_mixed_vs_one_process(kSteps, false, &moved, &m) == 0);
  CHECK(moved > 0);
  // the updates under half a bf16 step add up in the shard's masters, as one process's
  CHECK(zero3_mixed_vs_one_process(60, true, &moved, &m) == 0);
  CHECK(moved == 7 * 5 + 3 * 2 * 4);
  // between steps no weight is held; the shard (the masters), m and v 12 bytes, the float32
  // gradient shard 4, per parameter of the shard: each unit padded to a multiple of dp
  const int dp = world().size();
  const size_t s0 = (35 + 13 + (size_t)dp - 1) / (size_t)dp, s1 = (24 + 1 + (size_t)dp - 1) / (size_t)dp;
  CHECK(m.params == 0);
  CHECK(m.grads == 4 * (s0 + s1));
  CHECK(m.optimizer == 12 * (s0 + s1));
  const zero::Memory f = zero::mixed_formula_units({35 + 13, 24 + 1}, dp);
  CHECK((f.params == m.params && f.grads == m.grads && f.optimizer == m.optimizer));
}

TEST_CASE("zero: bf16 weights' memory: 2 + 2 bytes held, the float32 master with m and v in the optimizer") {
  Comm c = world();
  const int dp = c.size();
  std::vector<Tensor> all_bf16;
  for (const Shape& s : {Shape{7, 5}, Shape{3, 2, 4}}) all_bf16.push_back(randn(s, 3).to_dtype(DType::bf16));
  const size_t n = 35 + 24, shard = (n + (size_t)dp - 1) / (size_t)dp;
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    std::vector<Tensor> p = all_bf16;
    for (Tensor& t : p) t = t.to_dtype(DType::f32).to_dtype(DType::bf16);  // their own storage
    zero::DataParallelAdam z0(c, kAdam);
    zero::ShardedAdam z(c, kAdam, zero::Bug::none, std::max(stage, 1));
    for (size_t i = 0; i < p.size(); i++)
      p[i].impl()->grad = Tensor::zeros(p[i].shape(), Device::cpu, DType::bf16).impl_ptr();
    stage == 0 ? z0.step(pointers(p)) : z.step(pointers(p));
    const zero::Memory m = stage == 0 ? z0.memory(pointers(p)) : z.memory(pointers(p));
    CHECK(m.params == 2 * n);
    CHECK(m.grads == (stage == 2 ? 4 * shard : stage == 1 ? 2 * n : 2 * n));  // ZeRO-2: the reduced float32 shard
    CHECK(m.optimizer == (stage == 0 ? 12 * n : 12 * shard));                 // master, m, v
    const zero::Memory f = zero::mixed_formula((int64_t)n, 0, dp, stage);
    CHECK((f.params == m.params && f.grads == m.grads && f.optimizer == m.optimizer));
  }
  // float32 alone: the float32 formula
  for (int stage : {0, 1, 2}) {
    const zero::Memory a = zero::mixed_formula(73, 0, dp, stage), b = zero::formula(73, dp, stage);
    const size_t shard = (73 + (size_t)dp - 1) / (size_t)dp;
    CHECK(a.params == 2 * 73);
    CHECK(a.grads == (stage == 2 ? 4 * shard : 2 * 73));
    CHECK(a.optimizer == (stage == 0 ? 12 * 73 : 12 * shard));
    const zero::Memory c = zero::mixed_formula(0, 73, dp, stage);
    CHECK((c.params == b.params && c.grads == b.grads && c.optimizer == b.optimizer));
  }
}

TEST_CASE("zero: AdamW's moments in bf16: 2 bytes each in every stage, the formula with 2-byte moments") {
  Comm c = world();
  const int dp = c.size();
  AdamConfig adam = kAdam;
  adam.bf16_moments = true;
  const size_t n16 = 35, n32 = 24, shard = (n16 + n32 + (size_t)dp - 1) / (size_t)dp;
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    std::vector<Tensor> p{randn({7, 5}, 3).to_dtype(DType::bf16), randn({3, 2, 4}, 4)};
    for (Tensor& t : p) t.impl()->grad = Tensor::zeros(t.shape(), Device::cpu, t.dtype()).impl_ptr();
    zero::DataParallelAdam z0(c, adam);
    zero::ShardedAdam z(c, adam, zero::Bug::none, std::max(stage, 1));
    stage == 0 ? z0.step(pointers(p)) : z.step(pointers(p));
    const zero::Memory m = stage == 0 ? z0.memory(pointers(p)) : z.memory(pointers(p));
    // the master (4) and m and v (2 + 2): of the bf16 weights at ZeRO-0, of the shard beyond
    CHECK(m.optimizer == (stage == 0 ? 8 * n16 + 4 * n32 : 8 * shard));
    const zero::Memory f = zero::mixed_formula((int64_t)n16, (int64_t)n32, dp, stage, 2);
    CHECK((f.params == m.params && f.grads == m.grads && f.optimizer == m.optimizer));
  }
}

TEST_CASE("zero: gradients reduced in bf16: the sum rounded at each addition, widened, then the mean") {
  Comm c = world();
  Comm check = c.split(0, c.rank());
  const int dp = c.size();
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    std::vector<Tensor> p = mixed_params(false);
    zero::DataParallelAdam z0(c, kAdam);
    zero::ShardedAdam z(c, kAdam, zero::Bug::none, std::max(stage, 1));
    (stage == 0 ? z0.buckets() : z.buckets()).reduce_in_bf16(true);
    set_mixed_grads(p, c.rank(), 0, false);
    stage == 0 ? z0.step(pointers(p)) : z.step(pointers(p));
    std::vector<float> got;
    if (stage == 0) {
      for (const Tensor& g : z0.mean_grads(pointers(p))) {
        const std::vector<float> v = g.to_vector();
        got.insert(got.end(), v.begin(), v.end());
      }
    } else {
      got = z.gather_mean_grad(check);
    }
    // the exact sums (float32 holds them), each term and the result rounded to bf16; at dp <= 2
    // that is the one addition's rounding, bit for bit, beyond within a rounding per addition
    int64_t off = 0, wrong = 0, rounded = 0;
    for (size_t i = 0; i < p.size(); i++) {
      for (int64_t k = 0; k < p[i].numel(); k++) {
        float sum = 0, mag = 0;
        for (int r = 0; r < dp; r++) {
          const float g = bf16_grad_of(p[i].shape(), r, i, 0, false)[(size_t)k];
          sum += g, mag += std::fabs(g);
        }
        const float once = Tensor::from_vector({sum}, {1}).to_dtype(DType::bf16).to_vector()[0] / (float)dp;
        const float g = got[(size_t)(off + k)];
        if (dp <= 2)
          wrong += g != once;
        else
          wrong += std::fabs(g - sum / (float)dp) > (dp - 1) * std::ldexp(mag, -8) / (float)dp;
        rounded += once != sum / (float)dp;
      }
      off += p[i].numel();
    }
    CHECK_MESSAGE(wrong == 0, wrong << " mean gradients are not the bf16 sums'");
    if (dp > 1) CHECK(rounded > 0);  // (the test's sums need more than bf16's 8 bits)
  }
}
