// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <ostream>

#include "epmoe/sim/simulate.hpp"

// A simulated pass as a Chrome trace (chrome://tracing, ui.perfetto.dev): one process per
// rank, one slice per home stage (route, permute, shared, counts, reduce) and per stage of
// each unit (a chunk, or one round of a chunk under a receive bound), placed on the layer's
// schedule with the rank's own duration (the gap to the next slice is the time it waits for the
// slowest rank). Home stages have chunk -1.
namespace epmoe::sim {

inline void write_trace(std::ostream& os, const result& r) {
  const auto old = os.precision(12);
  os << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[";
  bool first = true;
  auto slice = [&](int rank, const char* name, int chunk, double start, double dur, int round = 0) {
    if (chunk < 0 && dur <= 0) return;  // a home stage with no work (e.g. no shared experts)
    os << (first ? "\n" : ",\n") << "{\"name\":\"" << name << "\",\"cat\":\"moe\",\"ph\":\"X\","
       << "\"pid\":" << rank << ",\"tid\":" << rank << ",\"ts\":" << start * 1e6
       << ",\"dur\":" << dur * 1e6 << ",\"args\":{\"chunk\":" << chunk << ",\"round\":" << round
       << "}}";
    first = false;
  };
  for (int rank = 0; rank < r.ranks; ++rank) {
    os << (first ? "\n" : ",\n") << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank
       << ",\"tid\":" << rank << ",\"args\":{\"name\":\"rank " << rank << "\"}}";
    first = false;
    const rank_result& me = r.per_rank[rank];
    const schedule_times& t = r.timeline;
    slice(rank, "route", -1, 0, me.route);
    slice(rank, "permute", -1, me.route, me.permute);
    slice(rank, "shared", -1, t.shared_start, me.shared);
    slice(rank, "counts", -1, t.counts_start, me.counts);
    for (int u = 0; u < r.units; ++u) {
      const auto i = static_cast<std::size_t>(rank) * r.units + u;
      const int c = r.unit_chunk[u], k = r.unit_round[u];
      slice(rank, "dispatch", c, r.timeline.dispatch_start[u], r.rank_dispatch[i], k);
      slice(rank, "experts", c, r.timeline.experts_start[u], r.rank_experts[i], k);
      slice(rank, "combine", c, r.timeline.combine_start[u], r.rank_combine[i], k);
    }
    slice(rank, "reduce", -1, t.reduce_start, me.reduce);
  }
  os << "\n]}\n";
  os.precision(old);
}

}  // namespace epmoe::sim
