// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/reference/expert_backward.hpp"
#include "epmoe/reference/weights.hpp"

// Llama 4's MoE block in float64, written from transformers 5.23's `Llama4TextMoe`,
// `Llama4Router` and `Llama4TextExperts`, not from the layer's code: the router's score scales
// each chosen expert's *input* (SwiGLU is not homogeneous: E(s x) != s E(x)).
namespace epmoe::reference {

namespace detail {
inline double silu_of(double a) { return a / (1.0 + std::exp(-a)); }
inline double silu_grad_of(double a) {
  const double s = 1.0 / (1.0 + std::exp(-a));
  return s * (1.0 + a * (1.0 - s));
}

/// One SwiGLU expert (W1, W3 [F, H], W2 [H, F]) on z [H]: out += W2 (silu(W1 z) ⊙ W3 z); with
/// dout, its backward: dW1, dW3, dW2 += (their terms), dz += W1ᵀ da + W3ᵀ db.
struct swiglu_ref {
  const float *w1, *w3, *w2;
  index_t H, F;
  void forward(const std::vector<double>& z, std::vector<double>& out) const {
    for (index_t f = 0; f < F; ++f) {
      double a = 0, b = 0;
      for (index_t i = 0; i < H; ++i)
        a += double{w1[f * H + i]} * z[i], b += double{w3[f * H + i]} * z[i];
      const double h = silu_of(a) * b;
      for (index_t o = 0; o < H; ++o) out[o] += double{w2[o * F + f]} * h;
    }
  }
  void backward(const std::vector<double>& z, const std::vector<double>& dout, double* dw1,
                double* dw3, double* dw2, std::vector<double>& dz) const {
    for (index_t f = 0; f < F; ++f) {
      double a = 0, b = 0, dh = 0;
      for (index_t i = 0; i < H; ++i)
        a += double{w1[f * H + i]} * z[i], b += double{w3[f * H + i]} * z[i];
      for (index_t o = 0; o < H; ++o) {
        dh += double{w2[o * F + f]} * dout[o];
        dw2[o * F + f] += dout[o] * silu_of(a) * b;
      }
      const double da = dh * b * silu_grad_of(a), db = dh * silu_of(a);
      for (index_t i = 0; i < H; ++i) {
        dw1[f * H + i] += da * z[i];
        dw3[f * H + i] += db * z[i];
        dz[i] += double{w1[f * H + i]} * da + double{w3[f * H + i]} * db;
      }
    }
  }
};
}  // namespace detail

/// What llama4_block returns: y [T, H] and, when dy was given, every gradient of
/// L = Σ dy ⊙ y (gate, routed and shared experts, x).
struct llama4_result {
  std::vector<double> y;
  gradients g;
};

/// Llama 4's block on every token of x [T, H] (all ranks at once: its routing is per token,
/// nothing is dropped): l = x W_gᵀ; S = the K largest l (ties to the lower id); s_e = σ(l_e);
/// y = Σ_{e∈S} W2_e (silu(W1_e s_e x) ⊙ W3_e s_e x) + Σ_n shared_n(x) (config shared_experts).
/// Backward, S fixed: d(in_e) from the expert's backward at s_e x; ds_e = ⟨x, d(in_e)⟩,
/// dx += s_e d(in_e); dl_e = ds_e s_e (1 - s_e), dW_g[e] += dl_e x, dx += dl_e W_g[e].
inline llama4_result llama4_block(const full_weights& w, int K, matrix_view<const float> x,
                                  matrix_view<const float> dy = {}) {
  const layer_config& cfg = w.cfg;
  const index_t T = x.rows, H = cfg.hidden, E = cfg.experts, F = cfg.ffn;
  const index_t N = cfg.shared_experts, Fs = cfg.shared_width();
  llama4_result r{std::vector<double>(static_cast<std::size_t>(T * H), 0.0),
                  gradients::zeros(cfg, T)};
  const bool back = dy.data != nullptr;
  std::vector<double> xt(H), z(H), out(H), dout(H), dz(H);
  for (index_t t = 0; t < T; ++t) {
    for (index_t i = 0; i < H; ++i) xt[i] = x(t, i);
    std::vector<double> l(E, 0.0);
    for (index_t e = 0; e < E; ++e)
      for (index_t i = 0; i < H; ++i) l[e] += double{w.gate[e * H + i]} * xt[i];
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
    std::fill(out.begin(), out.end(), 0.0);
    if (back)
      for (index_t o = 0; o < H; ++o) dout[o] = dy(t, o);
    double* dxt = r.g.dx.data() + t * H;
    for (int k = 0; k < K; ++k) {
      const int e = order[k];
      const double s = 1.0 / (1.0 + std::exp(-l[e]));
      for (index_t i = 0; i < H; ++i) z[i] = s * xt[i];
      const detail::swiglu_ref ex{w.w1.data() + e * F * H, w.w3.data() + e * F * H,
                                  w.w2.data() + e * H * F, H, F};
      ex.forward(z, out);
      if (!back) continue;
      std::fill(dz.begin(), dz.end(), 0.0);
      ex.backward(z, dout, r.g.dw1.data() + e * F * H, r.g.dw3.data() + e * F * H,
                  r.g.dw2.data() + e * H * F, dz);
      double ds = 0;
      for (index_t i = 0; i < H; ++i) ds += xt[i] * dz[i], dxt[i] += s * dz[i];
      const double dl = ds * s * (1.0 - s);
      for (index_t i = 0; i < H; ++i) {
        r.g.dgate[e * H + i] += dl * xt[i];
        dxt[i] += dl * double{w.gate[e * H + i]};
      }
    }
    for (index_t n = 0; n < N; ++n) {
      const detail::swiglu_ref sh{w.shared_w1.data() + n * Fs * H, w.shared_w3.data() + n * Fs * H,
                                  w.shared_w2.data() + n * H * Fs, H, Fs};
      sh.forward(xt, out);
      if (!back) continue;
      std::fill(dz.begin(), dz.end(), 0.0);
      sh.backward(xt, dout, r.g.dshared_w1.data() + n * Fs * H, r.g.dshared_w3.data() + n * Fs * H,
                  r.g.dshared_w2.data() + n * H * Fs, dz);
      for (index_t i = 0; i < H; ++i) dxt[i] += dz[i];
    }
    std::copy(out.begin(), out.end(), r.y.begin() + t * H);
  }
  return r;
}

}  // namespace epmoe::reference
