// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <vector>

#include "epmoe/core/exchange/core.hpp"

// Flat rows (one per kept assignment) in two unit layouts: whole chunks, each in its place of
// the pass-wide buffers (flat_exchange), and rounds that split each pair's rows of a chunk so
// the receive buffer holds at most max_recv_rows (flat_rounds_exchange).
namespace epmoe {

/// Flat rows, a unit per chunk. A rank's own rows skip the exchange: the regroup reads them
/// from the send buffer and the combine writes them back there.
template <class Comm, class Space>
class flat_exchange : public exchange_core<Comm, Space> {
  using base = exchange_core<Comm, Space>;

 public:
  using typename base::context;
  using typename base::mark;
  using typename base::value_type;

  flat_exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : base(comm, space, w, w.chunks, 8) {}

  int units(const dispatch_plan& p) const { return p.chunks; }
  int chunk_of_unit(const dispatch_plan&, int u) const { return u; }
  int round_of_unit(const dispatch_plan&, int) const { return 0; }

  /// The counts all-to-all: every rank learns the rows it receives per (chunk, source, local
  /// slot) and every rank's call header. Returns the first rank that rejected its inputs, or
  /// -1 (then the pass goes on). Static shapes (`static_rows` > 0: padded capacity, one
  /// chunk): every block holds static_rows rows; with `defer` (a device's forward) nothing
  /// waits: the verdict is read by resolve() after the pass (verdict_pending), and the reduce
  /// writes nothing unless every header agrees (verdicts()).
  int counts(context& x, const call_header& h, index_t static_rows, bool defer) {
    const mark t0 = x.clock.now();
    this->send_counts(x, h, 0);
    static_rows_ = static_rows;
    if (static_rows > 0 && defer) {
      static_layout(x);
      x.clock.exchange(t0, x.clock.now(), t0, t0, 0);
      return verdict_pending;
    }
    this->synchronize(x.space);
    const mark t1 = x.clock.now();
    x.clock.exchange(t0, t1, t1, t1, 0);
    return read(x);
  }
  /// A deferred pass's verdict and counts (after the space's synchronize()).
  int resolve(context& x) { return read(x); }
  /// Every rank's call header in the space's memory, verdict_stride() apart.
  const index_t* verdicts() const { return this->msg_recv_.device(); }
  index_t verdict_stride() const { return this->msg_.per_peer(); }

  void start_dispatch(context& x, int u) {
    this->marks_[4 * u] = x.clock.now();
    this->start_rows(u, this->counts_[u]);
    this->marks_[4 * u + 1] = x.clock.now();
  }

  void wait_dispatch(context& x, int u) {
    const mark w0 = x.clock.now();
    const double modeled = this->tr_.wait(this->dispatch_req_[u]);
    this->dispatch_done(x, u, w0, x.clock.now(), modeled);
    // Other ranks' rows from the receive buffer; this rank's own from its send buffer, where
    // they never left.
    const dispatch_plan& p = x.plan;
    const int L = p.local_experts, B = this->w_.ranks * L, b = u * B, m = b + this->me_ * L;
    if (this->w_.wire()) {
      wire_blocks(x, b, m, false);
      wire_blocks(x, m, m + L, true);
      wire_blocks(x, m + L, b + B, false);
    } else {
      copy_blocks(x, recv_view(p), this->expert_view(), b, m, x.dev.recv_offsets,
                  x.dev.regroup_offsets);
      copy_blocks(x, send_view(p), this->expert_view(), m, m + L, x.dev.send_offsets,
                  x.dev.regroup_offsets);
      copy_blocks(x, recv_view(p), this->expert_view(), m + L, b + B, x.dev.recv_offsets,
                  x.dev.regroup_offsets);
    }
    const index_t rows = p.expert_offsets[(u + 1) * L] - p.expert_offsets[u * L];
    this->dispatch_event(x, u, u, 0, rows, this->crossing_bytes(this->counts_[u].recv_n, true));
  }

  /// The rows every local expert computes in unit u: groups of the expert buffer.
  grouped_rows<value_type> expert_rows(const context& x, int u) const {
    return this->plan_rows(x, u, x.plan.expert_offsets[u * x.plan.local_experts]);
  }

