// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/config.hpp"
#include "epmoe/core/macros.hpp"

namespace epmoe::placement {

/// Contiguous blocks: experts [r*E/R, (r+1)*E/R) live on rank r, in order.
struct block {
  int experts = 1;
  int ranks = 1;

  constexpr block() = default;
  explicit block(const layer_config& cfg) : experts(cfg.experts), ranks(cfg.ranks) {}

  EPMOE_HD int experts_per_rank() const { return experts / ranks; }
  /// Rank that holds logical expert e.
  EPMOE_HD int rank_of(int e) const { return e / experts_per_rank(); }
  /// Slot of expert e among its rank's local experts.
  EPMOE_HD int local_index(int e) const { return e % experts_per_rank(); }
  /// Logical expert in local slot j of rank r.
  EPMOE_HD int expert_at(int r, int j) const { return r * experts_per_rank() + j; }
};

}  // namespace epmoe::placement
