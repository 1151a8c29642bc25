// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The group-wise formats' x86 micro-kernels (host_int4.hpp has the layout): AVX512-VNNI
// W4A8 / W8A8 (int32 sums per group, scaled into fp32 at the group's end), and W4A16 / W8A16
// on AVX-512 and AVX2+FMA (each weight dequantised in registers, fma(scale, q, offset), then
// fp32 FMA with the tokens). group_panel runs one panel on a kernel.

#include "epmoe/space/host_int4.hpp"

namespace epmoe::space::detail {

#if defined(EPMOE_HOST_PACKED_X86)
inline constexpr __mmask32 all32 = 0xFFFFFFFF;  // (the maskz forms: see host_int8.hpp's `all`)

// Calls f.template operator()<Kind>() for f's kind.
template <class F>
inline void with_kind(weights_format f, F&& fn) {
  if (f.id == wkind::int4)
    fn.template operator()<wkind::int4>();
  else if (f.id == wkind::int4_asym)
    fn.template operator()<wkind::int4_asym>();
  else
    fn.template operator()<wkind::int8_group>();
}

// The panels stream from memory: a quad's lines are fetched 2 KB ahead (more lines in flight
// than the hardware prefetcher keeps: +15-25% at one token on the 2-vCPU Xeon).
template <index_t QB>
__attribute__((always_inline)) inline void prefetch_quad(const std::byte* quad) {
  constexpr index_t ahead = 2048;
  __builtin_prefetch(quad + ahead);
  if constexpr (QB == 128) __builtin_prefetch(quad + ahead + 64);
}

// --- AVX512-VNNI W4A8 / W8A8 --------------------------------------------------------------

// MR rows (<= 6) x 32 columns: 2 MR int32 sums per group and 2 MR fp32 accumulators. Per
// quad one (int8: two) loads, 3 (2) ops to make the unsigned bytes, MR broadcasts, 2 MR
// vpdpbusd. a: the converted rows (host_int4.hpp, quantise_group_rows), sums at word `sums`.
template <int MR, wkind Kind>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void group_rows_vnni(
    const std::uint32_t* a, index_t lda, index_t sums, const float* row_scale,
    const std::byte* panel, weights_format f, index_t K, float* c, index_t ldc, __mmask16 m0,
    __mmask16 m1) {
  constexpr index_t QB = Kind == wkind::int8_group ? 128 : 64;
  const index_t G = group_count(f, K), per = f.group / 4;
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
  __m512 flo[MR], fhi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) flo[i] = fhi[i] = _mm512_setzero_ps();
  for (index_t t = 0; t < G; ++t) {
    const group_block b = group_at(panel, f, t);
    __m512i lo[MR], hi[MR];
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i)  // int4, int8_group: the sum starts at -z Σ qx
      lo[i] = hi[i] = Kind == wkind::int4_asym
                          ? _mm512_setzero_si512()
                          : _mm512_set1_epi32(static_cast<int>(a[i * lda + sums + t]));
    // (the last group: its quads up to K; the padded ones after it are skipped)
    const index_t quads = (std::min<index_t>(K - t * f.group, f.group) + 3) / 4;
    const std::uint32_t* x = a + t * per;
    for (index_t g = 0; g < quads; ++g) {
      prefetch_quad<QB>(b.quads + g * QB);
      __m512i u0, u1;
      if constexpr (Kind == wkind::int8_group) {
        u0 = _mm512_xor_si512(_mm512_load_si512(b.quads + g * 128), flip);
        u1 = _mm512_xor_si512(_mm512_load_si512(b.quads + g * 128 + 64), flip);
      } else {
        const __m512i w = _mm512_load_si512(b.quads + g * 64);
        u0 = _mm512_and_si512(w, nibble);
        u1 = _mm512_and_si512(_mm512_maskz_srli_epi16(all32, w, 4), nibble);
      }
      EPMOE_PACKED_UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512i xi = _mm512_set1_epi32(static_cast<int>(x[i * lda + g]));
        lo[i] = _mm512_dpbusd_epi32(lo[i], u0, xi);
        hi[i] = _mm512_dpbusd_epi32(hi[i], u1, xi);
      }
    }
    const __m512 s0 = _mm512_load_ps(b.scale), s1 = _mm512_load_ps(b.scale + 16);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      flo[i] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, lo[i]), s0, flo[i]);
      fhi[i] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, hi[i]), s1, fhi[i]);
      if constexpr (Kind == wkind::int4_asym) {  // + m Σ qx
        const __m512 sx = _mm512_set1_ps(std::bit_cast<float>(a[i * lda + sums + t]));
        flo[i] = _mm512_fmadd_ps(sx, _mm512_load_ps(b.offset), flo[i]);
        fhi[i] = _mm512_fmadd_ps(sx, _mm512_load_ps(b.offset + 16), fhi[i]);
      }
    }
  }
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 r = _mm512_set1_ps(row_scale[i]);
    flo[i] = _mm512_mul_ps(flo[i], r), fhi[i] = _mm512_mul_ps(fhi[i], r);
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, flo, fhi);
}

