// Kernel tests: bfloat16 (kernels/bf16.h). The rounding from float32 against a reference that
// rounds by arithmetic (the two bf16 neighbours in double, the nearer, ties to the even one) on
// every high half of a float with the low halves around the tie; the conversion kernels on the
// device under test equal the cpu's; the bf16 matmul against float64 sums of the same bf16
// inputs within the float32 accumulation bound, and bit for bit the float32 matmul of the
// widened inputs on the same device (a bf16 product is exact in float32: the sums round the
// same). Then the ops: cast both ways, matmul of two bf16 tensors, and their gradients.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/optim.h"
#include "common/layers/model.h"
#include "common/layers/moe.h"
#include "kernels/bf16.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// The magnitude of bf16 bits h (sign ignored) in double; bf16's largest finite value plus one
// ulp, 2^128, for the bits of infinity: the rounding boundary past which a value overflows.
double magnitude(uint16_t h) {
  if ((h & 0x7fffu) == 0x7f80u) return std::ldexp(1.0, 128);
  return std::fabs((double)float_of_bits((uint32_t)h << 16));
}

// Round to nearest, ties to even, by arithmetic on the two candidates: the bf16 of f's sign
// whose magnitude is the largest not above |f| (f's high half), and the next one up.
uint16_t reference_round(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
  const double d = std::fabs((double)f), below = magnitude(lo), above = magnitude(hi);
  if (d == below) return lo;
  if (d - below < above - d) return lo;
  if (d - below > above - d) return hi;
  return (lo & 1u) ? hi : lo;  // a tie: the even mantissa
}

std::string hex(uint32_t u) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", u);
  return s;
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("bf16: float32 rounds to the nearest bf16, ties to even; NaN stays NaN, overflow is infinity") {
  // every high half, with the low halves that matter: exact, just above, just under the tie,
  // the tie, just above it, the most
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
  int64_t checked = 0, bad = 0;
  std::string first;
  for (uint32_t high = 0; high <= 0xffff; high++)
    for (uint32_t low : lows) {
      const uint32_t u = high << 16 | low;
      const float f = float_of_bits(u);
      const uint16_t got = float_to_bf16(f);
      bool ok;
      if (std::isnan(f)) {  // any NaN of the same sign, never infinity
        const float g = bf16_to_float(got);
        ok = std::isnan(g) && std::signbit(g) == std::signbit(f);
      } else {
        ok = got == reference_round(f);
      }
      checked++;
      if (!ok && bad++ == 0) first = hex(u) + " -> " + hex(got) + ", want " + hex(reference_round(f));
    }
  CHECK_MESSAGE(bad == 0, bad << " of " << checked << " floats round wrongly; first: " << first);
  // the named cases
  CHECK(float_to_bf16(1.f) == 0x3f80);
  CHECK(float_to_bf16(float_of_bits(0x3f808000)) == 0x3f80);  // 1 + 2^-8: a tie, to the even 1
  CHECK(float_to_bf16(float_of_bits(0x3f818000)) == 0x3f82);  // a tie above an odd one: up
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7f80);  // overflows to infinity
  CHECK(float_to_bf16(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(float_to_bf16(-0.f) == 0x8000);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(float_of_bits(0x7f800001)))));  // a NaN whose payload would round to inf
  CHECK(bf16_to_float(float_to_bf16(float_of_bits(0x00010000))) == float_of_bits(0x00010000));  // a subnormal, kept
}

TEST_CASE("bf16: widening is exact and the conversion kernels equal the cpu's on the device under test") {
  std::vector<float> x = kt::inputs(1000, 17);
  x.push_back(std::numeric_limits<float>::infinity()), x.push_back(std::nanf("")),
      x.push_back(float_of_bits(0x3f808000)), x.push_back(1e-40f), x.push_back(-0.f);
  const int64_t n = (int64_t)x.size();
  for (Device d : {Device::cpu, kt::device_under_test()}) {
    CAPTURE(device_name(d));
    const KernelTable& k = kernels_for(d);
    Tensor src = kt::upload(x, d), half = Tensor::empty({n}, d, DType::bf16), back = kt::scratch(n, d);
    k.to_bf16(half.bf16_data(), src.data(), n);
    k.from_bf16(back.data(), half.bf16_data(), n);
    const std::vector<float> got = back.to_vector();
    for (int64_t i = 0; i < n; i++) {
      const float want = bf16_to_float(float_to_bf16(x[(size_t)i]));
      CHECK_MESSAGE((float_bits(got[(size_t)i]) == float_bits(want) || (std::isnan(want) && std::isnan(got[(size_t)i]))),
                    "element " << i << ": " << x[(size_t)i] << " -> " << got[(size_t)i] << ", want " << want);
    }
  }
}

