// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <type_traits>

#include "epmoe/core/exchange/core.hpp"
#include "epmoe/core/exchange/levels.hpp"
#include "epmoe/core/exchange/ops.hpp"

// Per-rank dedup rows (one per (token, rank), with each assignment's 8-byte metadata; the
// expert rank expands them and returns one weighted sum), optionally over the hierarchical
// levels (levels.hpp), in two unit layouts: whole chunks, or windows of tokens that each take
// a slot of every receive-side buffer (a receive bound).
namespace epmoe {

/// Unit layouts of the dedup rows: every chunk in its place of the pass-wide buffers, or
/// (max_recv_rows) windows of tokens, unit u in slot u % units_in_flight.
struct whole_chunks {
  static constexpr bool windows = false;
  static int slots(const workspace_layout& w) { return w.chunks; }
};
struct token_windows {
  static constexpr bool windows = true;
  static int slots(const workspace_layout& w) { return w.units_in_flight; }
};

/// Dedup, the received assignment rows of a unit: the first's index in the receive-side arrays
/// (weight_grad_recv()), their count, and per row its row among the unit's expert rows and
/// its metadata.
struct received_rows {
  index_t first, n;
  const index_t* expert_row;
  const std::int64_t* meta;
};

template <class Comm, class Space, class Units, bool Hierarchical>
class dedup_exchange : public exchange_core<Comm, Space> {
  using base = exchange_core<Comm, Space>;
  struct no_levels {
    no_levels(const Space&, const workspace_layout&, int) {}
  };
  using levels_type = std::conditional_t<Hierarchical, node_levels<Space>, no_levels>;

 public:
  using typename base::context;
  using typename base::mark;
  using typename base::value_type;

  dedup_exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : base(comm, space, w, Units::slots(w), Hierarchical ? 20 : 8),
        lv_(space, w, Units::slots(w)) {
    // The comm's own nodes are the layer's: each level may run on its communicator.
    if constexpr (Hierarchical && requires { comm.ranks_per_node(); })
      own_levels_ = comm.ranks_per_node() == w.ranks_per_node;
    const index_t n = w.recv_assign_rows;
    meta_recv_ = space.template allocate<std::int64_t>(n);
    sum_key_ = space.template allocate<std::int32_t>(3 * n);
    sum_first_ = space.template allocate<index_t>(2 * (n + 1) + n);
    sum_sort_ = space.template allocate<char>(Space::sort_scratch_bytes(n, n));
    g_recv_ = space.template allocate<float>(n);
    g_send_ = space.template allocate<float>(w.send_rows);
  }
  // Requests in flight write into this mode's buffers: they go first.
  ~dedup_exchange() { this->reset_units(); }
  dedup_exchange(const dedup_exchange&) = delete;

  int units(const dispatch_plan& p) const { return p.chunks; }
  int chunk_of_unit(const dispatch_plan& p, int u) const {
    return Units::windows ? u / p.rounds : u;
  }
  int round_of_unit(const dispatch_plan& p, int u) const {
    return Units::windows ? u % p.rounds : 0;
  }

  int counts(context& x, const call_header& h, index_t, bool) {
    this->exchange_counts(x, h, 0);
    return read(x);
  }
  int resolve(context&) { return -1; }
  const index_t* verdicts() const { return nullptr; }
  index_t verdict_stride() const { return 0; }

  /// Backward: the combine carries each received assignment's routing-weight gradient home,
  /// from weight_grad_recv() [received rows] into weight_grad_send() [send rows, as plan.meta].
  float* weight_grad_recv() const { return g_recv_.data(); }
  float* weight_grad_send() const { return g_send_.data(); }
  /// The received assignment rows of unit c (received_rows).
  received_rows received(const dispatch_plan& p, int c) const {
    const index_t first = p.recv_offsets[p.block(c, 0, 0)], at = first + shift_of(p, c).assign;
    return {at, p.recv_offsets[p.block(c + 1, 0, 0)] - first,
            sum_first_.data() + 2 * (this->w_.recv_assign_rows + 1) + at, meta_recv_.data() + at};
  }

