// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <vector>

#include "harness.hpp"
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/round_robin.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

// Placement decides where experts live, never what a token computes.
// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_placement_tests {
using namespace epmoe;

namespace {

template <class Placement, class Capacity = capacity::dropless, bool Dedup = false,
          class Space = space::host>
struct policies : test::threads_policies<2, Capacity, Space> {
  using placement = Placement;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};

// 8 experts on 4 ranks with 12 slots (3 per rank): experts 0 and 1 are hot and get copies.
placement::table replicated(int ranks_per_node = 0) {
  //                      rank 0    rank 1    rank 2    rank 3
  return placement::table(8, 4, {0, 2, 3, 1, 4, 5, 0, 6, 1, 7, 0, 1}, ranks_per_node);
}

layer_config cfg4(double cf = 1.0) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .top_k = 2,
          .ranks = 4,
          .max_tokens = 48,
          .capacity_factor = cf};
}

// Tokens skewed toward experts 0 and 1 (the replicated ones).
test::global_tokens skewed(const layer_config& cfg, reference::full_weights& w) {
  for (int e = 0; e < 2; ++e)
    for (int h = 0; h < cfg.hidden; ++h) w.gate[e * cfg.hidden + h] += 0.5f;
  auto g = test::make_tokens({48, 30, 0, 48}, cfg.hidden, 5);
  for (float& v : g.x) v = std::abs(v);
  return g;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE(
    "placement: block, round-robin and replicated tables all equal the reference",
    "[layer][placement]", test::spaces) {
  using Space = TestType;
  const layer_config cfg = cfg4();
  auto w = reference::full_weights::random(cfg, 1);
  const auto g = skewed(cfg, w);
  using B = policies<placement::block, capacity::dropless, false, Space>;
  using RR = policies<placement::round_robin, capacity::dropless, false, Space>;
  using Tab = policies<placement::table, capacity::dropless, false, Space>;
  const auto block = test::run_layer<B>(cfg, w, g);
  CHECK(test::relative_error(block.y, test::run_reference<B>(cfg, w, g)) <=
        test::tolerance<Space>(1e-4));
  CHECK(test::relative_error(test::run_layer<RR>(cfg, w, g).y, block.y) <=
        test::tolerance<Space>(1e-5));
  for (int rpn : {0, 2}) {  // one node, or two nodes of two ranks: a different copy choice
    CAPTURE(rpn);
    const auto rep = test::run_layer<Tab>(cfg, w, g, {.placement = replicated(rpn)});
    CHECK(test::relative_error(rep.y, block.y) <= test::tolerance<Space>(1e-5));
    // The hot expert's rows are spread over its copies: no rank computes them all.
    std::vector<index_t> copy_rows;  // rows each copy of expert 0 computed
    index_t routed_e0 = 0;
    for (int r = 0; r < 4; ++r) {
      const auto& s = rep.stats[r][0];
      routed_e0 += s.routed_per_expert[0];
      for (int j = 0; j < 3; ++j)
        if (replicated(rpn).expert_at(r, j) == 0) copy_rows.push_back(s.rows_per_local_expert[j]);
    }
    REQUIRE(copy_rows.size() == 3);  // on ranks 0, 2 and 3
    CHECK(routed_e0 > 0);
    CHECK(std::accumulate(copy_rows.begin(), copy_rows.end(), index_t{0}) == routed_e0);
    CHECK(*std::max_element(copy_rows.begin(), copy_rows.end()) < routed_e0);
  }
}

TEMPLATE_LIST_TEST_CASE("placement: with capacity and dedup, replicated tables match the reference",
                        "[layer][placement]", test::spaces) {
  using Space = TestType;
  const layer_config cfg = cfg4(0.75);
  auto w = reference::full_weights::random(cfg, 2);
  const auto g = skewed(cfg, w);
  using C = capacity::factor<false>;
  using Tab = policies<placement::table, C, false, Space>;
  using TabDedup = policies<placement::table, C, true, Space>;
  const test::run_options<Tab> opt{.placement = replicated()};
  const auto rep = test::run_layer<Tab>(cfg, w, g, opt);
  CHECK(test::relative_error(rep.y, test::run_reference<Tab>(cfg, w, g, opt)) <=
        test::tolerance<Space>(1e-4));
  const auto dedup = test::run_layer<TabDedup>(cfg, w, g, {.placement = replicated()});
  CHECK(test::relative_error(dedup.y, rep.y) <= test::tolerance<Space>(1e-6));
  // Copies share a hot expert's load, so fewer rows are dropped than with one copy each.
  using Blk = policies<placement::block, C, false, Space>;
  index_t dropped_block = 0, dropped_rep = 0;
  const auto blk = test::run_layer<Blk>(cfg, w, g);
  for (int r = 0; r < 4; ++r) {
    dropped_block += blk.stats[r][0].dropped;
    dropped_rep += rep.stats[r][0].dropped;
  }
  CHECK(dropped_rep < dropped_block);
}

TEMPLATE_LIST_TEST_CASE("placement: a token uses the copy on its own rank when there is one",
                        "[layer][placement]", test::spaces) {
  using Space = TestType;
  const layer_config cfg = cfg4();
  auto w = reference::full_weights::random(cfg, 3);
  const auto g = skewed(cfg, w);
  using Tab = policies<placement::table, capacity::dropless, false, Space>;
  const auto rep = test::run_layer<Tab>(cfg, w, g, {.placement = replicated()});
  // Expert 0 has copies on ranks 0, 2, 3: their tokens keep expert-0 rows at home.
  for (int r : {0, 3}) {
    const auto& s = rep.stats[r][0];
    const int j = r == 0 ? 0 : 1;  // local slot of expert 0 on that rank
    REQUIRE(replicated().expert_at(r, j) == 0);
    CHECK(s.routed_per_expert[0] > 0);  // else the next check holds for nothing
    CHECK(s.rows_per_local_expert[j] >= s.routed_per_expert[0]);
  }
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

TEMPLATE_LIST_TEST_CASE("placement: live re-placement moves only changed slots and keeps outputs",
                        "[layer][placement]", test::spaces) {
  using Space = TestType;
  const layer_config cfg = cfg4();
  auto w = reference::full_weights::random(cfg, 4);
  const auto g = skewed(cfg, w);
  using Tab = policies<placement::table, capacity::dropless, false, Space>;
  const placement::table start(cfg);                           // identity: 2 slots per rank
  const std::vector<int> next_map = {1, 0, 2, 3, 5, 4, 6, 7};  // swap 0<->1 and 4<->5
  const placement::table next(8, 4, next_map);
  std::vector<index_t> moved(4, -1);
  std::vector<int> placed(4, 0);  // Catch's CHECK is not thread-safe: check after the run
  test::run_options<Tab> opt{.passes = 2, .placement = start};
  opt.between = [&](moe_layer<Tab>& layer) {
    if (layer.passes() != 1) return;  // after the first pass only
    moved[layer.rank()] = layer.apply_placement(next);
    placed[layer.rank()] = layer.placement() == next;
  };
  const auto got = test::run_layer<Tab>(cfg, w, g, opt);
  CHECK(placed == std::vector<int>(4, 1));
  const auto want = test::run_reference<Tab>(cfg, w, g);
  CHECK(test::relative_error(got.ys[0], want) <= test::tolerance<Space>(1e-4));
  CHECK(test::relative_error(got.ys[1], want) <= test::tolerance<Space>(1e-4));
  // 4 slots changed; each holds w1, w3 [F, H] and w2 [H, F] of the space's element type.
  const index_t slot_bytes = 3 * index_t{cfg.ffn} * cfg.hidden *
                             index_t{sizeof(typename test::space_io<Space>::value_type)};
  CHECK(moved == std::vector<index_t>{2 * slot_bytes, 0, 2 * slot_bytes, 0});
}

TEMPLATE_LIST_TEST_CASE(
    "placement: the survivors' layer takes the router bias and re-placed experts as values",
    "[layer][placement]", test::spaces) {
  // exclude_ranks builds a layer that reads nothing the old one owns: not its router bias (in
  // the space's memory: a device pointer the host must not read), not the experts it owns
  // after a live re-placement, whatever the old layer does next or when it is gone.
  using Space = TestType;
  using io = test::space_io<Space>;
  struct P : test::router_policies<Space, router::sigmoid_bias<2>> {
    using placement [[maybe_unused]] = epmoe::placement::table;  // GCC: the layer reads it
  };
  const int R = 4;
  const layer_config cfg = cfg4();
  const auto w = reference::full_weights::random(cfg, 6);
  const auto g = test::make_tokens(std::vector<index_t>(R, 16), cfg.hidden, 7);
  // Every expert on two ranks (4 slots each), so any one rank can be lost.
  const auto ring = [&](int shift) {
    std::vector<int> phy;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) phy.push_back((2 * r + j + shift) % 8);
    return placement::table(8, R, phy);
  };
  const std::vector<char> lost{0, 1, 0, 0};
  std::vector<float> bias(8);
  for (int e = 0; e < 8; ++e) bias[static_cast<std::size_t>(e)] = 0.05f * float(e % 3) - 0.04f;
  std::vector<int> same(R, -1), own_bias(R, -1);
  comm::threads_world world(R);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const placement::table first = ring(0);
    test::rank_arrays<P> arrays(w, reference::slice(w, first, r));
    const Space space{};
    std::optional<moe_layer<P>> old;
    old.emplace(cfg, c, arrays.views(cfg, 4), router::sigmoid_bias<2>{}, capacity::dropless{},
                first, space);
    std::copy(bias.begin(), bias.end(), old->router_bias().begin());
    old->apply_placement(ring(2));  // the old layer owns its experts from here on
    if (lost[static_cast<std::size_t>(r)]) {
      old->apply_placement(ring(4));
      return;
    }
    auto survivors = old->exclude_ranks(lost);
    const std::span<float> kept = survivors.router_bias();
    own_bias[r] = std::equal(kept.begin(), kept.end(), bias.begin()) &&
                  survivors.router().bias != old->router().bias;
    const index_t T = 16, H = cfg.hidden;
    const auto x = io::upload(std::span(g.x).subspan(g.offset(r) * H, T * H));
    auto y = io::upload(std::vector<float>(T * H));
    std::vector<std::vector<float>> outs;
    const auto pass = [&] {
      io::poison(y, space);
      survivors.forward({io::data(x), T, H}, {io::data(y), T, H});
      outs.push_back(io::download(y, space));
    };
    pass();
    // Only the old layer changes: another bias, its experts re-placed again; then it is gone.
    std::fill(old->router_bias().begin(), old->router_bias().end(), 0.5f);
    old->apply_placement(ring(4));
    pass();
    old.reset();
    pass();
    same[r] = outs[0] == outs[1] && outs[0] == outs[2] &&
              std::all_of(outs[0].begin(), outs[0].end(), [](float v) { return std::isfinite(v); });
  });
  CHECK(own_bias == std::vector<int>{1, -1, 1, 1});
  CHECK(same == std::vector<int>{1, -1, 1, 1});
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC

