// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/core/clock.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/transport.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/core/workspace.hpp"

// The exchange engine of moe_layer, one for every space and comm: the counts all-to-all, then
// per unit (a chunk, or with a receive bound one round of a chunk) the dispatch all-to-all,
// the regroup to expert-major, the reverse regroup and the combine all-to-all; dedup's
// expansion and weighted sums; and the comm stats. Rows move through transport<Comm, Space>;
// copies and per-row math run as the space's primitives and EPMOE_HD functors, so a device
// runs the host's code. The layer drives it stage by stage (docs/architecture.md).
namespace epmoe {

namespace exchange_ops {

/// The counts message to peer r: per chunk, L padded counts, L real counts and the unique
/// rows (dedup), and hierarchical (G > 0) the node rows to r's node and the unique rows to
/// each of its G ranks (what r relays when it is this rank's peer there); then per chunk the
/// rounds this rank's sends need (bounded: the most any pair needs); then whether this rank
/// accepted its inputs.
struct count_message {
  const index_t* send_counts;
  const index_t* send_valid;
  const index_t* send_offsets;
  const index_t* unique_counts;  // nullptr without dedup
  int R, L, C;
  index_t quota;  // 0: unbounded
  int valid;
  index_t* out;                          // [R][P]
  const index_t* node_counts = nullptr;  // hierarchical: [C*N]
  int G = 0;                             // hierarchical: ranks per node (0: flat)
  EPMOE_HD static int width(int L, int G) { return 2 * L + 1 + (G > 0 ? 1 + G : 0); }
  EPMOE_HD static index_t per_peer(int L, int C, int G) { return C * width(L, G) + C + 1; }
  EPMOE_HD void operator()(index_t r) const {
    const int W = width(L, G);
    index_t* o = out + r * per_peer(L, C, G);
    for (int c = 0; c < C; ++c) {
      for (int j = 0; j < L; ++j) {
        const index_t b = (c * R + r) * L + j;
        o[c * W + j] = send_counts[b];
        o[c * W + L + j] = send_valid[b];
      }
      o[c * W + 2 * L] = unique_counts ? unique_counts[c * R + r] : 0;
      if (G > 0) {
        const int n = static_cast<int>(r) / G;
        o[c * W + 2 * L + 1] = node_counts[c * (R / G) + n];
        for (int g = 0; g < G; ++g) o[c * W + 2 * L + 2 + g] = unique_counts[c * R + n * G + g];
      }
      index_t rounds = 1;
      for (int d = 0; quota > 0 && d < R; ++d) {
        const index_t n = send_offsets[(c * R + d + 1) * L] - send_offsets[(c * R + d) * L];
        rounds = rounds > (n + quota - 1) / quota ? rounds : (n + quota - 1) / quota;
      }
      o[C * W + c] = rounds;
    }
    o[C * W + C] = valid;
  }
};

/// The block b in [b0, b0 + n) whose rows [offsets[b], offsets[b+1]) hold `row`.
EPMOE_HD index_t block_of(const index_t* offsets, index_t b0, index_t n, index_t row) {
  index_t lo = b0, hi = b0 + n;  // the first offset past row, minus one
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (offsets[mid + 1] <= row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Dedup, received assignment row i of chunk c: its unique row's index within the chunk's
/// unique rows (the key of the weighted sums) and its row among the chunk's expert rows.
struct unique_of_row {
  const index_t* recv_offsets;
  const index_t* regroup_offsets;
  const index_t* recv_unique_offsets;
  const index_t* expert_offsets;
  const std::int64_t* meta;  // the chunk's received metadata
  int c, R, L;
  std::int32_t* key;
  index_t* expert_row;
  EPMOE_HD void operator()(index_t i) const {
    const index_t b0 = static_cast<index_t>(c) * R * L, first = recv_offsets[b0];
    const index_t row = first + i, b = block_of(recv_offsets, b0, static_cast<index_t>(R) * L, row);
    const int s = static_cast<int>((b / L) % R);
    key[i] = static_cast<std::int32_t>(recv_unique_offsets[c * R + s] - recv_unique_offsets[c * R] +
                                       meta_index(meta[i]));
    expert_row[i] = regroup_offsets[b] + (row - recv_offsets[b]) - expert_offsets[c * L];
  }
};

/// Dedup: each received assignment row's expert-major row <- its unique row.
template <class T>
struct expand_unique {
  const std::int32_t* key;
  const index_t* expert_row;
  matrix_view<const T> unique;  // the chunk's unique rows
  matrix_view<T> expert;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const T* src = unique.row(key[i]);
    T* dst = expert.row(expert_row[i]);
    for (index_t h = h0; h < h1; ++h) dst[h] = src[h];
  }
};

/// Dedup: unique row u = the weighted sum of its assignments' expert outputs, in the order
/// they were received (the same sum on every space); `unweighted`: the plain sum (backward:
/// the weights were applied to the dy rows).
template <class T>
struct weighted_unique_sum {
  const std::int32_t* order;  // received rows sorted by unique row (stable)
  const index_t* first;       // [U+1]: their first position per unique row
  const index_t* expert_row;
  const std::int64_t* meta;  // the chunk's received metadata
  matrix_view<const T> expert;
  matrix_view<T> unique;
  bool unweighted = false;
  EPMOE_HD void operator()(index_t u, index_t h0, index_t h1) const {
    for (index_t h = h0; h < h1; h += rows::piece) {
      const index_t n = h1 - h < rows::piece ? h1 - h : rows::piece;
      float acc[rows::piece] = {};
      for (index_t p = first[u]; p < first[u + 1]; ++p) {
        const std::int32_t i = order[p];
        const float w = unweighted ? 1.f : meta_weight(meta[i]);
        const T* src = expert.row(expert_row[i]) + h;
        for (index_t j = 0; j < n; ++j) acc[j] += w * to_float(src[j]);
      }
      T* out = unique.row(u) + h;
      for (index_t j = 0; j < n; ++j) out[j] = from_float<T>(acc[j]);
    }
  }
};

/// Hierarchical: relay row i of a chunk reaches the node's ranks in its mask; flag (g, i) of
/// a [G][n] array is whether it reaches local rank g (scanned: its row in the fan buffer).
struct mask_bits {
  const std::int64_t* mask;
  index_t n;
  index_t* flags;
  EPMOE_HD void operator()(index_t j) const {
    const index_t g = j / n, i = j - g * n;
    flags[j] = (mask[i] >> g) & 1;
  }
};

/// Hierarchical: relay row i -> its copy for each rank of the node it reaches (dispatch), or
/// relay row i = the sum of what those ranks sent back, in rank order (combine).
template <class T>
struct fan_rows {
  const std::int64_t* mask;  // [n]
  const index_t* at;         // [G][n]: row of each copy in `fan`
  index_t n;
  int G;
  matrix_view<T> relay;
  matrix_view<T> fan;
  bool reduce = false;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const std::int64_t m = mask[i];
    T* r = relay.row(i);
    if (!reduce) {
      for (int g = 0; g < G; ++g)
        if ((m >> g) & 1) {
          T* d = fan.row(at[g * n + i]);
          for (index_t h = h0; h < h1; ++h) d[h] = r[h];
        }
      return;
    }
    for (index_t h = h0; h < h1; h += rows::piece) {
      const index_t w = h1 - h < rows::piece ? h1 - h : rows::piece;
      float acc[rows::piece] = {};
      for (int g = 0; g < G; ++g)
        if ((m >> g) & 1) {
          const T* src = fan.row(at[g * n + i]) + h;
          for (index_t j = 0; j < w; ++j) acc[j] += to_float(src[j]);
        }
      for (index_t j = 0; j < w; ++j) r[h + j] = from_float<T>(acc[j]);
    }
  }
};

/// Dedup backward at the expert rank, received assignment row i of a unit: its routing
/// weight's gradient g[i] = dy · out (out: the forward's expert output, saved), then dy times
/// the weight (the row the expert's backward takes; one expert row per received row).
template <class T>
struct dedup_weight_grad {
  const index_t* expert_row;  // [n]: row of received row i among the unit's expert rows
  const std::int64_t* meta;   // [n]
  matrix_view<T> expert;      // the unit's expert rows
  matrix_view<const T> saved;
  float* g;  // [n]
  EPMOE_HD void operator()(index_t i) const {
    const index_t e = expert_row[i];
    T* dy = expert.row(e);
    const T* out = saved.row(e);
    float d = 0.f;
    for (index_t h = 0; h < expert.cols; ++h) d += to_float(dy[h]) * to_float(out[h]);
    g[i] = d;
    const float w = meta_weight(meta[i]);
    for (index_t h = 0; h < expert.cols; ++h) dy[h] = from_float<T>(w * to_float(dy[h]));
  }
};

}  // namespace exchange_ops

/// What the exchange reads and writes during a pass (no back-pointers kept between calls).
template <class Space>
struct exchange_context {
  const Space& space;
  dispatch_plan& plan;     // host view
  const device_plan& dev;  // the plan's arrays in the space's memory
  const typename Space::template mirror<index_t>& recv_blocks;  // the plan's receive arrays
  pass_clock<Space>& clock;                                     // marks of this pass
  pass_stats& stats;
};

template <class Comm, class Space, bool Dedup>
class exchange {
 public:
  using value_type = typename Space::value_type;
  using transport_type = transport<Comm, Space>;
  using context = exchange_context<Space>;
  template <class T>
  using buffer = typename Space::template buffer<T>;
  template <class T>
  using mirror = typename Space::template mirror<T>;
  using mark = typename pass_clock<Space>::mark;

