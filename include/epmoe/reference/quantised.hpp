// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The quantised weight formats' definitions, written once as plain scalar code (issue 37):
// quantise, dequantise, then a double-precision loop. Every kernel path of a format is tested
// against these (tests/expert/test_int8.cpp, test_minifloat.cpp); docs/quantisation.md
// states them in prose.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "epmoe/core/options.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::reference {

/// int8_channel weights [N, K]: q[n, k] in [-127, 127] (pre-quantised ones may hold -128),
/// w[n, k] = scale[n] * q[n, k].
struct int8_channel {
  index_t rows = 0, cols = 0;
  std::vector<std::int8_t> q;  // [N, K] row-major
  std::vector<float> scale;    // [N]

  /// The format's quantisation of fp32 weights: per output channel n, scale = max_k |w| / 127
  /// (fp32 division), q = w / scale (fp32 division) rounded half to even, clamped to
  /// [-127, 127]; a channel whose scale is 0 (zeros, or a max below 127 denormals: the scale
  /// underflows) has q 0. (NaN and Inf are refused by the packer; not defined here.)
  static int8_channel quantise(matrix_view<const float> w) {
    int8_channel out{w.rows, w.cols, std::vector<std::int8_t>(std::size_t(w.rows * w.cols)),
                     std::vector<float>(std::size_t(w.rows))};
    for (index_t n = 0; n < w.rows; ++n) {
      float amax = 0;
      for (index_t k = 0; k < w.cols; ++k) amax = std::max(amax, std::abs(w(n, k)));
      const float s = amax / 127.f;
      out.scale[std::size_t(n)] = s;
      for (index_t k = 0; k < w.cols; ++k)
        out.q[std::size_t(n * w.cols + k)] =
            s > 0
                ? static_cast<std::int8_t>(std::clamp(std::nearbyint(w(n, k) / s), -127.f, 127.f))
                : 0;
    }
    return out;
  }
  double value(index_t n, index_t k) const {
    return double{scale[std::size_t(n)]} * q[std::size_t(n * cols + k)];
  }
};

/// One activation row quantised per token (W8A8): scale = max |x| / 127, q = x * (127 /
/// max |x|) (both fp32) rounded half to even; the row's values are scale * q. A zero row stays
/// zero, and so does a row whose 127 / max |x| overflows fp32 (max |x| < 127 / FLT_MAX, about
/// 3.7e-37: its products are below any output's rounding); a row holding NaN or ±Inf is all
/// NaN.
inline std::vector<double> int8_token(const float* x, index_t K) {
  float amax = 0;
  bool finite = true;
  for (index_t k = 0; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::abs(x[k]));
  }
  std::vector<double> out(std::size_t(K), finite ? 0.0 : NAN);
  const float inv = amax > 0 ? 127.f / amax : 0.f, s = amax / 127.f;
  if (!finite || !std::isfinite(inv) || inv == 0) return out;
  for (index_t k = 0; k < K; ++k) out[std::size_t(k)] = double{s} * std::nearbyint(x[k] * inv);
  return out;
}

/// c[M, N] = a[M, K] wᵀ over int8_channel weights, in double: W8A16 (a as it is) or, with
/// `a8`, W8A8 (each row of a quantised per token, int8_token). Also returns, per element,
/// Σ_k |a w| (the magnitude a rounding bound scales with) in `mag`.
inline std::vector<double> gemm_int8(matrix_view<const float> a, const int8_channel& w, bool a8,
                                     std::vector<double>* mag = nullptr) {
  const index_t M = a.rows, N = w.rows, K = w.cols;
  std::vector<double> c(std::size_t(M * N));
  if (mag) mag->assign(c.size(), 0.0);
  for (index_t i = 0; i < M; ++i) {
    std::vector<double> x(static_cast<std::size_t>(K));
    if (a8)
      x = int8_token(a.row(i), K);
    else
      for (index_t k = 0; k < K; ++k) x[std::size_t(k)] = a(i, k);
    for (index_t n = 0; n < N; ++n) {
      double s = 0, m = 0;
      for (index_t k = 0; k < K; ++k) {
        const double p = x[std::size_t(k)] * w.value(n, k);
        s += p;
        m += std::abs(p);
      }
      c[std::size_t(i * N + n)] = s;
      if (mag) (*mag)[std::size_t(i * N + n)] = m;
    }
  }
  return c;
}

