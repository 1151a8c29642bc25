// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "epmoe/core/losses.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

/// Wall time of each stage of the last pass on this rank, in seconds.
struct stage_times {
  double route = 0;     // gate GEMM + per-token top-k
  double plan = 0;      // counts, capacity, row order
  double permute = 0;   // gather token rows into the send buffer
  double dispatch = 0;  // all-to-all #1 (counts + rows), regroup by expert
  double experts = 0;   // grouped expert FFN
  double combine = 0;   // all-to-all #2 back to the home rank
  double shared = 0;    // shared experts on the home rank
  double reduce = 0;    // weighted sum of each token's K outputs (+ shared experts)
  double total = 0;
};

/// A stage of one chunk on a rank's timeline.
enum class stage_kind : std::uint8_t { dispatch, experts, combine };

/// One stage of one chunk (and round, with a receive bound): seconds since the pass began.
/// A dispatch or combine runs from its start to the end of its wait; experts is compute.
struct timeline_event {
  int chunk = 0;
  stage_kind stage = stage_kind::experts;
  double start = 0;
  double end = 0;
  int round = 0;      // round of the chunk (config max_recv_rows splits a chunk in rounds)
  index_t rows = 0;   // rows received (dispatch), computed (experts) or sent back (combine)
  index_t bytes = 0;  // of them, bytes that crossed to or from another rank
};

/// How uneven a load vector is: max/mean (1 = balanced) and (max - mean)/mean, the share by
/// which the busiest member (the straggler) exceeds the mean.
struct imbalance {
  double max_over_mean = 0;
  double excess = 0;

  template <class Range>
  static imbalance of(const Range& load) {
    double sum = 0, max = 0, n = 0;
    for (const auto& v : load) {
      sum += static_cast<double>(v);
      max = std::max(max, static_cast<double>(v));
      n += 1;
    }
    if (sum <= 0) return {};
    const double mean = sum / n;
    return {max / mean, (max - mean) / mean};
  }
};

/// Which (token, k) assignments of a pass capacity dropped: a [tokens, slots] mask read from
/// the pass's plan (no copy). Empty routing slots (no_expert) are not drops.
struct drop_mask {
  const std::int32_t* slot = nullptr;  // [tokens * slots]: send row, < 0 if dropped or empty
  const std::int32_t* phys = nullptr;  // [tokens * slots]: expert copy, < 0 if empty
  index_t tokens = 0;
  index_t slots = 0;  // K (E for expert choice)

  bool operator()(index_t t, index_t k) const {
    const index_t i = t * slots + k;
    return slot[i] < 0 && phys[i] >= 0;
  }
  /// Dropped assignments (equals pass_stats::dropped).
  index_t count() const {
    index_t n = 0;
    for (index_t t = 0; t < tokens; ++t)
      for (index_t k = 0; k < slots; ++k) n += (*this)(t, k) ? 1 : 0;
    return n;
  }
};

/// Rows and bytes this rank moved over one class of link in a pass's dispatch (its combine
/// moves as many rows back the other way); rows to itself are not counted.
struct link_traffic {
  index_t rows_sent = 0;
  index_t rows_received = 0;
  index_t bytes_sent = 0;  // rows and, with dedup, the assignments' metadata
  index_t bytes_received = 0;
};

