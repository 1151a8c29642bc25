// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The micro-kernels of the packed GEMM (host_packed.hpp), one per instruction set: AVX-512
// (12 rows x 32 columns in 24 registers), AVX2+FMA (6 x 16 in 12), a portable loop, and for
// bf16 panels AVX512-BF16 dot products (12 x 32, two k per instruction); the CPU's paths,
// chosen at run time, and the bf16 conversions they share.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

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

/// Rows of a converted once for a kernel that multiplies narrow inputs, row i at data + i *
/// stride: bf16 pairs for AVX512-BF16 (two per 32-bit word, element k even in the low half, a
/// last odd one beside a zero), or u8 quads for int8 VNNI (four per word, with a scale per
/// row: host_int8.hpp).
struct converted_rows {
  const std::uint32_t* data = nullptr;
  index_t stride = 0;             // words: at least ceil(K / 2) (pairs), ceil(K / 4) (quads)
  const float* scales = nullptr;  // u8 quads: row i's scale at scales[i]
};

namespace detail {

// Columns per panel (packed_nt::panel_cols, host_packed.hpp): the micro-kernels' width.
inline constexpr index_t panel_width = 32;

// An element of a panel as fp32.
inline float panel_value(float v) { return v; }
inline float panel_value(std::uint16_t v) { return bf16_value(v); }

// c rows [0, m) x columns [0, cols) of one panel, portable: a row of 32 accumulators per row
// of a (the compiler vectorises the inner loop).
template <class E>
inline void packed_panel_portable(matrix_view<const float> a, const E* panel, index_t K, float* c,
                                  index_t ldc, index_t cols) {
  constexpr index_t W = panel_width;
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
    converted_rows a, index_t rows, const std::uint16_t* panel, index_t K, float* c, index_t ldc,
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

}  // namespace epmoe::space