  static constexpr bool async = transport_type::async;

  exchange() = default;
  exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : tr_(comm, space), w_(w), me_(comm.rank()) {
    const index_t R = w.ranks, L = w.local_experts, C = w.chunks, H = w.row_stride;
    bounded_ = w.quota > 0 && !w.token_rounds;
    windows_ = w.token_rounds;
    slots_ = w.quota > 0 ? w.units_in_flight : static_cast<int>(C);
    slot_rows_ = R * w.per_source;
    const index_t recv_rows = w.recv_buffer_rows;
    x_send_ = space.template allocate<value_type>(w.send_rows * H);
    x_recv_ = space.template allocate<value_type>(recv_rows * H);
    x_expert_ = space.template allocate<value_type>(w.expert_rows * H);
    G_ = w.ranks_per_node;
    hier_ = G_ > 0;
    // The comm's own nodes are the layer's: each level may run on its communicator.
    if constexpr (requires { comm.ranks_per_node(); })
      levels_ = hier_ && comm.ranks_per_node() == G_;
    N_ = hier_ ? static_cast<int>(R / G_) : 1;
    const index_t P =
        exchange_ops::count_message::per_peer(static_cast<int>(L), static_cast<int>(C), G_);
    msg_send_ = space.template allocate<index_t>(R * P);
    msg_recv_ = space.template allocate_mirror<index_t>(R * P);
    const index_t S = slots_, A = hier_ ? 20 : 8;  // arrays of rank_counts in use
    const index_t CN = C * N_, CG = C * G_;
    host_ = std::vector<index_t>(static_cast<std::size_t>(A * R * S + C + 1 + CN + 1 + CG + C + 1));
    index_t* x = host_.data();
    counts_.resize(static_cast<std::size_t>(S));
    for (auto& k : counts_) {
      index_t** arrays[] = {&k.send_n,      &k.send_d,      &k.recv_n,      &k.recv_d,
                            &k.meta_send_n, &k.meta_send_d, &k.meta_recv_n, &k.meta_recv_d,
                            &k.a_send_n,    &k.a_send_d,    &k.a_recv_n,    &k.a_recv_d,
                            &k.m_send_n,    &k.m_send_d,    &k.m_recv_n,    &k.m_recv_d,
                            &k.b_send_n,    &k.b_send_d,    &k.b_recv_n,    &k.b_recv_d};
      for (index_t i = 0; i < A; ++i, x += R) *arrays[i] = x;
    }
    first_unit_ = x;
    x += C + 1;
    relay_offsets_ = x;             // [C*N+1]: relay rows per (chunk, source node), in that order
    fan_counts_ = x + CN + 1;       // [C*G]: fan rows per (chunk, local rank)
    fan_first_ = fan_counts_ + CG;  // [C+1]: each chunk's first fan row
    if (hier_) {
      x_relay_ = space.template allocate<value_type>(w.relay_rows * H);
      x_fan_ = space.template allocate<value_type>(w.fan_rows * H);
      mask_relay_ = space.template allocate<std::int64_t>(w.relay_rows);
      fan_at_ = space.template allocate<index_t>(2 * (G_ * w.relay_rows + slots_));
    }
    units_.assign(static_cast<std::size_t>(S), unit_state{});
    if (bounded_) {
      const index_t per = 3 * R * L + L + 1;
      unit_arrays_ = space.template allocate_mirror<index_t>(S * per);
      for (index_t k = 0; k < S; ++k) {
        units_[k].host = unit_arrays_.host() + k * per;
        units_[k].dev = unit_arrays_.device() + k * per;
      }
    }
    dispatch_req_.resize(static_cast<std::size_t>(S));
    meta_req_.resize(static_cast<std::size_t>(S));
    mask_req_.resize(static_cast<std::size_t>(S));
    combine_req_.resize(static_cast<std::size_t>(S));
    gback_req_.resize(static_cast<std::size_t>(S));
    marks_.resize(static_cast<std::size_t>(4 * S));
    if constexpr (Dedup) {
      const index_t n = w.recv_assign_rows;
      meta_recv_ = space.template allocate<std::int64_t>(n);
      sum_key_ = space.template allocate<std::int32_t>(3 * n);
      sum_first_ = space.template allocate<index_t>(2 * (n + 1) + n);
      sum_sort_ = space.template allocate<char>(Space::sort_scratch_bytes(n, n));
      g_recv_ = space.template allocate<float>(n);
      g_send_ = space.template allocate<float>(w.send_rows);
    }
  }

  /// Rows of the receive buffer (bounded: units in flight x ranks x per-pair quota rows).
  index_t receive_buffer_rows() const { return w_.recv_buffer_rows; }
  /// Units of the pass: its chunks, or with a bound every round of every chunk.
  int units(const dispatch_plan& p) const {
    return bounded_ ? static_cast<int>(first_unit_[p.chunks]) : p.chunks;
  }
  int chunk_of_unit(const dispatch_plan& p, int u) const {
    if (windows_) return u / p.rounds;
    if (!bounded_) return u;
    return static_cast<int>(std::upper_bound(first_unit_, first_unit_ + p.chunks + 1, u) -
                            first_unit_) -
           1;
  }
  int round_of_unit(const dispatch_plan& p, int u) const {
    if (windows_) return u % p.rounds;
    return bounded_ ? u - static_cast<int>(first_unit_[chunk_of_unit(p, u)]) : 0;
  }

