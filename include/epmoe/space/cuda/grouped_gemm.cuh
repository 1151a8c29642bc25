// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// cuBLAS GEMMs of space::cuda. The experts' grouped GEMM is one cublasGemmGroupedBatchedEx
// over every non-empty group (local expert), T in, fp32 accumulate, or one cublasGemmEx per
// group when the groups are large (set_per_group_rows). Each call of a pass has
// its own pinned and device arrays (a call's upload never races with the next call's), and
// the device pointer arrays are computed on the device from the groups' device offsets, so a
// pass captured in a CUDA graph computes its own pointers when replayed.
#include <algorithm>
#include <utility>
#include <vector>

#include "epmoe/core/view.hpp"
#include "epmoe/space/cuda/kernels.cuh"
#include "epmoe/space/cuda/runtime.cuh"

namespace epmoe::cuda_detail {

/// c [M, N] (row-major, ldc, type ct) = a [M, K] x b [N, K]^T (type ab), fp32 accumulate.
inline void gemm_nt(cublasHandle_t h, cudaDataType_t ab, const void* a, index_t lda, const void* b,
                    index_t ldb, cudaDataType_t ct, void* c, index_t ldc, index_t M, index_t N,
                    index_t K, float beta) {
  if (M == 0 || N == 0) return;
  const float alpha = 1.f;
  // Row-major C = A B^T is column-major C^T = B A^T: cuBLAS's A is our b (transposed).
  EPMOE_CUDA_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                                static_cast<int>(M), static_cast<int>(K), &alpha, b, ab,
                                static_cast<int>(ldb), a, ab, static_cast<int>(lda), &beta, c, ct,
                                static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/// c [M, N] (row-major, ldc, type ct) = a [M, K] x b [K, N] (b row-major, not transposed;
/// type ab) + beta c, fp32 accumulate (the backward's dX = dY W).
inline void gemm_nn(cublasHandle_t h, cudaDataType_t ab, const void* a, index_t lda, const void* b,
                    index_t ldb, cudaDataType_t ct, void* c, index_t ldc, index_t M, index_t N,
                    index_t K, float beta) {
  if (M == 0 || N == 0) return;
  const float alpha = 1.f;
  // Row-major C = A B is column-major C^T = B^T A^T, and row-major B read column-major is B^T.
  EPMOE_CUDA_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(N),
                                static_cast<int>(M), static_cast<int>(K), &alpha, b, ab,
                                static_cast<int>(ldb), a, ab, static_cast<int>(lda), &beta, c, ct,
                                static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/// c [M, N] (row-major, ldc, type ct) = a [R, M]^T x b [R, N] (type ab) + beta c, fp32
/// accumulate (the backward's dW = dYᵀ X). R > 0.
inline void gemm_tn(cublasHandle_t h, cudaDataType_t ab, const void* a, index_t lda, const void* b,
                    index_t ldb, cudaDataType_t ct, void* c, index_t ldc, index_t M, index_t N,
                    index_t R, float beta) {
  if (M == 0 || N == 0) return;
  const float alpha = 1.f;
  // Column-major C^T [N, M] = B^T [N, R] x A [R, M]: row-major b read column-major is B^T
  // (no op), row-major a read column-major is A^T (op T gives A).
  EPMOE_CUDA_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(N),
                                static_cast<int>(M), static_cast<int>(R), &alpha, b, ab,
                                static_cast<int>(ldb), a, ab, static_cast<int>(lda), &beta, c, ct,
                                static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

class grouped_gemm {
 public:
  /// Room for `calls` grouped calls per pass of up to `groups` groups each.
  void reserve(int calls, int groups) {
    if (calls <= calls_ && groups <= cap_) return;
    calls_ = std::max(calls, calls_);
    cap_ = std::max(groups, cap_);
    host_groups_ = pinned_buffer<int>(static_cast<index_t>(calls_) * cap_);
    dev_groups_ = device_buffer<int>(static_cast<index_t>(calls_) * cap_);
    dev_ptrs_ = device_buffer<const void*>(static_cast<index_t>(calls_) * 3 * cap_);
    const auto n = static_cast<std::size_t>(cap_);
    ta_.assign(n, CUBLAS_OP_T), tb_.assign(n, CUBLAS_OP_N);
    m_.resize(n), n_.resize(n), k_.resize(n), lda_.resize(n), ldb_.resize(n), ldc_.resize(n);
    size_.assign(n, 1), alpha_.assign(n, 1.f), beta_.assign(n, 0.f);
  }
  int calls() const { return calls_; }
  void begin_pass() { next_ = 0; }
  /// Groups averaging at least `rows` rows run as one cublasGemmEx each (cuBLAS picks each
  /// problem's kernel: on an H200 the grouped call ran large problems at a third of the dense
  /// rate); fewer, as one cublasGemmGroupedBatchedEx (one launch for many small problems).
  void set_per_group_rows(index_t rows) { per_group_rows_ = rows; }
  index_t per_group_rows() const { return per_group_rows_; }

  /// Per group g: c's rows of g = a's rows of g x b[g]^T.
  template <class T>
  void run(cublasHandle_t h, grouped_rows<const T> a, stacked_view<const T> b, grouped_rows<T> c,
           cudaStream_t s, std::pair<void*, std::size_t> workspace) {
    if (a.groups > cap_ || calls_ == 0)
      throw std::logic_error("epmoe: space::cuda grouped GEMM used beyond what was reserved");
    const int call = next_++ % calls_;
    int* groups = host_groups_.data() + call * cap_;
    int q = 0;
    for (int g = 0; g < a.groups; ++g) {
      const index_t rows = a.offsets[g + 1] - a.offsets[g];
      if (rows == 0) continue;
      groups[q] = g;
      m_[q] = static_cast<int>(b.rows);  // cuBLAS's m: the weight's rows (our output columns)
      n_[q] = static_cast<int>(rows);
      k_[q] = static_cast<int>(b.cols);
      lda_[q] = static_cast<int>(b.stride);
      ldb_[q] = static_cast<int>(a.stride);
      ldc_[q] = static_cast<int>(c.stride);
      ++q;
    }
    if (q == 0) return;
    EPMOE_CUDA_CHECK(cublasSetWorkspace(h, workspace.first, workspace.second));
    const dtype_t ab = dtype<T>::cuda;
    const index_t rows = a.offsets[a.groups] - a.offsets[0];
    if (grouped_ && rows < per_group_rows_ * q) {
      int* dg = dev_groups_.data() + call * cap_;
      const void** ptrs = dev_ptrs_.data() + static_cast<index_t>(call) * 3 * cap_;
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(dg, groups, sizeof(int) * q, cudaMemcpyHostToDevice, s));
      cuda_kernels::grouped_pointers<T>
          <<<1, cuda_kernels::block_threads, 0, s>>>(a, b, c, dg, q, ptrs, cap_);
      EPMOE_CUDA_CHECK(cudaGetLastError());
      const cublasStatus_t st = cublasGemmGroupedBatchedEx(
          h, ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(), ptrs, ab,
          lda_.data(), ptrs + cap_, ab, ldb_.data(), beta_.data(),
          const_cast<void* const*>(reinterpret_cast<const void* const*>(ptrs + 2 * cap_)), ab,
          ldc_.data(), q, size_.data(), CUBLAS_COMPUTE_32F);
      if (st != CUBLAS_STATUS_NOT_SUPPORTED) return check(st, "cublasGemmGroupedBatchedEx");
      grouped_ = false;  // this cuBLAS lacks it for these types: one GEMM per group from now
    }
    for (int i = 0; i < q; ++i) {
      const int g = groups[i];
      const index_t r0 = a.offsets[g] - a.offsets[0];
      gemm_nt(h, ab, a.data + r0 * a.stride, a.stride, b.data + g * b.batch_stride, b.stride, ab,
              c.data + r0 * c.stride, c.stride, n_[i], m_[i], k_[i], 0.f);
    }
  }

  /// Whether this cuBLAS has the grouped call for the types used (false: one GEMM per group).
  bool grouped() const { return grouped_; }

 private:
  using dtype_t = cudaDataType_t;
  int calls_ = 0, cap_ = 0, next_ = 0;
  bool grouped_ = true;
  index_t per_group_rows_ = 32;
  pinned_buffer<int> host_groups_;  // [calls][cap]: the non-empty groups of each call
  device_buffer<int> dev_groups_;
  device_buffer<const void*> dev_ptrs_;  // [calls][3][cap]: A, B, C per problem
  std::vector<cublasOperation_t> ta_, tb_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, size_;
  std::vector<float> alpha_, beta_;
};

}  // namespace epmoe::cuda_detail
