// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <type_traits>
#include <vector>

#include "epmoe/core/view.hpp"
#include "epmoe/expert/clamped_glu.hpp"
#include "epmoe/expert/mlp.hpp"
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

/// Each activation from its definition, in double.
template <class Act>
struct activation {
  static_assert(!std::is_same_v<Act, Act>,
                "reference::activation has no float64 formula for this activation: "
                "specialise reference::activation<Act> with a static of(double)");
};
template <>
struct activation<act::silu> {  // a σ(a)
  static double of(double a) { return a / (1.0 + std::exp(-a)); }
};
template <>
struct activation<act::gelu> {  // a Φ(a)
  static double of(double a) { return 0.5 * a * (1.0 + std::erf(a / std::sqrt(2.0))); }
};
template <>
struct activation<act::gelu_tanh> {  // Hendrycks & Gimpel's tanh approximation
  static double of(double a) {
    const double pi = 3.14159265358979323846;
    return 0.5 * a * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (a + 0.044715 * a * a * a)));
  }
};
template <>
struct activation<act::relu> {
  static double of(double a) { return a > 0 ? a : 0.0; }
};

namespace detail {
/// The rows of one expert of full_weights (routed or shared): W1, W3, W2 and the biases.
struct expert_rows {
  const float *w1, *w3, *w2, *b1, *b2;
  index_t F;
};
inline expert_rows rows_of(const full_weights& w, expert_ref which) {
  const index_t H = w.cfg.hidden, F = which.shared ? w.cfg.shared_width() : w.cfg.ffn;
  const index_t i = which.index;
  const auto at = [](const std::vector<float>& v, index_t offset) {
    return v.empty() ? nullptr : v.data() + offset;
  };
  return which.shared ? expert_rows{at(w.shared_w1, i * F * H), at(w.shared_w3, i * F * H),
                                    at(w.shared_w2, i * H * F), at(w.shared_b1, i * F),
                                    at(w.shared_b2, i * H),     F}
                      : expert_rows{at(w.w1, i * F * H), at(w.w3, i * F * H), at(w.w2, i * H * F),
                                    at(w.b1, i * F),     at(w.b2, i * H),     F};
}
/// out[o] += scale Σ_f W2[o, f] h[f] (+ b2[o]).
inline void down(const expert_rows& e, const std::vector<double>& h, const float* b2, double scale,
                 std::span<double> out) {
  for (std::size_t o = 0; o < out.size(); ++o) {
    double s = b2 ? double{b2[o]} : 0.0;
    for (index_t f = 0; f < e.F; ++f) s += double{e.w2[o * e.F + f]} * h[f];
    out[o] += scale * s;
  }
}
}  // namespace detail

/// Gated (Shazeer 2020): W2 (act(W1 x) ⊙ W3 x); SwiGLU with silu, GeGLU with GELU.
template <class Act>
struct expert_math<expert::glu<Act>> {
  static void add(const full_weights& w, expert_ref which, const float* x, double scale,
                  std::span<double> out) {
    const index_t H = w.cfg.hidden;
    const detail::expert_rows e = detail::rows_of(w, which);
    std::vector<double> h(static_cast<std::size_t>(e.F));
    for (index_t f = 0; f < e.F; ++f) {
      double a = 0, b = 0;
      for (index_t i = 0; i < H; ++i) {
        a += double{e.w1[f * H + i]} * x[i];
        b += double{e.w3[f * H + i]} * x[i];
      }
      h[f] = activation<Act>::of(a) * b;
    }
    detail::down(e, h, nullptr, scale, out);
  }
};

/// Non-gated (Vaswani et al. 2017; Switch, NLLB-MoE): W2 act(W1 x + b1) + b2, the biases
/// when Biases.
template <class Act, bool Biases>
struct expert_math<expert::mlp<Act, Biases>> {
  static void add(const full_weights& w, expert_ref which, const float* x, double scale,
                  std::span<double> out) {
    const index_t H = w.cfg.hidden;
    const detail::expert_rows e = detail::rows_of(w, which);
    std::vector<double> h(static_cast<std::size_t>(e.F));
    for (index_t f = 0; f < e.F; ++f) {
      double a = Biases ? double{e.b1[f]} : 0.0;
      for (index_t i = 0; i < H; ++i) a += double{e.w1[f * H + i]} * x[i];
      h[f] = activation<Act>::of(a);
    }
    detail::down(e, h, Biases ? e.b2 : nullptr, scale, out);
  }
};

/// Clamped gated (GPT-OSS, DeepSeek-V4), from `_apply_gate`: a = W1 x + b1, b = W3 x + b3,
/// g = min(a, limit), u = min(max(b, -limit), limit), h = g σ(alpha g) (u + up_shift),
/// W2 h + b2 (the biases when Form::biases). Routed experts only.
template <class Form>
struct expert_math<expert::clamped_glu<Form>> {
  static void hidden(const full_weights& w, index_t e, const float* x, std::vector<double>& a,
                     std::vector<double>& b) {
    const index_t H = w.cfg.hidden, F = w.cfg.ffn;
    for (index_t f = 0; f < F; ++f) {
      double sa = Form::biases ? double{w.b1[e * F + f]} : 0.0;
      double sb = Form::biases ? double{w.b3[e * F + f]} : 0.0;
      for (index_t i = 0; i < H; ++i) {
        sa += double{w.w1[(e * F + f) * H + i]} * x[i];
        sb += double{w.w3[(e * F + f) * H + i]} * x[i];
      }
      a[f] = sa, b[f] = sb;
    }
  }
  static double gated(double a, double b) {
    const double lim = Form::limit, g = std::min(a, lim), u = std::min(std::max(b, -lim), lim);
    return g / (1.0 + std::exp(-double{Form::alpha} * g)) * (u + double{Form::up_shift});
  }
  static void add(const full_weights& w, expert_ref which, const float* x, double scale,
                  std::span<double> out) {
    const index_t F = w.cfg.ffn, e = which.index;
    std::vector<double> a(F), b(F), h(F);
    hidden(w, e, x, a, b);
    for (index_t f = 0; f < F; ++f) h[f] = gated(a[f], b[f]);
    const detail::expert_rows rows{nullptr, nullptr, w.w2.data() + e * w.cfg.hidden * F,
                                   nullptr, nullptr, F};
    detail::down(rows, h, Form::biases ? w.b2.data() + e * w.cfg.hidden : nullptr, scale, out);
  }
};

}  // namespace epmoe::reference
