// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

/// The chunk of token t of T when a pass is cut into C chunks: tokens [c*T/C, (c+1)*T/C).
EPMOE_HD int chunk_of_token(index_t t, int chunks, index_t tokens) {
  return static_cast<int>(((t + 1) * chunks + tokens - 1) / tokens - 1);
}

/// Where every (token, k) assignment of one rank goes in one pass. The per-assignment arrays
/// (slot, phys, row_token, unique_*, meta) live in the space's memory; the per-block arrays
/// and the counts are host memory (host code sizes the exchanges from them). On the host
/// space the two are one memory.
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
  int rounds = 1;         // chunks per schedule chunk (a receive bound with dedup cuts each
                          //   in windows of tokens: the exchange's rounds)
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
  index_t* routed = nullptr;           // [E+Z]: assignments per logical expert (zero experts
                                       //   last), before capacity

  // Per-rank dedup only: a token sends one row to each rank holding any of its experts.
  std::int32_t* unique_slot = nullptr;     // [T*K]: unique send row of (t,k); -1 if dropped
  std::int32_t* unique_token = nullptr;    // [unique rows]: token of each unique send row
  index_t* unique_counts = nullptr;        // [C*R]: unique rows per (chunk, rank)
  index_t* unique_offsets = nullptr;       // [C*R+1]
  index_t* recv_unique_counts = nullptr;   // [C*R]: unique rows from (chunk, rank)
  index_t* recv_unique_offsets = nullptr;  // [C*R+1]
  std::int64_t* meta = nullptr;       // [send rows]: per assignment row, pack_meta(index, weight)
  std::int64_t* meta_recv = nullptr;  // [recv rows]

  // Hierarchical exchange (ranks_per_node = G > 0): a token sends one row to each node
  // (N = R / G) holding any of its kept assignments, to the rank there with its home's local
  // index, which fans it out to that node's ranks (docs/architecture.md).
  int ranks_per_node = 0;              // G; 0: no hierarchical exchange
  std::int32_t* node_slot = nullptr;   // [T*K]: node send row of (t,k); -1 if dropped
  std::int32_t* node_token = nullptr;  // [node rows]: token of each node send row
  std::int64_t* node_mask = nullptr;   // [node rows]: bit g: local rank g of the node
                                       //   holds one of the token's kept assignments
  index_t* node_counts = nullptr;      // [C*N]: node rows per (chunk, node)
  index_t* node_offsets = nullptr;     // [C*N+1]

  index_t assignments = 0;       // (token, expert) pairs routed to real experts; empty slots and
                                 //   zero experts excluded
  index_t zero_assignments = 0;  // (token, zero expert) pairs: added at home, never sent
  index_t dropped = 0;           // assignments past capacity
  index_t padding = 0;           // padding rows this rank sends

  EPMOE_HD int block(int c, int r, int j) const { return (c * ranks + r) * local_experts + j; }
  EPMOE_HD int nodes() const { return ranks_per_node > 0 ? ranks / ranks_per_node : 1; }
  EPMOE_HD int blocks() const { return chunks * ranks * local_experts; }
  /// The chunk of token t: tokens [c*T/C, (c+1)*T/C) form chunk c.
  EPMOE_HD int chunk_of(index_t t) const { return chunk_of_token(t, chunks, tokens); }
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

/// What the plan's per-assignment step holds of a placement: its view() (plain pointers, as
/// placement::table has) where it has one, else the placement itself (a small value).
template <class Placement>
auto placement_view(const Placement& p) {
  if constexpr (requires { p.view(); })
    return p.view();
  else
    return p;
}

namespace detail {
/// A host placement by reference (one the host plan must not copy: it may own arrays).
template <class Placement>
struct placement_ref {
  const Placement* p;
  int slot_for(int e, int home, std::uint64_t token) const { return p->slot_for(e, home, token); }
};
}  // namespace detail

