// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <optional>
#include <utility>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/view.hpp"

// How a comm moves rows that live in a space's memory: the layer composes, a (comm, space)
// pair specialises (as CUTLASS specialises a collective per architecture). This primary
// template is the host's: the comm's own calls on host pointers. A device space brings its
// own specialisations (space/cuda/transport.cuh: NCCL, and in-process ranks on one GPU).
namespace epmoe {

/// Which ranks an exchange reaches (issue 24): all of them, or only this rank's node (the
/// second level of a hierarchical exchange), or only the ranks with its local index on the
/// other nodes (the first). A comm with a communicator per level (comm::mpi) posts there;
/// the others run it over all ranks, with zero counts outside the level.
enum class exchange_level : unsigned char { all, node, cross };

namespace detail {
/// The request of an exchange that completed when it started (a blocking transport).
struct done_request {
  void wait() {}
  bool test() { return true; }
};
template <class Comm, bool Async>
struct request_of {
  using type = done_request;
};
template <class Comm>
struct request_of<Comm, true> {
  using type = decltype(std::declval<Comm&>().ialltoallv(
      std::declval<const float*>(), std::declval<const index_t*>(), std::declval<const index_t*>(),
      std::declval<float*>(), std::declval<const index_t*>(), std::declval<const index_t*>()));
};
}  // namespace detail

template <class Comm, class Space>
class transport {
  static_assert(!device_space<Space>,
                "epmoe: no transport for this comm on this device space: use comm::nccl, "
                "comm::threads or comm::local with space::cuda (space/cuda/transport.cuh)");
  static_assert(host_communicator<Comm>,
                "epmoe: the comm policy must provide alltoallv(send, counts, displs, recv, "
                "counts, displs) for float and int64 elements to move rows in host memory (see "
                "comm/local.hpp)");

 public:
  /// Whether an exchange can be started and waited for later (the comm's ialltoallv); without
  /// it every exchange completes inside start() and a pipelined schedule has nothing to hide.
  static constexpr bool async = requires(Comm & c, const float* s, float* r, const index_t* n) {
    c.ialltoallv(s, n, n, r, n, n).wait();
  };
  using request = typename detail::request_of<Comm, async>::type;

  transport() = default;
  transport(Comm& comm, const Space&) : comm_(&comm) {}

  /// n elements to every rank (block r of send to rank r), in the space's memory.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    comm_->alltoall(send, recv, n);
  }

  /// Starts an all-to-all-v (counts and displacements per rank, in elements, host arrays
  /// that stay valid until wait()).
  template <class T>
  void start(std::optional<request>& req, const T* send, const index_t* sn, const index_t* sd,
             T* recv, const index_t* rn, const index_t* rd) {
    if constexpr (async)
      req.emplace(comm_->ialltoallv(send, sn, sd, recv, rn, rd));
    else
      comm_->alltoallv(send, sn, sd, recv, rn, rd);
  }
  /// The same within one level, on the comm's communicator of that level where it has one.
  template <class T>
  void start(std::optional<request>& req, const T* send, const index_t* sn, const index_t* sd,
             T* recv, const index_t* rn, const index_t* rd, exchange_level level) {
    if constexpr (async && requires { comm_->ialltoallv(send, sn, sd, recv, rn, rd, level); })
      req.emplace(comm_->ialltoallv(send, sn, sd, recv, rn, rd, level));
    else if constexpr (!async && requires { comm_->alltoallv(send, sn, sd, recv, rn, rd, level); })
      comm_->alltoallv(send, sn, sd, recv, rn, rd, level);
    else
      start(req, send, sn, sd, recv, rn, rd);
  }
  /// Completes it; returns the link model's time where the comm has one (comm::throttled),
  /// else 0.
  double wait(std::optional<request>& req) {
    if (!req) return 0;
    req->wait();
    double modeled = 0;
    if constexpr (requires { req->modeled_seconds(); }) modeled = req->modeled_seconds();
    req.reset();
    return modeled;
  }
  /// Lets the comm progress pending exchanges (MPI moves data inside its calls).
  void progress(std::optional<request>& req) {
    if (req) req->test();
  }

 private:
  Comm* comm_ = nullptr;
};

}  // namespace epmoe
