// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <type_traits>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/router/topk_softmax.hpp>

using epmoe::router::topk_softmax;

namespace {

struct routed {
  std::vector<int> ids;
  std::vector<float> weights;
};

template <class Router>
routed route(const std::vector<float>& logits) {
  routed r{std::vector<int>(Router::top_k), std::vector<float>(Router::top_k)};
  const epmoe::token_input in{logits.data(), nullptr, static_cast<int>(logits.size())};
  Router{}.route_token(in, r.ids.data(), r.weights.data());
  return r;
}

// Full softmax in double.
std::vector<double> softmax(const std::vector<float>& logits) {
  const double m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp(double{logits[i]} - m);
  for (double& x : p) x /= sum;
  return p;
}

// Indices of the K largest logits, ties to the lower index.
std::vector<int> largest(const std::vector<float>& v, int k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(static_cast<std::size_t>(k));
  return idx;
}

std::vector<float> random_logits(std::mt19937& rng, int n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

double sum(const std::vector<float>& w) { return std::accumulate(w.begin(), w.end(), 0.0); }

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

template <class Router>
struct renormalises;
template <int K, bool Renormalize>
struct renormalises<topk_softmax<K, Renormalize>> : std::bool_constant<Renormalize> {};

}  // namespace

using renormalised = std::tuple<topk_softmax<1>, topk_softmax<2>, topk_softmax<4>, topk_softmax<8>>;
using plain = std::tuple<topk_softmax<1, false>, topk_softmax<2, false>, topk_softmax<4, false>>;
using all_routers =
    std::tuple<topk_softmax<1>, topk_softmax<2>, topk_softmax<4>, topk_softmax<1, false>,
               topk_softmax<2, false>, topk_softmax<4, false>>;

TEMPLATE_LIST_TEST_CASE("topk_softmax: satisfies router_policy", "[router]", all_routers) {
  STATIC_REQUIRE(epmoe::router_policy<TestType>);
  STATIC_REQUIRE(TestType::uses_gate);
  STATIC_REQUIRE(TestType::top_k >= 1);
}

TEMPLATE_LIST_TEST_CASE("topk_softmax: ids are the K largest logits, distinct, best first",
                        "[router]", all_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(11 + K);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = K + static_cast<int>(rng() % 20);
    const auto logits = random_logits(rng, E, 2.f);
    const auto r = route<TestType>(logits);
    REQUIRE(r.ids == largest(logits, K));
    REQUIRE(std::set<int>(r.ids.begin(), r.ids.end()).size() == static_cast<std::size_t>(K));
    for (int k = 1; k < K; ++k) REQUIRE(r.weights[k - 1] >= r.weights[k]);
  }
}

TEMPLATE_LIST_TEST_CASE("topk_softmax: renormalised weights sum to 1", "[router]", renormalised) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(21 + K);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = K + static_cast<int>(rng() % 24);
    const auto r = route<TestType>(random_logits(rng, E, 3.f));
    REQUIRE(sum(r.weights) == Approx(1.0).margin(1e-6));
    for (float w : r.weights) REQUIRE((w > 0.f && w <= 1.f));
  }
}

TEMPLATE_LIST_TEST_CASE(
    "topk_softmax: renormalised weights equal a softmax over the K chosen logits (Mixtral)",
    "[router]", renormalised) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(31 + K);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = K + static_cast<int>(rng() % 24);
    const auto logits = random_logits(rng, E, 2.f);
    const auto r = route<TestType>(logits);
    std::vector<float> chosen;
    for (int id : r.ids) chosen.push_back(logits[id]);
    const auto want = softmax(chosen);
    for (int k = 0; k < K; ++k) REQUIRE(r.weights[k] == Approx(want[k]).margin(1e-6));
  }
}

TEMPLATE_LIST_TEST_CASE(
    "topk_softmax: without renormalisation the weights are full-softmax probabilities", "[router]",
    plain) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(41 + K);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = K + 1 + static_cast<int>(rng() % 24);  // E > K
    const auto logits = random_logits(rng, E, 1.f);
    const auto r = route<TestType>(logits);
    const auto p = softmax(logits);
    for (int k = 0; k < K; ++k) REQUIRE(r.weights[k] == Approx(p[r.ids[k]]).margin(1e-6));
    REQUIRE(sum(r.weights) < 1.0 - 1e-6);  // the other experts keep some probability
  }
}