/// The plan's per-block arrays in the space's memory, for the plan's own functors and the
/// exchange's kernels (on the host space: the dispatch_plan's arrays themselves).
struct device_plan {
  index_t* kept = nullptr;                 // [R*L]
  index_t* send_counts = nullptr;          // [C*R*L]
  index_t* send_valid = nullptr;           // [C*R*L]
  index_t* send_offsets = nullptr;         // [C*R*L+1]
  index_t* routed = nullptr;               // [E+Z]
  index_t* unique_counts = nullptr;        // [C*R]
  index_t* unique_offsets = nullptr;       // [C*R+1]
  index_t* recv_counts = nullptr;          // [C*R*L]
  index_t* recv_offsets = nullptr;         // [C*R*L+1]
  index_t* regroup_offsets = nullptr;      // [C*R*L]
  index_t* expert_offsets = nullptr;       // [C*L+1]
  index_t* recv_unique_offsets = nullptr;  // [C*R+1]
  index_t* node_counts = nullptr;          // [C*N]
  index_t* node_offsets = nullptr;         // [C*N+1]
};

/// Scratch of the plan stage in the space's memory, sized for the most assignments (T*K) and
/// keys (the blocks C*R*L, or C*R for dedup's unique rows) of a pass.
struct plan_scratch {
  std::int32_t* keys = nullptr;         // [T*K]
  std::int32_t* sorted_keys = nullptr;  // [T*K]
  std::int32_t* order = nullptr;        // [T*K]
  std::int32_t* first_of = nullptr;     // [T*K] (dedup)
  index_t* rows = nullptr;              // [keys + 1]: entries per key
  index_t* first = nullptr;             // [keys + 1]: first sorted position of each key
  void* sort = nullptr;                 // the space's sort_scratch_bytes(T*K, keys)
};

