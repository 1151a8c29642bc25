// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// What every bundle of an experiment runs on (config, weights, each rank's tokens) and the
// experiment's options (passes, link, turns, the simulator's cluster).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/comm/throttled.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::experiment {

// --- inputs and options -----------------------------------------------------------------------

/// What every bundle runs on: the config, the full weights (each rank takes its slots), and
/// each rank's tokens.
struct inputs {
  layer_config cfg;
  reference::full_weights weights;
  std::vector<std::vector<float>> tokens;  // [rank]: T_r rows of H, T_r <= max_tokens

  index_t tokens_of(int rank) const {
    return static_cast<index_t>(tokens[static_cast<std::size_t>(rank)].size()) / cfg.hidden;
  }

  /// Random weights and max_tokens random tokens per rank.
  static inputs uniform(const layer_config& cfg, std::uint64_t seed) {
    inputs in{cfg, reference::full_weights::random(cfg, seed), {}};
    for (int r = 0; r < cfg.ranks; ++r)
      in.tokens.push_back(reference::random_tokens(cfg.max_tokens, cfg.hidden,
                                                   seed + 1 + static_cast<std::uint64_t>(r)));
    return in;
  }
  /// The same tokens moved toward expert `hot`'s gate row so that its logit rises by `boost`
  /// on every token: data from one domain, the router unchanged.
  static inputs skewed(const layer_config& cfg, std::uint64_t seed, int hot, double boost) {
    inputs in = uniform(cfg, seed);
    const index_t H = cfg.hidden;
    const float* g = in.weights.gate.data() + hot * H;
    double norm2 = 0;
    for (index_t i = 0; i < H; ++i) norm2 += double{g[i]} * g[i];
    const auto a = static_cast<float>(boost / std::max(norm2, 1e-30));
    for (auto& x : in.tokens)
      for (std::size_t t = 0; t < x.size() / H; ++t)
        for (index_t i = 0; i < H; ++i) x[t * H + i] += a * g[i];
    return in;
  }
};

struct options {
  int passes = 5;                 // timed passes after one warm-up: times are their medians
  comm::link link{};              // of the bundles treated `throttled`
  bool turns = true;              // thread ranks take turns for their expert stages
  std::string topology = "h200";  // the simulator's cluster (sim::preset), "" for none
  int nodes = 1;                  //   over this many nodes (ranks split evenly)
};

}  // namespace epmoe::experiment