TEMPLATE_LIST_TEST_CASE("topk_softmax: stable for logits around +-1e4", "[router]", all_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(51 + K);
  std::uniform_real_distribution<float> big(-1e4f, 1e4f);
  for (int trial = 0; trial < 100; ++trial) {
    const int E = K + static_cast<int>(rng() % 16);
    std::vector<float> logits(static_cast<std::size_t>(E));
    for (float& x : logits) x = big(rng);
    if (trial % 2) std::fill(logits.begin(), logits.end(), 1e4f);  // all tied, at the top
    const auto r = route<TestType>(logits);
    REQUIRE(r.ids == largest(logits, K));
    for (float w : r.weights) REQUIRE(std::isfinite(w));
    const auto p = softmax(logits);
    double chosen = 0;
    for (int id : r.ids) chosen += p[id];
    const double scale = renormalises<TestType>::value ? chosen : 1.0;
    for (int k = 0; k < K; ++k) REQUIRE(r.weights[k] * scale == Approx(p[r.ids[k]]).margin(1e-6));
    REQUIRE(r.weights[0] > 0.f);  // the best expert always has weight
  }
  // Shifted by a huge constant, the weights do not change.
  std::vector<float> small{0.5f, -1.f, 2.f, 0.f, 1.f, -3.f, 0.25f, 1.5f};
  small.resize(static_cast<std::size_t>(std::max(K, 8)), 0.f);
  std::vector<float> shifted = small;
  for (float& x : shifted) x += 1e4f;
  const auto a = route<TestType>(small), b = route<TestType>(shifted);
  CHECK(a.ids == b.ids);
  for (int k = 0; k < K; ++k) CHECK(a.weights[k] == Approx(b.weights[k]).margin(1e-3));
}

TEMPLATE_LIST_TEST_CASE("topk_softmax: K == E selects every expert", "[router]", all_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(61 + K);
  const auto logits = random_logits(rng, K, 1.f);
  const auto r = route<TestType>(logits);
  std::vector<int> sorted = r.ids;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> all(K);
  std::iota(all.begin(), all.end(), 0);
  CHECK(sorted == all);
  // Every expert chosen: renormalised or not, it is the full softmax.
  CHECK(sum(r.weights) == Approx(1.0).margin(1e-6));
  const auto p = softmax(logits);
  for (int k = 0; k < K; ++k) CHECK(r.weights[k] == Approx(p[r.ids[k]]).margin(1e-6));
}

TEMPLATE_LIST_TEST_CASE("topk_softmax: NaN logits do not crash and ids stay valid", "[router][nan]",
                        all_routers) {
  constexpr int K = TestType::top_k;
  const int E = K + 4;
  SECTION("some NaN: the numbers are chosen") {
    std::vector<float> logits(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) logits[e] = (e % 2) ? nan_f : float(e);
    const auto r = route<TestType>(logits);
    std::set<int> distinct(r.ids.begin(), r.ids.end());
    CHECK(distinct.size() == static_cast<std::size_t>(K));
    const int numbers = (E + 1) / 2;
    for (int k = 0; k < std::min(K, numbers); ++k) {
      CHECK((r.ids[k] >= 0 && r.ids[k] < E));
      CHECK(!std::isnan(logits[r.ids[k]]));
    }
  }
  SECTION("all NaN: K distinct ids in range") {
    const std::vector<float> logits(static_cast<std::size_t>(E), nan_f);
    const auto r = route<TestType>(logits);
    std::set<int> distinct(r.ids.begin(), r.ids.end());
    CHECK(distinct.size() == static_cast<std::size_t>(K));
    for (int id : r.ids) CHECK((id >= 0 && id < E));
  }
}

// ---------------------------------------------------------------- named configurations

TEST_CASE("topk_softmax: the named aliases are the documented configurations",
          "[router][aliases]") {
  using namespace epmoe::router;
  STATIC_REQUIRE(std::is_same_v<mixtral<2>, topk_softmax<2, true>>);
  STATIC_REQUIRE(std::is_same_v<mixtral<8>, topk_softmax<8, true>>);
  STATIC_REQUIRE(std::is_same_v<qwen<4>, topk_softmax<4, false>>);  // norm_topk_prob off
  STATIC_REQUIRE(std::is_same_v<qwen<4, true>, topk_softmax<4, true>>);
  STATIC_REQUIRE(std::is_same_v<switch_top1, topk_softmax<1, false>>);
  STATIC_REQUIRE(std::is_same_v<gshard_top2, topk_softmax<2, true>>);
  STATIC_REQUIRE(epmoe::router_policy<mixtral<2>>);
  STATIC_REQUIRE(epmoe::router_policy<qwen<4>>);
  STATIC_REQUIRE(epmoe::router_policy<switch_top1>);
  STATIC_REQUIRE(epmoe::router_policy<gshard_top2>);
}

