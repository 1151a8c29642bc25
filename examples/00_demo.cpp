// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// epmoe demo: one expert-parallel MoE layer on 4 in-process ranks, 8 experts, top-2, with
// Mixtral's shape ratios (F = 3.5 H) scaled down to run in seconds on 2 cores. It prints
// what expert parallelism does, pass by pass, and checks the result against the plain
// reference forward pass.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "args.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>

using namespace epmoe;

struct policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;  // Mixtral routing
  using comm = epmoe::comm::threads;              // 4 ranks = 4 threads
};

int main(int argc, char** argv) {
  cli::no_arguments(
      argc, argv,
      "usage: epmoe_demo\n"
      "  One expert-parallel MoE layer on 4 in-process ranks (8 experts, top-2): what each rank\n"
      "  holds and sends, load per expert, bytes, stage times, FLOPs, and the error against the\n"
      "  reference forward pass. No arguments.\n");
  const layer_config cfg{
      .hidden = 256, .ffn = 896, .experts = 8, .top_k = 2, .ranks = 4, .max_tokens = 256};
  const int R = cfg.ranks, E = cfg.experts, L = cfg.experts_per_rank();
  const index_t T = cfg.max_tokens, H = cfg.hidden;
  const auto full = reference::full_weights::random(cfg, 2026);
  const auto x = reference::random_tokens(R * T, H, 7);  // rank r holds rows [rT, (r+1)T)
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());  // unwritten: NaN
  std::vector<pass_stats> stats(R);

  std::printf("epmoe demo: H=%lld F=%d E=%d top-%d, %d ranks x %lld tokens, GEMM: %s\n\n",
              static_cast<long long>(H), cfg.ffn, E, cfg.top_k, R, static_cast<long long>(T),
              space::host_gemm_backend());

  placement::block where(cfg);
  std::printf("Experts per rank (placement::block):\n");
  for (int r = 0; r < R; ++r) {
    std::printf("  rank %d:", r);
    for (int j = 0; j < L; ++j) std::printf(" e%d", where.expert_at(r, j));
    std::printf("\n");
  }

  comm::threads_world world(R);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(full, where, r);
    moe_layer<policies> layer(cfg, c, {full.gate_view(), mine.experts()});
    const matrix_view<const float> xr(x.data() + r * T * H, T, H);
    const matrix_view<float> yr(y.data() + r * T * H, T, H);
    layer.forward(xr, yr);  // warm-up: first touch of the workspace
    layer.forward(xr, yr);
    stats[r] = layer.stats();
  });

  std::printf("\nDispatch all-to-all: rows sent from rank (row) to rank (column):\n        ");
  for (int d = 0; d < R; ++d) std::printf("   to %d", d);
  std::printf("\n");
  for (int s = 0; s < R; ++s) {
    std::printf("  from %d", s);
    for (int d = 0; d < R; ++d)
      std::printf(" %6lld", static_cast<long long>(stats[s].rows_sent[d]));
    std::printf("\n");
  }

  std::vector<index_t> load(E, 0);
  for (int r = 0; r < R; ++r)
    for (int e = 0; e < E; ++e) load[e] += stats[r].routed_per_expert[e];
  index_t total = 0, busiest = 0;
  for (index_t n : load) {
    total += n;
    busiest = std::max(busiest, n);
  }
  std::printf("\nLoad per expert (rows, all ranks):");
  for (int e = 0; e < E; ++e) std::printf(" e%d=%lld", e, static_cast<long long>(load[e]));
  std::printf("\n  max/mean = %.2f (1.00 = perfectly balanced)\n",
              busiest / (static_cast<double>(total) / E));
  std::vector<index_t> rank_rows(R, 0);
  for (int r = 0; r < R; ++r)
    for (index_t n : stats[r].rows_per_local_expert) rank_rows[r] += n;
  const int straggler =
      static_cast<int>(std::max_element(rank_rows.begin(), rank_rows.end()) - rank_rows.begin());
  std::printf("  rows computed per rank:");
  for (int r = 0; r < R; ++r) std::printf(" %lld", static_cast<long long>(rank_rows[r]));
  std::printf("  -> rank %d is the straggler\n", straggler);

  std::printf("\nBytes per all-to-all (to / from other ranks; own rows stay local):\n");
  std::printf("  rank   dispatch sent   dispatch recv    combine sent    combine recv\n");
  for (int r = 0; r < R; ++r)
    std::printf("  %4d %15lld %15lld %15lld %15lld\n", r,
                static_cast<long long>(stats[r].dispatch_bytes_sent),
                static_cast<long long>(stats[r].dispatch_bytes_received),
                static_cast<long long>(stats[r].combine_bytes_sent),
                static_cast<long long>(stats[r].combine_bytes_received));

  std::printf("\nTime per stage (ms), second pass:\n");
  std::printf("  rank   route    plan permute dispatch experts combine  reduce   total\n");
  for (int r = 0; r < R; ++r) {
    const stage_times& t = stats[r].time;
    std::printf("  %4d %7.2f %7.2f %7.2f %8.2f %7.2f %7.2f %7.2f %7.2f\n", r, t.route * 1e3,
                t.plan * 1e3, t.permute * 1e3, t.dispatch * 1e3, t.experts * 1e3, t.combine * 1e3,
                t.reduce * 1e3, t.total * 1e3);
  }

  double flops = 0;
  for (int r = 0; r < R; ++r) flops += stats[r].expert_flops;
  const double dense = static_cast<double>(R * T) * E * expert::swiglu::flops_per_row(cfg);
  std::printf(
      "\nExpert FLOPs: %.3g (top-%d of %d) vs %.3g for a dense FFN of all experts: "
      "%.2fx (= K/E)\n",
      flops, cfg.top_k, E, dense, flops / dense);

  std::vector<float> want(y.size());
  reference::forward(full, policies::router{}, policies::capacity{}, {x.data(), R * T, H},
                     std::vector<index_t>(R, T), {want.data(), R * T, H});
  double scale = 0;
  for (float v : want) scale = std::max(scale, static_cast<double>(std::abs(v)));
  const double rel = reference::max_relative_error(y, want);  // NaN or Inf: infinite
  std::printf("\nMax error vs the reference forward pass: %.2e (relative to max |y| = %.3g): %s\n",
              rel, scale, rel <= 1e-4 ? "OK" : "FAILED");
  return rel <= 1e-4 ? 0 : 1;
}
