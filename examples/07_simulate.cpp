// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Plans a deployment before renting it: runs the real planner for every simulated rank and
// prices the pass on a cluster model. With no flags it answers: 256 experts, top-8, 64 GPUs
// in 8 nodes, Zipf 1.2: which rank straggles, by how much, and how much replication and
// overlap recover (the flags spelled out):
//   epmoe_simulate --ranks 64 --nodes 8 --experts 256 --top-k 8 --skew 1.2
// --hierarchical sets the two-level exchange beside the flat ones (docs/simulator.md):
//   epmoe_simulate --skew 0 --node-limit 4 --hierarchical
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "args.hpp"
#include "process.hpp"
#include "simulate_args.hpp"
#include <epmoe/capacity/dropless.hpp>
#include <epmoe/capacity/factor.hpp>
#include <epmoe/epmoe.hpp>
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/block.hpp>
#include <epmoe/placement/round_robin.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/sim/calibrate.hpp>
#include <epmoe/sim/simulate.hpp>
#include <epmoe/sim/source.hpp>
#include <epmoe/sim/trace.hpp>
#include <epmoe/sim/validate.hpp>

using namespace epmoe;

namespace {

using namespace simulate_example;  // args, parse, usage_error

sim::topology make_topology(const args& a) {
  sim::topology t = a.topology.find('/') != std::string::npos || a.topology.ends_with(".txt")
                        ? sim::load_file(a.topology)
                        : sim::preset(a.topology);
  if (a.nodes < 1 || a.ranks % a.nodes != 0)
    usage_error("--nodes " + std::to_string(a.nodes) + " must divide --ranks " +
                std::to_string(a.ranks));
  t.nodes = a.nodes;
  t.ranks_per_node = a.ranks / a.nodes;  // the flags decide the shape, the preset the rates
  return t;
}

// The source's per-expert load, over all ranks, for the balancer.
template <class Source>
placement::table balanced(const args& a, const Source& src) {
  const auto load = src.expected_load();
  return placement::balance(load,
                            {.ranks = a.ranks, .nodes = a.nodes, .extra_slots = a.extra_slots})
      .refined;
}

// Every expert twice: rank r holds its block and the next rank's (a rank can be lost).
placement::table mirrored(const layer_config& cfg) {
  const int L = cfg.experts / cfg.ranks;
  std::vector<int> phy;
  for (int r = 0; r < cfg.ranks; ++r)
    for (int q : {r, (r + 1) % cfg.ranks})
      for (int j = 0; j < L; ++j) phy.push_back(q * L + j);
  return placement::table(cfg.experts, cfg.ranks, std::move(phy));
}

// How rows cross: one per assignment, one per (token, rank), or one per (token, node).
enum class exchange { flat, dedup, hierarchical };
exchange exchange_of(const args& a) {
  return a.hierarchical ? exchange::hierarchical : a.dedup ? exchange::dedup : exchange::flat;
}
const char* exchange_name(exchange x) {
  return x == exchange::hierarchical ? ", hierarchical" : x == exchange::dedup ? ", dedup" : "";
}

template <class Placement, class Source>
sim::result run_with(const args& a, const layer_config& cfg, const sim::topology& topo,
                     const Source& src, const Placement& where, int chunks,
                     exchange x = exchange::flat) {
  const sim::options opt{.chunks = chunks};
  if (x == exchange::hierarchical) {
    if (a.capacity == "dropless")
      return sim::simulate<sim::hierarchical_policies<Placement, capacity::dropless>>(
          cfg, topo, src, opt, where);
    return sim::simulate<sim::hierarchical_policies<Placement, capacity::factor<false>>>(
        cfg, topo, src, opt, where);
  }
  const bool dedup = x == exchange::dedup;
  if (a.capacity == "dropless") {
    if (dedup)
      return sim::simulate<sim::policies<Placement, capacity::dropless, true>>(cfg, topo, src, opt,
                                                                               where);
    return sim::simulate<sim::policies<Placement, capacity::dropless>>(cfg, topo, src, opt, where);
  }
  if (dedup)
    return sim::simulate<sim::policies<Placement, capacity::factor<false>, true>>(cfg, topo, src,
                                                                                  opt, where);
  return sim::simulate<sim::policies<Placement, capacity::factor<false>>>(cfg, topo, src, opt,
                                                                          where);
}

template <class Source>
sim::result run(const args& a, const std::string& where, int chunks, const layer_config& cfg,
                const sim::topology& topo, const Source& src, exchange x) {
  if (where == "block") return run_with(a, cfg, topo, src, placement::block(cfg), chunks, x);
  if (where == "round_robin")
    return run_with(a, cfg, topo, src, placement::round_robin(cfg), chunks, x);
  if (where == "balanced") return run_with(a, cfg, topo, src, balanced(a, src), chunks, x);
  if (where == "mirrored") return run_with(a, cfg, topo, src, mirrored(cfg), chunks, x);
  usage_error("unknown placement " + where + " (block, round_robin, balanced, mirrored)");
}

// The fullest port of one link class over the ranks, in or out (dispatch bytes).
double busiest_port(const sim::result& x, int l) {
  double b = 0;
  for (const auto& m : x.per_rank)
    b = std::max({b, m.dispatch_bytes.out[l], m.dispatch_bytes.in[l]});
  return b;
}
double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

// Flat, dedup and two-level side by side on one configuration: what crosses each link class
// and what it costs.
template <class Source>
void two_level(const args& a, const std::string& where, int chunks, const layer_config& cfg,
               const sim::topology& topo, const Source& src) {
  const exchange kinds[3] = {exchange::flat, exchange::dedup, exchange::hierarchical};
  sim::result r[3];
  for (int i = 0; i < 3; ++i) r[i] = run(a, where, chunks, cfg, topo, src, kinds[i]);
  std::printf("\ntwo-level dispatch (placement %s, capacity %s, %s, C=%d; %d nodes of %d ranks):\n",
              where.c_str(), a.capacity.c_str(), chunks > 1 ? "pipelined" : "sequential", chunks,
              topo.nodes, topo.ranks_per_node);
  std::printf("  %-34s %12s %12s %12s %10s %10s\n", "", "flat", "dedup", "hierarchical",
              "hier/flat", "hier/dedup");
  using sim::result;
  const struct {
    const char* what;
    double (*value)(const result&);
  } rows[] = {
      {"inter-node rows, all ranks (k)", [](const result& x) { return x.dispatch_rows[1] / 1e3; }},
      {"inter-node bytes, all ranks (MB)",
       [](const result& x) { return x.dispatch_bytes[1] / 1e6; }},
      {"intra-node bytes, all ranks (MB)",
       [](const result& x) { return x.dispatch_bytes[0] / 1e6; }},
      {"busiest NIC, in or out (MB)", [](const result& x) { return busiest_port(x, 1) / 1e6; }},
      {"busiest NVLink, in or out (MB)", [](const result& x) { return busiest_port(x, 0) / 1e6; }},
      {"dispatch (us)", [](const result& x) { return sum(x.stages.dispatch) * 1e6; }},
      {"combine (us)", [](const result& x) { return sum(x.stages.combine) * 1e6; }},
      {"layer latency (us)", [](const result& x) { return x.latency * 1e6; }}};
  for (const auto& row : rows) {
    double v[3];
    for (int i = 0; i < 3; ++i) v[i] = row.value(r[i]);
    std::printf("  %-34s %12.1f %12.1f %12.1f %10.3f %10.3f\n", row.what, v[0], v[1], v[2],
                v[0] > 0 ? v[2] / v[0] : 0.0, v[1] > 0 ? v[2] / v[1] : 0.0);
  }
  std::printf(
      "  (dispatch bytes: rows and, with dedup, 8 B of metadata per assignment; the combine "
      "sends the rows back)\n");
}

void print(const sim::result& r, int show) {
  std::vector<int> order(static_cast<std::size_t>(r.ranks));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return r.per_rank[x].total() > r.per_rank[y].total(); });
  if (static_cast<int>(order.size()) > show) order.resize(static_cast<std::size_t>(show));
  std::printf("  own stage times per rank, us (busiest first; counts = the counts all-to-all)\n");
  std::printf("  %5s %7s %7s %7s %7s %9s %9s %9s %7s %9s %8s %8s %8s\n", "rank", "route", "permute",
              "shared", "counts", "dispatch", "experts", "combine", "reduce", "total", "rows",
              "intra_MB", "inter_MB");
  for (int q : order) {
    const auto& m = r.per_rank[q];
    std::printf("  %5d %7.1f %7.1f %7.1f %7.1f %9.1f %9.1f %9.1f %7.1f %9.1f %8lld %8.1f %8.1f\n",
                q, m.route * 1e6, m.permute * 1e6, m.shared * 1e6, m.counts * 1e6, m.dispatch * 1e6,
                m.experts * 1e6, m.combine * 1e6, m.reduce * 1e6, m.total() * 1e6,
                static_cast<long long>(m.padded_rows_computed),
                (m.dispatch_bytes.out[0] + m.dispatch_bytes.in[0]) / 1e6,
                (m.dispatch_bytes.out[1] + m.dispatch_bytes.in[1]) / 1e6);
  }
  double mean = 0;
  for (const auto& m : r.per_rank) mean += m.total() / r.ranks;
  std::printf("  mean rank: %.1f us of own stage time (top %zu of %d ranks shown)\n", mean * 1e6,
              order.size(), r.ranks);
  std::printf("straggler: rank %d, %.0f%% above the mean rank; %s\n", r.straggler,
              r.straggler_excess * 100, r.straggler_reason.c_str());
  std::printf("rows computed per rank: max/mean %.2f; dropped %lld of %lld assignments\n",
              r.rows_imbalance.max_over_mean, static_cast<long long>(r.dropped),
              static_cast<long long>(r.assignments));
  std::printf("dispatch bytes: %.1f MB intra-node, %.1f MB inter-node (all ranks)\n",
              r.dispatch_bytes[0] / 1e6, r.dispatch_bytes[1] / 1e6);
  if (r.quota > 0) {
    index_t peak = 0;
    for (const auto& m : r.per_rank) peak = std::max(peak, m.peak_recv_rows);
    std::printf(
        "receive bound: %lld rows per pair per round (with dedup: tokens of every rank per "
        "window), %d rounds in the busiest chunk, %d exchange units; peak %lld rows received in "
        "one round\n",
        static_cast<long long>(r.quota), r.rounds, r.units, static_cast<long long>(peak));
  }
  std::printf("layer latency: %.1f us (%.1f us if every rank did the mean rank's work)\n",
              r.latency * 1e6, r.balanced_latency * 1e6);
}

