// Tensor: construction, shape errors, views and copies, and the counter-based RNG whose
// shards concatenate to the global tensor bit for bit (the property every distributed
// equivalence check in the lessons rests on).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"

using namespace ff;

namespace {

// ---- statistical bounds for 100k samples (n = 1e5).
constexpr int64_t kSamples = 100000;
// Sample mean of N(0,1): standard error 1/sqrt(n) = 0.0032; 0.02 is ~6 standard errors, so a
// correct generator fails with probability < 1e-8 while a bias of 0.02 is caught.
constexpr double kMeanTol = 0.02;
// Sample variance of N(0,1): standard error sqrt(2/n) = 0.0045; 0.03 is ~6.7 standard errors.
constexpr double kVarTol = 0.03;
// Fraction of N(0,1) in (-1, 1) is 0.6827 (standard error sqrt(p(1-p)/n) = 0.0015); 0.01 is ~7
// standard errors, and still tells a normal from a unit-variance uniform (0.577).
constexpr double kInsideOneSigma = 0.682689492137;
constexpr double kFractionTol = 0.01;

std::vector<float> values(const Tensor& t) { return t.to_vector(); }

// The hand-written concatenation of 3-D blocks along `dim` (independent of ops::concat).
Tensor concat_by_hand(const std::vector<Tensor>& parts, int64_t dim, const Shape& global) {
  std::vector<float> out((size_t)shape_numel(global));
  int64_t offset = 0;
  for (const Tensor& p : parts) {
    std::vector<float> v = values(p);
    const Shape& s = p.shape();
    for (int64_t i = 0; i < s[0]; i++)
      for (int64_t j = 0; j < s[1]; j++)
        for (int64_t k = 0; k < s[2]; k++) {
          int64_t gi = i + (dim == 0 ? offset : 0), gj = j + (dim == 1 ? offset : 0),
                  gk = k + (dim == 2 ? offset : 0);
          out[(size_t)((gi * global[1] + gj) * global[2] + gk)] =
              v[(size_t)((i * s[1] + j) * s[2] + k)];
        }
    offset += s[(size_t)dim];
  }
  return Tensor::from_vector(out, global);
}

}  // namespace

// ---------------------------------------------------------------------------
// construction and accessors

