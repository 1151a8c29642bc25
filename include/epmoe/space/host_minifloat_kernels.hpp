// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The micro-kernels the minifloat formats (fp8_block in host_fp8.hpp, mxfp4 in host_mxfp4.hpp)
// share: which one runs (minifloat_kernel), and the row loops over a panel whose pairs a
// format's `convert` turns into bf16 pairs in registers (convert(p, w0, w1): pair p's columns
// 0..15 and 16..31; convert.scales(block, s0, s1): the block's scale per column) — as bf16
// dot products on AVX512-BF16, or as fp32 FMAs of the words widened by a shift or a mask.

#include <algorithm>
#include <cstdint>

#include "epmoe/core/view.hpp"
#include "epmoe/space/host_packed_kernels.hpp"

namespace epmoe::space {

/// The kernels of the minifloat formats (fp8_block, mxfp4), best last: weights converted to
/// fp32 in registers and multiplied with fp32 tokens (portable, AVX2+FMA+F16C, AVX-512: by
/// shifts and vcvtph2ps; AVX512-VBMI: by the bf16 kernel's byte lookups, then a shift or a
/// mask), or to bf16 and multiplied with the tokens as bf16 pairs (AVX512-BF16 with VBMI).
enum class minifloat_kernel { portable, avx2, avx512, avx512_vbmi, avx512_bf16 };

inline const char* name_of(minifloat_kernel k) {
  switch (k) {
    case minifloat_kernel::avx512_bf16:
      return "AVX512-BF16 (bf16 dot products)";
    case minifloat_kernel::avx512_vbmi:
      return "AVX512-VBMI (bf16 lookups, fp32 FMA)";
    case minifloat_kernel::avx512:
      return "AVX-512 (fp32 FMA)";
    case minifloat_kernel::avx2:
      return "AVX2+FMA (fp32 FMA)";
    default:
      return "portable (fp32)";
  }
}

inline bool cpu_runs(minifloat_kernel k) {
#if defined(EPMOE_HOST_PACKED_X86)
  // (asked once: every GEMM chooses its kernel)
  static const bool vbmi = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vbmi");
  static const bool bf16 = vbmi && __builtin_cpu_supports("avx512bf16");
  if (k == minifloat_kernel::avx512_bf16) return bf16;
  if (k == minifloat_kernel::avx512_vbmi) return vbmi;
  if (k == minifloat_kernel::avx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (k == minifloat_kernel::avx2)
    return cpu_runs(cpu_path::avx2) && __builtin_cpu_supports("f16c");
#endif
  return k == minifloat_kernel::portable;
}

/// The minifloat kernel of a float path: the best one the path allows that the CPU runs
/// (avx512_bf16 only on the AVX512-BF16 path, whose tokens are bf16 pairs).
inline minifloat_kernel minifloat_kernel_for(cpu_path p) {
  using k = minifloat_kernel;
  for (const k c : {k::avx512_bf16, k::avx512_vbmi, k::avx512, k::avx2})
    if (cpu_runs(c) && (c == k::avx512_bf16 ? p == cpu_path::avx512_bf16
                        : c == k::avx2      ? p >= cpu_path::avx2
                                            : p >= cpu_path::avx512))
      return c;
  return k::portable;
}

namespace detail {

#if defined(EPMOE_HOST_PACKED_X86)
// Bytes ahead of the pair in use that the bf16 kernels prefetch: the few instructions per
// byte leave the hardware prefetcher behind (a pass read 15-25% of the bandwidth without).
#ifndef EPMOE_MINIFLOAT_PREFETCH
#define EPMOE_MINIFLOAT_PREFETCH 1024
#endif
inline constexpr index_t minifloat_prefetch = EPMOE_MINIFLOAT_PREFETCH;

// The rows kernels' U x MR partial sums per accumulator: zeroed per block, then folded and
// times the block's scales (one per column) added to the rows' totals. Inlined into each
// kernel (AVX-512F is in every caller's target).
template <int U, int MR>
__attribute__((target("avx512f"), always_inline)) inline void zero_sums(__m512 (&lo)[U][MR],
                                                                        __m512 (&hi)[U][MR]) {
  EPMOE_PACKED_UNROLL
  for (int u = 0; u < U; ++u) {
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) lo[u][i] = hi[u][i] = _mm512_setzero_ps();
  }
}
template <int U, int MR>
__attribute__((target("avx512f"), always_inline)) inline void fold_sums(__m512 (&lo)[U][MR],
                                                                        __m512 (&hi)[U][MR],
                                                                        const __m512& s0,
                                                                        const __m512& s1,
                                                                        __m512* tlo, __m512* thi) {
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    EPMOE_PACKED_UNROLL
    for (int u = 1; u < U; ++u)
      lo[0][i] = _mm512_add_ps(lo[0][i], lo[u][i]), hi[0][i] = _mm512_add_ps(hi[0][i], hi[u][i]);
    tlo[i] = _mm512_fmadd_ps(lo[0][i], s0, tlo[i]);
    thi[i] = _mm512_fmadd_ps(hi[0][i], s1, thi[i]);
  }
}

// MR rows (<= 8) of bf16 pairs x 32 columns of a minifloat panel whose scales change every
// Block pairs: per pair, convert(p, w0, w1) makes its bf16 pairs (columns 0..15, 16..31),
// then 2 MR dot products; per block the sums times convert.scales(block) (one per column) are
// added to the totals, in registers (a masked store read back by the next block would wait
// for the store to retire, and with it every load from memory before it). Few rows keep U
// sums per accumulator, pairs taken in turn, so that 8 or more dot products are in flight.
template <int MR, index_t Block, class Convert>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) inline void minifloat_rows_bf16(
    const std::uint32_t* a, index_t lda, const Convert& convert, index_t K, float* c, index_t ldc,
    __mmask16 m0, __mmask16 m1) {
  constexpr int U = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
  const index_t pairs = (K + 1) / 2;
  __m512 tlo[MR], thi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) tlo[i] = thi[i] = _mm512_setzero_ps();
  for (index_t p0 = 0; p0 < pairs; p0 += Block) {
    __m512 lo[U][MR], hi[U][MR];
    zero_sums(lo, hi);
    const index_t p1 = std::min(pairs, p0 + Block);
    index_t p = p0;
    for (; p + U <= p1; p += U) {
      EPMOE_PACKED_UNROLL
      for (int u = 0; u < U; ++u) {
        __m512i w0, w1;
        convert(p + u, w0, w1);
        EPMOE_PACKED_UNROLL
        for (int i = 0; i < MR; ++i) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + p + u]));
          lo[u][i] = _mm512_dpbf16_ps(lo[u][i], x, (__m512bh)w0);
          hi[u][i] = _mm512_dpbf16_ps(hi[u][i], x, (__m512bh)w1);
        }
      }
    }
    for (; p < p1; ++p) {
      __m512i w0, w1;
      convert(p, w0, w1);
      EPMOE_PACKED_UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + p]));
        lo[0][i] = _mm512_dpbf16_ps(lo[0][i], x, (__m512bh)w0);
        hi[0][i] = _mm512_dpbf16_ps(hi[0][i], x, (__m512bh)w1);
      }
    }
    __m512 s0, s1;
    convert.scales(p0 / Block, s0, s1);
    fold_sums(lo, hi, s0, s1, tlo, thi);
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, tlo, thi);
}