  template <bool Backward>
  void start_combine(context& x, int u) {
    this->marks_[4 * u + 2] = x.clock.now();
    const dispatch_plan& p = x.plan;
    const int L = p.local_experts, b = u * this->w_.ranks * L, m = b + this->me_ * L;
    // Back the same way: this rank's own rows straight into its send buffer.
    const auto from = this->const_view(this->expert_view());
    copy_blocks(x, from, recv_view(p), b, m, x.dev.regroup_offsets, x.dev.recv_offsets);
    copy_blocks(x, from, send_view(p), m, m + L, x.dev.regroup_offsets, x.dev.send_offsets);
    copy_blocks(x, from, recv_view(p), m + L, b + this->w_.ranks * L, x.dev.regroup_offsets,
                x.dev.recv_offsets);
    const rank_counts& n = this->counts_[u];
    this->tr_.start(this->combine_req_[u], this->x_recv_.data(), n.recv_n, n.recv_d, this->send_,
                    n.send_n, n.send_d);
    this->marks_[4 * u + 3] = x.clock.now();
  }

  template <bool Backward>
  void wait_combine(context& x, int u) {
    const mark w0 = x.clock.now();
    const double modeled = this->tr_.wait(this->combine_req_[u]);
    const rank_counts& n = this->counts_[u];
    index_t rows = x.plan.recv_rows_from(u, this->me_);
    for (int r = 0; r < this->w_.ranks; ++r) rows += n.recv_n[r] / this->w_.row_stride;
    this->combine_done(x, u, w0, x.clock.now(), modeled, u, 0, rows,
                       this->crossing_bytes(n.recv_n));
  }

 protected:
  // Blocks [b0, b1) of src -> dst (rows at src_at[b] -> dst_at[b], recv_counts[b] each: the
  // counts of what this rank receives, which for its own blocks equal what it sends itself).
  template <class Src>
  static void copy_blocks(context& x, Src src, matrix_view<value_type> dst, int b0, int b1,
                          const index_t* src_at, const index_t* dst_at) {
    if (b1 > b0)
      x.space.copy_blocks(matrix_view<const value_type>(src), dst, b1 - b0, src_at + b0,
                          dst_at + b0, x.dev.recv_counts + b0);
  }
  // 8-bit rows: blocks [b0, b1) from the wire receive buffer (or, `own`, the wire send
  // buffer: this rank's rows never left), dequantised into the expert buffer.
  void wire_blocks(context& x, int b0, int b1, bool own) const {
    const dispatch_plan& p = x.plan;
    const index_t* at = own ? p.send_offsets : p.recv_offsets;
    this->dequantise_blocks(x.space, own ? this->q_send_.data() : this->q_recv_.data(),
                            own ? p.send_rows() : p.recv_rows(), at[b0], at[b1] - at[b0], b0, b1,
                            own ? x.dev.send_offsets : x.dev.recv_offsets, x.dev.recv_counts,
                            x.dev.regroup_offsets);
  }
  matrix_view<value_type> recv_view(const dispatch_plan& p) const {
    return {this->x_recv_.data(), p.recv_rows(), this->w_.hidden, this->w_.row_stride};
  }
  matrix_view<value_type> send_view(const dispatch_plan& p) const {
    return {this->send_, p.send_rows(), this->w_.hidden, this->w_.row_stride};
  }

 private:
  // The verdict, then the receive plan and the exchanges' counts (static shapes: they must
  // equal the fixed ones).
  int read(context& x) {
    dispatch_plan& p = x.plan;
    if (const int rejected = read_verdict(this->msg_recv_.host(), this->msg_); rejected >= 0)
      return rejected;
    this->read_block_counts(p);
    build_recv_plan(p);
    if (p.recv_rows() > this->w_.recv_buffer_rows) this->overflow(p.recv_rows());
    for (int c = 0; c < p.chunks; ++c) set_rank_counts(p, c);
    x.stats.rounds = 1;
    x.stats.alltoalls = 1 + 2 * p.chunks;
    x.stats.peak_recv_rows = p.recv_rows();
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
    this->fill_comm_stats(x, false);
    if (static_rows_ > 0)
      for (int b = 0; b < p.blocks(); ++b)
        if (p.recv_counts[b] != static_rows_)
          throw comm_error("epmoe: rank " + std::to_string(this->me_) + " expected " +
                           std::to_string(static_rows_) + " rows per block (padded capacity) " +
                           "and got " + std::to_string(p.recv_counts[b]) +
                           ": every rank must use the same config and capacity");
    return -1;
  }

  // Static shapes: every block (one chunk) holds static_rows_ rows on both sides.
  void static_layout(context& x) {
    dispatch_plan& p = x.plan;
    p.send_offsets[0] = 0;
    for (int b = 0; b < p.blocks(); ++b) {
      p.recv_counts[b] = p.send_counts[b] = static_rows_;
      p.send_offsets[b + 1] = p.send_offsets[b] + static_rows_;
    }
    build_recv_plan(p);
    set_rank_counts(p, 0);
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
  }

