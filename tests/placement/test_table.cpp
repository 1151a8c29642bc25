// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/config.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/core/random.hpp>
#include <epmoe/placement/block.hpp>
#include <epmoe/placement/table.hpp>

using epmoe::placement::table;

namespace {

static_assert(epmoe::placement_policy<table>);
static_assert(epmoe::placement_with_validate<table>);

epmoe::layer_config config(int experts, int ranks) {
  epmoe::layer_config cfg;
  cfg.hidden = 4;
  cfg.ffn = 4;
  cfg.experts = experts;
  cfg.top_k = 1;
  cfg.ranks = ranks;
  cfg.max_tokens = 1;
  cfg.validate();
  return cfg;
}

std::pair<int, int> shape() {
  return GENERATE(std::pair{1, 1}, std::pair{4, 1}, std::pair{4, 2}, std::pair{4, 4},
                  std::pair{6, 3}, std::pair{8, 2}, std::pair{12, 4}, std::pair{64, 8},
                  std::pair{60, 6});
}

// 8 experts on 4 ranks with 12 slots (3 per rank): experts 0 and 1 have three copies each.
//                                     rank 0    rank 1    rank 2    rank 3
const std::vector<int> replicated_8x4 = {0, 2, 3, 1, 4, 5, 0, 6, 1, 7, 0, 1};

// Every expert once, then `extra` more copies of pseudo-random experts, in a fixed shuffle.
std::vector<int> random_phy_to_log(int experts, int extra, std::uint64_t seed) {
  std::vector<int> phy;
  for (int e = 0; e < experts; ++e) phy.push_back(e);
  for (int i = 0; i < extra; ++i)
    phy.push_back(static_cast<int>(epmoe::math::hash4(seed, 1, static_cast<std::uint64_t>(i), 0) %
                                   static_cast<std::uint64_t>(experts)));
  for (int i = static_cast<int>(phy.size()) - 1; i > 0; --i) {
    const auto j = epmoe::math::hash4(seed, 2, static_cast<std::uint64_t>(i), 0) %
                   static_cast<std::uint64_t>(i + 1);
    std::swap(phy[static_cast<std::size_t>(i)], phy[j]);
  }
  return phy;
}

// The table's invariants, each checked from the raw arrays.
void check_consistent(const table& t) {
  const int E = t.experts(), R = t.ranks(), P = t.slots(), S = t.slots_per_rank();
  CAPTURE(E, R, P);
  REQUIRE(P >= E);
  REQUIRE(P % R == 0);
  REQUIRE(S * R == P);  // each rank holds P/R slots
  REQUIRE(static_cast<int>(t.phy_to_log().size()) == P);
  const int M = t.max_copies();
  REQUIRE(static_cast<int>(t.log_to_phy().size()) == E * M);
  std::vector<int> count(static_cast<std::size_t>(E), 0);
  for (int p = 0; p < P; ++p) {
    const int e = t.phy_to_log()[p];
    REQUIRE((e >= 0 && e < E));  // every slot maps to a logical expert
    ++count[e];
    CHECK(t.expert_at(p / S, p % S) == e);
  }
  int max_count = 0, total = 0;
  for (int e = 0; e < E; ++e) {
    CAPTURE(e);
    CHECK(t.copies(e) >= 1);  // every expert has a copy
    CHECK(t.copies(e) == count[e]);
    max_count = std::max(max_count, count[e]);
    total += t.copies(e);
    std::set<int> slots;
    for (int i = 0; i < M; ++i) {
      const int p = t.log_to_phy()[e * M + i];
      if (i < t.copies(e)) {  // the inverse map agrees with phy_to_log
        REQUIRE((p >= 0 && p < P));
        CHECK(t.phy_to_log()[p] == e);
        slots.insert(p);
      } else {
        CHECK(p == -1);
      }
    }
    CHECK(static_cast<int>(slots.size()) == t.copies(e));  // distinct slots
  }
  CHECK(M == max_count);
  CHECK(total == P);
  const auto v = t.view();
  CHECK(v.phy_to_log == t.phy_to_log().data());
  CHECK(v.log_to_phy == t.log_to_phy().data());
  CHECK(v.max_copies == M);
  CHECK(v.slots_per_rank == S);
  CHECK(v.ranks_per_node == t.ranks_per_node());
}

// Runs f and returns the field of the config_error it throws ("" when it throws none).
std::string field_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const epmoe::config_error& err) {
    return err.field();
  }
  return "";
}

}  // namespace