  value_type* send_buffer() const { return x_send_.data(); }

  /// Backward passes (moe_layer::backward) run the same exchanges; with dedup the combine then
  /// sums each unique row's dX rows unweighted (the weights went onto the dy rows) and carries
  /// each assignment's routing-weight gradient home: the metadata exchange in reverse, from
  /// weight_grad_recv() [received rows] into weight_grad_send() [send rows, as plan.meta].
  void set_backward(bool b) { backward_ = b; }
  float* weight_grad_recv() const { return g_recv_.data(); }
  float* weight_grad_send() const { return g_send_.data(); }
  /// Dedup: the received assignment rows of chunk c (not row-bounded): the first's index in
  /// the receive-side arrays (weight_grad_recv()), their count, and per row its row among
  /// the unit's expert rows and its metadata.
  struct received_rows {
    index_t first, n;
    const index_t* expert_row;
    const std::int64_t* meta;
  };
  received_rows received(const dispatch_plan& p, int c) const {
    const index_t first = p.recv_offsets[p.block(c, 0, 0)], at = first + shift_of(p, c).assign;
    return {at, p.recv_offsets[p.block(c + 1, 0, 0)] - first,
            sum_first_.data() + 2 * (w_.recv_assign_rows + 1) + at, meta_recv_.data() + at};
  }
  std::int64_t* meta_recv() const { return meta_recv_.data(); }

  /// The counts all-to-all: every rank learns the rows it will receive per (chunk, source,
  /// local slot), whether every rank accepted its inputs (`valid`), and with a bound the rounds
  /// each chunk takes. Returns the first rank that rejected its inputs, or -1; then no row
  /// moved and the caller throws. The space's synchronize() here also brings the plan's host
  /// arrays (copied before the call).
  /// Static shapes (`static_rows` > 0: padded capacity, one chunk): every block holds
  /// static_rows rows, so the layout needs no counts. On a device nothing then waits (the
  /// pass can be captured in a graph): the counts arrive for stats and for the verdict on
  /// the inputs, which resolve() reads after the pass; the reduce writes nothing when a rank
  /// rejected its inputs. On the host the counts are read at once and must agree.
  int counts(context& x, bool valid, index_t static_rows = 0) {
    dispatch_plan& p = x.plan;
    const int R = w_.ranks, L = p.local_experts, C = p.chunks;
    const index_t P = exchange_ops::count_message::per_peer(L, C, G_);
    // A pass that threw mid-way (a failed exchange) may have left slots or requests in use.
    expert_owner_ = -1;
    for (unit_state& us : units_) us.busy = false;
    for (auto* reqs : {&dispatch_req_, &meta_req_, &combine_req_, &gback_req_, &mask_req_})
      for (auto& r : *reqs) r.reset();
    const mark t0 = x.clock.now();
    x.space.for_each(R, exchange_ops::count_message{
                            x.dev.send_counts, x.dev.send_valid, x.dev.send_offsets,
                            Dedup ? x.dev.unique_counts : nullptr, R, L, C, bounded_ ? w_.quota : 0,
                            valid ? 1 : 0, msg_send_.data(), x.dev.node_counts, G_});
    tr_.alltoall(msg_send_.data(), msg_recv_.device(), P);
    x.space.to_host(msg_recv_, 0, R * P);
    static_rows_ = static_rows;
    deferred_ = static_rows > 0 && device_space<Space>;
    if (deferred_) {
      static_layout(x);
      x.clock.exchange(t0, x.clock.now(), t0, t0, 0);
      return -1;
    }
    synchronize(x.space);
    const mark t1 = x.clock.now();
    x.clock.exchange(t0, t1, t1, t1, 0);
    return read_message(x);
  }

  /// Static shapes on a device: after the pass, the counts that arrived (stats) and the
  /// first rank that rejected its inputs, or -1. Call after the space's synchronize().
  int resolve(context& x) {
    if (!deferred_) return -1;
    deferred_ = false;
    return read_message(x);
  }
  /// Where the reduce finds every rank's verdict on its inputs (static shapes on a device:
  /// nothing is written when one rank rejected), else nullptr.
  const index_t* verdicts(const dispatch_plan& p) const {
    return deferred_ ? msg_recv_.device() + verdict_at(p) : nullptr;
  }
  /// Elements between two ranks' verdicts.
  index_t verdict_stride(const dispatch_plan& p) const {
    return exchange_ops::count_message::per_peer(p.local_experts, p.chunks, G_);
  }

  void start_dispatch(context& x, int u) {
    const int k = slot_of(u);
    marks_[4 * k] = x.clock.now();
    if (bounded_) {
      layout_unit(x, u);
    } else if (windows_) {
      claim_slot(k);
      set_rank_counts(x.plan, u);
    }
    rank_counts& n = counts_[k];
    if (hier_) {  // first level: node rows and their masks to the peers
      start_at(exchange_level::cross, dispatch_req_[k], x_send_.data(), n.a_send_n, n.a_send_d,
               x_relay_.data(), n.a_recv_n, n.a_recv_d);
      start_at(exchange_level::cross, mask_req_[k], x.plan.node_mask, n.m_send_n, n.m_send_d,
               mask_relay_.data(), n.m_recv_n, n.m_recv_d);
    } else {
      tr_.start(dispatch_req_[k], x_send_.data(), n.send_n, n.send_d, x_recv_.data(), n.recv_n,
                n.recv_d);
    }
    if constexpr (Dedup)
      tr_.start(meta_req_[k], x.plan.meta, n.meta_send_n, n.meta_send_d, meta_recv_.data(),
                n.meta_recv_n, n.meta_recv_d);
    marks_[4 * k + 1] = x.clock.now();
  }

  void wait_dispatch(context& x, int u) {
    const int k = slot_of(u);
    const mark w0 = x.clock.now();
    double modeled = tr_.wait(dispatch_req_[k]);
    const dispatch_plan& p = x.plan;
    const int B = w_.ranks * p.local_experts;
    index_t rows = 0;
    if (bounded_) {
      const mark w1 = x.clock.now();
      x.clock.exchange(marks_[4 * k], marks_[4 * k + 1], w0, w1, modeled);
      unit_state& us = units_[k];
      take_expert_buffer(u);
      x.space.copy_blocks(slot_view(k), expert_view(), B, us.dev + recv_at(), us.dev + regroup_at(),
                          us.dev);
      rows = us.host[expert_at() + p.local_experts];
    } else {
      if (windows_) take_expert_buffer(u);
      if constexpr (Dedup) modeled += tr_.wait(meta_req_[k]);
      if (hier_) modeled += fan_out(x, u);
      const mark w1 = x.clock.now();
      x.clock.exchange(marks_[4 * k], marks_[4 * k + 1], w0, w1, modeled);
      if constexpr (Dedup) {
        expand_unique_rows(x, u);
      } else {
        // Other ranks' rows from the receive buffer; this rank's own from its send buffer,
        // where they never left (the exchange skips them: set_rank_counts).
        const int b = u * B, m = b + me_ * p.local_experts, L = p.local_experts;
        copy_blocks(x, recv_view(p), expert_view(), b, m, x.dev.recv_offsets,
                    x.dev.regroup_offsets);
        copy_blocks(x, send_view(p), expert_view(), m, m + L, x.dev.send_offsets,
                    x.dev.regroup_offsets);
        copy_blocks(x, recv_view(p), expert_view(), m + L, b + B, x.dev.recv_offsets,
                    x.dev.regroup_offsets);
      }
      rows = p.expert_offsets[(u + 1) * p.local_experts] - p.expert_offsets[u * p.local_experts];
    }
    x.clock.event(chunk_of_unit(p, u), stage_kind::dispatch, round_of_unit(p, u), rows,
                  unit_bytes(k), marks_[4 * k], x.clock.now());
  }

