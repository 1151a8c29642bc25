// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/config.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/router/gate.hpp"
#include "epmoe/router/topk_softmax.hpp"

namespace epmoe::router {

/// A learned bias on the gate's logits around any gated router: logits = x gateᵀ + b, b the
/// layer's weights.gate_bias [1, E] (a parameter with a gradient, grads.gate_bias; unlike
/// sigmoid_bias's selection bias, it moves the weights too). The inner router routes from
/// the biased logits, and its backward gives dL/dlogits, whose column sums are dL/db.
template <class Inner>
struct logit_bias : Inner {
  static_assert(Inner::uses_gate, "router::logit_bias<Inner>: Inner must route from a gate");
  static constexpr bool uses_gate_bias = true;

  /// logits[t, e] += bias[e], element i of [T, E].
  template <class T>
  struct add_bias {
    matrix_view<float> logits;
    const T* bias;
    EPMOE_HD void operator()(index_t i) const {
      const index_t t = i / logits.cols, e = i - t * logits.cols;
      logits.data[t * logits.stride + e] += to_float(bias[e]);
    }
  };

  /// Its gate stage: the inner router's, then the bias.
  template <class Space, class T>
  void gate(const Space& space, const gate_pass<T>& g) const {
    router::gate(static_cast<const Inner&>(*this), space, g);
    space.for_each(g.logits.rows * g.logits.cols, add_bias<T>{g.logits, g.gate_bias.data});
  }
};

/// dbias[e] (+)= Σ_t dlogits[t, e], element e (rows in order: deterministic).
struct logit_bias_grad {
  matrix_view<const float> dlogits;  // [T, E]
  float* dbias;                      // [E]
  bool accumulate;
  EPMOE_HD void operator()(index_t e) const {
    float s = 0.f;
    for (index_t t = 0; t < dlogits.rows; ++t) s += dlogits.data[t * dlogits.stride + e];
    dbias[e] = accumulate ? dbias[e] + s : s;
  }
};

/// GPT-OSS (`GptOssTopKRouter`): logits = x Wᵀ + b, the top-K logits, softmax over those K
/// (Mixtral's weights on the biased logits).
template <int K>
using gpt_oss = logit_bias<topk_softmax<K, true>>;

}  // namespace epmoe::router
