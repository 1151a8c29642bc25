// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/clamped_glu.hpp"
#include "epmoe/expert/mlp.hpp"
#include "epmoe/expert/swiglu.hpp"

// Owned weights and inputs for tests, examples and benchmarks.
namespace epmoe::reference {

/// A small multiple of 1/16 in [-1, 1]. Gate weights and tokens drawn this way make every
/// logit an exact float sum in any order (BLAS or loop), so the layer and the reference pick
/// the same experts even at ties; expert weights need no such care.
inline float dyadic(std::mt19937_64& rng) {
  return static_cast<float>(static_cast<int>(rng() % 33) - 16) / 16.f;
}

/// Random tokens [rows, H], dyadic (see above).
inline std::vector<float> random_tokens(index_t rows, index_t hidden, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(static_cast<std::size_t>(rows * hidden));
  for (float& v : x) v = dyadic(rng);
  return x;
}

/// Every weight of the layer (all E experts, the shared experts, the noise gate), owned.
struct full_weights {
  layer_config cfg;
  std::vector<float> gate;        // [E + Z, H] (Z: config zero_experts, scored too)
  std::vector<float> w1;          // [E, F, H]
  std::vector<float> w3;          // [E, F, H]
  std::vector<float> w2;          // [E, H, F]
  std::vector<float> shared_w1;   // [N, Fs, H]
  std::vector<float> shared_w3;   // [N, Fs, H]
  std::vector<float> shared_w2;   // [N, H, Fs]
  std::vector<float> noise_gate;  // [E + Z, H] (noisy top-k)
  // Drawn after the above (their values do not depend on these):
  std::vector<float> b1, b2;                // [E, F], [E, H]: biased experts (expert::mlp)
  std::vector<float> shared_b1, shared_b2;  // [N, Fs], [N, H]
  std::vector<float> shared_gate;           // [N, H] (config shared_gate: Qwen2-MoE)
  std::vector<float> output_bias;           // [H] (config output_bias: JetMoE)
  std::vector<float> b3;                    // [E, F]: the up projection's bias (GPT-OSS)
  std::vector<float> gate_bias;             // [E + Z]: the gate's logit bias (GPT-OSS)

  /// Deterministic random weights of typical scale: uniform(-1, 1) / sqrt(fan-in); the gate
  /// dyadic times a power of two (see above).
  static full_weights random(const layer_config& cfg, std::uint64_t seed) {
    const std::size_t E = cfg.experts, H = cfg.hidden, F = cfg.ffn;
    const std::size_t N = cfg.shared_experts, Fs = cfg.shared_width();
    const std::size_t S = cfg.scored_experts();
    full_weights w{cfg,
                   std::vector<float>(S * H),
                   std::vector<float>(E * F * H),
                   std::vector<float>(E * F * H),
                   std::vector<float>(E * H * F),
                   std::vector<float>(N * Fs * H),
                   std::vector<float>(N * Fs * H),
                   std::vector<float>(N * H * Fs),
                   std::vector<float>(S * H),
                   {},
                   {},
                   {},
                   {},
                   {},
                   {},
                   {},
                   {}};  // the biases and gates: drawn below
    std::mt19937_64 rng(seed);
    // Gate logits of std ~2 (typical of trained routers), by a power-of-two scale that keeps
    // them exact.
    const float gs = std::min(1.f, std::exp2(std::round(std::log2(6.f / std::sqrt(float(H))))));
    for (float& v : w.gate) v = dyadic(rng) * gs;
    std::uniform_real_distribution<float> in(-1.f, 1.f);
    const float sh = 1.f / std::sqrt(static_cast<float>(H));
    const float sf = 1.f / std::sqrt(static_cast<float>(F));
    const float ss = 1.f / std::sqrt(static_cast<float>(Fs));
    for (float& v : w.w1) v = in(rng)*sh;
    for (float& v : w.w3) v = in(rng)*sh;
    for (float& v : w.w2) v = in(rng)*sf;
    for (float& v : w.shared_w1) v = in(rng)*sh;
    for (float& v : w.shared_w3) v = in(rng)*sh;
    for (float& v : w.shared_w2) v = in(rng)*ss;
    for (float& v : w.noise_gate) v = in(rng)*sh;
    const auto draw = [&](std::size_t n, float scale) {
      std::vector<float> v(n);
      for (float& x : v) x = in(rng)*scale;
      return v;
    };
    w.b1 = draw(E * F, sh);
    w.b2 = draw(E * H, sf);
    w.shared_b1 = draw(N * Fs, sh);
    w.shared_b2 = draw(N * H, ss);
    w.shared_gate = draw(N * H, 4 * sh);  // sigmoid scales spread over (0, 1)
    w.output_bias = draw(H, sf);
    w.b3 = draw(E * F, sh);
    w.gate_bias = draw(S, 1.f);  // logits of std ~2: a bias of this size reorders them
    return w;
  }

