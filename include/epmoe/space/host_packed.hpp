// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A GEMM for any number of rows over weights packed once (issue 22): c = a bᵀ with b (an
// expert's [out, in] weight) stored as panels of 32 output columns, K-major, so that every
// panel is read from memory once and used for all of a's rows while it sits in cache. sgemm
// packs b on every call, which dominates when a has 16-256 rows (an expert's share of a
// decode batch); the streaming kernel (host_gemm.hpp) re-reads a for every 4 columns.
// Micro-kernels: AVX-512 (12 rows x 32 columns in 24 registers), AVX2+FMA (6 x 16 in 12), a
// portable loop, and for bf16 panels AVX512-BF16 dot products (12 x 32, two k per
// instruction), chosen at run time from what the CPU has.

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

/// The kernels a CPU can run, best last. avx512_bf16 differs from avx512 for bf16 panels
/// only: dot products of bf16 pairs (the rows of a rounded to bf16 too), twice the FLOPs
/// per instruction of the widening path.
enum class cpu_path { portable, avx2, avx512, avx512_bf16 };

inline const char* name_of(cpu_path p) {
  switch (p) {
    case cpu_path::avx512_bf16:
      return "AVX512-BF16";
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
    case cpu_path::avx512_bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
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
  static const cpu_path best = cpu_runs(cpu_path::avx512_bf16) ? cpu_path::avx512_bf16
                               : cpu_runs(cpu_path::avx512)    ? cpu_path::avx512
                               : cpu_runs(cpu_path::avx2)      ? cpu_path::avx2
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

/// b [N, K] packed for c = a bᵀ: panel p holds columns [32p, 32p + 32) (columns past N
/// zero), 64-byte aligned. fp32: K rows of 32 elements. bf16 (packed_precision: half the bytes
/// to read, values rounded to nearest even): ceil(K / 2) rows of 32 pairs, column j's
/// elements k and k + 1 side by side (k even; past K zero), the layout of AVX512-BF16's pair
/// dot products, which the other paths widen with a shift and a mask. Built once; repack()
/// refills it in place (new values of the same shape and precision: a training step) without
/// allocating.
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
    return reinterpret_cast<const E*>(data_.get()) + p * panel_elements();
  }
  /// Bytes of the panels (weights and zero padding): what one pass reads.
  index_t packed_bytes() const {
    return panels() * panel_elements() * (as_ == packed_precision::bf16 ? 2 : 4);
  }

 private:
  index_t panel_elements() const {
    return as_ == packed_precision::bf16 ? (k_ + 1) / 2 * 2 * panel_cols : k_ * panel_cols;
  }
  template <class E, class Convert>
  void fill(matrix_view<const float> b, Convert convert) {
    // Element (k, j) of a panel: fp32 at k * 32 + j; bf16 at (k / 2) * 64 + 2 j + k % 2.
    const bool pairs = as_ == packed_precision::bf16;
    for (index_t p = 0; p < panels(); ++p) {
      E* out = reinterpret_cast<E*>(data_.get()) + p * panel_elements();
      std::fill_n(out, panel_elements(), E{});
      const index_t j0 = p * panel_cols, cols = std::min(panel_cols, n_ - j0);
      for (index_t k = 0; k < k_; ++k) {
        E* row = pairs ? out + k / 2 * 2 * panel_cols + k % 2 : out + k * panel_cols;
        const index_t step = pairs ? 2 : 1;
        for (index_t j = 0; j < cols; ++j) row[j * step] = convert(b(j0 + j, k));
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

/// Rows of a rounded to bf16, two per 32-bit word (element k even in the low half, a last odd
/// one beside a zero): the input of the AVX512-BF16 path, row i at data + i * stride.
struct bf16_pairs {
  const std::uint32_t* data = nullptr;
  index_t stride = 0;  // words: at least ceil(K / 2)
};

namespace detail {

// An element of a panel as fp32.
inline float panel_value(float v) { return v; }
inline float panel_value(std::uint16_t v) { return bf16_value(v); }

// c rows [0, m) x columns [0, cols) of one panel, portable: a row of 32 accumulators per row
// of a (the compiler vectorises the inner loop).
template <class E>
inline void packed_panel_portable(matrix_view<const float> a, const E* panel, index_t K, float* c,
                                  index_t ldc, index_t cols) {
  constexpr index_t W = packed_nt::panel_cols;
  constexpr bool pairs = sizeof(E) == 2;  // bf16: (k / 2) * 64 + 2 j + k % 2
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const float v = x[k];
      const E* w = pairs ? panel + k / 2 * 2 * W + k % 2 : panel + k * W;
      for (index_t j = 0; j < W; ++j) acc[j] += v * panel_value(w[pairs ? 2 * j : j]);
    }
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j];
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

#if defined(EPMOE_HOST_PACKED_X86)
// The micro-kernels' epilogue: MR rows of 32 (AVX-512) or 16 (AVX2) columns into c, masked
// to the panel's columns. Branch-free: with a branch, GCC keeps the accumulators in memory.
template <int MR>
__attribute__((target("avx512f"), always_inline)) inline void store_rows_avx512(
    float* c, index_t ldc, __mmask16 m0, __mmask16 m1, const __m512 (&lo)[MR],
    const __m512 (&hi)[MR]) {
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, m0, lo[i]);
    _mm512_mask_storeu_ps(c + i * ldc + 16, m1, hi[i]);
  }
}
template <int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void store_rows_avx2(
    float* c, index_t ldc, index_t cols, const __m256 (&lo)[MR], const __m256 (&hi)[MR]) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lanes);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lanes);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm256_maskstore_ps(c + i * ldc, m0, lo[i]);
    _mm256_maskstore_ps(c + i * ldc + 8, m1, hi[i]);
  }
}

