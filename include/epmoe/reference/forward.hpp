// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::reference {

/// The plain forward pass the layer is checked against: loops in double, no plan, no
/// communication, all E experts in one place. x holds every rank's tokens, rank after
/// rank (`tokens_per_rank`); capacity is applied per source rank in token order, as the
/// layer does. The router's route_token is the routing definition and is reused;
/// everything else is written out here.
template <class Router, class Capacity>
void forward(const full_weights& w, const Router& router, const Capacity& capacity,
             matrix_view<const float> x, std::span<const index_t> tokens_per_rank,
             matrix_view<float> y) {
  const layer_config& cfg = w.cfg;
  const index_t E = cfg.experts, H = cfg.hidden, F = cfg.ffn, K = Router::top_k;
  std::vector<float> logits(E), weight(K);
  std::vector<std::int32_t> ids(K);
  std::vector<index_t> used(E);
  std::vector<double> h(F), out(H);
  index_t t = 0;
  for (index_t n : tokens_per_rank) {
    const index_t limit = capacity.limit(cfg, n);
    std::fill(used.begin(), used.end(), 0);
    for (index_t end = t + n; t < end; ++t) {
      const float* xt = x.row(t);
      for (index_t e = 0; e < E; ++e) {
        double s = 0;
        for (index_t i = 0; i < H; ++i) s += double{xt[i]} * w.gate[e * H + i];
        logits[e] = static_cast<float>(s);
      }
      router.route_token(logits.data(), static_cast<int>(E), ids.data(), weight.data());
      std::fill(out.begin(), out.end(), 0.0);
      for (index_t k = 0; k < K; ++k) {
        const index_t e = ids[k];
        if (used[e]++ >= limit) continue;  // past capacity: dropped
        const float* w1 = &w.w1[e * F * H];
        const float* w3 = &w.w3[e * F * H];
        const float* w2 = &w.w2[e * H * F];
        for (index_t f = 0; f < F; ++f) {
          double a = 0, b = 0;
          for (index_t i = 0; i < H; ++i) {
            a += double{w1[f * H + i]} * xt[i];
            b += double{w3[f * H + i]} * xt[i];
          }
          h[f] = a / (1.0 + std::exp(-a)) * b;
        }
        for (index_t o = 0; o < H; ++o) {
          double s = 0;
          for (index_t f = 0; f < F; ++f) s += double{w2[o * F + f]} * h[f];
          out[o] += double{weight[k]} * s;
        }
      }
      for (index_t o = 0; o < H; ++o) y(t, o) = static_cast<float>(out[o]);
    }
  }
}

}  // namespace epmoe::reference
