// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/losses.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/core/workspace.hpp"
#include "epmoe/expert/activation.hpp"
#include "epmoe/parts/pass.hpp"

namespace epmoe {

namespace detail {
/// An expert policy's gradient bundle (grads_of<float>), or nothing for a forward-only one.
struct no_expert_grads {};
template <class X>
auto expert_grads_of() {
  if constexpr (requires { typename X::template grads_of<float>; })
    return typename X::template grads_of<float>{};
  else
    return no_expert_grads{};
}
}  // namespace detail

/// Gradients of one rank's parameters (float, in the space's memory), shaped as the weights;
/// a tensor the configuration does not use may stay empty: moe_layer<P>::gradients.
template <class ExpertGrads>
struct layer_gradients {
  matrix_view<float> gate{};         // [E, H]: from this rank's tokens; the gate is replicated,
                                     //   so sum it over the ranks (reduce_gradients, or the
                                     //   framework's all-reduce)
  ExpertGrads experts{};             // this rank's slots, local-slot order; a replicated
                                     //   expert's gradient is the sum over its copies
  ExpertGrads shared{};              // [N] shared experts
  matrix_view<float> shared_gate{};  // [N, H] (config shared_gate)
  matrix_view<float> output_bias{};  // [1, H] (config output_bias)
  matrix_view<float> noise_gate{};   // [E, H] noisy top-k's noise projection (while training)
  matrix_view<float> gate_bias{};    // [1, E] the gate's logit bias (router::logit_bias);
                                     //   replicated like the gate
};

}  // namespace epmoe

// What only training needs, in one part a layer holds only with config training: what a
// forward keeps for its backward (the experts' input rows, their outputs with dedup, their
// hidden layers without recompute, the token ids), the backward's staging, and
// reduce_gradients' sums.
namespace epmoe::parts {

/// A backward's loss scales: finite, and 0 for a router whose losses have no gradient.
template <class Router>
void check_losses(const loss_scales& ls) {
  for (double v : {ls.aux, ls.seq_aux, ls.z})
    detail::require(std::isfinite(v), "backward_options.losses", v, "must be finite");
  if constexpr (!has_probabilities_backward<Router>)
    detail::require(ls.aux == 0 && ls.seq_aux == 0 && ls.z == 0, "backward_options.losses",
                    "nonzero",
                    "this router's losses have no gradient (no probabilities_backward): leave "
                    "them 0");
}

/// Whether a gradient bundle of routed experts is empty: frozen experts (a framework's
/// requires_grad = false), whose backward computes dx only and no dW.
template <class Expert, class G>
bool frozen_experts(G g) {
  for (const auto* t : Expert::tensors(g))
    if (t->data) return false;
  return true;
}

/// Gradients shaped as the weights they belong to (L local slots; the noise gate's while
/// noisy top-k trains); the routed experts' all given or all empty (frozen).
template <class Expert, class Router, class Grads>
void check_gradients(const Grads& g, const layer_config& cfg, index_t L, bool noisy) {
  const index_t H = cfg.hidden;
  const index_t S = cfg.scored_experts();  // the router's tensors: E + Z rows
  if constexpr (Router::uses_gate) detail::require_shape(g.gate, S, H, "grads.gate");
  if constexpr (router_with_gate_bias<Router>)
    detail::require_shape(g.gate_bias, 1, S, "grads.gate_bias");
  if constexpr (requires { Expert::validate(g.experts, 0, 0, 0, std::string{}); }) {
    if (!frozen_experts<Expert>(g.experts))  // else frozen: every view empty
      Expert::validate(g.experts, L, H, cfg.ffn, "grads.experts");
    if (cfg.shared_experts > 0)
      Expert::validate(g.shared, cfg.shared_experts, H, cfg.shared_width(), "grads.shared");
  }
  if (cfg.shared_gate)
    detail::require_shape(g.shared_gate, cfg.shared_experts, H, "grads.shared_gate");
  if (cfg.output_bias) detail::require_shape(g.output_bias, 1, H, "grads.output_bias");
  if (noisy) detail::require_shape(g.noise_gate, S, H, "grads.noise_gate");
}

template <class Space, class Expert, class Router>
class training_state {
 public:
  using value_type = typename Space::value_type;
  using gradients = layer_gradients<decltype(epmoe::detail::expert_grads_of<Expert>())>;
  template <class T>
  using buffer = typename Space::template buffer<T>;
  template <class T>
  using mirror = typename Space::template mirror<T>;

