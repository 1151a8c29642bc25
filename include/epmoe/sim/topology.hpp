// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <istream>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"

// The machine a simulated deployment runs on: nodes of ranks (one rank per GPU or per CPU
// socket), two link classes and one expert-GEMM engine per rank.
namespace epmoe::sim {

/// Link class of one transfer: between two ranks of the same node (NVLink, shared memory)
/// or between nodes (the NIC).
enum class link { intra = 0, inter = 1 };

/// Per-rank rates of a homogeneous cluster. Bandwidths are bytes/s per direction per rank;
/// latencies are seconds per exchange (the alpha of alpha-beta).
struct topology {
  std::string name = "custom";
  int nodes = 1;
  int ranks_per_node = 1;
  double intra_bandwidth = 0;    // bytes/s a rank sends (and, separately, receives) in its node
  double intra_latency = 0;      // s: start-up of one exchange within a node
  double inter_bandwidth = 0;    // bytes/s of the rank's share of the NIC, per direction
  double inter_latency = 0;      // s: start-up of one exchange across nodes
  double gemm_flops = 0;         // FLOP/s of the expert GEMMs on one rank
  double memory_bandwidth = 0;   // bytes/s of the rank's memory (expert weights are read once)
  int activation_bytes = 2;      // bytes per element of a token row on the wire (bf16: 2)
  int weight_bytes = 2;          // bytes per expert weight element
  double copy_bandwidth = 0;     // bytes/s a rank copies rows (gather, reduce; 0: memory / 2)
  double topk_rate = 0;          // logits/s of softmax + top-k (0: reading them, 4 B each)
  double regroup_bandwidth = 0;  // bytes/s of the copies around an exchange (0: copy_bandwidth)
  double reduce_bandwidth = 0;   // bytes/s the weighted reduce reads and writes (0: copy_bandwidth)
  // Optional (rows per expert GEMM, FLOP/s) points, rows ascending: the expert GEMMs' rate
  // at that many rows (interpolated in log2 rows, the end points beyond); empty: gemm_flops
  // at every row count. A GEMM of few rows runs below the rate of many.
  std::vector<std::pair<double, double>> gemm_curve{};
  // Optional: the node of each rank, when nodes hold unequal ranks (a cluster that lost
  // ranks: surviving()); empty: rank / ranks_per_node.
  std::vector<int> rank_nodes{};

  /// Row copies on one rank: permute's gather, the reduce, the shared experts' input.
  double copy_rate() const { return copy_bandwidth > 0 ? copy_bandwidth : memory_bandwidth / 2; }
  /// A rank's rows to itself and the regroup by expert (and back): buffers the expert stage
  /// has pushed out of the caches on a host; the same kernels as copy_rate() on a GPU.
  double regroup_rate() const { return regroup_bandwidth > 0 ? regroup_bandwidth : copy_rate(); }
  /// The weighted reduce: K rows in per token, one row out; on a host its inputs were just
  /// written by the combine (cache hits) and only its output is cold.
  double reduce_rate() const { return reduce_bandwidth > 0 ? reduce_bandwidth : copy_rate(); }
  double select_rate() const { return topk_rate > 0 ? topk_rate : memory_bandwidth / 4; }

  /// The expert GEMMs' FLOP/s at `rows` rows (gemm_curve, else gemm_flops).
  double gemm_rate(double rows) const {
    const auto& c = gemm_curve;
    if (c.empty()) return gemm_flops;
    if (rows <= c.front().first) return c.front().second;
    if (rows >= c.back().first) return c.back().second;
    std::size_t i = 1;
    while (c[i].first < rows) ++i;
    const double f = std::log2(rows / c[i - 1].first) / std::log2(c[i].first / c[i - 1].first);
    return c[i - 1].second + f * (c[i].second - c[i - 1].second);
  }

  int ranks() const {
    return rank_nodes.empty() ? nodes * ranks_per_node : static_cast<int>(rank_nodes.size());
  }
  int node_of(int rank) const {
    return rank_nodes.empty() ? rank / ranks_per_node : rank_nodes[static_cast<std::size_t>(rank)];
  }
  link between(int a, int b) const { return node_of(a) == node_of(b) ? link::intra : link::inter; }
  double bandwidth(link l) const { return l == link::intra ? intra_bandwidth : inter_bandwidth; }
  double latency(link l) const { return l == link::intra ? intra_latency : inter_latency; }

