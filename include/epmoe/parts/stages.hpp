// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/core/exchange.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/weighting.hpp"
#include "epmoe/parts/lifecycle.hpp"
#include "epmoe/parts/pass.hpp"
#include "epmoe/parts/router.hpp"
#include "epmoe/parts/sizes.hpp"

// The stages a schedule drives (schedule/*.hpp), over a layer's parts: route, plan, permute,
// shared, counts, then per unit u (a chunk, or with max_recv_rows one round or window of a
// chunk) dispatch_start(u), dispatch_wait(u), experts(u), combine_start(u), combine_wait(u);
// then reduce. A forward's and a backward's differ only around the exchanges. Each stage
// notes its span on the pass's clock and where the call is (what a failure names).
namespace epmoe::parts {

/// What both directions share: the exchange's units and the timed stage runner.
template <class L>
struct stages_base {
  L& l;

  /// Runs the schedule over `stages` as one timed collective call of l (lifecycle.hpp).
  template <class Stages>
  static void drive(L& l, call_kind kind, std::uint64_t pass, Stages stages) {
    l.stats_.expert_flops = 0;
    l.stats_.started =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - l.built_).count();
    l.pending_ = true;
    const auto unit_text = [&](int u) {
      const dispatch_plan& p = l.plan_.host();
      return "chunk " + std::to_string(l.ex_.chunk_of_unit(p, u)) + ", round " +
             std::to_string(l.ex_.round_of_unit(p, u));
    };
    l.life_.run(l.space_, l.comm_, kind, pass, unit_text, [&] {
      l.clock_.begin_pass();
      const auto start = l.clock_.now();
      stages.start();
      L::schedule_type::run(stages);
      stages.finish();
      l.clock_.stage(&stage_times::total, start, l.clock_.now());
    });
  }

  /// A collective call of l that moves no rows: its checks, then every rank's header in one
  /// exchange (a rank that rejects its arguments, or ranks that make different calls: every
  /// rank throws, nothing is written), then `work`.
  template <class Check, class Work>
  static void side_call(L& l, call_kind kind, Check&& check, Work&& work) {
    l.life_.run(
        l.space_, l.comm_, kind, l.passes_, [](int) { return std::string(); },
        [&] {
          std::exception_ptr bad;
          try {
            check();
          } catch (...) {
            bad = std::current_exception();
          }
          int rejected = -1;
          try {
            rejected =
                l.ex_.agree(l.space_, {bad ? 0 : 1, kind, static_cast<std::int64_t>(l.passes_), 0});
          } catch (const config_error&) {
            l.life_.agreed();
            throw;
          }
          if (bad || rejected >= 0) l.life_.agreed();
          if (bad) std::rethrow_exception(bad);
          if (rejected >= 0)
            throw input_error(
                std::string(call_name(kind)) + " inputs of rank " + std::to_string(rejected),
                "rejected", "every rank must pass valid inputs; nothing was done");
          work();
        });
  }

  /// Fills what l's pass leaves for later: stage times from the clock's marks and the
  /// router's losses from the pass's logits (after the space finished the pass); a deferred
  /// pass's counts and verdict.
  static void resolve(const L& l) {
    if (l.pass_.deferred) l.space_.to_host(l.plan_.send_blocks(), 0, l.plan_.send_blocks().size());
    l.ex_.synchronize(l.space_);  // NCCL: a peer's failure or the deadline throws, never hangs
    l.pending_ = false;
    if (std::exchange(l.pass_.deferred, false)) {
      auto x = context_of(l);
      const int rejected = l.ex_.resolve(x);
      if (rejected >= 0)
        throw input_error("forward inputs of rank " + std::to_string(rejected), "rejected",
                          "every rank must pass valid inputs; no rank wrote y in that pass");
      count_plan_stats(l);
    }
    l.clock_.resolve(l.stats_);
    l.router_.losses(l.space_, l.pass_.tokens(), l.pass_.routing_given, l.stats_);
  }