TEST_CASE("tensor: construction gives the asked shape, dtype and values") {
  Tensor z = Tensor::zeros({2, 3});
  CHECK(z.shape() == Shape{2, 3});
  CHECK(z.dim() == 2);
  CHECK(z.numel() == 6);
  CHECK(z.size(-1) == 3);
  CHECK(z.size(0) == 2);
  CHECK(z.dtype() == DType::f32);
  CHECK(z.device() == Device::cpu);
  CHECK(z.nbytes() == 24);
  for (float v : values(z)) CHECK(v == 0.f);

  Tensor f = Tensor::full({4}, 2.5f);
  for (float v : values(f)) CHECK(v == 2.5f);

  Tensor v = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK(v.shape() == Shape{3, 2});
  CHECK(values(v) == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(v.data()[3] == 4.f);

  Tensor idx = Tensor::from_indices({5, -1, 7}, {3});
  CHECK(idx.dtype() == DType::i64);
  CHECK(idx.nbytes() == 24);
  CHECK(idx.to_index_vector() == std::vector<int64_t>{5, -1, 7});

  Tensor zi = Tensor::zeros({2, 2}, Device::cpu, DType::i64);
  CHECK(zi.to_index_vector() == std::vector<int64_t>(4, 0));

  CHECK(Tensor::from_vector({3.5f}, {1}).item() == 3.5f);
  CHECK(Tensor::from_vector({3.5f}, {}).item() == 3.5f);  // a 0-d tensor has one element
  Tensor empty = Tensor::empty({0, 4});
  CHECK(empty.numel() == 0);
  CHECK(values(empty).empty());
  CHECK_FALSE(Tensor().defined());
  CHECK(shape_str({2, 3}) == "(2, 3)");
  CHECK(shape_str({}) == "()");
}

TEST_CASE("tensor: bad shapes, dtypes and dims throw ff::Error") {
  CHECK_THROWS_AS(Tensor::empty({2, -1}), Error);
  CHECK_THROWS_AS(Tensor::zeros({-3}), Error);
  CHECK_THROWS_AS(Tensor::from_vector({1, 2, 3}, {2, 2}), Error);
  CHECK_THROWS_AS(Tensor::from_indices({1, 2}, {3}), Error);
  Tensor t = Tensor::zeros({2, 3});
  CHECK_THROWS_AS(t.size(2), Error);
  CHECK_THROWS_AS(t.size(-3), Error);
  CHECK_THROWS_AS(t.item(), Error);
  CHECK_THROWS_AS(t.index_data(), Error);
  CHECK_THROWS_AS(Tensor::zeros({2}, Device::cpu, DType::i64).data(), Error);
  CHECK_THROWS_AS(Tensor::zeros({2}, Device::cpu, DType::i64).requires_grad_(), Error);
  CHECK_THROWS_AS(Tensor().shape(), Error);
  CHECK_THROWS_AS(t.view({4, 2}), Error);
  CHECK_THROWS_AS(t.view({-2, -3}), Error);  // numel matches, but negative dims are no shape
  CHECK_THROWS_WITH_AS(Tensor::from_vector({1, 2, 3}, {2, 2}),
                       doctest::Contains("from_vector"), Error);
}

// ---------------------------------------------------------------------------
// views and copies

TEST_CASE("tensor: view and reshape share storage; clone and to() copy") {
  Tensor x = Tensor::from_vector({0, 1, 2, 3, 4, 5}, {2, 3});

  Tensor v = x.view({3, 2});
  CHECK(v.shape() == Shape{3, 2});
  CHECK(v.data() == x.data());
  v.data()[4] = 40.f;  // a write through the view is seen by the original
  CHECK(x.data()[4] == 40.f);

  Tensor r = reshape(x, {-1});
  CHECK(r.shape() == Shape{6});
  CHECK(r.data() == x.data());
  x.data()[0] = -7.f;
  CHECK(r.data()[0] == -7.f);

  Tensor c = x.clone();
  CHECK(bitwise_equal(c, x));
  CHECK(c.data() != x.data());
  c.data()[1] = 100.f;  // independent both ways
  CHECK(x.data()[1] == 1.f);
  x.data()[2] = 200.f;
  CHECK(c.data()[2] == 2.f);

  Tensor h = x.to(Device::cpu);
  CHECK(h.device() == Device::cpu);
  CHECK(bitwise_equal(h, x));
  CHECK(h.data() != x.data());
  h.data()[3] = 9.f;
  CHECK(x.data()[3] == 3.f);

  Tensor idx = Tensor::from_indices({4, 2}, {2});
  Tensor idx2 = idx.clone();
  CHECK(bitwise_equal(idx, idx2));
  CHECK(idx2.dtype() == DType::i64);

  // bitwise_equal notices a difference in shape, dtype or one bit of one value.
  CHECK_FALSE(bitwise_equal(x, x.view({3, 2})));
  CHECK_FALSE(bitwise_equal(Tensor::zeros({2}), Tensor::zeros({2}, Device::cpu, DType::i64)));
  Tensor y = x.clone();
  y.data()[5] = std::nextafter(y.data()[5], 1e9f);
  CHECK_FALSE(bitwise_equal(x, y));
}

TEST_CASE("tensor: to() another device is a round trip, or a clear error where absent") {
  Tensor x = randn({3, 4}, 1);
  for (Device d : {Device::sim, Device::cuda}) {
    CAPTURE(device_name(d));
    if (device_available(d)) {
      Tensor back = x.to(d).to(Device::cpu);
      CHECK(bitwise_equal(back, x));
    } else {
      CHECK_THROWS(x.to(d));
    }
  }
}

TEST_CASE("tensor: detach shares storage but has no autograd history") {
  Tensor x = randn({2, 3}, 3);
  x.requires_grad_();
  Tensor y = exp(x);
  REQUIRE(y.requires_grad());
  REQUIRE(y.impl()->grad_fn != nullptr);
  Tensor d = y.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.impl()->grad_fn == nullptr);
  CHECK(d.data() == y.data());
  CHECK(d.shape() == y.shape());
  Tensor xd = x.detach();
  CHECK_FALSE(xd.requires_grad());
  CHECK(xd.data() == x.data());
  CHECK(x.requires_grad());  // the original is unchanged
}

