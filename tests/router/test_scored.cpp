// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The scored routers (router::biased with sigmoid, softmax and sqrtsoftplus scores, selection
// on scores or logits; router::table): values against plain double formulas, gradients
// against central differences of those formulas, the eps and norm_min bounds binding, the
// score function at its extremes, and the errors that name a bad field.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <epmoe/router/biased.hpp>
#include <epmoe/router/route.hpp>
#include <epmoe/router/table.hpp>

using namespace epmoe;
using router::select_on;

namespace {

// The expected side: double arithmetic, nothing from epmoe.
double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double sqrtsp(double x) {
  return std::sqrt(x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)));
}

enum class fn { sigmoid, softmax, sqrtsoftplus };

std::vector<double> scores(fn f, const std::vector<double>& l) {
  std::vector<double> s(l.size());
  if (f == fn::softmax) {
    const double m = *std::max_element(l.begin(), l.end());
    double sum = 0;
    for (std::size_t e = 0; e < l.size(); ++e) sum += (s[e] = std::exp(l[e] - m));
    for (double& v : s) v /= sum;
  } else {
    for (std::size_t e = 0; e < l.size(); ++e) s[e] = f == fn::sigmoid ? sig(l[e]) : sqrtsp(l[e]);
  }
  return s;
}

struct setting {
  bool normalize = true;
  double eps = 0, norm_min = 0, scaling = 1;
};

// Weights of the fixed ids: c s_k / max(Σ s + eps, norm_min), or c s_k.
std::vector<double> weights(fn f, const std::vector<double>& l, const std::vector<int>& ids,
                            const setting& st) {
  const auto s = scores(f, l);
  double sum = 0;
  for (int e : ids) sum += s[e];
  const double d = st.normalize ? std::max(sum + st.eps, st.norm_min) : 1.0;
  std::vector<double> w;
  for (int e : ids) w.push_back(st.scaling * s[e] / d);
  return w;
}

// The K best keys, ties to the lower id.
std::vector<int> best(const std::vector<double>& key, int k) {
  std::vector<int> order(key.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

template <class Score>
constexpr fn fn_of() {
  if constexpr (std::is_same_v<Score, router::score::sigmoid>) return fn::sigmoid;
  if constexpr (std::is_same_v<Score, router::score::softmax>) return fn::softmax;
  return fn::sqrtsoftplus;
}

template <class R>
void apply(R& r, const setting& st) {
  r.normalize = st.normalize;
  r.eps = static_cast<float>(st.eps);
  r.norm_min = static_cast<float>(st.norm_min);
  r.scaling = static_cast<float>(st.scaling);
}

// Routes one token and checks ids, weights and the gradient of Σ g_k w_k against central
// differences of the formula (ids held). Returns the checks made.
template <class R>
int check_token(const R& r, const std::vector<float>& lf, const std::vector<int>& want_ids,
                const setting& st, std::int64_t token = 0) {
  constexpr int K = R::top_k;
  const fn f = fn_of<typename R::score_type>();
  const int E = static_cast<int>(lf.size());
  const std::vector<double> l(lf.begin(), lf.end());
  std::vector<int> ids(K, -7);
  std::vector<float> w(K, std::nanf(""));
  const token_input in{lf.data(), nullptr, E, token};
  r.route_token(in, ids.data(), w.data());
  CHECK(ids == want_ids);
  const auto want = weights(f, l, want_ids, st);
  for (int k = 0; k < K; ++k) CHECK(w[k] == Approx(want[k]).epsilon(2e-6).margin(1e-30));
  std::vector<float> g(K);
  for (int k = 0; k < K; ++k) g[k] = 0.3f - 0.7f * static_cast<float>(k) / K;
  std::vector<float> dl(E, std::nanf(""));
  r.backward_token(in, want_ids.data(), g.data(), dl.data());
  for (int e = 0; e < E; ++e) {
    const double h = 1e-5 * std::max(1.0, std::abs(l[e]));
    auto lp = l, lm = l;
    lp[e] += h, lm[e] -= h;
    const auto wp = weights(f, lp, want_ids, st), wm = weights(f, lm, want_ids, st);
    double fd = 0;
    for (int k = 0; k < K; ++k) fd += g[k] * (wp[k] - wm[k]) / (2 * h);
    INFO("expert " << e << " logit " << l[e]);
    CHECK(std::isfinite(dl[e]));
    CHECK(dl[e] == Approx(fd).epsilon(1e-4).margin(1e-7));
  }
  return 2 + K + E;
}

std::vector<float> random_logits(int E, std::uint64_t seed, float spread = 2.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-spread, spread);
  std::vector<float> l(static_cast<std::size_t>(E));
  for (float& v : l) v = u(rng);
  return l;
}

template <class Score, select_on Sel>
int check_biased(const setting& st, std::uint64_t seed) {
  constexpr int K = 3, E = 10;
  const auto lf = random_logits(E, seed);
  std::vector<float> bias = random_logits(E, seed + 100, 0.3f);
  router::biased<K, Score, Sel> r{};
  apply(r, st);
  r.bias = bias.data();
  const std::vector<double> l(lf.begin(), lf.end());
  const auto s = scores(fn_of<Score>(), l);
  std::vector<double> key(E);
  for (int e = 0; e < E; ++e) key[e] = (Sel == select_on::scores ? s[e] : l[e]) + bias[e];
  return check_token(r, lf, best(key, K), st);
}

}  // namespace

