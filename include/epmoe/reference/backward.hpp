// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <type_traits>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/mlp.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/reference/dispatch.hpp"
#include "epmoe/reference/expert_backward.hpp"
#include "epmoe/reference/experts.hpp"
#include "epmoe/reference/forward.hpp"
#include "epmoe/reference/loss_backward.hpp"
#include "epmoe/reference/routing.hpp"
#include "epmoe/reference/routing_backward.hpp"
#include "epmoe/reference/weights.hpp"

// The float64 backward of reference::forward (docs/training.md): the gradient of
// L = Σ dy ⊙ y with respect to every weight of full_weights and to x, written from the
// forward's formulas by hand (chain rule, loops in double), never through the layer's code.
// The routing decisions (which experts, which assignments capacity drops) are piecewise
// constant: they are recomputed as the forward makes them and held fixed, so gradients flow
// through the chosen experts and the routing weights only, and a dropped assignment
// contributes exactly zero.
namespace epmoe::reference {

/// The gradient of L = Σ dy ⊙ y, y = reference::forward<Expert>(w, router, capacity,
/// placement, x, tokens_per_rank, opt), with respect to every weight of w and to x, in
/// double. dy [sum(tokens_per_rank), H]. The routing and capacity decisions are the
/// forward's, recomputed and held fixed.
template <class Expert = expert::swiglu, class Router, class Capacity, class Placement>
gradients backward(const full_weights& w, const Router& router, const Capacity& capacity,
                   const Placement& placement, matrix_view<const float> x,
                   std::span<const index_t> tokens_per_rank, matrix_view<const float> dy,
                   const pass_options& opt = {}) {
  static_assert(router_with_gradient<Router>,
                "reference::backward has no gradient for this router yet: add a "
                "routing_grad(const router::X&, ...) overload in reference/routing_backward.hpp");
  const layer_config& cfg = w.cfg;
  const index_t H = cfg.hidden;
  index_t total = 0;
  for (index_t n : tokens_per_rank) total += n;
  gradients g = gradients::zeros(cfg, total);
  const auto routing = route_ranks(w, router, x, tokens_per_rank, opt);
  const layer_config scored = cfg.router_view();  // the router's batches: E + Z experts
  std::vector<double> dout(static_cast<std::size_t>(H));
  index_t t0 = 0;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    const rank_routing& route = routing[r];
    const index_t limit = limit_of(capacity, cfg, route.tokens);
    std::map<int, index_t> used;                          // as the forward counts them
    std::vector<double> dweights(route.ids.size(), 0.0);  // dropped and empty slots: 0
    for (index_t t = 0; t < route.tokens; ++t) {
      const float* xt = x.row(t0 + t);
      const std::span<double> dxt(g.dx.data() + (t0 + t) * H, static_cast<std::size_t>(H));
      const std::int64_t id = opt.token_ids.empty()
                                  ? static_cast<std::int64_t>(r) * cfg.max_tokens + t
                                  : opt.token_ids[t0 + t];
      for (index_t o = 0; o < H; ++o) dout[o] = dy(t0 + t, o);
      for (index_t k = 0; k < route.width; ++k) {
        const std::int32_t e = route.ids[t * route.width + k];
        if (e == no_expert) continue;
        if (e >= cfg.experts) {  // a zero expert, y += w x: dL/dw = dy · x, dx += w dy
          const double wk = route.weights[t * route.width + k];
          double d = 0;
          for (index_t o = 0; o < H; ++o) {
            d += dout[o] * double{xt[o]};
            dxt[o] += wk * dout[o];
          }
          dweights[t * route.width + k] = d;
          continue;
        }
        const int slot = slot_of(placement, e, static_cast<int>(r), static_cast<std::uint64_t>(id));
        if (used[slot]++ >= limit) continue;  // dropped: no gradient at all
        dweights[t * route.width + k] = expert_grad<Expert>::add(
            w, {false, e}, xt, route.weights[t * route.width + k], dout, g, dxt);
      }
      for (index_t s = 0; s < cfg.shared_experts; ++s) {
        if (!cfg.shared_gate) {
          expert_grad<Expert>::add(w, {true, s}, xt, 1.0, dout, g, dxt);
          continue;
        }
        // scale = σ(x · g_s): dL/d(x · g_s) = dL/dscale · scale (1 - scale).
        double d = 0;
        for (index_t i = 0; i < H; ++i) d += double{w.shared_gate[s * H + i]} * xt[i];
        const double scale = 1.0 / (1.0 + std::exp(-d));
        const double dscale = expert_grad<Expert>::add(w, {true, s}, xt, scale, dout, g, dxt);
        const double dd = dscale * scale * (1.0 - scale);
        for (index_t i = 0; i < H; ++i) {
          g.dshared_gate[s * H + i] += dd * xt[i];
          dxt[i] += dd * double{w.shared_gate[s * H + i]};
        }
      }
      if (cfg.output_bias)
        for (index_t o = 0; o < H; ++o) g.doutput_bias[o] += dout[o];
    }
    if constexpr (router_with_gradient<Router>) {
      const rank_batch b = detail::batch_of(w, scored, x, r, t0, route.tokens, opt);
      routing_grad(
          router, b, route, dweights, g,
          std::span<double>(g.dx.data() + t0 * H, static_cast<std::size_t>(route.tokens * H)));
    }
    t0 += route.tokens;
  }
  return g;
}

/// The same with placement::block.
template <class Expert = expert::swiglu, class Router, class Capacity>
gradients backward(const full_weights& w, const Router& router, const Capacity& capacity,
                   matrix_view<const float> x, std::span<const index_t> tokens_per_rank,
                   matrix_view<const float> dy, const pass_options& opt = {}) {
  return backward<Expert>(w, router, capacity, placement::block(w.cfg), x, tokens_per_rank, dy,
                          opt);
}

}  // namespace epmoe::reference
