// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <epmoe/reference/backward.hpp>
#include <epmoe/reference/forward.hpp>

// reference::backward against central finite differences of L = Σ dy ⊙ y, y from
// reference::forward_values (the reference forward in double, before its final rounding).
//
// How the check is made: the weights and tokens stay float (full_weights holds floats), so
// each parameter is moved by h ≈ 1e-3 and the step actually taken, float(v ± h) - v, is
// measured exactly in double; the forward then runs in double on those floats. The
// difference quotient's error is then the truncation term h² f''' / 6 (~1e-7 here) plus
// double rounding / h (~1e-13), far below what a wrong formula gives (a wrong factor or a
// missing term is off by ~1e-2 or more on these shapes): the tolerance is 2e-6 absolute plus
// 2e-6 relative (the largest error seen is 2.4e-7). Routing is piecewise constant, so every
// perturbed pass must route exactly as the base pass (checked: a flip fails the test rather than
// passing it by luck), and the gate is drawn continuous (not dyadic) so no two logits tie.
using namespace epmoe;

namespace {

constexpr double step = 1e-3;
constexpr double tol = 2e-6;

layer_config small_config(int shared = 0, bool shared_gate = false, bool output_bias = false) {
  return layer_config{.hidden = 6,
                      .ffn = 5,
                      .experts = 4,
                      .top_k = 2,
                      .ranks = 2,
                      .max_tokens = 8,
                      .shared_experts = shared,
                      .shared_ffn = shared > 0 ? 3 : 0,
                      .shared_gate = shared_gate,
                      .output_bias = output_bias};
}

// Random weights with a continuous gate of logits ~1 (no ties), and random tokens.
reference::full_weights smooth_weights(const layer_config& cfg, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  std::mt19937_64 rng(seed + 100);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& v : w.gate) v = u(rng);
  return w;
}
std::vector<float> uniform(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

struct tally {
  int compared = 0, nonzero = 0;
  double worst = 0;
};

// Every parameter of every tensor (and of x), one at a time, against the backward.
template <class Expert, class Router, class Capacity, class Placement = placement::block>
tally check_gradients(reference::full_weights w, const Router& router, const Capacity& capacity,
                      const std::vector<index_t>& ranks, std::uint64_t seed,
                      const reference::pass_options& opt = {}) {
  const layer_config& cfg = w.cfg;
  const index_t H = cfg.hidden;
  index_t N = 0;
  for (index_t n : ranks) N += n;
  std::vector<float> x = uniform(static_cast<std::size_t>(N * H), seed + 1);
  const std::vector<float> dy = uniform(x.size(), seed + 2);
  const Placement placement(cfg);
  const auto xv = [&] { return matrix_view<const float>{x.data(), N, H}; };
  const auto ids = [&] {
    std::vector<std::int32_t> all;
    for (const auto& r : reference::route_ranks(w, router, xv(), ranks, opt))
      all.insert(all.end(), r.ids.begin(), r.ids.end());
    return all;
  };
  const auto loss = [&] {
    const auto y =
        reference::forward_values<Expert>(w, router, capacity, placement, xv(), ranks, opt);
    double L = 0;
    for (std::size_t i = 0; i < y.size(); ++i) L += double{dy[i]} * y[i];
    return L;
  };
  const reference::gradients g = reference::backward<Expert>(w, router, capacity, placement, xv(),
                                                             ranks, {dy.data(), N, H}, opt);
  const auto base = ids();
  tally out;
  const auto check = [&](const char* name, std::vector<float>& p, const std::vector<double>& d) {
    REQUIRE(d.size() == p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      const float old = p[i];
      p[i] = static_cast<float>(old + step);
      const double up = double{p[i]} - old;
      REQUIRE(ids() == base);  // the same selection: the difference quotient is valid
      const double Lp = loss();
      p[i] = static_cast<float>(old - step);
      const double down = old - double{p[i]};
      REQUIRE(ids() == base);
      const double Lm = loss();
      p[i] = old;
      const double fd = (Lp - Lm) / (up + down);
      const double err = std::abs(fd - d[i]);
      INFO(name << "[" << i << "]: backward " << d[i] << ", finite differences " << fd);
      REQUIRE(std::isfinite(d[i]));
      REQUIRE(err <= tol * (1.0 + std::abs(fd)));
      out.worst = std::max(out.worst, err);
      ++out.compared;
      if (d[i] != 0.0) ++out.nonzero;
    }
  };
  check("gate", w.gate, g.dgate);
  check("w1", w.w1, g.dw1);
  check("w3", w.w3, g.dw3);
  check("w2", w.w2, g.dw2);
  check("b1", w.b1, g.db1);
  check("b2", w.b2, g.db2);
  check("shared_w1", w.shared_w1, g.dshared_w1);
  check("shared_w3", w.shared_w3, g.dshared_w3);
  check("shared_w2", w.shared_w2, g.dshared_w2);
  check("shared_b1", w.shared_b1, g.dshared_b1);
  check("shared_b2", w.shared_b2, g.dshared_b2);
  check("shared_gate", w.shared_gate, g.dshared_gate);
  check("output_bias", w.output_bias, g.doutput_bias);
  check("noise_gate", w.noise_gate, g.dnoise_gate);
  check("x", x, g.dx);
  REQUIRE(out.compared > 0);
  return out;
}

bool all_zero(const std::vector<double>& v) {
  for (double d : v)
    if (d != 0.0) return false;
  return true;
}
bool any_nonzero(const std::vector<double>& v) { return !all_zero(v); }

// Each expert type with shared experts (gated or not) and the output bias, on 1 and 2 ranks.
template <class Expert>
void check_expert(bool shared_gate) {
  const std::vector<std::vector<index_t>> splits{{8}, {5, 3}};
  for (const auto& ranks : splits) {
    CAPTURE(ranks.size(), shared_gate);
    const auto w = smooth_weights(small_config(1, shared_gate, true), 7);
    const auto t =
        check_gradients<Expert>(w, router::mixtral<2>{}, capacity::dropless{}, ranks, 11);
    CHECK(t.nonzero > t.compared / 2);
  }
}

}  // namespace

