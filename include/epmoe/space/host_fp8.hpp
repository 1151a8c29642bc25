// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// weights_format::fp8_block on the host (docs/quantisation.md): FP8 e4m3fn weights with one
// fp32 scale per 128 x 128 block (w = fp8 * scale_inv, as DeepSeek-V3's checkpoints), how a
// packed_nt panel holds them, the quantisation from fp32, and the micro-kernels, chosen at
// run time (minifloat_kernel): with VBMI each fp8 byte becomes bf16 in registers (two
// 128-entry byte lookups, vpermi2b), for dot products with the tokens as bf16 pairs on
// AVX512-BF16, else widened to fp32 by a shift or a mask for fp32 FMAs; the block's scale
// applied to the block's fp32 sums. Elsewhere fp8 -> fp16 by shifts -> fp32 (vcvtph2ps,
// exact for subnormals whatever MXCSR says), times the scale, fp32 FMA.
//
// A panel of 32 output columns (one 128-row block: the panels start at multiples of 32):
// ceil(K / 2) pairs of 64 bytes, pair p holding column j's inputs 2p and 2p + 1 at
// fp8_lane(j, 0 | 1), the order vpunpck{l,h}bw turns into bf16 pairs (past K, past N: 0x00);
// then ceil(K / 128) fp32 scales, one per block of 128 inputs.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/space/host_minifloat_kernels.hpp"
#include "epmoe/space/host_packed_kernels.hpp"

namespace epmoe::space {

/// e4m3fn bits -> fp32, exactly: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
/// is subnormal (m * 2^-9); 0x7f and 0xff are NaN (the format has no infinity).
constexpr float e4m3_float(std::uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = (b & 0x7f) == 0x7f ? std::bit_cast<float>(0x7fc00000u)
                  : e == 0           ? static_cast<float>(m) * 0x1p-9f
                           : std::bit_cast<float>(std::uint32_t((e + 120) << 23 | m << 20));
  return b & 0x80 ? -v : v;
}

/// fp32 -> e4m3fn bits, rounded to nearest even, saturating at ±448; v finite. The sign is
/// kept (-0 and values rounding to zero from below give 0x80).
inline std::uint8_t e4m3_bits(float v) {
  const auto s = static_cast<std::uint8_t>(std::signbit(v) ? 0x80 : 0);
  const float a = std::abs(v);
  if (a >= 464.f) return s | 0x7e;  // past the midpoint of 448 and (NaN's) 480
  if (a < 0x1p-6f)                  // subnormal: m * 2^-9 (m = 8 is the smallest normal, code 8)
    return s | static_cast<std::uint8_t>(std::nearbyint(a * 0x1p9f));
  const int e = std::ilogb(a);                                            // -6 .. 8
  const auto m = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - e)));  // 8 .. 16
  return s | static_cast<std::uint8_t>(std::min(((e + 7) << 3) + m - 8, 0x7e));
}

/// Column j's input of parity t (0: 2p, 1: 2p + 1) in a pair's 64 bytes.
constexpr index_t fp8_lane(index_t j, index_t t) {
  const index_t w = 2 * (j & 15) + t;  // its word in the bf16 pairs of columns [16 h, 16 h + 16)
  return 16 * (w >> 3) + 8 * (j >> 4) + (w & 7);
}

/// Bytes of one fp8 panel for K inputs (pairs, then the blocks' scales; 64-byte multiple).
constexpr index_t fp8_panel_bytes(index_t K) {
  return ((K + 1) / 2 * 64 + (K + 127) / 128 * 4 + 63) / 64 * 64;
}