  /// `keep`: elements per row of the experts' hidden layers a forward keeps (0: recompute).
  training_state(const layer_config& cfg, const Space& s, const workspace_layout& w, int width,
                 bool dedup, index_t keep)
      : keep_(keep), S_(w.row_stride), hidden_(cfg.hidden) {
    const index_t T = cfg.max_tokens, H = cfg.hidden;
    // Every unit's expert rows of a pass: the receive bound does not bound these copies
    // (docs/training.md): R * T * min(K, L) rows at most.
    saved_in_ = s.template allocate<value_type>(w.recv_rows * S_);
    if (dedup) saved_out_ = s.template allocate<value_type>(w.recv_rows * S_);
    if (keep_ > 0) saved_hidden_ = s.template allocate<value_type>(w.recv_rows * keep_);
    saved_at_.assign(static_cast<std::size_t>(w.max_units), 0);
    rows_cap_ = w.recv_rows;
    weight_grad_ = s.template allocate<float>(T * width);
    dx_home_ = s.template allocate<float>(T * H);
    token_ids_ = s.template allocate<std::int64_t>(T);
    width_ = width;
  }

  // --- the forward's side -----------------------------------------------------------------

  /// A training forward starts: the last one's state is gone.
  void begin_forward() {
    saved_ = false;
    rows_ = 0;
  }
  /// The layer's copy of the pass's token ids (backward reads them again), or empty.
  std::span<const std::int64_t> keep_token_ids(const Space& s, std::span<const std::int64_t> ids) {
    ids_kept_ = static_cast<index_t>(ids.size());
    if (ids.empty()) return {};
    const auto n = ids_kept_;
    s.for_each(n, expert::copy_elements<std::int64_t>{ids.data(), token_ids_.data()});
    return {token_ids_.data(), ids.size()};
  }
  /// Unit u's expert input rows (`inputs`), or with dedup their outputs, into the pass's copy.
  void save_rows(const Space& s, const grouped_rows<value_type>& rows, int u, bool inputs) {
    const index_t n = rows.rows();
    if (inputs) {
      if (rows_ + n > rows_cap_)
        throw std::logic_error("epmoe: a pass's expert rows exceed the saved-input workspace");
      saved_at_[static_cast<std::size_t>(u)] = rows_;
      rows_ += n;
    }
    const index_t at = saved_at_[static_cast<std::size_t>(u)];
    value_type* into = (inputs ? saved_in_ : saved_out_).data() + at * S_;
    s.for_each_row(n, rows.cols,
                   rows::copy<value_type>{{rows.data, n, rows.cols, S_}, {into, n, rows.cols, S_}});
  }
  /// Whether a forward keeps the experts' hidden layers (else the backward recomputes them).
  bool keeps() const { return keep_ > 0; }
  /// Where unit u's hidden layers go (kept without recompute), or nullptr.
  value_type* kept_hidden(int u) const {
    return keep_ > 0 ? saved_hidden_.data() + saved_at_[static_cast<std::size_t>(u)] * keep_
                     : nullptr;
  }
  /// The forward `id` ran to the end: its state waits for its backward.
  void end_forward(std::uint64_t id) {
    saved_ = true;
    last_ = id;
    any_ = true;
    inference_ = false;
  }
  /// The forward `id` kept nothing (forward_options::keep_for_backward false): it is the
  /// last pass, and it has no backward.
  void end_inference(std::uint64_t id) {
    saved_ = false;
    last_ = id;
    any_ = true;
    inference_ = true;
  }
  /// Bytes a forward of T tokens kept (expert rows, dedup outputs, hidden layers, routing,
  /// token ids).
  index_t saved_bytes(index_t T, bool dedup) const {
    return rows_ * ((dedup ? 2 : 1) * hidden_ + keep_) * static_cast<index_t>(sizeof(value_type)) +
           T * width_ * static_cast<index_t>(sizeof(float) + sizeof(std::int32_t)) +
           ids_kept_ * static_cast<index_t>(sizeof(std::int64_t));
  }

  // --- the backward's side ----------------------------------------------------------------

