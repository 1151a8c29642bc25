// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <epmoe/capacity/dropless.hpp>
#include <epmoe/capacity/factor.hpp>
#include <epmoe/core/concepts.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/core/plan.hpp>
#include <epmoe/core/routing.hpp>
#include <epmoe/core/rows.hpp>
#include <epmoe/placement/block.hpp>

using epmoe::index_t;
using epmoe::layer_config;

namespace {

layer_config cfg_of(double cf, int top_k, int experts, int ranks = 1) {
  layer_config c;
  c.hidden = 4;
  c.ffn = 4;
  c.experts = experts;
  c.top_k = top_k;
  c.ranks = ranks;
  c.max_tokens = 1024;
  c.capacity_factor = cf;
  c.validate();
  return c;
}

// Owns every array a dispatch_plan points to.
struct owned_plan {
  std::vector<std::int32_t> slot, phys, row_token;
  std::vector<index_t> kept;
  std::vector<index_t> send_counts, send_valid, send_offsets, recv_counts, recv_valid, recv_offsets,
      expert_offsets, regroup_offsets, routed;
  epmoe::dispatch_plan plan;

  owned_plan(int ranks, int local_experts, int top_k, index_t tokens, index_t send_rows,
             int experts) {
    const std::size_t B = static_cast<std::size_t>(ranks * local_experts);
    slot.assign(static_cast<std::size_t>(tokens * top_k), 12345);
    phys.assign(static_cast<std::size_t>(tokens * top_k), 12345);
    kept.assign(B, -7);
    row_token.assign(static_cast<std::size_t>(send_rows), 12345);
    send_counts.assign(B, -7);
    send_valid.assign(B, -7);
    send_offsets.assign(B + 1, -7);
    recv_counts.assign(B, 0);
    recv_valid.assign(B, 0);
    recv_offsets.assign(B + 1, -7);
    expert_offsets.assign(static_cast<std::size_t>(local_experts + 1), -7);
    regroup_offsets.assign(B, -7);
    routed.assign(static_cast<std::size_t>(experts), -7);
    plan.ranks = ranks;
    plan.local_experts = local_experts;
    plan.top_k = top_k;
    plan.slot = slot.data();
    plan.phys = phys.data();
    plan.kept = kept.data();
    plan.row_token = row_token.data();
    plan.send_counts = send_counts.data();
    plan.send_valid = send_valid.data();
    plan.send_offsets = send_offsets.data();
    plan.recv_counts = recv_counts.data();
    plan.recv_valid = recv_valid.data();
    plan.recv_offsets = recv_offsets.data();
    plan.expert_offsets = expert_offsets.data();
    plan.regroup_offsets = regroup_offsets.data();
    plan.routed = routed.data();
  }
};

// The hand-built routing: R = 2, E = 4 (L = 2, block b == expert id), K = 2, T = 6.
// Walking (t, k) in order with limit 2 per expert:
//   t0: e1 -> e1#0, e2 -> e2#0      t3: e3 -> drop, e1 -> drop
//   t1: e2 -> e2#1, e3 -> e3#0      t4: e0 -> e0#0, e2 -> drop
//   t2: e1 -> e1#1, e3 -> e3#1      t5: e2 -> drop, e1 -> drop
// Expert 1 is picked by tokens 0, 2, 3, 5: the picks of tokens 3 and 5 are dropped.
const std::vector<std::int32_t> kIds = {1, 2, 2, 3, 1, 3, 3, 1, 0, 2, 2, 1};
constexpr int kR = 2, kE = 4, kK = 2, kL = 2;
constexpr index_t kT = 6;

layer_config hand_cfg() { return cfg_of(0.5, kK, kE, kR); }  // limit ceil(0.5*6*2/4) = 2

epmoe::routing_view hand_routing(const std::vector<std::int32_t>& ids,
                                 const std::vector<float>& weights) {
  return {{ids.data(), kT, kK}, {weights.data(), kT, kK}};
}

}  // namespace