TEST_CASE("table: satisfies placement_policy", "[placement]") {
  STATIC_REQUIRE(epmoe::placement_policy<table>);
  const table t;
  CHECK(t.experts() == 1);
  CHECK(t.ranks() == 1);
}

TEST_CASE("table: the identity table from a layer_config equals block", "[placement]") {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto cfg = config(E, R);
  const table t(cfg);
  const epmoe::placement::block b(cfg);
  REQUIRE_NOTHROW(t.validate(cfg));
  check_consistent(t);
  REQUIRE(t.slots() == E);
  REQUIRE(t.slots_per_rank() == b.slots_per_rank());
  CHECK(t.max_copies() == 1);
  CHECK(t.ranks_per_node() == R);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < t.slots_per_rank(); ++j) CHECK(t.expert_at(r, j) == b.expert_at(r, j));
  for (int e = 0; e < E; ++e) {
    CHECK(t.copies(e) == 1);
    CHECK(t.log_to_phy()[e] == e);
    for (int home = 0; home < R; ++home)
      for (std::uint64_t token : {0ull, 7ull, ~0ull})
        CHECK(t.slot_for(e, home, token) == b.slot_for(e, home, token));
  }
  std::vector<int> ids(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) ids[e] = e;
  CHECK(t == table(E, R, ids));
}

TEST_CASE("table: a replicated table builds consistent inverse maps", "[placement]") {
  SECTION("hand-written: 8 experts, 4 ranks, 12 slots") {
    const table t(8, 4, replicated_8x4);
    check_consistent(t);
    CHECK(t.slots_per_rank() == 3);
    CHECK(t.max_copies() == 3);
    CHECK(t.copies(0) == 3);
    CHECK(t.copies(1) == 3);
    for (int e = 2; e < 8; ++e) CHECK(t.copies(e) == 1);
    std::vector<int> slots0(t.log_to_phy().begin(), t.log_to_phy().begin() + 3);
    std::sort(slots0.begin(), slots0.end());
    CHECK(slots0 == std::vector<int>{0, 6, 10});
    CHECK(t.expert_at(2, 2) == 1);
    CHECK(t.expert_at(3, 0) == 7);
  }
  SECTION("pseudo-random tables") {
    const auto [E, R, extra] =
        GENERATE(std::tuple{4, 2, 2}, std::tuple{8, 4, 4}, std::tuple{64, 8, 16},
                 std::tuple{60, 6, 30}, std::tuple{3, 3, 9}, std::tuple{16, 4, 0});
    const auto seed = GENERATE(1ull, 2ull, 3ull);
    CAPTURE(E, R, extra, seed);
    const table t(E, R, random_phy_to_log(E, extra, seed));
    check_consistent(t);
    CHECK(t.slots() == E + extra);
  }
  SECTION("ranks_per_node is recorded") {
    CHECK(table(8, 4, replicated_8x4, 2).ranks_per_node() == 2);
    CHECK(table(8, 4, replicated_8x4, 1).ranks_per_node() == 1);
    CHECK(table(8, 4, replicated_8x4, 4).ranks_per_node() == 4);
    CHECK(table(8, 4, replicated_8x4).ranks_per_node() == 4);  // 0: one node
    CHECK_FALSE(table(8, 4, replicated_8x4, 2) == table(8, 4, replicated_8x4, 1));
  }
}

