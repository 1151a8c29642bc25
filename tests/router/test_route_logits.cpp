// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// router::route, the entry point from logits to routing without a layer: hand-written
// logits against values worked out by hand; the layer's route stage against the same call;
// and layer.dropped() / stats().capacity against an independent count of capacity drops.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <epmoe/capacity/dropless.hpp>
#include <epmoe/capacity/factor.hpp>
#include <epmoe/comm/local.hpp>
#include <epmoe/comm/threads.hpp>
#include <epmoe/moe_layer.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/router/expert_choice.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/route.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/sinkhorn.hpp>
#include <epmoe/router/topk_softmax.hpp>
#include <epmoe/space/host.hpp>

using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

layer_config config(int experts, int top_k, double capacity_factor = 1.0) {
  return {.hidden = 8,
          .ffn = 16,
          .experts = experts,
          .top_k = top_k,
          .max_tokens = 16,
          .capacity_factor = capacity_factor};
}

// Routes T tokens of `logits` with route(); slots start as garbage so unwritten ones show.
struct routed {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};
template <class Router>
routed route(const Router& r, const layer_config& cfg, const std::vector<float>& logits,
             router::route_options opt = {}) {
  const index_t E = cfg.experts, T = static_cast<index_t>(logits.size()) / E;
  const int W = router::routing_width<Router>(cfg);
  routed out{std::vector<std::int32_t>(static_cast<std::size_t>(T * W), -7),
             std::vector<float>(static_cast<std::size_t>(T * W), nan_f)};
  router::route(r, cfg, {logits.data(), T, E}, {{out.ids.data(), T, W}, {out.weights.data(), T, W}},
                opt);
  return out;
}

void check_weights(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("weight " << i);
    CHECK(got[i] == Approx(want[i]).margin(1e-6));
  }
}

// route() must throw a config_error naming `field`.
template <class F>
void rejects(F&& f, const std::string& field) {
  try {
    f();
    FAIL_CHECK("accepted a bad " << field);
  } catch (const config_error& e) {
    CHECK(e.field() == field);
  }
}

}  // namespace

TEST_CASE("route: softmax routers on hand-written logits", "[router][route]") {
  SECTION("mixtral<2>: top-2 renormalised; a tie goes to the lower expert") {
    // Token 0: experts 1 (logit 3) and 3 (2): e^3 / (e^3 + e^2) = 1 / (1 + e^-1).
    // Token 1: experts 1 and 2 tie at 2: both weigh 1/2, the lower id first.
    const auto r = route(router::mixtral<2>{}, config(4, 2), {1, 3, 0, 2, -1, 2, 2, 0.5f});
    CHECK(r.ids == std::vector<std::int32_t>{1, 3, 1, 2});
    check_weights(r.weights, {0.7310585786, 0.2689414214, 0.5, 0.5});
  }
  SECTION("switch_top1: the expert's softmax probability, not renormalised") {
    const float l2 = std::log(2.f), l3 = std::log(3.f), l4 = std::log(4.f);
    // p = 3 / (3 + 1 + 1 + 1) = 1/2; then 4 / (2 + 2 + 4 + 1) = 4/9.
    const auto r = route(router::switch_top1{}, config(4, 1), {0, l3, 0, 0, l2, l2, l4, 0});
    CHECK(r.ids == std::vector<std::int32_t>{1, 2});
    check_weights(r.weights, {0.5, 4.0 / 9.0});
  }
}

TEST_CASE("route: sigmoid_bias selects with its bias, weighs without it", "[router][route]") {
  const std::vector<float> bias{0.f, 0.1f, 0.f, 0.2f};
  router::sigmoid_bias<2> r{.scaling = 2.5f};
  // Token 0: all s = 1/2; token 1: s = sigmoid(2, -1, 0, 1).
  const std::vector<float> logits{0, 0, 0, 0, 2, -1, 0, 1};
  SECTION("no bias: token 0's tie goes to experts 0, 1; token 1 takes 0 then 3") {
    const auto got = route(r, config(4, 2), logits);
    CHECK(got.ids == std::vector<std::int32_t>{0, 1, 0, 3});
    // 2.5 * s_k / (s_0 + s_3): s_0 = sigmoid(2) = 0.8808, s_3 = sigmoid(1) = 0.7311.
    check_weights(got.weights, {1.25, 1.25, 1.3661227579, 1.1338772421});
  }
  SECTION("a bias moves the choice (0.5 + 0.2, 0.5 + 0.1), and only the choice") {
    r.bias = bias.data();
    const auto got = route(r, config(4, 2), logits);
    // Token 1: s + b = 0.881, 0.369, 0.5, 0.931: expert 3 now leads.
    CHECK(got.ids == std::vector<std::int32_t>{3, 1, 3, 0});
    check_weights(got.weights, {1.25, 1.25, 1.1338772421, 1.3661227579});
  }
  SECTION("a non-finite bias is refused, naming the entry") {
    const std::vector<float> bad{0.f, 0.f, nan_f, 0.f};
    r.bias = bad.data();
    rejects([&] { route(r, config(4, 2), logits); }, "router.bias[2]");
  }
}

