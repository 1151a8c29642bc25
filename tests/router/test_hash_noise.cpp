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
#include <tuple>
#include <type_traits>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/losses.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/topk_softmax.hpp>

using epmoe::token_input;
using epmoe::router::hash;
using epmoe::router::jitter;
using epmoe::router::noisy_topk;

namespace {

struct routed {
  std::vector<int> ids;
  std::vector<float> weights;
};

template <class Router>
routed route(const Router& r, const token_input& in) {
  routed out{std::vector<int>(Router::top_k, -7), std::vector<float>(Router::top_k, -7.f)};
  r.route_token(in, out.ids.data(), out.weights.data());
  return out;
}

template <class Router>
routed route(const Router& r, const std::vector<float>& logits) {
  return route(r, token_input{logits.data(), nullptr, static_cast<int>(logits.size())});
}

// Expected side: softmax over the K largest logits (ties to the lower id), in double.
routed top_k_softmax(const std::vector<float>& l, int k) {
  std::vector<int> idx(l.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return l[a] > l[b]; });
  routed r;
  r.ids.assign(idx.begin(), idx.begin() + k);
  double s = 0;
  for (int id : r.ids) s += std::exp(double{l[id]} - l[r.ids[0]]);
  for (int id : r.ids) r.weights.push_back(static_cast<float>(std::exp(l[id] - l[r.ids[0]]) / s));
  return r;
}

double softplus(double x) { return std::log1p(std::exp(x)); }

std::vector<float> normal(std::mt19937& rng, int n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

double sum(const std::vector<float>& w) { return std::accumulate(w.begin(), w.end(), 0.0); }

// A hash token: only the id (and E) should matter; the rest is deliberately filled with junk.
token_input hash_input(std::int64_t id, int E, const float* junk = nullptr,
                       std::uint64_t pass = 0) {
  return token_input{junk, junk, E, id, pass};
}

}  // namespace

// ---------------------------------------------------------------- hash

using hash_routers = std::tuple<hash<1>, hash<2>, hash<4>>;

TEMPLATE_LIST_TEST_CASE("hash: a gate-less router that needs token ids", "[router][hash]",
                        hash_routers) {
  STATIC_REQUIRE(epmoe::router_policy<TestType>);
  STATIC_REQUIRE(epmoe::token_router<TestType>);
  STATIC_REQUIRE_FALSE(TestType::uses_gate);
  STATIC_REQUIRE(epmoe::router_needs_token_ids<TestType>);
  STATIC_REQUIRE_FALSE(epmoe::has_probabilities<TestType>);
}

TEMPLATE_LIST_TEST_CASE("hash: K distinct experts in range, each weighing 1/K", "[router][hash]",
                        hash_routers) {
  constexpr int K = TestType::top_k;
  for (int E : {K, K + 1, 8, 64}) {
    for (std::int64_t id = -50; id < 500; ++id) {
      const auto r = route(TestType{}, hash_input(id, E));
      REQUIRE(std::set<int>(r.ids.begin(), r.ids.end()).size() == static_cast<std::size_t>(K));
      for (int e : r.ids) REQUIRE((e >= 0 && e < E));
      for (float w : r.weights) REQUIRE(w == 1.f / K);
    }
  }
  // K == E: a permutation of all experts.
  const auto all = route(TestType{}, hash_input(12345, K));
  std::vector<int> sorted = all.ids;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> iota(K);
  std::iota(iota.begin(), iota.end(), 0);
  CHECK(sorted == iota);
}

