// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Strategies side by side: sixteen policy bundles (three of them user policies from
// examples/policies/), each one compile-time type, run by
// epmoe::experiment on the same tokens, weights and in-process ranks, uniform tokens and
// then tokens skewed toward one expert. One table per input, then a verdict per question,
// each sentence chosen from the measured numbers.
// Usage: epmoe_strategies [--tokens T] [--ranks R] [--passes N] [--topology NAME] [--nodes N]
//                         [--no-turns] [--json FILE] [--csv FILE]
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "args.hpp"
#include "policies/gelu_mlp.hpp"
#include "policies/gelu_mlp_reference.hpp"
#include "policies/least_loaded.hpp"
#include "policies/top_p.hpp"
#include <epmoe/epmoe.hpp>
#include <epmoe/experiment.hpp>

using namespace epmoe;

namespace {

constexpr int E = 16;  // experts

template <class Router, class Capacity = capacity::dropless, class Placement = placement::block,
          bool Dedup = false, class Schedule = schedule::sequential>
struct bundle : default_policies {
  using router = Router;
  using capacity = Capacity;
  using placement = Placement;
  using schedule = Schedule;
  using comm = epmoe::comm::threads;  // replaced by the experiment's ranks
  static constexpr layer_options options{.dedup = Dedup};
};

using mixtral = bundle<router::mixtral<2>>;
/// DeepSeek-V3's router: sigmoid scores, 4 groups of 4 experts, the best 2 groups per token.
struct deepseek : bundle<router::sigmoid_bias<2>> {
  static epmoe::router::sigmoid_bias<2> make_router(const layer_config&) {
    return {.groups = 4, .top_groups = 2, .scaling = 1.f, .gamma = 0.01f};
  }
};
/// GPT-OSS: a learned bias on the logits, softmax over the top 2; clamped SwiGLU experts with
/// biases (alpha 1.702, limit 7, the +1 on up).
struct gpt_oss : bundle<router::gpt_oss<2>> {
  using expert = epmoe::expert::gpt_oss;
};
/// DeepSeek-V4: sqrtsoftplus scores, selection on s + bias, renormalised and scaled; SwiGLU
/// experts with gate and up clamped at 10.
struct deepseek_v4 : bundle<router::deepseek_v4<2>> {
  using expert = epmoe::expert::deepseek_v4;
  static epmoe::router::deepseek_v4<2> make_router(const layer_config&) {
    return {.scaling = 1.5f, .gamma = 0.01f, .eps = 1e-20f};
  }
};
using expert_choice = bundle<router::expert_choice>;
using hashed = bundle<router::hash<2>>;
using replicated = bundle<router::mixtral<2>, capacity::dropless, placement::table>;
using dedup = bundle<router::mixtral<2>, capacity::dropless, placement::block, true>;
using padded = bundle<router::mixtral<2>, capacity::factor<true>>;
using pipelined =
    bundle<router::mixtral<2>, capacity::dropless, placement::block, false, schedule::pipelined<4>>;

// Policies written as a user would, one header each (examples/policies/, docs/policies.md).
using top_p = bundle<::policies::top_p<2>>;
struct gelu : mixtral {
  using expert = ::policies::gelu_mlp;
};
using least_loaded = bundle<router::mixtral<2>, capacity::dropless, ::policies::least_loaded>;

namespace ex = epmoe::experiment;
constexpr ex::treatment over_link{.throttled = true};

using strategies = ex::list<
    ex::bundle<"mixtral top-2", mixtral>, ex::bundle<"deepseek groups", deepseek>,
    ex::bundle<"deepseek +bias", deepseek, ex::treatment{.bias_steps = 50}>,
    ex::bundle<"gpt-oss", gpt_oss>, ex::bundle<"deepseek-v4", deepseek_v4>,
    ex::bundle<"expert choice", expert_choice>, ex::bundle<"hash top-2", hashed>,
    ex::bundle<"block (table)", replicated>,
    ex::bundle<"balanced +4", replicated, ex::treatment{.from_load = true, .extra_slots = 4}>,
    ex::bundle<"dedup", dedup>, ex::bundle<"padded cf 1.25", padded>,
    ex::bundle<"sequential, link", mixtral, over_link>,
    ex::bundle<"pipelined 4, link", pipelined, over_link>, ex::bundle<"top-p 0.5 (user)", top_p>,
    ex::bundle<"GELU MLP (user)", gelu>,
    ex::bundle<"least-loaded (user)", least_loaded, ex::treatment{.from_load = true}>>;

const ex::row& find(const std::vector<ex::row>& t, const char* name) {
  for (const ex::row& r : t)
    if (r.name == name) return r;
  throw std::runtime_error(std::string("no bundle ") + name);
}

/// "fell"/"rose"/"stayed about the same": the verb from the numbers.
std::string moved(double before, double after, double flat = 0.05) {
  if (!std::isfinite(before) || !std::isfinite(after)) return "could not be measured:";
  if (std::abs(after - before) <= flat * std::max(std::abs(before), std::abs(after)))
    return "stayed about the same,";
  return after < before ? "fell" : "rose";
}

void verdicts(const std::vector<ex::row>& t) {
  const ex::row &top2 = find(t, "mixtral top-2"), &ec = find(t, "expert choice");
  const ex::row &ds = find(t, "deepseek groups"), &learnt = find(t, "deepseek +bias");
  const ex::row &block = find(t, "block (table)"), &bal = find(t, "balanced +4");
  const ex::row &dd = find(t, "dedup"), &pad = find(t, "padded cf 1.25");
  const ex::row& least = find(t, "least-loaded (user)");
  const ex::row &seq = find(t, "sequential, link"), &pipe = find(t, "pipelined 4, link");
  std::printf("  - expert max/mean under expert choice %s %.2f -> %.2f (top-2 -> expert choice)\n",
              moved(top2.expert_imbalance, ec.expert_imbalance, 0.01).c_str(),
              top2.expert_imbalance, ec.expert_imbalance);
  std::printf("  - DeepSeek's aux-loss-free bias, 50 updates: expert max/mean %s %.2f -> %.2f\n",
              moved(ds.expert_imbalance, learnt.expert_imbalance, 0.01).c_str(),
              ds.expert_imbalance, learnt.expert_imbalance);
  std::printf(
      "  - replicas: the straggler's excess %s %.0f%% -> %.0f%% (sim on %s: %.0f%% -> "
      "%.0f%%)\n",
      moved(block.straggler_excess, bal.straggler_excess, 0.01).c_str(),
      100 * block.straggler_excess, 100 * bal.straggler_excess, block.topology.c_str(),
      100 * block.predicted_excess, 100 * bal.predicted_excess);
  std::printf(
      "  - a user's least-loaded placement (no replicas): the straggler's excess %s "
      "%.0f%% -> %.0f%% (block -> least-loaded)\n",
      moved(block.straggler_excess, least.straggler_excess, 0.01).c_str(),
      100 * block.straggler_excess, 100 * least.straggler_excess);
  std::printf("  - dedup: rows dispatched to other ranks %s %lld -> %lld\n",
              moved(double(top2.dispatch_rows), double(dd.dispatch_rows), 0).c_str(),
              static_cast<long long>(top2.dispatch_rows), static_cast<long long>(dd.dispatch_rows));
  std::printf("  - padded capacity 1.25: %lld assignments dropped, %lld padding rows sent\n",
              static_cast<long long>(pad.dropped), static_cast<long long>(pad.padding_rows));
  std::printf("  - over the link, pipelining: the pass %s %.2f -> %.2f ms (sim: %.3f -> %.3f ms)\n",
              moved(seq.time.total, pipe.time.total).c_str(), 1e3 * seq.time.total,
              1e3 * pipe.time.total, 1e3 * seq.predicted_seconds, 1e3 * pipe.predicted_seconds);
  double worst = 0;
  for (const ex::row& r : t) worst = std::max(worst, r.error);
  std::printf("  - every bundle against the float64 reference: worst error %.1e (%s)\n", worst,
              worst <= 1e-4 ? "OK" : "FAILED");
}

}  // namespace

