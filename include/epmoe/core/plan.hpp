// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

/// Where every (token, k) assignment of one rank goes in one pass. All arrays live in the
/// layer's workspace (host or device memory, as the space decides); the plan only points.
///
/// Send buffer layout: blocks b = dest_rank * L + local_expert, in order; block b holds
/// `send_counts[b]` rows from `send_offsets[b]` (padding rows last, their token is -1).
/// Receive buffer layout: blocks b = src_rank * L + local_expert ("source-major"); the
/// experts read them regrouped "expert-major" (local_expert * R + src_rank).
struct dispatch_plan {
  int ranks = 0;          // R
  int local_experts = 0;  // L: experts per rank
  int top_k = 0;          // K: routing slots per token (E for expert choice)
  index_t tokens = 0;     // T of this pass

  std::int32_t* slot = nullptr;        // [T*K]: send row of assignment (t,k); -1 if dropped
  std::int32_t* phys = nullptr;        // [T*K]: physical slot (copy) serving (t,k); -1 if empty
  std::int32_t* row_token = nullptr;   // [send rows]: token of each send row; -1 for padding
  index_t* send_counts = nullptr;      // [R*L]: rows sent to (dest, local expert), padding included
  index_t* send_valid = nullptr;       // [R*L]: of which real (not padding)
  index_t* send_offsets = nullptr;     // [R*L+1]
  index_t* recv_counts = nullptr;      // [R*L]: rows received from (src, local expert)
  index_t* recv_valid = nullptr;       // [R*L]: of which real
  index_t* recv_offsets = nullptr;     // [R*L+1]: source-major receive layout
  index_t* expert_offsets = nullptr;   // [L+1]: first row of each local expert, expert-major
  index_t* regroup_offsets = nullptr;  // [R*L]: expert-major row of source-major block s*L+j
  index_t* routed = nullptr;           // [E]: assignments per logical expert, before capacity

  // Per-rank dedup only: a token sends one row to each rank holding any of its experts.
  std::int32_t* unique_slot = nullptr;     // [T*K]: unique send row of (t,k); -1 if dropped
  std::int32_t* unique_token = nullptr;    // [unique rows]: token of each unique send row
  index_t* unique_counts = nullptr;        // [R]: unique rows to each rank
  index_t* unique_offsets = nullptr;       // [R+1]
  index_t* recv_unique_counts = nullptr;   // [R]: unique rows from each rank
  index_t* recv_unique_offsets = nullptr;  // [R+1]
  std::int64_t* meta = nullptr;       // [send rows]: per assignment row, pack_meta(index, weight)
  std::int64_t* meta_recv = nullptr;  // [recv rows]

  index_t assignments = 0;  // (token, expert) pairs routed; empty slots excluded
  index_t dropped = 0;      // assignments past capacity
  index_t padding = 0;      // padding rows this rank sends

  EPMOE_HD index_t send_rows() const { return send_offsets[ranks * local_experts]; }
  EPMOE_HD index_t recv_rows() const { return recv_offsets[ranks * local_experts]; }
  /// Rows to / from one peer rank: its L blocks are contiguous.
  EPMOE_HD index_t send_rows_to(int r) const {
    return send_offsets[(r + 1) * local_experts] - send_offsets[r * local_experts];
  }
  EPMOE_HD index_t recv_rows_from(int r) const {
    return recv_offsets[(r + 1) * local_experts] - recv_offsets[r * local_experts];
  }
};

/// Who a rank's tokens are: its rank (the home of its tokens, for replica choice) and each
/// token's id (given ids, else first + t).
struct token_origin {
  int home = 0;
  const std::int64_t* ids = nullptr;
  std::int64_t first = 0;
  EPMOE_HD std::uint64_t id(index_t t) const {
    return static_cast<std::uint64_t>(ids ? ids[t] : first + t);
  }
};

