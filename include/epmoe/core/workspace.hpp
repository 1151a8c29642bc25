// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange/wire.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/view.hpp"

// Every size of a layer's workspace, decided once from the config and the policies' static
// facts, the same on every space (the host tests run the layout the GPU uses).
namespace epmoe {

/// Rows and elements of every buffer of one rank's layer (all bounded by config max_tokens).
struct workspace_layout {
  index_t tokens = 0;            // T: most tokens of a pass (config max_tokens)
  int width = 0;                 // routing slots per token: top_k, or E for expert choice
  int experts = 0;               // E + Z: experts the router scores (the plan counts each)
  int ranks = 1;                 // R
  int local_experts = 1;         // L: physical slots per rank
  int chunks = 1;                // C: most chunks of a pass
  index_t hidden = 0;            // H
  index_t align = 1;             // rows of every buffer start 16-byte aligned: strides a multiple
  index_t row_stride = 0;        //   of `align` elements (H rounded up)
  index_t blocks = 0;            // C * R * L
  index_t per_expert = 0;        // most rows one source sends one slot (capacity, T, the router)
  index_t pad_rows = 0;          // padded capacity: rows every slot's blocks hold (0: no padding)
  index_t send_rows = 0;         // the send buffer: every row of a pass
  index_t from_one_rank = 0;     // most rows one source sends this rank in a pass
  index_t recv_rows = 0;         // unbounded: the receive buffer of a whole pass
  index_t recv_assign_rows = 0;  // receive-side per-assignment arrays (dedup: metadata, sums)
  int units_in_flight = 1;       // exchange units a schedule keeps in flight
  index_t quota = 0;             // bounded: rows per (source, destination) pair per round
  index_t per_source = 0;        // bounded: rows one source puts in a receive slot
  index_t recv_buffer_rows = 0;  // the receive buffer (bounded: units in flight slots)
  index_t expert_rows = 0;       // most rows the experts compute in one unit
  index_t max_rounds = 1;        // bounded: most rounds one chunk can need
  index_t max_units = 1;         // most exchange units of a pass
  // Bounded with dedup, rounds are windows of tokens: each source sends at most one unique
  // row per (token, rank) and one node row per (token, node), so `quota` tokens per round
  // bound every buffer of a unit; the plan then cuts a pass in `chunks` windows and each
  // unit's rows sit in slot (unit % units_in_flight) of every receive-side buffer.
  bool token_rounds = false;
  index_t slot_assign = 0;  // token rounds: assignment rows of one slot (R * quota * min(K, L))
  index_t slot_relay = 0;   //   relay rows of one slot (N * quota), and their copies
  index_t slot_fan = 0;
  int node_size = 0;       // ranks per node, for stats (0: all ranks one node)
  int ranks_per_node = 0;  // G of the hierarchical exchange (0: flat)
  index_t node_rows = 0;   // hierarchical: the node rows one pass sends
  index_t relay_rows = 0;  //   node rows a rank relays for its N peers (N * T)
  index_t fan_rows = 0;    //   their copies to the node's ranks (each reaches <= min(K, G))
  // 8-bit dispatch rows (config dispatch_rows, core/exchange/wire.hpp): bytes a row takes on
  // the wire (its scale and H values) and between two rows of the wire buffers (0: the
  // dispatch moves rows of the activation type).
  index_t wire_row_bytes = 0;
  index_t wire_stride = 0;

