// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/core/workspace.hpp"
#include "epmoe/parts/pass.hpp"

// The home rank's terms of a layer: the shared experts on every token (each scaled per token
// by its gate, config shared_gate), the output bias and the zero experts' w · x (config
// zero_experts: never dispatched), whose sum waits for the reduce; and their backward (the
// gradients of all of them, and their dx terms).
namespace epmoe::parts {

template <class Space, class Expert>
class home_terms {
 public:
  using value_type = typename Space::value_type;
  template <class T>
  using buffer = typename Space::template buffer<T>;
  template <class T>
  using mirror = typename Space::template mirror<T>;

  home_terms(const layer_config& cfg, const Space& s, const workspace_layout& w)
      : N_(cfg.shared_experts),
        H_(cfg.hidden),
        S_(w.row_stride),
        F_(cfg.shared_width()),
        align_(w.align),
        E_(cfg.experts),
        Z_(cfg.zero_experts),
        gated_(cfg.shared_gate),
        bias_(cfg.output_bias) {
    const index_t T = cfg.max_tokens;
    any_ = cfg.shared_experts > 0 || cfg.output_bias || cfg.zero_experts > 0;
    if (N_ > 0) in_ = s.template allocate<value_type>(T * S_);
    if (any_) out_ = s.template allocate<float>(T * H_);
    if (gated_) scale_ = s.template allocate<float>(T);
    offsets_ = s.template allocate_mirror<index_t>(2);
    if (cfg.training && N_ > 0) dy_ = s.template allocate<value_type>(T * S_);
    if (cfg.training && gated_) ds_ = s.template allocate<float>(T);
  }

  /// Their sum [T, H] for the reduce, or nullptr (none, or no tokens).
  const float* sum(index_t T) const { return any_ && T > 0 ? out_.data() : nullptr; }

  /// The shared experts (weights `w`, scratch for T rows), the output bias and the zero
  /// experts (their slots of `routing` [T, K]) on x [T, H]; returns the shared experts' FLOPs
  /// (a zero expert has none).
  template <class Weights>
  double forward(const Space& s, matrix_view<const value_type> x, const Weights& w,
                 value_type* scratch, routing_view routing) {
    const index_t T = x.rows, H = H_;
    if (!any_ || T == 0) return 0;
    const double flops = shared_forward(s, x, w, scratch);
    if (Z_ > 0)
      s.for_each_row(T, H,
                     rows::add_identity<value_type>{x, routing.ids, routing.weights, E_,
                                                    out_.data(), N_ == 0 && !bias_});
    return flops;
  }

  /// Their backward from dy [T, H]: each shared expert's on all T tokens (its gate's, when
  /// scaled), the output bias's gradient (dy's column sums) and the zero experts' dx term
  /// (Σ w dy); dx's terms added into dx.
  template <class Weights, class Grads>
  void backward(const Space& s, matrix_view<const value_type> x, matrix_view<const value_type> dy,
                const Weights& w, const Grads& g, float* dx, value_type* scratch, bool acc,
                routing_view routing) {
    if (Z_ > 0)
      s.for_each_row(
          x.rows, H_,
          rows::add_identity<value_type>{dy, routing.ids, routing.weights, E_, dx, false});
    shared_backward(s, x, dy, w, g, dx, scratch, acc);
  }

  /// The zero experts' routing-weight gradients, dy · x, into their slots of g [T, K] (after
  /// the routed experts' gradients are written there, before the router's backward).
  void weight_grad(const Space& s, matrix_view<const value_type> x,
                   matrix_view<const value_type> dy, routing_view routing,
                   matrix_view<float> g) const {
    if (Z_ > 0 && x.rows > 0)
      s.for_each(x.rows, rows::identity_weight_grad<value_type>{x, dy, routing.ids, E_, g});
  }