TEMPLATE_TEST_CASE("scored router: values and gradients against the formula", "[router][scored]",
                   router::score::sigmoid, router::score::softmax, router::score::sqrtsoftplus) {
  int n = 0;
  for (std::uint64_t seed = 1; seed <= 6; ++seed)
    for (const setting& st :
         {setting{}, setting{false, 0, 0, 2.5}, setting{true, 0.25, 0, 1.5},
          setting{true, 1e-6, 0, 1}, setting{true, 0, 50, 1}, setting{true, 0.1, 0.2, 3}}) {
      n += check_biased<TestType, select_on::scores>(st, seed);
      n += check_biased<TestType, select_on::logits>(st, seed);
    }
  CHECK(n == 6 * 6 * 2 * (2 + 3 + 10));
}

TEST_CASE("scored router: eps and norm_min bind", "[router][scored]") {
  const std::vector<float> l{0.5f, -1.f, 2.f, 0.f};
  router::deepseek_v4<2> r{};  // s = sqrt(softplus(l)); ids {2, 0}
  const double s2 = sqrtsp(2.0), s0 = sqrtsp(0.5);
  float w[2];
  int ids[2];
  const token_input in{l.data(), nullptr, 4};
  r.eps = 0.5f;
  r.route_token(in, ids, w);
  CHECK(w[0] == Approx(s2 / (s2 + s0 + 0.5)).epsilon(1e-6));
  r.eps = 0.f;
  r.norm_min = 100.f;  // the sum clamped: weights s / 100, no coupling in the gradient
  r.route_token(in, ids, w);
  CHECK(w[1] == Approx(s0 / 100).epsilon(1e-6));
  const float g[2] = {1.f, 0.f};
  float dl[4];
  r.backward_token(in, ids, g, dl);
  CHECK(dl[0] == 0.f);  // expert 0's score does not move expert 2's weight under the clamp
  CHECK(dl[2] == Approx(sig(2.0) / (2 * s2) / 100).epsilon(1e-5));
  // At the bound (the router's own float sum): torch's clamp passes the gradient there.
  r.norm_min = router::score::sqrtsoftplus::value(2.f) + router::score::sqrtsoftplus::value(0.5f);
  r.backward_token(in, ids, g, dl);
  CHECK(dl[0] != 0.f);
  int n = 0;
  for (double e : {1e-20, 1e-6, 0.3})
    n += check_token(
        [&] {
          router::lfm2_moe<2> x{};
          x.eps = static_cast<float>(e);
          return x;
        }(),
        l, {2, 0}, setting{true, e, 0, 1});
  CHECK(n == 3 * 8);
}

TEST_CASE("sqrtsoftplus: values and derivative near zero, far below and far above",
          "[router][scored]") {
  using S = router::score::sqrtsoftplus;
  int n = 0;
  for (double x : {-300.0, -104.0, -90.0, -40.0, -15.5, -15.0, -14.5, -3.0, -1e-3, 0.0, 1e-3, 0.7,
                   19.0, 21.0, 60.0, 1e4, 1e30}) {
    const float l = static_cast<float>(x);
    const float s = S::value(l), d = S::derivative(l, s);
    INFO("l = " << x);
    CHECK(std::isfinite(s));
    CHECK(std::isfinite(d));
    if (x < -87) {  // softplus is a float denormal or 0 there: s and s' tiny, never NaN
      CHECK((s >= 0.f && s < 1e-18f && d >= 0.f && d <= s));
    } else {
      const double want_s = sqrtsp(x), want_d = sig(x) / (2 * want_s);
      CHECK(s == Approx(want_s).epsilon(2e-6));
      CHECK(d == Approx(want_d).epsilon(2e-5));
    }
    ++n;
  }
  CHECK(S::value(0.f) == Approx(std::sqrt(std::log(2.0))).epsilon(1e-7));
  CHECK(S::value(-INFINITY) == 0.f);
  CHECK(S::derivative(-INFINITY, 0.f) == 0.f);
  CHECK(S::value(INFINITY) == INFINITY);
  CHECK(S::derivative(INFINITY, INFINITY) == 0.f);
  CHECK(n == 17);
}