  int chunks() const { return l.ex_.units(l.plan_.host()); }
  const typename L::space_type& space() const { return l.space_; }

  /// What the exchange reads and writes during a pass.
  static exchange_context<typename L::space_type> context_of(const L& l) {
    return {l.space_, l.plan_.host(), l.plan_.device(), l.plan_.recv_blocks(), l.clock_, l.stats_};
  }
  auto context() const { return context_of(l); }

  // Runs one stage (of unit u, or -1) and notes its span and where the call is.
  template <class F>
  void timed(double stage_times::*stage, int u, F&& f) {
    l.life_.at(stage, u);
    const auto a = l.clock_.now();
    f();
    l.clock_.stage(stage, a, l.clock_.now());
  }

  // The counts exchange with this rank's header; every rank learns whether all accepted
  // their inputs and make the same call. Returns false when the verdict waits (deferred).
  bool agree_counts(call_kind kind, std::uint64_t pass, std::exception_ptr error, bool defer) {
    auto x = context();
    const call_header h{error ? 0 : 1, kind, static_cast<std::int64_t>(pass), l.chunks_};
    int rejected = -1;
    try {
      rejected = l.ex_.counts(x, h, l.static_shapes() ? l.layout_.pad_rows : 0, defer);
    } catch (const config_error&) {  // different calls: every rank throws this
      l.life_.agreed();
      throw;
    }
    if (rejected == verdict_pending) return false;
    if (error || rejected >= 0) l.life_.agreed();  // every rank throws here: no abort
    if (error) std::rethrow_exception(error);
    if (rejected >= 0)
      throw input_error(
          std::string(call_name(kind)) + " inputs of rank " + std::to_string(rejected), "rejected",
          "every rank must pass valid inputs; no rank ran this pass (rank " +
              std::to_string(rejected) + " threw the reason)");
    count_plan_stats(l);
    return true;
  }

  void dispatch_start(int u) {
    timed(&stage_times::dispatch, u, [&] {
      auto x = context();
      l.ex_.start_dispatch(x, u);
    });
  }
  void dispatch_wait(int u) {
    timed(&stage_times::dispatch, u, [&] {
      auto x = context();
      l.ex_.wait_dispatch(x, u);
    });
  }
  template <bool Backward>
  void combine_start_(int u) {
    timed(&stage_times::combine, u, [&] {
      auto x = context();
      l.ex_.template start_combine<Backward>(x, u);
    });
  }
  template <bool Backward>
  void combine_wait_(int u) {
    timed(&stage_times::combine, u, [&] {
      auto x = context();
      l.ex_.template wait_combine<Backward>(x, u);
    });
  }

  // Unit u's expert rows, their count and its timeline event around `run(rows)`.
  template <class Run>
  void experts_of(int u, double flops_per_row, Run&& run) {
    timed(&stage_times::experts, u, [&] {
      auto x = context();
      const auto t0 = l.clock_.now();
      const auto rows = l.ex_.expert_rows(x, u);
      run(rows);
      l.ex_.progress();
      l.stats_.expert_flops += static_cast<double>(rows.rows()) * flops_per_row;
      const dispatch_plan& p = l.plan_.host();
      l.clock_.event(l.ex_.chunk_of_unit(p, u), stage_kind::experts, l.ex_.round_of_unit(p, u),
                     rows.rows(), 0, t0, l.clock_.now());
    });
  }

