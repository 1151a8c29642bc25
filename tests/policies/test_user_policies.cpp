// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Policies written as a user would, one header each (examples/policies/: top_p.hpp,
// gelu_mlp.hpp, least_loaded.hpp), run through the layer on 1, 2 and 4 ranks against the
// float64 reference, which gets their definitions here and in gelu_mlp_reference.hpp, written
// apart from their code.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <vector>

#include "../../examples/policies/gelu_mlp.hpp"
#include "../../examples/policies/gelu_mlp_reference.hpp"
#include "../../examples/policies/least_loaded.hpp"
#include "../../examples/policies/top_p.hpp"
#include "../layer/harness.hpp"

using namespace epmoe;

namespace policies {
/// top_p in float64: experts in order of probability (ties to the lower id) until their
/// probabilities reach p (at most K), weights renormalised over the chosen.
template <int K>
reference::rank_routing routing_of(const top_p<K>& r, const reference::rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts, H = b.cfg->hidden;
  reference::rank_routing out(T, K);
  for (index_t t = 0; t < T; ++t) {
    std::vector<double> l(static_cast<std::size_t>(E));
    for (index_t e = 0; e < E; ++e) {
      double s = 0;
      for (index_t h = 0; h < H; ++h) s += b.x[t * H + h] * double{b.w->gate[e * H + h]};
      l[e] = s;
    }
    const double m = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (double v : l) z += std::exp(v - m);
    std::vector<int> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return l[a] > l[c]; });
    double covered = 0;
    int taken = 0;
    for (; taken < K && (taken == 0 || covered < r.p); ++taken) {
      out.id(t, taken) = order[taken];
      out.weight(t, taken) = std::exp(l[order[taken]] - m) / z;
      covered += out.weight(t, taken);
    }
    for (int k = 0; k < taken; ++k) out.weight(t, k) /= covered;
  }
  return out;
}
}  // namespace policies

template <>
struct epmoe::test::expert_weights<policies::gelu_mlp> {
  template <class T>
  static policies::gelu_mlp::weights_of<T> of(test::expert_arrays<T> a, index_t n, index_t ffn,
                                              index_t hidden) {
    return {{a.w1, n, ffn, hidden}, {a.w2, n, hidden, ffn}};
  }
};

namespace {
template <class Router, class Expert = expert::swiglu, class Capacity = capacity::dropless,
          class Space = space::host>
struct user_policies : test::threads_policies<Router::top_k, Capacity, Space> {
  using router = Router;
  using expert = Expert;
};
}  // namespace

TEMPLATE_LIST_TEST_CASE(
    "user policies: a top-p router takes experts until p of the mass, on 1, 2, 4 ranks",
    "[policies]", test::spaces) {
  using Space = TestType;
  int cases = 0;
  for (int R : {1, 2, 4})
    for (float p : {0.3f, 0.6f, 0.95f}) {
      CAPTURE(R, p);
      const layer_config cfg{.hidden = 16,
                             .ffn = 12,
                             .experts = 8,
                             .top_k = 3,
                             .ranks = R,
                             .max_tokens = 24,
                             .capacity_factor = 0.6};
      const auto w = reference::full_weights::random(cfg, 11);
      const auto g = test::make_tokens(std::vector<index_t>(R, 24), cfg.hidden, 3 + R);
      using P = user_policies<policies::top_p<3>, expert::swiglu, capacity::dropless, Space>;
      const test::run_options<P> opt{.router = {.p = p}};
      const auto got = test::run_layer<P>(cfg, w, g, opt);
      CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, w, g, opt)) <=
            test::tolerance<Space>(1e-5));
      // Fewer than K experts where one or two cover p: empty slots are not assignments.
      index_t assigned = 0;
      for (int r = 0; r < R; ++r) assigned += got.stats[r][0].assignments;
      if (p < 0.5f) CHECK(assigned < 3 * 24 * R);
      // Capacity drops follow the chosen experts only.
      using D = user_policies<policies::top_p<3>, expert::swiglu, capacity::factor<>, Space>;
      const test::run_options<D> dopt{.router = {.p = p}};
      CHECK(test::relative_error(test::run_layer<D>(cfg, w, g, dopt).y,
                                 test::run_reference<D>(cfg, w, g, dopt)) <=
            test::tolerance<Space>(1e-5));
      ++cases;
    }
  CHECK(cases == 9);
}

