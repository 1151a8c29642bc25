// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// An experiment's table: a row per bundle, printed as text, JSON or CSV.

#include <algorithm>
#include <cstddef>
#include <iomanip>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "epmoe/core/report.hpp"
#include "epmoe/core/stats.hpp"

namespace epmoe::experiment {

// --- the table --------------------------------------------------------------------------------

/// One bundle's row. Counts are of the last pass, summed over ranks; times are medians over
/// the timed passes of the slowest rank's time (a pass lasts as long as its slowest rank).
struct row {
  std::string name;
  stage_times time;            // seconds
  index_t dispatch_rows = 0;   // rows that crossed to another rank in the dispatch
  index_t combine_rows = 0;    // and back in the combine
  index_t dispatch_bytes = 0;  // their bytes
  index_t combine_bytes = 0;
  index_t dropped = 0;           // assignments capacity dropped
  index_t padding_rows = 0;      // zero rows sent to pad blocks
  index_t peak_recv_rows = 0;    // the most rows one exchange put in one rank's receive buffer
  double expert_imbalance = 0;   // max/mean of assignments per logical expert
  double rank_imbalance = 0;     // max/mean of rows computed per rank
  int straggler = 0;             // the rank computing the most rows
  double straggler_excess = 0;   // its rows over the mean rank's, - 1
  double error = 0;              // max relative error against reference::forward (inf: NaN)
  std::string topology;          // the simulator's cluster, or empty
  double predicted_seconds = 0;  // the simulator's layer latency for this pass there
  int predicted_straggler = 0;
  double predicted_excess = 0;  // its straggler's own time over the mean rank's, - 1
};

// --- output -----------------------------------------------------------------------------------

/// The table as text: one line per bundle (times in ms, the straggler's excess in %).
inline void print(std::ostream& os, const std::vector<row>& table) {
  const auto old = os.flags();
  const auto prec = os.precision();
  std::size_t w = 6;
  for (const row& r : table) w = std::max(w, r.name.size());
  os << std::left << std::setw(static_cast<int>(w)) << "bundle" << std::right;
  for (const char* h :
       {"pass ms", "route", "dispatch", "experts", "combine", "reduce", "rows out", "bytes out",
        "drops", "peak rx", "exp imb", "rank imb", "excess", "error", "sim ms", "sim exc"})
    os << std::setw(10) << h;
  os << '\n' << std::fixed;
  for (const row& r : table) {
    os << std::left << std::setw(static_cast<int>(w)) << r.name << std::right
       << std::setprecision(2);
    for (double t : {r.time.total, r.time.route, r.time.dispatch, r.time.experts, r.time.combine,
                     r.time.reduce})
      os << std::setw(10) << t * 1e3;
    os << std::setw(10) << r.dispatch_rows << std::setw(10) << r.dispatch_bytes << std::setw(10)
       << r.dropped << std::setw(10) << r.peak_recv_rows << std::setw(10) << r.expert_imbalance
       << std::setw(10) << r.rank_imbalance << std::setw(9) << r.straggler_excess * 100 << '%'
       << std::setw(10) << std::scientific << std::setprecision(1) << r.error << std::fixed
       << std::setprecision(3);
    if (r.topology.empty())
      os << std::setw(10) << "-" << std::setw(10) << "-";
    else
      os << std::setw(10) << r.predicted_seconds * 1e3 << std::setw(9) << std::setprecision(1)
         << r.predicted_excess * 100 << '%';
    os << '\n';
  }
  os.flags(old);
  os.precision(prec);
}

namespace detail {
inline void json_string(std::ostream& os, std::string_view v) {
  os << '"';
  for (char c : v) {
    if (c == '"' || c == '\\') os << '\\';
    os << c;
  }
  os << '"';
}

inline void csv_string(std::ostream& os, std::string_view v) {  // RFC 4180: "" inside quotes
  os << '"';
  for (char c : v) os << (c == '"' ? "\"\"" : std::string(1, c));
  os << '"';
}

/// The row's fields as (name, value) pairs, in the order JSON and CSV write them.
inline std::vector<std::pair<const char*, double>> fields(const row& r) {
  const stage_times& t = r.time;
  return {{"route_s", t.route},
          {"plan_s", t.plan},
          {"permute_s", t.permute},
          {"dispatch_s", t.dispatch},
          {"experts_s", t.experts},
          {"combine_s", t.combine},
          {"shared_s", t.shared},
          {"reduce_s", t.reduce},
          {"pass_s", t.total},
          {"dispatch_rows", double(r.dispatch_rows)},
          {"combine_rows", double(r.combine_rows)},
          {"dispatch_bytes", double(r.dispatch_bytes)},
          {"combine_bytes", double(r.combine_bytes)},
          {"dropped", double(r.dropped)},
          {"padding_rows", double(r.padding_rows)},
          {"peak_recv_rows", double(r.peak_recv_rows)},
          {"expert_imbalance", r.expert_imbalance},
          {"rank_imbalance", r.rank_imbalance},
          {"straggler", double(r.straggler)},
          {"straggler_excess", r.straggler_excess},
          {"error", r.error},
          {"predicted_s", r.predicted_seconds},
          {"predicted_straggler", double(r.predicted_straggler)},
          {"predicted_excess", r.predicted_excess}};
}
}  // namespace detail

/// The table as a JSON array of objects (non-finite numbers as null).
inline void write_json(std::ostream& os, const std::vector<row>& table) {
  os << "[";
  for (std::size_t i = 0; i < table.size(); ++i) {
    os << (i ? ",\n " : "\n ") << "{\"bundle\":";
    detail::json_string(os, table[i].name);
    os << ",\"topology\":";
    detail::json_string(os, table[i].topology);
    for (const auto& [k, v] : detail::fields(table[i])) {
      os << ",\"" << k << "\":";
      epmoe::detail::json_number(os, v);
    }
    os << "}";
  }
  os << "\n]\n";
}

/// The table as CSV: a header line, then one line per bundle (names quoted).
inline void write_csv(std::ostream& os, const std::vector<row>& table) {
  os << "bundle,topology";
  if (!table.empty())
    for (const auto& f : detail::fields(table[0])) os << ',' << f.first;
  os << '\n';
  const auto prec = os.precision(17);
  for (const row& r : table) {
    detail::csv_string(os, r.name);
    os << ',';
    detail::csv_string(os, r.topology);
    for (const auto& f : detail::fields(r)) os << ',' << f.second;
    os << '\n';
  }
  os.precision(prec);
}

}  // namespace epmoe::experiment
