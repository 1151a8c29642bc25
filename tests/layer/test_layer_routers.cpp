// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <limits>
#include <vector>

#include "harness.hpp"
#include <epmoe/router/expert_choice.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/sinkhorn.hpp>
#include <epmoe/router/sparsemixer.hpp>
#include <epmoe/router/topk_softmax.hpp>

// Every router through the full layer, on 1 and 4 ranks, equals the reference.
// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_routers_tests {
using namespace epmoe;

namespace {

template <class Space, class Router, class Capacity = capacity::dropless>
using policies = test::router_policies<Space, Router, Capacity>;
using test::small_layer;

/// Layer on `ranks` threads vs reference on the same tokens, one pass.
template <class P>
double layer_vs_reference(const layer_config& cfg, const test::run_options<P>& opt = {},
                          std::uint64_t seed = 1) {
  const auto w = reference::full_weights::random(cfg, seed);
  std::vector<index_t> per_rank(cfg.ranks, 40);
  if (cfg.ranks > 1) per_rank[1] = 0;  // an idle rank
  if (cfg.ranks > 2) per_rank[2] = 17;
  const auto g = test::make_tokens(per_rank, cfg.hidden, seed + 1);
  auto o = opt;
  if (o.token_ids.empty() && router_needs_token_ids<typename P::router>) {
    o.token_ids.resize(static_cast<std::size_t>(g.total()));
    for (std::size_t i = 0; i < o.token_ids.size(); ++i)
      o.token_ids[i] = static_cast<std::int64_t>((i * 7919) % 50000);  // vocabulary ids
  }
  const auto got = test::run_layer<P>(cfg, w, g, o);
  return test::relative_error(got.y, test::run_reference<P>(cfg, w, g, o));
}

// One pass's layer output (every pass: ys) and the reference of each pass, on the tokens of
// layer_vs_reference.
template <class P>
struct both_sides {
  std::vector<std::vector<float>> layer, reference;
  std::vector<reference::rank_routing> routing;  // the reference's routing of pass 0
};
template <class P>
both_sides<P> run_both(const layer_config& cfg, const test::run_options<P>& opt,
                       std::uint64_t seed = 1) {
  const auto w = reference::full_weights::random(cfg, seed);
  std::vector<index_t> per_rank(cfg.ranks, 40);
  if (cfg.ranks > 1) per_rank[1] = 0;
  if (cfg.ranks > 2) per_rank[2] = 17;
  const auto g = test::make_tokens(per_rank, cfg.hidden, seed + 1);
  both_sides<P> out{test::run_layer<P>(cfg, w, g, opt).ys, {}, {}};
  for (int p = 0; p < opt.passes; ++p)
    out.reference.push_back(test::run_reference<P>(cfg, w, g, opt, static_cast<std::uint64_t>(p)));
  typename P::router router = opt.router;
  if constexpr (router_with_bias<typename P::router>)
    router.bias = opt.bias.empty() ? nullptr : opt.bias.data();
  out.routing = reference::route_ranks(w, router, {g.x.data(), g.total(), cfg.hidden}, g.per_rank);
  return out;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("routers through the layer: softmax family", "[layer][routers]",
                        test::spaces) {
  using Space = TestType;
  for (int R : {1, 4}) {
    CAPTURE(R);
    CHECK(layer_vs_reference<policies<Space, router::mixtral<2>>>(small_layer(R, 2)) <=
          test::tolerance<Space>(1e-4));
    CHECK(layer_vs_reference<policies<Space, router::qwen<4, false>>>(small_layer(R, 4)) <=
          test::tolerance<Space>(1e-4));
    CHECK(layer_vs_reference<policies<Space, router::switch_top1>>(small_layer(R, 1)) <=
          test::tolerance<Space>(1e-4));
    CHECK(layer_vs_reference<policies<Space, router::gshard_top2, capacity::factor<>>>(
              small_layer(R, 2)) <= 1e-4);
    // Group-limited softmax: 4 groups of 4, best 2 groups.
    test::run_options<policies<Space, router::topk_softmax<2>>> grouped{.router = {4, 2}};
    CHECK(layer_vs_reference(small_layer(R, 2, 16), grouped) <= test::tolerance<Space>(1e-4));
  }
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: DeepSeek-V3 sigmoid with bias and groups",
                        "[layer][routers]", test::spaces) {
  using Space = TestType;
  using P = policies<Space, router::sigmoid_bias<4>>;
  for (int R : {1, 4}) {
    CAPTURE(R);
    test::run_options<P> opt{.router = {.groups = 4, .top_groups = 2, .scaling = 2.5f}};
    opt.bias.resize(16);
    for (int e = 0; e < 16; ++e) opt.bias[e] = 0.05f * static_cast<float>(e % 5) - 0.1f;
    CHECK(layer_vs_reference(small_layer(R, 4, 16), opt) <= test::tolerance<Space>(1e-4));
  }
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: expert choice, hash, Sinkhorn",
                        "[layer][routers]", test::spaces) {
  using Space = TestType;
  for (int R : {1, 4}) {
    CAPTURE(R);
    CHECK(layer_vs_reference<policies<Space, router::expert_choice>>(small_layer(R, 2)) <=
          test::tolerance<Space>(1e-4));
    CHECK(layer_vs_reference<policies<Space, router::hash<2>>>(small_layer(R, 2)) <=
          test::tolerance<Space>(1e-4));
    CHECK(layer_vs_reference<policies<Space, router::sinkhorn<2>>>(small_layer(R, 2)) <=
          test::tolerance<Space>(1e-4));
    CHECK(layer_vs_reference<policies<Space, router::sinkhorn<1>>>(small_layer(R, 1)) <=
          test::tolerance<Space>(1e-4));
  }
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: training noise, seeded", "[layer][routers]",
                        test::spaces) {
  using Space = TestType;
  for (int R : {1, 4}) {
    CAPTURE(R);
    for (bool training : {false, true}) {
      CAPTURE(training);
      CHECK(layer_vs_reference<policies<Space, router::noisy_topk<2>>>(
                small_layer(R, 2), {.router = {.training = training, .seed = 9}}) <=
            test::tolerance<Space>(1e-4));
      using J = router::jitter<router::switch_top1>;
      J j{};
      j.training = training;
      j.eps = 0.1f;
      CHECK(layer_vs_reference<policies<Space, J>>(small_layer(R, 1), {.router = j}) <=
            test::tolerance<Space>(1e-4));
    }
  }
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: DBRX p-norm renormalisation",
                        "[layer][routers][pnorm]", test::spaces) {
  using Space = TestType;
  using P = policies<Space, router::dbrx<4>>;
  int checked = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const layer_config cfg = small_layer(R, 4, 16);
    const auto one = run_both<P>(cfg, {.router = {.norm_p = 1.f}});
    for (float p : {0.5f, 2.f, 3.f}) {
      CAPTURE(p);
      const auto got = run_both<P>(cfg, {.router = {.norm_p = p}});
      CHECK(test::relative_error(got.layer[0], got.reference[0]) <= test::tolerance<Space>(1e-4));
      // p moves every weight: p = 1's output is not p's (a p ignored fails here).
      CHECK(test::relative_error(got.layer[0], one.layer[0]) > 1e-3);
      ++checked;
    }
    CHECK(test::relative_error(one.layer[0], one.reference[0]) <= test::tolerance<Space>(1e-4));
  }
  CHECK(checked == 9);
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: group masks, DeepSeek's -inf and HF's 0.0",
                        "[layer][routers][group_mask]", test::spaces) {
  using Space = TestType;
  using P = policies<Space, router::sigmoid_bias<4>>;
  int checked = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const layer_config cfg = small_layer(R, 4, 16);
    for (bool negative : {true, false}) {
      CAPTURE(negative);
      // Negative biases make s + b < 0 in kept groups, where a dropped expert's 0.0 wins.
      std::vector<float> bias(16);
      for (int e = 0; e < 16; ++e)
        bias[e] = negative ? (e % 2 ? -0.9f : -0.05f * static_cast<float>(e % 5)) : 0.f;
      test::run_options<P> o{.router = {.groups = 4, .top_groups = 2, .scaling = 2.5f}};
      o.bias = bias;
      const auto minus_inf = run_both<P>(cfg, o);
      o.router.group_mask = router::group_mask_mode::zero;
      const auto zero = run_both<P>(cfg, o);
      CHECK(test::relative_error(minus_inf.layer[0], minus_inf.reference[0]) <=
            test::tolerance<Space>(1e-4));
      CHECK(test::relative_error(zero.layer[0], zero.reference[0]) <= test::tolerance<Space>(1e-4));
      // The routings differ exactly when some key is negative (sigmoid > 0 otherwise).
      int differ = 0;
      for (std::size_t r = 0; r < zero.routing.size(); ++r)
        differ += zero.routing[r].ids != minus_inf.routing[r].ids;
      if (negative) {
        CHECK(differ > 0);
        CHECK(test::relative_error(zero.layer[0], minus_inf.layer[0]) > 1e-3);
      } else {
        CHECK(differ == 0);
        CHECK(test::relative_error(zero.layer[0], minus_inf.layer[0]) <=
              test::tolerance<Space>(1e-5));
      }
      ++checked;
    }
  }
  CHECK(checked == 6);
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: PhiMoE sparsemixer, inference",
                        "[layer][routers][sparsemixer]", test::spaces) {
  using Space = TestType;
  using P = policies<Space, router::sparsemixer>;
  int checked = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    for (float eps : {0.01f, 0.3f}) {
      CAPTURE(eps);
      const auto got = run_both<P>(small_layer(R, 2), {.router = {.jitter_eps = eps}});
      CHECK(test::relative_error(got.layer[0], got.reference[0]) <= test::tolerance<Space>(1e-4));
      // eps 0.3 keeps more than the top expert in many rounds (weights below 1).
      int partial = 0;
      for (const auto& r : got.routing)
        for (double w : r.weights) partial += w < 1.0;
      if (eps > 0.1f) CHECK(partial > 20);
      ++checked;
    }
  }
  CHECK(checked == 6);
}

