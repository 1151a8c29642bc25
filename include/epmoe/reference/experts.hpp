// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <span>
#include <type_traits>
#include <vector>

#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/reference/weights.hpp"

// The float64 math of each expert type, found by the expert policy's type: a new expert
// type adds its own specialisation here (or next to it) and reference::forward uses it
// unchanged.
namespace epmoe::reference {

/// An expert of full_weights: routed expert `index` in [0, E), or shared expert `index` in
/// [0, N) when `shared`.
struct expert_ref {
  bool shared = false;
  index_t index = 0;
};

/// out[H] += scale · Expert(x[H]) in double, for the expert `which` of `w`. Specialise per
/// expert type: `static void add(const full_weights&, expert_ref, const float* x, double
/// scale, std::span<double> out)`.
template <class Expert>
struct expert_math {
  static_assert(!std::is_same_v<Expert, Expert>,
                "reference::expert_math has no float64 formula for this expert type: "
                "specialise reference::expert_math<Expert> with a static add()");
};

/// SwiGLU (Shazeer 2020): W2 (silu(W1 x) ⊙ W3 x), silu(a) = a / (1 + e^-a).
template <>
struct expert_math<expert::swiglu> {
  static void add(const full_weights& w, expert_ref which, const float* x, double scale,
                  std::span<double> out) {
    const index_t H = w.cfg.hidden, F = which.shared ? w.cfg.shared_width() : w.cfg.ffn;
    const float* w1 = (which.shared ? w.shared_w1 : w.w1).data() + which.index * F * H;
    const float* w3 = (which.shared ? w.shared_w3 : w.w3).data() + which.index * F * H;
    const float* w2 = (which.shared ? w.shared_w2 : w.w2).data() + which.index * H * F;
    std::vector<double> h(static_cast<std::size_t>(F));
    for (index_t f = 0; f < F; ++f) {
      double a = 0, b = 0;
      for (index_t i = 0; i < H; ++i) {
        a += double{w1[f * H + i]} * x[i];
        b += double{w3[f * H + i]} * x[i];
      }
      h[f] = a / (1.0 + std::exp(-a)) * b;
    }
    for (index_t o = 0; o < H; ++o) {
      double s = 0;
      for (index_t f = 0; f < F; ++f) s += double{w2[o * F + f]} * h[f];
      out[o] += scale * s;
    }
  }
};

}  // namespace epmoe::reference
