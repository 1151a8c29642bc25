// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// A layer made only of stand-in policies (tests/policies/stand_ins.hpp) compiles and runs:
// the contracts in core/checks.hpp are all the layer needs.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "stand_ins.hpp"
#include <epmoe/reference/compare.hpp>

using epmoe::index_t;

TEST_CASE("stand-ins: a layer of the smallest policies runs and routes each token to its expert",
          "[policies]") {
  const epmoe::layer_config cfg{
      .hidden = 4, .ffn = 4, .experts = 2, .top_k = 1, .ranks = 1, .max_tokens = 3};
  // Gate: expert 0 scores x[0], expert 1 scores x[1]. Expert 0 doubles, expert 1 negates.
  const std::vector<float> gate{1, 0, 0, 0, 0, 1, 0, 0};
  std::vector<float> w(2 * 16, 0.f);
  for (int h = 0; h < 4; ++h) {
    w[h * 4 + h] = 2.f;
    w[16 + h * 4 + h] = -1.f;
  }
  epmoe::moe_layer<stand_in::policies> layer(cfg, stand_in::comm{},
                                             {{gate.data(), 2, 4}, {{w.data(), 2, 4, 4}}});
  const std::vector<float> x{1, 0, 3, 4, 0, 1, 5, 6, 2, 1, 0, 1};
  std::vector<float> y(12, NAN);
  layer.forward({x.data(), 3, 4}, {y.data(), 3, 4});
  const std::vector<float> want{2, 0, 6, 8, 0, -1, -5, -6, 4, 2, 0, 2};
  CHECK(epmoe::reference::max_relative_error(y, want) == 0);
  CHECK(layer.stats().routed_per_expert == std::vector<index_t>{2, 1});
}
