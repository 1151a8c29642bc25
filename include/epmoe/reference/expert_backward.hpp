// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The float64 backward of one expert (reference/backward.hpp): the gradients it adds into,
// each activation's derivative, and expert_grad<Expert> beside experts.hpp's expert_math.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/clamped_glu.hpp"
#include "epmoe/expert/mlp.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/reference/experts.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::reference {

/// dL/d(each weight of full_weights), same shapes, and dL/dx [sum(tokens_per_rank), H].
/// Tensors a configuration does not use (dw3 for expert::mlp, the biases for expert::glu,
/// shared_* without shared experts, shared_gate, output_bias, noise_gate) stay zero.
struct gradients {
  std::vector<double> dgate;                   // [E + Z, H]
  std::vector<double> dw1, dw3, dw2;           // [E, F, H], [E, F, H], [E, H, F]
  std::vector<double> db1, db2;                // [E, F], [E, H]
  std::vector<double> db3;                     // [E, F] (clamped_glu's up bias)
  std::vector<double> dgate_bias;              // [E + Z] (router::logit_bias)
  std::vector<double> dshared_w1, dshared_w3;  // [N, Fs, H]
  std::vector<double> dshared_w2;              // [N, H, Fs]
  std::vector<double> dshared_b1, dshared_b2;  // [N, Fs], [N, H]
  std::vector<double> dshared_gate;            // [N, H]
  std::vector<double> doutput_bias;            // [H]
  std::vector<double> dnoise_gate;             // [E + Z, H] (noisy top-k while training)
  std::vector<double> dx;                      // [tokens, H]

  /// All zero, shaped for cfg and `tokens` rows of x.
  static gradients zeros(const layer_config& cfg, index_t tokens) {
    const std::size_t E = cfg.experts, H = cfg.hidden, F = cfg.ffn;
    const std::size_t N = cfg.shared_experts, Fs = cfg.shared_width();
    const std::size_t S = cfg.scored_experts();  // the router's tensors
    gradients g;
    g.dgate.assign(S * H, 0.0);
    g.dw1.assign(E * F * H, 0.0);
    g.dw3.assign(E * F * H, 0.0);
    g.dw2.assign(E * H * F, 0.0);
    g.db1.assign(E * F, 0.0);
    g.db2.assign(E * H, 0.0);
    g.db3.assign(E * F, 0.0);
    g.dgate_bias.assign(S, 0.0);
    g.dshared_w1.assign(N * Fs * H, 0.0);
    g.dshared_w3.assign(N * Fs * H, 0.0);
    g.dshared_w2.assign(N * H * Fs, 0.0);
    g.dshared_b1.assign(N * Fs, 0.0);
    g.dshared_b2.assign(N * H, 0.0);
    g.dshared_gate.assign(N * H, 0.0);
    g.doutput_bias.assign(H, 0.0);
    g.dnoise_gate.assign(S * H, 0.0);
    g.dx.assign(static_cast<std::size_t>(tokens) * H, 0.0);
    return g;
  }
};

/// Each activation's derivative from its definition (experts.hpp's activation<Act>), in
/// double.
template <class Act>
struct activation_grad {
  static_assert(!std::is_same_v<Act, Act>,
                "reference::activation_grad has no float64 derivative for this activation: "
                "specialise reference::activation_grad<Act> with a static of(double)");
};
template <>
struct activation_grad<act::silu> {  // (a σ(a))' = σ(a) (1 + a (1 - σ(a)))
  static double of(double a) {
    const double s = 1.0 / (1.0 + std::exp(-a));
    return s * (1.0 + a * (1.0 - s));
  }
};
template <>
struct activation_grad<act::gelu> {  // (a Φ(a))' = Φ(a) + a φ(a)
  static double of(double a) {
    const double pi = 3.14159265358979323846;
    return 0.5 * (1.0 + std::erf(a / std::sqrt(2.0))) +
           a * std::exp(-0.5 * a * a) / std::sqrt(2.0 * pi);
  }
};
template <>
struct activation_grad<act::gelu_tanh> {  // u = c (a + 0.044715 a³), f = a (1 + tanh u) / 2
  static double of(double a) {
    const double pi = 3.14159265358979323846, c = std::sqrt(2.0 / pi);
    const double th = std::tanh(c * (a + 0.044715 * a * a * a));
    return 0.5 * (1.0 + th) + 0.5 * a * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * a * a);
  }
};
template <>
struct activation_grad<act::relu> {  // 1 for a > 0, else 0 (0 at the kink, as PyTorch)
  static double of(double a) { return a > 0 ? 1.0 : 0.0; }
};

