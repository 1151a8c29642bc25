// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <epmoe/core/error.hpp>
#include <epmoe/core/random.hpp>
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/table.hpp>

namespace pl = epmoe::placement;

namespace {

constexpr int E = 64, R = 8;

// Zipf(s) load over n experts: load of the i-th hottest is 1 / (i+1)^s. Shuffled: expert
// (37 i + 11) mod n gets it, so the hot experts are spread out and block is not trivially bad.
std::vector<double> zipf(double s, bool shuffled, int n = E) {
  std::vector<double> load(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    load[static_cast<std::size_t>(shuffled ? (37 * i + 11) % n : i)] = 1.0 / std::pow(i + 1.0, s);
  return load;
}

// Heavy-tailed pseudo-random load (u^4, u uniform), the same for a seed on every platform.
std::vector<double> random_load(int n, std::uint64_t seed) {
  std::vector<double> load(static_cast<std::size_t>(n));
  for (int e = 0; e < n; ++e) {
    const double u =
        epmoe::math::uniform01(epmoe::math::hash4(seed, 3, static_cast<std::uint64_t>(e), 0));
    load[static_cast<std::size_t>(e)] = u * u * u * u;
  }
  return load;
}

pl::table block_table(int experts, int ranks) {
  std::vector<int> ids(static_cast<std::size_t>(experts));
  for (int e = 0; e < experts; ++e) ids[static_cast<std::size_t>(e)] = e;
  return pl::table(experts, ranks, ids);
}

double imbalance(const pl::table& t, const std::vector<double>& load) {
  return pl::max_over_mean(pl::rank_loads(t, load));
}

// A balancer table: the shape asked for, and every invariant of a valid table.
void check_valid(const pl::table& t, int experts, const pl::balance_options& o) {
  const int P = experts + o.extra_slots;
  REQUIRE(t.experts() == experts);
  REQUIRE(t.ranks() == o.ranks);
  REQUIRE(t.slots() == P);
  REQUIRE(t.slots_per_rank() * o.ranks == P);  // each rank P/R slots
  std::vector<int> count(static_cast<std::size_t>(experts), 0);
  for (int p = 0; p < P; ++p) {
    const int e = t.phy_to_log()[static_cast<std::size_t>(p)];
    REQUIRE((e >= 0 && e < experts));
    ++count[static_cast<std::size_t>(e)];
  }
  for (int e = 0; e < experts; ++e) {
    CAPTURE(e);
    REQUIRE(count[static_cast<std::size_t>(e)] >= 1);  // each expert at least one copy
    REQUIRE(t.copies(e) == count[static_cast<std::size_t>(e)]);
    for (int i = 0; i < t.copies(e); ++i) {
      const int p = t.log_to_phy()[static_cast<std::size_t>(e * t.max_copies() + i)];
      REQUIRE(t.phy_to_log()[static_cast<std::size_t>(p)] == e);
    }
  }
}

std::string field_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const epmoe::config_error& err) {
    return err.field();
  }
  return "";
}

}  // namespace

TEST_CASE("rank_loads: a copy carries its expert's load over its copies", "[placement][balancer]") {
  // 4 experts, 2 ranks, 6 slots: expert 0 has copies on both ranks, expert 1 two on rank 1.
  const pl::table t(4, 2, {0, 2, 3, 0, 1, 1});
  const std::vector<double> load = {4, 2, 1, 3};
  const auto r = pl::rank_loads(t, load);
  REQUIRE(r.size() == 2);
  CHECK(r[0] == Approx(2 + 1 + 3));
  CHECK(r[1] == Approx(2 + 2));
  CHECK(pl::max_over_mean(r) == Approx(6.0 / 5.0));
  const std::vector<double> zero(3, 0.0);
  CHECK(pl::max_over_mean(zero) == 0);
}

TEST_CASE("balance: deterministic", "[placement][balancer]") {
  const auto load = GENERATE(zipf(1.0, false), zipf(1.5, true), random_load(E, 4));
  const auto [nodes, groups, extra] = GENERATE(std::tuple{1, 1, 0}, std::tuple{1, 1, 16},
                                               std::tuple{2, 8, 16}, std::tuple{2, 8, 0});
  CAPTURE(nodes, groups, extra);
  const pl::balance_options o{.ranks = R, .nodes = nodes, .groups = groups, .extra_slots = extra};
  const auto a = pl::balance(load, o);
  const std::vector<double> copy = load;
  const auto b = pl::balance(copy, o);
  CHECK(a.greedy == b.greedy);
  CHECK(a.refined == b.refined);
  CHECK(a.greedy.phy_to_log() == b.greedy.phy_to_log());
  CHECK(a.refined.phy_to_log() == b.refined.phy_to_log());
  CHECK(a.greedy_max_over_mean == b.greedy_max_over_mean);
  CHECK(a.refined_max_over_mean == b.refined_max_over_mean);
}

