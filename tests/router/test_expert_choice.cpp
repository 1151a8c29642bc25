// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <epmoe/core/concepts.hpp>
#include <epmoe/core/losses.hpp>
#include <epmoe/core/routing.hpp>
#include <epmoe/router/expert_choice.hpp>

using epmoe::index_t;
using epmoe::layer_config;
using epmoe::no_expert;
using epmoe::router::expert_choice;

namespace {

layer_config config(int experts, int top_k, double cf, int max_tokens) {
  layer_config c;
  c.hidden = 8;
  c.ffn = 16;
  c.experts = experts;
  c.top_k = top_k;
  c.capacity_factor = cf;
  c.max_tokens = max_tokens;
  return c;
}

struct routed {
  int tokens = 0, experts = 0;
  std::vector<std::int32_t> ids;  // [T, E]
  std::vector<float> weights;     // [T, E]
  std::int32_t id(int t, int e) const { return ids[static_cast<std::size_t>(t * experts + e)]; }
  float weight(int t, int e) const { return weights[static_cast<std::size_t>(t * experts + e)]; }
};

// Runs route_batch on [T, E] logits with scratch sized as the layer sizes it.
routed run(const layer_config& cfg, const std::vector<float>& logits, int T) {
  const int E = cfg.experts;
  routed r{T, E, std::vector<std::int32_t>(static_cast<std::size_t>(T * E), 12345),
           std::vector<float>(static_cast<std::size_t>(T * E), -1.f)};
  std::vector<float> fs(static_cast<std::size_t>(expert_choice::scratch_floats(cfg)));
  std::vector<std::int32_t> is(static_cast<std::size_t>(expert_choice::scratch_ints(cfg)));
  expert_choice{}.route_batch(cfg, {logits.data(), T, E},
                              {{r.ids.data(), T, E}, {r.weights.data(), T, E}}, fs, is);
  return r;
}

// S = softmax over experts of each token, in double.
std::vector<double> scores(const std::vector<float>& logits, int T, int E) {
  std::vector<double> s(static_cast<std::size_t>(T * E));
  for (int t = 0; t < T; ++t) {
    double m = logits[t * E];
    for (int e = 0; e < E; ++e) m = std::max(m, double{logits[t * E + e]});
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += s[t * E + e] = std::exp(logits[t * E + e] - m);
    for (int e = 0; e < E; ++e) s[t * E + e] /= sum;
  }
  return s;
}

// C = min(T, ceil(cf * T * K / E)) in integers, for cf = num / den.
int capacity(int T, int K, int E, int num, int den) {
  const long long n = 1LL * num * T * K, d = 1LL * den * E;
  return static_cast<int>(std::min<long long>(T, (n + d - 1) / d));
}

// The C tokens expert e takes: best S[t, e] first, ties to the lower token.
std::vector<int> chosen_tokens(const std::vector<double>& s, int T, int E, int e, int C) {
  std::vector<int> t(static_cast<std::size_t>(T));
  std::iota(t.begin(), t.end(), 0);
  std::stable_sort(t.begin(), t.end(), [&](int a, int b) { return s[a * E + e] > s[b * E + e]; });
  t.resize(static_cast<std::size_t>(C));
  std::sort(t.begin(), t.end());
  return t;
}

// The tokens whose slot e holds expert e, ascending.
std::vector<int> tokens_of(const routed& r, int e) {
  std::vector<int> t;
  for (int i = 0; i < r.tokens; ++i)
    if (r.id(i, e) == e) t.push_back(i);
  return t;
}

int experts_of(const routed& r, int t) {
  int n = 0;
  for (int e = 0; e < r.experts; ++e) n += r.id(t, e) != no_expert;
  return n;
}

// Two-expert logits [x, 0] per token, so S[t, 0] = sigmoid(x) and S[t, 1] = 1 - S[t, 0].
std::vector<float> two_expert_logits(std::initializer_list<float> first) {
  std::vector<float> l;
  for (float x : first) {
    l.push_back(x);
    l.push_back(0.f);
  }
  return l;
}

}  // namespace

