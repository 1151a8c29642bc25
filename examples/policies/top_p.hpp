// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A router written as a user would, in one header: top-p ("nucleus") routing (Huang et al.
// 2024, "Harder tasks need more experts"): a token takes experts in order of probability
// until their probabilities sum to at least p, at most K of them; the chosen weights are
// renormalised to sum to 1. Unused slots hold no_expert (the plan skips them). Host and
// device alike: route_token is EPMOE_HD.
#include <cmath>

#include <epmoe/core/macros.hpp>
#include <epmoe/core/routing.hpp>
#include <epmoe/core/topk.hpp>

namespace policies {

template <int K>
struct top_p {
  static_assert(K >= 1, "top_p<K>: K must be >= 1");
  static constexpr int top_k = K;  // slots: at most K experts per token
  static constexpr bool uses_gate = true;

  float p = 0.5f;  // probability mass to cover

  EPMOE_HD void route_token(const epmoe::token_input& in, int* ids, float* weights) const {
    const float* l = in.logits;
    float max = -INFINITY;
    for (int e = 0; e < in.experts; ++e) max = l[e] > max ? l[e] : max;
    float denom = 0.f;
    for (int e = 0; e < in.experts; ++e) denom += epmoe::math::shifted_exp(l[e], max);
    float best[K] = {};
    int count = 0;
    for (int e = 0; e < in.experts; ++e)
      epmoe::math::insert_top<K>(epmoe::math::selection_key(l[e]), e, count, ids, best);
    float covered = 0.f;
    int taken = 0;
    for (; taken < K && (taken == 0 || covered < p); ++taken) {
      weights[taken] = epmoe::math::shifted_exp(l[ids[taken]], max) / denom;
      covered += weights[taken];
    }
    for (int k = 0; k < K; ++k) {
      if (k < taken) {
        weights[k] /= covered;
      } else {
        ids[k] = epmoe::no_expert;
        weights[k] = 0.f;
      }
    }
  }
};

}  // namespace policies
