// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Decode steps (issue 38): the exchange time (dispatch + combine stages: the counts round,
// both all-to-alls and their regroups) of the low-latency exchange (options.low_latency:
// fixed slots, one all-to-all per direction) against the default one (counts, then rows),
// side by side in one run, at T = 1, 4, 16, 64 tokens per rank, Mixtral-like (H 4096, E 8,
// K 2) and DeepSeek-V3-like (H 7168, E 256, K 8) shapes. The expert FFN is shrunk (F = 16):
// the exchange does not depend on it. The ranks meet before each step (as after a decode
// step's attention), so a stage's time is its exchange, not another rank's lateness.
// Figures: the slowest rank's median over the steps, and its fastest step.
//   epmoe_bench_decode [--ranks R] [--tokens 1,4,16,64] [--steps N] [--shapes all|tiny]
//   mpiexec -n R epmoe_bench_decode_mpi [--tokens ...] [--steps N] [--shapes ...]
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

struct figures {
  double exchange_ms = 0, step_ms = 0;
  double best_ms = 0;  // the fastest step's exchange: what a loaded machine's spikes spare
  double bytes = 0;    // dispatch bytes this rank sent to other ranks
};

// `steps` decode steps of T tokens on this rank through two layers, the default exchange's
// and the low-latency one's, alternating step by step (the machine's load hits both alike;
// one warm-up each first): medians.
template <class Default, class Fixed, class Make, class Sync>
std::array<figures, 2> run_rank(const layer_config& cfg, Make make, Sync sync,
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
  std::vector<double> ex[2], step[2];
  const auto pass = [&](auto& layer, int k, bool timed) {
    sync();  // the ranks start the step together (as after a decode step's attention)
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    if (!timed) return;
    const epmoe::pass_stats& st = layer.stats();
    ex[k].push_back((st.time.dispatch + st.time.combine) * 1e3);
    step[k].push_back(st.time.total * 1e3);
  };
  for (int i = -1; i < steps; ++i) {
    pass(a, 0, i >= 0);
    pass(b, 1, i >= 0);
  }
  const auto of = [&](int k, double bytes) {
    return figures{median(ex[k]), median(step[k]), *std::min_element(ex[k].begin(), ex[k].end()),
                   bytes};
  };
  return {of(0, double(a.stats().dispatch_bytes_sent)),
          of(1, double(b.stats().dispatch_bytes_sent))};
}

std::array<figures, 2> slowest(const std::vector<std::array<figures, 2>>& all) {
  std::array<figures, 2> f{};
  for (const auto& q : all)
    for (int k = 0; k < 2; ++k) {
      f[k].exchange_ms = std::max(f[k].exchange_ms, q[k].exchange_ms);
      f[k].step_ms = std::max(f[k].step_ms, q[k].step_ms);
      f[k].best_ms = std::max(f[k].best_ms, q[k].best_ms);
      f[k].bytes = std::max(f[k].bytes, q[k].bytes);
    }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, steps = 50;
  std::vector<index_t> tokens = {1, 4, 16, 64};
  std::string shapes = "all";
  cli::command_line cl(argc, argv,
                       "usage: epmoe_bench_decode [--ranks R] [--tokens 1,4,16,64] [--steps N] "
                       "[--shapes all|tiny]\n"
                       "       mpiexec -n R epmoe_bench_decode_mpi [--tokens ...] [--steps N] "
                       "[--shapes ...]\n"
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
  const char* where = "MPI processes (comm::mpi, shared memory)";
  const auto each_rank = [&](auto fn) {
    const std::array<figures, 2> mine =
        fn([] { return epmoe::comm::mpi(MPI_COMM_WORLD); }, [] { MPI_Barrier(MPI_COMM_WORLD); });
    std::vector<std::array<figures, 2>> all(static_cast<std::size_t>(R));
    MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, MPI_COMM_WORLD);
    return slowest(all);
  };
#else
  const int R = ranks, me = 0;
  using Comm = epmoe::comm::threads;
  const char* where = "in-process threads (comm::threads)";
  const auto each_rank = [&](auto fn) {
    std::vector<std::array<figures, 2>> all(static_cast<std::size_t>(R));
    epmoe::comm::threads_world world(R);
    world.run([&](epmoe::comm::threads c) {
      all[c.rank()] = fn([c] { return c; }, [c]() mutable { c.barrier(); });
    });
    return slowest(all);
  };
#endif
  set_blas_threads(1);  // ranks share the cores
  if (me == 0)
    std::printf(
        "decode exchange: %d ranks (%s), %d steps; CPU: %s\n"
        "ms: exchange (dispatch + combine stages) and step, the slowest rank's median (best: "
        "its fastest step); KB: dispatch bytes one rank sent\n\n"
        "%-13s %4s %10s %10s %6s %9s %9s %6s %10s %10s %9s %9s\n",
        R, where, steps, cpu_model().c_str(), "shape", "T", "default ms", "fixed ms", "ratio",
        "best def", "best fix", "ratio", "default KB", "fixed KB", "step def", "step fix");
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
        std::printf("%-13s %4lld %10.4f %10.4f %6.2f %9.4f %9.4f %6.2f %10.1f %10.1f %9.4f %9.4f\n",
                    s.name, static_cast<long long>(T), f[0].exchange_ms, f[1].exchange_ms,
                    f[1].exchange_ms / f[0].exchange_ms, f[0].best_ms, f[1].best_ms,
                    f[1].best_ms / f[0].best_ms, f[0].bytes / 1024, f[1].bytes / 1024, f[0].step_ms,
                    f[1].step_ms);
      std::fflush(stdout);
    }
  }
  return 0;
}