/// The format's block scales of fp32 weights b [N, K]: out [ceil(N / 128), ceil(K / 128)],
/// max |w| over the block / 448 (fp32; 0 for a zero block). NaN or ±Inf throws config_error
/// naming the output channel.
inline void fp8_block_scales(matrix_view<const float> b, std::vector<float>& out) {
  const index_t kb = (b.cols + 127) / 128;
  out.assign(static_cast<std::size_t>((b.rows + 127) / 128 * kb), 0.f);
  for (index_t n = 0; n < b.rows; ++n)
    for (index_t k = 0; k < b.cols; ++k) {
      const float w = b(n, k);
      if (!std::isfinite(w))
        throw config_error("pack_weights(fp8_block)", "output channel " + std::to_string(n),
                           "holds NaN or Inf, which the format refuses (e4m3fn has no "
                           "infinity, and its NaN would spread over the block)");
      float& s = out[static_cast<std::size_t>(n / 128 * kb + k / 128)];
      s = std::max(s, std::abs(w));
    }
  for (float& s : out) s /= 448.f;
}

/// Checks a checkpoint's fp8 codes and block scales (config_error naming the rule): no NaN
/// code (0x7f, 0xff); every scale finite, >= 0 and small enough that 448 * scale is finite.
inline void fp8_check(matrix_view<const std::uint8_t> q, const float* scale_inv) {
  for (index_t n = 0; n < q.rows; ++n)
    for (index_t k = 0; k < q.cols; ++k)
      if ((q(n, k) & 0x7f) == 0x7f)
        throw config_error("pack_weights(fp8_block)",
                           "weight [" + std::to_string(n) + ", " + std::to_string(k) + "]",
                           "is an e4m3fn NaN (0x7f or 0xff): the format refuses NaN weights");
  const index_t blocks = (q.rows + 127) / 128 * ((q.cols + 127) / 128);
  for (index_t i = 0; i < blocks; ++i)
    epmoe::detail::require(
        std::isfinite(scale_inv[i]) && scale_inv[i] >= 0 && scale_inv[i] <= 3.4028234e38f / 448,
        "pack_weights(fp8_block).scale_inv", scale_inv[i],
        "a block's scale must be finite, >= 0 and at most FLT_MAX / 448");
}

namespace detail {

// Packs columns [j0, j0 + cols) into one panel: code(n, k) their e4m3fn bytes, scales the
// ceil(K / 128) scales of their row block.
template <class Code>
inline void pack_fp8_panel(std::byte* out, index_t K, index_t cols, index_t j0, Code&& code,
                           const float* scales) {
  std::fill_n(out, fp8_panel_bytes(K), std::byte{0});
  auto* q = reinterpret_cast<std::uint8_t*>(out);
  for (index_t j = 0; j < cols; ++j)
    for (index_t k = 0; k < K; ++k) q[k / 2 * 64 + fp8_lane(j, k % 2)] = code(j0 + j, k);
  std::memcpy(out + (K + 1) / 2 * 64, scales, static_cast<std::size_t>((K + 127) / 128) * 4);
}

// The panel's values as fp32 (value * scale, one rounding) into out (column j at out + j *
// ldo), columns [0, cols).
inline void unpack_fp8_panel(const std::byte* panel, index_t K, index_t cols, float* out,
                             index_t ldo) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const auto* s = reinterpret_cast<const float*>(panel + (K + 1) / 2 * 64);
  for (index_t j = 0; j < cols; ++j)
    for (index_t k = 0; k < K; ++k)
      out[j * ldo + k] = e4m3_float(q[k / 2 * 64 + fp8_lane(j, k % 2)]) * s[k / 128];
}

// The 256 values, for the portable kernel.
inline constexpr std::array<float, 256> e4m3_values = [] {
  std::array<float, 256> v{};
  for (int b = 0; b < 256; ++b) v[std::size_t(b)] = e4m3_float(static_cast<std::uint8_t>(b));
  return v;
}();

// Portable: per input, the weight (value * block scale, fp32) times x, summed in fp32.
inline void fp8_panel_portable(matrix_view<const float> a, const std::byte* panel, index_t K,
                               float* c, index_t ldc, index_t cols) {
  constexpr index_t W = panel_width;
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const auto* s = reinterpret_cast<const float*>(panel + (K + 1) / 2 * 64);
  for (index_t i = 0; i < a.rows; ++i) {
    float acc[W] = {};
    const float* x = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const std::uint8_t* pair = q + k / 2 * 64;
      const float v = x[k], scale = s[k / 128];
      for (index_t j = 0; j < W; ++j) acc[j] += v * (e4m3_values[pair[fp8_lane(j, k % 2)]] * scale);
    }
    for (index_t j = 0; j < cols; ++j) c[i * ldc + j] = acc[j];
  }
}

