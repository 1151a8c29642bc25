// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <limits>
#include <mutex>

#include "harness.hpp"

// A namespace per file: the test programs compile their files as one unit.
namespace layer_invariants_tests {
using namespace epmoe;

namespace {

// A gate that makes routing chosen by hand: with H >= E and gate row e = unit vector e,
// token x = 2 at expert a, 1 at expert b, 0 elsewhere picks (a, b) for top-2.
reference::full_weights hand_gate(const layer_config& cfg, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < cfg.experts; ++e) w.gate[e * cfg.hidden + e] = 1.f;
  return w;
}

void pick(std::vector<float>& x, index_t t, index_t hidden, int a, int b) {
  std::fill_n(x.begin() + t * hidden, hidden, 0.f);
  x[t * hidden + a] = 2.f;
  x[t * hidden + b] = 1.f;
}

}  // namespace

TEST_CASE("layer: the same global tokens on 1, 2 and 4 ranks give the same outputs",
          "[layer][invariance]") {
  layer_config cfg{.hidden = 19, .ffn = 29, .experts = 8, .top_k = 2, .ranks = 1, .max_tokens = 96};
  const auto w = reference::full_weights::random(cfg, 11);
  const auto x = reference::random_tokens(96, cfg.hidden, 12);
  std::vector<std::vector<float>> outs;
  for (int R : {1, 2, 4}) {
    cfg.ranks = R;
    cfg.max_tokens = 96 / R;
    test::global_tokens g{std::vector<index_t>(R, 96 / R), x};
    outs.push_back(test::run_layer<test::threads_policies<2>>(cfg, w, g).y);
  }
  CHECK(test::relative_error(outs[1], outs[0]) <= 1e-6);
  CHECK(test::relative_error(outs[2], outs[0]) <= 1e-6);
}

TEST_CASE("layer: rows received over all ranks = routed assignments - dropped, every pass",
          "[layer][conservation]") {
  for (double cf : {0.5, 1.0, 4.0}) {
    const layer_config cfg{.hidden = 16,
                           .ffn = 8,
                           .experts = 8,
                           .top_k = 2,
                           .ranks = 4,
                           .max_tokens = 40,
                           .capacity_factor = cf};
    const auto w = reference::full_weights::random(cfg, 21);
    const auto g = test::make_tokens({40, 3, 0, 25}, cfg.hidden, 22);
    const auto run = test::run_layer<test::threads_policies<2, capacity::factor<true>>>(
        cfg, w, g, {.passes = 3});
    for (int p = 0; p < 3; ++p) {
      index_t received = 0, routed = 0, dropped = 0, sent = 0, recv_rows = 0;
      for (int r = 0; r < cfg.ranks; ++r) {
        const pass_stats& s = run.stats[r][p];
        for (index_t n : s.rows_per_local_expert) received += n;
        for (index_t n : s.routed_per_expert) routed += n;
        for (index_t n : s.rows_sent) sent += n;
        for (index_t n : s.rows_received) recv_rows += n;
        dropped += s.dropped;
        CHECK(s.assignments == g.per_rank[r] * cfg.top_k);
      }
      INFO("cf=" << cf << " pass " << p);
      CHECK(routed == g.total() * cfg.top_k);
      CHECK(received == routed - dropped);
      CHECK(sent == recv_rows);  // every row sent is received once (padding included)
      if (cf >= 4.0) CHECK(dropped == 0);
      if (cf <= 0.5) CHECK(dropped > 0);
    }
  }
}

