// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/random.hpp"

namespace epmoe::placement {

/// The per-token part of a table, as plain pointers (host or device memory).
struct table_view {
  const int* phy_to_log = nullptr;  // [P]
  const int* log_to_phy = nullptr;  // [E, max_copies], -1 past copies[e]
  const int* copies = nullptr;      // [E]
  int max_copies = 1;
  int slots_per_rank = 1;
  int ranks_per_node = 1;

  /// The copy of expert e a token on rank `home` uses: one on its own rank if any, else one
  /// on its own node, else any; among several, the token's hash spreads rows evenly.
  /// An expert's copies are listed in slot order, and a rank's (a node's) slots are
  /// contiguous, so each lookup is a binary search: O(log copies) for hot experts with many.
  EPMOE_HD int slot_for(int e, int home, std::uint64_t token) const {
    const int* c = log_to_phy + e * max_copies;
    const int n = copies[e];
    if (n == 1) return c[0];
    const std::uint64_t h = math::hash4(0x706c6163ull, token, static_cast<std::uint64_t>(e), 0);
    const int rank_lo = home * slots_per_rank;
    const int i = first_at_least(c, n, rank_lo);
    const int j = first_at_least(c, n, rank_lo + slots_per_rank);
    if (j > i) return c[i + static_cast<int>(h % static_cast<std::uint64_t>(j - i))];
    const int node_lo = home / ranks_per_node * ranks_per_node * slots_per_rank;
    const int a = first_at_least(c, n, node_lo);
    const int b = first_at_least(c, n, node_lo + ranks_per_node * slots_per_rank);
    if (b > a) return c[a + static_cast<int>(h % static_cast<std::uint64_t>(b - a))];
    return c[h % static_cast<std::uint64_t>(n)];
  }

  /// The first i in [0, n) with c[i] >= v (c ascending), or n.
  EPMOE_HD static int first_at_least(const int* c, int n, int v) {
    int lo = 0, hi = n;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (c[mid] < v)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo;
  }
};

/// An explicit physical-slot table with replicas, in DeepSeek EPLB's vocabulary: P physical
/// slots (P >= E, P divisible by R; rank r holds slots [r*P/R, (r+1)*P/R)), phy_to_log[P],
/// log_to_phy[E][max copies] (-1 padded) and copies[E]. A hot expert with several copies has
/// its rows spread over them (table_view::slot_for). Built from phy_to_log, or from all three
/// EPLB arrays (checked to agree); a bad table throws config_error naming the field.
class table {
 public:
  table() = default;
  /// The identity table: one copy per expert, as placement::block.
  explicit table(const layer_config& cfg) : table(cfg.experts, cfg.ranks, identity(cfg.experts)) {}

  /// ranks_per_node: ranks that share a node (0: all ranks on one node).
  table(int experts, int ranks, std::vector<int> phy_to_log, int ranks_per_node = 0)
      : experts_(experts),
        ranks_(ranks),
        ranks_per_node_(ranks_per_node > 0 ? ranks_per_node : ranks),
        phy_to_log_(std::move(phy_to_log)) {
    check_shape();
    copies_.assign(static_cast<std::size_t>(experts_), 0);
    for (int p = 0; p < slots(); ++p) ++copies_[phy_to_log_[p]];
    max_copies_ = 1;
    for (int e = 0; e < experts_; ++e) {
      detail::require(copies_[e] >= 1, "placement.copies", "expert " + std::to_string(e) + ": 0",
                      "every expert needs at least one physical slot");
      max_copies_ = std::max(max_copies_, copies_[e]);
    }
    log_to_phy_.assign(static_cast<std::size_t>(experts_ * max_copies_), -1);
    std::vector<int> filled(static_cast<std::size_t>(experts_), 0);
    for (int p = 0; p < slots(); ++p) {
      const int e = phy_to_log_[p];
      log_to_phy_[e * max_copies_ + filled[e]++] = p;
    }
  }

  /// From all three EPLB arrays; log_to_phy is [E, max_copies] row-major, -1 padded.
  static table from_eplb(int experts, int ranks, std::vector<int> phy_to_log,
                         std::span<const int> log_to_phy, std::span<const int> copies,
                         int ranks_per_node = 0) {
    table t(experts, ranks, std::move(phy_to_log), ranks_per_node);
    detail::require(copies.size() == static_cast<std::size_t>(experts), "placement.copies",
                    copies.size(), "must hold one count per logical expert");
    std::vector<char> listed(static_cast<std::size_t>(t.slots()), 0);
    for (int e = 0; e < experts; ++e) {
      detail::require(copies[e] == t.copies_[e], "placement.copies",
                      "expert " + std::to_string(e) + ": " + std::to_string(copies[e]),
                      "must equal the slots phy_to_log gives the expert");
      const std::size_t width = log_to_phy.size() / static_cast<std::size_t>(experts);
      for (int i = 0; i < copies[e]; ++i) {
        const int p = i < static_cast<int>(width) ? log_to_phy[e * width + i] : -1;
        detail::require(
            p >= 0 && p < t.slots() && t.phy_to_log_[p] == e && !listed[p], "placement.log_to_phy",
            "expert " + std::to_string(e) + " copy " + std::to_string(i) + ": " + std::to_string(p),
            "must name distinct slots whose phy_to_log is that expert");
        listed[p] = 1;
      }
    }
    return t;
  }

