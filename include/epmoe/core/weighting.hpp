// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where a layer applies each assignment's routing weight: on the expert's output (y = Σ_k
// w_k E_k(x), every family but one) or on its input (y = Σ_k E_k(w_k x), Llama 4; a SwiGLU is
// not homogeneous, so the two differ). A bundle chooses once:
//   struct llama4_policies : epmoe::default_policies {
//     using weighting = epmoe::weighting::input;
//   };
// Both are the same two passes: one direction sends weighted rows to the experts and sums
// what comes back with weight 1, the other sends plain rows and weights the sum at home. The
// routing weight's gradient g_k is the dot of the weighted-send direction's home tensor with
// what the plain-send direction brought back (output: dy · E_k(x); input: x · d(in_k)).
namespace epmoe::weighting {

/// A pass direction.
enum class direction { forward, backward };

/// y = Σ_k w_k E_k(x): the forward sends x, the reduce weights the outputs; the backward sends
/// w_k dy and sums the dX rows.
struct output {
  static constexpr direction weighted_send = direction::backward;
};

/// y = Σ_k E_k(w_k x) (Llama 4's `routed_in = x * score`): the forward sends w_k x and sums the
/// outputs; the backward sends dy, gets d(in_k) back, and at home dx += Σ_k w_k d(in_k),
/// g_k = x · d(in_k). Per-rank dedup sends one row per (token, rank), which cannot carry two
/// scales: refused at compile time.
struct input {
  static constexpr direction weighted_send = direction::forward;
};

}  // namespace epmoe::weighting

namespace epmoe::detail {
/// The bundle's weighting (weighting::output unless it declares `using weighting = ...`).
template <class Policies>
auto weighting_of() {
  if constexpr (requires { typename Policies::weighting; })
    return typename Policies::weighting{};
  else
    return weighting::output{};
}
}  // namespace epmoe::detail
