// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <regex>
#include <set>
#include <string>

#include "tour.hpp"

// Each step of the tour asserts what is robust on small shapes: counts, bytes, FLOPs, ratios
// of work, the order of events on a pass's timeline. Times are never asserted (this machine
// is shared); for them the test checks that the sentence says what the numbers say, both with
// made-up numbers (each direction, and a contradiction) and on the real run.
using namespace epmoe;
using namespace epmoe::tour;

namespace {

constexpr double nan_value = std::numeric_limits<double>::quiet_NaN();

bool has(const std::string& sentence, const char* what) {
  return sentence.find(what) != std::string::npos;
}

/// A change as a sentence prints it: "<what> <verb> A -> B<unit>".
struct printed_change {
  std::string verb;
  double before = 0, after = 0;
};

printed_change find_change(const std::string& sentence, const std::string& what) {
  const std::regex re(std::regex_replace(what, std::regex(R"([()'])"), R"(\$&)") +
                      R"( (fell|rose|stayed about the same,) (-?[0-9.]+) -> (-?[0-9.]+))");
  std::smatch m;
  INFO(sentence);
  REQUIRE(std::regex_search(sentence, m, re));
  return {m[1].str(), std::stod(m[2].str()), std::stod(m[3].str())};
}

/// The verb agrees with the two numbers as printed (`half` of their last digit of rounding):
/// "fell" never joins a rise, "rose" never a fall, "stayed" only values within the band.
void check_verb(const printed_change& c, double half, double flat = 0.05) {
  CAPTURE(c.verb, c.before, c.after);
  if (c.verb == "fell")
    CHECK(c.after <= c.before);
  else if (c.verb == "rose")
    CHECK(c.after >= c.before);
  else
    CHECK(std::abs(c.after - c.before) <=
          flat * std::max(std::abs(c.before), std::abs(c.after)) + 3 * half);
}

/// The printed numbers are the measured ones, rounded.
void check_printed(const printed_change& c, double before, double after, double half) {
  CHECK(std::abs(c.before - before) <= half * 1.0001);
  CHECK(std::abs(c.after - after) <= half * 1.0001);
}

machine_load quiet() {
  return {.calibration_ms_before = 7,
          .calibration_ms_after = 7.1,
          .core_share = 0.99,
          .pass_spread = 0.1};
}

}  // namespace

TEST_CASE("tour sentences: the verb of a change is chosen from its two values", "[tour]") {
  CHECK(trend_of(290.1, 447.4) == trend::rose);
  CHECK(trend_of(43.8, 83.8) == trend::rose);
  CHECK(trend_of(59.2, 31.8) == trend::fell);
  CHECK(trend_of(14.1, 14.2) == trend::flat);
  CHECK(trend_of(14.1, 14.2, 0) == trend::rose);  // counts: no band
  CHECK(trend_of(nan_value, 1) == trend::unknown);
  CHECK(trend_of(1, std::numeric_limits<double>::infinity()) == trend::unknown);
  CHECK(change("the wait", 43.8, 83.8, 1, " ms") == "the wait rose 43.8 -> 83.8 ms");
  CHECK(change("the wait", 83.8, 43.8, 1, " ms") == "the wait fell 83.8 -> 43.8 ms");
  CHECK(change("the wait", 14.1, 14.2, 1, " ms") ==
        "the wait stayed about the same, 14.1 -> 14.2 ms");
  CHECK(has(change("the wait", nan_value, 1, 1, " ms"), "could not be measured"));
}

TEST_CASE("tour sentences: the load check says when the machine was busy", "[tour]") {
  CHECK(busy_because(quiet()).empty());
  machine_load m = quiet();
  m.core_share = 0.4;  // the kernel waited for a core 60% of the time
  CHECK(has(busy_because(m), "40% of a core"));
  m = quiet();
  m.calibration_ms_after = 19;  // the same kernel ran 2.7x slower after the step
  CHECK(has(busy_because(m), "after"));
  m = quiet();
  m.pass_spread = 1.4;
  CHECK(has(busy_because(m), "2.4x the fastest"));
  m.pass_spread = nan_value;
  CHECK_FALSE(busy_because(m).empty());
  // The cause of a contradiction: busy first, then a shape too small to time, else other work.
  m = quiet();
  m.core_share = 0.4;
  CHECK(has(likely_cause(m, 50), "busy"));
  CHECK(has(likely_cause(m, 50), "rerun"));
  CHECK(has(likely_cause(quiet(), 0.2), "too small a shape"));
  CHECK(has(likely_cause(quiet(), 50), "other work on the cores"));
}