TEST_CASE("layer: capacity drops exactly the assignments past the limit, in token order",
          "[layer][capacity]") {
  // 2 ranks, 4 experts (0,1 on rank 0; 2,3 on rank 1), top-2, 6 tokens on rank 0, none on
  // rank 1. limit = ceil(cf*T*K/E) = ceil(1.0*6*2/4) = 3 rows per expert per source rank.
  const layer_config cfg{.hidden = 6,
                         .ffn = 5,
                         .experts = 4,
                         .top_k = 2,
                         .ranks = 2,
                         .max_tokens = 6,
                         .capacity_factor = 1.0};
  const auto w = hand_gate(cfg, 31);
  test::global_tokens g{{6, 0}, std::vector<float>(6 * cfg.hidden)};
  // Expert 1 is picked by tokens 0,1,2,3,5 -> tokens 3 and 5 lose expert 1.
  // Expert 2 by 0,4 -> kept. Expert 0 by 1,2,4 -> kept. Expert 3 by 3,5 -> kept.
  const int choice[6][2] = {{1, 2}, {0, 1}, {1, 0}, {3, 1}, {2, 0}, {1, 3}};
  for (int t = 0; t < 6; ++t) pick(g.x, t, cfg.hidden, choice[t][0], choice[t][1]);

  using P = test::threads_policies<2, capacity::factor<false>>;
  const auto got = test::run_layer<P>(cfg, w, g);
  const auto want = test::run_reference<P>(cfg, w, g);
  CHECK(test::relative_error(got.y, want) <= 1e-5);
  CHECK(got.stats[0][0].dropped == 2);
  CHECK(got.stats[1][0].dropped == 0);
  CHECK(got.stats[0][0].rows_per_local_expert[1] == 3);  // expert 1: 5 picks, limit 3

  // The plan marks exactly (t=3, k=1) and (t=5, k=0) as dropped.
  comm::threads_world world(2);
  std::vector<std::int32_t> slots(12);
  std::vector<float> y(6 * cfg.hidden, std::numeric_limits<float>::quiet_NaN());
  world.run([&](comm::threads c) {
    const auto mine = reference::slice(w, placement::block(cfg), c.rank());
    moe_layer<P> layer(cfg, c, {w.gate_view(), mine.experts()});
    const index_t T = g.per_rank[c.rank()];  // all 6 tokens on rank 0, none on rank 1
    layer.forward({g.x.data(), T, cfg.hidden}, {y.data(), T, cfg.hidden});
    if (c.rank() == 0) std::copy_n(layer.last_plan().slot, 12, slots.begin());
  });
  CHECK(test::relative_error(y, want) <= 1e-5);
  for (int t = 0; t < 6; ++t)
    for (int k = 0; k < 2; ++k) {
      const bool dropped = (t == 3 && k == 1) || (t == 5 && k == 0);
      INFO("t=" << t << " k=" << k);
      CHECK((slots[t * 2 + k] < 0) == dropped);
    }
}

TEST_CASE("layer: padding to capacity gives the same output as no padding", "[layer][capacity]") {
  const layer_config cfg{.hidden = 15,
                         .ffn = 9,
                         .experts = 6,
                         .top_k = 2,
                         .ranks = 3,
                         .max_tokens = 33,
                         .capacity_factor = 1.5};
  const auto w = reference::full_weights::random(cfg, 41);
  const auto g = test::make_tokens({33, 10, 0}, cfg.hidden, 42);
  const auto plain = test::run_layer<test::threads_policies<2, capacity::factor<false>>>(cfg, w, g);
  const auto padded = test::run_layer<test::threads_policies<2, capacity::factor<true>>>(cfg, w, g);
  CHECK(test::relative_error(padded.y, plain.y) <= 1e-6);
  // Padding makes every block exactly `limit` rows: rank 0 sends ceil(1.5*33*2/6) = 17 rows
  // per expert, to each of 3 ranks' 2 experts.
  for (int r = 0; r < 3; ++r) CHECK(padded.stats[0][0].rows_sent[r] == 2 * 17);
  CHECK(padded.stats[0][0].padding_rows > 0);
  CHECK(plain.stats[0][0].padding_rows == 0);
}

