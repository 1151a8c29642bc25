// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "harness.hpp"
#include <epmoe/capacity/factor.hpp>
#include <epmoe/schedule/pipelined.hpp>

// Bounded receive buffers (config max_recv_rows): a pass that would receive more rows than
// the bound is exchanged in rounds; nothing is dropped and the buffer never exceeds the bound.
// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_bounded_tests {
using namespace epmoe;

namespace {

template <int K, class Schedule = schedule::sequential, class Capacity = capacity::dropless,
          class Space = space::host>
struct policies : default_policies {
  using space = Space;
  using router = epmoe::router::topk_softmax<K>;
  using capacity = Capacity;
  using comm = epmoe::comm::threads;
  using schedule = Schedule;
};

// Every token of every rank picks expert `hot` first: its gate row dominates for tokens with
// positive entries (dyadic values: exact logits).
struct skewed {
  reference::full_weights w;
  test::global_tokens g;
};
skewed all_to_one(const layer_config& cfg, int hot, std::uint64_t seed) {
  skewed s{
      reference::full_weights::random(cfg, seed),
      test::make_tokens(std::vector<index_t>(cfg.ranks, cfg.max_tokens), cfg.hidden, seed + 1)};
  for (int h = 0; h < cfg.hidden; ++h) s.w.gate[hot * cfg.hidden + h] = 1.f;
  for (float& v : s.g.x) v = std::abs(v) + 0.25f;
  return s;
}

template <class P>
void check_bounded_all_to_one(int chunks) {
  // 8 ranks x 32 tokens x top-2 = 512 assignment rows; the bound is 1/8 of them.
  layer_config cfg{.hidden = 12,
                   .ffn = 7,
                   .experts = 8,
                   .top_k = P::router::top_k,
                   .ranks = 8,
                   .max_tokens = 32};
  cfg.chunks = chunks;
  const index_t total = index_t{cfg.ranks} * cfg.max_tokens * cfg.top_k;
  cfg.max_recv_rows = static_cast<int>(total / 8);
  const auto s = all_to_one(cfg, 5, 81);
  const auto got = test::run_layer<P>(cfg, s.w, s.g);
  CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, s.w, s.g)) <=
        test::tolerance<typename P::space>(1e-5));
  // Expert 5 lives on rank 5 and computed every token of every rank: nothing dropped.
  CHECK(got.stats[5][0].rows_per_local_expert[0] == index_t{cfg.ranks} * cfg.max_tokens);
  for (int r = 0; r < cfg.ranks; ++r) {
    const pass_stats& st = got.stats[r][0];
    CHECK(st.dropped == 0);
    CHECK(st.rounds > 1);
    CHECK(st.peak_recv_rows <= cfg.max_recv_rows);
    CHECK(st.recv_buffer_rows <= cfg.max_recv_rows);
    CHECK(st.recv_buffer_rows > 0);
  }
}

struct dedup_p : policies<2> {
  static constexpr epmoe::layer_options options{.dedup = true};
};

}  // namespace

TEMPLATE_LIST_TEST_CASE(
    "bounded: all tokens to one expert on 8 ranks, bound 1/8 of the rows, sequential",
    "[layer][bounded]", test::spaces) {
  using Space = TestType;
  check_bounded_all_to_one<policies<2, schedule::sequential, capacity::dropless, Space>>(1);
}

TEMPLATE_LIST_TEST_CASE("bounded: all tokens to one expert on 8 ranks, sequential with 3 chunks",
                        "[layer][bounded]", test::spaces) {
  using Space = TestType;
  check_bounded_all_to_one<policies<2, schedule::sequential, capacity::dropless, Space>>(3);
}

TEMPLATE_LIST_TEST_CASE("bounded: all tokens to one expert on 8 ranks, pipelined",
                        "[layer][bounded]", test::spaces) {
  using Space = TestType;
  check_bounded_all_to_one<policies<2, schedule::pipelined<4>, capacity::dropless, Space>>(0);
}

TEMPLATE_LIST_TEST_CASE("bounded: all tokens to one expert on 8 ranks, K = 1", "[layer][bounded]",
                        test::spaces) {
  using Space = TestType;
  check_bounded_all_to_one<policies<1, schedule::sequential, capacity::dropless, Space>>(1);
}

TEMPLATE_LIST_TEST_CASE("bounded: the unbounded pass and every bound give the same outputs",
                        "[layer][bounded]", test::spaces) {
  using Space = TestType;
  // Uneven T, idle ranks, capacity factor (bounded also works with drops), many bounds.
  for (int R : {1, 2, 3, 4}) {
    layer_config cfg{
        .hidden = 9, .ffn = 11, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 23};
    const auto w = reference::full_weights::random(cfg, 90 + R);
    std::vector<index_t> per_rank;
    for (int r = 0; r < R; ++r) per_rank.push_back(r == 1 ? 0 : 23 - 3 * r);
    const auto g = test::make_tokens(per_rank, cfg.hidden, 91 + R);
    const auto want =
        test::run_reference<policies<2, schedule::sequential, capacity::dropless, Space>>(cfg, w,
                                                                                          g);
    for (int bound : {R, R + 1, 3 * R, 7 * R, 1000}) {
      for (int chunks : {1, 2}) {
        INFO("R " << R << " bound " << bound << " chunks " << chunks);
        layer_config c = cfg;
        c.max_recv_rows = bound;
        c.chunks = chunks;
        const auto seq =
            test::run_layer<policies<2, schedule::sequential, capacity::dropless, Space>>(c, w, g);
        CHECK(test::relative_error(seq.y, want) <= test::tolerance<Space>(1e-5));
        for (int r = 0; r < R; ++r) CHECK(seq.stats[r][0].peak_recv_rows <= bound);
        if (bound >= 3 * R) {
          const auto pipe =
              test::run_layer<policies<2, schedule::pipelined<2>, capacity::dropless, Space>>(c, w,
                                                                                              g);
          CHECK(test::relative_error(pipe.y, want) <= test::tolerance<Space>(1e-5));
          for (int r = 0; r < R; ++r) CHECK(pipe.stats[r][0].recv_buffer_rows <= bound);
        }
        using F = policies<2, schedule::sequential, capacity::factor<false>, Space>;
        const test::run_options<F> opt{};
        const auto drop = test::run_layer<F>(c, w, g, opt);
        CHECK(test::relative_error(drop.y, test::run_reference<F>(cfg, w, g, opt)) <=
              test::tolerance<Space>(1e-5));
      }
    }
  }
}

