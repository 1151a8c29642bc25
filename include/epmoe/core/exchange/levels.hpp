// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <vector>

#include "epmoe/core/exchange/core.hpp"
#include "epmoe/core/exchange/ops.hpp"

// The hierarchical exchange's two levels (issue 24), what the dedup exchange adds with
// options.hierarchical: (a) one node row per (token, node) to this rank's peer on each node
// (same local index) with a mask of that node's ranks it must reach, (b) the relay's copies
// of each such row to the node's ranks; the combine sums in the node, then goes home.
namespace epmoe {

/// Where a unit's rows sit in the receive-side buffers: the plan's pass-wide offsets plus
/// these shifts (0 unless the unit takes a slot: windows of tokens).
struct unit_shifts {
  index_t unique = 0, assign = 0, relay = 0, fan = 0;
};

/// The relay's buffers and counts of the two levels: G ranks per node, N nodes.
template <class Space>
class node_levels {
 public:
  using value_type = typename Space::value_type;
  template <class T>
  using buffer = typename Space::template buffer<T>;

  node_levels() = default;
  node_levels(const Space& space, const workspace_layout& w, int slots)
      : G(w.ranks_per_node),
        N(w.ranks / w.ranks_per_node),
        relay_offsets(static_cast<std::size_t>(w.chunks) * N + 1, 0),
        fan_counts(static_cast<std::size_t>(w.chunks) * G, 0),
        fan_first(static_cast<std::size_t>(w.chunks) + 1, 0),
        w_(w),
        slots_(slots) {
    x_relay = space.template allocate<value_type>(w.relay_rows * w.row_stride);
    x_fan = space.template allocate<value_type>(w.fan_rows * w.row_stride);
    mask_relay = space.template allocate<std::int64_t>(w.relay_rows);
    fan_at_ = space.template allocate<index_t>(2 * (G * w.relay_rows + slots));
    if (w.wire()) {  // 8-bit rows: the dispatch's relay and fan rows on the wire
      q_relay = space.template allocate<std::uint8_t>(w.relay_rows * w.wire_stride);
      q_fan = space.template allocate<std::uint8_t>(w.fan_rows * w.wire_stride);
    }
  }

  /// The counts message from source s of chunk c (`m`: its entries): a peer whose rows for
  /// this node this rank relays tells their node rows and each of this node's ranks' rows.
  void read(int s, int c, int me, const index_t* m, int L) {
    if (s % G != me % G) return;
    relay_offsets[static_cast<std::size_t>(c * N + s / G + 1)] = m[2 * L + 1];
    for (int g = 0; g < G; ++g) fan_counts[static_cast<std::size_t>(c * G + g)] += m[2 * L + 2 + g];
  }
  void clear_counts() { std::fill(fan_counts.begin(), fan_counts.end(), 0); }
  /// After read(): the relay rows' offsets per (chunk, source node), each chunk's first fan
  /// row; whether the whole pass fits the buffers (unbounded).
  bool finish_counts(int C) {
    relay_offsets[0] = 0;
    for (int i = 0; i < C * N; ++i) relay_offsets[i + 1] += relay_offsets[i];
    fan_first[0] = 0;
    for (int c = 0; c < C; ++c) {
      fan_first[c + 1] = fan_first[c];
      for (int g = 0; g < G; ++g) fan_first[c + 1] += fan_counts[c * G + g];
    }
    return relay_offsets[C * N] <= w_.relay_rows && fan_first[C] <= w_.fan_rows;
  }
  /// Chunk c's relay and fan rows fit one slot (windows of tokens).
  bool fits_slot(int c) const {
    return relay_offsets[(c + 1) * N] - relay_offsets[c * N] <= w_.slot_relay &&
           fan_first[c + 1] - fan_first[c] <= w_.slot_fan;
  }
  index_t relay_first(int c) const { return relay_offsets[c * N]; }
  index_t fan_start(int c) const { return fan_first[c]; }

  /// Chunk c's counts of both levels (the metadata still goes straight to the expert ranks):
  /// (a) node rows to this rank's peer on each node, from the peers into the relay buffer;
  /// (m) their masks alike; (b) the relay rows' copies to the node's ranks, from the node's
  /// ranks into the receive buffer.
  void rank_counts_of(const dispatch_plan& p, int c, const unit_shifts& sh, int me,
                      rank_counts& n) const {
    const int R = w_.ranks, mine = me / G, local = me % G;
    const index_t H = w_.row_stride;
    for (int r = 0; r < R; ++r) {
      n.send_n[r] = n.recv_n[r] = n.send_d[r] = n.recv_d[r] = 0;
      n.a_send_n[r] = n.a_send_d[r] = n.a_recv_n[r] = n.a_recv_d[r] = 0;
      n.b_send_n[r] = n.b_send_d[r] = n.b_recv_n[r] = n.b_recv_d[r] = 0;
    }
    for (int m = 0; m < N; ++m) {  // the peer on node m
      const int r = m * G + local;
      n.a_send_n[r] = p.node_counts[c * N + m];
      n.a_send_d[r] = p.node_offsets[c * N + m];
      n.a_recv_n[r] = relay_offsets[c * N + m + 1] - relay_offsets[c * N + m];
      n.a_recv_d[r] = relay_offsets[c * N + m] + sh.relay;
    }
    index_t at = fan_first[c] + sh.fan;
    for (int g = 0; g < G; ++g) {  // rank g of this node
      const int r = mine * G + g;
      n.b_send_n[r] = fan_counts[c * G + g] * H;
      n.b_send_d[r] = at * H;
      at += fan_counts[c * G + g];
      index_t rows = 0;
      for (int m = 0; m < N; ++m) rows += p.recv_unique_counts[c * R + m * G + g];
      n.b_recv_n[r] = rows * H;
      n.b_recv_d[r] = (p.recv_unique_offsets[c * R + g] + sh.unique) * H;
    }
    for (int r = 0; r < R; ++r) {  // masks: one element per row
      n.m_send_n[r] = n.a_send_n[r];
      n.m_send_d[r] = n.a_send_d[r];
      n.m_recv_n[r] = n.a_recv_n[r];
      n.m_recv_d[r] = n.a_recv_d[r];
      n.a_send_n[r] *= H, n.a_send_d[r] *= H, n.a_recv_n[r] *= H, n.a_recv_d[r] *= H;
    }
  }

