// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"

// The exchange engine of moe_layer: the counts all-to-all, then per unit (a chunk, or with a
// receive bound one round of a chunk) the dispatch all-to-all, the regroup to expert-major,
// the reverse regroup and the combine all-to-all; dedup's expansion and weighted sum; and the
// comm stats. The layer drives it stage by stage (see docs/architecture.md).
namespace epmoe::detail {

/// The request type of a comm's ialltoallv (int for a comm without one).
template <class Comm, bool Async>
struct request_of {
  using type = int;
};
template <class Comm>
struct request_of<Comm, true> {
  using type = decltype(std::declval<Comm&>().ialltoallv(
      std::declval<const float*>(), std::declval<const index_t*>(), std::declval<const index_t*>(),
      std::declval<float*>(), std::declval<const index_t*>(), std::declval<const index_t*>()));
};

template <class Comm, class Space, bool Dedup>
class exchange {
 public:
  using clock = std::chrono::steady_clock;
  template <class T>
  using buffer = typename Space::template buffer<T>;

  /// Whether the comm can start an exchange and wait for it later (ialltoallv).
  static constexpr bool async = requires(Comm & c, const float* s, float* r, const index_t* n) {
    c.ialltoallv(s, n, n, r, n, n).wait();
  };
  using request_type = typename request_of<Comm, async>::type;

  /// What the workspace is sized from (rows; all fixed at construction).
  struct shape {
    int ranks = 1;
    int local_experts = 1;
    int chunks_max = 1;
    index_t hidden = 0;
    index_t send_rows = 0;      // the send buffer: every assignment row of a pass
    index_t recv_rows = 0;      // unbounded: the receive buffer of a whole pass
    index_t from_one_rank = 0;  // most rows one source can send this rank in a pass
    index_t bound = 0;          // config max_recv_rows (0: unbounded)
    int live_units = 1;         // units a schedule keeps in flight (bounded: receive slots)
    index_t max_rounds = 1;     // most rounds one chunk can need (bounded), sizes the timeline
  };

  void bind(Comm* comm, Space* space, dispatch_plan* plan, pass_stats* stats,
            const clock::time_point* pass_start) {
    comm_ = comm;
    space_ = space;
    plan_ = plan;
    stats_ = stats;
    pass_start_ = pass_start;
  }

  void allocate(const shape& s, std::int64_t* meta_recv) {
    s_ = s;
    const index_t R = s.ranks, L = s.local_experts, C = s.chunks_max, H = s.hidden;
    bounded_ = s.bound > 0;
    // Bounded: every (source, destination) pair moves at most `quota_` rows per round, and a
    // receive slot holds one round from every source; `live_units` slots are in flight.
    quota_ = bounded_ ? std::max<index_t>(1, s.bound / (R * s.live_units)) : 0;
    per_source_ = bounded_ ? std::min(quota_, s.from_one_rank) : 0;
    slot_rows_ = R * per_source_;
    slots_ = bounded_ ? s.live_units : static_cast<int>(C);
    const index_t recv_rows = bounded_ ? slots_ * slot_rows_ : s.recv_rows;
    const index_t expert_rows = bounded_ ? slot_rows_ : s.recv_rows;
    x_send_ = space_->template allocate<float>(s.send_rows * H);
    x_recv_ = space_->template allocate<float>(recv_rows * H);
    x_expert_ = space_->template allocate<float>(expert_rows * H);
    recv_capacity_ = recv_rows;
    expert_capacity_ = expert_rows;
    meta_recv_ = meta_recv;
    const index_t P = counts_per_peer(C);
    const index_t S = slots_;
    counts_ = space_->template allocate<index_t>(2 * R * P + 8 * R * S + (C + 1) +
                                                 (bounded_ ? S * (3 * R * L + L + 1) : 0));
    index_t* x = counts_.data() + 2 * R * P;
    ex_.resize(static_cast<std::size_t>(S));
    for (index_t c = 0; c < S; ++c, x += 8 * R)
      ex_[c] = {x, x + R, x + 2 * R, x + 3 * R, x + 4 * R, x + 5 * R, x + 6 * R, x + 7 * R};
    first_unit_ = x;
    x += C + 1;
    units_.assign(static_cast<std::size_t>(S), unit_state{});
    for (auto& u : units_)
      if (bounded_) {
        u.count = x, u.recv = x + R * L, u.regroup = x + 2 * R * L, u.expert = x + 3 * R * L;
        x += 3 * R * L + L + 1;
      }
    if constexpr (async) {
      dispatch_req_.resize(static_cast<std::size_t>(S));
      meta_req_.resize(static_cast<std::size_t>(S));
      combine_req_.resize(static_cast<std::size_t>(S));
    }
    event_start_.resize(static_cast<std::size_t>(2 * S));
    stats_->timeline.reserve(static_cast<std::size_t>(3 * C * (bounded_ ? s.max_rounds : 1)));
    stats_->recv_buffer_rows = recv_rows;
  }

