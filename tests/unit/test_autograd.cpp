// Autograd engine: accumulation, repeated backward, zero_grad, the no-grad scope,
// explicit output gradients, errors, a diamond graph, that graphs are freed, and the input/weight
// split of a backward (one weight, as matmul, and several).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#include <memory>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"

using namespace ff;

namespace {
// The gradients below are a handful of float32 operations away from a double reference:
// a few roundings of 2^-24 each. 1e-6 relative (~16 ulps) is tight enough that any wrong
// or missing term (an error of order 1) fails.
constexpr double kGradRtol = 1e-6;
constexpr double kGradAtol = 1e-7;

Tensor leaf(const Shape& s, uint64_t seed) {
  Tensor t = randn(s, seed);
  t.requires_grad_();
  return t;
}

Tensor from_double(const std::vector<double>& v, const Shape& s) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, s);
}
}  // namespace

TEST_CASE("autograd: a tensor used twice gets the sum of both gradients (x*x -> 2x)") {
  Tensor x = leaf({3, 5}, 1);
  sum_all(mul(x, x)).backward();
  REQUIRE(x.grad().defined());
  std::vector<double> want;
  for (float v : x.to_vector()) want.push_back(2.0 * v);
  CHECK(compare(x.grad(), from_double(want, {3, 5}), kGradAtol, kGradRtol).pass);

  // The same through two different ops: y = x + exp(x)  ->  dy/dx = 1 + exp(x)
  Tensor z = leaf({4}, 2);
  sum_all(add(z, exp(z))).backward();
  want.clear();
  for (float v : z.to_vector()) want.push_back(1.0 + std::exp((double)v));
  CHECK(compare(z.grad(), from_double(want, {4}), kGradAtol, kGradRtol).pass);
}

TEST_CASE("autograd: gradients add up across backward() calls until zero_grad") {
  Tensor x = leaf({2, 3}, 3);
  std::vector<double> three(6, 3.0), six(6, 6.0), nine(6, 9.0);

  sum_all(scale(x, 3.f)).backward();  // a fresh graph each call
  CHECK(compare(x.grad(), from_double(three, {2, 3}), 0, 0).pass);
  sum_all(scale(x, 3.f)).backward();
  CHECK(compare(x.grad(), from_double(six, {2, 3}), 0, 0).pass);

  Tensor y = sum_all(scale(x, 3.f));  // the same graph walked twice
  y.backward();
  CHECK(compare(x.grad(), from_double(nine, {2, 3}), 0, 0).pass);
  y.backward();
  CHECK(compare(x.grad(), from_double(std::vector<double>(6, 12.0), {2, 3}), 0, 0).pass);

  x.zero_grad();
  CHECK_FALSE(x.grad().defined());
  y.backward();
  CHECK(compare(x.grad(), from_double(three, {2, 3}), 0, 0).pass);
}

TEST_CASE("autograd: NoGradGuard records no tape, and restores the previous mode") {
  Tensor x = leaf({3}, 4);
  CHECK(grad_enabled());
  {
    NoGradGuard guard;
    CHECK_FALSE(grad_enabled());
    Tensor y = exp(mul(x, x));
    CHECK_FALSE(y.requires_grad());
    CHECK(y.impl()->grad_fn == nullptr);
    CHECK_THROWS_AS(sum_all(y).backward(), Error);
    {
      NoGradGuard nested;
      CHECK_FALSE(grad_enabled());
    }
    CHECK_FALSE(grad_enabled());  // the inner guard restores "off", not "on"
  }
  CHECK(grad_enabled());
  Tensor y = exp(x);
  CHECK(y.requires_grad());
  CHECK(y.impl()->grad_fn != nullptr);
  CHECK(y.impl()->grad_fn->name == "exp");

  // Ops on tensors that need no gradient record nothing either.
  Tensor c = exp(randn({3}, 5));
  CHECK_FALSE(c.requires_grad());
  CHECK(c.impl()->grad_fn == nullptr);
  // And a constant mixed with a leaf gets no .grad of its own.
  Tensor k = randn({3}, 6);
  sum_all(mul(x, k)).backward();
  CHECK_FALSE(k.grad().defined());
  CHECK(bitwise_equal(x.grad(), k));
}