  void start_dispatch(context& x, int u) {
    const int k = slot(u);
    this->marks_[4 * k] = x.clock.now();
    if constexpr (Units::windows) {
      this->claim_slot(k);
      set_rank_counts(x.plan, u);
    }
    const rank_counts& n = this->counts_[k];
    if constexpr (Hierarchical) {  // first level: node rows and their masks to the peers
      if (this->w_.wire()) {
        const auto b = this->in_wire_bytes(k, 1, n.a_send_n, n.a_send_d, n.a_recv_n, n.a_recv_d);
        if constexpr (base::moves_bytes)
          start_at(exchange_level::cross, this->dispatch_req_[k], this->q_send_.data(), b.sn, b.sd,
                   lv_.q_relay.data(), b.rn, b.rd);
      } else {
        start_at(exchange_level::cross, this->dispatch_req_[k], this->send_, n.a_send_n, n.a_send_d,
                 lv_.x_relay.data(), n.a_recv_n, n.a_recv_d);
      }
      start_at(exchange_level::cross, this->mask_req_[k], x.plan.node_mask, n.m_send_n, n.m_send_d,
               lv_.mask_relay.data(), n.m_recv_n, n.m_recv_d);
    } else {
      this->start_rows(k, n);
    }
    this->tr_.start(this->meta_req_[k], x.plan.meta, n.meta_send_n, n.meta_send_d,
                    meta_recv_.data(), n.meta_recv_n, n.meta_recv_d);
    this->marks_[4 * k + 1] = x.clock.now();
  }

  void wait_dispatch(context& x, int u) {
    const int k = slot(u);
    const mark w0 = x.clock.now();
    double modeled = this->tr_.wait(this->dispatch_req_[k]);
    if constexpr (Units::windows) this->take_expert_buffer(u);
    modeled += this->tr_.wait(this->meta_req_[k]);
    if constexpr (Hierarchical) modeled += fan_out(x, u);
    this->dispatch_done(x, k, w0, x.clock.now(), modeled);
    expand_unique_rows(x, u);
    const dispatch_plan& p = x.plan;
    const index_t rows =
        p.expert_offsets[(u + 1) * p.local_experts] - p.expert_offsets[u * p.local_experts];
    this->dispatch_event(x, k, chunk_of_unit(p, u), round_of_unit(p, u), rows, unit_bytes(k, true));
  }

  grouped_rows<value_type> expert_rows(const context& x, int u) const {
    return this->plan_rows(x, u, expert_first(x.plan, u));
  }

  /// The expert rank sums each token's outputs (forward: weighted; backward: plain, the
  /// weights went onto the dy rows), one row per (token, rank), and returns them.
  template <bool Backward>
  void start_combine(context& x, int u) {
    const int k = slot(u);
    this->marks_[4 * k + 2] = x.clock.now();
    weighted_unique_sums(x, u, Backward);
    this->release_expert_buffer();
    const rank_counts& n = this->counts_[k];
    if constexpr (Hierarchical)  // to the relay, which sums them in wait_combine
      start_at(exchange_level::node, this->combine_req_[k], this->x_recv_.data(), n.b_recv_n,
               n.b_recv_d, lv_.x_fan.data(), n.b_send_n, n.b_send_d);
    else
      this->tr_.start(this->combine_req_[k], this->x_recv_.data(), n.recv_n, n.recv_d, this->send_,
                      n.send_n, n.send_d);
    if constexpr (Backward)
      this->tr_.start(this->gback_req_[k], g_recv_.data(), n.meta_recv_n, n.meta_recv_d,
                      g_send_.data(), n.meta_send_n, n.meta_send_d);
    this->marks_[4 * k + 3] = x.clock.now();
  }

  template <bool Backward>
  void wait_combine(context& x, int u) {
    const int k = slot(u);
    const mark w0 = x.clock.now();
    double modeled = this->tr_.wait(this->combine_req_[k]);
    if constexpr (Hierarchical) modeled += fan_in(x, u);
    if constexpr (Backward) modeled += this->tr_.wait(this->gback_req_[k]);
    const mark w1 = x.clock.now();
    this->release_slot(k);
    const rank_counts& n = this->counts_[k];
    index_t rows = 0;
    for (int r = 0; r < this->w_.ranks; ++r)
      rows += (Hierarchical ? n.b_recv_n[r] : n.recv_n[r]) / this->w_.row_stride;
    this->combine_done(x, k, w0, w1, modeled, chunk_of_unit(x.plan, u), round_of_unit(x.plan, u),
                       rows, unit_bytes(k));
  }

 private:
  int slot(int u) const { return Units::windows ? u % this->slots_ : u; }