namespace detail {
/// The gradient rows of one expert (routed or shared), as rows_of for the weights.
struct expert_grad_rows {
  double *w1, *w3, *w2, *b1, *b2;
};
inline expert_grad_rows grad_rows_of(gradients& g, const layer_config& cfg, expert_ref which) {
  const index_t H = cfg.hidden, F = which.shared ? cfg.shared_width() : cfg.ffn;
  const index_t i = which.index;
  return which.shared
             ? expert_grad_rows{g.dshared_w1.data() + i * F * H, g.dshared_w3.data() + i * F * H,
                                g.dshared_w2.data() + i * H * F, g.dshared_b1.data() + i * F,
                                g.dshared_b2.data() + i * H}
             : expert_grad_rows{g.dw1.data() + i * F * H, g.dw3.data() + i * F * H,
                                g.dw2.data() + i * H * F, g.db1.data() + i * F,
                                g.db2.data() + i * H};
}
}  // namespace detail

/// The backward of expert_math<Expert>::add (out += scale · Expert(x)) for an upstream
/// gradient dout [H]: adds dL/dW of the expert `which` into g, dL/dx into dx [H], and returns
/// dL/dscale = dout · Expert(x). Specialise per expert type next to expert_math.
template <class Expert>
struct expert_grad {
  static_assert(!std::is_same_v<Expert, Expert>,
                "reference::expert_grad has no float64 backward for this expert type: "
                "specialise reference::expert_grad<Expert> with a static add()");
};

/// Gated: a = W1 x, b = W3 x, h = act(a) b, o = W2 h; with d = scale · dout:
/// dW2 += d hᵀ, dh = W2ᵀ d, da = dh b act'(a), db = dh act(a), dW1 += da xᵀ, dW3 += db xᵀ,
/// dx += W1ᵀ da + W3ᵀ db.
template <class Act>
struct expert_grad<expert::glu<Act>> {
  static double add(const full_weights& w, expert_ref which, const float* x, double scale,
                    std::span<const double> dout, gradients& g, std::span<double> dx) {
    const index_t H = w.cfg.hidden;
    const detail::expert_rows e = detail::rows_of(w, which);
    const detail::expert_grad_rows d = detail::grad_rows_of(g, w.cfg, which);
    const index_t F = e.F;
    std::vector<double> a(F), b(F), h(F), dh(F, 0.0);
    for (index_t f = 0; f < F; ++f) {
      double sa = 0, sb = 0;
      for (index_t i = 0; i < H; ++i) {
        sa += double{e.w1[f * H + i]} * x[i];
        sb += double{e.w3[f * H + i]} * x[i];
      }
      a[f] = sa;
      b[f] = sb;
      h[f] = activation<Act>::of(sa) * sb;
    }
    double dscale = 0;
    for (index_t o = 0; o < H; ++o) {
      double out = 0;
      for (index_t f = 0; f < F; ++f) out += double{e.w2[o * F + f]} * h[f];
      dscale += dout[o] * out;
      const double dd = scale * dout[o];
      for (index_t f = 0; f < F; ++f) {
        d.w2[o * F + f] += dd * h[f];
        dh[f] += double{e.w2[o * F + f]} * dd;
      }
    }
    for (index_t f = 0; f < F; ++f) {
      const double da = dh[f] * b[f] * activation_grad<Act>::of(a[f]);
      const double db = dh[f] * activation<Act>::of(a[f]);
      for (index_t i = 0; i < H; ++i) {
        d.w1[f * H + i] += da * x[i];
        d.w3[f * H + i] += db * x[i];
        dx[i] += double{e.w1[f * H + i]} * da + double{e.w3[f * H + i]} * db;
      }
    }
    return dscale;
  }
};