// ---------------------------------------------------------------------------
// counter-based RNG

TEST_CASE("rng: randn is a function of the seed: same seed same bits, other seeds differ") {
  Shape s{37, 11};
  CHECK(bitwise_equal(randn(s, 42), randn(s, 42)));
  for (uint64_t other : {43ull, 0ull, 42ull + (1ull << 32)}) {
    std::vector<float> a = values(randn(s, 42)), b = values(randn(s, other));
    int64_t same = 0;
    for (size_t i = 0; i < a.size(); i++) same += a[i] == b[i];
    CHECK(same == 0);  // continuous values: a coincidence in 407 draws is ~407 * 2^-24
  }
  // Element i depends on i only, not on the shape the tensor is drawn with.
  CHECK(bitwise_equal(randn({407}, 5), randn(s, 5).view({407})));
  // Neighbouring elements are not copies of each other.
  std::vector<float> a = values(randn({1000}, 9));
  std::set<float> distinct(a.begin(), a.end());
  CHECK(distinct.size() == a.size());
}

TEST_CASE("rng: randn has mean 0, variance 1 and normal mass within one sigma") {
  std::vector<float> v = values(randn({kSamples}, 2024));
  double s = 0, ss = 0;
  int64_t inside = 0, non_finite = 0;
  for (float x : v) {
    non_finite += !std::isfinite(x);
    s += x;
    inside += std::fabs(x) < 1.0;
  }
  CHECK(non_finite == 0);
  double mean = s / kSamples;
  for (float x : v) ss += (x - mean) * (x - mean);
  double var = ss / (kSamples - 1);
  CHECK(std::fabs(mean) < kMeanTol);
  CHECK(std::fabs(var - 1.0) < kVarTol);
  CHECK(std::fabs((double)inside / kSamples - kInsideOneSigma) < kFractionTol);
}

TEST_CASE("split_range: covers [0, n) exactly, sizes differ by at most one, any P") {
  for (int64_t n = 0; n <= 13; n++)
    for (int64_t P = 1; P <= 17; P++) {
      CAPTURE(n);
      CAPTURE(P);
      int64_t expect_begin = 0, smallest = n + 1, largest = -1;
      for (int64_t r = 0; r < P; r++) {
        int64_t b = -1, e = -1;
        split_range(n, P, r, &b, &e);
        CHECK(b == expect_begin);  // contiguous, in order, starting at 0
        CHECK(e >= b);
        smallest = std::min(smallest, e - b);
        largest = std::max(largest, e - b);
        expect_begin = e;
      }
      CHECK(expect_begin == n);  // ends exactly at n
      CHECK(largest - smallest <= 1);
    }
  int64_t b, e;
  CHECK_THROWS_AS(split_range(10, 0, 0, &b, &e), Error);
  CHECK_THROWS_AS(split_range(10, 3, 3, &b, &e), Error);
  CHECK_THROWS_AS(split_range(10, 3, -1, &b, &e), Error);
}

TEST_CASE("rng: shards from randn_slice concatenate to randn bit for bit, for P = 1..5") {
  const uint64_t seed = 1234;
  for (Shape global : {Shape{7, 5, 3}, Shape{5, 11, 2}})
    for (int64_t dim : {0, 1, 2}) {
      Tensor whole = randn(global, seed);
      for (int64_t P = 1; P <= 5; P++) {
        CAPTURE(shape_str(global));
        CAPTURE(dim);
        CAPTURE(P);
        std::vector<Tensor> parts;
        for (int64_t r = 0; r < P; r++) {
          int64_t b, e;
          split_range(global[(size_t)dim], P, r, &b, &e);
          Tensor part = randn_slice(global, dim, b, e, seed);
          Shape want = global;
          want[(size_t)dim] = e - b;
          CHECK(part.shape() == want);
          parts.push_back(part);
        }
        CHECK(bitwise_equal(concat_by_hand(parts, dim, global), whole));
      }
    }
  // A negative dim counts from the end, as everywhere else.
  CHECK(bitwise_equal(randn_slice({4, 6}, -1, 2, 5, 8), randn_slice({4, 6}, 1, 2, 5, 8)));
  // A different seed gives a different shard: the slice really depends on the seed.
  CHECK_FALSE(bitwise_equal(randn_slice({7, 5, 3}, 1, 1, 3, 1), randn_slice({7, 5, 3}, 1, 1, 3, 2)));
}