TEST_CASE("scored router: the bias moves the choice, never the weights", "[router][scored]") {
  const std::vector<float> l{1.f, 0.f, -1.f, 0.5f};
  const std::vector<float> bias{0.f, 0.f, 5.f, 0.f};
  router::ernie4_5<2> r{};
  r.bias = bias.data();
  int ids[2];
  float w[2];
  r.route_token({l.data(), nullptr, 4}, ids, w);
  CHECK(ids[0] == 2);  // chosen by the bias alone
  CHECK(ids[1] == 0);
  const auto p = scores(fn::softmax, {1.0, 0.0, -1.0, 0.5});
  CHECK(w[0] == Approx(p[2] / (p[2] + p[0])).epsilon(1e-6));
  // Kolibri / Llama 4 select on l + b: a bias of 0.6 on expert 3 beats expert 0 (l 1 vs 1.1),
  // and the weights are σ(l).
  const std::vector<float> b3{0.f, 0.f, 0.f, 0.6f};
  router::kolibri<1> k{};
  k.normalize = false;
  k.bias = b3.data();
  k.route_token({l.data(), nullptr, 4}, ids, w);
  CHECK(ids[0] == 3);
  CHECK(w[0] == Approx(sig(0.5)).epsilon(1e-6));
  // Saturated scores tie in float; logits do not: Llama 4 picks the larger logit.
  const std::vector<float> big{30.f, 31.f, 29.f};
  router::llama4<1> ll{};
  ll.normalize = false;
  ll.route_token({big.data(), nullptr, 3}, ids, w);
  CHECK(ids[0] == 1);
  CHECK(w[0] == 1.f);
}

TEST_CASE("scored router: probabilities and their backward", "[router][scored]") {
  const auto lf = random_logits(7, 9);
  const std::vector<double> l(lf.begin(), lf.end());
  const auto check = [&](auto r, fn f) {
    std::vector<float> p(7), dl(7, 0.f), dp(7);
    for (int e = 0; e < 7; ++e) dp[e] = 0.1f * static_cast<float>(e) - 0.2f;
    r.probabilities({lf.data(), nullptr, 7}, p.data());
    const auto norm = [&](const std::vector<double>& x) {
      auto s = scores(f, x);
      const double sum = std::accumulate(s.begin(), s.end(), 0.0);
      for (double& v : s) v /= sum;
      return s;
    };
    const auto want = norm(l);
    for (int e = 0; e < 7; ++e) CHECK(p[e] == Approx(want[e]).epsilon(1e-6));
    r.probabilities_backward({lf.data(), nullptr, 7}, dp.data(), dl.data());
    for (int e = 0; e < 7; ++e) {
      auto lp = l, lm = l;
      lp[e] += 1e-6, lm[e] -= 1e-6;
      const auto a = norm(lp), b = norm(lm);
      double fd = 0;
      for (int i = 0; i < 7; ++i) fd += dp[i] * (a[i] - b[i]) / 2e-6;
      CHECK(dl[e] == Approx(fd).epsilon(1e-4).margin(1e-7));
    }
    return 14;
  };
  int n = check(router::deepseek_v4<2>{}, fn::sqrtsoftplus);
  n += check(router::ernie4_5<2>{}, fn::softmax);
  n += check(router::sigmoid_bias<2>{}, fn::sigmoid);
  n += check(router::deepseek_v4_hash<2>{}, fn::sqrtsoftplus);
  CHECK(n == 4 * 14);
}

