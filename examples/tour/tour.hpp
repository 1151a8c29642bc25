// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The tour of expert parallelism: eight experiments on the real layer, each returning its
// numbers and a one-line conclusion computed from them. `World` is where the ranks run
// (ranks.hpp: threads, or MPI processes); every rank returns the same result.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <limits>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "conclusions.hpp"
#include "ranks.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/epmoe.hpp>
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/schedule/pipelined.hpp>

namespace epmoe::tour {

/// Shapes of the tour. The defaults run the whole tour in well under a minute on 2 cores;
/// small() is what the tests use.
struct options {
  int ranks = 4;  // R: must divide 8 (set by the world: threads, or mpiexec -n)
  int hidden = 256;
  int ffn = 512;
  int tokens = 256;  // per rank and pass
  int hot_expert = 5;
  double boost = 3.0;  // skewed inputs: the hot expert's logit raised by this much
  std::uint64_t seed = 2026;

  static options small(int ranks) {
    return {.ranks = ranks, .hidden = 32, .ffn = 48, .tokens = 64};
  }
  layer_config config(int top = top_k) const {
    return {.hidden = hidden,
            .ffn = ffn,
            .experts = experts,
            .top_k = top,
            .ranks = ranks,
            .max_tokens = tokens};
  }
};

/// The tour's policy bundles: softmax top-K routing over the world's communicator.
template <class Comm, class Capacity = capacity::dropless, class Schedule = schedule::sequential,
          class Placement = placement::block, int K = top_k, class Expert = expert::swiglu>
struct policies : default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using comm = Comm;
  using capacity = Capacity;
  using schedule = Schedule;
  using placement = Placement;
  using expert = Expert;
};

/// The sequential schedule, but only one rank of this process runs its experts at a time.
/// Thread ranks share this machine's cores, so concurrent expert GEMMs slow each other down
/// and a rank's expert time would measure the contention; taking turns makes it the rank's
/// own work, as on a cluster where every rank has its own device. (MPI ranks are processes:
/// each has its own lock, nothing changes.)
struct experts_in_turn {
  static constexpr int default_chunks = 1;
  static inline std::mutex turn;

  template <class Stages>
  static void run(Stages& s) {
    s.route();
    s.plan();
    s.permute();
    s.shared();
    s.counts();
    for (int c = 0; c < s.chunks(); ++c) {
      s.dispatch_start(c);
      s.dispatch_wait(c);
      {
        const std::lock_guard lock(turn);  // outside the experts stage's timer
        s.experts(c);
      }
      s.combine_start(c);
      s.combine_wait(c);
    }
    s.reduce();
  }
};

// --- helpers -----------------------------------------------------------------------------

/// Rank r's tokens [T, H]: the same in every process.
inline std::vector<float> tokens_of(const options& o, int rank) {
  return reference::random_tokens(o.tokens, o.hidden, o.seed + 1 + static_cast<unsigned>(rank));
}

/// The same tokens moved toward the hot expert's gate row, so that its logit rises by
/// `boost`: data from one domain, the same router.
inline std::vector<float> skewed(std::vector<float> x, const reference::full_weights& w,
                                 const options& o) {
  const index_t H = o.hidden;
  const float* g = w.gate.data() + o.hot_expert * H;
  double norm2 = 0;
  for (index_t i = 0; i < H; ++i) norm2 += double{g[i]} * g[i];
  const float a = static_cast<float>(o.boost / norm2);
  for (std::size_t t = 0; t < x.size() / H; ++t)
    for (index_t i = 0; i < H; ++i) x[t * H + i] += a * g[i];
  return x;
}

/// One pass; y is filled with NaN first, so a row the layer leaves unwritten cannot pass.
template <class Layer>
void forward(Layer& layer, const std::vector<float>& x, std::vector<float>& y) {
  const index_t H = layer.config().hidden, T = static_cast<index_t>(x.size()) / H;
  y.assign(x.size(), std::numeric_limits<float>::quiet_NaN());
  layer.forward({x.data(), T, H}, {y.data(), T, H});
}

/// A layer of policy bundle P on this rank, holding its slice of `full` under `where`.
template <class P>
struct rank_layer {
  reference::rank_weights mine;
  moe_layer<P> layer;

  rank_layer(const layer_config& cfg, typename P::comm comm, const reference::full_weights& full,
             const typename P::placement& where)
      : mine(reference::slice(full, where, comm.rank())),
        layer(cfg, std::move(comm), {full.gate_view(), mine.experts()}, {}, {}, where) {}
  rank_layer(const layer_config& cfg, typename P::comm comm, const reference::full_weights& full)
      : rank_layer(cfg, std::move(comm), full, typename P::placement(cfg)) {}
};

