// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Sequential vs pipelined schedule, C in {1, 2, 4, 8}, over a plain and a throttled link, in
// one run. The throttled link's bandwidth is calibrated so that the all-to-alls cost about
// what the expert GEMMs cost (comm ~ compute, the regime of a real cluster); the table shows
// the all-to-all time, how much of it stayed exposed, and the layer time.
// Threads: epmoe_bench_overlap [tokens per rank]. MPI (built with epmoe::mpi):
//   mpiexec -n 2 epmoe_bench_overlap_mpi [tokens per rank]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../examples/args.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/schedule/pipelined.hpp>
#if defined(EPMOE_BENCH_MPI)
#include <epmoe/comm/mpi.hpp>
#endif

using namespace epmoe;

namespace {

template <class Comm, class Schedule>
struct policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = Comm;
  using schedule = Schedule;
};

struct result {
  double layer = 0, comm = 0, exposed = 0, experts = 0;
};

// Median over `reps` passes (after one warm-up) of this rank's figures.
template <class P, class MakeComm>
result run(const layer_config& cfg, const reference::full_weights& full, int rank, MakeComm make) {
  const auto mine = reference::slice(full, placement::block(cfg), rank);
  moe_layer<P> layer(cfg, make(), {full.gate_view(), mine.experts()});
  const index_t T = cfg.max_tokens, H = cfg.hidden;
  const auto x = reference::random_tokens(T, H, 7 + rank);
  std::vector<float> y(x.size());
  std::vector<result> all;
  for (int rep = 0; rep < 6; ++rep) {
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    const pass_stats& s = layer.stats();
    if (rep > 0)
      all.push_back({s.time.total, s.comm_seconds, s.exposed_comm_seconds, s.time.experts});
  }
  std::sort(all.begin(), all.end(),
            [](const result& a, const result& b) { return a.layer < b.layer; });
  return all[all.size() / 2];
}

void print_row(const char* link, const char* schedule, int C, const result& r) {
  std::printf("%-10s %-11s %2d %10.1f %10.1f %10.1f %8.0f%% %10.1f\n", link, schedule, C,
              r.comm * 1e3, r.exposed * 1e3, r.layer * 1e3,
              r.comm > 0 ? 100.0 * (1.0 - r.exposed / r.comm) : 0.0, r.experts * 1e3);
}

// Runs the whole table with `each_rank(fn)` calling fn(comm) on every rank (threads: one
// thread per rank; MPI: this process), printing from rank 0.
template <class Inner, class EachRank>
void table(const layer_config base, EachRank each_rank, int me_for_print) {
  const auto full = reference::full_weights::random(base, 1);
  // Calibrate: expert time and bytes of one sequential pass on the plain link.
  result plain;
  index_t bytes = 0;
  each_rank([&](auto make, int r) {
    auto x = run<policies<Inner, schedule::sequential>>(base, full, r, make);
    if (r == 0) plain = x;
  });
  const index_t row = index_t{base.hidden} * 4;
  bytes = index_t{base.max_tokens} * base.top_k * row * (base.ranks - 1) / base.ranks;
  // Two exchanges (dispatch, combine) of `bytes` should take about the experts' time.
  const comm::link wire{
      .bandwidth = 2.0 * static_cast<double>(bytes) / std::max(plain.experts, 1e-6),
      .latency = 20e-6};
  if (me_for_print == 0)
    std::printf(
        "throttled link: %.1f MB/s, 20 us (dispatch + combine ~ expert time of %.1f ms)\n\n"
        "%-10s %-11s %2s %10s %10s %10s %9s %10s\n",
        wire.bandwidth * 1e-6, plain.experts * 1e3, "link", "schedule", "C", "comm ms",
        "exposed ms", "layer ms", "hidden", "experts ms");
  for (bool throttle : {false, true})
    for (int C : {1, 2, 4, 8}) {
      layer_config cfg = base;
      cfg.chunks = C;
      result seq, pipe;
      each_rank([&](auto make, int r) {
        if (throttle) {
          using T = comm::throttled<Inner>;
          const auto slow = [&] { return T(make(), wire); };
          auto a = run<policies<T, schedule::sequential>>(cfg, full, r, slow);
          auto b = run<policies<T, schedule::pipelined<4>>>(cfg, full, r, slow);
          if (r == 0) seq = a, pipe = b;
        } else {
          auto a = run<policies<Inner, schedule::sequential>>(cfg, full, r, make);
          auto b = run<policies<Inner, schedule::pipelined<4>>>(cfg, full, r, make);
          if (r == 0) seq = a, pipe = b;
        }
      });
      if (me_for_print == 0) {
        print_row(throttle ? "throttled" : "plain", "sequential", C, seq);
        print_row(throttle ? "throttled" : "plain", "pipelined", C, pipe);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
#if defined(EPMOE_BENCH_MPI)
  cli::command_line cl(argc, argv,
                       "usage: mpiexec -n R epmoe_bench_overlap_mpi [TOKENS]\n"
                       "  Sequential vs pipelined (C = 1, 2, 4, 8) over a plain and a throttled\n"
                       "  link, R MPI processes, TOKENS per rank (default 256).\n");
#else
  cli::command_line cl(argc, argv,
                       "usage: epmoe_bench_overlap [TOKENS]\n"
                       "  Sequential vs pipelined (C = 1, 2, 4, 8) over a plain and a throttled\n"
                       "  link, 2 in-process ranks, TOKENS per rank (default 256).\n");
#endif
  int T = 256;  // parsed before MPI starts: --help needs no mpiexec
  for (int given = 0; cl.next(); ++given)
    if (cl.positional() && given == 0)
      T = static_cast<int>(cl.integer_here());
    else
      cl.unknown();
  if (T < 1) cl.fail("TOKENS must be >= 1");
#if defined(EPMOE_BENCH_MPI)
  comm::mpi_session session(argc, argv);
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  using Inner = comm::mpi;
  // comm::mpi is move-only and its construction collective: a new one per layer.
  const auto each_rank = [&](auto fn) { fn([] { return comm::mpi(MPI_COMM_WORLD); }, me); };
  const char* where = "MPI processes";
#else
  const int R = 2, me = 0;
  using Inner = comm::threads;
  const auto each_rank = [&](auto fn) {
    comm::threads_world world(R);
    world.run([&](comm::threads c) { fn([c] { return c; }, c.rank()); });
  };
  const char* where = "in-process threads";
#endif
  const layer_config cfg{
      .hidden = 512, .ffn = 1024, .experts = 8, .top_k = 2, .ranks = R, .max_tokens = T};
  if (me == 0)
    std::printf("overlap: H=%d F=%d E=%d top-%d, %d ranks (%s) x %d tokens; GEMM: %s\n", cfg.hidden,
                cfg.ffn, cfg.experts, cfg.top_k, R, where, T, space::host_gemm_backend());
  table<Inner>(cfg, each_rank, me);
  return 0;
}