  bool bounded() const { return bounded_; }
  /// Rows of the receive buffer (bounded: live_units slots of ranks * per-pair quota rows).
  index_t receive_buffer_rows() const { return recv_capacity_; }
  /// Rows every (source, destination) pair moves per round (0: unbounded, one round).
  index_t quota() const { return quota_; }
  /// Units of the pass: its chunks, or with a bound every round of every chunk.
  int units() const {
    return bounded_ ? static_cast<int>(first_unit_[plan_->chunks]) : plan_->chunks;
  }
  int chunk_of_unit(int u) const {
    if (!bounded_) return u;
    return static_cast<int>(std::upper_bound(first_unit_, first_unit_ + plan_->chunks + 1, u) -
                            first_unit_) -
           1;
  }
  int round_of_unit(int u) const {
    return bounded_ ? u - static_cast<int>(first_unit_[chunk_of_unit(u)]) : 0;
  }

  matrix_view<float> send_view(index_t rows) const { return {x_send_.data(), rows, s_.hidden}; }
  index_t unique_send_rows() const { return plan_->unique_offsets[plan_->chunks * s_.ranks]; }

  /// The counts all-to-all: every rank learns the rows it will receive per (chunk, source,
  /// local slot), whether every rank accepted its inputs (`valid`), and with a bound the
  /// rounds each chunk takes (the most any pair needs, the same on every rank). Returns the
  /// first rank that rejected its inputs, or -1; then no row moved and the caller throws.
  int counts(bool valid) {
    dispatch_plan& p = *plan_;
    const int R = s_.ranks, L = p.local_experts, C = p.chunks, W = 2 * L + 1;
    const index_t P = counts_per_peer(C);
    const auto t0 = clock::now();
    // A pass that threw mid-way (a failed exchange) may have left slots marked in use.
    expert_owner_ = -1;
    for (unit_state& u : units_) u.busy = false;
    if constexpr (async)
      for (auto* reqs : {&dispatch_req_, &meta_req_, &combine_req_})
        for (auto& r : *reqs) r.reset();
    index_t* send_counts = counts_.data();
    index_t* recv_counts = send_counts + R * P;
    for (int r = 0; r < R; ++r) {
      index_t* out = send_counts + r * P;
      for (int c = 0; c < C; ++c) {
        index_t* blk = out + c * W;
        for (int j = 0; j < L; ++j) {
          blk[j] = p.send_counts[p.block(c, r, j)];
          blk[L + j] = p.send_valid[p.block(c, r, j)];
        }
        blk[2 * L] = Dedup ? p.unique_counts[c * R + r] : 0;
        // Rounds chunk c needs for this rank's sends (every pair's rows split in quotas).
        index_t rounds = 1;
        if (bounded_)
          for (int d = 0; d < R; ++d)
            rounds = std::max(rounds, (p.send_rows_to(c, d) + quota_ - 1) / quota_);
        out[C * W + c] = rounds;
      }
      out[C * W + C] = valid ? 1 : 0;
    }
    comm_->alltoall(send_counts, recv_counts, P);
    int rejected = -1;
    for (int s = R - 1; s >= 0; --s)
      if (recv_counts[s * P + C * W + C] == 0) rejected = s;
    if (rejected >= 0) {
      account(seconds_since(t0));
      return rejected;
    }
    for (int s = 0; s < R; ++s)
      for (int c = 0; c < C; ++c) {
        const index_t* in = recv_counts + s * P + c * W;
        for (int j = 0; j < L; ++j) {
          p.recv_counts[p.block(c, s, j)] = in[j];
          p.recv_valid[p.block(c, s, j)] = in[L + j];
        }
        if constexpr (Dedup) p.recv_unique_counts[c * R + s] = in[2 * L];
      }
    build_recv_plan(p);
    if constexpr (Dedup) {
      p.recv_unique_offsets[0] = 0;
      for (int b = 0; b < C * R; ++b)
        p.recv_unique_offsets[b + 1] = p.recv_unique_offsets[b] + p.recv_unique_counts[b];
    }
    if (bounded_) {
      first_unit_[0] = 0;
      index_t most = 1;
      for (int c = 0; c < C; ++c) {
        index_t rounds = 1;
        for (int s = 0; s < R; ++s) {
          rounds = std::max(rounds, recv_counts[s * P + C * W + c]);
          // A round from one source must fit its share of a slot.
          if (std::min(quota_, p.recv_rows_from(c, s)) > per_source_) overflow(p.recv_rows());
        }
        first_unit_[c + 1] = first_unit_[c] + rounds;
        most = std::max(most, rounds);
      }
      stats_->rounds = static_cast<int>(most);
      stats_->peak_recv_rows = 0;
    } else {
      if (p.recv_rows() > recv_capacity_) overflow(p.recv_rows());
      for (int c = 0; c < C; ++c) set_rank_counts(c);
      stats_->rounds = 1;
      stats_->peak_recv_rows = Dedup ? p.recv_unique_offsets[C * R] : p.recv_rows();
    }
    fill_comm_stats();
    account(seconds_since(t0));
    return -1;
  }

