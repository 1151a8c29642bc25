// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "harness.hpp"

// Per-rank dedup: a token that picks several experts on one rank sends that rank one row.
// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_dedup_tests {
using namespace epmoe;

namespace {

template <int K, class Capacity = capacity::dropless, class Space = space::host>
struct dedup_policies : test::threads_policies<K, Capacity, Space> {
  static constexpr epmoe::layer_options options{.dedup = true};
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("dedup: same outputs as per-assignment dispatch and as the reference",
                        "[layer][dedup]", test::spaces) {
  using Space = TestType;
  for (int R : {1, 2, 3, 4})
    for (int K : {1, 2, 4}) {
      const layer_config cfg{.hidden = 13,
                             .ffn = 9,
                             .experts = 2 * R * 2,
                             .top_k = K,
                             .ranks = R,
                             .max_tokens = 50,
                             .capacity_factor = 0.9};
      std::vector<index_t> per_rank(R, 50);
      if (R > 1) per_rank[R - 1] = 0;
      const auto w = reference::full_weights::random(cfg, 100 + R * 10 + K);
      const auto g = test::make_tokens(per_rank, cfg.hidden, 7 + R);
      test::with_top_k(K, [&]<int KK>() {
        CAPTURE(R, K);
        using D = capacity::dropless;
        const auto plain = test::run_layer<test::threads_policies<KK, D, Space>>(cfg, w, g);
        const auto dedup = test::run_layer<dedup_policies<KK, D, Space>>(cfg, w, g);
        CHECK(test::relative_error(dedup.y, plain.y) <= test::tolerance<Space>(1e-6));
        CHECK(test::relative_error(dedup.y, test::run_reference<dedup_policies<KK, D, Space>>(
                                                cfg, w, g)) <= test::tolerance<Space>(1e-4));
        // With capacity (drops) too.
        using C = capacity::factor<false>;
        const auto plain_c = test::run_layer<test::threads_policies<KK, C, Space>>(cfg, w, g);
        const auto dedup_c = test::run_layer<dedup_policies<KK, C, Space>>(cfg, w, g);
        CHECK(test::relative_error(dedup_c.y, plain_c.y) <= test::tolerance<Space>(1e-6));
        CHECK(dedup_c.stats[0][0].dropped == plain_c.stats[0][0].dropped);
        // Never more rows than without dedup; as many assignments.
        for (int r = 0; r < R; ++r)
          for (int d = 0; d < R; ++d) {
            CHECK(dedup.stats[r][0].rows_sent[d] <= plain.stats[r][0].rows_sent[d]);
            CHECK(dedup.stats[r][0].assignment_rows_sent[d] == plain.stats[r][0].rows_sent[d]);
          }
      });
    }
}

TEMPLATE_LIST_TEST_CASE("dedup: rows and bytes of both all-to-alls match a hand count",
                        "[layer][dedup]", test::spaces) {
  using Space = TestType;
  // 2 ranks, experts 0,1 on rank 0 and 2,3 on rank 1, top-2. Rank 0 holds 4 tokens:
  //   t0 -> (0, 1): both on rank 0     t1 -> (0, 2): one on each rank
  //   t2 -> (2, 3): both on rank 1     t3 -> (3, 1): one on each rank
  // Rank 1 holds no tokens. The gate is the identity, so a token with 2 at expert a and 1 at
  // expert b picks (a, b).
  const layer_config cfg{
      .hidden = 6, .ffn = 5, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 4};
  auto w = reference::full_weights::random(cfg, 9);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < 4; ++e) w.gate[e * cfg.hidden + e] = 1.f;
  test::global_tokens g{{4, 0}, std::vector<float>(4 * cfg.hidden, 0.f)};
  const int pick[4][2] = {{0, 1}, {0, 2}, {2, 3}, {3, 1}};
  for (int t = 0; t < 4; ++t) {
    g.x[t * cfg.hidden + pick[t][0]] = 2.f;
    g.x[t * cfg.hidden + pick[t][1]] = 1.f;
  }
  // Bytes of a row (the space's element type), of an assignment's metadata.
  const index_t row = cfg.hidden * sizeof(typename test::space_io<Space>::value_type), meta = 8;

  using D = capacity::dropless;
  const auto plain = test::run_layer<test::threads_policies<2, D, Space>>(cfg, w, g).stats;
  const auto dedup = test::run_layer<dedup_policies<2, D, Space>>(cfg, w, g).stats;
  // Without dedup: one row per assignment. To rank 0: t0 x2, t1, t3 = 4; to rank 1: t1, t2 x2,
  // t3 = 4.
  CHECK(plain[0][0].rows_sent == std::vector<index_t>{4, 4});
  CHECK(plain[0][0].dispatch_bytes_sent == 4 * row);
  CHECK(plain[0][0].dispatch_bytes_received == 0);  // rank 1 has no tokens
  CHECK(plain[1][0].dispatch_bytes_received == 4 * row);
  CHECK(plain[1][0].combine_bytes_sent == 4 * row);
  // With dedup: one row per (token, rank): to rank 0: t0, t1, t3 = 3; to rank 1: t1, t2, t3 =
  // 3, plus 8 bytes of (index, weight) per assignment.
  CHECK(dedup[0][0].rows_sent == std::vector<index_t>{3, 3});
  CHECK(dedup[0][0].assignment_rows_sent == std::vector<index_t>{4, 4});
  CHECK(dedup[0][0].dispatch_bytes_sent == 3 * row + 4 * meta);
  CHECK(dedup[1][0].dispatch_bytes_received == 3 * row + 4 * meta);
  CHECK(dedup[1][0].combine_bytes_sent == 3 * row);  // one weighted sum per (token, rank)
  CHECK(dedup[0][0].combine_bytes_received == 3 * row);
  // The experts compute the same rows either way.
  CHECK(dedup[1][0].rows_per_local_expert == plain[1][0].rows_per_local_expert);
  CHECK(dedup[0][0].rows_per_local_expert == std::vector<index_t>{2, 2});
}

}  // namespace layer_dedup_tests
