// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/capacity/factor.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/sim/cost.hpp"
#include "epmoe/sim/topology.hpp"

// simulate(): every rank's routing goes through the layer's own planner (build_send_plan,
// build_dedup_plan, the placement's slot_for, the capacity limit); only the counts are kept,
// and the cost model prices them.
namespace epmoe::sim {

/// The policy slots the planner reads (the layer's Policies work as they are).
template <class Placement = placement::block, class Capacity = capacity::dropless,
          bool Dedup = false>
struct policies {
  using placement = Placement;
  using capacity = Capacity;
  static constexpr bool dedup = Dedup;
};

struct options {
  int chunks = 1;                 // C: 1 = schedule::sequential, > 1 = schedule::pipelined<C>
  bool keep_peer_counts = false;  // keep [R, R] rows sent (tests; R*R numbers)
};

/// One rank's pass: its own stage times (summed over chunks, waits excluded) and counts.
struct rank_result {
  double dispatch = 0, experts = 0, combine = 0;  // seconds
  index_t tokens = 0, assignments = 0, dropped = 0, padding = 0;
  index_t rows_computed = 0;              // real rows its expert slots computed
  index_t padded_rows_computed = 0;       // padding included (what the GEMMs cost)
  traffic dispatch_bytes, combine_bytes;  // to and from other ranks, per link class
  double total() const { return dispatch + experts + combine; }
};

struct result {
  int ranks = 0, chunks = 1, slots_per_rank = 0;
  std::vector<rank_result> per_rank;          // [R]
  std::vector<index_t> rows_per_slot;         // [P]: real rows per physical slot
  std::vector<index_t> padded_rows_per_slot;  // [P]: padding included
  std::vector<double> rank_dispatch, rank_experts, rank_combine;  // [R, C] per chunk
  std::vector<index_t> rows_sent;             // [R, R] (keep_peer_counts): sender-major
  std::vector<index_t> assignment_rows_sent;  // [R, R]: the rows without dedup
  chunk_times stages;                         // per chunk, slowest rank
  schedule_times timeline;
  double latency = 0;           // predicted layer latency, seconds
  double balanced_latency = 0;  // the same schedule if every rank did the mean rank's work
  int straggler = 0;            // rank with the most own stage time
  double straggler_excess = 0;  // its own time / the mean rank's - 1
  std::string straggler_reason;
  imbalance rows_imbalance;           // of rows computed per rank
  double dispatch_bytes[2] = {0, 0};  // sent over each link class, all ranks
  double combine_bytes[2] = {0, 0};
  index_t assignments = 0, dropped = 0;
};

namespace detail {

/// The one plan workspace simulate() reuses for every rank.
struct plan_workspace {
  std::vector<std::int32_t> slot, phys, row_token, unique_slot, unique_token;
  std::vector<index_t> kept, send_counts, send_valid, send_offsets, recv_counts, recv_valid,
      recv_offsets, expert_offsets, regroup_offsets, routed, unique_counts, unique_offsets;
  std::vector<std::int64_t> meta;
  dispatch_plan plan;

