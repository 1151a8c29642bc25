// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The float64 backward of each router (reference/backward.hpp): routing_grad overloads.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/reference/expert_backward.hpp"
#include "epmoe/reference/routing.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::reference {

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

/// GPT-OSS: w = softmax over the chosen S of l = x Wᵀ + b (S fixed): dl_j = w_j (g_j - Σ_k
/// w_k g_k) for j ∈ S, 0 elsewhere; db += Σ_t dl, then the gate's projection.
template <int K>
void routing_grad(const router::logit_bias<router::topk_softmax<K, true>>& r, const rank_batch& b,
                  const rank_routing& route, std::span<const double> dweights, gradients& g,
                  std::span<double> dx) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const rank_routing fwd = routing_of(r, b);
  std::vector<double> dl(static_cast<std::size_t>(T * E), 0.0);
  for (index_t t = 0; t < T; ++t) {
    const std::int32_t* ids = &route.ids[t * route.width];
    const double* gk = &dweights[t * route.width];
    double wg = 0;
    for (int k = 0; k < K; ++k) wg += fwd.weights[t * K + k] * gk[k];
    for (int k = 0; k < K; ++k) dl[t * E + ids[k]] = fwd.weights[t * K + k] * (gk[k] - wg);
  }
  for (index_t t = 0; t < T; ++t)
    for (index_t e = 0; e < E; ++e) g.dgate_bias[e] += dl[t * E + e];
  detail::project_grad(b, b.w->gate, dl, g.dgate, dx);
}

/// Scored routers (biased: sigmoid_bias, DeepSeek-V4, ERNIE 4.5, ...; table): S fixed (the
/// bias and the table get no gradient), w_k = c s_k / D (routing_scored.hpp); dL/ds from the
/// weights, then the score's backward (softmax: into all E logits).
template <int K, class Score, router::select_on Select>
void routing_grad(const router::biased<K, Score, Select>& r, const rank_batch& b,
                  const rank_routing& route, std::span<const double> dweights, gradients& g,
                  std::span<double> dx) {
  detail::project_grad(b, b.w->gate, detail::scored_logits_grad<Score>(r, b, route, dweights),
                       g.dgate, dx);
}
template <int K, class Score>
void routing_grad(const router::table<K, Score>& r, const rank_batch& b, const rank_routing& route,
                  std::span<const double> dweights, gradients& g, std::span<double> dx) {
  detail::project_grad(b, b.w->gate, detail::scored_logits_grad<Score>(r, b, route, dweights),
                       g.dgate, dx);
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
/// One rank's batch as route_ranks builds it; `cfg` the router's (w.cfg.router_view(): E + Z
/// experts scored), which must outlive the batch.
inline rank_batch batch_of(const full_weights& w, const layer_config& cfg,
                           matrix_view<const float> x, std::size_t rank, index_t t0, index_t tokens,
                           const pass_options& opt) {
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

}  // namespace epmoe::reference
