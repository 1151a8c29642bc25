// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/topk_softmax.hpp>

// Issue 19's router variants: DBRX's p-norm renormalisation of the top-K weights, and the two
// conventions for the experts of dropped groups (DeepSeek's -inf, Hugging Face's 0.0).
using epmoe::layer_config;
using epmoe::token_input;
using epmoe::router::group_mask_mode;
using epmoe::router::sigmoid_bias;
using epmoe::router::topk_softmax;

namespace {

struct routed {
  std::vector<int> ids;
  std::vector<float> weights;
};

template <class Router>
routed route(const Router& r, const std::vector<float>& logits) {
  routed out{std::vector<int>(Router::top_k, -7),
             std::vector<float>(Router::top_k, std::numeric_limits<float>::quiet_NaN())};
  r.route_token(token_input{logits.data(), nullptr, static_cast<int>(logits.size())},
                out.ids.data(), out.weights.data());
  return out;
}

std::vector<float> normal(std::mt19937& rng, int n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

// Indices by descending key, ties to the lower index, the first k.
std::vector<int> best(const std::vector<double>& key, int k) {
  std::vector<int> idx(key.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key[a] > key[b]; });
  idx.resize(static_cast<std::size_t>(k));
  return idx;
}

// The experts of the kept groups (group score: the sum of its two best keys).
std::vector<bool> kept_experts(const std::vector<double>& key, int groups, int top_groups) {
  const int E = static_cast<int>(key.size()), size = E / groups;
  std::vector<double> score(static_cast<std::size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    std::vector<double> in(key.begin() + g * size, key.begin() + (g + 1) * size);
    std::sort(in.rbegin(), in.rend());
    score[g] = in[0] + in[1];
  }
  std::vector<bool> kept(static_cast<std::size_t>(E), false);
  for (int g : best(score, top_groups))
    for (int e = g * size; e < (g + 1) * size; ++e) kept[e] = true;
  return kept;
}

// DeepSeek-V3's selection in double: keys s + b, the dropped groups' experts at -inf (its own
// code) or at 0.0 (transformers' masked_fill), then the K best; weights s / sum(s).
routed deepseek_v3(const std::vector<float>& l, const std::vector<float>& b, int K, int groups,
                   int top_groups, bool zero) {
  const int E = static_cast<int>(l.size());
  std::vector<double> s(static_cast<std::size_t>(E)), key(s.size());
  for (int e = 0; e < E; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-double{l[e]}));
    key[e] = s[e] + b[e];
  }
  const auto kept = kept_experts(key, groups, top_groups);
  for (int e = 0; e < E; ++e)
    if (!kept[e]) key[e] = zero ? 0.0 : -std::numeric_limits<double>::infinity();
  routed out{best(key, K), {}};
  double sum = 0;
  for (int e : out.ids) sum += s[e];
  for (int e : out.ids) out.weights.push_back(static_cast<float>(s[e] / sum));
  return out;
}

}  // namespace

// ---------------------------------------------------------------- p-norm (DBRX)

TEST_CASE("p-norm: dbrx<K> is topk_softmax<K, true> with norm_p, Mixtral at p = 1",
          "[router][pnorm]") {
  using namespace epmoe::router;
  STATIC_REQUIRE(std::is_same_v<dbrx<4>, topk_softmax<4, true>>);
  STATIC_REQUIRE(std::is_same_v<mixtral<2>, topk_softmax<2, true>>);
  STATIC_REQUIRE(epmoe::router_policy<dbrx<4>>);
  CHECK(dbrx<4>{}.norm_p == 1.f);
  CHECK(mixtral<8>{}.norm_p == 1.f);
  std::mt19937 rng(1);
  for (int trial = 0; trial < 100; ++trial) {
    const auto l = normal(rng, 16, 2.f);
    const auto d = route(dbrx<4>{.norm_p = 1.f}, l), m = route(mixtral<4>{}, l);
    REQUIRE(d.ids == m.ids);
    REQUIRE(d.weights == m.weights);  // the same code at p = 1: bit for bit
  }
}