  // The send buffer as rows.
  matrix_view<typename L::value_type> send_view() const {
    return {l.ex_.send_buffer(), l.layout_.send_rows, l.cfg_.hidden, l.layout_.row_stride};
  }
  // Dedup: the send row whose combined sum comes home for each assignment (hierarchical: its
  // node row, else its rank's unique row).
  static const std::int32_t* home_slot(const dispatch_plan& p) {
    return L::hierarchical ? p.node_slot : p.unique_slot;
  }
  // 8-bit rows (config dispatch_rows): the send buffer's wire rows, and each of `from`'s T
  // tokens quantised once (one scale per row) into the exchange's token rows.
  matrix_view<std::uint8_t> wire_send_view() const {
    return {l.ex_.wire_send_buffer(), l.layout_.send_rows, l.layout_.wire_row_bytes,
            l.layout_.wire_stride};
  }
  matrix_view<const std::uint8_t> quantise_tokens(matrix_view<const typename L::value_type> from) {
    const index_t n = l.pass_.tokens();
    const matrix_view<std::uint8_t> q{l.ex_.wire_tokens(), n, l.layout_.wire_row_bytes,
                                      l.layout_.wire_stride};
    l.space_.for_each(n, wire_ops::quantise_rows<typename L::value_type>{from, q});
    return q;
  }
  // Dedup and hierarchical: one row of `from` per (token, rank) or (token, node).
  void gather_unique(matrix_view<const typename L::value_type> from) {
    const dispatch_plan& p = l.plan_.host();
    if (l.layout_.wire()) {  // the tokens' wire rows, copied as bytes
      const auto q = quantise_tokens(from);
      const std::int32_t* token = L::hierarchical ? p.node_token : p.unique_token;
      const index_t* n = L::hierarchical
                             ? l.plan_.device().node_offsets + p.chunks * p.nodes()
                             : l.plan_.device().unique_offsets + p.chunks * l.cfg_.ranks;
      l.space_.for_each_row_n(n, L::hierarchical ? l.layout_.node_rows : l.layout_.send_rows,
                              l.layout_.wire_row_bytes,
                              rows::gather<std::uint8_t>{q, token, wire_send_view()});
      return;
    }
    if constexpr (L::hierarchical)
      l.space_.for_each_row_n(
          l.plan_.device().node_offsets + p.chunks * p.nodes(), l.layout_.node_rows, l.cfg_.hidden,
          rows::gather<typename L::value_type>{from, p.node_token, send_view()});
    else
      l.space_.for_each_row_n(
          l.plan_.device().unique_offsets + p.chunks * l.cfg_.ranks, l.layout_.send_rows,
          l.cfg_.hidden, rows::gather<typename L::value_type>{from, p.unique_token, send_view()});
  }

  // Whether direction d sends weighted rows (the layer's weighting, core/weighting.hpp).
  static constexpr bool weighted_send(weighting::direction d) {
    return L::weighting_type::weighted_send == d;
  }
  // A flat exchange's send rows from src [T, H]: each kept assignment's row, times its routing
  // weight when `weighted` (padding rows zero either way: their dW terms must vanish).
  void send_rows(matrix_view<const typename L::value_type> src, bool weighted) {
    using T = typename L::value_type;
    const dispatch_plan& p = l.plan_.host();
    const index_t n = l.pass_.tokens(), H = l.cfg_.hidden;
    if (l.layout_.wire()) {  // each token quantised once, its wire row copied per send row
      const auto q = quantise_tokens(src);
      if (!weighted) {
        l.space_.for_each_row_n(l.plan_.device().send_offsets + p.blocks(), l.layout_.send_rows,
                                l.layout_.wire_row_bytes,
                                rows::gather<std::uint8_t>{q, p.row_token, wire_send_view()});
        return;
      }
      if constexpr (L::capacity_type::pads)  // padding rows: scale 0, values 0
        l.space_.fill(l.ex_.wire_send_buffer(), l.layout_.send_rows * l.layout_.wire_stride,
                      std::uint8_t{0});
      l.space_.for_each(n, wire_ops::scatter_scaled{q, p.slot, l.router_.routing(n).weights,
                                                    wire_send_view(), l.layout_.wire_row_bytes});
      return;
    }
    if (!weighted) {
      l.space_.for_each_row_n(l.plan_.device().send_offsets + p.blocks(), l.layout_.send_rows, H,
                              rows::gather<T>{src, p.row_token, send_view()});
      return;
    }
    if constexpr (L::capacity_type::pads)
      l.space_.fill(l.ex_.send_buffer(), l.layout_.send_rows * l.layout_.row_stride, T{});
    l.space_.for_each_row(
        n, H, rows::scatter_weighted<T>{src, p.slot, l.router_.routing(n).weights, send_view()});
  }
  // The weights a flat reduce of direction d applies: none when d sent weighted rows.
  matrix_view<const float> sum_weights(weighting::direction d) const {
    const index_t n = l.pass_.tokens();
    return weighted_send(d) ? matrix_view<const float>{nullptr, n, l.layout_.width}
                            : l.router_.routing(n).weights;
  }
  // The routing weights' gradient of a flat exchange: g[t, k] = home[t] · the row of (t, k)
  // that the plain-send direction brought back (weighting.hpp).
  void flat_weight_grad(matrix_view<const typename L::value_type> home) {
    const index_t n = l.pass_.tokens();
    l.space_.for_each(n, rows::routing_weight_grad<typename L::value_type>{
                             home, send_view(), l.plan_.host().slot, l.train_->weight_grad(n)});
  }

