// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <numeric>
#include <span>
#include <string>
#include <utility>
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
  table greedy;   // replicate + pack (the better of two packings, below)
  table refined;  // after the swap pass: never a higher max rank load than greedy
  double greedy_max_over_mean = 0;
  double refined_max_over_mean = 0;
  bool hierarchical = false;  // groups packed whole onto nodes (> 1), then ranks in each node
  std::string note;           // which level ran, and any option that was ignored
};

namespace balancing {

struct copy_item {
  int expert;
  double weight;  // load of one copy
};
using bins_t = std::vector<std::vector<copy_item>>;

// Gives `slots - experts.size()` extra copies, one at a time, to the expert with the highest
// load per copy (ties: the earlier in `experts`). Returns the copies in EPLB's physical order:
// one per expert in `experts` order, then the extra ones in the order they were given.
inline std::vector<copy_item> replicate(const std::vector<int>& experts,
                                        std::span<const double> load, int slots) {
  std::vector<int> copies(experts.size(), 1), order(experts.begin(), experts.end());
  for (int extra = slots - static_cast<int>(experts.size()); extra > 0; --extra) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < experts.size(); ++i)
      if (load[experts[i]] / copies[i] > load[experts[best]] / copies[best]) best = i;
    ++copies[best];
    order.push_back(experts[best]);
  }
  std::vector<int> count_of(load.size(), 0);
  for (std::size_t i = 0; i < experts.size(); ++i) count_of[experts[i]] = copies[i];
  std::vector<copy_item> items;
  for (int e : order) items.push_back({e, load[e] / count_of[e]});
  return items;
}

inline double bin_load(const std::vector<copy_item>& b) {
  double s = 0;
  for (const copy_item& c : b) s += c.weight;
  return s;
}

