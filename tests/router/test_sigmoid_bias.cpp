// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <epmoe/comm/threads.hpp>
#include <epmoe/core/concepts.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/core/losses.hpp>
#include <epmoe/moe_layer.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

using epmoe::layer_config;
using epmoe::router::sigmoid_bias;

namespace {

// The expected side is plain double arithmetic: nothing from epmoe::math.
double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct routed {
  std::vector<int> ids;
  std::vector<float> weights;
};

template <class Router>
routed route(const Router& r, const std::vector<float>& logits) {
  routed out{std::vector<int>(Router::top_k, -7), std::vector<float>(Router::top_k, -7.f)};
  const epmoe::token_input in{logits.data(), nullptr, static_cast<int>(logits.size())};
  r.route_token(in, out.ids.data(), out.weights.data());
  return out;
}

struct expected {
  std::vector<int> ids;
  std::vector<double> weights;
};

// DeepSeek-V3 without groups: select on sigmoid + bias (stable sort: ties to the lower id),
// weigh by the plain sigmoid, normalised if asked, times scaling.
expected reference(const std::vector<float>& logits, const std::vector<float>& bias, int k,
                   double scaling, bool normalize) {
  const int E = static_cast<int>(logits.size());
  std::vector<double> key(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) key[e] = sig(logits[e]) + (bias.empty() ? 0.0 : double{bias[e]});
  std::vector<int> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  expected x;
  x.ids.assign(order.begin(), order.begin() + k);
  double sum = 0;
  for (int id : x.ids) sum += sig(logits[id]);
  for (int id : x.ids) x.weights.push_back(scaling * sig(logits[id]) / (normalize ? sum : 1.0));
  return x;
}

std::vector<float> normal(std::mt19937& rng, int n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

double sum(const std::vector<float>& w) { return std::accumulate(w.begin(), w.end(), 0.0); }

layer_config config(int experts, int top_k) {
  layer_config c;
  c.hidden = 8;
  c.ffn = 16;
  c.experts = experts;
  c.top_k = top_k;
  c.max_tokens = 16;
  return c;
}

// validate() must throw a config_error naming `field`.
template <class Router>
void require_rejected(const Router& r, const layer_config& cfg, const std::string& field) {
  try {
    r.validate(cfg);
    FAIL_CHECK("validate() accepted a router whose " << field << " is bad");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == field);
    CHECK_THAT(e.what(), Catch::Matchers::Contains(field));
  }
}

constexpr float inf_f = std::numeric_limits<float>::infinity();
constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

}  // namespace

using sigmoid_routers =
    std::tuple<sigmoid_bias<1>, sigmoid_bias<2>, sigmoid_bias<4>, sigmoid_bias<8>>;

TEMPLATE_LIST_TEST_CASE("sigmoid_bias: satisfies router_policy with a bias and validate",
                        "[router][sigmoid_bias]", sigmoid_routers) {
  STATIC_REQUIRE(epmoe::router_policy<TestType>);
  STATIC_REQUIRE(epmoe::token_router<TestType>);
  STATIC_REQUIRE(epmoe::router_with_bias<TestType>);
  STATIC_REQUIRE(epmoe::router_with_validate<TestType>);
  STATIC_REQUIRE(epmoe::has_probabilities<TestType>);
  STATIC_REQUIRE(TestType::uses_gate);
  const TestType r{};
  CHECK(r.groups == 1);
  CHECK(r.top_groups == 1);
  CHECK(r.scaling == 1.f);
  CHECK(r.normalize);
  CHECK(r.bias == nullptr);
}

