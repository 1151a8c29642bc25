// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/topk.hpp"

// Scoring functions s = score(logits) of the scored routers (router::biased, router::table),
// and the weights they make of the chosen scores. A score is a type: prepare() once per token
// (softmax's max and sum), at() per expert, and the backward from dL/ds into dL/dlogits.
namespace epmoe::router::score {

/// A score applied to each logit alone: Derived gives value(l) and derivative(l, s).
template <class Derived>
struct pointwise {
  struct state {};
  EPMOE_HD static state prepare(const float*, int) { return {}; }
  EPMOE_HD static float at(const state&, const float* l, int e) { return Derived::value(l[e]); }
  /// dl[E] = the backward of s at the n chosen ids (ids < 0 are empty) for ds[n]: overwrites.
  EPMOE_HD static void backward_at(const state&, const float* l, int E, const int* ids,
                                   const float* ds, int n, float* dl) {
    for (int e = 0; e < E; ++e) dl[e] = 0.f;
    for (int k = 0; k < n; ++k)
      if (ids[k] >= 0) {
        const float x = l[ids[k]];
        dl[ids[k]] = ds[k] * Derived::derivative(x, Derived::value(x));
      }
  }
  /// p[E] = s / Σ_e s_e (the router's probabilities for the sequence loss, DeepSeek-V3's).
  EPMOE_HD static void probabilities(const float* l, int E, float* p) {
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum += (p[e] = Derived::value(l[e]));
    for (int e = 0; e < E; ++e) p[e] /= sum;
  }
  /// dl[E] += their backward: ds_e = (dp_e - p · dp) / Σ s, dl_e += ds_e s'(l_e).
  EPMOE_HD static void probabilities_backward(const float* l, int E, const float* dp, float* dl) {
    float sum = 0.f, pdp = 0.f;
    for (int e = 0; e < E; ++e) sum += Derived::value(l[e]);
    for (int e = 0; e < E; ++e) pdp += Derived::value(l[e]) / sum * dp[e];
    for (int e = 0; e < E; ++e) {
      const float s = Derived::value(l[e]);
      dl[e] += (dp[e] - pdp) / sum * Derived::derivative(l[e], s);
    }
  }
};

/// s = σ(l) (DeepSeek-V3, MiniMax-M2, LFM2-MoE; Llama 4 and Kolibri weigh with it).
struct sigmoid : pointwise<sigmoid> {
  static constexpr const char* name = "sigmoid";
  EPMOE_HD static float value(float l) { return math::sigmoid(l); }
  EPMOE_HD static float derivative(float, float s) { return s * (1.f - s); }
};

/// s = sqrt(softplus(l)) (DeepSeek-V4's `sqrtsoftplus`): s' = σ(l) / (2 s). Far below zero
/// softplus(l) ≈ σ(l) ≈ e^l, so s' = s / 2 there: finite where s underflows to 0 (torch's
/// sqrt backward gives NaN at s = 0).
struct sqrtsoftplus : pointwise<sqrtsoftplus> {
  static constexpr const char* name = "sqrtsoftplus";
  EPMOE_HD static float value(float l) {
    const float a = l > 0.f ? l : -l;
    return sqrtf((l > 0.f ? l : 0.f) + log1pf(expf(-a)));
  }
  EPMOE_HD static float derivative(float l, float s) {
    return l < -15.f ? 0.5f * s : math::sigmoid(l) / (2.f * s);
  }
};

/// s = softmax(l) over all E logits (ERNIE 4.5, LongCat-Flash): every s depends on every
/// logit, so the backward of the chosen scores reaches all E logits.
struct softmax {
  static constexpr const char* name = "softmax";
  struct state {
    float max, denom;
  };
  EPMOE_HD static state prepare(const float* l, int E) {
    float max = -INFINITY, denom = 0.f;
    for (int e = 0; e < E; ++e) max = l[e] > max ? l[e] : max;
    for (int e = 0; e < E; ++e) denom += math::shifted_exp(l[e], max);
    return {max, denom};
  }
  EPMOE_HD static float at(const state& st, const float* l, int e) {
    return math::shifted_exp(l[e], st.max) / st.denom;
  }
  EPMOE_HD static void backward_at(const state&, const float* l, int E, const int* ids,
                                   const float* ds, int n, float* dl) {
    math::softmax_backward_at(l, E, ids, ds, n, 1.f, dl);
  }
  /// The probabilities are s itself (Σ s = 1), and their backward softmax's.
  EPMOE_HD static void probabilities(const float* l, int E, float* p) { math::softmax(l, E, p); }
  EPMOE_HD static void probabilities_backward(const float* l, int E, const float* dp, float* dl) {
    math::softmax_probabilities_backward(l, E, dp, dl);
  }
};

}  // namespace epmoe::router::score

namespace epmoe::router {

/// The chosen scores' divisor: normalize, D = max(Σ_k s_k + eps, norm_min) (DeepSeek-V4 adds
/// eps = 1e-20, LFM2-MoE 1e-6; ERNIE 4.5 clamps at moe_norm_min); else 1.
EPMOE_HD float score_divisor(const float* s, int n, bool normalize, float eps, float norm_min) {
  if (!normalize) return 1.f;
  float sum = 0.f;
  for (int k = 0; k < n; ++k) sum += s[k];
  sum += eps;
  return sum < norm_min ? norm_min : sum;
}

/// ds[n] = dL/ds of w_k = c s_k / D for g[n] = dL/dw: (c / D)(g_k - Σ_j g_j s_j / D) while D
/// follows the sum, c g_k / D where the norm_min clamp holds D (or no normalisation: D = 1).
EPMOE_HD void score_weights_backward(const float* s, const float* g, int n, bool normalize,
                                     float eps, float norm_min, float c, float* ds) {
  float sum = 0.f, gs = 0.f;
  for (int k = 0; k < n; ++k) sum += s[k], gs += g[k] * s[k];
  sum += eps;
  const bool follows = normalize && !(sum < norm_min);
  const float d = follows ? sum : (normalize ? norm_min : 1.f);
  for (int k = 0; k < n; ++k) ds[k] = c / d * (g[k] - (follows ? gs / d : 0.f));
}

}  // namespace epmoe::router