  /// `limit(T)` is the capacity policy's rows per slot for T tokens; `router_cap` the router's
  /// own bound on a slot's rows (expert choice), or 0.
  /// `elem_bytes` is the size of the space's element type (rows are padded to 16 bytes:
  /// vector loads and 16-bit GEMMs need aligned rows whatever H is).
  template <class Limit>
  static workspace_layout of(const layer_config& cfg, int width, int local_experts, int chunks,
                             int units_in_flight, bool pads, Limit&& limit, index_t router_cap,
                             index_t elem_bytes, int node_size = 0, bool hierarchical = false,
                             bool dedup = false) {
    workspace_layout w;
    const index_t T = cfg.max_tokens, K = width, R = cfg.ranks, L = local_experts;
    w.tokens = T, w.width = width, w.ranks = cfg.ranks;
    w.experts = cfg.scored_experts();  // the plan counts the zero experts' picks too
    w.local_experts = local_experts, w.chunks = chunks, w.hidden = cfg.hidden;
    w.align = std::max<index_t>(1, 16 / elem_bytes);
    w.row_stride = w.padded(cfg.hidden);
    w.blocks = chunks * R * L;
    // Rows one source sends one slot: bounded by capacity, and by T (distinct experts).
    w.per_expert = std::min(T, limit(T));
    if (router_cap > 0) w.per_expert = std::min(w.per_expert, router_cap);
    // Padded blocks hold the capacity of a full pass: every rank's layout is the same
    // whatever its tokens, so static shapes agree across ranks.
    w.pad_rows = pads ? limit(T) : 0;
    w.send_rows = pads ? R * L * w.pad_rows : std::min(T * K, R * L * w.per_expert);
    w.from_one_rank = pads ? L * w.pad_rows : std::min(T * std::min(K, L), L * w.per_expert);
    w.recv_rows = R * w.from_one_rank;
    w.units_in_flight = units_in_flight;
    const index_t M = cfg.max_recv_rows;
    const index_t G = node_size > 0 ? node_size : R, N = R / G;
    w.recv_assign_rows = w.recv_rows;
    w.max_units = chunks;
    if (M > 0 && (dedup || hierarchical)) {
      // A window of q tokens of every source per unit: the plan's chunks are C windows of
      // ceil(T/C) tokens cut in ceil(ceil(T/C)/q) (<= ceil(T/q) + C - 1 in all for C <= chunks).
      const index_t q = std::max<index_t>(1, M / (R * units_in_flight)), S = units_in_flight;
      const index_t windows = (T + q - 1) / q + chunks - 1;
      // The plan indexes blocks (window, rank, local slot) with int.
      if (windows * R * L > std::numeric_limits<std::int32_t>::max())
        throw config_error("max_recv_rows", std::to_string(M),
                           "makes windows of " + std::to_string(q) + " token(s) and " +
                               std::to_string(windows * R * L) +
                               " blocks (windows x ranks x local experts), more than 2^31 - 1: "
                               "raise max_recv_rows or lower max_tokens");
      w.token_rounds = true;
      w.quota = q;
      w.per_source = std::min(q, T);
      w.chunks = static_cast<int>(windows);
      w.blocks = w.chunks * R * L;
      w.max_units = w.chunks;
      w.max_rounds = (T + q - 1) / q;
      w.slot_assign = R * w.per_source * std::min(K, L);
      w.recv_buffer_rows = S * R * w.per_source;
      w.recv_assign_rows = S * w.slot_assign;
      w.expert_rows = w.slot_assign;
      if (hierarchical) {
        w.slot_relay = N * w.per_source;
        w.slot_fan = w.slot_relay * std::min(K, G);
      }
    } else if (M > 0) {
      w.quota = std::max<index_t>(1, M / (R * units_in_flight));
      w.per_source = std::min(w.quota, w.from_one_rank);
      w.recv_buffer_rows = units_in_flight * R * w.per_source;
      w.expert_rows = R * w.per_source;
      w.max_rounds = (w.from_one_rank + w.quota - 1) / w.quota;
      if (chunks * w.max_rounds > std::numeric_limits<std::int32_t>::max())
        throw config_error("max_recv_rows", std::to_string(M),
                           "makes " + std::to_string(chunks * w.max_rounds) +
                               " rounds, more than 2^31 - 1: raise max_recv_rows");
      w.max_units = chunks * w.max_rounds;
    } else {
      w.recv_buffer_rows = w.recv_rows;
      w.expert_rows = w.recv_rows;
    }
    w.node_size = node_size;
    if (hierarchical) {
      w.ranks_per_node = static_cast<int>(G);
      w.node_rows = std::min(T * std::min(K, N), w.send_rows);
      w.relay_rows = w.token_rounds ? units_in_flight * w.slot_relay : N * T;
      w.fan_rows = w.token_rounds ? units_in_flight * w.slot_fan : w.relay_rows * std::min(K, G);
    }
    if (cfg.dispatch_rows == row_format::int8) {
      w.wire_row_bytes = wire_row::bytes(cfg.hidden);
      w.wire_stride = wire_row::stride(cfg.hidden);
    }
    return w;
  }