TEST_CASE("bf16: matmul of bf16 inputs sums in float32: within K u sum|a||b| of float64, the float32 matmul's bits") {
  struct Case {
    int64_t B, M, Nc, K;
    bool trans_a, trans_b, shared_b, accumulate;
  };
  const Case cases[] = {{1, 1, 1, 1, false, false, true, false}, {1, 7, 33, 65, false, false, true, false},
                        {3, 13, 7, 100, true, false, false, false}, {2, 33, 65, 7, false, true, true, true},
                        {2, 64, 64, 64, true, true, false, false}, {1, 100, 70, 300, false, false, true, true},
                        // a few rows (a decode step's product): b streamed, not widened first
                        {2, 3, 300, 70, true, false, false, true}, {1, 4, 600, 257, false, false, true, false}};
  for (Device d : {Device::cpu, kt::device_under_test()})
    for (const Case& c : cases) {
      CAPTURE(device_name(d));
      const std::string shape = std::to_string(c.B) + " x (" + std::to_string(c.M) + ", " + std::to_string(c.K) +
                                ") @ (" + std::to_string(c.K) + ", " + std::to_string(c.Nc) + ")" +
                                (c.trans_a ? ", a transposed" : "") + (c.trans_b ? ", b transposed" : "") +
                                (c.shared_b ? ", b shared" : "") + (c.accumulate ? ", accumulating" : "");
      CAPTURE(shape);
      const KernelTable& k = kernels_for(d);
      const int64_t na = c.B * c.M * c.K, nb = (c.shared_b ? 1 : c.B) * c.K * c.Nc, nc = c.B * c.M * c.Nc;
      // inputs rounded to bf16 on the host; the kernel gets their bits, the reference their values
      std::vector<float> a = kt::inputs(na, 1), b = kt::inputs(nb, 2), c0 = kt::inputs(nc, 3);
      for (float& v : a) v = bf16_to_float(float_to_bf16(v));
      for (float& v : b) v = bf16_to_float(float_to_bf16(v));
      Tensor a16 = Tensor::empty({na}, d, DType::bf16), b16 = Tensor::empty({nb}, d, DType::bf16);
      k.to_bf16(a16.bf16_data(), kt::upload(a, d).data(), na);
      k.to_bf16(b16.bf16_data(), kt::upload(b, d).data(), nb);
      const int64_t sa = c.M * c.K, sb = c.shared_b ? 0 : c.K * c.Nc;
      Tensor got = kt::upload(c0, d), wide = kt::upload(c0, d);
      k.matmul_bf16(got.data(), a16.bf16_data(), b16.bf16_data(), c.B, c.M, c.Nc, c.K, sa, sb, c.trans_a, c.trans_b,
                    c.accumulate);
      k.matmul(wide.data(), kt::upload(a, d).data(), kt::upload(b, d).data(), c.B, c.M, c.Nc, c.K, sa, sb, c.trans_a,
               c.trans_b, c.accumulate);
      const std::vector<float> g = got.to_vector(), w = wide.to_vector();
      std::vector<float> exact((size_t)nc);
      std::vector<double> tol((size_t)nc);
      for (int64_t z = 0; z < c.B; z++)
        for (int64_t i = 0; i < c.M; i++)
          for (int64_t j = 0; j < c.Nc; j++) {
            double s = 0, mag = 0;
            for (int64_t p = 0; p < c.K; p++) {
              const double x = a[(size_t)(z * sa + (c.trans_a ? p * c.M + i : i * c.K + p))];
              const double y = b[(size_t)(z * sb + (c.trans_b ? j * c.K + p : p * c.Nc + j))];
              s += x * y, mag += std::fabs(x * y);
            }
            const size_t at = (size_t)((z * c.M + i) * c.Nc + j);
            const double base = c.accumulate ? c0[at] : 0.0;
            exact[at] = (float)(base + s);
            // K + 1 roundings (one more adding c), each within u of the sums so far, plus the
            // float64 reference's own rounding to float: half an ulp of the result
            const double u = std::ldexp(1.0, -24);
            tol[at] = (double)(c.K + 1) * u * (mag + std::fabs(base)) + u * std::fabs(base + s);
          }
      kt::require_within(g, exact, tol, c.Nc, "matmul_bf16 against float64");
      int64_t differ = 0;
      for (int64_t i = 0; i < nc; i++) differ += float_bits(g[(size_t)i]) != float_bits(w[(size_t)i]);
      CHECK_MESSAGE(differ == 0, differ << " of " << nc << " elements differ from the float32 matmul of the widened inputs");
    }
}

