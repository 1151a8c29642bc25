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

/// Does nothing between passes.
struct no_step {
  template <class Layer>
  void operator()(Layer&) const {}
};

/// Runs `passes` forward passes of one moe_layer<P> per rank on cfg.ranks threads over the
/// same tokens and returns each pass's y [pass][tokens * H] in global token order. Every pass
/// starts from NaN (a row left unwritten fails any comparison); `between(layer)` runs on
/// every rank after each pass (a collective such as update_router).
template <class P, class Between = no_step>
std::vector<std::vector<float>> run_passes(const layer_config& cfg,
                                           const reference::full_weights& w, const global_tokens& g,
                                           const run_options<P>& opt, int passes,
                                           Between between = {}) {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> out(static_cast<std::size_t>(passes),
                                      std::vector<float>(g.x.size(), nan));
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
    const auto mine = reference::slice(w, where, r);
    moe_layer<P> layer(cfg, c, {w.gate_view(), mine.experts(), w.shared(), w.noise_gate_view()},
                       opt.router, opt.capacity, where);
    if constexpr (router_with_bias<typename P::router>)
      if (!opt.bias.empty())
        std::copy(opt.bias.begin(), opt.bias.end(), layer.router_bias().begin());
    const index_t T = g.per_rank[r], H = cfg.hidden;
    std::span<const std::int64_t> ids;
    if (!opt.token_ids.empty())
      ids = {opt.token_ids.data() + g.offset(r), static_cast<std::size_t>(T)};
    for (int p = 0; p < passes; ++p) {
      layer.forward({g.x.data() + g.offset(r) * H, T, H}, {out[p].data() + g.offset(r) * H, T, H},
                    ids);
      between(layer);
    }
  });
  return out;
}

}  // namespace epmoe::test