/// Group-wise weights [N, K] (weights_format int4, int4_asym, int8_group): along each row,
/// groups of `group` inputs (the last one holds K mod group when that is not 0), each with an
/// fp32 scale s (and an fp32 offset m: int4_asym), w[n, k] = s q[n, k] + m (m = 0 but for
/// int4_asym). q: int4 in [-8, 7], int4_asym in [0, 15], int8_group in [-128, 127].
struct group_weights {
  weights_format format;
  index_t rows = 0, cols = 0;
  std::vector<std::int8_t> q;        // [N, K] row-major
  std::vector<float> scale, offset;  // [N, G] row-major (offset: int4_asym; else zeros)

  index_t groups() const { return (cols + format.group - 1) / format.group; }
  float s(index_t n, index_t k) const {
    return scale[std::size_t(n * groups() + k / format.group)];
  }
  float m(index_t n, index_t k) const {
    return offset[std::size_t(n * groups() + k / format.group)];
  }
  /// The format's quantisation of fp32 weights, per group of a row (over its real inputs):
  /// int4: s = max |w| / 7.5 (fp32), q = round-half-even(w / s) (fp32) clamped to [-8, 7]
  ///   (|w - s q| <= s / 2: +max|w| gives 7.5, rounded to 8, clamped to 7);
  /// int4_asym: lo = min w, hi = max w, s = (hi - lo) / 15 and q = round-half-even((w - lo) /
  ///   s) clamped to [0, 15] (both in double, s then rounded to fp32), m = lo (a group of
  ///   equal values: s = 0, q = 0, m = that value);
  /// int8_group: s = max |w| / 127, q = round-half-even(w / s) clamped to [-127, 127] (fp32);
  /// a group whose s is 0 (zeros, or a max so small that s underflows) has q = 0. (NaN and Inf
  /// are refused by the packer.)
  static group_weights quantise(matrix_view<const float> w, weights_format f) {
    group_weights out{f, w.rows, w.cols, {}, {}, {}};
    const index_t K = w.cols, g = f.group, G = out.groups();
    out.q.assign(std::size_t(w.rows * K), 0);
    out.scale.assign(std::size_t(w.rows * G), 0.f);
    out.offset.assign(std::size_t(w.rows * G), 0.f);
    for (index_t n = 0; n < w.rows; ++n)
      for (index_t t = 0; t < G; ++t) {
        const index_t k0 = t * g, k1 = std::min(K, k0 + g);
        float amax = 0, lo = w(n, k0), hi = w(n, k0);
        for (index_t k = k0; k < k1; ++k) {
          amax = std::max(amax, std::abs(w(n, k)));
          lo = std::min(lo, w(n, k));
          hi = std::max(hi, w(n, k));
        }
        float s = 0, m = 0;
        for (index_t k = k0; k < k1; ++k) {
          double q = 0;
          if (f.id == weights_format::kind::int4_asym) {
            const double step = (double{hi} - lo) / 15;
            s = static_cast<float>(step), m = lo;
            q = step > 0 ? std::clamp(std::nearbyint((double{w(n, k)} - lo) / step), 0.0, 15.0) : 0;
          } else {
            const bool four = f.id == weights_format::kind::int4;
            s = amax / (four ? 7.5f : 127.f);
            if (s > 0)
              q = std::clamp(std::nearbyint(w(n, k) / s), four ? -8.f : -127.f, four ? 7.f : 127.f);
          }
          out.q[std::size_t(n * K + k)] = static_cast<std::int8_t>(q);
        }
        out.scale[std::size_t(n * G + t)] = s;
        out.offset[std::size_t(n * G + t)] = m;
      }
    return out;
  }
  /// The weight s q + m, exactly (double).
  double value(index_t n, index_t k) const {
    return double{s(n, k)} * q[std::size_t(n * cols + k)] + m(n, k);
  }
  /// That value rounded once to fp32 (a fused multiply-add): what the packed copy unpacks to
  /// and what the fp32 kernels multiply by.
  float value_fp32(index_t n, index_t k) const {
    return std::fma(s(n, k), static_cast<float>(q[std::size_t(n * cols + k)]), m(n, k));
  }
  /// Σ_k |x_k| (|s q| + |m|) for one activation row: the magnitude the kernels' fp32
  /// roundings scale with (products, group sums, the offsets' terms).
  double magnitude(const double* x, index_t n) const {
    double out = 0;
    for (index_t k = 0; k < cols; ++k)
      out += std::abs(x[k]) *
             (std::abs(double{s(n, k)} * q[std::size_t(n * cols + k)]) + std::abs(double{m(n, k)}));
    return out;
  }
};