TEMPLATE_LIST_TEST_CASE("user policies: a GELU MLP expert (with shared experts) equals its formula",
                        "[policies]", test::spaces) {
  using Space = TestType;
  int cases = 0;
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    // Odd H and F: the buffers' rows are padded to 16 bytes and the expert's hidden rows too.
    const layer_config cfg{.hidden = 13,
                           .ffn = 19,
                           .experts = 8,
                           .top_k = 2,
                           .ranks = R,
                           .max_tokens = 20,
                           .shared_experts = 1};
    const auto w = reference::full_weights::random(cfg, 5);
    const auto g = test::make_tokens(std::vector<index_t>(R, 20), cfg.hidden, 9);
    using P = user_policies<router::topk_softmax<2>, policies::gelu_mlp, capacity::dropless, Space>;
    const auto got = test::run_layer<P>(cfg, w, g);
    CHECK(test::relative_error(got.y, test::run_reference<P>(cfg, w, g)) <=
          test::tolerance<Space>(1e-5));
    // Its FLOPs are its own (two GEMMs), not SwiGLU's.
    index_t rows = 0;
    for (index_t n : got.stats[0][0].rows_per_local_expert) rows += n;
    CHECK(rows > 0);
    CHECK(got.stats[0][0].expert_flops == Approx(double(rows) * 4.0 * 13 * 19));
    ++cases;
  }
  CHECK(cases == 3);
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
TEST_CASE("user policies: least_loaded places the heaviest expert first on the lightest rank",
          "[policies][placement]") {
  layer_config cfg{.hidden = 4, .ffn = 4, .experts = 4, .top_k = 1, .ranks = 2, .max_tokens = 4};
  // Loads 1, 5, 3, 2: expert 1 -> rank 0, 2 -> rank 1, 3 -> rank 1 (3 < 5), 0 -> rank 0 (the
  // only free slot). Rank loads 6 and 5.
  const std::vector<double> load = {1, 5, 3, 2};
  const policies::least_loaded p(cfg, load);
  CHECK(p.slots_per_rank() == 2);
  CHECK(p.expert_at(0, 0) == 1);
  CHECK(p.expert_at(0, 1) == 0);
  CHECK(p.expert_at(1, 0) == 2);
  CHECK(p.expert_at(1, 1) == 3);
  for (int e = 0; e < 4; ++e)
    CHECK(p.expert_at(p.slot_for(e, 0, 0) / 2, p.slot_for(e, 0, 0) % 2) == e);
  // Without a load every expert weighs the same: round-robin.
  cfg.experts = 12, cfg.ranks = 3;
  const policies::least_loaded even(cfg);
  const placement::round_robin rr(cfg);
  int checked = 0;
  for (int e = 0; e < 12; ++e, ++checked) CHECK(even.slot_for(e, 0, 0) == rr.slot_for(e, 0, 0));
  CHECK(checked == 12);
  CHECK_THROWS_WITH(policies::least_loaded(cfg, std::vector<double>(5, 1.0)),
                    Catch::Contains("placement.load"));
}
#endif

namespace {
template <class Space>
struct least_loaded_policies
    : user_policies<router::topk_softmax<2>, expert::swiglu, capacity::factor<>, Space> {
  using placement = policies::least_loaded;
};
}  // namespace

TEMPLATE_LIST_TEST_CASE("user policies: a least_loaded placement runs the layer as the reference",
                        "[policies][placement]", test::spaces) {
  using Space = TestType;
  const layer_config cfg{
      .hidden = 12, .ffn = 10, .experts = 8, .top_k = 2, .ranks = 4, .max_tokens = 16};
  const auto w = reference::full_weights::random(cfg, 31);
  const auto g = test::make_tokens(std::vector<index_t>(4, 16), cfg.hidden, 32);
  using P = least_loaded_policies<Space>;
  const std::vector<double> load = {9, 1, 1, 7, 2, 8, 1, 3};
  const test::run_options<P> opt{.placement = policies::least_loaded(cfg, load)};
  CHECK(test::relative_error(test::run_layer<P>(cfg, w, g, opt).y,
                             test::run_reference<P>(cfg, w, g, opt)) <=
        test::tolerance<Space>(1e-5));
}