  // Unit c's shifts into its slot (windows of tokens), else none.
  unit_shifts shift_of(const dispatch_plan& p, int c) const {
    if constexpr (!Units::windows) {
      return {};
    } else {
      const index_t k = slot(c);
      const int R = this->w_.ranks;
      unit_shifts s;
      s.unique = k * R * this->w_.per_source - p.recv_unique_offsets[c * R];
      s.assign = k * this->w_.slot_assign - p.recv_offsets[p.block(c, 0, 0)];
      if constexpr (Hierarchical) {
        s.relay = k * this->w_.slot_relay - lv_.relay_first(c);
        s.fan = k * this->w_.slot_fan - lv_.fan_start(c);
      }
      return s;
    }
  }
  // Unit c's first row in the expert buffer (windows: one unit at a time, from row 0).
  index_t expert_first(const dispatch_plan& p, int c) const {
    return Units::windows ? 0 : p.expert_offsets[c * p.local_experts];
  }
  matrix_view<value_type> unit_expert_view(const dispatch_plan& p, int c) const {
    const int L = p.local_experts;
    return {this->x_expert_.data() + expert_first(p, c) * this->w_.row_stride,
            p.expert_offsets[(c + 1) * L] - p.expert_offsets[c * L], this->w_.hidden,
            this->w_.row_stride};
  }
  index_t unit_bytes(int k, bool dispatch = false) const {
    const rank_counts& n = this->counts_[k];
    if constexpr (Hierarchical)
      return this->crossing_bytes(n.a_recv_n, dispatch) +
             this->crossing_bytes(n.b_recv_n, dispatch);
    else
      return this->crossing_bytes(n.recv_n, dispatch);
  }

  // The verdict, then the receive plan: unique rows per (chunk, source), hierarchical the
  // relay's counts, each unit's fit and counts, the stats.
  int read(context& x) {
    dispatch_plan& p = x.plan;
    if (const int rejected = read_verdict(this->msg_recv_.host(), this->msg_); rejected >= 0)
      return rejected;
    const int R = this->w_.ranks, C = p.chunks, L = p.local_experts;
    this->read_block_counts(p);
    if constexpr (Hierarchical) lv_.clear_counts();
    for (int s = 0; s < R; ++s)
      for (int c = 0; c < C; ++c) {
        const index_t* m = this->chunk_from(s, c);
        p.recv_unique_counts[c * R + s] = m[2 * L];
        if constexpr (Hierarchical) lv_.read(s, c, this->me_, m, L);
      }
    build_recv_plan(p);
    // Hierarchical: rank e receives from each rank f of its node (local index g) the rows of
    // the sources f relays (local index g, node 0..N-1), so a chunk's unique rows are ordered
    // by the sources' (local index, node): each relay's rows are contiguous.
    int G = R, N = 1;
    if constexpr (Hierarchical) G = lv_.G, N = lv_.N;
    index_t at = 0;
    for (int c = 0; c < C; ++c)
      for (int g = 0; g < G; ++g)
        for (int n = 0; n < N; ++n) {
          const int b = c * R + n * G + g;
          p.recv_unique_offsets[b] = at;
          at += p.recv_unique_counts[b];
        }
    p.recv_unique_offsets[C * R] = at;
    bool relay_fits = true;
    if constexpr (Hierarchical) relay_fits = lv_.finish_counts(C);
    if constexpr (Units::windows) {
      // Every unit's rows must fit its slot (a peer that passed more tokens would not).
      index_t most = 0;
      for (int c = 0; c < C; ++c) {
        const index_t U = p.recv_unique_offsets[(c + 1) * R] - p.recv_unique_offsets[c * R];
        const index_t n = p.recv_offsets[p.block(c + 1, 0, 0)] - p.recv_offsets[p.block(c, 0, 0)];
        bool fits = U <= R * this->w_.per_source && n <= this->w_.slot_assign;
        if constexpr (Hierarchical) fits = fits && lv_.fits_slot(c);
        if (!fits) this->overflow(U);
        most = std::max(most, U);
      }
      x.stats.rounds = p.rounds;
      x.stats.peak_recv_rows = most;
    } else {
      if (!relay_fits) this->overflow(lv_relay_rows(C));
      if (p.recv_rows() > this->w_.recv_buffer_rows) this->overflow(p.recv_rows());
      for (int c = 0; c < C; ++c) set_rank_counts(p, c);
      x.stats.rounds = 1;
      x.stats.peak_recv_rows = p.recv_unique_offsets[C * R];
    }
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
    this->fill_comm_stats(x, true, !Hierarchical);
    if constexpr (Hierarchical) level_stats(x);
    return -1;
  }
  index_t lv_relay_rows(int C) const {
    if constexpr (Hierarchical)
      return lv_.relay_first(C);
    else
      return 0;
  }

