// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "epmoe/sim/topology.hpp"

// The cost model: what one rank's exchange and expert GEMMs take, and how a schedule strings
// the stages of every chunk together. Pure functions of counts, so tests can check them by hand.
namespace epmoe::sim {

/// Bytes one rank moves in one exchange, per link class (index: link).
struct traffic {
  double out[2] = {0, 0};  // bytes this rank sends to other ranks
  double in[2] = {0, 0};   // bytes it receives
  void add_out(link l, double b) { out[static_cast<int>(l)] += b; }
  void add_in(link l, double b) { in[static_cast<int>(l)] += b; }
};

/// Alpha-beta per link class: alpha once per exchange that uses the class (the peers are
/// served concurrently), then the busier direction of the rank's own port (its NVLink or
/// its NIC share): latency + max(bytes out, bytes in) / bandwidth. The two classes are
/// separate hardware and run concurrently, so the exchange takes the slower one.
inline double class_seconds(const topology& topo, const traffic& x, link l) {
  const int i = static_cast<int>(l);
  const double bytes = std::max(x.out[i], x.in[i]);
  if (bytes <= 0) return 0;
  return topo.latency(l) + bytes / topo.bandwidth(l);
}
inline double exchange_seconds(const topology& topo, const traffic& x) {
  return std::max(class_seconds(topo, x, link::intra), class_seconds(topo, x, link::inter));
}
/// Which class bounds the exchange (intra on a tie).
inline link bottleneck(const topology& topo, const traffic& x) {
  return class_seconds(topo, x, link::inter) > class_seconds(topo, x, link::intra) ? link::inter
                                                                                   : link::intra;
}

/// SwiGLU expert FLOPs per row: three [H, F] GEMMs (gate, up, down), 2 FLOPs a multiply-add.
inline double expert_flops_per_row(int hidden, int ffn) { return 6.0 * hidden * ffn; }
/// Weight bytes one expert reads per GEMM call: its three [H, F] matrices.
inline double expert_weight_bytes(const topology& topo, int hidden, int ffn) {
  return 3.0 * hidden * ffn * topo.weight_bytes;
}

/// One grouped-GEMM slot of `rows` rows: bound by compute or by reading its weights (small
/// row counts are memory bound). An empty slot costs nothing (the grouped GEMM skips it).
inline double slot_seconds(const topology& topo, int hidden, int ffn, double rows) {
  if (rows <= 0) return 0;
  return std::max(rows * expert_flops_per_row(hidden, ffn) / topo.gemm_flops,
                  expert_weight_bytes(topo, hidden, ffn) / topo.memory_bandwidth);
}

/// The stages of one pass, per chunk, for the whole layer: each all-to-all is bulk
/// synchronous, so chunk c's dispatch takes the slowest rank's exchange (dispatch[c] = max
/// over ranks), likewise experts[c] and combine[c]. All vectors have C entries.
struct chunk_times {
  std::vector<double> dispatch, experts, combine;
};

/// When each stage of each chunk starts and ends.
struct schedule_times {
  std::vector<double> dispatch_start, dispatch_end, experts_start, experts_end, combine_start,
      combine_end;
  double latency = 0;  // end of the last combine
};

/// The layer's order (schedule::pipelined; with C = 1 it is schedule::sequential): one
/// compute stream runs experts(c) once dispatch(c) has arrived; one comm stream runs the
/// exchanges one at a time in the order they are started: dispatch(c+1) when experts(c)
/// starts, combine(c) when experts(c) ends. Sequential = dispatch + experts + combine.
inline schedule_times schedule(const chunk_times& s) {
  const std::size_t C = s.dispatch.size();
  schedule_times o;
  for (auto* v : {&o.dispatch_start, &o.dispatch_end, &o.experts_start, &o.experts_end,
                  &o.combine_start, &o.combine_end})
    v->assign(C, 0.0);
  if (C == 0) return o;
  double comm_free = 0, compute_free = 0;
  o.dispatch_start[0] = 0;
  o.dispatch_end[0] = comm_free = s.dispatch[0];
  for (std::size_t c = 0; c < C; ++c) {
    o.experts_start[c] = std::max(o.dispatch_end[c], compute_free);
    if (c + 1 < C) {
      o.dispatch_start[c + 1] = std::max(o.experts_start[c], comm_free);
      o.dispatch_end[c + 1] = comm_free = o.dispatch_start[c + 1] + s.dispatch[c + 1];
    }
    o.experts_end[c] = compute_free = o.experts_start[c] + s.experts[c];
    o.combine_start[c] = std::max(o.experts_end[c], comm_free);
    o.combine_end[c] = comm_free = o.combine_start[c] + s.combine[c];
  }
  o.latency = o.combine_end[C - 1];
  return o;
}

}  // namespace epmoe::sim