// One block of np pairs already in bf16 (w: pair p's 32 columns at w + 64 p) times MR rows
// (<= 12) of bf16 pairs: the sums times the block's scales, added to the rows' totals (tot:
// 32 floats a row, on the stack: plain stores, which the next block's loads take at once).
// The scales by reference: the caller is a lambda, compiled without AVX-512, and a __m512 by
// value would cross two calling conventions where the call is not inlined (-Og).
template <int MR>
__attribute__((target("avx512f,avx512bf16"))) inline void minifloat_block_bf16(
    const std::uint32_t* a, index_t lda, const std::uint16_t* w, index_t np, const __m512& s0,
    const __m512& s1, float* tot) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t p = 0; p < np; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(w + 64 * p);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(w + 64 * p + 32);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + p]));
      lo[i] = _mm512_dpbf16_ps(lo[i], x, w0);
      hi[i] = _mm512_dpbf16_ps(hi[i], x, w1);
    }
  }
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    float* t = tot + 32 * i;
    _mm512_store_ps(t, _mm512_fmadd_ps(lo[i], s0, _mm512_load_ps(t)));
    _mm512_store_ps(t + 16, _mm512_fmadd_ps(hi[i], s1, _mm512_load_ps(t + 16)));
  }
}

// c rows [0, rows) x columns [0, cols) of a minifloat panel on AVX512-BF16. Up to 8 rows: each
// pair converted in registers as it is used (minifloat_rows_bf16). More: each block of pairs
// converted once into bf16 pairs on the stack for every 48 rows, then read by every 12 of them
// (else the conversion, repeated per 8 rows, costs more than the dot products).
template <index_t Block, class Convert>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) inline void minifloat_panel_bf16(
    converted_rows a, index_t rows, const Convert& convert, index_t K, float* c, index_t ldc,
    index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  if (rows <= 8) {
    with_rows<8>(rows, [&]<int MR>() {
      minifloat_rows_bf16<MR, Block>(a.data, a.stride, convert, K, c, ldc, m0, m1);
    });
    return;
  }
  constexpr index_t max_rows = 48;
  alignas(64) std::uint16_t w[Block * 64];
  alignas(64) float tot[max_rows * 32];
  const index_t pairs = (K + 1) / 2;
  for (index_t r0 = 0; r0 < rows; r0 += max_rows) {
    const index_t n = std::min(max_rows, rows - r0);
    std::fill_n(tot, n * 32, 0.f);
    for (index_t p0 = 0; p0 < pairs; p0 += Block) {
      const index_t np = std::min(pairs - p0, Block);
      for (index_t p = 0; p < np; ++p) {
        __m512i w0, w1;
        convert(p0 + p, w0, w1);
        _mm512_store_si512(w + 64 * p, w0);
        _mm512_store_si512(w + 64 * p + 32, w1);
      }
      __m512 s0, s1;
      convert.scales(p0 / Block, s0, s1);
      row_blocks<12>(n, [&](index_t i, index_t m) {
        with_rows<12>(m, [&]<int MR>() {
          minifloat_block_bf16<MR>(a.data + (r0 + i) * a.stride + p0, a.stride, w, np, s0, s1,
                                   tot + 32 * i);
        });
      });
    }
    for (index_t i = 0; i < n; ++i) {
      _mm512_mask_storeu_ps(c + (r0 + i) * ldc, m0, _mm512_load_ps(tot + 32 * i));
      _mm512_mask_storeu_ps(c + (r0 + i) * ldc + 16, m1, _mm512_load_ps(tot + 32 * i + 16));
    }
  }
}

