// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <span>

#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/topk.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

/// Router losses of one pass over this rank's tokens (what a training loop adds to its loss).
struct router_losses {
  double aux = 0;      // Switch/GShard: alpha * E * sum_i f_i * P_i over the whole pass
  double seq_aux = 0;  // the same per sequence of config.seq_len tokens, averaged
  double z = 0;        // ST-MoE router z-loss: mean_t (logsumexp_e logits[t, e])^2
  bool valid = false;  // false when the router has no gate or no probabilities()
};

/// What a training loop's loss adds of each router loss (dL/d aux, dL/d seq_aux, dL/d z): the
/// layer's backward adds their gradient into the gate's (and x's). Zero: no loss gradient.
struct loss_scales {
  double aux = 0, seq_aux = 0, z = 0;
};

template <class R>
concept has_probabilities = requires(const R& r, const token_input& in, float* p) {
  r.probabilities(in, p);
};

namespace detail {
/// alpha * E * sum_i f_i * P_i for tokens [begin, end): f_i = assignments to i / (n * K),
/// P_i = mean probability of i. probs holds [n, E] probabilities of those tokens.
inline double balance_loss(routing_view routing, const float* probs, index_t begin, index_t end,
                           int experts, int top_k, double alpha, std::span<double> acc) {
  const index_t n = end - begin;
  if (n == 0) return 0;
  std::fill(acc.begin(), acc.end(), 0.0);
  double* f = acc.data();
  double* P = acc.data() + experts;
  for (index_t t = begin; t < end; ++t) {
    for (index_t k = 0; k < routing.ids.cols; ++k) {
      const int e = routing.ids(t, k);
      if (e >= 0 && e < experts) f[e] += 1;
    }
    for (int e = 0; e < experts; ++e) P[e] += probs[(t - begin) * experts + e];
  }
  double s = 0;
  for (int e = 0; e < experts; ++e) s += (f[e] / (double(n) * top_k)) * (P[e] / double(n));
  return alpha * experts * s;
}
}  // namespace detail

/// Computes the losses of one pass from its logits [T, E] and routing. scratch: T*E floats
/// (probabilities) and 2E doubles; sized once by the layer.
template <class Router>
void compute_losses(const Router& router, const layer_config& cfg, matrix_view<const float> logits,
                    routing_view routing, std::span<float> probs, std::span<double> acc,
                    router_losses& out) {
  out = {};
  if constexpr (Router::uses_gate && has_probabilities<Router>) {
    const index_t T = logits.rows;
    const int E = cfg.experts;
    out.valid = true;
    if (T == 0) return;
    double z = 0;
    for (index_t t = 0; t < T; ++t) {
      const double lse = math::log_sum_exp(logits.row(t), E);
      z += lse * lse;
      router.probabilities(token_input{logits.row(t), nullptr, E, t, 0}, probs.data() + t * E);
    }
    out.z = z / double(T);
    out.aux =
        detail::balance_loss(routing, probs.data(), 0, T, E, cfg.top_k, cfg.aux_loss_coef, acc);
    const index_t L = cfg.seq_len > 0 ? cfg.seq_len : T;
    double sum = 0;
    index_t sequences = 0;
    for (index_t b = 0; b < T; b += L, ++sequences)
      sum += detail::balance_loss(routing, probs.data() + b * E, b, std::min(T, b + L), E,
                                  cfg.top_k, cfg.aux_loss_coef, acc);
    out.seq_aux = sum / double(sequences);
  }
}

namespace detail {
/// Adds scale * dbalance/dp to dp for tokens [begin, end): d(alpha E Σ_i f_i P_i)/dp[t, i] =
/// alpha E f_i / n, f from the routing's ids (held fixed). acc: E doubles.
inline void balance_loss_grad(routing_view routing, index_t begin, index_t end, int experts,
                              int top_k, double alpha, double scale, float* dp,
                              std::span<double> acc) {
  const index_t n = end - begin;
  if (n == 0 || scale == 0) return;
  std::fill(acc.begin(), acc.begin() + experts, 0.0);
  for (index_t t = begin; t < end; ++t)
    for (index_t k = 0; k < routing.ids.cols; ++k) {
      const int e = routing.ids(t, k);
      if (e >= 0 && e < experts) acc[e] += 1;
    }
  for (index_t t = begin; t < end; ++t)
    for (int e = 0; e < experts; ++e)
      dp[t * experts + e] +=
          static_cast<float>(scale * alpha * experts * (acc[e] / (double(n) * top_k)) / double(n));
}
}  // namespace detail

/// dlogits [T, E] += the gradient of scales.aux * aux + scales.seq_aux * seq_aux + scales.z * z
/// (compute_losses' definitions; the routing's counts held fixed) on the host. scratch: T*E
/// floats (dL/dprobabilities) and E doubles.
/// A router whose losses have a gradient: its probabilities() has a backward.
template <class R>
concept has_probabilities_backward = requires(const R& r, const token_input& in, const float* dp,
                                              float* dl) {
  r.probabilities_backward(in, dp, dl);
};

template <class Router>
void loss_backward(const Router& router, const layer_config& cfg, matrix_view<const float> logits,
                   routing_view routing, const loss_scales& scales, matrix_view<float> dlogits,
                   std::span<float> dp, std::span<double> acc) {
  if constexpr (Router::uses_gate && has_probabilities_backward<Router>) {
    const index_t T = logits.rows;
    const int E = cfg.experts;
    if (T == 0) return;
    std::fill(dp.begin(), dp.begin() + T * E, 0.f);
    detail::balance_loss_grad(routing, 0, T, E, cfg.top_k, cfg.aux_loss_coef, scales.aux, dp.data(),
                              acc);
    const index_t L = cfg.seq_len > 0 ? cfg.seq_len : T;
    const index_t sequences = (T + L - 1) / L;
    for (index_t b = 0; b < T; b += L)
      detail::balance_loss_grad(routing, b, std::min(T, b + L), E, cfg.top_k, cfg.aux_loss_coef,
                                scales.seq_aux / double(sequences), dp.data(), acc);
    for (index_t t = 0; t < T; ++t) {
      const token_input in{logits.row(t), nullptr, E, t, 0};
      float* dl = dlogits.row(t);
      if (scales.aux != 0 || scales.seq_aux != 0)
        router.probabilities_backward(in, dp.data() + t * E, dl);
      if (scales.z != 0) {  // d(mean_t lse_t^2)/dl[t, e] = 2 lse_t softmax(l_t)_e / T
        const float lse = math::log_sum_exp(logits.row(t), E);
        for (int e = 0; e < E; ++e)
          dl[e] += static_cast<float>(scales.z * 2.0 * lse / double(T)) * expf(logits(t, e) - lse);
      }
    }
  }
}

}  // namespace epmoe