  void validate(const layer_config& cfg) const {
    detail::require(cfg.experts == experts_, "placement.experts", experts_,
                    "must equal config experts");
    detail::require(cfg.ranks == ranks_, "placement.ranks", ranks_, "must equal config ranks");
  }

  int experts() const { return experts_; }
  int ranks() const { return ranks_; }
  int slots() const { return static_cast<int>(phy_to_log_.size()); }
  int slots_per_rank() const { return slots() / ranks_; }
  int ranks_per_node() const { return ranks_per_node_; }
  int max_copies() const { return max_copies_; }
  int copies(int e) const { return copies_[e]; }
  const std::vector<int>& phy_to_log() const { return phy_to_log_; }
  /// [E, max_copies] row-major, -1 padded (EPLB's logical_to_physical_map).
  const std::vector<int>& log_to_phy() const { return log_to_phy_; }

  int expert_at(int r, int j) const { return phy_to_log_[r * slots_per_rank() + j]; }
  int slot_for(int e, int home, std::uint64_t token) const {
    return view().slot_for(e, home, token);
  }

  table_view view() const {
    return {phy_to_log_.data(), log_to_phy_.data(), copies_.data(),
            max_copies_,        slots_per_rank(),   ranks_per_node_};
  }
  /// The view with its arrays where `place` puts them: place(std::span<const int>) returns a
  /// pointer to a copy the caller keeps (a device space's memory, for the plan's kernels).
  template <class Place>
  table_view view_in(Place&& place) const {
    table_view v = view();
    v.phy_to_log = place(std::span<const int>(phy_to_log_));
    v.log_to_phy = place(std::span<const int>(log_to_phy_));
    v.copies = place(std::span<const int>(copies_));
    return v;
  }

  bool operator==(const table& o) const {
    return experts_ == o.experts_ && ranks_ == o.ranks_ && ranks_per_node_ == o.ranks_per_node_ &&
           phy_to_log_ == o.phy_to_log_;
  }

 private:
  static std::vector<int> identity(int n) {
    std::vector<int> v(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) v[i] = i;
    return v;
  }

  void check_shape() const {
    detail::require(experts_ >= 1, "placement.experts", experts_, "must be >= 1");
    detail::require(ranks_ >= 1, "placement.ranks", ranks_, "must be >= 1");
    detail::require(ranks_ % ranks_per_node_ == 0, "placement.ranks_per_node", ranks_per_node_,
                    "must divide ranks");
    detail::require(slots() >= experts_, "placement.slots", slots(),
                    "must be >= experts (every expert needs a slot)");
    detail::require(slots() % ranks_ == 0, "placement.slots", slots(),
                    "must be divisible by ranks (every rank holds P/R slots)");
    for (int p = 0; p < slots(); ++p)
      detail::require(phy_to_log_[p] >= 0 && phy_to_log_[p] < experts_, "placement.phy_to_log",
                      "slot " + std::to_string(p) + ": " + std::to_string(phy_to_log_[p]),
                      "must be a logical expert id in [0, experts)");
  }

  int experts_ = 1, ranks_ = 1, ranks_per_node_ = 1, max_copies_ = 1;
  std::vector<int> phy_to_log_, log_to_phy_, copies_;
};

/// The placement after losing ranks (issue 23): the surviving ranks' slots, renumbered in
/// rank order, each still holding its expert (its weights stay where they are), so every
/// expert is served by its surviving copies. `lost[r]` != 0 marks rank r lost (size: ranks).
/// Throws config_error naming every expert whose copies all lived on lost ranks. The result
/// has one node (ranks_per_node of survivors is no longer uniform).
inline table surviving(const table& t, std::span<const char> lost) {
  epmoe::detail::require(static_cast<int>(lost.size()) == t.ranks(), "lost ranks (mask size)",
                         lost.size(), "must be the placement's ranks");
  const int L = t.slots_per_rank();
  std::vector<int> phy;
  std::vector<int> kept(static_cast<std::size_t>(t.experts()), 0);
  for (int r = 0; r < t.ranks(); ++r) {
    if (lost[static_cast<std::size_t>(r)]) continue;
    for (int j = 0; j < L; ++j) {
      phy.push_back(t.expert_at(r, j));
      ++kept[static_cast<std::size_t>(t.expert_at(r, j))];
    }
  }
  epmoe::detail::require(!phy.empty(), "lost ranks", "all", "at least one rank must survive");
  std::string gone;
  int n = 0;
  for (int e = 0; e < t.experts(); ++e)
    if (kept[static_cast<std::size_t>(e)] == 0 && n++ < 16)
      gone += (gone.empty() ? "" : ", ") + std::to_string(e);
  if (n > 0)
    throw config_error("lost ranks", std::to_string(n) + " expert(s) without a surviving copy",
                       "every expert needs a copy on a surviving rank; lost with their ranks: "
                       "expert(s) " +
                           gone + (n > 16 ? ", ..." : "") +
                           " (replicate them: placement::balancer, or a table with copies)");
  const int ranks = static_cast<int>(phy.size()) / L;
  return table(t.experts(), ranks, std::move(phy));
}

}  // namespace epmoe::placement
