// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// What each step of the tour measured (one struct of numbers per step) and what it concludes:
// `conclusion(result)` is a pure function of those numbers, so a sentence can only say what
// was measured. Every verb of change is chosen from the two values it joins ("fell", "rose",
// "stayed about the same"); a measurement that goes against the fact its step illustrates is
// said to, with its likely cause. The tests drive these functions with made-up numbers.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace epmoe::tour {

inline constexpr int experts = 8;  // E: fixed, so that "all E experts" is a compile-time top-k
inline constexpr int top_k = 2;    // K: each token runs two experts

// --- helpers -----------------------------------------------------------------------------

/// printf into a std::string: conclusions are computed, then formatted.
inline std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

/// A rate in bytes/s, in the unit that reads best.
inline std::string rate(double bytes_per_second) {
  return bytes_per_second >= 1e9 ? format("%.2f GB/s", bytes_per_second / 1e9)
                                 : format("%.1f MB/s", bytes_per_second / 1e6);
}

inline double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }
inline double max_of(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}
inline double min_of(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::min_element(v.begin(), v.end());
}
inline int argmax(const std::vector<double>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}
inline double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
/// How much slower the median pass was than the fastest: median / min - 1 (0: all equal).
inline double spread(const std::vector<double>& passes) {
  const double lo = min_of(passes);
  return lo > 0 ? median(passes) / lo - 1 : 0;
}

// --- the measured direction --------------------------------------------------------------

enum class trend { fell, rose, flat, unknown };

/// How `after` compares with `before`: flat when they differ by at most `flat` of the larger
/// (timings move by a few percent from pass to pass; counts use 0); unknown for NaN or Inf.
inline trend trend_of(double before, double after, double flat = 0.05) {
  if (!std::isfinite(before) || !std::isfinite(after)) return trend::unknown;
  if (std::abs(after - before) <= flat * std::max(std::abs(before), std::abs(after)))
    return trend::flat;
  return after < before ? trend::fell : trend::rose;
}

/// "<what> fell 14.1 -> 7.2 ms", "... rose ...", "... stayed about the same, 14.1 -> 14.3 ms":
/// the verb from the numbers, never from what the step expects.
inline std::string change(const std::string& what, double before, double after, int digits,
                          const char* unit, double flat = 0.05) {
  const std::string numbers = format("%.*f -> %.*f%s", digits, before, digits, after, unit);
  switch (trend_of(before, after, flat)) {
    case trend::fell:
      return what + " fell " + numbers;
    case trend::rose:
      return what + " rose " + numbers;
    case trend::flat:
      return what + " stayed about the same, " + numbers;
    default:
      return what + " could not be measured (" + numbers + ")";
  }
}

// --- the load check ----------------------------------------------------------------------

/// How busy the machine was around a timed step: a fixed single-thread kernel timed before
/// and after the step (no rank runs then), and the spread of the step's own passes.
struct machine_load {
  double calibration_ms_before = 0;  // wall time of the kernel, median of its runs (0: not run)
  double calibration_ms_after = 0;
  double core_share = 1;   // the kernel's CPU time / wall time: below 1 it waited for a core
  double pass_spread = 0;  // the step's timed passes: worst over ranks of median / fastest - 1
};

/// Why a step's times cannot be trusted, or "" when the load check saw nothing. A kernel that
/// gets less than 85% of a core, runs 30% slower or faster after the step than before, or a
/// median pass 1.5x the fastest: something else was running.
inline std::string busy_because(const machine_load& m) {
  std::string why;
  const auto add = [&](const std::string& s) { why += (why.empty() ? "" : ", ") + s; };
  if (!(m.core_share >= 0.85))
    add(format("a fixed kernel got %.0f%% of a core", 100 * m.core_share));
  if (m.calibration_ms_before > 0 || m.calibration_ms_after > 0) {
    const double drift = m.calibration_ms_after / m.calibration_ms_before;
    if (!(drift < 1.3 && drift > 1 / 1.3))
      add(format("it took %.2f ms before the step and %.2f ms after", m.calibration_ms_before,
                 m.calibration_ms_after));
  }
  if (!(m.pass_spread <= 0.5))
    add(format("the median pass took %.1fx the fastest", 1 + m.pass_spread));
  return why;
}

/// The likely cause of a time that contradicts its step's fact; `work_ms` is the timed work
/// per rank (below 1 ms, fixed costs weigh as much as the work).
inline std::string likely_cause(const machine_load& m, double work_ms) {
  const std::string busy = busy_because(m);
  if (!busy.empty()) return "the machine was busy (" + busy + "): rerun";
  if (!(work_ms >= 1.0))
    return format(
        "too small a shape (%.2f ms of work per rank: waking threads, barriers and caches cost "
        "as much as the work): run the default shapes",
        work_ms);
  return "other work on the cores between the load checks, which saw none: rerun";
}

