// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The README's usage example: 4 in-process ranks, 8 experts, top-2.
#include <cstdio>
#include <vector>

#include "args.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>

// Pick policies by overriding slots of the defaults.
struct policies : epmoe::default_policies {
  using router = epmoe::router::topk_softmax<2>;  // Mixtral: softmax, top-2, renormalised
  using capacity = epmoe::capacity::factor<>;     // drop past ceil(cf * T * K / E) rows
  using comm = epmoe::comm::threads;              // ranks are threads of this process
};

int main(int argc, char** argv) {
  cli::no_arguments(
      argc, argv,
      "usage: epmoe_quickstart\n"
      "  The README's usage example: 4 in-process ranks, 8 experts, top-2. No arguments.\n");
  const epmoe::layer_config cfg{.hidden = 64,
                                .ffn = 128,
                                .experts = 8,
                                .top_k = 2,
                                .ranks = 4,
                                .max_tokens = 32,
                                .capacity_factor = 1.25};
  const auto full = epmoe::reference::full_weights::random(cfg, /*seed=*/42);

  std::vector<epmoe::pass_stats> stats(cfg.ranks);
  epmoe::comm::threads_world world(cfg.ranks);
  world.run([&](epmoe::comm::threads comm) {
    const int rank = comm.rank();
    // Every rank holds the gate and its own E/R experts (views: no copies are made).
    const auto mine = epmoe::reference::slice(full, epmoe::placement::block(cfg), rank);
    epmoe::moe_layer<policies> layer(cfg, comm, {full.gate_view(), mine.experts()});

    const epmoe::index_t T = cfg.max_tokens;
    std::vector<float> x = epmoe::reference::random_tokens(T, cfg.hidden, /*seed=*/rank);
    std::vector<float> y(x.size());
    layer.forward({x.data(), T, cfg.hidden}, {y.data(), T, cfg.hidden});  // collective
    stats[rank] = layer.stats();
  });

  for (int r = 0; r < cfg.ranks; ++r)
    std::printf("rank %d: sent %lld rows, experts computed %lld rows, dropped %lld\n", r,
                static_cast<long long>(stats[r].dispatch_bytes_sent / (cfg.hidden * 4)),
                static_cast<long long>(stats[r].rows_per_local_expert[0] +
                                       stats[r].rows_per_local_expert[1]),
                static_cast<long long>(stats[r].dropped));
  return 0;
}
