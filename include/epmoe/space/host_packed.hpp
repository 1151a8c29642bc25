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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "epmoe/core/options.hpp"
#include "epmoe/core/view.hpp"

// The micro-kernels' loops over their MR rows unrolled before GCC places the accumulators
// (else it keeps a copy of them in memory, stored on every k).
#if defined(__clang__)
#define EPMOE_PACKED_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__CUDACC__)
#define EPMOE_PACKED_UNROLL _Pragma("GCC unroll 16")
#else
#define EPMOE_PACKED_UNROLL
#endif

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

/// fp32 -> bf16 bits, rounded to nearest even (NaN stays NaN).
inline std::uint16_t bf16_bits(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
/// bf16 bits -> fp32 (exact).
inline float bf16_value(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t{h} << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
/// v rounded to bf16, as fp32: what a bf16 packed weight holds.
inline float bf16_rounded(float v) { return bf16_value(bf16_bits(v)); }

/// b [N, K] packed for c = a bᵀ: panel p holds columns [32p, 32p + 32) as K rows of 32
/// elements (columns past N zero), 64-byte aligned; elements fp32, or bf16 (packed_precision:
/// half the bytes to read, values rounded to nearest even, products and sums in fp32). Built
/// once; repack() refills it in place (new values of the same shape and precision: a training
/// step) without allocating.
class packed_nt {
 public:
  static constexpr index_t panel_cols = 32;

  packed_nt() = default;
  explicit packed_nt(matrix_view<const float> b, packed_precision as = packed_precision::fp32) {
    repack(b, as);
  }

  /// Packs b, allocating only when its shape or precision differs from the last one.
  void repack(matrix_view<const float> b, packed_precision as = packed_precision::fp32) {
    if (b.rows != n_ || b.cols != k_ || as != as_ || !data_) {
      n_ = b.rows, k_ = b.cols, as_ = as;
      data_.reset(static_cast<std::byte*>(
          ::operator new[](std::max<std::size_t>(static_cast<std::size_t>(packed_bytes()), 1),
                           std::align_val_t{64})));
    }
    if (as_ == packed_precision::bf16)
      fill<std::uint16_t>(b, bf16_bits);
    else
      fill<float>(b, [](float v) { return v; });
  }

  index_t rows() const { return n_; }  // N: output columns of c
  index_t cols() const { return k_; }  // K
  packed_precision precision() const { return as_; }
  index_t panels() const { return (n_ + panel_cols - 1) / panel_cols; }
  /// Panel p's elements (E: float for fp32, std::uint16_t for bf16).
  template <class E>
  const E* panel(index_t p) const {
    return reinterpret_cast<const E*>(data_.get()) + p * k_ * panel_cols;
  }
  /// Bytes of the panels (weights and zero padding): what one pass reads.
  index_t packed_bytes() const {
    return panels() * k_ * panel_cols * (as_ == packed_precision::bf16 ? 2 : 4);
  }

 private:
  template <class E, class Convert>
  void fill(matrix_view<const float> b, Convert convert) {
    for (index_t p = 0; p < panels(); ++p) {
      E* out = reinterpret_cast<E*>(data_.get()) + p * k_ * panel_cols;
      const index_t j0 = p * panel_cols, cols = std::min(panel_cols, n_ - j0);
      for (index_t k = 0; k < k_; ++k) {
        E* row = out + k * panel_cols;
        for (index_t j = 0; j < cols; ++j) row[j] = convert(b(j0 + j, k));
        for (index_t j = cols; j < panel_cols; ++j) row[j] = E{};
      }
    }
  }
  struct aligned_delete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte, aligned_delete> data_;
  index_t n_ = 0, k_ = 0;
  packed_precision as_ = packed_precision::fp32;
};

namespace detail {

// c rows [0, m) x columns [0, cols) of one panel, portable: a row of 32 accumulators per row
// of a (the compiler vectorises the inner loop).
// An element of a panel as fp32.
inline float panel_value(float v) { return v; }
inline float panel_value(std::uint16_t v) { return bf16_value(v); }

template <class E>
inline void packed_panel_portable(matrix_view<const float> a, const E* panel, index_t K, float* c,
                                  index_t ldc, index_t cols) {
  constexpr index_t W = packed_nt::panel_cols;
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const float v = x[k];
      const E* w = panel + k * W;
      for (index_t j = 0; j < W; ++j) acc[j] += v * panel_value(w[j]);
    }
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j];
  }
}

#if defined(EPMOE_HOST_PACKED_X86)
// MR rows of a times one panel: 2 x MR zmm accumulators (MR <= 12: 24 of the 32 registers);
// per k two panel loads and MR broadcasts (the rows' k-th values), 2 MR FMAs. More rows per
// block read the panel (from L2) fewer times per row.
// 16 elements of a panel as fp32: bf16 widened by a shift (AVX-512F alone).
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const float* p) {
  return _mm512_load_ps(p);
}
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const std::uint16_t* p) {
  const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  // The maskz forms: GCC 12 warns about the unmasked ones' _mm512_undefined_epi32().
  const __m512i w = _mm512_maskz_cvtepu16_epi32(0xFFFF, h);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w, 16));
}

