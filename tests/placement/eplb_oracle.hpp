// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <stdexcept>
#include <vector>

// A test oracle: DeepSeek's EPLB greedy (github.com/deepseek-ai/EPLB, eplb.py,
// rebalance_experts) for one layer, written from its published description and kept
// independent of placement/balancer.hpp. Same steps and order as EPLB:
//   1. balanced packing of expert groups onto nodes (heaviest group first, to the lightest
//      node with room), when num_groups % num_nodes == 0; otherwise one node, one group;
//   2. per node, extra replicas one at a time to the expert with the most load per copy;
//   3. per node, balanced packing of the copies onto the node's GPUs.
// Ties: EPLB picks with Python's min and torch.max (the first of equal candidates wins, as
// here) and sorts with torch.sort, whose order among equal weights is unspecified: here equal
// weights keep their index order, or the reverse with reverse_ties. Arithmetic is float64
// (EPLB casts to float32), so the figures are exact for the load model.
namespace eplb_oracle {

struct packing {
  std::vector<int> pack;          // [n] pack of each item
  std::vector<int> rank_in_pack;  // [n] its position inside the pack
};

// n items onto m packs of n/m items each.
inline packing balanced_packing(const std::vector<double>& w, int m, bool reverse_ties = false) {
  const int n = static_cast<int>(w.size());
  if (m <= 0 || n % m != 0) throw std::invalid_argument("balanced_packing: m must divide n");
  const int per = n / m;
  packing out{std::vector<int>(w.size()), std::vector<int>(w.size())};
  if (per == 1) {  // EPLB: item i goes to pack i
    std::iota(out.pack.begin(), out.pack.end(), 0);
    std::fill(out.rank_in_pack.begin(), out.rank_in_pack.end(), 0);
    return out;
  }
  std::vector<int> order(w.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return w[a] > w[b] || (reverse_ties && w[a] == w[b] && a > b);
  });
  std::vector<double> weight(static_cast<std::size_t>(m), 0.0);
  std::vector<int> items(static_cast<std::size_t>(m), 0);
  for (int i : order) {
    int p = -1;
    for (int q = 0; q < m; ++q)
      if (items[q] < per && (p < 0 || weight[q] < weight[p])) p = q;
    out.pack[i] = p;
    out.rank_in_pack[i] = items[p]++;
    weight[p] += w[i];
  }
  return out;
}

struct replication {
  std::vector<int> phy2log;  // [phys] logical item of each copy: 0..n-1, then the extra ones
  std::vector<int> rank;     // [phys] replica index of each copy
  std::vector<int> count;    // [n] copies of each item
};

inline replication replicate(const std::vector<double>& w, int phys) {
  const int n = static_cast<int>(w.size());
  replication r{std::vector<int>(static_cast<std::size_t>(phys)),
                std::vector<int>(static_cast<std::size_t>(phys), 0), std::vector<int>(w.size(), 1)};
  std::iota(r.phy2log.begin(), r.phy2log.begin() + n, 0);
  for (int i = n; i < phys; ++i) {
    int best = 0;
    for (int j = 1; j < n; ++j)
      if (w[j] / r.count[j] > w[best] / r.count[best]) best = j;
    r.phy2log[i] = best;
    r.rank[i] = r.count[best]++;
  }
  return r;
}

struct result {
  std::vector<int> phy2log;               // [replicas] expert of each physical slot
  std::vector<std::vector<int>> log2phy;  // [experts][count] slots, by replica index
  std::vector<int> count;                 // [experts]
  bool hierarchical = false;
};