TEST_CASE("bf16: the MoE's grouped GEMMs with bf16 operands give the float32 kernels' bits on the widened inputs") {
  // 4 experts of (K 40, Nc 24) over 53 rows, one expert with none; both orientations of w
  const int64_t G = 4, K = 40, Nc = 24;
  const std::vector<int64_t> sizes = {20, 0, 31, 2};
  const int64_t M = 53;
  for (Device d : {Device::cpu, kt::device_under_test()})
    for (bool trans_w : {false, true}) {
      CAPTURE(device_name(d));
      CAPTURE(trans_w);
      const KernelTable& k = kernels_for(d);
      auto bf16_of = [&](int64_t n, uint64_t seed, std::vector<float>* wide) {
        *wide = kt::inputs(n, seed);
        for (float& v : *wide) v = bf16_to_float(float_to_bf16(v));
        Tensor h = Tensor::empty({n}, d, DType::bf16);
        k.to_bf16(h.bf16_data(), kt::upload(*wide, d).data(), n);
        return h;
      };
      std::vector<float> a, w, dc;
      const Tensor a16 = bf16_of(M * K, 31, &a), w16 = bf16_of(G * K * Nc, 32, &w), dc16 = bf16_of(M * Nc, 33, &dc);
      const Tensor gs = kt::upload_indices(sizes, d);
      Tensor c = kt::scratch(M * Nc, d), c32 = kt::scratch(M * Nc, d), dw = kt::scratch(G * K * Nc, d),
             dw32 = kt::scratch(G * K * Nc, d);
      k.grouped_gemm_bf16(c.data(), a16.bf16_data(), w16.bf16_data(), gs.index_data(), G, M, K, Nc, trans_w, false);
      k.grouped_gemm(c32.data(), kt::upload(a, d).data(), kt::upload(w, d).data(), gs.index_data(), G, M, K, Nc,
                     trans_w, false);
      k.grouped_gemm_dw_bf16(dw.data(), a16.bf16_data(), dc16.bf16_data(), gs.index_data(), G, M, K, Nc, false);
      k.grouped_gemm_dw(dw32.data(), kt::upload(a, d).data(), kt::upload(dc, d).data(), gs.index_data(), G, M, K, Nc,
                        false);
      for (auto [got, want, what] : {std::tuple{c, c32, std::string("grouped_gemm_bf16")},
                                     std::tuple{dw, dw32, std::string("grouped_gemm_dw_bf16")}}) {
        const std::vector<float> g = got.to_vector(), w_ = want.to_vector();
        int64_t differ = 0;
        for (size_t i = 0; i < g.size(); i++) differ += float_bits(g[i]) != float_bits(w_[i]);
        CHECK_MESSAGE(differ == 0, what << ": " << differ << " of " << g.size() << " elements differ from float32's");
      }
      // and the float32 kernel itself is right: one output against float64 (expert 2's first row)
      const int64_t row = 20, col = 5;
      double s = 0;
      for (int64_t p = 0; p < K; p++)
        s += (double)a[(size_t)(row * K + p)] * w[(size_t)(2 * K * Nc + (trans_w ? col * K + p : p * Nc + col))];
      CHECK(std::fabs(c.to_vector()[(size_t)(row * Nc + col)] - s) <= 1e-4 * (1 + std::fabs(s)));
    }
}

}  // TEST_SUITE("kernels")