TEST_CASE("placement: the balancer's table, applied live, evens out rank load",
          "[layer][placement]") {
  layer_config cfg = cfg4();
  cfg.max_tokens = 64;
  auto w = reference::full_weights::random(cfg, 6);
  auto g = skewed(cfg, w);
  g = test::make_tokens({64, 64, 64, 64}, cfg.hidden, 7);
  for (float& v : g.x) v = std::abs(v);
  using Tab = policies<placement::table>;
  std::vector<double> before(2), after(2);
  std::vector<float> y(g.x.size());
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  comm::threads_world world(4);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    // Start with 3 slots per rank, the last 4 slots duplicating experts 4..7 (cold).
    const placement::table start(8, 4, {0, 1, 4, 2, 3, 5, 4, 5, 6, 6, 7, 7});
    const auto mine = reference::slice(w, start, r);
    moe_layer<Tab> layer(cfg, c, {w.gate_view(), mine.experts()}, {}, {}, start);
    const index_t T = 64, H = cfg.hidden;
    const float* x = g.x.data() + r * T * H;
    float* mine_y = y.data() + r * T * H;
    std::fill(mine_y, mine_y + T * H, nan);
    layer.forward({x, T, H}, {mine_y, T, H});
    const auto load = layer.gather_load();
    std::vector<double> l(load.per_expert.begin(), load.per_expert.end());
    const auto plan = placement::balance(l, {.ranks = 4, .extra_slots = 4});
    layer.apply_placement(plan.refined);
    std::fill(mine_y, mine_y + T * H, nan);  // the second pass must write every row again
    layer.forward({x, T, H}, {mine_y, T, H});
    const auto load2 = layer.gather_load();
    if (r == 0) {
      before = {load.ranks.max_over_mean, load.ranks.excess};
      after = {load2.ranks.max_over_mean, load2.ranks.excess};
    }
  });
  INFO("rank max/mean before " << before[0] << ", after " << after[0]);
  CHECK(after[0] < before[0]);
  CHECK(test::relative_error(y, test::run_reference<Tab>(cfg, w, g)) <= 1e-4);
}