inline double max_over_mean(const std::vector<double>& v) { return imbalance::of(v).max_over_mean; }

/// A fixed single-thread kernel (~7 ms a run on the 2-core VM; shorter runs fit between the
/// scheduler's preemptions and miss the load), timed `runs` times: its median wall time in ms
/// and the share of a core it got (CPU time / wall time). Run where no rank of this process
/// runs, it sees only other work on the machine.
struct calibration {
  double ms = 0;
  double core_share = 1;
};

inline calibration calibrate(int runs = 5) {
  static volatile float sink = 1;  // the chain starts from memory: no compile-time answer
  std::vector<double> wall;
  double cpu = 0, elapsed = 0;
  for (int i = 0; i < runs; ++i) {
    const std::clock_t c0 = std::clock();
    const auto t0 = std::chrono::steady_clock::now();
    float s = sink;
    for (int n = 0; n < 5'000'000; ++n) s = s * 0.9999f + 1e-4f;  // dependent: fixed latency
    sink = s;
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu += double(std::clock() - c0) / CLOCKS_PER_SEC;
    elapsed += w;
    wall.push_back(1e3 * w);
  }
  return {median(wall), elapsed > 0 ? std::min(1.0, cpu / elapsed) : 1.0};
}

/// The load check around a timed step: calibrate() before and after, and the spread of the
/// step's passes (the worst rank's).
struct load_probe {
  calibration before = calibrate();

  machine_load finish(double pass_spread) const {
    const calibration after = calibrate();
    return {.calibration_ms_before = before.ms,
            .calibration_ms_after = after.ms,
            .core_share = std::min(before.core_share, after.core_share),
            .pass_spread = pass_spread};
  }
};

// --- 1. what EP distributes --------------------------------------------------------------

template <class World>
distribution_result what_ep_distributes(const World& world, const options& o) {
  using P = policies<typename World::comm_type>;
  const layer_config cfg = o.config();
  const auto full = reference::full_weights::random(cfg, o.seed);
  const auto views_bytes = [](const expert::swiglu::weights& w) {
    double b = 0;
    for (const auto* v : {&w.w1, &w.w3, &w.w2})
      b += double(v->count) * double(v->rows) * double(v->cols) * sizeof(float);
    return b;
  };
  const auto all = world.run([&](typename P::comm c) {
    rank_layer<P> l(cfg, std::move(c), full);  // validates: L experts of the right shapes
    numbers n;
    n.put(views_bytes(l.mine.experts()));
    for (int j = 0; j < l.layer.placement().slots_per_rank(); ++j)
      n.put(l.layer.placement().expert_at(l.layer.rank(), j));
    return n;
  });
  distribution_result r;
  r.ranks = o.ranks;
  r.gate_bytes = double(full.gate.size()) * sizeof(float);
  const expert::swiglu::weights every{full.w1_view(), full.w3_view(), full.w2_view()};
  r.replicated_bytes = views_bytes(every) + r.gate_bytes;
  const int L = cfg.experts_per_rank();
  for (const auto& v : all) {
    reader in{v};
    r.bytes_per_rank.push_back(in.get() + r.gate_bytes);
    r.experts_of_rank.push_back(in.get<int>(static_cast<std::size_t>(L)));
  }
  r.saving = r.replicated_bytes / max_of(r.bytes_per_rank);
  r.conclusion = conclusion(r);
  return r;
}

// --- 2. the communication pattern --------------------------------------------------------