template <int MR, class E>
__attribute__((target("avx512f"))) inline void packed_rows_avx512(const float* a, index_t lda,
                                                                  const E* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t k = 0; k < K; ++k) {
    const __m512 w0 = load16(panel + k * 32), w1 = load16(panel + k * 32 + 16);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(x, w0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, w1, hi[i]);
    }
  }
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, m0, lo[i]);
    _mm512_mask_storeu_ps(c + i * ldc + 16, m1, hi[i]);
  }
}

// Calls f.template operator()<MR>() for a block of `rows` rows (1 <= rows <= Max).
template <int Max, class F, int MR = 1>
inline void with_rows(index_t rows, F&& f) {
  if constexpr (MR < Max) {
    if (rows != MR) return with_rows<Max, F, MR + 1>(rows, std::forward<F>(f));
  }
  f.template operator()<MR>();
}

// Row blocks of at most Max rows, as even as possible (32 rows: 11 + 11 + 10, not 12 + 12 +
// 8): calls f(first row, rows) for each.
template <int Max, class F>
inline void row_blocks(index_t M, F&& f) {
  const index_t blocks = (M + Max - 1) / Max;
  for (index_t b = 0, i = 0; b < blocks; ++b) {
    const index_t n = (M - i) / (blocks - b);
    f(i, n);
    i += n;
  }
}

template <class E>
__attribute__((target("avx512f"))) inline void packed_panel_avx512(matrix_view<const float> a,
                                                                   const E* panel, index_t K,
                                                                   float* c, index_t ldc,
                                                                   index_t cols) {
  const auto mask = [](index_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  };
  const __mmask16 m0 = mask(cols), m1 = mask(cols - 16);
  row_blocks<12>(a.rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      packed_rows_avx512<MR, E>(a.row(i), a.stride, panel, K, c + i * ldc, ldc, m0, m1);
    });
  });
}

// AVX2: MR rows x one half (16 columns) of a panel in 2 x MR ymm accumulators (MR <= 6: 12
// of the 16 registers, the two weight vectors and the broadcast in the others).
// 8 elements of a panel as fp32.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const float* p) {
  return _mm256_load_ps(p);
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const std::uint16_t* p) {
  const __m128i h = _mm_load_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int MR, class E>
__attribute__((target("avx2,fma"))) inline void packed_rows_avx2(const float* a, index_t lda,
                                                                 const E* half, index_t K, float* c,
                                                                 index_t ldc, index_t cols) {
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (index_t k = 0; k < K; ++k) {
    const __m256 w0 = load8(half + k * 32), w1 = load8(half + k * 32 + 8);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
      lo[i] = _mm256_fmadd_ps(x, w0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, w1, hi[i]);
    }
  }
  // Masked stores, no branch: with one, GCC keeps the accumulators in memory.
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lanes);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lanes);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm256_maskstore_ps(c + i * ldc, m0, lo[i]);
    _mm256_maskstore_ps(c + i * ldc + 8, m1, hi[i]);
  }
}

template <class E>
__attribute__((target("avx2,fma"))) inline void packed_panel_avx2(matrix_view<const float> a,
                                                                  const E* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  index_t cols) {
  for (index_t h = 0; h < 2 && 16 * h < cols; ++h) {
    const index_t n = std::min<index_t>(16, cols - 16 * h);
    row_blocks<6>(a.rows, [&](index_t i, index_t m) {
      with_rows<6>(m, [&]<int MR>() {
        packed_rows_avx2<MR, E>(a.row(i), a.stride, panel + 16 * h, K, c + i * ldc + 16 * h, ldc,
                                n);
      });
    });
  }
}
#endif

}  // namespace detail

/// Rows of a per pass over the panels: a chunk of a (rows x K floats) stays in L2 beside the
/// panel in use, so that a is read from memory once while each panel is read M / chunk times.
inline index_t packed_row_chunk(index_t K) {
  constexpr index_t budget = 96 * 1024;  // floats: 384 KB of a 1 MB L2
  return std::max<index_t>(12, budget / std::max<index_t>(K, 1) / 12 * 12);
}

