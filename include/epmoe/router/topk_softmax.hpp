// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/topk.hpp"

namespace epmoe::router {

/// What an expert of a dropped group scores in group-limited selection (docs/routers.md):
/// minus_inf: nothing, it cannot be chosen (DeepSeek-V3's own inference code);
/// zero: 0.0, so it beats a kept expert whose key is negative (Hugging Face transformers'
/// DeepseekV3, `masked_fill(~score_mask, 0.0)`).
enum class group_mask_mode { minus_inf, zero };

/// Checks a group-limited router's groups against the layer (shared by the routers).
inline void validate_groups(const layer_config& cfg, int k, int groups, int top_groups) {
  detail::require(groups >= 1 && groups <= math::max_groups, "router.groups", groups,
                  "must be in [1, 64]");
  detail::require(cfg.experts % groups == 0, "router.groups", groups,
                  "must divide experts (groups are contiguous and equal)");
  detail::require(top_groups >= 1 && top_groups <= groups, "router.top_groups", top_groups,
                  "must be in [1, groups]");
  detail::require(k <= top_groups * (cfg.experts / groups), "router.top_groups", top_groups,
                  "kept groups must hold at least top_k experts");
}

/// How a group-limited router scores a group: the sum of its two best scores (DeepSeek-V3)
/// or its best score alone (DeepSeek-V2's `group_limited_greedy`).
enum class group_score { top2_sum, max };

/// Softmax over all E gate logits, then the top-K experts.
/// Renormalize = true: the K weights are divided by their p-norm (Σ_k |w_k|^p)^(1/p),
/// p = norm_p: 1 is their sum (Mixtral, GShard top-2; equal to a softmax over just the K
/// chosen logits), another p is DBRX's `moe_normalize_expert_weights = p`. false: the K
/// softmax probabilities as they are (Switch top-1, Qwen-MoE `norm_topk_prob = false`).
/// groups > 1 limits the choice to the best `top_groups` of `groups` contiguous expert groups,
/// a group scored by the sum of its two best probabilities (DeepSeek group-limited routing),
/// or by its best one (`group_by = group_score::max`, DeepSeek-V2). The weights are then
/// multiplied by `scaling` (DeepSeek-V2's routed_scaling_factor, 16 in V2).
/// The gate is a learned [E, H] matrix; the layer computes logits = x * gate^T.
template <int K, bool Renormalize = true>
struct topk_softmax {
  static_assert(K >= 1, "router::topk_softmax<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;

  int groups = 1;       // expert groups (1: no group limit)
  int top_groups = 1;   // groups kept per token when groups > 1
  float norm_p = 1.f;   // Renormalize: the p of the p-norm the K weights are divided by
  float scaling = 1.f;  // every weight times this (DeepSeek-V2's routed_scaling_factor)
  group_score group_by = group_score::top2_sum;

  void validate(const layer_config& cfg) const {
    validate_groups(cfg, K, groups, top_groups);
    detail::require(std::isfinite(norm_p) && norm_p > 0.f, "router.norm_p", norm_p,
                    "must be finite and > 0");
    detail::require(Renormalize || norm_p == 1.f, "router.norm_p", norm_p,
                    "must be 1 without renormalisation (topk_softmax<K, false>)");
    detail::require(std::isfinite(scaling) && scaling > 0.f, "router.scaling", scaling,
                    "must be finite and > 0");
    detail::require(group_by == group_score::top2_sum || group_by == group_score::max,
                    "router.group_by", static_cast<int>(group_by), "must be top2_sum or max");
  }

  /// logits[E] -> ids[K] (distinct, best first) and weights[K].
  EPMOE_HD void route_token(const token_input& in, int* ids, float* weights) const {
    const float* l = in.logits;
    const int E = in.experts;
    float max = -INFINITY;
    for (int e = 0; e < E; ++e) max = l[e] > max ? l[e] : max;
    float denom = 0.f;
    for (int e = 0; e < E; ++e) denom += math::shifted_exp(l[e], max);
    float best[K] = {};
    // Select on the logits (the order of the probabilities, exact where they underflow);
    // groups compare p_a + p_b through log(e^a + e^b), or max(p) through the best logit.
    const auto key = [&](int e) { return l[e]; };
    if (group_by == group_score::max)
      math::group_top_k<K>(key, math::pair_first{}, E, groups, top_groups, ids, best);
    else
      math::group_top_k<K>(key, math::pair_log_sum_exp{}, E, groups, top_groups, ids, best);
    float chosen = 0.f;
    for (int k = 0; k < K; ++k) {
      weights[k] = math::shifted_exp(l[ids[k]], max) / denom;
      chosen += weights[k];
    }
    if constexpr (Renormalize) {
      if (norm_p == 1.f) {
        for (int k = 0; k < K; ++k) weights[k] /= chosen;
      } else {
        // w_k / ||w||_p = r_k / ||r||_p with r_k = w_k / w_0 = e^(l_k - l_0) in (0, 1]: no
        // w_k^p underflows, whatever p.
        float norm = 0.f;
        for (int k = 0; k < K; ++k)
          norm += powf(weights[k] = math::shifted_exp(l[ids[k]], l[ids[0]]), norm_p);
        norm = powf(norm, 1.f / norm_p);
        for (int k = 0; k < K; ++k) weights[k] /= norm;
      }
    }
    if (scaling != 1.f)
      for (int k = 0; k < K; ++k) weights[k] *= scaling;
  }

  /// The router's probability of every expert (the P_i of the auxiliary loss).
  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    math::softmax(in.logits, in.experts, p);
  }

