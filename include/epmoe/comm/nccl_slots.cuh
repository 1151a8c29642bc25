// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// comm::nccl's slots for the low-latency exchange (issue 38): two device buffers of R fixed
// slots each, the send side (0) and the receive side (1), in NCCL's memory (ncclMemAlloc), and
// one exchange that moves slot r of one side to rank r's other side. Two ways, chosen once:
//  - symmetric: when every rank can load and store every other's memory (NCCL's LSA team is
//    the whole communicator: one NVLink domain), both sides are NCCL windows
//    (ncclCommWindowRegister, NCCL 2.28's device API) and one kernel stores each slot straight
//    into the peer's side, then raises a flag there and waits for the peer's flag here. One
//    launch, no proxy, no staging copy: DeepEP's low-latency layout on NVLink.
//  - registered: otherwise (across nodes, or when the comm was built without them), both sides
//    are registered with the communicator (ncclCommRegister) and move by grouped
//    ncclSend/ncclRecv, which NCCL runs zero-copy where its transports can.
// Every rank agrees on the way (NCCL wants registered buffers on all ranks or none).
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstdint>
#include <cuda/atomic>
#include <memory>
#include <utility>
#include <vector>

#include "epmoe/comm/nccl.cuh"

namespace epmoe {
namespace cuda_kernels {

/// Block (peer, piece) stores its piece of this rank's slot for `peer` into the peer's side
/// `to`, raises the piece's flag there to `seq`, then waits until the peer raised the same flag
/// here (or the host's stop word is set: the comm aborted).
__global__ void store_slots(const char* from, ncclWindow_t to, std::size_t slot_bytes,
                            std::size_t flags_at, int me, int pieces, unsigned long long seq,
                            const volatile int* stop) {
  const int peer = static_cast<int>(blockIdx.x) / pieces, piece = blockIdx.x % pieces;
  const std::size_t chunk = ((slot_bytes + pieces - 1) / pieces + 15) / 16 * 16;
  const std::size_t begin = min(slot_bytes, piece * chunk);
  const std::size_t n = min(slot_bytes, begin + chunk) - begin;
  const char* src = from + peer * slot_bytes + begin;
  char* dst = static_cast<char*>(ncclGetPeerPointer(to, me * slot_bytes + begin, peer));
  const auto bits = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst);
  if (((bits | n) & 15) == 0) {  // 16 bytes a thread where both ends are aligned
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (std::size_t i = threadIdx.x; i < n / 16; i += blockDim.x) d[i] = s[i];
  } else {
    for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
  __syncthreads();  // (with thread 0's system fence: every thread's stores before the flag)
  if (threadIdx.x == 0) {
    using flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;
    const std::size_t mine = flags_at + sizeof(unsigned long long) * (me * pieces + piece);
    const std::size_t theirs = flags_at + sizeof(unsigned long long) * (peer * pieces + piece);
    __threadfence_system();
    flag(*static_cast<unsigned long long*>(ncclGetPeerPointer(to, mine, peer)))
        .store(seq, cuda::memory_order_release);
    flag here(*static_cast<unsigned long long*>(ncclGetLocalPointer(to, theirs)));
    while (here.load(cuda::memory_order_acquire) < seq && *stop == 0) __nanosleep(64);
  }
  __syncthreads();
}

}  // namespace cuda_kernels

namespace comm {

class nccl_slots {
 public:
  nccl_slots() = default;
  /// Collective: every rank opens its slots at once, with the same `bytes` per side.
  nccl_slots(nccl& c, std::size_t bytes, bool symmetric_wanted)
      : comm_(c.get()), me_(c.rank()), ranks_(c.size()), stop_(c.stop_word()) {
    const ncclTeam_t lsa = ncclTeamLsa(comm_);
    std::vector<int> mine(ranks_, symmetric_wanted && lsa.nRanks == ranks_ ? 1 : 0),
        all(mine.size());
    c.alltoall(mine.data(), all.data(), 1);
    symmetric_ = true;
    for (int v : all) symmetric_ = symmetric_ && v == 1;
    flags_at_ = (bytes + 127) / 128 * 128;
    const std::size_t total = flags_at_ + sizeof(unsigned long long) * ranks_ * max_pieces;
    host_ = pinned_buffer<char>(static_cast<index_t>(bytes));
    for (part& p : side_) {
      EPMOE_CUDA_CHECK(ncclMemAlloc(&p.ptr, total));
      EPMOE_CUDA_CHECK(cudaMemset(p.ptr, 0, total));  // (the flags start at 0)
      EPMOE_CUDA_CHECK(cudaDeviceSynchronize());      // ... before any peer can raise one
      if (symmetric_)
        EPMOE_CUDA_CHECK(
            ncclCommWindowRegister(comm_, p.ptr, total, &p.window, NCCL_WIN_COLL_SYMMETRIC));
      else
        EPMOE_CUDA_CHECK(ncclCommRegister(comm_, p.ptr, total, &p.handle));
    }
  }
  nccl_slots(nccl_slots&& o) noexcept { swap(o); }
  nccl_slots& operator=(nccl_slots&& o) noexcept {
    swap(o);
    return *this;
  }
  ~nccl_slots() {
    // After an abort the communicator is gone (and a late peer may still store here): the
    // memory is left to the process's end rather than freed under a peer's mapping.
    if (!comm_ || stop_->aborted) return;
    cudaDeviceSynchronize();  // (no store kernel may still run into memory being unmapped)
    for (part& p : side_) {
      if (p.window) ncclCommWindowDeregister(comm_, p.window);
      if (p.handle) ncclCommDeregister(comm_, p.handle);
      if (p.ptr) ncclMemFree(p.ptr);
    }
  }