template <class World>
exchanges_result communication_pattern(const World& world, const options& o, int passes = 5) {
  using P = policies<counting<typename World::comm_type>>;
  const layer_config cfg = o.config();
  const auto full = reference::full_weights::random(cfg, o.seed);
  const auto all = world.run([&](typename World::comm_type c) {
    exchange_log log;
    const int r = c.rank();
    rank_layer<P> l(cfg, {std::move(c), &log}, full);
    const auto x = tokens_of(o, r);
    std::vector<float> y;
    numbers n;
    for (int p = 0; p < passes; ++p) {
      log.clear();  // construction agreed on the config through the comm: not a pass
      forward(l.layer, x, y);
      const pass_stats& s = l.layer.stats();
      n.put(log.counts_exchanges);
      n.put(log.counts_bytes);
      n.put(static_cast<double>(log.row_bytes.size()));
      n.put(log.row_bytes.size() > 0 ? log.row_bytes[0] : -1);
      n.put(log.row_bytes.size() > 1 ? log.row_bytes[1] : -1);
      n.put(s.dispatch_bytes_sent);
      n.put(s.combine_bytes_sent);
    }
    return n;
  });
  exchanges_result r;
  r.passes = passes;
  r.row_bytes = double(o.hidden) * sizeof(float);
  r.same_on_every_rank_and_pass = true;
  r.stats_match = true;
  for (const auto& v : all) {
    reader in{v};
    for (int p = 0; p < passes; ++p) {
      const int counts = static_cast<int>(in.get());
      const double cbytes = in.get();
      const int rows = static_cast<int>(in.get());
      const double d = in.get(), c = in.get(), sd = in.get(), sc = in.get();
      if (&v == &all.front() && p == 0) {
        r.counts_exchanges_per_pass = counts;
        r.row_exchanges_per_pass = rows;
        r.counts_bytes = cbytes;
      }
      r.same_on_every_rank_and_pass &=
          counts == r.counts_exchanges_per_pass && rows == r.row_exchanges_per_pass;
      r.stats_match &= d == sd && c == sc;
      if (p == passes - 1) {
        r.dispatch_bytes.push_back(d);
        r.combine_bytes.push_back(c);
        r.stats_dispatch_bytes.push_back(sd);
        r.stats_combine_bytes.push_back(sc);
      }
    }
  }
  r.conclusion = conclusion(r);
  return r;
}

// --- 3. compute per token ------------------------------------------------------------------

template <class World>
compute_result compute_per_token(const World& world, const options& o, int passes = 5) {
  // Ranks take turns for their expert GEMMs, so each rank's time is its own work.
  using Top = policies<typename World::comm_type, capacity::dropless, experts_in_turn>;
  using Dense = policies<typename World::comm_type, capacity::dropless, experts_in_turn,
                         placement::block, experts>;
  const auto full = reference::full_weights::random(o.config(), o.seed);
  const load_probe probe;
  // After a warm-up pass each (first touches), passes of the two layers alternate, so that
  // both see the same load of the machine; each rank's time is the median of its passes.
  const auto all = world.run([&](typename World::comm_type c) {
    rank_layer<Top> top(o.config(), another(c), full);
    rank_layer<Dense> dense(o.config(experts), std::move(c), full);
    const auto x = tokens_of(o, top.layer.rank());
    std::vector<float> y;
    forward(top.layer, x, y);
    forward(dense.layer, x, y);
    std::vector<double> top_s, dense_s;
    for (int p = 0; p < passes; ++p) {
      forward(top.layer, x, y);
      top_s.push_back(top.layer.stats().time.experts);
      forward(dense.layer, x, y);
      dense_s.push_back(dense.layer.stats().time.experts);
    }
    numbers n;
    n.put(top.layer.stats().expert_flops);
    n.put(median(top_s));
    n.put(dense.layer.stats().expert_flops);
    n.put(median(dense_s));
    n.put(std::max(spread(top_s), spread(dense_s)));
    return n;
  });
  compute_result r;
  r.ranks = o.ranks;
  const double tokens = double(o.tokens) * o.ranks;
  double worst_spread = 0;
  for (const auto& v : all) {
    r.flops_per_token_topk += v[0] / tokens;
    r.expert_seconds_topk += v[1];
    r.flops_per_token_dense += v[2] / tokens;
    r.expert_seconds_dense += v[3];
    worst_spread = std::max(worst_spread, v[4]);
  }
  r.flop_ratio = r.flops_per_token_topk / r.flops_per_token_dense;
  r.time_ratio = r.expert_seconds_topk / r.expert_seconds_dense;
  r.load = probe.finish(worst_spread);
  r.conclusion = conclusion(r);
  return r;
}

// --- 4. data-dependent routing -> imbalance ------------------------------------------------

