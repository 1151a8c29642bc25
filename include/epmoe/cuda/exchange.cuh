// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// How the CUDA layer moves row blocks between ranks, per communicator:
// - comm::local (one GPU, one rank): device-to-device copies on the stream, no host sync
//   (capturable in a CUDA graph);
// - comm::threads and any other in-process host communicator: R ranks on one GPU, each with
//   its own stream and workspace; each rank pulls its blocks from its peers' buffers with
//   device-to-device copies (peers' buffer addresses are swapped once, at construction);
//   every exchange meets the peers twice (data ready; copies done), host-synchronised;
// - comm::nccl: grouped ncclSend/ncclRecv on the stream (epmoe/comm/nccl.cuh).
#include <cstdint>
#include <vector>

#include "epmoe/comm/local.hpp"
#include "epmoe/cuda/runtime.cuh"

namespace epmoe::cuda_detail {

/// A run of rows between this rank and `peer`: `local` and `remote` are the first row in
/// this rank's buffer and in the peer's buffer.
struct row_block {
  int peer = 0;
  index_t local = 0;
  index_t remote = 0;
  index_t rows = 0;
};

/// The buffers an exchange reads from (registered once, so peers can find them).
enum class exchange_source : int { send = 0, expert = 1 };

/// In-process ranks (comm::local, comm::threads, ...): pull copies through peer addresses.
template <class Comm>
class pull_exchange {
 public:
  /// Counts can be exchanged on the device (no host sync) only with one rank.
  static constexpr bool device_counts = std::is_same_v<Comm, comm::local>;
  /// A pull needs each block's offset in the peer's buffer.
  static constexpr bool needs_remote = true;

  pull_exchange() = default;
  pull_exchange(Comm* c, const void* send_buffer, const void* expert_buffer) : comm_(c) {
    const int R = c->size();
    base_.resize(static_cast<std::size_t>(2 * R));
    scratch_.resize(static_cast<std::size_t>(2 * R));
    const void* mine[2] = {send_buffer, expert_buffer};
    for (int k = 0; k < 2; ++k) {
      for (int r = 0; r < R; ++r)
        scratch_[r] = static_cast<index_t>(reinterpret_cast<std::uintptr_t>(mine[k]));
      c->alltoall(scratch_.data(), scratch_.data() + R, index_t{1});
      for (int r = 0; r < R; ++r) base_[k * R + r] = scratch_[R + r];
    }
  }

  /// Receives `recvs` (rows from each peer's `src` buffer) into dst; sends happen by the
  /// peers' pulls. W = elements per row.
  template <class T>
  void exchange(exchange_source src, const T*, const row_block*, int, T* dst,
                const row_block* recvs, int n_recvs, index_t W, cudaStream_t s) {
    const int R = comm_->size();
    if (R > 1) {  // data ready on every rank before anyone pulls
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      barrier();
    }
    for (int i = 0; i < n_recvs; ++i) {
      const row_block& b = recvs[i];
      if (b.rows == 0) continue;
      const T* from = reinterpret_cast<const T*>(
          static_cast<std::uintptr_t>(base_[static_cast<int>(src) * R + b.peer]));
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst + b.local * W, from + b.remote * W,
                                       static_cast<std::size_t>(b.rows * W) * sizeof(T),
                                       cudaMemcpyDeviceToDevice, s));
    }
    if (R > 1) {  // every pull done before anyone reuses its buffers
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      barrier();
    }
  }

  /// Counts: host values after the device->host copy the caller enqueued (h_send). With one
  /// rank, a device copy instead (no sync): d_recv = d_send.
  void counts(const index_t* d_send, index_t* d_recv, const index_t* h_send, index_t* h_recv,
              index_t n, cudaStream_t s) {
    if constexpr (device_counts) {
      EPMOE_CUDA_CHECK(
          cudaMemcpyAsync(d_recv, d_send, sizeof(index_t) * n, cudaMemcpyDeviceToDevice, s));
      EPMOE_CUDA_CHECK(
          cudaMemcpyAsync(h_recv, d_recv, sizeof(index_t) * n, cudaMemcpyDeviceToHost, s));
    } else {
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      comm_->alltoall(h_send, h_recv, n);
    }
  }

  /// Host arrays, n per peer (the remote offsets of the next exchanges).
  void host_alltoall(const index_t* send, index_t* recv, index_t n) {
    comm_->alltoall(send, recv, n);
  }

 private:
  void barrier() {
    const int R = comm_->size();
    comm_->alltoall(scratch_.data(), scratch_.data() + R, index_t{1});
  }

  Comm* comm_ = nullptr;
  std::vector<index_t> base_;     // [2][R] peers' buffer addresses
  std::vector<index_t> scratch_;  // [2R]
};

/// Which exchange engine a communicator uses on the device (NCCL specialises this).
template <class Comm>
struct device_exchange_for {
  using type = pull_exchange<Comm>;
};

}  // namespace epmoe::cuda_detail
