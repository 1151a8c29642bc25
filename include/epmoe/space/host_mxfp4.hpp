// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// weights_format::mxfp4 on the host (docs/quantisation.md): E2M1 weights in blocks of 32
// inputs with one E8M0 scale each (w = e2m1 * 2^(e - 127), OCP MX; GPT-OSS's `*_blocks` and
// `*_scales`), how a packed_nt panel holds them, the quantisation from fp32 (the OCP rule)
// and the micro-kernels (minifloat_kernel, host_fp8.hpp): on AVX512-BF16 a 16-entry lookup
// (vpermw) makes a byte's two codes one bf16 pair, dot products with the tokens as bf16
// pairs, each column's block scale applied to its block's fp32 sums; elsewhere a 16-entry
// fp32 lookup (vpermps) times the scale, fp32 FMA.
//
// A panel of 32 output columns: ceil(K / 2) pairs of 32 bytes, byte j of pair p column j's
// inputs 2p (low nibble) and 2p + 1 (high nibble), as the checkpoints pack them (past K, past
// N: 0); then, 64-byte aligned, ceil(K / 32) blocks of 32 E8M0 bytes (column j's at j).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/space/host_fp8.hpp"
#include "epmoe/space/host_packed_kernels.hpp"

namespace epmoe::space {

/// E2M1 code (bit 3 the sign) -> its value: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
constexpr float e2m1_float(std::uint8_t c) {
  constexpr float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return c & 8 ? -mag[c & 7] : mag[c & 7];
}

/// E8M0 -> 2^(e - 127) as fp32 (e = 0: the subnormal 2^-127); e <= 254.
constexpr float e8m0_float(std::uint8_t e) {
  return std::bit_cast<float>(e == 0 ? 0x00400000u : std::uint32_t{e} << 23);
}

/// The OCP MX shared exponent of a block whose largest magnitude is amax: floor(log2 amax)
/// - 2 (E2M1's largest exponent), clamped to [-127, 127]; a zero block gets -127. As E8M0.
inline std::uint8_t mxfp4_scale(float amax) {
  const int x = amax > 0 ? std::ilogb(amax) - 2 : -127;
  return static_cast<std::uint8_t>(std::clamp(x, -127, 127) + 127);
}

/// w / 2^(e - 127) rounded to the nearest E2M1 value, ties to even, saturating at ±6 (the
/// sign kept): the OCP rule's element conversion.
inline std::uint8_t e2m1_code(float w, std::uint8_t e) {
  const double a = std::ldexp(std::abs(double{w}), 127 - e);  // exact
  const std::uint8_t s = std::signbit(w) ? 8 : 0;
  if (a < 1) return s | static_cast<std::uint8_t>(std::nearbyint(2 * a));  // 0, 0.5, 1
  const int x = std::ilogb(a);                                             // 0 ..
  const auto m = static_cast<int>(std::nearbyint(std::ldexp(a, 1 - x)));   // 2 .. 4
  return s | static_cast<std::uint8_t>(std::min(((x + 1) << 1) + m - 2, 7));
}

/// Byte offset of the E8M0 scales in an mxfp4 panel for K inputs, and the panel's bytes.
constexpr index_t mxfp4_scale_offset(index_t K) { return ((K + 1) / 2 * 32 + 63) / 64 * 64; }
constexpr index_t mxfp4_panel_bytes(index_t K) {
  return (mxfp4_scale_offset(K) + (K + 31) / 32 * 32 + 63) / 64 * 64;
}

/// Checks a checkpoint's E8M0 scales [N, ceil(K / 32)] (config_error naming the rule): 0xff
/// is NaN, and 253 or 254 put a block's values past fp32's range.
inline void mxfp4_check(matrix_view<const std::uint8_t> scales) {
  for (index_t n = 0; n < scales.rows; ++n)
    for (index_t b = 0; b < scales.cols; ++b)
      if (scales(n, b) > 252)
        throw config_error("pack_weights(mxfp4).scales",
                           "[" + std::to_string(n) + ", " + std::to_string(b) +
                               "] = " + std::to_string(int{scales(n, b)}),
                           "E8M0 0xff is NaN and 253, 254 overflow fp32 (6 * 2^126): the "
                           "format takes at most 252");
}

namespace detail {

// Packs columns [j0, j0 + cols) into one panel: block(n, b, codes) writes the E2M1 codes of
// row n's inputs [32 b, min(K, 32 b + 32)) to codes and returns their E8M0 scale.
template <class Block>
inline void pack_mxfp4_panel(std::byte* out, index_t K, index_t cols, index_t j0, Block&& block) {
  std::fill_n(out, mxfp4_panel_bytes(K), std::byte{0});
  auto* q = reinterpret_cast<std::uint8_t*>(out);
  std::uint8_t* e = q + mxfp4_scale_offset(K);
  std::uint8_t codes[32];
  for (index_t j = 0; j < cols; ++j)
    for (index_t b = 0; b < (K + 31) / 32; ++b) {
      e[b * 32 + j] = block(j0 + j, b, codes);
      for (index_t k = 32 * b; k < std::min(K, 32 * b + 32); ++k)
        q[k / 2 * 32 + j] |= static_cast<std::uint8_t>((codes[k - 32 * b] & 15) << (4 * (k % 2)));
    }
}

// Quantises fp32 rows [j0, j0 + cols) of b into one panel (the OCP rule per block of 32).
inline void quantise_mxfp4_panel(std::byte* out, matrix_view<const float> b, index_t j0,
                                 index_t cols) {
  pack_mxfp4_panel(out, b.cols, cols, j0, [&](index_t n, index_t bl, std::uint8_t* codes) {
    const index_t k0 = 32 * bl, k1 = std::min(b.cols, k0 + 32);
    float amax = 0;
    for (index_t k = k0; k < k1; ++k) {
      if (!std::isfinite(b(n, k)))
        throw config_error("pack_weights(mxfp4)", "output channel " + std::to_string(n),
                           "holds NaN or Inf, which the format refuses (E2M1 has neither)");
      amax = std::max(amax, std::abs(b(n, k)));
    }
    const std::uint8_t e = mxfp4_scale(amax);
    for (index_t k = k0; k < k1; ++k) codes[k - k0] = e2m1_code(b(n, k), e);
    return e;
  });
}

// The panel's values as fp32 (code value * 2^(e - 127), exact) into out (column j at out + j
// * ldo), columns [0, cols).
inline void unpack_mxfp4_panel(const std::byte* panel, index_t K, index_t cols, float* out,
                               index_t ldo) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const std::uint8_t* e = q + mxfp4_scale_offset(K);
  for (index_t j = 0; j < cols; ++j)
    for (index_t k = 0; k < K; ++k)
      out[j * ldo + k] =
          e2m1_float(static_cast<std::uint8_t>(q[k / 2 * 32 + j] >> (4 * (k % 2)) & 15)) *
          e8m0_float(e[k / 32 * 32 + j]);
}

// Portable: per input, the weight (value * scale, exact) times x, summed in fp32.
inline void mxfp4_panel_portable(matrix_view<const float> a, const std::byte* panel, index_t K,
                                 float* c, index_t ldc, index_t cols) {
  constexpr index_t W = panel_width;
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const std::uint8_t* e = q + mxfp4_scale_offset(K);
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const std::uint8_t *pair = q + k / 2 * 32, *scale = e + k / 32 * 32;
      const float v = x[k];
      for (index_t j = 0; j < W; ++j)
        acc[j] += v * (e2m1_float(static_cast<std::uint8_t>(pair[j] >> (4 * (k % 2)) & 15)) *
                       e8m0_float(scale[j]));
    }
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j];
  }
}

