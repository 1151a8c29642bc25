// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A placement written as a user would, in one header: "least-loaded rank". Given a load per
// expert (e.g. the last pass's), experts go, heaviest first, to the rank with the least load
// so far that still has a free slot (Graham's LPT rule, E/R slots per rank, one copy each).
// Without a load (the constructor from the config) every expert weighs the same and the
// result is round-robin. The maps are fixed-size arrays, so the object is trivially
// copyable and slot_for runs on a device as it is (EPMOE_HD).
#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <epmoe/core/config.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/core/macros.hpp>

namespace policies {

struct least_loaded {
  static constexpr int max_experts = 256;
  int experts = 1;
  int ranks = 1;
  std::array<std::int16_t, max_experts> slot_of{};    // expert -> global slot
  std::array<std::int16_t, max_experts> expert_of{};  // global slot -> expert

  least_loaded() = default;
  explicit least_loaded(const epmoe::layer_config& cfg)
      : least_loaded(cfg, std::vector<double>(static_cast<std::size_t>(cfg.experts), 1.0)) {}
  least_loaded(const epmoe::layer_config& cfg, std::span<const double> load)
      : experts(cfg.experts), ranks(cfg.ranks) {
    validate(cfg);
    epmoe::detail::require(static_cast<int>(load.size()) == experts, "placement.load",
                           static_cast<long>(load.size()), "needs one value per expert");
    std::vector<int> order(static_cast<std::size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return load[a] > load[b]; });
    std::vector<double> rank_load(static_cast<std::size_t>(ranks), 0.0);
    std::vector<int> used(static_cast<std::size_t>(ranks), 0);
    for (int e : order) {
      int best = -1;
      for (int r = 0; r < ranks; ++r)
        if (used[r] < slots_per_rank() && (best < 0 || rank_load[r] < rank_load[best])) best = r;
      const int slot = best * slots_per_rank() + used[best]++;
      rank_load[best] += load[e];
      slot_of[e] = static_cast<std::int16_t>(slot);
      expert_of[slot] = static_cast<std::int16_t>(e);
    }
  }

  void validate(const epmoe::layer_config& cfg) const {
    epmoe::detail::require(cfg.experts % cfg.ranks == 0, "experts", cfg.experts,
                           "must be divisible by ranks (least_loaded gives every rank E/R slots)");
    epmoe::detail::require(cfg.experts <= max_experts, "experts", cfg.experts,
                           "must be <= 256 for least_loaded (fixed-size maps)");
  }

  EPMOE_HD int slots_per_rank() const { return experts / ranks; }
  EPMOE_HD int expert_at(int r, int j) const { return expert_of[r * slots_per_rank() + j]; }
  EPMOE_HD int slot_for(int e, int /*home*/, std::uint64_t /*token*/) const { return slot_of[e]; }
};

}  // namespace policies