static_assert(reference::router_with_gradient<router::mixtral<2>> &&
              reference::router_with_gradient<router::sigmoid_bias<2>> &&
              reference::router_with_gradient<router::jitter<router::switch_top1>>);
// The losses' probabilities of sigmoid_bias (normalised sigmoid) also when it is wrapped.
static_assert(reference::detail::normalised_scores_v<router::jitter<router::sigmoid_bias<2>>> &&
              !reference::detail::normalised_scores_v<router::mixtral<2>>);
static_assert(!reference::router_with_gradient<router::sparsemixer>,
              "sparsemixer's gradient is not defined by the reference yet");

TEST_CASE("reference backward: swiglu, shared gate and output bias against finite differences",
          "[reference][backward]") {
  check_expert<expert::swiglu>(true);
  check_expert<expert::swiglu>(false);
}

TEST_CASE("reference backward: geglu and glu gelu_tanh against finite differences",
          "[reference][backward]") {
  check_expert<expert::glu<act::gelu>>(true);
  check_expert<expert::glu<act::gelu_tanh>>(true);
}

TEST_CASE("reference backward: mlp relu with biases and mlp gelu against finite differences",
          "[reference][backward]") {
  check_expert<expert::mlp<act::relu, true>>(true);
  check_expert<expert::mlp<act::gelu>>(false);
}

TEST_CASE("reference backward: topk_softmax variants against finite differences",
          "[reference][backward]") {
  const auto w = smooth_weights(small_config(), 3);
  const std::vector<index_t> two{4, 4};
  SECTION("renormalised, p = 1") {
    check_gradients<expert::swiglu>(w, router::topk_softmax<2, true>{}, capacity::dropless{}, two,
                                    21);
  }
  SECTION("renormalised, p = 2, scaling 2.5") {
    router::topk_softmax<2, true> r;
    r.norm_p = 2.f;
    r.scaling = 2.5f;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, two, 22);
  }
  SECTION("renormalised, p = 3 with K = 3") {
    auto cfg = small_config();
    cfg.top_k = 3;
    router::topk_softmax<3, true> r;
    r.norm_p = 3.f;
    check_gradients<expert::swiglu>(smooth_weights(cfg, 4), r, capacity::dropless{}, two, 23);
  }
  SECTION("not renormalised, scaling 16") {
    router::topk_softmax<2, false> r;
    r.scaling = 16.f;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, two, 24);
  }
  SECTION("top-1, not renormalised (Switch)") {
    auto cfg = small_config();
    cfg.top_k = 1;
    check_gradients<expert::swiglu>(smooth_weights(cfg, 5), router::switch_top1{},
                                    capacity::dropless{}, two, 25);
  }
  SECTION("groups: 2 groups, 1 kept, by top-2 sum and by max") {
    router::topk_softmax<2, true> r;
    r.groups = 2;
    r.top_groups = 1;
    const auto t = check_gradients<expert::swiglu>(w, r, capacity::dropless{}, two, 26);
    CHECK(t.nonzero > 0);
    r.group_by = router::group_score::max;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, two, 27);
  }
}

