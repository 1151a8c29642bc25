// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// epmoe_simulate's flags (examples/07_simulate.cpp): what they are and how they are read.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "args.hpp"

namespace simulate_example {

struct args {
  int ranks = 64, nodes = 8, experts = 256, top_k = 8, hidden = 7168, ffn = 2048;
  int tokens = 4096, chunks = 4, extra_slots = -1, show = 5;
  std::string placement = "block", capacity = "dropless", schedule = "sequential";
  std::string topology = "h100_nvlink_ib", trace, stats, calibrate;
  double skew = 1.2;
  bool dedup = false, compare = false, validate = false, topology_set = false;
  bool hierarchical = false;  // the two-level exchange, and a flat / dedup / two-level table
  int node_limit = 0;         // > 0: each token's experts on at most this many nodes' groups
  bool compare_set = false, single = false;  // --compare / --no-compare; --placement/--schedule
  int passes = 5, shared = 0, rounds = 11, max_recv_rows = 0;
  std::uint64_t seed = 1;
  std::vector<int> lost;  // --lose-ranks: what if these ranks die
};

constexpr const char* usage_text =
    "usage: epmoe_simulate [--ranks R] [--nodes N] [--experts E] [--top-k K] [--hidden H]\n"
    "  [--ffn F] [--tokens T per rank] [--placement block|round_robin|balanced|mirrored]\n"
    "  [--extra-slots S (balanced; default R)] [--capacity dropless|FACTOR] [--dedup]\n"
    "  [--hierarchical]: the two-level exchange (one row per (token, node), fanned out in the\n"
    "      node), and flat vs dedup vs two-level side by side (bytes per link class, times)\n"
    "  [--node-limit M]: node-limited routing (DeepSeek-V3: 4): the experts in --nodes equal\n"
    "      groups, each token's top-k within its M groups (with --skew's load)\n"
    "  [--schedule sequential|pipelined] [--chunks C] [--max-recv-rows N] [--skew ZIPF]\n"
    "  [--stats FILE (recorded stats lines instead of --skew)] [--seed N]\n"
    "  [--topology h100_nvlink_ib|h200|cpu_cluster|FILE] [--trace out.json] [--show N]\n"
    "  [--lose-ranks r,r,...]: then what if those ranks die: capacity lost, the new straggler\n"
    "      (the balanced placement, or the one --placement names)\n"
    "  [--compare | --no-compare]: block vs balanced x sequential vs pipelined, and the\n"
    "      answer (who straggles, by how much, what replication and overlap recover); the\n"
    "      default unless --placement or --schedule names one configuration\n"
    "  --calibrate FILE [--ranks R (2)] [--tokens T (256)] [--hidden H] [--ffn F] [--experts E]\n"
    "      [--top-k K]: measure comm::threads, host GEMM and memory rates; write a topology\n"
    "  --validate [--ranks R (2)] [--tokens T (256)] [--topology FILE] [--passes P]\n"
    "      [--shared N] [--skew Z] [--max-recv-rows N] ...:\n"
    "      predicted vs measured per-stage times of a real layer on comm::threads\n";

// A bad setting found after parsing: what was wrong and the usage, on stderr; exit 2.
[[noreturn]] inline void usage_error(const std::string& why) {
  std::fprintf(stderr, "epmoe_simulate: %s\n%s", why.c_str(), usage_text);
  std::exit(2);
}

inline args parse(int argc, char** argv) {
  args a;
  cli::command_line cl(argc, argv, usage_text);
  const auto integer = [&] { return static_cast<int>(cl.integer()); };
  while (cl.next()) {
    if (cl.is("--ranks"))
      a.ranks = integer();
    else if (cl.is("--nodes"))
      a.nodes = integer();
    else if (cl.is("--experts"))
      a.experts = integer();
    else if (cl.is("--top-k"))
      a.top_k = integer();
    else if (cl.is("--hidden"))
      a.hidden = integer();
    else if (cl.is("--ffn"))
      a.ffn = integer();
    else if (cl.is("--tokens"))
      a.tokens = integer();
    else if (cl.is("--chunks"))
      a.chunks = integer();
    else if (cl.is("--max-recv-rows"))
      a.max_recv_rows = integer();
    else if (cl.is("--extra-slots"))
      a.extra_slots = integer();
    else if (cl.is("--show"))
      a.show = integer();
    else if (cl.is("--placement"))
      a.placement = cl.value(), a.single = true;
    else if (cl.is("--capacity"))
      a.capacity = cl.value();
    else if (cl.is("--schedule"))
      a.schedule = cl.value(), a.single = true;
    else if (cl.is("--topology"))
      a.topology = cl.value(), a.topology_set = true;
    else if (cl.is("--calibrate"))
      a.calibrate = cl.value();
    else if (cl.is("--validate"))
      a.validate = true;
    else if (cl.is("--passes"))
      a.passes = integer();
    else if (cl.is("--shared"))
      a.shared = integer();
    else if (cl.is("--rounds"))
      a.rounds = integer();
    else if (cl.is("--trace"))
      a.trace = cl.value();
    else if (cl.is("--stats"))
      a.stats = cl.value();
    else if (cl.is("--skew"))
      a.skew = cl.number();
    else if (cl.is("--seed"))
      a.seed = static_cast<std::uint64_t>(cl.integer());
    else if (cl.is("--dedup"))
      a.dedup = true;
    else if (cl.is("--hierarchical"))
      a.hierarchical = true;
    else if (cl.is("--node-limit"))
      a.node_limit = integer();
    else if (cl.is("--lose-ranks"))
      for (long long r : cl.integers()) a.lost.push_back(static_cast<int>(r));
    else if (cl.is("--compare"))
      a.compare = a.compare_set = true;
    else if (cl.is("--no-compare"))
      a.compare = false, a.compare_set = true;
    else
      cl.unknown();
  }
  for (int r : a.lost)
    if (r < 0 || r >= a.ranks)
      cl.fail("--lose-ranks: rank " + std::to_string(r) + " is not in [0, --ranks)");
  if (a.placement != "block" && a.placement != "round_robin" && a.placement != "balanced" &&
      a.placement != "mirrored")
    cl.fail("--placement must be block, round_robin, balanced or mirrored, not " + a.placement);
  if (a.node_limit < 0 || a.node_limit > a.nodes)
    cl.fail("--node-limit must be in [1, --nodes] (0: off), not " + std::to_string(a.node_limit));
  if (a.node_limit > 0 && a.experts % a.nodes != 0)
    cl.fail("--node-limit needs --nodes to divide --experts (a group of experts per node)");
  if (a.node_limit > 0 && !a.stats.empty())
    cl.fail("--node-limit routes its own tokens: not with --stats");
  if (a.schedule != "sequential" && a.schedule != "pipelined")
    cl.fail("--schedule must be sequential or pipelined, not " + a.schedule);
  if (a.capacity != "dropless") {
    char* end = nullptr;
    const double cf = std::strtod(a.capacity.c_str(), &end);
    if (*end != '\0' || !(cf > 0)) cl.fail("--capacity must be dropless or a factor > 0");
  }
  if (!a.calibrate.empty() || a.validate) {  // this machine: small defaults unless given
    auto given = [&](const char* f) {
      for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) == f) return true;
      return false;
    };
    if (!given("--ranks")) a.ranks = 2;
    if (!given("--nodes")) a.nodes = 1;
    if (!given("--experts")) a.experts = 8;
    if (!given("--top-k")) a.top_k = 2;
    if (!given("--hidden")) a.hidden = 512;
    if (!given("--ffn")) a.ffn = 1024;
    if (!given("--tokens")) a.tokens = 256;
    if (!given("--skew")) a.skew = 0;
  }
  // Without --placement or --schedule the tool answers the comparison (block vs balanced x
  // sequential vs pipelined); naming one runs just that configuration.
  if (!a.compare_set) a.compare = !a.single && !a.hierarchical;
  if (a.extra_slots < 0) a.extra_slots = a.ranks;  // one spare slot per rank
  return a;
}

}  // namespace simulate_example
