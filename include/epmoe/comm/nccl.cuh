// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// comm::nccl: ranks on GPUs, and its transport for space::cuda: rows move by grouped
// ncclSend/ncclRecv per peer on the space's comm stream, after an event from the work stream,
// and the work stream waits for an event after them, so a pipelined schedule's exchange of
// one chunk runs while another chunk's experts compute. The counts go on the work stream; in
// dynamic mode one device->host copy and one wait tell the host the receive sizes, in static
// mode (padded capacity) nothing waits and a pass can be captured in a CUDA graph.
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/transport.hpp"
#include "epmoe/space/cuda/runtime.cuh"
#include "epmoe/space/cuda/space.cuh"

namespace epmoe {
namespace cuda_detail {
inline void check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw cuda_error(call, r, "ncclResult", ncclGetErrorString(r));
}
}  // namespace cuda_detail

namespace comm {

/// One rank of a user-supplied NCCL communicator (the user creates and destroys it). `stream`
/// orders the few host-array exchanges (start-up agreement, router load); a pass's rows move
/// on the layer's own streams. The host never waits for NCCL blindly (issue 23): wait()
/// polls the stream, NCCL's asynchronous error (a peer that failed) and the deadline
/// (set_timeout), and on either aborts the communicator (ncclCommAbort: the user then must not
/// destroy it again) and throws comm_aborted or comm_timeout.
///
/// Nodes (issue 24): with `ranks_per_node` G > 0 the ranks are nodes of G consecutive ranks,
/// and the hierarchical exchange runs each of its levels on a communicator of its own, split
/// from `comm` here (ncclCommSplit): the node's G ranks, and the N = size / G ranks of the same
/// local index. The constructor is then collective (every rank constructs at once, with the
/// same G: agreed first, a differing or bad G throws config_error on every rank); the split
/// communicators live as long as the last copy of this comm::nccl.
///
/// Slots (issue 38): open_slots gives the low-latency exchange its fixed slots in NCCL's
/// memory, symmetric windows stored into by a kernel when every rank is in one NVLink domain
/// (unless `symmetric_slots` is false on some rank), else registered buffers (nccl_slots.cuh).
class nccl_slots;
class nccl {
 public:
  explicit nccl(ncclComm_t comm, cudaStream_t stream = nullptr, int ranks_per_node = 0,
                bool symmetric_slots = true)
      : comm_(comm), stream_(stream), symmetric_slots_(symmetric_slots) {
    EPMOE_CUDA_CHECK(ncclCommUserRank(comm, &rank_));
    EPMOE_CUDA_CHECK(ncclCommCount(comm, &size_));
    if (ranks_per_node != 0) split(ranks_per_node);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t get() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  /// G: consecutive ranks per node (0: not told).
  int ranks_per_node() const { return levels_ ? levels_->G : 0; }

  /// One level's communicator and where its ranks sit in this one: its rank i is this comm's
  /// rank first + i * stride.
  struct level_comm {
    ncclComm_t comm;
    int n, first, stride;
  };
  level_comm at(exchange_level level) const {
    if (level == exchange_level::all || !levels_) return {comm_, size_, 0, 1};
    const int G = levels_->G;
    const ncclComm_t c = level == exchange_level::node ? levels_->node : levels_->cross;
    if (!c)
      throw comm_aborted("epmoe: comm::nccl: rank " + std::to_string(rank_) +
                             ": an exchange on an aborted node or cross-node communicator",
                         -1);
    if (level == exchange_level::node) return {c, G, rank_ / G * G, 1};
    return {c, size_ / G, rank_ % G, G};
  }

  /// Host arrays, n elements to every rank (start-up agreement, router load): staged
  /// through device memory, synchronous. Not used by a forward pass's rows.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(n) * size_;
    if (!staging_ || staging_->size() < static_cast<index_t>(2 * bytes))
      staging_ = std::make_shared<device_buffer<char>>(static_cast<index_t>(2 * bytes));
    char* d = staging_->data();
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(d, send, bytes, cudaMemcpyHostToDevice, stream_));
    alltoall_device(d, d + bytes, sizeof(T) * n, stream_);
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(recv, d + bytes, bytes, cudaMemcpyDeviceToHost, stream_));
    wait(stream_, "a host all-to-all");
  }

  /// Host arrays, all-to-all-v (counts and displacements in elements): staged through device
  /// memory, synchronous. For the rare exchanges of host data (live re-placement's weights).
  template <class T>
  void alltoallv(const T* send, const index_t* sn, const index_t* sd, T* recv, const index_t* rn,
                 const index_t* rd) {
    index_t out = 0, in = 0;
    for (int r = 0; r < size_; ++r) {
      out = std::max(out, sd[r] + sn[r]);
      in = std::max(in, rd[r] + rn[r]);
    }
    const std::size_t e = sizeof(T), bytes = e * static_cast<std::size_t>(out + in);
    if (!staging_ || staging_->size() < static_cast<index_t>(bytes))
      staging_ = std::make_shared<device_buffer<char>>(static_cast<index_t>(bytes));
    char* d_send = staging_->data();
    char* d_recv = d_send + e * out;
    if (out > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(d_send, send, e * out, cudaMemcpyHostToDevice, stream_));
    EPMOE_CUDA_CHECK(ncclGroupStart());
    for (int r = 0; r < size_; ++r) {
      if (sn[r] > 0)
        EPMOE_CUDA_CHECK(ncclSend(d_send + e * sd[r], e * sn[r], ncclInt8, r, comm_, stream_));
      if (rn[r] > 0)
        EPMOE_CUDA_CHECK(ncclRecv(d_recv + e * rd[r], e * rn[r], ncclInt8, r, comm_, stream_));
    }
    EPMOE_CUDA_CHECK(ncclGroupEnd());
    if (in > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(recv, d_recv, e * in, cudaMemcpyDeviceToHost, stream_));
    wait(stream_, "a host all-to-all-v");
  }

  /// Seconds a host wait for NCCL work may take (0: no limit); the layer sets its config's
  /// exchange_timeout.
  void set_timeout(double seconds) {
    if (!(seconds >= 0) || seconds > 1e9)
      throw config_error("exchange_timeout", std::to_string(seconds),
                         "must be >= 0 seconds (0: no limit) and finite");
    timeout_ = seconds;
  }
  /// This rank failed mid-pass: aborts the communicator, so that NCCL reports an error to the
  /// peers' waits instead of leaving their kernels waiting for this rank's rows.
  void abort(const std::string& /*why*/) {
    if (std::exchange(aborted_, true)) return;
    stop_->raise();  // (a slots kernel waiting for a peer's flag stops)
    ncclCommAbort(comm_);
    if (levels_) {  // a peer may wait on a level's communicator
      ncclComm_t* on[2] = {&levels_->node, &levels_->cross};
      for (ncclComm_t* c : on)
        if (*c) ncclCommAbort(std::exchange(*c, nullptr));
    }
  }

  /// Waits for stream s (what: the work, for the message) like cudaStreamSynchronize, but
  /// watching NCCL's asynchronous error and the deadline: on either, aborts the communicator
  /// and throws.
  void wait(cudaStream_t s, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) EPMOE_CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      if (!aborted_) async = async_error();
      if (aborted_ || (async != ncclSuccess && async != ncclInProgress)) {
        abort("");
        throw comm_aborted("epmoe: comm::nccl: rank " + std::to_string(rank_) + ": waiting for " +
                               what + ", NCCL reports " +
                               (async == ncclSuccess ? std::string("this communicator aborted")
                                                     : ncclGetErrorString(async)) +
                               ": a peer rank failed; the communicator is aborted",
                           -1);
      }
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_ > 0 && waited > timeout_) {
        abort("");
        throw comm_timeout("epmoe: comm::nccl: rank " + std::to_string(rank_) + ": " + what +
                           " did not complete within " + std::to_string(timeout_) +
                           " s (exchange_timeout): a peer rank stalled or died; the "
                           "communicator is aborted, end the job");
      }
      if (i > 256) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  /// Device arrays: `bytes` to every rank, block r of send to rank r.
  void alltoall_device(const void* send, void* recv, std::size_t bytes, cudaStream_t s) {
    EPMOE_CUDA_CHECK(ncclGroupStart());
    for (int r = 0; r < size_; ++r) {
      EPMOE_CUDA_CHECK(
          ncclSend(static_cast<const char*>(send) + r * bytes, bytes, ncclInt8, r, comm_, s));
      EPMOE_CUDA_CHECK(
          ncclRecv(static_cast<char*>(recv) + r * bytes, bytes, ncclInt8, r, comm_, s));
    }
    EPMOE_CUDA_CHECK(ncclGroupEnd());
  }

  /// Collective: the low-latency exchange's two sides of `bytes` each (nccl_slots.cuh).
  nccl_slots open_slots(std::size_t bytes);

  /// Set when this comm aborts: a word in pinned host memory that the slots kernel polls while
  /// it waits for a peer, shared by the copies of this comm and the slots opened on it.
  struct stop {
    bool aborted = false;
    pinned_buffer<int> host{1};
    void raise() {
      aborted = true;
      *static_cast<volatile int*>(host.data()) = 1;
    }
    const volatile int* word() const { return host.data(); }
  };
  const std::shared_ptr<stop>& stop_word() const { return stop_; }

 private:
  // The levels' communicators, shared by the copies; destroyed with the last one (or aborted).
  struct levels {
    int G = 0;
    ncclComm_t node = nullptr, cross = nullptr;
    levels() = default;
    levels(const levels&) = delete;
    levels& operator=(const levels&) = delete;
    ~levels() {
      if (node) ncclCommDestroy(node);
      if (cross) ncclCommDestroy(cross);
    }
  };

  // Agrees on G over the whole communicator, then splits the two levels' communicators.
  void split(int G) {
    std::vector<int> mine(static_cast<std::size_t>(size_), G), all(mine.size());
    alltoall(mine.data(), all.data(), 1);
    for (int r = 0; r < size_; ++r)
      if (all[r] != G)
        throw config_error("ranks_per_node", std::to_string(G),
                           "must be the same on every rank of comm::nccl (rank " +
                               std::to_string(r) + " passed " + std::to_string(all[r]) + ")");
    if (G < 0 || G > size_ || size_ % G != 0)
      throw config_error(
          "ranks_per_node", std::to_string(G),
          "must be 0 (no nodes) or divide the communicator's " + std::to_string(size_) + " ranks");
    auto l = std::make_shared<levels>();
    l->G = G;
    EPMOE_CUDA_CHECK(ncclCommSplit(comm_, rank_ / G, rank_ % G, &l->node, nullptr));
    EPMOE_CUDA_CHECK(ncclCommSplit(comm_, rank_ % G, rank_ / G, &l->cross, nullptr));
    levels_ = std::move(l);
  }

  // NCCL's asynchronous error of this communicator or of a level's.
  ncclResult_t async_error() const {
    ncclResult_t e = ncclSuccess;
    cuda_detail::check(ncclCommGetAsyncError(comm_, &e), "ncclCommGetAsyncError");
    if (!levels_) return e;
    const ncclComm_t on[2] = {levels_->node, levels_->cross};
    for (ncclComm_t c : on)
      if (c && (e == ncclSuccess || e == ncclInProgress))
        cuda_detail::check(ncclCommGetAsyncError(c, &e), "ncclCommGetAsyncError");
    return e;
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, size_ = 1;
  double timeout_ = 0;
  bool aborted_ = false;
  bool symmetric_slots_ = true;
  std::shared_ptr<stop> stop_ = std::make_shared<stop>();
  std::shared_ptr<device_buffer<char>> staging_;  // grows on first host alltoall
  std::shared_ptr<levels> levels_;                // with nodes: the levels' communicators
};

}  // namespace comm

