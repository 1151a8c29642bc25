// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/losses.hpp>
#include <epmoe/router/sinkhorn.hpp>

using epmoe::layer_config;
using epmoe::router::sinkhorn;

namespace {

layer_config config(int experts, int top_k, int max_tokens) {
  layer_config c;
  c.hidden = 8;
  c.ffn = 16;
  c.experts = experts;
  c.top_k = top_k;
  c.max_tokens = max_tokens;
  return c;
}

struct routed {
  int K = 0;
  std::vector<std::int32_t> ids;  // [T, K]
  std::vector<float> weights;     // [T, K]
  std::vector<int> row(int t) const { return {ids.begin() + t * K, ids.begin() + (t + 1) * K}; }
};

// Runs route_batch on [T, E] logits, with scratch sized as the layer sizes it (for
// max_tokens >= T: the scratch may be larger than this batch needs).
template <int K>
routed run(const std::vector<float>& logits, int T, int E, int max_tokens = 0,
           sinkhorn<K> router = {}) {
  const auto cfg = config(E, K, std::max(T, max_tokens));
  routed r{K, std::vector<std::int32_t>(static_cast<std::size_t>(T * K), -7),
           std::vector<float>(static_cast<std::size_t>(T * K), -7.f)};
  std::vector<float> fs(static_cast<std::size_t>(sinkhorn<K>::scratch_floats(cfg)));
  std::vector<std::int32_t> is(static_cast<std::size_t>(sinkhorn<K>::scratch_ints(cfg)));
  router.route_batch(cfg, {logits.data(), T, E}, {{r.ids.data(), T, K}, {r.weights.data(), T, K}},
                     fs, is);
  return r;
}

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Softmax probability of expert e for token t, in double.
double prob(const std::vector<float>& logits, int E, int t, int e) {
  double m = logits[t * E];
  for (int j = 0; j < E; ++j) m = std::max(m, double{logits[t * E + j]});
  double s = 0;
  for (int j = 0; j < E; ++j) s += std::exp(logits[t * E + j] - m);
  return std::exp(logits[t * E + e] - m) / s;
}

// Plain top-K of each token's logits (ties to the lower id): the load each expert would get.
std::vector<int> plain_load(const std::vector<float>& logits, int T, int E, int K) {
  std::vector<int> load(static_cast<std::size_t>(E), 0);
  for (int t = 0; t < T; ++t) {
    std::vector<int> idx(static_cast<std::size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int a, int b) { return logits[t * E + a] > logits[t * E + b]; });
    for (int k = 0; k < K; ++k) ++load[idx[k]];
  }
  return load;
}

std::vector<int> load_of(const routed& r, int E) {
  std::vector<int> load(static_cast<std::size_t>(E), 0);
  for (int id : r.ids) ++load[id];
  return load;
}

double max_over_mean(const std::vector<int>& load) {
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / load.size();
  return *std::max_element(load.begin(), load.end()) / mean;
}

// Most tokens (7 in 8) prefer expert 0 by a wide margin.
std::vector<float> skewed(std::mt19937& rng, int T, int E) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> l(static_cast<std::size_t>(T * E));
  for (float& x : l) x = d(rng);
  for (int t = 0; t < T; ++t)
    if (t % 8 != 7) l[static_cast<std::size_t>(t * E)] += 4.f;
  return l;
}

// Checks weights: sigmoid(logit) for K = 1, the full softmax probability for K > 1.
void check_weights(const routed& r, const std::vector<float>& logits, int T, int E) {
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < r.K; ++k) {
      const int e = r.ids[t * r.K + k];
      const double want = r.K == 1 ? sig(logits[t * E + e]) : prob(logits, E, t, e);
      REQUIRE(r.weights[t * r.K + k] == Approx(want).margin(1e-6));
    }
}

}  // namespace

using sinkhorn_routers = std::tuple<sinkhorn<1>, sinkhorn<2>, sinkhorn<4>>;

TEMPLATE_LIST_TEST_CASE("sinkhorn: a gated batch router", "[router][sinkhorn]", sinkhorn_routers) {
  STATIC_REQUIRE(epmoe::router_policy<TestType>);
  STATIC_REQUIRE(epmoe::batch_router<TestType>);
  STATIC_REQUIRE(TestType::uses_gate);
  STATIC_REQUIRE(epmoe::has_probabilities<TestType>);
  const auto cfg = config(8, TestType::top_k, 32);
  // The balanced matrix [T, E] plus T row and 2 E column factors.
  CHECK(TestType::scratch_floats(cfg) >= 32 * 8 + 32 + 2 * 8);
  CHECK(TestType::scratch_ints(cfg) == 0);
}

