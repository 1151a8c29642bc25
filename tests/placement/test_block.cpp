// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <utility>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/config.hpp>
#include <epmoe/placement/block.hpp>

namespace {

epmoe::placement::block make(int experts, int ranks) {
  epmoe::layer_config cfg;
  cfg.hidden = 4;
  cfg.ffn = 4;
  cfg.experts = experts;
  cfg.top_k = 1;
  cfg.ranks = ranks;
  cfg.max_tokens = 1;
  cfg.validate();
  return epmoe::placement::block(cfg);
}

std::pair<int, int> shape() {
  return GENERATE(std::pair{1, 1}, std::pair{4, 1}, std::pair{4, 2}, std::pair{4, 4},
                  std::pair{6, 3}, std::pair{8, 2}, std::pair{12, 4}, std::pair{64, 8},
                  std::pair{60, 6});
}

}  // namespace

TEST_CASE("block: satisfies placement_policy", "[placement]") {
  STATIC_REQUIRE(epmoe::placement_policy<epmoe::placement::block>);
  constexpr epmoe::placement::block single;
  CHECK(single.experts_per_rank() == 1);
  CHECK(single.rank_of(0) == 0);
}

TEST_CASE("block: rank_of, local_index and expert_at are mutually inverse", "[placement]") {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto p = make(E, R);
  const int L = p.experts_per_rank();
  REQUIRE(L == E / R);
  for (int e = 0; e < E; ++e) {
    const int r = p.rank_of(e), j = p.local_index(e);
    REQUIRE((r >= 0 && r < R));
    REQUIRE((j >= 0 && j < L));
    REQUIRE(p.expert_at(r, j) == e);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) {
      const int e = p.expert_at(r, j);
      REQUIRE((e >= 0 && e < E));
      REQUIRE(p.rank_of(e) == r);
      REQUIRE(p.local_index(e) == j);
    }
}

TEST_CASE("block: each rank holds exactly E/R experts", "[placement]") {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto p = make(E, R);
  std::vector<int> held(static_cast<std::size_t>(R), 0);
  for (int e = 0; e < E; ++e) ++held[p.rank_of(e)];
  for (int r = 0; r < R; ++r) CHECK(held[r] == E / R);
}

TEST_CASE("block: rank r holds the contiguous experts r*E/R .. (r+1)*E/R - 1", "[placement]") {
  const auto [E, R] = shape();
  CAPTURE(E, R);
  const auto p = make(E, R);
  const int L = E / R;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) CHECK(p.expert_at(r, j) == r * L + j);
  // Experts in id order walk the ranks in order, never going back.
  for (int e = 1; e < E; ++e) CHECK(p.rank_of(e) >= p.rank_of(e - 1));
}
