// kernels/cpu/cpu_kernels.h — the cpu device's kernels: plain C++ loops, the
// readable definition of every op. Signatures and shape conventions are those
// of KernelTable in kernels/kernels.h.
#pragma once
#include "kernels/kernels.h"

namespace ff::cpu {

void fill(float* out, int64_t n, float value);
void affine(float* out, const float* x, int64_t n, float alpha, float beta);
void binary(BinaryOp op, float* out, const float* a, const float* b, int64_t n, int64_t C,
            Broadcast bc);
void unary(UnaryOp op, float* out, const float* x, int64_t n);
void unary_backward(UnaryOp op, float* dx, const float* x, const float* y, const float* dy,
                    int64_t n);
void reduce(ReduceOp op, float* out, const float* in, int64_t outer, int64_t n, int64_t inner);
void max_backward(float* dx, const float* x, const float* y, const float* dy, int64_t outer,
                  int64_t n, int64_t inner);
void softmax_forward(float* y, const float* x, int64_t N, int64_t C);
void softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C);
void log_softmax_forward(float* y, const float* x, int64_t N, int64_t C);
void log_softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C);
void matmul(float* c, const float* a, const float* b, int64_t B, int64_t M, int64_t Nc, int64_t K,
            int64_t stride_a, int64_t stride_b, bool trans_a, bool trans_b, bool accumulate);
void transpose(float* out, const float* in, int64_t A, int64_t D0, int64_t Bm, int64_t D1,
               int64_t Cn);
void copy_block(float* dst, int64_t dst_n, int64_t dst_off, const float* src, int64_t src_n,
                int64_t src_off, int64_t outer, int64_t len, int64_t inner, bool accumulate);
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps);
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C);
void cross_entropy_forward(float* loss, float* lse, const float* logits, const int64_t* targets,
                           int64_t N, int64_t V);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int64_t* targets, const float* dloss, int64_t N, int64_t V);
void index_select_rows(float* out, const float* src, const int64_t* idx, int64_t M, int64_t C);
void index_add_rows(float* dst, const float* src, const int64_t* idx, int64_t M, int64_t C);
void topk_rows(float* vals, int64_t* idx, const float* x, int64_t N, int64_t C, int64_t k);
void topk_backward(float* dx, const float* dvals, const int64_t* idx, int64_t N, int64_t C,
                   int64_t k);
void masked_fill(float* out, const float* x, const float* mask, int64_t n, int64_t mask_n,
                 float value);

}  // namespace ff::cpu