TEST_CASE("sigmoid_bias: a hand-computed token", "[router][sigmoid_bias]") {
  // sigmoid(0, 2, -1, 1) = 0.5, 0.880797, 0.268941, 0.731059: top-2 are experts 1 and 3.
  const std::vector<float> logits{0.f, 2.f, -1.f, 1.f};
  const double s2 = 0.8807970779778823, s1 = 0.7310585786300049;
  SECTION("normalised, scaling 1") {
    const auto r = route(sigmoid_bias<2>{}, logits);
    CHECK(r.ids == std::vector<int>{1, 3});
    CHECK(r.weights[0] == Approx(s2 / (s2 + s1)).margin(1e-6));
    CHECK(r.weights[1] == Approx(s1 / (s2 + s1)).margin(1e-6));
  }
  SECTION("normalised, scaling 2.5: the weights sum to 2.5") {
    sigmoid_bias<2> router;
    router.scaling = 2.5f;
    const auto r = route(router, logits);
    CHECK(r.ids == std::vector<int>{1, 3});
    CHECK(r.weights[0] == Approx(2.5 * s2 / (s2 + s1)).margin(1e-6));
    CHECK(r.weights[1] == Approx(2.5 * s1 / (s2 + s1)).margin(1e-6));
    CHECK(sum(r.weights) == Approx(2.5).margin(1e-6));
  }
  SECTION("not normalised: scaling * sigmoid") {
    sigmoid_bias<2> router;
    router.normalize = false;
    router.scaling = 3.f;
    const auto r = route(router, logits);
    CHECK(r.ids == std::vector<int>{1, 3});
    CHECK(r.weights[0] == Approx(3 * s2).margin(1e-6));
    CHECK(r.weights[1] == Approx(3 * s1).margin(1e-6));
  }
  SECTION("K = 1, normalised: the single weight is the scaling") {
    sigmoid_bias<1> router;
    router.scaling = 2.5f;
    const auto r = route(router, logits);
    CHECK(r.ids == std::vector<int>{1});
    CHECK(r.weights[0] == Approx(2.5).margin(1e-6));
  }
}

TEMPLATE_LIST_TEST_CASE("sigmoid_bias: matches an independent implementation on random tokens",
                        "[router][sigmoid_bias]", sigmoid_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(101 + K);
  std::uniform_real_distribution<float> b(-0.3f, 0.3f), sc(0.5f, 3.f);
  for (int trial = 0; trial < 300; ++trial) {
    const int E = K + static_cast<int>(rng() % 24);
    const auto logits = normal(rng, E, 2.f);
    std::vector<float> bias(static_cast<std::size_t>(E));
    for (float& x : bias) x = b(rng);
    TestType router;
    router.scaling = sc(rng);
    router.normalize = trial % 3 != 0;
    if (trial % 4 != 0) router.bias = bias.data();  // every 4th token: no bias at all
    const auto r = route(router, logits);
    const auto want = reference(logits, router.bias ? bias : std::vector<float>{}, K,
                                router.scaling, router.normalize);
    REQUIRE(r.ids == want.ids);
    for (int k = 0; k < K; ++k) REQUIRE(r.weights[k] == Approx(want.weights[k]).margin(1e-6));
  }
}

TEMPLATE_LIST_TEST_CASE("sigmoid_bias: properties over random tokens", "[router][sigmoid_bias]",
                        sigmoid_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(201 + K);
  std::uniform_real_distribution<float> b(-1.f, 1.f), sc(0.1f, 4.f);
  for (int seed = 0; seed < 300; ++seed) {
    const int E = K + static_cast<int>(rng() % 40);
    const auto logits = normal(rng, E, 3.f);
    std::vector<float> bias(static_cast<std::size_t>(E));
    for (float& x : bias) x = b(rng);
    TestType router;
    router.scaling = sc(rng);
    router.bias = bias.data();
    const auto r = route(router, logits);
    REQUIRE(std::set<int>(r.ids.begin(), r.ids.end()).size() == static_cast<std::size_t>(K));
    for (int id : r.ids) REQUIRE((id >= 0 && id < E));
    for (float w : r.weights) REQUIRE(w > 0.f);
    REQUIRE(sum(r.weights) == Approx(router.scaling).epsilon(1e-5));
  }
}