  /// The handle of the last training forward.
  pass_handle last() const { return {last_, true}; }
  /// Throws config_error("backward", ...) unless `h` is the pass whose state is kept.
  void check(const pass_handle& h) const {
    if (!any_)
      throw config_error("backward", "no saved forward",
                         "needs a forward pass first, and runs once per forward");
    if (h.id != last_)
      throw config_error("backward", "pass " + std::to_string(h.id),
                         "the layer keeps the state of its last forward only (pass " +
                             std::to_string(last_) +
                             "): run each backward before the next forward");
    if (inference_)
      throw config_error("backward", "pass " + std::to_string(h.id),
                         "its forward kept nothing for a backward "
                         "(forward_options.keep_for_backward = false)");
    if (!saved_)
      throw config_error("backward", "pass " + std::to_string(h.id),
                         "consumed: its backward ran already (one backward per forward), or its "
                         "forward failed");
  }
  /// A backward of pass `h` takes its state, whatever happens next (a stale handle takes
  /// nothing: the state is another pass's).
  void consume(const pass_handle& h) {
    if (h.id == last_) saved_ = false;
  }
  /// The state no longer applies (the experts moved).
  void drop() { saved_ = false; }

  const value_type* saved_inputs(int u) const {
    return saved_in_.data() + saved_at_[static_cast<std::size_t>(u)] * S_;
  }
  value_type* saved_outputs(int u) const {
    return saved_out_.data() + saved_at_[static_cast<std::size_t>(u)] * S_;
  }
  matrix_view<float> weight_grad(index_t T) const { return {weight_grad_.data(), T, width_}; }
  float* weight_grad_data() const { return weight_grad_.data(); }
  float* dx_home() const { return dx_home_.data(); }

  /// The backward's call: its arguments for the stages, and whether a unit already wrote the
  /// expert gradients (the others add).
  struct call {
    matrix_view<const value_type> dy;
    matrix_view<value_type> dx;
    gradients grads;
    backward_options opt;
    bool grads_started = false;
  };
  call now{};

  // --- reduce_gradients ---------------------------------------------------------------------

  /// Which local slots hold a replicated expert: each such expert's index among them (their
  /// copies' gradients are summed), and the staging sized for every summed tensor.
  template <class Placement, class Weights>
  void plan_replicas(const Space& s, const layer_config& cfg, const Placement& where, int rank,
                     Weights w) {
    const int R = cfg.ranks, L = where.slots_per_rank(), E = cfg.experts;
    std::vector<int> copies(static_cast<std::size_t>(E), 0), index(copies.size(), -1);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < L; ++j) ++copies[where.expert_at(r, j)];
    int q = 0;
    for (int e = 0; e < E; ++e)
      if (copies[e] > 1) index[e] = q++;
    replica_of_slot_.assign(static_cast<std::size_t>(L), -1);
    for (int j = 0; j < L; ++j) replica_of_slot_[j] = index[where.expert_at(rank, j)];
    replicas_ = q;
    gradients none{};
    const index_t n = segments(s, cfg, w, none, true, true);
    const index_t padded = (n + R - 1) / R * R;
    if (!stage_.host() || stage_.size() < padded)
      stage_ = s.template allocate_mirror<float>(std::max<index_t>(padded, 1));
    reduce_send_.assign(static_cast<std::size_t>(std::max<index_t>(padded, 1)), 0.f);
    reduce_recv_.assign(reduce_send_.size(), 0.f);
  }

  /// The replicated tensors' sums over the ranks (and over a replicated expert's copies), each
  /// element summed in rank order by one rank and sent to all: a reduce-scatter, then an
  /// all-gather, through host memory and the comm's all-to-all. Collective.
  template <class Comm, class Weights>
  void reduce(Comm& comm, const Space& s, const layer_config& cfg, Weights w, gradients g) {
    const int R = cfg.ranks;
    const index_t n = segments(s, cfg, w, g, true);
    const index_t P = (n + R - 1) / R;  // each rank sums one piece
    s.to_host(stage_, 0, n);
    s.synchronize();
    float* v = stage_.host();
    std::fill(v + n, v + P * R, 0.f);
    comm.alltoall(v, reduce_recv_.data(), P);
    for (index_t i = 0; i < P; ++i) {
      float sum = 0.f;
      for (int r = 0; r < R; ++r) sum += reduce_recv_[static_cast<std::size_t>(r * P + i)];
      for (int r = 0; r < R; ++r) reduce_send_[static_cast<std::size_t>(r * P + i)] = sum;
    }
    comm.alltoall(reduce_send_.data(), v, P);
    s.to_device(stage_, 0, n);
    segments(s, cfg, w, g, false);
    s.synchronize();
  }

