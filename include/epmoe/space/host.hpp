// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>

#include "epmoe/core/view.hpp"
#include "epmoe/space/host_gemm.hpp"

namespace epmoe::space {

/// Owning host array, zero-initialised, sized once.
template <class T>
class host_buffer {
 public:
  host_buffer() = default;
  explicit host_buffer(index_t n)
      : data_(n > 0 ? new T[static_cast<std::size_t>(n)]() : nullptr), size_(n) {}
  T* data() const { return data_.get(); }
  index_t size() const { return size_; }

 private:
  std::unique_ptr<T[]> data_;
  index_t size_ = 0;
};

/// Host execution: memory is ordinary heap memory, loops run on the calling thread (one
/// rank = one thread), GEMMs go to BLAS when found (EPMOE_HAS_CBLAS), else a portable loop.
struct host {
  template <class T>
  using buffer = host_buffer<T>;

  template <class T>
  buffer<T> allocate(index_t n) const {
    return buffer<T>(n);
  }

  /// f(i) for i in [0, n): the per-row / per-token EPMOE_HD functors of the layer.
  template <class F>
  void for_each(index_t n, F&& f) const {
    for (index_t i = 0; i < n; ++i) f(i);
  }

  /// c[M,N] = a[M,K] * b[N,K]^T (row-major; b is a PyTorch-style [out, in] weight).
  void gemm_nt(matrix_view<const float> a, matrix_view<const float> b, matrix_view<float> c) const {
    host_gemm_nt(a, b, c);
  }

  /// Copies `count[i]` rows from src row `src_offset[i]` to dst row `dst_offset[i]`, for
  /// each of n blocks (the regroup between source-major and expert-major layouts).
  void copy_blocks(matrix_view<const float> src, matrix_view<float> dst, index_t n,
                   const index_t* src_offset, const index_t* dst_offset,
                   const index_t* count) const {
    for (index_t i = 0; i < n; ++i)
      for (index_t r = 0; r < count[i]; ++r)
        std::memcpy(dst.row(dst_offset[i] + r), src.row(src_offset[i] + r),
                    static_cast<std::size_t>(src.cols) * sizeof(float));
  }

  void synchronize() const {}
};

}  // namespace epmoe::space