TEST_CASE("layer: every token on one expert, dropless keeps all and stays correct",
          "[layer][skew]") {
  const layer_config cfg{
      .hidden = 12, .ffn = 7, .experts = 8, .top_k = 2, .ranks = 4, .max_tokens = 64};
  auto w = reference::full_weights::random(cfg, 51);
  // Expert 5's gate row dominates for tokens with positive entries.
  for (int h = 0; h < cfg.hidden; ++h) w.gate[5 * cfg.hidden + h] = 1.f;
  auto g = test::make_tokens({64, 64, 64, 64}, cfg.hidden, 52);
  for (float& v : g.x) v = std::abs(v) + 0.25f;
  using P = test::threads_policies<2>;
  const auto got = test::run_layer<P>(cfg, w, g);
  CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, w, g)) <= 1e-4);
  // Expert 5 lives on rank 2 (slot 1) and got every token of every rank.
  CHECK(got.stats[2][0].rows_per_local_expert[1] == 4 * 64);
  for (int r = 0; r < 4; ++r) {
    CHECK(got.stats[r][0].dropped == 0);
    CHECK(got.stats[r][0].routed_per_expert[5] == 64);
  }
}

TEST_CASE("layer: stats count bytes and FLOPs of the pass", "[layer][stats]") {
  const layer_config cfg{
      .hidden = 10, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 20};
  const auto w = reference::full_weights::random(cfg, 61);
  const auto g = test::make_tokens({20, 20}, cfg.hidden, 62);
  const auto run = test::run_layer<test::threads_policies<2>>(cfg, w, g);
  for (int r = 0; r < 2; ++r) {
    const pass_stats& s = run.stats[r][0];
    const int other = 1 - r;
    CHECK(s.dispatch_bytes_sent == s.rows_sent[other] * cfg.hidden * 4);
    CHECK(s.dispatch_bytes_received == s.rows_received[other] * cfg.hidden * 4);
    CHECK(s.combine_bytes_sent == s.dispatch_bytes_received);
    CHECK(run.stats[other][0].dispatch_bytes_received == s.dispatch_bytes_sent);
    index_t rows = 0;
    for (index_t n : s.rows_per_local_expert) rows += n;
    CHECK(s.expert_flops == Approx(6.0 * cfg.hidden * cfg.ffn * rows));
    // Stages are timed one after another inside the pass: their sum cannot exceed it.
    const stage_times& t = s.time;
    CHECK(t.experts > 0);
    CHECK(t.route + t.plan + t.permute + t.dispatch + t.experts + t.combine + t.shared + t.reduce <=
          t.total);
  }
}

TEST_CASE("layer: every buffer row starts 16-byte aligned whatever H (16-bit GEMMs, vector loads)",
          "[layer][workspace]") {
  int checked = 0;
  for (const index_t elem : {index_t{2}, index_t{4}, index_t{8}}) {
    for (int H = 1; H <= 40; ++H) {
      const layer_config cfg{
          .hidden = H, .ffn = 7, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 8};
      const auto w = workspace_layout::of(
          cfg, 2, 2, 1, 1, false, [](index_t T) { return T; }, 0, elem);
      CAPTURE(elem, H);
      CHECK(w.align * elem == std::max<index_t>(16, elem));
      CHECK(w.row_stride % w.align == 0);
      CHECK(w.row_stride >= H);
      CHECK(w.row_stride < H + w.align);
      ++checked;
    }
  }
  CHECK(checked == 3 * 40);
  // The layer's own layout, odd H: rows of 13 floats are laid out 16 apart.
  const layer_config cfg{
      .hidden = 13, .ffn = 7, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 12};
  std::vector<index_t> strides(2, -1);
  std::mutex m;
  test::run_options<test::threads_policies<2>> opt;
  opt.between = [&](moe_layer<test::threads_policies<2>>& l) {
    std::lock_guard lock(m);
    strides[static_cast<std::size_t>(l.comm().rank())] = l.layout().row_stride;
  };
  const auto wts = reference::full_weights::random(cfg, 81);
  const auto g = test::make_tokens({12, 5}, cfg.hidden, 82);
  const auto got = test::run_layer<test::threads_policies<2>>(cfg, wts, g, opt);
  CHECK(test::relative_error(got.y, test::run_reference<test::threads_policies<2>>(cfg, wts, g)) <=
        1e-4);
  CHECK(strides == std::vector<index_t>{16, 16});
}