TEMPLATE_LIST_TEST_CASE("hash: depends only on the token id and the seed", "[router][hash]",
                        hash_routers) {
  constexpr int E = 16;
  std::mt19937 rng(9);
  const auto junk_a = normal(rng, E, 5.f), junk_b = normal(rng, E, 5.f);
  TestType one, other;  // two objects with the same seed
  one.seed = other.seed = 42;
  std::vector<std::vector<int>> first;
  for (std::int64_t id = 0; id < 300; ++id) first.push_back(route(one, hash_input(id, E)).ids);
  // Another object, the ids in reverse order, with logits and passes: the same experts (a
  // router with hidden state, e.g. a generator advanced per call, fails this).
  for (std::int64_t id = 299; id >= 0; --id) {
    const auto& a = first[static_cast<std::size_t>(id)];
    REQUIRE(route(other, hash_input(id, E)).ids == a);
    REQUIRE(route(other, hash_input(id, E, junk_a.data(), 7)).ids == a);  // logits, pass
    REQUIRE(route(one, hash_input(id, E, junk_b.data(), 99)).ids == a);
  }
  // The same vocabulary ids split over 1, 2 or 4 "ranks" (each routing its own shard in its
  // own order) get the same experts: the map is a function of the id alone.
  std::vector<std::int64_t> vocab(256);
  for (std::size_t i = 0; i < vocab.size(); ++i)
    vocab[i] = static_cast<std::int64_t>(i * 7919 % 1000);
  std::vector<std::vector<int>> single;
  for (auto id : vocab) single.push_back(route(one, hash_input(id, E)).ids);
  for (int ranks : {2, 4}) {
    const std::size_t shard = vocab.size() / static_cast<std::size_t>(ranks);
    for (int rank = ranks - 1; rank >= 0; --rank) {
      TestType local;
      local.seed = 42;
      for (std::size_t i = 0; i < shard; ++i) {
        const std::size_t g = static_cast<std::size_t>(rank) * shard + i;
        REQUIRE(route(local, hash_input(vocab[g], E, junk_a.data(), i)).ids == single[g]);
      }
    }
  }
}

TEMPLATE_LIST_TEST_CASE("hash: another seed is another map", "[router][hash]", hash_routers) {
  constexpr int E = 16, N = 4000;
  TestType a, b;
  a.seed = 1;
  b.seed = 2;
  int same = 0;
  for (std::int64_t id = 0; id < N; ++id)
    same += route(a, hash_input(id, E)).ids[0] == route(b, hash_input(id, E)).ids[0];
  // Independent maps agree on ~1/16 of the ids (250 of 4000); a seed-blind map on all.
  CHECK(same < 2 * N / E);
  CHECK(same > N / (4 * E));
}

TEMPLATE_LIST_TEST_CASE("hash: spreads ids roughly uniformly over the experts", "[router][hash]",
                        hash_routers) {
  constexpr int K = TestType::top_k;
  for (int E : {8, 16, 60}) {
    const int N = 1000 * E;
    std::vector<double> count(static_cast<std::size_t>(E), 0);
    std::vector<double> first(static_cast<std::size_t>(E), 0);
    for (std::int64_t id = 0; id < N; ++id) {
      const auto r = route(TestType{}, hash_input(id, E));
      for (int e : r.ids) count[e] += 1;
      first[r.ids[0]] += 1;
    }
    // Chi-square with E - 1 degrees of freedom: mean E - 1, sd sqrt(2 (E - 1)). The bound is
    // 7 sd above the mean (33 for E = 8); one expert of 8 taking 20% too many ids gives ~46.
    auto chi2 = [&](const std::vector<double>& c, double expect) {
      double x = 0;
      for (double n : c) x += (n - expect) * (n - expect) / expect;
      return x;
    };
    const double bound = (E - 1) + 7 * std::sqrt(2.0 * (E - 1));
    INFO("E = " << E);
    CHECK(chi2(first, double(N) / E) < bound);
    // Counts of all K slots are not independent draws (a token's experts are distinct),
    // which only lowers the statistic.
    CHECK(chi2(count, double(N) * K / E) < bound);
  }
}

// ---------------------------------------------------------------- noisy top-k

using noisy_routers = std::tuple<noisy_topk<1>, noisy_topk<2>, noisy_topk<4>>;

TEMPLATE_LIST_TEST_CASE("noisy_topk: a gated router with a noise gate", "[router][noisy]",
                        noisy_routers) {
  STATIC_REQUIRE(epmoe::router_policy<TestType>);
  STATIC_REQUIRE(TestType::uses_gate);
  STATIC_REQUIRE(epmoe::router_with_noise_gate<TestType>);
  STATIC_REQUIRE(epmoe::has_probabilities<TestType>);
  CHECK_FALSE(TestType{}.training);  // off by default
}