  /// Backward of route_token for one token, its choice `ids` held fixed (docs/training.md):
  /// dl[E] = dL/dlogits from g[K] = dL/dweights (0 for a dropped assignment).
  /// Renormalised: w_k = c u_k, u_k = r_k / ||r||_q, r_k = e^(l_k): only the K chosen logits
  /// move, dl_j = c (u_j g_j - (Σ_k g_k u_k) u_j^q). Not renormalised: w_k = c p_k, the softmax
  /// backward over all E, dl_e = p_e (c g_e [e chosen] - c Σ_k g_k p_k).
  EPMOE_HD void backward_token(const token_input& in, const int* ids, const float* g,
                               float* dl) const {
    const float* l = in.logits;
    const int E = in.experts;
    if constexpr (Renormalize) {
      for (int e = 0; e < E; ++e) dl[e] = 0.f;
      float u[K], norm = 0.f, gu = 0.f;
      for (int k = 0; k < K; ++k)
        norm += powf(u[k] = math::shifted_exp(l[ids[k]], l[ids[0]]), norm_p);
      norm = powf(norm, 1.f / norm_p);
      for (int k = 0; k < K; ++k) gu += g[k] * (u[k] /= norm);
      for (int k = 0; k < K; ++k)
        dl[ids[k]] = scaling * (u[k] * g[k] - gu * (norm_p == 1.f ? u[k] : powf(u[k], norm_p)));
    } else {
      math::softmax_backward_at(l, E, ids, g, K, scaling, dl);
    }
  }

  /// dl[E] += the backward of probabilities() (the losses' gradient): p ⊙ (dp - p · dp).
  EPMOE_HD void probabilities_backward(const token_input& in, const float* dp, float* dl) const {
    math::softmax_probabilities_backward(in.logits, in.experts, dp, dl);
  }
};

/// Mixtral: softmax over all experts, top-K, renormalised.
template <int K>
using mixtral = topk_softmax<K, true>;
/// Qwen-MoE: softmax top-K; NormTopkProb mirrors its `norm_topk_prob` flag.
template <int K, bool NormTopkProb = false>
using qwen = topk_softmax<K, NormTopkProb>;
/// Switch Transformer: top-1, the weight is the expert's softmax probability.
using switch_top1 = topk_softmax<1, false>;
/// GShard: top-2, the two gates normalised to sum 1.
using gshard_top2 = topk_softmax<2, true>;
/// DBRX (16 experts, top-4): softmax top-K divided by the p-norm of the K weights; set
/// `norm_p` to its `moe_normalize_expert_weights` (DBRX ships 1: Mixtral's weights; a config
/// with it unset is topk_softmax<K, false>).
template <int K>
using dbrx = topk_softmax<K, true>;
/// DeepSeek-V2 (160 experts, top-6; V2-Lite 64, top-6): softmax top-K, not renormalised,
/// times `scaling` = routed_scaling_factor; `group_limited_greedy` is groups = n_group,
/// top_groups = topk_group, group_by = group_score::max.
template <int K>
using deepseek_v2 = topk_softmax<K, false>;

}  // namespace epmoe::router
