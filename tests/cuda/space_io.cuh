// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The tests' data movement for space::cuda<T>: the host test files, included by the .cu files
// here with EPMOE_TEST_SPACES set to CUDA spaces, run their very checks on the GPU. Uploads
// round to T; outputs are poisoned with 0xff bytes (NaN in fp32, bf16 and fp16) on the
// caller's stream, which the layer waits for without a device synchronisation.
#include <cuda_runtime.h>

#include <span>
#include <type_traits>
#include <vector>

// The space first: the harness names it in its list of spaces.
// clang-format off
#include <epmoe/space/cuda.cuh>
#include "../layer/harness.hpp"
// clang-format on

namespace epmoe::test {

template <class T>
struct space_io<space::cuda<T>> {
  using value_type = T;
  using array = device_buffer<T>;

  static array upload(std::span<const float> v) {
    std::vector<T> h(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) h[i] = from_float<T>(v[i]);
    return upload_as(std::span<const T>(h));
  }
  template <class U>
  static device_buffer<U> upload_as(std::span<const U> v) {
    device_buffer<U> d(static_cast<index_t>(v.size()));
    if (!v.empty())
      EPMOE_CUDA_CHECK(
          cudaMemcpy(d.data(), v.data(), sizeof(U) * v.size(), cudaMemcpyHostToDevice));
    // From pageable memory the copy may return before it lands; the layer's streams do not
    // wait for the legacy stream's copies.
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
    return d;
  }
  template <class A>
  static auto* data(A& a) {
    return a.data();
  }
  /// After the pass: the caller's stream waits for it (space::cuda::leave), and this copy
  /// runs on the legacy stream, which is the caller's here.
  static std::vector<float> download(const array& a, const space::cuda<T>&) {
    std::vector<T> h(static_cast<std::size_t>(a.size()));
    if (!h.empty())
      EPMOE_CUDA_CHECK(
          cudaMemcpy(h.data(), a.data(), sizeof(T) * h.size(), cudaMemcpyDeviceToHost));
    std::vector<float> out(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) out[i] = to_float(h[i]);
    return out;
  }
  /// On the caller's stream, no synchronisation: the pass must wait for it by itself.
  static void poison(array& a, const space::cuda<T>& s) {
    if (a.size() > 0)
      EPMOE_CUDA_CHECK(cudaMemsetAsync(a.data(), 0xff, sizeof(T) * a.size(), s.caller()));
  }
  static float round(float v) { return to_float(from_float<T>(v)); }
  /// bf16 and fp16 round the three GEMMs' outputs and the gate between them (8 / 11
  /// mantissa bits): the max-norm error against the double reference.
  static double tolerance(double fp32) {
    if constexpr (std::is_same_v<T, __half>) return fp32 > 4e-3 ? fp32 : 4e-3;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return fp32 > 3e-2 ? fp32 : 3e-2;
    return fp32;
  }
};

}  // namespace epmoe::test