  // The plan's counts into the stats (its host arrays arrived with the counts).
  static void count_plan_stats(const L& l) {
    dispatch_plan& p = l.plan_.host();
    count_send_plan(p, l.cfg_.experts, l.cfg_.zero_experts);
    l.stats_.tokens = l.pass_.tokens();
    l.stats_.assignments = p.assignments;
    l.stats_.zero_expert_assignments = p.zero_assignments;
    l.stats_.dropped = p.dropped;
    l.stats_.capacity = std::same_as<typename L::capacity_type, capacity::dropless>
                            ? std::nullopt
                            : std::optional<index_t>(l.pass_.limit);
    l.stats_.padding_rows = p.padding;
    std::copy_n(p.routed, l.cfg_.experts, l.stats_.routed_per_expert.begin());
    l.stats_.expert_imbalance = imbalance::of(l.stats_.routed_per_expert);
  }
};

/// A forward's stages. Until the counts exchange a failure of this rank (its inputs, or any
/// error of route, plan, permute or shared) makes the pass empty: the rank goes on with no
/// tokens, and the counts tell every peer; past it a failure is mid-pass (lifecycle).
template <class L>
struct forward_stages : stages_base<L> {
  using base = stages_base<L>;
  using base::l;
  using value_type = typename L::value_type;

  explicit forward_stages(L& layer) : base{layer} {}