// The plan's per-assignment and per-block steps, run by a space's for_each (host loops or
// kernels): a placement's slot_for and the capacity rule exist once.
namespace plan_ops {

/// Assignment a = t*K + k: the copy (physical slot) that serves it and its key, the block
/// (chunk, slot) it is sent in; empty slots (no_expert) and zero experts (e >= E: added at
/// home) get key B, after every block, and no copy.
template <class Placement>
struct assign_keys {
  const std::int32_t* ids;
  int K, RL, B, chunks;
  index_t tokens;
  Placement where;
  token_origin origin;
  std::int32_t* phys;
  std::int32_t* keys;
  int experts;  // E: ids at or past it are zero experts
  EPMOE_HD void operator()(index_t a) const {
    const index_t t = a / K;
    const int e = ids[a];
    if (e == no_expert || e >= experts) {
      phys[a] = -1;
      keys[a] = B;
      return;
    }
    const int s = where.slot_for(e, origin.home, origin.id(t));
    phys[a] = s;
    keys[a] = chunk_of_token(t, chunks, tokens) * RL + s;
  }
};

/// Slot s: capacity in token order over the chunks (a chunk's rows follow the earlier
/// chunks'), the rows each block sends, and with padding every slot filled to `pad_rows` in
/// the last chunk.
struct apply_capacity {
  const index_t* rows;  // [B]: assignments per block before capacity
  int RL, chunks;
  index_t limit;
  index_t pad_rows;  // 0: no padding
  index_t* valid;    // [B]
  index_t* counts;   // [B]
  index_t* kept;     // [RL]
  EPMOE_HD void operator()(index_t s) const {
    index_t before = 0;
    for (int c = 0; c < chunks; ++c) {
      const index_t b = c * RL + s, room = limit - before;
      const index_t v = room <= 0 ? 0 : (rows[b] < room ? rows[b] : room);
      valid[b] = counts[b] = v;
      before += rows[b];
    }
    kept[s] = before < limit ? before : limit;
    if (pad_rows > 0) counts[(chunks - 1) * RL + s] += pad_rows - kept[s];
  }
};

/// Sorted position p: the assignment there and its row in the send buffer (the block's
/// first `valid` assignments in token order), or -1 when dropped or empty.
struct place_rows {
  const std::int32_t* sorted_keys;
  const std::int32_t* order;
  const index_t* first;    // [B+1]
  const index_t* valid;    // [B]
  const index_t* offsets;  // [B+1] send offsets
  int B, K;
  std::int32_t* slot;
  std::int32_t* row_token;
  EPMOE_HD void operator()(index_t p) const {
    const int b = sorted_keys[p];
    const std::int32_t a = order[p];
    const index_t i = b < B ? p - first[b] : 0;
    if (b >= B || i >= valid[b]) {
      slot[a] = -1;
      return;
    }
    const index_t row = offsets[b] + i;
    slot[a] = static_cast<std::int32_t>(row);
    row_token[row] = a / K;
  }
};

/// Dedup, token t: a kept assignment is the first of t to its rank (key: its (chunk, rank)
/// group of unique rows) or shares the unique row of that first one (first_of).
struct unique_keys {
  const std::int32_t* slot;
  const std::int32_t* phys;
  int K, L, R, chunks;
  index_t tokens;
  std::int32_t* keys;      // [T*K]: c*R + r, or C*R (no unique row of its own)
  std::int32_t* first_of;  // [T*K]: the assignment whose unique row serves a, or -1
  EPMOE_HD void operator()(index_t t) const {
    const int c = chunk_of_token(t, chunks, tokens), CR = chunks * R;
    for (int k = 0; k < K; ++k) {
      const index_t a = t * K + k;
      keys[a] = CR;
      first_of[a] = -1;
      if (slot[a] < 0) continue;
      const int r = phys[a] / L;
      std::int32_t q = static_cast<std::int32_t>(a);
      for (int j = 0; j < k; ++j)  // an earlier kept expert of t on the same rank
        if (slot[t * K + j] >= 0 && phys[t * K + j] / L == r) {
          q = static_cast<std::int32_t>(t * K + j);
          break;
        }
      first_of[a] = q;
      if (q == a) keys[a] = c * R + r;
    }
  }
};

/// Dedup, sorted position p: unique rows are numbered in key order, token order within a key.
struct place_unique {
  const std::int32_t* sorted_keys;
  const std::int32_t* order;
  int CR, K;
  std::int32_t* unique_slot;
  std::int32_t* unique_token;
  EPMOE_HD void operator()(index_t p) const {
    if (sorted_keys[p] >= CR) return;
    const std::int32_t a = order[p];
    unique_slot[a] = static_cast<std::int32_t>(p);
    unique_token[p] = a / K;
  }
};

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

/// Dedup, assignment a: the unique row that carries it, and its row's metadata (the unique
/// row's index within its (chunk, rank) group, the weight the expert rank applies).
struct link_unique {
  const std::int32_t* first_of;
  const std::int32_t* slot;
  const std::int32_t* phys;
  const float* weights;           // [T*K]
  const index_t* unique_offsets;  // [C*R+1]
  int K, L, R, chunks;
  index_t tokens;
  std::int32_t* unique_slot;
  std::int64_t* meta;
  EPMOE_HD void operator()(index_t a) const {
    if (first_of[a] < 0) {
      unique_slot[a] = -1;
      return;
    }
    const std::int32_t u = unique_slot[first_of[a]];
    unique_slot[a] = u;
    const int c = chunk_of_token(a / K, chunks, tokens), r = phys[a] / L;
    meta[slot[a]] = pack_meta(static_cast<std::int32_t>(u - unique_offsets[c * R + r]), weights[a]);
  }
};

/// Hierarchical, token t: each kept assignment's node row (that of the token's first kept
/// assignment on the same node, numbered by place_unique) and each node row's mask of the
/// node's ranks it must reach. One thread per token: the mask is written by one thread.
struct link_nodes {
  const std::int32_t* first_of;  // per node, from unique_keys
  const std::int32_t* phys;
  int K, L, G;
  std::int32_t* node_slot;
  std::int64_t* node_mask;
  EPMOE_HD void operator()(index_t t) const {
    for (int k = 0; k < K; ++k) {
      const index_t a = t * K + k;
      if (first_of[a] < 0) {
        node_slot[a] = -1;
        continue;
      }
      const std::int32_t u = node_slot[first_of[a]];
      const std::int64_t bit = std::int64_t{1} << ((phys[a] / L) % G);
      node_mask[u] = first_of[a] == a ? bit : (node_mask[u] | bit);
      node_slot[a] = u;
    }
  }
};

}  // namespace plan_ops

using plan_ops::meta_index;
using plan_ops::meta_weight;
using plan_ops::pack_meta;