TEST_CASE("bf16 ops: cast both ways, matmul of two bf16 tensors, and their gradients") {
  for (Device d : {Device::cpu, Device::sim}) {
    CAPTURE(device_name(d));
    Tensor a = scale(randn({5, 70}, 11), 3.f).to(d).requires_grad_(), b = randn({70, 9}, 12).to(d).requires_grad_();
    Tensor a16 = cast(a, DType::bf16), b16 = cast(b, DType::bf16);
    REQUIRE(a16.dtype() == DType::bf16);
    // cast there and back rounds each value once
    const std::vector<float> av = a.to_vector(), back = cast(a16, DType::f32).to_vector();
    for (size_t i = 0; i < av.size(); i++) REQUIRE(float_bits(back[i]) == float_bits(bf16_to_float(float_to_bf16(av[i]))));
    // the product of two bf16 tensors is float32: the float32 product of the widened values
    Tensor y = matmul(a16, b16);
    REQUIRE(y.dtype() == DType::f32);
    const std::vector<float> yw = matmul(cast(a16, DType::f32), cast(b16, DType::f32)).to_vector(), yv = y.to_vector();
    for (size_t i = 0; i < yv.size(); i++) REQUIRE(float_bits(yv[i]) == float_bits(yw[i]));
    // backward: the gradient enters bf16, as the matmul's inputs are: da = bf16(bf16(g) b^T),
    // db = bf16(a^T bf16(g)), widened to float32 by the casts' backward
    Tensor g = randn({5, 9}, 13).to(d);
    y.backward(g);
    NoGradGuard no_grad;
    auto bf = [](const Tensor& t) { return cast(cast(t, DType::bf16), DType::f32); };
    const Tensor gw = bf(g), aw = cast(a16, DType::f32), bw = cast(b16, DType::f32);
    const std::vector<float> da = bf(matmul(gw, transpose(bw, 0, 1))).to_vector(),
                             db = bf(matmul(transpose(aw, 0, 1), gw)).to_vector();
    const std::vector<float> ga = a.grad().to_vector(), gb = b.grad().to_vector();
    REQUIRE(a.grad().dtype() == DType::f32);
    int64_t differ = 0;
    for (size_t i = 0; i < da.size(); i++) differ += float_bits(ga[i]) != float_bits(da[i]);
    for (size_t i = 0; i < db.size(); i++) differ += float_bits(gb[i]) != float_bits(db[i]);
    CHECK_MESSAGE(differ == 0, differ << " gradient elements differ from bf16(bf16(g) b^T) and bf16(a^T bf16(g))");
  }
}

TEST_CASE("bf16 ops: a planted bug in the bf16 matmul's backward is caught by the same comparison") {
  Tensor a = randn({4, 16}, 21).requires_grad_(), b = randn({16, 3}, 22);
  Tensor a16 = cast(a, DType::bf16), b16 = cast(b, DType::bf16);
  {
    testing::PlantedBug bug("matmul_bf16", testing::Bug::scale_by_1_01);
    matmul(a16, b16).backward(Tensor::full({4, 3}, 1.f));
  }
  NoGradGuard no_grad;
  const Tensor want = cast(cast(matmul(Tensor::full({4, 3}, 1.f), transpose(cast(b16, DType::f32), 0, 1)), DType::bf16),
                           DType::f32);
  const std::vector<float> got = a.grad().to_vector(), w = want.to_vector();
  int64_t differ = 0;
  for (size_t i = 0; i < w.size(); i++) differ += float_bits(got[i]) != float_bits(w[i]);
  CHECK(differ > 0);  // the scaled gradient no longer matches
  // and in bits: every element off by about 1%, far beyond a bf16 rounding of the product
  CHECK(std::fabs(got[0] / w[0] - 1.01f) < 0.01f);
}

TEST_CASE("bf16 ops: a float32 activation against a bf16 weight is rounded to bf16 first; its gradient is float32") {
  Tensor x = randn({3, 40}, 41).requires_grad_(), x2 = x.detach().clone().requires_grad_();
  const Tensor w16 = cast(randn({40, 5}, 42), DType::bf16);
  const Tensor g = randn({3, 5}, 43);
  const Tensor y = matmul(x, w16), y2 = matmul(cast(x2, DType::bf16), w16);
  y.backward(g), y2.backward(g);
  REQUIRE(x.grad().dtype() == DType::f32);
  const std::vector<float> a = y.to_vector(), b = y2.to_vector(), ga = x.grad().to_vector(), gb = x2.grad().to_vector();
  for (size_t i = 0; i < a.size(); i++) REQUIRE(float_bits(a[i]) == float_bits(b[i]));
  for (size_t i = 0; i < ga.size(); i++) REQUIRE(float_bits(ga[i]) == float_bits(gb[i]));
  CHECK_THROWS_AS(matmul(w16, randn({5, 2}, 44)), Error);  // a bf16 activation against a float32 weight: no rule
}