TEST_CASE("autograd: backward of a non-scalar with an explicit output gradient") {
  Tensor x = leaf({3, 4}, 7);
  Tensor y = mul(x, x);
  Tensor g = randn({3, 4}, 8);
  y.backward(g);
  std::vector<float> xv = x.to_vector(), gv = g.to_vector();
  std::vector<double> want;
  for (size_t i = 0; i < xv.size(); i++) want.push_back(2.0 * xv[i] * gv[i]);
  CHECK(compare(x.grad(), from_double(want, {3, 4}), kGradAtol, kGradRtol).pass);

  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("one-element"), Error);
  CHECK_THROWS_WITH_AS(y.backward(randn({4, 3}, 1)), doctest::Contains("gradient shape"), Error);
}

TEST_CASE("autograd: backward on a tensor that does not require grad is an error") {
  Tensor c = Tensor::zeros({1});
  CHECK_THROWS_WITH_AS(c.backward(), doctest::Contains("does not require grad"), Error);
  Tensor d = exp(randn({2}, 1));
  CHECK_THROWS_AS(d.backward(Tensor::full({2}, 1.f)), Error);
}

TEST_CASE("autograd: a leaf's own backward seeds its gradient; intermediates keep no .grad") {
  Tensor x = leaf({1}, 9);
  x.backward();
  CHECK(x.grad().item() == 1.f);

  Tensor w = leaf({3}, 10);
  Tensor h = exp(w);
  sum_all(h).backward();
  CHECK_FALSE(h.grad().defined());
  CHECK(w.grad().defined());
}

TEST_CASE("autograd: a diamond graph sums both paths") {
  // b = exp(x); c = b * x; d = b + c; L = sum(d)  ->  dL/dx = exp(x) * (2 + x)
  Tensor x = leaf({2, 5}, 11);
  Tensor b = exp(x);
  Tensor c = mul(b, x);
  Tensor d = add(b, c);
  sum_all(d).backward();
  std::vector<double> want;
  for (float v : x.to_vector()) want.push_back(std::exp((double)v) * (2.0 + v));
  CHECK(compare(x.grad(), from_double(want, {2, 5}), kGradAtol, kGradRtol).pass);

  // A wider diamond: two leaves feeding a shared intermediate used by three consumers.
  // u = x * w; L = sum(u + u*u + 2u)  ->  dL/du = 3 + 2u
  Tensor x2 = leaf({4}, 12), w2 = leaf({4}, 13);
  Tensor u = mul(x2, w2);
  sum_all(add(add(u, mul(u, u)), scale(u, 2.f))).backward();
  std::vector<float> xv = x2.to_vector(), wv = w2.to_vector();
  std::vector<double> gx, gw;
  for (size_t i = 0; i < xv.size(); i++) {
    double uu = (double)xv[i] * wv[i], du = 3.0 + 2.0 * uu;
    gx.push_back(du * wv[i]);
    gw.push_back(du * xv[i]);
  }
  // u is rounded to float before u*u; its rounding (2^-24 relative) feeds the gradient.
  CHECK(compare(x2.grad(), from_double(gx, {4}), kGradAtol, kGradRtol).pass);
  CHECK(compare(w2.grad(), from_double(gw, {4}), kGradAtol, kGradRtol).pass);
}

TEST_CASE("autograd: a graph is freed when its tensors go out of scope (no cycles)") {
  Tensor x = leaf({3, 4}, 14);
  std::weak_ptr<TensorImpl> mid, out;
  std::weak_ptr<Node> node;
  {
    Tensor h = exp(x);
    Tensor y = sum_all(mul(h, softmax(h)));
    mid = h.impl_ptr();
    out = y.impl_ptr();
    node = h.impl()->grad_fn;
    REQUIRE_FALSE(node.expired());
    y.backward();
  }
  CHECK(mid.expired());
  CHECK(out.expired());
  CHECK(node.expired());
  CHECK(x.grad().defined());  // the leaf and its gradient live on

  {  // the same without ever running backward
    Tensor h = silu(x);
    Tensor y = sum_all(matmul(h, transpose(h, 0, 1)));
    mid = h.impl_ptr();
  }
  CHECK(mid.expired());

  // And the check itself can fail: while a tensor is still referenced, it is alive.
  Tensor keep = exp(x);
  mid = keep.impl_ptr();
  { Tensor y = sum_all(keep); }
  CHECK_FALSE(mid.expired());
}