#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

TEMPLATE_LIST_TEST_CASE(
    "placement: two copies on the token's own rank share its rows (hash), as documented",
    "[layer][placement]", test::spaces) {
  using Space = TestType;
  // The balancer may put two copies of a hot expert on one rank (a twin) when that balances
  // best; a token of that rank then picks between them by its hash, like copies on its node.
  const layer_config cfg = cfg4(0.75);
  auto w = reference::full_weights::random(cfg, 4);
  const auto g = skewed(cfg, w);
  //                                         rank 0    rank 1    rank 2    rank 3
  const placement::table twins(8, 4, {0, 0, 2, 1, 3, 4, 5, 6, 7, 0, 1, 2});
  using Tab = policies<placement::table, capacity::factor<false>, false, Space>;
  const test::run_options<Tab> opt{.placement = twins};
  const auto got = test::run_layer<Tab>(cfg, w, g, opt);
  CHECK(test::relative_error(got.y, test::run_reference<Tab>(cfg, w, g, opt)) <=
        test::tolerance<Space>(1e-4));
  // Rank 0's own tokens for expert 0 reach both of its copies.
  const pass_stats& s0 = got.stats[0][0];
  CHECK(s0.rows_per_local_expert[0] > 0);
  CHECK(s0.rows_per_local_expert[1] > 0);
}

}  // namespace layer_placement_tests
