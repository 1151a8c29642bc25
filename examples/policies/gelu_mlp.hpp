// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// An expert written as a user would, in one header: the non-gated MLP of Switch, GShard and
// NLLB-MoE, y = W2 gelu(W1 x) (exact GELU, x Φ(x)). Its grouped forward runs on any space:
// two grouped GEMMs and an EPMOE_HD activation.
#include <array>
#include <cmath>
#include <string>

#include <epmoe/core/numeric.hpp>
#include <epmoe/core/view.hpp>

namespace policies {

struct gelu_mlp {
  template <class T>
  struct weights_of {
    epmoe::stacked_view<const T> w1;  // [L, F, H]
    epmoe::stacked_view<const T> w2;  // [L, H, F]
  };

  template <class T>
  static void validate(const weights_of<T>& w, epmoe::index_t count, epmoe::index_t hidden,
                       epmoe::index_t ffn, const std::string& name) {
    epmoe::detail::require_shape(w.w1, count, ffn, hidden, (name + ".w1").c_str());
    epmoe::detail::require_shape(w.w2, count, hidden, ffn, (name + ".w2").c_str());
  }
  template <class T>
  static std::array<epmoe::stacked_view<const T>*, 2> tensors(weights_of<T>& w) {
    return {&w.w1, &w.w2};
  }
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, epmoe::index_t first, epmoe::index_t n) {
    return {w.w1.slice(first, n), w.w2.slice(first, n)};
  }
  /// Two GEMMs of [rows, H] x [H, F] (and back).
  static double flops_per_row(epmoe::index_t hidden, epmoe::index_t ffn) {
    return 4.0 * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  static epmoe::index_t scratch_per_row(epmoe::index_t ffn) { return ffn; }

  EPMOE_HD static float gelu(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

  template <class T>
  struct gelu_rows {
    T* h;
    EPMOE_HD void operator()(epmoe::index_t i) const {
      h[i] = epmoe::from_float<T>(gelu(epmoe::to_float(h[i])));
    }
  };

  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, epmoe::grouped_rows<T> x,
                      T* scratch) {
    const epmoe::index_t F = w.w1.rows, n = x.elements(F);
    if (n == 0) return;
    const epmoe::grouped_rows<T> h = x.over(scratch, F);
    space.grouped_gemm_nt(x, w.w1, h);
    space.for_each(n, gelu_rows<T>{h.data});
    space.grouped_gemm_nt(h, w.w2, x);
  }
};

}  // namespace policies
