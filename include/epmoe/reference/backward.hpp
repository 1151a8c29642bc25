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
#include "epmoe/reference/experts.hpp"
#include "epmoe/reference/forward.hpp"
#include "epmoe/reference/routing.hpp"
#include "epmoe/reference/weights.hpp"

// The float64 backward of reference::forward (docs/training.md): the gradient of
// L = Σ dy ⊙ y with respect to every weight of full_weights and to x, written from the
// forward's formulas by hand (chain rule, loops in double), never through the layer's code.
// The routing decisions (which experts, which assignments capacity drops) are piecewise
// constant: they are recomputed as the forward makes them and held fixed, so gradients flow
// through the chosen experts and the routing weights only, and a dropped assignment
// contributes exactly zero.
namespace epmoe::reference {

/// dL/d(each weight of full_weights), same shapes, and dL/dx [sum(tokens_per_rank), H].
/// Tensors a configuration does not use (dw3 for expert::mlp, the biases for expert::glu,
/// shared_* without shared experts, shared_gate, output_bias, noise_gate) stay zero.
struct gradients {
  std::vector<double> dgate;                   // [E, H]
  std::vector<double> dw1, dw3, dw2;           // [E, F, H], [E, F, H], [E, H, F]
  std::vector<double> db1, db2;                // [E, F], [E, H]
  std::vector<double> dshared_w1, dshared_w3;  // [N, Fs, H]
  std::vector<double> dshared_w2;              // [N, H, Fs]
  std::vector<double> dshared_b1, dshared_b2;  // [N, Fs], [N, H]
  std::vector<double> dshared_gate;            // [N, H]
  std::vector<double> doutput_bias;            // [H]
  std::vector<double> dnoise_gate;             // [E, H] (noisy top-k while training)
  std::vector<double> dx;                      // [tokens, H]

