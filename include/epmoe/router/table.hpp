// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/router/score.hpp"

namespace epmoe::router {

/// Table routing (DeepSeek-V4's `hash_moe` layers, `DeepseekV4HashRouter`): the experts are a
/// frozen lookup of the token's vocabulary id, ids = table[token id] ([vocab, K] row-major),
/// and the learned gate weighs them: s = Score(logits) (sqrtsoftplus in DeepSeek-V4), weights
/// = s at the table's experts divided by D = max(Σ_k s_k + eps, norm_min) when `normalize`,
/// times `scaling`. The gate gets the gradient; the table none.
/// Token ids reach the router as router::hash's do (forward(x, y, token_ids)).
/// `table` is host memory the caller owns. A layer keeps its own copy (in its space's memory),
/// made at construction and whenever `layer.router().table` is pointed at other values (then
/// at the next pass; `vocab` must stay the constructor's): the caller's table may go away
/// once the layer has copied it. Every entry is checked where it is copied (0 <= id < E,
/// distinct within a row); every token id at each pass (0 <= id < vocab, host spaces; on a
/// device an out-of-range id routes nowhere: empty slots).
template <int K, class Score = score::sqrtsoftplus>
struct table {
  static_assert(K >= 1, "router::table<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;
  static constexpr bool needs_token_ids = true;
  static constexpr bool has_table = true;
  using score_type = Score;

  const std::int32_t* ids = nullptr;  // [vocab, K] expert ids per token id (tid2eid)
  std::int64_t vocab = 0;             // rows of `ids`
  float scaling = 1.f;                // routed scaling factor
  bool normalize = true;              // weights divided by D (above) before scaling
  float eps = 0.f;                    // added to the sum (DeepSeek-V4: 1e-20)
  float norm_min = 0.f;               // the sum clamped below at this

  void validate(const layer_config& cfg) const {
    detail::require(vocab >= 1, "router.vocab", vocab, "must be >= 1 (rows of router.ids)");
    detail::require(ids != nullptr, "router.ids", "nullptr", "must point at [vocab, K] expert ids");
    detail::require(std::isfinite(scaling) && scaling > 0.f, "router.scaling", scaling,
                    "must be finite and > 0");
    detail::require(std::isfinite(eps) && eps >= 0.f, "router.eps", eps, "must be finite and >= 0");
    detail::require(std::isfinite(norm_min) && norm_min >= 0.f, "router.norm_min", norm_min,
                    "must be finite and >= 0");
    detail::require(K <= cfg.experts, "cfg.experts", cfg.experts, "must be >= the router's top_k");
  }

  /// Every entry of the table (host memory): in [0, E) and distinct within its row.
  void validate_table(const layer_config& cfg) const {
    validate(cfg);
    for (std::int64_t v = 0; v < vocab; ++v)
      for (int k = 0; k < K; ++k) {
        const std::int32_t e = ids[v * K + k];
        const auto field = [&] {
          return "router.ids[" + std::to_string(v) + "][" + std::to_string(k) + "]";
        };
        if (e < 0 || e >= cfg.experts)
          throw config_error(field(), std::to_string(e),
                             "must be in [0, " + std::to_string(cfg.experts) + ")");
        for (int j = 0; j < k; ++j)
          if (ids[v * K + j] == e)
            throw config_error(field(), std::to_string(e),
                               "must differ from the row's other experts (distinct within a row)");
      }
  }

  /// Every token id (host memory) in [0, vocab).
  void check_token_ids(std::span<const std::int64_t> tokens) const {
    for (std::size_t t = 0; t < tokens.size(); ++t)
      if (tokens[t] < 0 || tokens[t] >= vocab)
        throw config_error("token_ids[" + std::to_string(t) + "]", std::to_string(tokens[t]),
                           "must be in [0, router.vocab = " + std::to_string(vocab) + ")");
  }

  EPMOE_HD void route_token(const token_input& in, int* out, float* weights) const {
    if (in.token < 0 || in.token >= vocab) {  // checked on the host; a device routes nowhere
      for (int k = 0; k < K; ++k) out[k] = no_expert, weights[k] = 0.f;
      return;
    }
    const auto st = Score::prepare(in.logits, in.experts);
    for (int k = 0; k < K; ++k)
      weights[k] = Score::at(st, in.logits, out[k] = ids[in.token * K + k]);
    const float f = normalize ? scaling / score_divisor(weights, K, true, eps, norm_min) : scaling;
    for (int k = 0; k < K; ++k) weights[k] *= f;
  }

  /// Normalised scores over all E (the gate's), for the sequence loss.
  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    Score::probabilities(in.logits, in.experts, p);
  }

  /// dl[E] from g[K] = dL/dweights, the table's ids fixed (empty slots: no gradient).
  EPMOE_HD void backward_token(const token_input& in, const int* chosen, const float* g,
                               float* dl) const {
    const auto st = Score::prepare(in.logits, in.experts);
    float s[K], ds[K];
    for (int k = 0; k < K; ++k) s[k] = chosen[k] >= 0 ? Score::at(st, in.logits, chosen[k]) : 0.f;
    score_weights_backward(s, g, K, normalize, eps, norm_min, scaling, ds);
    Score::backward_at(st, in.logits, in.experts, chosen, ds, K, dl);
  }

  EPMOE_HD void probabilities_backward(const token_input& in, const float* dp, float* dl) const {
    Score::probabilities_backward(in.logits, in.experts, dp, dl);
  }
};

/// DeepSeek-V4's hash layers: the table weighted by sqrtsoftplus scores (eps = 1e-20,
/// scaling = routed_scaling_factor).
template <int K>
using deepseek_v4_hash = table<K, score::sqrtsoftplus>;

}  // namespace epmoe::router
