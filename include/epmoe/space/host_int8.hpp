// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// weights_format::int8_channel on the host (docs/quantisation.md): how a packed_nt panel
// holds it, the quantisation (weights at pack time, activations per token per pass), and
// its micro-kernels, chosen at run time: W8A8 on AVX512-VNNI (vpdpbusd, u8 = s8 + 128 and the
// compensation 128 Σ_k q[j, k] stored with the panel), W8A16 elsewhere (int8 widened to fp32
// in registers: AVX-512, AVX2+FMA, a portable loop).
//
// A panel of 32 output columns: ceil(K / 4) quads of 128 bytes (column j's k = 4g .. 4g + 3
// at 128 g + 4 j + k % 4; past K and past N zero), then 32 fp32 scales, then 32 int32
// compensations. The quads are vpdpbusd's layout; the W8A16 paths take byte k % 4 of each
// 32-bit lane with a shift pair.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/space/host_packed_kernels.hpp"

namespace epmoe::space {

/// The int8_channel kernels, best last.
enum class int8_kernel { portable, avx2, avx512, avx512_vnni };

inline const char* name_of(int8_kernel k) {
  switch (k) {
    case int8_kernel::avx512_vnni:
      return "AVX512-VNNI W8A8";
    case int8_kernel::avx512:
      return "AVX-512 W8A16";
    case int8_kernel::avx2:
      return "AVX2+FMA W8A16";
    default:
      return "portable W8A16";
  }
}

inline bool cpu_runs(int8_kernel k) {
#if defined(EPMOE_HOST_PACKED_X86)
  if (k == int8_kernel::avx512_vnni) {  // (asked once: every int8 GEMM chooses its kernel)
    static const bool vnni =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return vnni;
  }
#endif
  return k == int8_kernel::avx512 ? cpu_runs(cpu_path::avx512)
         : k == int8_kernel::avx2 ? cpu_runs(cpu_path::avx2)
                                  : k == int8_kernel::portable;
}

/// The int8 kernel of a float path: any AVX-512 path takes VNNI where the CPU has it.
inline int8_kernel int8_kernel_for(cpu_path p) {
  if (p == cpu_path::avx512 || p == cpu_path::avx512_bf16)
    return cpu_runs(int8_kernel::avx512_vnni) ? int8_kernel::avx512_vnni : int8_kernel::avx512;
  return p == cpu_path::avx2 ? int8_kernel::avx2 : int8_kernel::portable;
}

/// The largest K the format packs: 255 * 127 * K must fit vpdpbusd's int32 sums.
inline constexpr index_t int8_max_cols = 2147483647 / (255 * 127);

/// Bytes of one int8 panel for K inputs.
constexpr index_t int8_panel_bytes(index_t K) { return (K + 3) / 4 * 128 + 32 * 8; }

/// The format's weight quantisation, one output channel (`row`) of K values: scale = max |w|
/// / 127 (fp32), q = round-half-even(w / scale) in [-127, 127] (all zero, scale 0, for a zero
/// channel), given as put(k, q). Returns the scale. NaN or ±Inf throws config_error.
template <class Put>
inline float quantise_int8_channel(const float* w, index_t K, index_t row, Put&& put) {
  float amax = 0;
  for (index_t k = 0; k < K; ++k) {
    if (!std::isfinite(w[k]))
      throw config_error("pack_weights(int8_channel)", "output channel " + std::to_string(row),
                         "holds NaN or Inf, which int8 cannot hold");
    amax = std::max(amax, std::abs(w[k]));
  }
  const float scale = amax / 127.f;
  for (index_t k = 0; k < K; ++k)
    put(k, static_cast<std::int8_t>(
               scale > 0 ? std::clamp(std::nearbyint(w[k] / scale), -127.f, 127.f) : 0.f));
  return scale;
}

/// 127 / max |x| of a row, or 0 where that is not a finite number: a zero row, and one so
/// small that the inverse overflows (max |x| < 127 / FLT_MAX): both quantise to zeros.
inline float u8_inverse_scale(float amax) {
  const float inv = amax > 0 ? 127.f / amax : 0.f;
  return std::isfinite(inv) ? inv : 0.f;
}

/// The format's per-token activation quantisation, one row of K values: scale = max |x| /
/// 127, q = round-half-even(x * (127 / max |x|)) (fp32 product) in [-127, 127]; a row of
/// zeros (or below 127 / FLT_MAX: u8_inverse_scale) gives scale 0. A row holding NaN or ±Inf
/// gets scale NaN (its outputs are NaN) and q = 0. Stored as u8 = q + 128, four per word (past
/// K: 128, a zero). Returns the scale.
inline float quantise_u8_row(const float* x, index_t K, std::uint8_t* out, index_t padded) {
  float amax = 0, poison = 0;  // poison: x * 0 is NaN for NaN and ±Inf
  for (index_t k = 0; k < K; ++k) {
    amax = std::max(amax, std::abs(x[k]));
    poison += x[k] * 0.f;
  }
  const bool bad = std::isnan(poison);
  const float inv = bad ? 0.f : u8_inverse_scale(amax);
  for (index_t k = 0; k < padded; ++k)
    out[k] = static_cast<std::uint8_t>(
        128 + (k < K && !bad
                   ? static_cast<int>(std::clamp(std::nearbyint(x[k] * inv), -127.f, 127.f))
                   : 0));
  return bad ? poison : inv > 0 ? amax / 127.f : 0.f;
}

namespace detail {

struct int8_panel_view {
  const std::int8_t* q;
  const float* scale;
  const std::int32_t* comp;
};
inline int8_panel_view int8_panel(const std::byte* p, index_t K) {
  const index_t quads = (K + 3) / 4 * 128;
  return {reinterpret_cast<const std::int8_t*>(p), reinterpret_cast<const float*>(p + quads),
          reinterpret_cast<const std::int32_t*>(p + quads + 128)};
}

// c rows [0, m) x columns [0, cols) of one panel, portable W8A16: fp32 sums of x q, times
// the column's scale at the end.
inline void int8_panel_portable(matrix_view<const float> a, const std::byte* panel, index_t K,
                                float* c, index_t ldc, index_t cols) {
  constexpr index_t W = panel_width;
  const int8_panel_view p = int8_panel(panel, K);
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const float v = x[k];
      const std::int8_t* w = p.q + k / 4 * 128 + k % 4;
      for (index_t j = 0; j < W; ++j) acc[j] += v * static_cast<float>(w[4 * j]);
    }
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j] * p.scale[j];
  }
}

