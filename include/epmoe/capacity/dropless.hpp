// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::capacity {

/// No limit: every assignment is processed; buffers are sized for the worst case
/// (every token of every rank on one rank's experts).
struct dropless {
  static constexpr bool pads = false;

  /// Most rows one source rank sends to one expert in a pass of `tokens` tokens:
  /// a token picks an expert at most once.
  index_t limit(const layer_config&, index_t tokens) const { return tokens; }
};

}  // namespace epmoe::capacity
