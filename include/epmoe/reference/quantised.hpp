// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The quantised weight formats' definitions, written once as plain scalar code (issue 37):
// quantise, dequantise, then a double-precision loop. Every kernel path of a format is tested
// against these (tests/expert/test_int8.cpp); docs/quantisation.md states them in prose.

#include <algorithm>
#include <cmath>
#include <cstdint>
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
  /// [-127, 127] (a scale that underflows to 0 gives q = ±127, values 0); a zero channel has
  /// scale 0 and q 0. (NaN and Inf are refused by the packer; not defined here.)
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
            amax > 0
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
/// zero; a row holding NaN or ±Inf is all NaN.
inline std::vector<double> int8_token(const float* x, index_t K) {
  float amax = 0;
  bool finite = true;
  for (index_t k = 0; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::abs(x[k]));
  }
  std::vector<double> out(std::size_t(K), finite ? 0.0 : NAN);
  if (!finite || amax == 0) return out;
  const float inv = 127.f / amax, s = amax / 127.f;
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
  /// a group of zeros has s = 0 and q = 0. (NaN and Inf are refused by the packer.)
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
            if (amax > 0)
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

}  // namespace epmoe::reference
