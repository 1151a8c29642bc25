// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "harness.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/schedule/pipelined.hpp>

// The pipelined schedule computes exactly what the sequential one does, chunk by chunk.
using namespace epmoe;

namespace {

template <class Capacity, bool Dedup, class Schedule>
struct policies : test::threads_policies<2, Capacity> {
  using schedule = Schedule;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};

template <class Capacity, bool Dedup>
void pipelined_equals_sequential() {
  using Seq = policies<Capacity, Dedup, schedule::sequential>;
  using Pipe = policies<Capacity, Dedup, schedule::pipelined<4>>;
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
    CHECK(test::relative_error(pipe.y, seq.y) <= 1e-6);
    CHECK(test::relative_error(pipe.y, test::run_reference<Seq>(cfg, w, g)) <= 1e-4);
    for (int r = 0; r < 4; ++r) {
      CHECK(pipe.stats[r][0].chunks == C);
      CHECK(pipe.stats[r][0].dropped == seq.stats[r][0].dropped);
      CHECK(pipe.stats[r][0].rows_per_local_expert == seq.stats[r][0].rows_per_local_expert);
    }
  }
}

}  // namespace

TEST_CASE("pipelined: equals sequential, dropless", "[layer][pipelined]") {
  pipelined_equals_sequential<capacity::dropless, false>();
}
TEST_CASE("pipelined: equals sequential, capacity factor", "[layer][pipelined]") {
  pipelined_equals_sequential<capacity::factor<false>, false>();
}
TEST_CASE("pipelined: equals sequential, padded capacity", "[layer][pipelined]") {
  pipelined_equals_sequential<capacity::factor<true>, false>();
}
TEST_CASE("pipelined: equals sequential, dedup", "[layer][pipelined]") {
  pipelined_equals_sequential<capacity::dropless, true>();
  pipelined_equals_sequential<capacity::factor<false>, true>();
}

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
  const auto none = test::run_layer<Pipe>(cfg, w, test::make_tokens({0, 0}, cfg.hidden, 4));
  CHECK(none.y.empty());
  const auto g = test::make_tokens({8, 3}, cfg.hidden, 5);
  CHECK(test::relative_error(test::run_layer<Pipe>(cfg, w, g).y,
                             test::run_reference<Pipe>(cfg, w, g)) <= 1e-4);
}

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
    for (int c = 0; c < 4; ++c) {
      const timeline_event* ev[3] = {};
      for (const timeline_event& e : s.timeline)
        if (e.chunk == c) {
          CHECK(ev[static_cast<int>(e.stage)] == nullptr);  // once
          ev[static_cast<int>(e.stage)] = &e;
        }
      REQUIRE((ev[0] && ev[1] && ev[2]));
      for (const timeline_event* e : ev) CHECK(e->start <= e->end);
      CHECK(ev[0]->end <= ev[1]->start);  // experts after their rows arrived
      CHECK(ev[1]->end <= ev[2]->start);  // combine after the experts
      if (c > 0) {                        // chunks in order
        for (const timeline_event& e : s.timeline)
          if (e.chunk == c - 1 && e.stage == stage_kind::experts) CHECK(e.end <= ev[1]->start);
      }
    }
    CHECK(s.comm_seconds >= s.exposed_comm_seconds);
    CHECK((s.overlap >= 0 && s.overlap <= 1));
  }
}

TEST_CASE("pipelined: over a throttled link, outputs unchanged and the wire time counted",
          "[layer][pipelined][throttled]") {
  struct P : default_policies {
    using router = epmoe::router::topk_softmax<2>;
    using comm = epmoe::comm::throttled<epmoe::comm::threads>;
    using schedule = epmoe::schedule::pipelined<4>;
  };
  const layer_config cfg{
      .hidden = 16, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 32};
  const auto w = reference::full_weights::random(cfg, 8);
  const auto g = test::make_tokens({32, 32}, cfg.hidden, 9);
  std::vector<float> y(g.x.size());
  std::vector<pass_stats> stats(2);
  comm::threads_world world(2);
  const comm::link slow{.bandwidth = 1e8, .latency = 1e-4};  // 100 MB/s: the wire dominates
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
    // 8 exchanges of >= 1e-4 s latency each, plus counts: the wire time is accounted.
    CHECK(s.comm_seconds >= 8e-4);
    CHECK(s.exposed_comm_seconds <= s.comm_seconds);
  }
}
