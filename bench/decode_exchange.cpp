// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Decode steps (issue 38): the exchange time (dispatch + combine stages: the counts round,
// both all-to-alls and their regroups) of the low-latency exchange (options.low_latency:
// fixed slots, one all-to-all per direction) against the default one (counts, then rows),
// side by side in one run, at T = 1, 4, 16, 64 tokens per rank, Mixtral-like (H 4096, E 8,
// K 2) and DeepSeek-V3-like (H 7168, E 256, K 8) shapes. The expert FFN is shrunk (F = 16):
// the exchange does not depend on it. The ranks meet before each step (as after a decode
// step's attention). A stage's time on a rank also holds its wait for the peers that arrive
// later (routing puts more rows on some ranks: their experts finish last), which no exchange
// can shorten: the exchange's own time is that of the rank that arrived last, which waits
// for no one. Figures: per step, the smallest dispatch and the smallest combine over the
// ranks, summed; the median over the steps (best: the fastest step); and, as seen by the
// ranks, the slowest rank's median of its dispatch + combine, waits included.
//   epmoe_bench_decode [--ranks R] [--tokens 1,4,16,64] [--steps N] [--shapes all|tiny]
//   mpiexec -n R epmoe_bench_decode_mpi [--tokens ...] [--steps N] [--shapes ...] [--messages]
// --messages: comm::mpi without windows (the low-latency exchange sends messages, as across
// nodes; on one node it writes into shared-memory windows).
#include <algorithm>
#include <array>
#include <cstdio>
#include <vector>

#include "bench_common.hpp"
#include <epmoe/reference/weights.hpp>
#if defined(EPMOE_BENCH_MPI)
#include <epmoe/comm/mpi.hpp>
#endif

namespace {

using namespace bench;

struct decode_shape {
  const char* name;
  layer_config cfg;
};

template <class Comm, int K, bool LowLatency>
struct decode_policies : epmoe::default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using comm = Comm;
  static constexpr epmoe::layer_options options{.low_latency = LowLatency};
};

// One rank's record of one exchange: per step its dispatch and combine stage times and the
// step's, in ms, then the dispatch bytes it sent to other ranks.
struct record {
  std::vector<double> dispatch, combine, step;
  double bytes = 0;
  std::vector<double> flat() const {  // (for MPI_Gather)
    std::vector<double> v = dispatch;
    v.insert(v.end(), combine.begin(), combine.end());
    v.insert(v.end(), step.begin(), step.end());
    v.push_back(bytes);
    return v;
  }
  static record of(const double* v, int steps) {
    const auto part = [&](int i) {
      return std::vector<double>(v + i * steps, v + (i + 1) * steps);
    };
    return {part(0), part(1), part(2), v[3 * steps]};
  }
};

struct figures {
  double exchange_ms = 0;  // the exchange's own: per step the last arriver's stages, median
  double best_ms = 0;      // ... its fastest step: what a loaded machine's spikes spare
  double seen_ms = 0;      // the slowest rank's median dispatch + combine, waits included
  double step_ms = 0;      // the slowest rank's median step
  double bytes = 0;        // dispatch bytes one rank sent to other ranks
};

// all[r]: rank r's record of one exchange.
figures figures_of(const std::vector<record>& all) {
  figures f{};
  const std::size_t steps = all[0].step.size();
  std::vector<double> own(steps);
  for (std::size_t s = 0; s < steps; ++s) {
    double d = all[0].dispatch[s], c = all[0].combine[s];
    for (const record& q : all) d = std::min(d, q.dispatch[s]), c = std::min(c, q.combine[s]);
    own[s] = d + c;
  }
  f.exchange_ms = median(own);
  f.best_ms = *std::min_element(own.begin(), own.end());
  for (const record& q : all) {
    std::vector<double> seen(steps);
    for (std::size_t s = 0; s < steps; ++s) seen[s] = q.dispatch[s] + q.combine[s];
    f.seen_ms = std::max(f.seen_ms, median(seen));
    f.step_ms = std::max(f.step_ms, median(q.step));
    f.bytes = std::max(f.bytes, q.bytes);
  }
  return f;
}

