// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "harness.hpp"

// forward(x, routing, y): the routing given by the caller, validated before anything moves.
// A namespace per file: the test programs compile their files as one unit.
namespace layer_routing_tests {
using namespace epmoe;

namespace {

// The reference's router for a given routing: looks the token's global position up.
template <int K>
struct table_router {
  static constexpr int top_k = K;
  static constexpr bool uses_gate = false;
  const std::int32_t* ids = nullptr;  // [R * max_tokens, K] by global position
  const float* weights = nullptr;
  void route_token(const token_input& in, int* out_ids, float* out_w) const {
    for (int k = 0; k < K; ++k) {
      out_ids[k] = ids[in.token * K + k];
      out_w[k] = weights[in.token * K + k];
    }
  }
};

struct given_routing {
  std::vector<std::int32_t> ids;  // [R * max_tokens, K]
  std::vector<float> weights;
};

// Random ids (some empty slots), dyadic weights in [0, 1].
given_routing random_routing(const layer_config& cfg, std::uint64_t seed) {
  const std::size_t n = static_cast<std::size_t>(cfg.ranks) * cfg.max_tokens * cfg.top_k;
  given_routing g{std::vector<std::int32_t>(n), std::vector<float>(n)};
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const auto u = static_cast<std::uint32_t>(s >> 33);
    g.ids[i] = u % 11 == 0 ? no_expert : static_cast<std::int32_t>(u % cfg.experts);
    g.weights[i] = static_cast<float>((u >> 8) % 17) / 16.f;
  }
  for (std::size_t i = 1; i < n; i += 2)  // a token's experts are distinct
    if (g.ids[i] != no_expert && g.ids[i] == g.ids[i - 1]) g.ids[i] = (g.ids[i] + 1) % cfg.experts;
  return g;
}

using P = test::threads_policies<2>;
// Outputs start as a NaN with a payload of its own: a row a valid pass leaves unwritten fails
// the comparison, and a rejected pass must leave every bit as it was.
constexpr std::uint32_t sentinel_bits = 0x7fc01234u;
const float sentinel = std::bit_cast<float>(sentinel_bits);
bool untouched(float v) { return std::bit_cast<std::uint32_t>(v) == sentinel_bits; }

struct outcome {
  std::vector<std::string> field, what;  // [rank]: the error each rank threw ("" if none)
  std::vector<float> y;                  // all ranks' outputs, global order
};

// One pass on every rank with the given routing; `edit` may break rank r's copy first.
template <class Edit>
outcome run_given(const layer_config& cfg, const reference::full_weights& w,
                  const test::global_tokens& g, const given_routing& routing, Edit edit,
                  int passes_after = 0) {
  outcome out{std::vector<std::string>(cfg.ranks), std::vector<std::string>(cfg.ranks),
              std::vector<float>(g.x.size(), sentinel)};
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(w, placement::block(cfg), r);
    moe_layer<P> layer(cfg, c, {w.gate_view(), mine.experts()});
    const index_t T = g.per_rank[r], H = cfg.hidden, K = cfg.top_k;
    const std::size_t at = static_cast<std::size_t>(r) * cfg.max_tokens * K;
    std::vector<std::int32_t> ids(routing.ids.begin() + at, routing.ids.begin() + at + T * K);
    std::vector<float> wts(routing.weights.begin() + at, routing.weights.begin() + at + T * K);
    edit(r, ids, wts);
    const matrix_view<const float> x(g.x.data() + g.offset(r) * H, T, H);
    const matrix_view<float> y(out.y.data() + g.offset(r) * H, T, H);
    try {
      layer.forward(x, routing_view{{ids.data(), T, K}, {wts.data(), T, K}}, y);
    } catch (const input_error& e) {
      out.field[r] = e.field();
      out.what[r] = e.what();
    }
    // The layer stays usable after a rejected pass.
    for (int p = 0; p < passes_after; ++p) {
      std::vector<std::int32_t> good(routing.ids.begin() + at, routing.ids.begin() + at + T * K);
      layer.forward(x, routing_view{{good.data(), T, K}, {routing.weights.data() + at, T, K}}, y);
    }
  });
  return out;
}

std::vector<float> reference_of(const layer_config& cfg, const reference::full_weights& w,
                                const test::global_tokens& g, const given_routing& routing) {
  std::vector<float> y(g.x.size());
  const index_t n = g.total(), H = cfg.hidden;
  const table_router<2> router{routing.ids.data(), routing.weights.data()};
  reference::forward(w, router, capacity::dropless{}, {g.x.data(), n, H}, g.per_rank,
                     {y.data(), n, H});
  return y;
}

const layer_config cfg{
    .hidden = 10, .ffn = 6, .experts = 8, .top_k = 2, .ranks = 2, .max_tokens = 12};

}  // namespace