TEST_CASE("reference backward: sigmoid_bias against finite differences, the bias gets none",
          "[reference][backward]") {
  const auto w = smooth_weights(small_config(), 9);
  const std::vector<float> bias{0.3f, -0.2f, 0.1f, -0.4f};
  const std::vector<index_t> one{8};
  router::sigmoid_bias<2> r;
  r.bias = bias.data();
  SECTION("normalized, scaling 2.5") {
    r.scaling = 2.5f;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, one, 31);
  }
  SECTION("not normalized") {
    r.normalize = false;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, std::vector<index_t>{3, 5}, 32);
  }
  SECTION("groups, both masks") {
    r.groups = 2;
    r.top_groups = 1;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, one, 33);
    r.group_mask = router::group_mask_mode::zero;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, one, 34);
  }
}

TEST_CASE("reference backward: expert choice, hash, noisy top-k, sinkhorn, jitter",
          "[reference][backward]") {
  const std::vector<index_t> two{4, 4};
  SECTION("expert choice") {
    const auto w = smooth_weights(small_config(), 41);
    check_gradients<expert::swiglu>(w, router::expert_choice{}, capacity::dropless{}, two, 41);
  }
  SECTION("hash: no gate gradient") {
    const auto w = smooth_weights(small_config(), 42);
    const std::vector<std::int64_t> ids{5, 17, 2, 9, 30, 1, 8, 4};
    reference::pass_options opt;
    opt.token_ids = ids;
    const auto t = check_gradients<expert::swiglu>(w, router::hash<2>{.seed = 3},
                                                   capacity::dropless{}, two, 42, opt);
    CHECK(t.nonzero > 0);
  }
  SECTION("noisy top-k, training: both gates") {
    const auto w = smooth_weights(small_config(), 43);
    router::noisy_topk<2> r;
    r.training = true;
    r.seed = 5;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, two, 43);
    r.training = false;
    check_gradients<expert::swiglu>(w, r, capacity::dropless{}, two, 44);
  }
  SECTION("sinkhorn, K = 1 and K = 2") {
    auto cfg = small_config();
    cfg.top_k = 1;
    check_gradients<expert::swiglu>(smooth_weights(cfg, 45), router::sinkhorn<1>{},
                                    capacity::dropless{}, two, 45);
    check_gradients<expert::swiglu>(smooth_weights(small_config(), 46), router::sinkhorn<2>{},
                                    capacity::dropless{}, two, 46);
  }
  SECTION("jitter around switch_top1, training") {
    auto cfg = small_config();
    cfg.top_k = 1;
    router::jitter<router::switch_top1> r;
    r.training = true;
    r.eps = 0.1f;
    r.seed = 9;
    check_gradients<expert::swiglu>(smooth_weights(cfg, 47), r, capacity::dropless{}, two, 47);
  }
}

TEST_CASE("reference backward: hash and noisy gates get gradients only where they are used",
          "[reference][backward]") {
  const auto w = smooth_weights(small_config(), 42);
  const std::vector<float> x = uniform(8 * 6, 1), dy = uniform(8 * 6, 2);
  const std::vector<index_t> two{4, 4};
  const matrix_view<const float> xv{x.data(), 8, 6}, dyv{dy.data(), 8, 6};
  const auto h = reference::backward(w, router::hash<2>{}, capacity::dropless{}, xv, two, dyv);
  CHECK(all_zero(h.dgate));
  CHECK(any_nonzero(h.dw1));
  router::noisy_topk<2> r;
  CHECK(all_zero(reference::backward(w, r, capacity::dropless{}, xv, two, dyv).dnoise_gate));
  r.training = true;
  CHECK(any_nonzero(reference::backward(w, r, capacity::dropless{}, xv, two, dyv).dnoise_gate));
  const std::vector<float> bias{5.f, 0.f, 0.f, 0.f};
  router::sigmoid_bias<2> s;
  s.bias = bias.data();
  CHECK(any_nonzero(reference::backward(w, s, capacity::dropless{}, xv, two, dyv).dgate));
}

namespace {
// A capacity of no rows: every routed assignment is dropped.
struct no_room {
  index_t limit(const layer_config&, index_t) const { return 0; }
};
}  // namespace