TEST_CASE("layer: repeated passes with changing T reuse the workspace", "[layer]") {
  const layer_config cfg{
      .hidden = 9, .ffn = 14, .experts = 4, .top_k = 1, .ranks = 2, .max_tokens = 30};
  const auto w = reference::full_weights::random(cfg, 71);
  comm::threads_world world(2);
  std::vector<double> errs;
  std::mutex m;
  world.run([&](comm::threads c) {
    using P = test::threads_policies<1, capacity::factor<true>>;
    const auto mine = reference::slice(w, placement::block(cfg), c.rank());
    moe_layer<P> layer(cfg, c, {w.gate_view(), mine.experts()});
    for (index_t T : {30, 0, 1, 17, 30}) {
      const auto x = reference::random_tokens(T, cfg.hidden, 100 + T + c.rank());
      std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN()), want;
      layer.forward({x.data(), T, cfg.hidden}, {y.data(), T, cfg.hidden});
      // A single-rank reference of this rank's tokens sees the same capacity limit.
      test::global_tokens g{{T}, x};
      want = test::run_reference<P>(cfg, w, g);
      std::lock_guard lock(m);
      errs.push_back(T == 0 ? 0.0 : test::relative_error(y, want));
    }
  });
  REQUIRE(errs.size() == 10);
  for (double e : errs) CHECK(e <= 1e-4);
}

TEST_CASE("layer: ranks that disagree on the config all throw, naming the field",
          "[layer][agreement]") {
  const layer_config cfg{
      .hidden = 8, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 4, .max_tokens = 16};
  const auto w = reference::full_weights::random(cfg, 81);
  for (const char* field : {"max_tokens", "capacity_factor (x1e9)"}) {
    std::vector<std::string> seen(4);
    comm::threads_world world(4);
    CHECK_THROWS_AS(world.run([&](comm::threads c) {
      layer_config mine = cfg;
      if (c.rank() == 2) {  // one rank with a different, valid config
        if (std::string(field) == "max_tokens")
          mine.max_tokens = 32;
        else
          mine.capacity_factor = 1.5;
      }
      const auto part = reference::slice(w, placement::block(mine), c.rank());
      try {
        moe_layer<test::threads_policies<2>> layer(mine, c, {w.gate_view(), part.experts()});
      } catch (const config_error& e) {
        seen[c.rank()] = e.field();
        throw;
      }
    }),
                    config_error);
    for (int r = 0; r < 4; ++r) CHECK(seen[r] == field);
  }
}

TEST_CASE("layer: one rank with bad weights makes every rank throw, none hangs",
          "[layer][agreement]") {
  const layer_config cfg{
      .hidden = 8, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 16};
  const auto w = reference::full_weights::random(cfg, 82);
  std::vector<std::string> seen(2);
  comm::threads_world world(2);
  CHECK_THROWS_AS(world.run([&](comm::threads c) {
    const auto part = reference::slice(w, placement::block(cfg), c.rank());
    auto experts = part.experts();
    if (c.rank() == 1) experts.w2.cols = 5;  // wrong F on one rank
    try {
      moe_layer<test::threads_policies<2>> layer(cfg, c, {w.gate_view(), experts});
    } catch (const config_error& e) {
      seen[c.rank()] = e.field();
      throw;
    }
  }),
                  config_error);
  CHECK(seen[1] == "weights.experts.w2");
  CHECK(seen[0].rfind("config_valid", 0) == 0);
}

}  // namespace layer_invariants_tests