TEST_CASE("tour sentences: step 3's time is said to follow the FLOPs only when it does", "[tour]") {
  compute_result r;
  r.ranks = 4;
  r.flops_per_token_topk = 1.57e6;
  r.flops_per_token_dense = 6.29e6;
  r.flop_ratio = 0.25;
  r.load = quiet();
  const auto with_times = [&](double top_ms, double dense_ms) {
    r.expert_seconds_topk = top_ms / 1e3;
    r.expert_seconds_dense = dense_ms / 1e3;
    r.time_ratio = top_ms / dense_ms;
    return conclusion(r);
  };
  const std::string follows = with_times(24.5, 117.3);
  CHECK(has(follows, "fell 117.3 -> 24.5 ms"));
  CHECK(has(follows, "compute per token does not"));
  CHECK_FALSE(has(follows, "contradicts"));
  // The issue's run: 0.83 of the dense time for 0.25 of the FLOPs.
  const std::string weak = with_times(97.4, 117.3);
  CHECK(has(weak, "fell 117.3 -> 97.4 ms, 0.83x for 0.25x the FLOPs"));
  CHECK(has(weak, "contradicts"));
  CHECK_FALSE(has(weak, "compute per token does not"));
  const std::string rose = with_times(130, 117.3);
  CHECK(has(rose, "rose 117.3 -> 130.0 ms"));
  CHECK(has(rose, "contradicts"));
  r.load.core_share = 0.3;
  CHECK(has(with_times(130, 117.3), "the machine was busy"));
  CHECK(has(with_times(24.5, 117.3), "rerun for steady times"));  // agrees, but say so
  r.load = quiet();
  CHECK(has(with_times(0.9, 1.0), "too small a shape"));  // 0.23 ms per rank
}

TEST_CASE("tour sentences: step 6 says rose when pipelining exposed more", "[tour]") {
  overlap_result r;
  r.bandwidth = 19.2e6;
  r.experts_seconds = 0.021;
  r.boundaries = r.overlapped_boundaries = 12;
  r.load = quiet();
  const auto with = [&](double exp_seq, double exp_pipe, double pass_seq, double pass_pipe) {
    r.exposed_sequential = exp_seq / 1e3;
    r.exposed_pipelined = exp_pipe / 1e3;
    r.total_sequential = pass_seq / 1e3;
    r.total_pipelined = pass_pipe / 1e3;
    r.comm_pipelined = r.comm_sequential = exp_seq / 1e3;
    r.overlap_pipelined = 1 - r.exposed_pipelined / r.comm_pipelined;
    return conclusion(r);
  };
  const std::string hid = with(59.2, 31.8, 122.7, 114.4);
  CHECK(has(hid, "the exposed all-to-all time fell 59.2 -> 31.8 ms"));
  CHECK(has(hid, "the pass fell 122.7 -> 114.4 ms"));
  CHECK_FALSE(has(hid, "contradicts"));
  // The issue's run on a loaded machine: both rose, and the sentence must say so.
  r.load.pass_spread = 1.2;
  const std::string loaded = with(290.1, 447.4, 573.7, 1227.9);
  CHECK(has(loaded, "the exposed all-to-all time rose 290.1 -> 447.4 ms"));
  CHECK(has(loaded, "the pass rose 573.7 -> 1227.9 ms"));
  CHECK(has(loaded, "contradicts"));
  CHECK(has(loaded, "the machine was busy"));
  CHECK_FALSE(has(loaded, "cut"));
  r.load = quiet();
  CHECK(has(with(59.2, 31.8, 114.4, 122.7), "contradicts"));  // hidden, yet the pass rose
  r.overlapped_boundaries = 0;                                // the timeline shows no overlap
  const std::string serial = with(59.2, 31.8, 122.7, 114.4);
  CHECK(has(serial, "at only 0 of 12 chunk boundaries"));
  CHECK(has(serial, "contradicts"));
}