TEST_CASE("bf16 ops: the MoE's experts with bf16 weights: the GEMMs' inputs rounded to bf16, bf16 weight gradients") {
  // 4 experts of (d 24, f 16) over 30 packed rows, one expert with none
  const int64_t G = 4, d = 24, f = 16, M = 30;
  moe::Params p;
  p.w1 = scale(randn({G, d, f}, 51), 0.2f), p.w3 = scale(randn({G, d, f}, 52), 0.2f), p.w2 = scale(randn({G, f, d}, 53), 0.2f);
  moe::Params p16 = p;
  p16.w1 = cast(p.w1, DType::bf16), p16.w3 = cast(p.w3, DType::bf16), p16.w2 = cast(p.w2, DType::bf16);
  moe::Params wide = p16;  // float32 weights holding the bf16 values
  wide.w1 = cast(p16.w1, DType::f32), wide.w3 = cast(p16.w3, DType::f32), wide.w2 = cast(p16.w2, DType::f32);
  const Tensor xp = randn({M, d}, 54), dyp = randn({M, d}, 55);
  const Tensor sizes = Tensor::from_indices({9, 0, 14, 7}, {G});
  auto bf = [](const Tensor& t) { return cast(cast(t, DType::bf16), DType::f32); };
  // forward: the float32 experts on the rounded weights, with xp and h rounded where the bf16
  // GEMMs take them, give the same bits
  moe::ExpertCache cache, ref;
  const Tensor y = moe::experts_forward(p16, xp, sizes, &cache);
  moe::experts_forward(wide, bf(xp), sizes, &ref);  // a, b, h of the rounded xp
  const Tensor y_ref = Tensor::empty({M, d});
  kernels_for(Device::cpu).grouped_gemm(y_ref.data(), bf(ref.h).data(), wide.w2.data(), sizes.index_data(), G, M, f, d,
                                        false, false);
  const std::vector<float> got = y.to_vector(), want = y_ref.to_vector();
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); i++) differ += float_bits(got[i]) != float_bits(want[i]);
  CHECK_MESSAGE(differ == 0, differ << " outputs differ from the float32 experts with rounded inputs");
  // backward: bf16 gradients for bf16 weights, float32 for the activations, each within bf16's
  // rounding of the float32 experts' on the same (rounded) weights
  const moe::ExpertGrads g16 = moe::experts_backward(p16, cache, dyp);
  moe::ExpertCache wide_cache;
  moe::experts_forward(wide, xp, sizes, &wide_cache);
  const moe::ExpertGrads g32 = moe::experts_backward(wide, wide_cache, dyp);
  CHECK(g16.dw1.dtype() == DType::bf16);
  CHECK(g16.dw2.dtype() == DType::bf16);
  CHECK(g16.dxp.dtype() == DType::f32);
  for (auto [half, full, what] : {std::tuple{g16.dw1, g32.dw1, std::string("dw1")}, std::tuple{g16.dw3, g32.dw3, std::string("dw3")},
                                  std::tuple{g16.dw2, g32.dw2, std::string("dw2")}, std::tuple{g16.dxp, g32.dxp, std::string("dxp")}}) {
    const std::vector<float> h = half.to_vector(), w = full.to_vector();
    double worst = 0, scale_of = 0;
    for (size_t i = 0; i < w.size(); i++) worst = std::max(worst, (double)std::fabs(h[i] - w[i])), scale_of = std::max(scale_of, (double)std::fabs(w[i]));
    // a few bf16 roundings (2^-8 each: of dyp, of da and db, of the gradient itself) of terms
    // no larger than the largest gradient: measured 0.003 to 0.007 of it
    CHECK_MESSAGE(worst <= 0.02 * scale_of, what << ": " << worst << " off, against " << scale_of);
    CHECK_MESSAGE(worst > 0, what << ": no rounding at all: the bf16 path did not run");
  }
  // an expert with no rows gets a zero gradient
  const std::vector<float> dw1 = g16.dw1.to_vector();
  bool zero = true;
  for (int64_t i = d * f; i < 2 * d * f; i++) zero = zero && dw1[(size_t)i] == 0.f;
  CHECK(zero);
}

