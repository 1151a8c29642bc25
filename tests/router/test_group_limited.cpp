// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/topk_softmax.hpp>

using epmoe::layer_config;
using epmoe::router::sigmoid_bias;
using epmoe::router::topk_softmax;

// Group-limited routing (DeepSeek): the experts form `groups` contiguous equal groups, a group
// scores the sum of its two best selection scores, only the best `top_groups` groups may be
// chosen from. Checked against a plain double implementation written here.
namespace {

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

std::vector<double> softmax(const std::vector<float>& l) {
  double m = l[0];
  for (float x : l) m = std::max(m, double{x});
  std::vector<double> p(l.size());
  double s = 0;
  for (std::size_t i = 0; i < l.size(); ++i) s += p[i] = std::exp(double{l[i]} - m);
  for (double& x : p) x /= s;
  return p;
}

// Indices of v sorted by value, descending; ties keep the lower index first.
std::vector<int> descending(const std::vector<double>& v) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  return idx;
}

// The kept groups: score = sum of the group's two best keys (its only key for one expert).
std::vector<bool> kept_groups(const std::vector<double>& key, int groups, int top_groups) {
  const int size = static_cast<int>(key.size()) / groups;
  std::vector<double> score(static_cast<std::size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    std::vector<double> mine(key.begin() + g * size, key.begin() + (g + 1) * size);
    std::sort(mine.rbegin(), mine.rend());
    score[g] = size > 1 ? mine[0] + mine[1] : mine[0];
  }
  std::vector<bool> kept(static_cast<std::size_t>(groups), false);
  const auto order = descending(score);
  for (int i = 0; i < top_groups; ++i) kept[order[i]] = true;
  return kept;
}

// Top-k of key over the experts of the kept groups.
std::vector<int> group_top(const std::vector<double>& key, int groups, int top_groups, int k) {
  const auto kept = kept_groups(key, groups, top_groups);
  const int size = static_cast<int>(key.size()) / groups;
  std::vector<int> ids;
  for (int e : descending(key))
    if (kept[e / size] && static_cast<int>(ids.size()) < k) ids.push_back(e);
  return ids;
}

struct expected {
  std::vector<int> ids;
  std::vector<double> weights;
  std::vector<bool> kept;
};

template <class Router>
struct reference;

template <int K, bool Renormalize>
struct reference<topk_softmax<K, Renormalize>> {
  static expected of(const topk_softmax<K, Renormalize>& r, const std::vector<float>& logits,
                     const std::vector<float>&) {
    const auto p = softmax(logits);
    expected x{group_top(p, r.groups, r.top_groups, K), {}, kept_groups(p, r.groups, r.top_groups)};
    double chosen = 0;
    for (int id : x.ids) chosen += p[id];
    for (int id : x.ids) x.weights.push_back(p[id] / (Renormalize ? chosen : 1.0));
    return x;
  }
};

template <int K>
struct reference<sigmoid_bias<K>> {
  static expected of(const sigmoid_bias<K>& r, const std::vector<float>& logits,
                     const std::vector<float>& bias) {
    std::vector<double> key(logits.size());
    for (std::size_t e = 0; e < key.size(); ++e)
      key[e] = sig(logits[e]) + (r.bias ? double{bias[e]} : 0.0);
    expected x{
        group_top(key, r.groups, r.top_groups, K), {}, kept_groups(key, r.groups, r.top_groups)};
    double s = 0;
    for (int id : x.ids) s += sig(logits[id]);
    for (int id : x.ids) x.weights.push_back(r.scaling * sig(logits[id]) / (r.normalize ? s : 1));
    return x;
  }
};

template <class Router>
struct routed {
  std::vector<int> ids = std::vector<int>(Router::top_k, -7);
  std::vector<float> weights = std::vector<float>(Router::top_k, -7.f);
};

template <class Router>
routed<Router> route(const Router& r, const std::vector<float>& logits) {
  routed<Router> out;
  r.route_token({logits.data(), nullptr, static_cast<int>(logits.size())}, out.ids.data(),
                out.weights.data());
  return out;
}