TEST_CASE("sigmoid_bias: the bias changes the selection, never the weights' scores",
          "[router][sigmoid_bias]") {
  // sigmoid: 0.8808, 0.7311, 0.5, 0.2689. Without bias: experts 0 and 1.
  const std::vector<float> logits{2.f, 1.f, 0.f, -1.f};
  const double s0 = sig(2), s3 = sig(-1);
  sigmoid_bias<2> router;
  REQUIRE(route(router, logits).ids == std::vector<int>{0, 1});
  // +0.9 on expert 3: 0.2689 + 0.9 = 1.169 beats every other key, so 3 is chosen first and
  // pushes expert 1 out; its weight is still its plain sigmoid share.
  const std::vector<float> bias{0.f, 0.f, 0.f, 0.9f};
  router.bias = bias.data();
  SECTION("normalised") {
    const auto r = route(router, logits);
    REQUIRE(r.ids == std::vector<int>{3, 0});
    CHECK(r.weights[0] == Approx(s3 / (s3 + s0)).margin(1e-6));
    CHECK(r.weights[1] == Approx(s0 / (s3 + s0)).margin(1e-6));
    // Had the biased key leaked into the weight it would be (s3 + 0.9) / (s3 + 0.9 + s0).
    CHECK(r.weights[0] < 0.5f);
  }
  SECTION("not normalised") {
    router.normalize = false;
    const auto r = route(router, logits);
    REQUIRE(r.ids == std::vector<int>{3, 0});
    CHECK(r.weights[0] == Approx(s3).margin(1e-6));
    CHECK(r.weights[1] == Approx(s0).margin(1e-6));
  }
  SECTION("a negative bias pushes the best expert out") {
    const std::vector<float> down{-1.f, 0.f, 0.f, 0.f};
    router.bias = down.data();
    const auto r = route(router, logits);
    REQUIRE(r.ids == std::vector<int>{1, 2});
    CHECK(r.weights[0] == Approx(sig(1) / (sig(1) + sig(0))).margin(1e-6));
  }
}

TEST_CASE("sigmoid_bias: ties go to the lowest expert id", "[router][sigmoid_bias][ties]") {
  SECTION("all logits equal") {
    const std::vector<float> logits(12, 0.25f);
    CHECK(route(sigmoid_bias<1>{}, logits).ids == std::vector<int>{0});
    CHECK(route(sigmoid_bias<4>{}, logits).ids == std::vector<int>{0, 1, 2, 3});
    const auto r = route(sigmoid_bias<8>{}, logits);
    CHECK(r.ids == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
    for (float w : r.weights) CHECK(w == Approx(1.0 / 8).margin(1e-7));
  }
  SECTION("equal biased keys") {
    const std::vector<float> logits(6, 0.f);
    const std::vector<float> bias{0.25f, 0.5f, 0.f, 0.5f, 0.25f, 0.5f};
    sigmoid_bias<2> two;
    two.bias = bias.data();
    CHECK(route(two, logits).ids == std::vector<int>{1, 3});
    sigmoid_bias<4> four;
    four.bias = bias.data();
    CHECK(route(four, logits).ids == std::vector<int>{1, 3, 5, 0});
  }
}

TEST_CASE("sigmoid_bias: probabilities are the normalised sigmoid scores",
          "[router][sigmoid_bias]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int E = 2 + static_cast<int>(rng() % 30);
    const auto logits = normal(rng, E, 2.f);
    std::vector<float> bias(static_cast<std::size_t>(E), 5.f);  // must not matter
    sigmoid_bias<1> router;
    router.bias = bias.data();
    std::vector<float> p(static_cast<std::size_t>(E));
    router.probabilities({logits.data(), nullptr, E}, p.data());
    double total = 0;
    for (float x : logits) total += sig(x);
    for (int e = 0; e < E; ++e) REQUIRE(p[e] == Approx(sig(logits[e]) / total).margin(1e-6));
  }
}

