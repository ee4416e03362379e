// make bench — kernel throughput on every device this machine has, measured in one run.
//
//   build/tests/bench_kernels [--quick] [--matmul-only | --rows-only]
//
// Per kernel and device: the median time of a few repetitions (after a warm-up), and
//   matmul:               GFLOP/s (2·M·N·K per product); on cuda also the ratio to cuBLAS
//                         SGEMM on the same shape, timed in this run; on cpu version 1 (the
//                         double-summing triple loop, at 256^3 only: it is slow), version 2
//                         (the cpu device's) and OpenBLAS's cblas_sgemm, at 256^3 and 1024^3,
//                         on 1 and 2 threads (OpenBLAS given the same count); the bf16 matmul
//                         (bf16 operands, float32 sums) against version 2; and the ratio
//                         version 2 / OpenBLAS;
//   bandwidth-bound ones: GB/s of the bytes the kernel must read and write at least once;
//                         on cuda also the ratio to a cudaMemcpy device-to-device moving
//                         the same number of bytes, timed in this run; on cpu the ratio to a
//                         memcpy of the same bytes on the same number of threads (1 and 2 for
//                         the kernels that thread), at a cache-resident shape (256 x 1024) and
//                         one past the caches (8192 x 8192).
// Each device gets shapes it can finish in about a second: the sim device runs every CUDA
// thread as a fiber on the CPU, so its figures say how fast the emulator is (it is a
// teaching and testing device), not how fast the kernel would be on a GPU. The last lines
// time the emulator itself: a 256-thread block with 8 barriers.
//
// Figures only: nothing here is asserted. Tests check correctness (make test).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/launchers.h"
#include "kernels/kernels.h"
#include "kernels/simt.h"
#include "kernels/simt_emulator.h"

using namespace ff;

// OpenBLAS's own (cblas.h declares them too, when it is OpenBLAS's cblas.h)
extern "C" void openblas_set_num_threads(int num_threads);
extern "C" char* openblas_get_corename(void);

#if FF_HAVE_CUDA
// tests/bench/cublas_reference.cu
void cublas_sgemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K);
#endif