  // Chunk c's per-rank element counts and displacements. Rows to itself skip the exchange
  // (one copy less each way; wait_dispatch and start_combine move them).
  void set_rank_counts(const dispatch_plan& p, int c) {
    const index_t H = this->w_.row_stride;  // elements per row moved (the padding rides along)
    rank_counts& n = this->counts_[c];
    for (int r = 0; r < this->w_.ranks; ++r) {
      const int b = p.block(c, r, 0);
      n.send_n[r] = p.send_rows_to(c, r) * H;
      n.send_d[r] = p.send_offsets[b] * H;
      n.recv_n[r] = p.recv_rows_from(c, r) * H;
      n.recv_d[r] = p.recv_offsets[b] * H;
    }
    n.send_n[this->me_] = n.recv_n[this->me_] = 0;
  }

  index_t static_rows_ = 0;  // static shapes: rows of every block (0: counted)
};

/// Flat rows with a receive bound: unit u is round i of chunk c, in which each (source,
/// destination) pair moves rows [i*q, (i+1)*q) of the source's contiguous rows of c; both
/// sides split from the counts alone, and each unit takes receive slot u % units_in_flight.
template <class Comm, class Space>
class flat_rounds_exchange : public exchange_core<Comm, Space> {
  using base = exchange_core<Comm, Space>;

 public:
  using typename base::context;
  using typename base::mark;
  using typename base::value_type;

  flat_rounds_exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : base(comm, space, w, w.units_in_flight, 8),
        first_unit_(static_cast<std::size_t>(w.chunks) + 1, 0),
        slot_rows_(index_t{w.ranks} * w.per_source) {
    const index_t per = 3 * index_t{w.ranks} * w.local_experts + w.local_experts + 1;
    unit_arrays_ = space.template allocate_mirror<index_t>(w.units_in_flight * per);
    per_slot_ = per;
  }
  // Requests in flight write into the base's buffers, which outlive them.

  int units(const dispatch_plan& p) const { return static_cast<int>(first_unit_[p.chunks]); }
  int chunk_of_unit(const dispatch_plan& p, int u) const {
    return static_cast<int>(
               std::upper_bound(first_unit_.begin(), first_unit_.begin() + p.chunks + 1, u) -
               first_unit_.begin()) -
           1;
  }
  int round_of_unit(const dispatch_plan& p, int u) const {
    return u - static_cast<int>(first_unit_[static_cast<std::size_t>(chunk_of_unit(p, u))]);
  }

  int counts(context& x, const call_header& h, index_t, bool) {
    this->exchange_counts(x, h, this->w_.quota);
    return read(x);
  }
  int resolve(context&) { return -1; }
  const index_t* verdicts() const { return nullptr; }
  index_t verdict_stride() const { return 0; }

  void start_dispatch(context& x, int u) {
    const int k = slot(u);
    this->marks_[4 * k] = x.clock.now();
    layout_unit(x, u);
    this->start_rows(k, this->counts_[k]);
    this->marks_[4 * k + 1] = x.clock.now();
  }

  void wait_dispatch(context& x, int u) {
    const int k = slot(u);
    const mark w0 = x.clock.now();
    const double modeled = this->tr_.wait(this->dispatch_req_[k]);
    this->dispatch_done(x, k, w0, x.clock.now(), modeled);
    this->take_expert_buffer(u);
    const index_t* dev = device_arrays(k);
    const int B = this->w_.ranks * x.plan.local_experts;
    const index_t rows = host_arrays(k)[expert_at() + x.plan.local_experts];
    if (this->w_.wire())  // the slot's rows follow one another from its first (layout_unit)
      this->dequantise_blocks(x.space, this->q_recv_.data(), (k + 1) * slot_rows_,
                              host_arrays(k)[recv_at()], rows, 0, B, dev + recv_at(), dev,
                              dev + regroup_at());
    else
      x.space.copy_blocks(slot_view(k), this->expert_view(), B, dev + recv_at(), dev + regroup_at(),
                          dev);
    this->dispatch_event(x, k, chunk_of_unit(x.plan, u), round_of_unit(x.plan, u), rows,
                         this->crossing_bytes(this->counts_[k].recv_n, true));
  }

  grouped_rows<value_type> expert_rows(const context& x, int u) const {
    const int k = slot(u);
    const workspace_layout& w = this->w_;
    return {this->x_expert_.data(),
            w.hidden,
            w.row_stride,
            x.plan.local_experts,
            host_arrays(k) + expert_at(),
            device_arrays(k) + expert_at(),
            w.align};
  }