TEST_CASE("table: a bad table throws config_error naming the field", "[placement]") {
  SECTION("slots not divisible by ranks") {
    CHECK(field_of([] { table(4, 2, {0, 1, 2, 3, 0}); }) == "placement.slots");
    CHECK(field_of([] { table(4, 4, {0, 1, 2, 3, 0, 1}); }) == "placement.slots");
  }
  SECTION("fewer slots than experts") {
    CHECK(field_of([] { table(4, 2, {0, 1}); }) == "placement.slots");
    CHECK(field_of([] { table(4, 1, {}); }) == "placement.slots");
  }
  SECTION("an id out of range") {
    CHECK(field_of([] { table(4, 2, {0, 1, 2, 4}); }) == "placement.phy_to_log");
    CHECK(field_of([] { table(4, 2, {0, -1, 2, 3}); }) == "placement.phy_to_log");
    try {
      table(4, 2, {0, 1, 2, 3, 9, 1});
      FAIL("accepted slot 4 = 9");
    } catch (const epmoe::config_error& err) {
      CHECK(err.field() == "placement.phy_to_log");
      CHECK(err.value() == "slot 4: 9");
    }
  }
  SECTION("an expert with no slot") {
    CHECK(field_of([] { table(4, 2, {0, 1, 2, 2}); }) == "placement.copies");
    CHECK(field_of([] {
            table(8, 4, {0, 2, 3, 1, 4, 5, 0, 6, 1, 0, 0, 1});
          }) == "placement.copies");  // expert 7 dropped
  }
  SECTION("ranks_per_node not dividing ranks") {
    CHECK(field_of([] { table(8, 4, replicated_8x4, 3); }) == "placement.ranks_per_node");
    CHECK(field_of([] { table(8, 4, replicated_8x4, 8); }) == "placement.ranks_per_node");
  }
  SECTION("experts or ranks below one") {
    CHECK(field_of([] { table(0, 1, {0}); }) == "placement.experts");
    CHECK(field_of([] { table(1, 0, {0}); }) == "placement.ranks");
  }
  SECTION("a good table throws nothing") {
    CHECK(field_of([] { table(8, 4, replicated_8x4, 2); }).empty());
  }
}

TEST_CASE("table: from_eplb accepts consistent EPLB arrays", "[placement]") {
  const int rpn = GENERATE(0, 2);
  CAPTURE(rpn);
  const table t(8, 4, replicated_8x4, rpn);
  std::vector<int> copies;
  for (int e = 0; e < t.experts(); ++e) copies.push_back(t.copies(e));
  const table u = table::from_eplb(8, 4, t.phy_to_log(), t.log_to_phy(), copies, rpn);
  CHECK(u == t);
  CHECK(u.log_to_phy() == t.log_to_phy());
  check_consistent(u);

  // EPLB may list an expert's copies in any order.
  std::vector<int> l2p = t.log_to_phy();
  std::reverse(l2p.begin(), l2p.begin() + t.copies(0));
  REQUIRE(l2p != t.log_to_phy());
  CHECK(table::from_eplb(8, 4, t.phy_to_log(), l2p, copies, rpn) == t);

  // Bigger pseudo-random tables round-trip too.
  const table big(64, 8, random_phy_to_log(64, 16, 5), 4);
  std::vector<int> big_copies;
  for (int e = 0; e < 64; ++e) big_copies.push_back(big.copies(e));
  CHECK(table::from_eplb(64, 8, big.phy_to_log(), big.log_to_phy(), big_copies, 4) == big);
}

TEST_CASE("table: from_eplb rejects arrays that disagree with phy_to_log", "[placement]") {
  const table t(8, 4, replicated_8x4);
  const int M = t.max_copies();
  const std::vector<int> copies = {3, 3, 1, 1, 1, 1, 1, 1};
  const auto eplb = [&](std::vector<int> l2p, std::vector<int> c) {
    return field_of([&] { table::from_eplb(8, 4, replicated_8x4, l2p, c); });
  };
  REQUIRE(eplb(t.log_to_phy(), copies).empty());

  SECTION("copies") {
    auto c = copies;
    c[0] = 2;
    CHECK(eplb(t.log_to_phy(), c) == "placement.copies");
    c = copies;
    c[7] = 2;
    CHECK(eplb(t.log_to_phy(), c) == "placement.copies");
    CHECK(eplb(t.log_to_phy(), {3, 3, 1, 1, 1, 1, 1}) == "placement.copies");  // one short
  }
  SECTION("log_to_phy naming another expert's slot") {
    auto l2p = t.log_to_phy();
    l2p[0 * M + 1] = 1;  // slot 1 holds expert 2
    CHECK(eplb(l2p, copies) == "placement.log_to_phy");
  }
  SECTION("log_to_phy padding inside an expert's copies") {
    auto l2p = t.log_to_phy();
    l2p[1 * M + 2] = -1;
    CHECK(eplb(l2p, copies) == "placement.log_to_phy");
  }
  SECTION("log_to_phy out of range") {
    auto l2p = t.log_to_phy();
    l2p[2 * M] = 12;
    CHECK(eplb(l2p, copies) == "placement.log_to_phy");
  }
  SECTION("log_to_phy too short") {
    CHECK(eplb({}, copies) == "placement.log_to_phy");
    const std::vector<int> narrow(t.log_to_phy().begin(), t.log_to_phy().begin() + 8);
    CHECK(eplb(narrow, copies) == "placement.log_to_phy");
  }
  SECTION("a bad phy_to_log is still named") {
    std::vector<int> bad = replicated_8x4;
    bad[5] = 8;
    CHECK(field_of([&] { table::from_eplb(8, 4, bad, t.log_to_phy(), copies); }) ==
          "placement.phy_to_log");
  }
}