#if defined(EPMOE_HOST_PACKED_X86)
// 16 E8M0 bytes -> 2^(e - 127) as fp32 (e = 0: 2^-127, a subnormal).
__attribute__((target("avx512f"), always_inline)) inline __m512 e8m0_avx512(const std::uint8_t* e) {
  const __m512i v =
      _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i bits = _mm512_maskz_slli_epi32(0xFFFF, v, 23);
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(bits, _mm512_testn_epi32_mask(v, v), _mm512_set1_epi32(0x00400000)));
}

// AVX-512: MR rows (<= 12) x 32 columns; per pair 16 bytes -> 16 columns' two inputs by
// vpermps over the 16 values (index: the low nibble; the high one shifted down).
template <int MR>
__attribute__((target("avx512f"))) inline void mxfp4_rows_avx512(const float* a, index_t lda,
                                                                 const std::uint8_t* q,
                                                                 const std::uint8_t* e, index_t K,
                                                                 float* c, index_t ldc,
                                                                 __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  const __m512 table = _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f,
                                      -1.5f, -2.f, -3.f, -4.f, -6.f);
  const index_t pairs = (K + 1) / 2;
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  for (index_t p = 0; p < pairs; ++p) {
    if (p % 16 == 0) s0 = e8m0_avx512(e + p / 16 * 32), s1 = e8m0_avx512(e + p / 16 * 32 + 16);
    const auto* pair = reinterpret_cast<const __m128i*>(q + 32 * p);
    const __m512i d0 = _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_load_si128(pair));
    const __m512i d1 = _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_load_si128(pair + 1));
    const __m512 e0 = _mm512_mul_ps(_mm512_maskz_permutexvar_ps(0xFFFF, d0, table), s0);
    const __m512 e1 = _mm512_mul_ps(_mm512_maskz_permutexvar_ps(0xFFFF, d1, table), s1);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p]);
      lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
    }
    if (2 * p + 1 == K) break;
    const __m512 o0 = _mm512_mul_ps(
        _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, d0, 4), table), s0);
    const __m512 o1 = _mm512_mul_ps(
        _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, d1, 4), table), s1);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p + 1]);
      lo[i] = _mm512_fmadd_ps(x, o0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, o1, hi[i]);
    }
  }
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