// --- AVX-512 W4A16 / W8A16 ------------------------------------------------------------------

// Input r of a quad as fp32 weights, columns [0, 16) and [16, 32): int4 from the nibbles of
// w0 (byte r of each lane: low nibble, high nibble), int8 from w0 and w1; then fma(scale, q,
// offset) (int4: offset -8 scale, the u = q + 8 stored) or scale q.
template <wkind Kind, int R>
__attribute__((target("avx512f"), always_inline)) inline void group_weights_avx512(
    __m512i w0, __m512i w1, __m512 s0, __m512 s1, __m512 o0, __m512 o1, __m512& e0, __m512& e1) {
  if constexpr (Kind == wkind::int8_group) {
    e0 = _mm512_mul_ps(int8_lane_avx512<R>(w0), s0);
    e1 = _mm512_mul_ps(int8_lane_avx512<R>(w1), s1);
  } else {
    const __m512i nibble = _mm512_set1_epi32(15);
    const __m512i n0 = _mm512_and_si512(_mm512_maskz_srli_epi32(all, w0, 8 * R), nibble);
    const __m512i n1 = _mm512_and_si512(_mm512_maskz_srli_epi32(all, w0, 8 * R + 4), nibble);
    e0 = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, n0), s0, o0);
    e1 = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, n1), s1, o1);
  }
}

// A quad: int8's two halves; int4's 64 bytes hold both halves' nibbles (w1 unused).
template <index_t QB>
__attribute__((target("avx512f"), always_inline)) inline void group_load_avx512(
    const std::byte* quad, __m512i& w0, __m512i& w1) {
  w0 = _mm512_load_si512(quad);
  w1 = QB == 128 ? _mm512_load_si512(quad + 64) : w0;
}

template <int MR, wkind Kind, int R>
__attribute__((target("avx512f"), always_inline)) inline void group_step_avx512(
    const float* a, index_t lda, index_t k, __m512i w0, __m512i w1, __m512 s0, __m512 s1, __m512 o0,
    __m512 o1, __m512 (&lo)[MR], __m512 (&hi)[MR]) {
  __m512 e0, e1;
  group_weights_avx512<Kind, R>(w0, w1, s0, s1, o0, o1, e0, e1);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m512 x = _mm512_set1_ps(a[i * lda + k]);
    lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
  }
}