 private:
  template <class Weights>
  double shared_forward(const Space& s, matrix_view<const value_type> x, const Weights& w,
                        value_type* scratch) {
    const index_t T = x.rows, H = H_;
    const value_type* bias = bias_ ? w.output_bias.data : nullptr;
    if (N_ == 0) {
      if (bias)
        s.for_each_row(
            T, H, rows::accumulate<value_type>{{nullptr, T, H}, out_.data(), true, nullptr, bias});
      return 0;
    }
    const matrix_view<value_type> in(in_.data(), T, H, S_);
    set_rows(s, T);
    for (index_t n = 0; n < N_; ++n) {
      float* scale = gated_ ? scale_.data() : nullptr;
      if (scale) s.for_each(T, rows::sigmoid_dot<value_type>{x, w.shared_gate.row(n), scale});
      s.for_each_row(T, H, rows::copy<value_type>{x, in});
      Expert::forward(s, Expert::slice(w.shared, n, 1), all_rows<value_type>(in.data, align_),
                      scratch);
      s.for_each_row(
          T, H,
          rows::accumulate<value_type>{in, out_.data(), n == 0, scale, n == 0 ? bias : nullptr});
    }
    return double(N_ * T) * Expert::flops_per_row(H, F_);
  }

  template <class Weights, class Grads>
  void shared_backward(const Space& s, matrix_view<const value_type> x,
                       matrix_view<const value_type> dy, const Weights& w, const Grads& g,
                       float* dx, value_type* scratch, bool acc) {
    const index_t T = x.rows, H = H_, S = S_;
    if (bias_)
      s.for_each(H, rows::column_sum<value_type, float>{dy, nullptr, g.output_bias.data, acc});
    if (N_ == 0) return;
    set_rows(s, T);
    for (index_t n = 0; n < N_; ++n) {
      const matrix_view<value_type> in(in_.data(), T, H, S), d(dy_.data(), T, H, S);
      const auto wn = Expert::slice(w.shared, n, 1);
      float* scale = gated_ ? scale_.data() : nullptr;
      s.for_each_row(T, H, rows::copy<value_type>{x, in});
      if (scale) {  // s = σ(x · g_n); its logit's gradient (dy · o) s (1 - s), o recomputed
        const value_type* gn = w.shared_gate.row(n);
        s.for_each(T, rows::sigmoid_dot<value_type>{x, gn, scale});
        s.for_each_row(T, H, rows::copy<value_type>{x, d});
        Expert::forward(s, wn, all_rows<value_type>(d.data), scratch);
        s.for_each(T, rows::sigmoid_dot_grad<value_type>{dy, d, scale, ds_.data()});
        s.for_each(H,
                   rows::column_sum<value_type, float>{x, ds_.data(), g.shared_gate.row(n), acc});
        s.for_each_row(T, H, rows::add_outer<value_type>{dx, H, ds_.data(), gn});
      }
      s.for_each_row(T, H, rows::scaled_copy<value_type>{dy, scale, d});
      const grouped_rows<value_type> drows = all_rows<value_type>(d.data);
      Expert::backward(s, wn, all_rows<const value_type>(in.data),
                       grouped_rows<const value_type>(drows), drows, Expert::slice(g.shared, n, 1),
                       scratch, acc);
      s.for_each_row(T, H, rows::accumulate<value_type>{d, dx, false});
    }
  }

  // One group of all T rows (the shared experts' GEMMs).
  void set_rows(const Space& s, index_t T) {
    offsets_.host()[0] = 0;
    offsets_.host()[1] = T;
    s.to_device(offsets_, 0, 2);
  }
  template <class T>
  grouped_rows<T> all_rows(T* data, index_t align = 1) const {
    return {data, H_, S_, 1, offsets_.host(), offsets_.device(), align};
  }

  index_t N_, H_, S_, F_, align_;
  int E_, Z_;  // routed and zero experts
  bool gated_, bias_, any_ = false;
  buffer<value_type> in_, dy_;  // the experts' input rows; backward: d(their output)
  buffer<float> out_, scale_, ds_;
  mirror<index_t> offsets_;  // [2]: one group of all T rows
};

}  // namespace epmoe::parts
