// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <array>
#include <catch2/catch.hpp>
#include <limits>
#include <vector>

#include "harness.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/schedule/pipelined.hpp>

// The pipelined schedule computes exactly what the sequential one does, chunk by chunk.
// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_pipelined_tests {
using namespace epmoe;

namespace {

template <class Capacity, bool Dedup, class Schedule, class Space = space::host>
struct policies : test::threads_policies<2, Capacity, Space> {
  using schedule = Schedule;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};

template <class Capacity, bool Dedup, class Space>
void pipelined_equals_sequential() {
  using Seq = policies<Capacity, Dedup, schedule::sequential, Space>;
  using Pipe = policies<Capacity, Dedup, schedule::pipelined<4>, Space>;
  for (int C : {1, 2, 3, 4, 8, 40}) {  // 40 > the tokens of some ranks: empty chunks
    CAPTURE(C);
    layer_config cfg{.hidden = 11,
                     .ffn = 7,
                     .experts = 8,
                     .top_k = 2,
                     .ranks = 4,
                     .max_tokens = 33,
                     .capacity_factor = 0.8,
                     .chunks = C};
    const auto w = reference::full_weights::random(cfg, 10 + C);
    const auto g = test::make_tokens({33, 0, 5, 17}, cfg.hidden, 20 + C);
    const auto seq = test::run_layer<Seq>(cfg, w, g);
    const auto pipe = test::run_layer<Pipe>(cfg, w, g);
    CHECK(test::relative_error(pipe.y, seq.y) <= test::tolerance<Space>(1e-6));
    CHECK(test::relative_error(pipe.y, test::run_reference<Seq>(cfg, w, g)) <=
          test::tolerance<Space>(1e-4));
    for (int r = 0; r < 4; ++r) {
      CHECK(pipe.stats[r][0].chunks == C);
      CHECK(pipe.stats[r][0].dropped == seq.stats[r][0].dropped);
      CHECK(pipe.stats[r][0].rows_per_local_expert == seq.stats[r][0].rows_per_local_expert);
      // Every chunk's expert FLOPs are counted (padding included), not the last chunk's only.
      index_t rows = 0;
      for (index_t n : pipe.stats[r][0].padded_rows_per_local_expert) rows += n;
      CHECK(pipe.stats[r][0].expert_flops == Approx(6.0 * cfg.hidden * cfg.ffn * rows));
    }
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("pipelined: equals sequential, dropless", "[layer][pipelined]",
                        test::spaces) {
  pipelined_equals_sequential<capacity::dropless, false, TestType>();
}
TEMPLATE_LIST_TEST_CASE("pipelined: equals sequential, capacity factor", "[layer][pipelined]",
                        test::spaces) {
  pipelined_equals_sequential<capacity::factor<false>, false, TestType>();
}
TEMPLATE_LIST_TEST_CASE("pipelined: equals sequential, padded capacity", "[layer][pipelined]",
                        test::spaces) {
  pipelined_equals_sequential<capacity::factor<true>, false, TestType>();
}
TEMPLATE_LIST_TEST_CASE("pipelined: equals sequential, dedup", "[layer][pipelined]", test::spaces) {
  pipelined_equals_sequential<capacity::dropless, true, TestType>();
  pipelined_equals_sequential<capacity::factor<false>, true, TestType>();
}

// Below: the host's timeline and a throttled link (host comms).
#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC

TEST_CASE("pipelined: T = 0 on every rank, and shared experts", "[layer][pipelined]") {
  using Pipe = policies<capacity::dropless, false, schedule::pipelined<3>>;
  layer_config cfg{.hidden = 9,
                   .ffn = 5,
                   .experts = 4,
                   .top_k = 2,
                   .ranks = 2,
                   .max_tokens = 8,
                   .shared_experts = 1};
  const auto w = reference::full_weights::random(cfg, 3);
  // An empty pass on every rank runs every chunk, moves nothing, and leaves the layer
  // ready for the next pass (shared-expert sums included).
  const auto none = test::run_layer<Pipe>(cfg, w, test::make_tokens({0, 0}, cfg.hidden, 4));
  for (int r = 0; r < 2; ++r) {
    REQUIRE(none.stats[r].size() == 1);
    const pass_stats& s = none.stats[r][0];
    CHECK(s.tokens == 0);
    CHECK(s.assignments == 0);
    CHECK(s.dispatch_bytes_sent + s.combine_bytes_sent == 0);
    CHECK(s.rows_sent == std::vector<index_t>(2, 0));
    CHECK(s.rows_per_local_expert == std::vector<index_t>(2, 0));
    CHECK(s.chunks == 3);
    CHECK(s.timeline.size() == 9);  // 3 chunks x (dispatch, experts, combine), all empty
    for (const timeline_event& e : s.timeline) CHECK(e.rows == 0);
  }
  const auto g = test::make_tokens({8, 3}, cfg.hidden, 5);
  const auto want = test::run_reference<Pipe>(cfg, w, g);
  CHECK(test::relative_error(test::run_layer<Pipe>(cfg, w, g).y, want) <= 1e-4);
  // The same layers, an empty pass first, then the tokens.
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> y(g.x.size(), nan);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(w, placement::block(cfg), r);
    moe_layer<Pipe> layer(cfg, c, {w.gate_view(), mine.experts(), w.shared()});
    layer.forward({g.x.data(), 0, cfg.hidden}, {y.data(), 0, cfg.hidden});
    const index_t T = g.per_rank[r], H = cfg.hidden;
    layer.forward({g.x.data() + g.offset(r) * H, T, H}, {y.data() + g.offset(r) * H, T, H});
  });
  CHECK(test::relative_error(y, want) <= 1e-4);
}

namespace {

// Each chunk's (dispatch, experts, combine) events of one pass, [chunk][stage].
std::vector<std::array<const timeline_event*, 3>> by_chunk(const pass_stats& s) {
  std::vector<std::array<const timeline_event*, 3>> ev(static_cast<std::size_t>(s.chunks));
  for (const timeline_event& e : s.timeline) {
    REQUIRE((e.chunk >= 0 && e.chunk < s.chunks));
    const auto*& slot = ev[static_cast<std::size_t>(e.chunk)][static_cast<int>(e.stage)];
    CHECK(slot == nullptr);  // once
    slot = &e;
  }
  for (const auto& c : ev) REQUIRE((c[0] && c[1] && c[2]));
  return ev;
}

constexpr int dispatch = 0, experts = 1, combine = 2;

}  // namespace

TEST_CASE("pipelined: the timeline holds every stage of every chunk once, in order",
          "[layer][pipelined]") {
  using Pipe = policies<capacity::dropless, false, schedule::pipelined<4>>;
  const layer_config cfg{
      .hidden = 8, .ffn = 6, .experts = 8, .top_k = 2, .ranks = 2, .max_tokens = 20};
  const auto w = reference::full_weights::random(cfg, 6);
  const auto run = test::run_layer<Pipe>(cfg, w, test::make_tokens({20, 3}, cfg.hidden, 7));
  for (int r = 0; r < 2; ++r) {
    const pass_stats& s = run.stats[r][0];
    REQUIRE(s.chunks == 4);
    REQUIRE(s.timeline.size() == 12);
    const auto ev = by_chunk(s);
    for (int c = 0; c < 4; ++c) {
      for (const timeline_event* e : ev[c]) CHECK(e->start <= e->end);
      CHECK(ev[c][dispatch]->end <= ev[c][experts]->start);  // experts after their rows arrived
      CHECK(ev[c][experts]->end <= ev[c][combine]->start);   // combine after the experts
      if (c > 0) CHECK(ev[c - 1][experts]->end <= ev[c][experts]->start);  // chunks in order
    }
    CHECK(s.comm_seconds > 0);
    CHECK(s.overlap == Approx(1.0 - s.exposed_comm_seconds / s.comm_seconds));
  }
}

TEST_CASE("pipelined: the next chunk's dispatch is in flight while this chunk's experts run",
          "[layer][pipelined]") {
  // Read from the timeline of one pass (no timing thresholds, no retries): the schedule's
  // order alone decides it. The sequential schedule on the same chunks overlaps nothing.
  layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 8, .top_k = 2, .ranks = 4, .max_tokens = 32, .chunks = 4};
  const auto w = reference::full_weights::random(cfg, 11);
  const auto g = test::make_tokens({32, 32, 17, 32}, cfg.hidden, 12);
  const auto pipe =
      test::run_layer<policies<capacity::dropless, false, schedule::pipelined<4>>>(cfg, w, g);
  const auto seq =
      test::run_layer<policies<capacity::dropless, false, schedule::sequential>>(cfg, w, g);
  CHECK(test::relative_error(pipe.y, seq.y) <= 1e-6);
  int pairs = 0;
  for (int r = 0; r < cfg.ranks; ++r) {
    CAPTURE(r);
    REQUIRE(pipe.stats[r][0].chunks == 4);
    REQUIRE(seq.stats[r][0].chunks == 4);
    const auto p = by_chunk(pipe.stats[r][0]), q = by_chunk(seq.stats[r][0]);
    for (int c = 0; c + 1 < 4; ++c) {
      CAPTURE(c);
      // Pipelined: chunk c+1's rows travel while chunk c computes ...
      CHECK(p[c + 1][dispatch]->start < p[c][experts]->end);
      // ... and chunk c's combine is in flight while chunk c+1 computes.
      CHECK(p[c][combine]->start < p[c + 1][experts]->start);
      CHECK(p[c][combine]->end >= p[c + 1][experts]->end);
      // Sequential: chunk c+1 starts after chunk c came back.
      CHECK(q[c + 1][dispatch]->start >= q[c][experts]->end);
      CHECK(q[c + 1][dispatch]->start >= q[c][combine]->end);
      ++pairs;
    }
  }
  CHECK(pairs == 4 * 3);
}