  /// The rows every local expert computes in unit u: groups of the expert buffer.
  grouped_rows<value_type> expert_rows(const context& x, int u) const {
    const dispatch_plan& p = x.plan;
    const int L = p.local_experts;
    if (bounded_) {
      const unit_state& us = units_[slot_of(u)];
      return {x_expert_.data(),     w_.hidden, w_.row_stride, L, us.host + expert_at(),
              us.dev + expert_at(), w_.align};
    }
    return {x_expert_.data() + expert_first(p, u) * w_.row_stride,
            w_.hidden,
            w_.row_stride,
            L,
            p.expert_offsets + u * L,
            x.dev.expert_offsets + u * L,
            w_.align};
  }

  void start_combine(context& x, int u) {
    const int k = slot_of(u);
    marks_[4 * k + 2] = x.clock.now();
    const dispatch_plan& p = x.plan;
    const int R = w_.ranks, L = p.local_experts;
    if (bounded_) {
      const unit_state& us = units_[k];
      x.space.copy_blocks(const_view(expert_view()), slot_view(k), R * L, us.dev + regroup_at(),
                          us.dev + recv_at(), us.dev);
      expert_owner_ = -1;
    } else if constexpr (Dedup) {
      weighted_unique_sums(x, u);
      expert_owner_ = -1;
    } else {
      // Back the same way: this rank's own rows straight into its send buffer.
      const int b = u * R * L, m = b + me_ * L;
      const auto from = const_view(expert_view());
      copy_blocks(x, from, recv_view(p), b, m, x.dev.regroup_offsets, x.dev.recv_offsets);
      copy_blocks(x, from, send_view(p), m, m + L, x.dev.regroup_offsets, x.dev.send_offsets);
      copy_blocks(x, from, recv_view(p), m + L, b + R * L, x.dev.regroup_offsets,
                  x.dev.recv_offsets);
    }
    // The reverse exchange: what came from rank s goes back to rank s, into the send rows
    // (hierarchical: to the relay, which sums them in wait_combine and sends them home).
    rank_counts& n = counts_[k];
    if (hier_)
      start_at(exchange_level::node, combine_req_[k], x_recv_.data(), n.b_recv_n, n.b_recv_d,
               x_fan_.data(), n.b_send_n, n.b_send_d);
    else
      tr_.start(combine_req_[k], x_recv_.data(), n.recv_n, n.recv_d, x_send_.data(), n.send_n,
                n.send_d);
    if (Dedup && backward_)
      tr_.start(gback_req_[k], g_recv_.data(), n.meta_recv_n, n.meta_recv_d, g_send_.data(),
                n.meta_send_n, n.meta_send_d);
    marks_[4 * k + 3] = x.clock.now();
  }

  void wait_combine(context& x, int u) {
    const int k = slot_of(u);
    const mark w0 = x.clock.now();
    double modeled = tr_.wait(combine_req_[k]);
    if (hier_) modeled += fan_in(x, u);
    if (Dedup && backward_) modeled += tr_.wait(gback_req_[k]);
    const mark w1 = x.clock.now();
    x.clock.exchange(marks_[4 * k + 2], marks_[4 * k + 3], w0, w1, modeled);
    units_[k].busy = false;
    index_t rows = 0;
    const rank_counts& n = counts_[k];
    for (int r = 0; r < w_.ranks; ++r)
      rows += (hier_ ? n.b_recv_n[r] : n.recv_n[r]) / w_.row_stride;
    if (!bounded_ && !Dedup) rows += x.plan.recv_rows_from(chunk_of_unit(x.plan, u), me_);
    x.clock.event(chunk_of_unit(x.plan, u), stage_kind::combine, round_of_unit(x.plan, u), rows,
                  unit_bytes(k), marks_[4 * k + 2], w1);
  }

  /// The host waits for the space's work: through the transport where it watches its comm
  /// (NCCL: asynchronous errors and the deadline), else the space's synchronize().
  void synchronize(const Space& s) const {
    if constexpr (requires { tr_.synchronize(s); })
      tr_.synchronize(s);
    else
      s.synchronize();
  }

  /// Lets the comm progress pending exchanges (MPI moves data inside its calls).
  void progress() {
    for (auto* reqs : {&dispatch_req_, &meta_req_, &combine_req_, &gback_req_, &mask_req_})
      for (auto& r : *reqs) tr_.progress(r);
  }

 private:
  struct rank_counts {  // per-rank counts/displacements (elements) of one unit's exchanges
    index_t *send_n, *send_d, *recv_n, *recv_d;
    index_t *meta_send_n, *meta_send_d, *meta_recv_n, *meta_recv_d;
    // Hierarchical: node rows to the peers (a) with their masks (m), fan rows in the node (b).
    index_t *a_send_n{}, *a_send_d{}, *a_recv_n{}, *a_recv_d{};
    index_t *m_send_n{}, *m_send_d{}, *m_recv_n{}, *m_recv_d{};
    index_t *b_send_n{}, *b_send_d{}, *b_recv_n{}, *b_recv_d{};
  };
  // A bounded unit's receive layout, host and space copies of one array: per block (source
  // s, local slot j) = s * L + j, its rows this round ([0, RL)), where they sit in the
  // receive buffer ([RL, 2RL)) and in the expert buffer ([2RL, 3RL)); then per local slot its
  // first row in the expert buffer ([3RL, 3RL + L + 1)).
  struct unit_state {
    index_t* host = nullptr;
    index_t* dev = nullptr;
    bool busy = false;
  };
  index_t recv_at() const { return index_t{w_.ranks} * w_.local_experts; }
  index_t regroup_at() const { return 2 * recv_at(); }
  index_t expert_at() const { return 3 * recv_at(); }

  int slot_of(int u) const { return bounded_ || windows_ ? u % slots_ : u; }

  // A bounded unit's receive slot; a schedule that keeps more units in flight than it
  // declared would overwrite one still in use.
  void claim_slot(int k) {
    unit_state& us = units_[k];
    if (us.busy)
      throw std::logic_error("epmoe: the schedule keeps more than " + std::to_string(slots_) +
                             " exchange rounds in flight; a receive bound (max_recv_rows) "
                             "sizes that many receive slots");
    us.busy = true;
  }
  // Bounded: the expert buffer holds one unit's rows at a time.
  void take_expert_buffer(int u) {
    if (expert_owner_ >= 0)
      throw std::logic_error(
          "epmoe: the schedule waited two dispatches before the first one's combine_start; a "
          "receive bound (max_recv_rows) keeps one round in the expert buffer at a time");
    expert_owner_ = u;
  }

