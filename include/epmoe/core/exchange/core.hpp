// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/core/clock.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange/message.hpp"
#include "epmoe/core/exchange/wire.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/transport.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/core/workspace.hpp"

// What every exchange mode shares: the row buffers, the counts message and its verdict, the
// per-unit counts and requests, the slots a bounded mode claims, and the comm stats. A mode
// (flat.hpp, dedup.hpp) derives from it and adds its own unit layout and row format.
namespace epmoe {

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

/// counts()'s answer when the verdict is read after the pass (static shapes on a device).
inline constexpr int verdict_pending = -2;

/// Per-rank element counts and displacements of one unit's exchanges.
struct rank_counts {
  index_t *send_n, *send_d, *recv_n, *recv_d;
  index_t *meta_send_n, *meta_send_d, *meta_recv_n, *meta_recv_d;
  // Hierarchical: node rows to the peers (a) with their masks (m), fan rows in the node (b).
  index_t *a_send_n{}, *a_send_d{}, *a_recv_n{}, *a_recv_d{};
  index_t *m_send_n{}, *m_send_d{}, *m_recv_n{}, *m_recv_d{};
  index_t *b_send_n{}, *b_send_d{}, *b_recv_n{}, *b_recv_d{};
};

template <class Comm, class Space>
class exchange_core {
 public:
  using value_type = typename Space::value_type;
  using transport_type = transport<Comm, Space>;
  using context = exchange_context<Space>;
  using request = std::optional<typename transport_type::request>;
  template <class T>
  using buffer = typename Space::template buffer<T>;
  template <class T>
  using mirror = typename Space::template mirror<T>;
  using mark = typename pass_clock<Space>::mark;

  static constexpr bool async = transport_type::async;
  /// Whether the comm moves 8-bit rows (an all-to-all-v of std::uint8_t; a device space's
  /// transports move any element type).
  static constexpr bool moves_bytes =
      device_space<Space> ||
      requires(Comm & c, const std::uint8_t* s, std::uint8_t* r, const index_t* n) {
    c.alltoallv(s, n, n, r, n, n);
  };

  exchange_core() = default;
  /// `slots`: units whose counts and requests live at once; `arrays`: rank_counts arrays of a
  /// slot in use (8, or 20 with the hierarchical levels); `receive`: whether the mode uses the
  /// receive buffer (the low-latency mode receives into slots of its own).
  exchange_core(Comm& comm, const Space& space, const workspace_layout& w, int slots, int arrays,
                bool receive = true)
      : tr_(comm, space), w_(w), me_(comm.rank()), slots_(slots) {
    const index_t R = w.ranks, H = w.row_stride;
    x_send_ = space.template allocate<value_type>(w.send_rows * H);
    send_ = x_send_.data();
    if (receive) x_recv_ = space.template allocate<value_type>(w.recv_buffer_rows * H);
    x_expert_ = space.template allocate<value_type>(w.expert_rows * H);
    msg_ = {static_cast<int>(R), w.local_experts, w.chunks, w.ranks_per_node};
    msg_send_ = space.template allocate<index_t>(R * msg_.per_peer());
    msg_recv_ = space.template allocate_mirror<index_t>(R * msg_.per_peer());
    table_.assign(static_cast<std::size_t>(arrays * R * slots), 0);
    counts_.resize(static_cast<std::size_t>(slots));
    index_t* x = table_.data();
    for (rank_counts& k : counts_) {
      index_t** all[] = {&k.send_n,      &k.send_d,      &k.recv_n,      &k.recv_d,
                         &k.meta_send_n, &k.meta_send_d, &k.meta_recv_n, &k.meta_recv_d,
                         &k.a_send_n,    &k.a_send_d,    &k.a_recv_n,    &k.a_recv_d,
                         &k.m_send_n,    &k.m_send_d,    &k.m_recv_n,    &k.m_recv_d,
                         &k.b_send_n,    &k.b_send_d,    &k.b_recv_n,    &k.b_recv_d};
      for (int i = 0; i < arrays; ++i, x += R) *all[i] = x;
    }
    for (auto* r : requests()) r->resize(static_cast<std::size_t>(slots));
    busy_.assign(static_cast<std::size_t>(slots), 0);
    marks_.resize(static_cast<std::size_t>(4 * slots));
    if (w.wire()) {  // 8-bit rows: the dispatch's own buffers (the combine keeps the above)
      if (!moves_bytes)
        throw config_error("dispatch_rows", "int8",
                           "needs a comm with an all-to-all-v of std::uint8_t elements (this "
                           "comm policy moves float and int64 only)");
      q_tokens_ = space.template allocate<std::uint8_t>(w.tokens * w.wire_stride);
      q_send_ = space.template allocate<std::uint8_t>(w.send_rows * w.wire_stride);
      q_recv_ = space.template allocate<std::uint8_t>(w.recv_buffer_rows * w.wire_stride);
      wire_table_.assign(static_cast<std::size_t>(12 * R * slots), 0);
    }
  }