 private:
  // Every tensor reduce sums, in a fixed order, copied into the staging buffer (`in`) or back
  // out of it; returns the elements. `count_only`: sizes only.
  template <class Weights>
  index_t segments(const Space& s, const layer_config& cfg, Weights& w, gradients& g, bool in,
                   bool count_only = false) {
    // m into the staging at element o (`in`), or back.
    const auto stage = [&](matrix_view<float> m, index_t o) {
      const matrix_view<float> st(stage_.device() + o, m.rows, m.cols, m.cols);
      if (in)
        s.for_each_row(m.rows, m.cols, rows::copy<float>{m, st});
      else
        s.for_each_row(m.rows, m.cols, rows::copy<float>{st, m});
    };
    index_t at = 0;
    const auto seg = [&](matrix_view<float> m) {
      if (!count_only && m.rows > 0) stage(m, at);
      at += m.rows * m.cols;
    };
    const index_t E = cfg.scored_experts(), H = cfg.hidden, N = cfg.shared_experts;
    if constexpr (Router::uses_gate) seg(count_only ? matrix_view<float>{nullptr, E, H} : g.gate);
    if constexpr (router_with_gate_bias<Router>)
      seg(count_only ? matrix_view<float>{nullptr, 1, E} : g.gate_bias);
    if constexpr (router_with_noise_gate<Router>)
      seg(count_only ? matrix_view<float>{nullptr, E, H} : g.noise_gate);
    if constexpr (requires { Expert::tensors(g.shared); }) {
      // The shapes come from the weights (the same as the gradients').
      auto ws = Expert::tensors(w.shared);
      auto gs = Expert::tensors(g.shared);
      for (std::size_t t = 0; t < ws.size(); ++t)
        for (index_t n = 0; n < N; ++n)
          seg(count_only ? matrix_view<float>{nullptr, ws[t]->rows, ws[t]->cols} : (*gs[t])[n]);
      if (cfg.shared_gate) seg(count_only ? matrix_view<float>{nullptr, N, H} : g.shared_gate);
      if (cfg.output_bias) seg(count_only ? matrix_view<float>{nullptr, 1, H} : g.output_bias);
      // Replicated routed experts: expert q's tensors at a fixed place, zeros where this rank
      // holds no copy of it.
      auto we = Expert::tensors(w.experts);
      auto ge = Expert::tensors(g.experts);
      index_t per = 0;
      for (auto* t : we) per += t->rows * t->cols;
      if (!count_only && in && replicas_ > 0) s.fill(stage_.device() + at, replicas_ * per, 0.f);
      for (std::size_t j = 0; !count_only && j < replica_of_slot_.size(); ++j) {
        const int q = replica_of_slot_[j];
        if (q < 0) continue;
        index_t o = at + q * per;
        for (std::size_t t = 0; t < we.size(); ++t) {  // frozen experts: zeros, unread
          if (ge[t]->data) stage((*ge[t])[static_cast<index_t>(j)], o);
          o += we[t]->rows * we[t]->cols;
        }
      }
      at += replicas_ * per;
    }
    return at;
  }

  index_t keep_, S_, hidden_;
  int width_ = 0;
  index_t ids_kept_ = 0;
  buffer<value_type> saved_in_;      // the experts' input rows of the pass, unit after unit
  buffer<value_type> saved_out_;     // dedup: their outputs
  buffer<value_type> saved_hidden_;  // without recompute: their hidden layers (keep_ per row)
  std::vector<index_t> saved_at_;    // [units]: each unit's first saved row
  index_t rows_ = 0, rows_cap_ = 0;
  bool saved_ = false, any_ = false;  // the last forward's state waits; a forward ran
  bool inference_ = false;            // the last forward kept nothing
  std::uint64_t last_ = 0;            // the last training forward's number
  buffer<float> weight_grad_, dx_home_;
  buffer<std::int64_t> token_ids_;
  std::vector<int> replica_of_slot_;  // each local slot's index among the replicated experts
  int replicas_ = 0;
  mirror<float> stage_;
  std::vector<float> reduce_send_, reduce_recv_;
};

}  // namespace epmoe::parts
