// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// comm::nccl: ranks on GPUs, rows moved by grouped ncclSend/ncclRecv on the stream.
// Dynamic mode: each rank's counts go to its peers on the device, then one device->host
// copy (and one stream synchronisation per pass) tells the host the receive sizes that the
// row exchanges and the grouped GEMM need. Static mode (capacity::factor<true>: every block
// padded to the capacity): every size is known in advance, nothing waits on the host, and a
// whole forward pass can be captured in a CUDA graph.
#include <nccl.h>

#include <memory>
#include <string>

#include "epmoe/core/error.hpp"
#include "epmoe/cuda/exchange.cuh"
#include "epmoe/cuda/runtime.cuh"

namespace epmoe {
namespace cuda_detail {
inline void check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw cuda_error(call, r, "ncclResult", ncclGetErrorString(r));
}
}  // namespace cuda_detail

namespace comm {

/// One rank of a user-supplied NCCL communicator (the user creates and destroys it), with
/// the stream NCCL work is ordered on (the layer's stream unless its space names another).
class nccl {
 public:
  nccl(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {
    EPMOE_CUDA_CHECK(ncclCommUserRank(comm, &rank_));
    EPMOE_CUDA_CHECK(ncclCommCount(comm, &size_));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t get() const { return comm_; }
  cudaStream_t stream() const { return stream_; }

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
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
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

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<device_buffer<char>> staging_;  // grows on first host alltoall
};

}  // namespace comm

namespace cuda_detail {

/// NCCL's engine: every block a grouped send or receive; counts exchanged on the device.
class nccl_exchange {
 public:
  static constexpr bool device_counts = true;
  static constexpr bool needs_remote = false;  // sends and receives pair up in order

  nccl_exchange() = default;
  nccl_exchange(comm::nccl* c, const void*, const void*) : comm_(c) {}

  template <class T>
  void exchange(exchange_source, const T* src, const row_block* sends, int n_sends, T* dst,
                const row_block* recvs, int n_recvs, index_t W, cudaStream_t s) {
    const std::size_t row = sizeof(T) * static_cast<std::size_t>(W);
    EPMOE_CUDA_CHECK(ncclGroupStart());
    for (int i = 0; i < n_sends; ++i)
      if (sends[i].rows > 0)
        EPMOE_CUDA_CHECK(ncclSend(src + sends[i].local * W, row * sends[i].rows, ncclInt8,
                                  sends[i].peer, comm_->get(), s));
    for (int i = 0; i < n_recvs; ++i)
      if (recvs[i].rows > 0)
        EPMOE_CUDA_CHECK(ncclRecv(dst + recvs[i].local * W, row * recvs[i].rows, ncclInt8,
                                  recvs[i].peer, comm_->get(), s));
    EPMOE_CUDA_CHECK(ncclGroupEnd());
  }

  /// Counts on the device, then one copy of what arrived to the host (no sync here).
  void counts(const index_t* d_send, index_t* d_recv, const index_t*, index_t* h_recv, index_t n,
              cudaStream_t s) {
    comm_->alltoall_device(d_send, d_recv, sizeof(index_t) * n, s);
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h_recv, d_recv, sizeof(index_t) * n * comm_->size(),
                                     cudaMemcpyDeviceToHost, s));
  }

  void host_alltoall(const index_t* send, index_t* recv, index_t n) {
    comm_->alltoall(send, recv, n);
  }

 private:
  comm::nccl* comm_ = nullptr;
};

template <>
struct device_exchange_for<comm::nccl> {
  using type = nccl_exchange;
};

}  // namespace cuda_detail
}  // namespace epmoe
