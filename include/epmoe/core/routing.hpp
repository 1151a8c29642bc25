// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/view.hpp"

namespace epmoe {

/// The router's answer for T tokens: expert ids [T, K] and combine weights [T, K].
template <class Id = const std::int32_t, class W = const float>
struct basic_routing_view {
  matrix_view<Id> ids;
  matrix_view<W> weights;
  index_t tokens() const { return ids.rows; }
  index_t top_k() const { return ids.cols; }
};
using routing_view = basic_routing_view<>;
using mutable_routing_view = basic_routing_view<std::int32_t, float>;

/// Id of an empty routing slot: a token with fewer experts than slots (expert choice) marks
/// the rest -1; the plan skips them (they are not drops).
inline constexpr std::int32_t no_expert = -1;

/// What a per-token router sees of one token.
struct token_input {
  const float* logits = nullptr;        // [E] gate logits; nullptr for gate-less routers
  const float* noise_logits = nullptr;  // [E] noise-gate logits (noisy top-k), else nullptr
  int experts = 0;                      // E
  std::int64_t token = 0;               // token id (hash routing) or global token position
  std::uint64_t pass = 0;               // forward pass counter (seeded training noise)
};

}  // namespace epmoe