// ---- the input/weight split of a backward (zero-bubble pipelines, lesson 07)
namespace {
// A two-layer block whose weights are leaves, each used twice (two deferred W's each).
struct SplitNet {
  Tensor x = leaf({5, 4}, 11), w1 = leaf({4, 6}, 12), w2 = leaf({6, 4}, 13);
  Tensor forward() const { return matmul(silu(matmul(x, w1)), w2) + matmul(matmul(x, w1), w2) * 0.5f; }
};
}  // namespace

TEST_CASE("autograd: a deferred backward gives input gradients now and the same weight gradients later") {
  SplitNet full, split;  // the same values (same seeds)
  Tensor g4 = randn({5, 4}, 15);
  run_backward(full.forward(), g4);

  DeferredGrads deferred;
  run_backward(split.forward(), g4, &deferred);
  CHECK(deferred.size() == 4);            // four matmuls with a leaf weight
  CHECK_FALSE(split.w1.grad().defined());  // W has not run
  CHECK_FALSE(split.w2.grad().defined());
  REQUIRE(split.x.grad().defined());       // I has
  CHECK(bitwise_equal(split.x.grad(), full.x.grad()));

  deferred.run();
  CHECK(deferred.empty());
  CHECK(bitwise_equal(split.w1.grad(), full.w1.grad()));
  CHECK(bitwise_equal(split.w2.grad(), full.w2.grad()));
}

TEST_CASE("autograd: a weight that is not a leaf is never deferred; without a queue nothing is") {
  Tensor x = leaf({3, 4}, 21), w = leaf({4, 2}, 22);
  Tensor w_used = scale(w, 2.f);  // an intermediate: its gradient must flow on now
  DeferredGrads deferred;
  run_backward(sum_all(matmul(x, w_used)), Tensor::full({}, 1.f), &deferred);
  CHECK(deferred.empty());
  REQUIRE(w.grad().defined());

  Tensor x2 = leaf({3, 4}, 21), w2 = leaf({4, 2}, 22);
  run_backward(sum_all(matmul(x2, w2)), Tensor::full({}, 1.f));
  REQUIRE(w2.grad().defined());
  // dL/dw (through w_used = 2w) is twice the direct one
  CHECK(compare(w.grad(), scale(w2.grad(), 2.f), 1e-6, 1e-6).pass);
}

TEST_CASE("autograd: a planted bug in matmul's backward is caught on the deferred path too") {
  SplitNet full, split;
  Tensor g4 = randn({5, 4}, 15);
  run_backward(full.forward(), g4);
  {
    testing::PlantedBug bug("matmul", testing::Bug::scale_by_1_01);
    DeferredGrads deferred;
    run_backward(split.forward(), g4, &deferred);
    deferred.run();
  }
  CHECK_FALSE(compare(split.w2.grad(), full.w2.grad(), 1e-6, 1e-6).pass);
  CHECK_FALSE(compare(split.x.grad(), full.x.grad(), 1e-6, 1e-6).pass);
}

TEST_CASE("autograd: DeferredGrads::run_next runs one W at a time, oldest first, as run() would") {
  SplitNet full, split;
  Tensor g4 = randn({5, 4}, 15);
  run_backward(full.forward(), g4);
  DeferredGrads deferred;
  int ops_seen = 0;
  run_backward(split.forward(), g4, &deferred, [&] { ops_seen++; });
  CHECK(ops_seen > 4);  // called after every op of the walk
  REQUIRE(deferred.size() == 4);
  size_t left = deferred.size();
  while (deferred.run_next()) CHECK(deferred.size() == --left);
  CHECK_FALSE(deferred.run_next());
  CHECK(bitwise_equal(split.w1.grad(), full.w1.grad()));
  CHECK(bitwise_equal(split.w2.grad(), full.w2.grad()));
}