// MR rows of a times one panel: 2 x MR zmm accumulators (MR <= 12: 24 of the 32 registers);
// per k two panel loads and MR broadcasts (the rows' k-th values), 2 MR FMAs. More rows per
// block read the panel (from L2) fewer times per row.
template <int MR>
__attribute__((target("avx512f"))) inline void packed_rows_avx512(const float* a, index_t lda,
                                                                  const float* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_load_ps(panel + k * 32), w1 = _mm512_load_ps(panel + k * 32 + 16);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(x, w0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, w1, hi[i]);
    }
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

// The same over bf16 pairs, widened in registers: a word holds (k, k + 1) of one column, so
// a shift gives element k and a mask element k + 1 (4 integer ops per 2 k and 32 columns).
// The maskz forms: GCC 12 warns about the unmasked ones' _mm512_undefined_epi32().
__attribute__((target("avx512f"), always_inline)) inline __m512 even16(__m512i w) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w, 16));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 odd16(__m512i w) {
  return _mm512_castsi512_ps(_mm512_maskz_and_epi32(0xFFFF, w, _mm512_set1_epi32(-65536)));
}

// One pair word (k, k + 1) of 32 columns into MR rows' accumulators (both: k + 1 < K).
template <int MR>
__attribute__((target("avx512f"), always_inline)) inline void widen_pair_avx512(
    const float* a, index_t lda, const std::uint16_t* pair, index_t k, bool both, __m512 (&lo)[MR],
    __m512 (&hi)[MR]) {
  const __m512i p0 = _mm512_load_si512(pair), p1 = _mm512_load_si512(pair + 32);
  const __m512 e0 = even16(p0), e1 = even16(p1);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 x = _mm512_set1_ps(a[i * lda + k]);
    lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
  }
  if (!both) return;
  const __m512 o0 = odd16(p0), o1 = odd16(p1);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 x = _mm512_set1_ps(a[i * lda + k + 1]);
    lo[i] = _mm512_fmadd_ps(x, o0, lo[i]);
    hi[i] = _mm512_fmadd_ps(x, o1, hi[i]);
  }
}