TEST_CASE("sigmoid_bias: update_bias moves each bias by gamma toward the mean load",
          "[router][sigmoid_bias][bias]") {
  sigmoid_bias<2> router;
  router.gamma = 0.125f;  // exact in binary, so the expected values are exact
  SECTION("under, at and over the mean") {
    std::vector<float> b{0.5f, -0.25f, 0.f, 1.f};
    const std::vector<epmoe::index_t> load{10, 20, 30, 20};  // mean 20
    router.update_bias(b, load);
    CHECK(b == std::vector<float>{0.625f, -0.25f, -0.125f, 1.f});
  }
  SECTION("a non-integer mean: nobody is at it") {
    std::vector<float> b{0.f, 0.f, 0.f};
    const std::vector<epmoe::index_t> load{1, 2, 3};  // mean 2: the middle one stays
    router.update_bias(b, load);
    CHECK(b == std::vector<float>{0.125f, 0.f, -0.125f});
    const std::vector<epmoe::index_t> uneven{1, 2};  // mean 1.5
    std::vector<float> c{0.f, 0.f};
    router.update_bias(c, uneven);
    CHECK(c == std::vector<float>{0.125f, -0.125f});
  }
  SECTION("perfectly balanced: no change at all") {
    std::vector<float> b{0.3f, -0.7f, 0.1f, 0.f};
    const auto before = b;
    const std::vector<epmoe::index_t> load{7, 7, 7, 7};
    router.update_bias(b, load);
    CHECK(b == before);
  }
  SECTION("the step is gamma whatever the size of the imbalance") {
    std::vector<float> b{0.f, 0.f};
    const std::vector<epmoe::index_t> load{0, 1000000};
    router.update_bias(b, load);
    CHECK(b == std::vector<float>{0.125f, -0.125f});
  }
  SECTION("repeated updates steer the selection toward the underloaded expert") {
    // Expert 0 always wins without bias (sigmoid 0.731 vs 0.690 vs 0.119). Each pass loads
    // the chosen expert only; the bias must hand some passes to expert 1.
    const std::vector<float> logits{1.f, 0.8f, -2.f};
    std::vector<float> b(3, 0.f);
    router.gamma = 0.01f;
    sigmoid_bias<1> one;
    one.bias = b.data();
    std::vector<int> chosen(3, 0);
    for (int pass = 0; pass < 20; ++pass) {
      const int e = route(one, logits).ids[0];
      ++chosen[static_cast<std::size_t>(e)];
      std::vector<epmoe::index_t> load(3, 0);
      load[static_cast<std::size_t>(e)] = 10;
      router.update_bias(b, load);
    }
    CHECK(chosen[1] >= 5);
    CHECK(chosen[0] >= 5);
    CHECK(chosen[2] == 0);  // 0.6 behind: 20 steps of 0.01 are not enough
    CHECK(b[2] == Approx(0.2).margin(1e-5));
  }
}

TEST_CASE("sigmoid_bias: validate names the bad field", "[router][sigmoid_bias][validate]") {
  const layer_config cfg = config(16, 4);
  SECTION("defaults and DeepSeek-like settings pass") {
    CHECK_NOTHROW(sigmoid_bias<4>{}.validate(cfg));
    sigmoid_bias<4> r;
    r.groups = 4;
    r.top_groups = 2;
    r.scaling = 2.5f;
    r.gamma = 0.f;
    CHECK_NOTHROW(r.validate(cfg));
  }
  SECTION("groups") {
    for (int g : {0, -1, 3, 5, 65, 128}) {  // 3, 5 do not divide 16; 0, 65, 128 out of range
      INFO("groups = " << g);
      sigmoid_bias<4> r;
      r.groups = g;
      require_rejected(r, cfg, "router.groups");
    }
    sigmoid_bias<1> r;
    r.groups = 64;
    r.top_groups = 1;
    CHECK_NOTHROW(r.validate(config(64, 1)));
  }
  SECTION("top_groups") {
    for (int tg : {0, -2, 5}) {  // 5 > groups
      INFO("top_groups = " << tg);
      sigmoid_bias<4> r;
      r.groups = 4;
      r.top_groups = tg;
      require_rejected(r, cfg, "router.top_groups");
    }
    // 1 kept group of 16/8 = 2 experts cannot hold 4.
    sigmoid_bias<4> r;
    r.groups = 8;
    r.top_groups = 1;
    require_rejected(r, cfg, "router.top_groups");
    r.top_groups = 2;
    CHECK_NOTHROW(r.validate(cfg));
  }
  SECTION("scaling") {
    for (float s : {0.f, -1.f, nan_f}) {
      INFO("scaling = " << s);
      sigmoid_bias<4> r;
      r.scaling = s;
      require_rejected(r, cfg, "router.scaling");
    }
  }
  SECTION("gamma") {
    for (float g : {-1e-3f, nan_f}) {
      INFO("gamma = " << g);
      sigmoid_bias<4> r;
      r.gamma = g;
      require_rejected(r, cfg, "router.gamma");
    }
  }
}