  /// All zero, shaped for cfg and `tokens` rows of x.
  static gradients zeros(const layer_config& cfg, index_t tokens) {
    const std::size_t E = cfg.experts, H = cfg.hidden, F = cfg.ffn;
    const std::size_t N = cfg.shared_experts, Fs = cfg.shared_width();
    gradients g;
    g.dgate.assign(E * H, 0.0);
    g.dw1.assign(E * F * H, 0.0);
    g.dw3.assign(E * F * H, 0.0);
    g.dw2.assign(E * H * F, 0.0);
    g.db1.assign(E * F, 0.0);
    g.db2.assign(E * H, 0.0);
    g.dshared_w1.assign(N * Fs * H, 0.0);
    g.dshared_w3.assign(N * Fs * H, 0.0);
    g.dshared_w2.assign(N * H * Fs, 0.0);
    g.dshared_b1.assign(N * Fs, 0.0);
    g.dshared_b2.assign(N * H, 0.0);
    g.dshared_gate.assign(N * H, 0.0);
    g.doutput_bias.assign(H, 0.0);
    g.dnoise_gate.assign(E * H, 0.0);
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

// ---- routers --------------------------------------------------------------------------
// routing_grad(router, batch, routing, dweights, g, dx): dweights [T, width] holds dL/d(each
// routing weight of `routing`, the batch's routing as routing_of made it; zero for an empty
// or dropped slot); adds dL/dgate (and dL/dnoise_gate) into g and dL/d(batch.x) into dx
// [T, H]. The selection is held fixed.

namespace detail {
/// logits = x · gateᵀ: dgate += dlᵀ x, dx += dl · gate, for dl [T, E].
inline void project_grad(const rank_batch& b, const std::vector<float>& weight,
                         const std::vector<double>& dl, std::vector<double>& dweight,
                         std::span<double> dx) {
  const index_t T = b.tokens, H = b.cfg->hidden, E = b.cfg->experts;
  for (index_t t = 0; t < T; ++t)
    for (index_t e = 0; e < E; ++e) {
      const double d = dl[t * E + e];
      if (d == 0.0) continue;
      for (index_t h = 0; h < H; ++h) {
        dweight[e * H + h] += d * b.x[t * H + h];
        dx[t * H + h] += d * double{weight[e * H + h]};
      }
    }
}

/// softmax's backward: dl_e += p_e (dp_e - Σ_j p_j dp_j).
inline void softmax_grad(std::span<const double> p, std::span<const double> dp,
                         std::span<double> dl) {
  double dot = 0;
  for (std::size_t j = 0; j < p.size(); ++j) dot += p[j] * dp[j];
  for (std::size_t e = 0; e < p.size(); ++e) dl[e] += p[e] * (dp[e] - dot);
}
}  // namespace detail

/// Softmax top-K: p = softmax(l), S the chosen K (fixed), c = scaling. Not renormalised:
/// w_k = c p_k, so dL/dp_k = c g_k. Renormalised by n = (Σ_{j∈S} p_j^q)^(1/q) (q = norm_p):
/// w_k = c p_k / n, ∂n/∂p_j = n^(1-q) p_j^(q-1), so
/// dL/dp_j = (c / n) (g_j - (Σ_k g_k p_k / n) n^(1-q) p_j^(q-1)) for j ∈ S (q = 1: the
/// softmax over S alone). Then dl = p ⊙ (dp - (p · dp)) over all E logits.
template <int K, bool Renormalize>
void routing_grad(const router::topk_softmax<K, Renormalize>& r, const rank_batch& b,
                  const rank_routing& route, std::span<const double> dweights, gradients& g,
                  std::span<double> dx) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  std::vector<double> dl(l.size(), 0.0), dp(static_cast<std::size_t>(E));
  const double c = r.scaling, q = r.norm_p;
  for (index_t t = 0; t < T; ++t) {
    const auto p = detail::softmax(std::span<const double>(l).subspan(t * E, E));
    std::fill(dp.begin(), dp.end(), 0.0);
    const std::int32_t* ids = &route.ids[t * route.width];
    const double* gk = &dweights[t * route.width];
    if (Renormalize) {
      double n = 0;
      for (int k = 0; k < K; ++k) n += std::pow(p[ids[k]], q);
      n = std::pow(n, 1.0 / q);
      double gp = 0;
      for (int k = 0; k < K; ++k) gp += gk[k] * p[ids[k]];
      for (int k = 0; k < K; ++k) {
        const int j = ids[k];
        dp[j] = c / n * (gk[k] - gp / n * std::pow(n, 1.0 - q) * std::pow(p[j], q - 1.0));
      }
    } else {
      for (int k = 0; k < K; ++k) dp[ids[k]] = c * gk[k];
    }
    detail::softmax_grad(p, dp, std::span<double>(dl).subspan(t * E, E));
  }
  detail::project_grad(b, b.w->gate, dl, g.dgate, dx);
}

/// Sigmoid + bias: s = σ(l), S chosen on s + bias (fixed; the bias gets no gradient),
/// c = scaling. normalize: w_k = c s_k / Σ_{j∈S} s_j, dL/ds_j = (c / Σ) (g_j - Σ_k g_k w_k / c);
/// else w_k = c s_k, dL/ds_j = c g_j. Then dl_j = dL/ds_j s_j (1 - s_j).
template <int K>
void routing_grad(const router::sigmoid_bias<K>& r, const rank_batch& b, const rank_routing& route,
                  std::span<const double> dweights, gradients& g, std::span<double> dx) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  std::vector<double> dl(l.size(), 0.0);
  const double c = r.scaling;
  for (index_t t = 0; t < T; ++t) {
    const std::int32_t* ids = &route.ids[t * route.width];
    const double* gk = &dweights[t * route.width];
    double sum = 0, gs = 0;
    for (int k = 0; k < K; ++k) {
      const double s = detail::sigmoid(l[t * E + ids[k]]);
      sum += s;
      gs += gk[k] * s;
    }
    for (int k = 0; k < K; ++k) {
      const double s = detail::sigmoid(l[t * E + ids[k]]);
      const double ds = r.normalize ? c / sum * (gk[k] - gs / sum) : c * gk[k];
      dl[t * E + ids[k]] += ds * s * (1.0 - s);
    }
  }
  detail::project_grad(b, b.w->gate, dl, g.dgate, dx);
}

/// Hash: the weights 1/K are constants and there is no gate: no gradient.
template <int K>
void routing_grad(const router::hash<K>&, const rank_batch&, const rank_routing&,
                  std::span<const double>, gradients&, std::span<double>) {}

/// Expert choice: w[t, e] = softmax(l_t)_e for the chosen (t, e) (fixed); softmax's backward
/// per token with dp_e = g[t, e] where e chose t, else 0.
inline void routing_grad(const router::expert_choice&, const rank_batch& b,
                         const rank_routing& route, std::span<const double> dweights, gradients& g,
                         std::span<double> dx) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  std::vector<double> dl(l.size(), 0.0), dp(static_cast<std::size_t>(E));
  for (index_t t = 0; t < T; ++t) {
    const auto p = detail::softmax(std::span<const double>(l).subspan(t * E, E));
    for (index_t e = 0; e < E; ++e)
      dp[e] = route.ids[t * route.width + e] == no_expert ? 0.0 : dweights[t * route.width + e];
    detail::softmax_grad(p, dp, std::span<double>(dl).subspan(t * E, E));
  }
  detail::project_grad(b, b.w->gate, dl, g.dgate, dx);
}

