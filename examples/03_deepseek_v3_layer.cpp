// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// A DeepSeek-V3-like MoE layer: 256 fine-grained routed experts in 8 groups, sigmoid scores
// with a selection-only bias, the best 4 groups per token, top-8, routed scaling 2.5, and
// one shared expert; widths scaled down (the model: H=7168, F=2048). 8 in-process ranks
// hold 32 experts each. It prints the load per group and per rank, then runs 200 passes
// of auxiliary-loss-free balancing (bias update after each pass) on skewed tokens and
// prints how the imbalance falls.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "args.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

using namespace epmoe;

struct deepseek_policies : default_policies {
  using router = epmoe::router::sigmoid_bias<8>;
  using comm = epmoe::comm::threads;
};

int main(int argc, char** argv) {
  cli::no_arguments(
      argc, argv,
      "usage: epmoe_deepseek_v3\n"
      "  A DeepSeek-V3-like layer (256 experts in 8 groups, top-8, a shared expert) on 8\n"
      "  in-process ranks: load per group and rank, then 200 passes of bias balancing. No\n"
      "  arguments.\n");
  const layer_config cfg{.hidden = 128,
                         .ffn = 32,
                         .experts = 256,
                         .top_k = 8,
                         .ranks = 8,
                         .max_tokens = 64,
                         .shared_experts = 1};
  const epmoe::router::sigmoid_bias<8> router{
      .groups = 8, .top_groups = 4, .scaling = 2.5f, .gamma = 1e-3f};
  auto full = reference::full_weights::random(cfg, 3);
  // Skew: experts 0..31 (group 0) get a head start for positive tokens.
  for (int e = 0; e < 32; ++e)
    for (int h = 0; h < cfg.hidden; ++h) full.gate[e * cfg.hidden + h] += 0.01f;

  const int passes = 200, E = cfg.experts, R = cfg.ranks;
  std::vector<index_t> first(E), last(E);
  std::vector<double> imbalance(passes);
  std::vector<pass_stats> stats(R);
  comm::threads_world world(R);
  world.run([&](comm::threads c) {
    const auto mine = reference::slice(full, placement::block(cfg), c.rank());
    moe_layer<deepseek_policies> layer(cfg, c, {full.gate_view(), mine.experts(), full.shared()},
                                       router);
    const index_t T = cfg.max_tokens, H = cfg.hidden;
    std::vector<float> y(T * H);
    for (int p = 0; p < passes; ++p) {
      auto x = reference::random_tokens(T, H, 1000 * p + c.rank());
      for (float& v : x) v = std::abs(v);
      layer.forward({x.data(), T, H}, {y.data(), T, H});
      const auto load = layer.update_router();  // collective: global load, then bias step
      if (c.rank() == 0) {
        if (p == 0) std::copy(load.begin(), load.end(), first.begin());
        if (p == passes - 1) std::copy(load.begin(), load.end(), last.begin());
        const double mean = static_cast<double>(T) * R * cfg.top_k / E;
        imbalance[p] = static_cast<double>(*std::max_element(load.begin(), load.end())) / mean;
      }
      if (p == 0) stats[c.rank()] = layer.stats();
    }
  });

  std::printf(
      "DeepSeek-V3-like layer: E=%d in 8 groups (top-4 groups), top-%d, 1 shared "
      "expert, scaling 2.5, %d ranks x %d tokens\n\n",
      E, cfg.top_k, R, cfg.max_tokens);
  const auto per_group = [&](const std::vector<index_t>& load, int g) {
    index_t n = 0;
    for (int e = 32 * g; e < 32 * (g + 1); ++e) n += load[e];
    return n;
  };
  std::printf("load per group, first pass (bias 0) and after %d passes of bias updates:\n", passes);
  for (int g = 0; g < 8; ++g)
    std::printf("  group %d: %5lld -> %5lld\n", g, static_cast<long long>(per_group(first, g)),
                static_cast<long long>(per_group(last, g)));
  std::printf("\nfirst pass, per rank (rank r holds experts [32r, 32r+32) = group r):\n");
  std::printf("  rank  rows computed  shared GFLOP  routed GFLOP  seq aux loss\n");
  for (int r = 0; r < R; ++r) {
    index_t rows = 0;
    for (index_t n : stats[r].rows_per_local_expert) rows += n;
    std::printf("  %4d %14lld %13.3f %13.3f %13.4f\n", r, static_cast<long long>(rows),
                stats[r].shared_flops * 1e-9, stats[r].expert_flops * 1e-9,
                stats[r].losses.seq_aux);
  }
  std::printf("\nmax/mean expert load while the bias learns (aux-loss-free balancing):\n");
  for (int p : {0, 25, 50, 100, 150, 199}) std::printf("  pass %3d: %.2f\n", p, imbalance[p]);
  return 0;
}
