// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/router/gate.hpp"
#include "epmoe/router/logit_bias.hpp"
#include "epmoe/router/route.hpp"

// The router stage of a layer: the router policy and everything it routes from and into (the
// gate's logits, the routing, the selection bias and its update, the pass counter behind
// seeded noise), its losses, and its backward into the gate and x.
namespace epmoe::parts {

/// What the router's backward reads and writes for one pass of T tokens.
template <class T>
struct router_backward {
  matrix_view<const T> x;                   // [T, H] the forward's tokens
  const std::int64_t* token_ids = nullptr;  // the forward's, or nullptr
  std::int64_t first_token = 0;             // rank * max_tokens
  std::uint64_t pass = 0;                   // the forward's number
  matrix_view<const T> gate, noise_gate;    // the weights
  matrix_view<float> dgate, dnoise_gate;    // their gradients
  matrix_view<float> weight_grad;           // [T, K] the routing weights' gradient
  float* dx = nullptr;                      // [T, H] dx's home-rank terms (added to)
  backward_options opt{};
  bool routing_given = false;
  matrix_view<float> dgate_bias{};  // [1, E] (router::logit_bias)
};

template <class Space, class Router>
class router_stage {
 public:
  using value_type = typename Space::value_type;
  template <class T>
  using buffer = typename Space::template buffer<T>;
  template <class T>
  using mirror = typename Space::template mirror<T>;

  /// `layer`: the layer's config; the router sees its E + Z scored experts (router_view).
  router_stage(const layer_config& layer, const Space& s, int width, Router r)
      : cfg_(layer.router_view()), router_(r), width_(width) {
    const layer_config& cfg = cfg_;
    const index_t T = cfg.max_tokens, E = cfg.experts, H = cfg.hidden;
    logits_ = s.template allocate_mirror<float>(Router::uses_gate ? T * E : 0);
    if constexpr (router_with_noise_gate<Router>) noise_logits_ = s.template allocate<float>(T * E);
    gate_scratch_ = s.template allocate<value_type>(router::gate_scratch<Router>(cfg));
    if constexpr (batch_router<Router>) {
      batch_floats_.resize(static_cast<std::size_t>(Router::scratch_floats(cfg)));
      batch_ints_.resize(static_cast<std::size_t>(Router::scratch_ints(cfg)));
    }
    if constexpr (Router::uses_gate && has_probabilities<Router>) {
      loss_probs_.resize(static_cast<std::size_t>(T * E));
      loss_acc_.resize(static_cast<std::size_t>(2 * E));
    }
    if constexpr (router_with_bias<Router>) {
      bias_ = s.template allocate_mirror<float>(E);
      load_send_.resize(static_cast<std::size_t>(cfg.ranks * E));
      load_recv_.resize(static_cast<std::size_t>(cfg.ranks * E));
      global_load_.resize(static_cast<std::size_t>(E));
    }
    ids_ = s.template allocate_mirror<std::int32_t>(T * width);
    weights_ = s.template allocate_mirror<float>(T * width);
    pass_counter_ = s.template allocate_mirror<std::uint64_t>(1);
    all_ = s.template allocate_mirror<index_t>(2);
    if (cfg.training) {
      if (Router::uses_gate) dlogits_ = s.template allocate_mirror<float>(T * E);
      if constexpr (router_with_noise_gate<Router>) dnoise_ = s.template allocate<float>(T * E);
      if constexpr (requires { Router::jitters_input; })
        jitter_dx_ = s.template allocate<float>(T * H);
    }
    if constexpr (router_with_table<Router>) {  // the layer's copy of a table router's ids
      router_.validate_table(cfg);
      vocab_ = router_.vocab;
      table_ = s.template allocate_mirror<std::int32_t>(vocab_ * Router::top_k);
    }
    adopt_bias(s);  // a bias given with the router starts the layer's own
    adopt_table(s);
  }
  router_stage(const router_stage&) = delete;

  Router& policy() { return router_; }
  const Router& policy() const { return router_; }

  /// The router may have changed since the last pass (policy(), bias()): a bad setting is
  /// rejected before the pass, on every rank, not mid-pass on one.
  void check(const Space& s, matrix_view<const value_type> noise_gate) {
    if constexpr (requires { router_.check(cfg_, noise_gate); })
      router_.check(cfg_, noise_gate);  // e.g. noisy top-k's noise gate while training
    adopt_bias(s);
    adopt_table(s);
    if constexpr (router_with_validate<Router>) {
      Router r = router_;  // its bias checked where the host can read it
      if constexpr (router_with_bias<Router>) r.bias = bias_.host();
      if constexpr (router_with_table<Router>) r.ids = table_.host();
      r.validate(cfg_);
    }
  }