TEST_CASE("reference backward: capacity drops get exactly zero gradient", "[reference][backward]") {
  auto cfg = small_config(1, true, false);
  cfg.capacity_factor = 0.25;  // ceil(0.25 * 8 * 2 / 4) = 1 row per (rank, expert)
  const auto w = smooth_weights(cfg, 51);
  const std::vector<std::vector<index_t>> splits{{8}, {6, 2}};
  for (const auto& ranks : splits) {
    CAPTURE(ranks.size());
    // The limit drops assignments and the backward still matches finite differences.
    check_gradients<expert::swiglu>(w, router::mixtral<2>{}, capacity::factor<false>{}, ranks, 52);
  }
  // The same under round-robin placement (capacity counts per physical slot).
  check_gradients<expert::swiglu, router::mixtral<2>, capacity::factor<true>,
                  placement::round_robin>(w, router::mixtral<2>{}, capacity::factor<true>{}, {5, 3},
                                          57);
  // Tokens with every assignment dropped and no shared expert: dx exactly zero.
  cfg.shared_experts = 0;
  cfg.shared_gate = false;
  const auto w0 = smooth_weights(cfg, 51);
  const std::vector<float> x = uniform(8 * 6, 53), dy = uniform(8 * 6, 54);
  const matrix_view<const float> xv{x.data(), 8, 6}, dyv{dy.data(), 8, 6};
  const std::vector<index_t> one{8};
  const auto g =
      reference::backward(w0, router::mixtral<2>{}, capacity::factor<false>{}, xv, one, dyv);
  auto route = reference::route_ranks(w0, router::mixtral<2>{}, xv, one).at(0);
  std::vector<int> seen(4, 0);
  int fully_dropped = 0, kept = 0;
  for (index_t t = 0; t < 8; ++t) {
    bool any = false;
    for (index_t k = 0; k < 2; ++k) any |= seen[route.id(t, k)]++ < 1;  // limit 1
    bool zero = true;
    for (index_t h = 0; h < 6; ++h) zero &= g.dx[t * 6 + h] == 0.0;
    CAPTURE(t);
    CHECK(zero == !any);
    fully_dropped += !any;
    kept += any;
  }
  REQUIRE(fully_dropped > 0);
  REQUIRE(kept > 0);
  // Nothing fits: every routed expert and the gate get exactly zero; the shared expert,
  // its gate and the output bias do not.
  auto cfg2 = small_config(1, true, true);
  const auto w2 = smooth_weights(cfg2, 55);
  const auto z = reference::backward(w2, router::mixtral<2>{}, no_room{}, xv, one, dyv);
  CHECK(all_zero(z.dgate));
  CHECK(all_zero(z.dw1));
  CHECK(all_zero(z.dw3));
  CHECK(all_zero(z.dw2));
  CHECK(any_nonzero(z.dshared_w1));
  CHECK(any_nonzero(z.dshared_gate));
  CHECK(any_nonzero(z.doutput_bias));
  CHECK(any_nonzero(z.dx));
  check_gradients<expert::swiglu>(w2, router::mixtral<2>{}, no_room{}, one, 56);
}

