// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Runs an experiment's bundles: each rank's passes, the table's row, the simulator's
// prediction and the error against the float64 reference.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epmoe/comm/throttled.hpp"
#include "epmoe/experiment/bundle.hpp"
#include "epmoe/experiment/inputs.hpp"
#include "epmoe/experiment/table.hpp"
#include "epmoe/moe_layer.hpp"
#include "epmoe/placement/balancer.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/reference/compare.hpp"
#include "epmoe/reference/forward.hpp"
#include "epmoe/reference/weights.hpp"
#include "epmoe/sim/simulate.hpp"
#include "epmoe/sim/source.hpp"
#include "epmoe/sim/topology.hpp"

namespace epmoe::experiment {

namespace detail {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline constexpr int stage_fields = 9;
inline void put_times(std::vector<double>& out, const stage_times& t) {
  for (double v :
       {t.route, t.plan, t.permute, t.dispatch, t.experts, t.combine, t.shared, t.reduce, t.total})
    out.push_back(v);
}
inline stage_times times_at(const double* v) {
  return {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
}

/// What one rank sends back after its passes: per timed pass the stage times, then the last
/// pass's `count_fields` counts, assignments per expert, the router's bias (a router with
/// one), output rows.
inline constexpr int count_fields = 9;

/// Token t of rank r's id: unique over ranks, the same in every pass.
inline std::int64_t token_id(const layer_config& cfg, int r, index_t t) {
  return std::int64_t{r} * cfg.max_tokens + t;
}

/// The router object a bundle runs with: `P::make_router(cfg)` where the bundle defines it
/// (a router with settings: groups, a scaling), else a default one.
template <class P>
typename P::router router_of(const layer_config& cfg) {
  if constexpr (requires { P::make_router(cfg); })
    return P::make_router(cfg);
  else
    return {};
}

/// Everything a rank's layer takes from the inputs: its slots, the shared experts (an expert
/// type whose views_of has shared()), the noise gate, the shared gate, the output bias and the
/// gate's logit bias.
template <class P>
typename moe_layer<P>::weights layer_weights(const inputs& in,
                                             const reference::rank_weights& mine) {
  using views = reference::views_of<typename P::expert>;
  const reference::full_weights& w = in.weights;
  const index_t N = w.cfg.shared_experts, H = w.cfg.hidden;
  typename moe_layer<P>::weights out{w.gate_view(), views::of(mine)};
  if constexpr (requires { views::shared(w); }) out.shared = views::shared(w);
  out.noise_gate = w.noise_gate_view();
  out.shared_gate = {w.shared_gate.data(), N, H};
  out.output_bias = {w.output_bias.data(), w.output_bias.empty() ? 0 : 1, H};
  if constexpr (requires { P::router::uses_gate_bias; })  // GPT-OSS's logit bias
    out.gate_bias = {w.gate_bias.data(), 1, w.cfg.experts};
  return out;
}

/// The placement made from one pass's load (see placement_for).
template <class P, treatment How, class Ranks>
typename P::placement from_load(const Ranks& ranks, const inputs& in) {
  using placement_type = typename P::placement;
  using Q = on_comm<P, typename Ranks::comm_type>;
  const layer_config& cfg = in.cfg;
  const placement_type start(cfg);  // placement::table(cfg): one copy per expert, as block
  const auto loads = ranks.run([&](typename Ranks::comm_type c) {
    const int r = c.rank();
    const auto mine = reference::slice(in.weights, start, r);
    moe_layer<Q> probe(cfg, std::move(c), layer_weights<Q>(in, mine), router_of<P>(cfg), {}, start);
    const std::vector<float>& x = in.tokens[static_cast<std::size_t>(r)];
    const index_t H = cfg.hidden, T = in.tokens_of(r);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(T));
    for (index_t t = 0; t < T; ++t) ids[t] = token_id(cfg, r, t);
    std::vector<float> y(x.size());
    probe.forward({x.data(), T, H}, {y.data(), T, H}, ids);
    const auto load = probe.gather_load();
    return std::vector<double>(load.per_expert.begin(), load.per_expert.end());
  });
  const std::vector<double>& load = loads[0];  // every rank gathered the same
  if constexpr (std::same_as<placement_type, placement::table>) {
    return placement::balance(load, {.ranks = cfg.ranks, .extra_slots = How.extra_slots}).refined;
  } else {
    static_assert(
        std::constructible_from<placement_type, const layer_config&, std::span<const double>>,
        "epmoe::experiment: treatment from_load needs placement::table or a placement "
        "constructible from (const layer_config&, std::span<const double> load)");
    return placement_type(cfg, std::span<const double>(load));
  }
}

/// The placement a bundle runs with: the policy's default, or (treatment from_load) one made
/// from the load of a pass of the same bundle under its default placement: for
/// placement::table the balancer's table with `extra_slots` replicas, for any other
/// placement its constructor from (config, load per expert).
template <class P, treatment How, class Ranks>
typename P::placement placement_for(const Ranks& ranks, const inputs& in) {
  if constexpr (!How.from_load) {
    return typename P::placement(in.cfg);
  } else {
    return from_load<P, How>(ranks, in);
  }
}

/// A rank's space: its own, sharing `turn` where the bundle takes turns.
template <class P>
typename P::space space_for(const std::shared_ptr<std::mutex>& turn) {
  if constexpr (std::same_as<typename P::space, turn_space>)
    return turn_space(turn);
  else
    return {};
}

/// One rank's passes of bundle P under `where`: the numbers count_fields describes.
template <class P, class Comm>
std::vector<double> rank_passes(Comm comm, const inputs& in, const options& opt,
                                const typename P::placement& where,
                                const std::shared_ptr<std::mutex>& turn, int bias_steps) {
  const layer_config& cfg = in.cfg;
  const int r = comm.rank();
  const std::vector<float>& x = in.tokens[static_cast<std::size_t>(r)];
  const index_t H = cfg.hidden, T = in.tokens_of(r);
  const auto mine = reference::slice(in.weights, where, r);
  moe_layer<P> layer(cfg, std::move(comm), layer_weights<P>(in, mine), router_of<P>(cfg), {}, where,
                     space_for<P>(turn));
  std::vector<float> y(x.size());
  std::vector<std::int64_t> ids(static_cast<std::size_t>(T));  // for routers that hash them
  for (index_t t = 0; t < T; ++t) ids[t] = token_id(cfg, r, t);
  if constexpr (router_with_bias<typename P::router>)
    for (int p = 0; p < bias_steps; ++p) {  // the bias learns the load: not timed
      layer.forward({x.data(), T, H}, {y.data(), T, H}, ids);
      layer.update_router();
    }
  std::vector<double> out;
  for (int p = 0; p <= opt.passes; ++p) {  // pass 0 warms up: not timed
    std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
    layer.forward({x.data(), T, H}, {y.data(), T, H}, ids);
    if (p > 0) put_times(out, layer.stats().time);
  }
  const pass_stats& s = layer.stats();
  index_t crossed = 0, back = 0, computed = 0;
  for (int q = 0; q < cfg.ranks; ++q)
    if (q != r) crossed += s.rows_sent[q], back += s.rows_received[q];
  for (index_t n : s.rows_per_local_expert) computed += n;
  for (double v : {double(crossed), double(back), double(s.dispatch_bytes_sent),
                   double(s.combine_bytes_sent), double(s.dropped), double(s.padding_rows),
                   double(s.peak_recv_rows), double(computed), double(s.chunks)})
    out.push_back(v);
  for (index_t n : s.routed_per_expert) out.push_back(static_cast<double>(n));
  if constexpr (router_with_bias<typename P::router>)
    for (float b : layer.router_bias()) out.push_back(b);
  out.insert(out.end(), y.begin(), y.end());
  return out;
}

/// The simulator's prediction of the same pass (the measured routing, replayed) on the
/// options' cluster.
template <class P>
void predict(row& out, const inputs& in, const options& opt,
             const std::vector<sim::stats_record>& records, const typename P::placement& where,
             int chunks) {
  if (opt.topology.empty()) return;
  // The simulator replays the recorded assignments: a token holds up to `width` of them.
  layer_config cfg = in.cfg;
  cfg.top_k = records.empty() ? cfg.top_k : records[0].top_k;
  sim::topology topo = sim::preset(opt.topology, opt.nodes);
  topo.nodes = opt.nodes;
  topo.ranks_per_node = cfg.ranks / opt.nodes;
  using expert_type = typename P::expert;
  using sim_policies = sim::policies<typename P::placement, typename P::capacity,
                                     epmoe::detail::options_of<P>().dedup, expert_type>;
  const sim::result res = sim::simulate<sim_policies>(cfg, topo, sim::recorded_source(records),
                                                      {.chunks = chunks}, where);
  out.topology = topo.name;
  out.predicted_seconds = res.latency;
  out.predicted_straggler = res.straggler;
  out.predicted_excess = res.straggler_excess;
}

}  // namespace detail

/// Runs bundle B on `ranks` over `in` and returns its row.
template <class B, class Ranks>
row run_bundle(const Ranks& ranks, const inputs& in, const options& opt) {
  using rank_comm = typename Ranks::comm_type;
  using comm_type = std::conditional_t<B::how.throttled, comm::throttled<rank_comm>, rank_comm>;
  using base = typename B::policies;
  constexpr bool turns = Ranks::share_cores && std::same_as<typename base::space, space::host>;
  using P = std::conditional_t<turns, in_turns_on<base, comm_type>, on_comm<base, comm_type>>;
  const layer_config& cfg = in.cfg;
  epmoe::detail::require(ranks.size() == cfg.ranks, "experiment.ranks", ranks.size(),
                         "must equal config ranks");
  epmoe::detail::require(static_cast<int>(in.tokens.size()) == cfg.ranks,
                         "experiment.inputs.tokens", static_cast<index_t>(in.tokens.size()),
                         "needs one batch per rank");
  epmoe::detail::require(opt.passes >= 1, "experiment.options.passes", opt.passes,
                         "must be >= 1 (timed passes after the warm-up)");
  epmoe::detail::require(opt.nodes >= 1 && cfg.ranks % opt.nodes == 0, "experiment.options.nodes",
                         opt.nodes, "must divide config ranks");
  constexpr bool biased = router_with_bias<typename base::router>;
  static_assert(biased || B::how.bias_steps == 0,
                "epmoe::experiment: treatment bias_steps needs a router with a bias "
                "(router::sigmoid_bias)");
  static_assert(B::how.bias_steps >= 0, "epmoe::experiment: treatment bias_steps must be >= 0");
  const auto where = detail::placement_for<base, B::how>(ranks, in);
  const auto turn = opt.turns ? std::make_shared<std::mutex>() : nullptr;
  const int steps = B::how.bias_steps;
  const auto all = ranks.run([&](rank_comm c) {
    if constexpr (B::how.throttled)
      return detail::rank_passes<P>(comm_type(std::move(c), opt.link), in, opt, where, turn, steps);
    else
      return detail::rank_passes<P>(std::move(c), in, opt, where, turn, steps);
  });

  row out;
  out.name = std::string(B::name);
  const int R = cfg.ranks, E = cfg.experts, F = detail::stage_fields, N = opt.passes;
  // Times: per pass the slowest rank's, per stage; then the median over passes.
  std::vector<std::vector<double>> per_field(F);
  for (int p = 0; p < N; ++p)
    for (int f = 0; f < F; ++f) {
      double slowest = 0;
      for (int r = 0; r < R; ++r) slowest = std::max(slowest, all[r][p * F + f]);
      per_field[f].push_back(slowest);
    }
  std::vector<double> med(F);
  for (int f = 0; f < F; ++f) med[f] = detail::median(per_field[f]);
  out.time = detail::times_at(med.data());

  std::vector<index_t> routed(static_cast<std::size_t>(E), 0), computed(R, 0);
  std::vector<sim::stats_record> records;
  std::vector<float> y, x;
  std::vector<index_t> per_rank;
  std::vector<std::int64_t> ids;
  int chunks = 1;
  const int width = router::routing_width<typename P::router>(cfg);  // E for expert choice
  const int bias_fields = biased ? E : 0;
  // The bias the timed passes ran with: every rank holds the same (update_router is global).
  std::vector<float> bias(all[0].data() + N * F + detail::count_fields + E,
                          all[0].data() + N * F + detail::count_fields + E + bias_fields);
  for (int r = 0; r < R; ++r) {
    const double* c = all[r].data() + N * F;
    out.dispatch_rows += static_cast<index_t>(c[0]);
    out.combine_rows += static_cast<index_t>(c[1]);
    out.dispatch_bytes += static_cast<index_t>(c[2]);
    out.combine_bytes += static_cast<index_t>(c[3]);
    out.dropped += static_cast<index_t>(c[4]);
    out.padding_rows += static_cast<index_t>(c[5]);
    out.peak_recv_rows = std::max(out.peak_recv_rows, static_cast<index_t>(c[6]));
    computed[r] = static_cast<index_t>(c[7]);
    chunks = static_cast<int>(c[8]);
    sim::stats_record rec{0, r, in.tokens_of(r), width, {}};
    for (int e = 0; e < E; ++e) {
      const auto n = static_cast<index_t>(c[detail::count_fields + e]);
      routed[e] += n;
      rec.routed_per_expert.push_back(n);
    }
    records.push_back(std::move(rec));
    const double* yr = c + detail::count_fields + E + bias_fields;
    y.insert(y.end(), yr, all[r].data() + all[r].size());
    x.insert(x.end(), in.tokens[r].begin(), in.tokens[r].end());
    per_rank.push_back(in.tokens_of(r));
    for (index_t t = 0; t < in.tokens_of(r); ++t) ids.push_back(detail::token_id(cfg, r, t));
  }
  out.expert_imbalance = imbalance::of(routed).max_over_mean;
  const imbalance ranks_load = imbalance::of(computed);
  out.rank_imbalance = ranks_load.max_over_mean;
  out.straggler_excess = ranks_load.excess;
  out.straggler =
      static_cast<int>(std::max_element(computed.begin(), computed.end()) - computed.begin());

  // Error against the float64 reference of the last pass (pass counter N: warm-up was 0).
  const index_t H = cfg.hidden, total = static_cast<index_t>(x.size()) / H;
  std::vector<float> want(x.size(), std::numeric_limits<float>::quiet_NaN());
  auto routing = detail::router_of<P>(cfg);
  if constexpr (biased)
    if (!bias.empty()) routing.bias = bias.data();
  reference::forward<typename P::expert>(in.weights, routing, typename P::capacity{}, where,
                                         {x.data(), total, H}, per_rank, {want.data(), total, H},
                                         {ids, static_cast<std::uint64_t>(N)});
  out.error = reference::max_relative_error(y, want);
  detail::predict<P>(out, in, opt, records, where, chunks);
  return out;
}

/// Runs every bundle of the list, in order, on the same inputs and ranks.
template <class... Bundles, class Ranks>
std::vector<row> run(list<Bundles...>, const Ranks& ranks, const inputs& in,
                     const options& opt = {}) {
  std::vector<row> table;
  (table.push_back(run_bundle<Bundles>(ranks, in, opt)), ...);
  return table;
}

}  // namespace epmoe::experiment
