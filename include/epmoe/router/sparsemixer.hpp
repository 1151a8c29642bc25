// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>

#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/topk.hpp"

namespace epmoe::router {

/// SparseMixer top-2 (PhiMoE / Phi-3.5-MoE; Liu et al. 2023, Hugging Face `sparsemixer`).
/// Per round r = 1, 2, on the gate logits s with the first round's expert set to -inf in the
/// second: t = the largest remaining s; expert e is masked when
///   (t - s_e) / max(|s_e|, t) > 2 * jitter_eps      (s_e of the unmasked logits)
/// and the weight is softmax over the unmasked remaining logits, at the chosen expert (no
/// renormalisation across the two). Inference chooses the argmax (t's expert). While
/// `training`, the choice is a Gumbel sample over the unmasked experts,
/// argmax_e (s_e - log(-log u_e)), and its weight is multiplied by 1 when it is the argmax or
/// a second draw u > 0.75, else by 0.3333 (Heun's third-order method, as Hugging Face writes
/// it). Draws are counter-based: u = uniform(seed, pass, token, c) with c = (r - 1) * E + e for
/// the Gumbel draws and c = 2E + r - 1 for the Heun draw (docs/routers.md).
struct sparsemixer {
  static constexpr int top_k = 2;
  static constexpr bool uses_gate = true;

  float jitter_eps = 0.01f;  // PhiMoE's router_jitter_noise
  bool training = false;
  std::uint64_t seed = 0;

  void validate(const layer_config&) const {
    detail::require(std::isfinite(jitter_eps) && jitter_eps >= 0.f, "router.jitter_eps", jitter_eps,
                    "must be finite and >= 0");
  }

  /// The uniform draw c of a token (see above).
  EPMOE_HD float draw(const token_input& in, int c) const {
    return math::uniform01(math::hash4(seed, in.pass, static_cast<std::uint64_t>(in.token),
                                       static_cast<std::uint64_t>(c)));
  }

  /// logits[E] -> ids[2] and weights[2] (E >= 2).
  EPMOE_HD void route_token(const token_input& in, int* ids, float* weights) const {
    const float* s = in.logits;
    const int E = in.experts;
    int first = -1;
    for (int r = 0; r < 2; ++r) {
      // t: the largest logit but the first round's choice (NaN ranks below every number).
      int top = -1;
      float t = -INFINITY;
      for (int e = 0; e < E; ++e) {
        if (e == first) continue;
        const float x = math::selection_key(s[e]);
        if (top < 0 || x > t) {
          top = e;
          t = x;
        }
      }
      const auto kept = [&](int e) {
        return e != first && !((t - s[e]) / fmaxf(fabsf(s[e]), t) > 2.f * jitter_eps);
      };
      int chosen = top;
      if (training) {
        float best = -INFINITY;
        chosen = -1;
        for (int e = 0; e < E; ++e) {
          if (!kept(e)) continue;
          const float g = math::selection_key(s[e] - logf(-logf(draw(in, r * E + e))));
          if (chosen < 0 || g > best) {
            chosen = e;
            best = g;
          }
        }
      }
      float sum = 0.f;
      for (int e = 0; e < E; ++e)
        if (kept(e)) sum += math::shifted_exp(s[e], t);
      float w = math::shifted_exp(s[chosen], t) / sum;
      if (training && !(chosen == top || draw(in, 2 * E + r) > 0.75f)) w *= 0.3333f;
      ids[r] = chosen;
      weights[r] = w;
      first = chosen;
    }
  }

  /// softmax(l): PhiMoE's load-balancing loss reads the full softmax, as Mixtral's.
  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    math::softmax(in.logits, in.experts, p);
  }
};

}  // namespace epmoe::router
