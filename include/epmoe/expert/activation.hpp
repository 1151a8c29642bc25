// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>

#include "epmoe/core/macros.hpp"

// The activations of published MoE experts, one element at a time in host+device code. An
// expert policy takes one as a type (expert::glu<act::gelu_tanh>, expert::mlp<act::relu>).
namespace epmoe::act {

/// silu(a) = a / (1 + e^-a) (SwiGLU: Mixtral, DeepSeek, Qwen, OLMoE, DBRX).
struct silu {
  static constexpr const char* name = "silu";
  EPMOE_HD static float apply(float a) { return a / (1.f + expf(-a)); }
};
/// Exact GELU, a Φ(a) (BERT, Switch's GELU variant, PyTorch's default `gelu`).
struct gelu {
  static constexpr const char* name = "gelu";
  EPMOE_HD static float apply(float a) { return 0.5f * a * (1.f + erff(a * 0.70710678118654752f)); }
};
/// GELU, tanh approximation (`gelu_new`, `gelu_pytorch_tanh`: GPT-2, T5 v1.1, Gemma).
struct gelu_tanh {
  static constexpr const char* name = "gelu_tanh";
  EPMOE_HD static float apply(float a) {
    return 0.5f * a * (1.f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)));
  }
};
/// max(a, 0) (Switch Transformer, NLLB-MoE, GShard).
struct relu {
  static constexpr const char* name = "relu";
  EPMOE_HD static float apply(float a) { return a > 0.f ? a : 0.f; }
};

}  // namespace epmoe::act
