// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/config.hpp"
#include "epmoe/core/view.hpp"

// A router's gate stage: the logits (and noise logits) it routes from. A router that needs
// more than logits = x gate^T (noise, input jitter) writes its own gate(space, pass); the
// layer calls router::gate whatever the router, so it never branches on router kinds.
namespace epmoe {

/// The gate stage's inputs and outputs for one pass of T tokens (the layer's buffers).
template <class T>
struct gate_pass {
  matrix_view<const T> x;                   // [T, H] the pass's tokens
  matrix_view<const T> gate;                // [E, H]
  matrix_view<const T> noise_gate;          // [E, H] (routers with uses_noise_gate), else empty
  matrix_view<float> logits;                // [T, E]
  matrix_view<float> noise;                 // [T, E] noise logits (uses_noise_gate), else empty
  T* scratch = nullptr;                     // router::gate_scratch(cfg) elements
  const std::int64_t* token_ids = nullptr;  // [T] or nullptr: then first_token + t
  std::int64_t first_token = 0;
  std::uint64_t pass = 0;                       // the layer's pass counter (seeded training noise)
  const std::uint64_t* pass_counter = nullptr;  // the same in the space's memory, when set
  matrix_view<const T> gate_bias{};             // [1, E] (routers with uses_gate_bias), else empty
};

namespace router {

/// Runs the router's gate stage: its own gate(space, pass) when it has one, else the linear
/// gate logits = x gate^T for a router with uses_gate, else nothing (gate-less routers).
template <class Router, class Space, class T>
void gate(const Router& r, const Space& space, const gate_pass<T>& g) {
  if constexpr (requires { r.gate(space, g); })
    r.gate(space, g);
  else if constexpr (Router::uses_gate)
    space.gemm_nt(g.x, g.gate, g.logits);
}

/// Elements of scratch the router's gate stage needs (its gate_scratch(cfg), else 0).
template <class Router>
index_t gate_scratch(const layer_config& cfg) {
  if constexpr (requires { Router::gate_scratch(cfg); })
    return Router::gate_scratch(cfg);
  else
    return 0;
}

}  // namespace router
}  // namespace epmoe
