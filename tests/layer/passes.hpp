// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Several passes of one layer on R in-process ranks, keeping every pass's output.
#include <algorithm>
#include <limits>
#include <span>
#include <vector>

#include "harness.hpp"

namespace epmoe::test {

/// Runs `passes` forward passes of one moe_layer<P> per rank over the same tokens and returns
/// each pass's y [pass][tokens * H] in global token order (run_layer: every pass starts from
/// NaN); `between(layer)` runs on every rank after each pass (a collective such as
/// update_router).
template <class P, class Between>
std::vector<std::vector<float>> run_passes(const layer_config& cfg,
                                           const reference::full_weights& w, const global_tokens& g,
                                           run_options<P> opt, int passes, Between between) {
  opt.passes = passes;
  opt.between = between;
  return run_layer<P>(cfg, w, g, opt).ys;
}
template <class P>
std::vector<std::vector<float>> run_passes(const layer_config& cfg,
                                           const reference::full_weights& w, const global_tokens& g,
                                           const run_options<P>& opt, int passes) {
  return run_passes<P>(cfg, w, g, opt, passes, [](moe_layer<P>&) {});
}

}  // namespace epmoe::test
