// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Load balancing by placement: a Zipf-skewed token stream over 64 experts on 8 in-process
// ranks makes the ranks of the hot experts stragglers. After one pass, the balancer builds a
// replicated table from the measured load (with 0, 8 and 16 extra slots), the layer moves
// the expert weights live, and the next pass shows the straggler's excess shrink.
// Usage: epmoe_load_balance [zipf exponent, default 1.0]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "args.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/reference/weights.hpp>

using namespace epmoe;

struct policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using placement = epmoe::placement::table;
  using comm = epmoe::comm::threads;
};

int main(int argc, char** argv) {
  cli::command_line cl(argc, argv,
                       "usage: epmoe_load_balance [ZIPF]\n"
                       "  ZIPF: skew of the token stream (default 1.0) over 64 experts on 8\n"
                       "  in-process ranks; prints the straggler's excess before and after\n"
                       "  balancing with 0, 8 and 16 extra slots.\n");
  double s = 1.0;
  for (int given = 0; cl.next(); ++given)
    if (cl.positional() && given == 0)
      s = cl.number_here();
    else
      cl.unknown();
  const int E = 64, R = 8;
  const index_t T = 256, H = 64;
  std::printf(
      "Zipf(%.2f) token stream over %d experts on %d ranks, top-2, %lld tokens per rank\n\n", s, E,
      R, static_cast<long long>(T));
  std::printf(
      "extra slots | straggler excess before -> after | rank max/mean before -> after"
      " | balancer greedy / refined | bytes moved\n");
  for (int extra : {0, 8, 16}) {
    const layer_config cfg{.hidden = static_cast<int>(H),
                           .ffn = 32,
                           .experts = E,
                           .top_k = 2,
                           .ranks = R,
                           .max_tokens = static_cast<int>(T)};
    auto full = reference::full_weights::random(cfg, 1);
    // The gate reads feature e for expert e, so a token with 2 at feature a and 1 at b picks
    // (a, b); a and b are drawn from Zipf(s): hot experts sit on the first ranks.
    std::fill(full.gate.begin(), full.gate.end(), 0.f);
    for (int e = 0; e < E; ++e) full.gate[e * H + e] = 1.f;
    // Start: every rank holds its block of experts plus `extra / R` copies of its last ones.
    std::vector<int> start;
    const int S = (E + extra) / R;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < S; ++j) start.push_back(r * (E / R) + (j < E / R ? j : j - E / R));
    const placement::table first(E, R, start);

    double before = 0, after = 0, before_mm = 0, after_mm = 0, greedy = 0, refined = 0;
    index_t moved = 0;
    std::vector<index_t> moved_per_rank(R);
    comm::threads_world world(R);
    world.run([&](comm::threads c) {
      const int r = c.rank();
      const auto mine = reference::slice(full, first, r);
      moe_layer<policies> layer(cfg, c, {full.gate_view(), mine.experts()}, {}, {}, first);
      std::vector<double> zipf(E);
      for (int e = 0; e < E; ++e) zipf[e] = 1.0 / std::pow(e + 1.0, s);
      std::mt19937_64 rng(10 + r);
      std::discrete_distribution<int> pick(zipf.begin(), zipf.end());
      auto x = reference::random_tokens(T, H, 10 + r);
      for (float& v : x) v *= 0.25f;  // small features elsewhere
      for (index_t t = 0; t < T; ++t) {
        const int a = pick(rng);
        int b = pick(rng);
        while (b == a) b = pick(rng);
        x[t * H + a] = 2.f;
        x[t * H + b] = 1.f;
      }
      std::vector<float> y(x.size());
      layer.forward({x.data(), T, H}, {y.data(), T, H});
      const auto load = layer.gather_load();
      const std::vector<double> l(load.per_expert.begin(), load.per_expert.end());
      const auto plan = placement::balance(l, {.ranks = R, .extra_slots = extra});
      moved_per_rank[r] = layer.apply_placement(plan.refined);
      layer.forward({x.data(), T, H}, {y.data(), T, H});
      const auto load2 = layer.gather_load();
      if (r == 0) {
        before = load.ranks.excess;
        after = load2.ranks.excess;
        before_mm = load.ranks.max_over_mean;
        after_mm = load2.ranks.max_over_mean;
        greedy = plan.greedy_max_over_mean;
        refined = plan.refined_max_over_mean;
      }
    });
    for (index_t b : moved_per_rank) moved += b;
    std::printf(
        "%11d | %+14.0f%% -> %+6.0f%%         | %12.2f -> %5.2f        | %7.2f / %-7.2f   | %lld\n",
        extra, 100 * before, 100 * after, before_mm, after_mm, greedy, refined,
        static_cast<long long>(moved));
  }
  std::printf(
      "\nexcess = (busiest rank's rows - mean) / mean: how much longer every other rank "
      "waits.\nThe balancer's figures assume a copy takes load/copies; the pass after "
      "shows what the layer measured.\n");
  return 0;
}