template <class T>
class transport<comm::nccl, space::cuda<T>> {
 public:
  static constexpr bool async = true;
  /// A started exchange: the event after its sends and receives on the comm stream.
  struct request {
    cudaEvent_t done = nullptr;
  };

  transport() = default;
  transport(comm::nccl& c, const space::cuda<T>& s)
      : comm_(&c), work_(s.stream()), side_(s.comm_stream()), events_(std::make_shared<ring>()) {}

  /// Device arrays on the work stream: n elements to every rank.
  template <class U>
  void alltoall(const U* send, U* recv, index_t n) {
    comm_->alltoall_device(send, recv, sizeof(U) * static_cast<std::size_t>(n), work_);
  }
  /// Counts and displacements per rank of the whole communicator; a level's exchange (the
  /// hierarchical one's) has counts only for that level's ranks and runs on its communicator.
  template <class U>
  void start(std::optional<request>& req, const U* send, const index_t* sn, const index_t* sd,
             U* recv, const index_t* rn, const index_t* rd,
             exchange_level level = exchange_level::all) {
    const comm::nccl::level_comm on = comm_->at(level);
    cudaEvent_t ready = events_->next(), done = events_->next();
    EPMOE_CUDA_CHECK(cudaEventRecord(ready, work_));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side_, ready));
    const std::size_t e = sizeof(U);
    EPMOE_CUDA_CHECK(ncclGroupStart());
    for (int i = 0; i < on.n; ++i) {
      const int r = on.first + i * on.stride;
      if (sn[r] > 0)
        EPMOE_CUDA_CHECK(ncclSend(send + sd[r], e * sn[r], ncclInt8, i, on.comm, side_));
      if (rn[r] > 0)
        EPMOE_CUDA_CHECK(ncclRecv(recv + rd[r], e * rn[r], ncclInt8, i, on.comm, side_));
    }
    EPMOE_CUDA_CHECK(ncclGroupEnd());
    EPMOE_CUDA_CHECK(cudaEventRecord(done, side_));
    req.emplace(request{done});
  }
  /// The work stream waits for the exchange (the host does not).
  double wait(std::optional<request>& req) {
    if (req) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(work_, req->done));
    req.reset();
    return 0;
  }
  void progress(std::optional<request>&) {}
  /// The host's wait for the space's work (the counts exchange): polled, with NCCL's errors
  /// and the deadline (comm::nccl::wait).
  void synchronize(const space::cuda<T>&) const { comm_->wait(work_, "the counts exchange"); }

 private:
  // Events for the exchanges in flight, reused round-robin (a schedule keeps a few in flight).
  struct ring {
    ring() {
      for (cudaEvent_t& e : events)
        EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    ring(const ring&) = delete;
    ring& operator=(const ring&) = delete;
    ~ring() {
      for (cudaEvent_t e : events) cudaEventDestroy(e);
    }
    cudaEvent_t next() { return events[i++ % events.size()]; }
    std::array<cudaEvent_t, 64> events{};
    std::size_t i = 0;
  };
  comm::nccl* comm_ = nullptr;
  cudaStream_t work_ = nullptr, side_ = nullptr;
  std::shared_ptr<ring> events_;
};

}  // namespace epmoe

#include "epmoe/comm/nccl_slots.cuh"