/// What a timed step adds to its sentence: the contradiction and its likely cause when the
/// times go against `fact`, else a note when the machine was busy, else nothing.
inline std::string verdict(bool agrees, const char* fact, const machine_load& m, double work_ms) {
  if (!agrees)
    return format("; this contradicts the fact (%s), likely cause: ", fact) +
           likely_cause(m, work_ms);
  const std::string busy = busy_because(m);
  return busy.empty() ? "" : "; the machine was busy (" + busy + "): rerun for steady times";
}

// --- 1. what EP distributes --------------------------------------------------------------

struct distribution_result {
  int ranks = 0;
  std::vector<std::vector<int>> experts_of_rank;  // [R][L]: the experts each rank holds
  std::vector<double> bytes_per_rank;  // weights each rank's layer was built with (expert + gate)
  double gate_bytes = 0;               // the router's gate: on every rank
  double replicated_bytes = 0;         // all E experts + gate, on every rank
  double saving = 0;                   // replicated / the largest rank
  std::string conclusion;
};

inline std::string conclusion(const distribution_result& r) {
  std::size_t lo = experts, hi = 0;
  for (const auto& v : r.experts_of_rank) lo = std::min(lo, v.size()), hi = std::max(hi, v.size());
  const std::string held =
      lo == hi ? format("each rank holds %zu", hi) : format("ranks hold %zu to %zu", lo, hi);
  const std::string less = r.saving > 1 ? format("%.2fx less", r.saving)
                                        : format(
                                              "%.2fx: no less; this contradicts the fact "
                                              "(EP divides the experts' weights)",
                                              r.saving);
  return format(
      "%s of %d experts: %.2f MB of weights on the fullest rank instead of %.2f MB "
      "replicated (%s; only the %.0f KB gate is on every rank)",
      held.c_str(), experts, max_of(r.bytes_per_rank) / 1e6, r.replicated_bytes / 1e6, less.c_str(),
      r.gate_bytes / 1e3);
}

// --- 2. the communication pattern --------------------------------------------------------

struct exchanges_result {
  int passes = 0;
  int counts_exchanges_per_pass = 0;  // alltoall of row counts (small, fixed size)
  int row_exchanges_per_pass = 0;     // alltoallv of token rows: dispatch, combine
  bool same_on_every_rank_and_pass = false;
  double counts_bytes = 0;                   // per rank and pass, to other ranks
  std::vector<double> dispatch_bytes;        // [R]: first row exchange, seen by the comm
  std::vector<double> combine_bytes;         // [R]: second row exchange
  std::vector<double> stats_dispatch_bytes;  // [R]: what the layer's stats report
  std::vector<double> stats_combine_bytes;   // [R]
  double row_bytes = 0;                      // H * 4
  bool stats_match = false;
  std::string conclusion;
};

inline std::string conclusion(const exchanges_result& r) {
  const double R = std::max<double>(1, static_cast<double>(r.dispatch_bytes.size()));
  return format(
      "%d all-to-all%s of rows per pass%s (dispatch %.0f KB, combine %.0f KB per rank on "
      "average), plus %d small exchange%s of counts (%.0f B)%s%s",
      r.row_exchanges_per_pass, r.row_exchanges_per_pass == 1 ? "" : "s",
      r.same_on_every_rank_and_pass ? " on every rank, every pass"
                                    : ", NOT the same on every rank and pass",
      sum(r.dispatch_bytes) / R / 1e3, sum(r.combine_bytes) / R / 1e3, r.counts_exchanges_per_pass,
      r.counts_exchanges_per_pass == 1 ? "" : "s", r.counts_bytes,
      r.stats_match ? "; the layer's stats report the same bytes" : "; STATS DISAGREE",
      r.row_exchanges_per_pass == 2 ? ""
                                    : "; this contradicts the fact (two all-to-alls of rows per "
                                      "pass: dispatch and combine)");
}

// --- 3. compute per token ----------------------------------------------------------------

struct compute_result {
  int k = top_k, experts = tour::experts, ranks = 0;
  double flops_per_token_topk = 0;   // measured: expert FLOPs of all ranks / tokens
  double flops_per_token_dense = 0;  // the same layer with every token on all E experts
  double flop_ratio = 0;             // = K/E
  double expert_seconds_topk = 0;    // experts stage summed over ranks (median pass of each)
  double expert_seconds_dense = 0;
  double time_ratio = 0;  // top-K / dense
  machine_load load;
  std::string conclusion;
};

