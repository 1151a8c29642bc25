// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The MoE blocks of published models that need more than a router and SwiGLU: each block's
// computation written here in float64 from its published formula (apart from the library's
// reference), the reference checked against it, then the layer on 1, 2 and 4 ranks against
// the reference.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <vector>

#include "harness.hpp"
#include <epmoe/expert/mlp.hpp>
#include <epmoe/sim/simulate.hpp>
#include <epmoe/sim/source.hpp>
#include <epmoe/sim/topology.hpp>

// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_models_tests {
using namespace epmoe;

namespace {

template <class Space, class Router, class Expert>
struct model_policies : test::router_policies<Space, Router> {
  using expert = Expert;
};

/// Softmax routing as the models' code writes it: p = softmax(l); with groups, DeepSeek-V2's
/// group_limited_greedy (a group's score its max p, the best top_groups kept, the others' p
/// filled with 0.0); the top-K p, divided by their sum when `renormalize`, times `scaling`.
struct softmax_routing {
  bool renormalize = true;
  int groups = 1, top_groups = 1;
  double scaling = 1;
};
struct top_k_choice {
  std::vector<int> ids;
  std::vector<double> weights;
};
top_k_choice softmax_top_k(const reference::full_weights& w, const float* x, int k,
                           softmax_routing r) {
  const index_t E = w.cfg.experts, H = w.cfg.hidden;
  std::vector<double> p(static_cast<std::size_t>(E));
  double max = -std::numeric_limits<double>::infinity(), sum = 0;
  for (index_t e = 0; e < E; ++e) {
    double l = 0;
    for (index_t i = 0; i < H; ++i) l += double{w.gate[e * H + i]} * x[i];
    p[e] = l;
    max = std::max(max, l);
  }
  for (double& v : p) sum += (v = std::exp(v - max));
  for (double& v : p) v /= sum;
  if (r.groups > 1) {
    const index_t size = E / r.groups;
    std::vector<std::pair<double, int>> score;  // (-max p, group): sorted best first
    for (int g = 0; g < r.groups; ++g)
      score.push_back({-*std::max_element(p.begin() + g * size, p.begin() + (g + 1) * size), g});
    std::sort(score.begin(), score.end());
    std::vector<double> masked(p.size(), 0.0);
    for (int j = 0; j < r.top_groups; ++j)
      for (index_t e = score[j].second * size; e < (score[j].second + 1) * size; ++e)
        masked[e] = p[e];
    p = masked;
  }
  top_k_choice c;
  std::vector<char> taken(static_cast<std::size_t>(E), 0);
  double chosen = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (index_t e = 0; e < E; ++e)
      if (!taken[e] && (best < 0 || p[e] > p[best])) best = static_cast<int>(e);
    taken[best] = 1;
    c.ids.push_back(best);
    c.weights.push_back(p[best]);
    chosen += p[best];
  }
  for (double& v : c.weights) v *= (r.renormalize ? 1 / chosen : 1.0) * r.scaling;
  return c;
}

double dot(const float* a, const float* x, index_t n) {
  double s = 0;
  for (index_t i = 0; i < n; ++i) s += double{a[i]} * x[i];
  return s;
}

/// One FFN in float64: W2 act(W1 x + b1) (⊙ W3 x when gated) + b2, weights [F, H], [H, F].
template <class Act>
std::vector<double> ffn(const float* w1, const float* w3, const float* w2, const float* b1,
                        const float* b2, const float* x, index_t H, index_t F, Act act) {
  std::vector<double> h(static_cast<std::size_t>(F)), y(static_cast<std::size_t>(H));
  for (index_t f = 0; f < F; ++f) {
    const double a = dot(w1 + f * H, x, H) + (b1 ? b1[f] : 0.0);
    h[f] = act(a) * (w3 ? dot(w3 + f * H, x, H) : 1.0);
  }
  for (index_t o = 0; o < H; ++o) {
    double s = b2 ? b2[o] : 0.0;
    for (index_t f = 0; f < F; ++f) s += double{w2[o * F + f]} * h[f];
    y[o] = s;
  }
  return y;
}

/// The whole block on every token: routed experts (softmax top-K), shared experts, their gate
/// and the output bias, as the model's code composes them.
template <class Act>
std::vector<float> block(const reference::full_weights& w, const std::vector<float>& x, bool gated,
                         bool biases, softmax_routing routing, Act act) {
  const layer_config& c = w.cfg;
  const index_t H = c.hidden, F = c.ffn, Fs = c.shared_width(),
                T = static_cast<index_t>(x.size()) / H;
  std::vector<float> y(x.size());
  for (index_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * H;
    std::vector<double> out(static_cast<std::size_t>(H), 0.0);
    const top_k_choice route = softmax_top_k(w, xt, c.top_k, routing);
    for (int k = 0; k < c.top_k; ++k) {
      const index_t e = route.ids[k];
      const auto v = ffn(w.w1.data() + e * F * H, gated ? w.w3.data() + e * F * H : nullptr,
                         w.w2.data() + e * H * F, biases ? w.b1.data() + e * F : nullptr,
                         biases ? w.b2.data() + e * H : nullptr, xt, H, F, act);
      for (index_t o = 0; o < H; ++o) out[o] += route.weights[k] * v[o];
    }
    for (index_t s = 0; s < c.shared_experts; ++s) {
      const auto v = ffn(w.shared_w1.data() + s * Fs * H, w.shared_w3.data() + s * Fs * H,
                         w.shared_w2.data() + s * H * Fs, nullptr, nullptr, xt, H, Fs, act);
      const double g =
          c.shared_gate ? 1.0 / (1.0 + std::exp(-dot(w.shared_gate.data() + s * H, xt, H))) : 1.0;
      for (index_t o = 0; o < H; ++o) out[o] += g * v[o];
    }
    for (index_t o = 0; o < H; ++o)
      y[t * H + o] = static_cast<float>(out[o] + (c.output_bias ? w.output_bias[o] : 0.0));
  }
  return y;
}

