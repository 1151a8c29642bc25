// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epmoe/core/exchange/core.hpp"
#include "epmoe/core/exchange/low_latency_ops.hpp"

// The low-latency exchange (layer_options::low_latency, docs/decode.md): every (source,
// destination) pair owns a fixed slot of S = from_one_rank rows (min(T*min(K, L), L * the
// capacity's rows per expert): the most rows one source can send one rank in a pass), after a
// head of whole rows that carries the call header and the pair's rows per local expert. The
// dispatch is ONE exchange of the slots (no counts round: the counts ride in the heads; a
// rank that rejected its inputs sends its head with no rows, and every rank reads every
// verdict before the experts run), the combine one back. The rows' tokens and
// weights never leave home: a slot's rows are sorted by local expert, so its per-expert
// counts name every row's expert, and the combine returns each row to the slot position it
// left from, where the home's plan finds it. How the slots move, by comm (host memory):
// - windows (puts: comm::threads, and comm::mpi when its ranks share a node): the receive
//   slots and the send buffer live in the comm's windows; each rank writes its head and used
//   rows straight into the peers' receive slots, and its outputs straight into the home's
//   send buffer rows (the head names them), then meets the others once per direction; the
//   writes hold the comm's put guard (comm::threads: a peer that gave up leaves only after
//   they land; both: a rank that wakes late writes nothing);
// - comm::mpi across nodes (at most): one round of MPI_Isend / MPI_Irecv, each receive posted
//   for the whole slot and each message only its head and used rows (a collective must
//   receive what is sent, point-to-point may receive less), posted (post_at_most) and waited
//   under the deadline in the wait call (posts);
// - comm::nccl (comm_slots): both sides of slots in NCCL's memory, moved by the comm: a kernel
//   that stores each slot into the peer's window and flags it (one NVLink domain), else
//   grouped ncclSend/ncclRecv of registered buffers (comm/nccl_slots.cuh);
// - any other comm (comm::any and torch.distributed, throttled, local, a device space): the
//   comm's all-to-all of whole slots, on the host posted where the comm has a non-blocking
//   one (posts).
// A posted round is waited for in the wait call, and a split start (defer) returns with its
// dispatch on the wire: the heads are read in wait_dispatch, the verdict after the pass
// (resolve), and a pass some rank rejected receives no rows and writes no y.
namespace epmoe {

/// One unit per pass (one chunk, no receive bound), one all-to-all per direction; the verdict
/// of every rank arrives with the rows, so counts() is the dispatch itself.
template <class Comm, class Space>
class low_latency_exchange : public exchange_core<Comm, Space> {
  using base = exchange_core<Comm, Space>;

 public:
  using typename base::context;
  using typename base::mark;
  using typename base::value_type;

  /// Whether the comm opens windows, memory every rank writes into (comm::threads, comm::mpi;
  /// host memory): windows() says whether it did.
  static constexpr bool puts = !device_space<Space> && requires(Comm & c, std::size_t n) {
    c.open_window(n).peers[0];
    c.put();
    c.barrier();
  };
  /// Whether it exchanges messages shorter than their receives, posted then waited for
  /// (comm::mpi on the host: across nodes, where it opens no window).
  static constexpr bool at_most =
      !device_space<Space> &&
      requires(Comm & c, const value_type* s, value_type* r, const index_t* n) {
    c.post_at_most(s, n, n, r, n, n);
    c.wait_at_most();
  };

  /// Whether the comm posts its meeting too (comm::mpi): with windows, a split start returns
  /// with its dispatch's meeting posted, and each meeting is waited for in the wait call.
  static constexpr bool posts_meeting = puts && requires(Comm & c) {
    c.post_barrier();
    c.wait_barrier();
  };
  /// Whether each round is posted and waited for in the wait call: comm::mpi's messages, or
  /// the comm's non-blocking all-to-all of whole slots (comm::throttled, comm::any and
  /// torch.distributed). A deferred dispatch (a split start) then returns with its round on
  /// the wire, and wait_dispatch reads the heads.
  static constexpr bool posts = !device_space<Space> && (at_most || base::async);
  /// Whether the comm gives the slots memory of its own and moves them itself (comm::nccl:
  /// NCCL windows a kernel stores into, or buffers registered with the communicator).
  static constexpr bool comm_slots = device_space<Space> && requires(Comm & c, std::size_t n) {
    c.open_slots(n).template data<value_type>(0);
  };

