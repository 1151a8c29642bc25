// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstring>
#include <string>

#include "epmoe/core/exchange/core.hpp"

// The low-latency exchange (layer_options::low_latency, docs/decode.md): every (source,
// destination) pair owns a fixed slot of S = from_one_rank rows (min(T*min(K, L), L * the
// capacity's rows per expert): the most rows one source can send one rank in a pass), after a
// head of whole rows that carries the call header and the pair's rows per local expert. The
// dispatch is ONE fixed-size all-to-all of the slots (no counts round: the counts ride in the
// heads), the combine one back; each moves R slots whatever the routing. The rows' tokens and
// weights never leave home: a slot's rows are sorted by local expert, so its per-expert
// counts name every row's expert, and the combine returns each row to the slot position it
// left from, where the home's plan finds it.
namespace epmoe {

namespace exchange_ops {
/// Copies the counts message to peer r into the head of slot r (the head is whole rows of
/// the slot buffer's element type; memcpy keeps the index_t bits as they are).
template <class T>
struct slot_head {
  const index_t* msg;
  index_t per_peer;
  T* slots;
  index_t slot_elems;
  EPMOE_HD void operator()(index_t r) const {
    memcpy(slots + r * slot_elems, msg + r * per_peer,
           static_cast<std::size_t>(per_peer) * sizeof(index_t));
  }
};
}  // namespace exchange_ops

/// One unit per pass (one chunk, no receive bound), one all-to-all per direction; the verdict
/// of every rank arrives with the rows, so counts() is the dispatch itself.
template <class Comm, class Space>
class low_latency_exchange : public exchange_core<Comm, Space> {
  using base = exchange_core<Comm, Space>;

 public:
  using typename base::context;
  using typename base::mark;
  using typename base::value_type;

  low_latency_exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : base(comm, space, w, 1, 8) {
    if (w.chunks != 1)
      throw config_error("chunks", std::to_string(w.chunks),
                         "must be 1 with options.low_latency (one round per direction moves a "
                         "whole pass; use schedule::sequential)");
    if (w.quota > 0)
      throw config_error("max_recv_rows", "> 0",
                         "must be 0 with options.low_latency (its slots are fixed: R x "
                         "max_tokens x min(top_k, local experts) rows)");
    if (w.wire())
      throw config_error("dispatch_rows", "int8",
                         "is not supported with options.low_latency (its slots move rows of the "
                         "activation type)");
    const index_t head_bytes = this->msg_.per_peer() * static_cast<index_t>(sizeof(index_t));
    const index_t row_bytes = w.row_stride * static_cast<index_t>(sizeof(value_type));
    head_rows_ = (head_bytes + row_bytes - 1) / row_bytes;
    slot_rows_ = head_rows_ + w.from_one_rank;
    const index_t R = w.ranks, L = w.local_experts;
    slots_send_ = space.template allocate<value_type>(R * slot_rows_ * w.row_stride);
    slots_recv_ = space.template allocate_mirror<value_type>(R * slot_rows_ * w.row_stride);
    at_ = space.template allocate_mirror<index_t>(2 * R * L);
  }

  /// Elements of one (source, destination) slot: its head and S rows, at the row stride.
  index_t slot_elements() const { return slot_rows_ * this->w_.row_stride; }
  /// Bytes one rank's two slot buffers take (send and receive, R slots each).
  index_t slot_buffer_bytes() const {
    return 2 * index_t{this->w_.ranks} * slot_elements() * static_cast<index_t>(sizeof(value_type));
  }

  int units(const dispatch_plan&) const { return 1; }
  int chunk_of_unit(const dispatch_plan&, int) const { return 0; }
  int round_of_unit(const dispatch_plan&, int) const { return 0; }

