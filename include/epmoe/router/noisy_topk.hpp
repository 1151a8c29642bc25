// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/topk.hpp"
#include "epmoe/router/gate.hpp"

namespace epmoe::router {

/// Noisy top-K gating (Shazeer et al. 2017):
///   H_i = (x W_g)_i + N(0,1) * softplus((x W_noise)_i),  weights = softmax over the top-K H.
/// W_noise is a second learned [E, H] matrix (moe_layer weights.noise_gate). The noise is
/// drawn only while `training` is true (off by default), seeded and counter-based: the same
/// (seed, pass, token, expert) always draws the same number.
template <int K>
struct noisy_topk {
  static_assert(K >= 1, "router::noisy_topk<K>: K must be >= 1");
  static constexpr int top_k = K;
  static constexpr bool uses_gate = true;
  static constexpr bool uses_noise_gate = true;

  bool training = false;
  std::uint64_t seed = 0;

  /// Its gate stage: the logits, and while training the noise logits x W_noise^T.
  template <class Space, class T>
  void gate(const Space& space, const gate_pass<T>& g) const {
    space.gemm_nt(g.x, g.gate, g.logits);
    if (training) space.gemm_nt(g.x, g.noise_gate, g.noise);
  }
  /// While training the pass needs weights.noise_gate [E, H].
  template <class T>
  void check(const layer_config& cfg, matrix_view<const T> noise_gate) const {
    if (training) detail::require_shape(noise_gate, cfg.experts, cfg.hidden, "weights.noise_gate");
  }

  /// The (noisy while training) logit H_e.
  EPMOE_HD float noisy_logit(const token_input& in, int e) const {
    if (!training || in.noise_logits == nullptr) return in.logits[e];
    const float n = in.noise_logits[e];
    const float softplus = n > 20.f ? n : log1pf(expf(n));
    const auto z = math::standard_normal(math::hash4(
        seed, in.pass, static_cast<std::uint64_t>(in.token), static_cast<std::uint64_t>(e)));
    return in.logits[e] + z * softplus;
  }

  EPMOE_HD void route_token(const token_input& in, int* ids, float* weights) const {
    float h[K] = {};
    int count = 0;
    for (int e = 0; e < in.experts; ++e)
      math::insert_top<K>(math::selection_key(noisy_logit(in, e)), e, count, ids, h);
    float sum = 0.f;
    for (int k = 0; k < K; ++k) sum += (weights[k] = math::shifted_exp(h[k], h[0]));
    for (int k = 0; k < K; ++k) weights[k] /= sum;
  }

  /// Backward for one token, the choice held fixed (`in` as in the forward: its noise logits,
  /// token and pass draw the same z): w = softmax over the chosen H, dH_k = w_k (g_k - Σ_j
  /// w_j g_j); dl = dH and, while training, dn = dH z σ(n) (softplus' = σ) into dnoise[E].
  EPMOE_HD void backward_token(const token_input& in, const int* ids, const float* g, float* dl,
                               float* dnoise) const {
    float h[K], w[K], sum = 0.f, gw = 0.f;
    for (int k = 0; k < K; ++k) h[k] = noisy_logit(in, ids[k]);
    for (int k = 0; k < K; ++k) sum += (w[k] = math::shifted_exp(h[k], h[0]));
    for (int k = 0; k < K; ++k) gw += (w[k] /= sum) * g[k];
    for (int e = 0; e < in.experts; ++e) dl[e] = 0.f;
    const bool noisy = training && in.noise_logits != nullptr && dnoise != nullptr;
    if (noisy)
      for (int e = 0; e < in.experts; ++e) dnoise[e] = 0.f;
    for (int k = 0; k < K; ++k) {
      const int e = ids[k];
      const float dh = w[k] * (g[k] - gw);
      dl[e] = dh;
      if (noisy) {
        const auto z = math::standard_normal(math::hash4(
            seed, in.pass, static_cast<std::uint64_t>(in.token), static_cast<std::uint64_t>(e)));
        dnoise[e] = dh * z * math::sigmoid(in.noise_logits[e]);
      }
    }
  }

  EPMOE_HD void probabilities(const token_input& in, float* p) const {
    float max = -INFINITY, sum = 0.f;
    for (int e = 0; e < in.experts; ++e) {
      p[e] = noisy_logit(in, e);
      max = p[e] > max ? p[e] : max;
    }
    for (int e = 0; e < in.experts; ++e) sum += (p[e] = math::shifted_exp(p[e], max));
    for (int e = 0; e < in.experts; ++e) p[e] /= sum;
  }
};

}  // namespace epmoe::router