template <class World>
routing_result routing_imbalance(const World& world, const options& o) {
  using P = policies<typename World::comm_type>;
  const layer_config cfg = o.config();
  const auto full = reference::full_weights::random(cfg, o.seed);
  const auto all = world.run([&](typename P::comm c) {
    rank_layer<P> l(cfg, std::move(c), full);
    const auto x = tokens_of(o, l.layer.rank());
    std::vector<float> y;
    numbers n;
    for (const auto& in : {x, skewed(x, full, o)}) {  // the same router, two inputs
      forward(l.layer, in, y);
      const auto load = l.layer.gather_load();  // collective: every rank's counts
      n.put_all(load.per_expert);
      n.put_all(load.per_rank);
    }
    return n;
  });
  routing_result r;
  r.hot_expert = o.hot_expert;
  reader in{all[0]};  // gather_load gave every rank the same numbers
  r.expert_rows_uniform = in.get(experts);
  r.rank_rows_uniform = in.get(static_cast<std::size_t>(o.ranks));
  r.expert_rows_skewed = in.get(experts);
  r.rank_rows_skewed = in.get(static_cast<std::size_t>(o.ranks));
  r.expert_max_over_mean_uniform = max_over_mean(r.expert_rows_uniform);
  r.expert_max_over_mean_skewed = max_over_mean(r.expert_rows_skewed);
  r.rank_max_over_mean_uniform = max_over_mean(r.rank_rows_uniform);
  r.rank_max_over_mean_skewed = max_over_mean(r.rank_rows_skewed);
  r.busiest_expert_skewed = argmax(r.expert_rows_skewed);
  r.conclusion = conclusion(r);
  return r;
}

// --- 5. capacity and padding ---------------------------------------------------------------

template <class World>
capacity_result capacity_and_padding(const World& world, const options& o,
                                     std::vector<double> factors = {0.5, 1.0, 1.25, 2.0}) {
  const auto full = reference::full_weights::random(o.config(), o.seed);
  // Per rank, for uniform then skewed tokens: dropped, assignments, the shape of the pass
  // (rows to each rank, padding included, and rows per local expert).
  const auto run = [&]<class P>(const layer_config& cfg) {
    return world.run([&](typename P::comm c) {
      rank_layer<P> l(cfg, std::move(c), full);
      const auto x = tokens_of(o, l.layer.rank());
      std::vector<float> y;
      numbers n;
      std::vector<std::vector<index_t>> shapes;
      for (const auto& in : {x, skewed(x, full, o)}) {
        forward(l.layer, in, y);
        const pass_stats& s = l.layer.stats();
        n.put(s.dropped);
        n.put(s.assignments);
        std::vector<index_t> shape = s.rows_sent;
        shape.insert(shape.end(), s.padded_rows_per_local_expert.begin(),
                     s.padded_rows_per_local_expert.end());
        shapes.push_back(shape);
        n.put(*std::max_element(s.padded_rows_per_local_expert.begin(),
                                s.padded_rows_per_local_expert.end()));
      }
      n.put(shapes[0] == shapes[1] ? 1 : 0);
      return n;
    });
  };
  struct summary {        // over all ranks; [0] uniform, [1] skewed tokens
    double drop[2] = {};  // share of assignments dropped
    double rows[2] = {};  // the busiest expert's rows, padding included
    bool fixed = true;    // every rank's shapes equal for both inputs
  };
  const auto summarize = [&](const std::vector<std::vector<double>>& all) {
    summary s;
    double assigned[2] = {};
    for (const auto& v : all) {
      reader in{v};
      for (int i = 0; i < 2; ++i) {
        s.drop[i] += in.get();
        assigned[i] += in.get();
        s.rows[i] = std::max(s.rows[i], in.get());
      }
      s.fixed &= in.get() == 1;
    }
    for (int i = 0; i < 2; ++i) s.drop[i] /= assigned[i];
    return s;
  };
  using Padded = policies<typename World::comm_type, capacity::factor<true>>;
  using Dropless = policies<typename World::comm_type>;
  capacity_result r;
  for (double f : factors) {
    layer_config cfg = o.config();
    cfg.capacity_factor = f;
    const summary s = summarize(run.template operator()<Padded>(cfg));
    capacity_row row{.factor = f};
    row.capacity = static_cast<double>(capacity::factor<true>{}.limit(cfg, o.tokens));
    row.buffer_rows = s.rows[0];
    row.drop_uniform = s.drop[0];
    row.drop_skewed = s.drop[1];
    row.shapes_fixed = s.fixed && s.rows[0] == s.rows[1];
    r.padded.push_back(row);
  }
  const summary d = summarize(run.template operator()<Dropless>(o.config()));
  r.dropless_shapes_fixed = d.fixed;
  r.dropless_busiest_rows = {d.rows[0], d.rows[1]};
  r.dropless_drop = {d.drop[0], d.drop[1]};
  r.conclusion = conclusion(r);
  return r;
}

// --- 6. hiding all-to-all latency ----------------------------------------------------------

