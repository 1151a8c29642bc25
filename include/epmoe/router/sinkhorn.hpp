// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/topk.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe::router {

/// Sinkhorn-balanced top-K (S-BASE, Clark et al. 2022; Megatron-Core's "sinkhorn"): the
/// matrix exp(logits) [T, E] of the local batch is scaled by row and column factors until
/// every expert's column carries the same mass (T/E) and every token's row the same (1/T
/// scaled), within `tolerance` or `max_iterations`; the top-K of each balanced row choose
/// the experts, and the weights are the unbalanced scores at those experts: the softmax
/// probabilities for K > 1, sigmoid(logit) for K = 1 (as Megatron-Core does).
template <int K>
struct sinkhorn {
  static_assert(K >= 1, "router::sinkhorn<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;

  float tolerance = 1e-4f;
  int max_iterations = 100;

  static index_t scratch_floats(const layer_config& cfg) {
    return index_t{cfg.max_tokens} * cfg.experts + cfg.max_tokens + 2 * index_t{cfg.experts};
  }
  static index_t scratch_ints(const layer_config&) { return 0; }

  void route_batch(const layer_config&, matrix_view<const float> logits, mutable_routing_view out,
                   std::span<float> fscratch, std::span<std::int32_t>) const {
    const index_t T = logits.rows, E = logits.cols;
    if (T == 0) return;
    matrix_view<float> c(fscratch.data(), T, E);
    float* d0 = fscratch.data() + T * E;  // row factors [T]
    float* d1 = d0 + T;                   // column factors [E]
    float* d1_old = d1 + E;
    float m = -INFINITY;
    for (index_t t = 0; t < T; ++t)
      for (index_t e = 0; e < E; ++e) m = std::max(m, math::selection_key(logits(t, e)));
    for (index_t t = 0; t < T; ++t)
      for (index_t e = 0; e < E; ++e) c(t, e) = std::exp(logits(t, e) - m);  // scale-free
    std::fill(d1, d1 + E, 1.f);
    constexpr float eps = 1e-8f;
    for (int it = 0; it < max_iterations; ++it) {
      for (index_t t = 0; t < T; ++t) {
        float s = 0.f;
        for (index_t e = 0; e < E; ++e) s += d1[e] * c(t, e);
        d0[t] = 1.f / (static_cast<float>(T) * (s + eps));
      }
      std::copy(d1, d1 + E, d1_old);
      for (index_t e = 0; e < E; ++e) {
        float s = 0.f;
        for (index_t t = 0; t < T; ++t) s += d0[t] * c(t, e);
        d1[e] = 1.f / (static_cast<float>(E) * (s + eps));
      }
      float err = 0.f;
      for (index_t e = 0; e < E; ++e) err += std::abs(d1[e] - d1_old[e]);
      if (err / static_cast<float>(E) <= tolerance) break;
    }
    for (index_t t = 0; t < T; ++t) {
      const float* l = logits.row(t);
      float keys[K] = {};
      int count = 0;
      for (index_t e = 0; e < E; ++e)
        math::insert_top<K>(math::selection_key(d1[e] * c(t, e) * d0[t]), static_cast<int>(e),
                            count, out.ids.row(t), keys);
      if constexpr (K == 1) {
        out.weights(t, 0) = math::sigmoid(l[out.ids(t, 0)]);
      } else {
        const float lm = *std::max_element(l, l + E);
        float sum = 0.f;
        for (index_t e = 0; e < E; ++e) sum += std::exp(l[e] - lm);
        for (int k = 0; k < K; ++k) out.weights(t, k) = std::exp(l[out.ids(t, k)] - lm) / sum;
      }
    }
  }

  /// Backward for one token, the balanced choice held fixed: K > 1, w_k = softmax(l)_k (the
  /// softmax backward); K = 1, w = σ(l_k) (dl_k = g σ (1 - σ)).
  EPMOE_HD void backward_token(const token_input& in, const int* ids, const float* g,
                               float* dl) const {
    if constexpr (K == 1) {
      for (int e = 0; e < in.experts; ++e) dl[e] = 0.f;
      const float s = math::sigmoid(in.logits[ids[0]]);
      dl[ids[0]] = g[0] * s * (1.f - s);
    } else {
      math::softmax_backward_at(in.logits, in.experts, ids, g, K, 1.f, dl);
    }
  }

  /// dl[E] += the backward of probabilities() (softmax) for the losses' gradient.
  EPMOE_HD void probabilities_backward(const token_input& in, const float* dp, float* dl) const {
    math::softmax_probabilities_backward(in.logits, in.experts, dp, dl);
  }

  void probabilities(const token_input& in, float* p) const {
    const float m = *std::max_element(in.logits, in.logits + in.experts);
    float sum = 0.f;
    for (int e = 0; e < in.experts; ++e) sum += (p[e] = std::exp(in.logits[e] - m));
    for (int e = 0; e < in.experts; ++e) p[e] /= sum;
  }
};

}  // namespace epmoe::router