  /// A table router's token ids (host spaces: a device's are not readable here).
  void check_token_ids(const Space&, std::span<const std::int64_t> ids) const {
    if constexpr (router_with_table<Router> && !device_space<Space>) router_.check_token_ids(ids);
  }

  /// The layer's own host copy of the selection bias [E + Z] (routers with has_bias).
  std::span<float> bias(const Space& s) requires router_with_bias<Router> {
    adopt_bias(s);
    return {bias_.host(), static_cast<std::size_t>(cfg_.experts)};
  }
  /// The router as another layer starts from it: its bias the host values of this one's.
  Router copy_for_another() const {
    Router r = router_;
    if constexpr (router_with_bias<Router>) r.bias = bias_.host();
    if constexpr (router_with_table<Router>) r.ids = table_.host();
    return r;
  }

  /// Routes T tokens: the router's gate stage, then its routing into ids and weights.
  template <class Pass>
  void route(const Space& s, const Pass& p, matrix_view<const value_type> gate,
             matrix_view<const value_type> noise_gate, std::int64_t first,
             matrix_view<const value_type> gate_bias = {}) {
    const index_t T = p.tokens(), E = cfg_.experts;
    if (p.given) return copy_given(s, *p.given, T);
    const matrix_view<float> logits(logits_.device(), Router::uses_gate ? T : 0, E);
    const matrix_view<float> noise(noise_logits_.data(), noise_logits_.data() ? T : 0, E);
    const std::int64_t* ids = p.token_ids.empty() ? nullptr : p.token_ids.data();
    router::gate(router_, s,
                 gate_pass<value_type>{p.x, gate, noise_gate, logits, noise, gate_scratch_.data(),
                                       ids, first, p.id, pass_counter_.device(), gate_bias});
    const router::route_options opt{.noise = noise,
                                    .token_ids = p.token_ids,
                                    .first_token = first,
                                    .pass = p.id,
                                    .pass_counter = pass_counter_.device(),
                                    .float_scratch = batch_floats_,
                                    .int_scratch = batch_ints_};
    if constexpr (token_router<Router>) {
      epmoe::detail::run_router(router_, cfg_, logits,
                                {{ids_.device(), T, width_}, {weights_.device(), T, width_}}, opt,
                                s);
    } else {  // a batch decides on the host: logits there, routing back (no-ops on the host)
      s.to_host(logits_, 0, T * E);
      s.synchronize();
      epmoe::detail::run_router(router_, cfg_, {logits_.host(), T, E},
                                {{ids_.host(), T, width_}, {weights_.host(), T, width_}}, opt,
                                router::serial{});
      s.to_device(ids_, 0, T * width_);
      s.to_device(weights_, 0, T * width_);
    }
  }
  /// A user-supplied routing (host memory, checked by forward) into the routing buffers.
  void copy_given(const Space& s, const routing_view& r, index_t T) {
    for (index_t t = 0; t < T; ++t)
      for (int k = 0; k < width_; ++k) {
        ids_.host()[t * width_ + k] = r.ids(t, k);
        weights_.host()[t * width_ + k] = r.weights(t, k);
      }
    s.to_device(ids_, 0, T * width_);
    s.to_device(weights_, 0, T * width_);
  }
  /// The pass counter the routers' noise reads, advanced on the space (a pass captured in a
  /// CUDA graph advances it each time it is replayed).
  void advance(const Space& s) const { s.for_each(1, rows::advance{pass_counter_.device()}); }

  /// The routing of the pass in the space's memory [T, slots].
  routing_view routing(index_t T) const {
    return {{ids_.device(), T, width_}, {weights_.device(), T, width_}};
  }
  /// The same on the host (waits for the pass on a device space).
  routing_view last_routing(const Space& s, index_t T) const {
    s.to_host(ids_, 0, T * width_);
    s.to_host(weights_, 0, T * width_);
    s.synchronize();
    return {{ids_.host(), T, width_}, {weights_.host(), T, width_}};
  }

