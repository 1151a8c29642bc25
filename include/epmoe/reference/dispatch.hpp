// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/capacity/factor.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/placement/round_robin.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/reference/random.hpp"

namespace epmoe::capacity {
// Found by argument-dependent lookup for the library's capacity policies only (never
// defined or called): the reference must have its own formula for each.
template <class C>
void has_reference_formula(const C&);
}  // namespace epmoe::capacity

namespace epmoe::placement {
// The same for the library's placements.
template <class P>
void has_reference_formula(const P&);
}  // namespace epmoe::placement

// Capacity limits and replica choice written from their definitions (capacity/*.hpp,
// docs/placement.md), independent of the policies' own limit() and slot_for(): a policy
// object is read for its parameters only.
namespace epmoe::reference {

template <class C>
concept library_capacity = requires(const C& c) {
  has_reference_formula(c);
};
template <class P>
concept library_placement = requires(const P& p) {
  has_reference_formula(p);
};

/// No limit.
inline constexpr index_t unlimited = std::numeric_limits<index_t>::max();

/// Dropless: every assignment is computed.
inline index_t capacity_limit(const capacity::dropless&, const layer_config&, index_t) {
  return unlimited;
}

/// GShard/Switch capacity: ceil(capacity_factor · T · K / E) rows per (source rank, slot),
/// T the rank's tokens this pass; padding changes shapes, not outputs. The definition's
/// expression, evaluated left to right as written.
template <bool Pad>
index_t capacity_limit(const capacity::factor<Pad>&, const layer_config& cfg, index_t tokens) {
  return static_cast<index_t>(
      std::ceil(cfg.capacity_factor * static_cast<double>(tokens) * static_cast<double>(cfg.top_k) /
                static_cast<double>(cfg.experts)));
}

/// The limit for any capacity policy: the formula above for the library's, the policy's own
/// limit() for any other.
template <class Capacity>
index_t limit_of(const Capacity& c, const layer_config& cfg, index_t tokens) {
  if constexpr (requires { capacity_limit(c, cfg, tokens); }) {
    return capacity_limit(c, cfg, tokens);
  } else {
    static_assert(!library_capacity<Capacity>,
                  "reference/dispatch.hpp has no capacity formula for this epmoe capacity "
                  "policy: add a capacity_limit overload written from its definition");
    return c.limit(cfg, tokens);
  }
}

// Physical slots are numbered p = rank · slots_per_rank + local slot (docs/placement.md).

/// Block: experts [r E/R, (r+1) E/R) on rank r in order, so expert e is slot e.
inline int replica_slot(const placement::block&, int e, int, std::uint64_t) { return e; }

/// Round robin: expert e on rank e mod R, local slot e / R (E/R slots per rank).
inline int replica_slot(const placement::round_robin& p, int e, int, std::uint64_t) {
  return e % p.ranks * (p.experts / p.ranks) + e / p.ranks;
}

/// A table with replicas: the copies of e on the token's own rank if any, else those on its
/// own node (ranks_per_node consecutive ranks), else all copies; among several candidates,
/// candidate number bits("plac", token, e, 0) mod count in slot order.
inline int replica_slot(const placement::table& t, int e, int home, std::uint64_t token) {
  const std::vector<int>& expert_in = t.phy_to_log();
  const int S = t.slots_per_rank(), G = t.ranks_per_node();
  std::vector<int> own, node, all;
  for (int p = 0; p < static_cast<int>(expert_in.size()); ++p) {
    if (expert_in[p] != e) continue;
    all.push_back(p);
    if (p / S == home) own.push_back(p);
    if (p / S / G == home / G) node.push_back(p);
  }
  const std::vector<int>& from = !own.empty() ? own : (!node.empty() ? node : all);
  if (from.size() == 1) return from[0];
  const std::uint64_t h = draws::bits(0x706c6163ull, token, static_cast<std::uint64_t>(e), 0);
  return from[h % from.size()];
}

/// The slot that serves expert e for a token of rank `home`: the rule above for the
/// library's placements, the placement's own slot_for for any other.
template <class Placement>
int slot_of(const Placement& p, int e, int home, std::uint64_t token) {
  if constexpr (requires { replica_slot(p, e, home, token); }) {
    return replica_slot(p, e, home, token);
  } else {
    static_assert(!library_placement<Placement>,
                  "reference/dispatch.hpp has no replica rule for this epmoe placement: add a "
                  "replica_slot overload written from its definition");
    return p.slot_for(e, home, token);
  }
}

}  // namespace epmoe::reference