  /// The dispatch: the heads and the permuted rows into the send slots, one fixed-size
  /// all-to-all, every rank's header read from the received heads. Returns the first rank
  /// that rejected its inputs (its slots carry no rows), or -1; throws config_error on every
  /// rank when ranks make different calls. Never deferred (the heads come to the host).
  int counts(context& x, const call_header& h, index_t, bool) {
    dispatch_plan& p = x.plan;
    const workspace_layout& w = this->w_;
    const int R = w.ranks, L = p.local_experts;
    const index_t P = this->msg_.per_peer(), E = slot_elements();
    const mark t0 = x.clock.now();
    this->reset_units();
    x.space.for_each(
        R, exchange_ops::count_message{x.dev.send_counts, x.dev.send_valid, x.dev.send_offsets,
                                       nullptr, this->msg_, 1, 0, h, this->msg_send_.data()});
    x.space.for_each(
        R, exchange_ops::slot_head<value_type>{this->msg_send_.data(), P, slots_send_.data(), E});
    index_t* send_at = at_.host();
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < L; ++j) {
        const int b = p.block(0, r, j);
        send_at[b] = r * slot_rows_ + head_rows_ + p.send_offsets[b] - p.send_offsets[r * L];
      }
    x.space.to_device(at_, 0, index_t{R} * L);
    copy_rows(x, send_view(p), slots_view(slots_send_.data()), x.dev.send_offsets, at_.device(),
              x.dev.send_counts);
    this->tr_.alltoall(slots_send_.data(), slots_recv_.device(), E);
    for (int r = 0; r < R; ++r) x.space.to_host(slots_recv_, r * E, head_elements());
    this->synchronize(x.space);
    for (int r = 0; r < R; ++r)
      std::memcpy(this->msg_recv_.host() + r * P, slots_recv_.host() + r * E,
                  static_cast<std::size_t>(P) * sizeof(index_t));
    const mark t1 = x.clock.now();
    x.clock.exchange(t0, t1, t1, t1, 0);
    if (const int rejected = read_verdict(this->msg_recv_.host(), this->msg_); rejected >= 0)
      return rejected;
    this->read_block_counts(p);
    build_recv_plan(p);
    index_t* recv_at = at_.host() + index_t{R} * L;
    for (int s = 0; s < R; ++s) {
      if (p.recv_rows_from(0, s) > w.from_one_rank) this->overflow(p.recv_rows());
      for (int j = 0; j < L; ++j) {
        const int b = p.block(0, s, j);
        recv_at[b] = s * slot_rows_ + head_rows_ + p.recv_offsets[b] - p.recv_offsets[s * L];
      }
    }
    x.space.to_device(at_, index_t{R} * L, index_t{R} * L);
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
    this->fill_comm_stats(x, false);
    pass_stats& st = x.stats;
    st.rounds = 1;
    st.alltoalls = 2;
    st.peak_recv_rows = p.recv_rows();
    // Fixed: every slot to every other rank moves whole, whatever its rows.
    const index_t moved = (R - 1) * E * static_cast<index_t>(sizeof(value_type));
    st.dispatch_bytes_sent = st.dispatch_bytes_received = moved;
    st.combine_bytes_sent = st.combine_bytes_received = moved;
    return -1;
  }
  int resolve(context&) { return -1; }
  const index_t* verdicts() const { return nullptr; }
  index_t verdict_stride() const { return 0; }

  /// The rows arrived with counts(): the dispatch stage regroups them by local expert.
  void start_dispatch(context&, int) {}
  void wait_dispatch(context& x, int) {
    const mark a = x.clock.now();
    copy_rows(x, slots_view(slots_recv_.device()), this->expert_view(), recv_at_device(),
              x.dev.regroup_offsets, x.dev.recv_counts);
    const dispatch_plan& p = x.plan;
    x.clock.event(0, stage_kind::dispatch, 0,
                  p.expert_offsets[p.local_experts] - p.expert_offsets[0],
                  x.stats.dispatch_bytes_received, a, x.clock.now());
  }

  grouped_rows<value_type> expert_rows(const context& x, int) const {
    return this->plan_rows(x, 0, x.plan.expert_offsets[0]);
  }

  /// The combine: the outputs into the received slots, where their rows came from, and the
  /// slots back in one fixed-size all-to-all.
  template <bool Backward>
  void start_combine(context& x, int) {
    this->marks_[2] = x.clock.now();
    copy_rows(x, this->const_view(this->expert_view()), slots_view(slots_recv_.device()),
              x.dev.regroup_offsets, recv_at_device(), x.dev.recv_counts);
    this->tr_.alltoall(slots_recv_.device(), slots_send_.data(), slot_elements());
    this->marks_[3] = x.clock.now();
  }
  /// Each row from its send slot back to its send-buffer row, where the reduce reads it.
  template <bool Backward>
  void wait_combine(context& x, int) {
    const mark w0 = x.clock.now();
    const dispatch_plan& p = x.plan;
    copy_rows(x, this->const_view(slots_view(slots_send_.data())), send_view(p), at_.device(),
              x.dev.send_offsets, x.dev.send_counts);
    this->combine_done(x, 0, w0, x.clock.now(), 0, 0, 0, p.send_rows(),
                       x.stats.combine_bytes_received);
  }

 private:
  index_t head_elements() const { return head_rows_ * this->w_.row_stride; }
  const index_t* recv_at_device() const {
    return at_.device() + index_t{this->w_.ranks} * this->w_.local_experts;
  }
  matrix_view<value_type> slots_view(value_type* s) const {
    return {s, this->w_.ranks * slot_rows_, this->w_.hidden, this->w_.row_stride};
  }
  matrix_view<value_type> send_view(const dispatch_plan& p) const {
    return {this->x_send_.data(), p.send_rows(), this->w_.hidden, this->w_.row_stride};
  }
  // The R*L blocks of the pass: count[b] rows from src row src_at[b] to dst row dst_at[b].
  template <class Src>
  void copy_rows(context& x, Src src, matrix_view<value_type> dst, const index_t* src_at,
                 const index_t* dst_at, const index_t* count) const {
    x.space.copy_blocks(matrix_view<const value_type>(src), dst,
                        index_t{this->w_.ranks} * this->w_.local_experts, src_at, dst_at, count);
  }

  index_t head_rows_ = 0;  // rows of a slot's head (the counts message to one peer)
  index_t slot_rows_ = 0;  // head + S rows
  typename base::template buffer<value_type> slots_send_;
  typename base::template mirror<value_type> slots_recv_;
  typename base::template mirror<index_t> at_;  // [2][R*L]: each block's first slot row, send
                                                // then receive side
};

}  // namespace epmoe