  low_latency_exchange(Comm& comm, const Space& space, const workspace_layout& w)
      : base(comm, space, w, 1, 8, false), comm_(&comm) {
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
    const index_t slots = R * slot_rows_ * w.row_stride;
    if constexpr (puts) {  // collective: every rank builds its layer's exchange here
      const auto bytes = [](index_t n) { return static_cast<std::size_t>(n) * sizeof(value_type); };
      to_recv_ = comm.open_window(bytes(slots));
      windows_ = !to_recv_.peers.empty();
      if (windows_) {
        to_send_ = comm.open_window(bytes(w.send_rows * w.row_stride));
        this->use_send_buffer(reinterpret_cast<value_type*>(to_send_.peers[this->me_]));
      }
    }
    if constexpr (comm_slots) {
      slots_ = comm.open_slots(static_cast<std::size_t>(slots) * sizeof(value_type));
    } else if (!windows()) {
      if constexpr (!at_most)  // (messages go from the send buffer)
        slots_send_ = space.template allocate<value_type>(slots);
      slots_recv_ = space.template allocate_mirror<value_type>(slots);
    }
    at_ = space.template allocate_mirror<index_t>(2 * R * L);
    sizes_.assign(static_cast<std::size_t>(4 * R), 0);
  }

  /// Whether the slots move by writes into the comm's windows (comm::threads; comm::mpi when
  /// its ranks share one node), else by its messages or all-to-all.
  bool windows() const {
    if constexpr (!puts)
      return false;
    else if constexpr (!at_most)
      return true;
    else
      return windows_;
  }

  /// Elements of one (source, destination) slot: its head and S rows, at the row stride.
  index_t slot_elements() const { return slot_rows_ * this->w_.row_stride; }
  /// Bytes one rank's slot buffers take: R slots to receive, and R to send unless the comm
  /// takes puts or messages (they go from the send buffer).
  index_t slot_buffer_bytes() const {
    return (puts || at_most ? 1 : 2) * index_t{this->w_.ranks} * slot_elements() *
           static_cast<index_t>(sizeof(value_type));
  }

  int units(const dispatch_plan&) const { return 1; }
  int chunk_of_unit(const dispatch_plan&, int) const { return 0; }
  int round_of_unit(const dispatch_plan&, int) const { return 0; }