  void start_dispatch(int u) {
    const int k = slot_of(u);
    event_start_[2 * k] = now();
    if (bounded_) layout_unit(u);
    rank_counts& x = ex_[k];
    start_exchange(req(dispatch_req_, k), x_send_.data(), x.send_n, x.send_d, x_recv_.data(),
                   x.recv_n, x.recv_d);
    if constexpr (Dedup)
      start_exchange(req(meta_req_, k), plan_->meta, x.meta_send_n, x.meta_send_d, meta_recv_,
                     x.meta_recv_n, x.meta_recv_d);
  }

  void wait_dispatch(int u) {
    const int k = slot_of(u);
    finish_exchange(req(dispatch_req_, k));
    const dispatch_plan& p = *plan_;
    const int B = s_.ranks * p.local_experts;
    index_t rows = 0;
    if (bounded_) {
      unit_state& us = units_[k];
      if (expert_owner_ >= 0)
        throw std::logic_error(
            "epmoe: the schedule waited two dispatches before the first one's combine_start; a "
            "receive bound (max_recv_rows) keeps one round in the expert buffer at a time");
      expert_owner_ = u;
      space_->copy_blocks(slot_view(k), expert_view(), B, us.recv, us.regroup, us.count);
      rows = us.expert[p.local_experts];
    } else {
      if constexpr (Dedup) {
        finish_exchange(req(meta_req_, k));
        expand_unique_rows(u);
      } else {
        const int b = u * B;
        space_->copy_blocks(recv_view(), expert_view(), B, p.recv_offsets + b,
                            p.regroup_offsets + b, p.recv_counts + b);
      }
      rows = p.expert_offsets[(u + 1) * p.local_experts] - p.expert_offsets[u * p.local_experts];
    }
    record({chunk_of_unit(u), stage_kind::dispatch, event_start_[2 * k], now(), round_of_unit(u),
            rows, crossing_bytes(ex_[k].recv_n)});
  }

  /// The rows local slot j computes in unit u (a view of the expert buffer).
  matrix_view<float> expert_rows(int u, int j) const {
    const dispatch_plan& p = *plan_;
    const int L = p.local_experts;
    if (bounded_) {
      const unit_state& us = units_[slot_of(u)];
      return expert_view().rows_slice(us.expert[j], us.expert[j + 1] - us.expert[j]);
    }
    const index_t begin = p.expert_offsets[u * L + j];
    return expert_view().rows_slice(begin, p.expert_offsets[u * L + j + 1] - begin);
  }