/// Noisy top-K: H = l + z ⊙ softplus(n) while training (z the same draws as the forward,
/// n = x W_noiseᵀ), else H = l; w = softmax over the chosen K of H: dH_k = w_k (g_k - Σ_j
/// w_j g_j) on the chosen, dl = dH, dn = dH z σ(n) (softplus' = σ).
template <int K>
void routing_grad(const router::noisy_topk<K>& r, const rank_batch& b, const rank_routing& route,
                  std::span<const double> dweights, gradients& g, std::span<double> dx) {
  const index_t T = b.tokens, E = b.cfg->experts;
  std::vector<double> dl(static_cast<std::size_t>(T * E), 0.0), dn(dl.size(), 0.0);
  std::vector<double> n;
  if (r.training) n = detail::project(b, b.w->noise_gate);
  for (index_t t = 0; t < T; ++t) {
    const double* w = &route.weights[t * route.width];
    const double* gk = &dweights[t * route.width];
    double gw = 0;
    for (int k = 0; k < K; ++k) gw += w[k] * gk[k];
    for (int k = 0; k < K; ++k) {
      const int e = route.ids[t * route.width + k];
      const double dh = w[k] * (gk[k] - gw);
      dl[t * E + e] += dh;
      if (r.training) {
        const double z = draws::normal(draws::bits(
            r.seed, b.pass, static_cast<std::uint64_t>(b.token[t]), static_cast<std::uint64_t>(e)));
        dn[t * E + e] += dh * z * detail::sigmoid(n[t * E + e]);
      }
    }
  }
  detail::project_grad(b, b.w->gate, dl, g.dgate, dx);
  if (r.training) detail::project_grad(b, b.w->noise_gate, dn, g.dnoise_gate, dx);
}

/// Sinkhorn: the balanced scores choose (fixed); the weights are softmax(l)_k (K > 1, its
/// backward with dp_k = g_k) or σ(l_k) (K = 1: dl_k = g_k σ (1 - σ)).
template <int K>
void routing_grad(const router::sinkhorn<K>&, const rank_batch& b, const rank_routing& route,
                  std::span<const double> dweights, gradients& g, std::span<double> dx) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  std::vector<double> dl(l.size(), 0.0), dp(static_cast<std::size_t>(E));
  for (index_t t = 0; t < T; ++t) {
    if (K == 1) {
      const int e = route.ids[t * route.width];
      const double s = detail::sigmoid(l[t * E + e]);
      dl[t * E + e] += dweights[t * route.width] * s * (1.0 - s);
      continue;
    }
    const auto p = detail::softmax(std::span<const double>(l).subspan(t * E, E));
    std::fill(dp.begin(), dp.end(), 0.0);
    for (int k = 0; k < K; ++k) dp[route.ids[t * route.width + k]] = dweights[t * route.width + k];
    detail::softmax_grad(p, dp, std::span<double>(dl).subspan(t * E, E));
  }
  detail::project_grad(b, b.w->gate, dl, g.dgate, dx);
}

template <class Router>
concept router_with_gradient = requires(const Router& r, const rank_batch& b,
                                        const rank_routing& route, std::span<const double> d,
                                        gradients& g, std::span<double> dx) {
  routing_grad(r, b, route, d, g, dx);
};