// Pair p of a minifloat panel (convert) times MR rows of fp32 tokens, into lo/hi (columns
// 0..15, 16..31): its even inputs' fp32 (a bf16 word << 16), then, with `odd`, its odd ones'
// (the high word, masked).
template <int MR, class Convert>
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline void
minifloat_pair_fma(const float* a, index_t lda, const Convert& convert, index_t p, __m512* lo,
                   __m512* hi, bool odd) {
  __m512i w0, w1;
  convert(p, w0, w1);
  const __m512 e0 = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w0, 16));
  const __m512 e1 = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w1, 16));
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p]);
    lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
  }
  if (!odd) return;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
  const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p + 1]);
    lo[i] = _mm512_fmadd_ps(x, o0, lo[i]);
    hi[i] = _mm512_fmadd_ps(x, o1, hi[i]);
  }
}

// MR rows (<= 8) of fp32 tokens x 32 columns of a minifloat panel without AVX512-BF16: each
// pair converted to bf16 pairs as for minifloat_rows_bf16 (convert), whose dwords give the
// even input's fp32 by a shift (the low word) and the odd input's by a mask (the high word):
// exact, about 10 instructions a pair against the AVX-512 kernel's 26. Two FMAs a dword
// where AVX512-BF16 has one vdpbf16ps; the tokens stay fp32. Per block, the sums times the
// block's scales, as there.
template <int MR, index_t Block, class Convert>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline void minifloat_rows_fma(
    const float* a, index_t lda, const Convert& convert, index_t K, float* c, index_t ldc,
    __mmask16 m0, __mmask16 m1) {
  constexpr int U = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
  const index_t pairs = (K + 1) / 2, full = K / 2;  // (a has no input K when K is odd)
  __m512 tlo[MR], thi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) tlo[i] = thi[i] = _mm512_setzero_ps();
  for (index_t p0 = 0; p0 < pairs; p0 += Block) {
    __m512 lo[U][MR], hi[U][MR];
    zero_sums(lo, hi);
    const index_t p1 = std::min(full, p0 + Block);
    index_t p = p0;
    for (; p + U <= p1; p += U) {
      EPMOE_PACKED_UNROLL
      for (int u = 0; u < U; ++u)
        minifloat_pair_fma<MR>(a, lda, convert, p + u, lo[u], hi[u], true);
    }
    for (; p < p1; ++p) minifloat_pair_fma<MR>(a, lda, convert, p, lo[0], hi[0], true);
    if (full < pairs && p0 + Block >= pairs)
      minifloat_pair_fma<MR>(a, lda, convert, full, lo[0], hi[0], false);
    __m512 s0, s1;
    convert.scales(p0 / Block, s0, s1);
    fold_sums(lo, hi, s0, s1, tlo, thi);
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, tlo, thi);
}