TEST_CASE("route: expert choice (a batch router), with and without scratch", "[router][route]") {
  // E = 2, cfg top_k 1, capacity factor 1: each expert takes C = ceil(4 * 1 / 2) = 2 tokens.
  // softmax rows: t0 (0.881, 0.119), t1 (0.119, 0.881), t2 (0.731, 0.269), t3 (0.5, 0.5):
  // expert 0 takes t0, t2; expert 1 takes t1, t3. Slot e of a token holds expert e or -1.
  const std::vector<float> logits{2, 0, 0, 2, 1, 0, 0, 0};
  const std::vector<std::int32_t> ids{0, -1, -1, 1, 0, -1, -1, 1};
  const std::vector<double> weights{0.8807970780, 0, 0, 0.8807970780, 0.7310585786, 0, 0, 0.5};
  SECTION("route() allocates its scratch") {
    const auto got = route(router::expert_choice{}, config(2, 1), logits);
    CHECK(got.ids == ids);
    check_weights(got.weights, weights);
  }
  SECTION("given scratch, too small scratch is refused") {
    std::vector<float> fs(8);
    std::vector<std::int32_t> is(4);
    const auto got = route(router::expert_choice{}, config(2, 1), logits,
                           {.float_scratch = fs, .int_scratch = is});
    CHECK(got.ids == ids);
    check_weights(got.weights, weights);
    std::vector<float> small(7);
    rejects(
        [&] {
          route(router::expert_choice{}, config(2, 1), logits,
                {.float_scratch = small, .int_scratch = is});
        },
        "options.float_scratch");
  }
}

TEST_CASE("route: bad arguments throw config_error naming them", "[router][route]") {
  const std::vector<float> logits(8, 0.f);
  rejects([&] { route(router::mixtral<2>{}, config(4, 3), logits); }, "cfg.top_k");
  std::vector<std::int32_t> ids(4);
  std::vector<float> w(4);
  rejects(
      [&] {  // 2 tokens of routing, 1 token of logits
        router::route(router::mixtral<2>{}, config(4, 2), {logits.data(), 1, 4},
                      {{ids.data(), 2, 2}, {w.data(), 2, 2}});
      },
      "logits");
  rejects(
      [&] {
        router::route(router::mixtral<2>{}, config(4, 2), {logits.data(), 2, 4},
                      {{ids.data(), 2, 2}, {w.data(), 1, 2}});
      },
      "out.weights");
  rejects([&] { route(router::hash<1>{}, config(4, 1), logits); }, "options.token_ids");
  rejects([&] { route(router::topk_softmax<2>{.groups = 3}, config(4, 2), logits); },
          "router.groups");
}

namespace {

template <class Router>
struct one_rank_policies : default_policies {
  using router = Router;
};

// The layer routes x through its gate with the same call: its last_routing() equals route()
// on logits = x * gate^T computed by the same host GEMM, bit for bit.
template <class Router>
void layer_routes_like_route(const Router& r) {
  layer_config cfg{.hidden = 16, .ffn = 8, .experts = 8, .top_k = 2, .max_tokens = 12};
  const auto full = reference::full_weights::random(cfg, 5);
  const placement::block where(cfg);
  const auto mine = reference::slice(full, where, 0);
  using layer_t = moe_layer<one_rank_policies<Router>>;
  layer_t layer(cfg, comm::local{}, {{full.gate.data(), 8, 16}, mine.experts()}, r);
  const index_t T = 11;
  const auto x = reference::random_tokens(T, 16, 9);
  std::vector<float> y(static_cast<std::size_t>(T * 16), nan_f);
  layer.forward({x.data(), T, 16}, {y.data(), T, 16});
  std::vector<float> logits(static_cast<std::size_t>(T * 8));
  space::host{}.gemm_nt({x.data(), T, 16}, {full.gate.data(), 8, 16}, {logits.data(), T, 8});
  const auto want = route(r, cfg, logits, {.first_token = 0});
  const routing_view got = layer.last_routing();
  REQUIRE(got.tokens() == T);
  int checked = 0;
  for (index_t t = 0; t < T; ++t)
    for (int k = 0; k < 2; ++k, ++checked) {
      CHECK(got.ids(t, k) == want.ids[t * 2 + k]);
      CHECK(got.weights(t, k) == want.weights[t * 2 + k]);
    }
  CHECK(checked == T * 2);
}

}  // namespace

TEST_CASE("route: the layer's route stage is route()", "[router][route][layer]") {
  layer_routes_like_route(router::mixtral<2>{});
  layer_routes_like_route(router::sinkhorn<2>{});
  static const std::vector<float> bias{0.3f, 0, 0, -0.2f, 0.1f, 0, 0.25f, 0};
  layer_routes_like_route(
      router::sigmoid_bias<2>{.groups = 2, .top_groups = 1, .bias = bias.data()});
}