template <int MR>
__attribute__((target("avx512f"))) inline void packed_rows_avx512(const float* a, index_t lda,
                                                                  const std::uint16_t* panel,
                                                                  index_t K, float* c, index_t ldc,
                                                                  __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t k = 0; k + 1 < K; k += 2)
    widen_pair_avx512<MR>(a, lda, panel + k * 32, k, true, lo, hi);
  if (K % 2) widen_pair_avx512<MR>(a, lda, panel + (K - 1) * 32, K - 1, false, lo, hi);
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

// AVX512-BF16: per pair of k, two panel loads, MR broadcasts of a row's (k, k + 1) pair, and
// 2 MR dot products that each add both products: twice the FMA path's FLOPs per instruction.
template <int MR>
__attribute__((target("avx512f,avx512bf16"))) inline void packed_rows_bf16dot(
    const std::uint32_t* a, index_t lda, const std::uint16_t* panel, index_t pairs, float* c,
    index_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t k = 0; k < pairs; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(panel + k * 64);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(panel + k * 64 + 32);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + k]));
      lo[i] = _mm512_dpbf16_ps(lo[i], x, w0);
      hi[i] = _mm512_dpbf16_ps(hi[i], x, w1);
    }
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

inline __mmask16 column_mask(index_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
}

template <class E>
__attribute__((target("avx512f"))) inline void packed_panel_avx512(matrix_view<const float> a,
                                                                   const E* panel, index_t K,
                                                                   float* c, index_t ldc,
                                                                   index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  row_blocks<12>(a.rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      packed_rows_avx512<MR>(a.row(i), a.stride, panel, K, c + i * ldc, ldc, m0, m1);
    });
  });
}

__attribute__((target("avx512f,avx512bf16"))) inline void packed_panel_bf16dot(
    bf16_pairs a, index_t rows, const std::uint16_t* panel, index_t K, float* c, index_t ldc,
    index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  row_blocks<12>(rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      packed_rows_bf16dot<MR>(a.data + i * a.stride, a.stride, panel, (K + 1) / 2, c + i * ldc, ldc,
                              m0, m1);
    });
  });
}

__attribute__((target("avx512f,avx512bf16"))) inline void to_bf16_pairs_avx512(const float* x,
                                                                               index_t K,
                                                                               std::uint32_t* out) {
  index_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
    _mm512_storeu_si512(out + k / 2, (__m512i)h);
  }
  for (; k < K; k += 2)
    out[k / 2] = bf16_bits(x[k]) | (k + 1 < K ? std::uint32_t{bf16_bits(x[k + 1])} << 16 : 0u);
}

// AVX2: MR rows x one half (16 columns) of a panel in 2 x MR ymm accumulators (MR <= 6: 12
// of the 16 registers, the two weight vectors and the broadcast in the others).
template <int MR>
__attribute__((target("avx2,fma"))) inline void packed_rows_avx2(const float* a, index_t lda,
                                                                 const float* half, index_t K,
                                                                 float* c, index_t ldc,
                                                                 index_t cols) {
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (index_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(half + k * 32), w1 = _mm256_load_ps(half + k * 32 + 8);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
      lo[i] = _mm256_fmadd_ps(x, w0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, w1, hi[i]);
    }
  }
  store_rows_avx2<MR>(c, ldc, cols, lo, hi);
}

// The same over bf16 pairs (pair: a half's 16 columns of one pair word), widened by shift
// and mask.
template <int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void widen_pair_avx2(
    const float* a, index_t lda, const std::uint16_t* pair, index_t k, bool both, __m256 (&lo)[MR],
    __m256 (&hi)[MR]) {
  const __m256i p0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pair));
  const __m256i p1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pair + 16));
  const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));
  const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
    lo[i] = _mm256_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm256_fmadd_ps(x, e1, hi[i]);
  }
  if (!both) return;
  const __m256i high = _mm256_set1_epi32(-65536);
  const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high));
  const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high));
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m256 x = _mm256_broadcast_ss(a + i * lda + k + 1);
    lo[i] = _mm256_fmadd_ps(x, o0, lo[i]);
    hi[i] = _mm256_fmadd_ps(x, o1, hi[i]);
  }
}