#if defined(EPMOE_HOST_PACKED_X86)
// Words holding an fp8 byte in their high half -> fp16 of value * 2^-8 (the sign to bit 15 and
// 14, bit 14 cleared: e4m3's exponent and mantissa land on fp16's; subnormals stay exact).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i fp8_half_avx512(
    __m512i t) {
  return _mm512_maskz_and_epi32(0xFFFF, _mm512_maskz_srai_epi16(~0u, t, 1),
                                _mm512_set1_epi16(static_cast<short>(0xBFFF)));
}

// One pair of 32 columns (its 64 bytes) as fp32 * 2^-8 * scale: e0/o0 columns 0..15 of input
// 2p / 2p + 1, e1/o1 columns 16..31.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void fp8_pair_avx512(
    const std::uint8_t* pair, __m512 s, __m512& e0, __m512& o0, __m512& e1, __m512& o1) {
  const __m512i c8 = _mm512_load_si512(pair), zero = _mm512_setzero_si512();
  const __m512i h0 = fp8_half_avx512(_mm512_unpacklo_epi8(zero, c8));
  const __m512i h1 = fp8_half_avx512(_mm512_unpackhi_epi8(zero, c8));
  const __m512i g0 = _mm512_maskz_srli_epi32(0xFFFF, h0, 16);  // odd inputs: the high words
  const __m512i g1 = _mm512_maskz_srli_epi32(0xFFFF, h1, 16);
  e0 = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, _mm512_maskz_cvtepi32_epi16(0xFFFF, h0)), s);
  o0 = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, _mm512_maskz_cvtepi32_epi16(0xFFFF, g0)), s);
  e1 = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, _mm512_maskz_cvtepi32_epi16(0xFFFF, h1)), s);
  o1 = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xFFFF, _mm512_maskz_cvtepi32_epi16(0xFFFF, g1)), s);
}

// AVX-512: MR rows (<= 12) x 32 columns, fp32 FMA; the sums times 2^8 at the end.
template <int MR>
__attribute__((target("avx512f,avx512bw"))) inline void fp8_rows_avx512(
    const float* a, index_t lda, const std::uint8_t* q, const float* scales, index_t K, float* c,
    index_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  const index_t pairs = (K + 1) / 2;
  for (index_t p = 0; p < pairs; ++p) {
    __m512 e0, o0, e1, o1;
    fp8_pair_avx512(q + 64 * p, _mm512_set1_ps(scales[p / 64]), e0, o0, e1, o1);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p]);
      lo[i] = _mm512_fmadd_ps(x, e0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, e1, hi[i]);
    }
    if (2 * p + 1 == K) break;  // (a has no input K)
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + 2 * p + 1]);
      lo[i] = _mm512_fmadd_ps(x, o0, lo[i]);
      hi[i] = _mm512_fmadd_ps(x, o1, hi[i]);
    }
  }
  const __m512 up = _mm512_set1_ps(0x1p8f);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = _mm512_mul_ps(lo[i], up), hi[i] = _mm512_mul_ps(hi[i], up);
  store_rows_avx512<MR>(c, ldc, m0, m1, lo, hi);
}

__attribute__((target("avx512f,avx512bw"))) inline void fp8_panel_avx512(matrix_view<const float> a,
                                                                         const std::byte* panel,
                                                                         index_t K, float* c,
                                                                         index_t ldc,
                                                                         index_t cols) {
  const __mmask16 m0 = column_mask(cols), m1 = column_mask(cols - 16);
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const auto* s = reinterpret_cast<const float*>(panel + (K + 1) / 2 * 64);
  row_blocks<12>(a.rows, [&](index_t i, index_t n) {
    with_rows<12>(n, [&]<int MR>() {
      fp8_rows_avx512<MR>(a.row(i), a.stride, q, s, K, c + i * ldc, ldc, m0, m1);
    });
  });
}

