// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/reference/weights.hpp"

namespace epmoe::reference {

/// Inputs of a pass beyond the tokens themselves.
struct pass_options {
  std::span<const std::int64_t> token_ids;  // one per token (all ranks), or empty
  std::uint64_t pass = 0;                   // the layer's pass counter (training noise)
};

namespace detail {
// One SwiGLU expert on one token, in double: W2 (silu(W1 x) * W3 x).
inline void expert_ffn(const float* w1, const float* w3, const float* w2, const float* x, index_t H,
                       index_t F, std::vector<double>& h, std::vector<double>& out, double scale) {
  for (index_t f = 0; f < F; ++f) {
    double a = 0, b = 0;
    for (index_t i = 0; i < H; ++i) {
      a += double{w1[f * H + i]} * x[i];
      b += double{w3[f * H + i]} * x[i];
    }
    h[f] = a / (1.0 + std::exp(-a)) * b;
  }
  for (index_t o = 0; o < H; ++o) {
    double s = 0;
    for (index_t f = 0; f < F; ++f) s += double{w2[o * F + f]} * h[f];
    out[o] += scale * s;
  }
}
}  // namespace detail

/// The plain forward pass the layer is checked against: loops in double, no plan, no
/// communication, all E experts in one place. x holds every rank's tokens, rank after
/// rank (`tokens_per_rank`); capacity is applied per source rank in token order, as the
/// layer does. The router's route_token / route_batch is the routing definition and is
/// reused; logits, noise, jitter, capacity, experts, shared experts and the weighted sum
/// are written out here.
/// Capacity counts rows per physical slot, so with replicas the reference follows the
/// placement's choice of copy (slot_for); without replicas a slot is an expert.
template <class Router, class Capacity, class Placement>
void forward(const full_weights& w, const Router& router, const Capacity& capacity,
             const Placement& placement, matrix_view<const float> x,
             std::span<const index_t> tokens_per_rank, matrix_view<float> y,
             const pass_options& opt = {}) {
  const layer_config& cfg = w.cfg;
  const index_t E = cfg.experts, H = cfg.hidden, F = cfg.ffn;
  const index_t K = Router::top_k > 0 ? Router::top_k : E;
  const index_t N = cfg.shared_experts, Fs = cfg.shared_width();
  std::vector<index_t> used(static_cast<std::size_t>(placement.slots_per_rank()) * cfg.ranks);
  std::vector<double> h(std::max(F, Fs)), out(H);
  std::vector<float> gate_in(H);
  index_t t0 = 0;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    const index_t n = tokens_per_rank[r];
    // Route this rank's tokens.
    std::vector<float> logits(n * E), noise(n * E);
    std::vector<std::int32_t> ids(n * K);
    std::vector<float> weight(n * K);
    bool noisy = false;
    if constexpr (router_with_noise_gate<Router>) noisy = router.training;
    for (index_t t = 0; t < n; ++t) {
      const float* xt = x.row(t0 + t);
      const std::int64_t id = opt.token_ids.empty()
                                  ? static_cast<std::int64_t>(r) * cfg.max_tokens + t
                                  : opt.token_ids[t0 + t];
      for (index_t i = 0; i < H; ++i) gate_in[i] = xt[i];
      if constexpr (router_with_jitter<Router>)
        if (router.training)
          for (index_t i = 0; i < H; ++i) gate_in[i] = xt[i] * router.factor(opt.pass, id, i);
      for (index_t e = 0; e < E && Router::uses_gate; ++e) {
        double s = 0, z = 0;
        for (index_t i = 0; i < H; ++i) {
          s += double{gate_in[i]} * w.gate[e * H + i];
          z += double{gate_in[i]} * w.noise_gate[e * H + i];
        }
        logits[t * E + e] = static_cast<float>(s);
        noise[t * E + e] = static_cast<float>(z);
      }
      if constexpr (token_router<Router>)
        router.route_token(
            token_input{Router::uses_gate ? &logits[t * E] : nullptr,
                        noisy ? &noise[t * E] : nullptr, static_cast<int>(E), id, opt.pass},
            &ids[t * K], &weight[t * K]);
    }
    if constexpr (batch_router<Router>) {
      std::vector<float> fs(Router::scratch_floats(cfg));
      std::vector<std::int32_t> is(Router::scratch_ints(cfg));
      router.route_batch(cfg, {logits.data(), n, E}, {{ids.data(), n, K}, {weight.data(), n, K}},
                         fs, is);
    }
    // Experts, with capacity per (source rank, expert) in token order.
    const index_t limit = capacity.limit(cfg, n);
    std::fill(used.begin(), used.end(), 0);
    for (index_t t = 0; t < n; ++t) {
      const float* xt = x.row(t0 + t);
      const std::int64_t id = opt.token_ids.empty()
                                  ? static_cast<std::int64_t>(r) * cfg.max_tokens + t
                                  : opt.token_ids[t0 + t];
      std::fill(out.begin(), out.end(), 0.0);
      for (index_t k = 0; k < K; ++k) {
        const index_t e = ids[t * K + k];
        if (e == no_expert) continue;
        const int slot = placement.slot_for(static_cast<int>(e), static_cast<int>(r),
                                            static_cast<std::uint64_t>(id));
        if (used[slot]++ >= limit) continue;  // past capacity: dropped
        detail::expert_ffn(&w.w1[e * F * H], &w.w3[e * F * H], &w.w2[e * H * F], xt, H, F, h, out,
                           weight[t * K + k]);
      }
      for (index_t s = 0; s < N; ++s)
        detail::expert_ffn(&w.shared_w1[s * Fs * H], &w.shared_w3[s * Fs * H],
                           &w.shared_w2[s * H * Fs], xt, H, Fs, h, out, 1.0);
      for (index_t o = 0; o < H; ++o) y(t0 + t, o) = static_cast<float>(out[o]);
    }
    t0 += n;
  }
}

}  // namespace epmoe::reference

namespace epmoe::reference {
/// The same with placement::block (one copy per expert).
template <class Router, class Capacity>
void forward(const full_weights& w, const Router& router, const Capacity& capacity,
             matrix_view<const float> x, std::span<const index_t> tokens_per_rank,
             matrix_view<float> y, const pass_options& opt = {}) {
  forward(w, router, capacity, placement::block(w.cfg), x, tokens_per_rank, y, opt);
}
}  // namespace epmoe::reference
