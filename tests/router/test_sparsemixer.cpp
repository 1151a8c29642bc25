// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/error.hpp>
#include <epmoe/reference/random.hpp>
#include <epmoe/router/route.hpp>
#include <epmoe/router/sparsemixer.hpp>

// PhiMoE's SparseMixer: hand-worked tokens in inference, and the training sample against the
// definition written here in double from the reference's draws (reference/random.hpp).
using epmoe::token_input;
using epmoe::router::sparsemixer;

namespace {

struct routed {
  std::vector<int> ids;
  std::vector<float> weights;
};

routed route(const sparsemixer& r, const std::vector<float>& logits, std::int64_t token = 0,
             std::uint64_t pass = 0) {
  routed out{std::vector<int>(2, -7), std::vector<float>(2, std::nanf(""))};
  r.route_token(token_input{logits.data(), nullptr, static_cast<int>(logits.size()), token, pass},
                out.ids.data(), out.weights.data());
  return out;
}

// softmax over the given logits, at `at` (double).
double softmax_at(const std::vector<double>& kept, double at) {
  double sum = 0;
  for (double v : kept) sum += std::exp(v - at);
  return 1.0 / sum;
}

// The draw c of a token, as the definition reads it: uniform(bits(seed, pass, token, c)).
double u(std::uint64_t seed, std::uint64_t pass, std::int64_t token, int c) {
  namespace d = epmoe::reference::draws;
  return d::uniform(d::bits(seed, pass, static_cast<std::uint64_t>(token), c));
}

// The training definition in double (Hugging Face's sparsemixer with training = True), for one
// token: per round the unmasked experts, a Gumbel sample, and Heun's factor.
routed sample(const sparsemixer& r, const std::vector<float>& l, std::int64_t token,
              std::uint64_t pass) {
  const int E = static_cast<int>(l.size());
  routed out;
  std::vector<bool> gone(static_cast<std::size_t>(E), false);
  for (int round = 0; round < 2; ++round) {
    int top = -1;
    for (int e = 0; e < E; ++e)
      if (!gone[e] && (top < 0 || l[e] > l[top])) top = e;
    const double t = l[top];
    std::vector<int> kept;
    for (int e = 0; e < E; ++e)
      if (!gone[e] && !((t - l[e]) / std::max(std::abs(double{l[e]}), t) > 2.0 * r.jitter_eps))
        kept.push_back(e);
    int chosen = -1;
    double best = 0;
    for (int e : kept) {
      const double g = l[e] - std::log(-std::log(u(r.seed, pass, token, round * E + e)));
      if (chosen < 0 || g > best) chosen = e, best = g;
    }
    double sum = 0;
    for (int e : kept) sum += std::exp(l[e] - t);
    double w = std::exp(l[chosen] - t) / sum;
    if (chosen != top && !(u(r.seed, pass, token, 2 * E + round) > 0.75)) w *= 0.3333;
    out.ids.push_back(chosen);
    out.weights.push_back(static_cast<float>(w));
    gone[chosen] = true;
  }
  return out;
}

}  // namespace