TEMPLATE_LIST_TEST_CASE("noisy_topk: not training, it is softmax over the clean top-K",
                        "[router][noisy]", noisy_routers) {
  constexpr int K = TestType::top_k;
  std::mt19937 rng(500 + K);
  for (int trial = 0; trial < 300; ++trial) {
    const int E = K + static_cast<int>(rng() % 20);
    const auto logits = normal(rng, E, 2.f), noise = normal(rng, E, 3.f);
    TestType r;
    r.seed = rng();
    const auto got = route(r, token_input{logits.data(), noise.data(), E, trial, 3});
    const auto want = top_k_softmax(logits, K);
    REQUIRE(got.ids == want.ids);
    for (int k = 0; k < K; ++k) REQUIRE(got.weights[k] == Approx(want.weights[k]).margin(1e-6));
    std::vector<float> p(static_cast<std::size_t>(E));
    r.probabilities({logits.data(), noise.data(), E, trial, 3}, p.data());
    const auto full = top_k_softmax(logits, E);  // full softmax, in descending order
    for (int e = 0; e < E; ++e) REQUIRE(p[full.ids[e]] == Approx(full.weights[e]).margin(1e-6));
  }
  // Ties go to the lowest expert id.
  const std::vector<float> flat(K + 5, 1.5f);
  auto want = std::vector<int>(K);
  std::iota(want.begin(), want.end(), 0);
  CHECK(route(TestType{}, flat).ids == want);
}

TEMPLATE_LIST_TEST_CASE("noisy_topk: training adds seeded noise, same per (seed, pass, token)",
                        "[router][noisy]", noisy_routers) {
  constexpr int K = TestType::top_k, E = 8, T = 200;
  std::mt19937 rng(600 + K);
  TestType r;
  r.training = true;
  r.seed = 1234;
  int changed_ids = 0;
  const std::vector<float> noise(E, 0.f);  // softplus(0) = ln 2
  std::vector<std::vector<float>> all_logits;
  std::vector<routed> all_got;
  for (int t = 0; t < T; ++t) {
    const auto logits = normal(rng, E, 1.f);
    const token_input in{logits.data(), noise.data(), E, t, 5};
    const auto got = route(r, in), clean = top_k_softmax(logits, K);
    all_logits.push_back(logits);
    all_got.push_back(got);
    changed_ids += got.ids != clean.ids;
    if (K > 1 && got.ids == clean.ids) REQUIRE(got.weights != clean.weights);
    // Properties: K distinct ids in range, weights sum to 1.
    REQUIRE(std::set<int>(got.ids.begin(), got.ids.end()).size() == static_cast<std::size_t>(K));
    for (int e : got.ids) REQUIRE((e >= 0 && e < E));
    REQUIRE(sum(got.weights) == Approx(1.0).margin(1e-6));
    // Another pass, seed or token draws other noise.
    for (int e = 0; e < E; ++e) {
      const float h = r.noisy_logit(in, e);
      REQUIRE(h != logits[e]);
      REQUIRE(r.noisy_logit({logits.data(), noise.data(), E, t, 6}, e) != h);
      REQUIRE(r.noisy_logit({logits.data(), noise.data(), E, t + 1000, 5}, e) != h);
      TestType reseeded = r;
      reseeded.seed = 4321;
      REQUIRE(reseeded.noisy_logit(in, e) != h);
    }
  }
  // Noise of scale ln 2 on unit logits changes a fair share of the choices.
  CHECK(changed_ids > T / 10);
  CHECK(changed_ids < T);
  // Deterministic: the same (seed, pass, token) on a fresh object, tokens in reverse order,
  // draws the same noise (no state carried from call to call).
  TestType fresh;
  fresh.training = true;
  fresh.seed = 1234;
  for (int t = T - 1; t >= 0; --t) {
    const auto again = route(fresh, token_input{all_logits[t].data(), noise.data(), E, t, 5});
    REQUIRE(again.ids == all_got[t].ids);
    REQUIRE(again.weights == all_got[t].weights);
  }
}