/// What one forward pass did on this rank. Sized once at layer construction; a pass only
/// overwrites the numbers.
struct pass_stats {
  index_t tokens = 0;                          // T of the pass
  index_t assignments = 0;                     // routed (token, expert) pairs: T * K less
                                               //   the zero experts' and empty slots
  index_t zero_expert_assignments = 0;         // (token, zero expert) pairs (config
                                               //   zero_experts): added at home, no row sent
  index_t dropped = 0;                         // assignments past capacity: contribute nothing
  std::optional<index_t> capacity;             // rows this rank may send one expert copy this
                                               //   pass (the capacity policy's limit, per
                                               //   source rank); none for capacity::dropless
  index_t padding_rows = 0;                    // zero rows this rank sent to pad blocks
  std::vector<index_t> routed_per_expert;      // [E]: this rank's assignments per logical expert
  std::vector<index_t> rows_per_local_expert;  // [L]: real rows this rank's experts computed
  std::vector<index_t> padded_rows_per_local_expert;  // [L]: same, padding included
  std::vector<index_t> rows_sent;                     // [R]: rows sent to each rank (dispatch)
  std::vector<index_t> rows_received;             // [R]: rows received from each rank (dispatch)
  std::vector<index_t> assignment_rows_sent;      // [R]: (token, expert) rows to each rank:
  std::vector<index_t> assignment_rows_received;  //   the rows without dedup
  index_t dispatch_bytes_sent = 0;                // to other ranks (self rows stay local)
  index_t dispatch_bytes_received = 0;            // from other ranks
  index_t combine_bytes_sent = 0;
  index_t combine_bytes_received = 0;
  int ranks_per_node = 0;      // ranks one node holds: the link classes below split by it
  link_traffic intra_node;     // dispatch traffic with ranks of this rank's node
  link_traffic inter_node;     //   and with other nodes (hierarchical: one row per node)
  double expert_flops = 0;     // FLOPs of this rank's expert GEMMs, padding included
  double shared_flops = 0;     // FLOPs of the shared experts on this rank
  imbalance expert_imbalance;  // of routed_per_expert (this rank's tokens)
  imbalance rank_imbalance;    // of rows_sent: how unevenly this rank's rows spread over ranks
  router_losses losses;        // of this rank's tokens (valid when the router has a gate)
  int chunks = 1;              // chunks the pass was cut into
  std::vector<timeline_event> timeline;  // per chunk (and round): dispatch, experts, combine
  double comm_seconds = 0;               // all-to-all time: counts + every chunk's exchanges
                                         // (the link model's time where throttled)
  double exposed_comm_seconds = 0;       // of it, time this rank waited (not hidden by compute)
  double overlap = 0;                    // 1 - exposed / comm: the share hidden
  stage_times time;
  stage_times began;           // when each stage first began, seconds since the pass began
  double started = 0;          // when the pass began, seconds since the layer was built
  int rounds = 1;              // most exchange rounds of one chunk (> 1 when max_recv_rows splits)
  index_t peak_recv_rows = 0;  // most rows one exchange round put in the receive buffer
  int alltoalls = 0;  // all-to-alls the pass made (flat: counts + 2 per unit; low latency: 2;
                      //   0: not counted, dedup and hierarchical)
  index_t recv_buffer_rows = 0;  // rows of the receive buffer (<= max_recv_rows when set)
  bool backward = false;         // the last call was backward(): time, began, timeline and the
                                 //   comm times are its stages (route: the router's and the
                                 //   gate's backward; experts: dX and dW); the counts are the
                                 //   forward's
  index_t saved_bytes = 0;       // training: bytes the last forward kept for backward (expert
                                 //   input rows, logits, routing), beyond the pass's buffers

  pass_stats() = default;
  pass_stats(int experts, int local_experts, int ranks)
      : routed_per_expert(experts),
        rows_per_local_expert(local_experts),
        padded_rows_per_local_expert(local_experts),
        rows_sent(ranks),
        rows_received(ranks),
        assignment_rows_sent(ranks),
        assignment_rows_received(ranks) {}
};

/// A pass seen by all ranks (moe_layer::gather_load): rows per logical expert summed over
/// ranks, and real rows each rank's experts computed.
struct global_load {
  std::vector<index_t> per_expert;  // [E]
  std::vector<index_t> per_rank;    // [R]
  imbalance experts, ranks;         // the straggler's excess is ranks.excess
};

/// gather_load's collective: one all-to-all of every rank's per-expert load and computed rows.
template <class Comm>
global_load gather_global_load(Comm& comm, const pass_stats& s, int R, int E) {
  const int W = E + 1;
  std::vector<index_t> send(static_cast<std::size_t>(R * W)), recv(send.size());
  index_t computed = 0;
  for (index_t n : s.rows_per_local_expert) computed += n;
  for (int r = 0; r < R; ++r) {
    std::copy_n(s.routed_per_expert.begin(), E, send.begin() + r * W);
    send[static_cast<std::size_t>(r * W + E)] = computed;
  }
  comm.alltoall(send.data(), recv.data(), W);
  global_load g{std::vector<index_t>(E, 0), std::vector<index_t>(R, 0), {}, {}};
  for (int r = 0; r < R; ++r) {
    for (int e = 0; e < E; ++e) g.per_expert[e] += recv[static_cast<std::size_t>(r * W + e)];
    g.per_rank[r] = recv[static_cast<std::size_t>(r * W + E)];
  }
  g.experts = imbalance::of(g.per_expert);
  g.ranks = imbalance::of(g.per_rank);
  return g;
}

}  // namespace epmoe