// `steps` decode steps of T tokens on this rank through two layers, the default exchange's
// and the low-latency one's, alternating step by step (the machine's load hits both alike;
// one warm-up each first): this rank's records.
template <class Default, class Fixed, class Make, class Sync>
std::array<record, 2> run_rank(const layer_config& cfg, Make make, Sync sync,
                               const epmoe::reference::full_weights& full, int steps) {
  using placement = typename epmoe::moe_layer<Default>::placement_type;
  auto c0 = make();
  const int r = c0.rank();
  const index_t T = cfg.max_tokens, H = cfg.hidden;
  const auto mine = epmoe::reference::slice(full, placement(cfg), r);
  epmoe::moe_layer<Default> a(cfg, std::move(c0), {full.gate_view(), mine.experts()});
  epmoe::moe_layer<Fixed> b(cfg, make(), {full.gate_view(), mine.experts()});
  const auto x = epmoe::reference::random_tokens(T, H, 100 + r);
  std::vector<float> y(x.size());
  std::array<record, 2> rec;
  const auto pass = [&](auto& layer, int k, bool timed) {
    sync();  // the ranks start the step together (as after a decode step's attention)
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    if (!timed) return;
    const epmoe::pass_stats& st = layer.stats();
    rec[k].dispatch.push_back(st.time.dispatch * 1e3);
    rec[k].combine.push_back(st.time.combine * 1e3);
    rec[k].step.push_back(st.time.total * 1e3);
  };
  for (int i = -1; i < steps; ++i) {
    pass(a, 0, i >= 0);
    pass(b, 1, i >= 0);
  }
  rec[0].bytes = double(a.stats().dispatch_bytes_sent);
  rec[1].bytes = double(b.stats().dispatch_bytes_sent);
  return rec;
}

