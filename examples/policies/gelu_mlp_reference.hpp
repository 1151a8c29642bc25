// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the float64 reference (epmoe::testing) needs of the GELU-MLP expert: its formula,
// written from the definition apart from gelu_mlp.hpp's code, and how its weights view a
// rank's slice of full_weights (w1 and w2; w3 unused).
#include <cmath>
#include <span>
#include <vector>

#include "gelu_mlp.hpp"
#include <epmoe/reference/experts.hpp>
#include <epmoe/reference/weights.hpp>

namespace epmoe::reference {
/// gelu_mlp in float64: W2 gelu(W1 x), gelu(a) = a Φ(a) = a (1 + erf(a / sqrt 2)) / 2, over
/// full_weights' w1 and w2.
template <>
struct expert_math<::policies::gelu_mlp> {
  static void add(const full_weights& w, expert_ref which, const float* x, double scale,
                  std::span<double> out) {
    const index_t H = w.cfg.hidden, F = which.shared ? w.cfg.shared_width() : w.cfg.ffn;
    const float* w1 = (which.shared ? w.shared_w1 : w.w1).data() + which.index * F * H;
    const float* w2 = (which.shared ? w.shared_w2 : w.w2).data() + which.index * H * F;
    std::vector<double> h(static_cast<std::size_t>(F));
    for (index_t f = 0; f < F; ++f) {
      double a = 0;
      for (index_t i = 0; i < H; ++i) a += double{w1[f * H + i]} * x[i];
      h[f] = a * 0.5 * (1.0 + std::erf(a / std::sqrt(2.0)));
    }
    for (index_t o = 0; o < H; ++o) {
      double s = 0;
      for (index_t f = 0; f < F; ++f) s += double{w2[o * F + f]} * h[f];
      out[o] += scale * s;
    }
  }
};

template <>
struct views_of<::policies::gelu_mlp> {
  static ::policies::gelu_mlp::weights_of<float> of(const rank_weights& r) {
    return {{r.w1.data(), r.local, r.ffn, r.hidden}, {r.w2.data(), r.local, r.hidden, r.ffn}};
  }
};
}  // namespace epmoe::reference