/// The time follows the FLOPs when it fell with them and within a factor 2 of their ratio
/// (GEMMs of fewer rows run somewhat slower per FLOP).
inline bool time_follows_flops(const compute_result& r) {
  return trend_of(r.expert_seconds_dense, r.expert_seconds_topk) == trend::fell &&
         r.time_ratio <= 2 * r.flop_ratio && r.time_ratio >= r.flop_ratio / 2;
}

inline std::string conclusion(const compute_result& r) {
  const double ke = double(r.k) / r.experts;
  const bool k_over_e = std::abs(r.flop_ratio - ke) <= 1e-9 * ke;
  const bool follows = time_follows_flops(r);
  const double work_ms = 1e3 * r.expert_seconds_topk / std::max(1, r.ranks);
  return format("top-%d of %d runs %.2f MFLOP per token instead of %.2f: a ratio of %.3f %s K/E; ",
                r.k, r.experts, r.flops_per_token_topk / 1e6, r.flops_per_token_dense / 1e6,
                r.flop_ratio, k_over_e ? "=" : "!=") +
         change("the experts' time (all ranks, median pass)", 1e3 * r.expert_seconds_dense,
                1e3 * r.expert_seconds_topk, 1, " ms") +
         format(", %.2fx for %.2fx the FLOPs", r.time_ratio, r.flop_ratio) +
         (follows ? ": parameters grow with E, compute per token does not" : "") +
         (k_over_e ? "" : "; this contradicts the fact (top-K runs K/E of the FLOPs)") +
         verdict(follows, "the experts' time follows their FLOPs", r.load, work_ms);
}

// --- 4. data-dependent routing -> imbalance ------------------------------------------------

struct routing_result {
  int hot_expert = 0;
  std::vector<double> expert_rows_uniform, expert_rows_skewed;  // [E], all ranks' tokens
  std::vector<double> rank_rows_uniform, rank_rows_skewed;      // [R]: rows each rank computed
  double expert_max_over_mean_uniform = 0, expert_max_over_mean_skewed = 0;
  double rank_max_over_mean_uniform = 0, rank_max_over_mean_skewed = 0;
  int busiest_expert_skewed = 0;
  std::string conclusion;
};

inline std::string conclusion(const routing_result& r) {
  const int b = r.busiest_expert_skewed;
  const bool agrees =
      trend_of(r.expert_max_over_mean_uniform, r.expert_max_over_mean_skewed, 0) == trend::rose;
  return format(
             "the same router sends expert %d %.0f%% of all rows on skewed inputs (%.0f%% on "
             "uniform): ",
             b, 100 * r.expert_rows_skewed[b] / sum(r.expert_rows_skewed),
             100 * r.expert_rows_uniform[b] / sum(r.expert_rows_uniform)) +
         change("max/mean per expert", r.expert_max_over_mean_uniform,
                r.expert_max_over_mean_skewed, 2, "", 0) +
         ", " +
         change("per rank", r.rank_max_over_mean_uniform, r.rank_max_over_mean_skewed, 2, "", 0) +
         (agrees ? "" : "; this contradicts the fact (routing, and so the load, follows the data)");
}

// --- 5. capacity and padding ---------------------------------------------------------------

struct capacity_row {
  double factor = 0;
  double capacity = 0;      // rows one source rank may send one expert: ceil(cf * T * K / E)
  double buffer_rows = 0;   // rows each expert's GEMM gets, padding included (all sources)
  double drop_uniform = 0;  // share of (token, expert) assignments dropped
  double drop_skewed = 0;
  bool shapes_fixed = false;  // exchange counts and expert rows equal for both inputs
};

struct capacity_result {
  std::vector<capacity_row> padded;  // capacity::factor<true>, one row per factor
  bool dropless_shapes_fixed = false;
  std::vector<double> dropless_busiest_rows;  // [uniform, skewed]: the busiest expert's rows
  std::vector<double> dropless_drop;          // [uniform, skewed]: share dropped (none)
  std::string conclusion;
};