  /// Rows of the receive buffer (bounded: units in flight x ranks x per-pair quota rows).
  index_t receive_buffer_rows() const { return w_.recv_buffer_rows; }
  value_type* send_buffer() const { return send_; }
  /// A mode whose send rows live elsewhere (low latency: a comm's window) frees the buffer.
  void use_send_buffer(value_type* rows) {
    x_send_ = {};
    send_ = rows;
  }
  /// 8-bit rows: the tokens' wire rows [max_tokens] and the send buffer's [send rows], one
  /// wire stride apart (layout().wire_stride; nullptr without 8-bit rows).
  std::uint8_t* wire_tokens() const { return q_tokens_.data(); }
  std::uint8_t* wire_send_buffer() const { return q_send_.data(); }

  /// A call that moves no rows (reduce_gradients, gather_load, ...): the header alone, in the
  /// same exchange a pass's counts take. Returns the first rank that rejected its inputs, or
  /// -1; throws config_error on every rank when ranks make different calls.
  int agree(const Space& space, const call_header& h) {
    space.for_each(w_.ranks, exchange_ops::header_message{msg_, h, msg_send_.data()});
    tr_.alltoall(msg_send_.data(), msg_recv_.device(), msg_.per_peer());
    space.to_host(msg_recv_, 0, w_.ranks * msg_.per_peer());
    synchronize(space);
    return read_verdict(msg_recv_.host(), msg_);
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
    for (auto* reqs : requests())
      for (auto& r : *reqs) tr_.progress(r);
  }

 protected:
  // A pass that threw mid-way (a failed exchange) may have left slots or requests in use.
  void reset_units() {
    expert_owner_ = -1;
    std::fill(busy_.begin(), busy_.end(), 0);
    for (auto* reqs : requests())
      for (auto& r : *reqs) r.reset();
  }

  // The counts exchange, started: every rank's header and counts of the pass to every peer.
  void send_counts(context& x, const call_header& h, index_t quota) {
    const dispatch_plan& p = x.plan;
    reset_units();
    x.space.for_each(w_.ranks, exchange_ops::count_message{x.dev.send_counts, x.dev.send_valid,
                                                           x.dev.send_offsets, x.dev.unique_counts,
                                                           msg_, p.chunks, quota, h,
                                                           msg_send_.data(), x.dev.node_counts});
    tr_.alltoall(msg_send_.data(), msg_recv_.device(), msg_.per_peer());
    x.space.to_host(msg_recv_, 0, w_.ranks * msg_.per_peer());
  }
  // The counts exchange, waited for, on the clock (the modes whose verdict is never deferred).
  void exchange_counts(context& x, const call_header& h, index_t quota) {
    const mark t0 = x.clock.now();
    send_counts(x, h, quota);
    synchronize(x.space);
    const mark t1 = x.clock.now();
    x.clock.exchange(t0, t1, t1, t1, 0);
  }
  // The message from rank s, and its chunk c's counts.
  const index_t* message_from(int s) const { return msg_recv_.host() + s * msg_.per_peer(); }
  const index_t* chunk_from(int s, int c) const { return message_from(s) + msg_.chunk_at(c); }