inline result rebalance_hierarchical(const std::vector<double>& weight, int replicas, int groups,
                                     int nodes, int gpus, bool reverse_ties = false) {
  const int E = static_cast<int>(weight.size());
  if (E % groups || groups % nodes || gpus % nodes || replicas % gpus)
    throw std::invalid_argument("rebalance_hierarchical: shapes do not divide");
  const int group_size = E / groups, per_node = groups / nodes, log_per_node = E / nodes;
  const int phy_per_node = replicas / nodes, per_gpu = replicas / gpus;

  // 1. Groups onto nodes; mlog (the node-major order) of expert e and its inverse.
  std::vector<double> group_load(static_cast<std::size_t>(groups), 0.0);
  for (int e = 0; e < E; ++e) group_load[e / group_size] += weight[e];
  const packing gp = balanced_packing(group_load, nodes, reverse_ties);
  std::vector<int> log2mlog(static_cast<std::size_t>(E)), mlog2log(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) {
    const int g = e / group_size;
    log2mlog[e] = (gp.pack[g] * per_node + gp.rank_in_pack[g]) * group_size + e % group_size;
    mlog2log[log2mlog[e]] = e;
  }

  result out;
  out.phy2log.assign(static_cast<std::size_t>(replicas), -1);
  std::vector<int> phy_rank(static_cast<std::size_t>(replicas), -1);
  out.count.assign(static_cast<std::size_t>(E), 0);
  for (int node = 0; node < nodes; ++node) {
    // 2. Replicas inside the node, over its experts in mlog order.
    std::vector<double> w(static_cast<std::size_t>(log_per_node));
    for (int i = 0; i < log_per_node; ++i) w[i] = weight[mlog2log[node * log_per_node + i]];
    const replication rep = replicate(w, phy_per_node);
    // 3. The node's copies onto its GPUs; copy c lands in node slot pack * per_gpu + rank.
    std::vector<double> per_copy(static_cast<std::size_t>(phy_per_node));
    for (int c = 0; c < phy_per_node; ++c)
      per_copy[c] = w[rep.phy2log[c]] / rep.count[rep.phy2log[c]];
    const packing cp = balanced_packing(per_copy, gpus / nodes, reverse_ties);
    for (int c = 0; c < phy_per_node; ++c) {
      const int slot = node * phy_per_node + cp.pack[c] * per_gpu + cp.rank_in_pack[c];
      const int e = mlog2log[node * log_per_node + rep.phy2log[c]];
      out.phy2log[slot] = e;
      phy_rank[slot] = rep.rank[c];
    }
    for (int i = 0; i < log_per_node; ++i)
      out.count[mlog2log[node * log_per_node + i]] = rep.count[i];
  }
  out.log2phy.assign(static_cast<std::size_t>(E), {});
  for (int e = 0; e < E; ++e) out.log2phy[e].assign(static_cast<std::size_t>(out.count[e]), -1);
  for (int p = 0; p < replicas; ++p) out.log2phy[out.phy2log[p]][phy_rank[p]] = p;
  return out;
}

/// EPLB's entry point: hierarchical when the groups divide over the nodes, else global.
inline result rebalance_experts(const std::vector<double>& weight, int num_replicas, int num_groups,
                                int num_nodes, int num_gpus, bool reverse_ties = false) {
  if (num_groups % num_nodes == 0) {
    result r =
        rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus, reverse_ties);
    r.hierarchical = true;
    return r;
  }
  return rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus, reverse_ties);
}

/// Load per GPU when each copy of expert e takes weight[e] / count[e].
inline std::vector<double> gpu_loads(const result& r, const std::vector<double>& weight, int gpus) {
  const int per_gpu = static_cast<int>(r.phy2log.size()) / gpus;
  std::vector<double> out(static_cast<std::size_t>(gpus), 0.0);
  for (std::size_t p = 0; p < r.phy2log.size(); ++p)
    out[static_cast<int>(p) / per_gpu] += weight[r.phy2log[p]] / r.count[r.phy2log[p]];
  return out;
}

inline double max_over_mean(const std::vector<double>& v) {
  double sum = 0, top = 0;
  for (double x : v) {
    sum += x;
    top = std::max(top, x);
  }
  return sum > 0 ? top * static_cast<double>(v.size()) / sum : 0;
}

}  // namespace eplb_oracle
