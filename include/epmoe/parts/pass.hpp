// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>
#include <exception>
#include <span>
#include <string>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/exchange/message.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

namespace epmoe {

/// What forward returns: the pass's number and whether the layer kept what its backward needs
/// (config training, and forward_options::keep_for_backward). backward(pass, ...) consumes it,
/// once; the layer keeps the state of its last forward only, so an older pass's handle is refused
/// by name.
struct pass_handle {
  std::uint64_t id = 0;
  bool training = false;
  explicit operator bool() const { return training; }
};

/// How a forward runs (moe_layer::forward).
struct forward_options {
  /// A training layer's forward keeps what its backward reads (the expert rows, their hidden
  /// layers, the token ids). false: an inference pass (a framework's no_grad) keeps nothing
  /// and writes none of that storage; it has no backward.
  bool keep_for_backward = true;
};

/// How a backward runs (moe_layer::backward).
struct backward_options {
  loss_scales losses{};     // add d(scale * loss)/d(gate, x) for each router loss of the pass
  bool accumulate = false;  // add into `grads` instead of overwriting them
  /// A pass whose routing was given: where the routing weights' gradient dL/dweights [T, K]
  /// goes (the space's memory; 0 for a dropped assignment or an empty slot), or empty.
  matrix_view<float> routing_grad{};
};

}  // namespace epmoe

// The layer's parts (docs/architecture.md): a pass, the lifecycle guard, the weights store,
// the router stage, the home terms, the training state and the stages a schedule drives.
namespace epmoe::parts {

/// One forward of a layer, as a value: what it runs on, its tokens, where its routing comes
/// from and this rank's verdict on its inputs. A rank whose inputs are rejected, or that
/// fails before the pass's first exchange, runs it empty up to the counts exchange, which
/// tells every peer; all ranks then throw before a row moves.
template <class T>
struct forward_pass {
  std::uint64_t id = 0;                     // the layer's passes() before it ran
  matrix_view<const T> x;                   // [T, H] (backward reads it again)
  matrix_view<T> y;                         // [T, H]
  std::span<const std::int64_t> token_ids;  // the caller's, or the layer's copy (training)
  const routing_view* given = nullptr;      // a user-supplied routing, during the pass
  bool routing_given = false;               // the routing was given (no losses, no router grad)
  bool saves = false;                       // a training pass that keeps its backward's state
  index_t limit = 0;                        // the capacity of the pass's slots
  std::exception_ptr error;                 // this rank's rejected input or early failure
  bool deferred = false;  // static shapes on a device: the verdict is read after the pass

  index_t tokens() const { return x.rows; }
  /// From here on the pass has no tokens (its error is thrown at the counts exchange).
  void make_empty(std::exception_ptr e) {
    error = std::move(e);
    x.rows = 0;
    token_ids = {};
    given = nullptr;
  }
};

/// A pass's tokens x and outputs y: [T, H] with T <= max_tokens.
template <class T>
void check_pass_inputs(matrix_view<const T> x, matrix_view<T> y, const layer_config& cfg) {
  detail::require(x.rows <= cfg.max_tokens, "x.rows", x.rows,
                  "tokens per pass must be <= config max_tokens");
  detail::require_shape(x, x.rows, cfg.hidden, "x");
  detail::require_shape(y, x.rows, cfg.hidden, "y");
}

/// Token ids: one per token for a router that hashes them, else none or one per token.
template <class Router>
void check_token_ids(std::span<const std::int64_t> ids, index_t T) {
  if constexpr (router_needs_token_ids<Router>)
    detail::require(ids.size() == static_cast<std::size_t>(T), "token_ids", ids.size(),
                    "this router hashes token ids: pass one per token");
  else
    detail::require(ids.empty() || ids.size() == static_cast<std::size_t>(T), "token_ids",
                    ids.size(), "must be empty or one id per token");
}

/// Every entry of a user-supplied routing [T, width] (host memory), before anything is
/// written: input_error naming the entry ("routing.ids[5][1] = 99: must be in [0, 64)").
inline void check_given_routing(routing_view r, index_t T, int experts, int width) {
  detail::require_shape(r.ids, T, width, "routing.ids");
  detail::require_shape(r.weights, T, width, "routing.weights");
  const auto at = [](const char* field, index_t t, int k) {
    return std::string(field) + "[" + std::to_string(t) + "][" + std::to_string(k) + "]";
  };
  for (index_t t = 0; t < T; ++t)
    for (int k = 0; k < width; ++k) {
      const std::int32_t e = r.ids(t, k);
      if (e != no_expert && (e < 0 || e >= experts))
        throw input_error(at("routing.ids", t, k), std::to_string(e),
                          "must be in [0, " + std::to_string(experts) + ") or -1 (an empty slot)");
      for (int q = 0; q < k; ++q)  // buffers hold at most one row per (token, expert)
        if (e != no_expert && r.ids(t, q) == e)
          throw input_error(
              at("routing.ids", t, k), std::to_string(e),
              "repeats " + at("routing.ids", t, q) + ": a token's experts must be distinct");
      const float w = r.weights(t, k);
      if (!(std::isfinite(w) && w >= 0))
        throw input_error(at("routing.weights", t, k), detail::to_text(w),
                          "must be finite and >= 0");
    }
}

}  // namespace epmoe::parts
