// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <epmoe/core/losses.hpp>
#include <epmoe/router/expert_choice.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/sinkhorn.hpp>
#include <epmoe/router/topk_softmax.hpp>

using epmoe::layer_config;
using epmoe::router_losses;
namespace router = epmoe::router;

namespace {

layer_config config(int experts, int top_k, int max_tokens, double alpha = 0.01, int seq_len = 0) {
  layer_config c;
  c.hidden = 8;
  c.ffn = 16;
  c.experts = experts;
  c.top_k = top_k;
  c.max_tokens = max_tokens;
  c.aux_loss_coef = alpha;
  c.seq_len = seq_len;
  return c;
}

// A pass: logits [T, E] and its routing [T, slots].
struct pass {
  int T = 0, E = 0, slots = 0;
  std::vector<float> logits;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

template <class Router>
router_losses losses(const Router& r, const layer_config& cfg, const pass& p) {
  std::vector<float> probs(static_cast<std::size_t>(p.T * p.E));
  std::vector<double> acc(static_cast<std::size_t>(2 * p.E));
  router_losses out{-1, -1, -1, false};  // must be overwritten
  epmoe::compute_losses(r, cfg, {p.logits.data(), p.T, p.E},
                        {{p.ids.data(), p.T, p.slots}, {p.weights.data(), p.T, p.slots}}, probs,
                        acc, out);
  return out;
}

// Routes every token of p.logits with a token router.
template <class Router>
void route_all(const Router& r, pass& p) {
  p.slots = Router::top_k;
  p.ids.assign(static_cast<std::size_t>(p.T * p.slots), -7);
  p.weights.assign(static_cast<std::size_t>(p.T * p.slots), 0.f);
  for (int t = 0; t < p.T; ++t) {
    std::vector<int> ids(static_cast<std::size_t>(p.slots));
    r.route_token({p.logits.data() + t * p.E, nullptr, p.E, t}, ids.data(),
                  p.weights.data() + t * p.slots);
    for (int k = 0; k < p.slots; ++k) p.ids[static_cast<std::size_t>(t * p.slots + k)] = ids[k];
  }
}

// ---- the expected side: plain double, nothing from epmoe::math ----

std::vector<double> softmax_row(const float* l, int E) {
  double m = l[0];
  for (int e = 0; e < E; ++e) m = std::max(m, double{l[e]});
  std::vector<double> p(static_cast<std::size_t>(E));
  double s = 0;
  for (int e = 0; e < E; ++e) s += p[e] = std::exp(l[e] - m);
  for (double& x : p) x /= s;
  return p;
}

std::vector<double> sigmoid_share_row(const float* l, int E) {
  std::vector<double> p(static_cast<std::size_t>(E));
  double s = 0;
  for (int e = 0; e < E; ++e) s += p[e] = 1 / (1 + std::exp(-double{l[e]}));
  for (double& x : p) x /= s;
  return p;
}

using prob_fn = std::vector<double> (*)(const float*, int);

// alpha * E * sum_i f_i P_i over tokens [begin, end): f_i = assignments to i / (n K),
// P_i = mean probability of i. Empty slots (negative ids) count for nobody.
double aux_ref(const pass& p, int begin, int end, int K, double alpha, prob_fn probs) {
  const int n = end - begin;
  std::vector<double> f(static_cast<std::size_t>(p.E), 0), P(static_cast<std::size_t>(p.E), 0);
  for (int t = begin; t < end; ++t) {
    for (int k = 0; k < p.slots; ++k) {
      const int e = p.ids[t * p.slots + k];
      if (e >= 0) f[e] += 1.0 / (n * K);
    }
    const auto row = probs(p.logits.data() + t * p.E, p.E);
    for (int e = 0; e < p.E; ++e) P[e] += row[e] / n;
  }
  double s = 0;
  for (int e = 0; e < p.E; ++e) s += f[e] * P[e];
  return alpha * p.E * s;
}

double z_ref(const pass& p) {
  double z = 0;
  for (int t = 0; t < p.T; ++t) {
    const float* l = p.logits.data() + t * p.E;
    double m = l[0], s = 0;
    for (int e = 0; e < p.E; ++e) m = std::max(m, double{l[e]});
    for (int e = 0; e < p.E; ++e) s += std::exp(l[e] - m);
    const double lse = m + std::log(s);
    z += lse * lse;
  }
  return z / p.T;
}

pass random_pass(std::mt19937& rng, int T, int E, float scale, float shift = 0.f) {
  std::normal_distribution<float> d(shift, scale);
  pass p{T, E, 0, std::vector<float>(static_cast<std::size_t>(T * E)), {}, {}};
  for (float& x : p.logits) x = d(rng);
  return p;
}

}  // namespace

TEST_CASE("losses: perfectly uniform routing gives aux == alpha", "[losses]") {
  constexpr int E = 4, T = 8;
  for (double alpha : {0.01, 0.5, 1.0}) {
    for (int K : {1, 2}) {
      // Every expert equally likely for every token (a token's logits all equal), and the
      // routing spread evenly: token t -> t mod E (and t + 1 mod E).
      pass p{T, E, K, {}, {}, {}};
      for (int t = 0; t < T; ++t)
        for (int e = 0; e < E; ++e) p.logits.push_back(0.25f * static_cast<float>(t));
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k) p.ids.push_back((t + k) % E);
      p.weights.assign(p.ids.size(), 1.f / K);
      INFO("alpha = " << alpha << ", K = " << K);
      const auto cfg = config(E, K, T, alpha);
      router_losses out;
      if (K == 1)
        out = losses(router::switch_top1{}, cfg, p);
      else
        out = losses(router::gshard_top2{}, cfg, p);
      CHECK(out.valid);
      CHECK(out.aux == Approx(alpha).epsilon(1e-12));
      CHECK(out.seq_aux == Approx(alpha).epsilon(1e-12));
    }
  }
}