std::vector<float> normal(std::mt19937& rng, int n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

layer_config config(int experts, int top_k) {
  layer_config c;
  c.hidden = 8;
  c.ffn = 16;
  c.experts = experts;
  c.top_k = top_k;
  c.max_tokens = 16;
  return c;
}

template <class Router>
void require_rejected(const Router& r, const layer_config& cfg, const std::string& field) {
  try {
    r.validate(cfg);
    FAIL("validate() accepted a router whose " << field << " is bad");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == field);
  }
}

// Checks `trials` random tokens of random (E, groups, top_groups) against the reference.
template <class Router>
void check_random(unsigned seed, int trials, bool with_bias) {
  constexpr int K = Router::top_k;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> b(-0.2f, 0.2f);
  const int group_counts[] = {2, 3, 4, 8};
  for (int trial = 0; trial < trials; ++trial) {
    const int groups = group_counts[rng() % 4];
    const int size = 1 + static_cast<int>(rng() % 5);
    const int E = groups * size;
    if (E < K) continue;
    const int min_groups = (K + size - 1) / size;  // kept groups must hold K experts
    const int top_groups = min_groups + static_cast<int>(rng() % (groups - min_groups + 1));
    Router r;
    r.groups = groups;
    r.top_groups = top_groups;
    REQUIRE_NOTHROW(r.validate(config(E, K)));
    const auto logits = normal(rng, E, 1.5f);
    std::vector<float> bias(static_cast<std::size_t>(E));
    for (float& x : bias) x = b(rng);
    if constexpr (requires { r.bias; })
      if (with_bias) r.bias = bias.data();
    const auto got = route(r, logits);
    const auto want = reference<Router>::of(r, logits, bias);
    INFO("E = " << E << ", groups = " << groups << ", top_groups = " << top_groups);
    for (int id : got.ids) {
      REQUIRE((id >= 0 && id < E));
      REQUIRE(want.kept[id / size]);  // never outside the kept groups
    }
    REQUIRE(std::set<int>(got.ids.begin(), got.ids.end()).size() == static_cast<std::size_t>(K));
    REQUIRE(got.ids == want.ids);
    for (int k = 0; k < K; ++k) REQUIRE(got.weights[k] == Approx(want.weights[k]).margin(1e-6));
  }
}

}  // namespace

using grouped_routers =
    std::tuple<topk_softmax<1>, topk_softmax<2>, topk_softmax<4>, topk_softmax<2, false>,
               topk_softmax<4, false>, sigmoid_bias<1>, sigmoid_bias<2>, sigmoid_bias<4>>;

TEMPLATE_LIST_TEST_CASE(
    "group-limited: matches an independent implementation, never leaves the "
    "kept groups",
    "[router][groups]", grouped_routers) {
  check_random<TestType>(301 + TestType::top_k, 400, false);
  if constexpr (requires(TestType r) { r.bias; }) check_random<TestType>(401, 400, true);
}

TEST_CASE("group-limited: DeepSeek-V3 shape (E 256, 8 groups, top-4 groups, top-8)",
          "[router][groups]") {
  constexpr int E = 256, G = 8, TG = 4, K = 8;
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> b(-0.05f, 0.05f);
  SECTION("sigmoid_bias, scaling 2.5, with a bias") {
    std::vector<float> bias(E);
    for (float& x : bias) x = b(rng);
    sigmoid_bias<K> r;
    r.groups = G;
    r.top_groups = TG;
    r.scaling = 2.5f;
    r.bias = bias.data();
    REQUIRE_NOTHROW(r.validate(config(E, K)));
    for (int t = 0; t < 200; ++t) {
      const auto logits = normal(rng, E, 1.f);
      const auto got = route(r, logits);
      const auto want = reference<sigmoid_bias<K>>::of(r, logits, bias);
      REQUIRE(got.ids == want.ids);
      for (int k = 0; k < K; ++k) REQUIRE(got.weights[k] == Approx(want.weights[k]).margin(1e-6));
      std::set<int> groups;
      for (int id : got.ids) groups.insert(id / (E / G));
      REQUIRE(groups.size() <= static_cast<std::size_t>(TG));
    }
  }
  SECTION("topk_softmax") {
    topk_softmax<K> r;
    r.groups = G;
    r.top_groups = TG;
    REQUIRE_NOTHROW(r.validate(config(E, K)));
    for (int t = 0; t < 200; ++t) {
      const auto logits = normal(rng, E, 2.f);
      const auto got = route(r, logits);
      const auto want = reference<topk_softmax<K>>::of(r, logits, {});
      REQUIRE(got.ids == want.ids);
      for (int k = 0; k < K; ++k) REQUIRE(got.weights[k] == Approx(want.weights[k]).margin(1e-6));
    }
  }
}

