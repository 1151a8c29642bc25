// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <exception>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/capacity/factor.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/exchange/message.hpp"
#include "epmoe/core/options.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/sim/cost.hpp"
#include "epmoe/sim/counts.hpp"
#include "epmoe/sim/result.hpp"
#include "epmoe/sim/topology.hpp"

// simulate(): every rank's routing goes through the layer's own planner (build_send_plan,
// build_dedup_plan, the placement's slot_for, the capacity limit); only the counts are kept,
// and the cost model prices them.
namespace epmoe::sim {

/// The policy slots the planner and the cost model read (the layer's Policies work as they
/// are; without an expert slot the expert is SwiGLU).
template <class Placement = placement::block, class Capacity = capacity::dropless,
          bool Dedup = false, class Expert = expert::swiglu>
struct policies {
  using placement = Placement;
  using capacity = Capacity;
  using expert = Expert;
  static constexpr layer_options options{.dedup = Dedup};
};

/// The same with the two-level exchange (options.hierarchical, which implies dedup): one row
/// per (token, node) between nodes, fanned out inside the node (topology::ranks_per_node).
template <class Placement = placement::block, class Capacity = capacity::dropless,
          class Expert = expert::swiglu>
struct hierarchical_policies : policies<Placement, Capacity, true, Expert> {
  static constexpr layer_options options{.dedup = true, .hierarchical = true};
};

struct options {
  int chunks = 1;                 // C: 1 = schedule::sequential, > 1 = schedule::pipelined<C>
  bool keep_peer_counts = false;  // keep [R, R] rows sent (tests; R*R numbers)
  int threads = 0;  // planner threads over ranks (0: the hardware's, at most one per 16 ranks)
};

/// Simulates one forward pass of moe_layer<Policies> on `topo`: every rank routes its
/// source tokens, plans with `where` and `cap` as the layer does, and the counts are priced.
/// A Source provides tokens(rank) and route(rank, mutable_routing_view) (see source.hpp) and
/// must be safe to call from several threads at once (the sources here are: const, stateless).
/// Memory is O(threads * (R * C + P * C + T * K)) (plus R * R with keep_peer_counts).
template <class Policies, class Source>
result simulate(const layer_config& cfg, const topology& topo, const Source& src,
                const options& opt, const typename Policies::placement& where,
                const typename Policies::capacity& cap = {}) {
  using placement_type = typename Policies::placement;
  using capacity_type = typename Policies::capacity;
  using expert_type = typename detail::expert_of<Policies>::type;
  constexpr bool hierarchical = epmoe::detail::options_of<Policies>().hierarchical;
  constexpr bool dedup = epmoe::detail::options_of<Policies>().dedup || hierarchical;
  // The low-latency exchange: one all-to-all per direction of fixed slots, no counts round.
  constexpr bool low_latency = epmoe::detail::options_of<Policies>().low_latency;
  static_assert(!(low_latency && (dedup || capacity_type::pads)),
                "epmoe::sim: options.low_latency moves flat rows in fixed slots (as in the "
                "layer): no dedup, hierarchical or padded capacity");
  static_assert(!(dedup && capacity_type::pads),
                "epmoe::sim: per-rank dedup (and so the hierarchical exchange) does not combine "
                "with padded capacity (as in the layer): use capacity::factor<false> or "
                "capacity::dropless with dedup");
  cfg.validate();
  topo.validate();
  epmoe::detail::require(cfg.zero_experts == 0, "zero_experts", cfg.zero_experts,
                         "must be 0 in the simulator (it prices the routed experts' rows; a "
                         "zero expert sends none)");
  if constexpr (placement_with_validate<placement_type>) where.validate(cfg);
  epmoe::detail::require(topo.ranks() == cfg.ranks, "topology ranks", topo.ranks(),
                         "nodes * ranks_per_node must equal config ranks");
  epmoe::detail::require(opt.chunks >= 1 && opt.chunks <= 1024, "chunks", opt.chunks,
                         "must be in [1, 1024]");
  epmoe::detail::require(opt.threads >= 0, "threads", opt.threads,
                         "must be >= 0 (0: the hardware's)");
  const int R = cfg.ranks, K = cfg.top_k, E = cfg.experts, Cs = opt.chunks;
  const int L = where.slots_per_rank(), P = R * L;
  const int G = hierarchical ? topo.ranks_per_node : 0;  // the planner's nodes: rank / G
  if constexpr (hierarchical) {
    epmoe::detail::require(topo.rank_nodes.empty(), "topology.rank_nodes", topo.rank_nodes.size(),
                           "must be empty with options.hierarchical (every node holds "
                           "ranks_per_node ranks)");
    epmoe::detail::require(G <= 64, "topology.ranks_per_node", G,
                           "must be <= 64 with options.hierarchical (as in the layer)");
    epmoe::detail::require(cfg.ranks_per_node == 0 || cfg.ranks_per_node == G,
                           "config ranks_per_node", cfg.ranks_per_node,
                           "must be 0 or the topology's ranks_per_node");
  }
  // The receive bound, as the layer splits it: every (source, destination) pair moves at most
  // `quota` rows per round; the schedule keeps 1 (sequential) or 3 (pipelined) rounds in flight.
  // With dedup a round is a window of `quota` tokens of every rank: the plan's chunks.
  const index_t bound = cfg.max_recv_rows;
  const int live = Cs > 1 ? 3 : 1;
  if (bound > 0) {
    epmoe::detail::require(!capacity_type::pads, "max_recv_rows", bound,
                           "does not combine with padded capacity (as in the layer): use "
                           "capacity::factor<false> or capacity::dropless");
    epmoe::detail::require(bound >= index_t{R} * live, "max_recv_rows", bound,
                           live == 1 ? "must be >= ranks"
                                     : "must be >= 3 * ranks (a pipelined schedule keeps 3 "
                                       "rounds in flight)");
  }
  if constexpr (low_latency) {
    epmoe::detail::require(Cs == 1, "chunks", Cs, "must be 1 with options.low_latency");
    epmoe::detail::require(bound == 0, "max_recv_rows", bound,
                           "must be 0 with options.low_latency");
  }
  const index_t quota = bound > 0 ? std::max<index_t>(1, bound / (index_t{R} * live)) : 0;
  const index_t per_chunk = (cfg.max_tokens + Cs - 1) / Cs;
  const int windows = dedup && quota > 0 ? static_cast<int>((per_chunk + quota - 1) / quota) : 1;
  const int C = Cs * windows;                            // the plan's chunks
  const index_t row_quota = dedup ? index_t{0} : quota;  // rounds that split a pair's rows
  const double row_bytes = double(cfg.hidden) * topo.activation_bytes;
  const double meta_bytes = dedup ? double(sizeof(std::int64_t)) : 0.0;

  result out;
  out.ranks = R, out.chunks = Cs, out.slots_per_rank = L, out.hierarchical = hierarchical;
  out.low_latency = low_latency;
  // Low latency: the bytes of one (source, destination) slot, as the layer sizes it: a head of
  // whole rows (the counts message) and S = min(T * min(K, L), L * per-expert bound) rows.
  double slot_bytes = 0;
  if constexpr (low_latency) {
    const index_t T = cfg.max_tokens;
    const index_t S = std::min<index_t>(T * std::min(K, L), L * std::min(T, cap.limit(cfg, T)));
    const double head = double(call_header::size + 2 * L + 2) * double(sizeof(index_t));
    slot_bytes = (std::ceil(head / row_bytes) + double(S)) * row_bytes;
    out.slot_bytes = slot_bytes;
  }
  out.per_rank.resize(static_cast<std::size_t>(R));
  if (opt.keep_peer_counts) {
    out.rows_sent.assign(static_cast<std::size_t>(R) * R, 0);
    out.assignment_rows_sent.assign(static_cast<std::size_t>(R) * R, 0);
  }

  // Plan every rank with the layer's planner; threads take contiguous ranges of ranks.
  int W = opt.threads > 0 ? opt.threads : static_cast<int>(std::thread::hardware_concurrency());
  W = std::clamp(std::min(W, R / 16), 1, R);
  std::vector<detail::partial_counts> parts;
  parts.reserve(static_cast<std::size_t>(W));
  for (int w = 0; w < W; ++w) parts.emplace_back(R, C, P);
  auto plan_ranks = [&](int r0, int r1, detail::partial_counts& part, auto& look) {
    detail::plan_workspace ws(R, L, K, C, E, G);
    std::vector<std::int32_t> ids;
    std::vector<float> weights;
    for (int r = r0; r < r1; ++r) {
      const index_t T = src.tokens(r);
      epmoe::detail::require(T <= cfg.max_tokens, "source tokens", T,
                             "must be <= config max_tokens");
      ids.resize(static_cast<std::size_t>(T * K));
      weights.resize(static_cast<std::size_t>(T * K));
      src.route(r, {{ids.data(), T, K}, {weights.data(), T, K}});
      const index_t limit = cap.limit(cfg, T);
      // Padded blocks hold the capacity of max_tokens, as in the layer.
      const index_t pad_rows = capacity_type::pads ? cap.limit(cfg, cfg.max_tokens) : 0;
      ws.reserve(T, K, std::max(T * K, pad_rows * P));
      dispatch_plan& p = ws.plan;
      const routing_view routing{{ids.data(), T, K}, {weights.data(), T, K}};
      if constexpr (requires { look.set_home(r); }) look.set_home(r);
      // Token ids as the layer numbers them without given ids: rank * max_tokens + t.
      build_send_plan(routing, look, E, limit, capacity_type::pads,
                      token_origin{r, nullptr, std::int64_t{r} * cfg.max_tokens}, p, &ws.scratch,
                      dedup, pad_rows);

      rank_result& me = out.per_rank[r];
      me.tokens = T, me.assignments = p.assignments, me.dropped = p.dropped;
      me.padding = p.padding;
      for (int c = 0; c < C; ++c)
        for (int s = 0; s < R; ++s) {
          const index_t assigned = p.send_rows_to(c, s);
          const index_t rows = dedup ? p.unique_counts[c * R + s] : assigned;
          for (int j = 0; j < L; ++j) {
            const int b = p.block(c, s, j);
            part.rows_per_slot[s * L + j] += p.send_valid[b];
            part.padded_rows_per_slot[s * L + j] += p.send_counts[b];
            part.slot_chunk_rows[static_cast<std::size_t>(c) * P + s * L + j] += p.send_counts[b];
          }
          if (opt.keep_peer_counts) {
            out.rows_sent[static_cast<std::size_t>(r) * R + s] += rows;
            out.assignment_rows_sent[static_cast<std::size_t>(r) * R + s] += assigned;
          }
          if constexpr (hierarchical) {  // the metadata goes straight to the expert rank
            if (s == r) continue;
            const int l = static_cast<int>(topo.between(r, s));
            part.counts[static_cast<std::size_t>(r) * C + c].meta_out[l] += double(assigned);
            part.counts[static_cast<std::size_t>(s) * C + c].meta_in[l] += double(assigned);
            continue;
          }
          me.send_rows += rows;
          if (row_quota > 0) {  // the pair's rows in rounds of `quota`, spanning s's slots
            const index_t n = assigned;
            const index_t pair_rounds = std::max<index_t>(1, (n + quota - 1) / quota);
            const int l = s == r ? -1 : static_cast<int>(topo.between(r, s));
            for (index_t i = 0; i < pair_rounds; ++i) {
              const index_t lo = i * quota, hi = lo + quota;
              const double moved = double(std::min(n, hi) - std::min(n, lo));
              auto& acc = part.round(c, i, R, P);
              if (l < 0) {
                acc.counts[r].self_rows += moved;
              } else {
                acc.counts[r].rows_out[l] += moved;
                acc.counts[s].rows_in[l] += moved;
              }
              index_t first = 0;
              for (int j = 0; j < L; ++j) {
                const index_t b0 = first, b1 = first + p.send_counts[p.block(c, s, j)];
                first = b1;
                acc.slot_rows[s * L + j] +=
                    std::max<index_t>(0, std::min(b1, hi) - std::max(b0, lo));
              }
            }
          }
          auto& mine = part.counts[static_cast<std::size_t>(r) * C + c];
          if (s == r) {  // rows for its own experts stay in memory: a copy, not the link
            mine.self_rows += double(rows);
            me.self_rows += rows;
            continue;
          }
          const int l = static_cast<int>(topo.between(r, s));
          auto& theirs = part.counts[static_cast<std::size_t>(s) * C + c];
          mine.rows_out[l] += double(rows), mine.meta_out[l] += double(assigned);
          theirs.rows_in[l] += double(rows), theirs.meta_in[l] += double(assigned);
        }
      if constexpr (hierarchical)
        for (int c = 0; c < C; ++c) detail::add_node_rows(p, topo, r, c, C, part.counts, me);
    }
  };
  auto plan_part = [&](int w) {
    const int r0 = static_cast<int>(std::int64_t{R} * w / W);
    const int r1 = static_cast<int>(std::int64_t{R} * (w + 1) / W);
    if constexpr (std::same_as<placement_type, placement::table>) {
      detail::table_lookup look(where);
      plan_ranks(r0, r1, parts[w], look);
    } else {
      plan_ranks(r0, r1, parts[w], where);
    }
  };
  if (W == 1) {
    plan_part(0);
  } else {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(W));
    {
      std::vector<std::jthread> pool;
      pool.reserve(static_cast<std::size_t>(W));
      for (int w = 0; w < W; ++w)
        pool.emplace_back([&, w] {
          try {
            plan_part(w);
          } catch (...) {
            errors[w] = std::current_exception();
          }
        });
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  // Sum the threads' counts into the first.
  detail::partial_counts& all = parts[0];
  for (int w = 1; w < W; ++w) {
    const detail::partial_counts& q = parts[w];
    for (std::size_t i = 0; i < all.counts.size(); ++i) {
      auto& a = all.counts[i];
      const auto& b = q.counts[i];
      for (int l = 0; l < 2; ++l) {
        a.rows_out[l] += b.rows_out[l], a.rows_in[l] += b.rows_in[l];
        a.meta_out[l] += b.meta_out[l], a.meta_in[l] += b.meta_in[l];
      }
      a.self_rows += b.self_rows;
      a.fan_rows += b.fan_rows;
    }
    for (std::size_t i = 0; i < all.slot_chunk_rows.size(); ++i)
      all.slot_chunk_rows[i] += q.slot_chunk_rows[i];
    for (std::size_t c = 0; c < q.rounds.size(); ++c)
      for (std::size_t i = 0; i < q.rounds[c].size(); ++i) {
        auto& a = all.round(static_cast<int>(c), static_cast<index_t>(i), R, P);
        const auto& b = q.rounds[c][i];
        for (int r = 0; r < R; ++r) {
          for (int l = 0; l < 2; ++l)
            a.counts[r].rows_out[l] += b.counts[r].rows_out[l],
                a.counts[r].rows_in[l] += b.counts[r].rows_in[l];
          a.counts[r].self_rows += b.counts[r].self_rows;
        }
        for (int k = 0; k < P; ++k) a.slot_rows[k] += b.slot_rows[k];
      }
    for (std::size_t i = 0; i < all.rows_per_slot.size(); ++i) {
      all.rows_per_slot[i] += q.rows_per_slot[i];
      all.padded_rows_per_slot[i] += q.padded_rows_per_slot[i];
    }
  }
  out.rows_per_slot = std::move(all.rows_per_slot);
  out.padded_rows_per_slot = std::move(all.padded_rows_per_slot);
  // Units: one per chunk, or with a receive bound every round of every chunk (a chunk's rounds
  // are the most any pair needs: the layer's ranks agree on them in the counts exchange).
  std::vector<detail::rank_chunk_counts> unit_counts;  // [R * U]
  std::vector<index_t> unit_slot_rows;                 // [U * P], padding in
  if (row_quota > 0) {
    for (int c = 0; c < C; ++c) {
      if (all.rounds.empty() || all.rounds[c].empty()) all.round(c, 0, R, P);
      for (std::size_t i = 0; i < all.rounds[c].size(); ++i) {
        out.unit_chunk.push_back(c);
        out.unit_round.push_back(static_cast<int>(i));
        out.rounds = std::max(out.rounds, static_cast<int>(i) + 1);
      }
    }
    const auto U = out.unit_chunk.size();
    unit_counts.resize(static_cast<std::size_t>(R) * U);
    unit_slot_rows.reserve(U * static_cast<std::size_t>(P));
    for (std::size_t u = 0; u < U; ++u) {
      const auto& acc = all.rounds[out.unit_chunk[u]][out.unit_round[u]];
      for (int r = 0; r < R; ++r) unit_counts[r * U + u] = acc.counts[r];
      unit_slot_rows.insert(unit_slot_rows.end(), acc.slot_rows.begin(), acc.slot_rows.end());
    }
  } else {
    for (int c = 0; c < C; ++c)  // (dedup with a bound: a chunk's windows)
      out.unit_chunk.push_back(c / windows), out.unit_round.push_back(c % windows);
    out.rounds = windows;
    unit_counts = std::move(all.counts);
    unit_slot_rows = std::move(all.slot_chunk_rows);
  }
  out.units = static_cast<int>(out.unit_chunk.size());
  out.quota = quota;
  const int U = out.units;

  // Price every (rank, unit); a unit's stage lasts as long as its slowest rank.
  out.rank_dispatch.assign(static_cast<std::size_t>(R) * U, 0);
  out.rank_experts.assign(static_cast<std::size_t>(R) * U, 0);
  out.rank_combine.assign(static_cast<std::size_t>(R) * U, 0);
  out.unit_rows.assign(static_cast<std::size_t>(R) * U, 0);
  chunk_times mean;
  for (auto* v : {&out.stages.dispatch, &out.stages.experts, &out.stages.combine, &mean.dispatch,
                  &mean.experts, &mean.combine})
    v->assign(static_cast<std::size_t>(U), 0.0);
  out.stages.sequential_units = mean.sequential_units = Cs == 1;
  // The counts all-to-all: per chunk, L padded counts, L real counts and a unique count, as
  // index_t, to every rank (hierarchical: and the node rows and the unique rows to each rank of
  // the peer's node).
  const double counts_time =
      low_latency ? 0.0
                  : counts_seconds(topo, double(C) * (2 * L + 1 + (hierarchical ? 1 + G : 0)) *
                                             double(sizeof(index_t)));
  const int N = cfg.shared_experts;
  // Each expert priced by its own policy's FLOPs (and so weight bytes).
  const double expert_flops = expert_type::flops_per_row(cfg.hidden, cfg.ffn);
  const double shared_flops = expert_type::flops_per_row(cfg.hidden, cfg.shared_width());
  for (int r = 0; r < R; ++r) {
    rank_result& me = out.per_rank[r];
    out.assignments += me.assignments;
    out.dropped += me.dropped;
    const double T = double(me.tokens);
    me.route = route_seconds(topo, T, cfg.hidden, E);
    me.permute = copy_seconds(topo, double(me.send_rows), row_bytes);
    if (N > 0 && T > 0)  // per shared expert: copy the tokens in, one [T, H] x [H, F'] FFN
      me.shared = N * (slot_seconds(topo, shared_flops, T) + copy_seconds(topo, T, row_bytes));
    me.counts = counts_time;
    // Reduce reads each expert output row once (one per kept assignment, or per unique row
    // with dedup) and the shared experts' sum, and writes the T output rows: priced as that
    // many rows at the reduce rate.
    const double back =
        dedup ? double(me.send_rows - me.padding) : double(me.assignments - me.dropped);
    me.reduce = reduce_seconds(topo, back + T + (N > 0 ? T : 0.0), row_bytes);
    traffic fixed;  // low latency: a whole slot to and from every other rank, each direction
    if constexpr (low_latency)
      for (int q = 0; q < R; ++q)
        if (q != r)
          fixed.add_out(topo.between(r, q), slot_bytes),
              fixed.add_in(topo.between(r, q), slot_bytes);
    for (int c = 0; c < U; ++c) {  // c: the unit
      const auto i = static_cast<std::size_t>(r) * U + c;
      const auto& n = unit_counts[i];
      traffic d, m;
      for (int l = 0; l < 2; ++l) {
        d.out[l] = n.rows_out[l] * row_bytes + n.meta_out[l] * meta_bytes;
        d.in[l] = n.rows_in[l] * row_bytes + n.meta_in[l] * meta_bytes;
        m.out[l] = n.rows_in[l] * row_bytes;  // results go back where the rows came from
        m.in[l] = n.rows_out[l] * row_bytes;
        if constexpr (low_latency)
          d.out[l] = m.out[l] = fixed.out[l], d.in[l] = m.in[l] = fixed.in[l];
        me.dispatch_bytes.out[l] += d.out[l], me.dispatch_bytes.in[l] += d.in[l];
        me.combine_bytes.out[l] += m.out[l], me.combine_bytes.in[l] += m.in[l];
        out.dispatch_bytes[l] += d.out[l], out.combine_bytes[l] += m.out[l];
        me.rows_out[l] += static_cast<index_t>(n.rows_out[l]);
        me.rows_in[l] += static_cast<index_t>(n.rows_in[l]);
        out.dispatch_rows[l] += static_cast<index_t>(n.rows_out[l]);
      }
      double x = 0, received = 0;  // received: assignment rows of this chunk, padding in
      for (int j = 0; j < L; ++j) {
        const double rows = double(unit_slot_rows[static_cast<std::size_t>(c) * P + r * L + j]);
        x += slot_seconds(topo, expert_flops, rows);
        received += rows;
      }
      // Local copies: its rows to itself, and every received row regrouped by expert (and
      // back before the combine); hierarchical: and the relayed rows' copies for the node.
      const double local = regroup_seconds(topo, n.self_rows + n.fan_rows + received, row_bytes);
      out.unit_rows[i] = static_cast<index_t>(received);
      // Rows landing in its receive buffer (unique rows with dedup): pass_stats' peak is the
      // fullest round with a bound, else the whole pass. Hierarchical: the relays' copies
      // (its own relayed copies are its fan rows not sent).
      const auto landed =
          static_cast<index_t>(hierarchical ? n.rows_in[0] + n.fan_rows - n.rows_out[0]
                                            : n.self_rows + n.rows_in[0] + n.rows_in[1]);
      me.peak_recv_rows =
          quota > 0 ? std::max(me.peak_recv_rows, landed) : me.peak_recv_rows + landed;
      if constexpr (hierarchical) {
        // Two exchanges one after the other, as the layer waits the first before the relays
        // fan out: the node rows between nodes with all the metadata, then the relayed rows
        // inside the node; the combine in reverse.
        traffic first = d, second;
        first.out[0] = n.meta_out[0] * meta_bytes, first.in[0] = n.meta_in[0] * meta_bytes;
        second.out[0] = n.rows_out[0] * row_bytes, second.in[0] = n.rows_in[0] * row_bytes;
        traffic back_first = m, back_second;
        back_first.out[0] = back_first.in[0] = 0;
        back_second.out[0] = second.in[0], back_second.in[0] = second.out[0];
        out.rank_dispatch[i] =
            exchange_seconds(topo, first) + exchange_seconds(topo, second) + local;
        out.rank_combine[i] =
            exchange_seconds(topo, back_second) + exchange_seconds(topo, back_first) + local;
      } else {
        out.rank_dispatch[i] = exchange_seconds(topo, d) + local;
        out.rank_combine[i] = exchange_seconds(topo, m) + local;
      }
      out.rank_experts[i] = x;
      me.dispatch += out.rank_dispatch[i], me.experts += x, me.combine += out.rank_combine[i];
      out.stages.dispatch[c] = std::max(out.stages.dispatch[c], out.rank_dispatch[i]);
      out.stages.experts[c] = std::max(out.stages.experts[c], x);
      out.stages.combine[c] = std::max(out.stages.combine[c], out.rank_combine[i]);
      mean.dispatch[c] += out.rank_dispatch[i] / R;
      mean.experts[c] += x / R;
      mean.combine[c] += out.rank_combine[i] / R;
    }
    out.stages.before = std::max(out.stages.before, me.route + me.permute);
    out.stages.shared = std::max(out.stages.shared, me.shared);
    out.stages.counts = std::max(out.stages.counts, me.counts);
    out.stages.after = std::max(out.stages.after, me.reduce);
    mean.before += (me.route + me.permute) / R;
    mean.shared += me.shared / R;
    mean.counts += me.counts / R;
    mean.after += me.reduce / R;
    for (int j = 0; j < L; ++j) {
      me.rows_computed += out.rows_per_slot[r * L + j];
      me.padded_rows_computed += out.padded_rows_per_slot[r * L + j];
    }
  }
  out.timeline = schedule(out.stages);
  out.latency = out.timeline.latency;
  out.balanced_latency = schedule(mean).latency;

  // The straggler and why: the stage where it exceeds the mean rank the most.
  std::vector<index_t> rows(static_cast<std::size_t>(R));
  double mean_total = 0, mean_stage[stage_count] = {};
  for (int r = 0; r < R; ++r) {
    const rank_result& me = out.per_rank[r];
    rows[r] = me.rows_computed;
    mean_total += me.total() / R;
    for (int k = 0; k < stage_count; ++k) mean_stage[k] += me.time(stage(k)) / R;
    if (me.total() > out.per_rank[out.straggler].total()) out.straggler = r;
  }
  out.rows_imbalance = imbalance::of(rows);
  const rank_result& s = out.per_rank[out.straggler];
  out.straggler_excess = mean_total > 0 ? s.total() / mean_total - 1 : 0;
  int worst = static_cast<int>(stage::experts);
  for (int k = 0; k < stage_count; ++k)
    if (s.time(stage(k)) - mean_stage[k] > s.time(stage(worst)) - mean_stage[worst]) worst = k;
  std::ostringstream why;
  why << std::fixed;
  why.precision(1);
  const double own = s.time(stage(worst)), avg = mean_stage[worst];
  if (stage(worst) == stage::experts) {
    const double mean_rows = double(std::accumulate(rows.begin(), rows.end(), index_t{0})) / R;
    why << "compute: " << s.padded_rows_computed << " rows on its " << L << " slots vs "
        << mean_rows << " on the mean rank (" << own * 1e6 << " us vs " << avg * 1e6 << " us)";
  } else if (stage(worst) == stage::dispatch || stage(worst) == stage::combine) {
    const bool disp = stage(worst) == stage::dispatch;
    const traffic& t = disp ? s.dispatch_bytes : s.combine_bytes;
    const link l = bottleneck(topo, t);
    const int i = static_cast<int>(l);
    why << (disp ? "dispatch" : "combine") << " on the "
        << (l == link::inter ? "inter-node link (NIC)" : "intra-node link") << ": "
        << detail::format_bytes(t.out[i]) << " out, " << detail::format_bytes(t.in[i]) << " in ("
        << own * 1e6 << " us vs " << avg * 1e6 << " us on the mean rank)";
  } else {
    why << stage_names[worst] << ": " << s.tokens << " tokens, " << s.send_rows << " send rows ("
        << own * 1e6 << " us vs " << avg * 1e6 << " us on the mean rank)";
  }
  out.straggler_reason = why.str();
  return out;
}

/// With the policy's default placement (placement(cfg)) and capacity.
template <class Policies, class Source>
result simulate(const layer_config& cfg, const topology& topo, const Source& src,
                const options& opt = {}) {
  return simulate<Policies>(cfg, topo, src, opt, typename Policies::placement(cfg));
}

}  // namespace epmoe::sim