TEST_CASE("topk_softmax: the aliases on a hand-computed token", "[router][aliases]") {
  using namespace epmoe::router;
  // softmax(1, 3, 2, 0) = e^{1,3,2,0} / 33.1929 = 0.0819, 0.6051, 0.2226, 0.0301.
  const std::vector<float> logits{1.f, 3.f, 2.f, 0.f};
  const double denom = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  const double p1 = std::exp(3.0) / denom, p2 = std::exp(2.0) / denom;
  const double e1 = std::exp(1.0);  // softmax(3, 2) = e / (1 + e), 1 / (1 + e)
  SECTION("mixtral<2> and gshard_top2: softmax over the two chosen logits") {
    for (const auto& r : {route<mixtral<2>>(logits), route<gshard_top2>(logits)}) {
      CHECK(r.ids == std::vector<int>{1, 2});
      CHECK(r.weights[0] == Approx(e1 / (1 + e1)).margin(1e-6));
      CHECK(r.weights[1] == Approx(1 / (1 + e1)).margin(1e-6));
    }
  }
  SECTION("qwen<2>: the full-softmax probabilities, not renormalised") {
    const auto r = route<qwen<2>>(logits);
    CHECK(r.ids == std::vector<int>{1, 2});
    CHECK(r.weights[0] == Approx(p1).margin(1e-6));
    CHECK(r.weights[1] == Approx(p2).margin(1e-6));
    const auto n = route<qwen<2, true>>(logits);  // norm_topk_prob on: Mixtral's weights
    CHECK(n.weights[0] == Approx(p1 / (p1 + p2)).margin(1e-6));
  }
  SECTION("switch_top1: the argmax with its softmax probability") {
    const auto r = route<switch_top1>(logits);
    CHECK(r.ids == std::vector<int>{1});
    CHECK(r.weights[0] == Approx(p1).margin(1e-6));
  }
}

TEST_CASE("topk_softmax: qwen weights are the full softmax at the chosen ids (random)",
          "[router][aliases]") {
  using epmoe::router::qwen;
  std::mt19937 rng(71);
  for (int trial = 0; trial < 300; ++trial) {
    const int E = 4 + static_cast<int>(rng() % 60);
    const auto logits = random_logits(rng, E, 1.5f);
    const auto r = route<qwen<4>>(logits);
    const auto p = softmax(logits);
    REQUIRE(r.ids == largest(logits, 4));
    for (int k = 0; k < 4; ++k) REQUIRE(r.weights[k] == Approx(p[r.ids[k]]).margin(1e-6));
    const auto m = route<epmoe::router::mixtral<4>>(logits);
    REQUIRE(m.ids == r.ids);
    const double chosen = p[r.ids[0]] + p[r.ids[1]] + p[r.ids[2]] + p[r.ids[3]];
    for (int k = 0; k < 4; ++k) REQUIRE(m.weights[k] == Approx(p[m.ids[k]] / chosen).margin(1e-6));
  }
}

TEMPLATE_LIST_TEST_CASE("topk_softmax: ties go to the lowest expert id", "[router][ties]",
                        all_routers) {
  constexpr int K = TestType::top_k;
  std::vector<int> first(K);
  std::iota(first.begin(), first.end(), 0);
  const std::vector<float> flat(static_cast<std::size_t>(K + 6), -0.75f);
  const auto r = route<TestType>(flat);
  CHECK(r.ids == first);
  // Partial ties: 2 tied at the top, then 3 tied below.
  std::vector<float> steps(12, -5.f);
  for (int e : {9, 4}) steps[static_cast<std::size_t>(e)] = 2.f;
  for (int e : {11, 1, 7}) steps[static_cast<std::size_t>(e)] = 1.f;
  const std::vector<int> order{4, 9, 1, 7, 11, 0, 2, 3};
  CHECK(route<TestType>(steps).ids == std::vector<int>(order.begin(), order.begin() + K));
}
