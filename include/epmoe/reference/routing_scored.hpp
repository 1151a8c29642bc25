// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The scored routers (router::biased: DeepSeek-V3/V4, ERNIE 4.5, LFM2-MoE, Kolibri, Llama 4,
// LongCat-Flash; router::table: DeepSeek-V4's hash layers) in float64, from their formulas
// (docs/routers.md): a router object is read for its parameters only.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/reference/routing.hpp"
#include "epmoe/router/biased.hpp"
#include "epmoe/router/table.hpp"

namespace epmoe::reference {
namespace detail {

/// s = score(l) over one token's E logits: σ(l), sqrt(log(1 + e^l)), or softmax(l).
template <class Score>
std::vector<double> scores(std::span<const double> l) {
  if constexpr (std::is_same_v<Score, router::score::softmax>) {
    return softmax(l);
  } else {
    std::vector<double> s(l.size());
    for (std::size_t e = 0; e < l.size(); ++e)
      s[e] =
          std::is_same_v<Score, router::score::sigmoid> ? sigmoid(l[e]) : std::sqrt(softplus(l[e]));
    return s;
  }
}

/// dL/dl [E] of one token from dL/ds [E] (ds zero off the chosen experts): softmax's
/// p ⊙ (ds - p · ds); σ' = σ (1 - σ); (sqrt(softplus))' = σ(l) / (2 sqrt(softplus(l))).
template <class Score>
void scores_grad(std::span<const double> l, std::span<const double> ds, std::span<double> dl) {
  if constexpr (std::is_same_v<Score, router::score::softmax>) {
    const auto p = softmax(l);
    double dot = 0;
    for (std::size_t e = 0; e < l.size(); ++e) dot += p[e] * ds[e];
    for (std::size_t e = 0; e < l.size(); ++e) dl[e] += p[e] * (ds[e] - dot);
  } else {
    for (std::size_t e = 0; e < l.size(); ++e) {
      if (ds[e] == 0.0) continue;
      double d;
      if (std::is_same_v<Score, router::score::sigmoid>) {
        d = sigmoid(l[e]) * (1.0 - sigmoid(l[e]));
      } else {
        const double r = std::sqrt(softplus(l[e]));
        d = r > 0 ? sigmoid(l[e]) / (2.0 * r) : 0.0;
      }
      dl[e] += ds[e] * d;
    }
  }
}

/// The chosen scores' weights: c s_k / D, D = max(Σ_k s_k + eps, norm_min) (normalize), else
/// D = 1.
inline double divisor_of(std::span<const double> chosen, bool normalize, double eps,
                         double norm_min) {
  if (!normalize) return 1.0;
  return std::max(std::accumulate(chosen.begin(), chosen.end(), 0.0) + eps, norm_min);
}

/// dL/ds_j of w_k = c s_k / D for g = dL/dw: c / D (g_j - Σ_k g_k s_k / D) while D moves with
/// the sum; c g_j / D where D is a constant (the norm_min clamp holds, or no normalisation).
inline std::vector<double> weights_grad(std::span<const double> chosen, std::span<const double> g,
                                        bool normalize, double eps, double norm_min, double c) {
  const double sum = std::accumulate(chosen.begin(), chosen.end(), 0.0) + eps;
  const bool moves = normalize && sum >= norm_min;
  const double d = divisor_of(chosen, normalize, eps, norm_min);
  double gs = 0;
  for (std::size_t k = 0; k < chosen.size(); ++k) gs += g[k] * chosen[k];
  std::vector<double> ds(chosen.size());
  for (std::size_t k = 0; k < chosen.size(); ++k) ds[k] = c / d * (g[k] - (moves ? gs / d : 0.0));
  return ds;
}

}  // namespace detail

/// Scored with a selection bias: s = score(l); the K best keys (s or l) + b (b zero when
/// unset) inside the kept groups, a group's score the sum of its two best keys (group_mask
/// zero: the K best of all, dropped groups' keys 0.0); weights scaling · s_k / D. The bias
/// moves the selection only.
template <int K, class Score, router::select_on Select>
rank_routing routing_of(const router::biased<K, Score, Select>& r, const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  rank_routing out(T, K);
  std::vector<double> key(static_cast<std::size_t>(E)), chosen(K);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E);
    const auto s = detail::scores<Score>(row);
    for (index_t e = 0; e < E; ++e)
      key[e] = (Select == router::select_on::scores ? s[e] : row[e]) +
               (r.bias ? double{r.bias[e]} : 0.0);
    const auto ids =
        detail::group_limited_best(key, K, r.groups, r.top_groups, detail::sum_of, r.group_mask);
    for (int k = 0; k < K; ++k) chosen[k] = s[ids[k]];
    const double d = detail::divisor_of(chosen, r.normalize, r.eps, r.norm_min);
    for (int k = 0; k < K; ++k) {
      out.id(t, k) = ids[k];
      out.weight(t, k) = double{r.scaling} * chosen[k] / d;
    }
  }
  return out;
}

/// Table: ids = table[token id] (row-major [vocab, K]); weights scaling · s_k / D with s the
/// gate's scores at those experts.
template <int K, class Score>
rank_routing routing_of(const router::table<K, Score>& r, const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  rank_routing out(T, K);
  std::vector<double> chosen(K);
  for (index_t t = 0; t < T; ++t) {
    if (b.token[t] < 0 || b.token[t] >= r.vocab)
      throw config_error("token_ids[" + std::to_string(t) + "]", std::to_string(b.token[t]),
                         "must be in [0, router.vocab) (reference::routing_of(table))");
    const auto s = detail::scores<Score>(
        std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E));
    for (int k = 0; k < K; ++k) chosen[k] = s[r.ids[b.token[t] * K + k]];
    const double d = detail::divisor_of(chosen, r.normalize, r.eps, r.norm_min);
    for (int k = 0; k < K; ++k) {
      out.id(t, k) = r.ids[b.token[t] * K + k];
      out.weight(t, k) = double{r.scaling} * chosen[k] / d;
    }
  }
  return out;
}

namespace detail {
/// dL/dlogits [T, E] of a scored routing whose choice `route` is fixed.
template <class Score, class Router>
std::vector<double> scored_logits_grad(const Router& r, const rank_batch& b,
                                       const rank_routing& route,
                                       std::span<const double> dweights) {
  const index_t T = b.tokens, E = b.cfg->experts, K = route.width;
  const auto l = project(b, b.w->gate);
  std::vector<double> dl(l.size(), 0.0), ds(static_cast<std::size_t>(E)), chosen(K);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E);
    const auto s = scores<Score>(row);
    for (index_t k = 0; k < K; ++k) chosen[k] = s[route.ids[t * K + k]];
    const auto dsk =
        weights_grad(chosen, dweights.subspan(t * K, K), r.normalize, r.eps, r.norm_min, r.scaling);
    std::fill(ds.begin(), ds.end(), 0.0);
    for (index_t k = 0; k < K; ++k) ds[route.ids[t * K + k]] += dsk[k];
    scores_grad<Score>(row, ds, std::span<double>(dl).subspan(static_cast<std::size_t>(t * E), E));
  }
  return dl;
}

/// The score of a scored router (void for others): what loss_probabilities normalises.
template <int K, class S, router::select_on Sel>
S score_of(const router::biased<K, S, Sel>*);
template <int K, class S>
S score_of(const router::table<K, S>*);
void score_of(const void*);
template <class Router>
using score_of_t = decltype(score_of(static_cast<const Router*>(nullptr)));
}  // namespace detail

}  // namespace epmoe::reference
