// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <span>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/topk.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/router/topk_softmax.hpp"

namespace epmoe::router {

/// DeepSeek-V3 routing with auxiliary-loss-free balancing:
///   s = sigmoid(logits); selection on s + b (b: per-expert bias, selection only);
///   weights = s at the chosen experts, divided by their sum (normalize), times `scaling`.
/// With groups > 1 the choice is limited to the best `top_groups` groups, a group scored by
/// the sum of its two best s + b (DeepSeek-V3: 256 experts, 8 groups, top-4 groups, top-8,
/// scaling 2.5). `group_mask` says what an expert of a dropped group scores: nothing
/// (minus_inf, DeepSeek's code) or 0.0 (zero, Hugging Face's; it then beats a kept expert whose
/// s + b is negative).
/// The bias b [E] is read through `bias` (nullptr: all zero). A layer keeps its own copy,
/// the same on every rank (`moe_layer::router_bias()`: read or write it in place); a `bias`
/// given with the router to the layer's constructor, or set later through
/// `layer.router().bias`, is copied into that copy (at construction, or at the next pass).
/// The layer updates it between passes (update_router) from the global load of the last pass:
///   b_i += gamma * sign(mean load - load_i).
template <int K>
struct sigmoid_bias {
  static_assert(K >= 1, "router::sigmoid_bias<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;
  static constexpr bool has_bias = true;

  int groups = 1;
  int top_groups = 1;
  float scaling = 1.f;          // routed scaling factor
  bool normalize = true;        // weights divided by their sum before scaling
  float gamma = 1e-3f;          // bias update speed
  const float* bias = nullptr;  // [E] host values, or nullptr (all zero); see above
  group_mask_mode group_mask = group_mask_mode::minus_inf;  // dropped groups' experts score

  void validate(const layer_config& cfg) const {
    validate_groups(cfg, K, groups, top_groups);
    detail::require(std::isfinite(scaling) && scaling > 0.f, "router.scaling", scaling,
                    "must be finite and > 0");
    detail::require(std::isfinite(gamma) && gamma >= 0.f, "router.gamma", gamma,
                    "must be finite and >= 0");
    detail::require(group_mask == group_mask_mode::minus_inf || group_mask == group_mask_mode::zero,
                    "router.group_mask", static_cast<int>(group_mask), "must be minus_inf or zero");
    if (bias)
      for (int e = 0; e < cfg.experts; ++e)
        if (!std::isfinite(bias[e]))
          throw config_error("router.bias[" + std::to_string(e) + "]", detail::to_text(bias[e]),
                             "must be finite");
  }

  EPMOE_HD float selection(const float* l, int e) const {
    return math::sigmoid(l[e]) + (bias ? bias[e] : 0.f);
  }

  EPMOE_HD void route_token(const token_input& in, int* ids, float* weights) const {
    const float* l = in.logits;
    float keys[K] = {};
    math::group_top_k<K>([&](int e) { return selection(l, e); }, math::pair_sum{}, in.experts,
                         groups, top_groups, ids, keys,
                         group_mask == group_mask_mode::zero ? 0.f : -INFINITY);
    float sum = 0.f;
    for (int k = 0; k < K; ++k) sum += (weights[k] = math::sigmoid(l[ids[k]]));
    const float f = normalize ? scaling / sum : scaling;
    for (int k = 0; k < K; ++k) weights[k] *= f;
  }

  /// Normalised sigmoid scores s_i / sum_j s_j (DeepSeek-V3's sequence-wise balance loss).
  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    float sum = 0.f;
    for (int e = 0; e < in.experts; ++e) sum += (p[e] = math::sigmoid(in.logits[e]));
    for (int e = 0; e < in.experts; ++e) p[e] /= sum;
  }

  /// Backward of route_token for one token, its choice `ids` held fixed: dl[E] = dL/dlogits
  /// from g[K] = dL/dweights. s = σ(l); normalised, w_k = c s_k / Σ_j s_j (j chosen):
  /// ds_k = (c / Σ)(g_k - Σ_j g_j s_j / Σ), else ds_k = c g_k; dl_k = ds_k s_k (1 - s_k) on the
  /// chosen experts, 0 elsewhere. The bias only selects: it gets no gradient (update_bias).
  EPMOE_HD void backward_token(const token_input& in, const int* ids, const float* g,
                               float* dl) const {
    const float* l = in.logits;
    for (int e = 0; e < in.experts; ++e) dl[e] = 0.f;
    float s[K], sum = 0.f, gs = 0.f;
    for (int k = 0; k < K; ++k) {
      sum += (s[k] = math::sigmoid(l[ids[k]]));
      gs += g[k] * s[k];
    }
    for (int k = 0; k < K; ++k) {
      const float ds = normalize ? scaling / sum * (g[k] - gs / sum) : scaling * g[k];
      dl[ids[k]] = ds * s[k] * (1.f - s[k]);
    }
  }

  /// dl[E] += the backward of probabilities() (the sequence loss's gradient): p = s / Σ s,
  /// ds_e = (dp_e - p · dp) / Σ s, dl_e += ds_e s_e (1 - s_e).
  EPMOE_HD void probabilities_backward(const token_input& in, const float* dp, float* dl) const {
    const float* l = in.logits;
    float sum = 0.f, pdp = 0.f;
    for (int e = 0; e < in.experts; ++e) sum += math::sigmoid(l[e]);
    for (int e = 0; e < in.experts; ++e) pdp += math::sigmoid(l[e]) / sum * dp[e];
    for (int e = 0; e < in.experts; ++e) {
      const float s = math::sigmoid(l[e]);
      dl[e] += (dp[e] - pdp) / sum * s * (1.f - s);
    }
  }

  /// b_i += gamma * sign(mean(load) - load_i): underloaded experts become more attractive.
  void update_bias(std::span<float> b, std::span<const index_t> load) const {
    detail::require(load.size() == b.size(), "load", load.size(),
                    "must hold one count per expert (the bias size)");
    double mean = 0;
    for (index_t n : load) mean += static_cast<double>(n);
    mean /= static_cast<double>(load.size());
    for (std::size_t e = 0; e < b.size(); ++e) {
      const double d = mean - static_cast<double>(load[e]);
      b[e] += d > 0 ? gamma : (d < 0 ? -gamma : 0.f);
    }
  }
};

}  // namespace epmoe::router