  // Where unit c's receive-side rows sit: the plan's pass-wide offsets plus these shifts.
  // Without a bound every shift is 0; with token rounds unit c takes slot c % S of every
  // receive-side buffer (unique rows, assignment arrays, relay and fan rows).
  struct shifts {
    index_t unique = 0, assign = 0, relay = 0, fan = 0;
  };
  shifts shift_of(const dispatch_plan& p, int c) const {
    if (!windows_) return {};
    const index_t k = slot_of(c);
    const int R = w_.ranks;
    shifts s;
    s.unique = k * R * w_.per_source - p.recv_unique_offsets[c * R];
    s.assign = k * w_.slot_assign - p.recv_offsets[p.block(c, 0, 0)];
    if (hier_) {
      s.relay = k * w_.slot_relay - relay_offsets_[c * N_];
      s.fan = k * w_.slot_fan - fan_first_[c];
    }
    return s;
  }
  // Unit c's first row in the expert buffer (token rounds: one unit at a time, from row 0).
  index_t expert_first(const dispatch_plan& p, int c) const {
    return windows_ ? 0 : p.expert_offsets[c * p.local_experts];
  }
  matrix_view<value_type> unit_expert_view(const dispatch_plan& p, int c) const {
    const int L = p.local_experts;
    return {x_expert_.data() + expert_first(p, c) * w_.row_stride,
            p.expert_offsets[(c + 1) * L] - p.expert_offsets[c * L], w_.hidden, w_.row_stride};
  }

  [[noreturn]] void overflow(index_t rows) const {
    throw comm_error("epmoe: rank " + std::to_string(me_) + " would receive " +
                     std::to_string(rows) + " rows, more than its workspace (" +
                     std::to_string(w_.recv_buffer_rows) +
                     "); a peer passed more tokens than max_tokens?");
  }

  // Hierarchical, chunk c after its first level arrived: each relay row's copies to the
  // node's ranks (rows in the fan buffer from a scan of the masks), the second level, and
  // its wait. Returns the link model's time.
  double fan_out(context& x, int c) {
    const int k = slot_of(c);
    rank_counts& n = counts_[k];
    double modeled = tr_.wait(mask_req_[k]);
    const fan_view f = fan_of(x.plan, c);
    x.space.for_each(G_ * f.n, exchange_ops::mask_bits{f.mask, f.n, f.flags});
    x.space.exclusive_scan(f.flags, f.at, G_ * f.n);
    x.space.for_each_row(f.n, w_.hidden,
                         exchange_ops::fan_rows<value_type>{f.mask, f.at, f.n, G_, f.relay, f.fan});
    start_at(exchange_level::node, dispatch_req_[k], x_fan_.data(), n.b_send_n, n.b_send_d,
             x_recv_.data(), n.b_recv_n, n.b_recv_d);
    return modeled + tr_.wait(dispatch_req_[k]);
  }

  // Hierarchical, chunk c after the node's ranks sent their sums back: each relay row = the
  // sum of its copies, then the first level in reverse, home.
  double fan_in(context& x, int c) {
    rank_counts& n = counts_[slot_of(c)];
    const fan_view f = fan_of(x.plan, c);
    x.space.for_each_row(
        f.n, w_.hidden,
        exchange_ops::fan_rows<value_type>{f.mask, f.at, f.n, G_, f.relay, f.fan, true});
    std::optional<typename transport_type::request> back;
    start_at(exchange_level::cross, back, x_relay_.data(), n.a_recv_n, n.a_recv_d, x_send_.data(),
             n.a_send_n, n.a_send_d);
    return tr_.wait(back);
  }

  // An exchange of one level: on the comm's communicator of it when the comm's nodes are the
  // layer's, else over every rank (zero counts outside the level).
  template <class T>
  void start_at(exchange_level level, std::optional<typename transport_type::request>& req,
                const T* send, const index_t* sn, const index_t* sd, T* recv, const index_t* rn,
                const index_t* rd) {
    if constexpr (requires { tr_.start(req, send, sn, sd, recv, rn, rd, level); })
      if (levels_) return tr_.start(req, send, sn, sd, recv, rn, rd, level);
    tr_.start(req, send, sn, sd, recv, rn, rd);
  }

  struct fan_view {
    index_t n;                 // the chunk's relay rows
    const std::int64_t* mask;  // their masks
    index_t* flags;            // [G][n]
    index_t* at;               // [G][n] (+1): each copy's row in `fan`
    matrix_view<value_type> relay, fan;
  };
  fan_view fan_of(const dispatch_plan& p, int c) const {
    const shifts sh = shift_of(p, c);
    const index_t n = relay_offsets_[(c + 1) * N_] - relay_offsets_[c * N_];
    const index_t r0 = relay_offsets_[c * N_] + sh.relay;
    const index_t H = w_.row_stride, half = G_ * w_.relay_rows + slots_;
    // [G][n] flags then their scan (+1) per unit: after the earlier units', or in its slot.
    index_t* flags = fan_at_.data() + (windows_ ? slot_of(c) * (G_ * w_.slot_relay + 1)
                                                : G_ * relay_offsets_[c * N_] + c);
    const index_t f0 = fan_first_[c] + sh.fan;
    return {n,
            mask_relay_.data() + r0,
            flags,
            flags + half,
            {x_relay_.data() + r0 * H, n, w_.hidden, H},
            {x_fan_.data() + f0 * H, fan_first_[c + 1] - fan_first_[c], w_.hidden, H}};
  }

  // Bytes of rows that crossed to or from other ranks in unit k's exchanges (both levels).
  index_t unit_bytes(int k) const {
    const rank_counts& n = counts_[k];
    return hier_ ? crossing_bytes(n.a_recv_n) + crossing_bytes(n.b_recv_n)
                 : crossing_bytes(n.recv_n);
  }

  // Bytes of the rows (H elements each; the alignment padding is not counted) that crossed
  // to or from other ranks.
  index_t crossing_bytes(const index_t* n) const {
    index_t e = 0;
    for (int r = 0; r < w_.ranks; ++r)
      if (r != me_) e += n[r];
    return e / w_.row_stride * w_.hidden * static_cast<index_t>(sizeof(value_type));
  }

  index_t verdict_at(const dispatch_plan& p) const {
    return p.chunks * exchange_ops::count_message::width(p.local_experts, G_) + p.chunks;
  }

  // The counts message that arrived: the verdicts, then the receive plan (static shapes: it
  // must equal the fixed one).
  int read_message(context& x) {
    const dispatch_plan& p = x.plan;
    const index_t* in = msg_recv_.host();
    const index_t P = verdict_stride(p);
    for (int s = 0; s < w_.ranks; ++s)
      if (in[s * P + verdict_at(p)] == 0) return s;
    read_counts(x, in);
    if (static_rows_ > 0)
      for (int b = 0; b < p.blocks(); ++b)
        if (p.recv_counts[b] != static_rows_)
          throw comm_error("epmoe: rank " + std::to_string(me_) + " expected " +
                           std::to_string(static_rows_) +
                           " rows per block (padded capacity) "
                           "and got " +
                           std::to_string(p.recv_counts[b]) +
                           ": every rank must use the same config and capacity");
    return -1;
  }

  // Static shapes: every block (one chunk) holds static_rows_ rows on both sides.
  void static_layout(context& x) {
    dispatch_plan& p = x.plan;
    const int B = p.blocks();
    p.send_offsets[0] = 0;
    for (int b = 0; b < B; ++b) {
      p.recv_counts[b] = p.send_counts[b] = static_rows_;
      p.send_offsets[b + 1] = p.send_offsets[b] + static_rows_;
    }
    build_recv_plan(p);
    set_rank_counts(p, 0);
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
  }

