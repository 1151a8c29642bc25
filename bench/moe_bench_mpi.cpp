// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Expert-parallel scaling over MPI processes: a fixed number of global tokens split over the
// ranks, without and with per-rank dedup. Run it on 1 and on 2 ranks and compare:
//   mpiexec -n 1 epmoe_bench_mpi --json one.json
//   mpiexec -n 2 epmoe_bench_mpi --json two.json
// (bench/compare_torch.py --scaling does both, and 1 rank with --blas-threads 1.) Each rank's
// BLAS gets cpus / ranks threads unless --blas-threads says otherwise.
//
//   epmoe_bench_mpi [--shapes all|tiny|NAME,...] [--scaling-tokens 128,1024]
//                   [--scaling-reps N] [--batches N] [--blas-threads N] [--no-pack]
//                   [--json FILE|-]
#include "scaling.hpp"
#include <epmoe/comm/mpi.hpp>  // brings <mpi.h>

namespace {

using namespace bench;

struct options {
  std::string shapes = "all";
  std::vector<index_t> tokens = {128, 1024};
  int reps = 5;
  int batches = 4;
  int blas_threads = 0;  // per rank; 0: cpus / ranks
  bool pack = true;      // the layer packs its expert weights
  std::string json_path;
};

options parse(int argc, char** argv) {
  options o;
  cli::command_line cl(
      argc, argv,
      "usage: mpiexec -n R epmoe_bench_mpi [--shapes all|tiny|NAME,...]\n"
      "  [--scaling-tokens 128,1024] [--scaling-reps N] [--batches N] [--blas-threads N]\n"
      "  [--no-pack] [--json FILE|-]\n"
      "  Expert-parallel scaling over R MPI processes, without and with per-rank dedup.\n");
  while (cl.next()) {
    if (cl.is("--shapes"))
      o.shapes = cl.value();
    else if (cl.is("--scaling-tokens"))
      o.tokens = token_list(cl);
    else if (cl.is("--scaling-reps"))
      o.reps = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--batches"))
      o.batches = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--blas-threads"))
      o.blas_threads = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--no-pack"))
      o.pack = false;
    else if (cl.is("--json"))
      o.json_path = cl.value();
    else
      cl.unknown();
  }
  return o;
}

// Rank 0 gets every rank's pass times and row counts.
std::vector<rank_run> gather(const rank_run& mine, int R, int me) {
  const int n = static_cast<int>(mine.seconds.size());
  std::vector<double> times(static_cast<std::size_t>(n * R));
  long long counts[3] = {mine.rows_sent, mine.assignment_rows_sent, mine.dispatch_bytes};
  std::vector<long long> all_counts(static_cast<std::size_t>(3 * R));
  MPI_Gather(mine.seconds.data(), n, MPI_DOUBLE, times.data(), n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(counts, 3, MPI_LONG_LONG, all_counts.data(), 3, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  std::vector<rank_run> runs(static_cast<std::size_t>(R));
  if (me != 0) return runs;
  for (int r = 0; r < R; ++r) {
    runs[r].seconds.assign(times.begin() + r * n, times.begin() + (r + 1) * n);
    runs[r].rows_sent = all_counts[3 * r];
    runs[r].assignment_rows_sent = all_counts[3 * r + 1];
    runs[r].dispatch_bytes = all_counts[3 * r + 2];
  }
  runs[0].stages = mine.stages;
  return runs;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);  // before MPI starts: --help needs no mpiexec
  epmoe::comm::mpi_session session(argc, argv);
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  // The processes share the machine's cores: each rank's BLAS gets cpus / ranks threads.
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.blas_threads > 0 ? o.blas_threads : std::max(1, cpus / R);
  set_blas_threads(threads);
  std::FILE* out = o.json_path == "-" ? stderr : stdout;
  if (me == 0) {
    std::fprintf(out, "MPI scaling: %d ranks, %d BLAS threads per rank (BLAS core %s)\n", R,
                 threads, blas_core().c_str());
    print_scaling_header(out);
  }
  json arr = json::array();
  for (const shape& s : parse_shapes(o.shapes)) {
    if (s.cfg.experts % R != 0) continue;
    const auto full = epmoe::reference::full_weights::random(s.cfg, 1);
    for (index_t G : o.tokens) {
      if (G % R != 0) continue;
      for (bool dedup : {false, true}) {
        rank_run mine;
        const auto one = [&]<bool D>() {
          with_policies<epmoe::comm::mpi, D>(s, [&]<class P>(auto router) {
            mine = scaling_rank<P>(s, router, epmoe::comm::mpi(MPI_COMM_WORLD), full, G, o.reps,
                                   o.batches, o.pack);
          });
        };
        if (dedup)
          one.template operator()<true>();
        else
          one.template operator()<false>();
        const auto runs = gather(mine, R, me);
        if (me == 0) {
          print_scaling_row(out, s, "mpi", G, R, dedup, threads, runs);
          arr.push(scaling_json(s, "mpi", G, dedup, threads, runs));
        }
      }
    }
  }
  if (me == 0 && !o.json_path.empty()) {
    json root = json::object();
    root.add("program", "epmoe_bench_mpi").add("ranks", R).add("scaling", arr);
    write_text(o.json_path, root.str());
  }
  return 0;
}