namespace detail {
// The panels [p0, p1) of b, elements E, on `path`.
template <class E>
inline void gemm_nt_panels(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           index_t p0, index_t p1, cpu_path path) {
  const index_t K = b.cols(), N = b.rows(), chunk = packed_row_chunk(K);
  for (index_t i0 = 0; i0 < a.rows; i0 += chunk) {
    const matrix_view<const float> ai = a.rows_slice(i0, std::min(chunk, a.rows - i0));
    for (index_t p = p0; p < p1; ++p) {
      const index_t j0 = p * packed_nt::panel_cols;
      const index_t cols = std::min(packed_nt::panel_cols, N - j0);
      float* cp = c.row(i0) + j0;
      const E* panel = b.panel<E>(p);
#if defined(EPMOE_HOST_PACKED_X86)
      if (path == cpu_path::avx512) {
        packed_panel_avx512(ai, panel, K, cp, c.stride, cols);
        continue;
      }
      if (path == cpu_path::avx2) {
        packed_panel_avx2(ai, panel, K, cp, c.stride, cols);
        continue;
      }
#endif
      packed_panel_portable(ai, panel, K, cp, c.stride, cols);
    }
  }
}
}  // namespace detail

/// c[M, N] = a[M, K] bᵀ for b packed, over panels [p0, p1) (c's columns [32 p0, 32 p1) ∩
/// [0, N)), on `path` (which the CPU must run: cpu_runs). Each panel is read once per chunk
/// of rows (packed_row_chunk) and used for all of them while in cache; a split of the panels
/// over threads shares nothing. Sums run over k in order: bits depend on the shapes alone.
/// bf16 panels are widened to fp32 as they load (products and sums in fp32).
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           index_t p0, index_t p1, cpu_path path = best_cpu_path()) {
  if (b.precision() == packed_precision::bf16)
    detail::gemm_nt_panels<std::uint16_t>(a, b, c, p0, p1, path);
  else
    detail::gemm_nt_panels<float>(a, b, c, p0, p1, path);
}

/// Every panel.
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           cpu_path path = best_cpu_path()) {
  gemm_nt_packed(a, b, c, 0, b.panels(), path);
}

/// Packed copies of stacked weights (an expert tensor [L, N, K]), found again by the tensor
/// they copy: the storage a layer owns when it packs its experts (moe_layer::pack_weights).
/// The copies are of the values at pack() time: weights changed in place need pack() again.
class packed_weights {
 public:
  /// Packs every matrix of w; a tensor held already (same memory and shape) is refilled in
  /// place, without allocating.
  void pack(stacked_view<const float> w, packed_precision as = packed_precision::fp32) {
    entry* e = nullptr;
    for (entry& x : entries_)
      if (same(x.source, w)) e = &x;
    if (!e) e = &entries_.emplace_back(entry{w, std::vector<packed_nt>(std::size_t(w.count))});
    for (index_t j = 0; j < w.count; ++j) e->mats[std::size_t(j)].repack(w[j], as);
  }
  /// The packed matrices of w (w may be a slice of a packed tensor: experts [j, j + n)), or
  /// nullptr when w is not packed here.
  const packed_nt* find(stacked_view<const float> w) const {
    for (const entry& x : entries_) {
      const stacked_view<const float>& s = x.source;
      if (w.rows != s.rows || w.cols != s.cols || w.stride != s.stride || w.count < 1 ||
          (w.count > 1 && w.batch_stride != s.batch_stride))
        continue;
      const auto at = reinterpret_cast<std::uintptr_t>(w.data);
      const auto base = reinterpret_cast<std::uintptr_t>(s.data);
      if (at < base || (at - base) % sizeof(float)) continue;
      const auto offset = static_cast<index_t>((at - base) / sizeof(float));
      const index_t j = s.batch_stride > 0 ? offset / s.batch_stride : 0;
      if (j * s.batch_stride == offset && j + w.count <= s.count) return &x.mats[std::size_t(j)];
    }
    return nullptr;
  }
  /// Holds exactly the tensors of `all`, packed: those held already are refilled in place,
  /// the others dropped (a layer that rebound its weights).
  void pack_only(std::span<const stacked_view<const float>> all,
                 packed_precision as = packed_precision::fp32) {
    std::erase_if(entries_, [&](const entry& x) {
      return std::none_of(all.begin(), all.end(), [&](const auto& w) { return same(x.source, w); });
    });
    for (const auto& w : all) pack(w, as);
  }
  void clear() { entries_.clear(); }
  bool empty() const { return entries_.empty(); }
  /// Bytes of the packed copies (what packing adds to the weights' memory).
  index_t bytes() const {
    index_t n = 0;
    for (const entry& x : entries_)
      for (const packed_nt& m : x.mats) n += m.packed_bytes();
    return n;
  }

 private:
  struct entry {
    stacked_view<const float> source;
    std::vector<packed_nt> mats;
  };
  static bool same(const stacked_view<const float>& a, const stacked_view<const float>& b) {
    return a.data == b.data && a.count == b.count && a.rows == b.rows && a.cols == b.cols &&
           a.stride == b.stride && a.batch_stride == b.batch_stride;
  }
  std::vector<entry> entries_;
};

}  // namespace epmoe::space