  // The received counts: the receive plan, the rounds, the exchanges' counts and the stats.
  void read_counts(context& x, const index_t* in) {
    dispatch_plan& p = x.plan;
    const int R = w_.ranks, L = p.local_experts, C = p.chunks;
    const int W = exchange_ops::count_message::width(L, G_);
    const index_t P = exchange_ops::count_message::per_peer(L, C, G_);
    if (hier_) std::fill(fan_counts_, fan_counts_ + C * G_, 0);
    for (int s = 0; s < R; ++s)
      for (int c = 0; c < C; ++c) {
        const index_t* m = in + s * P + c * W;
        for (int j = 0; j < L; ++j) {
          p.recv_counts[p.block(c, s, j)] = m[j];
          p.recv_valid[p.block(c, s, j)] = m[L + j];
        }
        if constexpr (Dedup) p.recv_unique_counts[c * R + s] = m[2 * L];
        if (hier_ && s % G_ == me_ % G_) {  // a peer whose rows for this node this rank relays
          relay_offsets_[c * N_ + s / G_ + 1] = m[2 * L + 1];
          for (int g = 0; g < G_; ++g) fan_counts_[c * G_ + g] += m[2 * L + 2 + g];
        }
      }
    build_recv_plan(p);
    if constexpr (Dedup) {
      // Hierarchical: rank e receives from each rank f of its node (local index g) the rows
      // of the sources f relays (local index g, node 0..N-1), so a chunk's unique rows are
      // ordered by the sources' (local index, node): each relay's rows are contiguous.
      const int G = hier_ ? G_ : R, N = hier_ ? N_ : 1;
      index_t at = 0;
      for (int c = 0; c < C; ++c)
        for (int g = 0; g < G; ++g)
          for (int n = 0; n < N; ++n) {
            const int b = c * R + n * G + g;
            p.recv_unique_offsets[b] = at;
            at += p.recv_unique_counts[b];
          }
      p.recv_unique_offsets[C * R] = at;
    }
    if (hier_) {
      relay_offsets_[0] = 0;
      for (int i = 0; i < C * N_; ++i) relay_offsets_[i + 1] += relay_offsets_[i];
      fan_first_[0] = 0;
      for (int c = 0; c < C; ++c) {
        fan_first_[c + 1] = fan_first_[c];
        for (int g = 0; g < G_; ++g) fan_first_[c + 1] += fan_counts_[c * G_ + g];
      }
      if (!windows_ && (relay_offsets_[C * N_] > w_.relay_rows || fan_first_[C] > w_.fan_rows))
        overflow(relay_offsets_[C * N_]);
    }
    if (bounded_) {
      first_unit_[0] = 0;
      index_t most = 1;
      for (int c = 0; c < C; ++c) {
        index_t rounds = 1;
        for (int s = 0; s < R; ++s) {
          rounds = std::max(rounds, in[s * P + C * W + c]);
          // A round from one source must fit its share of a slot.
          if (std::min(w_.quota, p.recv_rows_from(c, s)) > w_.per_source) overflow(p.recv_rows());
        }
        first_unit_[c + 1] = first_unit_[c] + rounds;
        most = std::max(most, rounds);
      }
      x.stats.rounds = static_cast<int>(most);
      x.stats.peak_recv_rows = 0;
    } else if (windows_) {
      // Every unit's rows must fit its slot (a peer that passed more tokens would not).
      index_t most = 0;
      for (int c = 0; c < C; ++c) {
        const index_t U = p.recv_unique_offsets[(c + 1) * R] - p.recv_unique_offsets[c * R];
        const index_t n = p.recv_offsets[p.block(c + 1, 0, 0)] - p.recv_offsets[p.block(c, 0, 0)];
        const bool relay_fits =
            !hier_ || (relay_offsets_[(c + 1) * N_] - relay_offsets_[c * N_] <= w_.slot_relay &&
                       fan_first_[c + 1] - fan_first_[c] <= w_.slot_fan);
        if (U > R * w_.per_source || n > w_.slot_assign || !relay_fits) overflow(U);
        most = std::max(most, U);
      }
      x.stats.rounds = p.rounds;
      x.stats.peak_recv_rows = most;
    } else {
      if (p.recv_rows() > w_.recv_buffer_rows) overflow(p.recv_rows());
      for (int c = 0; c < C; ++c) set_rank_counts(p, c);
      x.stats.rounds = 1;
      x.stats.peak_recv_rows = Dedup ? p.recv_unique_offsets[C * R] : p.recv_rows();
    }
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
    fill_comm_stats(x);
  }

  // Bounded: unit u is round i of chunk c; pair (s, d) moves rows [i*q, min(n, (i+1)*q)) of
  // the source's contiguous rows of chunk c to d, which span d's local slots in order, so
  // both sides compute the same split from the counts alone.
  void layout_unit(context& x, int u) {
    const dispatch_plan& p = x.plan;
    const int R = w_.ranks, L = p.local_experts, k = slot_of(u);
    const int c = chunk_of_unit(p, u), i = round_of_unit(p, u);
    const index_t H = w_.row_stride, lo = i * w_.quota, hi = lo + w_.quota;
    claim_slot(k);
    unit_state& us = units_[k];
    rank_counts& n = counts_[k];
    index_t* count = us.host;
    index_t* recv = us.host + recv_at();
    index_t* regroup = us.host + regroup_at();
    index_t* expert = us.host + expert_at();
    const index_t base = k * slot_rows_;
    index_t at = base;
    for (int r = 0; r < R; ++r) {
      const index_t ns = p.send_rows_to(c, r);
      const index_t sa = std::min(ns, lo), sb = std::min(ns, hi);
      n.send_n[r] = (sb - sa) * H;
      n.send_d[r] = (p.send_offsets[p.block(c, r, 0)] + sa) * H;
      const index_t nr = p.recv_rows_from(c, r);
      const index_t ra = std::min(nr, lo), rb = std::min(nr, hi);
      n.recv_n[r] = (rb - ra) * H;
      n.recv_d[r] = at * H;
      const index_t first = p.recv_offsets[p.block(c, r, 0)];
      for (int j = 0; j < L; ++j) {
        const int b = p.block(c, r, j);
        const index_t b0 = p.recv_offsets[b] - first, b1 = b0 + p.recv_counts[b];
        const index_t x0 = std::max(b0, ra), x1 = std::min(b1, rb);
        count[r * L + j] = std::max<index_t>(0, x1 - x0);
        recv[r * L + j] = at + std::max<index_t>(0, x0 - ra);
      }
      at += rb - ra;
    }
    x.stats.peak_recv_rows = std::max(x.stats.peak_recv_rows, at - base);
    index_t row = 0;
    for (int j = 0; j < L; ++j) {
      expert[j] = row;
      for (int r = 0; r < R; ++r) {
        regroup[r * L + j] = row;
        row += count[r * L + j];
      }
    }
    expert[L] = row;
    x.space.to_device(unit_arrays_, us.host - unit_arrays_.host(), expert_at() + L + 1);
  }