// MR rows (<= 8) x 32 columns in 2 MR accumulators; per quad 8 dequantised vectors (4 ops
// each), 8 MR FMAs.
template <int MR, wkind Kind>
__attribute__((target("avx512f"))) inline void group_rows_avx512(const float* a, index_t lda,
                                                                 const std::byte* panel,
                                                                 weights_format f, index_t K,
                                                                 float* c, index_t ldc,
                                                                 __mmask16 m0, __mmask16 m1) {
  constexpr index_t QB = Kind == wkind::int8_group ? 128 : 64;
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (index_t t = 0, k0 = 0; k0 < K; ++t, k0 += f.group) {
    const group_block b = group_at(panel, f, t);
    const __m512 s0 = _mm512_load_ps(b.scale), s1 = _mm512_load_ps(b.scale + 16);
    const __m512 eight = _mm512_set1_ps(-8.f);
    const __m512 o0 =
        Kind == wkind::int4_asym ? _mm512_load_ps(b.offset) : _mm512_mul_ps(s0, eight);
    const __m512 o1 =
        Kind == wkind::int4_asym ? _mm512_load_ps(b.offset + 16) : _mm512_mul_ps(s1, eight);
    const index_t k1 = std::min(K, k0 + f.group);
    index_t k = k0;
    for (; k + 4 <= k1; k += 4) {
      prefetch_quad<QB>(b.quads + (k - k0) / 4 * QB);
      __m512i w0, w1;
      group_load_avx512<QB>(b.quads + (k - k0) / 4 * QB, w0, w1);
      group_step_avx512<MR, Kind, 0>(a, lda, k, w0, w1, s0, s1, o0, o1, lo, hi);
      group_step_avx512<MR, Kind, 1>(a, lda, k + 1, w0, w1, s0, s1, o0, o1, lo, hi);
      group_step_avx512<MR, Kind, 2>(a, lda, k + 2, w0, w1, s0, s1, o0, o1, lo, hi);
      group_step_avx512<MR, Kind, 3>(a, lda, k + 3, w0, w1, s0, s1, o0, o1, lo, hi);
    }
    if (k < k1) {  // the row's last K % 4 inputs (a has no more)
      __m512i w0, w1;
      group_load_avx512<QB>(b.quads + (k - k0) / 4 * QB, w0, w1);
      group_step_avx512<MR, Kind, 0>(a, lda, k, w0, w1, s0, s1, o0, o1, lo, hi);
      if (k + 1 < k1) group_step_avx512<MR, Kind, 1>(a, lda, k + 1, w0, w1, s0, s1, o0, o1, lo, hi);
      if (k + 2 < k1) group_step_avx512<MR, Kind, 2>(a, lda, k + 2, w0, w1, s0, s1, o0, o1, lo, hi);
    }
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

// --- AVX2+FMA W4A16 / W8A16 ----------------------------------------------------------------

// Half H (columns [16 H, 16 H + 16)) of input r of a quad as 2 x 8 fp32 weights: int4 from
// the nibbles of the quad's 64 bytes (w0: columns 0-7, w1: 8-15 of the half), int8 from the
// half's 64 bytes.
template <wkind Kind, int H, int R>
__attribute__((target("avx2,fma"), always_inline)) inline void group_weights_avx2(
    __m256i w0, __m256i w1, __m256 s0, __m256 s1, __m256 o0, __m256 o1, __m256& e0, __m256& e1) {
  if constexpr (Kind == wkind::int8_group) {
    e0 = _mm256_mul_ps(int8_lane_avx2<R>(w0), s0);
    e1 = _mm256_mul_ps(int8_lane_avx2<R>(w1), s1);
  } else {
    const __m256i nibble = _mm256_set1_epi32(15);
    e0 = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w0, 8 * R + 4 * H), nibble)), s0, o0);
    e1 = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w1, 8 * R + 4 * H), nibble)), s1, o1);
  }
}

template <int MR, wkind Kind, int H, int R>
__attribute__((target("avx2,fma"), always_inline)) inline void group_step_avx2(
    const float* a, index_t lda, index_t k, __m256i w0, __m256i w1, __m256 s0, __m256 s1, __m256 o0,
    __m256 o1, __m256 (&lo)[MR], __m256 (&hi)[MR]) {
  __m256 e0, e1;
  group_weights_avx2<Kind, H, R>(w0, w1, s0, s1, o0, o1, e0, e1);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) {
    const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
    lo[i] = _mm256_fmadd_ps(x, e0, lo[i]);
    hi[i] = _mm256_fmadd_ps(x, e1, hi[i]);
  }
}