TEST_CASE("noisy_topk: noise scale is softplus(noise logit), the draw N(0, 1)", "[router][noisy]") {
  constexpr int E = 16;
  noisy_topk<2> r;
  r.training = true;
  r.seed = 77;
  const std::vector<float> zero(E, 0.f);
  SECTION("the same draw scaled by softplus(n) for every n") {
    for (std::int64_t t = 0; t < 50; ++t) {
      for (int e = 0; e < E; ++e) {
        std::vector<double> z;
        for (float n : {-2.f, 0.f, 1.f, 5.f, 19.f, 25.f}) {
          const std::vector<float> noise(E, n);
          z.push_back(r.noisy_logit({zero.data(), noise.data(), E, t, 1}, e) / softplus(n));
        }
        for (double x : z) REQUIRE(x == Approx(z[0]).epsilon(1e-5));
      }
    }
  }
  SECTION("noise logit -30: essentially no noise, the clean choice") {
    std::mt19937 rng(8);
    const std::vector<float> quiet(E, -30.f);
    for (std::int64_t t = 0; t < 200; ++t) {
      const auto logits = normal(rng, E, 1.f);
      const token_input in{logits.data(), quiet.data(), E, t, 2};
      for (int e = 0; e < E; ++e) REQUIRE(std::abs(r.noisy_logit(in, e) - logits[e]) < 1e-10);
      const auto got = route(r, in), want = top_k_softmax(logits, 2);
      REQUIRE(got.ids == want.ids);
      for (int k = 0; k < 2; ++k) REQUIRE(got.weights[k] == Approx(want.weights[k]).margin(1e-6));
    }
  }
  SECTION("the draws are standard normal") {
    const std::vector<float> noise(E, 0.f);
    double s = 0, s2 = 0;
    int n = 0, beyond2 = 0;
    for (std::int64_t t = 0; t < 2000; ++t) {
      for (int e = 0; e < E; ++e) {
        const double z = r.noisy_logit({zero.data(), noise.data(), E, t, 3}, e) / std::log(2.0);
        s += z;
        s2 += z * z;
        beyond2 += std::abs(z) > 2;
        ++n;
      }
    }
    const double mean = s / n, var = s2 / n - mean * mean;
    CHECK(std::abs(mean) < 0.03);  // sd of the mean: 1/sqrt(32000) = 0.0056
    CHECK(var == Approx(1.0).margin(0.05));
    CHECK(double(beyond2) / n == Approx(0.0455).margin(0.01));  // P(|z| > 2)
  }
  SECTION("without noise logits no noise is drawn, training or not") {
    std::mt19937 rng(9);
    const auto logits = normal(rng, E, 1.f);
    const token_input in{logits.data(), nullptr, E, 3, 4};
    for (int e = 0; e < E; ++e) CHECK(r.noisy_logit(in, e) == logits[e]);
  }
}

// ---------------------------------------------------------------- jitter

using epmoe::router::gshard_top2;
using epmoe::router::mixtral;
using epmoe::router::switch_top1;

using jittered = std::tuple<switch_top1, mixtral<2>, gshard_top2, epmoe::router::sigmoid_bias<2>>;

TEMPLATE_LIST_TEST_CASE("jitter: wraps a router and routes exactly like it", "[router][jitter]",
                        jittered) {
  using J = jitter<TestType>;
  STATIC_REQUIRE(epmoe::router_policy<J>);
  STATIC_REQUIRE(epmoe::router_with_jitter<J>);
  STATIC_REQUIRE_FALSE(epmoe::router_with_jitter<TestType>);
  STATIC_REQUIRE(J::top_k == TestType::top_k);
  STATIC_REQUIRE(J::uses_gate == TestType::uses_gate);
  STATIC_REQUIRE(std::is_base_of_v<TestType, J>);
  const J j{};
  CHECK_FALSE(j.training);  // off by default
  CHECK(j.eps == 1e-2f);
  std::mt19937 rng(31);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = TestType::top_k + static_cast<int>(rng() % 16);
    const auto logits = normal(rng, E, 2.f);
    J jr;
    jr.training = true;  // jitter acts on the gate input, never on the routing itself
    jr.seed = rng();
    const auto a = route(jr, logits), b = route(TestType{}, logits);
    REQUIRE(a.ids == b.ids);
    REQUIRE(a.weights == b.weights);
    std::vector<float> pa(static_cast<std::size_t>(E)), pb(static_cast<std::size_t>(E));
    jr.probabilities({logits.data(), nullptr, E}, pa.data());
    TestType{}.probabilities({logits.data(), nullptr, E}, pb.data());
    REQUIRE(pa == pb);
  }
}

