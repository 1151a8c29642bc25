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

/// Softmax over all E gate logits, then the top-K experts.
/// Renormalize = true: the K weights are divided by their p-norm (Σ_k |w_k|^p)^(1/p),
/// p = norm_p: 1 is their sum (Mixtral, GShard top-2; equal to a softmax over just the K
/// chosen logits), another p is DBRX's `moe_normalize_expert_weights = p`. false: the K
/// softmax probabilities as they are (Switch top-1, Qwen-MoE `norm_topk_prob = false`).
/// groups > 1 limits the choice to the best `top_groups` of `groups` contiguous expert groups,
/// a group scored by the sum of its two best probabilities (DeepSeek group-limited routing).
/// The gate is a learned [E, H] matrix; the layer computes logits = x * gate^T.
template <int K, bool Renormalize = true>
struct topk_softmax {
  static_assert(K >= 1, "router::topk_softmax<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;

  int groups = 1;      // expert groups (1: no group limit)
  int top_groups = 1;  // groups kept per token when groups > 1
  float norm_p = 1.f;  // Renormalize: the p of the p-norm the K weights are divided by

  void validate(const layer_config& cfg) const {
    validate_groups(cfg, K, groups, top_groups);
    detail::require(std::isfinite(norm_p) && norm_p > 0.f, "router.norm_p", norm_p,
                    "must be finite and > 0");
    detail::require(Renormalize || norm_p == 1.f, "router.norm_p", norm_p,
                    "must be 1 without renormalisation (topk_softmax<K, false>)");
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
    // groups compare p_a + p_b through log(e^a + e^b).
    math::group_top_k<K>([&](int e) { return l[e]; }, math::pair_log_sum_exp{}, E, groups,
                         top_groups, ids, best);
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
  }

  /// The router's probability of every expert (the P_i of the auxiliary loss).
  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    const float* l = in.logits;
    float max = -INFINITY;
    for (int e = 0; e < in.experts; ++e) max = l[e] > max ? l[e] : max;
    float denom = 0.f;
    for (int e = 0; e < in.experts; ++e) denom += (p[e] = math::shifted_exp(l[e], max));
    for (int e = 0; e < in.experts; ++e) p[e] /= denom;
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

}  // namespace epmoe::router
