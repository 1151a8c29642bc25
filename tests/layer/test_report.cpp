// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

#include "harness.hpp"
#include "json.hpp"
#include <epmoe/core/report.hpp>
#include <epmoe/schedule/pipelined.hpp>
#include <epmoe/sim/source.hpp>

// Run reports: stats JSON lines (read back by the simulator) and a Chrome trace.
// A namespace per file: the test programs compile their files as one unit.
namespace report_tests {
using namespace epmoe;

namespace {

struct policies : test::threads_policies<2> {
  using schedule = epmoe::schedule::pipelined<2>;
};

struct recorded {
  std::vector<pass_record> records;  // every rank's, every pass
  std::vector<float> y, want;        // the last pass's outputs and the reference's
};

// Two passes on 4 ranks, bounded so that chunks take several rounds; every rank's records.
recorded run_recorded(int passes) {
  layer_config cfg{.hidden = 8, .ffn = 6, .experts = 8, .top_k = 2, .ranks = 4, .max_tokens = 24};
  cfg.max_recv_rows = 12;
  const auto w = reference::full_weights::random(cfg, 121);
  const auto g = test::make_tokens({24, 0, 17, 24}, cfg.hidden, 122);
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> y(g.x.size(), nan);
  std::vector<pass_record> records;
  std::mutex m;
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const auto mine = reference::slice(w, placement::block(cfg), r);
    moe_layer<policies> layer(cfg, c, {w.gate_view(), mine.experts()});
    const index_t T = g.per_rank[r], H = cfg.hidden;
    for (int p = 0; p < passes; ++p) {
      // Each pass starts from NaN: recording must not stand in for a pass that wrote nothing.
      std::fill(y.begin() + g.offset(r) * H, y.begin() + (g.offset(r) + T) * H, nan);
      layer.forward({g.x.data() + g.offset(r) * H, T, H}, {y.data() + g.offset(r) * H, T, H});
      pass_record rec = record_pass(layer);  // copies the stats: off the hot path
      std::lock_guard<std::mutex> lock(m);
      records.push_back(std::move(rec));
    }
  });
  // Files for tools/plot_stats.py when asked (EPMOE_REPORT_DIR), not otherwise.
  if (const char* dir = std::getenv("EPMOE_REPORT_DIR")) {
    std::ofstream stats(std::string(dir) + "/stats.jsonl"), trace(std::string(dir) + "/trace.json");
    write_stats_json(stats, records);
    write_trace_json(trace, records);
  }
  return {std::move(records), std::move(y), test::run_reference<policies>(cfg, w, g)};
}

}  // namespace

TEST_CASE("report: stats lines parse as JSON and the simulator reads them back",
          "[layer][report]") {
  const auto run = run_recorded(2);
  const auto& records = run.records;
  REQUIRE(records.size() == 8);
  CHECK(test::relative_error(run.y, run.want) <= 1e-5);  // the recorded passes computed y
  std::ostringstream os;
  write_stats_json(os, records);
  // Every line is one JSON object with the run's numbers.
  std::istringstream lines(os.str());
  std::set<std::pair<int, int>> seen;
  std::string line;
  std::size_t i = 0;
  while (std::getline(lines, line)) {
    const auto v = test::json::parse(line);
    const pass_record& r = records[i++];
    CHECK(v["rank"].n == r.rank);
    CHECK(v["pass"].n == r.pass);
    seen.insert({r.pass, r.rank});
    for (const char* key : {"tokens",
                            "top_k",
                            "routed_per_expert",
                            "experts",
                            "ranks",
                            "assignments",
                            "dropped",
                            "local_experts",
                            "rows_per_local_expert",
                            "rows_sent",
                            "rows_received",
                            "dispatch_bytes_sent",
                            "dispatch_bytes_received",
                            "combine_bytes_sent",
                            "combine_bytes_received",
                            "losses",
                            "rounds",
                            "peak_recv_rows",
                            "recv_buffer_rows",
                            "time",
                            "began"})
      CHECK(v.has(key));
    for (const char* stage : {"route", "plan", "permute", "dispatch", "experts", "combine",
                              "shared", "reduce", "total"})
      CHECK(v["time"].has(stage));
    CHECK(v["rows_sent"].a.size() == 4);
    CHECK(v["routed_per_expert"].a.size() == 8);
    CHECK(v["dropped"].n == 0);
    CHECK(v["dispatch_bytes_sent"].n == static_cast<double>(r.stats.dispatch_bytes_sent));
    CHECK(v["losses"].has("aux"));
  }
  CHECK(i == records.size());
  CHECK(seen.size() == 8);  // every (pass, rank)
  // The simulator's reader takes the same lines: the routing counts survive the trip.
  std::istringstream in(os.str());
  const auto back = sim::read_stats(in);
  REQUIRE(back.size() == records.size());
  for (std::size_t k = 0; k < back.size(); ++k) {
    CHECK(back[k].pass == records[k].pass);
    CHECK(back[k].rank == records[k].rank);
    CHECK(back[k].tokens == records[k].stats.tokens);
    CHECK(back[k].top_k == 2);
    CHECK(back[k].routed_per_expert == records[k].stats.routed_per_expert);
  }
  // ... and can replay one pass of it.
  const sim::recorded_source replay(back, 1);
  CHECK(replay.ranks() == 4);
  CHECK(replay.tokens(2) == 17);
}

TEST_CASE("report: the trace parses and has every rank, stage and counter", "[layer][report]") {
  const auto records = run_recorded(2).records;
  std::ostringstream os;
  write_trace_json(os, records);
  const auto v = test::json::parse(os.str());
  REQUIRE(v["traceEvents"].kind == test::json::value::array);
  std::map<int, std::set<std::string>> names;  // per rank (pid): slice, counter and track names
  int rounds_seen = 0;
  for (const auto& e : v["traceEvents"].a) {
    const int pid = static_cast<int>(e["pid"].n);
    const std::string ph = e["ph"].s;
    if (ph == "M") {
      names[pid].insert(e["args"]["name"].s);
      continue;
    }
    names[pid].insert(e["name"].s);
    if (ph == "X") {
      CHECK(e["dur"].n >= 0);
      CHECK(e["ts"].n >= 0);
      if (e["args"].has("round") && e["args"]["round"].n > 0) ++rounds_seen;
    } else {
      CHECK(ph == "C");
    }
  }
  REQUIRE(names.size() == 4);
  for (int r = 0; r < 4; ++r)
    for (const char* want :
         {"rank 0", "stages", "pass 0", "pass 1", "route", "plan", "permute", "shared", "reduce",
          "dispatch", "experts", "combine", "rows", "bytes"}) {
      const std::string w = std::string(want) == "rank 0" ? "rank " + std::to_string(r) : want;
      INFO("rank " << r << ": " << w);
      CHECK(names[r].count(w) == 1);
    }
  CHECK(rounds_seen > 0);  // the bound split chunks into rounds, and the trace shows them
}

}  // namespace report_tests