// One block of np pairs already widened to fp32 (w: pair p's even inputs, columns 0..15 and
// 16..31, then its odd ones, at w + 64 p) times MR rows (<= 12) of fp32 tokens, the last pair
// without its odd input when `half` (K odd): the sums times the block's scales, added to the
// rows' totals (tot: 32 floats a row). Scales by reference, as minifloat_block_bf16's.
template <int MR>
__attribute__((target("avx512f"))) inline void minifloat_block_fma(const float* a, index_t lda,
                                                                   const float* w, index_t np,
                                                                   bool half, const __m512& s0,
                                                                   const __m512& s1, float* tot) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t p = 0; p < np; ++p) {
    const float* wp = w + 64 * p;
    const __m512 e0 = _mm512_load_ps(wp), e1 = _mm512_load_ps(wp + 16);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p]);
      lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
    }
    if (half && p + 1 == np) break;  // (a has no input K)
    const __m512 o0 = _mm512_load_ps(wp + 32), o1 = _mm512_load_ps(wp + 48);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p + 1]);
      lo[i] = _mm512_fmadd_ps(x, o0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, o1, hi[i]);
    }
  }
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    float* t = tot + 32 * i;
    _mm512_store_ps(t, _mm512_fmadd_ps(lo[i], s0, _mm512_load_ps(t)));
    _mm512_store_ps(t + 16, _mm512_fmadd_ps(hi[i], s1, _mm512_load_ps(t + 16)));
  }
}

// c rows [0, a.rows) x columns [0, cols) of a minifloat panel on AVX512-VBMI. Up to 8 rows:
// each pair converted in registers as it is used (minifloat_rows_fma). More: each block of
// pairs converted once per 48 rows into fp32 on the stack (16 KB for fp8's 64 pairs) and read
// by every 12 of them, so that the FMAs are nearly all a pair costs (converting again for
// every 8 rows cost a quarter more).
template <index_t Block, class Convert>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline void minifloat_panel_fma(
    matrix_view<const float> a, const Convert& convert, index_t K, float* c, index_t ldc,
    index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  if (a.rows <= 8) {
    with_rows<8>(a.rows, [&]<int MR>() {
      minifloat_rows_fma<MR, Block>(a.data, a.stride, convert, K, c, ldc, m0, m1);
    });
    return;
  }
  constexpr index_t max_rows = 48;
  alignas(64) float w[Block * 64];
  alignas(64) float tot[max_rows * 32];
  const index_t pairs = (K + 1) / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (index_t r0 = 0; r0 < a.rows; r0 += max_rows) {
    const index_t n = std::min(max_rows, a.rows - r0);
    std::fill_n(tot, n * 32, 0.f);
    for (index_t p0 = 0; p0 < pairs; p0 += Block) {
      const index_t np = std::min(pairs - p0, Block);
      for (index_t p = 0; p < np; ++p) {
        __m512i w0, w1;
        convert(p0 + p, w0, w1);
        float* wp = w + 64 * p;
        _mm512_store_ps(wp, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w0, 16)));
        _mm512_store_ps(wp + 16, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, w1, 16)));
        _mm512_store_ps(wp + 32, _mm512_castsi512_ps(_mm512_and_si512(w0, high)));
        _mm512_store_ps(wp + 48, _mm512_castsi512_ps(_mm512_and_si512(w1, high)));
      }
      __m512 s0, s1;
      convert.scales(p0 / Block, s0, s1);
      const bool half = K % 2 == 1 && p0 + np == pairs;
      row_blocks<12>(n, [&](index_t i, index_t m) {
        with_rows<12>(m, [&]<int MR>() {
          minifloat_block_fma<MR>(a.row(r0 + i) + 2 * p0, a.stride, w, np, half, s0, s1,
                                  tot + 32 * i);
        });
      });
    }
    for (index_t i = 0; i < n; ++i) {
      _mm512_mask_storeu_ps(c + (r0 + i) * ldc, m0, _mm512_load_ps(tot + 32 * i));
      _mm512_mask_storeu_ps(c + (r0 + i) * ldc + 16, m1, _mm512_load_ps(tot + 32 * i + 16));
    }
  }
}
#endif

}  // namespace detail

}  // namespace epmoe::space