TEST_CASE("p-norm: a hand-worked token", "[router][pnorm]") {
  // softmax(1, 3, 2, 0): the two chosen are p ∝ (e^3, e^2), i.e. r = (1, 1/e).
  const std::vector<float> logits{1.f, 3.f, 2.f, 0.f};
  const double r1 = std::exp(-1.0);
  SECTION("p = 2: r / sqrt(1 + e^-2) = 0.9385, 0.3453") {
    const auto r = route(topk_softmax<2>{.norm_p = 2.f}, logits);
    CHECK(r.ids == std::vector<int>{1, 2});
    const double n = std::sqrt(1 + r1 * r1);
    CHECK(r.weights[0] == Approx(1 / n).epsilon(1e-6));
    CHECK(r.weights[1] == Approx(r1 / n).epsilon(1e-6));
    CHECK(r.weights[0] == Approx(0.93851).epsilon(1e-4));
    CHECK(r.weights[1] == Approx(0.34526).epsilon(1e-4));
  }
  SECTION("p = 0.5: r / (1 + e^-1/2)^2") {
    const auto r = route(topk_softmax<2>{.norm_p = 0.5f}, logits);
    const double n = std::pow(1 + std::sqrt(r1), 2.0);
    CHECK(r.weights[0] == Approx(1 / n).epsilon(1e-6));
    CHECK(r.weights[1] == Approx(r1 / n).epsilon(1e-6));
  }
  SECTION("p = 1: the sum, e / (1 + e) and 1 / (1 + e)") {
    const auto r = route(topk_softmax<2>{.norm_p = 1.f}, logits);
    CHECK(r.weights[0] == Approx(1 / (1 + r1)).epsilon(1e-6));
    CHECK(r.weights[1] == Approx(r1 / (1 + r1)).epsilon(1e-6));
  }
}

TEST_CASE("p-norm: the weights are the softmax at the chosen ids over their p-norm (random)",
          "[router][pnorm]") {
  std::mt19937 rng(2);
  int checked = 0;
  for (float p : {0.5f, 1.5f, 2.f, 3.f, 8.f}) {
    for (int trial = 0; trial < 100; ++trial) {
      const int E = 4 + static_cast<int>(rng() % 28);
      const auto l = normal(rng, E, 2.f);
      const auto r = route(topk_softmax<4>{.norm_p = p}, l);
      const double m = *std::max_element(l.begin(), l.end());
      double denom = 0;
      for (float v : l) denom += std::exp(v - m);
      double norm = 0;
      for (int e : r.ids) norm += std::pow(std::exp(l[e] - m) / denom, double{p});
      norm = std::pow(norm, 1.0 / p);
      double pnorm_of_weights = 0;
      for (int k = 0; k < 4; ++k) {
        REQUIRE(r.weights[k] == Approx(std::exp(l[r.ids[k]] - m) / denom / norm).epsilon(1e-5));
        pnorm_of_weights += std::pow(double{r.weights[k]}, double{p});
      }
      REQUIRE(std::pow(pnorm_of_weights, 1.0 / p) == Approx(1.0).epsilon(1e-5));
      ++checked;
    }
  }
  CHECK(checked == 500);
}

TEST_CASE("p-norm: large p and far-apart logits stay finite", "[router][pnorm]") {
  // w_k^p would underflow in float (0.01^100); the ratios to the best do not.
  const std::vector<float> logits{0.f, -4.f, -90.f, -5.f, 10.f, -200.f};
  const auto r = route(topk_softmax<4>{.norm_p = 100.f}, logits);
  CHECK(r.ids == std::vector<int>{4, 0, 1, 3});
  for (float w : r.weights) CHECK(std::isfinite(w));
  CHECK(r.weights[0] == Approx(1.0).epsilon(1e-6));  // the largest r = 1 dominates the norm
  CHECK(r.weights[1] == Approx(std::exp(-10.0)).epsilon(1e-4));
}