TEST_CASE("table router: experts from the table, weights from the gate", "[router][table]") {
  const std::vector<std::int32_t> tid2eid{3, 0, 1, 2, 2, 3, 0, 1};  // vocab 4, K 2
  int n = 0;
  for (const setting& st : {setting{true, 1e-20, 0, 1.5}, setting{false, 0, 0, 2},
                            setting{true, 0.4, 0, 1}, setting{true, 0, 30, 1}}) {
    router::deepseek_v4_hash<2> r{};
    r.ids = tid2eid.data();
    r.vocab = 4;
    apply(r, st);
    for (std::int64_t tok = 0; tok < 4; ++tok) {
      const auto l = random_logits(4, 20 + static_cast<std::uint64_t>(tok));
      n += check_token(r, l, {tid2eid[tok * 2], tid2eid[tok * 2 + 1]}, st, tok);
    }
    router::table<2, router::score::softmax> s{};
    s.ids = tid2eid.data();
    s.vocab = 4;
    apply(s, st);
    n += check_token(s, random_logits(4, 5), {0, 1}, st, 3);
  }
  CHECK(n == 4 * 5 * (2 + 2 + 4));
}

TEST_CASE("scored routers: bad settings and tables are named", "[router][table][errors]") {
  const layer_config cfg{
      .hidden = 4, .ffn = 4, .experts = 4, .top_k = 2, .ranks = 1, .max_tokens = 4};
  router::deepseek_v4<2> r{};
  r.eps = -1e-6f;
  CHECK_THROWS_WITH(r.validate(cfg), Catch::Contains("router.eps") && Catch::Contains(">= 0"));
  r.eps = NAN;
  CHECK_THROWS_WITH(r.validate(cfg), Catch::Contains("router.eps"));
  r.eps = 0.f;
  r.norm_min = -1.f;
  CHECK_THROWS_WITH(r.validate(cfg), Catch::Contains("router.norm_min"));
  r.norm_min = INFINITY;
  CHECK_THROWS_WITH(r.validate(cfg), Catch::Contains("router.norm_min"));
  r.norm_min = 0.f;
  CHECK_NOTHROW(r.validate(cfg));

  std::vector<std::int32_t> t{0, 1, 2, 3, 1, 0};  // vocab 3
  router::deepseek_v4_hash<2> h{};
  CHECK_THROWS_WITH(h.validate_table(cfg), Catch::Contains("router.vocab"));
  h.vocab = 3;
  CHECK_THROWS_WITH(h.validate_table(cfg), Catch::Contains("router.ids"));
  h.ids = t.data();
  CHECK_NOTHROW(h.validate_table(cfg));
  t[3] = 4;
  CHECK_THROWS_WITH(h.validate_table(cfg),
                    Catch::Contains("router.ids[1][1]") && Catch::Contains("[0, 4)"));
  t[3] = -1;
  CHECK_THROWS_WITH(h.validate_table(cfg), Catch::Contains("router.ids[1][1]"));
  t[3] = 2;
  CHECK_THROWS_WITH(h.validate_table(cfg),
                    Catch::Contains("router.ids[1][1]") && Catch::Contains("distinct"));
  t[3] = 3;
  h.eps = -1.f;
  CHECK_THROWS_WITH(h.validate_table(cfg), Catch::Contains("router.eps"));
  h.eps = 0.f;
  h.scaling = 0.f;
  CHECK_THROWS_WITH(h.validate_table(cfg), Catch::Contains("router.scaling"));
  h.scaling = 1.f;

  // route(): token ids past the table, before anything is written.
  const std::vector<float> logits(8, 0.5f);
  std::vector<std::int32_t> ids(4, -7);
  std::vector<float> w(4, -7.f);
  const std::vector<std::int64_t> tokens{2, 3};
  CHECK_THROWS_WITH(router::route(h, cfg, {logits.data(), 2, 4},
                                  {{ids.data(), 2, 2}, {w.data(), 2, 2}}, {.token_ids = tokens}),
                    Catch::Contains("token_ids[1]") && Catch::Contains("router.vocab = 3"));
  CHECK(ids == std::vector<std::int32_t>(4, -7));
  const std::vector<std::int64_t> ok{2, 0};
  router::route(h, cfg, {logits.data(), 2, 4}, {{ids.data(), 2, 2}, {w.data(), 2, 2}},
                {.token_ids = ok});
  CHECK(ids == std::vector<std::int32_t>{1, 0, 0, 1});
  // A device can't throw mid-pass: a token outside the table routes nowhere.
  int got[2];
  float gw[2];
  h.route_token({logits.data(), nullptr, 4, 7}, got, gw);
  CHECK((got[0] == no_expert && got[1] == no_expert && gw[0] == 0.f && gw[1] == 0.f));
}