  // Per-rank element counts and displacements of chunk c's exchanges (unbounded): rows (per
  // assignment, or unique with dedup) and, with dedup, the per-assignment metadata.
  void set_rank_counts(const dispatch_plan& p, int c) {
    const int R = w_.ranks;
    const index_t H = w_.row_stride;  // elements per row moved (the padding rides along)
    const shifts sh = shift_of(p, c);
    rank_counts& n = counts_[slot_of(c)];
    for (int r = 0; r < R; ++r) {
      const int b = p.block(c, r, 0);
      const index_t rows_to = Dedup ? p.unique_counts[c * R + r] : p.send_rows_to(c, r);
      const index_t rows_at = Dedup ? p.unique_offsets[c * R + r] : p.send_offsets[b];
      const index_t rows_from = Dedup ? p.recv_unique_counts[c * R + r] : p.recv_rows_from(c, r);
      const index_t rows_in =
          Dedup ? p.recv_unique_offsets[c * R + r] + sh.unique : p.recv_offsets[b];
      n.send_n[r] = rows_to * H;
      n.send_d[r] = rows_at * H;
      n.recv_n[r] = rows_from * H;
      n.recv_d[r] = rows_in * H;
      n.meta_send_n[r] = p.send_rows_to(c, r);
      n.meta_send_d[r] = p.send_offsets[b];
      n.meta_recv_n[r] = p.recv_rows_from(c, r);
      n.meta_recv_d[r] = p.recv_offsets[b] + sh.assign;
    }
    // Rows to itself skip the exchange (issue 22: one copy less each way; wait_dispatch and
    // start_combine move them between the send and expert buffers). Dedup's unique rows
    // still go through the receive buffer, where its expansion reads them.
    if constexpr (!Dedup) n.send_n[me_] = n.recv_n[me_] = 0;
    if (hier_) hier_rank_counts(p, c, sh);
  }