TEMPLATE_LIST_TEST_CASE("routers through the layer: PhiMoE sparsemixer, training samples per pass",
                        "[layer][routers][sparsemixer]", test::spaces) {
  using Space = TestType;
  using P = policies<Space, router::sparsemixer>;
  int checked = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const auto got =
        run_both<P>(small_layer(R, 2),
                    {.router = {.jitter_eps = 0.3f, .training = true, .seed = 11}, .passes = 2});
    REQUIRE(got.layer.size() == 2);
    REQUIRE(got.reference.size() == 2);
    for (int p = 0; p < 2; ++p, ++checked) {
      CAPTURE(p);
      CHECK(test::relative_error(got.layer[p], got.reference[p]) <= test::tolerance<Space>(1e-4));
    }
    // A new sample every pass (a pass counter stuck at 0 fails above).
    CHECK(test::relative_error(got.reference[1], got.reference[0]) > 1e-3);
  }
  CHECK(checked == 6);
}

TEMPLATE_LIST_TEST_CASE(
    "routers through the layer: expert choice gives every expert C tokens per rank",
    "[layer][routers]", test::spaces) {
  using Space = TestType;
  const layer_config cfg = small_layer(4, 2);
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens({40, 40, 40, 40}, cfg.hidden, 4);
  const auto run = test::run_layer<policies<Space, router::expert_choice>>(cfg, w, g);
  const index_t C = router::expert_choice::capacity(cfg, 40);  // ceil(1.0 * 40 * 2 / 8) = 10
  REQUIRE(C == 10);
  for (int r = 0; r < 4; ++r) {
    REQUIRE(run.stats[r][0].routed_per_expert.size() == 8);
    for (index_t n : run.stats[r][0].routed_per_expert) CHECK(n == C);
    CHECK(run.stats[r][0].assignments == 8 * C);
    index_t rows = 0;
    for (index_t n : run.stats[r][0].rows_per_local_expert) rows += n;
    CHECK(rows == 4 * C * 2);  // 2 local experts, C rows from each of 4 ranks
  }
}

