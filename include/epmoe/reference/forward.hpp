// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/reference/dispatch.hpp"
#include "epmoe/reference/experts.hpp"
#include "epmoe/reference/routing.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::reference {

/// The plain forward pass the layer is checked against: loops in double, no plan, no
/// communication, all E experts in one place. x [sum(tokens_per_rank), H] holds every rank's
/// tokens, rank after rank; y the same shape. Routing (routing.hpp), capacity and replica
/// choice (dispatch.hpp) and the expert math (experts.hpp, chosen by Expert) are written
/// from their definitions, never through the policies' own code. Capacity applies per
/// (source rank, physical slot) in token order, then slot order within a token, as the
/// layer does; with replicas it counts the copy the placement's rule picks.
///
/// forward_values is the same pass returning y in double, before the final rounding to
/// float: reference::backward's finite-difference checks differentiate it.
///
/// Zero experts (config zero_experts = Z; LongCat-Flash's `LongcatFlashExperts`): the router
/// scores E + Z experts (gate [E + Z, H]); a chosen id e >= E is `nn.Identity`, so the token
/// gets weight · x, with no capacity (it computes nothing).
template <class Expert = expert::swiglu, class Router, class Capacity, class Placement>
std::vector<double> forward_values(const full_weights& w, const Router& router,
                                   const Capacity& capacity, const Placement& placement,
                                   matrix_view<const float> x,
                                   std::span<const index_t> tokens_per_rank,
                                   const pass_options& opt = {}) {
  const layer_config& cfg = w.cfg;
  const index_t H = cfg.hidden;
  index_t total = 0;
  for (index_t n : tokens_per_rank) total += n;
  std::vector<double> y(static_cast<std::size_t>(total * H));  // [sum(tokens_per_rank), H]
  const auto routing = route_ranks(w, router, x, tokens_per_rank, opt);
  std::vector<double> out(static_cast<std::size_t>(H));
  index_t t0 = 0;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    const rank_routing& route = routing[r];
    const index_t limit = limit_of(capacity, cfg, route.tokens);
    std::map<int, index_t> used;  // rows this rank sent to each slot so far
    for (index_t t = 0; t < route.tokens; ++t) {
      const float* xt = x.row(t0 + t);
      const std::int64_t id = opt.token_ids.empty()
                                  ? static_cast<std::int64_t>(r) * cfg.max_tokens + t
                                  : opt.token_ids[t0 + t];
      std::fill(out.begin(), out.end(), 0.0);
      for (index_t k = 0; k < route.width; ++k) {
        const std::int32_t e = route.ids[t * route.width + k];
        if (e == no_expert) continue;
        const double weight = route.weights[t * route.width + k];
        if (e >= cfg.experts) {  // a zero expert: identity(x) * weight
          for (index_t o = 0; o < H; ++o) out[o] += weight * double{xt[o]};
          continue;
        }
        const int slot = slot_of(placement, e, static_cast<int>(r), static_cast<std::uint64_t>(id));
        if (used[slot]++ >= limit) continue;  // past capacity: dropped
        expert_math<Expert>::add(w, {false, e}, xt, weight, out);
      }
      for (index_t s = 0; s < cfg.shared_experts; ++s) {
        double scale = 1.0;  // Qwen2-MoE's shared-expert gate: sigmoid(x · g_s)
        if (cfg.shared_gate) {
          double d = 0;
          for (index_t i = 0; i < H; ++i) d += double{w.shared_gate[s * H + i]} * xt[i];
          scale = 1.0 / (1.0 + std::exp(-d));
        }
        expert_math<Expert>::add(w, {true, s}, xt, scale, out);
      }
      if (cfg.output_bias)  // JetMoE
        for (index_t o = 0; o < H; ++o) out[o] += w.output_bias[o];
      std::copy(out.begin(), out.end(), y.begin() + (t0 + t) * H);
    }
    t0 += route.tokens;
  }
  return y;
}

template <class Expert = expert::swiglu, class Router, class Capacity, class Placement>
void forward(const full_weights& w, const Router& router, const Capacity& capacity,
             const Placement& placement, matrix_view<const float> x,
             std::span<const index_t> tokens_per_rank, matrix_view<float> y,
             const pass_options& opt = {}) {
  const std::vector<double> v =
      forward_values<Expert>(w, router, capacity, placement, x, tokens_per_rank, opt);
  const index_t H = w.cfg.hidden;
  for (index_t t = 0; t < static_cast<index_t>(v.size()) / H; ++t)
    for (index_t o = 0; o < H; ++o) y(t, o) = static_cast<float>(v[t * H + o]);
}

/// The same with placement::block (one copy per expert).
template <class Expert = expert::swiglu, class Router, class Capacity>
void forward(const full_weights& w, const Router& router, const Capacity& capacity,
             matrix_view<const float> x, std::span<const index_t> tokens_per_rank,
             matrix_view<float> y, const pass_options& opt = {}) {
  forward<Expert>(w, router, capacity, placement::block(w.cfg), x, tokens_per_rank, y, opt);
}

}  // namespace epmoe::reference