  void validate() const {
    using detail::require;
    require(nodes >= 1, "topology.nodes", nodes, "must be >= 1");
    require(ranks_per_node >= 1, "topology.ranks_per_node", ranks_per_node, "must be >= 1");
    require(intra_bandwidth > 0 || ranks_per_node == 1, "topology.intra_bandwidth", intra_bandwidth,
            "must be > 0 when a node holds several ranks");
    require(inter_bandwidth > 0 || nodes == 1, "topology.inter_bandwidth", inter_bandwidth,
            "must be > 0 when there are several nodes");
    require(intra_latency >= 0, "topology.intra_latency", intra_latency, "must be >= 0");
    require(inter_latency >= 0, "topology.inter_latency", inter_latency, "must be >= 0");
    require(gemm_flops > 0, "topology.gemm_flops", gemm_flops, "must be > 0");
    require(memory_bandwidth > 0, "topology.memory_bandwidth", memory_bandwidth, "must be > 0");
    for (std::size_t i = 0; i < gemm_curve.size(); ++i) {
      require(gemm_curve[i].first >= 1 && gemm_curve[i].second > 0, "topology.gemm_curve",
              gemm_curve[i].first, "points need rows >= 1 and FLOP/s > 0");
      require(i == 0 || gemm_curve[i].first > gemm_curve[i - 1].first, "topology.gemm_curve",
              gemm_curve[i].first, "rows must ascend");
    }
    require(activation_bytes >= 1, "topology.activation_bytes", activation_bytes, "must be >= 1");
    require(weight_bytes >= 1, "topology.weight_bytes", weight_bytes, "must be >= 1");
    require(copy_bandwidth >= 0, "topology.copy_bandwidth", copy_bandwidth,
            "must be >= 0 (0: half the memory bandwidth)");
    require(regroup_bandwidth >= 0, "topology.regroup_bandwidth", regroup_bandwidth,
            "must be >= 0 (0: copy_bandwidth)");
    require(reduce_bandwidth >= 0, "topology.reduce_bandwidth", reduce_bandwidth,
            "must be >= 0 (0: copy_bandwidth)");
    require(topk_rate >= 0, "topology.topk_rate", topk_rate,
            "must be >= 0 (0: a read of the logits at memory bandwidth)");
  }
};

/// 8x H100 SXM per node: NVLink 4 gives 450 GB/s per direction per GPU (900 GB/s both
/// ways); one 400 Gb/s ConnectX-7 per GPU gives 50 GB/s. Latencies are what NCCL/DeepEP
/// all-to-alls start with (a few us in a node, ~10 us over IB). GEMM rate: 600 TFLOP/s,
/// about 60% of the 989 TFLOP/s dense bf16 peak, what grouped GEMMs of MoE shapes
/// (a few hundred rows per expert) sustain in practice. HBM3: 3.35 TB/s; a row gather moves
/// ~1.3 TB/s (read + write); a fused softmax/top-k kernel ~50 G logits/s.
inline topology h100_nvlink_ib(int nodes = 1) {
  topology t{"h100_nvlink_ib", nodes, 8, 450e9, 3e-6, 50e9, 10e-6, 600e12, 3.35e12, 2, 2};
  t.copy_bandwidth = 1.3e12;
  t.topk_rate = 50e9;
  return t;
}

/// 8x H200 per node: the H100's compute and links, HBM3e at 4.8 TB/s (the weight-read
/// bound of small experts and the row copies fall by 30%).
inline topology h200(int nodes = 1) {
  topology t = h100_nvlink_ib(nodes);
  t.name = "h200";
  t.memory_bandwidth = 4.8e12;
  t.copy_bandwidth = 1.9e12;
  return t;
}

/// A CPU cluster: 2 ranks (sockets) per node over shared memory (~20 GB/s a copy), 100 Gb/s
/// Ethernet/IB shared by the two (6.25 GB/s each), fp32 rows as the host layer sends them;
/// ~1.5 TFLOP/s of fp32 GEMM, ~150 GB/s of DRAM and ~50 GB/s of row copies per socket.
inline topology cpu_cluster(int nodes = 1) {
  topology t{"cpu_cluster", nodes, 2, 20e9, 2e-6, 6.25e9, 15e-6, 1.5e12, 150e9, 4, 4};
  t.copy_bandwidth = 50e9;
  t.topk_rate = 20e9;
  return t;
}

/// A preset by name: h100_nvlink_ib, h200 or cpu_cluster.
inline topology preset(const std::string& name, int nodes = 1) {
  if (name == "h100_nvlink_ib" || name == "h100") return h100_nvlink_ib(nodes);
  if (name == "h200") return h200(nodes);
  if (name == "cpu_cluster" || name == "cpu") return cpu_cluster(nodes);
  throw config_error("topology", name, "must be h100_nvlink_ib, h200 or cpu_cluster");
}

/// The file format: one `key = value` per line, `#` starts a comment; keys are the field
/// names. Missing keys keep their defaults (those of `base`).
inline void save(std::ostream& os, const topology& t) {
  os.precision(17);
  os << "# epmoe::sim topology\n"
     << "name = " << t.name << "\nnodes = " << t.nodes << "\nranks_per_node = " << t.ranks_per_node
     << "\nintra_bandwidth = " << t.intra_bandwidth << "\nintra_latency = " << t.intra_latency
     << "\ninter_bandwidth = " << t.inter_bandwidth << "\ninter_latency = " << t.inter_latency
     << "\ngemm_flops = " << t.gemm_flops << "\nmemory_bandwidth = " << t.memory_bandwidth
     << "\nactivation_bytes = " << t.activation_bytes << "\nweight_bytes = " << t.weight_bytes
     << "\ncopy_bandwidth = " << t.copy_bandwidth << "\ntopk_rate = " << t.topk_rate
     << "\nregroup_bandwidth = " << t.regroup_bandwidth
     << "\nreduce_bandwidth = " << t.reduce_bandwidth << "\n";
  if (!t.gemm_curve.empty()) {
    os << "gemm_curve =";
    for (const auto& [rows, rate] : t.gemm_curve) os << ' ' << rows << ':' << rate;
    os << '\n';
  }
}

inline topology load(std::istream& is, topology base = {}) {
  std::string line;
  while (std::getline(is, line)) {
    line = line.substr(0, line.find('#'));
    const auto eq = line.find('=');
    auto trim = [](std::string s) {
      const auto b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
      return b == std::string::npos ? std::string{} : s.substr(b, e - b + 1);
    };
    if (trim(line).empty()) continue;
    if (eq == std::string::npos) throw config_error("topology file", line, "expected key = value");
    const std::string key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    std::istringstream v(value);
    bool ok = true;
    if (key == "name")
      base.name = value;
    else if (key == "nodes")
      ok = bool(v >> base.nodes);
    else if (key == "ranks_per_node")
      ok = bool(v >> base.ranks_per_node);
    else if (key == "intra_bandwidth")
      ok = bool(v >> base.intra_bandwidth);
    else if (key == "intra_latency")
      ok = bool(v >> base.intra_latency);
    else if (key == "inter_bandwidth")
      ok = bool(v >> base.inter_bandwidth);
    else if (key == "inter_latency")
      ok = bool(v >> base.inter_latency);
    else if (key == "gemm_flops")
      ok = bool(v >> base.gemm_flops);
    else if (key == "memory_bandwidth")
      ok = bool(v >> base.memory_bandwidth);
    else if (key == "activation_bytes")
      ok = bool(v >> base.activation_bytes);
    else if (key == "weight_bytes")
      ok = bool(v >> base.weight_bytes);
    else if (key == "copy_bandwidth")
      ok = bool(v >> base.copy_bandwidth);
    else if (key == "topk_rate")
      ok = bool(v >> base.topk_rate);
    else if (key == "regroup_bandwidth")
      ok = bool(v >> base.regroup_bandwidth);
    else if (key == "reduce_bandwidth")
      ok = bool(v >> base.reduce_bandwidth);
    else if (key == "gemm_curve") {  // rows:flops pairs, space separated
      base.gemm_curve.clear();
      std::string point;
      while (ok && v >> point) {
        const auto colon = point.find(':');
        std::istringstream rows(point.substr(0, colon)), rate(point.substr(colon + 1));
        std::pair<double, double> p;
        ok = colon != std::string::npos && bool(rows >> p.first) && bool(rate >> p.second);
        base.gemm_curve.push_back(p);
      }
    } else
      throw config_error("topology file", key, "unknown key");
    if (!ok)
      throw config_error(
          "topology." + key, value,
          key == "gemm_curve" ? "expected rows:FLOP/s pairs, space separated" : "not a number");
  }
  base.validate();
  return base;
}

inline void save_file(const std::string& path, const topology& t) {
  std::ofstream f(path);
  if (!f) throw config_error("topology file", path, "cannot be written");
  save(f, t);
}

inline topology load_file(const std::string& path, topology base = {}) {
  std::ifstream f(path);
  if (!f) throw config_error("topology file", path, "cannot be read");
  return load(f, std::move(base));
}

/// The cluster after losing ranks (issue 23): the survivors, renumbered in rank order, each
/// on its node as before (lost[r] != 0: rank r is gone; size: ranks()). Rates unchanged.
inline topology surviving(const topology& t, std::span<const char> lost) {
  epmoe::detail::require(static_cast<int>(lost.size()) == t.ranks(), "lost ranks (mask size)",
                         lost.size(), "must be the topology's ranks");
  topology s = t;
  s.rank_nodes.clear();
  for (int r = 0; r < t.ranks(); ++r)
    if (!lost[static_cast<std::size_t>(r)]) s.rank_nodes.push_back(t.node_of(r));
  epmoe::detail::require(!s.rank_nodes.empty(), "lost ranks", "all",
                         "at least one rank must survive");
  return s;
}

}  // namespace epmoe::sim
