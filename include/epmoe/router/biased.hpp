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
#include "epmoe/router/score.hpp"
#include "epmoe/router/topk_softmax.hpp"

namespace epmoe::router {

/// What a scored router's selection ranks: the scores s (DeepSeek, ERNIE, LongCat) or the
/// raw logits (Llama 4, Kolibri: top-k of l + b, then σ of the chosen l).
enum class select_on { scores, logits };

/// A scored router with a selection bias (docs/routers.md):
///   s = Score(logits)  (score::sigmoid, score::softmax over all E, score::sqrtsoftplus);
///   the K best (s or l) + b, b a per-expert bias that moves the choice only, no gradient;
///   weights = s at the chosen experts, divided by D = max(Σ_k s_k + eps, norm_min) when
///   `normalize`, times `scaling`.
/// With groups > 1 the choice is limited to the best `top_groups` groups, a group scored by
/// the sum of its two best keys (DeepSeek-V3: 256 experts, 8 groups, top-4 groups, top-8,
/// scaling 2.5). `group_mask` says what an expert of a dropped group scores: nothing
/// (minus_inf, DeepSeek's code) or 0.0 (zero, Hugging Face's; it then beats a kept expert whose
/// key is negative).
/// The bias b [E] is read through `bias` (nullptr: all zero). A layer keeps its own copy,
/// the same on every rank (`moe_layer::router_bias()`: read or write it in place); a `bias`
/// given with the router to the layer's constructor, or set later through
/// `layer.router().bias`, is copied into that copy (at construction, or at the next pass).
/// The layer updates it between passes (update_router) from the global load of the last pass:
///   b_i += gamma * sign(mean load - load_i).
template <int K, class Score = score::sigmoid, select_on Select = select_on::scores>
struct biased {
  static_assert(K >= 1, "router::biased<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;
  static constexpr bool has_bias = true;
  using score_type = Score;

  int groups = 1;
  int top_groups = 1;
  float scaling = 1.f;          // routed scaling factor
  bool normalize = true;        // weights divided by D (above) before scaling
  float gamma = 1e-3f;          // bias update speed
  const float* bias = nullptr;  // [E] host values, or nullptr (all zero); see above
  group_mask_mode group_mask = group_mask_mode::minus_inf;  // dropped groups' experts score
  float eps = 0.f;       // added to the chosen scores' sum (DeepSeek-V4 1e-20, LFM2 1e-6)
  float norm_min = 0.f;  // the sum clamped below at this (ERNIE 4.5's moe_norm_min)

  void validate(const layer_config& cfg) const {
    validate_groups(cfg, K, groups, top_groups);
    detail::require(std::isfinite(scaling) && scaling > 0.f, "router.scaling", scaling,
                    "must be finite and > 0");
    detail::require(std::isfinite(gamma) && gamma >= 0.f, "router.gamma", gamma,
                    "must be finite and >= 0");
    detail::require(std::isfinite(eps) && eps >= 0.f, "router.eps", eps, "must be finite and >= 0");
    detail::require(std::isfinite(norm_min) && norm_min >= 0.f, "router.norm_min", norm_min,
                    "must be finite and >= 0");
    detail::require(group_mask == group_mask_mode::minus_inf || group_mask == group_mask_mode::zero,
                    "router.group_mask", static_cast<int>(group_mask), "must be minus_inf or zero");
    if (bias)
      for (int e = 0; e < cfg.experts; ++e)
        if (!std::isfinite(bias[e]))
          throw config_error("router.bias[" + std::to_string(e) + "]", detail::to_text(bias[e]),
                             "must be finite");
  }

  /// The selection key of expert e: (s_e or l_e) + b_e.
  EPMOE_HD float selection(const typename Score::state& st, const float* l, int e) const {
    const float v = Select == select_on::scores ? Score::at(st, l, e) : l[e];
    return v + (bias ? bias[e] : 0.f);
  }

  EPMOE_HD void route_token(const token_input& in, int* ids, float* weights) const {
    const float* l = in.logits;
    const auto st = Score::prepare(l, in.experts);
    float keys[K] = {};
    math::group_top_k<K>([&](int e) { return selection(st, l, e); }, math::pair_sum{}, in.experts,
                         groups, top_groups, ids, keys,
                         group_mask == group_mask_mode::zero ? 0.f : -INFINITY);
    for (int k = 0; k < K; ++k) weights[k] = Score::at(st, l, ids[k]);
    const float f = normalize ? scaling / score_divisor(weights, K, true, eps, norm_min) : scaling;
    for (int k = 0; k < K; ++k) weights[k] *= f;
  }

  /// Normalised scores s_i / Σ_j s_j (softmax: the probabilities), for the sequence loss.
  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    Score::probabilities(in.logits, in.experts, p);
  }