TEST_CASE("expert_choice: is a batch router with a variable number of experts per token",
          "[router][expert_choice]") {
  STATIC_REQUIRE(epmoe::router_policy<expert_choice>);
  STATIC_REQUIRE(epmoe::batch_router<expert_choice>);
  STATIC_REQUIRE_FALSE(epmoe::token_router<expert_choice>);
  STATIC_REQUIRE(epmoe::has_probabilities<expert_choice>);
  STATIC_REQUIRE(expert_choice::top_k == 0);
  STATIC_REQUIRE(expert_choice::uses_gate);
  const auto cfg = config(4, 2, 1.0, 32);
  CHECK(expert_choice::scratch_floats(cfg) >= 32 * 4);
  CHECK(expert_choice::scratch_ints(cfg) >= 32);
}

TEST_CASE("expert_choice: capacity is min(T, ceil(cf * T * K / E))", "[router][expert_choice]") {
  CHECK(expert_choice::capacity(config(4, 1, 1.0, 64), 8) == 2);
  CHECK(expert_choice::capacity(config(4, 2, 1.0, 64), 8) == 4);
  CHECK(expert_choice::capacity(config(4, 1, 1.0, 64), 9) == 3);    // ceil(2.25)
  CHECK(expert_choice::capacity(config(4, 2, 1.25, 64), 10) == 7);  // ceil(6.25)
  CHECK(expert_choice::capacity(config(2, 2, 4.0, 64), 3) == 3);    // 12 > T
  CHECK(expert_choice::capacity(config(8, 1, 0.5, 64), 4) == 1);    // ceil(0.25)
  CHECK(expert_choice::capacity(config(4, 1, 1.0, 64), 0) == 0);
}

TEST_CASE("expert_choice: a hand-computed batch", "[router][expert_choice]") {
  // T 4, E 2, K 1, cf 1: C = 2. S[t, 0] = sigmoid(l0): 0.881, 0.5, 0.269, 0.622.
  const auto logits = two_expert_logits({2.f, 0.f, -1.f, 0.5f});
  const auto r = run(config(2, 1, 1.0, 4), logits, 4);
  // Expert 0 takes tokens 0 (0.881) and 3 (0.622); expert 1 takes 2 (0.731) and 1 (0.5).
  CHECK(tokens_of(r, 0) == std::vector<int>{0, 3});
  CHECK(tokens_of(r, 1) == std::vector<int>{1, 2});
  CHECK(r.id(0, 0) == 0);
  CHECK(r.id(0, 1) == no_expert);
  CHECK(r.id(1, 0) == no_expert);
  CHECK(r.id(1, 1) == 1);
  CHECK(r.weight(0, 0) == Approx(0.8807970779778823).margin(1e-6));
  CHECK(r.weight(3, 0) == Approx(0.6224593312018546).margin(1e-6));
  CHECK(r.weight(2, 1) == Approx(1 - 0.2689414213699951).margin(1e-6));
  CHECK(r.weight(1, 1) == Approx(0.5).margin(1e-6));
}

TEST_CASE("expert_choice: a token may get no expert or every expert", "[router][expert_choice]") {
  SECTION("no expert: C = 1 of T = 3, the middle token loses both") {
    // cf 0.5: ceil(0.5 * 3 * 1 / 2) = 1. Expert 0 takes the highest S0, expert 1 the lowest.
    const auto r = run(config(2, 1, 0.5, 3), two_expert_logits({2.f, 0.f, -2.f}), 3);
    CHECK(experts_of(r, 0) == 1);
    CHECK(experts_of(r, 1) == 0);
    CHECK(experts_of(r, 2) == 1);
    CHECK(r.id(1, 0) == no_expert);
    CHECK(r.id(1, 1) == no_expert);
    CHECK(r.id(0, 0) == 0);
    CHECK(r.id(2, 1) == 1);
  }
  SECTION("every expert: C = 2 of T = 3, the middle token is second for both") {
    const auto r = run(config(2, 1, 1.0, 3), two_expert_logits({2.f, 0.f, -2.f}), 3);
    CHECK(experts_of(r, 1) == 2);
    CHECK(r.id(1, 0) == 0);
    CHECK(r.id(1, 1) == 1);
    CHECK(r.weight(1, 0) == Approx(0.5).margin(1e-6));
    CHECK(r.weight(1, 1) == Approx(0.5).margin(1e-6));
    CHECK(experts_of(r, 0) == 1);
    CHECK(experts_of(r, 2) == 1);
  }
  SECTION("both in one batch, by ties: equal scores go to the lowest token") {
    // Every S is 1/4; C = ceil(4 * 1 / 4) = 1: every expert takes token 0.
    const std::vector<float> logits(16, 0.3f);
    const auto r = run(config(4, 1, 1.0, 4), logits, 4);
    for (int e = 0; e < 4; ++e) {
      CHECK(r.id(0, e) == e);
      CHECK(r.weight(0, e) == Approx(0.25).margin(1e-6));
    }
    CHECK(experts_of(r, 0) == 4);
    for (int t = 1; t < 4; ++t) CHECK(experts_of(r, t) == 0);
  }
}