TEMPLATE_LIST_TEST_CASE("shared experts: every token's output adds N always-on experts",
                        "[layer][shared]", test::spaces) {
  using Space = TestType;
  for (int R : {1, 4}) {
    CAPTURE(R);
    layer_config cfg = small_layer(R, 2);
    cfg.shared_experts = 2;
    cfg.shared_ffn = 7;
    CHECK(layer_vs_reference<policies<Space, router::mixtral<2>>>(cfg) <=
          test::tolerance<Space>(1e-4));
    cfg.shared_ffn = 0;  // same width as the routed experts
    CHECK(layer_vs_reference<policies<Space, router::sigmoid_bias<2>>>(cfg) <=
          test::tolerance<Space>(1e-4));
  }
  // Stats count their FLOPs; without them the output differs.
  using M = policies<Space, router::mixtral<2>>;
  layer_config cfg = small_layer(1, 2);
  cfg.shared_experts = 1;
  const auto w = reference::full_weights::random(cfg, 5);
  const auto g = test::make_tokens({40}, cfg.hidden, 6);
  const auto with = test::run_layer<M>(cfg, w, g);
  CHECK(with.stats[0][0].shared_flops == Approx(40.0 * 6 * cfg.hidden * cfg.ffn));
  auto w_none = w;  // the same routed experts, no shared one
  w_none.cfg.shared_experts = 0;
  const auto without = test::run_layer<M>(w_none.cfg, w_none, g);
  // Both right (a NaN output would also make them "differ"), and not the same.
  CHECK(test::relative_error(with.y, test::run_reference<M>(cfg, w, g)) <=
        test::tolerance<Space>(1e-4));
  CHECK(test::relative_error(without.y, test::run_reference<M>(w_none.cfg, w_none, g)) <=
        test::tolerance<Space>(1e-4));
  CHECK(test::relative_error(without.y, with.y) > 1e-3);
}

