// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>

#include "epmoe/core/macros.hpp"

// The activations of published MoE experts, one element at a time in host+device code (apply,
// and grad: the derivative, for the expert backward). An expert policy takes one as a type
// (expert::glu<act::gelu_tanh>, expert::mlp<act::relu>).
namespace epmoe::act {

/// silu(a) = a / (1 + e^-a) (SwiGLU: Mixtral, DeepSeek, Qwen, OLMoE, DBRX).
struct silu {
  static constexpr const char* name = "silu";
  EPMOE_HD static float apply(float a) { return a / (1.f + expf(-a)); }
  /// silu'(a) = σ(a) (1 + a (1 - σ(a))).
  EPMOE_HD static float grad(float a) {
    const float s = 1.f / (1.f + expf(-a));
    return s * (1.f + a * (1.f - s));
  }
};
/// Exact GELU, a Φ(a) (BERT, Switch's GELU variant, PyTorch's default `gelu`).
struct gelu {
  static constexpr const char* name = "gelu";
  EPMOE_HD static float apply(float a) { return 0.5f * a * (1.f + erff(a * 0.70710678118654752f)); }
  /// gelu'(a) = Φ(a) + a φ(a).
  EPMOE_HD static float grad(float a) {
    return 0.5f * (1.f + erff(a * 0.70710678118654752f)) +
           a * 0.39894228040143268f * expf(-0.5f * a * a);
  }
};
/// GELU, tanh approximation (`gelu_new`, `gelu_pytorch_tanh`: GPT-2, T5 v1.1, Gemma).
struct gelu_tanh {
  static constexpr const char* name = "gelu_tanh";
  EPMOE_HD static float apply(float a) {
    return 0.5f * a * (1.f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)));
  }
  /// With u = c (a + 0.044715 a³): (1 + tanh u) / 2 + a (1 - tanh² u) c (1 + 3 · 0.044715 a²) / 2.
  EPMOE_HD static float grad(float a) {
    constexpr float c = 0.79788456080286536f;
    const float t = tanhf(c * (a + 0.044715f * a * a * a));
    return 0.5f * (1.f + t) + 0.5f * a * (1.f - t * t) * c * (1.f + 3.f * 0.044715f * a * a);
  }
};
/// max(a, 0) (Switch Transformer, NLLB-MoE, GShard).
struct relu {
  static constexpr const char* name = "relu";
  EPMOE_HD static float apply(float a) { return a > 0.f ? a : 0.f; }
  /// 1 for a > 0, else 0 (0 at the kink, as PyTorch).
  EPMOE_HD static float grad(float a) { return a > 0.f ? 1.f : 0.f; }
};

}  // namespace epmoe::act

namespace epmoe::expert {
/// dst[i] = src[i]: the hidden layers an expert keeps for backward (out of and back into
/// its scratch).
template <class T>
struct copy_elements {
  const T* src;
  T* dst;
  EPMOE_HD void operator()(index_t i) const { dst[i] = src[i]; }
};
}  // namespace epmoe::expert