  // The hierarchical levels' rows per link class and the exchanges' bytes (both levels).
  void level_stats(context& x) {
    const dispatch_plan& p = x.plan;
    pass_stats& st = x.stats;
    for (int c = 0; c < p.chunks; ++c) {
      if constexpr (Units::windows) set_rank_counts(p, c);  // (no unit is in flight yet)
      lv_.add_link_rows(this->counts_[slot(c)], this->me_, st);
    }
    this->add_link_row_bytes(st);
    const index_t row_bytes = this->value_row_bytes();
    st.dispatch_bytes_sent = st.intra_node.bytes_sent + st.inter_node.bytes_sent;
    st.dispatch_bytes_received = st.intra_node.bytes_received + st.inter_node.bytes_received;
    st.combine_bytes_sent = (st.intra_node.rows_received + st.inter_node.rows_received) * row_bytes;
    st.combine_bytes_received = (st.intra_node.rows_sent + st.inter_node.rows_sent) * row_bytes;
  }

  // Unit c's per-rank element counts and displacements: unique rows and the per-assignment
  // metadata (hierarchical: the rows go in two levels instead).
  void set_rank_counts(const dispatch_plan& p, int c) {
    const int R = this->w_.ranks;
    const index_t H = this->w_.row_stride;  // elements per row moved (the padding rides along)
    const unit_shifts sh = shift_of(p, c);
    rank_counts& n = this->counts_[slot(c)];
    for (int r = 0; r < R; ++r) {
      const int b = p.block(c, r, 0);
      n.send_n[r] = p.unique_counts[c * R + r] * H;
      n.send_d[r] = p.unique_offsets[c * R + r] * H;
      n.recv_n[r] = p.recv_unique_counts[c * R + r] * H;
      n.recv_d[r] = (p.recv_unique_offsets[c * R + r] + sh.unique) * H;
      n.meta_send_n[r] = p.send_rows_to(c, r);
      n.meta_send_d[r] = p.send_offsets[b];
      n.meta_recv_n[r] = p.recv_rows_from(c, r);
      n.meta_recv_d[r] = p.recv_offsets[b] + sh.assign;
    }
    if constexpr (Hierarchical) lv_.rank_counts_of(p, c, sh, this->me_, n);
  }

  // Hierarchical, unit c after its first level arrived: the copies to the node's ranks, the
  // second level, and its wait. Returns the link model's time.
  double fan_out(context& x, int c) {
    const int k = slot(c);
    const rank_counts& n = this->counts_[k];
    double modeled = this->tr_.wait(this->mask_req_[k]);
    lv_.fan_out(x.space, lv_.fan_of(c, shift_of(x.plan, c), Units::windows ? k : -1));
    if (this->w_.wire()) {
      const auto b = this->in_wire_bytes(k, 2, n.b_send_n, n.b_send_d, n.b_recv_n, n.b_recv_d);
      if constexpr (base::moves_bytes)
        start_at(exchange_level::node, this->dispatch_req_[k], lv_.q_fan.data(), b.sn, b.sd,
                 this->q_recv_.data(), b.rn, b.rd);
    } else {
      start_at(exchange_level::node, this->dispatch_req_[k], lv_.x_fan.data(), n.b_send_n,
               n.b_send_d, this->x_recv_.data(), n.b_recv_n, n.b_recv_d);
    }
    return modeled + this->tr_.wait(this->dispatch_req_[k]);
  }
  // Hierarchical, unit c after the node's ranks sent their sums back: each relay row = the
  // sum of its copies, then the first level in reverse, home.
  double fan_in(context& x, int c) {
    const int k = slot(c);
    const rank_counts& n = this->counts_[k];
    lv_.fan_in(x.space, lv_.fan_of(c, shift_of(x.plan, c), Units::windows ? k : -1));
    typename base::request back;
    start_at(exchange_level::cross, back, lv_.x_relay.data(), n.a_recv_n, n.a_recv_d, this->send_,
             n.a_send_n, n.a_send_d);
    return this->tr_.wait(back);
  }
  // An exchange of one level: on the comm's communicator of it when the comm's nodes are the
  // layer's, else over every rank (zero counts outside the level).
  template <class T>
  void start_at(exchange_level level, typename base::request& req, const T* send, const index_t* sn,
                const index_t* sd, T* recv, const index_t* rn, const index_t* rd) {
    if constexpr (requires { this->tr_.start(req, send, sn, sd, recv, rn, rd, level); })
      if (own_levels_) return this->tr_.start(req, send, sn, sd, recv, rn, rd, level);
    this->tr_.start(req, send, sn, sd, recv, rn, rd);
  }