  /// The router's losses of the last pass of T tokens (none for a given routing).
  void losses(const Space& s, index_t T, bool given, pass_stats& st) const {
    const layer_config& cfg = cfg_;
    st.losses = {};
    if constexpr (Router::uses_gate && has_probabilities<Router>) {
      if (given) return;
      s.to_host(logits_, 0, T * cfg.experts);
      const routing_view r = last_routing(s, T);
      compute_losses(router_, cfg, {logits_.host(), T, cfg.experts}, r,
                     std::span<float>(loss_probs_), std::span<double>(loss_acc_), st.losses);
    }
  }

  /// update_router's collective: the last pass's per-expert load `routed` summed over the
  /// ranks (an all-reduce through the comm's all-to-all), then the router's bias update.
  template <class Comm>
  std::span<const index_t> update_bias(Comm& comm, const Space& s,
                                       const index_t* routed) requires router_with_bias<Router> {
    const int R = cfg_.ranks, E = cfg_.experts;
    for (int r = 0; r < R; ++r)
      std::copy_n(routed, E, load_send_.begin() + static_cast<std::size_t>(r) * E);
    comm.alltoall(load_send_.data(), load_recv_.data(), E);
    for (int e = 0; e < E; ++e) {
      index_t sum = 0;
      for (int r = 0; r < R; ++r) sum += load_recv_[static_cast<std::size_t>(r) * E + e];
      global_load_[static_cast<std::size_t>(e)] = sum;
    }
    router_.update_bias(bias(s), global_load_);
    return global_load_;
  }

  /// The router's backward into dlogits (+ the losses'), then dgate = dlogitsᵀ x and the
  /// home-rank term dx += dlogits W_gate (through the jitter mask, and the noise gate's while
  /// training). A given routing ran no router: its gates' gradients are zeros.
  void backward(const Space& s, const router_backward<value_type>& b) {
    if constexpr (Router::uses_gate && router_with_backward<Router>) {
      const layer_config& cfg = cfg_;
      const index_t T = b.x.rows, H = cfg.hidden, E = cfg.experts;
      const bool noisy = noisy_training();
      if (b.routing_given) {
        if (b.opt.accumulate) return;
        for (index_t e = 0; e < E; ++e) s.fill(b.dgate.row(e), H, 0.f);
        for (index_t e = 0; noisy && e < E; ++e) s.fill(b.dnoise_gate.row(e), H, 0.f);
        if constexpr (router_with_gate_bias<Router>) s.fill(b.dgate_bias.data, E, 0.f);
        return;
      }
      const matrix_view<float> dl(dlogits_.device(), T, E);
      const matrix_view<float> dn(dnoise_.data(), noisy ? T : 0, E);
      s.for_each(T, rows::backward_tokens<Router>{router_,
                                                  {logits_.device(), T, E},
                                                  {ids_.device(), T, width_},
                                                  b.weight_grad,
                                                  dl,
                                                  {noise_logits_.data(), noisy ? T : 0, E},
                                                  dn,
                                                  b.token_ids,
                                                  b.first_token,
                                                  b.pass});
      const loss_scales& ls = b.opt.losses;
      if constexpr (has_probabilities_backward<Router>)
        if (ls.aux != 0 || ls.seq_aux != 0 || ls.z != 0) {  // the losses are host code
          s.to_host(logits_, 0, T * E);
          s.to_host(dlogits_, 0, T * E);
          const routing_view r = last_routing(s, T);  // waits for both copies
          loss_backward(router_, cfg, {logits_.host(), T, E}, r, ls, {dlogits_.host(), T, E},
                        std::span<float>(loss_probs_), std::span<double>(loss_acc_));
          s.to_device(dlogits_, 0, T * E);
        }
      if constexpr (router_with_gate_bias<Router>)  // logits = x Wᵀ + b: db = Σ_t dlogits
        s.for_each(E, router::logit_bias_grad{dl, b.dgate_bias.data, b.opt.accumulate});
      all_.host()[0] = 0;
      all_.host()[1] = T;
      s.to_device(all_, 0, 2);
      // The gate's input: x, or x ⊙ m with input jitter (its dx term then goes through m).
      const bool jit = jittered();
      const value_type* gx = jit ? gate_scratch_.data() : b.x.data;
      const index_t gs = jit ? H : b.x.stride;
      float* dxg = jit ? jitter_dx_.data() : b.dx;
      const auto project_back = [&](matrix_view<const float> d, matrix_view<const value_type> w,
                                    matrix_view<float> dw, bool dx_adds) {
        // A projection logits = x Wᵀ: dW (+)= dᵀ x, dx (+)= d W.
        const grouped_rows<const float> a = all_rows<const float>(d.data, E, E);
        s.grouped_gemm_tn_accumulate(
            a, all_rows<const value_type>(gx, H, gs),
            stacked_view<float>(dw.data, 1, E, H, dw.stride, E * dw.stride), b.opt.accumulate);
        s.grouped_gemm_nn(a,
                          stacked_view<const value_type>(w.data, 1, E, H, w.stride, E * w.stride),
                          all_rows<float>(dxg, H, H), dx_adds);
      };
      project_back(dl, b.gate, b.dgate, !jit);
      if (noisy) project_back(dn, b.noise_gate, b.dnoise_gate, true);  // the noise gate
      if constexpr (requires { typename Router::unjittered; })
        if (jit)
          s.for_each_row(T, H,
                         typename Router::unjittered{router_, dxg, b.dx, H, b.token_ids,
                                                     b.first_token, b.pass});
    }
  }