  /// A forward of l: the pass value (empty when `check` throws), then the stages; a training
  /// forward keeps its state for the backward. Returns the pass's handle.
  template <class Check>
  static pass_handle run(L& l, matrix_view<const value_type> x, matrix_view<value_type> y,
                         std::span<const std::int64_t> token_ids, const routing_view* routing,
                         const forward_options& opt, Check&& check) {
    l.life_.usable();
    auto& pass = l.pass_;
    pass = {};
    pass.id = l.passes_, pass.x = x, pass.y = y, pass.token_ids = token_ids;
    pass.given = routing, pass.routing_given = routing != nullptr;
    pass.saves = l.train_ && opt.keep_for_backward;
    try {
      l.store_.require_readable();
      check();
    } catch (...) {
      pass.make_empty(std::current_exception());
    }
    if (l.train_) l.train_->begin_forward();  // the last pass's state is gone either way
    if (pass.saves) pass.token_ids = l.train_->keep_token_ids(l.space_, pass.token_ids);
    dispatch_plan& p = l.plan_.host();
    p.rounds = rounds_per_chunk(l.layout_, l.cfg_, l.chunks_);
    p.chunks = l.chunks_ * p.rounds;
    l.stats_.chunks = l.chunks_;
    l.stats_.backward = false;
    base::drive(l, call_kind::forward, l.passes_, forward_stages(l));
    const pass_handle h{l.passes_++, pass.saves};
    // Static shapes on a device: this rank's own error, once its part of the pass is queued.
    if (pass.error) std::rethrow_exception(pass.error);
    l.stats_.saved_bytes = 0;
    if (pass.saves) {
      l.train_->end_forward(h.id);
      l.stats_.saved_bytes =
          l.train_->saved_bytes(pass.tokens(), L::dedup) + l.router_.saved_bytes(pass.tokens());
    } else if (l.train_) {
      l.train_->end_inference(h.id);
    }
    return h;
  }
  void start() {}
  void route() {
    early(&stage_times::route, [&] {
      const auto& w = l.store_.views();
      l.router_.route(l.space_, l.pass_, w.gate, w.noise_gate, first_token(l), w.gate_bias);
    });
  }
  void plan() {
    early(&stage_times::plan, [&] { plan_pass(); });
  }
  void permute() {
    early(&stage_times::permute, [&] {
      if constexpr (L::dedup)
        this->gather_unique(l.pass_.x);
      else
        this->send_rows(l.pass_.x, this->weighted_send(weighting::direction::forward));
    });
  }
  void shared() {
    early(&stage_times::shared, [&] {
      l.stats_.shared_flops = 0;
      l.store_.with_space(l.space_, [&](const auto& s) {
        l.stats_.shared_flops = l.home_.forward(s, l.pass_.x, l.store_.views(), l.scratch_.data(),
                                                l.router_.routing(l.pass_.tokens()));
      });
    });
  }
  // defer: the verdict may be read after the pass (a device's static shapes; a split start's
  // low-latency round, posted).
  void counts(bool defer = device_space<typename L::space_type>) {
    this->timed(&stage_times::dispatch, -1, [&] {
      counted_ = true;
      if (!this->agree_counts(call_kind::forward, l.pass_.id, l.pass_.error, defer))
        l.pass_.deferred = true;
    });
  }
  void experts(int u) {
    this->experts_of(
        u, L::expert_type::flops_per_row(l.cfg_.hidden, l.cfg_.ffn), [&](const auto& rows) {
          const bool saves = l.pass_.saves;
          if (saves) l.train_->save_rows(l.space_, rows, u, true);
          L& ly = l;
          ly.store_.with_space(ly.space_, [&](const auto& s) {
            if constexpr (keeps_hidden<typename L::expert_type, typename L::space_type>)
              L::expert_type::forward(s, ly.store_.views().experts, rows, ly.scratch_.data(),
                                      saves ? ly.train_->kept_hidden(u) : nullptr);
            else
              L::expert_type::forward(s, ly.store_.views().experts, rows, ly.scratch_.data());
          });
          if (L::dedup && saves) l.train_->save_rows(l.space_, rows, u, false);
        });
  }
  void combine_start(int u) { this->template combine_start_<false>(u); }
  void combine_wait(int u) { this->template combine_wait_<false>(u); }
  void reduce() {
    this->timed(&stage_times::reduce, -1, [&] {
      const dispatch_plan& p = l.plan_.host();
      const index_t T = l.pass_.tokens();
      const float* shared = l.home_.sum(T);
      if constexpr (L::dedup)
        l.space_.for_each_row(T, l.cfg_.hidden,
                              rows::sum_unique<value_type>{this->send_view(), this->home_slot(p),
                                                           l.layout_.width, shared, l.pass_.y});
      else
        l.space_.for_each_row(
            T, l.cfg_.hidden,
            rows::weighted_reduce<value_type>{
                this->send_view(), p.slot, this->sum_weights(weighting::direction::forward), shared,
                l.pass_.y, l.pass_.deferred ? l.ex_.verdicts() : nullptr, l.ex_.verdict_stride(),
                l.cfg_.ranks});
    });
  }
  void finish() { l.router_.advance(l.space_); }

  static std::int64_t first_token(const L& l) { return std::int64_t{l.rank()} * l.cfg_.max_tokens; }