  // Chunk c's blocks from every source into the receive plan (counts and real rows).
  void read_block_counts(dispatch_plan& p) const {
    const int L = p.local_experts;
    for (int s = 0; s < w_.ranks; ++s)
      for (int c = 0; c < p.chunks; ++c) {
        const index_t* m = chunk_from(s, c);
        for (int j = 0; j < L; ++j) {
          p.recv_counts[p.block(c, s, j)] = m[j];
          p.recv_valid[p.block(c, s, j)] = m[L + j];
        }
      }
  }

  // A bounded unit's receive slot; a schedule that keeps more units in flight than it
  // declared would overwrite one still in use.
  void claim_slot(int k) {
    if (busy_[static_cast<std::size_t>(k)])
      throw std::logic_error("epmoe: the schedule keeps more than " + std::to_string(slots_) +
                             " exchange rounds in flight; a receive bound (max_recv_rows) "
                             "sizes that many receive slots");
    busy_[static_cast<std::size_t>(k)] = 1;
  }
  void release_slot(int k) { busy_[static_cast<std::size_t>(k)] = 0; }
  // Bounded: the expert buffer holds one unit's rows at a time.
  void take_expert_buffer(int u) {
    if (expert_owner_ >= 0)
      throw std::logic_error(
          "epmoe: the schedule waited two dispatches before the first one's combine_start; a "
          "receive bound (max_recv_rows) keeps one round in the expert buffer at a time");
    expert_owner_ = u;
  }
  void release_expert_buffer() { expert_owner_ = -1; }

  [[noreturn]] void overflow(index_t rows) const {
    throw comm_error("epmoe: rank " + std::to_string(me_) + " would receive " +
                     std::to_string(rows) + " rows, more than its workspace (" +
                     std::to_string(w_.recv_buffer_rows) +
                     "); a peer passed more tokens than max_tokens?");
  }

  // Bytes of the rows (H elements each; the alignment padding is not counted) that crossed
  // to or from other ranks; `dispatch`: rows of the dispatch (8-bit rows: their wire bytes).
  index_t crossing_bytes(const index_t* n, bool dispatch = false) const {
    index_t e = 0;
    for (int r = 0; r < w_.ranks; ++r)
      if (r != me_) e += n[r];
    return e / w_.row_stride * (dispatch ? dispatch_row_bytes() : value_row_bytes());
  }
  index_t value_row_bytes() const { return w_.hidden * static_cast<index_t>(sizeof(value_type)); }
  index_t dispatch_row_bytes() const {
    return w_.dispatch_row_bytes(static_cast<index_t>(sizeof(value_type)));
  }