template <int MR>
__attribute__((target("avx2,fma"))) inline void packed_rows_avx2(const float* a, index_t lda,
                                                                 const std::uint16_t* half,
                                                                 index_t K, float* c, index_t ldc,
                                                                 index_t cols) {
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (index_t k = 0; k + 1 < K; k += 2)
    widen_pair_avx2<MR>(a, lda, half + k * 32, k, true, lo, hi);
  if (K % 2) widen_pair_avx2<MR>(a, lda, half + (K - 1) * 32, K - 1, false, lo, hi);
  store_rows_avx2<MR>(c, ldc, cols, lo, hi);
}

template <class E>
__attribute__((target("avx2,fma"))) inline void packed_panel_avx2(matrix_view<const float> a,
                                                                  const E* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  index_t cols) {
  // Half h starts at column 16 h: element 16 h of an fp32 row, word 16 h (element 32 h) of a
  // bf16 pair row.
  for (index_t h = 0; h < 2 && 16 * h < cols; ++h) {
    const index_t n = std::min<index_t>(16, cols - 16 * h);
    row_blocks<6>(a.rows, [&](index_t i, index_t m) {
      with_rows<6>(m, [&]<int MR>() {
        packed_rows_avx2<MR>(a.row(i), a.stride, panel + 16 * h * (sizeof(E) == 2 ? 2 : 1), K,
                             c + i * ldc + 16 * h, ldc, n);
      });
    });
  }
}
#endif

}  // namespace detail

/// a's rows as bf16 pairs into out (row stride `stride` words, at least ceil(K / 2)),
/// rounded to nearest even; on `path` avx512_bf16 with its conversion instruction (which also
/// flushes subnormals to zero).
inline void to_bf16_pairs(matrix_view<const float> a, std::uint32_t* out, index_t stride,
                          cpu_path path = best_cpu_path()) {
  for (index_t i = 0; i < a.rows; ++i) {
    const float* x = a.row(i);
    std::uint32_t* o = out + i * stride;
#if defined(EPMOE_HOST_PACKED_X86)
    if (path == cpu_path::avx512_bf16) {
      detail::to_bf16_pairs_avx512(x, a.cols, o);
      continue;
    }
#endif
    for (index_t k = 0; k < a.cols; k += 2)
      o[k / 2] = bf16_bits(x[k]) | (k + 1 < a.cols ? std::uint32_t{bf16_bits(x[k + 1])} << 16 : 0u);
  }
}

/// Rows of a per pass over the panels: a chunk of a (rows x K floats) stays in L2 beside the
/// panel in use, so that a is read from memory once while each panel is read M / chunk times.
inline index_t packed_row_chunk(index_t K) {
  constexpr index_t budget = 96 * 1024;  // floats: 384 KB of a 1 MB L2
  return std::max<index_t>(12, budget / std::max<index_t>(K, 1) / 12 * 12);
}

