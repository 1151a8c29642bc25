// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/config.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/placement/block.hpp>
#include <epmoe/placement/round_robin.hpp>

namespace {

static_assert(epmoe::placement_policy<epmoe::placement::block>);
static_assert(epmoe::placement_policy<epmoe::placement::round_robin>);
static_assert(epmoe::placement_with_validate<epmoe::placement::block>);
static_assert(epmoe::placement_with_validate<epmoe::placement::round_robin>);

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

epmoe::placement::round_robin make(int experts, int ranks) {
  const auto cfg = config(experts, ranks);
  epmoe::placement::round_robin p(cfg);
  p.validate(cfg);
  return p;
}

std::pair<int, int> shape() {
  return GENERATE(std::pair{1, 1}, std::pair{4, 1}, std::pair{4, 2}, std::pair{4, 4},
                  std::pair{6, 3}, std::pair{8, 2}, std::pair{12, 4}, std::pair{64, 8},
                  std::pair{60, 6});
}

using one_copy_policies = std::tuple<epmoe::placement::block, epmoe::placement::round_robin>;

}  // namespace

TEST_CASE("round_robin: satisfies placement_policy", "[placement]") {
  STATIC_REQUIRE(epmoe::placement_policy<epmoe::placement::round_robin>);
  STATIC_REQUIRE(epmoe::placement_policy<epmoe::placement::block>);
  constexpr epmoe::placement::round_robin single;
  CHECK(single.slots_per_rank() == 1);
  CHECK(single.rank_of(0) == 0);
  CHECK(single.slot_for(0, 0, 0) == 0);
}

TEST_CASE("round_robin: expert e lives on rank e mod R in local slot e / R", "[placement]") {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto p = make(E, R);
  REQUIRE(p.slots_per_rank() == E / R);
  for (int e = 0; e < E; ++e) {
    CAPTURE(e);
    CHECK(p.rank_of(e) == e % R);
    CHECK(p.local_index(e) == e / R);
    CHECK(p.expert_at(e % R, e / R) == e);
  }
}

TEST_CASE("round_robin: rank_of, local_index, expert_at and slot_for agree", "[placement]") {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto p = make(E, R);
  const int S = p.slots_per_rank();
  std::vector<int> held(static_cast<std::size_t>(R), 0);
  std::vector<int> seen(static_cast<std::size_t>(E), 0);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < S; ++j) {
      const int e = p.expert_at(r, j);
      REQUIRE((e >= 0 && e < E));
      ++seen[e];
      ++held[r];
      CHECK(p.rank_of(e) == r);
      CHECK(p.local_index(e) == j);
    }
  for (int e = 0; e < E; ++e) CHECK(seen[e] == 1);  // one copy each
  for (int r = 0; r < R; ++r) CHECK(held[r] == E / R);
  // One copy: the slot never depends on the token or its home rank.
  for (int e = 0; e < E; ++e)
    for (int home = 0; home < R; ++home)
      for (std::uint64_t token : {0ull, 1ull, 12345ull, ~0ull}) {
        const int slot = p.slot_for(e, home, token);
        REQUIRE(slot == p.rank_of(e) * S + p.local_index(e));
        CHECK(p.expert_at(slot / S, slot % S) == e);
      }
}

TEST_CASE("round_robin: neighbouring experts land on different ranks", "[placement]") {
  const auto p = make(64, 8);
  for (int e = 1; e < 64; ++e) CHECK(p.rank_of(e) != p.rank_of(e - 1));
  // Every run of R consecutive experts covers all R ranks once.
  for (int start = 0; start + 8 <= 64; ++start) {
    std::vector<int> hit(8, 0);
    for (int e = start; e < start + 8; ++e) ++hit[p.rank_of(e)];
    for (int r = 0; r < 8; ++r) CHECK(hit[r] == 1);
  }
}

TEST_CASE("round_robin: validate rejects experts not divisible by ranks", "[placement]") {
  const auto [E, R] = GENERATE(std::pair{6, 4}, std::pair{5, 2}, std::pair{7, 8}, std::pair{9, 6});
  CAPTURE(E, R);
  const auto cfg = config(E, R);
  const epmoe::placement::round_robin p(cfg);
  try {
    p.validate(cfg);
    FAIL("validate accepted experts = " << E << " on ranks = " << R);
  } catch (const epmoe::config_error& err) {
    CHECK(err.field() == "experts");
    CHECK(err.value() == std::to_string(E));
  }
  CHECK_NOTHROW(p.validate(config(E * R, R)));
}

TEMPLATE_LIST_TEST_CASE("one-copy placements: every slot serves the expert it holds", "[placement]",
                        one_copy_policies) {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto cfg = config(E, R);
  const TestType p(cfg);
  REQUIRE_NOTHROW(p.validate(cfg));
  const int S = p.slots_per_rank();
  REQUIRE(S * R == E);
  for (int e = 0; e < E; ++e) {
    const int slot = p.slot_for(e, e % R, static_cast<std::uint64_t>(e) * 7919u);
    REQUIRE((slot >= 0 && slot < E));
    CHECK(p.expert_at(slot / S, slot % S) == e);
    CHECK(p.rank_of(e) == slot / S);
    CHECK(p.local_index(e) == slot % S);
  }
}
