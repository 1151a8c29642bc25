// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// What simulate() counts per rank, chunk and round, and the plan workspace and placement
// lookup its planner threads reuse.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/core/plan.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/sim/result.hpp"
#include "epmoe/sim/topology.hpp"

namespace epmoe::sim::detail {

/// The expert a bundle names, else SwiGLU (the simulator's bundles may omit it).
template <class P>
struct expert_of {
  using type = expert::swiglu;
};
template <class P>
requires requires { typename P::expert; }
struct expert_of<P> {
  using type = typename P::expert;
};

/// The one plan workspace simulate() reuses for every rank.
struct plan_workspace {
  std::vector<std::int32_t> slot, phys, row_token, unique_slot, unique_token, node_slot, node_token;
  std::vector<index_t> kept, send_counts, send_valid, send_offsets, recv_counts, recv_valid,
      recv_offsets, expert_offsets, regroup_offsets, routed, unique_counts, unique_offsets,
      node_counts, node_offsets;
  std::vector<std::int64_t> meta, node_mask;
  dispatch_plan plan;
  host_plan_scratch scratch;

  /// G > 0: ranks per node of the hierarchical plan (node rows per chunk and node too).
  plan_workspace(int R, int L, int K, int C, int E, int G = 0) {
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
    if (G > 0) {
      node_counts.resize(static_cast<std::size_t>(C) * (R / G));
      node_offsets.resize(static_cast<std::size_t>(C) * (R / G) + 1);
    }
    plan.ranks_per_node = G;
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
      if (plan.ranks_per_node > 0) {  // node rows: at most one per assignment
        for (auto* v : {&node_slot, &node_token}) v->resize(TK);
        node_mask.resize(TK);
      }
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
    p.node_slot = node_slot.data(), p.node_token = node_token.data();
    p.node_mask = node_mask.data(), p.node_counts = node_counts.data();
    p.node_offsets = node_offsets.data();
  }
};

// Rows and metadata entries crossing each link class, per (rank, chunk), and rows a rank
// sends itself.
struct rank_chunk_counts {
  double rows_out[2] = {0, 0}, rows_in[2] = {0, 0}, meta_out[2] = {0, 0}, meta_in[2] = {0, 0};
  double self_rows = 0;
  double fan_rows = 0;  // hierarchical: relayed rows copied out, one per rank reached (itself in)
};

// Hierarchical, home rank r, chunk c of plan p: its node rows to the peer with its local
// index on each node (itself on its own node), and each peer's copies of them to the node's
// ranks that hold one of the token's experts: per rank e, r's unique rows to e.
inline void add_node_rows(const dispatch_plan& p, const topology& topo, int r, int c, int C,
                          std::vector<rank_chunk_counts>& counts, rank_result& me) {
  const int R = p.ranks, G = p.ranks_per_node, N = p.nodes();
  auto at = [&](int q) -> rank_chunk_counts& {
    return counts[static_cast<std::size_t>(q) * C + c];
  };
  for (int n = 0; n < N; ++n) {
    const auto rows = double(p.node_counts[c * N + n]);
    const int f = n * G + r % G;
    me.send_rows += p.node_counts[c * N + n];
    if (f == r) {  // its own node: it relays them itself
      at(r).self_rows += rows;
      me.self_rows += p.node_counts[c * N + n];
      continue;
    }
    const int l = static_cast<int>(topo.between(r, f));
    at(r).rows_out[l] += rows;
    at(f).rows_in[l] += rows;
  }
  for (int e = 0; e < R; ++e) {
    const auto rows = double(p.unique_counts[c * R + e]);
    const int f = e / G * G + r % G;
    at(f).fan_rows += rows;
    if (e == f) {  // the relay's own slots: a copy
      at(f).self_rows += rows;
      continue;
    }
    const int l = static_cast<int>(topo.between(f, e));
    at(f).rows_out[l] += rows;
    at(e).rows_in[l] += rows;
  }
}

// With a receive bound: what round i of chunk c moves (grown as rounds appear).
struct round_counts {
  std::vector<rank_chunk_counts> counts;  // [R]
  std::vector<index_t> slot_rows;         // [P]
};

// What one planner thread accumulates over its ranks; summed after the threads join (sums
// of whole numbers: exact, whatever the thread count).
struct partial_counts {
  std::vector<std::vector<round_counts>> rounds;  // [C][round] (bounded only)
  std::vector<rank_chunk_counts> counts;          // [R * C]
  std::vector<index_t> slot_chunk_rows;           // [C * P]: padded rows per (chunk, physical slot)
  std::vector<index_t> rows_per_slot, padded_rows_per_slot;  // [P]
  partial_counts(int R, int C, int P)
      : counts(static_cast<std::size_t>(R) * C),
        slot_chunk_rows(static_cast<std::size_t>(C) * P, 0),
        rows_per_slot(static_cast<std::size_t>(P), 0),
        padded_rows_per_slot(static_cast<std::size_t>(P), 0) {}
  round_counts& round(int c, index_t i, int R, int P) {
    if (rounds.empty()) rounds.resize(counts.size() / static_cast<std::size_t>(R));
    auto& v = rounds[static_cast<std::size_t>(c)];
    while (static_cast<index_t>(v.size()) <= i)
      v.push_back({std::vector<rank_chunk_counts>(static_cast<std::size_t>(R)),
                   std::vector<index_t>(static_cast<std::size_t>(P), 0)});
    return v[static_cast<std::size_t>(i)];
  }
};

// placement::table's slot_for with the per-(home rank, expert) search done once per rank
// and the token's half of the replica hash once per token: the same answers (a test checks
// them against table::slot_for) without three binary searches per assignment.
class table_lookup {
 public:
  explicit table_lookup(const placement::table& t)
      : v_(t.view()),
        first_(static_cast<std::size_t>(t.experts())),
        count_(static_cast<std::size_t>(t.experts())),
        inverse_(static_cast<std::size_t>(t.experts())),
        seed_(math::mix64(0x706c6163ull)) {}