  // Expert-major row of each received assignment of unit c <- its unique row. Indexed by the
  // receive row (in the unit's slot with windows), so a schedule may expand unit c + 1 before
  // unit c's sums.
  void expand_unique_rows(context& x, int c) {
    const dispatch_plan& p = x.plan;
    const index_t first = p.recv_offsets[p.block(c, 0, 0)];
    const index_t n = p.recv_offsets[p.block(c + 1, 0, 0)] - first;
    const index_t at = first + shift_of(p, c).assign;
    std::int32_t* key = sum_key_.data() + at;
    index_t* expert_row = sum_first_.data() + 2 * (this->w_.recv_assign_rows + 1) + at;
    x.space.for_each(n, exchange_ops::unique_of_row{x.dev.recv_offsets, x.dev.regroup_offsets,
                                                    x.dev.recv_unique_offsets, x.dev.expert_offsets,
                                                    meta_recv_.data() + at, c, this->w_.ranks,
                                                    p.local_experts, key, expert_row});
    if (this->w_.wire())
      x.space.for_each_row(n, this->w_.hidden,
                           wire_ops::expand_dequantise<value_type>{
                               key, expert_row, chunk_unique_wire(p, c), unit_expert_view(p, c)});
    else
      x.space.for_each_row(n, this->w_.hidden,
                           exchange_ops::expand_unique<value_type>{
                               key, expert_row, chunk_unique_view(p, c), unit_expert_view(p, c)});
  }

  // Each unique row of unit c = the sum of its assignments' expert outputs (`unweighted`:
  // backward, the weights went onto the dy rows), in the order they were received.
  void weighted_unique_sums(context& x, int c, bool unweighted) {
    const dispatch_plan& p = x.plan;
    const int R = this->w_.ranks;
    const index_t first = p.recv_offsets[p.block(c, 0, 0)];
    const index_t n = p.recv_offsets[p.block(c + 1, 0, 0)] - first;
    const index_t U = p.recv_unique_offsets[(c + 1) * R] - p.recv_unique_offsets[c * R];
    const index_t cap = this->w_.recv_assign_rows, at = first + shift_of(p, c).assign;
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
        U, this->w_.hidden,
        exchange_ops::weighted_unique_sum<value_type>{
            order, firsts, expert_row, meta_recv_.data() + at,
            this->const_view(unit_expert_view(p, c)), chunk_unique_view(p, c), unweighted});
  }

  matrix_view<value_type> chunk_unique_view(const dispatch_plan& p, int c) const {
    const int R = this->w_.ranks;
    const index_t u0 = p.recv_unique_offsets[c * R];
    return {this->x_recv_.data() + (u0 + shift_of(p, c).unique) * this->w_.row_stride,
            p.recv_unique_offsets[(c + 1) * R] - u0, this->w_.hidden, this->w_.row_stride};
  }

  // 8-bit rows: unit c's unique rows as they arrived (chunk_unique_view's rows, on the wire).
  matrix_view<const std::uint8_t> chunk_unique_wire(const dispatch_plan& p, int c) const {
    const int R = this->w_.ranks;
    const index_t u0 = p.recv_unique_offsets[c * R];
    return this->wire_view(
        this->q_recv_.data() + (u0 + shift_of(p, c).unique) * this->w_.wire_stride,
        p.recv_unique_offsets[(c + 1) * R] - u0);
  }

  [[no_unique_address]] levels_type lv_;
  bool own_levels_ = false;  // the comm runs each level on its own communicator
  typename base::template buffer<std::int64_t> meta_recv_;  // the received assignments' metadata
  typename base::template buffer<std::int32_t> sum_key_;    // [3][recv rows] keys, sorted, order
  typename base::template buffer<index_t> sum_first_;  // rows and first per unique row; expert rows
  typename base::template buffer<char> sum_sort_;
  typename base::template buffer<float> g_recv_, g_send_;  // backward: routing-weight gradients
};

}  // namespace epmoe
