// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Grouped GEMM over the local experts with cuBLAS's cublasGemmGroupedBatchedEx: one call
// runs every expert's [rows_j, in] x [out, in]^T with its own row count, T in, fp32
// accumulate. Problem descriptions live in host arrays and device pointer arrays sized once.
#include <algorithm>
#include <vector>

#include "epmoe/cuda/runtime.cuh"

namespace epmoe::cuda_detail {

/// c [m, out] (row-major, ldc) = a [m, in] (lda) x b [out, in]^T (ldb), fp32 accumulate.
struct gemm_problem {
  const void* a;
  index_t lda;
  const void* b;
  index_t ldb;
  void* c;
  index_t ldc;
  index_t m, out, in;
};

class grouped_gemm {
 public:
  grouped_gemm() = default;
  explicit grouped_gemm(int max_problems)
      : cap_(max_problems),
        host_ptrs_(3 * static_cast<index_t>(max_problems)),
        dev_ptrs_(3 * static_cast<index_t>(max_problems)),
        ta_(max_problems, CUBLAS_OP_T),
        tb_(max_problems, CUBLAS_OP_N),
        m_(max_problems),
        n_(max_problems),
        k_(max_problems),
        lda_(max_problems),
        ldb_(max_problems),
        ldc_(max_problems),
        size_(max_problems, 1),
        alpha_(max_problems, 1.f),
        beta_(max_problems, 0.f) {}

  /// Describes the problems (rows == 0 ones are skipped) and uploads their pointers.
  /// Call again only after the previous run's upload finished (the stream was synchronised
  /// since), or once for fixed shapes (static mode) and then run() any number of times.
  void set(const gemm_problem* p, int count, cudaStream_t s) {
    n_problems_ = 0;
    for (int i = 0; i < count; ++i) {
      if (p[i].m == 0) continue;
      if (n_problems_ == cap_) throw std::logic_error("epmoe: grouped_gemm: too many problems");
      const int q = n_problems_++;
      // Row-major C = A B^T is column-major C^T = B A^T: cuBLAS's A is our b (transposed).
      m_[q] = static_cast<int>(p[i].out);
      n_[q] = static_cast<int>(p[i].m);
      k_[q] = static_cast<int>(p[i].in);
      lda_[q] = static_cast<int>(p[i].ldb);
      ldb_[q] = static_cast<int>(p[i].lda);
      ldc_[q] = static_cast<int>(p[i].ldc);
      host_ptrs_[q] = const_cast<void*>(p[i].b);
      host_ptrs_[cap_ + q] = const_cast<void*>(p[i].a);
      host_ptrs_[2 * cap_ + q] = p[i].c;
    }
    if (n_problems_ > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(dev_ptrs_.data(), host_ptrs_.data(),
                                       sizeof(void*) * 3 * static_cast<std::size_t>(cap_),
                                       cudaMemcpyHostToDevice, s));
  }

  /// Runs the problems of the last set() with beta (0: overwrite, 1: accumulate into c).
  /// Where this cuBLAS lacks the grouped call for these types (CUBLAS_STATUS_NOT_SUPPORTED),
  /// falls back, from then on, to one cublasGemmEx per problem (same math, more launches).
  void run(cublasHandle_t h, cudaDataType_t ab, cudaDataType_t c, float beta) {
    if (n_problems_ == 0) return;
    std::fill_n(beta_.begin(), n_problems_, beta);
    if (grouped_) {
      void** d = dev_ptrs_.data();
      const cublasStatus_t st = cublasGemmGroupedBatchedEx(
          h, ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(),
          const_cast<const void* const*>(d), ab, lda_.data(),
          const_cast<const void* const*>(d + cap_), ab, ldb_.data(), beta_.data(), d + 2 * cap_, c,
          ldc_.data(), n_problems_, size_.data(), CUBLAS_COMPUTE_32F);
      if (st != CUBLAS_STATUS_NOT_SUPPORTED) return check(st, "cublasGemmGroupedBatchedEx");
      grouped_ = false;
    }
    for (int q = 0; q < n_problems_; ++q)
      EPMOE_CUDA_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m_[q], n_[q], k_[q], &alpha_[q],
                                    host_ptrs_[q], ab, lda_[q], host_ptrs_[cap_ + q], ab, ldb_[q],
                                    &beta_[q], host_ptrs_[2 * cap_ + q], c, ldc_[q],
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  /// Whether the last run used the grouped call (false: the per-problem fallback).
  bool grouped() const { return grouped_; }
  int problems() const { return n_problems_; }

 private:
  int cap_ = 0, n_problems_ = 0;
  bool grouped_ = true;
  pinned_buffer<void*> host_ptrs_;  // [3 * cap]: A, B, C per problem
  device_buffer<void*> dev_ptrs_;
  std::vector<cublasOperation_t> ta_, tb_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, size_;
  std::vector<float> alpha_, beta_;
};

}  // namespace epmoe::cuda_detail
