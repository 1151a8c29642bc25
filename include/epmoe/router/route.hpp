// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/view.hpp"

// Logits -> routing for any router, without a layer: the one path the layer's route stage
// takes too, so a router checked here is the router the layer runs.
namespace epmoe::router {

/// route()'s default executor: f(i) for i in [0, n) on the calling thread.
struct serial {
  template <class F>
  void for_each(index_t n, F&& f) const {
    for (index_t i = 0; i < n; ++i) f(i);
  }
};

/// What route() needs besides the logits; every field may stay at its default.
struct route_options {
  matrix_view<const float> noise{};             // [T, E] noise-gate logits (noisy_topk while
                                                //   training), or empty
  std::span<const std::int64_t> token_ids{};    // [T] token ids (router::hash needs them), or
                                                //   empty: token t is first_token + t
  std::int64_t first_token = 0;                 // the layer: rank * max_tokens
  std::uint64_t pass = 0;                       // pass counter of seeded training noise
  const std::uint64_t* pass_counter = nullptr;  // or the counter in the executor's memory (a
                                                //   captured graph reads it when replayed)
  std::span<float> float_scratch{};             // batch routers: >= scratch_floats(cfg) with
  std::span<std::int32_t> int_scratch{};        //   max_tokens = T; empty: route() allocates
};

/// Routing slots per token: the router's top_k, or E for a variable count (expert choice).
template <class Router>
int routing_width(const layer_config& cfg) {
  return Router::top_k > 0 ? Router::top_k : cfg.experts;
}

}  // namespace epmoe::router

namespace epmoe::detail {
/// router::route()'s argument checks (config_error naming the argument).
template <class Router>
void check_route(const Router& router, const layer_config& cfg, matrix_view<const float> logits,
                 mutable_routing_view out, const router::route_options& opt) {
  const index_t T = out.ids.rows;
  const int E = cfg.experts;
  require(E >= 1, "cfg.experts", E, "must be >= 1");
  require(cfg.top_k >= 1, "cfg.top_k", cfg.top_k, "must be >= 1");
  if constexpr (Router::top_k > 0) {
    require(cfg.top_k == Router::top_k, "cfg.top_k", cfg.top_k,
            ("must equal the router's top_k (" + std::to_string(Router::top_k) + ")").c_str());
    require(Router::top_k <= E, "cfg.experts", E, "must be >= the router's top_k");
  }
  if constexpr (router_with_validate<Router>) router.validate(cfg);
  if constexpr (requires { router.validate_table(cfg); }) router.validate_table(cfg);
  const int width = router::routing_width<Router>(cfg);
  require_shape(out.ids, T, width, "out.ids");
  require_shape(out.weights, T, width, "out.weights");
  if constexpr (Router::uses_gate) require_shape(logits, T, E, "logits");
  if (opt.noise.data != nullptr) require_shape(opt.noise, T, E, "options.noise");
  if constexpr (router_needs_token_ids<Router>)
    require(opt.token_ids.size() == static_cast<std::size_t>(T), "options.token_ids",
            opt.token_ids.size(), "this router hashes token ids: pass one per token");
  else
    require(opt.token_ids.empty() || opt.token_ids.size() == static_cast<std::size_t>(T),
            "options.token_ids", opt.token_ids.size(), "must be empty or one id per token");
  if constexpr (requires { router.check_token_ids(opt.token_ids); })
    router.check_token_ids(opt.token_ids);  // a table's rows
}

/// The routing itself, on arguments route() checked (the layer's route stage calls this
/// directly: it checked them once, collectively, and a throw mid-pass would strand its peers).
template <class Router, class Space>
void run_router(const Router& router, const layer_config& cfg, matrix_view<const float> logits,
                mutable_routing_view out, const router::route_options& opt, const Space& space) {
  const index_t T = out.ids.rows;
  if constexpr (token_router<Router>) {
    space.for_each(
        T, rows::route_tokens<Router>{
               router, Router::uses_gate ? logits : matrix_view<const float>{}, opt.noise, out.ids,
               out.weights, opt.token_ids.empty() ? nullptr : opt.token_ids.data(), opt.first_token,
               opt.pass, cfg.experts, opt.pass_counter});
  } else {
    // Batch scratch scales with the batch: size it for these T tokens.
    layer_config batch = cfg;
    batch.max_tokens = static_cast<int>(T);
    const auto floats = static_cast<std::size_t>(Router::scratch_floats(batch));
    const auto ints = static_cast<std::size_t>(Router::scratch_ints(batch));
    std::vector<float> own_floats;
    std::vector<std::int32_t> own_ints;
    std::span<float> fs = opt.float_scratch;
    std::span<std::int32_t> is = opt.int_scratch;
    if (fs.empty() && floats > 0) {
      own_floats.resize(floats);
      fs = own_floats;
    }
    if (is.empty() && ints > 0) {
      own_ints.resize(ints);
      is = own_ints;
    }
    require(fs.size() >= floats, "options.float_scratch", fs.size(),
            "must hold the router's scratch_floats for T tokens");
    require(is.size() >= ints, "options.int_scratch", is.size(),
            "must hold the router's scratch_ints for T tokens");
    router.route_batch(cfg, logits, out, fs, is);
  }
}
}  // namespace epmoe::detail

namespace epmoe::router {

/// Routes T tokens: logits [T, E] (row-major; ignored by gate-less routers) into out.ids and
/// out.weights [T, routing_width] (ids in [0, E), or no_expert for an empty slot), exactly as
/// moe_layer's route stage does. A token router runs route_token per token through
/// `space.for_each` (by default on the calling thread); a batch router runs route_batch over
/// the whole batch. Uses cfg.experts, cfg.top_k (must equal a fixed router's top_k) and, for
/// expert choice, cfg.capacity_factor. The router's own state is used as it is: sigmoid_bias
/// selects with `bias` (nullptr: zeros), noisy_topk adds noise only while `training` (give
/// options.noise). Throws config_error naming the argument that breaks a rule, before writing
/// anything; allocates only for a batch router given no scratch.
template <class Router, class Space = serial>
void route(const Router& router, const layer_config& cfg, matrix_view<const float> logits,
           mutable_routing_view out, const route_options& opt = {}, const Space& space = {}) {
  static_assert(router_policy<Router>,
                "epmoe::router::route: the router must provide top_k, uses_gate and "
                "route_token or route_batch (see core/concepts.hpp)");
  detail::check_route(router, cfg, logits, out, opt);
  detail::run_router(router, cfg, logits, out, opt, space);
}

}  // namespace epmoe::router