  /// Side i's memory (0: send slots, 1: receive slots), and the receive side's host copy.
  template <class T>
  T* data(int i) const {
    return static_cast<T*>(side_[i].ptr);
  }
  template <class T>
  T* host() const {
    return reinterpret_cast<T*>(host_.data());
  }
  /// Whether the slots move by the store kernel (else by registered ncclSend/ncclRecv).
  bool symmetric() const { return symmetric_; }

  /// Slot r of side `from` (slot_bytes each) to rank r's other side, in this rank's slot there,
  /// on stream s; the work queued after it on s reads the other side whole.
  void alltoall(int from, std::size_t slot_bytes, cudaStream_t s, nccl& c) {
    const char* src = data<const char>(from);
    if (!symmetric_) return c.alltoall_device(src, data<char>(1 - from), slot_bytes, s);
    const int pieces = static_cast<int>(std::clamp<std::size_t>(slot_bytes >> 15, 1, max_pieces));
    cuda_kernels::store_slots<<<ranks_ * pieces, 256, 0, s>>>(src, side_[1 - from].window,
                                                              slot_bytes, flags_at_, me_, pieces,
                                                              ++seq_[1 - from], stop_->word());
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }
  /// Bytes [first, first + n) of the receive side to its host copy, on stream s.
  void to_host(std::size_t first, std::size_t n, cudaStream_t s) const {
    if (n > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(host_.data() + first, data<char>(1) + first, n,
                                       cudaMemcpyDeviceToHost, s));
  }

 private:
  static constexpr std::size_t max_pieces = 16;  // blocks per peer (32 KiB of a slot each)
  struct part {
    void* ptr = nullptr;
    ncclWindow_t window = nullptr;  // symmetric
    void* handle = nullptr;         // registered
  };
  void swap(nccl_slots& o) noexcept {
    std::swap(comm_, o.comm_), std::swap(me_, o.me_), std::swap(ranks_, o.ranks_);
    std::swap(stop_, o.stop_), std::swap(side_, o.side_), std::swap(host_, o.host_);
    std::swap(symmetric_, o.symmetric_), std::swap(flags_at_, o.flags_at_);
    std::swap(seq_, o.seq_);
  }

  ncclComm_t comm_ = nullptr;
  int me_ = 0, ranks_ = 1;
  std::shared_ptr<nccl::stop> stop_;  // the comm's abort, seen by the store kernel's waits
  part side_[2];
  pinned_buffer<char> host_;  // the receive side's heads, for the host
  bool symmetric_ = false;
  std::size_t flags_at_ = 0;            // the flags after the slots: [R][max_pieces] per side
  unsigned long long seq_[2] = {0, 0};  // per side: the flag value of its last exchange
};

inline nccl_slots nccl::open_slots(std::size_t bytes) {
  return nccl_slots(*this, bytes, symmetric_slots_);
}

}  // namespace comm
}  // namespace epmoe