  /// Backward of route_token for one token, its choice `ids` held fixed: dl[E] = dL/dlogits
  /// from g[K] = dL/dweights: ds from the weights (score_weights_backward), then the score's
  /// backward (σ, sqrtsoftplus: the chosen logits alone; softmax: all E). The bias only
  /// selects: it gets no gradient (update_bias).
  EPMOE_HD void backward_token(const token_input& in, const int* ids, const float* g,
                               float* dl) const {
    const float* l = in.logits;
    const auto st = Score::prepare(l, in.experts);
    float s[K], ds[K];
    for (int k = 0; k < K; ++k) s[k] = Score::at(st, l, ids[k]);
    score_weights_backward(s, g, K, normalize, eps, norm_min, scaling, ds);
    Score::backward_at(st, l, in.experts, ids, ds, K, dl);
  }

  /// dl[E] += the backward of probabilities() (the sequence loss's gradient).
  EPMOE_HD void probabilities_backward(const token_input& in, const float* dp, float* dl) const {
    Score::probabilities_backward(in.logits, in.experts, dp, dl);
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

/// DeepSeek-V3 (and MiniMax-M2, GLM-4-MoE, dots1): sigmoid scores, selection on s + b.
template <int K>
using sigmoid_bias = biased<K, score::sigmoid>;
/// DeepSeek-V4 (`DeepseekV4TopKRouter`, transformers 5.23): sqrtsoftplus scores, selection on
/// s + e_score_correction_bias, renormalised with eps = 1e-20, scaling = routed_scaling_factor.
template <int K>
using deepseek_v4 = biased<K, score::sqrtsoftplus>;
/// ERNIE 4.5 MoE (`Ernie4_5_MoeTopKRouter`): softmax over E, selection on p + moe_statics'
/// bias, weights p / clamp(Σ, norm_min = moe_norm_min).
template <int K>
using ernie4_5 = biased<K, score::softmax>;
/// LFM2-MoE (`Lfm2MoeTopKRouter`): sigmoid, selection on s + expert_bias, renormalised with
/// eps = 1e-6 when norm_topk_prob, times routed_scaling_factor.
template <int K>
using lfm2_moe = biased<K, score::sigmoid>;
/// Llama 4 (`Llama4Router`): top-k of the logits, weights σ(l_k), normalize = false (the
/// layer applies the weight to the expert's input, not its output: the layer's business).
/// Kolibri (`Kolibri1TopKRouter`): the same on l + e_score_correction_bias, renormalised
/// (no eps) when norm_topk_prob.
template <int K>
using llama4 = biased<K, score::sigmoid, select_on::logits>;
template <int K>
using kolibri = biased<K, score::sigmoid, select_on::logits>;
/// LongCat-Flash (`LongcatFlashTopkRouter`): softmax over the E real + Z zero experts,
/// selection on p + e_score_correction_bias, weights p · routed_scaling_factor, normalize = false.
template <int K>
using longcat_flash = biased<K, score::softmax>;

}  // namespace epmoe::router
