// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/view.hpp"

namespace epmoe {

/// The router's answer for T tokens: expert ids [T, K] and combine weights [T, K].
template <class Id = const std::int32_t, class W = const float>
struct basic_routing_view {
  matrix_view<Id> ids;
  matrix_view<W> weights;
  index_t tokens() const { return ids.rows; }
  index_t top_k() const { return ids.cols; }
};
using routing_view = basic_routing_view<>;
using mutable_routing_view = basic_routing_view<std::int32_t, float>;

}  // namespace epmoe