  template <bool Backward>
  void start_combine(context& x, int u) {
    const int k = slot(u);
    this->marks_[4 * k + 2] = x.clock.now();
    const index_t* dev = device_arrays(k);
    x.space.copy_blocks(this->const_view(this->expert_view()), slot_view(k),
                        this->w_.ranks * x.plan.local_experts, dev + regroup_at(), dev + recv_at(),
                        dev);
    this->release_expert_buffer();
    const rank_counts& n = this->counts_[k];
    this->tr_.start(this->combine_req_[k], this->x_recv_.data(), n.recv_n, n.recv_d, this->send_,
                    n.send_n, n.send_d);
    this->marks_[4 * k + 3] = x.clock.now();
  }

  template <bool Backward>
  void wait_combine(context& x, int u) {
    const int k = slot(u);
    const mark w0 = x.clock.now();
    const double modeled = this->tr_.wait(this->combine_req_[k]);
    const mark w1 = x.clock.now();
    this->release_slot(k);
    const rank_counts& n = this->counts_[k];
    index_t rows = 0;
    for (int r = 0; r < this->w_.ranks; ++r) rows += n.recv_n[r] / this->w_.row_stride;
    this->combine_done(x, k, w0, w1, modeled, chunk_of_unit(x.plan, u), round_of_unit(x.plan, u),
                       rows, this->crossing_bytes(n.recv_n));
  }

 private:
  int slot(int u) const { return u % this->slots_; }
  // A unit's receive layout, host and space copies of one array: per block (source s, local
  // slot j) = s * L + j, its rows this round ([0, RL)), where they sit in the receive buffer
  // ([RL, 2RL)) and in the expert buffer ([2RL, 3RL)); then per local slot its first row in
  // the expert buffer ([3RL, 3RL + L + 1)).
  index_t recv_at() const { return index_t{this->w_.ranks} * this->w_.local_experts; }
  index_t regroup_at() const { return 2 * recv_at(); }
  index_t expert_at() const { return 3 * recv_at(); }
  index_t* host_arrays(int k) const { return unit_arrays_.host() + k * per_slot_; }
  index_t* device_arrays(int k) const { return unit_arrays_.device() + k * per_slot_; }
  matrix_view<value_type> slot_view(int k) const {
    return {this->x_recv_.data(), (k + 1) * slot_rows_, this->w_.hidden, this->w_.row_stride};
  }

  // The verdict, the receive plan and each chunk's rounds (the most any pair needs).
  int read(context& x) {
    dispatch_plan& p = x.plan;
    if (const int rejected = read_verdict(this->msg_recv_.host(), this->msg_); rejected >= 0)
      return rejected;
    this->read_block_counts(p);
    build_recv_plan(p);
    const workspace_layout& w = this->w_;
    index_t most = 1;
    for (int c = 0; c < p.chunks; ++c) {
      index_t rounds = 1;
      for (int s = 0; s < w.ranks; ++s) {
        rounds = std::max(rounds, this->message_from(s)[this->msg_.rounds_at(c)]);
        // A round from one source must fit its share of a slot.
        if (std::min(w.quota, p.recv_rows_from(c, s)) > w.per_source) this->overflow(p.recv_rows());
      }
      first_unit_[static_cast<std::size_t>(c) + 1] =
          first_unit_[static_cast<std::size_t>(c)] + rounds;
      most = std::max(most, rounds);
    }
    x.stats.rounds = static_cast<int>(most);
    x.stats.alltoalls = 1 + 2 * units(p);
    x.stats.peak_recv_rows = 0;
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
    this->fill_comm_stats(x, false);
    return -1;
  }

  // Unit u's per-rank counts and receive layout, from the plan alone.
  void layout_unit(context& x, int u) {
    const dispatch_plan& p = x.plan;
    const int R = this->w_.ranks, L = p.local_experts, k = slot(u);
    const int c = chunk_of_unit(p, u), i = round_of_unit(p, u);
    const index_t H = this->w_.row_stride, lo = i * this->w_.quota, hi = lo + this->w_.quota;
    this->claim_slot(k);
    rank_counts& n = this->counts_[k];
    index_t* count = host_arrays(k);
    index_t* recv = count + recv_at();
    index_t* regroup = count + regroup_at();
    index_t* expert = count + expert_at();
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
        // (an empty block sits where the next row goes: every block's rows follow the last)
        recv[r * L + j] = at + std::max<index_t>(0, std::min(x0, rb) - ra);
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
    x.space.to_device(unit_arrays_, k * per_slot_, expert_at() + L + 1);
  }

  std::vector<index_t> first_unit_;                      // [C+1]: first unit of each chunk
  index_t slot_rows_ = 0;                                // rows of one receive slot
  typename base::template mirror<index_t> unit_arrays_;  // [slots][per_slot_]
  index_t per_slot_ = 0;
};

}  // namespace epmoe
