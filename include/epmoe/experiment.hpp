// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// epmoe::experiment: several policy bundles through the same tokens, weights and ranks, one
// table. Each bundle is a compile-time type; the experiment swaps in the ranks' comm, runs
// a warm-up pass and `passes` timed ones, and sets each bundle's counts, error against the
// float64 reference and the simulator's prediction for a cluster beside its measured times:
//
//   using strategies = experiment::list<
//       experiment::bundle<"mixtral top-2", mixtral>,
//       experiment::bundle<"balanced +4", replicated, {.from_load = true, .extra_slots = 4}>>;
//   const auto in = experiment::inputs::skewed(cfg, /*seed*/ 1, /*hot expert*/ 0, 2.0);
//   const auto table = experiment::run(strategies{}, experiment::thread_ranks{4}, in, {});
//   experiment::print(std::cout, table);
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <memory>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "epmoe/comm/threads.hpp"
#include "epmoe/comm/throttled.hpp"
#include "epmoe/core/report.hpp"
#include "epmoe/moe_layer.hpp"
#include "epmoe/placement/balancer.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/reference/compare.hpp"
#include "epmoe/reference/forward.hpp"
#include "epmoe/reference/weights.hpp"
#include "epmoe/sim/simulate.hpp"
#include "epmoe/sim/source.hpp"
#include "epmoe/sim/topology.hpp"

#ifdef EPMOE_HAS_MPI
#include "epmoe/comm/mpi.hpp"
#endif

namespace epmoe::experiment {

// --- the bundles ------------------------------------------------------------------------------

/// A bundle's name as a template argument: bundle<"mixtral top-2", P>.
template <std::size_t N>
struct name_string {
  char text[N]{};
  constexpr name_string(const char (&s)[N]) { std::copy_n(s, N, text); }
  constexpr std::string_view view() const { return {text, N - 1}; }
};

/// What the experiment does to a bundle besides running it.
struct treatment {
  bool throttled = false;  // exchanges take as long as options.link says (comm::throttled):
                           //   a cluster's all-to-all cost on one machine
  bool from_load = false;  // the placement is made from the load of a first pass of the
                           //   bundle (detail::placement_for)
  int extra_slots = 0;     // with from_load and placement::table: replicas the balancer adds
  int bias_steps = 0;      // with a router that has a bias (DeepSeek-V3's aux-loss-free
                           //   balancing): untimed passes, each followed by update_router,
                           //   before the timed ones; the timed passes use the learnt bias
};

/// One entry of the experiment: a name, a policy bundle (its comm is replaced by the ranks'
/// own; a router with settings comes from `static router make_router(const layer_config&)`
/// in the bundle) and a treatment.
template <name_string Name, class Policies, treatment How = {}>
struct bundle {
  static constexpr std::string_view name = Name.view();
  using policies = Policies;
  static constexpr treatment how = How;
};

template <class... Bundles>
struct list {};

/// Bundle P on communicator Comm.
template <class P, class Comm>
struct on_comm : P {
  using comm = Comm;
};

// --- ranks that share one machine take turns ---------------------------------------------------

/// The host space, with a lock its copies share: the experts stage of a rank that runs under
/// in_turns<> waits for it. Thread ranks share this machine's cores, so concurrent expert
/// GEMMs slow each other down and a rank's expert time would measure the contention; taking
/// turns makes it the rank's own work, as on a cluster where each rank has its own device.
class turn_space : public space::host {
 public:
  turn_space() = default;
  /// Each rank its own space (its own GEMM helper threads), the lock shared; a null lock:
  /// turn() does not lock (ranks run their experts together).
  explicit turn_space(std::shared_ptr<std::mutex> lock) : turn_(std::move(lock)) {}
  std::unique_lock<std::mutex> turn() const {
    return turn_ ? std::unique_lock<std::mutex>(*turn_) : std::unique_lock<std::mutex>();
  }

 private:
  std::shared_ptr<std::mutex> turn_;
};

/// Schedule S with each experts stage taken in turn (the wait is outside its timer).
template <class S>
struct in_turns {
  static constexpr int default_chunks = S::default_chunks;
  static constexpr int units_in_flight = units_in_flight_of<S>();

  template <class Stages>
  struct taking_turns {
    Stages& s;
    int chunks() const { return s.chunks(); }
    void route() { s.route(); }
    void plan() { s.plan(); }
    void permute() { s.permute(); }
    void shared() { s.shared(); }
    void counts() { s.counts(); }
    void dispatch_start(int u) { s.dispatch_start(u); }
    void dispatch_wait(int u) { s.dispatch_wait(u); }
    void experts(int u) {
      const auto lock = s.space().turn();
      s.experts(u);
    }
    void combine_start(int u) { s.combine_start(u); }
    void combine_wait(int u) { s.combine_wait(u); }
    void reduce() { s.reduce(); }
  };