using factor_policies = std::tuple<epmoe::capacity::factor<false>, epmoe::capacity::factor<true>>;

TEMPLATE_LIST_TEST_CASE("capacity: factor limit is ceil(cf * T * K / E)", "[capacity]",
                        factor_policies) {
  STATIC_REQUIRE(epmoe::capacity_policy<TestType>);
  struct row {
    double cf;
    index_t tokens;
    int top_k, experts;
    index_t want;
  };
  const row table[] = {
      {1.25, 7, 2, 4, 5},    // 4.375 -> 5
      {1.25, 0, 2, 4, 0},    // no tokens, no rows
      {1.0, 8, 2, 4, 4},     // exact
      {1.0, 9, 2, 4, 5},     // 4.5 -> 5
      {2.0, 5, 1, 8, 2},     // 1.25 -> 2
      {0.5, 3, 1, 4, 1},     // 0.375 -> 1
      {1.5, 100, 2, 8, 38},  // 37.5 -> 38
      {0.25, 16, 2, 8, 1},   // exact 1
      {4.0, 3, 2, 2, 12},    // may exceed T
      {1.0, 1, 1, 64, 1},    // 1/64 -> 1
      {1.0, 4096, 8, 64, 512},
  };
  for (const row& r : table) {
    CAPTURE(r.cf, r.tokens, r.top_k, r.experts);
    CHECK(TestType{}.limit(cfg_of(r.cf, r.top_k, r.experts), r.tokens) == r.want);
  }
}

TEST_CASE("plan: chunk c holds the tokens from floor(c*T/C) up to floor((c+1)*T/C)",
          "[capacity][plan]") {
  int checked = 0;
  for (index_t T : {index_t{1}, index_t{2}, index_t{7}, index_t{10}, index_t{33}, index_t{100}}) {
    for (int C : {1, 2, 3, 4, 7, 8, 40}) {
      for (int c = 0; c < C; ++c) {
        for (index_t t = c * T / C; t < (c + 1) * T / C; ++t) {
          CAPTURE(T, C, c, t);
          CHECK(epmoe::chunk_of_token(t, C, T) == c);
          ++checked;
        }
      }
    }
  }
  CHECK(checked == 7 * (1 + 2 + 7 + 10 + 33 + 100));  // every token of every (T, C) once
}

TEST_CASE("plan: a padding row is sent as zeros, a token row as the token", "[capacity][plan]") {
  constexpr index_t H = 5;
  const std::vector<float> x = {1, 2, 3, 4, 5, -1, -2, -3, -4, -5};  // two tokens
  const std::vector<std::int32_t> row_token = {1, -1, 0, -1};        // rows 1 and 3 pad
  std::vector<float> out(4 * H, NAN);
  const epmoe::rows::gather<float> g{{x.data(), 2, H, H}, row_token.data(), {out.data(), 4, H, H}};
  for (index_t i = 0; i < 4; ++i) g(i, 0, H);
  for (index_t h = 0; h < H; ++h) {
    CHECK(out[0 * H + h] == x[1 * H + h]);
    CHECK(out[1 * H + h] == 0.f);
    CHECK(out[2 * H + h] == x[0 * H + h]);
    CHECK(out[3 * H + h] == 0.f);
  }
}

TEST_CASE("capacity: dropless limit is T", "[capacity]") {
  STATIC_REQUIRE(epmoe::capacity_policy<epmoe::capacity::dropless>);
  const epmoe::capacity::dropless d;
  for (index_t T : {index_t{0}, index_t{1}, index_t{7}, index_t{1000}}) {
    CHECK(d.limit(cfg_of(1.0, 2, 4), T) == T);
    CHECK(d.limit(cfg_of(0.01, 1, 64), T) == T);  // the factor does not matter
  }
}

