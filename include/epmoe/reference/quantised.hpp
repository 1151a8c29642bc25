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

}  // namespace epmoe::reference