  void start_combine(int u) {
    const int k = slot_of(u);
    event_start_[2 * k + 1] = now();
    const dispatch_plan& p = *plan_;
    const int R = s_.ranks, L = p.local_experts;
    if (bounded_) {
      const unit_state& us = units_[k];
      space_->copy_blocks(expert_view(), slot_view(k), R * L, us.regroup, us.recv, us.count);
      expert_owner_ = -1;
    } else if constexpr (Dedup) {
      weighted_unique_sums(u);
    } else {
      const int B = R * L, b = u * B;
      space_->copy_blocks(expert_view(), recv_view(), B, p.regroup_offsets + b, p.recv_offsets + b,
                          p.recv_counts + b);
    }
    // The reverse exchange: what came from rank s goes back to rank s, into the send rows.
    rank_counts& x = ex_[k];
    start_exchange(req(combine_req_, k), x_recv_.data(), x.recv_n, x.recv_d, x_send_.data(),
                   x.send_n, x.send_d);
  }

  void wait_combine(int u) {
    const int k = slot_of(u);
    finish_exchange(req(combine_req_, k));
    units_[k].busy = false;
    index_t rows = 0;
    for (int r = 0; r < s_.ranks; ++r) rows += ex_[k].recv_n[r] / s_.hidden;
    record({chunk_of_unit(u), stage_kind::combine, event_start_[2 * k + 1], now(), round_of_unit(u),
            rows, crossing_bytes(ex_[k].recv_n)});
  }

  /// Lets the comm progress pending exchanges (MPI moves data inside its calls).
  void progress() {
    if constexpr (async)
      for (auto* reqs : {&dispatch_req_, &meta_req_, &combine_req_})
        for (auto& r : *reqs)
          if (r) r->test();
  }

  /// Appends to the timeline while its reserved capacity lasts (a pass allocates nothing).
  void record(const timeline_event& e) {
    if (stats_->timeline.size() < stats_->timeline.capacity()) stats_->timeline.push_back(e);
  }

  double now() const { return seconds_since(*pass_start_); }

 private:
  struct rank_counts {  // per-rank counts/displacements (elements) of one unit's exchanges
    index_t *send_n, *send_d, *recv_n, *recv_d;
    index_t *meta_send_n, *meta_send_d, *meta_recv_n, *meta_recv_d;
  };
  // A bounded unit's receive layout: per block (source s, local slot j) = s * L + j, its rows
  // this round, where they sit in the receive buffer and in the expert buffer; per local slot
  // its first row in the expert buffer.
  struct unit_state {
    index_t *count = nullptr, *recv = nullptr, *regroup = nullptr, *expert = nullptr;
    bool busy = false;
  };

  static double seconds_since(clock::time_point t) {
    return std::chrono::duration<double>(clock::now() - t).count();
  }
  // Per peer: per chunk L padded counts, L real counts, unique rows (dedup); then per chunk
  // the rounds this rank's sends need; then whether this rank accepted its inputs.
  index_t counts_per_peer(index_t chunks) const {
    return chunks * (2 * s_.local_experts + 1) + chunks + 1;
  }

  int slot_of(int u) const { return bounded_ ? u % slots_ : u; }

  template <class V>
  static std::optional<request_type>* req(V& v, int k) {
    if constexpr (async)
      return &v[static_cast<std::size_t>(k)];
    else
      return nullptr;  // a blocking comm finishes inside start_exchange
  }

  void account(double t) {
    stats_->comm_seconds += t;  // a blocking exchange: all of it exposed
    stats_->exposed_comm_seconds += t;
  }

  [[noreturn]] void overflow(index_t rows) const {
    throw comm_error("epmoe: rank " + std::to_string(comm_->rank()) + " would receive " +
                     std::to_string(rows) + " rows, more than its workspace (" +
                     std::to_string(recv_capacity_) +
                     "); a peer passed more tokens than max_tokens?");
  }

  index_t crossing_bytes(const index_t* n) const {
    index_t e = 0;
    for (int r = 0; r < s_.ranks; ++r)
      if (r != comm_->rank()) e += n[r];
    return e * static_cast<index_t>(sizeof(float));
  }