TEST_CASE("bf16 ops: the whole model in mixed precision: bf16 matmul weights, float32 embedding, norms and router") {
  // lesson 08's model (model.h's default config: MLA, a dense block, a MoE block with a shared
  // expert), on cpu and on sim, with every matmul weight held in bf16 (Megatron's layout: the
  // float32 copy would be the optimizer's master), the rest float32
  model::Config c;
  const model::Params full = model::init_params(c, 7);
  for (Device d : {Device::cpu, Device::sim}) {
    CAPTURE(device_name(d));
    model::Params mixed = model::init_params(c, 7, d);
    for (Tensor* w : mixed.matmul_weights()) *w = cast(w->detach(), DType::bf16).requires_grad_();
    const Tensor tokens = randint({2, 17}, 8, c.vocab);
    const model::Output f32 = model::loss_and_grads(c, full, tokens), bf = model::loss_and_grads(c, mixed, tokens.to(d));
    // the loss moves by bf16's rounding of the weights and the GEMMs' inputs, not more (measured:
    // 4.66616 and 4.66684, 0.015%)
    const double l32 = f32.loss.item(), l16 = bf.loss.item();
    CAPTURE(l32);
    CAPTURE(l16);
    CHECK(l16 != l32);
    CHECK(std::fabs(l16 - l32) <= 0.002 * std::fabs(l32));
    // every parameter has its gradient, in its own dtype, close to the float32 model's (measured:
    // at most 1.2% of its norm)
    int64_t bf16_grads = 0;
    const std::vector<model::NamedTensor> a = mixed.named_parameters(), b = full.named_parameters();
    for (size_t i = 0; i < a.size(); i++) {
      CAPTURE(a[i].name);
      REQUIRE(a[i].t.grad().defined());
      CHECK(a[i].t.grad().dtype() == a[i].t.dtype());
      bf16_grads += a[i].t.dtype() == DType::bf16;
      const std::vector<float> g16 = a[i].t.grad().to_vector(), g32 = b[i].t.grad().to_vector();
      double diff = 0, norm = 0;
      for (size_t k = 0; k < g32.size(); k++) diff += std::pow(g16[k] - g32[k], 2), norm += std::pow(g32[k], 2);
      CHECK(std::sqrt(diff) <= 0.05 * std::sqrt(norm) + 1e-6);
    }
    CHECK(bf16_grads == 1 + 7 * c.layers + 3 * c.dense_layers + 6 * (c.layers - c.dense_layers));
  }
}

TEST_CASE("bf16 AdamW: a float32 master copy keeps the small updates a bf16 weight rounds away") {
  // weights near 1, where bf16's step is 2^-7: lr 1e-4 moves a weight by about 1e-4 a step,
  // under half a step (2^-8 = 0.0039), so each update alone rounds back to the same bf16
  for (Device d : {Device::cpu, Device::sim}) {
    CAPTURE(device_name(d));
    const int64_t n = 64;
    std::vector<float> w0(n), gv(n);
    for (int64_t i = 0; i < n; i++) w0[(size_t)i] = 1.f + (float)i / 256.f, gv[(size_t)i] = (i % 2 ? 1.f : -1.f) * 0.5f;
    AdamConfig cfg;
    cfg.lr = 1e-4;
    auto run = [&](bool master, int steps, Adam* keep) {
      AdamConfig c = cfg;
      c.master_weights = master;
      Adam adam(c);
      Tensor p = cast(Tensor::from_vector(w0, {n}), DType::bf16).to(d);
      const Tensor g = cast(Tensor::from_vector(gv, {n}), DType::bf16).to(d);
      for (int s = 0; s < steps; s++) adam.step({&p}, {g});
      if (keep) *keep = adam;
      return p.to_vector();
    };
    // with the master: the same steps as float32 AdamW on the widened values, then rounded
    Adam with_master;
    const std::vector<float> kept = run(true, 100, &with_master);
    Tensor p32 = cast(cast(Tensor::from_vector(w0, {n}), DType::bf16), DType::f32).to(d);
    const Tensor g32 = cast(cast(Tensor::from_vector(gv, {n}), DType::bf16), DType::f32).to(d);
    Adam plain(cfg);
    for (int s = 0; s < 100; s++) plain.step({&p32}, {g32});
    const std::vector<float> master = with_master.master(0).to_vector(), want = p32.to_vector();
    int64_t differ = 0, moved = 0, lost = 0;
    for (int64_t i = 0; i < n; i++) {
      differ += float_bits(master[(size_t)i]) != float_bits(want[(size_t)i]);
      differ += float_bits(kept[(size_t)i]) != float_bits(bf16_to_float(float_to_bf16(want[(size_t)i])));
      moved += kept[(size_t)i] != bf16_to_float(float_to_bf16(w0[(size_t)i]));
    }
    CHECK_MESSAGE(differ == 0, differ << " values differ from float32 AdamW's master and its rounding");
    CHECK(moved == n);  // 100 steps of about 1e-4 each: every weight moved by bf16 steps
    CHECK(with_master.master_bytes() == (size_t)n * 4);
    // the planted bug: no master, each step rounded away, no weight ever moves
    const std::vector<float> stuck = run(false, 100, nullptr);
    for (int64_t i = 0; i < n; i++) lost += stuck[(size_t)i] == bf16_to_float(float_to_bf16(w0[(size_t)i]));
    CHECK(lost == n);
  }
}