TEST_CASE("losses: aux grows with skew", "[losses]") {
  constexpr int E = 4, T = 64, K = 1;
  const double alpha = 0.1;
  const auto cfg = config(E, K, T, alpha);
  std::mt19937 rng(21);
  const auto base = random_pass(rng, T, E, 1.f);
  double previous = 0;
  for (float level : {0.f, 0.5f, 1.f, 2.f, 4.f, 8.f, 16.f}) {
    // The same random logits with `level` added to expert 0 for every token: more tokens
    // choose expert 0 and its probability grows.
    pass p = base;
    for (int t = 0; t < T; ++t) p.logits[static_cast<std::size_t>(t * E)] += level;
    route_all(router::switch_top1{}, p);
    const auto out = losses(router::switch_top1{}, cfg, p);
    INFO("level = " << level << ", aux = " << out.aux);
    REQUIRE(out.valid);
    CHECK(out.aux == Approx(aux_ref(p, 0, T, K, alpha, softmax_row)).epsilon(1e-6));
    CHECK(out.aux > previous);
    previous = out.aux;
  }
  CHECK(previous > 0.99 * alpha * E);  // everything on one expert, P ~ 1: alpha * E
  CHECK(previous <= alpha * E);
}

TEST_CASE("losses: match an independent computation on random passes", "[losses]") {
  std::mt19937 rng(404);
  for (int trial = 0; trial < 30; ++trial) {
    const int E = 2 + static_cast<int>(rng() % 10), T = 1 + static_cast<int>(rng() % 40);
    auto p = random_pass(rng, T, E, 2.f);
    const double alpha = 0.01 * (1 + trial % 5);
    INFO("T = " << T << ", E = " << E);
    // topk_softmax<2>
    route_all(router::topk_softmax<2>{}, p);
    auto out = losses(router::topk_softmax<2>{}, config(E, 2, T, alpha), p);
    REQUIRE(out.valid);
    REQUIRE(out.aux == Approx(aux_ref(p, 0, T, 2, alpha, softmax_row)).epsilon(1e-5));
    REQUIRE(out.seq_aux == Approx(out.aux).epsilon(1e-12));  // seq_len 0: the whole pass
    REQUIRE(out.z == Approx(z_ref(p)).epsilon(1e-5));
    // sigmoid_bias<1>: P is the normalised sigmoid score.
    route_all(router::sigmoid_bias<1>{}, p);
    out = losses(router::sigmoid_bias<1>{}, config(E, 1, T, alpha), p);
    REQUIRE(out.valid);
    REQUIRE(out.aux == Approx(aux_ref(p, 0, T, 1, alpha, sigmoid_share_row)).epsilon(1e-5));
    REQUIRE(out.z == Approx(z_ref(p)).epsilon(1e-5));
    // noisy_topk<1> (even training: the loss sees the clean logits) and jitter: softmax.
    route_all(router::switch_top1{}, p);
    const auto cfg = config(E, 1, T, alpha);
    const double want = aux_ref(p, 0, T, 1, alpha, softmax_row);
    router::noisy_topk<1> noisy;
    noisy.training = true;
    REQUIRE(losses(noisy, cfg, p).aux == Approx(want).epsilon(1e-5));
    REQUIRE(losses(router::jitter<router::switch_top1>{}, cfg, p).aux ==
            Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("losses: z-loss is mean_t logsumexp(logits)^2", "[losses]") {
  SECTION("by hand: one token of two zero logits") {
    pass p{1, 2, 1, {0.f, 0.f}, {0}, {1.f}};
    const double ln2 = std::log(2.0);
    CHECK(losses(router::switch_top1{}, config(2, 1, 1), p).z == Approx(ln2 * ln2).epsilon(1e-6));
  }
  SECTION("large logits stay finite and exact") {
    std::mt19937 rng(12);
    auto p = random_pass(rng, 20, 8, 3.f, 60.f);  // logits around 60: exp would overflow
    route_all(router::switch_top1{}, p);
    const auto out = losses(router::switch_top1{}, config(8, 1, 20), p);
    REQUIRE(std::isfinite(out.z));
    CHECK(out.z == Approx(z_ref(p)).epsilon(1e-5));
    CHECK(std::isfinite(out.aux));
  }
  SECTION("z does not depend on alpha or the routing") {
    std::mt19937 rng(13);
    auto p = random_pass(rng, 16, 4, 1.f);
    route_all(router::switch_top1{}, p);
    const double a = losses(router::switch_top1{}, config(4, 1, 16, 0.01), p).z;
    std::fill(p.ids.begin(), p.ids.end(), 3);
    const double b = losses(router::switch_top1{}, config(4, 1, 16, 0.7), p).z;
    CHECK(a == b);
    CHECK(a == Approx(z_ref(p)).epsilon(1e-5));
  }
}

TEST_CASE("losses: sequence-level aux is the mean of per-sequence aux losses", "[losses]") {
  const double alpha = 0.05;
  SECTION("every sequence on its own expert: balanced overall, skewed per sequence") {
    constexpr int E = 3, L = 4, T = 12;
    pass p{T, E, 1, std::vector<float>(T * E, 0.f), {}, {}};
    for (int t = 0; t < T; ++t) {
      p.logits[static_cast<std::size_t>(t * E + t / L)] = 3.f;
      p.ids.push_back(t / L);
      p.weights.push_back(1.f);
    }
    const auto out = losses(router::switch_top1{}, config(E, 1, T, alpha, L), p);
    double want = 0;
    for (int s = 0; s < T / L; ++s) want += aux_ref(p, s * L, (s + 1) * L, 1, alpha, softmax_row);
    want /= T / L;
    CHECK(out.seq_aux == Approx(want).epsilon(1e-6));
    CHECK(out.aux == Approx(aux_ref(p, 0, T, 1, alpha, softmax_row)).epsilon(1e-6));
    CHECK(out.aux == Approx(alpha).epsilon(1e-6));  // each expert: 1/3 of tokens, mean P 1/3
    CHECK(out.seq_aux > 2.5 * out.aux);             // alpha * 3 * softmax(3, 0, 0)[0]
  }
  SECTION("random passes, K = 2, seq_len dividing T") {
    std::mt19937 rng(77);
    for (int trial = 0; trial < 20; ++trial) {
      const int E = 2 + static_cast<int>(rng() % 8), L = 1 + static_cast<int>(rng() % 8);
      const int S = 1 + static_cast<int>(rng() % 6), T = S * L;
      auto p = random_pass(rng, T, E, 1.5f);
      route_all(router::gshard_top2{}, p);
      const auto out = losses(router::gshard_top2{}, config(E, 2, T, alpha, L), p);
      double want = 0;
      for (int s = 0; s < S; ++s) want += aux_ref(p, s * L, (s + 1) * L, 2, alpha, softmax_row);
      want /= S;
      INFO("E = " << E << ", L = " << L << ", sequences = " << S);
      REQUIRE(out.seq_aux == Approx(want).epsilon(1e-5));
      REQUIRE(out.aux == Approx(aux_ref(p, 0, T, 2, alpha, softmax_row)).epsilon(1e-5));
      // seq_len == T is the whole pass again.
      REQUIRE(losses(router::gshard_top2{}, config(E, 2, T, alpha, T), p).seq_aux ==
              Approx(out.aux).epsilon(1e-12));
    }
  }
}

TEST_CASE("losses: expert choice is balanced by construction, aux == alpha", "[losses]") {
  constexpr int E = 4, T = 16, K = 2;  // C = T K / E = 8: f_i = 1/E exactly
  const double alpha = 0.02;
  std::mt19937 rng(5);
  auto p = random_pass(rng, T, E, 2.f);
  const auto cfg = config(E, K, T, alpha);
  p.slots = E;
  p.ids.assign(T * E, 0);
  p.weights.assign(T * E, 0.f);
  std::vector<float> fs(static_cast<std::size_t>(router::expert_choice::scratch_floats(cfg)));
  std::vector<std::int32_t> is(static_cast<std::size_t>(router::expert_choice::scratch_ints(cfg)));
  router::expert_choice{}.route_batch(cfg, {p.logits.data(), T, E},
                                      {{p.ids.data(), T, E}, {p.weights.data(), T, E}}, fs, is);
  const auto out = losses(router::expert_choice{}, cfg, p);
  REQUIRE(out.valid);
  CHECK(out.aux == Approx(alpha).epsilon(1e-6));
  CHECK(out.aux == Approx(aux_ref(p, 0, T, K, alpha, softmax_row)).epsilon(1e-6));
  CHECK(out.z == Approx(z_ref(p)).epsilon(1e-5));
}

TEST_CASE("losses: sinkhorn reports the softmax losses of its routing", "[losses]") {
  constexpr int E = 6, T = 24, K = 2;
  std::mt19937 rng(6);
  auto p = random_pass(rng, T, E, 2.f);
  const auto cfg = config(E, K, T, 0.01);
  p.slots = K;
  p.ids.assign(T * K, 0);
  p.weights.assign(T * K, 0.f);
  std::vector<float> fs(static_cast<std::size_t>(router::sinkhorn<K>::scratch_floats(cfg)));
  router::sinkhorn<K>{}.route_batch(cfg, {p.logits.data(), T, E},
                                    {{p.ids.data(), T, K}, {p.weights.data(), T, K}}, fs, {});
  const auto out = losses(router::sinkhorn<K>{}, cfg, p);
  REQUIRE(out.valid);
  CHECK(out.aux == Approx(aux_ref(p, 0, T, K, 0.01, softmax_row)).epsilon(1e-5));
  CHECK(out.z == Approx(z_ref(p)).epsilon(1e-5));
}

TEST_CASE("losses: invalid (all zero) for a router without a gate", "[losses]") {
  std::mt19937 rng(8);
  auto p = random_pass(rng, 10, 4, 1.f);
  p.slots = 2;
  p.ids.assign(20, 1);
  p.weights.assign(20, 0.5f);
  const auto out = losses(router::hash<2>{}, config(4, 2, 10), p);
  CHECK_FALSE(out.valid);
  CHECK(out.aux == 0);
  CHECK(out.seq_aux == 0);
  CHECK(out.z == 0);
}

TEST_CASE("losses: an empty pass is valid and zero", "[losses]") {
  pass p{0, 4, 1, {}, {}, {}};
  const auto out = losses(router::switch_top1{}, config(4, 1, 4), p);
  CHECK(out.valid);
  CHECK(out.aux == 0);
  CHECK(out.seq_aux == 0);
  CHECK(out.z == 0);
}

namespace {

// Hugging Face Mixtral's load_balancing_loss_func (modeling_mixtral.py, no attention mask),
// written out in plain double: softmax over the experts, top-K, one-hot mask [T, K, E]
// averaged over tokens to [K, E], times the mean probability [E], summed, times E.
double hf_mixtral_loss(const pass& p, int K) {
  std::vector<double> tokens_per_expert(static_cast<std::size_t>(K * p.E), 0);
  std::vector<double> prob_per_expert(static_cast<std::size_t>(p.E), 0);
  for (int t = 0; t < p.T; ++t) {
    const auto prob = softmax_row(p.logits.data() + t * p.E, p.E);
    std::vector<int> order(static_cast<std::size_t>(p.E));
    for (int e = 0; e < p.E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
    for (int k = 0; k < K; ++k) tokens_per_expert[k * p.E + order[k]] += 1.0 / p.T;
    for (int e = 0; e < p.E; ++e) prob_per_expert[e] += prob[e] / p.T;
  }
  double loss = 0;
  for (int k = 0; k < K; ++k)
    for (int e = 0; e < p.E; ++e) loss += tokens_per_expert[k * p.E + e] * prob_per_expert[e];
  return loss * p.E;
}

}  // namespace

TEST_CASE("losses: aux is Switch's, Hugging Face Mixtral's value is K / alpha times it",
          "[losses][hf]") {
  CHECK(layer_config{}.aux_loss_coef == 0.01);  // Switch's alpha, as docs/routers.md says
  std::mt19937 rng(77);
  int checked = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int E = 4 + static_cast<int>(rng() % 6), T = 3 + static_cast<int>(rng() % 20);
    const int K = 1 + trial % 3;
    auto p = random_pass(rng, T, E, 1.5f);
    INFO("T = " << T << ", E = " << E << ", K = " << K);
    const double alpha = 0.01, hf = hf_mixtral_loss(p, K);
    router_losses out;
    if (K == 1) {
      route_all(router::mixtral<1>{}, p);
      out = losses(router::mixtral<1>{}, config(E, 1, T, alpha), p);
    } else if (K == 2) {
      route_all(router::mixtral<2>{}, p);
      out = losses(router::mixtral<2>{}, config(E, 2, T, alpha), p);
    } else {
      route_all(router::mixtral<3>{}, p);
      out = losses(router::mixtral<3>{}, config(E, 3, T, alpha), p);
    }
    REQUIRE(out.valid);
    CHECK(out.aux * K / alpha == Approx(hf).epsilon(1e-5));
    // HF's training term router_aux_loss_coef * loss: aux with aux_loss_coef = K * coef.
    const double coef = 0.02;
    pass q = p;
    const auto scaled = K == 1   ? losses(router::mixtral<1>{}, config(E, 1, T, K * coef), q)
                        : K == 2 ? losses(router::mixtral<2>{}, config(E, 2, T, K * coef), q)
                                 : losses(router::mixtral<3>{}, config(E, 3, T, K * coef), q);
    CHECK(scaled.aux == Approx(coef * hf).epsilon(1e-5));
    ++checked;
  }
  CHECK(checked == 24);
}