/// Non-gated: a = W1 x + b1, h = act(a), o = W2 h + b2; with d = scale · dout: dW2 += d hᵀ,
/// db2 += d, da = (W2ᵀ d) act'(a), db1 += da, dW1 += da xᵀ, dx += W1ᵀ da (biases when Biases).
template <class Act, bool Biases>
struct expert_grad<expert::mlp<Act, Biases>> {
  static double add(const full_weights& w, expert_ref which, const float* x, double scale,
                    std::span<const double> dout, gradients& g, std::span<double> dx) {
    const index_t H = w.cfg.hidden;
    const detail::expert_rows e = detail::rows_of(w, which);
    const detail::expert_grad_rows d = detail::grad_rows_of(g, w.cfg, which);
    const index_t F = e.F;
    std::vector<double> a(F), h(F), dh(F, 0.0);
    for (index_t f = 0; f < F; ++f) {
      double s = Biases ? double{e.b1[f]} : 0.0;
      for (index_t i = 0; i < H; ++i) s += double{e.w1[f * H + i]} * x[i];
      a[f] = s;
      h[f] = activation<Act>::of(s);
    }
    double dscale = 0;
    for (index_t o = 0; o < H; ++o) {
      double out = Biases ? double{e.b2[o]} : 0.0;
      for (index_t f = 0; f < F; ++f) out += double{e.w2[o * F + f]} * h[f];
      dscale += dout[o] * out;
      const double dd = scale * dout[o];
      if (Biases) d.b2[o] += dd;
      for (index_t f = 0; f < F; ++f) {
        d.w2[o * F + f] += dd * h[f];
        dh[f] += double{e.w2[o * F + f]} * dd;
      }
    }
    for (index_t f = 0; f < F; ++f) {
      const double da = dh[f] * activation_grad<Act>::of(a[f]);
      if (Biases) d.b1[f] += da;
      for (index_t i = 0; i < H; ++i) {
        d.w1[f * H + i] += da * x[i];
        dx[i] += double{e.w1[f * H + i]} * da;
      }
    }
    return dscale;
  }
};

/// Clamped gated: with d = scale · dout, dW2 += d hᵀ, db2 += d, dh = W2ᵀ d; a clamp's
/// derivative is 1 inside its bounds (bounds included, as torch.clamp) and 0 outside:
/// da = dh (u + up_shift) [a <= limit] (σ(αg) + α g σ(αg)(1 - σ(αg))), db = dh g σ(αg)
/// [-limit <= b <= limit]; dW1 += da xᵀ, db1 += da, dW3 += db xᵀ, db3 += db,
/// dx += W1ᵀ da + W3ᵀ db.
template <class Form>
struct expert_grad<expert::clamped_glu<Form>> {
  static double add(const full_weights& w, expert_ref which, const float* x, double scale,
                    std::span<const double> dout, gradients& g, std::span<double> dx) {
    using M = expert_math<expert::clamped_glu<Form>>;
    const index_t H = w.cfg.hidden, F = w.cfg.ffn, e = which.index;
    std::vector<double> a(F), b(F), h(F), dh(F, 0.0);
    M::hidden(w, e, x, a, b);
    for (index_t f = 0; f < F; ++f) h[f] = M::gated(a[f], b[f]);
    const float* w2 = w.w2.data() + e * H * F;
    double dscale = 0;
    for (index_t o = 0; o < H; ++o) {
      double out = Form::biases ? double{w.b2[e * H + o]} : 0.0;
      for (index_t f = 0; f < F; ++f) out += double{w2[o * F + f]} * h[f];
      dscale += dout[o] * out;
      const double dd = scale * dout[o];
      if (Form::biases) g.db2[e * H + o] += dd;
      for (index_t f = 0; f < F; ++f) {
        g.dw2[(e * H + o) * F + f] += dd * h[f];
        dh[f] += double{w2[o * F + f]} * dd;
      }
    }
    const double lim = Form::limit, alpha = Form::alpha;
    for (index_t f = 0; f < F; ++f) {
      const double gv = std::min(a[f], lim), u = std::min(std::max(b[f], -lim), lim);
      const double s = 1.0 / (1.0 + std::exp(-alpha * gv));
      const double da =
          a[f] <= lim ? dh[f] * (u + double{Form::up_shift}) * (s + alpha * gv * s * (1.0 - s))
                      : 0.0;
      const double db = (b[f] >= -lim && b[f] <= lim) ? dh[f] * gv * s : 0.0;
      if (Form::biases) g.db1[e * F + f] += da, g.db3[e * F + f] += db;
      for (index_t i = 0; i < H; ++i) {
        g.dw1[(e * F + f) * H + i] += da * x[i];
        g.dw3[(e * F + f) * H + i] += db * x[i];
        dx[i] += double{w.w1[(e * F + f) * H + i]} * da + double{w.w3[(e * F + f) * H + i]} * db;
      }
    }
    return dscale;
  }
};

}  // namespace epmoe::reference