// ---- an op that defers several weights (the MoE layers' ops do, model.cpp and dsv3_ep.cpp)
namespace {
// y = x * a + b elementwise, recorded with inputs {a, x, b} and weights {b, a} (in that order,
// so the mapping from weight_backward's list to the inputs is exercised): dx = g a, da = g x,
// db = g. `wrong_count` makes the weight half return one gradient too few.
Tensor axpb(const Tensor& a, const Tensor& x, const Tensor& b, bool wrong_count = false) {
  Tensor y;
  {
    NoGradGuard no_grad;
    y = add(mul(x, a), b);
  }
  Tensor ad = a.detach(), xd = x.detach();
  return record_split(y, "axpb", {a, x, b}, {2, 0}, [ad, xd, wrong_count](const Tensor& g) {
    return SplitGrads{{Tensor(), mul(g, ad), Tensor()}, [ad, xd, g, wrong_count] {
                        if (wrong_count) return std::vector<Tensor>{g.clone()};
                        return std::vector<Tensor>{g.clone(), mul(g, xd)};
                      }};
  });
}
struct Axpb {
  Tensor a = leaf({3, 4}, 31), x = leaf({3, 4}, 32), b = leaf({3, 4}, 33);
  Tensor forward() const { return axpb(a, exp(x), b); }  // x behind an op: the I path flows on
};
}  // namespace

TEST_CASE("autograd: an op with several weights defers them all to one W, each to its own input") {
  Axpb full, split;
  Tensor g = randn({3, 4}, 35);
  run_backward(full.forward(), g);
  // against the formulas: dx = g a exp(x), da = g exp(x), db = g
  CHECK(bitwise_equal(full.b.grad(), g));
  CHECK(bitwise_equal(full.a.grad(), mul(g, exp(full.x))));
  CHECK(bitwise_equal(full.x.grad(), mul(mul(g, full.a), exp(full.x))));

  DeferredGrads deferred;
  run_backward(split.forward(), g, &deferred);
  CHECK(deferred.size() == 1);  // one op: one W for both its weights
  REQUIRE(split.x.grad().defined());
  CHECK(bitwise_equal(split.x.grad(), full.x.grad()));
  CHECK_FALSE(split.a.grad().defined());
  CHECK_FALSE(split.b.grad().defined());
  deferred.run();
  CHECK(bitwise_equal(split.a.grad(), full.a.grad()));
  CHECK(bitwise_equal(split.b.grad(), full.b.grad()));
  CHECK(bitwise_equal(split.x.grad(), full.x.grad()));  // W touches no input gradient
}

TEST_CASE("autograd: several weights are deferred only when every one is a leaf that requires grad") {
  Axpb full;
  Tensor g = randn({3, 4}, 35);
  run_backward(full.forward(), g);
  SUBCASE("one weight an intermediate") {
    Axpb s;
    DeferredGrads deferred;
    run_backward(axpb(s.a, exp(s.x), scale(s.b, 1.f)), g, &deferred);
    CHECK(deferred.empty());
    REQUIRE(s.a.grad().defined());  // the whole backward ran now
    CHECK(bitwise_equal(s.a.grad(), full.a.grad()));
    CHECK(bitwise_equal(s.b.grad(), full.b.grad()));
  }
  SUBCASE("one weight that requires no grad") {
    Axpb s;
    Tensor b = s.b.detach();
    DeferredGrads deferred;
    run_backward(axpb(s.a, exp(s.x), b), g, &deferred);
    CHECK(deferred.empty());
    REQUIRE(s.a.grad().defined());
    CHECK(bitwise_equal(s.a.grad(), full.a.grad()));
    CHECK_FALSE(b.grad().defined());
  }
}