/// Switch input jitter: the gate sees x ⊙ m (m the forward's draws); the inner router's
/// gradient on that input, its dx contribution times m.
template <class Inner>
requires router_with_gradient<Inner>
void routing_grad(const router::jitter<Inner>& j, const rank_batch& b, const rank_routing& route,
                  std::span<const double> dweights, gradients& g, std::span<double> dx) {
  const Inner& inner = j;
  if (!j.training) return routing_grad(inner, b, route, dweights, g, dx);
  rank_batch jittered = b;
  const index_t H = b.cfg->hidden;
  const double eps = j.eps;
  std::vector<double> m(b.x.size()), dxj(b.x.size(), 0.0);
  for (index_t t = 0; t < b.tokens; ++t)
    for (index_t h = 0; h < H; ++h) {
      const double u = draws::uniform(draws::bits(
          j.seed, b.pass, static_cast<std::uint64_t>(b.token[t]), static_cast<std::uint64_t>(h)));
      m[t * H + h] = 1.0 - eps + 2.0 * eps * u;
      jittered.x[t * H + h] *= m[t * H + h];
    }
  routing_grad(inner, jittered, route, dweights, g, dxj);
  for (std::size_t i = 0; i < dxj.size(); ++i) dx[i] += dxj[i] * m[i];
}

namespace detail {
/// One rank's batch as route_ranks builds it.
inline rank_batch batch_of(const full_weights& w, matrix_view<const float> x, std::size_t rank,
                           index_t t0, index_t tokens, const pass_options& opt) {
  const layer_config& cfg = w.cfg;
  const index_t H = cfg.hidden;
  rank_batch b{&cfg, &w, tokens, {}, {}, opt.pass};
  b.x.resize(static_cast<std::size_t>(tokens * H));
  b.token.resize(static_cast<std::size_t>(tokens));
  for (index_t t = 0; t < tokens; ++t) {
    for (index_t h = 0; h < H; ++h) b.x[t * H + h] = x(t0 + t, h);
    b.token[t] = opt.token_ids.empty() ? static_cast<std::int64_t>(rank) * cfg.max_tokens + t
                                       : opt.token_ids[t0 + t];
  }
  return b;
}
}  // namespace detail

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
                "routing_grad(const router::X&, ...) overload in reference/backward.hpp");
  const layer_config& cfg = w.cfg;
  const index_t H = cfg.hidden;
  index_t total = 0;
  for (index_t n : tokens_per_rank) total += n;
  gradients g = gradients::zeros(cfg, total);
  const auto routing = route_ranks(w, router, x, tokens_per_rank, opt);
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
      const rank_batch b = detail::batch_of(w, x, r, t0, route.tokens, opt);
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

// ---- router losses ----------------------------------------------------------------------
// The losses the layer reports per rank (core/losses.hpp, compute_losses), in double from
// their definitions, and their gradients. On one rank's T tokens with logits l [T, E] (the
// gate's input: jittered while a jitter router trains), probabilities p (the router's
// probabilities(): softmax(l); sigmoid_bias: σ(l) / Σ_e σ(l_e)) and the routing's ids:
//   z       = (1/T) Σ_t lse(l_t)²                       dz/dl[t, e] = (2/T) lse(l_t) softmax(l_t)_e
//   aux     = α E Σ_i f_i P_i over the whole pass        daux/dp[t, i] = α E f_i / T
//   seq_aux = mean over sequences of config.seq_len tokens (0: the pass) of the same
// with α = config.aux_loss_coef, f_i = (ids equal to i) / (n K), K = config.top_k, P_i the
// mean of p[., i] over the n tokens. f counts the selection: piecewise constant, no gradient.

/// The weight of each loss in the caller's total: Σ_ranks aux · aux_r + seq_aux · seq_aux_r +
/// z · z_r (1 adds the reported loss as it is).
using epmoe::loss_scales;  // core/losses.hpp: a plain struct of three coefficients

template <class Router>
concept router_with_losses = Router::uses_gate && has_probabilities<Router>;