#if defined(EPMOE_HOST_PACKED_X86)
// All lanes: the maskz forms, as GCC 12 warns about the unmasked ones' undefined vectors.
inline constexpr __mmask16 all = 0xFFFF;

// Byte B of each 32-bit lane, sign-extended, as fp32.
template <int B>
__attribute__((target("avx512f"), always_inline)) inline __m512 int8_lane_avx512(__m512i w) {
  return _mm512_maskz_cvtepi32_ps(
      all, _mm512_maskz_srai_epi32(all, _mm512_maskz_slli_epi32(all, w, 24 - 8 * B), 24));
}
template <int B>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 int8_lane_avx2(__m256i w) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * B), 24));
}

// Input k = 4 g + B of MR rows into their accumulators (w0, w1: quad g's two halves).
template <int MR, int B>
__attribute__((target("avx512f"), always_inline)) inline void int8_step_avx512(
    const float* a, index_t lda, index_t k, __m512i w0, __m512i w1, __m512 (&lo)[MR],
    __m512 (&hi)[MR]) {
  const __m512 e0 = int8_lane_avx512<B>(w0), e1 = int8_lane_avx512<B>(w1);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 x = _mm512_set1_ps(a[i * lda + k]);
    lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
  }
}

// AVX-512 W8A16: MR rows (<= 12) x 32 columns in 2 MR accumulators; per quad two loads, 8
// shifts and 8 conversions, 8 MR FMAs.
template <int MR>
__attribute__((target("avx512f"))) inline void int8_rows_avx512(const float* a, index_t lda,
                                                                int8_panel_view p, index_t K,
                                                                float* c, index_t ldc, __mmask16 m0,
                                                                __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  index_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const __m512i w0 = _mm512_load_si512(p.q + k * 32), w1 = _mm512_load_si512(p.q + k * 32 + 64);
    int8_step_avx512<MR, 0>(a, lda, k, w0, w1, lo, hi);
    int8_step_avx512<MR, 1>(a, lda, k + 1, w0, w1, lo, hi);
    int8_step_avx512<MR, 2>(a, lda, k + 2, w0, w1, lo, hi);
    int8_step_avx512<MR, 3>(a, lda, k + 3, w0, w1, lo, hi);
  }
  if (k < K) {  // the last quad's first K % 4 inputs (a has no more)
    const __m512i w0 = _mm512_load_si512(p.q + k * 32), w1 = _mm512_load_si512(p.q + k * 32 + 64);
    int8_step_avx512<MR, 0>(a, lda, k, w0, w1, lo, hi);
    if (k + 1 < K) int8_step_avx512<MR, 1>(a, lda, k + 1, w0, w1, lo, hi);
    if (k + 2 < K) int8_step_avx512<MR, 2>(a, lda, k + 2, w0, w1, lo, hi);
  }
  const __m512 s0 = _mm512_load_ps(p.scale), s1 = _mm512_load_ps(p.scale + 16);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = _mm512_mul_ps(lo[i], s0), hi[i] = _mm512_mul_ps(hi[i], s1);
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

