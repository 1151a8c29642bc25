// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <numeric>
#include <span>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/placement/table.hpp"

// The balancer: from per-expert load, a replicated placement table that evens out the load
// per rank (the straggler is the busiest rank). Host code, run between passes.
namespace epmoe::placement {

struct balance_options {
  int ranks = 1;
  int nodes = 1;        // ranks are split evenly over nodes
  int groups = 1;       // expert groups (contiguous, equal), packed whole onto nodes
  int extra_slots = 0;  // replicas beyond one per expert: P = E + extra_slots
};

/// Load per rank of a table, a copy taking load[e] / copies(e) (rows spread evenly).
inline std::vector<double> rank_loads(const table& t, std::span<const double> load) {
  std::vector<double> r(static_cast<std::size_t>(t.ranks()), 0.0);
  for (int p = 0; p < t.slots(); ++p) {
    const int e = t.phy_to_log()[p];
    r[p / t.slots_per_rank()] += load[e] / t.copies(e);
  }
  return r;
}

/// max / mean of a load vector (1 = balanced); 0 for an all-zero vector.
inline double max_over_mean(std::span<const double> v) {
  const double sum = std::accumulate(v.begin(), v.end(), 0.0);
  if (sum <= 0) return 0;
  return *std::max_element(v.begin(), v.end()) / (sum / static_cast<double>(v.size()));
}

struct balance_result {
  table greedy;   // replicate + pack
  table refined;  // after the swap pass: never a higher max rank load than greedy
  double greedy_max_over_mean = 0;
  double refined_max_over_mean = 0;
};

namespace balancing {

struct copy_item {
  int expert;
  double weight;  // load of one copy
};

// Gives `slots - experts.size()` extra copies, one at a time, to the expert with the highest
// load per copy (ties: lower id), then returns every copy.
inline std::vector<copy_item> replicate(const std::vector<int>& experts,
                                        std::span<const double> load, int slots) {
  std::vector<int> copies(experts.size(), 1);
  for (int extra = slots - static_cast<int>(experts.size()); extra > 0; --extra) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < experts.size(); ++i)
      if (load[experts[i]] / copies[i] > load[experts[best]] / copies[best]) best = i;
    ++copies[best];
  }
  std::vector<copy_item> items;
  for (std::size_t i = 0; i < experts.size(); ++i)
    for (int c = 0; c < copies[i]; ++c) items.push_back({experts[i], load[experts[i]] / copies[i]});
  return items;
}

// Packs copies onto `ranks` ranks of `per_rank` slots each: heaviest first, each to the
// least loaded rank with room, avoiding a second copy of an expert on one rank when it can.
inline std::vector<std::vector<copy_item>> pack(std::vector<copy_item> items, int ranks,
                                                int per_rank) {
  std::stable_sort(items.begin(), items.end(), [](const copy_item& a, const copy_item& b) {
    return a.weight > b.weight || (a.weight == b.weight && a.expert < b.expert);
  });
  std::vector<std::vector<copy_item>> bins(static_cast<std::size_t>(ranks));
  std::vector<double> sum(static_cast<std::size_t>(ranks), 0.0);
  for (const copy_item& it : items) {
    int best = -1;
    for (int pass = 0; pass < 2 && best < 0; ++pass)
      for (int r = 0; r < ranks; ++r) {
        if (static_cast<int>(bins[r].size()) == per_rank) continue;
        const bool twin = std::any_of(bins[r].begin(), bins[r].end(),
                                      [&](const copy_item& o) { return o.expert == it.expert; });
        if (pass == 0 && twin) continue;
        if (best < 0 || sum[r] < sum[best]) best = r;
      }
    bins[best].push_back(it);
    sum[best] += it.weight;
  }
  return bins;
}

// Swaps between the most and the least loaded rank while a swap lowers the larger of the two
// below the current maximum: the maximum never rises.
inline void refine(std::vector<std::vector<copy_item>>& bins, int max_rounds = 1000) {
  const auto load = [](const std::vector<copy_item>& b) {
    double s = 0;
    for (const copy_item& c : b) s += c.weight;
    return s;
  };
  const auto holds = [](const std::vector<copy_item>& b, int e, std::size_t except) {
    for (std::size_t i = 0; i < b.size(); ++i)
      if (i != except && b[i].expert == e) return true;
    return false;
  };
  for (int round = 0; round < max_rounds; ++round) {
    std::size_t hi = 0, lo = 0;
    for (std::size_t r = 1; r < bins.size(); ++r) {
      if (load(bins[r]) > load(bins[hi])) hi = r;
      if (load(bins[r]) < load(bins[lo])) lo = r;
    }
    const double lh = load(bins[hi]), ll = load(bins[lo]);
    double best = lh;
    std::size_t bi = 0, bj = 0;
    for (std::size_t i = 0; i < bins[hi].size(); ++i)
      for (std::size_t j = 0; j < bins[lo].size(); ++j) {
        const double wi = bins[hi][i].weight, wj = bins[lo][j].weight;
        const double worst = std::max(lh - wi + wj, ll - wj + wi);
        if (worst < best - 1e-12 && !holds(bins[lo], bins[hi][i].expert, j) &&
            !holds(bins[hi], bins[lo][j].expert, i)) {
          best = worst;
          bi = i;
          bj = j;
        }
      }
    if (best >= lh) return;
    std::swap(bins[hi][bi], bins[lo][bj]);
  }
}

