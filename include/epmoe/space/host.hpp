// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "epmoe/core/view.hpp"
#include "epmoe/space/host_gemm.hpp"

namespace epmoe::space {

namespace detail {

#if defined(EPMOE_HOST_GEMM_AVX2)
// exp(x), 8 lanes: x = n ln2 + r, |r| <= ln2/2, exp(r) by Cephes' expf polynomial (~1 ulp),
// times 2^n through the exponent bits. Inputs past 88 give +inf, below -87 give ~1e-38.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.f), _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(y, _mm256_set1_ps(HUGE_VALF), big);
}

// a[i] = silu(a[i]) * b[i] = a[i] / (1 + exp(-a[i])) * b[i], 8 at a time.
__attribute__((target("avx2,fma"))) inline void silu_mul_avx2(float* a, const float* b, index_t n) {
  index_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(b + i)));
  }
  for (; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}
#endif

}  // namespace detail

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

  /// a[i] = silu(a[i]) * b[i] for i in [0, n): SwiGLU's gate, vectorised (a fast exp within
  /// ~2 ulp of expf) where the CPU has AVX2, else the same formula as expert::silu_mul.
  void silu_mul(float* a, const float* b, index_t n) const {
#if defined(EPMOE_HOST_GEMM_AVX2)
    if (detail::cpu_has_avx2_fma()) return detail::silu_mul_avx2(a, b, n);
#endif
    for (index_t i = 0; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
  }

  void synchronize() const {}
};

}  // namespace epmoe::space