// AVX2: one half (16 columns) of a pair as fp32 * 2^-8 * scale, inputs 2p (e) and 2p + 1 (o),
// columns 0..7 and 8..15 of the half. Half h's words: vpunpck{l,h}bw of the pair's two 32-byte
// halves (columns 16h + 0..7, then 16h + 8..15), even / odd split by a pack and a permute.
template <int H>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void fp8_half_pair_avx2(
    const std::uint8_t* pair, __m256 s, __m256& e0, __m256& e1, __m256& o0, __m256& o1) {
  const __m256i ca = _mm256_load_si256(reinterpret_cast<const __m256i*>(pair));
  const __m256i cb = _mm256_load_si256(reinterpret_cast<const __m256i*>(pair + 32));
  const __m256i zero = _mm256_setzero_si256(), keep = _mm256_set1_epi16(static_cast<short>(0xBFFF));
  const __m256i ta = H == 0 ? _mm256_unpacklo_epi8(zero, ca) : _mm256_unpackhi_epi8(zero, ca);
  const __m256i tb = H == 0 ? _mm256_unpacklo_epi8(zero, cb) : _mm256_unpackhi_epi8(zero, cb);
  const __m256i ha = _mm256_and_si256(_mm256_srai_epi16(ta, 1), keep);
  const __m256i hb = _mm256_and_si256(_mm256_srai_epi16(tb, 1), keep);
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  const __m256i ev = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(ha, low), _mm256_and_si256(hb, low)), 0xD8);
  const __m256i od = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_srli_epi32(ha, 16), _mm256_srli_epi32(hb, 16)), 0xD8);
  e0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(ev)), s);
  e1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(ev, 1)), s);
  o0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(od)), s);
  o1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(od, 1)), s);
}

template <int MR, int H>
__attribute__((target("avx2,fma,f16c"))) inline void fp8_rows_avx2(const float* a, index_t lda,
                                                                   const std::uint8_t* q,
                                                                   const float* scales, index_t K,
                                                                   float* c, index_t ldc,
                                                                   index_t cols) {
  __m256 lo[MR], hi[MR];
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  const index_t pairs = (K + 1) / 2;
  for (index_t p = 0; p < pairs; ++p) {
    __m256 e0, e1, o0, o1;
    fp8_half_pair_avx2<H>(q + 64 * p, _mm256_set1_ps(scales[p / 64]), e0, e1, o0, o1);
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + 2 * p);
      lo[i] = _mm256_fmadd_ps(x, e0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, e1, hi[i]);
    }
    if (2 * p + 1 == K) break;
    EPMOE_PACKED_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + 2 * p + 1);
      lo[i] = _mm256_fmadd_ps(x, o0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, o1, hi[i]);
    }
  }
  const __m256 up = _mm256_set1_ps(0x1p8f);
  EPMOE_PACKED_UNROLL
  for (int i = 0; i < MR; ++i) lo[i] = _mm256_mul_ps(lo[i], up), hi[i] = _mm256_mul_ps(hi[i], up);
  store_rows_avx2<MR>(c, ldc, cols, lo, hi);
}

__attribute__((target("avx2,fma,f16c"))) inline void fp8_panel_avx2(matrix_view<const float> a,
                                                                    const std::byte* panel,
                                                                    index_t K, float* c,
                                                                    index_t ldc, index_t cols) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const auto* s = reinterpret_cast<const float*>(panel + (K + 1) / 2 * 64);
  const auto half = [&]<int H>() {
    const index_t n = std::min<index_t>(16, cols - 16 * H);
    row_blocks<4>(a.rows, [&](index_t i, index_t m) {
      with_rows<4>(m, [&]<int MR>() {
        fp8_rows_avx2<MR, H>(a.row(i), a.stride, q, s, K, c + i * ldc + 16 * H, ldc, n);
      });
    });
  };
  half.template operator()<0>();
  if (cols > 16) half.template operator()<1>();
}

