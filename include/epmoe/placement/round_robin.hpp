// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"

namespace epmoe::placement {

/// Expert e on rank e mod R, in local slot e / R: neighbouring experts (often similarly hot
/// in fine-grained models) land on different ranks. One copy each.
struct round_robin {
  int experts = 1;
  int ranks = 1;

  constexpr round_robin() = default;
  explicit round_robin(const layer_config& cfg) : experts(cfg.experts), ranks(cfg.ranks) {}

  void validate(const layer_config& cfg) const {
    detail::require(cfg.experts % cfg.ranks == 0, "experts", cfg.experts,
                    "must be divisible by ranks (placement::round_robin gives every rank E/R "
                    "experts)");
  }

  EPMOE_HD int slots_per_rank() const { return experts / ranks; }
  EPMOE_HD int rank_of(int e) const { return e % ranks; }
  EPMOE_HD int local_index(int e) const { return e / ranks; }
  EPMOE_HD int expert_at(int r, int j) const { return j * ranks + r; }
  EPMOE_HD int slot_for(int e, int /*home*/, std::uint64_t /*token*/) const {
    return rank_of(e) * slots_per_rank() + local_index(e);
  }
};

}  // namespace epmoe::placement