  matrix_view<const float> gate_view() const {
    return {gate.data(), cfg.scored_experts(), cfg.hidden};
  }
  matrix_view<const float> noise_gate_view() const {
    return {noise_gate.data(), cfg.scored_experts(), cfg.hidden};
  }
  stacked_view<const float> w1_view() const {
    return {w1.data(), cfg.experts, cfg.ffn, cfg.hidden};
  }
  stacked_view<const float> w3_view() const {
    return {w3.data(), cfg.experts, cfg.ffn, cfg.hidden};
  }
  stacked_view<const float> w2_view() const {
    return {w2.data(), cfg.experts, cfg.hidden, cfg.ffn};
  }
  /// The shared experts as a layer takes them.
  expert::swiglu::weights shared() const {
    const index_t N = cfg.shared_experts, H = cfg.hidden, Fs = cfg.shared_width();
    return {
        {shared_w1.data(), N, Fs, H}, {shared_w3.data(), N, Fs, H}, {shared_w2.data(), N, H, Fs}};
  }
};

/// Copies of the experts one rank holds under a placement, stacked in local-slot order:
/// what a framework hands the layer for that rank.
struct rank_weights {
  std::vector<float> w1, w3, w2;
  index_t local = 0, hidden = 0, ffn = 0;
  std::vector<float> b1, b2;  // [L, F], [L, H]
  std::vector<float> b3;      // [L, F] (GPT-OSS)

  expert::swiglu::weights experts() const {
    return {{w1.data(), local, ffn, hidden},
            {w3.data(), local, ffn, hidden},
            {w2.data(), local, hidden, ffn}};
  }
};

/// An expert type's weights over a rank_weights slice (its w1, w3, w2 as floats): SwiGLU
/// reads all three; another expert type specialises this with a static of(const
/// rank_weights&) returning its weights_of<float> (examples/policies/gelu_mlp_reference.hpp),
/// and, for shared experts, a static shared(const full_weights&).
template <class Expert>
struct views_of {
  static_assert(!std::is_same_v<Expert, Expert>,
                "reference::views_of has no view of rank_weights for this expert type: "
                "specialise reference::views_of<Expert> with a static of(const rank_weights&)");
};
template <class Act>
struct views_of<expert::glu<Act>> {
  static typename expert::glu<Act>::weights of(const rank_weights& r) { return r.experts(); }
  static typename expert::glu<Act>::weights shared(const full_weights& w) { return w.shared(); }
};
template <class Act, bool Biases>
struct views_of<expert::mlp<Act, Biases>> {
  static typename expert::mlp<Act, Biases>::weights of(const rank_weights& r) {
    const index_t L = r.local, H = r.hidden, F = r.ffn;
    return {{r.w1.data(), L, F, H},
            {r.w2.data(), L, H, F},
            {r.b1.data(), L, 1, F},
            {r.b2.data(), L, 1, H}};
  }
  static typename expert::mlp<Act, Biases>::weights shared(const full_weights& w) {
    const index_t N = w.cfg.shared_experts, H = w.cfg.hidden, F = w.cfg.shared_width();
    return {{w.shared_w1.data(), N, F, H},
            {w.shared_w2.data(), N, H, F},
            {w.shared_b1.data(), N, 1, F},
            {w.shared_b2.data(), N, 1, H}};
  }
};

template <class Form>
struct views_of<expert::clamped_glu<Form>> {
  using X = expert::clamped_glu<Form>;
  static typename X::weights of(const rank_weights& r) {
    const index_t L = r.local, H = r.hidden, F = r.ffn;
    typename X::weights v{{r.w1.data(), L, F, H}, {r.w3.data(), L, F, H}, {r.w2.data(), L, H, F}};
    if constexpr (X::biases)
      v.b1 = {r.b1.data(), L, 1, F}, v.b3 = {r.b3.data(), L, 1, F}, v.b2 = {r.b2.data(), L, 1, H};
    return v;
  }
};

template <class Placement>
rank_weights slice(const full_weights& w, const Placement& placement, int rank) {
  const index_t L = placement.slots_per_rank(), H = w.cfg.hidden, F = w.cfg.ffn;
  rank_weights r{std::vector<float>(L * F * H),
                 std::vector<float>(L * F * H),
                 std::vector<float>(L * H * F),
                 L,
                 H,
                 F,
                 std::vector<float>(L * F),
                 std::vector<float>(L * H),
                 std::vector<float>(L * F)};
  for (index_t j = 0; j < L; ++j) {
    const index_t e = placement.expert_at(rank, static_cast<int>(j));
    if (!w.b1.empty()) {
      std::copy_n(w.b1.begin() + e * F, F, r.b1.begin() + j * F);
      std::copy_n(w.b2.begin() + e * H, H, r.b2.begin() + j * H);
    }
    if (!w.b3.empty()) std::copy_n(w.b3.begin() + e * F, F, r.b3.begin() + j * F);
    std::copy_n(w.w1.begin() + e * F * H, F * H, r.w1.begin() + j * F * H);
    std::copy_n(w.w3.begin() + e * F * H, F * H, r.w3.begin() + j * F * H);
    std::copy_n(w.w2.begin() + e * H * F, H * F, r.w2.begin() + j * H * F);
  }
  return r;
}

}  // namespace epmoe::reference