TEST_CASE("tour sentences: step 8 says the wait rose when it rose", "[tour]") {
  straggler_result r;
  r.hot_expert = 5;
  r.hot_rank = r.straggler_before = 2;
  r.extra_slots = 4;
  r.hot_copies = 3;
  r.excess_before = 0.64;
  r.excess_after = 0.02;
  r.load = quiet();
  const auto with = [&](std::vector<double> before, std::vector<double> after) {
    r.expert_ms_before = before;
    r.expert_ms_after = after;
    r.wait_ms_before.clear();
    r.wait_ms_after.clear();
    for (double t : before) r.wait_ms_before.push_back(max_of(before) - t);
    for (double t : after) r.wait_ms_after.push_back(max_of(after) - t);
    return conclusion(r);
  };
  const std::string cut = with({9.67, 5.94, 23.92, 6.94}, {11.94, 12.76, 12.57, 17.34});
  CHECK(has(cut, "hot expert 5 makes its rank 2 the straggler with 64% more rows"));
  CHECK(has(cut, "the excess fell 64 -> 2%"));
  r.experts_of_rank_after = {{0, 7, 4}, {1, 2, 3}, {5, 5, 4}, {5, 6, 3}};  // two copies on rank 2
  CHECK(has(conclusion(r), "(expert 5: 3 copies on 2 ranks)"));
  CHECK(has(cut, "the longest wait fell 17.98 -> 5.40 ms"));
  CHECK_FALSE(has(cut, "contradicts"));
  // The issue's run: the wait rose 43.8 -> 83.8 ms.
  const std::string rose = with({10, 20, 53.8, 30}, {20, 103.8, 40, 50});
  CHECK(has(rose, "the longest wait rose 43.80 -> 83.80 ms"));
  CHECK(has(rose, "contradicts"));
  // By time another rank was the slowest: said, and a contradiction.
  const std::string other = with({30, 5, 20, 6}, {12, 12, 12, 13});
  CHECK(has(other, "by time rank 0 was the slowest"));
  CHECK(has(other, "contradicts"));
  r.straggler_before = 1;  // the rows' straggler is not the hot expert's rank: said
  CHECK(has(with({9.67, 23.92, 5.94, 6.94}, {11.94, 12.76, 12.57, 17.34}),
            "hot expert 5 lives on rank 2, yet rank 1 is the straggler"));
  CHECK(has(with({9.67, 23.92, 5.94, 6.94}, {11.94, 12.76, 12.57, 17.34}), "contradicts"));
  r.straggler_before = 2;
  r.excess_after = 0.8;  // replicas that made the rows worse
  CHECK(has(with({9.67, 5.94, 23.92, 6.94}, {11.94, 12.76, 12.57, 17.34}),
            "the excess rose 64 -> 80%"));
}

TEST_CASE("tour sentences: steps 1, 4, 5 and 7 say what their numbers say", "[tour]") {
  distribution_result d;
  d.experts_of_rank = {{0, 1}, {2, 3}};
  d.bytes_per_rank = {2e6, 2e6};
  d.replicated_bytes = 4e6;
  d.saving = 2;
  CHECK_FALSE(has(conclusion(d), "contradicts"));
  d.saving = 1;
  CHECK(has(conclusion(d), "contradicts"));

  routing_result g;
  g.expert_rows_uniform = g.expert_rows_skewed = {10, 10, 10, 10};
  g.expert_max_over_mean_uniform = g.expert_max_over_mean_skewed = 1;
  CHECK(has(conclusion(g), "stayed about the same"));
  CHECK(has(conclusion(g), "contradicts"));
  g.expert_rows_skewed = {4, 4, 28, 4};
  g.expert_max_over_mean_skewed = 2.8;
  CHECK(has(conclusion(g), "max/mean per expert rose 1.00 -> 2.80"));
  CHECK_FALSE(has(conclusion(g), "contradicts"));

  capacity_result c;
  c.padded = {{.factor = 0.5, .buffer_rows = 128, .drop_skewed = 0.5, .shapes_fixed = true},
              {.factor = 2, .buffer_rows = 512, .drop_skewed = 0.05, .shapes_fixed = true}};
  c.dropless_busiest_rows = {271, 619};
  c.dropless_drop = {0, 0};
  CHECK(has(conclusion(c), "the drops on skewed inputs fell 50.0 -> 5.0%"));
  CHECK_FALSE(has(conclusion(c), "contradicts"));
  c.padded[1].drop_skewed = 0.6;
  CHECK(has(conclusion(c), "the drops on skewed inputs rose 50.0 -> 60.0%"));
  CHECK(has(conclusion(c), "contradicts"));

  // Step 7 on the shared NaN-aware measure: a NaN (or unwritten, NaN-filled) row of the
  // layer's output is an infinite error, and the sentence says the sum is NOT the output.
  trace_result t;
  t.token = 3;
  t.found = true;
  t.experts = {2, 6};
  t.ranks = {1, 3};
  t.weights = {0.5, 0.5};
  t.input_diff = {0, 0};
  t.combined = t.reference_row = {0.5, -0.25, 1.0};
  t.layer_row = {0.5, -0.25, 1.0};
  compare_rows(t);
  CHECK(t.combined_vs_layer == 0);
  CHECK_FALSE(has(conclusion(t), "contradicts"));
  t.layer_row[1] = nan_value;
  compare_rows(t);
  CHECK(std::isinf(t.combined_vs_layer));
  CHECK(has(conclusion(t), "is NOT (NaN or Inf in a row) the layer's output"));
  CHECK(has(conclusion(t), "contradicts"));
}

