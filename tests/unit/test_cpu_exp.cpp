// The cpu row kernels' exps (kernels/cpu/row_math.h): polynomials the compiler can vectorise
// instead of a libm call per element. exp_double's comment claims: rounded to float, within
// 0.51 ulp of exp(x) for every float x, with exp(-inf) = 0 (as a float), exp(inf) = inf,
// NaN -> NaN and the clamps at the ends of float's range. exp_float's (in float, twice the
// lanes): within 0.94 ulp for x in [-87.3, 88] (where exp is a normal float; its domain ends at
// 88), subnormal or 0 below, 0 at -inf, NaN -> NaN. Checked here against libm's exp in double,
// on every 97th float of the range (about 11 million values each).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>

#include <doctest/doctest.h>
#include "kernels/cpu/row_math.h"

namespace {

// the distance from the float f to the real value want, in units of the last place of f's
// binade (the spacing of floats around want)
double ulps(float f, double want) {
  int e;
  std::frexp(want, &e);
  const double ulp = std::ldexp(1.0, std::max(e - 24, -149));  // -149: denormals
  return std::fabs((double)f - want) / ulp;
}

// The worst error, in ulps of exp(x), of f over every 97th float from -0 down to `first` and
// from +0 up to `last` (walking the bit patterns), and over `extra`.
struct Sweep {
  double worst = 0;
  float worst_x = 0;
  int64_t checked = 0;
};
template <typename F>
Sweep sweep(float first, float last, std::initializer_list<float> extra, F f) {
  uint32_t lo, hi;
  std::memcpy(&lo, &first, 4);
  std::memcpy(&hi, &last, 4);
  Sweep w;
  auto check = [&](float x) {
    const double e = ulps(f(x), std::exp((double)x));
    if (e > w.worst) w.worst = e, w.worst_x = x;
    w.checked++;
  };
  for (uint32_t b = 0x80000000u; b <= lo; b += 97) { float x; std::memcpy(&x, &b, 4); check(x); }
  for (uint32_t b = 0; b <= hi; b += 97) { float x; std::memcpy(&x, &b, 4); check(x); }
  for (float x : extra) check(x);
  return w;
}

}  // namespace

TEST_CASE("cpu exp_double: within 0.51 ulp of exp once rounded to float, on a sweep of floats") {
  const float first = -103.0f, last = 88.7f;  // exp of both is a finite, non-zero float
  const Sweep w = sweep(first, last, {first, last, -1.f, 0.f, 1.f, 0.5f, -0.5f, 10.f, -10.f},
                        [](float x) { return (float)ff::cpu::exp_double(x); });
  MESSAGE("worst: " << w.worst << " ulp at x = " << w.worst_x << " over " << w.checked << " floats");
  CHECK(w.worst <= 0.51);
}

TEST_CASE("cpu exp_double: -inf, +inf, NaN and the clamped ends") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK((float)ff::cpu::exp_double(-inf) == 0.f);  // exp(-104) ~ 7e-46 in double
  CHECK((float)ff::cpu::exp_double(-200.f) == 0.f);  // below float's range: rounds to 0
  CHECK(std::isinf((float)ff::cpu::exp_double(inf)));
  CHECK(std::isinf((float)ff::cpu::exp_double(100.f)));  // above it: inf, as expf
  CHECK(std::isnan(ff::cpu::exp_double(std::nanf(""))));
}

TEST_CASE("cpu exp_float: within 0.94 ulp of exp, on a sweep of floats") {
  const float first = -87.3f, last = 88.f;  // exp of both is a normal float
  // besides the sweep: the worst cases of a sweep of every float (0.9357 and 0.9331 ulp), the ends
  const Sweep w = sweep(first, last,
                        {16.2898178f, -5.19525242f, first, last, -1.f, 0.f, 1.f, 0.5f, -0.5f,
                         10.f, -10.f},
                        [](float x) { return ff::cpu::exp_float(x); });
  MESSAGE("worst: " << w.worst << " ulp at x = " << w.worst_x << " over " << w.checked << " floats");
  CHECK(w.worst <= 0.94);
}

TEST_CASE("cpu exp_float: -inf, NaN, the subnormal range and the clamp") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(ff::cpu::exp_float(-inf) == 0.f);
  CHECK(ff::cpu::exp_float(-88.f) == 0.f);   // exp(-88) ~ 6e-39: flushed to 0
  CHECK(ff::cpu::exp_float(-200.f) == 0.f);  // clamped to -88
  CHECK(std::isnan(ff::cpu::exp_float(std::nanf(""))));
  CHECK(ff::cpu::exp_float(0.f) == 1.f);
  // below 2^-126 the result is a subnormal or 0, within 1e-38 of exp(x)
  double worst = 0;
  for (float x = -88.5f; x < -87.2f; x = std::nextafter(x, 0.f))
    worst = std::max(worst, std::fabs((double)ff::cpu::exp_float(x) - std::exp((double)x)));
  CHECK(worst < 1e-38);
}
