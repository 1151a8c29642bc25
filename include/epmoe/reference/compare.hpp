// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

// The error measure of every acceptance check (tests, examples, the tour): a check that
// compares a NaN with anything must fail, so NaN, Inf and size mismatches are infinite.
namespace epmoe::reference {

/// max_i |got_i - want_i| / max(max_i |want_i|, 1e-30); +inf when the sizes differ or any
/// element of either side is NaN or Inf. Two empty ranges compare equal (0).
template <class A, class B>
double max_relative_error(std::span<const A> got, std::span<const B> want) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  if (got.size() != want.size()) return inf;
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double a = static_cast<double>(got[i]), b = static_cast<double>(want[i]);
    if (!std::isfinite(a) || !std::isfinite(b)) return inf;
    diff = std::max(diff, std::abs(a - b));
    scale = std::max(scale, std::abs(b));
  }
  return diff / std::max(scale, 1e-30);
}

/// The same for any two contiguous ranges (std::vector, std::array, spans).
template <class RA, class RB>
double max_relative_error(const RA& got, const RB& want) {
  return max_relative_error(std::span(std::data(got), std::size(got)),
                            std::span(std::data(want), std::size(want)));
}

}  // namespace epmoe::reference
