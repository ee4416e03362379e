// Lesson 01's own CUDA kernels (lessons/01_online_softmax/online_softmax.cu) on the device under
// test, against the definition computed here on the host in double precision: (m, l) per row,
// the normalised softmax, and split-K flash-decoding's (m, l, o) partial and merged states.
// Inputs include outliers (every 17th value x100), a row of -inf columns and a ragged last
// warp/chunk, so a lost max, a missing rescale or a missing -inf guard fails.
#include <cfloat>
#include <cmath>
#include <limits>

#include "lessons/01_online_softmax/online_softmax.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

struct Lesson01Kernels {
  decltype(&ff::online_softmax::sim::row_states) row_states;
  decltype(&ff::online_softmax::sim::normalise) normalise;
  decltype(&ff::online_softmax::sim::decode_partial) decode_partial;
  decltype(&ff::online_softmax::sim::merge_states) merge_states;
};

Lesson01Kernels kernels_under_test() {
#if FF_HAVE_CUDA
  if (kt::device_under_test() == Device::cuda)
    return {ff::online_softmax::cuda::row_states, ff::online_softmax::cuda::normalise, ff::online_softmax::cuda::decode_partial,
            ff::online_softmax::cuda::merge_states};
#endif
  return {ff::online_softmax::sim::row_states, ff::online_softmax::sim::normalise, ff::online_softmax::sim::decode_partial,
          ff::online_softmax::sim::merge_states};
}

const float kNegInf = -std::numeric_limits<float>::infinity();

// rows x n values with outliers; row 1 starts with `masked` columns of -inf.
std::vector<float> rows_with_mask(int64_t rows, int64_t n, int64_t masked, uint64_t seed) {
  std::vector<float> x = kt::inputs(rows * n, seed);
  if (rows > 1)
    for (int64_t j = 0; j < std::min(masked, n); j++) x[(size_t)(n + j)] = kNegInf;
  return x;
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("lesson 01 kernels: row_states and normalise equal the two-pass softmax in double") {
  const Device d = kt::device_under_test();
  const Lesson01Kernels k = kernels_under_test();
  for (int64_t n : {int64_t(1), int64_t(31), int64_t(32), int64_t(1000)}) {
    const int64_t rows = 5;
    const std::vector<float> x = rows_with_mask(rows, n, n / 2, 7 + (uint64_t)n);
    Tensor xd = kt::upload(x, d), state = kt::scratch(rows * 2, d), y = kt::scratch(rows * n, d);
    k.row_states(state.data(), xd.data(), rows, n);
    k.normalise(y.data(), xd.data(), state.data(), rows, n);
    std::vector<float> want_state((size_t)(rows * 2)), want_y((size_t)(rows * n));
    std::vector<double> tol_state((size_t)(rows * 2)), tol_y((size_t)(rows * n));
    for (int64_t r = 0; r < rows; r++) {
      const float* row = &x[(size_t)(r * n)];
      double m = -INFINITY, l = 0;
      for (int64_t j = 0; j < n; j++) m = std::max(m, (double)row[j]);
      for (int64_t j = 0; j < n; j++) l += std::exp((double)row[j] - m);
      want_state[(size_t)(2 * r)] = (float)m;
      want_state[(size_t)(2 * r + 1)] = (float)l;
      tol_state[(size_t)(2 * r)] = 0;  // the max is exact whatever the order
      // l: n float additions in another order, each term within a few ulps of exp
      tol_state[(size_t)(2 * r + 1)] = 4.0 * (double)(n + 2) * FLT_EPSILON * l;
      for (int64_t j = 0; j < n; j++) {
        const double p = std::exp((double)row[j] - m) / l;
        want_y[(size_t)(r * n + j)] = (float)p;
        tol_y[(size_t)(r * n + j)] = 4.0 * (double)(n + 2) * FLT_EPSILON * p + 1e-30;
      }
    }
    const std::string what = "n=" + std::to_string(n);
    kt::require_within(state.to_vector(), want_state, tol_state, 2, "row_states " + what);
    kt::require_within(y.to_vector(), want_y, tol_y, n, "normalise " + what);
  }
}

TEST_CASE("lesson 01 kernels: decode_partial then merge_states equal softmax(s) v in double") {
  const Device d = kt::device_under_test();
  const Lesson01Kernels k = kernels_under_test();
  struct Shape3 { int64_t nq, nk, dv, splits; };
  for (Shape3 sh : {Shape3{3, 1, 1, 1}, Shape3{4, 300, 8, 3}, Shape3{2, 129, 5, 4},
                    Shape3{1, 64, 16, 64}}) {
    const int64_t width = 2 + sh.dv;
    const std::vector<float> s = kt::inputs(sh.nq * sh.nk, 11, 0.5f);  // scores, with outliers
    const std::vector<float> v = kt::inputs(sh.nk * sh.dv, 12);
    Tensor sd = kt::upload(s, d), vd = kt::upload(v, d);
    Tensor partial = kt::scratch(sh.nq * sh.splits * width, d), state = kt::scratch(sh.nq * width, d);
    k.decode_partial(partial.data(), sd.data(), vd.data(), sh.nq, sh.nk, sh.dv, sh.splits);
    k.merge_states(state.data(), partial.data(), sh.nq, sh.dv, sh.splits);
    std::vector<float> got = state.to_vector(), out((size_t)(sh.nq * sh.dv)),
                       want((size_t)(sh.nq * sh.dv));
    std::vector<double> tol((size_t)(sh.nq * sh.dv));
    double vmax = 0;
    for (float t : v) vmax = std::max(vmax, (double)std::fabs(t));
    for (int64_t q = 0; q < sh.nq; q++) {
      const float* row = &s[(size_t)(q * sh.nk)];
      double m = -INFINITY, l = 0;
      for (int64_t j = 0; j < sh.nk; j++) m = std::max(m, (double)row[j]);
      for (int64_t j = 0; j < sh.nk; j++) l += std::exp((double)row[j] - m);
      REQUIRE(got[(size_t)(q * width)] == (float)m);  // the merged max is exact
      for (int64_t c = 0; c < sh.dv; c++) {
        double o = 0;
        for (int64_t j = 0; j < sh.nk; j++) o += std::exp((double)row[j] - m) * v[(size_t)(j * sh.dv + c)];
        out[(size_t)(q * sh.dv + c)] = got[(size_t)(q * width + 2 + c)] / got[(size_t)(q * width + 1)];
        want[(size_t)(q * sh.dv + c)] = (float)(o / l);
        // o / l sums nk terms p v with |v| <= vmax: the n eps bound on an absolute scale
        tol[(size_t)(q * sh.dv + c)] = 4.0 * (double)(sh.nk + 2) * FLT_EPSILON * vmax;
      }
    }
    kt::require_within(out, want, tol, sh.dv,
                       "decoding nq=" + std::to_string(sh.nq) + " nk=" + std::to_string(sh.nk) +
                           " splits=" + std::to_string(sh.splits));
  }
}

}  // TEST_SUITE
