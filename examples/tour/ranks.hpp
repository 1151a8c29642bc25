// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where the tour's ranks run: threads of this process (comm::threads), or, under mpiexec,
// the processes of MPI_COMM_WORLD (comm::mpi). A step hands `run` a body that takes the
// rank's communicator and returns that rank's numbers; every rank gets every rank's numbers
// back, so every rank computes the same result.
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include <epmoe/comm/threads.hpp>
#include <epmoe/core/view.hpp>
#include <epmoe/experiment.hpp>

#ifdef EPMOE_HAS_MPI
#include <epmoe/comm/mpi.hpp>
#endif

namespace epmoe::tour {

/// One rank's numbers, appended in an order its reader repeats.
struct numbers {
  std::vector<double> v;

  void put(double x) { v.push_back(x); }
  template <class Range>
  void put_all(const Range& r) {
    for (const auto& x : r) v.push_back(static_cast<double>(x));
  }
};

/// Reads a rank's numbers back in the order they were put.
struct reader {
  const std::vector<double>& v;
  std::size_t at = 0;

  double get() { return v.at(at++); }
  template <class T = double>
  std::vector<T> get(std::size_t n) {
    std::vector<T> out;
    for (std::size_t i = 0; i < n; ++i) out.push_back(static_cast<T>(get()));
    return out;
  }
};

/// The experiment's ranks (epmoe/experiment.hpp), with a body that returns `numbers`.
template <class Ranks>
struct ranks_of : Ranks {
  /// fn(comm_type) -> numbers on every rank; returns them all, [rank].
  template <class Fn>
  std::vector<std::vector<double>> run(Fn&& fn) const {
    return Ranks::run([&](typename Ranks::comm_type c) { return fn(std::move(c)).v; });
  }
};

/// R ranks as threads of this process.
struct thread_ranks : ranks_of<experiment::thread_ranks> {
  explicit thread_ranks(int r) { ranks = r; }
  bool prints() const { return true; }
};

#ifdef EPMOE_HAS_MPI
/// The processes of MPI_COMM_WORLD (the program holds an mpi_session).
struct mpi_ranks : ranks_of<experiment::mpi_ranks> {
  bool prints() const {  // rank 0 speaks for all
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r == 0;
  }
};
#endif

/// A second endpoint on the same ranks (collective), for a second layer: a threads comm is a
/// handle to its world; an MPI comm is duplicated.
inline comm::threads another(const comm::threads& c) { return c; }
#ifdef EPMOE_HAS_MPI
inline comm::mpi another(const comm::mpi& c) { return comm::mpi(c.native()); }
#endif

/// What a counting communicator saw: every exchange the layer asked for.
struct exchange_log {
  int counts_exchanges = 0;          // alltoall: the fixed-size exchange of row counts
  index_t counts_bytes = 0;          // to other ranks
  std::vector<index_t> row_bytes;    // one entry per alltoallv of rows: bytes to other ranks
  std::vector<index_t> other_bytes;  // alltoallv of anything else (dedup's metadata)

  void clear() { *this = {}; }
};

/// Any communicator, with every exchange logged (blocking or started): the tour's way to
/// count the all-to-alls of a pass without trusting the layer's own stats.
template <class Inner>
class counting {
 public:
  counting(Inner inner, exchange_log* log) : inner_(std::move(inner)), log_(log) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }

  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    ++log_->counts_exchanges;
    log_->counts_bytes += n * static_cast<index_t>(sizeof(T)) * (size() - 1);
    inner_.alltoall(send, recv, n);
  }

  template <class T>
  void alltoallv(const T* send, const index_t* sn, const index_t* sd, T* recv, const index_t* rn,
                 const index_t* rd) {
    log_rows<T>(sn);
    inner_.alltoallv(send, sn, sd, recv, rn, rd);
  }

  template <class T>
  auto ialltoallv(const T* send, const index_t* sn, const index_t* sd, T* recv, const index_t* rn,
                  const index_t* rd) {
    log_rows<T>(sn);
    return inner_.ialltoallv(send, sn, sd, recv, rn, rd);
  }

 private:
  template <class T>
  void log_rows(const index_t* send_counts) {
    index_t bytes = 0;
    for (int r = 0; r < size(); ++r)
      if (r != rank()) bytes += send_counts[r] * static_cast<index_t>(sizeof(T));
    (std::is_same_v<T, float> ? log_->row_bytes : log_->other_bytes).push_back(bytes);
  }

  Inner inner_;
  exchange_log* log_;
};

}  // namespace epmoe::tour