inline std::string conclusion(const capacity_result& r) {
  bool all_fixed = true;
  for (const auto& row : r.padded) all_fixed &= row.shapes_fixed;
  const capacity_row& lo = r.padded.front();
  const capacity_row& hi = r.padded.back();
  const bool dropless_drops = sum(r.dropless_drop) > 0;
  const bool agrees =
      all_fixed && !dropless_drops && trend_of(lo.drop_skewed, hi.drop_skewed, 0) != trend::rose;
  return format(
             "padded to capacity, shapes are %s across inputs; from capacity factor %.2f to "
             "%.2f ",
             all_fixed ? "fixed" : "NOT fixed", lo.factor, hi.factor) +
         change("each expert's buffer", lo.buffer_rows, hi.buffer_rows, 0, " rows", 0) + " and " +
         change("the drops on skewed inputs", 100 * lo.drop_skewed, 100 * hi.drop_skewed, 1, "%",
                0) +
         format("; dropless %s but its shapes %s (",
                dropless_drops ? "DROPS rows" : "keeps every row",
                r.dropless_shapes_fixed ? "stay fixed" : "change with the data") +
         change("the busiest expert's rows", r.dropless_busiest_rows[0], r.dropless_busiest_rows[1],
                0, "", 0) +
         ")" +
         (agrees ? ""
                 : "; this contradicts the fact (padding fixes shapes, a larger capacity drops "
                   "less, dropless drops nothing)");
}

// --- 6. hiding all-to-all latency ----------------------------------------------------------

struct overlap_result {
  int chunks = 4;
  double bandwidth = 0;        // the modelled link, bytes/s: sized so comm ~ compute
  double latency = 20e-6;      // seconds per exchange
  double experts_seconds = 0;  // expert compute of one pass (unthrottled, slowest rank)
  double comm_sequential = 0;  // all-to-all time of a pass, slowest rank (median pass)
  double exposed_sequential = 0;
  double total_sequential = 0;
  double comm_pipelined = 0;
  double exposed_pipelined = 0;
  double total_pipelined = 0;
  double overlap_pipelined = 0;  // share of the all-to-all time hidden behind experts
  // From the pipelined pass's timeline (stats().timeline), every rank, last pass: how many
  // chunk boundaries c -> c+1 there were, and at how many chunk c+1's dispatch started
  // before chunk c's experts ended (was on the wire while they computed).
  int boundaries = 0;
  int overlapped_boundaries = 0;
  machine_load load;
  std::string conclusion;
};

inline std::string conclusion(const overlap_result& r) {
  const bool hidden = trend_of(r.exposed_sequential, r.exposed_pipelined) == trend::fell;
  const bool pass_ok = trend_of(r.total_sequential, r.total_pipelined) != trend::rose;
  const bool timeline_ok = r.boundaries > 0 && r.overlapped_boundaries == r.boundaries;
  const std::string timeline =
      timeline_ok ? ""
                  : format(
                        "; the timeline shows chunk c+1's dispatch in flight during chunk c's "
                        "experts at only %d of %d chunk boundaries",
                        r.overlapped_boundaries, r.boundaries);
  return format(
             "over a link where one all-to-all costs as much as the experts (%s), pipelining %d "
             "chunks hid %.0f%% of its all-to-all time behind expert compute: ",
             rate(r.bandwidth).c_str(), r.chunks, 100 * std::max(0.0, r.overlap_pipelined)) +
         change("the exposed all-to-all time", 1e3 * r.exposed_sequential,
                1e3 * r.exposed_pipelined, 1, " ms") +
         " and " + change("the pass", 1e3 * r.total_sequential, 1e3 * r.total_pipelined, 1, " ms") +
         timeline +
         verdict(hidden && pass_ok && timeline_ok,
                 "pipelining hides all-to-all time behind expert compute, and the pass gets "
                 "shorter",
                 r.load, 1e3 * r.experts_seconds);
}

// --- 7. one token, two experts on two ranks ------------------------------------------------

struct trace_result {
  bool found = false;
  int home_rank = 0;
  int token = -1;
  std::vector<int> experts, ranks, slots;    // [K]: chosen experts, their ranks and local slots
  std::vector<double> weights;               // [K]: router weights (sum to 1)
  std::vector<double> send_rows;             // [K]: row of the home rank's send buffer
  std::vector<double> input_diff;            // [K]: relative error, row the expert got vs x[t]
  std::vector<std::vector<double>> outputs;  // [K][H]: what each expert returned
  std::vector<double> combined;              // [H]: sum_k weight_k * output_k
  std::vector<double> layer_row;             // [H]: the layer's y[t]
  std::vector<double> reference_row;         // [H]: the reference forward pass's y[t]
  // reference::max_relative_error: NaN, Inf or a missing row count as infinite.
  double combined_vs_layer = 0;      // combined vs the layer's row (float order: 0)
  double combined_vs_reference = 0;  // combined vs the float64 reference
  std::string conclusion;
};