  /// Whether passes draw routing noise through a noise gate (noisy top-k while training).
  bool noisy_training() const {
    if constexpr (router_with_noise_gate<Router>)
      return router_.training;
    else
      return false;
  }
  /// Bytes a training forward keeps of the router: its logits (routers with a gate).
  index_t saved_bytes(index_t T) const {
    return Router::uses_gate ? T * cfg_.experts * static_cast<index_t>(sizeof(float)) : 0;
  }

 private:
  // The router reads the layer's bias; values it was pointed at instead (the constructor's
  // router, policy().bias = p) are copied in first, so no setting is silently dropped. Those
  // values are host memory.
  void adopt_bias(const Space& s) {
    if constexpr (router_with_bias<Router>) {
      const layer_config& cfg = cfg_;
      float* own = bias_.host();
      if (router_.bias != bias_.device() || router_.bias == nullptr) {
        if (router_.bias && router_.bias != own)
          std::copy_n(router_.bias, cfg.experts, own);
        else if (!router_.bias)
          std::fill_n(own, cfg.experts, 0.f);
        router_.bias = bias_.device();
      }
      s.to_device(bias_, 0, cfg.experts);
    }
  }
  // A table router's ids: values it was pointed at (host memory) are checked, then copied
  // into the layer's own, which it reads from then on.
  void adopt_table(const Space& s) {
    if constexpr (router_with_table<Router>) {
      const layer_config& cfg = cfg_;
      if (router_.ids == table_.device()) return;
      epmoe::detail::require(router_.vocab == vocab_, "router.vocab", router_.vocab,
                             "must stay the constructor's (the layer's copy has that many rows)");
      router_.validate_table(cfg);
      const index_t n = vocab_ * Router::top_k;
      std::copy_n(router_.ids, n, table_.host());
      s.to_device(table_, 0, n);
      router_.ids = table_.device();
    }
  }
  // Whether the gate saw x ⊙ m (input jitter while training).
  bool jittered() const {
    if constexpr (requires { Router::jitters_input; })
      return router_.training;
    else
      return false;
  }
  // One group of all T rows (the gate's GEMMs).
  template <class T>
  grouped_rows<T> all_rows(T* data, index_t cols, index_t stride) const {
    return {data, cols, stride, 1, all_.host(), all_.device(), 1};
  }

  layer_config cfg_;  // the layer's, with the E + Z experts the router scores
  Router router_;
  int width_;  // routing slots per token
  mirror<float> logits_, weights_, bias_, dlogits_;
  mirror<std::int32_t> ids_, table_;
  index_t vocab_ = 0;  // rows of table_
  mirror<std::uint64_t> pass_counter_;
  mirror<index_t> all_;  // [2]: one group of all T rows
  buffer<float> noise_logits_, dnoise_, jitter_dx_;
  buffer<value_type> gate_scratch_;
  std::vector<float> batch_floats_;  // batch routers decide on the host
  std::vector<std::int32_t> batch_ints_;
  mutable std::vector<float> loss_probs_;  // losses are computed on the host
  mutable std::vector<double> loss_acc_;
  std::vector<index_t> load_send_, load_recv_, global_load_;
};

}  // namespace epmoe::parts