TEST_CASE("p-norm: norm_p is checked", "[router][pnorm][errors]") {
  const layer_config cfg{.experts = 8, .top_k = 2};
  CHECK_NOTHROW(topk_softmax<2>{.norm_p = 2.f}.validate(cfg));
  CHECK_NOTHROW(topk_softmax<2, false>{}.validate(cfg));
  for (float bad : {0.f, -1.f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH(topk_softmax<2>{.norm_p = bad}.validate(cfg),
                      Catch::Contains("router.norm_p") && Catch::Contains("finite and > 0"));
  }
  // Without renormalisation a p would be silently ignored: rejected.
  using plain = topk_softmax<2, false>;
  CHECK_THROWS_WITH(plain{.norm_p = 2.f}.validate(cfg),
                    Catch::Contains("router.norm_p") && Catch::Contains("without renormalisation"));
}

// ---------------------------------------------------------------- group masks

TEST_CASE("group masks: where the conventions differ, a hand-worked token",
          "[router][group_mask]") {
  // E = 4 in 2 groups of 2, keep 1 group, K = 2. s = sigmoid(l) = (3/4, 1/2, 1/4, 1/2);
  // b = (-1/4, -3/4, -1/4, -3/4): keys s + b = (1/2, -1/4, 0, -1/4); group 0 scores 1/4,
  // group 1 -1/4: group 0 is kept, and its second expert's key is negative.
  const std::vector<float> l{std::log(3.f), 0.f, -std::log(3.f), 0.f};
  const std::vector<float> b{-0.25f, -0.75f, -0.25f, -0.75f};
  sigmoid_bias<2> r{.groups = 2, .top_groups = 1, .bias = b.data()};
  SECTION("minus_inf (DeepSeek): only group 0; weights 3/4 / (5/4), 1/2 / (5/4)") {
    const auto got = route(r, l);
    CHECK(got.ids == std::vector<int>{0, 1});
    CHECK(got.weights[0] == Approx(0.6).epsilon(1e-6));
    CHECK(got.weights[1] == Approx(0.4).epsilon(1e-6));
  }
  SECTION("zero (Hugging Face): dropped expert 2 scores 0 > -1/4; weights 3/4, 1/4") {
    r.group_mask = group_mask_mode::zero;
    const auto got = route(r, l);
    CHECK(got.ids == std::vector<int>{0, 2});  // 2 and 3 tie at 0: the lower id
    CHECK(got.weights[0] == Approx(0.75).epsilon(1e-6));
    CHECK(got.weights[1] == Approx(0.25).epsilon(1e-6));
  }
  SECTION("zero: every kept key negative, both experts from the dropped group") {
    const std::vector<float> low{-1.f, -1.f, -1.f, -1.f};
    r.bias = low.data();
    r.group_mask = group_mask_mode::zero;
    CHECK(route(r, l).ids == std::vector<int>{2, 3});
    r.group_mask = group_mask_mode::minus_inf;
    CHECK(route(r, l).ids == std::vector<int>{0, 1});
  }
}

TEST_CASE("group masks: where the conventions agree (no negative key), a hand-worked token",
          "[router][group_mask]") {
  // Same logits, no bias: keys s = (3/4, 1/2, 1/4, 1/2) > 0, so a 0.0 never wins.
  const std::vector<float> l{std::log(3.f), 0.f, -std::log(3.f), 0.f};
  for (auto mode : {group_mask_mode::minus_inf, group_mask_mode::zero}) {
    const auto got =
        route(sigmoid_bias<2>{.groups = 2, .top_groups = 1, .scaling = 2.f, .group_mask = mode}, l);
    CHECK(got.ids == std::vector<int>{0, 1});
    CHECK(got.weights[0] == Approx(2 * 0.6).epsilon(1e-6));
    CHECK(got.weights[1] == Approx(2 * 0.4).epsilon(1e-6));
  }
}

TEST_CASE("group masks: both conventions against DeepSeek-V3 written in double (random)",
          "[router][group_mask]") {
  std::mt19937 rng(19);
  std::uniform_real_distribution<float> bias(-1.f, 0.25f);
  int differ = 0, agree_checked = 0, trials = 0;
  for (int trial = 0; trial < 400; ++trial, ++trials) {
    const int groups = 2 + static_cast<int>(rng() % 3);  // 2..4 groups of 4
    const int E = 4 * groups, top_groups = 1 + static_cast<int>(rng() % (groups - 1));
    const auto l = normal(rng, E, 2.f);
    std::vector<float> b(static_cast<std::size_t>(E));
    for (float& x : b) x = bias(rng);
    sigmoid_bias<4> r{.groups = groups, .top_groups = top_groups, .bias = b.data()};
    const auto minus_inf = route(r, l);
    r.group_mask = group_mask_mode::zero;
    const auto zero = route(r, l);
    const auto want_minus_inf = deepseek_v3(l, b, 4, groups, top_groups, false);
    const auto want_zero = deepseek_v3(l, b, 4, groups, top_groups, true);
    REQUIRE(minus_inf.ids == want_minus_inf.ids);
    REQUIRE(zero.ids == want_zero.ids);
    for (int k = 0; k < 4; ++k) {
      REQUIRE(minus_inf.weights[k] == Approx(want_minus_inf.weights[k]).epsilon(1e-5));
      REQUIRE(zero.weights[k] == Approx(want_zero.weights[k]).epsilon(1e-5));
    }
    differ += minus_inf.ids != zero.ids;
    // Without the negative biases every key is s > 0: the two agree.
    std::fill(b.begin(), b.end(), 0.f);
    const auto z0 = route(r, l);
    r.group_mask = group_mask_mode::minus_inf;
    const auto m0 = route(r, l);
    REQUIRE(z0.ids == m0.ids);
    REQUIRE(z0.weights == m0.weights);
    ++agree_checked;
  }
  REQUIRE(trials == 400);
  CHECK(agree_checked == 400);
  CHECK(differ > 40);  // negative keys in kept groups happen often with these biases
}

TEST_CASE("group masks: softmax groups (Hugging Face's 0.0-filled probabilities) choose as -inf",
          "[router][group_mask]") {
  // DeepSeek-V2's group_limited_greedy fills dropped probabilities with 0.0; a kept
  // probability is > 0, so topk_softmax's groups need no second convention.
  std::mt19937 rng(7);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto l = normal(rng, 16, 3.f);
    const auto got = route(topk_softmax<4>{.groups = 4, .top_groups = 2}, l);
    std::vector<double> p(16);
    const double m = *std::max_element(l.begin(), l.end());
    for (int e = 0; e < 16; ++e) p[e] = std::exp(l[e] - m);
    const auto kept = kept_experts(p, 4, 2);
    for (int e = 0; e < 16; ++e)
      if (!kept[e]) p[e] = 0.0;
    REQUIRE(got.ids == best(p, 4));
    ++checked;
  }
  CHECK(checked == 300);
}