  // Hierarchical, chunk c: the rows go in two exchanges instead of one (the metadata still
  // goes straight to the expert ranks). (a) node rows to this rank's peer on each node (same
  // local index), from the peers into the relay buffer; (m) their masks alike; (b) the relay
  // rows' copies to the node's ranks, from the node's ranks into the receive buffer.
  void hier_rank_counts(const dispatch_plan& p, int c, const shifts& sh) {
    const int R = w_.ranks, G = G_, N = N_, mine = me_ / G, local = me_ % G;
    const index_t H = w_.row_stride;
    rank_counts& n = counts_[slot_of(c)];
    for (int r = 0; r < R; ++r) {
      n.send_n[r] = n.recv_n[r] = n.send_d[r] = n.recv_d[r] = 0;
      n.a_send_n[r] = n.a_send_d[r] = n.a_recv_n[r] = n.a_recv_d[r] = 0;
      n.b_send_n[r] = n.b_send_d[r] = n.b_recv_n[r] = n.b_recv_d[r] = 0;
    }
    for (int m = 0; m < N; ++m) {  // the peer on node m
      const int r = m * G + local;
      n.a_send_n[r] = p.node_counts[c * N + m];
      n.a_send_d[r] = p.node_offsets[c * N + m];
      n.a_recv_n[r] = relay_offsets_[c * N + m + 1] - relay_offsets_[c * N + m];
      n.a_recv_d[r] = relay_offsets_[c * N + m] + sh.relay;
    }
    index_t at = fan_first_[c] + sh.fan;
    for (int g = 0; g < G; ++g) {  // rank g of this node
      const int r = mine * G + g;
      n.b_send_n[r] = fan_counts_[c * G + g] * H;
      n.b_send_d[r] = at * H;
      at += fan_counts_[c * G + g];
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

  void fill_comm_stats(context& x) {
    const dispatch_plan& p = x.plan;
    pass_stats& st = x.stats;
    const int R = w_.ranks, L = p.local_experts, C = p.chunks;
    const index_t row_bytes = w_.hidden * static_cast<index_t>(sizeof(value_type));
    const index_t meta_bytes = Dedup ? static_cast<index_t>(sizeof(std::int64_t)) : 0;
    index_t sent = 0, received = 0, meta_sent = 0, meta_received = 0;
    for (int r = 0; r < R; ++r) {
      st.assignment_rows_sent[r] = p.send_rows_to(r);
      st.assignment_rows_received[r] = p.recv_rows_from(r);
      st.rows_sent[r] = st.assignment_rows_sent[r];
      st.rows_received[r] = st.assignment_rows_received[r];
      if constexpr (Dedup) {
        st.rows_sent[r] = st.rows_received[r] = 0;
        for (int c = 0; c < C; ++c) {
          st.rows_sent[r] += p.unique_counts[c * R + r];
          st.rows_received[r] += p.recv_unique_counts[c * R + r];
        }
      }
      if (r != me_) {
        sent += st.rows_sent[r];
        received += st.rows_received[r];
        meta_sent += st.assignment_rows_sent[r];
        meta_received += st.assignment_rows_received[r];
      }
    }
    st.dispatch_bytes_sent = sent * row_bytes + meta_sent * meta_bytes;
    st.dispatch_bytes_received = received * row_bytes + meta_received * meta_bytes;
    st.rank_imbalance = imbalance::of(st.rows_sent);
    st.combine_bytes_sent = received * row_bytes;
    st.combine_bytes_received = sent * row_bytes;
    level_stats(x, row_bytes, meta_bytes);
    if (hier_) {  // the rows went in two levels
      st.dispatch_bytes_sent = st.intra_node.bytes_sent + st.inter_node.bytes_sent;
      st.dispatch_bytes_received = st.intra_node.bytes_received + st.inter_node.bytes_received;
      st.combine_bytes_sent =
          st.intra_node.rows_received * row_bytes + st.inter_node.rows_received * row_bytes;
      st.combine_bytes_received =
          st.intra_node.rows_sent * row_bytes + st.inter_node.rows_sent * row_bytes;
    }
    for (int j = 0; j < L; ++j) {
      index_t real = 0, padded = 0;
      for (int c = 0; c < C; ++c)
        for (int s = 0; s < R; ++s) {
          real += p.recv_valid[p.block(c, s, j)];
          padded += p.recv_counts[p.block(c, s, j)];
        }
      st.rows_per_local_expert[j] = real;
      st.padded_rows_per_local_expert[j] = padded;
    }
  }

  // Rows and bytes over each link class (ranks of one node: w_.node_size). Flat: the rows to
  // each other rank; hierarchical: the first level's node rows and the second level's fan
  // rows. The metadata (dedup) goes straight to the expert ranks either way.
  void level_stats(context& x, index_t row_bytes, index_t meta_bytes) {
    const dispatch_plan& p = x.plan;
    pass_stats& st = x.stats;
    const int R = w_.ranks, C = p.chunks, G = w_.node_size > 0 ? w_.node_size : R;
    st.ranks_per_node = G;
    st.intra_node = st.inter_node = {};
    auto level = [&](int r) -> link_traffic& {
      return r / G == me_ / G ? st.intra_node : st.inter_node;
    };
    for (int r = 0; r < R; ++r) {
      if (r == me_) continue;
      link_traffic& l = level(r);
      l.bytes_sent += st.assignment_rows_sent[r] * meta_bytes;
      l.bytes_received += st.assignment_rows_received[r] * meta_bytes;
      if (hier_) continue;
      l.rows_sent += st.rows_sent[r];
      l.rows_received += st.rows_received[r];
    }
    if (hier_)
      for (int c = 0; c < C; ++c) {
        if (windows_) set_rank_counts(p, c);  // (in its slot: no unit is in flight yet)
        const rank_counts& n = counts_[slot_of(c)];
        for (int r = 0; r < R; ++r) {
          if (r == me_) continue;
          link_traffic& l = level(r);  // (a) only reaches other nodes, (b) only this one
          l.rows_sent += (n.a_send_n[r] + n.b_send_n[r]) / w_.row_stride;
          l.rows_received += (n.a_recv_n[r] + n.b_recv_n[r]) / w_.row_stride;
        }
      }
    for (int i = 0; i < 2; ++i) {
      link_traffic& l = i == 0 ? st.intra_node : st.inter_node;
      l.bytes_sent += l.rows_sent * row_bytes;
      l.bytes_received += l.rows_received * row_bytes;
    }
  }

  // Dedup: expert-major row of each received assignment of chunk c <- its unique row.
  void expand_unique_rows(context& x, int c) {
    const dispatch_plan& p = x.plan;
    const int R = w_.ranks, L = p.local_experts;
    const index_t first = p.recv_offsets[p.block(c, 0, 0)];
    const index_t n = p.recv_offsets[p.block(c + 1, 0, 0)] - first;
    // Indexed by the receive row (in the unit's slot when bounded), so a schedule may expand
    // chunk c + 1 before chunk c's sums.
    const index_t at = first + shift_of(p, c).assign;
    std::int32_t* key = sum_key_.data() + at;
    index_t* expert_row = sum_first_.data() + 2 * (w_.recv_assign_rows + 1) + at;
    x.space.for_each(n,
                     exchange_ops::unique_of_row{x.dev.recv_offsets, x.dev.regroup_offsets,
                                                 x.dev.recv_unique_offsets, x.dev.expert_offsets,
                                                 meta_recv_.data() + at, c, R, L, key, expert_row});
    const matrix_view<const value_type> unique = chunk_unique_view(p, c);
    x.space.for_each_row(
        n, w_.hidden,
        exchange_ops::expand_unique<value_type>{key, expert_row, unique, unit_expert_view(p, c)});
  }

  // Dedup: the expert rank sums each token's weighted outputs, one row per (token, rank).
  void weighted_unique_sums(context& x, int c) {
    const dispatch_plan& p = x.plan;
    const int R = w_.ranks;
    const index_t first = p.recv_offsets[p.block(c, 0, 0)];
    const index_t n = p.recv_offsets[p.block(c + 1, 0, 0)] - first;
    const index_t U = p.recv_unique_offsets[(c + 1) * R] - p.recv_unique_offsets[c * R];
    const index_t cap = w_.recv_assign_rows, at = first + shift_of(p, c).assign;
    const std::int32_t* key = sum_key_.data() + at;  // from expand_unique_rows
    std::int32_t* sorted = sum_key_.data() + cap;
    std::int32_t* order = sorted + cap;
    index_t* rows = sum_first_.data();
    index_t* firsts = rows + cap + 1;
    const index_t* expert_row = firsts + cap + 1 + at;
    x.space.count(key, n, U, rows);
    x.space.exclusive_scan(rows, firsts, U);
    x.space.sort_by_key(key, n, U, sorted, order, sum_sort_.data());
    x.space.for_each_row(
        U, w_.hidden,
        exchange_ops::weighted_unique_sum<value_type>{
            order, firsts, expert_row, meta_recv_.data() + at, const_view(unit_expert_view(p, c)),
            chunk_unique_view(p, c), backward_});
  }

  matrix_view<value_type> chunk_unique_view(const dispatch_plan& p, int c) const {
    const int R = w_.ranks;
    const index_t u0 = p.recv_unique_offsets[c * R];
    return {x_recv_.data() + (u0 + shift_of(p, c).unique) * w_.row_stride,
            p.recv_unique_offsets[(c + 1) * R] - u0, w_.hidden, w_.row_stride};
  }
  matrix_view<value_type> recv_view(const dispatch_plan& p) const {
    return {x_recv_.data(), p.recv_rows(), w_.hidden, w_.row_stride};
  }
  matrix_view<value_type> send_view(const dispatch_plan& p) const {
    return {x_send_.data(), p.send_rows(), w_.hidden, w_.row_stride};
  }
  // Blocks [b0, b1) of src -> dst (rows at src_at[b] -> dst_at[b], recv_counts[b] each: the
  // counts of what this rank receives, which for its own blocks equal what it sends itself).
  template <class Src>
  static void copy_blocks(context& x, Src src, matrix_view<value_type> dst, int b0, int b1,
                          const index_t* src_at, const index_t* dst_at) {
    if (b1 > b0)
      x.space.copy_blocks(matrix_view<const value_type>(src), dst, b1 - b0, src_at + b0,
                          dst_at + b0, x.dev.recv_counts + b0);
  }
  matrix_view<value_type> slot_view(int k) const {
    return {x_recv_.data(), (k + 1) * slot_rows_, w_.hidden, w_.row_stride};
  }
  matrix_view<value_type> expert_view() const {
    return {x_expert_.data(), w_.expert_rows, w_.hidden, w_.row_stride};
  }
  static matrix_view<const value_type> const_view(matrix_view<value_type> v) { return v; }

  transport_type tr_{};
  workspace_layout w_{};
  int me_ = 0;
  bool bounded_ = false;  // rounds split each pair's rows (no dedup)
  bool windows_ = false;  // rounds are windows of tokens (dedup): workspace token_rounds
  index_t slot_rows_ = 0;
  int slots_ = 1;
  int expert_owner_ = -1;    // bounded: the unit whose rows are in the expert buffer
  index_t static_rows_ = 0;  // static shapes: rows of every block (0: counted)
  bool deferred_ = false;    // static shapes on a device: the counts are read after the pass
  buffer<value_type> x_send_, x_recv_, x_expert_;
  buffer<index_t> msg_send_;
  mirror<index_t> msg_recv_;
  mirror<index_t> unit_arrays_;      // bounded: [slots] unit_state arrays
  std::vector<index_t> host_;        // per slot: rank_counts; first unit of each chunk
  std::vector<rank_counts> counts_;  // [slots]
  std::vector<unit_state> units_;    // [slots]
  index_t* first_unit_ = nullptr;    // [C+1]: bounded: first unit of each chunk
  std::vector<std::optional<typename transport_type::request>> dispatch_req_, meta_req_,
      combine_req_, gback_req_,     // [slots] (gback: dedup backward's weight gradients)
      mask_req_;                    //   hierarchical: the node rows' masks
  std::vector<mark> marks_;         // [4 * slots]: when each slot's dispatch and combine began and
                                    // their starts returned
  buffer<std::int64_t> meta_recv_;  // dedup: the received assignments' metadata
  buffer<std::int32_t> sum_key_;    // dedup: [3][recv rows] keys, sorted keys, order
  buffer<index_t> sum_first_;       // dedup: rows and first per unique row; expert rows
  buffer<char> sum_sort_;
  buffer<float> g_recv_, g_send_;  // dedup backward: routing-weight gradients
  bool backward_ = false;
  // Hierarchical exchange: G ranks per node, N nodes.
  bool hier_ = false;
  bool levels_ = false;  // the comm runs each level on its own communicator
  int G_ = 0, N_ = 1;
  buffer<value_type> x_relay_;       // node rows this rank relays, per (chunk, source node)
  buffer<value_type> x_fan_;         // their copies per (chunk, local rank, source node)
  buffer<std::int64_t> mask_relay_;  // the relay rows' masks
  buffer<index_t> fan_at_;           // per chunk [G][n] flags, then their scan (fan rows)
  index_t* relay_offsets_ = nullptr;
  index_t* fan_counts_ = nullptr;
  index_t* fan_first_ = nullptr;
};

}  // namespace epmoe