namespace {

using Clock = std::chrono::steady_clock;

// The instruction set an OpenBLAS core's kernels use, in matmul_isa()'s words: a ratio against
// OpenBLAS means something only when both sides run the same one (the Makefile gives OpenBLAS
// the best this CPU has, whatever the environment sets; kernels/README.md).
std::string blas_isa(const std::string& core) {
  for (const char* c : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    if (core == c) return "AVX-512";
  for (const char* c : {"Haswell", "Zen"})
    if (core == c) return "AVX2 + FMA";
  return "older than AVX2";
}

// The best instruction set this CPU has, in the same words.
std::string cpu_best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd"))
    return "AVX-512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "AVX2 + FMA";
  return "portable";
}

// The ratio column against OpenBLAS: `blas / ours` when both run the same instruction set, else
// why there is none.
std::string of_openblas(double blas_ms, double ms) {
  const std::string core = openblas_get_corename(), theirs = blas_isa(core), ours = cpu::matmul_isa();
  if (theirs != ours) return "no ratio: OpenBLAS " + core + " (" + theirs + "), ours " + ours;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f of OpenBLAS", blas_ms / ms);
  return buf;
}

// Median milliseconds of fn() over `reps` runs after one warm-up, synchronising the device.
double median_ms(Device d, int reps, const std::function<void()>& fn) {
  fn();
  device_synchronize(d);
  std::vector<double> t;
  for (int i = 0; i < reps; i++) {
    auto t0 = Clock::now();
    fn();
    device_synchronize(d);
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int reps_for(Device d) { return d == Device::sim ? 3 : 10; }

void row(const std::string& kernel, Device d, const std::string& shape, double ms,
         const std::string& throughput, const std::string& vs) {
  std::printf("%-24s %-5s %-16s %10.3f ms  %16s  %s\n", kernel.c_str(), device_name(d),
              shape.c_str(), ms, throughput.c_str(), vs.c_str());
  std::fflush(stdout);
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// The cudaMemcpy device-to-device time for `bytes` of reads plus writes (bytes / 2 copied).
double memcpy_ms(Device d, size_t bytes) {
  size_t half = std::max<size_t>(bytes / 2, 4);
  Tensor a = Tensor::zeros({(int64_t)(half / 4)}, d), b = Tensor::zeros({(int64_t)(half / 4)}, d);
  return median_ms(d, reps_for(d), [&] { device_memcpy(b.raw(), d, a.raw(), d, a.nbytes()); });
}

// ----------------------------------------------------------------------------
// matmul: the three versions side by side, and cuBLAS on cuda

using MatmulFn = void (*)(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, bool, bool, bool);

// The cpu matmul: versions 1 and 2 of kernels/cpu/matmul.cpp against OpenBLAS, on 1 and 2
// threads each.
void bench_cpu_matmul(bool quick) {
  const Device d = Device::cpu;
  const int default_threads = cpu::matmul_threads();
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const char* ranks = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  std::printf("cpu matmul: %d thread(s) by default here (%s); OMP_NUM_THREADS sets it, and under "
              "mpirun the node's %d cores are divided among its ranks; below, 1 and 2 threads; "
              "OpenBLAS runs its %s kernels (%s; OPENBLAS_CORETYPE), version 2 its %s kernels (FF_CPU_ISA); "
              "the best this CPU has: %s\n",
              default_threads,
              omp ? "OMP_NUM_THREADS" : ranks ? "cores / mpirun ranks on this node" : "one per core",
              omp_get_num_procs(), openblas_get_corename(), blas_isa(openblas_get_corename()).c_str(),
              cpu::matmul_isa(), cpu_best_isa().c_str());
  for (int64_t n : quick ? std::vector<int64_t>{64} : std::vector<int64_t>{256, 1024}) {
    Tensor a = randn({n, n}, 1, d), b = randn({n, n}, 2, d), c = Tensor::zeros({n, n}, d);
    const Tensor a16 = cast(a, DType::bf16), b16 = cast(b, DType::bf16);
    const double flop = 2.0 * n * n * n;
    for (int threads : {1, 2}) {
      const std::string shape = std::to_string(n) + "^3 " + std::to_string(threads) + " thr";
      auto run = [&](MatmulFn fn) {
        return median_ms(d, reps_for(d), [&] {
          fn(c.data(), a.data(), b.data(), 1, n, n, n, 0, 0, false, false, false);
        });
      };
      if (n <= 256 && threads == 1) {  // version 1 has no threads, and takes ~1 s at 1024^3
        double ms = run(cpu::matmul_v1);
        row("matmul v1 triple loop", d, shape, ms, fmt("%.2f GFLOP/s", flop / ms / 1e6), "");
      }
      // OpenBLAS's idle worker threads spin for a while after a call: let them go to sleep
      // before timing version 2 (and libgomp's before OpenBLAS), so neither slows the other.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      cpu::set_matmul_threads(threads);
      double v2 = run(cpu::matmul);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      openblas_set_num_threads(threads);
      double blas = median_ms(d, reps_for(d), [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)n, (int)n, 1.f,
                    a.data(), (int)n, b.data(), (int)n, 0.f, c.data(), (int)n);
      });
      row("matmul OpenBLAS sgemm", d, shape, blas, fmt("%.1f GFLOP/s", flop / blas / 1e6),
          "(reference)");
      row("matmul v2 blocked", d, shape, v2, fmt("%.1f GFLOP/s", flop / v2 / 1e6), of_openblas(blas, v2));
      // bf16 operands (kernels/cpu/bf16.cpp: widened, then version 2), against version 2 itself
      const double bf = median_ms(d, reps_for(d), [&] {
        cpu::matmul_bf16(c.data(), a16.bf16_data(), b16.bf16_data(), 1, n, n, n, 0, 0, false, false, false);
      });
      row("matmul bf16 widened", d, shape, bf, fmt("%.1f GFLOP/s", flop / bf / 1e6),
          fmt("%.2fx float32 v2", v2 / bf));
    }
  }
  // A decode step's product: one row against a weight matrix past the caches (b streamed once,
  // its bytes the cost): float32 (4 bytes a weight) against bf16 (2 bytes, widened in registers)
  const int64_t n = quick ? 256 : 2048;
  const Tensor x = randn({1, n}, 3, d), w = randn({n, n}, 4, d), x16 = cast(x, DType::bf16), w16 = cast(w, DType::bf16);
  Tensor y = Tensor::zeros({1, n}, d);
  for (int threads : {1, 2}) {
    cpu::set_matmul_threads(threads);
    const std::string shape = "1x" + std::to_string(n) + "x" + std::to_string(n) + " " + std::to_string(threads) + " thr";
    const double f32 = median_ms(d, reps_for(d), [&] {
      cpu::matmul(y.data(), x.data(), w.data(), 1, 1, n, n, 0, 0, false, false, false);
    });
    const double bf = median_ms(d, reps_for(d), [&] {
      cpu::matmul_bf16(y.data(), x16.bf16_data(), w16.bf16_data(), 1, 1, n, n, 0, 0, false, false, false);
    });
    row("decode row float32", d, shape, f32, fmt("%.1f GB/s of b", 4.0 * n * n / f32 / 1e6), "");
    row("decode row bf16", d, shape, bf, fmt("%.1f GB/s of b", 2.0 * n * n / bf / 1e6), fmt("%.2fx float32", f32 / bf));
  }
  cpu::set_matmul_threads(default_threads);
}

// The MoE's grouped GEMMs (kernels/cpu/moe.cpp): tokens routed top-2 among 8 experts (rows per
// expert drawn at random), each expert's rows times its own (d, h) weights: the forward, the
// backward's dX against the transposed weights and dW, each against ONE OpenBLAS sgemm with the
// same total FLOPs (all the rows times one (d, h) matrix), on 1 and 2 threads.
void bench_cpu_grouped_gemm(bool quick) {
  const Device d = Device::cpu;
  const int default_threads = cpu::matmul_threads();
  const int64_t G = 8, M = quick ? 128 : 2048, D = quick ? 32 : 256, H = 2 * D;
  std::vector<int64_t> sizes((size_t)G, 0);
  uint64_t state = 12345;
  for (int64_t i = 0; i < M; i++) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    sizes[(size_t)((state >> 33) % G)]++;
  }
  Tensor a = randn({M, D}, 11, d), w = randn({G, D, H}, 12, d), dc = randn({M, H}, 13, d);
  Tensor c = Tensor::zeros({M, H}, d), dx = Tensor::zeros({M, D}, d), dw = Tensor::zeros({G, D, H}, d);
  const double flop = 2.0 * M * D * H;
  std::printf("cpu grouped GEMM (the MoE's experts): %lld rows among %lld experts, (%lld, %lld) "
              "weights each; against one OpenBLAS sgemm of the same FLOPs\n",
              (long long)M, (long long)G, (long long)D, (long long)H);
  for (int threads : {1, 2}) {
    const std::string shape = std::to_string(M) + "x" + std::to_string(D) + "x" + std::to_string(H) +
                              " " + std::to_string(threads) + " thr";
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    openblas_set_num_threads(threads);
    const double blas = median_ms(d, reps_for(d), [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)H, (int)D, 1.f, a.data(),
                  (int)D, w.data(), (int)H, 0.f, c.data(), (int)H);
    });
    row("grouped: OpenBLAS sgemm", d, shape, blas, fmt("%.1f GFLOP/s", flop / blas / 1e6), "(reference)");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    cpu::set_matmul_threads(threads);
    const struct {
      const char* name;
      std::function<void()> run;
    } cases[] = {
        {"grouped_gemm x W", [&] { cpu::grouped_gemm(c.data(), a.data(), w.data(), sizes.data(), G, M, D, H, false, false); }},
        {"grouped_gemm dy W^T", [&] { cpu::grouped_gemm(dx.data(), dc.data(), w.data(), sizes.data(), G, M, H, D, true, false); }},
        {"grouped_gemm_dw", [&] { cpu::grouped_gemm_dw(dw.data(), a.data(), dc.data(), sizes.data(), G, M, D, H, false); }},
    };
    for (const auto& k : cases) {
      const double ms = median_ms(d, reps_for(d), k.run);
      row(k.name, d, shape, ms, fmt("%.1f GFLOP/s", flop / ms / 1e6), of_openblas(blas, ms));
    }
  }
  cpu::set_matmul_threads(default_threads);
}

