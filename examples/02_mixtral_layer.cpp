// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// A Mixtral-8x7B-like MoE layer (8 experts, top-2, softmax renormalised, SwiGLU experts,
// F = 3.5 H) with the model's 4096/14336 widths scaled by 1/8, on 2 in-process ranks.
// Prints the routing each pass produces and what it costs.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "args.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>

using namespace epmoe;

struct mixtral_policies : default_policies {
  using router = epmoe::router::mixtral<2>;
  using comm = epmoe::comm::threads;
};

int main(int argc, char** argv) {
  cli::no_arguments(
      argc, argv,
      "usage: epmoe_mixtral\n"
      "  A Mixtral-8x7B-like layer (widths / 8) on 2 in-process ranks: load per expert, bytes,\n"
      "  losses and stage times per pass. No arguments.\n");
  const layer_config cfg{
      .hidden = 512, .ffn = 1792, .experts = 8, .top_k = 2, .ranks = 2, .max_tokens = 128};
  const auto full = reference::full_weights::random(cfg, 8);
  std::vector<pass_stats> stats(cfg.ranks);
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const auto mine = reference::slice(full, placement::block(cfg), c.rank());
    moe_layer<mixtral_policies> layer(cfg, c, {full.gate_view(), mine.experts()});
    const index_t T = cfg.max_tokens, H = cfg.hidden;
    const auto x = reference::random_tokens(T, H, 100 + c.rank());
    std::vector<float> y(x.size());
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    stats[c.rank()] = layer.stats();
  });

  std::printf("Mixtral-like layer: H=%d F=%d E=%d top-%d, %d ranks x %d tokens\n\n", cfg.hidden,
              cfg.ffn, cfg.experts, cfg.top_k, cfg.ranks, cfg.max_tokens);
  std::printf("expert:      ");
  for (int e = 0; e < cfg.experts; ++e) std::printf("%6d", e);
  std::printf("\n");
  std::vector<index_t> load(cfg.experts, 0);
  for (int r = 0; r < cfg.ranks; ++r) {
    std::printf("from rank %d: ", r);
    for (int e = 0; e < cfg.experts; ++e) {
      std::printf("%6lld", static_cast<long long>(stats[r].routed_per_expert[e]));
      load[e] += stats[r].routed_per_expert[e];
    }
    std::printf("\n");
  }
  const double mean = 2.0 * cfg.max_tokens * cfg.ranks / cfg.experts;
  std::printf("max/mean expert load: %.2f\n\n",
              static_cast<double>(*std::max_element(load.begin(), load.end())) / mean);
  std::printf(
      "rank  rows computed  sent bytes  recv bytes  expert GFLOP  aux loss  z-loss  "
      "experts ms  total ms\n");
  for (int r = 0; r < cfg.ranks; ++r) {
    const pass_stats& s = stats[r];
    index_t rows = 0;
    for (index_t n : s.rows_per_local_expert) rows += n;
    std::printf("%4d %14lld %11lld %11lld %13.2f %9.4f %7.2f %11.1f %9.1f\n", r,
                static_cast<long long>(rows), static_cast<long long>(s.dispatch_bytes_sent),
                static_cast<long long>(s.dispatch_bytes_received), s.expert_flops * 1e-9,
                s.losses.aux, s.losses.z, s.time.experts * 1e3, s.time.total * 1e3);
  }
  return 0;
}
