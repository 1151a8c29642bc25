// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "harness.hpp"

using namespace epmoe;
using test::with_top_k;

// Layer == reference over R in {1,2,3,4,8}, E in {R, 2R, 64}, K in {1,2,4}, T in
// {0,1,7,513}, H and F not multiples of 8, ranks 1, 4, 7 passing no tokens. Written once
// for each capacity policy.
using capacities = std::tuple<capacity::dropless, capacity::factor<false>, capacity::factor<true>>;

TEMPLATE_LIST_TEST_CASE("layer: equals the reference over ranks, experts, top-k, tokens",
                        "[layer][reference]", capacities) {
  int runs = 0;
  for (int R : {1, 2, 3, 4, 8})
    for (int E : {R, 2 * R, 64})
      for (int K : {1, 2, 4})
        for (index_t T : {0, 1, 7, 513}) {
          if (K > E || E % R != 0) continue;
          const layer_config cfg{.hidden = 13,
                                 .ffn = 19,
                                 .experts = E,
                                 .top_k = K,
                                 .ranks = R,
                                 .max_tokens = std::max<int>(1, static_cast<int>(T)),
                                 .capacity_factor = 1.0};
          std::vector<index_t> per_rank(R, T);
          for (int r = 1; r < R; r += 3) per_rank[r] = 0;  // some ranks idle this pass
          const auto w = reference::full_weights::random(cfg, 1000 + E * 7 + K);
          const auto g = test::make_tokens(per_rank, cfg.hidden, 7 * R + T);
          with_top_k(K, [&]<int KK>() {
            using P = test::threads_policies<KK, TestType>;
            const auto got = test::run_layer<P>(cfg, w, g);
            const auto want = test::run_reference<P>(cfg, w, g);
            INFO("R=" << R << " E=" << E << " K=" << K << " T=" << T);
            CHECK(test::relative_error(got.y, want) <= 1e-4);
          });
          ++runs;
        }
  CHECK(runs > 40);
}

TEMPLATE_LIST_TEST_CASE("layer: uneven tokens per rank match the reference", "[layer][reference]",
                        capacities) {
  const layer_config cfg{.hidden = 21,
                         .ffn = 11,
                         .experts = 12,
                         .top_k = 2,
                         .ranks = 4,
                         .max_tokens = 64,
                         .capacity_factor = 0.75};
  const auto w = reference::full_weights::random(cfg, 5);
  const auto g = test::make_tokens({0, 1, 7, 64}, cfg.hidden, 9);
  using P = test::threads_policies<2, TestType>;
  CHECK(test::relative_error(test::run_layer<P>(cfg, w, g).y, test::run_reference<P>(cfg, w, g)) <=
        1e-4);
}

TEST_CASE("layer: one rank with comm::local equals the reference", "[layer][reference]") {
  struct P : default_policies {
    using router = epmoe::router::topk_softmax<2, false>;  // Switch/GShard: no renormalisation
  };
  const layer_config cfg{
      .hidden = 17, .ffn = 23, .experts = 6, .top_k = 2, .ranks = 1, .max_tokens = 50};
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens({50}, cfg.hidden, 4);
  const auto mine = reference::slice(w, placement::block(cfg), 0);
  moe_layer<P> layer(cfg, comm::local{}, {w.gate_view(), mine.experts()});
  std::vector<float> y(g.x.size());
  layer.forward({g.x.data(), 50, 17}, {y.data(), 50, 17});
  CHECK(test::relative_error(y, test::run_reference<P>(cfg, w, g)) <= 1e-4);
}