namespace detail {
// True for sigmoid_bias<K> and types derived from it (jitter<sigmoid_bias<K>>, a model's
// alias): their probabilities are the normalised sigmoid.
template <int K>
std::true_type sigmoid_probabilities(const router::sigmoid_bias<K>*);
std::false_type sigmoid_probabilities(const void*);
template <class Router>
inline constexpr bool sigmoid_probabilities_v =
    decltype(sigmoid_probabilities(static_cast<const Router*>(nullptr)))::value;

/// The probabilities compute_losses uses: the router's probabilities(), softmax(l), or
/// σ(l) / Σ_e σ(l_e) for sigmoid_bias.
template <class Router>
std::vector<double> loss_probabilities(std::span<const double> l) {
  if constexpr (sigmoid_probabilities_v<Router>) {
    std::vector<double> p(l.size());
    double sum = 0;
    for (std::size_t e = 0; e < l.size(); ++e) sum += (p[e] = sigmoid(l[e]));
    for (double& v : p) v /= sum;
    return p;
  } else {
    return softmax(l);
  }
}
/// Their backward: dl += ∂p/∂l dp.
template <class Router>
void loss_probabilities_grad(std::span<const double> l, std::span<const double> dp,
                             std::span<double> dl) {
  if constexpr (sigmoid_probabilities_v<Router>) {
    // p_e = s_e / S: dL/ds_j = (dp_j - Σ_i dp_i p_i) / S, then ds/dl = s (1 - s).
    double sum = 0, dot = 0;
    for (double v : l) sum += sigmoid(v);
    for (std::size_t e = 0; e < l.size(); ++e) dot += dp[e] * sigmoid(l[e]) / sum;
    for (std::size_t e = 0; e < l.size(); ++e) {
      const double s = sigmoid(l[e]);
      dl[e] += (dp[e] - dot) / sum * s * (1.0 - s);
    }
  } else {
    softmax_grad(softmax(l), dp, dl);
  }
}

/// The gate's input for the losses: the batch, jittered while a jitter router trains (m the
/// factors, empty otherwise).
template <class Router>
rank_batch loss_batch(const Router&, const rank_batch& b, std::vector<double>&) {
  return b;
}
template <class Inner>
rank_batch loss_batch(const router::jitter<Inner>& j, const rank_batch& b, std::vector<double>& m) {
  if (!j.training) return b;
  rank_batch out = b;
  const index_t H = b.cfg->hidden;
  const double eps = j.eps;
  m.resize(b.x.size());
  for (index_t t = 0; t < b.tokens; ++t)
    for (index_t h = 0; h < H; ++h) {
      const double u = draws::uniform(draws::bits(
          j.seed, b.pass, static_cast<std::uint64_t>(b.token[t]), static_cast<std::uint64_t>(h)));
      m[t * H + h] = 1.0 - eps + 2.0 * eps * u;
      out.x[t * H + h] *= m[t * H + h];
    }
  return out;
}

inline double log_sum_exp_row(std::span<const double> v) {
  double m = minus_inf;
  for (double x : v) m = std::max(m, x);
  double s = 0;
  for (double x : v) s += std::exp(x - m);
  return m + std::log(s);
}

/// One rank's losses and, when dl is not empty, their gradient with respect to the logits
/// (scaled by `scales`) added into dl [T, E].
template <class Router>
router_losses rank_losses(const Router&, const rank_batch& b, const rank_routing& route,
                          const loss_scales& scales, std::vector<double>& dl) {
  const layer_config& cfg = *b.cfg;
  const index_t T = b.tokens, E = cfg.experts, K = cfg.top_k;
  router_losses out;
  out.valid = true;
  if (T == 0) return out;
  const auto l = project(b, b.w->gate);
  std::vector<double> p(l.size()), dp(l.size(), 0.0);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(l).subspan(t * E, E);
    const auto pt = loss_probabilities<Router>(row);
    std::copy(pt.begin(), pt.end(), p.begin() + t * E);
    const double lse = log_sum_exp_row(row);
    out.z += lse * lse / static_cast<double>(T);
    if (!dl.empty()) {
      const auto q = softmax(row);
      for (index_t e = 0; e < E; ++e)
        dl[t * E + e] += scales.z * 2.0 / static_cast<double>(T) * lse * q[e];
    }
  }
  const double alpha = cfg.aux_loss_coef;
  // alpha E Σ_i f_i P_i over [begin, end), its gradient times `scale` into dp.
  const auto balance = [&](index_t begin, index_t end, double scale) {
    const auto n = static_cast<double>(end - begin);
    std::vector<double> f(static_cast<std::size_t>(E), 0.0), P(f.size(), 0.0);
    for (index_t t = begin; t < end; ++t) {
      for (index_t k = 0; k < route.width; ++k) {
        const std::int32_t e = route.ids[t * route.width + k];
        if (e >= 0 && e < E) f[e] += 1.0 / (n * static_cast<double>(K));
      }
      for (index_t e = 0; e < E; ++e) P[e] += p[t * E + e] / n;
    }
    double loss = 0;
    for (index_t e = 0; e < E; ++e) loss += f[e] * P[e];
    for (index_t t = begin; t < end; ++t)
      for (index_t e = 0; e < E; ++e) dp[t * E + e] += scale * alpha * E * f[e] / n;
    return alpha * static_cast<double>(E) * loss;
  };
  out.aux = balance(0, T, scales.aux);
  const index_t L = cfg.seq_len > 0 ? cfg.seq_len : T;
  const index_t sequences = (T + L - 1) / L;
  for (index_t s = 0; s < T; s += L)
    out.seq_aux += balance(s, std::min(T, s + L), scales.seq_aux / static_cast<double>(sequences)) /
                   static_cast<double>(sequences);
  if (!dl.empty())
    for (index_t t = 0; t < T; ++t)
      loss_probabilities_grad<Router>(std::span<const double>(l).subspan(t * E, E),
                                      std::span<const double>(dp).subspan(t * E, E),
                                      std::span<double>(dl).subspan(t * E, E));
  return out;
}
}  // namespace detail