  // 8-bit rows: counts and displacements in rows of the activation type (row_stride elements
  // each) as bytes of wire rows, into slot k's set `set` (0: direct, 1: cross, 2: node) of
  // four arrays, which stay valid until the slot's next dispatch (what a started exchange
  // reads until its wait).
  struct wire_counts {
    const index_t *sn, *sd, *rn, *rd;
  };
  wire_counts in_wire_bytes(int k, int set, const index_t* sn, const index_t* sd, const index_t* rn,
                            const index_t* rd) {
    const int R = w_.ranks;
    index_t* out = wire_table_.data() + static_cast<std::size_t>((12 * k + 4 * set) * R);
    const index_t* in[4] = {sn, sd, rn, rd};
    for (int a = 0; a < 4; ++a)
      for (int r = 0; r < R; ++r) out[a * R + r] = in[a][r] / w_.row_stride * w_.wire_stride;
    return {out, out + R, out + 2 * R, out + 3 * R};
  }
  // Slot k's dispatch of rows over counts n (set 0): the activation type's rows, or with
  // 8-bit rows the wire buffers' at the same rows.
  void start_rows(int k, const rank_counts& n) {
    if (w_.wire()) {
      const wire_counts b = in_wire_bytes(k, 0, n.send_n, n.send_d, n.recv_n, n.recv_d);
      if constexpr (moves_bytes)
        tr_.start(dispatch_req_[k], q_send_.data(), b.sn, b.sd, q_recv_.data(), b.rn, b.rd);
    } else {
      tr_.start(dispatch_req_[k], send_, n.send_n, n.send_d, x_recv_.data(), n.recv_n, n.recv_d);
    }
  }
  // Wire rows of a buffer as a view (`rows` of them).
  matrix_view<std::uint8_t> wire_view(std::uint8_t* p, index_t rows) const {
    return {p, rows, w_.wire_row_bytes, w_.wire_stride};
  }
  // Blocks [b0, b1) of wire rows in `src` (rows at src_at[b], count[b] each, following one
  // another from host row `first`, `rows` in all) -> expert-buffer rows at dst_at[b],
  // dequantised.
  void dequantise_blocks(const Space& s, std::uint8_t* src, index_t src_rows, index_t first,
                         index_t rows, int b0, int b1, const index_t* src_at, const index_t* count,
                         const index_t* dst_at) const {
    if (b1 <= b0 || rows <= 0) return;
    s.for_each_row(
        rows, w_.hidden,
        wire_ops::dequantise_blocks<value_type>{wire_view(src, src_rows), src_at, count, dst_at, b0,
                                                b1 - b0, first, expert_view()});
  }

