// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The simulator against a real layer on MPI processes (issue 9): calibrates the MPI exchange,
// host GEMMs, route and copies on these ranks (sim::measure), runs the real moe_layer (block,
// dropless, sequential, comm::mpi) on a source's exact routing and prints predicted vs
// measured per stage (best calibration and best pass over rounds of both), as
// `epmoe_simulate --validate` does on comm::threads.
//   mpiexec -n 2 epmoe_sim_validate_mpi [--tokens 256] [--hidden 512] [--ffn 1024]
//       [--experts 8] [--top-k 2] [--skew 0] [--shared 0] [--passes 5] [--rounds 11] [--seed 1]
//       [--max-recv-rows 0]
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../../examples/args.hpp"
#include "../../examples/process.hpp"
#include <epmoe/comm/mpi.hpp>  // brings <mpi.h>
#include <epmoe/sim/source.hpp>
#include <epmoe/sim/validate.hpp>

using namespace epmoe;

int main(int argc, char** argv) try {
  int T = 256, H = 512, F = 1024, E = 8, K = 2, shared = 0, passes = 5, rounds = 11, bound = 0;
  double skew = 0;
  std::uint64_t seed = 1;
  cli::command_line cl(
      argc, argv,
      "usage: mpiexec -n R epmoe_sim_validate_mpi [--tokens 256] [--hidden 512] [--ffn 1024]\n"
      "  [--experts 8] [--top-k 2] [--skew 0] [--shared 0] [--passes 5] [--rounds 11]\n"
      "  [--seed 1] [--max-recv-rows 0]\n"
      "  The simulator's predicted per-stage times against a real layer on R MPI processes.\n");
  while (cl.next()) {  // before MPI starts: --help needs no mpiexec
    int* field = cl.is("--tokens")          ? &T
                 : cl.is("--hidden")        ? &H
                 : cl.is("--ffn")           ? &F
                 : cl.is("--experts")       ? &E
                 : cl.is("--top-k")         ? &K
                 : cl.is("--shared")        ? &shared
                 : cl.is("--passes")        ? &passes
                 : cl.is("--rounds")        ? &rounds
                 : cl.is("--max-recv-rows") ? &bound
                                            : nullptr;
    if (field)
      *field = static_cast<int>(cl.integer());
    else if (cl.is("--skew"))
      skew = cl.number();
    else if (cl.is("--seed"))
      seed = static_cast<std::uint64_t>(cl.integer());
    else
      cl.unknown();
  }
  comm::mpi_session session(argc, argv);
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  const layer_config cfg{.hidden = H,
                         .ffn = F,
                         .experts = E,
                         .top_k = K,
                         .ranks = R,
                         .max_tokens = T,
                         .shared_experts = shared,
                         .max_recv_rows = bound};
  const auto src = skew > 0 ? sim::zipf(E, skew, K, T, seed) : sim::uniform(E, K, T, seed);
  comm::mpi c(MPI_COMM_WORLD);
  programs::map_large_buffers_fresh();
  const int blas = sim::share_blas_threads(R);
  const auto w = sim::hand_gate_weights(cfg);
  const auto rounds_out = sim::run_rounds(
      c, [] { return comm::mpi(MPI_COMM_WORLD); }, cfg, w, src, passes, rounds);
  if (me == 0) {
    std::vector<sim::calibration> cals;
    for (const auto& r : rounds_out) cals.push_back(r.cal);
    const auto o = sim::options_for(cfg, T);
    sim::print_calibration(
        stdout, sim::median_of(cals, o, R), o, R,
        ("MPI processes, comm::mpi, median of " + std::to_string(rounds) + " rounds").c_str());
    const auto s = sim::simulate<sim::policies<>>(cfg, cals[0].topo, src);
    std::printf(
        "validation: real moe_layer (block, dropless, sequential) on %d MPI ranks, H=%d F=%d "
        "E=%d top-%d T=%d, %d shared, max_recv_rows %d, %s %.2f; %d rounds of (calibrate, %d "
        "passes), each round's best pass; %d BLAS thread(s) per rank; sim rows/rank max/mean "
        "%.2f\n",
        R, H, F, E, K, T, shared, bound, skew > 0 ? "Zipf" : "uniform", skew, rounds, passes, blas,
        s.rows_imbalance.max_over_mean);
    sim::print_validation(stdout, sim::compare_rounds(cfg, src, rounds_out, "calibrated_mpi"));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "epmoe_sim_validate_mpi: %s\n", e.what());
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}
