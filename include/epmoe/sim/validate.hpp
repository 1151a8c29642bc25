// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epmoe/core/stats.hpp"
#include "epmoe/moe_layer.hpp"
#include "epmoe/reference/weights.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/sim/calibrate.hpp"
#include "epmoe/sim/simulate.hpp"
#include "epmoe/space/host_gemm.hpp"

#if defined(__linux__)
#include <sched.h>
#endif

// Validation: a real moe_layer (block, dropless, sequential) on any comm routes exactly a
// source's assignments, and its measured stage times are set against what simulate()
// predicts for the same pass on a calibrated topology. Used by `epmoe_simulate --validate`
// (comm::threads) and bench/sim/validate_mpi.cpp (comm::mpi).
namespace epmoe::sim {

/// Sets the BLAS to the cores this process may run on over `ranks` ranks (at least 1 each),
/// for the probes and the passes alike, and returns that count: R ranks whose GEMMs each ask
/// for every core fight over them, and the fight, not the model, then sets the expert times.
inline int share_blas_threads(int ranks) {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
#endif
  const int n = std::max(1, cores / std::max(1, ranks));
  space::set_blas_threads(n);
  return n;
}

template <int K, class Comm>
struct validation_policies : default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using comm = Comm;
};

/// Weights whose gate routes a token x with x[e] = K - k at its k-th source expert (0
/// elsewhere) to exactly those experts, in that order (gate row e = unit vector e; H >= E).
inline reference::full_weights hand_gate_weights(const layer_config& cfg, std::uint64_t seed = 3) {
  epmoe::detail::require(cfg.hidden >= cfg.experts, "validation hidden", cfg.hidden,
                         "must be >= experts (the hand-made gate)");
  auto w = reference::full_weights::random(cfg, seed);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < cfg.experts; ++e) w.gate[static_cast<std::size_t>(e) * cfg.hidden + e] = 1.f;
  return w;
}

/// Rank r's tokens [T, H] for hand_gate_weights.
template <class Source>
std::vector<float> hand_gate_tokens(const layer_config& cfg, const Source& src, int rank) {
  const index_t T = src.tokens(rank), K = cfg.top_k;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
  std::vector<float> wt(ids.size());
  src.route(rank, {{ids.data(), T, K}, {wt.data(), T, K}});
  std::vector<float> x(static_cast<std::size_t>(T * cfg.hidden), 0.f);
  for (index_t t = 0; t < T; ++t)
    for (index_t k = 0; k < K; ++k)
      if (ids[t * K + k] >= 0) x[t * cfg.hidden + ids[t * K + k]] = float(K - k);
  return x;
}

/// This rank's stage times of `passes` passes (after one warm-up pass) of the real layer, each
/// pass from cold caches (detail::cold_caches stands for the rest of a model).
template <int K, class Comm, class Source>
std::vector<stage_times> run_layer_passes(Comm c, const layer_config& cfg,
                                          const reference::full_weights& w, const Source& src,
                                          int passes) {
  using P = validation_policies<K, Comm>;
  const int r = c.rank();
  const typename P::placement where(cfg);
  const auto mine = reference::slice(w, where, r);
  const auto x = hand_gate_tokens(cfg, src, r);
  moe_layer<P> layer(cfg, std::move(c),
                     {w.gate_view(), mine.experts(), w.shared(), w.noise_gate_view()}, {}, {},
                     where);
  const index_t T = src.tokens(r), H = cfg.hidden;
  std::vector<float> y(static_cast<std::size_t>(T * H));
  std::vector<stage_times> out;
  detail::cold_caches rest_of_model;
  for (int p = 0; p < passes + 1; ++p) {
    rest_of_model();
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    if (p > 0) out.push_back(layer.stats().time);
  }
  return out;
}

/// run_layer_passes for a top-k known at run time (1, 2, 4, 6 or 8).
template <class Comm, class Source>
std::vector<stage_times> run_layer_passes(Comm c, const layer_config& cfg,
                                          const reference::full_weights& w, const Source& src,
                                          int passes) {
  switch (cfg.top_k) {
    case 1:
      return run_layer_passes<1>(std::move(c), cfg, w, src, passes);
    case 2:
      return run_layer_passes<2>(std::move(c), cfg, w, src, passes);
    case 4:
      return run_layer_passes<4>(std::move(c), cfg, w, src, passes);
    case 6:
      return run_layer_passes<6>(std::move(c), cfg, w, src, passes);
    case 8:
      return run_layer_passes<8>(std::move(c), cfg, w, src, passes);
    default:
      throw config_error("validation top_k", std::to_string(cfg.top_k), "must be 1, 2, 4, 6 or 8");
  }
}