/// Builds the send side of a plan in the space's memory from a routing (also there), in
/// token order (the order capacity drops follow, whatever the chunks): each assignment to
/// expert e goes to the copy the placement picks (slot_for) while fewer than `limit` rows
/// went there; later ones are dropped. Ids in [E, E + zero) are zero experts: counted in
/// `routed`, never sent. With `pad_rows` > 0 (>= limit), every slot sends that many rows (the
/// padding in the last chunk, token -1). As keys, a stable sort and scans, so a device runs
/// the same steps as the host. Fills the arrays of `d` and the per-assignment arrays of `p`;
/// the host's per-block arrays and counts follow from them (mirror, then count_send_plan).
template <class Space, class Placement>
void build_send_plan(const Space& space, routing_view routing, const Placement& where, int experts,
                     index_t limit, index_t pad_rows, token_origin origin, dispatch_plan& p,
                     const device_plan& d, const plan_scratch& w, int zero = 0) {
  const int RL = p.ranks * p.local_experts, B = p.blocks(), K = p.top_k;
  const index_t T = routing.tokens(), n = T * K;
  p.tokens = T;
  space.for_each(n, plan_ops::assign_keys<Placement>{routing.ids.data, K, RL, B, p.chunks, T, where,
                                                     origin, p.phys, w.keys, experts});
  space.count(routing.ids.data, n, experts + zero, d.routed);
  space.count(w.keys, n, B, w.rows);
  space.sort_by_key(w.keys, n, B, w.sorted_keys, w.order, w.sort);
  space.exclusive_scan(w.rows, w.first, B);
  space.for_each(RL, plan_ops::apply_capacity{w.rows, RL, p.chunks, limit, pad_rows, d.send_valid,
                                              d.send_counts, d.kept});
  space.exclusive_scan(d.send_counts, d.send_offsets, B);
  if (pad_rows > 0) space.fill(p.row_token, RL * pad_rows, std::int32_t{-1});  // padding: -1
  space.for_each(n, plan_ops::place_rows{w.sorted_keys, w.order, w.first, d.send_valid,
                                         d.send_offsets, B, K, p.slot, p.row_token});
}

/// Per-rank dedup on top of build_send_plan: each token gets one unique send row per
/// destination rank among its kept assignments (in token order, in the token's chunk);
/// every assignment row carries its unique row's index and its weight (meta).
template <class Space>
void build_dedup_plan(const Space& space, routing_view routing, dispatch_plan& p,
                      const device_plan& d, const plan_scratch& w) {
  const int R = p.ranks, K = p.top_k, L = p.local_experts, CR = p.chunks * R;
  const index_t T = p.tokens, n = T * K;
  space.for_each(T,
                 plan_ops::unique_keys{p.slot, p.phys, K, L, R, p.chunks, T, w.keys, w.first_of});
  space.count(w.keys, n, CR, d.unique_counts);
  space.exclusive_scan(d.unique_counts, d.unique_offsets, CR);
  space.sort_by_key(w.keys, n, CR, w.sorted_keys, w.order, w.sort);
  space.for_each(
      n, plan_ops::place_unique{w.sorted_keys, w.order, CR, K, p.unique_slot, p.unique_token});
  space.for_each(
      n, plan_ops::link_unique{w.first_of, p.slot, p.phys, routing.weights.data, d.unique_offsets,
                               K, L, R, p.chunks, T, p.unique_slot, p.meta});
}

/// Hierarchical exchange on top of build_dedup_plan: each token gets one node send row per
/// destination node among its kept assignments (in token order, in its chunk), with the mask
/// of that node's ranks it reaches; every assignment knows its node row (node_slot). The
/// same steps as the per-rank dedup, keyed by node (a node is G ranks of L slots).
template <class Space>
void build_node_plan(const Space& space, dispatch_plan& p, const device_plan& d,
                     const plan_scratch& w) {
  const int G = p.ranks_per_node, N = p.nodes(), K = p.top_k, L = p.local_experts;
  const int CN = p.chunks * N;
  const index_t T = p.tokens, n = T * K;
  space.for_each(
      T, plan_ops::unique_keys{p.slot, p.phys, K, L * G, N, p.chunks, T, w.keys, w.first_of});
  space.count(w.keys, n, CN, d.node_counts);
  space.exclusive_scan(d.node_counts, d.node_offsets, CN);
  space.sort_by_key(w.keys, n, CN, w.sorted_keys, w.order, w.sort);
  space.for_each(n,
                 plan_ops::place_unique{w.sorted_keys, w.order, CN, K, p.node_slot, p.node_token});
  space.for_each(T, plan_ops::link_nodes{w.first_of, p.phys, K, L, G, p.node_slot, p.node_mask});
}

