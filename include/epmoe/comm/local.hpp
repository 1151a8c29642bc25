// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::comm {

/// One rank: every exchange is a local copy. The default for a single process.
struct local {
  /// A non-blocking exchange here is complete at once.
  struct request {
    void wait() {}
    bool test() { return true; }
  };

  int rank() const { return 0; }
  int size() const { return 1; }

  /// Fixed-size all-to-all: n elements to (and from) every rank.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    std::copy_n(send, n, recv);
  }

  /// All-to-all-v; counts and displacements per rank, in elements.
  template <class T>
  void alltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                 const index_t* recv_counts, const index_t* recv_displs) {
    if (send_counts[0] != recv_counts[0])
      throw comm_error("epmoe: comm::local: send count " + std::to_string(send_counts[0]) +
                       " != receive count " + std::to_string(recv_counts[0]));
    std::copy_n(send + send_displs[0], send_counts[0], recv + recv_displs[0]);
  }

  template <class T>
  request ialltoallv(const T* send, const index_t* send_counts, const index_t* send_displs, T* recv,
                     const index_t* recv_counts, const index_t* recv_displs) {
    alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    return {};
  }
};

}  // namespace epmoe::comm