  plan_workspace(int R, int L, int K, int C, int E) {
    const auto B = static_cast<std::size_t>(C) * R * L;
    kept.resize(static_cast<std::size_t>(R) * L);
    for (auto* v : {&send_counts, &send_valid, &recv_counts, &recv_valid, &regroup_offsets})
      v->resize(B);
    send_offsets.resize(B + 1);
    recv_offsets.resize(B + 1);
    expert_offsets.resize(static_cast<std::size_t>(C) * L + 1);
    routed.resize(static_cast<std::size_t>(E));
    unique_counts.resize(static_cast<std::size_t>(C) * R);
    unique_offsets.resize(static_cast<std::size_t>(C) * R + 1);
    plan.ranks = R;
    plan.local_experts = L;
    plan.top_k = K;
    plan.chunks = C;
  }
  /// Sizes the per-token and per-row arrays for T tokens and at most `rows` send rows.
  void reserve(index_t T, int K, index_t rows) {
    const auto TK = static_cast<std::size_t>(T * K);
    if (slot.size() < TK) {
      for (auto* v : {&slot, &phys, &unique_slot, &unique_token}) v->resize(TK);
    }
    if (row_token.size() < static_cast<std::size_t>(rows)) {
      row_token.resize(static_cast<std::size_t>(rows));
      meta.resize(static_cast<std::size_t>(rows));
    }
    dispatch_plan& p = plan;
    p.slot = slot.data(), p.phys = phys.data(), p.row_token = row_token.data();
    p.kept = kept.data(), p.send_counts = send_counts.data(), p.send_valid = send_valid.data();
    p.send_offsets = send_offsets.data(), p.recv_counts = recv_counts.data();
    p.recv_valid = recv_valid.data(), p.recv_offsets = recv_offsets.data();
    p.expert_offsets = expert_offsets.data(), p.regroup_offsets = regroup_offsets.data();
    p.routed = routed.data(), p.unique_slot = unique_slot.data();
    p.unique_token = unique_token.data(), p.unique_counts = unique_counts.data();
    p.unique_offsets = unique_offsets.data(), p.meta = meta.data();
  }
};

// Rows and metadata entries crossing each link class, per (rank, chunk).
struct rank_chunk_counts {
  double rows_out[2] = {0, 0}, rows_in[2] = {0, 0}, meta_out[2] = {0, 0}, meta_in[2] = {0, 0};
};

inline std::string format_bytes(double b) {
  std::ostringstream s;
  s.precision(3);
  if (b >= 1e9)
    s << b / 1e9 << " GB";
  else if (b >= 1e6)
    s << b / 1e6 << " MB";
  else
    s << b / 1e3 << " kB";
  return s.str();
}

}  // namespace detail

/// Simulates one forward pass of moe_layer<Policies> on `topo`: every rank routes its
/// source tokens, plans with `where` and `cap` as the layer does, and the counts are priced.
/// A Source provides tokens(rank) and route(rank, mutable_routing_view) (see source.hpp).
/// Memory is O(R * C + P * C + T * K) (plus R * R with keep_peer_counts), whatever R.
template <class Policies, class Source>
result simulate(const layer_config& cfg, const topology& topo, const Source& src,
                const options& opt, const typename Policies::placement& where,
                const typename Policies::capacity& cap = {}) {
  using placement_type = typename Policies::placement;
  using capacity_type = typename Policies::capacity;
  constexpr bool dedup = requires { requires Policies::dedup; };
  static_assert(!(dedup && capacity_type::pads),
                "epmoe::sim: per-rank dedup does not combine with padded capacity (as in the "
                "layer): use capacity::factor<false> or capacity::dropless with dedup");
  cfg.validate();
  topo.validate();
  if constexpr (placement_with_validate<placement_type>) where.validate(cfg);
  epmoe::detail::require(topo.ranks() == cfg.ranks, "topology ranks", topo.ranks(),
                         "nodes * ranks_per_node must equal config ranks");
  epmoe::detail::require(opt.chunks >= 1 && opt.chunks <= 1024, "chunks", opt.chunks,
                         "must be in [1, 1024]");
  const int R = cfg.ranks, K = cfg.top_k, E = cfg.experts, C = opt.chunks;
  const int L = where.slots_per_rank(), P = R * L;
  const double row_bytes = double(cfg.hidden) * topo.activation_bytes;
  const double meta_bytes = dedup ? double(sizeof(std::int64_t)) : 0.0;

  result out;
  out.ranks = R, out.chunks = C, out.slots_per_rank = L;
  out.per_rank.resize(static_cast<std::size_t>(R));
  out.rows_per_slot.assign(static_cast<std::size_t>(P), 0);
  out.padded_rows_per_slot.assign(static_cast<std::size_t>(P), 0);
  if (opt.keep_peer_counts) {
    out.rows_sent.assign(static_cast<std::size_t>(R) * R, 0);
    out.assignment_rows_sent.assign(static_cast<std::size_t>(R) * R, 0);
  }
  std::vector<detail::rank_chunk_counts> counts(static_cast<std::size_t>(R) * C);
  std::vector<index_t> slot_chunk_rows(static_cast<std::size_t>(C) * P, 0);  // padded

  detail::plan_workspace ws(R, L, K, C, E);
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  for (int r = 0; r < R; ++r) {
    const index_t T = src.tokens(r);
    epmoe::detail::require(T <= cfg.max_tokens, "source tokens", T, "must be <= config max_tokens");
    ids.resize(static_cast<std::size_t>(T * K));
    weights.resize(static_cast<std::size_t>(T * K));
    src.route(r, {{ids.data(), T, K}, {weights.data(), T, K}});
    const index_t limit = cap.limit(cfg, T);
    ws.reserve(T, K, std::max(T * K, capacity_type::pads ? limit * P : 0));
    dispatch_plan& p = ws.plan;
    const routing_view routing{{ids.data(), T, K}, {weights.data(), T, K}};
    // Token ids as the layer numbers them without given ids: rank * max_tokens + t.
    build_send_plan(routing, where, E, limit, capacity_type::pads,
                    token_origin{r, nullptr, std::int64_t{r} * cfg.max_tokens}, p);
    if constexpr (dedup) build_dedup_plan(routing, p);

    rank_result& me = out.per_rank[r];
    me.tokens = T, me.assignments = p.assignments, me.dropped = p.dropped, me.padding = p.padding;
    out.assignments += p.assignments;
    out.dropped += p.dropped;
    for (int c = 0; c < C; ++c)
      for (int s = 0; s < R; ++s) {
        const index_t assigned = p.send_rows_to(c, s);
        const index_t rows = dedup ? p.unique_counts[c * R + s] : assigned;
        for (int j = 0; j < L; ++j) {
          const int b = p.block(c, s, j);
          out.rows_per_slot[s * L + j] += p.send_valid[b];
          out.padded_rows_per_slot[s * L + j] += p.send_counts[b];
          slot_chunk_rows[static_cast<std::size_t>(c) * P + s * L + j] += p.send_counts[b];
        }
        if (opt.keep_peer_counts) {
          out.rows_sent[static_cast<std::size_t>(r) * R + s] += rows;
          out.assignment_rows_sent[static_cast<std::size_t>(r) * R + s] += assigned;
        }
        if (s == r) continue;  // rows for its own experts stay in memory
        const int l = static_cast<int>(topo.between(r, s));
        auto& mine = counts[static_cast<std::size_t>(r) * C + c];
        auto& theirs = counts[static_cast<std::size_t>(s) * C + c];
        mine.rows_out[l] += double(rows), mine.meta_out[l] += double(assigned);
        theirs.rows_in[l] += double(rows), theirs.meta_in[l] += double(assigned);
      }
  }

  // Price every (rank, chunk); a chunk's stage lasts as long as its slowest rank.
  out.rank_dispatch.assign(static_cast<std::size_t>(R) * C, 0);
  out.rank_experts.assign(static_cast<std::size_t>(R) * C, 0);
  out.rank_combine.assign(static_cast<std::size_t>(R) * C, 0);
  chunk_times mean;
  for (auto* v : {&out.stages.dispatch, &out.stages.experts, &out.stages.combine, &mean.dispatch,
                  &mean.experts, &mean.combine})
    v->assign(static_cast<std::size_t>(C), 0.0);
  for (int r = 0; r < R; ++r) {
    rank_result& me = out.per_rank[r];
    for (int c = 0; c < C; ++c) {
      const auto i = static_cast<std::size_t>(r) * C + c;
      const auto& n = counts[i];
      traffic d, m;
      for (int l = 0; l < 2; ++l) {
        d.out[l] = n.rows_out[l] * row_bytes + n.meta_out[l] * meta_bytes;
        d.in[l] = n.rows_in[l] * row_bytes + n.meta_in[l] * meta_bytes;
        m.out[l] = n.rows_in[l] * row_bytes;  // results go back where the rows came from
        m.in[l] = n.rows_out[l] * row_bytes;
        me.dispatch_bytes.out[l] += d.out[l], me.dispatch_bytes.in[l] += d.in[l];
        me.combine_bytes.out[l] += m.out[l], me.combine_bytes.in[l] += m.in[l];
        out.dispatch_bytes[l] += d.out[l], out.combine_bytes[l] += m.out[l];
      }
      double x = 0;
      for (int j = 0; j < L; ++j)
        x += slot_seconds(topo, cfg.hidden, cfg.ffn,
                          double(slot_chunk_rows[static_cast<std::size_t>(c) * P + r * L + j]));
      out.rank_dispatch[i] = exchange_seconds(topo, d);
      out.rank_experts[i] = x;
      out.rank_combine[i] = exchange_seconds(topo, m);
      me.dispatch += out.rank_dispatch[i], me.experts += x, me.combine += out.rank_combine[i];
      out.stages.dispatch[c] = std::max(out.stages.dispatch[c], out.rank_dispatch[i]);
      out.stages.experts[c] = std::max(out.stages.experts[c], x);
      out.stages.combine[c] = std::max(out.stages.combine[c], out.rank_combine[i]);
      mean.dispatch[c] += out.rank_dispatch[i] / R;
      mean.experts[c] += x / R;
      mean.combine[c] += out.rank_combine[i] / R;
    }
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
  double mean_total = 0, mean_stage[3] = {0, 0, 0};
  for (int r = 0; r < R; ++r) {
    const rank_result& me = out.per_rank[r];
    rows[r] = me.rows_computed;
    mean_total += me.total() / R;
    mean_stage[0] += me.dispatch / R, mean_stage[1] += me.experts / R;
    mean_stage[2] += me.combine / R;
    if (me.total() > out.per_rank[out.straggler].total()) out.straggler = r;
  }
  out.rows_imbalance = imbalance::of(rows);
  const rank_result& s = out.per_rank[out.straggler];
  out.straggler_excess = mean_total > 0 ? s.total() / mean_total - 1 : 0;
  const double own[3] = {s.dispatch, s.experts, s.combine};
  int worst = 0;
  for (int k = 1; k < 3; ++k)
    if (own[k] - mean_stage[k] > own[worst] - mean_stage[worst]) worst = k;
  std::ostringstream why;
  why.precision(3);
  if (worst == 1) {
    const double mean_rows = double(out.rows_imbalance.max_over_mean > 0
                                        ? std::accumulate(rows.begin(), rows.end(), index_t{0})
                                        : 0) /
                             R;
    why << "compute: " << s.padded_rows_computed << " rows on its " << L << " slots vs "
        << mean_rows << " on the mean rank (" << s.experts * 1e6 << " us vs " << mean_stage[1] * 1e6
        << " us)";
  } else {
    const traffic& t = worst == 0 ? s.dispatch_bytes : s.combine_bytes;
    const link l = bottleneck(topo, t);
    const int i = static_cast<int>(l);
    why << (worst == 0 ? "dispatch" : "combine") << " on the "
        << (l == link::inter ? "inter-node link (NIC)" : "intra-node link") << ": "
        << detail::format_bytes(t.out[i]) << " out, " << detail::format_bytes(t.in[i]) << " in ("
        << own[worst] * 1e6 << " us vs " << mean_stage[worst] * 1e6 << " us on the mean rank)";
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