void bench_matmul(Device d, int64_t n) {
  std::vector<std::pair<std::string, MatmulFn>> versions;
  if (d == Device::sim)
    versions = {{"matmul v1 naive", sim::matmul_v1},
                {"matmul v2 smem tiles", sim::matmul_v2},
                {"matmul v3 2-D reg tiles", sim::matmul_v3}};
#if FF_HAVE_CUDA
  if (d == Device::cuda)
    versions = {{"matmul v1 naive", cuda::matmul_v1},
                {"matmul v2 smem tiles", cuda::matmul_v2},
                {"matmul v3 2-D reg tiles", cuda::matmul_v3}};
#endif
  Tensor a = randn({n, n}, 1, d), b = randn({n, n}, 2, d), c = Tensor::zeros({n, n}, d);
  const double flop = 2.0 * n * n * n;
  std::string shape = std::to_string(n) + "^3";
  double cublas = 0;
#if FF_HAVE_CUDA
  if (d == Device::cuda) {
    cublas = median_ms(d, reps_for(d), [&] { cublas_sgemm(a.data(), b.data(), c.data(), n, n, n); });
    row("matmul cuBLAS SGEMM", d, shape, cublas, fmt("%.1f GFLOP/s", flop / cublas / 1e6),
        "(reference)");
  }
#endif
  for (auto& [name, fn] : versions) {
    double ms = median_ms(d, reps_for(d), [&] {
      fn(c.data(), a.data(), b.data(), 1, n, n, n, 0, 0, false, false, false);
    });
    row(name, d, shape, ms, fmt("%.2f GFLOP/s", flop / ms / 1e6),
        cublas > 0 ? fmt("%.2f of cuBLAS", cublas / ms) : "");
  }
}

