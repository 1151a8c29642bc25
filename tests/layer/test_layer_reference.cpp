// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <limits>

#include "harness.hpp"
#include <epmoe/schedule/pipelined.hpp>

// A namespace per file: the test programs compile their files as one unit.
namespace layer_reference_tests {
using namespace epmoe;
using test::with_top_k;

// Layer == reference over R in {1,2,3,4,8}, E in {R, 2R, 64}, K in {1,2,4}, T in
// {0,1,7,513}, H and F not multiples of 8, ranks 1, 4, 7 passing no tokens. Written once
// for each capacity policy and each space (test::spaces: the host here, the GPU in
// tests/cuda).
using capacities = std::tuple<capacity::dropless, capacity::factor<false>, capacity::factor<true>>;

TEMPLATE_LIST_TEST_CASE("layer: equals the reference over ranks, experts, top-k, tokens",
                        "[layer][reference]", test::with_spaces<capacities>) {
  using Capacity = typename TestType::first_type;
  using Space = typename TestType::second_type;
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
            using P = test::threads_policies<KK, Capacity, Space>;
            const auto got = test::run_layer<P>(cfg, w, g);
            const auto want = test::run_reference<P>(cfg, w, g);
            INFO("R=" << R << " E=" << E << " K=" << K << " T=" << T);
            CHECK(test::relative_error(got.y, want) <= test::tolerance<Space>(1e-4));
          });
          ++runs;
        }
  CHECK(runs > 40);
}

TEMPLATE_LIST_TEST_CASE("layer: uneven tokens per rank match the reference", "[layer][reference]",
                        test::with_spaces<capacities>) {
  using Space = typename TestType::second_type;
  const layer_config cfg{.hidden = 21,
                         .ffn = 11,
                         .experts = 12,
                         .top_k = 2,
                         .ranks = 4,
                         .max_tokens = 64,
                         .capacity_factor = 0.75};
  const auto w = reference::full_weights::random(cfg, 5);
  const auto g = test::make_tokens({0, 1, 7, 64}, cfg.hidden, 9);
  using P = test::threads_policies<2, typename TestType::first_type, Space>;
  CHECK(test::relative_error(test::run_layer<P>(cfg, w, g).y, test::run_reference<P>(cfg, w, g)) <=
        test::tolerance<Space>(1e-4));
}

namespace {
template <class Space>
struct local_policies : default_policies {
  using space = Space;
  using router = epmoe::router::topk_softmax<2, false>;  // Switch/GShard: no renormalisation
};
}  // namespace

TEMPLATE_LIST_TEST_CASE("layer: one rank with comm::local equals the reference",
                        "[layer][reference]", test::spaces) {
  using P = local_policies<TestType>;
  const layer_config cfg{
      .hidden = 17, .ffn = 23, .experts = 6, .top_k = 2, .ranks = 1, .max_tokens = 50};
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens({50}, cfg.hidden, 4);
  CHECK(test::relative_error(test::run_layer<P>(cfg, w, g).y, test::run_reference<P>(cfg, w, g)) <=
        test::tolerance<TestType>(1e-4));
}

namespace {

template <class Base>
struct dedup_of : Base {
  static constexpr epmoe::layer_options options{.dedup = true};
};
template <class Base>
struct pipelined_of : Base {
  using schedule = epmoe::schedule::pipelined<3>;
};
template <class Space>
using drop_policies_on =
    std::tuple<test::threads_policies<2, capacity::factor<false>, Space>,
               test::threads_policies<2, capacity::factor<true>, Space>,
               dedup_of<test::threads_policies<2, capacity::factor<false>, Space>>,
               pipelined_of<test::threads_policies<2, capacity::factor<false>, Space>>>;
using drop_policies = test::per_space<drop_policies_on>;

}  // namespace

// A small capacity drops every assignment of the later tokens: their rows must still be
// written (zero, or the shared experts alone), not left as they were.
TEMPLATE_LIST_TEST_CASE("layer: a token with every assignment dropped gets zero or shared only",
                        "[layer][reference][capacity]", drop_policies) {
  using P = TestType;
  layer_config cfg{.hidden = 13,
                   .ffn = 9,
                   .experts = 8,
                   .top_k = 2,
                   .ranks = 2,
                   .max_tokens = 40,
                   .capacity_factor = 0.25};  // 3 rows per expert per source rank of 80
  const auto g = test::make_tokens({40, 29}, cfg.hidden, 41);
  const index_t H = cfg.hidden;
  for (int shared : {0, 2}) {
    cfg.shared_experts = shared;
    CAPTURE(shared);
    const auto w = reference::full_weights::random(cfg, 42);
    const auto got = test::run_layer<P>(cfg, w, g, {.passes = 2});
    const auto want = test::run_reference<P>(cfg, w, g);
    CHECK(test::relative_error(got.y, want) <= test::tolerance<typename P::space>(1e-4));
    if (shared > 0) continue;
    // Without shared experts a fully dropped token's reference row is exactly zero: the case
    // this test is for happens on both ranks.
    for (int r = 0; r < cfg.ranks; ++r) {
      int zero_rows = 0;
      for (index_t t = g.offset(r); t < g.offset(r) + g.per_rank[r]; ++t)
        zero_rows += std::all_of(want.begin() + t * H, want.begin() + (t + 1) * H,
                                 [](float v) { return v == 0.f; });
      CAPTURE(r);
      CHECK(zero_rows >= 5);
      CHECK(got.stats[r][1].dropped > 0);
    }
  }
}

}  // namespace layer_reference_tests