/// c[M, N] = a[M, K] wᵀ over group-wise weights, in double: W4A16 / W8A16 (a as it is) or,
/// with `a8`, W4A8 / W8A8 (each row quantised per token, int8_token). `mag` (optional): per
/// element, group_weights::magnitude.
inline std::vector<double> gemm_grouped(matrix_view<const float> a, const group_weights& w, bool a8,
                                        std::vector<double>* mag = nullptr) {
  const index_t M = a.rows, N = w.rows, K = w.cols;
  std::vector<double> c(std::size_t(M * N));
  if (mag) mag->assign(c.size(), 0.0);
  for (index_t i = 0; i < M; ++i) {
    std::vector<double> x(static_cast<std::size_t>(K));
    if (a8)
      x = int8_token(a.row(i), K);
    else
      for (index_t k = 0; k < K; ++k) x[std::size_t(k)] = a(i, k);
    for (index_t n = 0; n < N; ++n) {
      double s = 0;
      for (index_t k = 0; k < K; ++k) s += x[std::size_t(k)] * w.value(n, k);
      c[std::size_t(i * N + n)] = s;
      if (mag) (*mag)[std::size_t(i * N + n)] = w.magnitude(x.data(), n);
    }
  }
  return c;
}

/// e4m3fn (FP8) bits -> value: sign, exponent e (4 bits, bias 7), mantissa m (3 bits);
/// (1 + m/8) 2^(e-7), or m 2^-9 for e = 0 (subnormal); 0x7f and 0xff are NaN; no infinity.
inline double e4m3_value(std::uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = (b & 0x7f) == 0x7f ? NAN
                   : e == 0           ? std::ldexp(m, -9)
                                      : std::ldexp(8 + m, e - 10);
  return b & 0x80 ? -v : v;
}
/// E2M1 (FP4) code -> value: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), bit 3 the sign.
inline double e2m1_value(std::uint8_t c) {
  constexpr double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return c & 8 ? -mag[c & 7] : mag[c & 7];
}
/// E8M0 -> 2^(e - 127); 0xff is NaN.
inline double e8m0_value(std::uint8_t e) { return e == 0xff ? NAN : std::ldexp(1.0, e - 127); }