  /// Whether the dispatch moves 8-bit rows (wire buffers beside the activation type's).
  bool wire() const { return wire_stride > 0; }
  /// Bytes of one dispatch row that cross the link (the alignment padding is not counted).
  index_t dispatch_row_bytes(index_t elem_bytes) const {
    return wire() ? wire_row_bytes : hidden * elem_bytes;
  }

  /// A row of n elements padded to the alignment.
  index_t padded(index_t n) const { return (n + align - 1) / align * align; }

  index_t nodes() const { return ranks_per_node > 0 ? ranks / ranks_per_node : 1; }
  /// Keys the plan sorts: the blocks, or dedup's (chunk, rank) groups.
  index_t plan_keys() const { return std::max<index_t>(blocks, index_t{chunks} * ranks); }
};

/// The dispatch plan's arrays in a space's memory, with the host view and the space's view
/// of them. The per-block arrays are mirrors in two runs (the send side, written by the plan
/// stage and read on the host; the receive side, written on the host and read by the
/// exchange's kernels) so each crosses in one copy.
template <class Space>
class plan_storage {
 public:
  template <class T>
  using buffer = typename Space::template buffer<T>;
  template <class T>
  using mirror = typename Space::template mirror<T>;

  plan_storage() = default;
  plan_storage(const Space& s, const workspace_layout& w, bool dedup) {
    const index_t B = w.blocks, RL = index_t{w.ranks} * w.local_experts;
    const index_t CR = index_t{w.chunks} * w.ranks, E = w.experts;
    const index_t n = w.tokens * w.width, keys = w.plan_keys();
    const index_t CN = index_t{w.chunks} * w.nodes();
    send_ = s.template allocate_mirror<index_t>(RL + 3 * B + 1 + E + 2 * CR + 1 + 2 * CN + 1);
    recv_ = s.template allocate_mirror<index_t>(4 * B + 1 + index_t{w.chunks} * w.local_experts +
                                                1 + 2 * CR + 1);
    routes_ = s.template allocate_mirror<std::int32_t>(2 * n);  // slot, phys: read by dropped()
    const bool hier = w.ranks_per_node > 0;
    assignment_ = s.template allocate<std::int32_t>(((dedup || hier) ? 5 : 3) * n + (hier ? n : 0));
    row_token_ = s.template allocate<std::int32_t>(w.send_rows);
    if (dedup) {
      unique_token_ = s.template allocate<std::int32_t>(w.tokens * std::min(w.width, w.ranks));
      meta_ = s.template allocate<std::int64_t>(w.send_rows);
    }
    if (hier) {
      node_token_ = s.template allocate<std::int32_t>(w.node_rows);
      node_mask_ = s.template allocate<std::int64_t>(w.node_rows);
    }
    counts_ = s.template allocate<index_t>(2 * (keys + 1));
    sort_ = s.template allocate<char>(Space::sort_scratch_bytes(n, keys));
    bind(w, dedup);
  }

  dispatch_plan& host() { return plan_; }
  const dispatch_plan& host() const { return plan_; }
  const device_plan& device() const { return dev_; }
  const plan_scratch& scratch() const { return scratch_; }
  /// The send side's per-block arrays (kept .. unique offsets) and the receive side's.
  const mirror<index_t>& send_blocks() const { return send_; }
  const mirror<index_t>& recv_blocks() const { return recv_; }
  /// Every assignment's send row, then its copy ([2][T*K]; the plan's slot and phys).
  const mirror<std::int32_t>& routes() const { return routes_; }