  /// Resolves every expert's candidate copies for tokens living on rank `home`.
  void set_home(int home) {
    using tv = placement::table_view;
    const int spr = v_.slots_per_rank, rpn = v_.ranks_per_node;
    for (std::size_t e = 0; e < first_.size(); ++e) {
      const int* c = v_.log_to_phy + e * static_cast<std::size_t>(v_.max_copies);
      const int n = v_.copies[e];
      first_[e] = 0, count_[e] = n;
      if (n == 1) continue;
      const int rank_lo = home * spr, i = tv::first_at_least(c, n, rank_lo);
      const int j = tv::first_at_least(c, n, rank_lo + spr);
      if (j > i) {  // copies on the home rank (more than one: the hash picks)
        first_[e] = i, count_[e] = j - i;
        continue;
      }
      const int node_lo = home / rpn * rpn * spr;
      const int a = tv::first_at_least(c, n, node_lo);
      const int b = tv::first_at_least(c, n, node_lo + rpn * spr);
      if (b > a) first_[e] = a, count_[e] = b - a;
    }
    for (std::size_t e = 0; e < first_.size(); ++e)
      inverse_[e] = ~std::uint64_t{0} / static_cast<std::uint64_t>(count_[e]);
    last_token_ = ~std::uint64_t{0};
  }

  /// `home` must be the rank given to set_home.
  int slot_for(int e, int /*home*/, std::uint64_t token) const {
    const int* c = v_.log_to_phy + e * static_cast<std::size_t>(v_.max_copies) + first_[e];
    const int n = count_[e];
    if (n == 1) return c[0];
    if (token != last_token_) last_token_ = token, token_mix_ = math::mix64(seed_ ^ token);
    const std::uint64_t h = math::mix64(math::mix64(token_mix_ ^ static_cast<std::uint64_t>(e)));
    return c[mod(h, static_cast<std::uint64_t>(n), inverse_[e])];
  }

  static std::uint64_t mulhi(std::uint64_t a, std::uint64_t b) {  // (a * b) >> 64, portably
    const std::uint64_t al = a & 0xffffffffu, ah = a >> 32, bl = b & 0xffffffffu, bh = b >> 32;
    const std::uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    const std::uint64_t mid = (ll >> 32) + (lh & 0xffffffffu) + (hl & 0xffffffffu);
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
  }
  /// h % n without a 64-bit divide: q = mulhi(h, floor((2^64-1)/n)) is q_true - {0, 1, 2}.
  static std::uint64_t mod(std::uint64_t h, std::uint64_t n, std::uint64_t inverse) {
    const std::uint64_t q = mulhi(h, inverse);
    std::uint64_t r = h - q * n;
    while (r >= n) r -= n;
    return r;
  }

 private:
  placement::table_view v_;
  std::vector<int> first_, count_;      // [E]: candidate copies log_to_phy[e][first, first+count)
  std::vector<std::uint64_t> inverse_;  // [E]: floor((2^64 - 1) / count)
  std::uint64_t seed_;
  mutable std::uint64_t last_token_ = ~std::uint64_t{0}, token_mix_ = 0;
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

}  // namespace epmoe::sim::detail
