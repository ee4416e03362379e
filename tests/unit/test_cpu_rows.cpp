// The cpu row kernels' own promises (kernels/cpu/row_math.h, reduce.cpp, norm_loss.cpp,
// layout.cpp), which the device-vs-cpu kernel tests do not see:
//  - transpose moves 8 x 8 blocks in registers inside 32 x 32 tiles, and ragged edges one
//    float at a time: bit-exact against the plain loop on shapes that cut blocks and tiles;
//  - every row kernel gives the same bits on 1, 2 and 3 threads (rows are shared among threads
//    from 2^16 elements; rmsnorm's dw adds per-block partial sums in a fixed order);
//  - rmsnorm's dw is summed in 16 blocks of rows (float), then the blocks in double.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

// Runs fn on 1, 2 and 3 threads (the matmul's and row kernels' thread count) and restores the
// default.
void for_thread_counts(const std::function<void(int)>& fn) {
  const int threads = cpu::matmul_threads();
  for (int n : {1, 2, 3}) {
    cpu::set_matmul_threads(n);
    fn(n);
  }
  cpu::set_matmul_threads(threads);
}

void require_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                       const std::string& what) {
  REQUIRE(got.size() == want.size());
  INFO(what);
  CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("cpu transpose: 8 x 8 register blocks, ragged blocks and tiles, vs the plain loop") {
  // (A, D0, Bm, D1, Cn): whole blocks (8, 32, 64), ragged ones (37 x 45: 4 blocks and 5 rows,
  // 5 blocks and 5 columns), a tile cut by 1 (33), rows of 4 KiB (1024 x 1024, and threaded:
  // 2^20 elements), batched with a middle dim (2 x 64 x 3 x 41), and Cn > 1; beyond 8 MiB, the
  // streaming stores (1536 x 1536; batched, 2 x 516 x 3 x 700) and their fallback when the
  // tile rows are not 16-byte aligned (D0 = 1539).
  const int64_t shapes[][5] = {{1, 8, 1, 8, 1},       {1, 37, 1, 45, 1},     {1, 33, 1, 33, 1},
                               {1, 7, 1, 300, 1},     {1, 300, 1, 7, 1},     {1, 1024, 1, 1024, 1},
                               {2, 64, 3, 41, 1},     {1, 257, 1, 300, 1},   {2, 19, 2, 23, 3},
                               {1, 1536, 1, 1536, 1}, {2, 516, 3, 700, 1},   {1, 1539, 1, 1400, 1}};
  for (auto& s : shapes) {
    const int64_t A = s[0], D0 = s[1], Bm = s[2], D1 = s[3], Cn = s[4], n = A * D0 * Bm * D1 * Cn;
    const std::vector<float> x = kt::inputs(n, 31);
    std::vector<float> want(n);
    for (int64_t a = 0; a < A; a++)
      for (int64_t i = 0; i < D0; i++)
        for (int64_t b = 0; b < Bm; b++)
          for (int64_t j = 0; j < D1; j++)
            for (int64_t c = 0; c < Cn; c++)
              want[(((a * D1 + j) * Bm + b) * D0 + i) * Cn + c] =
                  x[(((a * D0 + i) * Bm + b) * D1 + j) * Cn + c];
    for_thread_counts([&](int threads) {
      std::vector<float> out(n, std::nanf(""));
      kt::cpu_kernels().transpose(out.data(), x.data(), A, D0, Bm, D1, Cn);
      require_same_bits(out, want,
                        "transpose " + shape_str({A, D0, Bm, D1, Cn}) + " on " +
                            std::to_string(threads) + " thread(s)");
    });
  }
}

TEST_CASE("cpu row kernels: the same bits on 1, 2 and 3 threads") {
  const KernelTable& k = kt::cpu_kernels();
  // Each >= 2^16 elements, so that the rows are shared: many rows; fewer rows than rmsnorm's
  // 16 dw blocks (5); a row count that splits unevenly (17 rows of 4097).
  const int64_t shapes[][2] = {{301, 1000}, {5, 20000}, {17, 4097}};
  for (auto& s : shapes) {
    const int64_t N = s[0], C = s[1], n = N * C;
    const std::string shape = shape_str({N, C});
    const std::vector<float> x = kt::inputs(n, 41), dy = kt::inputs(n, 42), w = kt::inputs(C, 43);
    std::vector<int64_t> targets(N);
    for (int64_t r = 0; r < N; r++) targets[r] = (r * 7919) % C;
    std::vector<float> dloss = kt::inputs(N, 44);
    // Every output of every kernel, on the current thread count, in one list.
    auto outputs = [&] {
      std::vector<std::vector<float>> o;
      auto add = [&](int64_t size) -> float* {
        o.emplace_back(size, std::nanf(""));
        return o.back().data();
      };
      float* sm = add(n);
      k.softmax_forward(sm, x.data(), N, C);
      k.softmax_backward(add(n), sm, dy.data(), N, C);
      float* lsm = add(n);
      k.log_softmax_forward(lsm, x.data(), N, C);
      k.log_softmax_backward(add(n), lsm, dy.data(), N, C);
      float* rstd = add(N);
      k.rmsnorm_forward(add(n), rstd, x.data(), w.data(), N, C, 1e-5f);
      k.rmsnorm_backward(add(n), add(C), dy.data(), x.data(), w.data(), rstd, N, C);
      float* lse = add(N);
      k.cross_entropy_forward(add(N), lse, x.data(), targets.data(), N, C);
      k.cross_entropy_backward(add(n), x.data(), lse, targets.data(), dloss.data(), N, C);
      k.reduce(ReduceOp::sum, add(N), x.data(), N, C, 1);
      k.reduce(ReduceOp::sum, add(C), x.data(), 1, N, C);
      float* mx = add(N);
      k.reduce(ReduceOp::max, mx, x.data(), N, C, 1);
      k.max_backward(add(n), x.data(), mx, dloss.data(), N, C, 1);
      k.transpose(add(n), x.data(), 1, N, 1, C, 1);
      return o;
    };
    std::vector<std::vector<float>> one;
    for_thread_counts([&](int threads) {
      std::vector<std::vector<float>> got = outputs();
      if (threads == 1) one = got;
      for (size_t i = 0; i < got.size(); i++)
        require_same_bits(got[i], one[i],
                          "output " + std::to_string(i) + " of " + shape + " on " +
                              std::to_string(threads) + " threads vs 1");
    });
  }
}

TEST_CASE("cpu rmsnorm_backward: dw summed in 16 blocks of rows, then the blocks in double") {
  // dw_j = sum_r fl(dy_rj fl(x_rj rstd_r)): each term rounded to float, as the kernel does, then
  // summed in long double here. The kernel adds each block's ceil(N / 16) terms in float (within
  // (ceil(N / 16) - 1) 2^-24 sum|terms|), the 16 block sums in double, and rounds once (half an
  // ulp). A float sum over all N rows in order may be off by (N - 1) 2^-24 sum|terms|, ~16 times
  // as much: this bound catches the blocks added in float, or a block left out.
  const int64_t N = 600, C = 300;  // 180000 elements: 16 blocks of 37 or 38 rows, on 2 threads
  const std::vector<float> x = kt::inputs(N * C, 51), dy = kt::inputs(N * C, 52),
                           w = kt::inputs(C, 53);
  std::vector<float> y(N * C), rstd(N), dx(N * C), dw(C);
  const KernelTable& k = kt::cpu_kernels();
  k.rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  k.rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  const double block_rows = (N + 15) / 16;
  for (int64_t j = 0; j < C; j++) {
    long double sum = 0, abs_sum = 0;
    for (int64_t r = 0; r < N; r++) {
      const float xhat = x[r * C + j] * rstd[r], term = dy[r * C + j] * xhat;
      sum += term, abs_sum += std::fabs(term);
    }
    const double tol = 0.5 * FLT_EPSILON * std::fabs((double)sum) +
                       block_rows * std::ldexp(1.0, -24) * (double)abs_sum;
    INFO("dw[" << j << "]");
    REQUIRE(std::fabs((double)dw[j] - (double)sum) <= tol);
  }
}
