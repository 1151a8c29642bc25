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
/// A pass is cut into C chunks of consecutive tokens (C = 1 unless a schedule pipelines),
/// so that one chunk's exchange can overlap another chunk's experts. Blocks are indexed
/// b = (chunk * R + rank) * L + local_slot, in that order in every buffer:
/// - send buffer: block (c, dest, j) holds send_counts[b] rows from send_offsets[b] (padding
///   rows last, in the last chunk, with token -1); a chunk's rows to one rank are contiguous;
/// - receive buffer: block (c, src, j) ("source-major");
/// - expert buffer: per chunk, expert-major: (c, j) holds every source's rows for local slot j
///   from expert_offsets[c*L + j]; regroup_offsets[b] is where block (c, src, j) goes there.
struct dispatch_plan {
  int ranks = 0;          // R
  int local_experts = 0;  // L: physical expert slots per rank
  int top_k = 0;          // K: routing slots per token (E for expert choice)
  int chunks = 1;         // C
  index_t tokens = 0;     // T of this pass

  std::int32_t* slot = nullptr;        // [T*K]: send row of assignment (t,k); -1 if dropped
  std::int32_t* phys = nullptr;        // [T*K]: physical slot (copy) serving (t,k); -1 if empty
  std::int32_t* row_token = nullptr;   // [send rows]: token of each send row; -1 for padding
  index_t* kept = nullptr;             // [R*L]: rows kept per slot (capacity count)
  index_t* send_counts = nullptr;      // [C*R*L]: rows sent per block, padding included
  index_t* send_valid = nullptr;       // [C*R*L]: of which real (not padding)
  index_t* send_offsets = nullptr;     // [C*R*L+1]
  index_t* recv_counts = nullptr;      // [C*R*L]: rows received per block (c, src, j)
  index_t* recv_valid = nullptr;       // [C*R*L]: of which real
  index_t* recv_offsets = nullptr;     // [C*R*L+1]
  index_t* expert_offsets = nullptr;   // [C*L+1]: first row of (chunk, local slot), expert-major
  index_t* regroup_offsets = nullptr;  // [C*R*L]: expert-major row of receive block b
  index_t* routed = nullptr;           // [E]: assignments per logical expert, before capacity

  // Per-rank dedup only: a token sends one row to each rank holding any of its experts.
  std::int32_t* unique_slot = nullptr;     // [T*K]: unique send row of (t,k); -1 if dropped
  std::int32_t* unique_token = nullptr;    // [unique rows]: token of each unique send row
  index_t* unique_counts = nullptr;        // [C*R]: unique rows per (chunk, rank)
  index_t* unique_offsets = nullptr;       // [C*R+1]
  index_t* recv_unique_counts = nullptr;   // [C*R]: unique rows from (chunk, rank)
  index_t* recv_unique_offsets = nullptr;  // [C*R+1]
  std::int64_t* meta = nullptr;       // [send rows]: per assignment row, pack_meta(index, weight)
  std::int64_t* meta_recv = nullptr;  // [recv rows]

  index_t assignments = 0;  // (token, expert) pairs routed; empty slots excluded
  index_t dropped = 0;      // assignments past capacity
  index_t padding = 0;      // padding rows this rank sends