__attribute__((target("avx512f"))) inline void int8_panel_avx512(matrix_view<const float> a,
                                                                 const std::byte* panel, index_t K,
                                                                 float* c, index_t ldc,
                                                                 index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  const int8_panel_view p = int8_panel(panel, K);
  row_blocks<12>(a.rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      int8_rows_avx512<MR>(a.row(i), a.stride, p, K, c + i * ldc, ldc, m0, m1);
    });
  });
}

// AVX512-VNNI W8A8: MR rows of u8 quads (one word per row and quad) x 32 columns in 2 MR
// int32 accumulators; per quad two loads, MR broadcasts, 2 MR vpdpbusd (4 products each).
// Then c = float(acc - comp) * (row scale * column scale).
template <int MR>
__attribute__((target("avx512f,avx512vnni"))) inline void int8_rows_vnni(
    const std::uint32_t* a, index_t lda, const float* row_scale, int8_panel_view p, index_t quads,
    float* c, index_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512i lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
  for (index_t g = 0; g < quads; ++g) {
    const __m512i w0 = _mm512_load_si512(p.q + g * 128), w1 = _mm512_load_si512(p.q + g * 128 + 64);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512i x = _mm512_set1_epi32(static_cast<int>(a[i * lda + g]));
      lo[i] = _mm512_dpbusd_epi32(lo[i], x, w0);
      hi[i] = _mm512_dpbusd_epi32(hi[i], x, w1);
    }
  }
  const __m512i c0 = _mm512_load_si512(p.comp), c1 = _mm512_load_si512(p.comp + 16);
  const __m512 s0 = _mm512_load_ps(p.scale), s1 = _mm512_load_ps(p.scale + 16);
  __m512 flo[MR], fhi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 r = _mm512_set1_ps(row_scale[i]);
    flo[i] = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(all, _mm512_sub_epi32(lo[i], c0)),
                           _mm512_mul_ps(r, s0));
    fhi[i] = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(all, _mm512_sub_epi32(hi[i], c1)),
                           _mm512_mul_ps(r, s1));
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, flo, fhi);
}