TEST_CASE("autograd: a planted bug reaches the deferred weights of a multi-weight op, at their input index") {
  Axpb full;
  Tensor g = randn({3, 4}, 35);
  run_backward(full.forward(), g);
  for (bool defer : {false, true}) {
    CAPTURE(defer);
    {  // drop_first_input zeroes input 0's gradient: a, a deferred weight, not b nor x
      Axpb s;
      testing::PlantedBug bug("axpb", testing::Bug::drop_first_input);
      DeferredGrads deferred;
      run_backward(s.forward(), g, defer ? &deferred : nullptr);
      deferred.run();
      CHECK(bitwise_equal(s.a.grad(), Tensor::zeros({3, 4})));
      CHECK(bitwise_equal(s.b.grad(), full.b.grad()));
      CHECK(bitwise_equal(s.x.grad(), full.x.grad()));
    }
    {  // scale_by_1_01: every gradient of the op, deferred or not, is 1% off
      Axpb s;
      testing::PlantedBug bug("axpb", testing::Bug::scale_by_1_01);
      DeferredGrads deferred;
      run_backward(s.forward(), g, defer ? &deferred : nullptr);
      deferred.run();
      CHECK_FALSE(compare(s.a.grad(), full.a.grad(), 1e-6, 1e-6).pass);
      CHECK_FALSE(compare(s.b.grad(), full.b.grad(), 1e-6, 1e-6).pass);
      CHECK_FALSE(compare(s.x.grad(), full.x.grad(), 1e-6, 1e-6).pass);
    }
  }
}

TEST_CASE("autograd: a split backward that returns the wrong number of weight gradients is an error") {
  Axpb s;
  Tensor g = randn({3, 4}, 35);
  CHECK_THROWS_AS(run_backward(axpb(s.a, s.x, s.b, true), g), Error);
  DeferredGrads deferred;
  run_backward(axpb(s.a, s.x, s.b, true), g, &deferred);  // I is fine
  CHECK_THROWS_AS(deferred.run(), Error);                  // W is not
  CHECK_THROWS_AS(record_split(s.a.clone(), "bad", {s.a}, {1}, [](const Tensor&) { return SplitGrads{}; }),
                  Error);
}

TEST_CASE("autograd: the between-ops hook runs after each recorded op and each op's backward") {
  int calls = 0;
  set_between_ops([&] { calls++; });
  Tensor x = leaf({3}, 7);
  Tensor y = mul(exp(x), x);  // two ops
  CHECK(calls == 2);
  {
    NoGradGuard ng;  // untaped ops too
    exp(x);
  }
  CHECK(calls == 3);
  calls = 0;
  y.backward(Tensor::full({3}, 1.f));
  CHECK(calls >= 2);  // after mul's and exp's backward (and after the ops they compute with)
  set_between_ops({});
  calls = 0;
  sum_all(exp(x)).backward();
  CHECK(calls == 0);  // removed
}

TEST_CASE("autograd: a leaf's post-accumulate hook fires once per backward, after its .grad holds the sum") {
  // y = sum(w1 * x) + sum(w1 * w2): w1 is used twice, so its hook must wait for both terms
  Tensor w1 = leaf({3}, 11), w2 = leaf({3}, 12), x = randn({3}, 13);
  std::vector<std::string> fired;
  std::vector<float> seen_w1;
  w1.impl()->post_accumulate_grad = [&] { fired.push_back("w1"), seen_w1 = w1.grad().to_vector(); };
  w2.impl()->post_accumulate_grad = [&] { fired.push_back("w2"); };
  Tensor y = add(sum_all(mul(w1, x)), sum_all(mul(w1, w2)));
  y.backward();
  REQUIRE(fired.size() == 2);  // once each, whatever the order
  CHECK(std::count(fired.begin(), fired.end(), "w1") == 1);
  CHECK(std::count(fired.begin(), fired.end(), "w2") == 1);
  std::vector<double> want;  // d/dw1 = x + w2, complete when the hook saw it
  for (int i = 0; i < 3; i++) want.push_back((double)x.to_vector()[i] + (double)w2.to_vector()[i]);
  CHECK(compare(Tensor::from_vector(seen_w1, {3}), from_double(want, {3}), kGradAtol, kGradRtol).pass);
  // a second backward: each fires again, its .grad now the sum of both passes
  y.backward();
  CHECK(fired.size() == 4);
  w1.impl()->post_accumulate_grad = nullptr;
  w2.impl()->post_accumulate_grad = nullptr;
}