// MR rows (<= 4) x one half (16 columns) in 2 MR accumulators.
template <int MR, wkind Kind, int H>
__attribute__((target("avx2,fma"))) inline void group_rows_avx2(const float* a, index_t lda,
                                                                const std::byte* panel,
                                                                weights_format f, index_t K,
                                                                float* c, index_t ldc,
                                                                index_t cols) {
  constexpr index_t QB = Kind == wkind::int8_group ? 128 : 64;
  constexpr index_t half = Kind == wkind::int8_group ? 64 * H : 0;  // int4: both in one
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (index_t t = 0, k0 = 0; k0 < K; ++t, k0 += f.group) {
    const group_block b = group_at(panel, f, t);
    const __m256 s0 = _mm256_load_ps(b.scale + 16 * H), s1 = _mm256_load_ps(b.scale + 16 * H + 8);
    const __m256 eight = _mm256_set1_ps(-8.f);
    const __m256 o0 =
        Kind == wkind::int4_asym ? _mm256_load_ps(b.offset + 16 * H) : _mm256_mul_ps(s0, eight);
    const __m256 o1 =
        Kind == wkind::int4_asym ? _mm256_load_ps(b.offset + 16 * H + 8) : _mm256_mul_ps(s1, eight);
    const index_t k1 = std::min(K, k0 + f.group);
    const auto quad = [&](index_t at) {
      return reinterpret_cast<const __m256i*>(b.quads + (at - k0) / 4 * QB + half);
    };
    index_t k = k0;
    for (; k + 4 <= k1; k += 4) {
      const __m256i w0 = _mm256_load_si256(quad(k)), w1 = _mm256_load_si256(quad(k) + 1);
      group_step_avx2<MR, Kind, H, 0>(a, lda, k, w0, w1, s0, s1, o0, o1, lo, hi);
      group_step_avx2<MR, Kind, H, 1>(a, lda, k + 1, w0, w1, s0, s1, o0, o1, lo, hi);
      group_step_avx2<MR, Kind, H, 2>(a, lda, k + 2, w0, w1, s0, s1, o0, o1, lo, hi);
      group_step_avx2<MR, Kind, H, 3>(a, lda, k + 3, w0, w1, s0, s1, o0, o1, lo, hi);
    }
    if (k < k1) {
      const __m256i w0 = _mm256_load_si256(quad(k)), w1 = _mm256_load_si256(quad(k) + 1);
      group_step_avx2<MR, Kind, H, 0>(a, lda, k, w0, w1, s0, s1, o0, o1, lo, hi);
      if (k + 1 < k1)
        group_step_avx2<MR, Kind, H, 1>(a, lda, k + 1, w0, w1, s0, s1, o0, o1, lo, hi);
      if (k + 2 < k1)
        group_step_avx2<MR, Kind, H, 2>(a, lda, k + 2, w0, w1, s0, s1, o0, o1, lo, hi);
    }
  }
  store_rows_avx2<MR>(c, ldc, cols, lo, hi);
}
#endif

// One panel's c rows [0, a.rows) x columns [0, cols) on `kernel`; a8: a converted for VNNI
// (quantise_group_rows, stride group_input_words).
inline void group_panel(int8_kernel kernel, matrix_view<const float> a, converted_rows a8,
                        const std::byte* panel, weights_format f, index_t K, float* c, index_t ldc,
                        index_t cols) {
#if defined(EPMOE_HOST_PACKED_X86)
  if (kernel == int8_kernel::avx512_vnni || kernel == int8_kernel::avx512) {
    const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
    const index_t sums = group_count(f, K) * f.group / 4;
    with_kind(f, [&]<wkind Kind>() {
      if (kernel == int8_kernel::avx512_vnni)
        row_blocks<6>(a.rows, [&](index_t i, index_t n) {
          with_rows<6>(n, [&]<int MR>() {
            group_rows_vnni<MR, Kind>(a8.data + i * a8.stride, a8.stride, sums, a8.scales + i,
                                      panel, f, K, c + i * ldc, ldc, m0, m1);
          });
        });
      else
        row_blocks<8>(a.rows, [&](index_t i, index_t n) {
          with_rows<8>(n, [&]<int MR>() {
            group_rows_avx512<MR, Kind>(a.row(i), a.stride, panel, f, K, c + i * ldc, ldc, m0, m1);
          });
        });
    });
    return;
  }
  if (kernel == int8_kernel::avx2) {
    with_kind(f, [&]<wkind Kind>() {
      row_blocks<4>(a.rows, [&](index_t i, index_t n) {
        with_rows<4>(n, [&]<int MR>() {
          group_rows_avx2<MR, Kind, 0>(a.row(i), a.stride, panel, f, K, c + i * ldc, ldc,
                                       std::min<index_t>(16, cols));
          if (cols > 16)
            group_rows_avx2<MR, Kind, 1>(a.row(i), a.stride, panel, f, K, c + i * ldc + 16, ldc,
                                         cols - 16);
        });
      });
    });
    return;
  }
#endif
  (void)a8;
  group_panel_portable(a, panel, f, K, c, ldc, cols);
}

}  // namespace epmoe::space::detail