__attribute__((target("avx512f,avx512vnni"))) inline void int8_panel_vnni(
    converted_rows a, index_t rows, const std::byte* panel, index_t K, float* c, index_t ldc,
    index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  const int8_panel_view p = int8_panel(panel, K);
  row_blocks<12>(rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      int8_rows_vnni<MR>(a.data + i * a.stride, a.stride, a.scales + i, p, (K + 3) / 4, c + i * ldc,
                         ldc, m0, m1);
    });
  });
}

// AVX2 W8A16: MR rows (<= 6) x one half (16 columns: bytes [64 h, 64 h + 64) of a quad).
template <int MR, int B>
__attribute__((target("avx2,fma"), always_inline)) inline void int8_step_avx2(
    const float* a, index_t lda, index_t k, __m256i w0, __m256i w1, __m256 (&lo)[MR],
    __m256 (&hi)[MR]) {
  const __m256 e0 = int8_lane_avx2<B>(w0), e1 = int8_lane_avx2<B>(w1);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
    lo[i] = _mm256_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm256_fmadd_ps(x, e1, hi[i]);
  }
}

template <int MR>
__attribute__((target("avx2,fma"))) inline void int8_rows_avx2(const float* a, index_t lda,
                                                               const std::int8_t* half,
                                                               const float* scale, index_t K,
                                                               float* c, index_t ldc,
                                                               index_t cols) {
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  const auto* quads = reinterpret_cast<const __m256i*>(half);  // quad g at quads[4 g]
  index_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const __m256i w0 = _mm256_load_si256(quads + k), w1 = _mm256_load_si256(quads + k + 1);
    int8_step_avx2<MR, 0>(a, lda, k, w0, w1, lo, hi);
    int8_step_avx2<MR, 1>(a, lda, k + 1, w0, w1, lo, hi);
    int8_step_avx2<MR, 2>(a, lda, k + 2, w0, w1, lo, hi);
    int8_step_avx2<MR, 3>(a, lda, k + 3, w0, w1, lo, hi);
  }
  if (k < K) {
    const __m256i w0 = _mm256_load_si256(quads + k), w1 = _mm256_load_si256(quads + k + 1);
    int8_step_avx2<MR, 0>(a, lda, k, w0, w1, lo, hi);
    if (k + 1 < K) int8_step_avx2<MR, 1>(a, lda, k + 1, w0, w1, lo, hi);
    if (k + 2 < K) int8_step_avx2<MR, 2>(a, lda, k + 2, w0, w1, lo, hi);
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = _mm256_mul_ps(lo[i], s0), hi[i] = _mm256_mul_ps(hi[i], s1);
  store_rows_avx2<MR>(c, ldc, cols, lo, hi);
}

__attribute__((target("avx2,fma"))) inline void int8_panel_avx2(matrix_view<const float> a,
                                                                const std::byte* panel, index_t K,
                                                                float* c, index_t ldc,
                                                                index_t cols) {
  const int8_panel_view p = int8_panel(panel, K);
  for (index_t h = 0; h < 2 && 16 * h < cols; ++h) {
    const index_t n = std::min<index_t>(16, cols - 16 * h);
    row_blocks<6>(a.rows, [&](index_t i, index_t m) {
      with_rows<6>(m, [&]<int MR>() {
        int8_rows_avx2<MR>(a.row(i), a.stride, p.q + 64 * h, p.scale + 16 * h, K,
                           c + i * ldc + 16 * h, ldc, n);
      });
    });
  }
}