TEST_CASE("autograd: with the weight gradients deferred, a weight's hook fires when its W runs") {
  Tensor w = leaf({4, 2}, 21), x = leaf({3, 4}, 22);
  int fired = 0;
  w.impl()->post_accumulate_grad = [&] { fired++; };
  DeferredGrads deferred;
  Tensor y = sum_all(matmul(x, w));
  run_backward(y, Tensor::full({}, 1.f), &deferred);
  CHECK(fired == 0);        // "I" only: w's gradient is not in yet
  CHECK(!w.grad().defined());
  deferred.run();           // "W"
  CHECK(fired == 1);
  CHECK(w.grad().defined());
  w.impl()->post_accumulate_grad = nullptr;
}

TEST_CASE("autograd: a leaf is finished as soon as its last reader has run, even with no gradient") {
  // mul(w2, h) reads w2 before h = f(w1): w2's gradient is final right after that op, before the
  // walk reaches w1, whatever place w2 has in the topological order
  Tensor w1 = leaf({3}, 31), w2 = leaf({3}, 32), x = randn({3}, 33);
  std::vector<std::string> fired;
  bool w1_done_when_w2_fired = true;
  w1.impl()->post_accumulate_grad = [&] { fired.push_back("w1"); };
  w2.impl()->post_accumulate_grad = [&] {
    fired.push_back("w2");
    w1_done_when_w2_fired = w1.grad().defined();
  };
  sum_all(mul(w2, exp(mul(w1, x)))).backward();
  CHECK(fired == std::vector<std::string>{"w2", "w1"});
  CHECK_FALSE(w1_done_when_w2_fired);
  // an op that sends its input no gradient: the leaf is finished all the same, its .grad untouched
  Tensor w3 = leaf({2}, 34);
  int w3_fired = 0;
  w3.impl()->post_accumulate_grad = [&] { w3_fired++; };
  Tensor stopped = record(Tensor::zeros({2}), "stop", {w3}, [](const Tensor&) { return std::vector<Tensor>{Tensor()}; });
  add(sum_all(stopped), sum_all(mul(w1, x))).backward();
  CHECK(w3_fired == 1);
  CHECK_FALSE(w3.grad().defined());
  for (Tensor* w : {&w1, &w2, &w3}) w->impl()->post_accumulate_grad = nullptr;
}

TEST_CASE("autograd: a weight read by split and plain ops, deferred, gets every gradient and one hook after the last") {
  // y = sum(x @ W) + sum(W * W) + sum(v @ W): two matmuls split (W deferred), one plain reader
  for (int pass = 0; pass < 2; pass++) {
    Tensor W = leaf({4, 3}, 41), x = randn({2, 4}, 42), v = randn({5, 4}, 43);
    int fired = 0;
    std::vector<float> at_hook;
    W.impl()->post_accumulate_grad = [&] { fired++, at_hook = W.grad().to_vector(); };
    Tensor y = add(add(sum_all(matmul(x, W)), sum_all(mul(W, W))), sum_all(matmul(v, W)));
    if (pass == 0) {
      y.backward();
    } else {
      DeferredGrads deferred;
      run_backward(y, Tensor::full({}, 1.f), &deferred);
      CHECK(fired == 0);  // two W's to come
      deferred.run();
    }
    CAPTURE(pass);
    CHECK(fired == 1);
    // d/dW = x^T 1 + 2 W + v^T 1: every term in, when the hook saw it and after
    std::vector<double> want;
    const std::vector<float> w = W.to_vector(), xs = x.to_vector(), vs = v.to_vector();
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 3; j++)
        want.push_back((double)xs[i] + xs[4 + i] + 2.0 * w[i * 3 + j] + vs[i] + vs[4 + i] + vs[8 + i] + vs[12 + i] + vs[16 + i]);
    CHECK(compare(W.grad(), from_double(want, {4, 3}), kGradAtol, kGradRtol).pass);
    CHECK(compare(Tensor::from_vector(at_hook, {4, 3}), from_double(want, {4, 3}), kGradAtol, kGradRtol).pass);
    W.impl()->post_accumulate_grad = nullptr;
  }
}
