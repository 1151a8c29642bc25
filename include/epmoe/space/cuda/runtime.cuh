// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The CUDA runtime pieces every CUDA header uses: error checks that throw, the element types
// (fp32, bf16, fp16), owning device and pinned buffers. Included only by CUDA builds (nvcc).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

/// A failed CUDA, cuBLAS or NCCL call: the message names the call, the code and its text.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(const std::string& call, int code, const std::string& name, const std::string& text)
      : std::runtime_error("epmoe: " + call + " failed: " + name + " (" + std::to_string(code) +
                           "): " + text),
        code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace cuda_detail {
inline void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw cuda_error(call, e, cudaGetErrorName(e), cudaGetErrorString(e));
}
inline void check(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw cuda_error(call, s, cublasGetStatusName(s), cublasGetStatusString(s));
}
}  // namespace cuda_detail

/// Throws cuda_error naming the call (its source text), the code and the runtime's text.
#define EPMOE_CUDA_CHECK(...) ::epmoe::cuda_detail::check((__VA_ARGS__), #__VA_ARGS__)

/// Element types of activations and weights on the device; math is always fp32.
template <class T>
struct dtype;
template <>
struct dtype<float> {
  static constexpr cudaDataType_t cuda = CUDA_R_32F;
  static constexpr const char* name = "fp32";
};
template <>
struct dtype<__nv_bfloat16> {
  static constexpr cudaDataType_t cuda = CUDA_R_16BF;
  static constexpr const char* name = "bf16";
};
template <>
struct dtype<__half> {
  static constexpr cudaDataType_t cuda = CUDA_R_16F;
  static constexpr const char* name = "fp16";
};

/// The 16-bit element types convert through float (core/numeric.hpp's to_float/from_float).
template <>
struct scalar<__nv_bfloat16> {
  EPMOE_HD static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  EPMOE_HD static __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }  // nearest
};
template <>
struct scalar<__half> {
  EPMOE_HD static float to_float(__half v) { return __half2float(v); }
  EPMOE_HD static __half from_float(float v) { return __float2half(v); }
};

/// Owning device array (cudaMalloc, never managed memory), sized once, move-only.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(index_t n) : size_(n) {
    if (n > 0)
      EPMOE_CUDA_CHECK(
          cudaMalloc(reinterpret_cast<void**>(&data_), static_cast<std::size_t>(n) * sizeof(T)));
  }
  device_buffer(device_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~device_buffer() {
    if (data_) cudaFree(data_);  // no throw from a destructor; a failed free leaks
  }
  T* data() const { return data_; }
  index_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  index_t size_ = 0;
};

/// Page-locked host array: the target of the few device->host copies (counts, stats), so
/// they run asynchronously and can be captured in a CUDA graph.
template <class T>
class pinned_buffer {
 public:
  pinned_buffer() = default;
  explicit pinned_buffer(index_t n) : size_(n) {
    if (n > 0)
      EPMOE_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data_),
                                      static_cast<std::size_t>(n) * sizeof(T)));
    for (index_t i = 0; i < n; ++i) data_[i] = T{};
  }
  pinned_buffer(pinned_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~pinned_buffer() {
    if (data_) cudaFreeHost(data_);
  }
  T* data() const { return data_; }
  index_t size() const { return size_; }
  T& operator[](index_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  index_t size_ = 0;
};

/// Whether this process can run CUDA work: any error (no driver, no device: without a
/// driver cudaGetDeviceCount returns an error, not zero devices) means no.
inline bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace epmoe