__attribute__((target("avx512f"))) inline void mxfp4_panel_avx512(matrix_view<const float> a,
                                                                  const std::byte* panel, index_t K,
                                                                  float* c, index_t ldc,
                                                                  index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  row_blocks<12>(a.rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      mxfp4_rows_avx512<MR>(a.row(i), a.stride, q, q + mxfp4_scale_offset(K), K, c + i * ldc, ldc,
                            m0, m1);
    });
  });
}

// AVX2: 8 columns' codes (the low nibbles of d) -> fp32: magnitude by vpermps (3 index bits),
// the sign from bit 3.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 e2m1_avx2(__m256i d) {
  const __m256 mag = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(d, 28), _mm256_set1_epi32(INT32_MIN));
  return _mm256_or_ps(_mm256_permutevar8x32_ps(mag, d), _mm256_castsi256_ps(sign));
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 e8m0_avx2(const std::uint8_t* e) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e)));
  const __m256i zero = _mm256_cmpeq_epi32(v, _mm256_setzero_si256());
  return _mm256_castsi256_ps(
      _mm256_blendv_epi8(_mm256_slli_epi32(v, 23), _mm256_set1_epi32(0x00400000), zero));
}

// MR rows (<= 4) x one half (16 columns: bytes [16 h, 16 h + 16) of a pair).
template <int MR>
__attribute__((target("avx2,fma"))) inline void mxfp4_rows_avx2(const float* a, index_t lda,
                                                                const std::uint8_t* q,
                                                                const std::uint8_t* e, index_t K,
                                                                float* c, index_t ldc,
                                                                index_t cols) {
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  const index_t pairs = (K + 1) / 2;
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (index_t p = 0; p < pairs; ++p) {
    if (p % 16 == 0) s0 = e8m0_avx2(e + p / 16 * 32), s1 = e8m0_avx2(e + p / 16 * 32 + 8);
    const auto* pair = reinterpret_cast<const __m128i*>(q + 32 * p);
    const __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(pair));
    const __m256i d1 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 32 * p + 8)));
    const __m256 e0 = _mm256_mul_ps(e2m1_avx2(d0), s0), e1 = _mm256_mul_ps(e2m1_avx2(d1), s1);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + 2 * p);
      lo[i] = _mm256_fmadd_ps(x, e0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, e1, hi[i]);
    }
    if (2 * p + 1 == K) break;
    const __m256 o0 = _mm256_mul_ps(e2m1_avx2(_mm256_srli_epi32(d0, 4)), s0);
    const __m256 o1 = _mm256_mul_ps(e2m1_avx2(_mm256_srli_epi32(d1, 4)), s1);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + 2 * p + 1);
      lo[i] = _mm256_fmadd_ps(x, o0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, o1, hi[i]);
    }
  }
  store_rows_avx2<MR>(c, ldc, cols, lo, hi);
}