TEST_CASE("table: from_eplb rejects a log_to_phy row that names one slot twice", "[placement]") {
  // Expert 0 is in slots {0, 6, 10}; a row {0, 0, 10} passes a per-entry check but leaves slot 6
  // out of the inverse map, so it disagrees with phy_to_log.
  const table t(8, 4, replicated_8x4);
  const int M = t.max_copies();
  auto l2p = t.log_to_phy();
  std::sort(l2p.begin(), l2p.begin() + M);
  REQUIRE(std::vector<int>(l2p.begin(), l2p.begin() + M) == std::vector<int>{0, 6, 10});
  l2p[1] = 0;
  const std::vector<int> copies = {3, 3, 1, 1, 1, 1, 1, 1};
  CHECK(field_of([&] { table::from_eplb(8, 4, replicated_8x4, l2p, copies); }) ==
        "placement.log_to_phy");
}

TEST_CASE("table: validate rejects a config with other experts or ranks", "[placement]") {
  const table t(8, 4, replicated_8x4);
  CHECK_NOTHROW(t.validate(config(8, 4)));
  CHECK(field_of([&] { t.validate(config(16, 4)); }) == "placement.experts");
  CHECK(field_of([&] { t.validate(config(4, 4)); }) == "placement.experts");
  CHECK(field_of([&] { t.validate(config(8, 2)); }) == "placement.ranks");
  CHECK(field_of([&] { t.validate(config(8, 8)); }) == "placement.ranks");
}

// --- replica choice: table_view::slot_for ---

TEST_CASE("slot_for: a copy on the token's own rank always wins", "[placement]") {
  const int rpn = GENERATE(0, 1, 2, 4);
  CAPTURE(rpn);
  const table t(8, 4, replicated_8x4, rpn);
  const int S = t.slots_per_rank();
  int homes = 0;  // (expert, rank) pairs with a local copy
  for (int e : {0, 1})
    for (int home = 0; home < 4; ++home) {
      int own = -1;
      for (int j = 0; j < S; ++j)
        if (t.expert_at(home, j) == e) own = home * S + j;
      if (own < 0) continue;
      CAPTURE(e, home);
      for (std::uint64_t token = 0; token < 2000; ++token)
        REQUIRE(t.slot_for(e, home, token) == own);
      ++homes;
    }
  CHECK(homes == 6);  // expert 0 on ranks 0, 2, 3; expert 1 on ranks 1, 2, 3
}

TEST_CASE("slot_for: then a copy on the token's own node", "[placement]") {
  // 8 ranks in nodes of 2, 2 slots per rank: expert 1 lives on ranks 1 (node 0), 4 and 6.
  const std::vector<int> ids = {0, 9, 1, 3, 4, 5, 6, 7, 8, 1, 10, 11, 1, 13, 2, 12};
  const table t(14, 8, ids, 2);
  check_consistent(t);
  REQUIRE(t.copies(1) == 3);
  for (std::uint64_t token = 0; token < 2000; ++token) {
    CAPTURE(token);
    REQUIRE(t.slot_for(1, 0, token) == 2);    // rank 0: node 0 holds rank 1's copy
    REQUIRE(t.slot_for(1, 1, token) == 2);    // rank 1: its own
    REQUIRE(t.slot_for(1, 5, token) == 9);    // rank 5: node 2 holds rank 4's copy
    REQUIRE(t.slot_for(1, 7, token) == 12);   // rank 7: node 3 holds rank 6's copy
    const int far = t.slot_for(1, 2, token);  // rank 2: node 1 holds none
    REQUIRE((far == 2 || far == 9 || far == 12));
  }
}