// all[r]: rank r's records of the two exchanges.
std::array<figures, 2> both_figures(const std::vector<std::array<record, 2>>& all) {
  std::array<figures, 2> f{};
  for (int k = 0; k < 2; ++k) {
    std::vector<record> one;
    for (const auto& q : all) one.push_back(q[k]);
    f[k] = figures_of(one);
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, steps = 50;
  std::vector<index_t> tokens = {1, 4, 16, 64};
  std::string shapes = "all";
  bool windows = true;
  cli::command_line cl(argc, argv,
                       "usage: epmoe_bench_decode [--ranks R] [--tokens 1,4,16,64] [--steps N] "
                       "[--shapes all|tiny]\n"
                       "       mpiexec -n R epmoe_bench_decode_mpi [--tokens ...] [--steps N] "
                       "[--shapes ...] [--messages]\n"
                       "  Decode steps: exchange time of options.low_latency vs the default.\n");
  while (cl.next()) {
    if (cl.is("--ranks"))
      ranks = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--tokens"))
      tokens = token_list(cl);
    else if (cl.is("--steps"))
      steps = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--shapes"))
      shapes = cl.value();
    else if (cl.is("--messages"))
      windows = false;
    else
      cl.unknown();
  }
  const bool tiny = shapes == "tiny";
  const std::vector<decode_shape> list =
      tiny ? std::vector<decode_shape>{{"tiny-mixtral",
                                        {.hidden = 64, .ffn = 8, .experts = 8, .top_k = 2}},
                                       {"tiny-deepseek",
                                        {.hidden = 64, .ffn = 8, .experts = 16, .top_k = 8}}}
           : std::vector<decode_shape>{
                 {"mixtral", {.hidden = 4096, .ffn = 16, .experts = 8, .top_k = 2}},
                 {"deepseek", {.hidden = 7168, .ffn = 16, .experts = 256, .top_k = 8}}};
#if defined(EPMOE_BENCH_MPI)
  epmoe::comm::mpi_session session(argc, argv);
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  (void)ranks;  // mpiexec -n says
  using Comm = epmoe::comm::mpi;
  const char* where = windows ? "MPI processes (comm::mpi; low latency: shared-memory windows)"
                              : "MPI processes (comm::mpi; low latency: messages)";
  const auto each_rank = [&](auto fn) {
    const std::array<record, 2> mine =
        fn([&] { return epmoe::comm::mpi(MPI_COMM_WORLD, 8, windows); },
           [] { MPI_Barrier(MPI_COMM_WORLD); });
    std::vector<std::array<record, 2>> all(static_cast<std::size_t>(R));
    for (int k = 0; k < 2; ++k) {  // every rank's steps, gathered (the same count on each)
      const std::vector<double> v = mine[k].flat();
      const int n = static_cast<int>(v.size()), steps = static_cast<int>(mine[k].step.size());
      std::vector<double> got(static_cast<std::size_t>(n) * R);
      MPI_Allgather(v.data(), n, MPI_DOUBLE, got.data(), n, MPI_DOUBLE, MPI_COMM_WORLD);
      for (int q = 0; q < R; ++q) all[q][k] = record::of(got.data() + q * n, steps);
    }
    return both_figures(all);
  };
#else
  const int R = ranks, me = 0;
  (void)windows;  // (comm::threads always writes into windows)
  using Comm = epmoe::comm::threads;
  const char* where = "in-process threads (comm::threads)";
  const auto each_rank = [&](auto fn) {
    std::vector<std::array<record, 2>> all(static_cast<std::size_t>(R));
    epmoe::comm::threads_world world(R);
    world.run([&](epmoe::comm::threads c) {
      all[c.rank()] = fn([c] { return c; }, [c]() mutable { c.barrier(); });
    });
    return both_figures(all);
  };
#endif
  set_blas_threads(1);  // ranks share the cores
  if (me == 0)
    std::printf(
        "decode exchange: %d ranks (%s), %d steps; CPU: %s\n"
        "ms: the exchange's own time (dispatch + combine stages of the rank that arrived last "
        "at each, per step): median and best step; as seen by the ranks (the slowest rank's "
        "median, waits for later peers included); the step's. KB: dispatch bytes one rank "
        "sent\n\n"
        "%-13s %4s %10s %10s %6s %9s %9s %6s %9s %9s %6s %10s %10s %9s %9s\n",
        R, where, steps, cpu_model().c_str(), "shape", "T", "default ms", "fixed ms", "ratio",
        "best def", "best fix", "ratio", "seen def", "seen fix", "ratio", "default KB", "fixed KB",
        "step def", "step fix");
  for (const decode_shape& s : list) {
    layer_config base = s.cfg;
    base.ranks = R;
    if (base.experts % R != 0) continue;
    for (index_t T : tokens) {
      layer_config cfg = base;
      cfg.max_tokens = static_cast<int>(T);
      const auto full = epmoe::reference::full_weights::random(cfg, 1);
      std::array<figures, 2> f{};
      const auto both = [&]<int K>() {
        f = each_rank([&](auto make, auto sync) {
          return run_rank<decode_policies<Comm, K, false>, decode_policies<Comm, K, true>>(
              cfg, make, sync, full, steps);
        });
      };
      if (cfg.top_k == 2)
        both.template operator()<2>();
      else
        both.template operator()<8>();
      if (me == 0)
        std::printf(
            "%-13s %4lld %10.4f %10.4f %6.2f %9.4f %9.4f %6.2f %9.4f %9.4f %6.2f %10.1f %10.1f "
            "%9.4f %9.4f\n",
            s.name, static_cast<long long>(T), f[0].exchange_ms, f[1].exchange_ms,
            f[1].exchange_ms / f[0].exchange_ms, f[0].best_ms, f[1].best_ms,
            f[1].best_ms / f[0].best_ms, f[0].seen_ms, f[1].seen_ms, f[1].seen_ms / f[0].seen_ms,
            f[0].bytes / 1024, f[1].bytes / 1024, f[0].step_ms, f[1].step_ms);
      std::fflush(stdout);
    }
  }
  return 0;
}