TEST_CASE("sparsemixer: a top-2 token router with PhiMoE's defaults", "[router][sparsemixer]") {
  STATIC_REQUIRE(epmoe::router_policy<sparsemixer>);
  STATIC_REQUIRE(epmoe::token_router<sparsemixer>);
  STATIC_REQUIRE(sparsemixer::top_k == 2);
  STATIC_REQUIRE(sparsemixer::uses_gate);
  const sparsemixer r{};
  CHECK(r.jitter_eps == 0.01f);  // PhiMoE config router_jitter_noise
  CHECK_FALSE(r.training);
  const epmoe::layer_config cfg{.experts = 16, .top_k = 2};
  CHECK_NOTHROW(r.validate(cfg));
  CHECK_NOTHROW(sparsemixer{.jitter_eps = 0.f}.validate(cfg));
  for (float bad : {-0.01f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH(sparsemixer{.jitter_eps = bad}.validate(cfg),
                      Catch::Contains("router.jitter_eps"));
  }
}

TEST_CASE("sparsemixer: hand-worked tokens (inference)", "[router][sparsemixer]") {
  SECTION("eps 0.01: 2.9 is 3.3% below 3 > 2%: masked, both weights 1") {
    const auto r = route({}, {1.f, 3.f, 2.9f, 0.f});
    CHECK(r.ids == std::vector<int>{1, 2});
    CHECK(r.weights[0] == 1.f);
    CHECK(r.weights[1] == 1.f);
  }
  SECTION("eps 0.05: 2.9 kept beside 3 in round 1; round 2 keeps only 2.9 (3 stays out)") {
    // Round 1: t = 3, (3 - 2.9) / 3 = 0.033 <= 0.1 kept; 1 and 0 masked: w = 1 / (1 + e^-0.1).
    // Round 2: t = 2.9; (2.9 - 1) / 2.9 and 2.9 / 2.9 > 0.1: masked; expert 1 is gone: w = 1.
    const auto r = route({.jitter_eps = 0.05f}, {1.f, 3.f, 2.9f, 0.f});
    CHECK(r.ids == std::vector<int>{1, 2});
    CHECK(r.weights[0] == Approx(1.0 / (1.0 + std::exp(-0.1))).epsilon(1e-6));
    CHECK(r.weights[0] == Approx(0.524979).epsilon(1e-5));
    CHECK(r.weights[1] == 1.f);
  }
  SECTION("eps 0.6: a negative logit's own |s| is the denominator when it exceeds t") {
    // Round 1: t = 0.2. e1: (0.2 + 2) / max(2, 0.2) = 1.1 <= 1.2 kept (over t it would be 11);
    // e2: 0.1 / 0.2 = 0.5 kept; e3: 0.6 / 0.4 = 1.5 masked.
    // Round 2 (expert 0 gone): t = 0.1. e1: 2.1 / 2 = 1.05 kept; e3: 0.5 / 0.4 = 1.25 masked.
    const auto r = route({.jitter_eps = 0.6f}, {0.2f, -2.f, 0.1f, -0.4f});
    CHECK(r.ids == std::vector<int>{0, 2});
    CHECK(r.weights[0] == Approx(softmax_at({0.2, -2.0, 0.1}, 0.2)).epsilon(1e-6));
    CHECK(r.weights[0] == Approx(0.4961).epsilon(1e-3));
    CHECK(r.weights[1] == Approx(softmax_at({-2.0, 0.1}, 0.1)).epsilon(1e-6));
    CHECK(r.weights[1] == Approx(0.8909).epsilon(1e-3));
  }
  SECTION("all logits negative: t < 0, the denominator is |s|") {
    // Round 1: t = -1; e1: 0.01 / 1.01 <= 0.02 kept; e2: 2 / 3, e3: 0.5 / 1.5 masked.
    // Round 2: t = -1.01; e2: 1.99 / 3, e3: 0.49 / 1.5 masked: w = 1.
    const auto r = route({}, {-1.f, -1.01f, -3.f, -1.5f});
    CHECK(r.ids == std::vector<int>{0, 1});
    CHECK(r.weights[0] == Approx(1.0 / (1.0 + std::exp(-0.01))).epsilon(1e-5));
    CHECK(r.weights[1] == 1.f);
  }
  SECTION("eps 0: only ties with the maximum are kept; ties go to the lower id") {
    const auto r = route({.jitter_eps = 0.f}, {0.5f, 2.f, 2.f, 2.f});
    CHECK(r.ids == std::vector<int>{1, 2});
    CHECK(r.weights[0] == Approx(1.0 / 3).epsilon(1e-6));
    CHECK(r.weights[1] == Approx(0.5).epsilon(1e-6));
  }
}

TEST_CASE("sparsemixer: inference is the argmax pair, weights from the masked softmax (random)",
          "[router][sparsemixer]") {
  std::mt19937 rng(19);
  std::normal_distribution<float> logit(0.f, 2.f);
  int partial = 0, trials = 0;
  for (float eps : {0.01f, 0.1f, 0.4f}) {
    const sparsemixer r{.jitter_eps = eps};
    for (int trial = 0; trial < 300; ++trial, ++trials) {
      const int E = 2 + static_cast<int>(rng() % 30);
      std::vector<float> l(static_cast<std::size_t>(E));
      for (float& v : l) v = logit(rng);
      std::vector<int> order(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) order[e] = e;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
      const auto got = route(r, l, trial, 3);
      REQUIRE(got.ids == std::vector<int>{order[0], order[1]});
      // Inference equals the training definition's argmax branch: compare weights round by
      // round with the unmasked softmax written here.
      for (int round = 0; round < 2; ++round) {
        const double t = l[order[round]];
        double sum = 0;
        for (int e = 0; e < E; ++e)
          if (e != order[0] || round == 0)
            if (!((t - l[e]) / std::max(std::abs(double{l[e]}), t) > 2.0 * eps))
              sum += std::exp(l[e] - t);
        REQUIRE(got.weights[round] == Approx(1.0 / sum).epsilon(1e-5));
        partial += got.weights[round] < 1.f;
      }
    }
  }
  REQUIRE(trials == 900);
  CHECK(partial > 100);  // the masks kept more than the top expert often enough to matter
}

TEST_CASE("sparsemixer: training samples by Gumbel-max from (seed, pass, token, expert)",
          "[router][sparsemixer][training]") {
  std::mt19937 rng(23);
  std::normal_distribution<float> logit(0.f, 1.f);
  int off_argmax = 0, heun = 0, trials = 0;
  for (float eps : {0.3f, 2.f}) {
    const sparsemixer r{.jitter_eps = eps, .training = true, .seed = 77};
    for (int trial = 0; trial < 400; ++trial, ++trials) {
      const int E = 2 + static_cast<int>(rng() % 14);
      std::vector<float> l(static_cast<std::size_t>(E));
      for (float& v : l) v = logit(rng);
      const std::int64_t token = 1000 + trial;
      const std::uint64_t pass = trial % 3;
      const auto got = route(r, l, token, pass);
      const auto want = sample(r, l, token, pass);
      REQUIRE(got.ids == want.ids);
      REQUIRE(got.ids[0] != got.ids[1]);
      for (int k = 0; k < 2; ++k) REQUIRE(got.weights[k] == Approx(want.weights[k]).epsilon(1e-5));
      const int argmax = static_cast<int>(std::max_element(l.begin(), l.end()) - l.begin());
      off_argmax += got.ids[0] != argmax;
      heun += got.ids[0] != argmax && !(u(r.seed, pass, token, 2 * E) > 0.75);
    }
  }
  REQUIRE(trials == 800);
  CHECK(off_argmax > 50);  // the sample leaves the argmax
  CHECK(heun > 20);        // and Heun's 1/3 factor applies
}

TEST_CASE("sparsemixer: the training sample's law is softmax over the unmasked experts",
          "[router][sparsemixer][training]") {
  // Nothing masked (eps large): round 1 picks e with probability softmax(l)_e; a pick off the
  // argmax keeps its full weight with probability 1/4 (u > 0.75), else a third of it.
  const std::vector<float> l{1.f, 0.5f, 0.f, -0.5f};
  const sparsemixer r{.jitter_eps = 100.f, .training = true, .seed = 5};
  std::vector<int> picks(4, 0);
  int off = 0, full = 0;
  const int n = 40000;
  for (int token = 0; token < n; ++token) {
    const auto got = route(r, l, token, 1);
    ++picks[got.ids[0]];
    const double p = softmax_at({1.0, 0.5, 0.0, -0.5}, l[got.ids[0]]);
    if (got.ids[0] != 0) {
      ++off;
      full += std::abs(got.weights[0] - p) < 1e-6;
      if (std::abs(got.weights[0] - p) >= 1e-6) REQUIRE(got.weights[0] == Approx(0.3333 * p));
    } else {
      REQUIRE(got.weights[0] == Approx(p).epsilon(1e-6));
    }
  }
  for (int e = 0; e < 4; ++e)
    CHECK(picks[e] / double(n) == Approx(softmax_at({1.0, 0.5, 0.0, -0.5}, l[e])).margin(0.01));
  REQUIRE(off > 10000);
  CHECK(full / double(off) == Approx(0.25).margin(0.015));
}

TEST_CASE("sparsemixer: the seed, pass and token change the sample, not inference",
          "[router][sparsemixer][training]") {
  std::vector<float> l(12);
  for (int e = 0; e < 12; ++e) l[e] = 0.1f * static_cast<float>(e % 5);
  const sparsemixer train{.jitter_eps = 10.f, .training = true, .seed = 1};
  sparsemixer other_seed = train;
  other_seed.seed = 2;
  const sparsemixer infer{.jitter_eps = 10.f, .seed = 1};
  int by_pass = 0, by_token = 0, by_seed = 0, count = 0;
  for (std::int64_t token = 0; token < 200; ++token, ++count) {
    const auto a = route(train, l, token, 0);
    by_pass += route(train, l, token, 1).ids != a.ids;
    by_token += route(train, l, token + 1000, 0).ids != a.ids;
    by_seed += route(other_seed, l, token, 0).ids != a.ids;
    CHECK(route(train, l, token, 0).ids == a.ids);  // a pure function of its inputs
    const auto i = route(infer, l, token, token);
    REQUIRE(i.ids == route(infer, l, 0, 0).ids);
    REQUIRE(i.weights == route(infer, l, 0, 0).weights);
  }
  REQUIRE(count == 200);
  CHECK(by_pass > 100);
  CHECK(by_token > 100);
  CHECK(by_seed > 100);
}

TEST_CASE("sparsemixer: NaN logits keep two distinct ids in range", "[router][sparsemixer][nan]") {
  for (bool training : {false, true}) {
    const sparsemixer r{.training = training};
    const auto all = route(r, std::vector<float>(5, std::nanf("")));
    CHECK(all.ids[0] != all.ids[1]);
    for (int id : all.ids) CHECK((id >= 0 && id < 5));
    const auto some = route(r, {std::nanf(""), 1.f, std::nanf(""), 2.f});
    CHECK(some.ids[0] != some.ids[1]);
    for (int id : some.ids) CHECK((id >= 0 && id < 4));
  }
}

TEST_CASE("sparsemixer: router::route checks jitter_eps and routes", "[router][sparsemixer]") {
  const epmoe::layer_config cfg{.experts = 4, .top_k = 2};
  const std::vector<float> logits{1.f, 3.f, 2.9f, 0.f, 0.2f, -2.f, 0.1f, -0.4f};
  std::vector<std::int32_t> ids(4, -7);
  std::vector<float> w(4, std::nanf(""));
  epmoe::router::route(sparsemixer{.jitter_eps = 0.6f}, cfg, {logits.data(), 2, 4},
                       {{ids.data(), 2, 2}, {w.data(), 2, 2}});
  CHECK(ids == std::vector<std::int32_t>{1, 2, 0, 2});
  CHECK(w[2] == Approx(softmax_at({0.2, -2.0, 0.1}, 0.2)).epsilon(1e-6));
  CHECK_THROWS_AS(epmoe::router::route(sparsemixer{.jitter_eps = -1.f}, cfg, {logits.data(), 2, 4},
                                       {{ids.data(), 2, 2}, {w.data(), 2, 2}}),
                  epmoe::config_error);
}
