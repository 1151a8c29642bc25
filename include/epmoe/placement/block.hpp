// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"

namespace epmoe::placement {

/// Contiguous blocks: experts [r*E/R, (r+1)*E/R) live on rank r, in order; one copy each.
/// Physical slot p = logical expert p.
struct block {
  int experts = 1;
  int ranks = 1;

  constexpr block() = default;
  explicit block(const layer_config& cfg) : experts(cfg.experts), ranks(cfg.ranks) {}

  void validate(const layer_config& cfg) const {
    detail::require(cfg.experts % cfg.ranks == 0, "experts", cfg.experts,
                    "must be divisible by ranks (placement::block gives every rank E/R experts)");
  }

  EPMOE_HD int experts_per_rank() const { return experts / ranks; }
  EPMOE_HD int slots_per_rank() const { return experts_per_rank(); }
  /// Rank that holds logical expert e.
  EPMOE_HD int rank_of(int e) const { return e / experts_per_rank(); }
  /// Slot of expert e among its rank's local experts.
  EPMOE_HD int local_index(int e) const { return e % experts_per_rank(); }
  /// Logical expert in local slot j of rank r.
  EPMOE_HD int expert_at(int r, int j) const { return r * experts_per_rank() + j; }
  /// Physical slot (rank * slots_per_rank + local slot) that serves expert e for a token.
  EPMOE_HD int slot_for(int e, int /*home*/, std::uint64_t /*token*/) const { return e; }
};

}  // namespace epmoe::placement