TEST_CASE("tour 1: every expert lives on exactly one rank, a rank holds 1/R of them", "[tour]") {
  for (int R : {2, 4, 8}) {
    CAPTURE(R);
    const options o = options::small(R);
    const auto r = what_ep_distributes(thread_ranks{R}, o);
    std::multiset<int> held;
    for (const auto& v : r.experts_of_rank) {
      CHECK(v.size() == static_cast<std::size_t>(experts / R));
      held.insert(v.begin(), v.end());
    }
    CHECK(held == std::multiset<int>{0, 1, 2, 3, 4, 5, 6, 7});
    const double expert_bytes = r.replicated_bytes - r.gate_bytes;
    for (double b : r.bytes_per_rank) CHECK(b == Approx(expert_bytes / R + r.gate_bytes));
    CHECK(r.saving > 0.9 * R);
  }
}

TEST_CASE("tour 2: exactly two row all-to-alls per pass, and their bytes are the stats'",
          "[tour]") {
  for (int R : {2, 4}) {
    CAPTURE(R);
    const auto r = communication_pattern(thread_ranks{R}, options::small(R));
    CHECK(r.row_exchanges_per_pass == 2);
    CHECK(r.counts_exchanges_per_pass == 1);
    CHECK(r.same_on_every_rank_and_pass);
    CHECK(r.stats_match);
    // Every row that went out comes back: the combine moves what the dispatch moved.
    CHECK(sum(r.dispatch_bytes) == sum(r.combine_bytes));
    CHECK(sum(r.dispatch_bytes) > 0);
    for (double b : r.dispatch_bytes) CHECK(std::fmod(b, r.row_bytes) == 0);
  }
}

TEST_CASE("tour 3: expert FLOPs per token of top-K over all E experts is K/E", "[tour]") {
  const options o = options::small(4);
  const auto r = compute_per_token(thread_ranks{4}, o, 3);
  CHECK(r.flop_ratio == Approx(double(top_k) / experts).epsilon(1e-12));
  CHECK(r.flops_per_token_dense ==
        Approx(experts * expert::swiglu::flops_per_row(o.hidden, o.ffn)));
  // The times are whatever this machine gave; the sentence must say what they were.
  const auto c = find_change(r.conclusion, "the experts' time (all ranks, median pass)");
  check_verb(c, 0.05);
  check_printed(c, 1e3 * r.expert_seconds_dense, 1e3 * r.expert_seconds_topk, 0.05);
  CHECK(has(r.conclusion, "contradicts") == !time_follows_flops(r));
}

TEST_CASE("tour 4: skewed inputs make the hot expert and its rank the busiest", "[tour]") {
  const options o = options::small(4);
  const auto r = routing_imbalance(thread_ranks{4}, o);
  const double assignments = double(o.tokens) * o.ranks * top_k;
  CHECK(sum(r.expert_rows_uniform) == assignments);
  CHECK(sum(r.expert_rows_skewed) == assignments);
  CHECK(r.busiest_expert_skewed == o.hot_expert);
  CHECK(r.expert_max_over_mean_skewed > r.expert_max_over_mean_uniform);
  CHECK(r.rank_max_over_mean_skewed > r.rank_max_over_mean_uniform);
  CHECK(argmax(r.rank_rows_skewed) == placement::block(o.config()).rank_of(o.hot_expert));
}