// ----------------------------------------------------------------------------
// bandwidth-bound kernels: (N rows, C columns) of float

void bench_bandwidth(Device d, int64_t N, int64_t C) {
  const KernelTable& k = kernels_for(d);
  const int64_t n = N * C;
  Tensor x = randn({N, C}, 3, d), y = randn({N, C}, 4, d), out = Tensor::zeros({N, C}, d);
  Tensor w = randn({C}, 5, d), rowbuf = Tensor::zeros({N}, d), rowbuf2 = Tensor::zeros({N}, d);
  Tensor targets = randint({N}, 6, C, d), idx = randint({N}, 7, N, d);
  const double F = sizeof(float);
  std::string shape = std::to_string(N) + "x" + std::to_string(C);
  struct Case {
    const char* name;
    double bytes;  // minimal bytes read + written
    std::function<void()> run;
  };
  std::vector<Case> cases = {
      {"binary add", 3 * F * n,
       [&] { k.binary(BinaryOp::add, out.data(), x.data(), y.data(), n, C, Broadcast::same); }},
      {"transpose", 2 * F * n, [&] { k.transpose(out.data(), x.data(), 1, N, 1, C, 1); }},
      {"reduce sum (rows)", F * (n + N),
       [&] { k.reduce(ReduceOp::sum, rowbuf.data(), x.data(), N, C, 1); }},
      {"softmax_forward", 2 * F * n, [&] { k.softmax_forward(out.data(), x.data(), N, C); }},
      {"softmax_backward", 3 * F * n,
       [&] { k.softmax_backward(out.data(), x.data(), y.data(), N, C); }},
      {"rmsnorm_forward", F * (2 * n + C + N),
       [&] { k.rmsnorm_forward(out.data(), rowbuf.data(), x.data(), w.data(), N, C, 1e-5f); }},
      {"cross_entropy_fwd", F * (n + 2 * N) + 8.0 * N,
       [&] {
         k.cross_entropy_forward(rowbuf.data(), rowbuf2.data(), x.data(), targets.index_data(), N, C);
       }},
      {"index_select_rows", 2 * F * n + 8.0 * N,
       [&] { k.index_select_rows(out.data(), x.data(), idx.index_data(), N, C); }},
  };
  for (const Case& c : cases) {
    double ms = median_ms(d, reps_for(d), c.run);
    double gbs = c.bytes / ms / 1e6;
    std::string vs;
    if (d == Device::cuda) vs = fmt("%.2f of cudaMemcpy", gbs / (c.bytes / memcpy_ms(d, (size_t)c.bytes) / 1e6));
    row(c.name, d, shape, ms, fmt("%.2f GB/s", gbs), vs);
  }
}

