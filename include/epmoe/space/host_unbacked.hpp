// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Expert tensors with no values behind them (codes only, issue 37): a layer serving a
// quantised checkpoint keeps the packed codes and nothing else, yet its passes find each
// packed copy by the tensor view it copies (packed_weights::find). These views have real
// shapes and strides in address space that is reserved, never committed: no memory is used,
// and a read faults at once instead of computing with garbage.

#include <sys/mman.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::space {

/// Owns reserved, inaccessible address ranges and hands out contiguous stacked views of
/// them ([count, rows, cols] floats): the views of a layer whose expert weights exist only
/// as packed codes (moe_layer::pack_codes). Must outlive the layer's use of the views.
class unbacked_tensors {
 public:
  unbacked_tensors() = default;
  unbacked_tensors(const unbacked_tensors&) = delete;
  unbacked_tensors& operator=(const unbacked_tensors&) = delete;
  unbacked_tensors(unbacked_tensors&& o) noexcept : ranges_(std::exchange(o.ranges_, {})) {}
  unbacked_tensors& operator=(unbacked_tensors&& o) noexcept {
    std::swap(ranges_, o.ranges_);
    return *this;
  }
  ~unbacked_tensors() { release(); }

  /// A [count, rows, cols] view of a new range: count * rows * cols floats of address space
  /// (PROT_NONE, MAP_NORESERVE: no memory, no commit charge); a read of it faults.
  stacked_view<const float> add(index_t count, index_t rows, index_t cols) {
    epmoe::detail::require(
        count > 0 && rows > 0 && cols > 0, "unbacked_tensors.add",
        std::to_string(count) + " x " + std::to_string(rows) + " x " + std::to_string(cols),
        "a tensor needs count, rows and cols > 0");
    const auto bytes = static_cast<std::size_t>(count * rows * cols) * sizeof(float);
    void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    epmoe::detail::require(p != MAP_FAILED, "unbacked_tensors.add",
                           std::to_string(bytes) + " bytes",
                           "the address space could not be reserved (mmap)");
    ranges_.push_back({p, bytes});
    return {static_cast<const float*>(p), count, rows, cols};
  }
  /// Bytes of address space reserved (none of them memory).
  std::size_t reserved_bytes() const {
    std::size_t n = 0;
    for (const range& r : ranges_) n += r.bytes;
    return n;
  }
  void release() {
    for (const range& r : ranges_) ::munmap(r.at, r.bytes);
    ranges_.clear();
  }

 private:
  struct range {
    void* at;
    std::size_t bytes;
  };
  std::vector<range> ranges_;
};

}  // namespace epmoe::space
