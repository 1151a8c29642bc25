// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/random.hpp"

namespace epmoe::router {

/// Switch Transformer input jitter around any gated router: while `training`, the router's
/// input (not the experts') is multiplied element-wise by U(1 - eps, 1 + eps) before the
/// gate GEMM. Seeded, counter-based, off by default.
///   using router = epmoe::router::jitter<epmoe::router::switch_top1>;
template <class Inner>
struct jitter : Inner {
  static constexpr bool jitters_input = true;

  float eps = 1e-2f;
  std::uint64_t seed = 0;
  bool training = false;

  /// The factor for element h of token `token` in pass `pass`.
  EPMOE_HD float factor(std::uint64_t pass, std::int64_t token, std::int64_t h) const {
    const float u = math::uniform01(
        math::hash4(seed, pass, static_cast<std::uint64_t>(token), static_cast<std::uint64_t>(h)));
    return 1.f - eps + 2.f * eps * u;
  }
};

}  // namespace epmoe::router
