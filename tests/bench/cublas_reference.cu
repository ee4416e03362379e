// tests/bench/cublas_reference.cu — cuBLAS SGEMM, the reference figure for make bench's
// matmul versions (nvcc builds only). FP32 math without TF32, as the hand-written kernels.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

static void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS error in ") + what + ": status " + std::to_string((int)s));
}

// c (M, N) = a (M, K) @ b (K, N), row-major device pointers, on the default stream (timed by
// make bench exactly as the hand-written kernels are: host clock around launch + synchronize).
void cublas_sgemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K) {
  static cublasHandle_t handle = [] {
    cublasHandle_t h;
    cublas_check(cublasCreate(&h), "cublasCreate");
    cublas_check(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    return h;
  }();
  const float alpha = 1.f, beta = 0.f;
  // cuBLAS is column-major: row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ.
  cublas_check(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, b,
                           (int)N, a, (int)K, &beta, c, (int)N),
               "cublasSgemm");
}