 private:
  // A stage before the counts exchange: a failure makes the pass empty (planned again with
  // no tokens) and is thrown at the counts, on every rank; after it, a failure is mid-pass.
  template <class F>
  void early(double stage_times::*stage, F&& f) {
    if (counted_) return this->timed(stage, -1, f);
    try {
      this->timed(stage, -1, f);
    } catch (...) {
      if (l.pass_.error) throw;  // the empty pass failed too
      l.pass_.make_empty(std::current_exception());
      plan_pass();
    }
  }
  void plan_pass() {
    dispatch_plan& p = l.plan_.host();
    const index_t T = l.pass_.tokens();
    l.pass_.limit = l.capacity_.limit(l.cfg_, T);
    const token_origin origin{
        l.rank(), l.pass_.token_ids.empty() ? nullptr : l.pass_.token_ids.data(), first_token(l)};
    const auto routing = l.router_.routing(T);
    build_send_plan(l.space_, routing, l.where_.view(), l.cfg_.experts, l.pass_.limit,
                    l.layout_.pad_rows, origin, p, l.plan_.device(), l.plan_.scratch(),
                    l.cfg_.zero_experts);
    if constexpr (L::dedup)
      build_dedup_plan(l.space_, routing, p, l.plan_.device(), l.plan_.scratch());
    if constexpr (L::hierarchical)
      build_node_plan(l.space_, p, l.plan_.device(), l.plan_.scratch());
    // Static shapes on a device: the host reads the counts after the pass.
    if (!(device_space<typename L::space_type> && l.static_shapes()))
      l.space_.to_host(l.plan_.send_blocks(), 0, l.plan_.send_blocks().size());
  }

  bool counted_ = false;
};

/// A backward's stages over the forward's plan and exchange. Its counts exchange runs first
/// (start): every rank learns whether all accept their arguments before any stage writes
/// (the home terms' gradients included, whatever the schedule runs first); it never waits for
/// later (static shapes on a device too).
template <class L>
struct backward_stages : stages_base<L> {
  using base = stages_base<L>;
  using base::l;
  using value_type = typename L::value_type;
  std::exception_ptr error;  // this rank's rejected arguments
  std::uint64_t pass = 0;    // the forward it goes back through

