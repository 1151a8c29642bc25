// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A GEMM for any number of rows over weights packed once (issue 22): c = a bᵀ with b (an
// expert's [out, in] weight) stored as panels of 32 output columns, K-major, so that every
// panel is read from memory once and used for all of a's rows while it sits in cache. sgemm
// packs b on every call, which dominates when a has 16-256 rows (an expert's share of a
// decode batch); the streaming kernel (host_gemm.hpp) re-reads a for every 4 columns.
// Micro-kernels: AVX-512 (6 rows x 32 columns in 12 registers), AVX2+FMA (3 x 32 in 12), and
// a portable loop, chosen at run time from what the CPU has.

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#include "epmoe/core/view.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EPMOE_HOST_PACKED_X86 1
#include <immintrin.h>
#endif

namespace epmoe::space {

/// The kernels a CPU can run, best last.
enum class cpu_path { portable, avx2, avx512 };

inline const char* name_of(cpu_path p) {
  switch (p) {
    case cpu_path::avx512:
      return "AVX-512";
    case cpu_path::avx2:
      return "AVX2+FMA";
    default:
      return "portable";
  }
}

/// Whether this CPU runs the path's instructions.
inline bool cpu_runs(cpu_path p) {
#if defined(EPMOE_HOST_PACKED_X86)
  switch (p) {
    case cpu_path::avx512:
      return __builtin_cpu_supports("avx512f");
    case cpu_path::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
#else
  return p == cpu_path::portable;
#endif
}

/// The best path this CPU runs (asked once).
inline cpu_path best_cpu_path() {
  static const cpu_path best = cpu_runs(cpu_path::avx512) ? cpu_path::avx512
                               : cpu_runs(cpu_path::avx2) ? cpu_path::avx2
                                                          : cpu_path::portable;
  return best;
}

/// b [N, K] packed for c = a bᵀ: panel p holds columns [32p, 32p + 32) as K rows of 32 floats
/// (columns past N zero), 64-byte aligned. Built once; repack() refills it in place (new
/// values of the same shape: a training step) without allocating.
class packed_nt {
 public:
  static constexpr index_t panel_cols = 32;

  packed_nt() = default;
  explicit packed_nt(matrix_view<const float> b) { repack(b); }

  /// Packs b, allocating only when its shape differs from the last one.
  void repack(matrix_view<const float> b) {
    if (b.rows != n_ || b.cols != k_ || !data_) {
      n_ = b.rows, k_ = b.cols;
      const std::size_t floats = static_cast<std::size_t>(panels() * k_ * panel_cols);
      data_.reset(static_cast<float*>(::operator new[](
          std::max<std::size_t>(floats, 1) * sizeof(float), std::align_val_t{64})));
    }
    for (index_t p = 0; p < panels(); ++p) {
      float* out = panel_to_fill(p);
      const index_t j0 = p * panel_cols, cols = std::min(panel_cols, n_ - j0);
      for (index_t k = 0; k < k_; ++k) {
        float* row = out + k * panel_cols;
        for (index_t j = 0; j < cols; ++j) row[j] = b(j0 + j, k);
        for (index_t j = cols; j < panel_cols; ++j) row[j] = 0.f;
      }
    }
  }

  index_t rows() const { return n_; }  // N: output columns of c
  index_t cols() const { return k_; }  // K
  index_t panels() const { return (n_ + panel_cols - 1) / panel_cols; }
  const float* panel(index_t p) const { return data_.get() + p * k_ * panel_cols; }
  /// The packed floats (weights and zero padding): what one pass reads.
  index_t packed_floats() const { return panels() * k_ * panel_cols; }

 private:
  float* panel_to_fill(index_t p) { return data_.get() + p * k_ * panel_cols; }
  struct aligned_delete {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<float, aligned_delete> data_;
  index_t n_ = 0, k_ = 0;
};

namespace detail {

// c rows [0, m) x columns [0, cols) of one panel, portable: a row of 32 accumulators per row
// of a (the compiler vectorises the inner loop).
inline void packed_panel_portable(matrix_view<const float> a, const float* panel, index_t K,
                                  float* c, index_t ldc, index_t cols) {
  constexpr index_t W = packed_nt::panel_cols;
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const float v = x[k];
      const float* w = panel + k * W;
      for (index_t j = 0; j < W; ++j) acc[j] += v * w[j];
    }
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j];
  }
}

#if defined(EPMOE_HOST_PACKED_X86)
// MR rows of a times one panel: 2 x MR zmm accumulators; per k two panel loads and MR
// broadcasts (the rows' k-th values), 2 MR FMAs.
template <int MR>
__attribute__((target("avx512f"))) inline void packed_rows_avx512(const float* a, index_t lda,
                                                                  const float* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_load_ps(panel + k * 32), w1 = _mm512_load_ps(panel + k * 32 + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(x, w0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, w1, hi[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, m0, lo[i]);
    _mm512_mask_storeu_ps(c + i * ldc + 16, m1, hi[i]);
  }
}

__attribute__((target("avx512f"))) inline void packed_panel_avx512(matrix_view<const float> a,
                                                                   const float* panel, index_t K,
                                                                   float* c, index_t ldc,
                                                                   index_t cols) {
  const auto mask = [](index_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  };
  const __mmask16 m0 = mask(cols), m1 = mask(cols - 16);
  index_t i = 0;
  for (; i + 6 <= a.rows; i += 6)
    packed_rows_avx512<6>(a.row(i), a.stride, panel, K, c + i * ldc, ldc, m0, m1);
  const float* ar = a.row(std::min(i, a.rows));
  float* cr = c + i * ldc;
  switch (a.rows - i) {
    case 5:
      return packed_rows_avx512<5>(ar, a.stride, panel, K, cr, ldc, m0, m1);
    case 4:
      return packed_rows_avx512<4>(ar, a.stride, panel, K, cr, ldc, m0, m1);
    case 3:
      return packed_rows_avx512<3>(ar, a.stride, panel, K, cr, ldc, m0, m1);
    case 2:
      return packed_rows_avx512<2>(ar, a.stride, panel, K, cr, ldc, m0, m1);
    case 1:
      return packed_rows_avx512<1>(ar, a.stride, panel, K, cr, ldc, m0, m1);
    default:
      return;
  }
}

// AVX2: MR rows x 32 columns in 4 x MR ymm accumulators.
template <int MR>
__attribute__((target("avx2,fma"))) inline void packed_rows_avx2(const float* a, index_t lda,
                                                                 const float* panel, index_t K,
                                                                 float* c, index_t ldc,
                                                                 index_t cols) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_ps();
  for (index_t k = 0; k < K; ++k) {
    const float* w = panel + k * 32;
    const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
    const __m256 w2 = _mm256_load_ps(w + 16), w3 = _mm256_load_ps(w + 24);
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
      acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(x, w2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(x, w3, acc[i][3]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (cols == 32) {
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(c + i * ldc + 8 * q, acc[i][q]);
    } else {
      alignas(32) float row[32];
      for (int q = 0; q < 4; ++q) _mm256_store_ps(row + 8 * q, acc[i][q]);
      std::copy_n(row, cols, c + i * ldc);
    }
  }
}

__attribute__((target("avx2,fma"))) inline void packed_panel_avx2(matrix_view<const float> a,
                                                                  const float* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  index_t cols) {
  index_t i = 0;
  for (; i + 3 <= a.rows; i += 3)
    packed_rows_avx2<3>(a.row(i), a.stride, panel, K, c + i * ldc, ldc, cols);
  const float* ar = a.row(std::min(i, a.rows));
  float* cr = c + i * ldc;
  if (a.rows - i == 2) packed_rows_avx2<2>(ar, a.stride, panel, K, cr, ldc, cols);
  if (a.rows - i == 1) packed_rows_avx2<1>(ar, a.stride, panel, K, cr, ldc, cols);
}
#endif

}  // namespace detail

/// c[M, N] = a[M, K] bᵀ for b packed, over panels [p0, p1) (c's columns [32 p0, 32 p1) ∩
/// [0, N)), on `path` (which the CPU must run: cpu_runs). Each panel is read once for all of
/// a's rows; a split of the panels over threads shares nothing.
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           index_t p0, index_t p1, cpu_path path = best_cpu_path()) {
  const index_t K = b.cols(), N = b.rows();
  for (index_t p = p0; p < p1; ++p) {
    const index_t j0 = p * packed_nt::panel_cols;
    const index_t cols = std::min(packed_nt::panel_cols, N - j0);
    float* cp = c.data + j0;
#if defined(EPMOE_HOST_PACKED_X86)
    if (path == cpu_path::avx512) {
      detail::packed_panel_avx512(a, b.panel(p), K, cp, c.stride, cols);
      continue;
    }
    if (path == cpu_path::avx2) {
      detail::packed_panel_avx2(a, b.panel(p), K, cp, c.stride, cols);
      continue;
    }
#endif
    detail::packed_panel_portable(a, b.panel(p), K, cp, c.stride, cols);
  }
}

/// Every panel.
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           cpu_path path = best_cpu_path()) {
  gemm_nt_packed(a, b, c, 0, b.panels(), path);
}

}  // namespace epmoe::space