__attribute__((target("avx2,fma"))) inline void mxfp4_panel_avx2(matrix_view<const float> a,
                                                                 const std::byte* panel, index_t K,
                                                                 float* c, index_t ldc,
                                                                 index_t cols) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  for (index_t h = 0; h < 2 && 16 * h < cols; ++h) {
    const index_t n = std::min<index_t>(16, cols - 16 * h);
    row_blocks<4>(a.rows, [&](index_t i, index_t m) {
      with_rows<4>(m, [&]<int MR>() {
        mxfp4_rows_avx2<MR>(a.row(i), a.stride, q + 16 * h, q + mxfp4_scale_offset(K) + 16 * h, K,
                            c + i * ldc + 16 * h, ldc, n);
      });
    });
  }
}

// AVX512-BF16: 16 bytes (16 columns' two codes) -> 16 bf16 pairs: each byte widened to a
// dword b, b * 4097 puts the low nibble in the low word and the high nibble in the high one
// (vpmaddwd), and vpermw looks both up in the 16 values' bf16 bits (twice over: index bit 4
// is the high nibble's bit 0). Scales: each column's per block of 16 pairs.
struct mxfp4_to_bf16 {
  const std::uint8_t *q, *e;
  __m512i values, times;

  __attribute__((target("avx512f,avx512bw")))
  mxfp4_to_bf16(const std::uint8_t* codes, const std::uint8_t* scales)
      : q(codes), e(scales) {
    const __m512i table = _mm512_set4_epi32(0x40c04080, 0x40404000, 0x3fc03f80, 0x3f000000);
    const __m512i signs = _mm512_set1_epi32(static_cast<int>(0x80008000u));
    values = _mm512_mask_or_epi32(table, 0xF0F0, table, signs);  // words 8..15: negative
    times = _mm512_set1_epi32(4097);
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) __m512i pairs(
      const std::uint8_t* bytes) const {
    const __m512i d = _mm512_maskz_cvtepu8_epi32(
        0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    return _mm512_permutexvar_epi16(_mm512_madd_epi16(d, times), values);
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) void operator()(index_t p, __m512i& w0,
                                                                             __m512i& w1) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + 32 * p + minifloat_prefetch), _MM_HINT_T0);
    w0 = pairs(q + 32 * p);
    w1 = pairs(q + 32 * p + 16);
  }
  __attribute__((target("avx512f"), always_inline)) void scales(index_t block, __m512& s0,
                                                                __m512& s1) const {
    s0 = e8m0_avx512(e + block * 32), s1 = e8m0_avx512(e + block * 32 + 16);
  }
};

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) inline void mxfp4_panel_bf16(
    converted_rows a, index_t rows, const std::byte* panel, index_t K, float* c, index_t ldc,
    index_t cols) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const mxfp4_to_bf16 convert(q, q + mxfp4_scale_offset(K));
  minifloat_panel_bf16<16>(a, rows, convert, K, c, ldc, cols);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline void mxfp4_panel_vbmi(
    matrix_view<const float> a, const std::byte* panel, index_t K, float* c, index_t ldc,
    index_t cols) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const mxfp4_to_bf16 convert(q, q + mxfp4_scale_offset(K));
  minifloat_panel_fma<16>(a, convert, K, c, ldc, cols);
}
#endif

// c rows [0, a.rows) x columns [0, cols) of one mxfp4 panel on `kernel` (a16 as fp8_panel's).
inline void mxfp4_panel(matrix_view<const float> a, converted_rows a16, const std::byte* panel,
                        index_t K, float* c, index_t ldc, index_t cols, minifloat_kernel kernel) {
#if defined(EPMOE_HOST_PACKED_X86)
  if (kernel == minifloat_kernel::avx512_bf16)
    return mxfp4_panel_bf16(a16, a.rows, panel, K, c, ldc, cols);
  if (kernel == minifloat_kernel::avx512_vbmi) return mxfp4_panel_vbmi(a, panel, K, c, ldc, cols);
  if (kernel == minifloat_kernel::avx512) return mxfp4_panel_avx512(a, panel, K, c, ldc, cols);
  if (kernel == minifloat_kernel::avx2) return mxfp4_panel_avx2(a, panel, K, c, ldc, cols);
#endif
  (void)a16, (void)kernel;
  mxfp4_panel_portable(a, panel, K, c, ldc, cols);
}

}  // namespace detail

}  // namespace epmoe::space
