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

/// Expert choice (Zhou et al. 2022): S = softmax over experts of each token's logits; each
/// expert takes its C best tokens by S[:, e], C = min(T, ceil(capacity_factor * T * K / E))
/// (ties: lower token first), with weight S[t, e]. A token gets 0..E experts: its routing
/// row has E slots, its experts in increasing id, the rest no_expert. Experts are perfectly
/// balanced by construction; the choice sees the whole local batch, so it is a batch router.
struct expert_choice {
  static constexpr int top_k = 0;  // not fixed: config top_k sets C, a token gets 0..E experts
  static constexpr bool uses_gate = true;

  static index_t capacity(const layer_config& cfg, index_t tokens) {
    const auto c = static_cast<index_t>(
        std::ceil(cfg.capacity_factor * static_cast<double>(tokens) * cfg.top_k / cfg.experts));
    return std::min(tokens, c);
  }

  /// Scratch the layer provides: the score matrix, and a token order per expert.
  static index_t scratch_floats(const layer_config& cfg) {
    return index_t{cfg.max_tokens} * cfg.experts;
  }
  static index_t scratch_ints(const layer_config& cfg) { return cfg.max_tokens; }

  void route_batch(const layer_config& cfg, matrix_view<const float> logits,
                   mutable_routing_view out, std::span<float> fscratch,
                   std::span<std::int32_t> iscratch) const {
    const index_t T = logits.rows, E = logits.cols;
    matrix_view<float> s(fscratch.data(), T, E);
    for (index_t t = 0; t < T; ++t) {
      const float* l = logits.row(t);
      const float m = *std::max_element(l, l + E);
      float sum = 0.f;
      for (index_t e = 0; e < E; ++e) sum += (s(t, e) = std::exp(l[e] - m));
      for (index_t e = 0; e < E; ++e) s(t, e) /= sum;
      for (index_t e = 0; e < E; ++e) {
        out.ids(t, e) = no_expert;
        out.weights(t, e) = 0.f;
      }
    }
    const index_t C = capacity(cfg, T);
    std::int32_t* order = iscratch.data();
    for (index_t e = 0; e < E; ++e) {
      for (index_t t = 0; t < T; ++t) order[t] = static_cast<std::int32_t>(t);
      std::partial_sort(order, order + C, order + T, [&](std::int32_t a, std::int32_t b) {
        const float x = math::selection_key(s(a, e)), y = math::selection_key(s(b, e));
        return x > y || (x == y && a < b);
      });
      // Slot e of token t holds expert e: ids stay sorted by expert, empty slots -1.
      for (index_t c = 0; c < C; ++c) {
        out.ids(order[c], e) = static_cast<std::int32_t>(e);
        out.weights(order[c], e) = s(order[c], e);
      }
    }
  }

  /// Backward for one token, the choice held fixed: w[t, e] = softmax(l_t)_e for the experts
  /// that chose t (slot e holds expert e or no_expert), so the softmax backward with
  /// dp_e = g[e] where chosen (docs/training.md).
  EPMOE_HD void backward_token(const token_input& in, const int* ids, const float* g,
                               float* dl) const {
    math::softmax_backward_at(in.logits, in.experts, ids, g, in.experts, 1.f, dl);
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