/// The plan's counts from its host arrays (after the space's arrays reached the host):
/// assignments (to real experts; to the `zero` zero experts apart), drops and padding rows.
inline void count_send_plan(dispatch_plan& p, int experts, int zero = 0) {
  const int B = p.blocks(), RL = p.ranks * p.local_experts;
  index_t routed = 0, kept = 0, sent = 0, to_zero = 0;
  for (int e = 0; e < experts; ++e) routed += p.routed[e];
  for (int e = experts; e < experts + zero; ++e) to_zero += p.routed[e];
  p.zero_assignments = to_zero;
  for (int s = 0; s < RL; ++s) kept += p.kept[s];
  for (int b = 0; b < B; ++b) sent += p.send_counts[b];
  p.assignments = routed;
  p.dropped = routed - kept;
  p.padding = sent - kept;
}

/// Receive offsets and the per-chunk expert-major regroup, once recv_counts are known (host).
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

/// The plan stage's scratch on the host, grown on demand (tests, the simulator).
struct host_plan_scratch {
  std::vector<std::int32_t> keys, sorted_keys, order, first_of;
  std::vector<index_t> rows, first, sort;

  plan_scratch reserve(index_t assignments, index_t max_keys) {
    const auto n = static_cast<std::size_t>(assignments), k = static_cast<std::size_t>(max_keys);
    for (auto* v : {&keys, &sorted_keys, &order, &first_of})
      if (v->size() < n) v->resize(n);
    for (auto* v : {&rows, &first})
      if (v->size() < k + 1) v->resize(k + 1);
    if (sort.size() < k + 2) sort.resize(k + 2);
    return {keys.data(), sorted_keys.data(), order.data(), first_of.data(),
            rows.data(), first.data(),       sort.data()};
  }
};

}  // namespace epmoe

#include "epmoe/space/host.hpp"

namespace epmoe {

/// The host plan in one call, over arrays the caller owns (tests, the simulator): checks the
/// routing's ids, builds the send side (and with `dedup` the unique rows) and its counts.
/// With `pad`, every slot sends `pad_rows` rows (default: `limit`; the layer pads to the
/// capacity of max_tokens).
template <class Placement>
void build_send_plan(routing_view routing, const Placement& placement, int experts, index_t limit,
                     bool pad, token_origin origin, dispatch_plan& p,
                     host_plan_scratch* scratch = nullptr, bool dedup = false,
                     index_t pad_rows = -1) {
  // Hierarchical (p.ranks_per_node > 0) builds on dedup's unique rows.
  dedup = dedup || p.ranks_per_node > 0;
  const index_t T = routing.tokens();
  for (index_t t = 0; t < T; ++t)
    for (int k = 0; k < p.top_k; ++k) {
      const int e = routing.ids(t, k);
      if (e != no_expert && (e < 0 || e >= experts))
        throw config_error("routing.ids", std::to_string(e),
                           "expert id must be in [0, " + std::to_string(experts) + ")");
    }
  host_plan_scratch local;
  host_plan_scratch& s = scratch ? *scratch : local;
  const plan_scratch w = s.reserve(T * p.top_k, std::max(p.blocks(), p.chunks * p.ranks));
  device_plan d;
  d.kept = p.kept, d.send_counts = p.send_counts, d.send_valid = p.send_valid;
  d.send_offsets = p.send_offsets, d.routed = p.routed;
  d.unique_counts = p.unique_counts, d.unique_offsets = p.unique_offsets;
  d.node_counts = p.node_counts, d.node_offsets = p.node_offsets;
  const space::host host;
  const index_t padded = !pad ? 0 : pad_rows >= 0 ? pad_rows : limit;
  build_send_plan(host, routing, detail::placement_ref<Placement>{&placement}, experts, limit,
                  padded, origin, p, d, w);
  if (dedup) build_dedup_plan(host, routing, p, d, w);
  if (p.ranks_per_node > 0) build_node_plan(host, p, d, w);
  count_send_plan(p, experts);
}

}  // namespace epmoe