const auto silu = [](double a) { return a / (1 + std::exp(-a)); };
const auto relu = [](double a) { return a > 0 ? a : 0.0; };
const auto gelu = [](double a) { return a * 0.5 * std::erfc(-a / std::sqrt(2.0)); };
const auto gelu_tanh = [](double a) {
  return 0.5 * a * (1 + std::tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)));
};

/// The family's block from its formula vs the reference vs the layer on 1, 2 and 4 ranks.
template <class Space, class Router, class Expert, class Act>
void check_family(layer_config cfg, bool gated, bool biases, softmax_routing routing, Act act,
                  std::uint64_t seed, Router router = {}) {
  using P = model_policies<Space, Router, Expert>;
  const test::run_options<P> opt{.router = router};
  int ran = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    cfg.ranks = R;
    const auto w = reference::full_weights::random(cfg, seed);
    std::vector<index_t> per_rank(R, 24);
    if (R > 2) per_rank[2] = 0;  // an idle rank
    const auto g = test::make_tokens(per_rank, cfg.hidden, seed + 1);
    const auto want = test::run_reference<P>(cfg, w, g, opt);
    CHECK(test::relative_error(want, block(w, g.x, gated, biases, routing, act)) <= 1e-12);
    const auto got = test::run_layer<P>(cfg, w, g, opt);
    CHECK(test::relative_error(got.y, want) <= test::tolerance<Space>(1e-4));
    ++ran;
  }
  CHECK(ran == 3);
}

