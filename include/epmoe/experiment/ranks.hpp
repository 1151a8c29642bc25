// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where an experiment's ranks run: threads of this process, or MPI processes.

#include <cstddef>
#include <utility>
#include <vector>

#include "epmoe/comm/threads.hpp"

#ifdef EPMOE_HAS_MPI
#include "epmoe/comm/mpi.hpp"
#endif

namespace epmoe::experiment {

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

}  // namespace epmoe::experiment
