// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <span>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/parts/stages.hpp"

// A forward in two or three calls (docs/decode.md, "Split phase and two-batch overlap"): start
// runs route, plan, permute, shared, the counts exchange (every rank's verdict) and posts the
// first unit's dispatch (the low-latency exchange on a comm that posts: its one round, the
// verdicts riding with the rows, read in finish); experts (optional) waits for it, runs the experts
// and posts the combine; finish waits for the combine and sums. Between the calls the caller
// computes (another micro-batch's attention or experts) while an exchange is on the wire. The units
// run one after another (the other micro-batch is the overlap).
namespace epmoe {

/// What start returns and finish consumes, once: the pass's number (and, in a split_layer,
/// the lane that holds its state).
struct split_handle {
  std::uint64_t id = 0;
  int lane = 0;
};

}  // namespace epmoe

namespace epmoe::parts {

/// The one split pass a layer may hold between start and finish.
struct split_state {
  bool open = false;
  bool experts_done = false;  // experts(handle) ran: the last combine is posted
  std::uint64_t id = 0;

  /// A call that needs the layer's pass state (forward, backward, start) while a split pass
  /// holds it is refused, by name.
  void idle(const char* call) const {
    if (open)
      throw config_error(call, "while split pass " + std::to_string(id) + " is in flight",
                         "finish(handle) first: a layer holds one pass's state (a split_layer "
                         "holds one per in-flight pass)");
  }
};

template <class L>
struct split_stages : forward_stages<L> {
  using base = forward_stages<L>;
  using base::l;
  using value_type = typename L::value_type;

  explicit split_stages(L& layer) : base(layer) {}

  /// The first half of a forward of l (check: as forward's). On a rejected input every rank
  /// throws here and nothing is written; the pass is then not in flight (a posted low-latency
  /// round: every rank throws in finish instead, and nothing is written).
  template <class Check>
  static split_handle start_pass(L& l, matrix_view<const value_type> x, matrix_view<value_type> y,
                                 std::span<const std::int64_t> token_ids, Check&& check) {
    l.life_.usable();
    l.split_.idle("start");
    auto& pass = l.pass_;
    pass = {};
    pass.id = l.passes_, pass.x = x, pass.y = y, pass.token_ids = token_ids;
    try {
      l.store_.require_readable();
      check();
    } catch (...) {
      pass.make_empty(std::current_exception());
    }
    if (l.train_) l.train_->begin_forward();  // forward only: the split pass keeps nothing
    dispatch_plan& p = l.plan_.host();
    p.rounds = rounds_per_chunk(l.layout_, l.cfg_, l.chunks_);
    p.chunks = l.chunks_ * p.rounds;
    l.stats_.chunks = l.chunks_;
    l.stats_.backward = false;
    begin(l);
    split_stages s(l);
    s.guarded([&] {
      l.clock_.begin_pass();
      const auto a = l.clock_.now();
      s.route();
      s.plan();
      s.permute();
      s.shared();
      // Every rank's verdict: a rejected input throws here, on every rank; a low-latency
      // round carries the verdicts with the rows: posted here, read in finish.
      s.counts(device_space<typename L::space_type> || L::options.low_latency);
      if (s.chunks() > 0) s.dispatch_start(0);
      l.clock_.stage(&stage_times::total, a, l.clock_.now());
    });
    l.split_.open = true, l.split_.experts_done = false, l.split_.id = l.passes_;
    return {l.passes_, 0};
  }

  /// The middle step (optional): waits for the dispatch, runs the experts and posts the
  /// combine (the last unit's: the caller computes while it is on the wire).
  static void experts_pass(L& l, split_handle h) {
    check(l, h, "experts(handle)");
    if (l.split_.experts_done)
      throw config_error("experts(handle)", "pass " + std::to_string(h.id),
                         "ran its experts already: call experts(handle) at most once, before "
                         "finish(handle)");
    l.split_.experts_done = true;
    split_stages s(l);
    s.guarded([&] {
      const auto a = l.clock_.now();
      const int n = s.chunks();
      for (int u = 0; u < n; ++u) {
        if (u > 0) s.dispatch_start(u);
        s.dispatch_wait(u);
        s.experts(u);
        s.combine_start(u);
        if (u + 1 < n) s.combine_wait(u);
      }
      l.clock_.stage(&stage_times::total, a, l.clock_.now());
    });
  }

  /// The second half: the experts step unless it ran, then waits for the combine and sums
  /// into the y given to start. h: what start returned (once).
  static void finish_pass(L& l, split_handle h) {
    check(l, h, "finish(handle)");
    if (!l.split_.experts_done) {
      try {
        experts_pass(l, h);
      } catch (...) {
        l.split_.open = false;
        throw;
      }
    }
    l.split_.open = false;  // whatever happens next
    l.pending_ = true;
    split_stages s(l);
    s.guarded([&] {
      const auto a = l.clock_.now();
      if (const int n = s.chunks(); n > 0) s.combine_wait(n - 1);
      s.reduce();
      s.finish();
      l.clock_.stage(&stage_times::total, a, l.clock_.now());  // time spent in the layer
    });
    ++l.passes_;
    if (l.pass_.error) std::rethrow_exception(l.pass_.error);  // device static shapes
    // A verdict that came with the dispatch (deferred): read now, a rejection throws here.
    if (l.pass_.deferred) l.stats();
    l.stats_.saved_bytes = 0;
    if (l.train_) l.train_->end_inference(h.id);
  }

 private:
  static void check(const L& l, split_handle h, const char* call) {
    l.life_.usable();
    if (!l.split_.open || h.id != l.split_.id)
      throw config_error(call, "pass " + std::to_string(h.id),
                         l.split_.open ? "is not the split pass in flight (pass " +
                                             std::to_string(l.split_.id) + "): finish each once"
                                       : std::string("no split pass is in flight: finish each "
                                                     "handle once, after its start"));
  }
  static void begin(L& l) {
    l.stats_.expert_flops = 0;
    l.stats_.started =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - l.built_).count();
    l.pending_ = true;
  }
  template <class F>
  void guarded(F&& f) {
    const auto unit_text = [&](int u) {
      const dispatch_plan& p = l.plan_.host();
      return "chunk " + std::to_string(l.ex_.chunk_of_unit(p, u)) + ", round " +
             std::to_string(l.ex_.round_of_unit(p, u));
    };
    l.life_.run(l.space_, l.comm_, call_kind::forward, l.passes_, unit_text, f);
  }
};

}  // namespace epmoe::parts