TEST_CASE("expert_choice: ties go to the lower token first", "[router][expert_choice][ties]") {
  // T 6, E 3, K 1, cf 1: C = 2. Tokens 1, 3 and 4 tie on expert 2 (S = 0.5); 1 and 3 win.
  std::vector<float> logits(18, 0.f);
  for (int t : {1, 3, 4}) logits[static_cast<std::size_t>(t * 3 + 2)] = std::log(2.f);
  const auto r = run(config(3, 1, 1.0, 6), logits, 6);
  CHECK(tokens_of(r, 2) == std::vector<int>{1, 3});
  // The other tokens all have S = 1/3 on experts 0 and 1: the two lowest of them win.
  CHECK(tokens_of(r, 0) == std::vector<int>{0, 2});
  CHECK(tokens_of(r, 1) == std::vector<int>{0, 2});
}

TEST_CASE("expert_choice: matches an independent implementation on random batches",
          "[router][expert_choice]") {
  std::mt19937 rng(77);
  std::normal_distribution<float> d(0.f, 1.5f);
  const int cf_num[] = {1, 5, 1, 3, 2}, cf_den[] = {1, 4, 2, 1, 1};  // 1, 1.25, 0.5, 3, 2
  for (int trial = 0; trial < 200; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 12);
    const int K = 1 + static_cast<int>(rng() % static_cast<unsigned>(E));
    const int max_tokens = 1 + static_cast<int>(rng() % 40);
    const int T = 1 + static_cast<int>(rng() % static_cast<unsigned>(max_tokens));  // <= max
    const int which = static_cast<int>(rng() % 5);
    const auto cfg = config(E, K, static_cast<double>(cf_num[which]) / cf_den[which], max_tokens);
    std::vector<float> logits(static_cast<std::size_t>(T * E));
    for (float& x : logits) x = d(rng);
    const auto r = run(cfg, logits, T);
    const auto s = scores(logits, T, E);
    const int C = capacity(T, K, E, cf_num[which], cf_den[which]);
    INFO("T = " << T << ", E = " << E << ", K = " << K << ", C = " << C);
    REQUIRE(expert_choice::capacity(cfg, T) == C);
    for (int e = 0; e < E; ++e) {
      const auto mine = tokens_of(r, e);
      REQUIRE(static_cast<int>(mine.size()) == C);  // perfectly balanced
      REQUIRE(mine == chosen_tokens(s, T, E, e, C));
      for (int t : mine) REQUIRE(r.weight(t, e) == Approx(s[t * E + e]).margin(1e-6));
    }
    // Slot e holds expert e or no_expert, nothing else.
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) REQUIRE((r.id(t, e) == e || r.id(t, e) == no_expert));
  }
}

TEST_CASE("expert_choice: T < C takes every token for every expert", "[router][expert_choice]") {
  // cf 4, K 2, E 2, T 3: ceil(4 * 3 * 2 / 2) = 12 > 3.
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> logits(6);
  for (float& x : logits) x = d(rng);
  const auto r = run(config(2, 2, 4.0, 8), logits, 3);
  const auto s = scores(logits, 3, 2);
  for (int t = 0; t < 3; ++t) {
    CHECK(experts_of(r, t) == 2);
    for (int e = 0; e < 2; ++e) CHECK(r.weight(t, e) == Approx(s[t * 2 + e]).margin(1e-6));
  }
}

TEST_CASE("expert_choice: an empty batch writes nothing", "[router][expert_choice]") {
  const auto r = run(config(4, 1, 1.0, 4), {}, 0);
  CHECK(r.ids.empty());
}

TEST_CASE("expert_choice: probabilities are the softmax over experts", "[router][expert_choice]") {
  const std::vector<float> logits{1.f, -0.5f, 2.f, 0.f, 0.25f};
  std::vector<float> p(5);
  expert_choice{}.probabilities({logits.data(), nullptr, 5}, p.data());
  const auto s = scores(logits, 1, 5);
  for (int e = 0; e < 5; ++e) CHECK(p[e] == Approx(s[e]).margin(1e-7));
}
