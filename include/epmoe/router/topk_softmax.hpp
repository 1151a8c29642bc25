// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/macros.hpp"
#include "epmoe/core/topk.hpp"

namespace epmoe::router {

/// Softmax over all E gate logits, then the top-K experts.
/// Renormalize = true: the K weights are divided by their sum (Mixtral; equal to a softmax
/// over just the K chosen logits). false: the K softmax probabilities as they are
/// (Switch / GShard / Qwen `norm_topk_prob = false`).
/// The gate is a learned [E, H] matrix; the layer computes logits = x * gate^T.
template <int K, bool Renormalize = true>
struct topk_softmax {
  static_assert(K >= 1, "router::topk_softmax<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;

  /// logits[E] -> ids[K] (distinct, best first) and weights[K].
  EPMOE_HD void route_token(const float* logits, int num_experts, int* ids, float* weights) const {
    float best[K] = {};
    math::top_k<K>(logits, num_experts, ids, best);
    const float max = best[0];
    float denom = 0.f;
    for (int e = 0; e < num_experts; ++e) denom += math::shifted_exp(logits[e], max);
    float chosen = 0.f;
    for (int k = 0; k < K; ++k) {
      weights[k] = math::shifted_exp(logits[ids[k]], max) / denom;
      chosen += weights[k];
    }
    if constexpr (Renormalize)
      for (int k = 0; k < K; ++k) weights[k] /= chosen;
  }
};

/// Mixtral: softmax, top-K, renormalised.
template <int K>
using mixtral = topk_softmax<K, true>;

}  // namespace epmoe::router
