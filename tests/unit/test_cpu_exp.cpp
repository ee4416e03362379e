// The cpu row kernels' exp (kernels/cpu/row_math.h, exp_double): a polynomial the compiler can
// vectorise instead of a libm call per element. Its comment claims: rounded to float, within
// 0.51 ulp of exp(x) for every float x, with exp(-inf) = 0 (as a float), exp(inf) = inf, NaN -> NaN and the
// clamps at the ends of float's range. Checked here against libm's exp in double, on every
// 97th float of the range where exp is a finite, non-zero float (about 11 million values).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

}  // namespace

TEST_CASE("cpu exp_double: within 0.51 ulp of exp once rounded to float, on a sweep of floats") {
  uint32_t lo, hi;
  const float first = -103.0f, last = 88.7f;  // exp of both is a finite, non-zero float
  std::memcpy(&lo, &first, 4);
  std::memcpy(&hi, &last, 4);
  double worst = 0;
  float worst_x = 0;
  int64_t checked = 0;
  auto check = [&](float x) {
    const double e = ulps((float)ff::cpu::exp_double(x), std::exp((double)x));
    if (e > worst) worst = e, worst_x = x;
    checked++;
  };
  // negative floats: bit patterns from -0 up to `first`; positive: from +0 up to `last`
  for (uint32_t b = 0x80000000u; b <= lo; b += 97) { float x; std::memcpy(&x, &b, 4); check(x); }
  for (uint32_t b = 0; b <= hi; b += 97) { float x; std::memcpy(&x, &b, 4); check(x); }
  for (float x : {first, last, -1.f, 0.f, 1.f, 0.5f, -0.5f, 10.f, -10.f}) check(x);
  MESSAGE("worst: " << worst << " ulp at x = " << worst_x << " over " << checked << " floats");
  CHECK(worst <= 0.51);
}

TEST_CASE("cpu exp_double: -inf, +inf, NaN and the clamped ends") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK((float)ff::cpu::exp_double(-inf) == 0.f);  // exp(-104) ~ 7e-46 in double
  CHECK((float)ff::cpu::exp_double(-200.f) == 0.f);  // below float's range: rounds to 0
  CHECK(std::isinf((float)ff::cpu::exp_double(inf)));
  CHECK(std::isinf((float)ff::cpu::exp_double(100.f)));  // above it: inf, as expf
  CHECK(std::isnan(ff::cpu::exp_double(std::nanf(""))));
}
