// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>

#include "epmoe/core/config.hpp"
#include "epmoe/core/workspace.hpp"
#include "epmoe/router/route.hpp"

// What a layer's parts are sized from, decided once at construction before anything is
// allocated (the layout's own checks come first).
namespace epmoe::parts {

/// Chunks a schedule cuts a pass in unless config chunks says otherwise.
template <class Schedule>
int default_chunks() {
  if constexpr (requires { Schedule::default_chunks; })
    return Schedule::default_chunks;
  else
    return 1;
}

/// The workspace layout of layer type L (its policies and options) for slots L per rank.
template <class L, class Capacity>
workspace_layout layout_of(const layer_config& cfg, int slots, int chunks, const Capacity& capacity,
                           int node_size) {
  using Router = typename L::router_type;
  index_t router_cap = 0;
  if constexpr (requires { Router::capacity(cfg, index_t{}); })
    router_cap = Router::capacity(cfg, cfg.max_tokens);  // expert choice
  return workspace_layout::of(
      cfg, router::routing_width<Router>(cfg), slots, chunks, L::units_in_flight, Capacity::pads,
      [&](index_t T) { return capacity.limit(cfg, T); }, router_cap, sizeof(typename L::value_type),
      node_size, L::hierarchical, L::dedup);
}

/// Windows of tokens per schedule chunk when a receive bound meets dedup (token rounds): each
/// holds at most `quota` tokens of every rank whatever its T.
inline int rounds_per_chunk(const workspace_layout& w, const layer_config& cfg, int chunks) {
  if (!w.token_rounds) return 1;
  const index_t per_chunk = (cfg.max_tokens + chunks - 1) / chunks;
  return static_cast<int>((per_chunk + w.quota - 1) / w.quota);
}

/// Elements of the experts' scratch (routed and shared, forward and, when training,
/// backward: each at most a unit's rows, or the shared experts' T rows).
template <class L>
index_t scratch_elements(const layer_config& cfg, const workspace_layout& w) {
  using X = typename L::expert_type;
  const index_t T = cfg.max_tokens, N = cfg.shared_experts;
  const index_t F = w.padded(cfg.ffn), Fs = w.padded(cfg.shared_width());
  index_t need = std::max(w.expert_rows * X::scratch_per_row(F),
                          N > 0 ? T * X::scratch_per_row(Fs) : index_t{0});
  if constexpr (requires { X::backward_scratch_per_row(index_t{}); })
    if (cfg.training)
      need = std::max({need, w.expert_rows * X::backward_scratch_per_row(F),
                       N > 0 ? T * X::backward_scratch_per_row(Fs) : index_t{0}});
  return need;
}

/// What a device space keeps for a pass's grouped GEMMs and scans (a forward's three per unit
/// and per shared expert; a backward's eight per unit, eleven per shared expert, two for the
/// gate).
template <class L, class Space>
void reserve_gemms(const Space& s, const layer_config& cfg, const workspace_layout& w, int slots) {
  const int units = static_cast<int>(w.max_units), N = cfg.shared_experts;
  const index_t keys = std::max(w.plan_keys(), w.recv_buffer_rows) + 1;
  s.reserve(3 * units + 3 * N + 2, std::max(1, slots), keys);
  if constexpr (requires { L::expert_type::backward_scratch_per_row(index_t{}); })
    if (cfg.training) s.reserve(8 * units + 11 * N + 4, std::max(1, slots), keys);
}

/// Whether expert X can keep its hidden layers for the backward (a forward with `keep`).
template <class X, class Space>
inline constexpr bool keeps_hidden =
    requires(const Space& s, const typename X::template weights_of<typename Space::value_type>& w,
             grouped_rows<typename Space::value_type> r, typename Space::value_type* p) {
  X::forward(s, w, r, p, p);
  X::keep_per_row(index_t{});
};
/// Elements per row a training forward keeps of the experts' hidden layers (0: the backward
/// recomputes them: config recompute, or an expert that cannot keep them).
template <class X, class Space>
index_t keep_per_row(const layer_config& cfg, const workspace_layout& w) {
  if constexpr (keeps_hidden<X, Space>)
    return cfg.training && !cfg.recompute ? X::keep_per_row(w.padded(cfg.ffn)) : 0;
  else
    return 0;
}

}  // namespace epmoe::parts