TEST_CASE("sigmoid_bias: validate rejects non-finite scaling and gamma",
          "[router][sigmoid_bias][validate]") {
  // layer_config requires its real knobs (capacity_factor, aux_loss_coef) to be finite; an
  // infinite scaling makes every weight inf, an infinite gamma every bias +-inf.
  const layer_config cfg = config(16, 4);
  sigmoid_bias<4> r;
  r.scaling = inf_f;
  require_rejected(r, cfg, "router.scaling");
  sigmoid_bias<4> g;
  g.gamma = inf_f;
  require_rejected(g, cfg, "router.gamma");
}

namespace {

struct bias_policies : epmoe::default_policies {
  using router = sigmoid_bias<2>;
  using comm = epmoe::comm::threads;
};
struct bias_policies_local : epmoe::default_policies {
  using router = sigmoid_bias<2>;
};
using bias_layer = epmoe::moe_layer<bias_policies>;

// How a test hands the layer its bias.
enum class bias_way { none, constructor, router_bias, router_pointer };

// What one rank saw (Catch asserts on the main thread only, after the ranks join).
struct rank_seen {
  std::vector<float> x;                // [6, 8]: the logits (identity gate)
  std::vector<std::int32_t> ids;       // [6, 2]
  std::vector<float> weights;          // [6, 2]
  std::vector<float> bias;             // router_bias() after the pass
  bool router_reads_own_copy = false;  // router().bias == router_bias().data()
};

// Two ranks, E = H = 8 with an identity gate (logits = x, exactly), 6 tokens each: every
// token's routing must be the reference's with `bias` (or without, for none).
void check_layer_bias(bias_way way) {
  const layer_config cfg{
      .hidden = 8, .ffn = 16, .experts = 8, .top_k = 2, .ranks = 2, .max_tokens = 6};
  const std::vector<float> bias{0.f, -0.3f, 0.f, 0.35f, 0.f, 0.2f, -0.1f, 0.f};
  std::vector<float> gate(64, 0.f);
  for (int e = 0; e < 8; ++e) gate[e * 8 + e] = 1.f;
  const auto full = epmoe::reference::full_weights::random(cfg, 21);
  const epmoe::placement::block where(cfg);
  std::vector<rank_seen> seen(2);
  epmoe::comm::threads_world world(2);
  world.run([&](epmoe::comm::threads c) {
    const int r = c.rank();
    const auto mine = epmoe::reference::slice(full, where, r);
    std::vector<float> given = bias;  // the constructor must copy it: spoiled right after
    sigmoid_bias<2> router;
    if (way == bias_way::constructor) router.bias = given.data();
    bias_layer layer(cfg, c, {{gate.data(), 8, 8}, mine.experts()}, router);
    std::fill(given.begin(), given.end(), nan_f);
    std::vector<float> pointed = bias;
    if (way == bias_way::router_bias)
      std::copy(bias.begin(), bias.end(), layer.router_bias().begin());
    if (way == bias_way::router_pointer) layer.router().bias = pointed.data();
    std::mt19937 rng(40 + r);
    rank_seen& s = seen[static_cast<std::size_t>(r)];
    s.x = normal(rng, 6 * 8, 0.6f);
    std::vector<float> y(s.x.size(), nan_f);
    layer.forward({s.x.data(), 6, 8}, {y.data(), 6, 8});
    const epmoe::routing_view got = layer.last_routing();
    for (int t = 0; t < 6; ++t)
      for (int k = 0; k < 2; ++k) {
        s.ids.push_back(got.ids(t, k));
        s.weights.push_back(got.weights(t, k));
      }
    s.router_reads_own_copy = layer.router().bias == layer.router_bias().data();
    s.bias.assign(layer.router_bias().begin(), layer.router_bias().end());
  });
  int checked = 0, moved = 0;
  for (int r = 0; r < 2; ++r) {
    const rank_seen& s = seen[static_cast<std::size_t>(r)];
    REQUIRE(s.ids.size() == 12);
    for (int t = 0; t < 6; ++t, ++checked) {
      const std::vector<float> logits(s.x.begin() + t * 8, s.x.begin() + (t + 1) * 8);
      const auto want =
          reference(logits, way == bias_way::none ? std::vector<float>{} : bias, 2, 1.0, true);
      INFO("rank " << r << " token " << t);
      for (int k = 0; k < 2; ++k) {
        CHECK(s.ids[t * 2 + k] == want.ids[k]);
        CHECK(s.weights[t * 2 + k] == Approx(want.weights[k]).margin(1e-6));
      }
      if (want.ids != reference(logits, {}, 2, 1.0, true).ids) ++moved;
    }
    // The layer reads its own copy from now on, and reports the values it routed with.
    CHECK(s.router_reads_own_copy);
    CHECK(s.bias == (way == bias_way::none ? std::vector<float>(8, 0.f) : bias));
  }
  CHECK(checked == 12);
  if (way != bias_way::none) CHECK(moved > 0);  // the bias changes some token's experts
}

}  // namespace

