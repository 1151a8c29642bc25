// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <vector>

#include "epmoe/core/stats.hpp"

// The stage clock of a pass: the stages and exchanges note marks of the space's clock (host:
// the time at once; a device: events on its stream), and resolve() turns them into the
// pass's stage times, timeline and all-to-all time once the marks can be read (at once on the
// host, after a synchronisation on a device). Every record is reserved at construction: a
// pass allocates nothing.
namespace epmoe {

template <class Space>
class pass_clock {
 public:
  using space_clock = typename Space::clock;
  using mark = typename space_clock::mark;

  pass_clock() = default;
  /// Room for `stages` stage spans, `events` timeline events and `exchanges` exchanges.
  pass_clock(space_clock c, std::size_t stages, std::size_t events, std::size_t exchanges)
      : clock_(std::move(c)) {
    stages_.reserve(stages);
    events_.reserve(events);
    exchanges_.reserve(exchanges);
  }

  void begin_pass() {
    clock_.begin_pass();
    stages_.clear();
    events_.clear();
    exchanges_.clear();
    start_ = clock_.now();
  }
  mark now() { return clock_.now(); }

  /// A stage ran from a to b (time adds up when a stage runs several times).
  void stage(double stage_times::*field, mark a, mark b) { push(stages_, {field, a, b}); }
  /// A timeline event (a chunk's dispatch, experts or combine) ran from a to b.
  void event(int chunk, stage_kind kind, int round, index_t rows, index_t bytes, mark a, mark b) {
    push(events_, {chunk, kind, round, rows, bytes, a, b});
  }
  /// An exchange: the caller was blocked while starting it (sa to sb) and waiting for it (wa
  /// to wb); `modeled` is the link model's time for it (0: none).
  void exchange(mark sa, mark sb, mark wa, mark wb, double modeled) {
    push(exchanges_, {sa, sb, wa, wb, modeled});
  }

  /// Fills the times of `s` from the marks (read them only once they are complete).
  void resolve(pass_stats& s) const {
    const double t0 = clock_.seconds(start_);
    const auto at = [&](mark m) { return clock_.seconds(m) - t0; };
    s.time = {};
    s.began = {};
    stage_times seen{};
    for (const stage_span& r : stages_) {
      const double a = at(r.a), b = at(r.b);
      if (seen.*r.field == 0) s.began.*r.field = a, seen.*r.field = 1;
      s.time.*r.field += b - a;
    }
    s.timeline.clear();  // keeps its capacity
    for (const event_span& e : events_)
      if (s.timeline.size() < s.timeline.capacity())
        s.timeline.push_back({e.chunk, e.kind, at(e.a), at(e.b), e.round, e.rows, e.bytes});
    // Each exchange's wire time is what the rank was blocked, or the link model's when
    // longer (the rest ran while the rank computed: hidden).
    s.comm_seconds = s.exposed_comm_seconds = 0;
    for (const exchange_span& x : exchanges_) {
      const double blocked = (at(x.sb) - at(x.sa)) + (at(x.wb) - at(x.wa));
      s.comm_seconds += std::max(blocked, x.modeled);
      s.exposed_comm_seconds += blocked;
    }
    s.overlap = s.comm_seconds > 0 ? 1.0 - s.exposed_comm_seconds / s.comm_seconds : 0.0;
  }
  /// Seconds from the pass's start to mark m.
  double since_start(mark m) const { return clock_.seconds(m) - clock_.seconds(start_); }

 private:
  using stage_field = double stage_times::*;
  struct stage_span {
    stage_field field;
    mark a, b;
  };
  struct event_span {
    int chunk;
    stage_kind kind;
    int round;
    index_t rows, bytes;
    mark a, b;
  };
  struct exchange_span {
    mark sa, sb, wa, wb;
    double modeled;
  };
  template <class V>
  static void push(V& v, typename V::value_type r) {
    if (v.size() < v.capacity()) v.push_back(r);
  }

  space_clock clock_{};
  mark start_{};
  std::vector<stage_span> stages_;
  std::vector<event_span> events_;
  std::vector<exchange_span> exchanges_;
};

}  // namespace epmoe