  EPMOE_HD int block(int c, int r, int j) const { return (c * ranks + r) * local_experts + j; }
  EPMOE_HD int blocks() const { return chunks * ranks * local_experts; }
  /// The chunk of token t: tokens [c*T/C, (c+1)*T/C) form chunk c.
  EPMOE_HD int chunk_of(index_t t) const {
    return static_cast<int>(((t + 1) * chunks + tokens - 1) / tokens - 1);
  }
  EPMOE_HD index_t send_rows() const { return send_offsets[blocks()]; }
  EPMOE_HD index_t recv_rows() const { return recv_offsets[blocks()]; }
  /// Rows of chunk c to / from one peer rank: its L blocks are contiguous.
  EPMOE_HD index_t send_rows_to(int c, int r) const {
    return send_offsets[block(c, r + 1, 0)] - send_offsets[block(c, r, 0)];
  }
  EPMOE_HD index_t recv_rows_from(int c, int r) const {
    return recv_offsets[block(c, r + 1, 0)] - recv_offsets[block(c, r, 0)];
  }
  /// Over all chunks.
  EPMOE_HD index_t send_rows_to(int r) const {
    index_t n = 0;
    for (int c = 0; c < chunks; ++c) n += send_rows_to(c, r);
    return n;
  }
  EPMOE_HD index_t recv_rows_from(int r) const {
    index_t n = 0;
    for (int c = 0; c < chunks; ++c) n += recv_rows_from(c, r);
    return n;
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
/// follow, whatever the chunks): each assignment to expert e goes to the physical slot the
/// placement picks (slot_for: one of e's copies) while fewer than `limit` rows went there;
/// later ones are dropped. With `pad`, every slot gets `limit` rows (the padding in the last
/// chunk). Host version; a device space computes the same with a scan.
template <class Placement>
void build_send_plan(routing_view routing, const Placement& placement, int experts, index_t limit,
                     bool pad, token_origin origin, dispatch_plan& p) {
  const int RL = p.ranks * p.local_experts, B = p.blocks(), K = p.top_k;
  const index_t T = routing.tokens();
  p.tokens = T;
  p.dropped = 0;
  p.padding = 0;
  p.assignments = 0;
  for (int e = 0; e < experts; ++e) p.routed[e] = 0;
  for (int b = 0; b < RL; ++b) p.kept[b] = 0;
  for (int b = 0; b < B; ++b) p.send_valid[b] = 0;

  // Pass 1: the copy of each assignment and its position inside its block, or dropped.
  for (index_t t = 0; t < T; ++t) {
    const int c = p.chunk_of(t);
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
      if (p.kept[b] < limit) {
        ++p.kept[b];
        s = static_cast<std::int32_t>(p.send_valid[c * RL + b]++);
      } else {
        ++p.dropped;
      }
    }
  }
  // Block sizes and offsets; padding fills each slot up to `limit` in the last chunk.
  p.send_offsets[0] = 0;
  for (int b = 0; b < B; ++b) {
    const bool last = b >= (p.chunks - 1) * RL;
    p.send_counts[b] = p.send_valid[b] + (pad && last ? limit - p.kept[b % RL] : 0);
    p.padding += p.send_counts[b] - p.send_valid[b];
    p.send_offsets[b + 1] = p.send_offsets[b] + p.send_counts[b];
  }
  // Pass 2: absolute rows; padding rows carry token -1.
  for (int b = 0; b < B; ++b)
    for (index_t i = p.send_valid[b]; i < p.send_counts[b]; ++i)
      p.row_token[p.send_offsets[b] + i] = -1;
  for (index_t t = 0; t < T; ++t) {
    const int c = p.chunk_of(t);
    for (int k = 0; k < K; ++k) {
      std::int32_t& s = p.slot[t * K + k];
      if (s < 0) continue;  // dropped or empty
      s += static_cast<std::int32_t>(p.send_offsets[c * RL + p.phys[t * K + k]]);
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
/// destination rank among its kept assignments (in token order, in the token's chunk);
/// every assignment row carries (its unique row's index within the rows of its chunk from
/// this rank to that rank, its weight).
inline void build_dedup_plan(routing_view routing, dispatch_plan& p) {
  const int R = p.ranks, K = p.top_k, L = p.local_experts, CR = p.chunks * R;
  const index_t T = p.tokens;
  for (int b = 0; b < CR; ++b) p.unique_counts[b] = 0;
  for (index_t t = 0; t < T; ++t) {
    const int c = p.chunk_of(t);
    for (int k = 0; k < K; ++k) {
      std::int32_t& u = p.unique_slot[t * K + k];
      u = -1;
      if (p.slot[t * K + k] < 0) continue;
      const int r = p.phys[t * K + k] / L;
      for (int q = 0; q < k && u < 0; ++q)  // an earlier expert of t on the same rank
        if (p.slot[t * K + q] >= 0 && p.phys[t * K + q] / L == r) u = p.unique_slot[t * K + q];
      if (u < 0) u = static_cast<std::int32_t>(p.unique_counts[c * R + r]++);
    }
  }
  p.unique_offsets[0] = 0;
  for (int b = 0; b < CR; ++b) p.unique_offsets[b + 1] = p.unique_offsets[b] + p.unique_counts[b];
  for (index_t t = 0; t < T; ++t) {
    const int c = p.chunk_of(t);
    for (int k = 0; k < K; ++k) {
      std::int32_t& u = p.unique_slot[t * K + k];
      if (u < 0) continue;
      p.meta[p.slot[t * K + k]] = pack_meta(u, routing.weights(t, k));
      u += static_cast<std::int32_t>(p.unique_offsets[c * R + p.phys[t * K + k] / L]);
      p.unique_token[u] = static_cast<std::int32_t>(t);
    }
  }
}

/// Receive offsets and the per-chunk expert-major regroup, once recv_counts are known.
inline void build_recv_plan(dispatch_plan& p) {
  const int R = p.ranks, L = p.local_experts, C = p.chunks;
  p.recv_offsets[0] = 0;
  for (int b = 0; b < p.blocks(); ++b) p.recv_offsets[b + 1] = p.recv_offsets[b] + p.recv_counts[b];
  index_t row = 0;
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < L; ++j) {
      p.expert_offsets[c * L + j] = row;
      for (int s = 0; s < R; ++s) {
        p.regroup_offsets[p.block(c, s, j)] = row;
        row += p.recv_counts[p.block(c, s, j)];
      }
    }
  p.expert_offsets[C * L] = row;
}

}  // namespace epmoe