TEST_CASE("group masks: group_mask is checked", "[router][group_mask][errors]") {
  const layer_config cfg{.experts = 8, .top_k = 2};
  sigmoid_bias<2> r{.groups = 2, .top_groups = 1};
  CHECK_NOTHROW(r.validate(cfg));
  r.group_mask = group_mask_mode::zero;
  CHECK_NOTHROW(r.validate(cfg));
  r.group_mask = static_cast<group_mask_mode>(7);
  CHECK_THROWS_WITH(r.validate(cfg), Catch::Contains("router.group_mask"));
}

TEST_CASE("DeepSeek-V2: a group scored by its max p, weights times routed scaling",
          "[router][deepseek_v2]") {
  // Groups {0, 1} and {2, 3}: logits (2, -5 | 1.5, 1.5). Max p: group 0 (e^2 > e^1.5); sum of
  // the two best: group 1 (2 e^1.5 = 8.96 > e^2 + e^-5 = 7.40).
  const std::vector<float> logits{2.f, -5.f, 1.5f, 1.5f};
  const double denom = std::exp(2.0) + std::exp(-5.0) + 2 * std::exp(1.5);
  using epmoe::router::deepseek_v2;
  using epmoe::router::group_score;
  const auto v2 = route(
      deepseek_v2<1>{.groups = 2, .top_groups = 1, .scaling = 16.f, .group_by = group_score::max},
      logits);
  CHECK(v2.ids == std::vector<int>{0});
  CHECK(v2.weights[0] == Approx(16 * std::exp(2.0) / denom).epsilon(1e-6));  // 7.227
  CHECK(v2.weights[0] == Approx(7.2272).epsilon(1e-4));
  const auto v3 = route(deepseek_v2<1>{.groups = 2, .top_groups = 1, .scaling = 16.f}, logits);
  CHECK(v3.ids == std::vector<int>{2});
  CHECK(v3.weights[0] == Approx(16 * std::exp(1.5) / denom).epsilon(1e-6));
  // Scaling after renormalisation: Mixtral's weights times 2.
  const auto m = route(topk_softmax<2>{.scaling = 2.f}, logits);
  CHECK(m.weights[0] + m.weights[1] == Approx(2.0).epsilon(1e-6));
}

TEST_CASE("DeepSeek-V2: scaling and group_by are checked", "[router][deepseek_v2][errors]") {
  const layer_config cfg{.hidden = 4, .ffn = 4, .experts = 4, .top_k = 1, .max_tokens = 1};
  const auto field = [&](const auto& r) -> std::string {
    try {
      r.validate(cfg);
    } catch (const epmoe::config_error& e) {
      return e.field();
    }
    return "<valid>";
  };
  CHECK(field(epmoe::router::deepseek_v2<1>{.scaling = 0.f}) == "router.scaling");
  CHECK(field(epmoe::router::deepseek_v2<1>{.scaling = NAN}) == "router.scaling");
  CHECK(field(epmoe::router::deepseek_v2<1>{
            .group_by = static_cast<epmoe::router::group_score>(7)}) == "router.group_by");
  CHECK(field(epmoe::router::deepseek_v2<1>{.scaling = 16.f}) == "<valid>");
}