  /// The dispatch: the heads and the permuted rows into the send slots, one fixed-size
  /// all-to-all, every rank's header read from the received heads. Returns the first rank
  /// that rejected its inputs (its slots carry no rows), or -1; throws config_error on every
  /// rank when ranks make different calls. With `defer` on a comm that posts (a split start),
  /// the round is posted and verdict_pending returned: wait_dispatch reads the heads, and
  /// resolve() the verdict after the pass (the reduce writes y only if every rank accepted).
  int counts(context& x, const call_header& h, index_t, bool defer) {
    dispatch_plan& p = x.plan;
    const workspace_layout& w = this->w_;
    const int R = w.ranks, L = p.local_experts;
    const index_t P = this->msg_.per_peer(), E = slot_elements();
    const mark t0 = x.clock.now();
    this->reset_units();
    req_.reset();  // (a pass that failed mid-way may have left its round)
    pending_ = false, verdict_ = -1, mismatch_ = nullptr;
    x.space.for_each(
        R, exchange_ops::count_message{x.dev.send_counts, x.dev.send_valid, x.dev.send_offsets,
                                       nullptr, this->msg_, 1, 0, h, this->msg_send_.data()});
    if constexpr (puts || at_most)  // the row of this rank's send buffer the peer's rows return to
      for (int r = 0; r < R; ++r)
        this->msg_send_.data()[r * P + this->msg_.chunk_at(0) + 2 * L] = p.send_offsets[r * L];
    x.space.for_each(index_t{R} * L, exchange_ops::slot_rows_of{x.dev.send_offsets, L, slot_rows_,
                                                                head_rows_, at_.device()});
    const index_t stride = w.row_stride, me = this->me_;
    if (windows()) {  // the head and the used rows straight into each peer's slot
      if constexpr (puts) {
        const std::size_t row = static_cast<std::size_t>(stride) * sizeof(value_type);
        {
          const auto writing = comm_->put();  // released before the meeting
          for (int r = 0; r < R; ++r) {
            std::byte* at =
                to_recv_.peers[r] + static_cast<std::size_t>(me * E) * sizeof(value_type);
            std::memcpy(at, this->msg_send_.data() + r * P,
                        static_cast<std::size_t>(P) * sizeof(index_t));
            // (its own rows stay in the send buffer: wait_dispatch reads them there)
            if (const index_t n = p.send_rows_to(0, r); n > 0 && r != me)
              std::memcpy(at + head_rows_ * row,
                          this->send_buffer() + p.send_offsets[r * L] * stride,
                          static_cast<std::size_t>(n) * row);
          }
        }
        if constexpr (posts_meeting) {
          this->marks_[0] = t0;
          comm_->post_barrier();
          this->marks_[1] = x.clock.now();
          if (defer) {
            pending_ = true;
            return verdict_pending;
          }
          comm_->wait_barrier();
          this->dispatch_done(x, 0, this->marks_[1], x.clock.now(), 0);
        } else {
          comm_->barrier();
        }
      }
    } else {
      if constexpr (!at_most) {  // whole slots: heads and rows into the send slots
        x.space.for_each(
            R, exchange_ops::slot_head<value_type>{this->msg_send_.data(), P, send_slots(), E});
        copy_rows(x, send_view(p), slots_view(send_slots()), x.dev.send_offsets, at_.device(),
                  x.dev.send_counts);
      }
      if constexpr (posts) {
        this->marks_[0] = t0;
        if constexpr (at_most)
          post_heads_and_rows(p);
        else
          post(send_slots(), recv_slots());
        this->marks_[1] = x.clock.now();
        if (defer) {
          pending_ = true;
          return verdict_pending;
        }
        const double modeled = wait_round();
        this->dispatch_done(x, 0, this->marks_[1], x.clock.now(), modeled);
      } else {
        move_slots(x, 0, E);
      }
    }
    return arrived(x, t0);
  }
  /// A deferred dispatch's verdict (after wait_dispatch): the first rank that rejected its
  /// inputs, or -1; config_error on every rank when ranks made different calls.
  int resolve(context&) {
    if (mismatch_) std::rethrow_exception(std::exchange(mismatch_, nullptr));
    return verdict_;
  }
  /// Every rank's call header (a deferred pass's reduce writes y only if all agree).
  const index_t* verdicts() const { return this->msg_recv_.host(); }
  index_t verdict_stride() const { return this->msg_.per_peer(); }