TEST_CASE("slot_for: several copies on the own node share its rows", "[placement]") {
  // 8 ranks in nodes of 4, 2 slots per rank: expert 0 on ranks 1, 2 (node 0) and 5 (node 1).
  const std::vector<int> ids = {1, 2, 0, 3, 0, 4, 5, 6, 7, 8, 0, 9, 10, 11, 12, 13};
  const table t(14, 8, ids, 4);
  check_consistent(t);
  const int N = 20000;
  int at2 = 0, at4 = 0;
  for (std::uint64_t token = 0; token < static_cast<std::uint64_t>(N); ++token) {
    const int s = t.slot_for(0, 0, token);
    REQUIRE((s == 2 || s == 4));  // never rank 5's copy on the other node
    (s == 2 ? at2 : at4) += 1;
    REQUIRE(t.slot_for(0, 7, token) == 10);  // node 1 has one copy
  }
  INFO("rank 1: " << at2 << ", rank 2: " << at4);
  CHECK(at2 > 0.45 * N);
  CHECK(at4 > 0.45 * N);
}

TEST_CASE("slot_for: copies on other nodes share a hot expert's rows evenly", "[placement]") {
  // 8 ranks in nodes of 2 (or one node), 2 slots per rank: expert 0 has c copies, in slot 0
  // of ranks 2 .. 2+c-1; tokens of ranks 0 and 1 have no copy on their rank or node.
  const int c = GENERATE(2, 3, 4, 5, 6);
  const int rpn = GENERATE(0, 2);
  CAPTURE(c, rpn);
  std::vector<int> ids(16, -1);
  for (int i = 0; i < c; ++i) ids[static_cast<std::size_t>(2 * (2 + i))] = 0;
  int next = 1;
  for (int& id : ids)
    if (id < 0) id = next++;
  const table t(next, 8, ids, rpn);
  check_consistent(t);
  REQUIRE(t.copies(0) == c);
  const int N = 30000;
  for (int home : {0, 1}) {
    CAPTURE(home);
    std::vector<int> rows(16, 0);
    for (std::uint64_t token = 0; token < static_cast<std::uint64_t>(N); ++token) {
      const int s = t.slot_for(0, home, token * 0x9e3779b9ull + 17);
      REQUIRE((s >= 0 && s < 16));
      REQUIRE(ids[static_cast<std::size_t>(s)] == 0);
      ++rows[static_cast<std::size_t>(s)];
    }
    const double fair = static_cast<double>(N) / c;
    for (int i = 0; i < c; ++i) {
      const int s = 2 * (2 + i);
      CAPTURE(s, rows[static_cast<std::size_t>(s)], fair);
      CHECK(rows[static_cast<std::size_t>(s)] > 0.9 * fair);
      CHECK(rows[static_cast<std::size_t>(s)] < 1.1 * fair);
    }
  }
}

TEST_CASE("slot_for: deterministic, and the view agrees with the table", "[placement]") {
  // Every rank computes a token's copy on its own: the choice must depend on (expert, home,
  // token) alone, not on the object, the call order or earlier calls.
  const table t(64, 8, random_phy_to_log(64, 16, 9), 4);
  std::vector<int> first;
  for (int e = 0; e < 64; ++e)
    for (int home = 0; home < 8; ++home)
      for (std::uint64_t token = 0; token < 50; ++token) {
        const int s = t.slot_for(e, home, token);
        REQUIRE((s >= 0 && s < t.slots()));
        REQUIRE(t.phy_to_log()[static_cast<std::size_t>(s)] == e);
        first.push_back(s);
      }
  // Another table from the same arrays, through its view, swept in reverse order.
  const table same(64, 8, random_phy_to_log(64, 16, 9), 4);
  const auto v = same.view();
  std::size_t i = first.size();
  for (int e = 63; e >= 0; --e)
    for (int home = 7; home >= 0; --home)
      for (std::uint64_t token = 50; token-- > 0;)
        REQUIRE(v.slot_for(e, home, token) == first[--i]);
  CHECK(i == 0);
}

TEST_CASE("slot_for: an expert with one copy always gets that slot", "[placement]") {
  const int rpn = GENERATE(0, 1, 2);
  const table t(8, 4, replicated_8x4, rpn);
  for (int e = 2; e < 8; ++e) {
    REQUIRE(t.copies(e) == 1);
    const int only = t.log_to_phy()[static_cast<std::size_t>(e * t.max_copies())];
    for (int home = 0; home < 4; ++home)
      for (std::uint64_t token : {0ull, 1ull, 99ull, 1ull << 40, ~0ull})
        CHECK(t.slot_for(e, home, token) == only);
  }
}
