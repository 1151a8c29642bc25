// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// comm::mpi's shared-memory windows (included by mpi.hpp): the low-latency exchange's puts.
// On one node MPI's shared-memory transport copies a message twice (into its FIFO, out of it)
// and makes a rendezvous per large message; a window lets a rank write its rows straight into
// a peer's slot, one copy, and meet the peers once (MPI_Ibarrier) per direction.

#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "epmoe/comm/mpi.hpp"

namespace epmoe::comm {

/// `bytes` of this rank's memory (zeroed) and the address of every rank's, in one MPI
/// shared-memory window (MPI_Win_allocate_shared, not contiguous across ranks so each rank's
/// part is local to it). Empty (no peers) when the ranks do not all share one node: the
/// caller then sends messages. Owns the MPI_Win: freed when destroyed (collective: every
/// rank destroys its layer), except after the comm failed (a timed-out or aborted peer may
/// never free its own, and a collective would wait for it): the memory then stays till exit.
/// Loads and stores reach it directly; the comm's barrier orders them (the fences are what
/// MPI_Win_sync does in the unified memory model, without its epoch).
class mpi::window {
 public:
  std::vector<std::byte*> peers;  // [rank]: that rank's memory

  window() = default;
  window(window&& o) noexcept
      : peers(std::move(o.peers)),
        win_(std::exchange(o.win_, MPI_WIN_NULL)),
        state_(std::move(o.state_)) {}
  window& operator=(window&& o) noexcept {
    if (this != &o) {
      release();
      peers = std::move(o.peers);
      win_ = std::exchange(o.win_, MPI_WIN_NULL);
      state_ = std::move(o.state_);
    }
    return *this;
  }
  window(const window&) = delete;
  window& operator=(const window&) = delete;
  ~window() { release(); }

 private:
  friend class mpi;
  void release() noexcept {
    if (win_ == MPI_WIN_NULL) return;
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized && state_ && state_->error.empty()) MPI_Win_free(&win_);
    win_ = MPI_WIN_NULL;
    peers.clear();
  }

  MPI_Win win_ = MPI_WIN_NULL;
  std::shared_ptr<const failure> state_;  // the comm's: broken, the free is skipped
};

/// See mpi::put(). Nothing to release: a write into a shared window needs no completion.
class mpi::put_guard {
 public:
  explicit put_guard(mpi& c) {
    c.usable();
    c.check_peers();
  }
  put_guard(const put_guard&) = delete;
  put_guard& operator=(const put_guard&) = delete;
};

inline mpi::window mpi::open_window(std::size_t bytes) {
  usable();
  // Every rank must reach every other's memory: the shared-memory split spans the comm on
  // every rank (EPMOE_RANKS_PER_NODE's pretended nodes do not count).
  MPI_Comm shared = MPI_COMM_NULL;
  detail::mpi_check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &shared),
                    "MPI_Comm_split_type");
  int n = 0;
  const int code = MPI_Comm_size(shared, &n);
  MPI_Comm_free(&shared);
  detail::mpi_check(code, "MPI_Comm_size");
  int all = n == size_ && windows_ ? 1 : 0;
  detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm_), "MPI_Allreduce");
  window w;
  if (!all) return w;
  MPI_Info info = MPI_INFO_NULL;
  detail::mpi_check(MPI_Info_create(&info), "MPI_Info_create");
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  const MPI_Aint size = static_cast<MPI_Aint>(std::max<std::size_t>(bytes, 1));
  const int made = MPI_Win_allocate_shared(size, 1, info, comm_, &base, &w.win_);
  MPI_Info_free(&info);
  detail::mpi_check(made, "MPI_Win_allocate_shared");
  w.state_ = state_;
  detail::mpi_check(MPI_Win_set_errhandler(w.win_, MPI_ERRORS_RETURN), "MPI_Win_set_errhandler");
  std::memset(base, 0, static_cast<std::size_t>(size));
  w.peers.resize(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    MPI_Aint at_size = 0;
    int unit = 0;
    void* at = nullptr;
    detail::mpi_check(MPI_Win_shared_query(w.win_, r, &at_size, &unit, &at),
                      "MPI_Win_shared_query");
    w.peers[static_cast<std::size_t>(r)] = static_cast<std::byte*>(at);
  }
  barrier();  // every rank zeroed its part before any writes into it
  return w;
}

inline mpi::put_guard mpi::put() { return put_guard(*this); }

inline void mpi::post_barrier() {
  usable();
  if (barrier_ != MPI_REQUEST_NULL)
    throw comm_error("epmoe: comm::mpi: a barrier is already posted: wait for it (wait_barrier)");
  std::atomic_thread_fence(std::memory_order_seq_cst);  // this rank's writes, then the meeting
  detail::mpi_check(MPI_Ibarrier(comm_, &barrier_), "MPI_Ibarrier");
}

inline void mpi::wait_barrier() {
  if (barrier_ == MPI_REQUEST_NULL) return;
  wait_for(barrier_, "MPI_Ibarrier");                   // (completed: MPI resets the request)
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the peers' writes, then the reads
}

inline void mpi::barrier() {
  post_barrier();
  wait_barrier();
}

}  // namespace epmoe::comm