 private:
  // The received heads to the host: every rank's header and counts, the verdict, the receive
  // plan and the pass's exchange stats. Returns the verdict (throws on different calls).
  int arrived(context& x, mark t0) {
    dispatch_plan& p = x.plan;
    const workspace_layout& w = this->w_;
    const int R = w.ranks, L = p.local_experts;
    const index_t P = this->msg_.per_peer(), E = slot_elements();
    if (!windows()) {
      for (int r = 0; r < R; ++r)
        if constexpr (comm_slots)
          slots_.to_host(sizeof(value_type) * r * E, sizeof(value_type) * head_elements(),
                         x.space.stream());
        else
          x.space.to_host(slots_recv_, r * E, head_elements());
      this->synchronize(x.space);
    }
    for (int r = 0; r < R; ++r)
      std::memcpy(this->msg_recv_.host() + r * P, recv_host() + r * E,
                  static_cast<std::size_t>(P) * sizeof(index_t));
    if (!posted()) {  // (posted: dispatch_done noted the round)
      const mark t1 = x.clock.now();
      x.clock.exchange(t0, t1, t1, t1, 0);
    }
    int rejected = -1;
    try {
      rejected = read_verdict(this->msg_recv_.host(), this->msg_);
    } catch (...) {
      settle();
      throw;
    }
    if (rejected >= 0) {
      settle();
      return rejected;
    }
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
    if constexpr (puts || at_most) {  // the used rows, and a head per peer with the dispatch
      const index_t heads = (R - 1) * P * static_cast<index_t>(sizeof(index_t));
      st.dispatch_bytes_sent += heads;
      st.dispatch_bytes_received += heads;
    } else {  // every slot to every other rank moves whole, whatever its rows
      const index_t moved = (R - 1) * E * static_cast<index_t>(sizeof(value_type));
      st.dispatch_bytes_sent = st.dispatch_bytes_received = moved;
      st.combine_bytes_sent = st.combine_bytes_received = moved;
    }
    return -1;
  }
  // Completes the posted round; the link model's seconds where the comm has one.
  double wait_round() {
    if (windows()) {
      if constexpr (posts_meeting) comm_->wait_barrier();
      return 0;
    }
    if constexpr (at_most) {
      comm_->wait_at_most();
      return 0;
    } else {
      return this->tr_.wait(req_);
    }
  }
  // comm::mpi: one round of two parts, each peer's head (its counts message) and its used
  // rows, sent from where they lie (the counts messages, the permuted send buffer: no copy
  // into a send slot) into the peer's receive slot; each receive is the whole slot. This
  // rank's own slot is copied, not messaged.
  void post_heads_and_rows(const dispatch_plan& p) {
    const int R = this->w_.ranks, L = p.local_experts, me = this->me_;
    const index_t P = this->msg_.per_peer(), E = slot_elements(), stride = this->w_.row_stride;
    const index_t head = P * static_cast<index_t>(sizeof(index_t));
    const index_t row0 = head_rows_ * stride;  // a slot's first row, in elements
    value_type* recv = recv_slots();
    const value_type* rows = this->send_buffer();
    index_t* n = sizes_.data();
    for (int r = 0; r < R; ++r) {  // the heads, in bytes
      n[r] = n[2 * R + r] = head;
      n[R + r] = r * head;
      n[3 * R + r] = r * E * static_cast<index_t>(sizeof(value_type));
    }
    std::memcpy(recv + me * E, this->msg_send_.data() + me * P, static_cast<std::size_t>(head));
    n[me] = n[2 * R + me] = 0;
    comm_->post_at_most(reinterpret_cast<const std::byte*>(this->msg_send_.data()), n, n + R,
                        reinterpret_cast<std::byte*>(recv), n + 2 * R, n + 3 * R);
    for (int r = 0; r < R; ++r) {  // the rows, in elements
      n[r] = p.send_rows_to(0, r) * stride;
      n[R + r] = p.send_offsets[r * L] * stride;
      n[2 * R + r] = E - row0;
      n[3 * R + r] = r * E + row0;
    }
    n[me] = n[2 * R + me] = 0;  // (its own rows stay in the send buffer)
    comm_->post_at_most(rows, n, n + R, recv, n + 2 * R, n + 3 * R);
  }
  // Every rank's slots as one all-to-all of whole slots, started (waited in the wait call).
  void post(value_type* send, value_type* recv) {
    const int R = this->w_.ranks;
    const index_t E = slot_elements();
    index_t* n = sizes_.data();
    for (int r = 0; r < R; ++r) n[r] = n[2 * R + r] = E, n[R + r] = n[3 * R + r] = r * E;
    this->tr_.start(req_, send, n, n + R, recv, n + 2 * R, n + 3 * R);
  }