/// Collective: every rank's stage times, [rank][pass], on every rank.
template <class Comm>
std::vector<std::vector<stage_times>> gather_times(Comm& c, const std::vector<stage_times>& mine) {
  constexpr int F = 9;  // the fields of stage_times
  const int R = c.size();
  const auto n = static_cast<index_t>(mine.size() * F);
  std::vector<double> flat(static_cast<std::size_t>(n));
  for (std::size_t p = 0; p < mine.size(); ++p) {
    const stage_times& t = mine[p];
    const double v[F] = {t.route,   t.plan,   t.permute, t.dispatch, t.experts,
                         t.combine, t.shared, t.reduce,  t.total};
    std::copy_n(v, F, flat.begin() + static_cast<std::ptrdiff_t>(p * F));
  }
  std::vector<double> send(static_cast<std::size_t>(n) * R), recv(send.size());
  for (int r = 0; r < R; ++r) std::copy(flat.begin(), flat.end(), send.begin() + r * n);
  c.alltoall(send.data(), recv.data(), n);
  std::vector<std::vector<stage_times>> all(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r)
    for (std::size_t p = 0; p < mine.size(); ++p) {
      const double* v = recv.data() + r * n + p * F;
      all[r].push_back({v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]});
    }
  return all;
}

struct validation_row {
  std::string stage;
  double predicted = 0;  // s; < 0: not modelled
  double measured = 0;   // s
  double error = 0;      // (predicted - measured) / measured; over rounds, their median
  double error_low = 0, error_high = 0;  // over rounds: the least and the greatest error
};

/// Predicted (the slowest rank's own time of each stage, as the sim's schedule uses it) vs
/// measured (the best pass, as calibrate() takes the best probe: on a shared machine the
/// slower passes carry the neighbours' noise). A home or compute stage's measured time is the
/// slowest rank's; an exchange's (dispatch: counts + rows + regroup; combine) is the busiest
/// expert rank's: it receives the most rows (the slowest regroup, as the sim's stage) and
/// reaches the combine last, so it waits for no peer there. Total: the slowest rank's.
inline std::vector<validation_row> compare(const result& s,
                                           const std::vector<std::vector<stage_times>>& real) {
  const std::size_t passes = real.empty() ? 0 : real[0].size();
  auto per_pass = [&](double stage_times::*f, bool of_busiest) {
    std::vector<double> v;
    for (std::size_t p = 0; p < passes; ++p) {
      std::size_t busiest = 0;
      for (std::size_t r = 1; r < real.size(); ++r)
        if (real[r][p].experts > real[busiest][p].experts) busiest = r;
      double x = real[busiest][p].*f;
      if (!of_busiest)
        for (const auto& rank : real) x = std::max(x, rank[p].*f);
      v.push_back(x);
    }
    return detail::best(v, false);
  };
  auto slowest = [&](double rank_result::*f) {
    double x = 0;
    for (const auto& r : s.per_rank) x = std::max(x, r.*f);
    return x;
  };
  double d = 0, x = 0, m = 0;
  for (int c = 0; c < s.units; ++c)
    d += s.stages.dispatch[c], x += s.stages.experts[c], m += s.stages.combine[c];
  std::vector<validation_row> rows = {
      {"route", slowest(&rank_result::route), per_pass(&stage_times::route, false)},
      {"plan", -1, per_pass(&stage_times::plan, false)},
      {"permute", slowest(&rank_result::permute), per_pass(&stage_times::permute, false)},
      {"shared", s.stages.shared, per_pass(&stage_times::shared, false)},
      {"dispatch (counts + rows)", s.stages.counts + d, per_pass(&stage_times::dispatch, true)},
      {"experts", x, per_pass(&stage_times::experts, false)},
      {"combine", m, per_pass(&stage_times::combine, true)},
      {"reduce", s.stages.after, per_pass(&stage_times::reduce, false)},
      {"layer total", s.latency, per_pass(&stage_times::total, false)}};
  for (auto& r : rows)
    r.error = r.error_low = r.error_high =
        r.measured > 0 && r.predicted >= 0 ? (r.predicted - r.measured) / r.measured : 0;
  return rows;
}

/// One validation round: a calibration and the passes run right after it, under the same
/// load (on a shared machine the load changes from second to second).
struct validation_round {
  calibration cal;
  std::vector<std::vector<stage_times>> real;  // [rank][pass]
};

