// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/router/gate.hpp"

namespace epmoe::router {

/// Switch Transformer input jitter around any gated router: while `training`, the router's
/// input (not the experts') is multiplied element-wise by U(1 - eps, 1 + eps) before the
/// gate GEMM. Seeded, counter-based, off by default.
///   using router = epmoe::router::jitter<epmoe::router::switch_top1>;
template <class Inner>
struct jitter : Inner {
  static constexpr bool jitters_input = true;

  float eps = 1e-2f;
  std::uint64_t seed = 0;
  bool training = false;

  /// The factor for element h of token `token` in pass `pass`.
  EPMOE_HD float factor(std::uint64_t pass, std::int64_t token, std::int64_t h) const {
    const float u = math::uniform01(
        math::hash4(seed, pass, static_cast<std::uint64_t>(token), static_cast<std::uint64_t>(h)));
    return 1.f - eps + 2.f * eps * u;
  }

  /// x * U(1-eps, 1+eps), element i of a [T, H] pass (the gate's input while training).
  template <class T>
  struct jittered {
    jitter router;
    matrix_view<const T> x;
    T* out;
    const std::int64_t* ids;
    std::int64_t first;
    std::uint64_t pass;
    const std::uint64_t* pass_counter;  // read on the device when set
    EPMOE_HD void operator()(index_t i) const {
      const index_t t = i / x.cols, h = i % x.cols;
      const std::uint64_t p = pass_counter ? *pass_counter : pass;
      out[i] = from_float<T>(to_float(x(t, h)) * router.factor(p, ids ? ids[t] : first + t, h));
    }
  };

  /// Its gate stage: the inner router's, on the jittered input while training.
  template <class Space, class T>
  void gate(const Space& space, const gate_pass<T>& g) const {
    if (!training) return router::gate(static_cast<const Inner&>(*this), space, g);
    space.for_each(g.x.rows * g.x.cols, jittered<T>{*this, g.x, g.scratch, g.token_ids,
                                                    g.first_token, g.pass, g.pass_counter});
    gate_pass<T> in = g;
    in.x = {g.scratch, g.x.rows, g.x.cols};
    router::gate(static_cast<const Inner&>(*this), space, in);
  }
  /// Backward: the gate saw x ⊙ m, so its dx term d (the logits' gradient times the gate)
  /// reaches x times m: into[t, h] += d[t, h] * m[t, h], m redrawn as in that forward.
  struct unjittered {
    jitter router;
    const float* d;  // [T, H]
    float* into;     // [T, H]
    index_t cols;
    const std::int64_t* ids;
    std::int64_t first;
    std::uint64_t pass;
    EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
      const std::int64_t token = ids ? ids[t] : first + t;
      for (index_t h = h0; h < h1; ++h)
        into[t * cols + h] += d[t * cols + h] * router.factor(pass, token, h);
    }
  };

  /// The jittered input: [max_tokens, H].
  static index_t gate_scratch(const layer_config& cfg) {
    return static_cast<index_t>(cfg.max_tokens) * cfg.hidden;
  }
};

}  // namespace epmoe::router
