// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Transports of space::cuda for in-process ranks: comm::local (one GPU, one rank: a device
// copy, no host synchronisation, capturable) and comm::threads (R ranks on one GPU, each its
// own streams and workspace: the receiver copies its rows straight from the sender's buffer
// with device copies; every exchange synchronises the work stream before the ranks meet, so
// it is blocking). NCCL's is in comm/nccl.cuh.
#include <optional>
#include <utility>

#include "epmoe/comm/local.hpp"
#include "epmoe/comm/threads.hpp"
#include "epmoe/core/transport.hpp"
#include "epmoe/space/cuda/runtime.cuh"
#include "epmoe/space/cuda/space.cuh"

namespace epmoe {

template <class T>
class transport<comm::local, space::cuda<T>> {
 public:
  static constexpr bool async = false;
  using request = detail::done_request;
  transport() = default;
  transport(comm::local&, const space::cuda<T>& s) : stream_(s.stream()) {}

  template <class U>
  void alltoall(const U* send, U* recv, index_t n) {
    copy(recv, send, n);
  }
  template <class U>
  void start(std::optional<request>&, const U* send, const index_t* sn, const index_t* sd, U* recv,
             const index_t* rn, const index_t* rd) {
    if (sn[0] != rn[0])
      throw comm_error("epmoe: comm::local: send count " + std::to_string(sn[0]) +
                       " != receive count " + std::to_string(rn[0]));
    copy(recv + rd[0], send + sd[0], sn[0]);
  }
  double wait(std::optional<request>&) { return 0; }
  void progress(std::optional<request>&) {}

 private:
  template <class U>
  void copy(U* dst, const U* src, index_t n) {
    if (n > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(U) * static_cast<std::size_t>(n),
                                       cudaMemcpyDeviceToDevice, stream_));
  }
  cudaStream_t stream_ = nullptr;
};

template <class T>
class transport<comm::threads, space::cuda<T>> {
 public:
  static constexpr bool async = false;
  using request = detail::done_request;
  transport() = default;
  transport(comm::threads& c, const space::cuda<T>& s) : comm_(&c), stream_(s.stream()) {}

  template <class U>
  void alltoall(const U* send, U* recv, index_t n) {
    const int R = comm_->size();
    counts_.resize(static_cast<std::size_t>(2 * R));  // once: R does not change
    for (int r = 0; r < R; ++r) counts_[r] = n, counts_[R + r] = r * n;
    std::optional<request> none;
    start(none, send, counts_.data(), counts_.data() + R, recv, counts_.data(), counts_.data() + R);
  }
  template <class U>
  void start(std::optional<request>&, const U* send, const index_t* sn, const index_t* sd, U* recv,
             const index_t* rn, const index_t* rd) {
    // The rows must be in device memory before a peer copies them.
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    comm_->alltoallv_with(
        send, sn, sd, recv, rn, rd,
        [&](void* dst, const void* src, std::size_t bytes) {
          EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
        },
        [&] { EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); });
  }
  double wait(std::optional<request>&) { return 0; }
  void progress(std::optional<request>&) {}

 private:
  comm::threads* comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<index_t> counts_;
};

}  // namespace epmoe