// quantise_u8_row, 16 at a time (the same arithmetic: fp32 product, round half to even by
// the default MXCSR mode, clamp).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline float quantise_u8_row_avx512(
    const float* x, index_t K, std::uint8_t* out, index_t padded) {
  __m512 amax = _mm512_setzero_ps(), poison = _mm512_setzero_ps();
  for (index_t k = 0; k < K; k += 16) {
    const __mmask16 m = column_mask(K - k);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    amax = _mm512_maskz_max_ps(all, amax, _mm512_abs_ps(v));
    poison = _mm512_add_ps(poison, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  alignas(64) float lanes[16], sums[16];
  _mm512_store_ps(lanes, amax);
  _mm512_store_ps(sums, poison);
  float big = 0, bad = 0;
  for (int l = 0; l < 16; ++l) big = std::max(big, lanes[l]), bad += sums[l];
  if (std::isnan(bad)) {
    std::fill_n(out, padded, std::uint8_t{128});
    return bad;
  }
  const float scalar_inv = u8_inverse_scale(big);
  const __m512 inv = _mm512_set1_ps(scalar_inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i bias = _mm512_set1_epi32(128);
  for (index_t k = 0; k < padded; k += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(column_mask(K - k), x + k);
    __m512i q = _mm512_maskz_cvtps_epi32(all, _mm512_mul_ps(v, inv));
    q = _mm512_add_epi32(_mm512_maskz_min_epi32(all, _mm512_maskz_max_epi32(all, q, lo), hi), bias);
    _mm_mask_storeu_epi8(out + k, column_mask(padded - k), _mm512_maskz_cvtepi32_epi8(all, q));
  }
  return scalar_inv > 0 ? big / 127.f : 0.f;
}
#endif

}  // namespace detail

/// The rows of a quantised per token for the W8A8 kernel: row i's u8 quads at out + i *
/// stride (words, at least ceil(K / 4)), its scale at scales[i].
inline void quantise_u8_rows(matrix_view<const float> a, std::uint32_t* out, index_t stride,
                             float* scales, int8_kernel kernel) {
  for (index_t i = 0; i < a.rows; ++i) {
    auto* o = reinterpret_cast<std::uint8_t*>(out + i * stride);
#if defined(EPMOE_HOST_PACKED_X86)
    if (kernel == int8_kernel::avx512_vnni) {
      scales[i] = detail::quantise_u8_row_avx512(a.row(i), a.cols, o, 4 * stride);
      continue;
    }
#endif
    (void)kernel;
    scales[i] = quantise_u8_row(a.row(i), a.cols, o, 4 * stride);
  }
}

namespace detail {

// Packs rows [j0, j0 + cols) of b (fp32, quantised here) or of q (pre-quantised, with
// `scales`) into one panel; zero past K and past cols.
inline void pack_int8_panel(std::byte* out, index_t K, index_t cols, index_t j0,
                            matrix_view<const float> b, matrix_view<const std::int8_t> q,
                            const float* scales) {
  const index_t quads = (K + 3) / 4 * 128;
  std::fill_n(out, int8_panel_bytes(K), std::byte{0});
  auto* w = reinterpret_cast<std::int8_t*>(out);
  float scale[panel_width] = {};
  std::int32_t comp[panel_width] = {};
  for (index_t j = 0; j < cols; ++j) {
    std::int8_t* col = w + 4 * j;  // k at col + k / 4 * 128 + k % 4
    const auto at = [&](index_t k) -> std::int8_t& { return col[k / 4 * 128 + k % 4]; };
    if (b.data) {
      scale[j] = quantise_int8_channel(b.row(j0 + j), K, j0 + j,
                                       [&](index_t k, std::int8_t v) { at(k) = v; });
    } else {
      scale[j] = scales[j0 + j];
      for (index_t k = 0; k < K; ++k) at(k) = q(j0 + j, k);
    }
    std::int32_t sum = 0;
    for (index_t k = 0; k < K; ++k) sum += at(k);
    comp[j] = 128 * sum;
  }
  std::memcpy(out + quads, scale, sizeof scale);
  std::memcpy(out + quads + sizeof scale, comp, sizeof comp);
}

}  // namespace detail

}  // namespace epmoe::space