namespace {

template <class Capacity>
struct drop_policies : default_policies {
  using capacity = Capacity;
  using comm = epmoe::comm::threads;
};

// Rank r's given routing: every token picks expert 0 (hot) and one of 1..3; every 5th token's
// second slot is empty (-1), which is not a drop.
std::vector<std::int32_t> given_ids(index_t T, int rank) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * 2));
  for (index_t t = 0; t < T; ++t) {
    ids[t * 2] = (t + rank) % 4 == 3 ? 2 : 0;
    ids[t * 2 + 1] = t % 5 == 4 ? no_expert : static_cast<std::int32_t>(1 + (t + 2 * rank) % 3);
    if (ids[t * 2 + 1] == ids[t * 2]) ids[t * 2 + 1] = 3;
  }
  return ids;
}

// The drops capacity makes, counted independently: per source rank, each expert keeps its
// first `limit` assignments in token order (then slot order), the rest are dropped.
std::vector<char> expected_drops(const std::vector<std::int32_t>& ids, index_t limit) {
  std::vector<index_t> kept(4, 0);
  std::vector<char> drop(ids.size(), 0);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == no_expert) continue;
    if (kept[ids[i]] < limit)
      ++kept[ids[i]];
    else
      drop[i] = 1;
  }
  return drop;
}

// What one rank saw of its pass (Catch asserts on the main thread, after the ranks join).
struct rank_drops {
  std::vector<std::int32_t> ids;  // [T, 2] the given routing
  std::vector<char> mask;         // [T, 2] layer.dropped()
  index_t tokens = 0, slots = 0, mask_count = -1, stats_dropped = -1;
  std::optional<index_t> capacity = -1;
};

template <class Capacity>
void check_drops(std::optional<index_t> (*limit_of)(index_t T)) {
  layer_config cfg{.hidden = 8,
                   .ffn = 16,
                   .experts = 4,
                   .top_k = 2,
                   .ranks = 2,
                   .max_tokens = 12,
                   .capacity_factor = 0.5};
  const auto full = reference::full_weights::random(cfg, 3);
  const placement::block where(cfg);
  std::vector<rank_drops> seen(2);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(full, where, r);
    moe_layer<drop_policies<Capacity>> layer(cfg, c, {full.gate_view(), mine.experts()});
    const index_t T = 12 - 3 * r;  // 12 and 9 tokens
    const auto x = reference::random_tokens(T, 8, 4 + r);
    std::vector<float> y(static_cast<std::size_t>(T * 8), nan_f);
    rank_drops& s = seen[static_cast<std::size_t>(r)];
    s.ids = given_ids(T, r);
    const std::vector<float> w(s.ids.size(), 0.5f);
    layer.forward({x.data(), T, 8}, {{s.ids.data(), T, 2}, {w.data(), T, 2}}, {y.data(), T, 8});
    const drop_mask mask = layer.dropped();
    s.tokens = mask.tokens;
    s.slots = mask.slots;
    for (index_t t = 0; t < mask.tokens; ++t)
      for (index_t k = 0; k < mask.slots; ++k) s.mask.push_back(mask(t, k) ? 1 : 0);
    s.mask_count = mask.count();
    s.stats_dropped = layer.stats().dropped;
    s.capacity = layer.stats().capacity;
  });
  int checked = 0;
  for (int r = 0; r < 2; ++r) {
    const rank_drops& s = seen[static_cast<std::size_t>(r)];
    const index_t T = 12 - 3 * r;
    INFO("rank " << r);
    REQUIRE(s.tokens == T);
    REQUIRE(s.slots == 2);
    const std::optional<index_t> limit = limit_of(T);
    CHECK(s.capacity == limit);
    const auto want = expected_drops(s.ids, limit ? *limit : T);
    REQUIRE(s.mask.size() == want.size());
    index_t expected = 0;
    for (std::size_t i = 0; i < want.size(); ++i, ++checked) {
      INFO("token " << i / 2 << " slot " << i % 2);
      CHECK(s.mask[i] == want[i]);
      expected += want[i];
    }
    CHECK(s.mask_count == expected);
    CHECK(s.stats_dropped == expected);
    if (limit) CHECK(expected > 0);  // the routing is skewed enough to drop
  }
  CHECK(checked == 2 * (12 + 9));
}

}  // namespace

TEST_CASE("layer.dropped() and stats().capacity match an independent count of drops",
          "[layer][capacity][dropped]") {
  SECTION("capacity::factor: ceil(0.5 * T * 2 / 4) rows per expert per source rank") {
    check_drops<capacity::factor<>>([](index_t T) {
      return std::optional<index_t>((T + 3) / 4);  // ceil(0.5 * T * 2 / 4)
    });
  }
  SECTION("capacity::dropless: no limit, nothing dropped") {
    check_drops<capacity::dropless>([](index_t) { return std::optional<index_t>(); });
  }
}