TEST_CASE("bf16 AdamW restored with its masters goes on to the same bits; from the bf16 weights alone its masters differ") {
  // A checkpoint's resume: 30 small steps (lr 1e-4 on weights near 1, each under half a bf16
  // step), stopped after 10, restored into a new Adam with m, v, t and the masters, 20 more.
  const int64_t n = 40;
  AdamConfig cfg;
  cfg.lr = 1e-4;
  const Tensor w0 = add(scale(randn({n}, 81), 0.01f), Tensor::full({n}, 1.f)).to_dtype(DType::bf16);
  const auto grad = [&](int s) { return Tensor::full({n}, 0.25f + 0.01f * (float)s).to_dtype(DType::bf16); };
  Adam whole(cfg);
  Tensor a = w0.clone();
  for (int s = 0; s < 30; s++) whole.step({&a}, {grad(s)});
  for (bool keep_masters : {true, false}) {
    CAPTURE(keep_masters);
    Adam first(cfg);
    Tensor b = w0.clone();
    for (int s = 0; s < 10; s++) first.step({&b}, {grad(s)});
    Adam resumed(cfg);
    resumed.restore({first.exp_avg()[0]}, {first.exp_avg_sq()[0]}, first.steps(),
                    keep_masters ? std::vector<Tensor>{first.master(0)} : std::vector<Tensor>{});
    for (int s = 10; s < 30; s++) resumed.step({&b}, {grad(s)});
    // the masters: the same bits only when restored; the weights then too
    CHECK(bitwise_equal(whole.master(0), resumed.master(0)) == keep_masters);
    if (keep_masters) CHECK(bitwise_equal(a, b));
  }
}

TEST_CASE("bf16 AdamW moments: m and v kept in bf16, each step the float32 update from them, then rounded") {
  // Against a float32-moment AdamW stepped by hand: each step starts from the bf16 moments
  // widened (restore), so the parameter and the rounded moments must match bit for bit.
  for (Device d : {Device::cpu, Device::sim}) {
    CAPTURE(device_name(d));
    const int64_t n = 48;
    AdamConfig cfg;
    cfg.lr = 1e-2, cfg.bf16_moments = true;
    Adam narrow(cfg);
    Tensor p = randn({n}, 71).to(d), q = p.clone();
    std::vector<Tensor> m16{Tensor::zeros({n}, d, DType::bf16)}, v16{Tensor::zeros({n}, d, DType::bf16)};
    int64_t differ = 0;
    for (int s = 1; s <= 4; s++) {
      const Tensor g = randn({n}, 71 + s).to(d);
      narrow.step({&p}, {g});
      AdamConfig wide_cfg = cfg;
      wide_cfg.bf16_moments = false;
      Adam wide(wide_cfg);  // from the same moments, widened
      wide.restore({m16[0].to_dtype(DType::f32)}, {v16[0].to_dtype(DType::f32)}, s - 1);
      wide.step({&q}, {g});
      m16[0] = wide.exp_avg()[0].to_dtype(DType::bf16), v16[0] = wide.exp_avg_sq()[0].to_dtype(DType::bf16);
      REQUIRE(narrow.exp_avg()[0].dtype() == DType::bf16);
      differ += !bitwise_equal(p, q) + !bitwise_equal(narrow.exp_avg()[0], m16[0]) +
                !bitwise_equal(narrow.exp_avg_sq()[0], v16[0]);
    }
    CHECK_MESSAGE(differ == 0, differ << " of the steps' parameters and moments differ");
    CHECK(narrow.state_bytes() == (size_t)n * 2 * 2);  // m and v, 2 bytes each
    // and they are not the float32 moments: the rounding is there (it changes the weights)
    Adam full(AdamConfig{cfg.lr});
    Tensor r = randn({n}, 71).to(d);
    for (int s = 1; s <= 4; s++) full.step({&r}, {randn({n}, 71 + s).to(d)});
    CHECK(!bitwise_equal(r, p));
  }
}