namespace {
// The router losses' gradients (gate and x) against finite differences of
// Σ_r scales.aux · aux_r + scales.seq_aux · seq_aux_r + scales.z · z_r.
template <class Router>
int check_loss_gradients(reference::full_weights w, const Router& router,
                         const std::vector<index_t>& ranks, std::uint64_t seed) {
  const index_t H = w.cfg.hidden;
  index_t N = 0;
  for (index_t n : ranks) N += n;
  std::vector<float> x = uniform(static_cast<std::size_t>(N * H), seed);
  const reference::loss_scales scales{1.3, 0.7, 0.05};
  const auto xv = [&] { return matrix_view<const float>{x.data(), N, H}; };
  const auto ids = [&] {
    std::vector<std::int32_t> all;
    for (const auto& r : reference::route_ranks(w, router, xv(), ranks))
      all.insert(all.end(), r.ids.begin(), r.ids.end());
    return all;
  };
  const auto loss = [&] {
    double L = 0;
    for (const auto& l : reference::losses(w, router, xv(), ranks)) {
      REQUIRE(l.valid);
      L += scales.aux * l.aux + scales.seq_aux * l.seq_aux + scales.z * l.z;
    }
    return L;
  };
  const auto g = reference::loss_backward(w, router, xv(), ranks, scales);
  CHECK(all_zero(g.dw1));
  CHECK(all_zero(g.dw2));
  CHECK(all_zero(g.dshared_gate));
  const auto base = ids();
  int compared = 0;
  const auto check = [&](const char* name, std::vector<float>& p, const std::vector<double>& d) {
    REQUIRE(d.size() == p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      const float old = p[i];
      p[i] = static_cast<float>(old + step);
      const double up = double{p[i]} - old;
      REQUIRE(ids() == base);
      const double Lp = loss();
      p[i] = static_cast<float>(old - step);
      const double down = old - double{p[i]};
      REQUIRE(ids() == base);
      const double Lm = loss();
      p[i] = old;
      const double fd = (Lp - Lm) / (up + down);
      INFO(name << "[" << i << "]: backward " << d[i] << ", finite differences " << fd);
      REQUIRE(std::isfinite(d[i]));
      REQUIRE(std::abs(fd - d[i]) <= tol * (1.0 + std::abs(fd)));
      ++compared;
    }
  };
  check("gate", w.gate, g.dgate);
  check("x", x, g.dx);
  REQUIRE(any_nonzero(g.dgate));
  REQUIRE(compared > 0);
  return compared;
}

layer_config loss_config() {
  auto cfg = small_config();
  cfg.aux_loss_coef = 0.5;  // large enough that aux and seq_aux weigh in the sum
  cfg.seq_len = 3;          // sequences of 3 tokens (the last one shorter)
  return cfg;
}
}  // namespace

TEST_CASE("reference losses: the same as the layer's compute_losses", "[reference][backward]") {
  const auto w = smooth_weights(loss_config(), 61);
  const std::vector<float> x = uniform(7 * 6, 62);
  const std::vector<index_t> one{7};
  const matrix_view<const float> xv{x.data(), 7, 6};
  const auto compare = [&](const auto& router) {
    const auto route = reference::route_ranks(w, router, xv, one).at(0);
    std::vector<float> logits(7 * 4), weights(route.weights.begin(), route.weights.end());
    for (index_t t = 0; t < 7; ++t)
      for (index_t e = 0; e < 4; ++e) {
        double s = 0;
        for (index_t h = 0; h < 6; ++h) s += double{x[t * 6 + h]} * w.gate[e * 6 + h];
        logits[t * 4 + e] = static_cast<float>(s);
      }
    const routing_view rv{{route.ids.data(), 7, route.width}, {weights.data(), 7, route.width}};
    std::vector<float> probs(7 * 4);
    std::vector<double> acc(8);
    router_losses layer;
    compute_losses(router, w.cfg, {logits.data(), 7, 4}, rv, probs, acc, layer);
    const auto ref = reference::losses(w, router, xv, one).at(0);
    REQUIRE(layer.valid);
    REQUIRE(ref.valid);
    CHECK(ref.aux > 0);
    CHECK(ref.seq_aux > 0);
    CHECK(ref.z > 0);
    CHECK(ref.aux == Approx(layer.aux).epsilon(1e-5));
    CHECK(ref.seq_aux == Approx(layer.seq_aux).epsilon(1e-5));
    CHECK(ref.z == Approx(layer.z).epsilon(1e-5));
  };
  compare(router::mixtral<2>{});
  compare(router::sigmoid_bias<2>{});
  compare(router::expert_choice{});
}

TEST_CASE("reference loss_backward: aux, sequence aux and z-loss against finite differences",
          "[reference][backward]") {
  const auto w = smooth_weights(loss_config(), 63);
  const std::vector<index_t> two{4, 3};
  SECTION("topk_softmax") { check_loss_gradients(w, router::mixtral<2>{}, two, 64); }
  SECTION("sigmoid_bias, and jittered while training") {
    const std::vector<float> bias{0.3f, -0.2f, 0.1f, -0.4f};
    router::sigmoid_bias<2> s;
    s.bias = bias.data();
    check_loss_gradients(w, s, two, 65);
    router::jitter<router::sigmoid_bias<2>> j;
    j.bias = bias.data();
    j.training = true;
    j.eps = 0.1f;
    check_loss_gradients(w, j, two, 66);
  }
  SECTION("expert choice") { check_loss_gradients(w, router::expert_choice{}, two, 67); }
  SECTION("noisy top-k while training") {
    router::noisy_topk<2> r;
    r.training = true;
    r.seed = 3;
    check_loss_gradients(w, r, two, 68);
  }
}