inline table to_table(const std::vector<std::vector<copy_item>>& bins, int experts, int ranks,
                      int ranks_per_node) {
  std::vector<int> phy;
  for (const auto& b : bins)
    for (const copy_item& c : b) phy.push_back(c.expert);
  return table(experts, ranks, std::move(phy), ranks_per_node);
}

}  // namespace balancing

/// A replicated table for `load` (one number per logical expert: rows of one pass, or a
/// moving average over passes). Hierarchical when groups divide evenly over nodes: groups
/// are packed whole onto nodes (heaviest first, to the lightest node with room), then each
/// node replicates its experts over its slots and packs the copies onto its ranks; otherwise
/// one global level. Every rank gets P/R slots. Deterministic. The refined table also tries
/// the unreplicated block layout as a start, so with no extra slots it is never worse than
/// placement::block.
inline balance_result balance(std::span<const double> load, const balance_options& o) {
  const int E = static_cast<int>(load.size()), R = o.ranks, P = E + o.extra_slots;
  detail::require(R >= 1, "ranks", R, "must be >= 1");
  detail::require(o.extra_slots >= 0, "extra_slots", o.extra_slots, "must be >= 0");
  detail::require(P % R == 0, "extra_slots", o.extra_slots,
                  "experts + extra_slots must be divisible by ranks");
  detail::require(o.nodes >= 1 && R % o.nodes == 0, "nodes", o.nodes, "must divide ranks");
  detail::require(o.groups >= 1 && E % o.groups == 0, "groups", o.groups, "must divide experts");
  for (double l : load) detail::require(l >= 0, "load", l, "must be >= 0");
  const int N = o.groups % o.nodes == 0 && P % o.nodes == 0 ? o.nodes : 1;
  const int rpn = R / N, S = P / R;        // rpn: ranks per packing unit (a node, or all ranks)
  const int ranks_per_node = R / o.nodes;  // what the tables record for replica choice

  // Node level: whole groups onto nodes, heaviest first.
  std::vector<std::vector<int>> node_experts(static_cast<std::size_t>(N));
  {
    const int G = N > 1 ? o.groups : 1, size = E / G;
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < G; ++g)
      groups.push_back(
          {std::accumulate(load.begin() + g * size, load.begin() + (g + 1) * size, 0.0), g});
    std::stable_sort(groups.begin(), groups.end(),
                     [](auto& a, auto& b) { return a.first > b.first; });
    std::vector<double> node_load(static_cast<std::size_t>(N), 0.0);
    std::vector<int> node_groups(static_cast<std::size_t>(N), 0);
    for (const auto& [l, g] : groups) {
      int best = -1;
      for (int n = 0; n < N; ++n)
        if (node_groups[n] < G / N && (best < 0 || node_load[n] < node_load[best])) best = n;
      node_load[best] += l;
      ++node_groups[best];
      for (int e = g * size; e < (g + 1) * size; ++e) node_experts[best].push_back(e);
    }
  }
  // Rank level, per node: replicate over the node's slots, pack onto its ranks.
  std::vector<std::vector<balancing::copy_item>> bins;
  for (int n = 0; n < N; ++n) {
    std::sort(node_experts[n].begin(), node_experts[n].end());
    auto part = balancing::pack(balancing::replicate(node_experts[n], load, P / N), rpn, S);
    for (auto& b : part) bins.push_back(std::move(b));
  }
  balance_result out;
  out.greedy = balancing::to_table(bins, E, R, ranks_per_node);
  // Refinement swaps inside a node only (a swap across nodes would split a group).
  auto refined = bins;
  for (int n = 0; n < N; ++n) {
    std::vector<std::vector<balancing::copy_item>> part(refined.begin() + n * rpn,
                                                        refined.begin() + (n + 1) * rpn);
    balancing::refine(part);
    std::copy(part.begin(), part.end(), refined.begin() + n * rpn);
  }
  out.refined = balancing::to_table(refined, E, R, ranks_per_node);
  if (o.extra_slots == 0) {  // block as a second start (it keeps groups whole on nodes)
    std::vector<std::vector<balancing::copy_item>> blocks(static_cast<std::size_t>(R));
    for (int e = 0; e < E; ++e) blocks[e / S].push_back({e, load[e]});
    for (int n = 0; n < N; ++n) {
      std::vector<std::vector<balancing::copy_item>> part(blocks.begin() + n * rpn,
                                                          blocks.begin() + (n + 1) * rpn);
      balancing::refine(part);
      std::copy(part.begin(), part.end(), blocks.begin() + n * rpn);
    }
    table from_block = balancing::to_table(blocks, E, R, ranks_per_node);
    if (max_over_mean(rank_loads(from_block, load)) < max_over_mean(rank_loads(out.refined, load)))
      out.refined = std::move(from_block);
  }
  out.greedy_max_over_mean = max_over_mean(rank_loads(out.greedy, load));
  out.refined_max_over_mean = max_over_mean(rank_loads(out.refined, load));
  if (out.refined_max_over_mean > out.greedy_max_over_mean) {  // never worse than greedy
    out.refined = out.greedy;
    out.refined_max_over_mean = out.greedy_max_over_mean;
  }
  return out;
}

}  // namespace epmoe::placement