  // Bounded: unit u is round i of chunk c; pair (s, d) moves rows [i*q, min(n, (i+1)*q)) of
  // the source's contiguous rows of chunk c to d, which span d's local slots in order, so
  // both sides compute the same split from the counts alone.
  void layout_unit(int u) {
    const dispatch_plan& p = *plan_;
    const int R = s_.ranks, L = p.local_experts, k = slot_of(u);
    const int c = chunk_of_unit(u), i = round_of_unit(u);
    const index_t H = s_.hidden, lo = i * quota_, hi = lo + quota_;
    unit_state& us = units_[k];
    if (us.busy)
      throw std::logic_error("epmoe: the schedule keeps more than " + std::to_string(slots_) +
                             " exchange rounds in flight; a receive bound (max_recv_rows) "
                             "sizes that many receive slots");
    us.busy = true;
    rank_counts& x = ex_[k];
    const index_t base = k * slot_rows_;
    index_t at = base;
    for (int r = 0; r < R; ++r) {
      const index_t ns = p.send_rows_to(c, r);
      const index_t sa = std::min(ns, lo), sb = std::min(ns, hi);
      x.send_n[r] = (sb - sa) * H;
      x.send_d[r] = (p.send_offsets[p.block(c, r, 0)] + sa) * H;
      const index_t nr = p.recv_rows_from(c, r);
      const index_t ra = std::min(nr, lo), rb = std::min(nr, hi);
      x.recv_n[r] = (rb - ra) * H;
      x.recv_d[r] = at * H;
      const index_t first = p.recv_offsets[p.block(c, r, 0)];
      for (int j = 0; j < L; ++j) {
        const int b = p.block(c, r, j);
        const index_t b0 = p.recv_offsets[b] - first, b1 = b0 + p.recv_counts[b];
        const index_t x0 = std::max(b0, ra), x1 = std::min(b1, rb);
        us.count[r * L + j] = std::max<index_t>(0, x1 - x0);
        us.recv[r * L + j] = at + std::max<index_t>(0, x0 - ra);
      }
      at += rb - ra;
    }
    stats_->peak_recv_rows = std::max(stats_->peak_recv_rows, at - base);
    index_t row = 0;
    for (int j = 0; j < L; ++j) {
      us.expert[j] = row;
      for (int r = 0; r < R; ++r) {
        us.regroup[r * L + j] = row;
        row += us.count[r * L + j];
      }
    }
    us.expert[L] = row;
  }

  // Per-rank element counts and displacements of chunk c's exchanges (unbounded): rows (per
  // assignment, or unique with dedup) and, with dedup, the per-assignment metadata.
  void set_rank_counts(int c) {
    const dispatch_plan& p = *plan_;
    const int R = s_.ranks;
    const index_t H = s_.hidden;
    rank_counts& x = ex_[c];
    for (int r = 0; r < R; ++r) {
      const int b = p.block(c, r, 0);
      const index_t rows_to = Dedup ? p.unique_counts[c * R + r] : p.send_rows_to(c, r);
      const index_t rows_at = Dedup ? p.unique_offsets[c * R + r] : p.send_offsets[b];
      const index_t rows_from = Dedup ? p.recv_unique_counts[c * R + r] : p.recv_rows_from(c, r);
      const index_t rows_in = Dedup ? p.recv_unique_offsets[c * R + r] : p.recv_offsets[b];
      x.send_n[r] = rows_to * H;
      x.send_d[r] = rows_at * H;
      x.recv_n[r] = rows_from * H;
      x.recv_d[r] = rows_in * H;
      x.meta_send_n[r] = p.send_rows_to(c, r);
      x.meta_send_d[r] = p.send_offsets[b];
      x.meta_recv_n[r] = p.recv_rows_from(c, r);
      x.meta_recv_d[r] = p.recv_offsets[b];
    }
  }