TEST_CASE("balance: every table is valid and the figures match it", "[placement][balancer]") {
  const auto [experts, ranks, nodes, groups, extra] =
      GENERATE(std::tuple{64, 8, 1, 1, 0}, std::tuple{64, 8, 1, 1, 8}, std::tuple{64, 8, 1, 1, 16},
               std::tuple{64, 8, 2, 8, 0}, std::tuple{64, 8, 2, 8, 16}, std::tuple{64, 8, 4, 4, 32},
               std::tuple{64, 8, 2, 1, 16}, std::tuple{12, 4, 2, 2, 4}, std::tuple{6, 3, 1, 3, 3},
               std::tuple{4, 4, 1, 1, 12}, std::tuple{1, 1, 1, 1, 3});
  const auto seed = GENERATE(1ull, 2ull, 3ull);
  CAPTURE(experts, ranks, nodes, groups, extra, seed);
  const pl::balance_options o{
      .ranks = ranks, .nodes = nodes, .groups = groups, .extra_slots = extra};
  for (const auto& load : {random_load(experts, seed), zipf(1.2, seed == 2, experts)}) {
    const auto res = pl::balance(load, o);
    check_valid(res.greedy, experts, o);
    check_valid(res.refined, experts, o);
    CHECK(res.greedy_max_over_mean == Approx(imbalance(res.greedy, load)));
    CHECK(res.refined_max_over_mean == Approx(imbalance(res.refined, load)));
    CHECK(res.refined_max_over_mean >= 1.0 - 1e-12);
  }
}

TEST_CASE("balance: refined max/mean is never above greedy", "[placement][balancer]") {
  const auto [nodes, groups, extra] =
      GENERATE(std::tuple{1, 1, 0}, std::tuple{1, 1, 8}, std::tuple{1, 1, 16}, std::tuple{2, 8, 0},
               std::tuple{2, 8, 16}, std::tuple{4, 16, 8});
  CAPTURE(nodes, groups, extra);
  const pl::balance_options o{.ranks = R, .nodes = nodes, .groups = groups, .extra_slots = extra};
  for (std::uint64_t seed = 0; seed < 40; ++seed) {
    CAPTURE(seed);
    const auto load = random_load(E, seed);
    const auto res = pl::balance(load, o);
    REQUIRE(imbalance(res.refined, load) <= imbalance(res.greedy, load) + 1e-12);
  }
  for (double s : {0.5, 1.0, 1.5, 2.0})
    for (bool shuffled : {false, true}) {
      const auto load = zipf(s, shuffled);
      const auto res = pl::balance(load, o);
      CAPTURE(s, shuffled);
      REQUIRE(imbalance(res.refined, load) <= imbalance(res.greedy, load) + 1e-12);
    }
}

TEST_CASE("balance: Zipf loads over 64 experts on 8 ranks", "[placement][balancer]") {
  const double s = GENERATE(1.0, 1.5);
  const bool shuffled = GENERATE(false, true);
  const auto load = zipf(s, shuffled);
  const double block = imbalance(block_table(E, R), load);
  double refined16 = 0;
  for (int extra : {0, 16}) {
    const auto res = pl::balance(load, {.ranks = R, .extra_slots = extra});
    std::printf("zipf(%.1f)%s extra %2d: max/mean greedy %.4f refined %.4f (block %.4f)\n", s,
                shuffled ? " shuffled" : "         ", extra, res.greedy_max_over_mean,
                res.refined_max_over_mean, block);
    CHECK(res.refined_max_over_mean <= res.greedy_max_over_mean);
    CHECK(res.refined_max_over_mean <= block);
    if (extra == 16) refined16 = res.refined_max_over_mean;
  }
  CAPTURE(s, shuffled, refined16);
  if (s == 1.0) CHECK(refined16 <= 1.10);
  CHECK(refined16 < block);
}

TEST_CASE("balance: with no extra slots never worse than block", "[placement][balancer]") {
  const pl::balance_options o{.ranks = R};
  std::vector<std::vector<double>> loads;
  for (double s : {0.5, 1.0, 1.5, 2.0})
    for (bool shuffled : {false, true}) loads.push_back(zipf(s, shuffled));
  for (std::uint64_t seed = 0; seed < 40; ++seed) loads.push_back(random_load(E, seed));
  // Loads block already balances perfectly: the balancer must not undo it.
  std::vector<double> even(E);
  for (int e = 0; e < E; ++e)
    even[static_cast<std::size_t>(e)] = 1.0 + (e % 8 == 0 ? 7.0 : 0.0) - (e % 8 == 1 ? 0.5 : 0.0);
  loads.push_back(even);
  const auto block = block_table(E, R);
  for (std::size_t i = 0; i < loads.size(); ++i) {
    CAPTURE(i);
    const auto res = pl::balance(loads[i], o);
    REQUIRE(res.refined.slots() == E);
    REQUIRE(res.refined_max_over_mean <= imbalance(block, loads[i]) + 1e-12);
  }
}