// AVX512-VBMI: the bf16 bits of e4m3fn magnitude m (0..127) as two byte tables of 128
// entries (hi: sign clear; lo), looked up with vpermi2b (index bits 0..6; bit 7, the sign,
// is ORed into the high byte).
inline constexpr auto fp8_bf16_bytes = [] {
  std::array<std::uint8_t, 256> t{};  // [0, 128): high bytes; [128, 256): low bytes
  for (int m = 0; m < 128; ++m) {
    const auto u = std::bit_cast<std::uint32_t>(e4m3_float(static_cast<std::uint8_t>(m)));
    t[std::size_t(m)] = static_cast<std::uint8_t>(u >> 24);
    t[std::size_t(128 + m)] = static_cast<std::uint8_t>(u >> 16);
  }
  return t;
}();

// fp8 pairs -> bf16 pairs: one load, two lookups, an OR (the sign) and two unpacks; one
// scale per block of 64 pairs.
struct fp8_to_bf16 {
  const std::uint8_t* q;
  const float* block_scales;
  __m512i hi0, hi1, lo0, lo1, sign;

  __attribute__((target("avx512f,avx512bw,avx512vbmi")))
  fp8_to_bf16(const std::uint8_t* codes, const float* scales)
      : q(codes), block_scales(scales) {
    const std::uint8_t* t = fp8_bf16_bytes.data();
    hi0 = _mm512_loadu_si512(t), hi1 = _mm512_loadu_si512(t + 64);
    lo0 = _mm512_loadu_si512(t + 128), lo1 = _mm512_loadu_si512(t + 192);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  __attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) void operator()(
      index_t p, __m512i& w0, __m512i& w1) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + 64 * p + minifloat_prefetch), _MM_HINT_T0);
    const __m512i c8 = _mm512_load_si512(q + 64 * p);
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c8, hi1), c8, sign,
                                                0xF8);  // table | (c8 & sign)
    const __m512i l = _mm512_permutex2var_epi8(lo0, c8, lo1);
    w0 = _mm512_unpacklo_epi8(l, h);
    w1 = _mm512_unpackhi_epi8(l, h);
  }
  __attribute__((target("avx512f"), always_inline)) void scales(index_t block, __m512& s0,
                                                                __m512& s1) const {
    s0 = s1 = _mm512_set1_ps(block_scales[block]);
  }
};

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) inline void fp8_panel_bf16(
    converted_rows a, index_t rows, const std::byte* panel, index_t K, float* c, index_t ldc,
    index_t cols) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const fp8_to_bf16 convert(q, reinterpret_cast<const float*>(panel + (K + 1) / 2 * 64));
  minifloat_panel_bf16<64>(a, rows, convert, K, c, ldc, cols);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline void fp8_panel_vbmi(
    matrix_view<const float> a, const std::byte* panel, index_t K, float* c, index_t ldc,
    index_t cols) {
  const auto* q = reinterpret_cast<const std::uint8_t*>(panel);
  const fp8_to_bf16 convert(q, reinterpret_cast<const float*>(panel + (K + 1) / 2 * 64));
  minifloat_panel_fma<64>(a, convert, K, c, ldc, cols);
}
#endif

// c rows [0, a.rows) x columns [0, cols) of one fp8 panel on `kernel` (a16: a as bf16 pairs,
// read by avx512_bf16).
inline void fp8_panel(matrix_view<const float> a, converted_rows a16, const std::byte* panel,
                      index_t K, float* c, index_t ldc, index_t cols, minifloat_kernel kernel) {
#if defined(EPMOE_HOST_PACKED_X86)
  if (kernel == minifloat_kernel::avx512_bf16)
    return fp8_panel_bf16(a16, a.rows, panel, K, c, ldc, cols);
  if (kernel == minifloat_kernel::avx512_vbmi) return fp8_panel_vbmi(a, panel, K, c, ldc, cols);
  if (kernel == minifloat_kernel::avx512) return fp8_panel_avx512(a, panel, K, c, ldc, cols);
  if (kernel == minifloat_kernel::avx2) return fp8_panel_avx2(a, panel, K, c, ldc, cols);
#endif
  (void)a16, (void)kernel;
  fp8_panel_portable(a, panel, K, c, ldc, cols);
}

}  // namespace detail

}  // namespace epmoe::space