  void fill_comm_stats() {
    const dispatch_plan& p = *plan_;
    pass_stats& st = *stats_;
    const int R = s_.ranks, L = p.local_experts, C = p.chunks, me = comm_->rank();
    const index_t row_bytes = s_.hidden * static_cast<index_t>(sizeof(float));
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
      if (r != me) {
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

  // One exchange: non-blocking when the comm can, else blocking; requests live per slot.
  template <class T>
  void start_exchange(std::optional<request_type>* req, const T* send, const index_t* sn,
                      const index_t* sd, T* recv, const index_t* rn, const index_t* rd) {
    if constexpr (async)
      req->emplace(comm_->ialltoallv(send, sn, sd, recv, rn, rd));
    else
      comm_->alltoallv(send, sn, sd, recv, rn, rd);
  }

  void finish_exchange(std::optional<request_type>* req) {
    if constexpr (async) {
      const auto t0 = clock::now();
      (*req)->wait();
      const double blocked = seconds_since(t0);
      double wire = blocked;
      if constexpr (requires { (*req)->modeled_seconds(); })
        wire = std::max(blocked, (*req)->modeled_seconds());
      req->reset();
      stats_->comm_seconds += wire;
      stats_->exposed_comm_seconds += blocked;
    }
  }

  // Dedup: expert-major row of each received assignment of chunk c <- its unique row.
  void expand_unique_rows(int c) {
    const dispatch_plan& p = *plan_;
    const int R = s_.ranks, L = p.local_experts;
    const matrix_view<float> in = unique_recv_view(), out = expert_view();
    for (int s = 0; s < R; ++s)
      for (int j = 0; j < L; ++j) {
        const int b = p.block(c, s, j);
        for (index_t i = 0; i < p.recv_counts[b]; ++i) {
          const index_t u =
              p.recv_unique_offsets[c * R + s] + meta_index(p.meta_recv[p.recv_offsets[b] + i]);
          std::copy_n(in.row(u), s_.hidden, out.row(p.regroup_offsets[b] + i));
        }
      }
  }

  // Dedup: the expert rank sums each token's weighted outputs, one row per (token, rank).
  void weighted_unique_sums(int c) {
    const dispatch_plan& p = *plan_;
    const int R = s_.ranks, L = p.local_experts;
    const matrix_view<float> out = unique_recv_view(), in = expert_view();
    for (index_t u = p.recv_unique_offsets[c * R]; u < p.recv_unique_offsets[(c + 1) * R]; ++u)
      std::fill_n(out.row(u), s_.hidden, 0.f);
    for (int s = 0; s < R; ++s)
      for (int j = 0; j < L; ++j) {
        const int b = p.block(c, s, j);
        for (index_t i = 0; i < p.recv_counts[b]; ++i) {
          const std::int64_t m = p.meta_recv[p.recv_offsets[b] + i];
          const float w = meta_weight(m);
          const float* src = in.row(p.regroup_offsets[b] + i);
          float* dst = out.row(p.recv_unique_offsets[c * R + s] + meta_index(m));
          for (index_t h = 0; h < s_.hidden; ++h) dst[h] += w * src[h];
        }
      }
  }

  matrix_view<float> unique_recv_view() const {
    return {x_recv_.data(), plan_->recv_unique_offsets[plan_->chunks * s_.ranks], s_.hidden};
  }
  matrix_view<float> recv_view() const { return {x_recv_.data(), plan_->recv_rows(), s_.hidden}; }
  matrix_view<float> slot_view(int k) const {
    return {x_recv_.data(), (k + 1) * slot_rows_, s_.hidden};
  }
  matrix_view<float> expert_view() const {
    return {x_expert_.data(), bounded_ ? slot_rows_ : plan_->recv_rows(), s_.hidden};
  }

  Comm* comm_ = nullptr;
  Space* space_ = nullptr;
  dispatch_plan* plan_ = nullptr;
  pass_stats* stats_ = nullptr;
  const clock::time_point* pass_start_ = nullptr;
  shape s_{};
  bool bounded_ = false;
  index_t quota_ = 0, per_source_ = 0, slot_rows_ = 0, recv_capacity_ = 0, expert_capacity_ = 0;
  int slots_ = 1;
  int expert_owner_ = -1;  // bounded: the unit whose rows are in the expert buffer
  buffer<float> x_send_, x_recv_, x_expert_;
  buffer<index_t> counts_;
  std::int64_t* meta_recv_ = nullptr;
  std::vector<rank_counts> ex_;    // [slots]
  std::vector<unit_state> units_;  // [slots]
  index_t* first_unit_ = nullptr;  // [C+1]: bounded: first unit of each chunk
  std::vector<std::optional<request_type>> dispatch_req_, meta_req_, combine_req_;  // [slots]
  std::vector<double> event_start_;  // [2 * slots]: when each slot's dispatch/combine began
};

}  // namespace epmoe::detail