  template <class Stages>
  static void run(Stages& s) {
    if constexpr (requires { s.space().turn(); }) {
      taking_turns<Stages> t{s};
      S::run(t);
    } else {
      S::run(s);  // a space without turns (its own device per rank)
    }
  }
};

/// Bundle P on communicator Comm, its experts in turns on turn_space (thread ranks).
template <class P, class Comm>
struct in_turns_on : P {
  using comm = Comm;
  using space = turn_space;
  using schedule = in_turns<typename P::schedule>;
};

// --- where the ranks run ----------------------------------------------------------------------

/// R ranks as threads of this process.
struct thread_ranks {
  using comm_type = comm::threads;
  static constexpr bool share_cores = true;  // their expert stages take turns (in_turns)
  int ranks = 4;

  int size() const { return ranks; }
  /// fn(comm_type) -> std::vector<double> on every rank; returns them all, [rank].
  template <class Fn>
  std::vector<std::vector<double>> run(Fn&& fn) const {
    std::vector<std::vector<double>> out(static_cast<std::size_t>(ranks));
    comm::threads_world world(ranks);
    world.run([&](comm::threads c) {
      const int r = c.rank();
      out[static_cast<std::size_t>(r)] = fn(std::move(c));
    });
    return out;
  }
};

#ifdef EPMOE_HAS_MPI
/// The processes of MPI_COMM_WORLD (the program holds an mpi_session): every process gets
/// every rank's numbers, so every process builds the same table.
struct mpi_ranks {
  using comm_type = comm::mpi;
  static constexpr bool share_cores = false;  // a process per rank, a lock per process

  int size() const {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
  template <class Fn>
  std::vector<std::vector<double>> run(Fn&& fn) const {
    const std::vector<double> mine = fn(comm::mpi(MPI_COMM_WORLD));
    const int R = size();
    int n = static_cast<int>(mine.size());
    std::vector<int> counts(static_cast<std::size_t>(R)), displs(counts.size());
    comm::detail::mpi_check(
        MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
    int total = 0;
    for (int r = 0; r < R; ++r) displs[r] = std::exchange(total, total + counts[r]);
    std::vector<double> all(static_cast<std::size_t>(total));
    comm::detail::mpi_check(MPI_Allgatherv(mine.data(), n, MPI_DOUBLE, all.data(), counts.data(),
                                           displs.data(), MPI_DOUBLE, MPI_COMM_WORLD),
                            "MPI_Allgatherv");
    std::vector<std::vector<double>> out(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r)
      out[r].assign(all.begin() + displs[r], all.begin() + displs[r] + counts[r]);
    return out;
  }
};
#endif

// --- inputs and options -----------------------------------------------------------------------

/// What every bundle runs on: the config, the full weights (each rank takes its slots), and
/// each rank's tokens.
struct inputs {
  layer_config cfg;
  reference::full_weights weights;
  std::vector<std::vector<float>> tokens;  // [rank]: T_r rows of H, T_r <= max_tokens

  index_t tokens_of(int rank) const {
    return static_cast<index_t>(tokens[static_cast<std::size_t>(rank)].size()) / cfg.hidden;
  }

  /// Random weights and max_tokens random tokens per rank.
  static inputs uniform(const layer_config& cfg, std::uint64_t seed) {
    inputs in{cfg, reference::full_weights::random(cfg, seed), {}};
    for (int r = 0; r < cfg.ranks; ++r)
      in.tokens.push_back(reference::random_tokens(cfg.max_tokens, cfg.hidden,
                                                   seed + 1 + static_cast<std::uint64_t>(r)));
    return in;
  }
  /// The same tokens moved toward expert `hot`'s gate row so that its logit rises by `boost`
  /// on every token: data from one domain, the router unchanged.
  static inputs skewed(const layer_config& cfg, std::uint64_t seed, int hot, double boost) {
    inputs in = uniform(cfg, seed);
    const index_t H = cfg.hidden;
    const float* g = in.weights.gate.data() + hot * H;
    double norm2 = 0;
    for (index_t i = 0; i < H; ++i) norm2 += double{g[i]} * g[i];
    const auto a = static_cast<float>(boost / std::max(norm2, 1e-30));
    for (auto& x : in.tokens)
      for (std::size_t t = 0; t < x.size() / H; ++t)
        for (index_t i = 0; i < H; ++i) x[t * H + i] += a * g[i];
    return in;
  }
};

struct options {
  int passes = 5;                 // timed passes after one warm-up: times are their medians
  comm::link link{};              // of the bundles treated `throttled`
  bool turns = true;              // thread ranks take turns for their expert stages
  std::string topology = "h200";  // the simulator's cluster (sim::preset), "" for none
  int nodes = 1;                  //   over this many nodes (ranks split evenly)
};

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
/// type whose views_of has shared()), the noise gate, the shared gate and the output bias.
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