 public:
  /// The rows arrived with counts(), or (deferred) arrive here: the verdict is kept for
  /// resolve(), and a pass some rank rejected (or called differently) receives no rows. The
  /// dispatch stage regroups them by local expert.
  void start_dispatch(context&, int) {}
  void wait_dispatch(context& x, int) {
    if constexpr (posts || posts_meeting)
      if (std::exchange(pending_, false)) {
        const mark w0 = x.clock.now();
        const double modeled = wait_round();
        this->dispatch_done(x, 0, w0, x.clock.now(), modeled);
        try {
          verdict_ = arrived(x, w0);
        } catch (const config_error&) {
          mismatch_ = std::current_exception();
          verdict_ = 0;
        }
        if (verdict_ >= 0) empty_receive(x);
      }
    const mark a = x.clock.now();
    const dispatch_plan& p = x.plan;
    if (windows() || at_most) {  // this rank's own rows never left its send buffer
      const index_t L = p.local_experts, first = this->me_ * L, n = this->w_.ranks * L;
      const auto slots = [&](index_t b, index_t e) {
        x.space.copy_blocks(matrix_view<const value_type>(slots_view(recv_slots())),
                            this->expert_view(), e - b, recv_at_device() + b,
                            x.dev.regroup_offsets + b, x.dev.recv_counts + b);
      };
      slots(0, first);
      x.space.copy_blocks(matrix_view<const value_type>(send_view(p)), this->expert_view(), L,
                          x.dev.send_offsets + first, x.dev.regroup_offsets + first,
                          x.dev.recv_counts + first);
      slots(first + L, n);
    } else {
      copy_rows(x, slots_view(recv_slots()), this->expert_view(), recv_at_device(),
                x.dev.regroup_offsets, x.dev.recv_counts);
    }
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
    const dispatch_plan& p = x.plan;
    const int R = this->w_.ranks, L = p.local_experts;
    const index_t stride = this->w_.row_stride, P = this->msg_.per_peer(), me = this->me_;
    if (windows()) {  // each output row straight into its home's send-buffer row
      if constexpr (puts) {
        const std::size_t row = static_cast<std::size_t>(stride) * sizeof(value_type);
        {
          const auto writing = comm_->put();  // released before the meeting
          for (int q = 0; q < R; ++q) {
            const index_t home = this->msg_recv_.host()[q * P + this->msg_.chunk_at(0) + 2 * L];
            for (int j = 0; j < L; ++j) {
              const int b = p.block(0, q, j);
              if (p.recv_counts[b] == 0) continue;
              const index_t at = home + p.recv_offsets[b] - p.recv_offsets[q * L];  // home row
              std::memcpy(to_send_.peers[q] + static_cast<std::size_t>(at) * row,
                          this->x_expert_.data() + p.regroup_offsets[b] * stride,
                          static_cast<std::size_t>(p.recv_counts[b]) * row);
            }
          }
        }
        if constexpr (posts_meeting)
          comm_->post_barrier();  // (waited for in wait_combine)
        else
          comm_->barrier();
      }
    } else {
      copy_rows(x, this->const_view(this->expert_view()), slots_view(recv_slots()),
                x.dev.regroup_offsets, recv_at_device(), x.dev.recv_counts);
      if constexpr (at_most) {  // each peer's rows back, received straight into the send buffer
        index_t* n = sizes_.data();
        for (int r = 0; r < R; ++r) {
          n[r] = p.recv_rows_from(0, r) * stride;
          n[R + r] = (r * slot_rows_ + head_rows_) * stride;
          n[2 * R + r] = p.send_rows_to(0, r) * stride;
          n[3 * R + r] = p.send_offsets[r * L] * stride;
        }
        std::memcpy(this->send_buffer() + n[3 * R + me], recv_slots() + n[R + me],
                    static_cast<std::size_t>(n[me]) * sizeof(value_type));  // its own rows
        n[me] = n[2 * R + me] = 0;
        comm_->post_at_most(recv_slots(), n, n + R, this->send_buffer(), n + 2 * R, n + 3 * R);
      } else if constexpr (posts) {
        post(recv_slots(), send_slots());
      } else {
        move_slots(x, 1, slot_elements());
      }
    }
    this->marks_[3] = x.clock.now();
  }
  /// Each row from its send slot back to its send-buffer row, where the reduce reads it.
  template <bool Backward>
  void wait_combine(context& x, int) {
    const mark w0 = x.clock.now();
    const dispatch_plan& p = x.plan;
    double modeled = 0;
    if constexpr (posts || posts_meeting)
      if (posted()) modeled = wait_round();
    if constexpr (!puts && !at_most)  // the rows from their slots to their send-buffer rows
      copy_rows(x, this->const_view(slots_view(send_slots())), send_view(p), at_.device(),
                x.dev.send_offsets, x.dev.send_counts);
    this->combine_done(x, 0, w0, x.clock.now(), modeled, 0, 0, p.send_rows(),
                       x.stats.combine_bytes_received);
  }