TEMPLATE_LIST_TEST_CASE("sinkhorn: balances a skewed batch far better than plain top-K",
                        "[router][sinkhorn]", sinkhorn_routers) {
  constexpr int K = TestType::top_k, T = 256, E = 8;
  std::mt19937 rng(900 + K);
  for (int batch = 0; batch < 4; ++batch) {
    const auto logits = skewed(rng, T, E);
    const auto r = run<K>(logits, T, E, 300);
    const double plain = max_over_mean(plain_load(logits, T, E, K));
    const double balanced = max_over_mean(load_of(r, E));
    INFO("plain max/mean " << plain << ", sinkhorn max/mean " << balanced);
    // Expert 0 is in 7/8 of the plain choices: max/mean = 7 (K 1), 3.5 (K 2), 1.75 (K 4).
    REQUIRE(plain > 1.5);
    // Sinkhorn removes most of the excess over perfect balance (max/mean 1).
    CHECK(balanced - 1 < 0.25 * (plain - 1));
    CHECK(balanced < 1.5);
    check_weights(r, logits, T, E);
    for (int t = 0; t < T; ++t) {
      const auto row = r.row(t);
      REQUIRE(std::set<int>(row.begin(), row.end()).size() == static_cast<std::size_t>(K));
      for (int e : row) REQUIRE((e >= 0 && e < E));
    }
  }
}

TEMPLATE_LIST_TEST_CASE("sinkhorn: on an already balanced batch it picks the plain top-K",
                        "[router][sinkhorn]", sinkhorn_routers) {
  constexpr int K = TestType::top_k, E = 8, T = 64;
  SECTION("cyclic preferences: token t likes t, t+1, ... most") {
    std::vector<float> logits(T * E, 0.f);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < K; ++j) logits[t * E + (t + j) % E] = 4.f - static_cast<float>(j);
    const auto r = run<K>(logits, T, E);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < K; ++j) REQUIRE(r.ids[t * K + j] == (t + j) % E);
    check_weights(r, logits, T, E);
  }
  SECTION("a shuffled batch where every expert is the argmax of T/E tokens") {
    std::mt19937 rng(17 + K);
    std::normal_distribution<float> d(0.f, 0.3f);
    std::vector<int> favourite(T);
    for (int t = 0; t < T; ++t) favourite[t] = t % E;
    std::shuffle(favourite.begin(), favourite.end(), rng);
    std::vector<float> logits(T * E);
    for (float& x : logits) x = d(rng);
    for (int t = 0; t < T; ++t) logits[t * E + favourite[t]] += 4.f;
    const auto r = run<K>(logits, T, E);
    for (int t = 0; t < T; ++t) REQUIRE(r.ids[t * K] == favourite[t]);
    check_weights(r, logits, T, E);
  }
}

TEMPLATE_LIST_TEST_CASE("sinkhorn: ties go to the lowest expert id", "[router][sinkhorn][ties]",
                        sinkhorn_routers) {
  constexpr int K = TestType::top_k, E = 6, T = 5;
  const std::vector<float> flat(T * E, 0.7f);
  const auto r = run<K>(flat, T, E);
  std::vector<int> want(K);
  std::iota(want.begin(), want.end(), 0);
  for (int t = 0; t < T; ++t) REQUIRE(r.row(t) == want);
  check_weights(r, flat, T, E);
}

TEMPLATE_LIST_TEST_CASE("sinkhorn: properties over random batches", "[router][sinkhorn]",
                        sinkhorn_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(1000 + K);
  std::normal_distribution<float> d(0.f, 2.f);
  for (int seed = 0; seed < 200; ++seed) {
    const int E = K + static_cast<int>(rng() % 10);
    const int T = 1 + static_cast<int>(rng() % 24);
    std::vector<float> logits(static_cast<std::size_t>(T * E));
    for (float& x : logits) x = d(rng);
    const auto r = run<K>(logits, T, E, T + 3);
    for (int t = 0; t < T; ++t) {
      const auto row = r.row(t);
      REQUIRE(std::set<int>(row.begin(), row.end()).size() == static_cast<std::size_t>(K));
      for (int e : row) REQUIRE((e >= 0 && e < E));
      double total = 0;
      for (int k = 0; k < K; ++k) total += r.weights[t * K + k];
      REQUIRE(total <= 1.0 + 1e-6);  // a subset of a softmax, or one sigmoid
    }
    check_weights(r, logits, T, E);
  }
}

TEST_CASE("sinkhorn: an empty batch writes nothing", "[router][sinkhorn]") {
  const auto r = run<2>({}, 0, 4, 4);
  CHECK(r.ids.empty());
}

TEST_CASE("sinkhorn: probabilities are the softmax over experts", "[router][sinkhorn]") {
  const std::vector<float> logits{1.f, -0.5f, 2.f, 0.f};
  std::vector<float> p(4);
  sinkhorn<2>{}.probabilities({logits.data(), nullptr, 4}, p.data());
  for (int e = 0; e < 4; ++e) CHECK(p[e] == Approx(prob(logits, 4, 0, e)).margin(1e-7));
}
