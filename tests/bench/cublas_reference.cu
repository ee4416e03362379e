// tests/bench/cublas_reference.cu — cuBLAS SGEMM, the reference figure for make bench's
// matmul versions (nvcc builds only). FP32 math without TF32, as the hand-written kernels.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

static void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS error in ") + what + ": status " + std::to_string((int)s));
}

// Median milliseconds of c (M, N) = a (M, K) @ b (K, N), row-major device pointers.
double cublas_sgemm_ms(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K,
                       int reps) {
  cublasHandle_t handle;
  cublas_check(cublasCreate(&handle), "cublasCreate");
  cublas_check(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  const float alpha = 1.f, beta = 0.f;
  // cuBLAS is column-major: row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ.
  auto run = [&] {
    cublas_check(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, b,
                             (int)N, a, (int)K, &beta, c, (int)N),
                 "cublasSgemm");
  };
  run();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> t;
  for (int i = 0; i < reps; i++) {
    cudaEventRecord(start);
    run();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    t.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