 private:
  // A pass that stops after the dispatch (rejected inputs, different calls): with puts, every
  // rank has read its heads before any rank's next dispatch writes them again.
  void settle() {
    if constexpr (puts)
      if (windows()) comm_->barrier();
  }
  // The receive slots (in this rank's window, or the slot buffer) and their host copy.
  value_type* recv_slots() const {
    if constexpr (comm_slots) return slots_.template data<value_type>(1);
    if constexpr (puts)
      if (windows()) return reinterpret_cast<value_type*>(to_recv_.peers[this->me_]);
    return slots_recv_.device();
  }
  const value_type* recv_host() const {
    if constexpr (comm_slots) return slots_.template host<value_type>();
    if constexpr (puts)
      if (windows()) return recv_slots();
    return slots_recv_.host();
  }
  value_type* send_slots() const {
    if constexpr (comm_slots) return slots_.template data<value_type>(0);
    return slots_send_.data();
  }
  // Side `from`'s slots (0: send, 1: receive) to the peers' other side, n elements a slot.
  void move_slots(context& x, int from, index_t n) {
    if constexpr (comm_slots)
      slots_.alltoall(from, static_cast<std::size_t>(n) * sizeof(value_type), x.space.stream(),
                      *comm_);
    else if (from == 0)
      this->tr_.alltoall(send_slots(), recv_slots(), n);
    else
      this->tr_.alltoall(recv_slots(), send_slots(), n);
  }
  // Whether the rounds are posted and waited for in the wait calls.
  bool posted() const { return windows() ? posts_meeting : posts; }
  index_t head_elements() const { return head_rows_ * this->w_.row_stride; }
  const index_t* recv_at_device() const {
    return at_.device() + index_t{this->w_.ranks} * this->w_.local_experts;
  }
  matrix_view<value_type> slots_view(value_type* s) const {
    return {s, this->w_.ranks * slot_rows_, this->w_.hidden, this->w_.row_stride};
  }
  matrix_view<value_type> send_view(const dispatch_plan& p) const {
    return {this->send_buffer(), p.send_rows(), this->w_.hidden, this->w_.row_stride};
  }
  // The R*L blocks of the pass: count[b] rows from src row src_at[b] to dst row dst_at[b].
  template <class Src>
  void copy_rows(context& x, Src src, matrix_view<value_type> dst, const index_t* src_at,
                 const index_t* dst_at, const index_t* count) const {
    x.space.copy_blocks(matrix_view<const value_type>(src), dst,
                        index_t{this->w_.ranks} * this->w_.local_experts, src_at, dst_at, count);
  }

  // A pass some rank rejected: no rows received (y is not written: the verdicts mask it).
  void empty_receive(context& x) {
    dispatch_plan& p = x.plan;
    const index_t P = this->msg_.per_peer();
    for (int r = 0; r < this->w_.ranks; ++r)
      std::fill_n(this->msg_recv_.host() + r * P + this->msg_.chunk_at(0), 2 * p.local_experts,
                  index_t{0});
    this->read_block_counts(p);
    build_recv_plan(p);
    x.space.to_device(x.recv_blocks, 0, x.recv_blocks.size());
  }

  Comm* comm_;
  typename base::request req_;   // posts: the slots' round in flight
  bool pending_ = false;         // posts: a deferred dispatch waits in wait_dispatch
  int verdict_ = -1;             // a deferred dispatch's verdict
  std::exception_ptr mismatch_;  // ... or the different calls it found
  std::vector<index_t> sizes_;   // at most: [4][R] counts and displacements of one exchange
  typename detail::window_of<Comm, puts>::type to_recv_{}, to_send_{};  // puts: the receive
                                                                        // slots, the send rows
  bool windows_ = false;   // puts: the comm opened them (comm::mpi: its ranks share a node)
  index_t head_rows_ = 0;  // rows of a slot's head (the counts message to one peer)
  index_t slot_rows_ = 0;  // head + S rows
  typename detail::slots_of<Comm, comm_slots>::type slots_{};  // comm_slots: both sides
  typename base::template buffer<value_type> slots_send_;
  typename base::template mirror<value_type> slots_recv_;
  typename base::template mirror<index_t> at_;  // [2][R*L]: each block's first slot row, send
                                                // then receive side
};

}  // namespace epmoe