// Any placement as a table: the expert each slot holds.
template <class Placement>
placement::table as_table(const layer_config& cfg, const Placement& p) {
  std::vector<int> phy;
  for (int r = 0; r < cfg.ranks; ++r)
    for (int j = 0; j < p.slots_per_rank(); ++j) phy.push_back(p.expert_at(r, j));
  return placement::table(cfg.experts, cfg.ranks, std::move(phy));
}

// What if ranks die (issue 23): the same pass before and after, on the survivors (each keeps
// its slots: placement::surviving, the layer's exclude_ranks) at the same tokens per rank.
template <class Source>
void what_if(const args& a, const layer_config& cfg, const sim::topology& topo, const Source& src) {
  std::vector<char> lost(static_cast<std::size_t>(a.ranks), 0);
  for (int r : a.lost) lost[static_cast<std::size_t>(r)] = 1;
  const std::string name = a.single ? a.placement : "balanced";
  const placement::table where = name == "balanced"   ? balanced(a, src)
                                 : name == "mirrored" ? mirrored(cfg)
                                 : name == "block"    ? as_table(cfg, placement::block(cfg))
                                                      : as_table(cfg, placement::round_robin(cfg));
  std::string which;
  for (int r : a.lost) which += (which.empty() ? "" : ", ") + std::to_string(r);
  std::printf("\nwhat if rank(s) %s die (placement %s, %d slots, sequential):\n", which.c_str(),
              name.c_str(), where.slots());
  placement::table after;
  try {
    after = placement::surviving(where, lost);
  } catch (const config_error& e) {
    std::printf("  the layer cannot go on: %s\n", e.what());
    return;
  }
  std::vector<int> old_rank;  // survivor -> its rank before
  for (int r = 0; r < a.ranks; ++r)
    if (!lost[static_cast<std::size_t>(r)]) old_rank.push_back(r);
  std::vector<int> fewer;  // experts that lost a copy but kept one
  for (int e = 0; e < cfg.experts; ++e) {
    int before = 0, now = 0;
    for (int p = 0; p < where.slots(); ++p) before += where.phy_to_log()[p] == e;
    for (int p = 0; p < after.slots(); ++p) now += after.phy_to_log()[p] == e;
    if (now < before) fewer.push_back(e);
  }
  layer_config cfg2 = cfg;
  cfg2.ranks = after.ranks();
  // Survivors leave nodes of unequal size, which the two-level exchange does not take.
  const exchange x = a.dedup || a.hierarchical ? exchange::dedup : exchange::flat;
  if (a.hierarchical) std::printf("  (flat dedup exchange: the survivors' nodes are unequal)\n");
  const sim::result r0 = run_with(a, cfg, topo, src, where, 1, x);
  const sim::result r1 = run_with(a, cfg2, sim::surviving(topo, lost), src, after, 1, x);
  const int gone = where.slots() - after.slots();
  std::printf(
      "  capacity lost: %d of %d expert slots (%.1f%%), the tokens of %d rank(s); %zu expert(s) "
      "lost a copy and run on the others",
      gone, where.slots(), 100.0 * gone / where.slots(), a.ranks - after.ranks(), fewer.size());
  for (std::size_t i = 0; i < fewer.size() && i < 8; ++i)
    std::printf("%s%d", i ? ", " : " (", fewer[i]);
  std::printf("%s\n", fewer.empty() ? "" : fewer.size() > 8 ? ", ...)" : ")");
  std::printf("  before: straggler rank %d, %.0f%% above the mean rank; layer %.1f us\n",
              r0.straggler, 100 * r0.straggler_excess, r0.latency * 1e6);
  std::printf(
      "  after:  straggler rank %d (rank %d before), %.0f%% above the mean rank; layer "
      "%.1f us (%+.1f%%), rows max/mean %.2f (was %.2f)\n",
      r1.straggler, old_rank[static_cast<std::size_t>(r1.straggler)], 100 * r1.straggler_excess,
      r1.latency * 1e6, 100 * (r1.latency / r0.latency - 1), r1.rows_imbalance.max_over_mean,
      r0.rows_imbalance.max_over_mean);
}

