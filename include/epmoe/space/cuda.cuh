// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The CUDA execution space: memory is device memory (cudaMalloc), loops are kernels on the
// rank's stream, GEMMs are cuBLAS. `T` is the element type of activations and weights
// (float, __nv_bfloat16, __half); routing, accumulation and the SwiGLU gate stay fp32.
// A layer whose policies name space::cuda<T> is the CUDA specialization of moe_layer
// (epmoe/cuda/moe_layer.cuh); the per-token math it runs is the host's EPMOE_HD code.
#include <concepts>
#include <type_traits>

#include "epmoe/cuda/runtime.cuh"

namespace epmoe::space {

namespace cuda_detail {
template <class F>
__global__ void for_each_kernel(index_t n, F f) {
  const index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) f(i);
}
}  // namespace cuda_detail

template <class T = float>
struct cuda {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> ||
                    std::is_same_v<T, __half>,
                "epmoe: space::cuda<T> takes float, __nv_bfloat16 or __half");
  using value_type = T;
  static constexpr bool device = true;
  template <class U>
  using buffer = device_buffer<U>;

  /// The rank's stream. nullptr: the layer creates (and owns) a non-blocking stream of its
  /// own; pass yours to order the layer with your work or to capture it in a CUDA graph.
  cudaStream_t stream = nullptr;

  template <class U>
  buffer<U> allocate(index_t n) const {
    return buffer<U>(n);
  }

  /// f(i) for i in [0, n) as a kernel on `s`: the per-row/per-token EPMOE_HD functors.
  template <class F>
  static void for_each(index_t n, const F& f, cudaStream_t s) {
    if (n <= 0) return;
    constexpr int block = 256;
    cuda_detail::for_each_kernel<<<static_cast<unsigned>((n + block - 1) / block), block, 0, s>>>(
        n, f);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace epmoe::space

namespace epmoe {
/// A space whose memory is on a device: moe_layer then uses its CUDA specialization.
template <class S>
concept device_space = requires {
  requires S::device;
  typename S::value_type;
};
}  // namespace epmoe