/// The code (0 .. n - 1) of the nearest of n increasing magnitudes to a >= 0, ties to the even
/// code, past the last: the last (saturation).
inline int nearest_code(double a, const double* mag, int n) {
  int best = 0;
  for (int c = 1; c < n; ++c) {
    const double d = std::abs(a - mag[c]), db = std::abs(a - mag[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return best;
}

/// fp8_block weights [N, K]: e4m3fn codes and one scale per 128 x 128 block,
/// w[n, k] = e4m3(q[n, k]) * scale[n / 128, k / 128] (DeepSeek-V3's weight_scale_inv).
struct fp8_block {
  index_t rows = 0, cols = 0;
  std::vector<std::uint8_t> q;  // [N, K] row-major
  std::vector<float> scale;     // [ceil(N / 128), ceil(K / 128)]

  index_t scale_cols() const { return (cols + 127) / 128; }
  /// The format's quantisation of fp32 weights: per block, scale = max |w| / 448 (fp32
  /// division; a zero block: scale 0, codes ±0 by sign), q = the e4m3fn value nearest to
  /// w / scale (fp32 division), ties to the even code, the sign kept. (NaN and Inf: refused.)
  static fp8_block quantise(matrix_view<const float> w) {
    fp8_block out{w.rows, w.cols, std::vector<std::uint8_t>(std::size_t(w.rows * w.cols)), {}};
    out.scale.assign(std::size_t((w.rows + 127) / 128 * out.scale_cols()), 0.f);
    for (index_t n = 0; n < w.rows; ++n)
      for (index_t k = 0; k < w.cols; ++k) {
        float& s = out.scale[std::size_t(n / 128 * out.scale_cols() + k / 128)];
        s = std::max(s, std::abs(w(n, k)));
      }
    for (float& s : out.scale) s = s / 448.f;
    std::array<double, 127> mag{};  // codes 0 .. 0x7e: increasing
    for (int c = 0; c < 127; ++c) mag[std::size_t(c)] = e4m3_value(static_cast<std::uint8_t>(c));
    for (index_t n = 0; n < w.rows; ++n)
      for (index_t k = 0; k < w.cols; ++k) {
        const float s = out.scale[std::size_t(n / 128 * out.scale_cols() + k / 128)];
        const float v = s > 0 ? w(n, k) / s : w(n, k);
        out.q[std::size_t(n * w.cols + k)] = static_cast<std::uint8_t>(
            (std::signbit(v) ? 0x80 : 0) | nearest_code(std::abs(double{v}), mag.data(), 127));
      }
    return out;
  }
  double value(index_t n, index_t k) const {
    return e4m3_value(q[std::size_t(n * cols + k)]) *
           double{scale[std::size_t(n / 128 * scale_cols() + k / 128)]};
  }
};

/// mxfp4 weights [N, K]: E2M1 codes (one per byte here) and one E8M0 scale per row and block
/// of 32 inputs, w[n, k] = e2m1(code[n, k]) * 2^(scale[n, k / 32] - 127).
struct mxfp4 {
  index_t rows = 0, cols = 0;
  std::vector<std::uint8_t> code;   // [N, K] row-major, 0..15
  std::vector<std::uint8_t> scale;  // [N, ceil(K / 32)]

  index_t blocks() const { return (cols + 31) / 32; }
  /// The OCP MX rule: per block, X = floor(log2 max |w|) - 2 clamped to [-127, 127] (-127 for
  /// a zero block), scale = X + 127, code = the E2M1 value nearest to w / 2^X, ties to the even
  /// code, saturating at ±6, the sign kept. (NaN and Inf: refused.)
  static mxfp4 quantise(matrix_view<const float> w) {
    mxfp4 out{w.rows, w.cols, std::vector<std::uint8_t>(std::size_t(w.rows * w.cols)), {}};
    out.scale.resize(std::size_t(w.rows * out.blocks()));
    constexpr double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    for (index_t n = 0; n < w.rows; ++n)
      for (index_t b = 0; b < out.blocks(); ++b) {
        double amax = 0;
        for (index_t k = 32 * b; k < std::min(w.cols, 32 * b + 32); ++k)
          amax = std::max(amax, std::abs(double{w(n, k)}));
        const int x = amax > 0 ? std::clamp(int(std::floor(std::log2(amax))) - 2, -127, 127) : -127;
        out.scale[std::size_t(n * out.blocks() + b)] = static_cast<std::uint8_t>(x + 127);
        for (index_t k = 32 * b; k < std::min(w.cols, 32 * b + 32); ++k) {
          const double v = std::ldexp(double{w(n, k)}, -x);
          out.code[std::size_t(n * w.cols + k)] = static_cast<std::uint8_t>(
              (std::signbit(v) ? 8 : 0) | nearest_code(std::abs(v), mag, 8));
        }
      }
    return out;
  }
  /// As GPT-OSS's checkpoints store it: blocks [N, ceil(K / 32), 16] bytes (input 2i of a
  /// block in byte i's low nibble, 2i + 1 in its high one; past K zero).
  std::vector<std::uint8_t> packed_blocks() const {
    std::vector<std::uint8_t> out(std::size_t(rows * blocks() * 16), 0);
    for (index_t n = 0; n < rows; ++n)
      for (index_t k = 0; k < cols; ++k)
        out[std::size_t(n * blocks() * 16 + k / 2)] |=
            static_cast<std::uint8_t>(code[std::size_t(n * cols + k)] << (4 * (k % 2)));
    return out;
  }
  double value(index_t n, index_t k) const {
    return e2m1_value(code[std::size_t(n * cols + k)]) *
           e8m0_value(scale[std::size_t(n * blocks() + k / 32)]);
  }
};

/// x rounded to bf16, nearest even (NaN stays NaN): the tokens of a bf16 dot product.
inline float bf16_round(float x) {
  if (std::isnan(x)) return x;
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof u);
  return x;
}

/// c[M, N] = a[M, K] wᵀ in double over weights W with rows, cols and value(n, k) (fp8_block,
/// mxfp4), the tokens as they are or (bf16_tokens: the AVX512-BF16 kernels) rounded to bf16.
/// Also returns, per element, Σ_k |a w| in `mag`.
template <class W>
inline std::vector<double> gemm_dequantised(matrix_view<const float> a, const W& w,
                                            bool bf16_tokens, std::vector<double>* mag = nullptr) {
  const index_t M = a.rows, N = w.rows, K = w.cols;
  std::vector<double> c(std::size_t(M * N)), wd(std::size_t(N * K));
  for (index_t n = 0; n < N; ++n)
    for (index_t k = 0; k < K; ++k) wd[std::size_t(n * K + k)] = w.value(n, k);
  if (mag) mag->assign(c.size(), 0.0);
  for (index_t i = 0; i < M; ++i)
    for (index_t n = 0; n < N; ++n) {
      double s = 0, m = 0;
      for (index_t k = 0; k < K; ++k) {
        const double x = bf16_tokens ? bf16_round(a(i, k)) : a(i, k);
        const double p = x * wd[std::size_t(n * K + k)];
        s += p;
        m += std::abs(p);
      }
      c[std::size_t(i * N + n)] = s;
      if (mag) (*mag)[std::size_t(i * N + n)] = m;
    }
  return c;
}

}  // namespace epmoe::reference