template <class World>
overlap_result hiding_latency(const World& world, const options& o, int passes = 5) {
  using Comm = typename World::comm_type;
  using Free = policies<Comm>;
  using Seq = policies<comm::throttled<Comm>>;
  using Pipe = policies<comm::throttled<Comm>, capacity::dropless, schedule::pipelined<4>>;
  const auto full = reference::full_weights::random(o.config(), o.seed);
  overlap_result r;
  const load_probe load;
  // Size the link from a free-running pass: one exchange as long as all the expert compute,
  // the regime of a cluster where the all-to-alls cost as much as the GEMMs.
  const auto probe = world.run([&](Comm c) {
    rank_layer<Free> l(o.config(), std::move(c), full);
    const auto x = tokens_of(o, l.layer.rank());
    std::vector<float> y;
    forward(l.layer, x, y);  // warm-up
    std::vector<double> experts_s;
    for (int p = 0; p < passes; ++p) {
      forward(l.layer, x, y);
      experts_s.push_back(l.layer.stats().time.experts);
    }
    numbers n;
    n.put(median(experts_s));
    n.put(std::max(l.layer.stats().dispatch_bytes_sent, l.layer.stats().dispatch_bytes_received));
    return n;
  });
  double bytes = 0;
  for (const auto& v : probe) {
    r.experts_seconds = std::max(r.experts_seconds, v[0]);
    bytes = std::max(bytes, v[1]);
  }
  r.bandwidth = bytes / r.experts_seconds;
  const comm::link link{.bandwidth = r.bandwidth, .latency = r.latency};
  layer_config piped = o.config();
  piped.chunks = r.chunks;
  // Passes of the two schedules alternate, so that both see the same load of the machine.
  const auto all = world.run([&](Comm c) {
    rank_layer<Seq> seq(o.config(), {another(c), link}, full);
    rank_layer<Pipe> pipe(piped, {std::move(c), link}, full);
    const auto x = tokens_of(o, seq.layer.rank());
    std::vector<float> y;
    forward(seq.layer, x, y);  // warm-up
    forward(pipe.layer, x, y);
    std::vector<double> m[6];  // per pass: comm, exposed, total; sequential then pipelined
    const auto record = [&](int i, const pass_stats& s) {
      m[3 * i + 0].push_back(s.comm_seconds);
      m[3 * i + 1].push_back(s.exposed_comm_seconds);
      m[3 * i + 2].push_back(s.time.total);
    };
    for (int p = 0; p < passes; ++p) {
      forward(seq.layer, x, y);
      record(0, seq.layer.stats());
      forward(pipe.layer, x, y);
      record(1, pipe.layer.stats());
    }
    numbers n;
    for (const auto& v : m) n.put(median(v));  // a shared machine may stall one pass
    n.put(std::max(spread(m[2]), spread(m[5])));
    // The last pipelined pass's timeline: an order of events, not a duration, so a loaded
    // machine cannot blur it. Boundary c -> c+1 overlaps when chunk c+1's dispatch started
    // before chunk c's experts ended.
    const auto& events = pipe.layer.stats().timeline;
    const auto when = [&](int chunk, stage_kind k, bool end) {
      double t = end ? -1 : std::numeric_limits<double>::infinity();
      for (const timeline_event& e : events)
        if (e.chunk == chunk && e.stage == k) t = end ? std::max(t, e.end) : std::min(t, e.start);
      return t;
    };
    const int C = pipe.layer.stats().chunks;
    int overlapped = 0;
    for (int c = 0; c + 1 < C; ++c)
      overlapped += when(c + 1, stage_kind::dispatch, false) < when(c, stage_kind::experts, true);
    n.put(C - 1);
    n.put(overlapped);
    return n;
  });
  std::vector<double> worst(6, 0.0);  // the slowest rank's
  double worst_spread = 0;
  for (const auto& v : all) {
    for (int i = 0; i < 6; ++i) worst[i] = std::max(worst[i], v[i]);
    worst_spread = std::max(worst_spread, v[6]);
    r.boundaries += static_cast<int>(v[7]);
    r.overlapped_boundaries += static_cast<int>(v[8]);
  }
  r.comm_sequential = worst[0];
  r.exposed_sequential = worst[1];
  r.total_sequential = worst[2];
  r.comm_pipelined = worst[3];
  r.exposed_pipelined = worst[4];
  r.total_pipelined = worst[5];
  r.overlap_pipelined = 1 - r.exposed_pipelined / r.comm_pipelined;
  r.load = load.finish(worst_spread);
  r.conclusion = conclusion(r);
  return r;
}

}  // namespace epmoe::tour

// Steps 7 and 8 (their own file: this one would pass 600 lines).
#include "steps_7_8.hpp"  // IWYU pragma: export