// The cpu's bandwidth-bound kernels against a memcpy of the same bytes (half read, half
// written) on the same number of threads, both timed here: the ratio says how close a kernel
// comes to streaming its bytes once. Two shapes: rows of 1024 in a 1 MiB tensor, which stays
// in the caches, and 8192 x 8192 (256 MiB a tensor, 512-768 MiB a kernel: past the L3 of this
// machine), where memory bandwidth is the limit. 1 and 2 threads for the kernels that share
// their rows among threads (kernels/cpu/row_math.h); one for the others.
void bench_cpu_bandwidth(bool quick, bool rows_only = false) {
  const Device d = Device::cpu;
  const KernelTable& k = kernels_for(d);
  const int default_threads = cpu::matmul_threads();
  std::printf("cpu row kernels: GB/s of the bytes each must read + write once, and the ratio to "
              "a memcpy moving as many bytes on as many threads in this run\n");
  const double F = sizeof(float);
  std::vector<std::pair<int64_t, int64_t>> shapes = {{256, 1024}, {8192, 8192}};
  if (quick) shapes = {{64, 256}};
  if (rows_only) shapes = {{256, 1024}};  // --rows-only: the shape lessons use (bench_rows.py)
  for (auto [N, C] : shapes) {
    const int64_t n = N * C;
    const int reps = n > (int64_t(1) << 24) ? 5 : 20;
    Tensor x = randn({N, C}, 3, d), y = randn({N, C}, 4, d), out = Tensor::zeros({N, C}, d);
    Tensor w = randn({C}, 5, d), rowbuf = Tensor::zeros({N}, d), rowbuf2 = Tensor::zeros({N}, d);
    Tensor colbuf = Tensor::zeros({C}, d), dloss = randn({N}, 8, d);
    Tensor targets = randint({N}, 6, C, d), idx = randint({N}, 7, N, d);
    Tensor sm = Tensor::zeros({N, C}, d), lsm = Tensor::zeros({N, C}, d);
    k.softmax_forward(sm.data(), x.data(), N, C);  // the backward ones get real forward outputs
    k.log_softmax_forward(lsm.data(), x.data(), N, C);
    k.rmsnorm_forward(out.data(), rowbuf.data(), x.data(), w.data(), N, C, 1e-5f);
    Tensor rstd = rowbuf.clone();
    k.cross_entropy_forward(rowbuf.data(), rowbuf2.data(), x.data(), targets.index_data(), N, C);
    Tensor lse = rowbuf2.clone();
    // memcpy's buffers: half of the most bytes a case below moves (3 tensors and a few rows),
    // each way
    std::vector<float> src((size_t)(3 * n / 2 + 4 * (N + C))), dst(src.size());
    auto memcpy_ms_threads = [&](double bytes, int threads) {
      const size_t half = (size_t)(bytes / 2), per = (half + threads - 1) / threads;
      char* s = reinterpret_cast<char*>(src.data());
      char* t = reinterpret_cast<char*>(dst.data());
      return median_ms(d, reps, [&] {
#pragma omp parallel for num_threads(threads)
        for (int i = 0; i < threads; i++) {
          const size_t off = std::min(half, i * per), len = std::min(half, off + per) - off;
          std::memcpy(t + off, s + off, len);
        }
      });
    };
    struct Case {
      const char* name;
      double bytes;   // minimal bytes read + written
      bool threaded;  // shares its rows among threads
      std::function<void()> run;
    };
    std::vector<Case> cases = {
        {"binary add", 3 * F * n, false,
         [&] { k.binary(BinaryOp::add, out.data(), x.data(), y.data(), n, C, Broadcast::same); }},
        {"transpose", 2 * F * n, true, [&] { k.transpose(out.data(), x.data(), 1, N, 1, C, 1); }},
        {"reduce sum (rows)", F * (n + N), true,
         [&] { k.reduce(ReduceOp::sum, rowbuf.data(), x.data(), N, C, 1); }},
        {"reduce sum (columns)", F * (n + C), true,
         [&] { k.reduce(ReduceOp::sum, colbuf.data(), x.data(), 1, N, C); }},
        {"reduce max (rows)", F * (n + N), true,
         [&] { k.reduce(ReduceOp::max, rowbuf.data(), x.data(), N, C, 1); }},
        {"max_backward", F * (2 * n + 2 * N), true,
         [&] { k.max_backward(out.data(), x.data(), rowbuf.data(), rowbuf2.data(), N, C, 1); }},
        {"softmax_forward", 2 * F * n, true, [&] { k.softmax_forward(out.data(), x.data(), N, C); }},
        {"softmax_backward", 3 * F * n, true,
         [&] { k.softmax_backward(out.data(), sm.data(), y.data(), N, C); }},
        {"log_softmax_forward", 2 * F * n, true,
         [&] { k.log_softmax_forward(out.data(), x.data(), N, C); }},
        {"log_softmax_backward", 3 * F * n, true,
         [&] { k.log_softmax_backward(out.data(), lsm.data(), y.data(), N, C); }},
        {"rmsnorm_forward", F * (2 * n + C + N), true,
         [&] { k.rmsnorm_forward(out.data(), rowbuf.data(), x.data(), w.data(), N, C, 1e-5f); }},
        {"rmsnorm_backward", F * (3 * n + 2 * C + N), true,
         [&] {
           k.rmsnorm_backward(out.data(), colbuf.data(), y.data(), x.data(), w.data(), rstd.data(),
                              N, C);
         }},
        {"cross_entropy_fwd", F * (n + 2 * N) + 8.0 * N, true,
         [&] {
           k.cross_entropy_forward(rowbuf.data(), rowbuf2.data(), x.data(), targets.index_data(),
                                   N, C);
         }},
        {"cross_entropy_bwd", F * (2 * n + 2 * N) + 8.0 * N, true,
         [&] {
           k.cross_entropy_backward(out.data(), x.data(), lse.data(), targets.index_data(),
                                    dloss.data(), N, C);
         }},
        {"index_select_rows", 2 * F * n + 8.0 * N, false,
         [&] { k.index_select_rows(out.data(), x.data(), idx.index_data(), N, C); }},
    };
    for (const Case& c : cases)
      for (int threads : {1, 2}) {
        if (threads > 1 && !c.threaded) continue;
        cpu::set_matmul_threads(threads);
        const double ms = median_ms(d, reps, c.run), copy = memcpy_ms_threads(c.bytes, threads);
        const double gbs = c.bytes / ms / 1e6, copy_gbs = c.bytes / copy / 1e6;
        row(c.name, d, std::to_string(N) + "x" + std::to_string(C) + " " + std::to_string(threads) + " thr",
            ms, fmt("%.2f GB/s", gbs), fmt("%.2f of memcpy", gbs / copy_gbs) + fmt(" (%.1f GB/s)", copy_gbs));
      }
  }
  cpu::set_matmul_threads(default_threads);
}