namespace {

template <class Schedule>
struct throttled_policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::throttled<epmoe::comm::threads>;
  using schedule = Schedule;
};

// One pass of 4 chunks on 2 ranks over a 100 MB/s link with 2 ms latency (the wire
// dominates); checks what holds for any schedule and returns each rank's stats.
template <class Schedule>
std::vector<pass_stats> throttled_pass() {
  using P = throttled_policies<Schedule>;
  const layer_config cfg{
      .hidden = 16, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 32, .chunks = 4};
  const auto w = reference::full_weights::random(cfg, 8);
  const auto g = test::make_tokens({32, 32}, cfg.hidden, 9);
  std::vector<float> y(g.x.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<pass_stats> stats(2);
  comm::threads_world world(2);
  const comm::link slow{.bandwidth = 1e8, .latency = 2e-3};
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(w, placement::block(cfg), r);
    moe_layer<P> layer(cfg, comm::throttled<comm::threads>(c, slow),
                       {w.gate_view(), mine.experts()});
    layer.forward({g.x.data() + r * 32 * 16, 32, 16}, {y.data() + r * 32 * 16, 32, 16});
    stats[r] = layer.stats();
  });
  CHECK(test::relative_error(y, test::run_reference<P>(cfg, w, g)) <= 1e-4);
  for (const pass_stats& s : stats) {
    REQUIRE(s.chunks == 4);
    REQUIRE(s.timeline.size() == 12);
    // Each exchange waits out at least the link's time for the rows it brought in (the
    // model charges the larger of in and out), and comm_seconds counts at least their sum.
    double modeled = 0;
    int exchanges = 0;
    for (const timeline_event& e : s.timeline) {
      if (e.stage == stage_kind::experts) continue;
      const double wire = slow.latency + static_cast<double>(e.bytes) / slow.bandwidth;
      CHECK(e.end - e.start >= wire - 1e-6);  // 1 us: the deadline's rounding to the clock
      modeled += wire;
      ++exchanges;
    }
    CHECK(exchanges == 8);
    CHECK(s.comm_seconds >= modeled - 1e-5);
    CHECK(s.overlap == Approx(1.0 - s.exposed_comm_seconds / s.comm_seconds));
  }
  return stats;
}

}  // namespace

TEST_CASE("pipelined: over a throttled link, outputs unchanged and the wire time counted",
          "[layer][pipelined][throttled]") {
  // Sequential: each exchange is waited at once, so its event is the link's time itself.
  throttled_pass<schedule::sequential>();
  const auto pipe = throttled_pass<schedule::pipelined<4>>();
  for (const pass_stats& s : pipe) {
    const auto ev = by_chunk(s);
    for (int c = 0; c + 1 < 4; ++c) CHECK(ev[c + 1][dispatch]->start < ev[c][experts]->end);
  }
}
#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

}  // namespace layer_pipelined_tests