TEST_CASE("routing: a given routing is what the layer computes", "[layer][routing]") {
  const auto w = reference::full_weights::random(cfg, 101);
  const auto g = test::make_tokens({12, 7}, cfg.hidden, 102);
  const auto routing = random_routing(cfg, 103);
  const auto got = run_given(cfg, w, g, routing, [](int, auto&, auto&) {});
  CHECK(got.field[0].empty());
  CHECK(got.field[1].empty());
  CHECK(test::relative_error(got.y, reference_of(cfg, w, g, routing)) <= 1e-5);
}

TEST_CASE("routing: an id out of range names the token and slot, on every rank",
          "[layer][routing][error]") {
  const auto w = reference::full_weights::random(cfg, 104);
  const auto g = test::make_tokens({12, 7}, cfg.hidden, 105);
  const auto routing = random_routing(cfg, 106);
  const auto got = run_given(
      cfg, w, g, routing,
      [](int r, auto& ids, auto&) {
        if (r == 1) ids[5 * 2 + 1] = 99;
      },
      1);
  CHECK(got.field[1] == "routing.ids[5][1]");
  CHECK(got.what[1] == "epmoe: routing.ids[5][1] = 99: must be in [0, 8) or -1 (an empty slot)");
  // The peer does not hang in an exchange: it throws too, naming the rank that rejected.
  CHECK(got.what[0].find("rank 1") != std::string::npos);
  // The pass after the rejected one runs normally on both ranks.
  CHECK(test::relative_error(got.y, reference_of(cfg, w, g, routing)) <= 1e-5);
}

TEST_CASE("routing: a rejected pass writes nothing to any rank's output",
          "[layer][routing][error]") {
  const auto w = reference::full_weights::random(cfg, 107);
  const auto g = test::make_tokens({12, 7}, cfg.hidden, 108);
  const auto routing = random_routing(cfg, 109);
  const float bad = GENERATE(-0.5f, std::numeric_limits<float>::quiet_NaN(),
                             std::numeric_limits<float>::infinity());
  const auto got = run_given(cfg, w, g, routing, [&](int r, auto&, auto& wts) {
    if (r == 0) wts[3 * 2 + 0] = bad;
  });
  CHECK(got.field[0] == "routing.weights[3][0]");
  CHECK(got.what[0].find("must be finite and >= 0") != std::string::npos);
  CHECK(got.field[1].find("rank 0") != std::string::npos);
  CHECK(std::all_of(got.y.begin(), got.y.end(), untouched));
}

TEST_CASE("routing: an id below -1 and a wrong shape are rejected", "[layer][routing][error]") {
  const auto w = reference::full_weights::random(cfg, 110);
  const auto g = test::make_tokens({12, 7}, cfg.hidden, 111);
  const auto routing = random_routing(cfg, 112);
  const auto neg = run_given(cfg, w, g, routing, [](int r, auto& ids, auto&) {
    if (r == 1) ids[0] = -2;
  });
  CHECK(neg.field[1] == "routing.ids[0][0]");
  CHECK(std::all_of(neg.y.begin(), neg.y.end(), untouched));
}

TEST_CASE("forward: a rank with too many tokens makes every rank throw, none hangs",
          "[layer][routing][error]") {
  const auto w = reference::full_weights::random(cfg, 113);
  const auto g = test::make_tokens({12, 13}, cfg.hidden, 114);  // rank 1: 13 > max_tokens
  std::vector<std::string> what(2);
  std::vector<float> y(g.x.size(), sentinel);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(w, placement::block(cfg), r);
    moe_layer<P> layer(cfg, c, {w.gate_view(), mine.experts()});
    const index_t T = g.per_rank[r], H = cfg.hidden;
    try {
      layer.forward({g.x.data() + g.offset(r) * H, T, H}, {y.data() + g.offset(r) * H, T, H});
    } catch (const config_error& e) {
      what[r] = e.what();
    }
  });
  CHECK(what[1].find("x.rows = 13") != std::string::npos);
  CHECK(what[0].find("rank 1") != std::string::npos);
  CHECK(std::all_of(y.begin(), y.end(), untouched));
}

TEST_CASE("routing: a token that repeats an expert is rejected", "[layer][routing][error]") {
  const auto w = reference::full_weights::random(cfg, 115);
  const auto g = test::make_tokens({12, 7}, cfg.hidden, 116);
  auto routing = random_routing(cfg, 117);
  const auto got = run_given(cfg, w, g, routing, [](int r, auto& ids, auto&) {
    if (r == 0) ids[4 * 2 + 0] = ids[4 * 2 + 1] = 3;  // buffers hold one row per (token, expert)
  });
  CHECK(got.field[0] == "routing.ids[4][1]");
  CHECK(got.what[0].find("repeats routing.ids[4][0]") != std::string::npos);
  CHECK(std::all_of(got.y.begin(), got.y.end(), untouched));
}

}  // namespace layer_routing_tests
