// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Flat vs hierarchical dispatch and combine (issue 24), side by side in one run: R ranks as
// R/G nodes of G, both benchmark shapes. Per exchange: the rows and bytes every rank sent
// over each link class in the dispatch (the combine returns as many), the all-to-all time
// and the pass time (the slowest rank's median), over the plain comm and over
// comm::throttled with two link classes: the inter-node link calibrated so the flat
// exchange's inter-node bytes (dispatch + combine) take `--slow` times the experts' time
// (default 4: the network is the bottleneck, as for DeepSeek-V3 across nodes), the
// intra-node link 8x faster (NVLink against a NIC). On one machine every link is memory: the
// plain rows show the bytes, the throttled rows the time a slow network makes of them.
//   epmoe_bench_hierarchical [--shapes all|tiny|NAME,...] [--tokens T] [--ranks R]
//                            [--per-node G] [--reps N] [--slow X]
//   mpiexec -n R epmoe_bench_hierarchical_mpi [--shapes ...] [--tokens T] [--per-node G]
//                                             [--reps N] [--slow X]
#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench_common.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/reference/weights.hpp>
#if defined(EPMOE_BENCH_MPI)
#include <epmoe/comm/mpi.hpp>
#endif

namespace {

using namespace bench;
using epmoe::pass_stats;

struct options {
  std::string shapes = "all";
  index_t tokens = 64;  // per rank
  int ranks = 4;        // threads
  int per_node = 2;
  int reps = 5;
  double slow = 4;  // the flat exchange's inter-node time over the experts' time
};

/// One rank's figures: medians over the timed passes, counts of the last one.
struct rank_numbers {
  double ms = 0, comm_ms = 0, experts_ms = 0;
  double rows[2] = {0, 0}, bytes[2] = {0, 0};  // [intra, inter] sent in the dispatch
  double link_bytes = 0;  // the larger of inter-node bytes sent and received (the NIC's share)
};

template <class Base, bool Hier>
struct two_level : Base {
  static constexpr epmoe::layer_options options{.dedup = true, .hierarchical = Hier};
};

template <class P, class Router, class Comm>
rank_numbers run_rank(const shape& s, const layer_config& cfg, Router router, Comm comm,
                      const epmoe::reference::full_weights& full, int reps) {
  using layer_t = epmoe::moe_layer<P>;
  const int r = comm.rank();
  const index_t T = cfg.max_tokens, H = cfg.hidden;
  const auto mine = epmoe::reference::slice(full, typename layer_t::placement_type(cfg), r);
  layer_t layer(cfg, std::move(comm), {full.gate_view(), mine.experts(), full.shared()}, router);
  layer.pack_weights();
  const auto all = epmoe::reference::random_tokens(T * cfg.ranks, H, 100);
  const std::vector<float> x(all.begin() + r * T * H, all.begin() + (r + 1) * T * H);
  std::vector<float> y(x.size());
  std::vector<double> ms, comm_ms, experts_ms;
  for (int i = -1; i < reps; ++i) {
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    if (i < 0) continue;
    const pass_stats& st = layer.stats();
    ms.push_back(st.time.total * 1e3);
    comm_ms.push_back(st.comm_seconds * 1e3);
    experts_ms.push_back(st.time.experts * 1e3);
  }
  (void)s;
  const pass_stats& st = layer.stats();
  rank_numbers n{median(ms), median(comm_ms), median(experts_ms)};
  const epmoe::link_traffic* level[2] = {&st.intra_node, &st.inter_node};
  for (int l = 0; l < 2; ++l) {
    n.rows[l] = static_cast<double>(level[l]->rows_sent);
    n.bytes[l] = static_cast<double>(level[l]->bytes_sent);
  }
  n.link_bytes =
      static_cast<double>(std::max(st.inter_node.bytes_sent, st.inter_node.bytes_received));
  return n;
}

/// Every rank's numbers combined: times of the slowest rank, rows and bytes summed.
rank_numbers combine(const std::vector<rank_numbers>& ranks) {
  rank_numbers c;
  for (const rank_numbers& q : ranks) {
    c.ms = std::max(c.ms, q.ms);
    c.comm_ms = std::max(c.comm_ms, q.comm_ms);
    c.experts_ms = std::max(c.experts_ms, q.experts_ms);
    c.link_bytes = std::max(c.link_bytes, q.link_bytes);
    for (int l = 0; l < 2; ++l) c.rows[l] += q.rows[l], c.bytes[l] += q.bytes[l];
  }
  return c;
}

void print_row(const shape& s, const char* link, const char* exchange, const rank_numbers& n) {
  std::printf("%-14s %-10s %-8s %10.0f %10.0f %9.2f %9.2f %9.2f %9.2f\n", s.name.c_str(), link,
              exchange, n.rows[1], n.rows[0], n.bytes[1] * 1e-6, n.bytes[0] * 1e-6, n.comm_ms,
              n.ms);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  cli::command_line cl(
      argc, argv,
#if defined(EPMOE_BENCH_MPI)
      "usage: mpiexec -n R epmoe_bench_hierarchical_mpi [--shapes all|tiny|NAME,...]\n"
      "  [--tokens T] [--per-node G] [--reps N] [--slow X]\n"
#else
      "usage: epmoe_bench_hierarchical [--shapes all|tiny|NAME,...] [--tokens T] [--ranks R]\n"
      "  [--per-node G] [--reps N] [--slow X]\n"
#endif
      "  Flat vs hierarchical dispatch on R ranks as R/G nodes of G (default 4 as 2 x 2), T\n"
      "  tokens per rank (default 64): rows and bytes per link class, time over the plain\n"
      "  comm and over a throttled two-class link whose inter-node part takes the flat\n"
      "  exchange X times the experts' time (default 4), the intra-node part 8x faster.\n");
  while (cl.next()) {
    if (cl.is("--shapes"))
      o.shapes = cl.value();
    else if (cl.is("--tokens"))
      o.tokens = std::max<index_t>(1, cl.integer());
    else if (cl.is("--ranks"))
      o.ranks = static_cast<int>(cl.integer());
    else if (cl.is("--per-node"))
      o.per_node = static_cast<int>(cl.integer());
    else if (cl.is("--reps"))
      o.reps = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--slow"))
      o.slow = cl.number();
    else
      cl.unknown();
  }
#if defined(EPMOE_BENCH_MPI)
  epmoe::comm::mpi_session session(argc, argv);
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  using Inner = epmoe::comm::mpi;
  const char* where = "MPI processes";
  // comm::mpi is move-only and its construction collective: a new one per layer. Every rank
  // gathers every rank's numbers (each calibrates the same throttled link from them).
  const auto each_rank = [&](auto fn) {
    const rank_numbers mine = fn([] { return epmoe::comm::mpi(MPI_COMM_WORLD); });
    std::vector<rank_numbers> all(static_cast<std::size_t>(R));
    MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, MPI_COMM_WORLD);
    return combine(all);
  };
#else
  const int R = o.ranks, me = 0;
  using Inner = epmoe::comm::threads;
  const char* where = "in-process threads";
  const auto each_rank = [&](auto fn) {
    std::vector<rank_numbers> all(static_cast<std::size_t>(R));
    epmoe::comm::threads_world world(R);
    world.run([&](epmoe::comm::threads c) { all[c.rank()] = fn([c] { return c; }); });
    return combine(all);
  };
#endif
  if (o.per_node < 1 || R % o.per_node != 0) cl.fail("--per-node must divide the ranks");
  if (!(o.slow > 0)) cl.fail("--slow must be > 0");
  set_blas_threads(1);  // ranks share the cores
  if (me == 0) {
    std::printf(
        "hierarchical dispatch: %d ranks (%s) as %d nodes x %d, %lld tokens per rank; CPU: %s; "
        "GEMM: %s\n"
        "rows and MB: dispatch sent, summed over ranks (the combine returns as many); ms: the "
        "slowest rank's median\n\n",
        R, where, R / o.per_node, o.per_node, static_cast<long long>(o.tokens), cpu_model().c_str(),
        epmoe::space::host_gemm_backend());
    std::printf("%-14s %-10s %-8s %10s %10s %9s %9s %9s %9s\n", "shape", "link", "dispatch",
                "inter rows", "intra rows", "inter MB", "intra MB", "comm ms", "layer ms");
  }
  for (const shape& s : parse_shapes(o.shapes)) {
    layer_config cfg = s.cfg;
    cfg.ranks = R;
    cfg.max_tokens = static_cast<int>(o.tokens);
    cfg.ranks_per_node = o.per_node;
    if (cfg.experts % R != 0) continue;
    const auto full = epmoe::reference::full_weights::random(cfg, 1);
    rank_numbers plain[2], slow[2];
    with_policies<Inner, true>(s, [&]<class P>(auto router) {
      for (int h = 0; h < 2; ++h)
        plain[h] = each_rank([&](auto make) {
          return h ? run_rank<two_level<P, true>>(s, cfg, router, make(), full, o.reps)
                   : run_rank<two_level<P, false>>(s, cfg, router, make(), full, o.reps);
        });
    });
    // The inter-node link moves the flat exchange's busiest NIC share twice (dispatch and
    // combine) in `slow` times the experts' time; inside a node, 8x faster.
    const double inter_bw = 2.0 * std::max(plain[0].link_bytes, 1.0) /
                            (o.slow * std::max(plain[0].experts_ms, 1e-3) * 1e-3);
    const epmoe::comm::node_links links{.intra = {.bandwidth = 8 * inter_bw, .latency = 5e-6},
                                        .inter = {.bandwidth = inter_bw, .latency = 20e-6},
                                        .ranks_per_node = o.per_node};
    using Slow = epmoe::comm::throttled<Inner>;
    with_policies<Slow, true>(s, [&]<class P>(auto router) {
      for (int h = 0; h < 2; ++h)
        slow[h] = each_rank([&](auto make) {
          return h ? run_rank<two_level<P, true>>(s, cfg, router, Slow(make(), links), full, o.reps)
                   : run_rank<two_level<P, false>>(s, cfg, router, Slow(make(), links), full,
                                                   o.reps);
        });
    });
    if (me != 0) continue;
    print_row(s, "plain", "flat", plain[0]);
    print_row(s, "plain", "2-level", plain[1]);
    print_row(s, "throttled", "flat", slow[0]);
    print_row(s, "throttled", "2-level", slow[1]);
    std::printf(
        "%-14s 2-level / flat: inter-node bytes %.2f, intra-node bytes %.2f; layer time %.2f "
        "plain, %.2f throttled (inter %.0f MB/s, intra %.0f MB/s)\n\n",
        s.name.c_str(), plain[1].bytes[1] / std::max(plain[0].bytes[1], 1.0),
        plain[1].bytes[0] / std::max(plain[0].bytes[0], 1.0), plain[1].ms / plain[0].ms,
        slow[1].ms / slow[0].ms, inter_bw * 1e-6, 8 * inter_bw * 1e-6);
    std::fflush(stdout);
  }
  return 0;
}