/// Builds the send side of `plan` from a routing, in token order (the order capacity drops
/// follow): each assignment to expert e goes to the physical slot the placement picks
/// (slot_for: one of e's copies), i.e. the next row of block (rank, local slot), while fewer
/// than `limit` rows are there; later ones are dropped. With `pad`, every block is `limit`
/// rows. Host version; a device space computes the same with a scan.
template <class Placement>
void build_send_plan(routing_view routing, const Placement& placement, int experts, index_t limit,
                     bool pad, token_origin origin, dispatch_plan& p) {
  const int B = p.ranks * p.local_experts, K = p.top_k;
  const index_t T = routing.tokens();
  p.tokens = T;
  p.dropped = 0;
  p.padding = 0;
  for (int e = 0; e < experts; ++e) p.routed[e] = 0;
  for (int b = 0; b < B; ++b) p.send_valid[b] = 0;

  // Pass 1: the copy and the position inside its block of each assignment, or dropped.
  p.assignments = 0;
  for (index_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int e = routing.ids(t, k);
      std::int32_t& s = p.slot[t * K + k];
      std::int32_t& b = p.phys[t * K + k];
      s = b = -1;
      if (e == no_expert) continue;  // an empty slot (expert choice): not an assignment
      if (e < 0 || e >= experts)
        throw config_error("routing.ids", std::to_string(e),
                           "expert id must be in [0, " + std::to_string(experts) + ")");
      ++p.routed[e];
      ++p.assignments;
      b = placement.slot_for(e, origin.home, origin.id(t));
      if (p.send_valid[b] < limit)
        s = static_cast<std::int32_t>(p.send_valid[b]++);
      else
        ++p.dropped;
    }
  }
  // Block sizes and offsets.
  p.send_offsets[0] = 0;
  for (int b = 0; b < B; ++b) {
    p.send_counts[b] = pad ? limit : p.send_valid[b];
    p.padding += p.send_counts[b] - p.send_valid[b];
    p.send_offsets[b + 1] = p.send_offsets[b] + p.send_counts[b];
  }
  // Pass 2: absolute rows; padding rows carry token -1.
  for (int b = 0; b < B; ++b)
    for (index_t i = p.send_valid[b]; i < p.send_counts[b]; ++i)
      p.row_token[p.send_offsets[b] + i] = -1;
  for (index_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      std::int32_t& s = p.slot[t * K + k];
      if (s < 0) continue;  // dropped or empty
      s += static_cast<std::int32_t>(p.send_offsets[p.phys[t * K + k]]);
      p.row_token[s] = static_cast<std::int32_t>(t);
    }
  }
}

/// An assignment's metadata for dedup: its unique row's index within the rows from its
/// source rank (low 32 bits) and its combine weight (high 32 bits, the float's bits).
EPMOE_HD std::int64_t pack_meta(std::int32_t index, float weight) {
  std::uint32_t bits;
  memcpy(&bits, &weight, sizeof bits);
  return static_cast<std::int64_t>((std::uint64_t{bits} << 32) | static_cast<std::uint32_t>(index));
}
EPMOE_HD std::int32_t meta_index(std::int64_t m) {
  return static_cast<std::int32_t>(static_cast<std::uint64_t>(m) & 0xffffffffu);
}
EPMOE_HD float meta_weight(std::int64_t m) {
  const auto bits = static_cast<std::uint32_t>(static_cast<std::uint64_t>(m) >> 32);
  float w;
  memcpy(&w, &bits, sizeof w);
  return w;
}

/// Per-rank dedup on top of build_send_plan: each token gets one unique send row per
/// destination rank among its kept assignments (in token order within a rank); every
/// assignment row carries (its unique row's index within that rank's rows, its weight).
inline void build_dedup_plan(routing_view routing, dispatch_plan& p) {
  const int R = p.ranks, K = p.top_k, L = p.local_experts;
  const index_t T = p.tokens;
  for (int r = 0; r < R; ++r) p.unique_counts[r] = 0;
  for (index_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      std::int32_t& u = p.unique_slot[t * K + k];
      u = -1;
      if (p.slot[t * K + k] < 0) continue;
      const int r = p.phys[t * K + k] / L;
      for (int q = 0; q < k && u < 0; ++q)  // an earlier expert of t on the same rank
        if (p.slot[t * K + q] >= 0 && p.phys[t * K + q] / L == r) u = p.unique_slot[t * K + q];
      if (u < 0) u = static_cast<std::int32_t>(p.unique_counts[r]++);
    }
  p.unique_offsets[0] = 0;
  for (int r = 0; r < R; ++r) p.unique_offsets[r + 1] = p.unique_offsets[r] + p.unique_counts[r];
  for (index_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      std::int32_t& u = p.unique_slot[t * K + k];
      if (u < 0) continue;
      p.meta[p.slot[t * K + k]] = pack_meta(u, routing.weights(t, k));
      u += static_cast<std::int32_t>(p.unique_offsets[p.phys[t * K + k] / L]);
      p.unique_token[u] = static_cast<std::int32_t>(t);
    }
}

/// Receive offsets, source-major and expert-major, once recv_counts are known.
inline void build_recv_plan(dispatch_plan& p) {
  const int R = p.ranks, L = p.local_experts;
  p.recv_offsets[0] = 0;
  for (int b = 0; b < R * L; ++b) p.recv_offsets[b + 1] = p.recv_offsets[b] + p.recv_counts[b];
  index_t row = 0;
  for (int j = 0; j < L; ++j) {
    p.expert_offsets[j] = row;
    for (int s = 0; s < R; ++s) {
      p.regroup_offsets[s * L + j] = row;
      row += p.recv_counts[s * L + j];
    }
  }
  p.expert_offsets[L] = row;
}

}  // namespace epmoe
