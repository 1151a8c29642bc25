// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <iterator>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/core/stats.hpp"

// Run reports of real passes: one stats JSON line per (pass, rank), a superset of what
// sim::write_stats_line writes (so sim::read_stats and sim::recorded_source replay it), and a
// Chrome / Perfetto trace of the passes of every rank (chrome://tracing, ui.perfetto.dev).
// Recording is a copy of pass_stats after forward; writing allocates, so do it off the hot path.
namespace epmoe {

/// What one rank's pass leaves for a report: its stats, which pass and rank, and the logical
/// expert of each of its local slots (for per-expert views of what the rank computed).
struct pass_record {
  int pass = 0;
  int rank = 0;
  int top_k = 0;
  pass_stats stats;
  std::vector<int> local_experts;  // [L]: the expert each local slot held in this pass
};

/// The record of a layer's last pass (any moe_layer: uses config(), stats(), placement()).
template <class Layer>
pass_record record_pass(const Layer& layer) {
  pass_record r{
      static_cast<int>(layer.passes()) - 1, layer.rank(), layer.config().top_k, layer.stats(), {}};
  const int L = static_cast<int>(layer.stats().rows_per_local_expert.size());
  for (int j = 0; j < L; ++j) r.local_experts.push_back(layer.placement().expert_at(r.rank, j));
  return r;
}

namespace detail {
// JSON has no NaN or infinity: write null for them.
inline void json_number(std::ostream& os, double v) {
  if (std::isfinite(v))
    os << v;
  else
    os << "null";
}
template <class Range>
void json_array(std::ostream& os, const Range& v) {
  os << '[';
  bool first = true;
  for (const auto& x : v) {
    os << (first ? "" : ",");
    json_number(os, static_cast<double>(x));
    first = false;
  }
  os << ']';
}
inline void json_stage_times(std::ostream& os, const stage_times& t) {
  const std::pair<const char*, double> f[] = {
      {"route", t.route},       {"plan", t.plan},       {"permute", t.permute},
      {"dispatch", t.dispatch}, {"experts", t.experts}, {"combine", t.combine},
      {"shared", t.shared},     {"reduce", t.reduce},   {"total", t.total}};
  os << '{';
  for (std::size_t i = 0; i < std::size(f); ++i) {
    os << (i ? "," : "") << '"' << f[i].first << "\":";
    json_number(os, f[i].second);
  }
  os << '}';
}
}  // namespace detail

/// One JSON object and a newline: sim::write_stats_line's keys (pass, rank, tokens, top_k,
/// routed_per_expert) first, then drops, capacity (rows per expert copy per source rank, null
/// when dropless), rows per local slot and per rank, bytes, losses,
/// rounds and stage times (seconds). sim::read_stats reads it back.
inline void write_stats_json(std::ostream& os, const pass_record& r) {
  const pass_stats& s = r.stats;
  const auto old = os.precision(9);
  os << "{\"pass\":" << r.pass << ",\"rank\":" << r.rank << ",\"tokens\":" << s.tokens
     << ",\"top_k\":" << r.top_k << ",\"routed_per_expert\":";
  detail::json_array(os, s.routed_per_expert);
  os << ",\"experts\":" << s.routed_per_expert.size() << ",\"ranks\":" << s.rows_sent.size()
     << ",\"assignments\":" << s.assignments << ",\"dropped\":" << s.dropped
     << ",\"padding_rows\":" << s.padding_rows << ",\"capacity\":";
  if (s.capacity)  // null: no limit (dropless)
    os << *s.capacity;
  else
    os << "null";
  os << ",\"local_experts\":";
  detail::json_array(os, r.local_experts);
  os << ",\"rows_per_local_expert\":";
  detail::json_array(os, s.rows_per_local_expert);
  os << ",\"padded_rows_per_local_expert\":";
  detail::json_array(os, s.padded_rows_per_local_expert);
  os << ",\"rows_sent\":";
  detail::json_array(os, s.rows_sent);
  os << ",\"rows_received\":";
  detail::json_array(os, s.rows_received);
  os << ",\"assignment_rows_sent\":";
  detail::json_array(os, s.assignment_rows_sent);
  os << ",\"assignment_rows_received\":";
  detail::json_array(os, s.assignment_rows_received);
  os << ",\"dispatch_bytes_sent\":" << s.dispatch_bytes_sent
     << ",\"dispatch_bytes_received\":" << s.dispatch_bytes_received
     << ",\"combine_bytes_sent\":" << s.combine_bytes_sent
     << ",\"combine_bytes_received\":" << s.combine_bytes_received << ",\"expert_flops\":";
  detail::json_number(os, s.expert_flops);
  os << ",\"shared_flops\":";
  detail::json_number(os, s.shared_flops);
  os << ",\"losses\":{\"valid\":" << (s.losses.valid ? "true" : "false") << ",\"aux\":";
  detail::json_number(os, s.losses.aux);
  os << ",\"seq_aux\":";
  detail::json_number(os, s.losses.seq_aux);
  os << ",\"z\":";
  detail::json_number(os, s.losses.z);
  os << "},\"expert_imbalance\":";
  detail::json_number(os, s.expert_imbalance.max_over_mean);
  os << ",\"rank_imbalance\":";
  detail::json_number(os, s.rank_imbalance.max_over_mean);
  os << ",\"chunks\":" << s.chunks << ",\"rounds\":" << s.rounds
     << ",\"peak_recv_rows\":" << s.peak_recv_rows << ",\"recv_buffer_rows\":" << s.recv_buffer_rows
     << ",\"comm_seconds\":";
  detail::json_number(os, s.comm_seconds);
  os << ",\"exposed_comm_seconds\":";
  detail::json_number(os, s.exposed_comm_seconds);
  os << ",\"overlap\":";
  detail::json_number(os, s.overlap);
  os << ",\"started\":";
  detail::json_number(os, s.started);
  os << ",\"time\":";
  detail::json_stage_times(os, s.time);
  os << ",\"began\":";
  detail::json_stage_times(os, s.began);
  os << "}\n";
  os.precision(old);
}

inline void write_stats_json(std::ostream& os, std::span<const pass_record> records) {
  for (const pass_record& r : records) write_stats_json(os, r);
}

/// A Chrome trace of every record: one process per rank ("rank r") with four tracks —
/// "stages" (a "pass p" slice around route, plan, permute, shared, reduce), "dispatch",
/// "experts", "combine" (a slice per chunk and round, args chunk, round, rows, bytes) — and
/// counters "rows" and "bytes" of each exchange. Times are the layer's own clock (seconds
/// since it was built, in microseconds): ranks built together line up.
inline void write_trace_json(std::ostream& os, std::span<const pass_record> records) {
  const auto old = os.precision(12);
  os << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[";
  bool first = true;
  auto begin = [&] {
    os << (first ? "\n" : ",\n");
    first = false;
  };
  auto us = [](double s) { return std::isfinite(s) ? s * 1e6 : 0.0; };
  std::vector<int> named;
  static constexpr const char* tracks[] = {"stages", "dispatch", "experts", "combine"};
  for (const pass_record& r : records) {
    bool seen = false;
    for (int n : named) seen |= n == r.rank;
    if (!seen) {
      named.push_back(r.rank);
      begin();
      os << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << r.rank
         << ",\"args\":{\"name\":\"rank " << r.rank << "\"}}";
      for (int t = 0; t < 4; ++t) {
        begin();
        os << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << r.rank << ",\"tid\":" << t
           << ",\"args\":{\"name\":\"" << tracks[t] << "\"}}";
      }
    }
    const pass_stats& s = r.stats;
    const double t0 = s.started;
    begin();
    os << "{\"name\":\"pass " << r.pass << "\",\"cat\":\"pass\",\"ph\":\"X\",\"pid\":" << r.rank
       << ",\"tid\":0,\"ts\":" << us(t0) << ",\"dur\":" << us(s.time.total)
       << ",\"args\":{\"pass\":" << r.pass << ",\"tokens\":" << s.tokens
       << ",\"dropped\":" << s.dropped << ",\"rounds\":" << s.rounds << ",\"chunks\":" << s.chunks
       << "}}";
    const std::pair<const char*, double stage_times::*> stages[] = {
        {"route", &stage_times::route},
        {"plan", &stage_times::plan},
        {"permute", &stage_times::permute},
        {"shared", &stage_times::shared},
        {"reduce", &stage_times::reduce}};
    for (const auto& [name, m] : stages) {
      begin();
      os << "{\"name\":\"" << name << "\",\"cat\":\"stage\",\"ph\":\"X\",\"pid\":" << r.rank
         << ",\"tid\":0,\"ts\":" << us(t0 + s.began.*m) << ",\"dur\":" << us(s.time.*m)
         << ",\"args\":{\"pass\":" << r.pass << "}}";
    }
    for (const timeline_event& e : s.timeline) {
      const int tid = 1 + static_cast<int>(e.stage);
      const char* name = tracks[tid];
      begin();
      os << "{\"name\":\"" << name << "\",\"cat\":\"chunk\",\"ph\":\"X\",\"pid\":" << r.rank
         << ",\"tid\":" << tid << ",\"ts\":" << us(t0 + e.start)
         << ",\"dur\":" << us(e.end - e.start) << ",\"args\":{\"pass\":" << r.pass
         << ",\"chunk\":" << e.chunk << ",\"round\":" << e.round << ",\"rows\":" << e.rows
         << ",\"bytes\":" << e.bytes << "}}";
      if (e.stage == stage_kind::experts) continue;
      // Counters: the rows and bytes of this exchange while it runs, back to 0 after.
      for (const auto& [at, on] : {std::pair{e.start, true}, std::pair{e.end, false}}) {
        begin();
        os << "{\"name\":\"rows\",\"ph\":\"C\",\"pid\":" << r.rank << ",\"ts\":" << us(t0 + at)
           << ",\"args\":{\"" << name << "\":" << (on ? e.rows : 0) << "}}";
        begin();
        os << "{\"name\":\"bytes\",\"ph\":\"C\",\"pid\":" << r.rank << ",\"ts\":" << us(t0 + at)
           << ",\"args\":{\"" << name << "\":" << (on ? e.bytes : 0) << "}}";
      }
    }
  }
  os << "\n]}\n";
  os.precision(old);
}

}  // namespace epmoe