// Copies beyond the first of an expert on one rank (0: no expert twice on a rank).
inline int twins(const bins_t& bins) {
  int n = 0;
  for (const auto& b : bins)
    for (std::size_t i = 0; i < b.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (b[j].expert == b[i].expert) {
          ++n;
          break;
        }
  return n;
}

// Packs copies onto `ranks` ranks of `per_rank` slots each: heaviest first (ties: input
// order), each to the least loaded rank with room (ties: lower rank). This is EPLB's
// balanced packing. With avoid_twins, a rank that already holds the expert is passed over
// while another has room: a second start for refine, not a rule (it can cost load).
inline bins_t pack(std::vector<copy_item> items, int ranks, int per_rank, bool avoid_twins) {
  std::stable_sort(items.begin(), items.end(),
                   [](const copy_item& a, const copy_item& b) { return a.weight > b.weight; });
  bins_t bins(static_cast<std::size_t>(ranks));
  std::vector<double> sum(static_cast<std::size_t>(ranks), 0.0);
  for (const copy_item& it : items) {
    int best = -1;
    for (int pass = avoid_twins ? 0 : 1; pass < 2 && best < 0; ++pass)
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

// Local search on the busiest rank: swaps one of its copies with one on any other rank when
// the larger of the two new loads is below the current maximum, taking the swap that lowers
// it most; twins only break ties (a twin-free swap wins among equally good ones). The
// maximum never rises, and each swap lowers the busiest rank, so it ends.
inline void refine(bins_t& bins, int max_rounds = 4096) {
  const auto holds = [](const std::vector<copy_item>& b, int e, std::size_t except) {
    for (std::size_t i = 0; i < b.size(); ++i)
      if (i != except && b[i].expert == e) return true;
    return false;
  };
  std::vector<double> sum(bins.size());
  for (std::size_t r = 0; r < bins.size(); ++r) sum[r] = bin_load(bins[r]);
  for (int round = 0; round < max_rounds; ++round) {
    const std::size_t hi =
        static_cast<std::size_t>(std::max_element(sum.begin(), sum.end()) - sum.begin());
    const double lh = sum[hi], tol = 1e-12 * lh;
    double best = lh;
    bool best_twin = true;
    std::size_t br = hi, bi = 0, bj = 0;
    for (std::size_t r = 0; r < bins.size(); ++r) {
      if (r == hi) continue;
      for (std::size_t i = 0; i < bins[hi].size(); ++i)
        for (std::size_t j = 0; j < bins[r].size(); ++j) {
          const copy_item &a = bins[hi][i], &b = bins[r][j];
          if (a.expert == b.expert) continue;
          const double worst = std::max(lh - a.weight + b.weight, sum[r] - b.weight + a.weight);
          if (worst >= lh - tol || worst > best + tol) continue;
          const bool twin = holds(bins[r], a.expert, j) || holds(bins[hi], b.expert, i);
          if (worst >= best - tol && (twin || !best_twin)) continue;  // a tie: twin-free wins
          best = worst;
          best_twin = twin;
          br = r;
          bi = i;
          bj = j;
        }
    }
    if (br == hi) return;
    sum[hi] += bins[br][bj].weight - bins[hi][bi].weight;
    sum[br] += bins[hi][bi].weight - bins[br][bj].weight;
    std::swap(bins[hi][bi], bins[br][bj]);
  }
}

inline table to_table(const bins_t& bins, int experts, int ranks, int ranks_per_node) {
  std::vector<int> phy;
  for (const auto& b : bins)
    for (const copy_item& c : b) phy.push_back(c.expert);
  return table(experts, ranks, std::move(phy), ranks_per_node);
}

inline double peak(const bins_t& bins) {
  double m = 0;
  for (const auto& b : bins) m = std::max(m, bin_load(b));
  return m;
}

// The better of two packings of one node: lower maximum rank load, then fewer twins.
inline bool better(const bins_t& a, const bins_t& b) {
  const double ma = peak(a), mb = peak(b), tol = 1e-12 * std::max(ma, mb);
  if (ma < mb - tol) return true;
  if (ma > mb + tol) return false;
  return twins(a) < twins(b);
}

// The rank level of one node (or of all ranks): replicate its experts over its slots, pack
// the copies twice (EPLB's packing and the twin-avoiding one), refine each, keep the better.
struct node_plan {
  bins_t greedy, refined;
  double peak = 0;  // the refined maximum rank load
};

inline node_plan plan_node(const std::vector<int>& experts, std::span<const double> load, int slots,
                           int ranks) {
  const auto items = replicate(experts, load, slots);
  auto plain = pack(items, ranks, slots / ranks, false);
  auto apart = pack(items, ranks, slots / ranks, true);
  node_plan out;
  out.greedy = better(apart, plain) ? apart : plain;
  refine(plain);
  refine(apart);
  out.refined = better(apart, plain) ? std::move(apart) : std::move(plain);
  out.peak = peak(out.refined);
  return out;
}

// EPLB's balanced packing of groups onto nodes: heaviest first (ties: lower group), each to
// the lightest node with room. A node lists its groups in arrival order (EPLB's expert order
// inside the node, which breaks replication ties).
inline std::vector<std::vector<int>> pack_groups(const std::vector<double>& group_load, int nodes) {
  const int G = static_cast<int>(group_load.size());
  std::vector<int> order(static_cast<std::size_t>(G));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return group_load[a] > group_load[b]; });
  std::vector<std::vector<int>> out(static_cast<std::size_t>(nodes));
  std::vector<double> sum(static_cast<std::size_t>(nodes), 0.0);
  for (int g : order) {
    int best = -1;
    for (int n = 0; n < nodes; ++n)
      if (static_cast<int>(out[n].size()) < G / nodes && (best < 0 || sum[n] < sum[best])) best = n;
    sum[best] += group_load[g];
    out[best].push_back(g);
  }
  return out;
}

// Group sums are only a proxy for what a node's ranks end up with (a hot expert can be
// replicated; equal sums can hide one hot expert). Swaps a group of the busiest node with one
// of another node when both nodes' refined maxima end below the current maximum, until none
// does. First improvement; a swap whose node means already reach the maximum is not planned;
// at most `budget` node plans (a large node's plan takes ~0.1 ms). plan(groups) -> node_plan.
template <class Plan>
void swap_groups(std::vector<std::vector<int>>& node_groups, std::vector<node_plan>& plans,
                 const std::vector<double>& group_load, int ranks_per_node, const Plan& plan,
                 int budget = 128) {
  const std::size_t N = node_groups.size();
  std::vector<double> sum(N, 0.0);
  for (std::size_t n = 0; n < N; ++n)
    for (int g : node_groups[n]) sum[n] += group_load[g];
  for (bool swapped = true; swapped && budget > 0;) {
    swapped = false;
    std::size_t hi = 0;
    for (std::size_t n = 1; n < N; ++n)
      if (plans[n].peak > plans[hi].peak) hi = n;
    const double top = plans[hi].peak, tol = 1e-12 * top;
    for (std::size_t m = 0; m < N && !swapped && budget > 0; ++m) {
      if (m == hi) continue;
      for (std::size_t a = 0; a < node_groups[hi].size() && !swapped && budget > 0; ++a)
        for (std::size_t b = 0; b < node_groups[m].size() && !swapped && budget > 0; ++b) {
          const double moved = group_load[node_groups[m][b]] - group_load[node_groups[hi][a]];
          if (std::max(sum[hi] + moved, sum[m] - moved) / ranks_per_node >= top - tol) continue;
          auto gh = node_groups[hi], gm = node_groups[m];
          std::swap(gh[a], gm[b]);
          auto ph = plan(gh), pm = plan(gm);
          budget -= 2;
          if (std::max(ph.peak, pm.peak) >= top - tol) continue;
          sum[hi] += moved;
          sum[m] -= moved;
          node_groups[hi] = std::move(gh);
          node_groups[m] = std::move(gm);
          plans[hi] = std::move(ph);
          plans[m] = std::move(pm);
          swapped = true;
        }
    }
  }
}

}  // namespace balancing