TEST_CASE("capacity: pads flags", "[capacity]") {
  STATIC_REQUIRE_FALSE(epmoe::capacity::dropless::pads);
  STATIC_REQUIRE_FALSE(epmoe::capacity::factor<>::pads);
  STATIC_REQUIRE_FALSE(epmoe::capacity::factor<false>::pads);
  STATIC_REQUIRE(epmoe::capacity::factor<true>::pads);
  STATIC_REQUIRE(epmoe::capacity::padded_factor::pads);
}

TEST_CASE("plan: build_send_plan drops past capacity in token order", "[capacity][plan]") {
  const layer_config cfg = hand_cfg();
  const index_t limit = epmoe::capacity::factor<>{}.limit(cfg, kT);
  REQUIRE(limit == 2);
  const std::vector<float> w(kIds.size(), 0.5f);
  owned_plan o(kR, kL, kK, kT, kT * kK, kE);
  epmoe::build_send_plan(hand_routing(kIds, w), epmoe::placement::block(cfg), kE, limit, false, {},
                         o.plan);

  // Blocks [e0, e1 | e2, e3]: e0 holds 1 row (t4), the others 2; offsets 0, 1, 3, 5, 7.
  CHECK(o.slot == std::vector<std::int32_t>{1, 3, 4, 5, 2, 6, -1, -1, 0, -1, -1, -1});
  CHECK(o.send_valid == std::vector<index_t>{1, 2, 2, 2});
  CHECK(o.send_counts == std::vector<index_t>{1, 2, 2, 2});
  CHECK(o.send_offsets == std::vector<index_t>{0, 1, 3, 5, 7});
  CHECK(o.routed == std::vector<index_t>{1, 4, 4, 3});
  CHECK(o.plan.dropped == 5);
  CHECK(o.plan.padding == 0);
  CHECK(o.plan.tokens == kT);
  CHECK(o.plan.send_rows() == 7);
  CHECK(o.plan.send_rows_to(0) == 3);
  CHECK(o.plan.send_rows_to(1) == 4);
  const std::vector<std::int32_t> rows(o.row_token.begin(), o.row_token.begin() + 7);
  CHECK(rows == std::vector<std::int32_t>{4, 0, 2, 0, 1, 1, 2});
  // Expert 1 is picked by tokens 0, 2, 3, 5; the picks of tokens 3 and 5 (k = 1) are dropped.
  CHECK(o.slot[3 * kK + 1] == -1);
  CHECK(o.slot[5 * kK + 1] == -1);
  CHECK(o.slot[0 * kK + 0] >= 0);
  CHECK(o.slot[2 * kK + 0] >= 0);
  // Every kept assignment's row points back at its token.
  for (index_t t = 0; t < kT; ++t)
    for (int k = 0; k < kK; ++k) {
      const std::int32_t s = o.slot[t * kK + k];
      if (s >= 0) CHECK(o.row_token[s] == t);
    }
}

TEST_CASE("plan: build_send_plan with padding fills every block to the limit", "[capacity][plan]") {
  const layer_config cfg = hand_cfg();
  const index_t limit = epmoe::capacity::padded_factor{}.limit(cfg, kT);
  REQUIRE(limit == 2);
  const std::vector<float> w(kIds.size(), 0.5f);
  owned_plan o(kR, kL, kK, kT, kR * kL * limit, kE);
  epmoe::build_send_plan(hand_routing(kIds, w), epmoe::placement::block(cfg), kE, limit, true, {},
                         o.plan);

  CHECK(o.send_counts == std::vector<index_t>{2, 2, 2, 2});
  CHECK(o.send_valid == std::vector<index_t>{1, 2, 2, 2});
  CHECK(o.send_offsets == std::vector<index_t>{0, 2, 4, 6, 8});
  CHECK(o.slot == std::vector<std::int32_t>{2, 4, 5, 6, 3, 7, -1, -1, 0, -1, -1, -1});
  // Row 1 pads expert 0's block (only t4 is real there): token -1.
  CHECK(o.row_token == std::vector<std::int32_t>{4, -1, 0, 2, 0, 1, 1, 2});
  CHECK(o.plan.padding == 1);
  CHECK(o.plan.dropped == 5);
  CHECK(o.routed == std::vector<index_t>{1, 4, 4, 3});
  CHECK(o.plan.send_rows() == kR * kL * limit);
}