void write_trace(const std::string& path, const sim::result& r) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (!f) throw config_error("--trace", path, "cannot be written");
  sim::write_trace(f, r);
  std::printf("trace: %s (open in ui.perfetto.dev)\n", path.c_str());
}

// ---- calibration and validation on this machine (comm::threads) ----

layer_config validation_config(const args& a) {
  return {.hidden = a.hidden,
          .ffn = a.ffn,
          .experts = a.experts,
          .top_k = a.top_k,
          .ranks = a.ranks,
          .max_tokens = a.tokens,
          .shared_experts = a.shared,
          .max_recv_rows = a.max_recv_rows};
}

sim::calibration calibrate_here(const args& a) {
  const auto o = sim::options_for(validation_config(a), a.tokens);
  programs::map_large_buffers_fresh();
  const int blas = sim::share_blas_threads(a.ranks);
  std::printf("%d BLAS thread(s) per rank\n", blas);
  const auto c = sim::calibrate(o);
  sim::print_calibration(stdout, c, o, a.ranks, "in-process, comm::threads");
  return c;
}

// The real layer (block, dropless, sequential) on comm::threads against the simulator: rounds
// of (calibrate, passes), each calibration predicting the passes beside it.
template <class Source>
int validate(const args& a, const Source& src) {
  const layer_config cfg = validation_config(a);
  const auto w = sim::hand_gate_weights(cfg);
  programs::map_large_buffers_fresh();
  const int blas = sim::share_blas_threads(a.ranks);
  std::vector<std::vector<stage_times>> real(static_cast<std::size_t>(a.ranks));
  std::vector<sim::validation_round> rounds;
  comm::threads_world world(a.ranks);
  world.run([&](comm::threads c) {
    if (a.topology_set) {
      real[c.rank()] = sim::run_layer_passes(c, cfg, w, src, a.passes * a.rounds);
      return;
    }
    auto mine = sim::run_rounds(
        c, [&] { return c; }, cfg, w, src, a.passes, a.rounds);
    if (c.rank() == 0) rounds = std::move(mine);
  });
  std::vector<sim::validation_row> rows;
  double imbalance = 0;
  if (a.topology_set) {
    sim::topology topo = sim::load_file(a.topology);
    topo.nodes = 1, topo.ranks_per_node = a.ranks;
    const auto s = sim::simulate<sim::policies<>>(cfg, topo, src);
    rows = sim::compare(s, real);
    imbalance = s.rows_imbalance.max_over_mean;
  } else {
    std::vector<sim::calibration> cals;
    for (const auto& r : rounds) cals.push_back(r.cal);
    const auto o = sim::options_for(cfg, a.tokens);
    sim::print_calibration(
        stdout, sim::median_of(cals, o, a.ranks), o, a.ranks,
        ("in-process, comm::threads, median of " + std::to_string(a.rounds) + " rounds").c_str());
    rows = sim::compare_rounds(cfg, src, rounds);
    imbalance = sim::simulate<sim::policies<>>(cfg, cals[0].topo, src).rows_imbalance.max_over_mean;
  }
  std::printf(
      "validation: real moe_layer (block, dropless, sequential) on %d comm::threads ranks, "
      "H=%d F=%d E=%d top-%d T=%d, %d shared, max_recv_rows %d, %s; %d rounds of (calibrate, %d "
      "passes), each round's best pass; %d BLAS thread(s) per rank; sim rows/rank max/mean %.2f\n",
      a.ranks, a.hidden, a.ffn, a.experts, a.top_k, a.tokens, a.shared, a.max_recv_rows,
      a.skew > 0 ? ("Zipf " + std::to_string(a.skew).substr(0, 4)).c_str() : "uniform", a.rounds,
      a.passes, blas, imbalance);
  sim::print_validation(stdout, rows);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const args a = parse(argc, argv);
  if (!a.calibrate.empty()) {
    auto c = calibrate_here(a);
    sim::save_file(a.calibrate, c.topo);
    std::printf("wrote %s:\n", a.calibrate.c_str());
    sim::save(std::cout, c.topo);
    return 0;
  }
  if (a.validate) {
    if (a.skew > 0) return validate(a, sim::zipf(a.experts, a.skew, a.top_k, a.tokens, a.seed));
    return validate(a, sim::uniform(a.experts, a.top_k, a.tokens, a.seed));
  }
  const sim::topology topo = make_topology(a);
  const layer_config cfg{.hidden = a.hidden,
                         .ffn = a.ffn,
                         .experts = a.experts,
                         .top_k = a.top_k,
                         .ranks = a.ranks,
                         .max_tokens = a.tokens,
                         .capacity_factor = a.capacity == "dropless" ? 1.0 : std::stod(a.capacity),
                         .max_recv_rows = a.max_recv_rows};
  auto go = [&](const auto& src) {
    std::printf("%d experts, top-%d, H=%d F=%d, %d tokens/rank on %d ranks in %d nodes (%s)\n",
                a.experts, a.top_k, a.hidden, a.ffn, a.tokens, a.ranks, a.nodes, topo.name.c_str());
    if (a.node_limit > 0)
      std::printf("node-limited routing: each token's experts in %d of %d groups of %d experts\n",
                  a.node_limit, a.nodes, a.experts / a.nodes);
    if (a.compare) {
      // The question of issue 9 in one run: who straggles, by how much, and what replication
      // (balanced table) and overlap (pipelined) recover.
      double lat[2][2];
      sim::result base;
      const char* places[2] = {"block", "balanced"};
      for (int p = 0; p < 2; ++p)
        for (int s = 0; s < 2; ++s) {
          auto r = run(a, places[p], s ? a.chunks : 1, cfg, topo, src, exchange_of(a));
          lat[p][s] = r.latency;
          if (p == 0 && s == 0) base = std::move(r);
        }
      std::printf("placement block, capacity %s%s, sequential:\n", a.capacity.c_str(),
                  exchange_name(exchange_of(a)));
      print(base, a.show);
      write_trace(a.trace, base);
      const std::string bal = "balanced +" + std::to_string(a.extra_slots) + " slots";
      std::printf("\n%-28s %14s %14s\n", "latency (us)", "sequential",
                  ("pipelined C=" + std::to_string(a.chunks)).c_str());
      for (int p = 0; p < 2; ++p)
        std::printf("%-28s %14.1f %14.1f\n", p ? bal.c_str() : "block", lat[p][0] * 1e6,
                    lat[p][1] * 1e6);
      auto pct = [&](double x) { return 100 * (1 - x / lat[0][0]); };
      std::printf(
          "\nanswer: rank %d is the straggler, %.0f%% above the mean rank: %s;\n"
          "  the layer takes %.2f ms, %.1fx the %.2f ms of perfect balance.\n"
          "  replication (%s) recovers %.0f%% (-> %.2f ms), overlap (pipelined C=%d) %.0f%% "
          "(-> %.2f ms), both %.0f%% (-> %.2f ms).\n",
          base.straggler, 100 * base.straggler_excess, base.straggler_reason.c_str(),
          base.latency * 1e3, base.latency / base.balanced_latency, base.balanced_latency * 1e3,
          bal.c_str(), pct(lat[1][0]), lat[1][0] * 1e3, a.chunks, pct(lat[0][1]), lat[0][1] * 1e3,
          pct(lat[1][1]), lat[1][1] * 1e3);
      if (a.hierarchical) two_level(a, "block", 1, cfg, topo, src);
      if (!a.lost.empty()) what_if(a, cfg, topo, src);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int chunks = a.schedule == "pipelined" ? a.chunks : 1;
    const auto r = run(a, a.placement, chunks, cfg, topo, src, exchange_of(a));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("placement %s, capacity %s%s, %s (C=%d); simulated in %.3f s\n",
                a.placement.c_str(), a.capacity.c_str(), exchange_name(exchange_of(a)),
                a.schedule.c_str(), chunks, secs);
    print(r, a.show);
    write_trace(a.trace, r);
    if (a.hierarchical) two_level(a, a.placement, chunks, cfg, topo, src);
    if (!a.lost.empty()) what_if(a, cfg, topo, src);
  };
  if (!a.stats.empty()) {
    std::ifstream f(a.stats);
    go(sim::recorded_source(sim::read_stats(f), 0, a.seed));
  } else if (a.node_limit > 0) {  // the groups follow block placement's nodes
    auto load = a.skew > 0 ? sim::zipf_load(a.experts, a.skew, a.seed)
                           : std::vector<double>(static_cast<std::size_t>(a.experts), 1.0);
    go(sim::group_limited_source(std::move(load), a.top_k, a.tokens, a.nodes, a.node_limit,
                                 a.seed));
  } else if (a.skew > 0) {
    go(sim::zipf(a.experts, a.skew, a.top_k, a.tokens, a.seed));
  } else {
    go(sim::uniform(a.experts, a.top_k, a.tokens, a.seed));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "epmoe_simulate: %s\n", e.what());
  return 1;
}