namespace detail {
// The panels [p0, p1) of b, elements E, on `path` (a16: a as bf16 pairs, for avx512_bf16).
template <class E>
inline void gemm_nt_panels(matrix_view<const float> a, bf16_pairs a16, const packed_nt& b,
                           matrix_view<float> c, index_t p0, index_t p1, cpu_path path) {
  const index_t K = b.cols(), N = b.rows(), chunk = packed_row_chunk(K);
  for (index_t i0 = 0; i0 < a.rows; i0 += chunk) {
    const matrix_view<const float> ai = a.rows_slice(i0, std::min(chunk, a.rows - i0));
    for (index_t p = p0; p < p1; ++p) {
      const index_t j0 = p * packed_nt::panel_cols;
      const index_t cols = std::min(packed_nt::panel_cols, N - j0);
      float* cp = c.row(i0) + j0;
      const E* panel = b.panel<E>(p);
#if defined(EPMOE_HOST_PACKED_X86)
      if constexpr (sizeof(E) == 2) {
        if (path == cpu_path::avx512_bf16) {
          packed_panel_bf16dot({a16.data + i0 * a16.stride, a16.stride}, ai.rows, panel, K, cp,
                               c.stride, cols);
          continue;
        }
      }
      if (path == cpu_path::avx512 || path == cpu_path::avx512_bf16) {
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

/// Whether gemm_nt_packed over b on `path` reads a as bf16 pairs (to_bf16_pairs): bf16
/// panels on AVX512-BF16, whose dot products take bf16 on both sides.
inline bool packed_reads_bf16_pairs(const packed_nt& b, cpu_path path) {
  return path == cpu_path::avx512_bf16 && b.precision() == packed_precision::bf16;
}

/// c[M, N] = a[M, K] bᵀ for b packed, over panels [p0, p1) (c's columns [32 p0, 32 p1) ∩
/// [0, N)), on `path` (which the CPU must run: cpu_runs). Each panel is read once per chunk
/// of rows (packed_row_chunk) and used for all of them while in cache; a split of the panels
/// over threads shares nothing. Sums run over k in order: bits depend on the shapes alone.
/// bf16 panels are widened to fp32 as they load (products and sums in fp32), or on
/// AVX512-BF16 multiplied with a16, a rounded to bf16 (packed_reads_bf16_pairs: products of
/// two bf16 exact in fp32, sums in fp32).
inline void gemm_nt_packed(matrix_view<const float> a, bf16_pairs a16, const packed_nt& b,
                           matrix_view<float> c, index_t p0, index_t p1,
                           cpu_path path = best_cpu_path()) {
  if (b.precision() == packed_precision::bf16)
    detail::gemm_nt_panels<std::uint16_t>(a, a16, b, c, p0, p1, path);
  else
    detail::gemm_nt_panels<float>(a, a16, b, c, p0, p1, path);
}

/// The same, rounding a to bf16 pairs itself where the path reads them (into memory it
/// allocates: the space converts once into storage packed_weights holds).
inline void gemm_nt_packed(matrix_view<const float> a, const packed_nt& b, matrix_view<float> c,
                           index_t p0, index_t p1, cpu_path path = best_cpu_path()) {
  std::vector<std::uint32_t> pairs;
  bf16_pairs a16;
  if (packed_reads_bf16_pairs(b, path)) {
    a16.stride = (a.cols + 1) / 2;
    pairs.resize(static_cast<std::size_t>(a.rows * a16.stride));
    to_bf16_pairs(a, pairs.data(), a16.stride, path);
    a16.data = pairs.data();
  }
  gemm_nt_packed(a, a16, b, c, p0, p1, path);
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
  void clear() {
    entries_.clear();
    pairs_ = {};
  }
  bool empty() const { return entries_.empty(); }

  /// Room for `rows` rows of the widest input of the packed tensors as bf16 pairs (the
  /// AVX512-BF16 path's converted activations): sized when the layer packs, so that its
  /// passes do not allocate.
  void reserve_inputs(index_t rows) {
    index_t k = 0;
    for (const entry& x : entries_) k = std::max(k, x.source.cols);
    input_pairs(rows, k);
  }
  /// That room for rows x K inputs (grown when it is short: a caller that did not reserve).
  std::uint32_t* input_pairs(index_t rows, index_t K) const {
    const auto n = static_cast<std::size_t>(rows * ((K + 1) / 2));
    if (pairs_.size() < n) pairs_.resize(n);
    return pairs_.data();
  }
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
  mutable std::vector<std::uint32_t> pairs_;  // scratch of the pass that reads these copies
};

}  // namespace epmoe::space