TEST_CASE("jitter: switch_top1 inside jitter is Switch top-1", "[router][jitter]") {
  // Independent check of the inner routing: argmax, weight = full softmax probability.
  const std::vector<float> logits{0.5f, 2.f, -1.f, 1.f};
  const auto r = route(jitter<switch_top1>{}, logits);
  double denom = 0;
  for (float x : logits) denom += std::exp(double{x});
  CHECK(r.ids == std::vector<int>{1});
  CHECK(r.weights[0] == Approx(std::exp(2.0) / denom).margin(1e-6));
}

TEST_CASE("jitter: factor is U(1 - eps, 1 + eps), mean 1, per (pass, token, h)",
          "[router][jitter]") {
  for (float eps : {1e-2f, 0.1f, 0.5f}) {
    jitter<switch_top1> j;
    j.eps = eps;
    j.seed = 99;
    double s = 0, s2 = 0, lo = 2, hi = 0;
    int n = 0;
    for (std::uint64_t pass = 0; pass < 4; ++pass)
      for (std::int64_t t = 0; t < 100; ++t)
        for (std::int64_t h = 0; h < 64; ++h) {
          const float f = j.factor(pass, t, h);
          REQUIRE(f >= 1.f - eps);
          REQUIRE(f <= 1.f + eps);
          s += f;
          s2 += f * f;
          lo = std::min(lo, double{f});
          hi = std::max(hi, double{f});
          ++n;
        }
    const double mean = s / n, var = s2 / n - mean * mean;
    INFO("eps = " << eps);
    // Uniform: sd of the mean eps / sqrt(3 n) ~ eps * 3.6e-3; variance eps^2 / 3.
    CHECK(std::abs(mean - 1) < 0.02 * eps);
    CHECK(var == Approx(eps * eps / 3).epsilon(0.05));
    CHECK(lo < 1 - 0.99 * eps);  // reaches both ends
    CHECK(hi > 1 + 0.99 * eps);
  }
}

TEST_CASE("jitter: factor is deterministic and depends on seed, pass, token and h",
          "[router][jitter]") {
  jitter<switch_top1> j;
  j.seed = 5;
  jitter<switch_top1> other = j;
  other.seed = 6;
  int same_pass = 0, same_token = 0, same_h = 0, same_seed = 0;
  std::vector<float> first;
  for (std::int64_t t = 0; t < 64; ++t)
    for (std::int64_t h = 0; h < 64; ++h) {
      const float f = j.factor(3, t, h);
      first.push_back(f);
      same_pass += j.factor(4, t, h) == f;
      same_token += j.factor(3, t + 64, h) == f;
      same_h += j.factor(3, t, h + 64) == f;
      same_seed += other.factor(3, t, h) == f;
    }
  // A fresh object with the same seed, in reverse order, gives the same factors.
  jitter<switch_top1> fresh;
  fresh.seed = 5;
  std::size_t i = first.size();
  for (std::int64_t t = 63; t >= 0; --t)
    for (std::int64_t h = 63; h >= 0; --h) REQUIRE(fresh.factor(3, t, h) == first[--i]);
  CHECK(i == 0);
  // 24-bit uniforms: an accidental equality is ~1 in 1.7e7 per pair.
  CHECK(same_pass <= 2);
  CHECK(same_token <= 2);
  CHECK(same_h <= 2);
  CHECK(same_seed <= 2);
}