TEST_CASE("tour 5: padded capacity fixes shapes, a larger factor drops less", "[tour]") {
  const options o = options::small(4);
  const auto r = capacity_and_padding(thread_ranks{4}, o, {0.5, 1.0, 1.5, 2.0});
  REQUIRE(r.padded.size() == 4);
  for (std::size_t i = 0; i < r.padded.size(); ++i) {
    const capacity_row& c = r.padded[i];
    CAPTURE(c.factor);
    CHECK(c.shapes_fixed);
    CHECK(c.capacity == std::ceil(c.factor * o.tokens * top_k / experts));
    CHECK(c.buffer_rows == o.ranks * c.capacity);
    if (i > 0) {
      CHECK(c.drop_skewed <= r.padded[i - 1].drop_skewed);
      CHECK(c.drop_uniform <= r.padded[i - 1].drop_uniform);
    }
  }
  CHECK(r.padded.front().drop_skewed > r.padded.back().drop_skewed);
  CHECK_FALSE(r.dropless_shapes_fixed);
  CHECK(r.dropless_drop == std::vector<double>{0, 0});
  CHECK(r.dropless_busiest_rows[1] > r.dropless_busiest_rows[0]);
}

TEST_CASE(
    "tour 6: the pipelined pass puts chunk c+1's dispatch on the wire during chunk c's "
    "experts",
    "[tour]") {
  // Shapes where the experts take milliseconds, so the modelled wire time is well above the
  // link's latency and the threads' barriers.
  options o = options::small(2);
  o.hidden = 128;
  o.ffn = 256;
  o.tokens = 256;
  const auto r = hiding_latency(thread_ranks{2}, o, 3);
  // The overlap, from the pass's timeline: an order of events, which a loaded machine can
  // stretch but not reorder. Every rank, every chunk boundary (2 ranks x 3 boundaries).
  REQUIRE(r.boundaries == 2 * (r.chunks - 1));
  CHECK(r.overlapped_boundaries == r.boundaries);
  // The times: only that the sentence follows them.
  const auto exposed = find_change(r.conclusion, "the exposed all-to-all time");
  check_verb(exposed, 0.05);
  check_printed(exposed, 1e3 * r.exposed_sequential, 1e3 * r.exposed_pipelined, 0.05);
  const auto pass = find_change(r.conclusion, "the pass");
  check_verb(pass, 0.05);
  check_printed(pass, 1e3 * r.total_sequential, 1e3 * r.total_pipelined, 0.05);
  CHECK(has(r.conclusion, "contradicts") ==
        (exposed.verb != "fell" || pass.verb == "rose" || r.overlapped_boundaries != r.boundaries));
}

TEST_CASE("tour 7: a token's two returned rows, weighted, are its output and the reference's",
          "[tour]") {
  for (int R : {2, 4}) {
    CAPTURE(R);
    const auto r = trace_one_token(thread_ranks{R}, options::small(R));
    REQUIRE(r.found);
    CHECK(r.ranks[0] != r.ranks[1]);
    CHECK(r.weights[0] + r.weights[1] == Approx(1.0));
    REQUIRE(r.input_diff.size() == static_cast<std::size_t>(top_k));
    for (double d : r.input_diff) CHECK(d == 0);  // the token's own row travels
    CHECK(r.combined_vs_layer <= 1e-6);
    CHECK(r.combined_vs_reference <= 1e-4);
  }
}

TEST_CASE("tour 8: the hot expert's rank is the straggler, replicas lower its excess", "[tour]") {
  for (int R : {2, 4}) {
    CAPTURE(R);
    const auto r = the_straggler(thread_ranks{R}, options::small(R), 3);
    CHECK(r.straggler_before == r.hot_rank);
    CHECK(r.excess_after < r.excess_before);
    CHECK(r.hot_copies > 1);
    CHECK(sum(r.rows_after) == sum(r.rows_before));  // the same rows, placed better
    const auto excess = find_change(r.conclusion, "the excess");
    CHECK(excess.verb == "fell");
    check_printed(excess, 100 * r.excess_before, 100 * r.excess_after, 0.5);
    // The wait is a time: the sentence follows it, whichever way it went.
    const auto wait = find_change(r.conclusion, "the longest wait");
    check_verb(wait, 0.005);
    check_printed(wait, max_of(r.wait_ms_before), max_of(r.wait_ms_after), 0.005);
  }
}