TEST_CASE("bf16 ops: a bf16 weight read twice adds its two bf16 gradients") {
  const Tensor a16 = cast(randn({4, 12}, 61), DType::bf16), g = randn({4, 3}, 62);
  Tensor once = cast(randn({12, 3}, 63), DType::bf16).requires_grad_(), twice = once.detach().clone().requires_grad_();
  matmul(a16, once).backward(g);
  add(matmul(a16, twice), matmul(a16, twice)).backward(g);
  REQUIRE(twice.grad().dtype() == DType::bf16);
  // the same gradient twice: their sum, doubled exactly, is representable
  const std::vector<float> one = once.grad().to_vector(), two = twice.grad().to_vector();
  int64_t differ = 0;
  for (size_t i = 0; i < one.size(); i++) differ += float_bits(two[i]) != float_bits(2 * one[i]);
  CHECK(differ == 0);
}

TEST_CASE("bf16 ops: transpose, slice and concat move bf16 numbers exactly, and their gradients are bf16") {
  for (Device d : {Device::cpu, Device::sim}) {
    CAPTURE(device_name(d));
    const Tensor x32 = randn({3, 4, 5}, 21, d), y32 = randn({3, 2, 5}, 22, d);
    Tensor x = cast(x32, DType::bf16).detach().requires_grad_(), y = cast(y32, DType::bf16).detach().requires_grad_();
    const Tensor xw = x.to_dtype(DType::f32), yw = y.to_dtype(DType::f32);
    // the same numbers as the float32 op on the widened values, held in bf16
    const Tensor t = transpose(x, 0, 2), sl = slice(x, 1, 1, 3), c = concat({x, y}, 1);
    for (const auto& [got, want] : {std::pair{t, transpose(xw, 0, 2)}, std::pair{sl, slice(xw, 1, 1, 3)},
                                    std::pair{c, concat({xw, yw}, 1)}}) {
      CHECK(got.dtype() == DType::bf16);
      CHECK(got.shape() == want.shape());
      CHECK(got.to_vector() == want.to_vector());
    }
    // gradients: ones through each, summed: every element of x gets 1 (transpose) + 1 if in the
    // slice's rows + 1 (concat); y 1
    const Tensor loss = add(add(sum_all(cast(t, DType::f32)), sum_all(cast(sl, DType::f32))), sum_all(cast(c, DType::f32)));
    run_backward(loss, Tensor::full({}, 1.f, d));
    REQUIRE(x.grad().defined());
    CHECK(x.grad().dtype() == DType::bf16);
    CHECK(y.grad().dtype() == DType::bf16);
    const std::vector<float> gx = x.grad().to_vector(), gy = y.grad().to_vector();
    for (int64_t i = 0; i < 3; i++)
      for (int64_t j = 0; j < 4; j++)
        for (int64_t k = 0; k < 5; k++) CHECK(gx[(size_t)((i * 4 + j) * 5 + k)] == (j == 1 || j == 2 ? 3.f : 2.f));
    for (float g : gy) CHECK(g == 1.f);
    // mixing dtypes is refused
    CHECK_THROWS_WITH_AS(concat({x, x32}, 1), doctest::Contains("bf16 tensors with tensors of another dtype"), Error);
  }
}