TEST_CASE("plan: build_send_plan with a large limit drops nothing", "[capacity][plan]") {
  const layer_config cfg = hand_cfg();
  const std::vector<float> w(kIds.size(), 0.5f);
  owned_plan o(kR, kL, kK, kT, kT * kK, kE);
  epmoe::build_send_plan(hand_routing(kIds, w), epmoe::placement::block(cfg), kE, kT, false, {},
                         o.plan);
  CHECK(o.plan.dropped == 0);
  CHECK(o.send_counts == std::vector<index_t>{1, 4, 4, 3});
  CHECK(o.send_offsets == std::vector<index_t>{0, 1, 5, 9, 12});
  for (std::int32_t s : o.slot) CHECK(s >= 0);
  // Inside a block, rows follow token order.
  CHECK(o.row_token == std::vector<std::int32_t>{4, 0, 2, 3, 5, 0, 1, 4, 5, 1, 2, 3});
}

TEST_CASE("plan: build_send_plan rejects an out-of-range expert id", "[capacity][plan]") {
  const layer_config cfg = hand_cfg();
  const std::vector<float> w(kIds.size(), 0.5f);
  for (std::int32_t bad : {kE, -2, 1000}) {  // -1 is no_expert: an empty slot
    std::vector<std::int32_t> ids = kIds;
    ids[7] = bad;
    owned_plan o(kR, kL, kK, kT, kT * kK, kE);
    try {
      epmoe::build_send_plan(hand_routing(ids, w), epmoe::placement::block(cfg), kE, 2, false, {},
                             o.plan);
      FAIL("expert id " << bad << " was accepted");
    } catch (const epmoe::config_error& e) {
      CHECK(e.field() == "routing.ids");
      CHECK(e.value() == std::to_string(bad));
    }
  }
}

TEST_CASE("plan: empty routing slots (no_expert) are skipped, not dropped", "[capacity][plan]") {
  const layer_config cfg = hand_cfg();
  const std::vector<float> w(kIds.size(), 0.5f);
  std::vector<std::int32_t> ids = kIds;
  ids[0] = epmoe::no_expert;
  ids[5] = epmoe::no_expert;
  owned_plan o(kR, kL, kK, kT, kT * kK, kE);
  epmoe::build_send_plan(hand_routing(ids, w), epmoe::placement::block(cfg), kE, kT, false, {},
                         o.plan);
  CHECK(o.plan.assignments == static_cast<epmoe::index_t>(kIds.size()) - 2);
  CHECK(o.plan.dropped == 0);
  CHECK(o.plan.slot[0] == -1);
  CHECK(o.plan.slot[5] == -1);
  CHECK(o.plan.send_rows() == o.plan.assignments);
}

TEST_CASE("plan: build_recv_plan lays out source-major and expert-major offsets",
          "[capacity][plan]") {
  // R = 2, L = 3; recv_counts[s * L + j] rows from source s for local expert j.
  owned_plan o(2, 3, 1, 0, 0, 6);
  o.recv_counts = {1, 0, 2, 3, 4, 0};
  o.plan.recv_counts = o.recv_counts.data();
  epmoe::build_recv_plan(o.plan);
  CHECK(o.recv_offsets == std::vector<index_t>{0, 1, 1, 3, 6, 10, 10});
  CHECK(o.plan.recv_rows() == 10);
  CHECK(o.plan.recv_rows_from(0) == 3);
  CHECK(o.plan.recv_rows_from(1) == 7);
  // Expert-major: e0 = [s0: 1, s1: 3], e1 = [s0: 0, s1: 4], e2 = [s0: 2, s1: 0].
  CHECK(o.expert_offsets == std::vector<index_t>{0, 4, 8, 10});
  CHECK(o.regroup_offsets == std::vector<index_t>{0, 4, 8, 1, 4, 10});
}