  void start() {
    this->timed(&stage_times::dispatch, -1,
                [&] { this->agree_counts(call_kind::backward, pass, error, false); });
  }
  // Weighted outputs without dedup: the routing weights' gradient, dy · the forward's outputs
  // (still in the send buffer).
  void route() {
    this->timed(&stage_times::route, -1, [&] {
      const index_t T = l.pass_.tokens();
      l.space_.fill(l.train_->dx_home(), T * l.cfg_.hidden, 0.f);
      if constexpr (!L::dedup && base::weighted_send(weighting::direction::backward))
        this->flat_weight_grad(call().dy);
    });
  }
  void plan() {}  // the forward's plan
  // The combine's backward: each kept assignment's send row = weight x dy (weighted outputs)
  // or dy (weighted inputs).
  void permute() {
    this->timed(&stage_times::permute, -1, [&] {
      if constexpr (L::dedup)  // one dy row per (token, rank or node): weighted at the expert
        this->gather_unique(call().dy);
      else
        this->send_rows(call().dy, this->weighted_send(weighting::direction::backward));
    });
  }
  void shared() {
    this->timed(&stage_times::shared, -1, [&] {
      l.store_.with_space(l.space_, [&](const auto& s) {
        l.home_.backward(s, l.pass_.x, call().dy, l.store_.views(), call().grads,
                         l.train_->dx_home(), l.scratch_.data(), call().opt.accumulate,
                         l.router_.routing(l.pass_.tokens()));
      });
    });
  }
  void counts() {}  // ran first
  // dX and dW of unit u's rows: dy rows arrived in the expert buffer, x rows were saved by
  // the forward; dX overwrites dy there for the combine.
  void experts(int u) {
    this->experts_of(u, backward_flops_per_row(), [&](const auto& rows) {
      const grouped_rows<const value_type> in = rows.over(l.train_->saved_inputs(u), l.cfg_.hidden);
      if constexpr (L::dedup) {  // each received row's weight gradient, then its dy x weight
        const auto r = l.ex_.received(l.plan_.host(), u);
        const index_t H = l.cfg_.hidden, S = l.layout_.row_stride;
        l.space_.for_each(r.n, exchange_ops::dedup_weight_grad<value_type>{
                                   r.expert_row,
                                   r.meta,
                                   {rows.data, rows.rows(), H, S},
                                   {l.train_->saved_outputs(u), rows.rows(), H, S},
                                   l.ex_.weight_grad_recv() + r.first});
      }
      const bool acc = call().opt.accumulate || call().grads_started;
      L& ly = l;
      auto& g = call().grads.experts;
      ly.store_.with_space(ly.space_, [&](const auto& s) {
        const grouped_rows<const value_type> dy(rows);
        if constexpr (keeps_hidden<typename L::expert_type, typename L::space_type>)
          L::expert_type::backward(s, ly.store_.views().experts, in, dy, rows, g,
                                   ly.scratch_.data(), acc,
                                   static_cast<const value_type*>(ly.train_->kept_hidden(u)));
        else
          L::expert_type::backward(s, ly.store_.views().experts, in, dy, rows, g,
                                   ly.scratch_.data(), acc);
      });
      call().grads_started = true;
    });
  }
  void combine_start(int u) { this->template combine_start_<true>(u); }
  void combine_wait(int u) { this->template combine_wait_<true>(u); }
  // The router's backward (its weights' gradients are all home now), then dx = the home-rank
  // terms + the sum of each token's kept assignments' dX rows (with dedup one per rank).
  void reduce() {
    this->timed(&stage_times::reduce, -1, [&] {
      const dispatch_plan& p = l.plan_.host();
      const index_t T = l.pass_.tokens(), H = l.cfg_.hidden;
      const auto& w = l.store_.views();
      if constexpr (L::dedup)
        l.space_.for_each(T, rows::gather_weight_grad{l.ex_.weight_grad_send(), p.slot,
                                                      l.train_->weight_grad(T)});
      else if constexpr (base::weighted_send(weighting::direction::forward))
        this->flat_weight_grad(l.pass_.x);  // weighted inputs: x · d(in_k), just back home
      l.home_.weight_grad(l.space_, l.pass_.x, call().dy, l.router_.routing(T),
                          l.train_->weight_grad(T));
      l.router_.backward(
          l.space_,
          {l.pass_.x, l.pass_.token_ids.empty() ? nullptr : l.pass_.token_ids.data(),
           forward_stages<L>::first_token(l), l.pass_.id, w.gate, w.noise_gate, call().grads.gate,
           call().grads.noise_gate, l.train_->weight_grad(T), l.train_->dx_home(), call().opt,
           l.pass_.routing_given, call().grads.gate_bias});
      if (const matrix_view<float> g = call().opt.routing_grad; g.data)  // a given routing's
        l.space_.for_each_row(T, g.cols, rows::copy<float>{l.train_->weight_grad(T), g});
      if constexpr (L::dedup)
        l.space_.for_each_row(
            T, H,
            rows::sum_unique<value_type>{this->send_view(), this->home_slot(p), l.layout_.width,
                                         l.train_->dx_home(), call().dx});
      else
        l.space_.for_each_row(
            T, H,
            rows::weighted_reduce<value_type>{this->send_view(), p.slot,
                                              this->sum_weights(weighting::direction::backward),
                                              l.train_->dx_home(), call().dx});
    });
  }
  void finish() {}

 private:
  auto& call() { return l.train_->now; }
  // The experts' backward FLOPs per row (the policy's count, else twice the forward's).
  double backward_flops_per_row() const {
    const index_t H = l.cfg_.hidden, F = l.cfg_.ffn;
    using X = typename L::expert_type;
    if constexpr (requires { X::backward_flops_per_row(H, F, true); })
      return X::backward_flops_per_row(H, F, !l.train_->keeps());
    else
      return 2.0 * X::flops_per_row(H, F);
  }
};

}  // namespace epmoe::parts