int main(int argc, char** argv) {
  cli::command_line cl(
      argc, argv,
      "usage: epmoe_strategies [--tokens T] [--ranks R] [--passes N]\n"
      "                        [--topology NAME] [--nodes N] [--no-turns]\n"
      "                        [--json FILE] [--csv FILE]\n"
      "  Sixteen policy bundles (routers, placement, dedup, capacity, schedule,\n"
      "  three user policies) on the same tokens and R in-process ranks\n"
      "  (1, 2 or 4; default 4, T = 256 tokens per rank, 16 experts, top-2): a table for\n"
      "  uniform and one for skewed tokens, then one verdict per question.\n"
      "  --topology: the simulator's cluster (h200, h100_nvlink_ib, cpu_cluster;\n"
      "  default h200) over --nodes nodes. --no-turns: the ranks' expert stages\n"
      "  run at once (default: in turns, each rank's time its own work).\n"
      "  JSON/CSV: both tables.\n");
  index_t T = 256;
  int R = 4, passes = 5;
  std::string json, csv, topology = "h200";
  int nodes = 1;
  bool turns = true;
  while (cl.next()) {
    if (cl.is("--tokens"))
      T = cl.integer();
    else if (cl.is("--ranks"))
      R = static_cast<int>(cl.integer());
    else if (cl.is("--passes"))
      passes = static_cast<int>(cl.integer());
    else if (cl.is("--topology"))
      topology = cl.value();
    else if (cl.is("--no-turns"))
      turns = false;
    else if (cl.is("--nodes"))
      nodes = static_cast<int>(cl.integer());
    else if (cl.is("--json"))
      json = cl.value();
    else if (cl.is("--csv"))
      csv = cl.value();
    else
      cl.unknown();
  }
  // 16 experts + 4 replicas ("balanced +4") fill the same slots on every rank: R in {1, 2, 4}.
  if (T < 1 || (R != 1 && R != 2 && R != 4) || passes < 1 || nodes < 1 || R % nodes != 0)
    cl.fail("need --tokens >= 1, --passes >= 1, --ranks 1, 2 or 4, --nodes dividing --ranks");
  const layer_config cfg{.hidden = 64,
                         .ffn = 128,
                         .experts = E,
                         .top_k = 2,
                         .ranks = R,
                         .max_tokens = static_cast<int>(T),
                         .capacity_factor = 1.25};
  const ex::options opt{.passes = passes,
                        .link = {.bandwidth = 2e9, .latency = 20e-6},
                        .turns = turns,
                        .topology = topology,
                        .nodes = nodes};
  std::vector<ex::row> all;
  int failed = 0;
  for (const bool skew : {false, true}) {
    const auto in = skew ? ex::inputs::skewed(cfg, 7, 3, 2.5) : ex::inputs::uniform(cfg, 7);
    auto table = ex::run(strategies{}, ex::thread_ranks{R}, in, opt);
    std::printf(
        "%s tokens, %d ranks x %lld tokens, %d experts, top-2 (times: median of %d "
        "passes, ms; sim: %s):\n",
        skew ? "Skewed" : "Uniform", R, static_cast<long long>(T), E, passes,
        table[0].topology.c_str());
    ex::print(std::cout, table);
    std::fflush(stdout);
    verdicts(table);
    std::printf("\n");
    for (ex::row& r : table) {
      failed += !(r.error <= 1e-4);
      r.name = (skew ? "skewed: " : "uniform: ") + r.name;
      all.push_back(r);
    }
  }
  if (!json.empty()) {
    std::ofstream f(json);
    ex::write_json(f, all);
  }
  if (!csv.empty()) {
    std::ofstream f(csv);
    ex::write_csv(f, all);
  }
  return failed ? 1 : 0;
}