TEST_CASE("rng: randn_slice rejects ranges and dims outside the global shape") {
  CHECK_THROWS_AS(randn_slice({4, 6}, 1, 3, 2, 0), Error);   // begin > end
  CHECK_THROWS_AS(randn_slice({4, 6}, 1, 0, 7, 0), Error);   // end > n
  CHECK_THROWS_AS(randn_slice({4, 6}, 1, -1, 2, 0), Error);  // begin < 0
  CHECK_THROWS_AS(randn_slice({4, 6}, 2, 0, 1, 0), Error);   // dim out of range
  CHECK(randn_slice({4, 6}, 0, 2, 2, 0).numel() == 0);       // an empty shard is fine
}

TEST_CASE("rng: randint stays in [0, high) and reaches every value") {
  const int64_t high = 7;
  Tensor t = randint({10000}, 5, high);
  CHECK(t.dtype() == DType::i64);
  std::vector<int64_t> counts(high, 0);
  int64_t outside = 0;
  for (int64_t v : t.to_index_vector()) {
    if (v < 0 || v >= high) outside++;
    else counts[(size_t)v]++;
  }
  CHECK(outside == 0);
  // Expected 10000/7 = 1429 each (standard deviation ~35): 1000 is > 12 deviations away.
  constexpr int64_t kMinCount = 1000;
  for (int64_t c : counts) CHECK(c > kMinCount);
  CHECK(bitwise_equal(randint({50}, 5, high), randint({50}, 5, high)));
  CHECK_FALSE(bitwise_equal(randint({50}, 5, high), randint({50}, 6, high)));
  std::vector<int64_t> ones = randint({100}, 3, 1).to_index_vector();
  CHECK(ones == std::vector<int64_t>(100, 0));  // high = 1: only 0 is allowed
  CHECK_THROWS_AS(randint({3}, 0, 0), Error);
}

TEST_CASE("rng: rand_uniform stays in [lo, hi) and fills it") {
  Tensor t = rand_uniform({kSamples}, 11, -2.f, 3.f);
  float lo = 1e30f, hi = -1e30f;
  double s = 0;
  int64_t outside = 0;
  for (float v : values(t)) {
    outside += !(v >= -2.f && v < 3.f);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    s += v;
  }
  CHECK(outside == 0);
  // 1e5 draws over a width of 5 leave gaps of ~5e-5 at the ends; 1e-2 is far beyond that.
  constexpr float kEdgeTol = 1e-2f;
  CHECK(lo < -2.f + kEdgeTol);
  CHECK(hi > 3.f - kEdgeTol);
  // Uniform(-2, 3): mean 0.5, standard deviation 5/sqrt(12) = 1.44, standard error 0.0046;
  // 0.03 is ~6.5 standard errors.
  constexpr double kUniformMeanTol = 0.03;
  CHECK(std::fabs(s / kSamples - 0.5) < kUniformMeanTol);

  // Far from 0 a float step is coarse (6e-5 at 1000): lo + (hi - lo) * u must not round to hi.
  outside = 0;
  for (float v : values(rand_uniform({2 * kSamples}, 3, 1000.f, 1001.f)))
    outside += !(v >= 1000.f && v < 1001.f);
  CHECK(outside == 0);
  CHECK(bitwise_equal(rand_uniform({20}, 1, 0.f, 1.f), rand_uniform({20}, 1, 0.f, 1.f)));
  CHECK_THROWS_AS(rand_uniform({3}, 1, 1.f, 1.f), Error);
}
