// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// epmoe over MPI: one process per expert-parallel rank, two experts per rank, top-2.
//   mpiexec -n 4 build/default/examples/epmoe_mpi_example
// Each rank passes a different number of tokens; rank 0 prints what every rank sent,
// received and computed, the load imbalance, and the error against the reference forward
// pass (each rank checks its own tokens, and rank 0 reports the worst).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "args.hpp"
#include <epmoe/comm/mpi.hpp>  // brings <mpi.h>
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>

using namespace epmoe;

struct policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::mpi;  // ranks are the processes of an MPI communicator
};

// The same layer with per-rank dedup: one row per (token, destination rank).
struct dedup_policies : policies {
  static constexpr epmoe::layer_options options{.dedup = true};
};

// Two passes (the first is warm-up) of moe_layer<P>; returns the stats of the second.
template <class P>
pass_stats run(const layer_config& cfg, const reference::full_weights& full,
               const reference::rank_weights& mine, const std::vector<float>& x,
               std::vector<float>& y, index_t T) {
  moe_layer<P> layer(cfg, comm::mpi(MPI_COMM_WORLD), {full.gate_view(), mine.experts()});
  for (int pass = 0; pass < 2; ++pass)
    layer.forward({x.data(), T, cfg.hidden}, {y.data(), T, cfg.hidden});
  return layer.stats();
}  // the layer frees its MPI communicator here, before the session finalizes MPI

int main(int argc, char** argv) {
  cli::no_arguments(argc, argv,  // before MPI starts: --help needs no mpiexec
                    "usage: mpiexec -n R epmoe_mpi_example\n"
                    "  The layer on R MPI processes, two experts each, top-2: the rows and\n"
                    "  bytes each rank sent and received, the imbalance, and the error against\n"
                    "  the reference forward pass. No arguments.\n");
  comm::mpi_session session(argc, argv);  // MPI_Init_thread ... MPI_Finalize
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);

  const layer_config cfg{
      .hidden = 256, .ffn = 896, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 256};
  const index_t H = cfg.hidden;
  // Uneven batches (256 tokens on rank 0, fewer on each later rank, always over 128).
  const index_t T = cfg.max_tokens - (cfg.max_tokens / 2 * me) / R;
  // Every rank draws the same weights from one seed and keeps its own experts; a real model
  // would load only those.
  const auto full = reference::full_weights::random(cfg, 2026);
  const auto mine = reference::slice(full, placement::block(cfg), me);
  const auto x = reference::random_tokens(T, H, 100 + static_cast<std::uint64_t>(me));
  // NaN until the layer writes them: a row it skipped shows up as an infinite error below.
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> y_dedup(y);
  const pass_stats s = run<policies>(cfg, full, mine, x, y, T);
  const pass_stats sd = run<dedup_policies>(cfg, full, mine, x, y_dedup, T);

  // This rank's row of the table; rank 0 gathers them all.
  constexpr int kCols = 9;
  index_t rows_out = 0, rows_in = 0, computed = 0, dedup_out = 0;
  for (int r = 0; r < R; ++r)
    if (r != me) {
      rows_out += s.rows_sent[r];
      rows_in += s.rows_received[r];
      dedup_out += sd.rows_sent[r];
    }
  for (index_t n : s.rows_per_local_expert) computed += n;
  const index_t row[kCols] = {s.tokens,
                              rows_out,
                              rows_in,
                              s.dispatch_bytes_sent,
                              s.dispatch_bytes_received,
                              computed,
                              static_cast<index_t>(s.time.total * 1e6),
                              dedup_out,
                              sd.dispatch_bytes_sent};
  std::vector<index_t> table(me == 0 ? kCols * R : 0);
  MPI_Gather(row, kCols, MPI_INT64_T, table.data(), kCols, MPI_INT64_T, 0, MPI_COMM_WORLD);

  // The reference for this rank's tokens alone (dropless: no other rank's tokens matter).
  std::vector<float> want(y.size());
  const index_t counts[] = {T};
  reference::forward(full, policies::router{}, policies::capacity{}, {x.data(), T, H}, counts,
                     {want.data(), T, H});
  // max |y - want| / max |want| on this rank's tokens, infinite on any NaN/Inf; the worst rank.
  const double mine_err = std::max(reference::max_relative_error(y, want),
                                   reference::max_relative_error(y_dedup, want));
  double rel = 0;
  MPI_Allreduce(&mine_err, &rel, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

  if (me == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    std::printf("epmoe over MPI: %d ranks, %d experts (2 per rank), top-%d, H=%d F=%d\n", R,
                cfg.experts, cfg.top_k, cfg.hidden, cfg.ffn);
    std::printf("MPI: %.*s\n\n",
                static_cast<int>(std::find(version, version + len, '\n') - version), version);
    std::printf(
        "Dispatch, second pass (rows and bytes to / from other ranks), and with "
        "per-rank dedup:\n");
    std::printf(
        "  rank  tokens  rows sent  rows recv   bytes sent   bytes recv  rows computed"
        "  pass ms | dedup: rows sent   bytes sent\n");
    index_t busiest = 0, total = 0;
    for (int r = 0; r < R; ++r) {
      const index_t* t = &table[kCols * r];
      std::printf("  %4d %7lld %10lld %10lld %12lld %12lld %14lld %8.2f | %16lld %12lld\n", r,
                  static_cast<long long>(t[0]), static_cast<long long>(t[1]),
                  static_cast<long long>(t[2]), static_cast<long long>(t[3]),
                  static_cast<long long>(t[4]), static_cast<long long>(t[5]), t[6] / 1e3,
                  static_cast<long long>(t[7]), static_cast<long long>(t[8]));
      busiest = std::max(busiest, t[5]);
      total += t[5];
    }
    std::printf("\nImbalance (rows computed, max/mean over ranks): %.2f (1.00 = balanced)\n",
                busiest / std::max(static_cast<double>(total) / R, 1.0));
    std::printf("Max relative error vs the reference forward pass (worst rank): %.2e: %s\n", rel,
                rel <= 1e-4 ? "OK" : "FAILED");
  }
  return rel <= 1e-4 ? 0 : 1;
}