  // The counts' stats: rows and bytes per rank (`unique`: dedup's rows per (chunk, rank), else
  // every assignment's row), per link class (ranks of one node: w_.node_size) when the rows go
  // to each rank `direct`ly (the hierarchical levels count their own), rows per local expert.
  void fill_comm_stats(context& x, bool unique, bool direct = true) const {
    const dispatch_plan& p = x.plan;
    pass_stats& st = x.stats;
    const int R = w_.ranks, C = p.chunks;
    const index_t row_bytes = value_row_bytes(), wire_bytes = dispatch_row_bytes();
    const index_t meta_bytes = unique ? static_cast<index_t>(sizeof(std::int64_t)) : 0;
    index_t sent = 0, received = 0, meta_sent = 0, meta_received = 0;
    const int G = w_.node_size > 0 ? w_.node_size : R;
    st.ranks_per_node = G;
    st.intra_node = st.inter_node = {};
    for (int r = 0; r < R; ++r) {
      st.assignment_rows_sent[r] = p.send_rows_to(r);
      st.assignment_rows_received[r] = p.recv_rows_from(r);
      st.rows_sent[r] = st.assignment_rows_sent[r];
      st.rows_received[r] = st.assignment_rows_received[r];
      if (unique) {
        st.rows_sent[r] = st.rows_received[r] = 0;
        for (int c = 0; c < C; ++c) {
          st.rows_sent[r] += p.unique_counts[c * R + r];
          st.rows_received[r] += p.recv_unique_counts[c * R + r];
        }
      }
      if (r == me_) continue;
      sent += st.rows_sent[r];
      received += st.rows_received[r];
      meta_sent += st.assignment_rows_sent[r];
      meta_received += st.assignment_rows_received[r];
      link_traffic& l = r / G == me_ / G ? st.intra_node : st.inter_node;
      l.bytes_sent += st.assignment_rows_sent[r] * meta_bytes;
      l.bytes_received += st.assignment_rows_received[r] * meta_bytes;
      if (!direct) continue;
      l.rows_sent += st.rows_sent[r];
      l.rows_received += st.rows_received[r];
    }
    st.dispatch_bytes_sent = sent * wire_bytes + meta_sent * meta_bytes;
    st.dispatch_bytes_received = received * wire_bytes + meta_received * meta_bytes;
    st.rank_imbalance = imbalance::of(st.rows_sent);
    st.combine_bytes_sent = received * row_bytes;
    st.combine_bytes_received = sent * row_bytes;
    if (direct) add_link_row_bytes(st);
    for (int j = 0; j < p.local_experts; ++j) {
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

  // Each link class's bytes of the dispatch's rows, once its rows are counted.
  void add_link_row_bytes(pass_stats& st) const {
    const index_t row_bytes = dispatch_row_bytes();
    for (link_traffic* l : {&st.intra_node, &st.inter_node}) {
      l->bytes_sent += l->rows_sent * row_bytes;
      l->bytes_received += l->rows_received * row_bytes;
    }
  }

  // Slot k's dispatch of unit u: began at marks_[4k], its start returned at [4k+1]; its
  // combine [4k+2], [4k+3]. The exchange spans and timeline events of both.
  void dispatch_done(context& x, int k, mark w0, mark w1, double modeled) {
    x.clock.exchange(marks_[4 * k], marks_[4 * k + 1], w0, w1, modeled);
  }
  void dispatch_event(context& x, int k, int chunk, int round, index_t rows, index_t bytes) {
    x.clock.event(chunk, stage_kind::dispatch, round, rows, bytes, marks_[4 * k], x.clock.now());
  }
  void combine_done(context& x, int k, mark w0, mark w1, double modeled, int chunk, int round,
                    index_t rows, index_t bytes) {
    x.clock.exchange(marks_[4 * k + 2], marks_[4 * k + 3], w0, w1, modeled);
    x.clock.event(chunk, stage_kind::combine, round, rows, bytes, marks_[4 * k + 2], w1);
  }

  // Unit u's rows of every local expert, the plan's groups from expert-buffer row `first`.
  grouped_rows<value_type> plan_rows(const context& x, int u, index_t first) const {
    const int L = x.plan.local_experts;
    return {x_expert_.data() + first * w_.row_stride,
            w_.hidden,
            w_.row_stride,
            L,
            x.plan.expert_offsets + u * L,
            x.dev.expert_offsets + u * L,
            w_.align};
  }
  matrix_view<value_type> expert_view() const {
    return {x_expert_.data(), w_.expert_rows, w_.hidden, w_.row_stride};
  }
  static matrix_view<const value_type> const_view(matrix_view<value_type> v) { return v; }

  std::array<std::vector<request>*, 5> requests() {
    return {&dispatch_req_, &meta_req_, &combine_req_, &gback_req_, &mask_req_};
  }

  transport_type tr_{};
  workspace_layout w_{};
  int me_ = 0;
  int slots_ = 1;
  buffer<value_type> x_send_, x_recv_, x_expert_;
  value_type* send_ = nullptr;  // x_send_, or a mode's own (low latency: a comm's window)
  buffer<std::uint8_t> q_tokens_, q_send_, q_recv_;  // 8-bit rows: tokens, send, receive
  std::vector<index_t> wire_table_;                  // [slots][12][R]: in_wire_bytes' arrays
  message_layout msg_{};
  buffer<index_t> msg_send_;
  mirror<index_t> msg_recv_;
  std::vector<index_t> table_;       // every slot's rank_counts arrays
  std::vector<rank_counts> counts_;  // [slots]
  std::vector<request> dispatch_req_, meta_req_, combine_req_,
      gback_req_,            // dedup backward's routing-weight gradients
      mask_req_;             // hierarchical: the node rows' masks
  std::vector<mark> marks_;  // [4 * slots]: each slot's dispatch and combine, begun / started
  std::vector<char> busy_;   // bounded: the receive slots in use
  int expert_owner_ = -1;    // bounded: the unit whose rows are in the expert buffer
};

}  // namespace epmoe
