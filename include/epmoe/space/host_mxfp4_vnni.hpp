// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// weights_format::mxfp4 as W4A8 on AVX512-VNNI (docs/quantisation.md, "mxfp4"): twice an E2M1
// value is an integer in [-12, 12] and an E8M0 scale a power of two, so a block of 32 inputs
// is an int8 dot product (vpdpbusd) of the tokens quantised per row (quantise_group_rows, as
// the group-wise formats' W4A8) with the codes looked up as 2 e2m1 + 12 (unsigned, vpshufb),
// its int32 sum started at -12 Σ qx, then scaled by 2^(e - 127) / 2 per column into fp32.
// It reads host_mxfp4.hpp's panels as they are: a quad of inputs 4g..4g+3 is pairs 2g and
// 2g + 1, 64 bytes, whose nibbles VBMI's vpermt2b gathers into each column's dword.

#include "epmoe/space/host_int4_kernels.hpp"
#include "epmoe/space/host_mxfp4.hpp"

namespace epmoe::space {

/// Whether mxfp4 panels compute W4A8 on `path`: AVX512-VNNI (int8_kernel_for) and VBMI.
inline bool mxfp4_w4a8(cpu_path path) {
#if defined(EPMOE_HOST_PACKED_X86)
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi && int8_kernel_for(path) == int8_kernel::avx512_vnni;
#else
  (void)path;
  return false;
#endif
}

namespace detail {

// Column j's dword of a quad: its inputs 4g, 4g + 1 (the low, high nibble of pair 2g's byte j),
// 4g + 2, 4g + 3 (pair 2g + 1's byte, 32 + j), as vpermt2b indices over the low nibbles'
// lookups (0..63) and the high ones' (64..127); at[1]: columns 16..31.
struct mxfp4_quad_indices {
  alignas(64) std::uint8_t at[2][64];
};
constexpr mxfp4_quad_indices make_mxfp4_quad_indices() {
  mxfp4_quad_indices r{};
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 16; ++j) {
      const int col = 16 * half + j;
      r.at[half][4 * j] = static_cast<std::uint8_t>(col);
      r.at[half][4 * j + 1] = static_cast<std::uint8_t>(64 + col);
      r.at[half][4 * j + 2] = static_cast<std::uint8_t>(32 + col);
      r.at[half][4 * j + 3] = static_cast<std::uint8_t>(96 + col);
    }
  return r;
}
inline constexpr mxfp4_quad_indices mxfp4_quad_index = make_mxfp4_quad_indices();

#if defined(EPMOE_HOST_PACKED_X86)
// MR rows (<= 6) x 32 columns: 2 MR int32 sums per block of 32 inputs, 2 MR fp32 accumulators.
// a: the rows as quantise_group_rows(weights_format::mxfp4) makes them, sums at word `sums`.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"))) inline void mxfp4_rows_vnni(
    const std::uint32_t* a, index_t lda, index_t sums, const float* row_scale,
    const std::uint8_t* q, const std::uint8_t* e, index_t K, float* c, index_t ldc, __mmask16 m0,
    __mmask16 m1) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // 2 e2m1(code) + 12 for codes 0..15 (bit 3 the sign), in every 128-bit lane (vpshufb's).
  const __m512i table = _mm512_maskz_broadcast_i32x4(
      0xFFFF, _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i idx0 = _mm512_load_si512(mxfp4_quad_index.at[0]);
  const __m512i idx1 = _mm512_load_si512(mxfp4_quad_index.at[1]);
  const __m512 half_scale = _mm512_set1_ps(0.5f);
  __m512 flo[MR], fhi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) flo[i] = fhi[i] = _mm512_setzero_ps();
  const index_t G = (K + 31) / 32;
  for (index_t t = 0; t < G; ++t) {
    __m512i lo[MR], hi[MR];
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i)
      lo[i] = hi[i] = _mm512_set1_epi32(static_cast<int>(a[i * lda + sums + t]));  // -12 Σ qx
    const index_t quads = (std::min<index_t>(K - 32 * t, 32) + 3) / 4;
    const std::uint32_t* x = a + 8 * t;
    for (index_t g = 0; g < quads; ++g) {
      const std::uint8_t* w = q + (8 * t + g) * 64;
      __builtin_prefetch(w + 2048);
      const __m512i v = _mm512_load_si512(w);
      const __m512i l = _mm512_shuffle_epi8(table, _mm512_and_si512(v, nibble));
      const __m512i h = _mm512_shuffle_epi8(
          table, _mm512_and_si512(_mm512_maskz_srli_epi16(all32, v, 4), nibble));
      const __m512i u0 = _mm512_permutex2var_epi8(l, idx0, h);
      const __m512i u1 = _mm512_permutex2var_epi8(l, idx1, h);
      EPMOE_PACKED_UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512i xi = _mm512_set1_epi32(static_cast<int>(x[i * lda + g]));
        lo[i] = _mm512_dpbusd_epi32(lo[i], u0, xi);
        hi[i] = _mm512_dpbusd_epi32(hi[i], u1, xi);
      }
    }
    const __m512 s0 = _mm512_mul_ps(e8m0_avx512(e + 32 * t), half_scale);
    const __m512 s1 = _mm512_mul_ps(e8m0_avx512(e + 32 * t + 16), half_scale);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      flo[i] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, lo[i]), s0, flo[i]);
      fhi[i] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, hi[i]), s1, fhi[i]);
    }
  }
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 r = _mm512_set1_ps(row_scale[i]);
    flo[i] = _mm512_mul_ps(flo[i], r), fhi[i] = _mm512_mul_ps(fhi[i], r);
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, flo, fhi);
}
#endif

// One mxfp4 panel's c rows [0, rows) x columns [0, cols) as W4A8 (mxfp4_w4a8 must hold); a8:
// the rows converted by quantise_group_rows(weights_format::mxfp4).
inline void mxfp4_panel_vnni(converted_rows a8, index_t rows, const std::byte* panel, index_t K,
                             float* c, index_t ldc, index_t cols) {
#if defined(EPMOE_HOST_PACKED_X86)
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  const index_t sums = group_count(weights_format::mxfp4, K) * 8;
  row_blocks<6>(rows, [&](index_t i, index_t n) {
    with_rows<6>(n, [&]<int MR>() {
      mxfp4_rows_vnni<MR>(a8.data + i * a8.stride, a8.stride, sums, a8.scales + i, q,
                          q + mxfp4_scale_offset(K), K, c + i * ldc, ldc, m0, m1);
    });
  });
#else
  (void)a8, (void)rows, (void)panel, (void)K, (void)c, (void)ldc, (void)cols;
#endif
}

}  // namespace detail

}  // namespace epmoe::space
