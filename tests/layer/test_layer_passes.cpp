// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <span>
#include <vector>

#include "passes.hpp"
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

// State across passes: three passes of one layer, each compared with the reference of that
// pass (shared-expert sums, training noise drawn per pass, the DeepSeek bias after
// update_router), on 1, 2 and 4 ranks.
// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_passes_tests {
using namespace epmoe;

namespace {

constexpr int passes = 3;

template <class Space, class Router, class Capacity = capacity::dropless>
using policies = test::router_policies<Space, Router, Capacity>;
using test::small_layer;

// Uneven ranks, one idle: 40 | 40, 23 | 40, 0, 17, 33 tokens.
test::global_tokens tokens(const layer_config& cfg, std::uint64_t seed) {
  std::vector<index_t> per_rank(static_cast<std::size_t>(cfg.ranks), 40);
  if (cfg.ranks == 2) per_rank[1] = 23;
  if (cfg.ranks == 4) per_rank = {40, 0, 17, 33};
  return test::make_tokens(per_rank, cfg.hidden, seed);
}

// Each pass's layer output against the reference of the same pass (same token ids).
template <class P>
void check_training_noise(const layer_config& cfg, const test::run_options<P>& opt) {
  const auto w = reference::full_weights::random(cfg, 21);
  const auto g = tokens(cfg, 22);
  const auto got = test::run_passes<P>(cfg, w, g, opt, passes);
  std::vector<std::vector<float>> want;
  for (int p = 0; p < passes; ++p) {
    CAPTURE(p);
    want.push_back(test::run_reference<P>(cfg, w, g, opt, static_cast<std::uint64_t>(p)));
    CHECK(test::relative_error(got[p], want[p]) <= test::tolerance<typename P::space>(1e-4));
  }
  REQUIRE(want.size() == passes);
  // The noise changes the output from pass to pass, so noise stuck at one pass fails above.
  CHECK(test::relative_error(want[1], want[0]) > 1e-3);
  CHECK(test::relative_error(want[2], want[1]) > 1e-3);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("passes: shared experts are recomputed, not accumulated, every pass",
                        "[layer][passes][shared]", test::spaces) {
  using Space = TestType;
  int checked = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    layer_config cfg = small_layer(R, 2);
    cfg.shared_experts = 2;
    cfg.shared_ffn = 7;
    using P = policies<Space, router::mixtral<2>>;
    const auto w = reference::full_weights::random(cfg, 11);
    const auto g = tokens(cfg, 12);
    const auto got = test::run_passes<P>(cfg, w, g, {}, passes);
    const auto want = test::run_reference<P>(cfg, w, g);
    for (int p = 0; p < passes; ++p, ++checked) {
      CAPTURE(p);
      CHECK(test::relative_error(got[p], want) <= test::tolerance<Space>(1e-4));
    }
  }
  CHECK(checked == 3 * passes);
}

TEMPLATE_LIST_TEST_CASE("passes: noisy top-k draws new noise every pass", "[layer][passes][noise]",
                        test::spaces) {
  using Space = TestType;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    check_training_noise<policies<Space, router::noisy_topk<2>, capacity::factor<>>>(
        small_layer(R, 2), {.router = {.training = true, .seed = 9}});
  }
}

TEMPLATE_LIST_TEST_CASE("passes: Switch jitter draws new factors every pass",
                        "[layer][passes][noise]", test::spaces) {
  using Space = TestType;
  using J = router::jitter<router::switch_top1>;
  J j{};
  j.training = true;
  j.eps = 0.1f;
  j.seed = 4;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    check_training_noise<policies<Space, J>>(small_layer(R, 1), {.router = j});
  }
}

TEMPLATE_LIST_TEST_CASE("passes: the DeepSeek bias after update_router matches its definition",
                        "[layer][passes][bias]", test::spaces) {
  using Space = TestType;
  using Router = router::sigmoid_bias<4>;
  using P = policies<Space, Router>;
  const Router router{.groups = 4, .top_groups = 2, .scaling = 2.5f, .gamma = 0.05f};
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const layer_config cfg = small_layer(R, 4, 16);
    const auto w = reference::full_weights::random(cfg, 31);
    const auto g = tokens(cfg, 32);
    test::run_options<P> opt{.router = router};
    opt.bias.assign(16, 0.f);
    for (int e = 0; e < 16; e += 3) opt.bias[e] = 0.1f;  // a loaded bias, not all zero
    const auto got = test::run_passes<P>(cfg, w, g, opt, passes,
                                         [](moe_layer<P>& layer) { layer.update_router(); });
    // The reference: route, then b_e += gamma * sign(mean load - load_e) on the global load.
    std::vector<float> bias = opt.bias;
    const index_t n = g.total();
    for (int p = 0; p < passes; ++p) {
      CAPTURE(p);
      test::run_options<P> now = opt;
      now.bias = bias;
      const auto want = test::run_reference<P>(cfg, w, g, now, static_cast<std::uint64_t>(p));
      CHECK(test::relative_error(got[p], want) <= test::tolerance<Space>(1e-4));
      if (p > 0)  // the update changed the routing: a skipped update fails above
        CHECK(test::relative_error(want, test::run_reference<P>(cfg, w, g, opt)) > 1e-3);
      Router biased = router;
      biased.bias = bias.data();
      const auto routed =
          reference::route_ranks(w, biased, {g.x.data(), n, cfg.hidden}, g.per_rank);
      reference::update_bias(router, std::span<float>(bias), reference::expert_load(routed, 16));
    }
    CHECK(bias != opt.bias);
  }
}

}  // namespace layer_passes_tests