layer_config family(int top_k, int experts = 8) {
  return {.hidden = 16,
          .ffn = 12,
          .experts = experts,
          .top_k = top_k,
          .ranks = 1,
          .max_tokens = 24,
          .capacity_factor = 1.0};
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("models: Switch Transformer, ReLU MLP experts without biases",
                        "[layer][models]", test::spaces) {
  check_family<TestType, router::switch_top1, expert::mlp<act::relu>>(
      family(1), false, false, {.renormalize = false}, relu, 41);
}

TEMPLATE_LIST_TEST_CASE("models: NLLB-MoE, ReLU MLP experts with biases, top-2", "[layer][models]",
                        test::spaces) {
  check_family<TestType, router::gshard_top2, expert::mlp<act::relu, true>>(
      family(2), false, true, {.renormalize = true}, relu, 42);
}

TEMPLATE_LIST_TEST_CASE("models: GShard with GELU and GELU-tanh MLP experts", "[layer][models]",
                        test::spaces) {
  check_family<TestType, router::gshard_top2, expert::mlp<act::gelu, true>>(
      family(2), false, true, {.renormalize = true}, gelu, 43);
  check_family<TestType, router::gshard_top2, expert::mlp<act::gelu_tanh>>(
      family(2), false, false, {.renormalize = true}, gelu_tanh, 44);
}

TEMPLATE_LIST_TEST_CASE("models: GeGLU experts (gated, GELU-tanh)", "[layer][models]",
                        test::spaces) {
  check_family<TestType, router::mixtral<2>, expert::glu<act::gelu_tanh>>(
      family(2), true, false, {.renormalize = true}, gelu_tanh, 45);
}

TEMPLATE_LIST_TEST_CASE("models: Qwen2-MoE, a shared expert scaled per token by its sigmoid gate",
                        "[layer][models]", test::spaces) {
  layer_config cfg = family(4);
  cfg.shared_experts = 1;
  cfg.shared_ffn = 20;
  cfg.shared_gate = true;
  check_family<TestType, router::qwen<4, false>, expert::swiglu>(cfg, true, false,
                                                                 {.renormalize = false}, silu, 46);
  // Without the gate the same weights give another output: the gate is not silently ignored.
  const auto w = reference::full_weights::random(cfg, 46);
  const auto g = test::make_tokens({24}, cfg.hidden, 47);
  reference::full_weights plain = w;
  plain.cfg.shared_gate = false;
  CHECK(test::relative_error(block(w, g.x, true, false, {.renormalize = false}, silu),
                             block(plain, g.x, true, false, {.renormalize = false}, silu)) > 1e-2);
}

TEMPLATE_LIST_TEST_CASE(
    "models: Qwen3-MoE and OLMoE, softmax top-8 of 16 with and without "
    "norm_topk_prob",
    "[layer][models]", test::spaces) {
  check_family<TestType, router::qwen<8, true>, expert::swiglu>(family(8, 16), true, false,
                                                                {.renormalize = true}, silu, 50);
  check_family<TestType, router::qwen<8, false>, expert::swiglu>(family(8, 16), true, false,
                                                                 {.renormalize = false}, silu, 51);
}

TEMPLATE_LIST_TEST_CASE(
    "models: DeepSeek-V2, group-limited greedy by the group's max, routed "
    "scaling 16, two shared experts",
    "[layer][models]", test::spaces) {
  layer_config cfg = family(4, 16);
  cfg.shared_experts = 2;
  const router::deepseek_v2<4> v2{
      .groups = 4, .top_groups = 2, .scaling = 16.f, .group_by = router::group_score::max};
  check_family<TestType, router::deepseek_v2<4>, expert::swiglu>(
      cfg, true, false, {.renormalize = false, .groups = 4, .top_groups = 2, .scaling = 16}, silu,
      52, v2);
  // The V3 group score (two best) on the same weights routes differently: the option counts.
  const auto w = reference::full_weights::random(cfg, 52);
  const auto g = test::make_tokens({24}, cfg.hidden, 53);
  using P = model_policies<TestType, router::deepseek_v2<4>, expert::swiglu>;
  test::run_options<P> v3{.router = v2};
  v3.router.group_by = router::group_score::top2_sum;
  cfg.ranks = 1;
  CHECK(test::relative_error(test::run_reference<P>(cfg, w, g, v3),
                             test::run_reference<P>(cfg, w, g, {.router = v2})) > 1e-3);
}

TEMPLATE_LIST_TEST_CASE("models: JetMoE, an output bias after the weighted sum", "[layer][models]",
                        test::spaces) {
  layer_config cfg = family(2);
  cfg.output_bias = true;
  check_family<TestType, router::mixtral<2>, expert::swiglu>(cfg, true, false,
                                                             {.renormalize = true}, silu, 48);
}

TEMPLATE_LIST_TEST_CASE("models: shared gate and output bias with no shared expert rows to run",
                        "[layer][models]", test::spaces) {
  // Output bias alone (no shared experts): the home rank's terms are the bias only.
  layer_config cfg = family(1);
  cfg.output_bias = true;
  check_family<TestType, router::switch_top1, expert::mlp<act::relu, true>>(
      cfg, false, true, {.renormalize = false}, relu, 49);
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
TEST_CASE("models: shared_gate without shared experts, a missing gate or bias are named",
          "[layer][models]") {
  layer_config cfg = family(2);
  cfg.shared_gate = true;
  CHECK_THROWS_WITH(cfg.validate(),
                    Catch::Contains("shared_gate") && Catch::Contains("needs shared_experts > 0"));
  struct P : default_policies {};
  cfg.shared_experts = 1;
  const auto w = reference::full_weights::random(cfg, 3);
  const auto mine = reference::slice(w, placement::block(cfg), 0);
  const moe_layer<P>::weights views{w.gate_view(), mine.experts(), w.shared()};
  const auto field = [&](const layer_config& c) -> std::string {
    try {
      moe_layer<P> layer(c, comm::local{}, views);
    } catch (const config_error& e) {
      return e.field();
    }
    return "<constructed without error>";
  };
  CHECK(field(cfg) == "weights.shared_gate");
  cfg.shared_gate = false;
  cfg.output_bias = true;
  CHECK(field(cfg) == "weights.output_bias");
  cfg.output_bias = false;
  CHECK(field(cfg) == "<constructed without error>");
}

TEST_CASE("models: the simulator prices each expert type by its own FLOPs",
          "[layer][models][sim]") {
  const layer_config cfg{
      .hidden = 64, .ffn = 128, .experts = 4, .top_k = 1, .ranks = 2, .max_tokens = 400};
  const sim::recorded_source src({{0, 0, 400, 1, {100, 100, 150, 50}}, {0, 1, 0, 1, {0, 0, 0, 0}}});
  sim::topology topo = sim::preset("h200", 1);
  topo.ranks_per_node = 2;
  const auto swiglu =
      sim::simulate<sim::policies<placement::block, capacity::dropless, false, expert::swiglu>>(
          cfg, topo, src);
  const auto relu = sim::simulate<
      sim::policies<placement::block, capacity::dropless, false, expert::mlp<act::relu, true>>>(
      cfg, topo, src);
  int ranks = 0;
  for (int r = 0; r < 2; ++r, ++ranks) {
    CAPTURE(r);
    REQUIRE(swiglu.per_rank[r].experts > 0);
    // Two [H, F] matrices against three: 4HF against 6HF FLOPs and weight bytes per row.
    CHECK(relu.per_rank[r].experts / swiglu.per_rank[r].experts == Approx(4.0 / 6.0));
  }
  CHECK(ranks == 2);
}
#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

}  // namespace layer_models_tests
