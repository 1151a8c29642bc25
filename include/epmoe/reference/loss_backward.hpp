// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The router losses in float64 and their backward (reference/backward.hpp).

#include <cmath>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/reference/expert_backward.hpp"
#include "epmoe/reference/routing.hpp"
#include "epmoe/reference/routing_backward.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::reference {

// ---- router losses ----------------------------------------------------------------------
// The losses the layer reports per rank (core/losses.hpp, compute_losses), in double from
// their definitions, and their gradients. On one rank's T tokens with logits l [T, E] (the
// gate's input: jittered while a jitter router trains), probabilities p (the router's
// probabilities(): softmax(l); a scored router's s / Σ_e s_e) and the routing's ids:
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
// A scored router (sigmoid_bias, DeepSeek-V4, table, ... and types derived from them) has the
// normalised scores s / Σ s as its probabilities (softmax: the softmax); others the softmax.
template <class Router>
inline constexpr bool normalised_scores_v =
    !std::is_void_v<score_of_t<Router>> &&
    !std::is_same_v<score_of_t<Router>, router::score::softmax>;

/// The probabilities compute_losses uses: the router's probabilities(), softmax(l), or
/// s / Σ_e s_e for a scored router (sigmoid_bias: σ(l) / Σ_e σ(l_e)).
template <class Router>
std::vector<double> loss_probabilities(std::span<const double> l) {
  if constexpr (normalised_scores_v<Router>) {
    auto p = scores<score_of_t<Router>>(l);
    double sum = 0;
    for (double v : p) sum += v;
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
  if constexpr (normalised_scores_v<Router>) {
    // p_e = s_e / S: dL/ds_j = (dp_j - Σ_i dp_i p_i) / S, then the score's backward.
    const auto s = scores<score_of_t<Router>>(l);
    double sum = 0, dot = 0;
    for (double v : s) sum += v;
    for (std::size_t e = 0; e < l.size(); ++e) dot += dp[e] * s[e] / sum;
    std::vector<double> ds(l.size());
    for (std::size_t e = 0; e < l.size(); ++e) ds[e] = (dp[e] - dot) / sum;
    scores_grad<score_of_t<Router>>(l, ds, dl);
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
  auto l = project(b, b.w->gate);
  if constexpr (router_with_gate_bias<Router>)  // GPT-OSS: the losses see the biased logits
    for (index_t t = 0; t < T; ++t)
      for (index_t e = 0; e < E; ++e) l[t * E + e] += double{b.w->gate_bias[e]};
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
  const layer_config scored = w.cfg.router_view();
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    std::vector<double> m;
    const rank_batch b = detail::loss_batch(
        router, detail::batch_of(w, scored, x, r, t0, tokens_per_rank[r], opt), m);
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
  const layer_config cfg = w.cfg.router_view();  // the router scores E + Z experts
  const index_t H = cfg.hidden, E = cfg.experts;
  index_t total = 0;
  for (index_t n : tokens_per_rank) total += n;
  gradients g = gradients::zeros(w.cfg, total);
  const auto routing = route_ranks(w, router, x, tokens_per_rank, opt);
  index_t t0 = 0;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    const index_t T = tokens_per_rank[r];
    std::vector<double> m, dl(static_cast<std::size_t>(T * E), 0.0),
        dxb(static_cast<std::size_t>(T * H), 0.0);
    const rank_batch b = detail::loss_batch(router, detail::batch_of(w, cfg, x, r, t0, T, opt), m);
    detail::rank_losses(router, b, routing[r], scales, dl);
    detail::project_grad(b, w.gate, dl, g.dgate, dxb);
    if constexpr (router_with_gate_bias<Router>)
      for (index_t t = 0; t < T; ++t)
        for (index_t e = 0; e < E; ++e) g.dgate_bias[e] += dl[t * E + e];
    for (std::size_t i = 0; i < dxb.size(); ++i)
      g.dx[t0 * H + i] += m.empty() ? dxb[i] : dxb[i] * m[i];
    t0 += T;
  }
  return g;
}

}  // namespace epmoe::reference