TEST_CASE("sigmoid_bias in a layer: every way to set the bias routes with it",
          "[router][sigmoid_bias][layer]") {
  SECTION("none") { check_layer_bias(bias_way::none); }
  SECTION("the router given to the constructor (copied)") {
    check_layer_bias(bias_way::constructor);
  }
  SECTION("layer.router_bias()") { check_layer_bias(bias_way::router_bias); }
  SECTION("layer.router().bias = values") { check_layer_bias(bias_way::router_pointer); }
}

TEST_CASE("sigmoid_bias in a layer: update_router starts from a bias just pointed at",
          "[router][sigmoid_bias][layer]") {
  const layer_config cfg{.hidden = 8, .ffn = 16, .experts = 8, .top_k = 2, .max_tokens = 6};
  const auto full = epmoe::reference::full_weights::random(cfg, 22);
  const auto mine = epmoe::reference::slice(full, epmoe::placement::block(cfg), 0);
  epmoe::moe_layer<bias_policies_local> layer(cfg, {}, {full.gate_view(), mine.experts()});
  std::mt19937 rng(3);
  const auto x = normal(rng, 6 * 8, 1.f);
  std::vector<float> y(x.size(), nan_f);
  layer.forward({x.data(), 6, 8}, {y.data(), 6, 8});
  const std::vector<float> b{1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f};
  layer.router().bias = b.data();
  const auto load = layer.update_router();
  REQUIRE(load.size() == 8);
  double mean = 0;
  for (auto n : load) mean += static_cast<double>(n) / 8;
  for (int e = 0; e < 8; ++e) {
    const double step = mean > load[e] ? 1e-3 : (mean < load[e] ? -1e-3 : 0.0);
    CHECK(layer.router_bias()[e] == Approx(b[e] + step).margin(1e-6));
  }
}

TEST_CASE("sigmoid_bias in a layer: a non-finite bias is rejected on every rank",
          "[router][sigmoid_bias][layer]") {
  const layer_config cfg{
      .hidden = 8, .ffn = 16, .experts = 8, .top_k = 2, .ranks = 2, .max_tokens = 4};
  const auto full = epmoe::reference::full_weights::random(cfg, 23);
  const epmoe::placement::block where(cfg);
  std::vector<std::string> field(2, "(no error)");
  std::vector<long> untouched(2, 0);
  epmoe::comm::threads_world world(2);
  world.run([&](epmoe::comm::threads c) {
    const int r = c.rank();
    const auto mine = epmoe::reference::slice(full, where, r);
    bias_layer layer(cfg, c, {full.gate_view(), mine.experts()});
    if (r == 1) layer.router_bias()[3] = nan_f;
    const std::vector<float> x(32, 0.5f);
    std::vector<float> y(32, 7.f);
    try {
      layer.forward({x.data(), 4, 8}, {y.data(), 4, 8});
    } catch (const epmoe::config_error& e) {
      field[static_cast<std::size_t>(r)] = e.field();
    }
    untouched[static_cast<std::size_t>(r)] = std::count(y.begin(), y.end(), 7.f);
  });
  CHECK(field[1] == "router.bias[3]");
  CHECK(field[0] == "forward inputs of rank 1");  // the peer is told, not left waiting
  CHECK(untouched == std::vector<long>{32, 32});  // no rank wrote y
}