TEMPLATE_LIST_TEST_CASE("router losses are reported per pass", "[layer][losses]", test::spaces) {
  using Space = TestType;
  layer_config cfg = small_layer(2, 2);
  cfg.seq_len = 10;
  const auto w = reference::full_weights::random(cfg, 7);
  const auto g = test::make_tokens({40, 40}, cfg.hidden, 8);
  const auto soft = test::run_layer<policies<Space, router::mixtral<2>>>(cfg, w, g);
  const auto hashed = test::run_layer<policies<Space, router::hash<2>>>(
      cfg, w, g, {.token_ids = std::vector<std::int64_t>(80, 3)});
  for (int r = 0; r < 2; ++r) {
    const router_losses& l = soft.stats[r][0].losses;
    CHECK(l.valid);
    CHECK(l.aux > 0);
    CHECK(l.seq_aux > 0);
    CHECK(l.z > 0);
    CHECK_FALSE(hashed.stats[r][0].losses.valid);
  }
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC  // a host loop of 200 updates
TEST_CASE("bias update drives a skewed load toward balance", "[layer][routers][bias]") {
  // 16 experts; tokens whose gate prefers experts 0..3. Each pass, every rank routes its
  // tokens, then update_router() applies b_i += gamma * sign(mean - load_i) from the global
  // load. max/mean load must fall.
  layer_config cfg{.hidden = 16, .ffn = 4, .experts = 16, .top_k = 2, .ranks = 2, .max_tokens = 64};
  auto w = reference::full_weights::random(cfg, 10);
  for (int e = 0; e < 4; ++e)
    for (int h = 0; h < cfg.hidden; ++h) w.gate[e * cfg.hidden + h] += 0.25f;
  using P = policies<space::host, router::sigmoid_bias<2>>;
  std::vector<double> curve(200);
  std::vector<std::vector<float>> bias(2);  // [rank]: after the last update
  std::vector<float> last_bias;             // rank 0's, as the last pass used it
  test::global_tokens last_x{{64, 64}, std::vector<float>(2 * 64 * 16)};
  std::vector<float> last_y(2 * 64 * 16);  // the last pass, every rank
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(w, placement::block(cfg), r);
    moe_layer<P> layer(cfg, c, {w.gate_view(), mine.experts()}, {.gamma = 2e-3f});
    std::vector<float> y(64 * 16);
    for (int step = 0; step < 200; ++step) {
      auto x = reference::random_tokens(64, 16, 1000 * step + r);
      for (float& v : x) v = std::abs(v);  // positive tokens: the skewed rows win
      if (step == 199) {
        std::copy(x.begin(), x.end(), last_x.x.begin() + r * 64 * 16);
        if (r == 0) last_bias.assign(layer.router_bias().begin(), layer.router_bias().end());
      }
      std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
      layer.forward({x.data(), 64, 16}, {y.data(), 64, 16});
      const auto load = layer.update_router();
      double mx = 0, sum = 0;
      for (index_t n : load) {
        mx = std::max(mx, static_cast<double>(n));
        sum += static_cast<double>(n);
      }
      if (r == 0) curve[step] = mx / (sum / 16);
    }
    std::copy(y.begin(), y.end(), last_y.begin() + r * 64 * 16);
    bias[r].assign(layer.router_bias().begin(), layer.router_bias().end());
  });
  // Every rank holds the same bias after the collective updates, and the hot expert's fell.
  REQUIRE(bias[0].size() == 16);
  CHECK(bias[1] == bias[0]);
  CHECK(bias[0][0] < 0);
  // The last pass used the bias of the updates before it, on every rank.
  CHECK(test::relative_error(
            last_y, test::run_reference<P>(
                        cfg, w, last_x, {.router = {.gamma = 2e-3f}, .bias = last_bias})) <= 1e-4);
  const double first = (curve[0] + curve[1] + curve[2]) / 3;
  const double last = (curve[197] + curve[198] + curve[199]) / 3;
  INFO("max/mean load: first passes " << first << ", last passes " << last);
  CHECK(first > 2.0);
  CHECK(last < 0.6 * first);
}
#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

}  // namespace layer_routers_tests