TEST_CASE("group-limited: the best expert is skipped when its group's top-2 sum loses",
          "[router][groups]") {
  // 4 groups of 2. Group 0 holds the single best logit (5) next to a poor one; group 1's two
  // good logits make the larger pair sum, so with one kept group expert 0 is out.
  SECTION("topk_softmax: probabilities e^5 + e^-5 = 148.4 < 2 e^4.5 = 180.0") {
    const std::vector<float> logits{5.f, -5.f, 4.5f, 4.5f, 0.f, 0.f, -1.f, 1.f};
    topk_softmax<1> r;
    r.groups = 4;
    r.top_groups = 1;
    CHECK(route(r, logits).ids == std::vector<int>{2});
    r.top_groups = 2;  // group 0 is second best (148.4 vs 2 and 3.1): expert 0 is back
    CHECK(route(r, logits).ids == std::vector<int>{0});
    topk_softmax<2> two;
    two.groups = 4;
    two.top_groups = 1;
    const auto got = route(two, logits);
    CHECK(got.ids == std::vector<int>{2, 3});
    CHECK(got.weights[0] == Approx(0.5).margin(1e-6));
  }
  SECTION("sigmoid_bias: sigmoid sums 1.0 < 2 sigmoid(3) = 1.905") {
    const std::vector<float> logits{5.f, -5.f, 3.f, 3.f, 0.f, 0.f, -1.f, 1.f};
    sigmoid_bias<1> r;
    r.groups = 4;
    r.top_groups = 1;
    CHECK(route(r, logits).ids == std::vector<int>{2});
    // A bias can bring group 0 back: +1 on expert 1 makes its pair sum 2.0.
    const std::vector<float> bias{0.f, 1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    r.bias = bias.data();
    const auto got = route(r, logits);
    CHECK(got.ids == std::vector<int>{1});  // 0.0067 + 1 beats sigmoid(5) = 0.9933
    r.normalize = false;
    CHECK(route(r, logits).weights[0] == Approx(sig(-5)).margin(1e-7));
  }
}

TEST_CASE("group-limited: ties go to the lower group, then the lower expert",
          "[router][groups][ties]") {
  const std::vector<float> flat(8, 0.5f);
  topk_softmax<2> s;
  s.groups = 4;
  s.top_groups = 2;
  CHECK(route(s, flat).ids == std::vector<int>{0, 1});
  sigmoid_bias<3> b;
  b.groups = 4;
  b.top_groups = 2;
  CHECK(route(b, flat).ids == std::vector<int>{0, 1, 2});
  // Equal pair sums in groups 1 and 3 (1+0 and 0+1), group 0 and 2 lower: groups 1 and 3 kept.
  const std::vector<float> pairs{0.f, -1.f, 1.f, 0.f, -1.f, 0.f, 0.f, 1.f};
  topk_softmax<1> one;
  one.groups = 4;
  one.top_groups = 1;
  CHECK(route(one, pairs).ids == std::vector<int>{2});  // group 1 before group 3
  topk_softmax<2> two;
  two.groups = 4;
  two.top_groups = 2;
  CHECK(route(two, pairs).ids == std::vector<int>{2, 7});
}

TEST_CASE("group-limited: one expert per group scores by that expert alone", "[router][groups]") {
  // groups == E: each group holds one expert, so top_groups >= K is plain top-K.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    const auto logits = normal(rng, 8, 1.f);
    topk_softmax<2> g;
    g.groups = 8;
    g.top_groups = 2;
    REQUIRE(route(g, logits).ids == route(topk_softmax<2>{}, logits).ids);
    sigmoid_bias<2> s;
    s.groups = 8;
    s.top_groups = 3;
    REQUIRE(route(s, logits).ids == route(sigmoid_bias<2>{}, logits).ids);
  }
}