// ----------------------------------------------------------------------------
// the emulator itself

__global__ void eight_barriers(float* out) {
  __shared__ float s[256];
  float v = (float)threadIdx.x;
  for (int i = 0; i < 8; i++) {
    s[threadIdx.x] = v;
    __syncthreads();
    v += s[(threadIdx.x + 1) % blockDim.x];
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

void bench_emulator(int64_t blocks) {
  Tensor out = Tensor::empty({blocks * 256}, Device::sim);
  auto block_us = [&] {
    double ms = median_ms(Device::sim, 5, [&] {
      SIMT_LAUNCH(eight_barriers, dim3((unsigned)blocks), dim3(256), 0, 0, out.data());
    });
    return ms * 1e3 / (double)blocks;
  };
  const bool racecheck = simt::options().racecheck;
  simt::options().racecheck = false;
  const double plain = block_us();
  simt::options().racecheck = true;
  const double checked = block_us();
  simt::options().racecheck = racecheck;
  std::printf("emulator: a 256-thread block with 8 barriers takes %.1f us; %.1f M emulated "
              "threads/s (%lld blocks per launch, shuffled order); %.1f us with the race check "
              "comparing its %lld KiB argument after each block\n",
              plain, 256 / plain, (long long)blocks, checked, (long long)(blocks * 256 * 4 / 1024));
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, matmul_only = false;  // --matmul-only: the cpu matmul and grouped GEMMs
  bool rows_only = false;  // --rows-only: the cpu row kernels at 256 x 1024 (tests/bench/bench_rows.py)
  for (int i = 1; i < argc; i++) {
    quick |= std::strcmp(argv[i], "--quick") == 0;
    matmul_only |= std::strcmp(argv[i], "--matmul-only") == 0;
    rows_only |= std::strcmp(argv[i], "--rows-only") == 0;
  }
  std::printf("%-24s %-5s %-16s %13s  %16s  %s\n", "kernel", "dev", "shape", "median", "throughput",
              "in this run");
  for (Device d : {Device::cpu, Device::sim, Device::cuda}) {
    if (!device_available(d)) {
      std::printf("(%s: not available here — %s)\n", device_name(d), device_unavailable_reason(d));
      continue;
    }
    // Shapes each device finishes in about a second.
    int64_t n = d == Device::cuda ? 4096 : d == Device::cpu ? 256 : 128;
    int64_t N = d == Device::cuda ? 8192 : d == Device::cpu ? 1024 : 256;
    int64_t C = d == Device::cuda ? 4096 : 1024;
    if (quick) n = std::min<int64_t>(n, 64), N = std::min<int64_t>(N, 64), C = std::min<int64_t>(C, 256);
    if (d == Device::cpu && rows_only) {
      bench_cpu_bandwidth(quick, true);
      return 0;
    }
    if (d == Device::cpu) {
      bench_cpu_matmul(quick);
      bench_cpu_grouped_gemm(quick);
      if (matmul_only) return 0;
      bench_cpu_bandwidth(quick);
      continue;
    }
    bench_matmul(d, n);
    bench_bandwidth(d, N, C);
  }
  bench_emulator(quick ? 4 : 64);
  return 0;
}
