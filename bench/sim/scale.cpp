// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The simulator at scale (issue 9): 1024 ranks x 256 experts x 4096 tokens per rank, top-8,
// block-like (balanced table, 1 slot per rank) and uniform/Zipf; prints the wall time of
// simulate() and of its parts (routing the sources, planning), best of N runs.
//   epmoe_sim_scale [--ranks 1024] [--nodes 128] [--experts 256] [--tokens 4096] [--reps 3]
//                   [--threads N (0: the hardware's)]
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "../../examples/args.hpp"
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/sim/simulate.hpp>
#include <epmoe/sim/source.hpp>

using namespace epmoe;
using clk = std::chrono::steady_clock;

static double since(clk::time_point t) {
  return std::chrono::duration<double>(clk::now() - t).count();
}

int main(int argc, char** argv) {
  int R = 1024, N = 128, E = 256, K = 8, T = 4096, reps = 3, threads = 0;
  cli::command_line cl(
      argc, argv,
      "usage: epmoe_sim_scale [--ranks 1024] [--nodes 128] [--experts 256] [--tokens 4096]\n"
      "  [--reps 3] [--threads N (0: the hardware's)]\n"
      "  Wall time of the simulator's plan at scale (top-8; uniform and Zipf 1.2), best of\n"
      "  --reps runs.\n");
  while (cl.next()) {
    int* field = cl.is("--ranks")     ? &R
                 : cl.is("--nodes")   ? &N
                 : cl.is("--experts") ? &E
                 : cl.is("--tokens")  ? &T
                 : cl.is("--reps")    ? &reps
                 : cl.is("--threads") ? &threads
                                      : nullptr;
    if (!field) cl.unknown();
    *field = static_cast<int>(cl.integer());
  }
  if (R < 1 || N < 1 || R % N != 0 || E < K || T < 1 || reps < 1 || threads < 0)
    cl.fail("needs ranks, nodes, tokens, reps >= 1, nodes dividing ranks, experts >= 8");
  const layer_config cfg{
      .hidden = 7168, .ffn = 2048, .experts = E, .top_k = K, .ranks = R, .max_tokens = T};
  const auto topo = sim::h100_nvlink_ib(N);
  for (double skew : {0.0, 1.2}) {
    const auto src = skew > 0 ? sim::zipf(E, skew, K, T) : sim::uniform(E, K, T);
    const int extra = ((E + R - 1) / R) * R - E + (E % R == 0 ? R : 0);  // >= 1 slot per rank
    const auto table =
        placement::balance(src.expected_load(), {.ranks = R, .nodes = N, .extra_slots = extra})
            .refined;
    double best_route = 1e9, best_sim = 1e9, best_cpu = 1e9, latency = 0;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T) * K);
    std::vector<float> w(ids.size());
    for (int rep = 0; rep < reps; ++rep) {
      auto t0 = clk::now();
      for (int r = 0; r < R; ++r) src.route(r, {{ids.data(), T, K}, {w.data(), T, K}});
      best_route = std::min(best_route, since(t0));
      t0 = clk::now();
      const std::clock_t c0 = std::clock();
      const auto s = sim::simulate<sim::policies<placement::table>>(cfg, topo, src,
                                                                    {.threads = threads}, table);
      best_sim = std::min(best_sim, since(t0));
      best_cpu = std::min(best_cpu, double(std::clock() - c0) / CLOCKS_PER_SEC);
      latency = s.latency;
    }
    std::printf(
        "%s: %d ranks x %d experts x %d tokens/rank, top-%d, balanced table (+%d "
        "slots): simulate %.3f s wall, %.3f s CPU (routing the source alone %.3f s); latency %.1f "
        "us\n",
        skew > 0 ? "zipf 1.2" : "uniform", R, E, T, K, extra, best_sim, best_cpu, best_route,
        latency * 1e6);
  }
}