 private:
  // Carves the arrays: host and device pointers at the same offsets of each mirror.
  void bind(const workspace_layout& w, bool dedup) {
    const index_t B = w.blocks, RL = index_t{w.ranks} * w.local_experts;
    const index_t CR = index_t{w.chunks} * w.ranks, n = w.tokens * w.width;
    const index_t CN = index_t{w.chunks} * w.nodes();
    dispatch_plan& p = plan_;
    device_plan& d = dev_;
    p.ranks = w.ranks;
    p.local_experts = w.local_experts;
    p.top_k = w.width;
    p.chunks = w.chunks;
    p.ranks_per_node = w.ranks_per_node;
    // Send side: kept [RL], counts [B], valid [B], offsets [B+1], routed [E], unique counts
    // [CR], unique offsets [CR+1], node counts [CN], node offsets [CN+1].
    carve(send_, {{&p.kept, &d.kept, RL},
                  {&p.send_counts, &d.send_counts, B},
                  {&p.send_valid, &d.send_valid, B},
                  {&p.send_offsets, &d.send_offsets, B + 1},
                  {&p.routed, &d.routed, w.experts},
                  {&p.unique_counts, &d.unique_counts, CR},
                  {&p.unique_offsets, &d.unique_offsets, CR + 1},
                  {&p.node_counts, &d.node_counts, CN},
                  {&p.node_offsets, &d.node_offsets, CN + 1}});
    // Receive side: counts [B], valid [B], offsets [B+1], regroup [B], expert offsets
    // [C*L+1], unique counts [CR], unique offsets [CR+1].
    index_t* unused = nullptr;
    carve(recv_, {{&p.recv_counts, &d.recv_counts, B},
                  {&p.recv_valid, &unused, B},
                  {&p.recv_offsets, &d.recv_offsets, B + 1},
                  {&p.regroup_offsets, &d.regroup_offsets, B},
                  {&p.expert_offsets, &d.expert_offsets, index_t{w.chunks} * w.local_experts + 1},
                  {&p.recv_unique_counts, &unused, CR},
                  {&p.recv_unique_offsets, &d.recv_unique_offsets, CR + 1}});
    p.slot = routes_.device();
    p.phys = routes_.device() + n;
    std::int32_t* a = assignment_.data();
    scratch_.keys = a;
    scratch_.sorted_keys = a + n;
    scratch_.order = a + 2 * n;
    if (dedup || w.ranks_per_node > 0) {
      p.unique_slot = a + 3 * n;
      scratch_.first_of = a + 4 * n;
    }
    if (w.ranks_per_node > 0) p.node_slot = a + 5 * n;
    p.node_token = node_token_.data();
    p.node_mask = node_mask_.data();
    p.row_token = row_token_.data();
    p.unique_token = unique_token_.data();
    p.meta = meta_.data();
    scratch_.rows = counts_.data();
    scratch_.first = counts_.data() + w.plan_keys() + 1;
    scratch_.sort = sort_.data();
  }

  struct piece {
    index_t** host;
    index_t** dev;
    index_t n;
  };
  static void carve(const mirror<index_t>& m, std::initializer_list<piece> pieces) {
    index_t at = 0;
    for (const piece& x : pieces) {
      *x.host = m.host() + at;
      *x.dev = m.device() + at;
      at += x.n;
    }
  }

  dispatch_plan plan_{};
  device_plan dev_{};
  plan_scratch scratch_{};
  mirror<index_t> send_, recv_;
  mirror<std::int32_t> routes_;
  buffer<std::int32_t> assignment_, row_token_, unique_token_, node_token_;
  buffer<std::int64_t> meta_, node_mask_;
  buffer<index_t> counts_;
  buffer<char> sort_;
};

}  // namespace epmoe