/// Collective: `rounds` rounds of (calibrate, `passes` layer passes) on this rank's comm;
/// every rank returns every round's calibration and every rank's stage times.
template <class Comm, class MakeComm, class Source>
std::vector<validation_round> run_rounds(Comm& c, MakeComm&& make_comm, const layer_config& cfg,
                                         const reference::full_weights& w, const Source& src,
                                         int passes, int rounds) {
  const auto o = options_for(cfg, src.tokens(c.rank()));
  std::vector<validation_round> out;
  for (int i = 0; i < rounds; ++i) {
    calibration cal = measure(c, o);
    const auto mine = run_layer_passes(make_comm(), cfg, w, src, passes);
    out.push_back({std::move(cal), gather_times(c, mine)});
  }
  return out;
}

/// Each round's calibration predicts that round's passes (simulate on its topology, compare
/// with its best pass); a row carries the medians over rounds of the predicted time, the
/// measured time and the error, and the error's range. Pairing a calibration with the passes
/// beside it keeps a load change between rounds out of the error.
template <class Policies = policies<>, class Source>
std::vector<validation_row> compare_rounds(const layer_config& cfg, const Source& src,
                                           const std::vector<validation_round>& rounds,
                                           const std::string& topology_name = "calibrated") {
  std::vector<std::vector<validation_row>> each;
  for (const auto& r : rounds) {
    topology topo = r.cal.topo;
    topo.name = topology_name;
    each.push_back(compare(simulate<Policies>(cfg, topo, src), r.real));
  }
  if (each.empty()) return {};
  std::vector<validation_row> out = each[0];
  for (std::size_t k = 0; k < out.size(); ++k) {
    std::vector<double> p, m, e;
    for (const auto& rows : each)
      p.push_back(rows[k].predicted), m.push_back(rows[k].measured), e.push_back(rows[k].error);
    out[k].predicted = out[k].predicted < 0 ? -1 : detail::median(p);
    out[k].measured = detail::median(m);
    out[k].error = detail::median(e);
    out[k].error_low = *std::min_element(e.begin(), e.end());
    out[k].error_high = *std::max_element(e.begin(), e.end());
  }
  return out;
}

inline void print_calibration(std::FILE* f, const calibration& c, const calibration_options& o,
                              int ranks, const char* comm) {
  std::fprintf(
      f,
      "calibration on %d ranks (%s):\n"
      "  alltoallv to each peer: %.1f us at %lld B, %.1f us at %lld B -> latency %.1f us, "
      "%.2f GB/s in per rank\n"
      "  expert FFNs (swiglu, %lld rows x H %d x F %d, %d experts): %.1f GFLOP/s per rank\n"
      "  route (gate %lld x %d x %d + top-%d): %.1f us -> top-k %.2f G logits/s\n"
      "  row copies into cold buffers: gather %.2f GB/s, regroup %.2f GB/s, weighted reduce "
      "%.2f GB/s; memory reads: %.2f GB/s per rank\n",
      ranks, comm, c.exchange_small * 1e6, static_cast<long long>(o.small_bytes),
      c.exchange_large * 1e6, static_cast<long long>(o.large_bytes), c.latency * 1e6,
      c.bandwidth / 1e9, static_cast<long long>(o.gemm_rows), o.hidden, o.ffn, o.gemm_calls,
      c.gemm_flops / 1e9, static_cast<long long>(o.tokens), o.hidden, o.experts, o.top_k,
      c.route_seconds * 1e6, c.topk_rate / 1e9, c.copy_bandwidth / 1e9, c.regroup_bandwidth / 1e9,
      c.reduce_bandwidth / 1e9, c.memory_bandwidth / 1e9);
  if (c.gemm_curve.size() > 1) {
    std::fprintf(f, "  expert FFN rate by rows per expert:");
    for (const auto& [rows, rate] : c.gemm_curve) std::fprintf(f, " %.0f: %.1f", rows, rate / 1e9);
    std::fprintf(f, " GFLOP/s\n");
  }
}

inline void print_validation(std::FILE* f, const std::vector<validation_row>& rows) {
  std::fprintf(f, "  %-26s %12s %12s %9s  %s\n", "stage", "predicted ms", "measured ms", "error",
               "range over rounds");
  for (const auto& r : rows) {
    if (r.predicted <= 0 && r.measured < 1e-6)
      std::fprintf(f, "  %-26s %12.3f %12.3f %9s\n", r.stage.c_str(), 0.0, r.measured * 1e3, "-");
    else if (r.predicted < 0)
      std::fprintf(f, "  %-26s %12s %12.3f\n", r.stage.c_str(), "(not priced)", r.measured * 1e3);
    else
      std::fprintf(f, "  %-26s %12.3f %12.3f %+8.0f%%  %+.0f%% .. %+.0f%%\n", r.stage.c_str(),
                   r.predicted * 1e3, r.measured * 1e3, 100 * r.error, 100 * r.error_low,
                   100 * r.error_high);
  }
}

}  // namespace epmoe::sim