/// A replicated table for `load` (one number per logical expert: rows of one pass, or a
/// moving average over passes), following DeepSeek EPLB's rebalance_experts:
/// hierarchical when `groups % nodes == 0` (whole groups packed onto nodes, heaviest first,
/// to the lightest node with room; then each node replicates its experts over its slots and
/// packs the copies onto its ranks), otherwise one global level, where `groups` and `nodes`
/// need not divide experts and ranks (they are ignored; `note` says so). Every rank gets P/R
/// slots. greedy: EPLB's packing or a twin-avoiding one, the better. refined: both refined by
/// swaps inside a node, the better kept (fewer twins on a tie); in hierarchical mode groups
/// are also swapped between nodes while that lowers the busiest node. So the refined max/mean
/// is never above EPLB's on the same arguments. With no extra slots the block layout is also
/// refined, so it is never worse than placement::block. Deterministic. Throws config_error
/// on arguments EPLB rejects too (hierarchical path: nodes must divide ranks, groups experts).
inline balance_result balance(std::span<const double> load, const balance_options& o) {
  const int E = static_cast<int>(load.size()), R = o.ranks, P = E + o.extra_slots;
  detail::require(R >= 1, "ranks", R, "must be >= 1");
  detail::require(o.extra_slots >= 0, "extra_slots", o.extra_slots, "must be >= 0");
  detail::require(P % R == 0, "extra_slots", o.extra_slots,
                  "experts + extra_slots must be divisible by ranks");
  detail::require(o.nodes >= 1, "nodes", o.nodes, "must be >= 1");
  detail::require(o.groups >= 1, "groups", o.groups, "must be >= 1");
  for (double l : load) detail::require(l >= 0, "load", l, "must be >= 0");
  balance_result out;
  const bool by_node = o.groups % o.nodes == 0;  // EPLB's test for its hierarchical path
  if (by_node) {                                 // which asserts both of these
    detail::require(R % o.nodes == 0, "nodes", o.nodes,
                    "must divide ranks when groups divide over nodes (hierarchical balancing)");
    detail::require(E % o.groups == 0, "groups", o.groups,
                    "must divide experts when groups divide over nodes (hierarchical balancing)");
  }
  out.hierarchical = by_node && o.nodes > 1;
  const auto num = [](int v) { return std::to_string(v); };
  if (out.hierarchical) {
    out.note = "hierarchical: " + num(o.groups) + " groups packed whole onto " + num(o.nodes) +
               " nodes, then ranks inside each node";
  } else if (by_node) {
    out.note = "one node: all " + num(R) + " ranks balanced together";
  } else {
    out.note = "global: groups (" + num(o.groups) + ") do not divide over nodes (" + num(o.nodes) +
               "), so one level over all " + num(R) + " ranks, groups ignored";
    if (E % o.groups != 0)
      out.note += "; groups (" + num(o.groups) + ") do not divide experts (" + num(E) + ")";
    if (R % o.nodes != 0)
      out.note += "; nodes (" + num(o.nodes) + ") do not divide ranks (" + num(R) +
                  "): the tables record one node";
  }
  // On the node path with one node, groups only order the experts (as in EPLB, for ties).
  const int N = by_node ? o.nodes : 1, G = by_node ? o.groups : 1;
  const int rpn = R / N, S = P / R;  // rpn: ranks per packing unit (a node, or all ranks)
  const int ranks_per_node = R % o.nodes == 0 ? R / o.nodes : R;  // for replica choice

  // Node level (EPLB's), then the rank level per node; in hierarchical mode, groups are then
  // swapped between nodes where that lowers the busiest one.
  const int size = E / G;
  std::vector<double> group_load(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g)
    group_load[g] = std::accumulate(load.begin() + g * size, load.begin() + (g + 1) * size, 0.0);
  auto node_groups = balancing::pack_groups(group_load, N);
  const auto plan = [&](const std::vector<int>& gs) {
    std::vector<int> experts;
    for (int g : gs)
      for (int e = g * size; e < (g + 1) * size; ++e) experts.push_back(e);
    return balancing::plan_node(experts, load, P / N, rpn);
  };
  std::vector<balancing::node_plan> plans;
  for (int n = 0; n < N; ++n) plans.push_back(plan(node_groups[n]));
  balancing::bins_t greedy;
  for (const auto& pn : plans) greedy.insert(greedy.end(), pn.greedy.begin(), pn.greedy.end());
  out.greedy = balancing::to_table(greedy, E, R, ranks_per_node);
  if (N > 1 && G > N) balancing::swap_groups(node_groups, plans, group_load, rpn, plan);
  balancing::bins_t refined;  // copies were swapped inside a node only: groups stay whole
  for (const auto& pn : plans) refined.insert(refined.end(), pn.refined.begin(), pn.refined.end());
  out.refined = balancing::to_table(refined, E, R, ranks_per_node);
  if (o.extra_slots == 0) {  // block as a third start (it keeps groups whole on nodes)
    balancing::bins_t blocks(static_cast<std::size_t>(R));
    for (int e = 0; e < E; ++e) blocks[e / S].push_back({e, load[e]});
    for (int n = 0; n < N; ++n) {
      balancing::bins_t part(blocks.begin() + n * rpn, blocks.begin() + (n + 1) * rpn);
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
