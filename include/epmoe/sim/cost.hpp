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

/// Weight bytes one expert reads per GEMM call. A dense expert does one multiply-add (2
/// FLOPs) per weight per row, so its weights are flops_per_row / 2 (the expert policy's own
/// flops_per_row: SwiGLU's three [H, F] matrices, a plain MLP's two).
inline double expert_weight_bytes(const topology& topo, double flops_per_row) {
  return flops_per_row / 2 * topo.weight_bytes;
}

/// One grouped-GEMM slot of `rows` rows of an expert of `flops_per_row`: bound by compute (at
/// the rate for that many rows) or by reading its weights (small row counts are memory
/// bound). An empty slot costs nothing (the grouped GEMM skips it).
inline double slot_seconds(const topology& topo, double flops_per_row, double rows) {
  if (rows <= 0) return 0;
  return std::max(rows * flops_per_row / topo.gemm_rate(rows),
                  expert_weight_bytes(topo, flops_per_row) / topo.memory_bandwidth);
}

/// Routing T tokens: the gate GEMM ([T, H] x [H, E], 2 FLOPs a multiply-add) at the GEMM
/// rate, then softmax and top-k over each token's E logits.
inline double route_seconds(const topology& topo, double tokens, int hidden, int experts) {
  if (tokens <= 0) return 0;
  return 2.0 * tokens * hidden * experts / topo.gemm_flops + tokens * experts / topo.select_rate();
}
/// Copying `rows` rows of `row_bytes` on one rank (permute's gather, the shared experts'
/// input).
inline double copy_seconds(const topology& topo, double rows, double row_bytes) {
  return rows * row_bytes / topo.copy_rate();
}
/// The weighted reduce: `rows` rows read and written (each expert output once, the output).
inline double reduce_seconds(const topology& topo, double rows, double row_bytes) {
  return rows * row_bytes / topo.reduce_rate();
}
/// The copies around an exchange: a rank's rows to itself, the regroup by expert and back.
inline double regroup_seconds(const topology& topo, double rows, double row_bytes) {
  return rows * row_bytes / topo.regroup_rate();
}
/// The counts all-to-all before the rows move: `bytes_per_peer` to every other rank, one
/// exchange on each link class the cluster has (latency bound: a few hundred bytes a peer).
inline double counts_seconds(const topology& topo, double bytes_per_peer) {
  traffic x;
  const double intra = bytes_per_peer * (topo.ranks_per_node - 1);
  const double inter = bytes_per_peer * (topo.ranks() - topo.ranks_per_node);
  x.add_out(link::intra, intra), x.add_in(link::intra, intra);
  x.add_out(link::inter, inter), x.add_in(link::inter, inter);
  return exchange_seconds(topo, x);
}

/// The stages of one pass for the whole layer. Each all-to-all is bulk synchronous, so
/// chunk c's dispatch takes the slowest rank's exchange (dispatch[c] = max over ranks),
/// likewise experts[c] and combine[c] (C entries each). The home-rank stages are the slowest
/// rank's too: route + permute before the counts exchange, shared experts, reduce after the
/// last combine.
struct chunk_times {
  std::vector<double> dispatch, experts, combine;
  double before = 0;  // route + permute
  double shared = 0;  // shared experts
  double counts = 0;  // the counts all-to-all
  double after = 0;   // reduce
  // Several units run one at a time (schedule::sequential with receive-bound rounds);
  // otherwise more than one unit means schedule::pipelined.
  bool sequential_units = false;
};

/// When each stage of each chunk starts and ends.
struct schedule_times {
  std::vector<double> dispatch_start, dispatch_end, experts_start, experts_end, combine_start,
      combine_end;
  double shared_start = 0, counts_start = 0, reduce_start = 0;
  double latency = 0;  // end of the reduce
};

/// The layer's order. C = 1 (or sequential_units) is schedule::sequential: route, permute,
/// shared, counts, then dispatch + experts + combine of each unit in turn, reduce. C > 1 is
/// schedule::pipelined<C>: route, permute,
/// counts; shared runs on the compute stream while dispatch(0) is in flight; one compute
/// stream runs experts(c) once dispatch(c) has arrived; one comm stream runs the exchanges
/// one at a time in the order they are started: dispatch(c+1) when experts(c) starts,
/// combine(c) when experts(c) ends; reduce after the last combine.
inline schedule_times schedule(const chunk_times& s) {
  const std::size_t C = s.dispatch.size();
  schedule_times o;
  for (auto* v : {&o.dispatch_start, &o.dispatch_end, &o.experts_start, &o.experts_end,
                  &o.combine_start, &o.combine_end})
    v->assign(C, 0.0);
  double comm_free = 0, compute_free = 0;
  const bool pipelined = C > 1 && !s.sequential_units;
  if (pipelined) {
    o.counts_start = s.before;
    o.shared_start = comm_free = o.counts_start + s.counts;
    compute_free = o.shared_start + s.shared;
  } else {
    o.shared_start = s.before;
    o.counts_start = o.shared_start + s.shared;
    compute_free = comm_free = o.counts_start + s.counts;
  }
  if (C == 0) {
    o.reduce_start = comm_free;
    o.latency = o.reduce_start + s.after;
    return o;
  }
  if (!pipelined) {  // each unit's dispatch, experts and combine, one unit after another
    double t = comm_free;
    for (std::size_t c = 0; c < C; ++c) {
      o.dispatch_start[c] = t;
      o.experts_start[c] = o.dispatch_end[c] = t + s.dispatch[c];
      o.combine_start[c] = o.experts_end[c] = o.experts_start[c] + s.experts[c];
      t = o.combine_end[c] = o.combine_start[c] + s.combine[c];
    }
    o.reduce_start = t;
    o.latency = o.reduce_start + s.after;
    return o;
  }
  o.dispatch_start[0] = comm_free;
  o.dispatch_end[0] = comm_free = o.dispatch_start[0] + s.dispatch[0];
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
  o.reduce_start = o.combine_end[C - 1];
  o.latency = o.reduce_start + s.after;
  return o;
}

}  // namespace epmoe::sim
