// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// What simulate() predicts: each rank's stage times and counts, and the pass's latency.

#include <string>
#include <vector>

#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/sim/cost.hpp"

namespace epmoe::sim {

/// The stages of one rank's pass, in the layer's order (stage_times without plan).
enum class stage { route, permute, shared, counts, dispatch, experts, combine, reduce };
inline constexpr int stage_count = 8;
inline constexpr const char* stage_names[stage_count] = {
    "route", "permute", "shared", "counts", "dispatch", "experts", "combine", "reduce"};

/// One rank's pass: its own stage times (summed over chunks, waits excluded) and counts.
/// dispatch and combine are the row exchanges plus the rank's local row copies (its rows to
/// itself, the regroup by expert and back); counts is the counts all-to-all before them.
/// Hierarchical: send rows are its node rows (one per (token, node)), self rows those for its
/// own node (it relays them itself), and rows_out/rows_in count both levels (node rows on the
/// inter-node link, the rows it relays to its node's ranks on the intra-node one).
struct rank_result {
  double route = 0, permute = 0, shared = 0, counts = 0;  // seconds
  double dispatch = 0, experts = 0, combine = 0, reduce = 0;
  index_t tokens = 0, assignments = 0, dropped = 0, padding = 0;
  index_t send_rows = 0;                  // rows permute gathers (unique with dedup), padding in
  index_t self_rows = 0;                  // of them, rows for its own slots: copied, never sent
  index_t rows_computed = 0;              // real rows its expert slots computed
  index_t peak_recv_rows = 0;             // pass_stats': the fullest round's, else the pass's
  index_t padded_rows_computed = 0;       // padding included (what the GEMMs cost)
  traffic dispatch_bytes, combine_bytes;  // to and from other ranks, per link class
  index_t rows_out[2] = {0, 0}, rows_in[2] = {0, 0};  // dispatch rows to / from other ranks,
                                                      // per link class (the combine's: back)
  double time(stage s) const {
    const double t[stage_count] = {route,    permute, shared,  counts,
                                   dispatch, experts, combine, reduce};
    return t[static_cast<int>(s)];
  }
  double total() const {
    return route + permute + shared + counts + dispatch + experts + combine + reduce;
  }
};

struct result {
  int ranks = 0, chunks = 1, slots_per_rank = 0;
  // Exchange units in the layer's order: one per chunk, or with config max_recv_rows every
  // round of every chunk (chunk c's rounds: the most any (source, destination) pair needs).
  int units = 1, rounds = 1;                  // units; most rounds of one chunk
  index_t quota = 0;                          // rows a pair moves per round (0: unbounded)
  std::vector<int> unit_chunk, unit_round;    // [U]
  std::vector<index_t> unit_rows;             // [R, U]: rows each rank's slots compute per unit
  std::vector<rank_result> per_rank;          // [R]
  std::vector<index_t> rows_per_slot;         // [P]: real rows per physical slot
  std::vector<index_t> padded_rows_per_slot;  // [P]: padding included
  std::vector<double> rank_dispatch, rank_experts, rank_combine;  // [R, U] per unit
  std::vector<index_t> rows_sent;             // [R, R] (keep_peer_counts): sender-major
  std::vector<index_t> assignment_rows_sent;  // [R, R]: the rows without dedup
  chunk_times stages;                         // per unit (and home stages), slowest rank
  schedule_times timeline;
  double latency = 0;           // predicted layer latency, seconds
  double balanced_latency = 0;  // the same schedule if every rank did the mean rank's work
  int straggler = 0;            // rank with the most own stage time
  double straggler_excess = 0;  // its own time / the mean rank's - 1
  std::string straggler_reason;
  imbalance rows_imbalance;           // of rows computed per rank
  double dispatch_bytes[2] = {0, 0};  // sent over each link class, all ranks
  double combine_bytes[2] = {0, 0};
  index_t dispatch_rows[2] = {0, 0};  // rows sent over each link class, all ranks
  bool hierarchical = false;          // priced as the two-level exchange
  bool low_latency = false;           // priced as fixed slots, one round per direction
  double slot_bytes = 0;              // low latency: bytes of one (source, destination) slot
  index_t assignments = 0, dropped = 0;
};

}  // namespace epmoe::sim
