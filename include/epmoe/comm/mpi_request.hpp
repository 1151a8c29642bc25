// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// comm::mpi's pending exchanges (included by mpi.hpp): the request of an ialltoallv.

#include <cstddef>
#include <string>
#include <utility>

#include "epmoe/comm/mpi.hpp"

namespace epmoe::comm {

/// A pending ialltoallv. Move-only; wait() completes it (throws comm_error on failure),
/// test() says whether it has; the destructor waits for one still pending.
class mpi::request {
 public:
  request() = default;
  request(request&& o) noexcept
      : req_(std::exchange(o.req_, MPI_REQUEST_NULL)),
        busy_(std::exchange(o.busy_, nullptr)),
        comm_(o.comm_) {}
  request& operator=(request&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      req_ = std::exchange(o.req_, MPI_REQUEST_NULL);
      busy_ = std::exchange(o.busy_, nullptr);
      comm_ = o.comm_;
    }
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  // Buffers in use by MPI must not be freed under it: wait, but a destructor cannot throw.
  ~request() { finish_quietly(); }

  /// True while the exchange may still be running.
  bool pending() const { return busy_ != nullptr; }

  void wait() {
    if (!pending()) return;
    try {
      comm_->wait_for(req_, "MPI_Ialltoallv");
    } catch (...) {
      abandon();
      throw;
    }
    done();
  }

  bool test() {
    if (!pending()) return true;
    comm_->usable();
    int flag = 0;
    const int code = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) done();
    detail::mpi_check(code, "MPI_Test");
    if (flag) done();
    return flag != 0;
  }

 private:
  friend class mpi;
  request(MPI_Request req, unsigned char* busy, mpi* comm) : req_(req), busy_(busy), comm_(comm) {}

  void done() noexcept {
    *busy_ = 0;  // the slot's int counts may be reused
    busy_ = nullptr;
    req_ = MPI_REQUEST_NULL;
  }
  // A failed comm: the collective stays with MPI (it cannot be cancelled), never waited for.
  void abandon() noexcept {
    busy_ = nullptr;
    req_ = MPI_REQUEST_NULL;
  }
  void finish_quietly() noexcept {
    if (!pending()) return;
    if (comm_->broken()) return abandon();
    try {
      comm_->wait_for(req_, "MPI_Ialltoallv");
      done();
    } catch (...) {
      abandon();
    }
  }

  MPI_Request req_ = MPI_REQUEST_NULL;
  unsigned char* busy_ = nullptr;
  mpi* comm_ = nullptr;
};

template <class T>
mpi::request mpi::ialltoallv(const T* send, const index_t* send_counts, const index_t* send_displs,
                             T* recv, const index_t* recv_counts, const index_t* recv_displs,
                             exchange_level level) {
  std::size_t slot = 0;
  while (slot < busy_.size() && busy_[slot]) ++slot;
  if (slot == busy_.size())
    throw comm_error("epmoe: comm::mpi: more than " + std::to_string(busy_.size()) +
                     " ialltoallv pending; wait() for one, or construct comm::mpi with a "
                     "larger max_in_flight");
  // MPI reads the count arrays until the exchange completes: they live in the slot till then.
  usable();
  int* c = ints_.data() + 8 * static_cast<std::size_t>(size_) * (slot + 1);
  const detail::mpi_block_type<T> type(
      to_ints(send_counts, send_displs, recv_counts, recv_displs, c));
  int n = size_;
  const MPI_Comm on = at_level(level, c, n);
  MPI_Request req = MPI_REQUEST_NULL;
  detail::mpi_check(
      MPI_Ialltoallv(send, c, c + n, type.get(), recv, c + 2 * n, c + 3 * n, type.get(), on, &req),
      "MPI_Ialltoallv");
  busy_[slot] = 1;
  return request(req, &busy_[slot], this);
}

}  // namespace epmoe::comm