TEST_CASE("group-limited: keeping every group is plain top-K", "[router][groups]") {
  std::mt19937 rng(6);
  for (int trial = 0; trial < 100; ++trial) {
    const auto logits = normal(rng, 16, 2.f);
    topk_softmax<4> g;
    g.groups = 4;
    g.top_groups = 4;
    const auto a = route(g, logits), p = route(topk_softmax<4>{}, logits);
    REQUIRE(a.ids == p.ids);
    for (int k = 0; k < 4; ++k) REQUIRE(a.weights[k] == Approx(p.weights[k]).margin(1e-6));
    sigmoid_bias<4> s;
    s.groups = 4;
    s.top_groups = 4;
    REQUIRE(route(s, logits).ids == route(sigmoid_bias<4>{}, logits).ids);
  }
}

TEST_CASE("group-limited: topk_softmax validate names the bad field",
          "[router][groups][validate]") {
  const layer_config cfg = config(16, 4);
  CHECK_NOTHROW(topk_softmax<4>{}.validate(cfg));
  topk_softmax<4> r;
  r.groups = 3;  // does not divide 16
  require_rejected(r, cfg, "router.groups");
  r.groups = 0;
  require_rejected(r, cfg, "router.groups");
  r.groups = 65;
  require_rejected(r, cfg, "router.groups");
  r.groups = 4;
  r.top_groups = 0;
  require_rejected(r, cfg, "router.top_groups");
  r.top_groups = 5;
  require_rejected(r, cfg, "router.top_groups");
  r.groups = 16;
  r.top_groups = 3;  // 3 kept groups of one expert cannot hold 4
  require_rejected(r, cfg, "router.top_groups");
  r.top_groups = 4;
  CHECK_NOTHROW(r.validate(cfg));
}

TEST_CASE("group-limited: topk_softmax ranks by probability even where it underflows in float",
          "[router][groups]") {
  // Exact probabilities (and logits) order these experts; float exp(l - max) flushes them to 0
  // or rounds them equal. Plain top-K (groups == 1) ranks on the logits and gets them right;
  // group-limited routing must agree with it and with the double reference.
  SECTION("every group kept: the same ids as plain top-K") {
    topk_softmax<2> all;
    all.groups = 2;
    all.top_groups = 2;
    for (const std::vector<float>& logits : {std::vector<float>{0.f, -300.f, -150.f, -400.f},
                                             std::vector<float>{5.f, 0.f, 1e-6f, -1.f}}) {
      const auto want = reference<topk_softmax<2>>::of(all, logits, {});
      CHECK(route(topk_softmax<2>{}, logits).ids == want.ids);  // plain top-K: right
      CHECK(route(all, logits).ids == want.ids);
    }
  }
  SECTION("the kept groups follow the exact probability sums") {
    // Group 2 (-150, -150) is far likelier than group 1 (-200, -200); both sums are 0 in float.
    const std::vector<float> logits{0.f, -1.f, -200.f, -200.f, -150.f, -150.f};
    topk_softmax<3> r;
    r.groups = 3;
    r.top_groups = 2;
    const auto want = reference<topk_softmax<3>>::of(r, logits, {});
    REQUIRE(want.ids == std::vector<int>{0, 1, 4});
    CHECK(route(r, logits).ids == want.ids);
  }
}