TEST_CASE("balance: hierarchical with no extra slots never worse than block",
          "[placement][balancer]") {
  // block keeps whole groups on one node (node n holds experts [n E/N, (n+1) E/N)), so it is
  // a valid hierarchical table; the balancer's should be no worse. 16 experts, 4 ranks, 2 nodes,
  // 2 groups: group 0 (load 34) can split 17/17 over node 0's ranks, as block does.
  const std::vector<double> load = {1, 5, 8, 3, 3, 6, 4, 4, 4, 2, 1, 3, 3, 1, 4, 2};
  const pl::balance_options o{.ranks = 4, .nodes = 2, .groups = 2};
  const auto res = pl::balance(load, o);
  check_valid(res.refined, 16, o);
  const double block = imbalance(block_table(16, 4), load);
  CAPTURE(res.greedy_max_over_mean, block);
  CHECK(res.refined_max_over_mean <= block + 1e-12);
}

TEST_CASE("balance: hierarchical mode keeps each group on one node", "[placement][balancer]") {
  const int extra = GENERATE(0, 8, 16);
  const auto load = GENERATE(zipf(1.0, false), zipf(1.5, true), random_load(E, 11));
  CAPTURE(extra);
  const int nodes = 2, groups = 8, rpn = R / nodes, size = E / groups;
  const pl::balance_options o{.ranks = R, .nodes = nodes, .groups = groups, .extra_slots = extra};
  const auto res = pl::balance(load, o);
  for (const pl::table* t : {&res.greedy, &res.refined}) {
    check_valid(*t, E, o);
    CHECK(t->ranks_per_node() == rpn);
    const int S = t->slots_per_rank();
    std::vector<int> groups_on_node(static_cast<std::size_t>(nodes), 0);
    for (int g = 0; g < groups; ++g) {
      std::set<int> node_of_copies;
      for (int p = 0; p < t->slots(); ++p)
        if (t->phy_to_log()[static_cast<std::size_t>(p)] / size == g)
          node_of_copies.insert(p / S / rpn);
      CAPTURE(g);
      REQUIRE(node_of_copies.size() == 1);
      ++groups_on_node[static_cast<std::size_t>(*node_of_copies.begin())];
    }
    for (int n = 0; n < nodes; ++n)
      CHECK(groups_on_node[static_cast<std::size_t>(n)] == groups / nodes);
  }
}

TEST_CASE("balance: the table records the nodes, hierarchical or not", "[placement][balancer]") {
  // nodes = 2 with groups = 1 cannot pack groups onto nodes, so the balancer uses one global
  // level; the ranks still sit in two nodes, and slot_for's own-node preference needs to know.
  const auto [nodes, groups] = GENERATE(std::pair{2, 8}, std::pair{2, 1}, std::pair{4, 2});
  CAPTURE(nodes, groups);
  const auto res = pl::balance(zipf(1.0, true),
                               {.ranks = R, .nodes = nodes, .groups = groups, .extra_slots = 16});
  CHECK(res.greedy.ranks_per_node() == R / nodes);
  CHECK(res.refined.ranks_per_node() == R / nodes);
}

TEST_CASE("balance: bad options throw config_error naming the field", "[placement][balancer]") {
  const auto load = zipf(1.0, false);
  const auto field = [&](pl::balance_options o, std::vector<double> l = {}) {
    if (l.empty()) l = load;
    return field_of([&] { pl::balance(l, o); });
  };
  CHECK(field({.ranks = R, .extra_slots = 16}).empty());
  CHECK(field({.ranks = R, .extra_slots = 3}) == "extra_slots");   // 67 slots on 8 ranks
  CHECK(field({.ranks = R, .extra_slots = 12}) == "extra_slots");  // 76 slots on 8 ranks
  CHECK(field({.ranks = R, .extra_slots = -8}) == "extra_slots");
  CHECK(field({.ranks = 6}) == "extra_slots");  // 64 slots on 6 ranks
  CHECK(field({.ranks = R, .nodes = 3}) == "nodes");
  CHECK(field({.ranks = R, .nodes = 0}) == "nodes");
  CHECK(field({.ranks = R, .nodes = 16}) == "nodes");
  CHECK(field({.ranks = R, .groups = 3}) == "groups");
  CHECK(field({.ranks = R, .groups = 0}) == "groups");
  CHECK(field({.ranks = R, .groups = 128}) == "groups");
  CHECK(field({.ranks = 0}) == "ranks");
  auto neg = load;
  neg[5] = -0.25;
  CHECK(field({.ranks = R}, neg) == "load");
  auto nan = load;
  nan[63] = std::numeric_limits<double>::quiet_NaN();
  CHECK(field({.ranks = R}, nan) == "load");
}

TEST_CASE("balance: uniform load is perfectly balanced with no extra slots",
          "[placement][balancer]") {
  const auto [nodes, groups] = GENERATE(std::pair{1, 1}, std::pair{2, 8}, std::pair{2, 2},
                                        std::pair{4, 8}, std::pair{8, 8}, std::pair{2, 1});
  const double value = GENERATE(1.0, 3.5);
  CAPTURE(nodes, groups, value);
  const std::vector<double> load(E, value);
  const auto res = pl::balance(load, {.ranks = R, .nodes = nodes, .groups = groups});
  CHECK(res.greedy_max_over_mean == Approx(1.0).epsilon(1e-12));
  CHECK(res.refined_max_over_mean == Approx(1.0).epsilon(1e-12));
  for (double r : pl::rank_loads(res.refined, load)) CHECK(r == Approx(8 * value));
}
