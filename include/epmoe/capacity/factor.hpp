// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::capacity {

/// GShard/Switch capacity: each source rank sends each expert at most
/// ceil(capacity_factor * T * K / E) rows per pass, T its tokens this pass. Assignments past
/// the limit are dropped in token order (then k order), counted, and contribute nothing.
/// Pad = true pads every (rank, expert) block to the limit with zero rows, so every
/// exchange and every expert GEMM has a shape fixed by T alone, whatever the routing.
template <bool Pad = false>
struct factor {
  static constexpr bool pads = Pad;

  index_t limit(const layer_config& cfg, index_t tokens) const {
    return static_cast<index_t>(
        std::ceil(cfg.capacity_factor * static_cast<double>(tokens) * cfg.top_k / cfg.experts));
  }
};

/// Capacity factor with every expert buffer padded to capacity (static shapes).
using padded_factor = factor<true>;

}  // namespace epmoe::capacity