  /// Chunk c's relay rows, their masks and their copies (unit slot `k`, or -1: its place of
  /// the pass-wide buffers).
  struct fan_view {
    index_t n;                 // the chunk's relay rows
    const std::int64_t* mask;  // their masks
    index_t* flags;            // [G][n]
    index_t* at;               // [G][n] (+1): each copy's row in `fan`
    matrix_view<value_type> relay, fan;
    matrix_view<std::uint8_t> wire_relay, wire_fan;  // 8-bit rows: the same rows on the wire
  };
  fan_view fan_of(int c, const unit_shifts& sh, int k) const {
    const index_t n = relay_offsets[(c + 1) * N] - relay_offsets[c * N];
    const index_t r0 = relay_offsets[c * N] + sh.relay;
    const index_t H = w_.row_stride, half = G * w_.relay_rows + slots_;
    // [G][n] flags then their scan (+1) per unit: after the earlier units', or in its slot.
    index_t* flags =
        fan_at_.data() + (k >= 0 ? k * (G * w_.slot_relay + 1) : G * relay_offsets[c * N] + c);
    const index_t f0 = fan_first[c] + sh.fan, fans = fan_first[c + 1] - fan_first[c];
    const index_t Q = w_.wire_stride, B = w_.wire_row_bytes;
    return {n,
            mask_relay.data() + r0,
            flags,
            flags + half,
            {x_relay.data() + r0 * H, n, w_.hidden, H},
            {x_fan.data() + f0 * H, fans, w_.hidden, H},
            {Q > 0 ? q_relay.data() + r0 * Q : nullptr, n, B, Q},
            {Q > 0 ? q_fan.data() + f0 * Q : nullptr, fans, B, Q}};
  }
  /// Each relay row -> its copy for every rank of the node it reaches (rows in the fan
  /// buffer from a scan of the masks).
  void fan_out(const Space& space, const fan_view& f) const {
    space.for_each(G * f.n, exchange_ops::mask_bits{f.mask, f.n, f.flags});
    space.exclusive_scan(f.flags, f.at, G * f.n);
    if (w_.wire())  // 8-bit rows: copies of their bytes, scale and values
      space.for_each_row(
          f.n, w_.wire_row_bytes,
          exchange_ops::fan_rows<std::uint8_t>{f.mask, f.at, f.n, G, f.wire_relay, f.wire_fan});
    else
      space.for_each_row(f.n, w_.hidden,
                         exchange_ops::fan_rows<value_type>{f.mask, f.at, f.n, G, f.relay, f.fan});
  }
  /// Each relay row = the sum of what the node's ranks sent back, in rank order.
  void fan_in(const Space& space, const fan_view& f) const {
    space.for_each_row(
        f.n, w_.hidden,
        exchange_ops::fan_rows<value_type>{f.mask, f.at, f.n, G, f.relay, f.fan, true});
  }

  /// Rows over each link class of one unit's counts: (a) only reaches other nodes, (b) only
  /// this one.
  void add_link_rows(const rank_counts& n, int me, pass_stats& st) const {
    for (int r = 0; r < w_.ranks; ++r) {
      if (r == me) continue;
      link_traffic& l = r / G == me / G ? st.intra_node : st.inter_node;
      l.rows_sent += (n.a_send_n[r] + n.b_send_n[r]) / w_.row_stride;
      l.rows_received += (n.a_recv_n[r] + n.b_recv_n[r]) / w_.row_stride;
    }
  }

  int G = 0, N = 1;
  buffer<value_type> x_relay;           // node rows this rank relays, per (chunk, source node)
  buffer<value_type> x_fan;             // their copies per (chunk, local rank, source node)
  buffer<std::uint8_t> q_relay, q_fan;  // 8-bit rows: the same rows on the wire
  buffer<std::int64_t> mask_relay;      // the relay rows' masks
  std::vector<index_t> relay_offsets;   // [C*N+1]: relay rows per (chunk, source node)
  std::vector<index_t> fan_counts;      // [C*G]: fan rows per (chunk, local rank)
  std::vector<index_t> fan_first;       // [C+1]: each chunk's first fan row

 private:
  workspace_layout w_{};
  int slots_ = 1;
  buffer<index_t> fan_at_;  // per chunk [G][n] flags, then their scan (fan rows)
};

}  // namespace epmoe