/// The router losses of each rank (core/losses.hpp's definitions) in double, on the
/// reference's routing.
template <class Router>
std::vector<router_losses> losses(const full_weights& w, const Router& router,
                                  matrix_view<const float> x,
                                  std::span<const index_t> tokens_per_rank,
                                  const pass_options& opt = {}) {
  static_assert(router_with_losses<Router>,
                "reference::losses: this router reports no losses (no gate or no probabilities)");
  const auto routing = route_ranks(w, router, x, tokens_per_rank, opt);
  std::vector<router_losses> out;
  index_t t0 = 0;
  std::vector<double> none;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    std::vector<double> m;
    const rank_batch b =
        detail::loss_batch(router, detail::batch_of(w, x, r, t0, tokens_per_rank[r], opt), m);
    out.push_back(detail::rank_losses(router, b, routing[r], {}, none));
    t0 += tokens_per_rank[r];
  }
  return out;
}

/// The gradient of Σ_ranks scales.aux · aux_r + scales.seq_aux · seq_aux_r + scales.z · z_r
/// with respect to the gate and x (every other tensor zero): add it to backward's.
template <class Router>
gradients loss_backward(const full_weights& w, const Router& router, matrix_view<const float> x,
                        std::span<const index_t> tokens_per_rank, const loss_scales& scales,
                        const pass_options& opt = {}) {
  static_assert(router_with_losses<Router>,
                "reference::loss_backward: this router reports no losses (no gate or no "
                "probabilities)");
  const layer_config& cfg = w.cfg;
  const index_t H = cfg.hidden, E = cfg.experts;
  index_t total = 0;
  for (index_t n : tokens_per_rank) total += n;
  gradients g = gradients::zeros(cfg, total);
  const auto routing = route_ranks(w, router, x, tokens_per_rank, opt);
  index_t t0 = 0;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    const index_t T = tokens_per_rank[r];
    std::vector<double> m, dl(static_cast<std::size_t>(T * E), 0.0),
        dxb(static_cast<std::size_t>(T * H), 0.0);
    const rank_batch b = detail::loss_batch(router, detail::batch_of(w, x, r, t0, T, opt), m);
    detail::rank_losses(router, b, routing[r], scales, dl);
    detail::project_grad(b, w.gate, dl, g.dgate, dxb);
    for (std::size_t i = 0; i < dxb.size(); ++i)
      g.dx[t0 * H + i] += m.empty() ? dxb[i] : dxb[i] * m[i];
    t0 += T;
  }
  return g;
}

}  // namespace epmoe::reference
