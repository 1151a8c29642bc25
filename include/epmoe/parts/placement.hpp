// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <span>
#include <utility>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/plan.hpp"

// A layer's placement and what its plan reads of it: the placement's view (plain pointers)
// with the arrays copied into the space's memory on a device, or the placement itself (a
// small value) where it has no view.
namespace epmoe::parts {

template <class Space, class Placement>
class placed {
 public:
  placed(Placement p, const Space& s) : p_(std::move(p)) { place(s); }
  placed(const placed&) = delete;

  const Placement& get() const { return p_; }
  /// What the plan's per-assignment step reads (valid until the next set()).
  const auto& view() const { return where_; }
  /// Another placement (a live re-placement), copied to the space when it reads arrays.
  void set(const Placement& next, const Space& s) {
    p_ = next;
    place(s);
  }

 private:
  void place(const Space& s) {
    if constexpr (requires {
                    p_.view_in([](std::span<const int>) -> const int* { return nullptr; });
                  } &&
                  device_space<Space>) {
      arrays_.clear();
      where_ = p_.view_in([&](std::span<const int> v) -> const int* {
        auto& m =
            arrays_.emplace_back(s.template allocate_mirror<int>(static_cast<index_t>(v.size())));
        std::copy(v.begin(), v.end(), m.host());
        s.to_device(m, 0, static_cast<index_t>(v.size()));
        return m.device();
      });
      s.synchronize();
    } else {
      where_ = placement_view(p_);
    }
  }

  Placement p_;
  decltype(placement_view(std::declval<const Placement&>())) where_{placement_view(p_)};
  std::vector<typename Space::template mirror<int>> arrays_;  // a device space's copies
};

}  // namespace epmoe::parts