TEMPLATE_LIST_TEST_CASE("bounded: repeated passes reuse the rounds workspace", "[layer][bounded]",
                        test::spaces) {
  using Space = TestType;
  layer_config cfg{.hidden = 8, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 40};
  cfg.max_recv_rows = 6;
  const auto w = reference::full_weights::random(cfg, 93);
  test::run_options<policies<2, schedule::sequential, capacity::dropless, Space>> opt;
  opt.passes = 3;
  const auto g = test::make_tokens({40, 17}, cfg.hidden, 94);
  const auto got =
      test::run_layer<policies<2, schedule::sequential, capacity::dropless, Space>>(cfg, w, g, opt);
  CHECK(
      test::relative_error(
          got.y, test::run_reference<policies<2, schedule::sequential, capacity::dropless, Space>>(
                     cfg, w, g)) <= test::tolerance<Space>(1e-5));
  for (int r = 0; r < 2; ++r) {
    REQUIRE(got.stats[r].size() == 3);
    for (const pass_stats& s : got.stats[r]) {
      CHECK(s.rounds > 1);  // the busier pair moves ~40 rows, 3 a round
      CHECK(s.peak_recv_rows <= 6);
      CHECK(s.timeline.size() == static_cast<std::size_t>(3 * s.rounds));
    }
  }
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
// Dedup: a round is a window of tokens (each sends one row per rank), 8 tokens of every rank.
TEST_CASE("bounded: all tokens to one expert on 8 ranks, dedup in windows of tokens",
          "[layer][bounded]") {
  check_bounded_all_to_one<dedup_p>(1);
}

TEST_CASE("bounded: invalid max_recv_rows and unsupported combinations are rejected",
          "[layer][bounded][error]") {
  layer_config cfg{.hidden = 8, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 8};
  const auto w = reference::full_weights::random(cfg, 95);
  // Every rank must throw config_error naming max_recv_rows with the rule; any other
  // exception escapes world.run and fails the test.
  auto rejected = [&]<class P>(layer_config c, const char* must_contain) {
    std::vector<std::string> field(2), what(2);  // per rank: no lock needed
    comm::threads_world world(c.ranks);
    world.run([&](comm::threads comm) {
      const auto mine = reference::slice(w, placement::block(cfg), comm.rank());
      try {
        moe_layer<P> layer(c, comm, {w.gate_view(), mine.experts()});
      } catch (const config_error& e) {
        field[comm.rank()] = e.field();
        what[comm.rank()] = e.what();
      }
    });
    int ranks = 0;
    for (int r = 0; r < 2; ++r, ++ranks) {
      INFO("rank " << r << ": " << what[r]);
      CHECK(field[r] == "max_recv_rows");
      CHECK(what[r].find(must_contain) != std::string::npos);
    }
    return ranks;
  };
  layer_config c = cfg;
  c.max_recv_rows = -1;
  CHECK(rejected.operator()<policies<2>>(c, ">= 0") == 2);
  c.max_recv_rows = 1;  // < ranks
  CHECK(rejected.operator()<policies<2>>(c, ">= ranks") == 2);
  c.max_recv_rows = 4;  // >= R, but a pipelined schedule keeps 3 rounds in flight
  CHECK(rejected.operator()<policies<2, schedule::pipelined<2>>>(c, "ranks * 3") == 2);
  c.max_recv_rows = 64;
  CHECK(rejected.operator()<policies<2, schedule::sequential, capacity::factor<true>>>(
            c, "capacity::dropless") == 2);
}

TEST_CASE("bounded: ranks that disagree on max_recv_rows all throw naming it",
          "[layer][bounded][error]") {
  layer_config cfg{.hidden = 8, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 8};
  const auto w = reference::full_weights::random(cfg, 96);
  std::vector<std::string> fields(2);
  comm::threads_world world(2);
  world.run([&](comm::threads comm) {
    layer_config c = cfg;
    c.max_recv_rows = comm.rank() == 0 ? 0 : 16;
    const auto mine = reference::slice(w, placement::block(cfg), comm.rank());
    try {
      moe_layer<policies<2>> layer(c, comm, {w.gate_view(), mine.experts()});
    } catch (const config_error& e) {
      fields[comm.rank()] = e.field();
    }
  });
  CHECK(fields[0] == "max_recv_rows");
  CHECK(fields[1] == "max_recv_rows");
}
#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

}  // namespace layer_bounded_tests
