// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/routing.hpp"

namespace epmoe::router {

/// Hash layers (Roller et al. 2021): expert = hash(token id), no gate, nothing learned.
/// The token id is the input token's vocabulary id, passed to forward(x, y, token_ids), so
/// a token goes to the same experts in every run and on any number of ranks. K > 1 draws K
/// hashes (distinct experts: a collision moves to the next expert); each weighs 1/K.
template <int K = 1>
struct hash {
  static_assert(K >= 1, "router::hash<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = false;
  static constexpr bool needs_token_ids = true;

  std::uint64_t seed = 0;

  EPMOE_HD void route_token(const token_input& in, int* ids, float* weights) const {
    const auto E = static_cast<std::uint64_t>(in.experts);
    for (int k = 0; k < K; ++k) {
      auto e = static_cast<int>(math::hash4(seed, static_cast<std::uint64_t>(in.token),
                                            static_cast<std::uint64_t>(k), 0) %
                                E);
      // At most E probes: with K <= E (the layer checks it) a free expert is always found.
      for (int probe = 0, clash = 1; clash && probe < in.experts; ++probe) {
        clash = 0;
        for (int j = 0; j < k; ++j) clash |= ids[j] == e;
        if (clash) e = (e + 1) % in.experts;
      }
      ids[k] = e;
      weights[k] = 1.f / K;
    }
  }
};

}  // namespace epmoe::router