inline constexpr double trace_layer_tolerance = 1e-6;      // the same float sum, in any order
inline constexpr double trace_reference_tolerance = 1e-4;  // float vs float64

inline std::string conclusion(const trace_result& r) {
  if (r.token < 0 || r.experts.size() < 2)
    return format("no token of rank %d picked two experts; nothing to follow", r.home_rank);
  const auto is = [](double err, double tol) {
    return err <= tol ? "is" : std::isfinite(err) ? "is NOT" : "is NOT (NaN or Inf in a row)";
  };
  bool arrived = true;
  for (double d : r.input_diff) arrived &= d == 0;
  return format(
      "token %d of rank %d went to expert %d on rank %d (weight %.3f) and expert %d on rank %d "
      "(weight %.3f)%s; the weighted sum of the two returned rows %s the layer's output "
      "(relative difference %.1e) and %s the reference's (relative error %.1e)%s",
      r.token, r.home_rank, r.experts[0], r.ranks[0], r.weights[0], r.experts[1], r.ranks[1],
      r.weights[1], r.found ? "" : ", both on one rank",
      is(r.combined_vs_layer, trace_layer_tolerance), r.combined_vs_layer,
      is(r.combined_vs_reference, trace_reference_tolerance), r.combined_vs_reference,
      arrived && r.combined_vs_layer <= trace_layer_tolerance &&
              r.combined_vs_reference <= trace_reference_tolerance
          ? ""
          : "; this contradicts the fact (a token's output is the weighted sum of its experts' "
            "rows, sent and returned unchanged)");
}

// --- 8. the straggler ----------------------------------------------------------------------

struct straggler_result {
  int hot_expert = 0, hot_rank = 0;
  std::vector<double> rows_before, rows_after;            // [R]: rows each rank's experts computed
  std::vector<double> expert_ms_before, expert_ms_after;  // [R]: measured, median of passes
  std::vector<double> wait_ms_before, wait_ms_after;      // [R]: slowest rank's - own
  int straggler_before = 0, straggler_after = 0;          // by rows
  double excess_before = 0, excess_after = 0;             // (max - mean) / mean of rows per rank
  double predicted_max_over_mean = 0;                     // the balancer's own estimate
  int extra_slots = 0, hot_copies = 0;
  std::vector<std::vector<int>> experts_of_rank_after;  // [R][slots]
  machine_load load;
  std::string conclusion;
};

inline std::string conclusion(const straggler_result& r) {
  const int slowest = argmax(r.expert_ms_before);
  const bool rows_agree = r.straggler_before == r.hot_rank &&
                          trend_of(r.excess_before, r.excess_after, 0) == trend::fell;
  const bool times_agree =
      slowest == r.straggler_before &&
      trend_of(max_of(r.wait_ms_before), max_of(r.wait_ms_after)) == trend::fell;
  const double work_ms =
      r.expert_ms_before.empty() ? 0 : sum(r.expert_ms_before) / double(r.expert_ms_before.size());
  int holders = 0;  // ranks holding a copy of the hot expert (the balancer may put two on one)
  for (const auto& held : r.experts_of_rank_after)
    holders += std::find(held.begin(), held.end(), r.hot_expert) != held.end();
  const std::string on_ranks = holders > 0 ? format(" on %d ranks", holders) : "";
  const std::string who =
      r.straggler_before == r.hot_rank
          ? format("hot expert %d makes its rank %d the straggler", r.hot_expert, r.hot_rank)
          : format("hot expert %d lives on rank %d, yet rank %d is the straggler", r.hot_expert,
                   r.hot_rank, r.straggler_before);
  return who +
         format(" with %.0f%% more rows than the mean (the others wait up to %.2f ms for it",
                100 * r.excess_before, max_of(r.wait_ms_before)) +
         (slowest == r.straggler_before ? ")"
                                        : format("; by time rank %d was the slowest)", slowest)) +
         format("; with %d extra slots from the balancer (expert %d: %d copies%s) ", r.extra_slots,
                r.hot_expert, r.hot_copies, on_ranks.c_str()) +
         change("the excess", 100 * r.excess_before, 100 * r.excess_after, 0, "%", 0) + " and " +
         change("the longest wait", max_of(r.wait_ms_before), max_of(r.wait_ms_after), 2, " ms") +
         (rows_agree ? ""
                     : "; this contradicts the fact (the hot expert's rank is the straggler, and "
                       "replicas spread its rows)") +
         verdict(times_agree,
                 "the rank with the most rows is the slowest, and replicas cut the others' wait",
                 r.load, work_ms);
}

}  // namespace epmoe::tour
